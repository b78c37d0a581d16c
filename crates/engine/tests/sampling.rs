//! Sampling on the backend (`Backend::sample_step`) on the CPU, whose implementation is the host
//! `Sampler` itself: the op against `Sampler::sample_split`, and the generation loop that uses it
//! (enqueueing the next step before the current token's text) against a plain host loop.

mod common;

use std::sync::atomic::AtomicBool;

use common::{load, prompt_ids, synth};
use lily::backend::cpu::{Cpu, CpuStep};
use lily::backend::Backend;
use lily::model::{Logits, Next};
use lily::runtime::generate::{generate_ex, Forced, GenRequest};
use lily::runtime::sampler::{token_logprobs, Sampler, SamplingParams};
use lily::runtime::stop::{FinishReason, StopKind, StopRules};

fn row(v: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut r = lily::rng::Rng::new(seed);
    (0..v).map(|_| r.normal() * scale).collect()
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.9,
        top_k: 20,
        top_p: 0.95,
        min_p: 0.01,
        presence_penalty: 0.5,
        frequency_penalty: 0.3,
        repetition_penalty: 1.2,
        seed: Some(seed),
    }
}

/// The op draws what `sample_split` draws, counting its own picks and noted tokens as generated,
/// advancing the step, and leaving the logits raw.
#[test]
fn cpu_sample_step_is_the_host_sampler() {
    let v = 3000;
    let prompt: Vec<u32> = (0..50).map(|i| (i * 37) % v as u32).collect();
    for p in [
        sampled(7),
        SamplingParams {
            top_k: 0,
            ..sampled(8)
        },
        SamplingParams {
            temperature: 0.0,
            ..sampled(9)
        },
    ] {
        let mut dev = Cpu
            .new_sampler(&p, 7, v, &prompt)
            .unwrap()
            .expect("the CPU samples every parameter set");
        let mut host = Sampler::new(
            SamplingParams {
                seed: Some(7),
                ..p.clone()
            },
            v,
        )
        .unwrap();
        let mut generated = Vec::new();
        let mut step = CpuStep { token: 0, pos: 10 };
        for i in 0..40 {
            // Peaked rows (a few tokens dominate) so that penalties change the picks.
            let mut l = row(v, i, 2.0);
            l[(i as usize * 11) % v] += 8.0;
            l[5] += 7.0;
            if i % 7 == 3 {
                // A forced token: counted, no draw.
                Cpu.sample_note(&mut dev, 5);
                generated.push(5);
                continue;
            }
            let raw = l.clone();
            Cpu.sample_step(&l, v, &mut dev, &mut step);
            assert_eq!(l, raw, "the op changed its logits");
            let want = host.sample_split(&mut l.clone(), &prompt, &generated);
            assert_eq!(step.token, want, "{p:?} draw {i}");
            generated.push(want);
        }
        assert_eq!(step.pos, 10 + 40 - 6);
    }
}

/// Log-probabilities through the op's default (read back, computed on the host).
#[test]
fn cpu_logprobs_are_the_hosts() {
    let l = row(500, 3, 3.0);
    let (lp, top) = Cpu.logprobs(&l, 500, 17, 5).unwrap();
    assert_eq!((lp, top), token_logprobs(&l, 17, 5));
}

/// The host loop the generation loop must equal: sample each step's logits on the host, feed
/// the token back.
fn host_loop(
    m: &lily::model::Qwen35<Cpu>,
    prompt: &[u32],
    p: &SamplingParams,
    forced: &[u32],
    n: usize,
) -> Vec<u32> {
    let mut st = m.new_state(512).unwrap();
    let mut s = Sampler::new(p.clone(), m.cfg.vocab_size).unwrap();
    let mut l = m.forward(&mut st, prompt, Logits::Last, None).unwrap();
    let mut ids = Vec::new();
    for i in 0..n {
        let id = if i < forced.len() {
            forced[i]
        } else {
            s.sample_split(&mut l, prompt, &ids)
        };
        ids.push(id);
        l = match m.decode(&mut st, Some(id), false).unwrap() {
            Next::Logits(l) => l,
            other => panic!("{other:?}"),
        };
    }
    ids
}

#[test]
fn generation_on_the_backend_equals_host_sampling() {
    let dir = synth("tiny", 3, &[]);
    let m = load(dir.path());
    let tok = lily::tokenizer::Tokenizer::from_dir(dir.path()).unwrap();
    let v = m.cfg.vocab_size;
    let prompt = prompt_ids(20, v);
    let cancel = AtomicBool::new(false);
    let n = 24;
    let gen = |p: &SamplingParams, stop: StopRules, forced: Vec<u32>, logprobs: Option<usize>| {
        let mut st = m.new_state(512).unwrap();
        let req = GenRequest {
            prompt: &prompt,
            cached: 0,
            sampling: p,
            stop,
            logprobs,
            forced: Forced {
                now: forced,
                after: None,
            },
            constraint: None,
            cancel: &cancel,
        };
        let mut lps = Vec::new();
        let g = generate_ex(&m, &mut st, &tok, req, |e| {
            lps.extend(e.logprob);
            true
        })
        .unwrap();
        (g, st.pos, lps)
    };
    let budget = StopRules {
        max_tokens: Some(n),
        ..StopRules::new(512)
    };
    for p in [
        sampled(11),
        SamplingParams {
            top_k: 0,
            top_p: 0.9,
            ..sampled(12)
        },
        SamplingParams {
            temperature: 0.0,
            ..sampled(13)
        },
    ] {
        let want = host_loop(&m, &prompt, &p, &[], n);
        let (g, pos, _) = gen(&p, budget.clone(), vec![], None);
        assert_eq!(g.ids, want, "{p:?}");
        assert_eq!(g.finish, Some(FinishReason::Length));
        // A length stop computes no step after the last token.
        assert_eq!(pos, prompt.len() + n - 1);
        // Forced tokens are counted for the penalties and cost no draw.
        let forced = vec![want[3], 100, 101];
        let (g, _, _) = gen(&p, budget.clone(), forced.clone(), None);
        assert_eq!(
            g.ids,
            host_loop(&m, &prompt, &p, &forced, n),
            "forced, {p:?}"
        );
    }
    // A stop id: generation ends on it; the loop's lookahead fed it (the step after it was
    // enqueued before it was read), and nothing past it (tests/lookahead.rs: without it).
    let p = sampled(11);
    let want = host_loop(&m, &prompt, &p, &[], n);
    let at = 9;
    let stop_id = want[at];
    let first = want.iter().position(|&t| t == stop_id).unwrap();
    let (g, pos, _) = gen(
        &p,
        StopRules {
            stop_ids: vec![stop_id],
            ..budget.clone()
        },
        vec![],
        None,
    );
    assert_eq!(g.ids, want[..=first]);
    assert_eq!(g.finish, Some(FinishReason::Stop(StopKind::Id(stop_id))));
    assert_eq!(pos, prompt.len() + first + 1);
    // A stop string: the text ends before it and nothing after the token that completed it is
    // emitted (that token's step may have been computed: the state says how far it went).
    let full = gen(&p, budget.clone(), vec![], None).0;
    let text = full.text.clone();
    let stop: String = text
        .chars()
        .skip(text.chars().count() / 2)
        .take(2)
        .collect();
    if !stop.is_empty() {
        let (g, pos, _) = gen(
            &p,
            StopRules {
                stop_strings: vec![stop.clone()],
                ..budget.clone()
            },
            vec![],
            None,
        );
        assert_eq!(g.text, text[..text.find(&stop).unwrap()]);
        assert_eq!(g.ids, want[..g.ids.len()]);
        assert_eq!(g.finish, Some(FinishReason::Stop(StopKind::String(stop))));
        assert!(
            pos == prompt.len() + g.ids.len() - 1 || pos == prompt.len() + g.ids.len(),
            "state at {pos}"
        );
    }
    // Log-probabilities: one per token, the sampled token's among them when it is likely.
    let (g, _, lps) = gen(&p, budget, vec![], Some(3));
    assert_eq!(g.ids, want);
    assert_eq!(lps.len(), n);
    assert!(lps.iter().all(|l| l.top.len() == 3
        && l.logprob <= 0.0
        && l.top.windows(2).all(|w| w[0].1 >= w[1].1)));
}
