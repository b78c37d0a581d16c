//! The decode loop's one-step lookahead (`Qwen35::lookahead`, runtime/generate.rs) against the
//! loop without it, on any backend: the same tokens, text, finish reason and log-probabilities
//! for every way a generation ends, and a state that holds what its position says (the prefix
//! cache resumes from it as from a fresh prefill). Included by `#[path]` from lookahead.rs (the
//! CPU), wgpu_ops.rs and cuda_ops.rs (which leaves out `check_cache`: bf16 prefill and decode
//! round differently, so a cached turn need not equal a fresh prefill's to the bit there).
#![allow(dead_code)]

use std::sync::atomic::AtomicBool;

use lily::backend::Backend;
use lily::model::Qwen35;
use lily::runtime::cache::{generate_cached, CacheConfig, PrefixCache};
use lily::runtime::generate::{generate_ex, Forced, GenRequest, TokenLogprob};
use lily::runtime::sampler::SamplingParams;
use lily::runtime::stop::{FinishReason, StopKind, StopRules};
use lily::tokenizer::Tokenizer;

/// One generation's outcome and the state's position after it.
#[derive(Debug, PartialEq)]
pub struct Run {
    pub ids: Vec<u32>,
    pub text: String,
    pub finish: Option<FinishReason>,
    pub logprobs: Vec<TokenLogprob>,
    pub pos: usize,
}

/// What a generation is asked for (besides the prompt and the sampling).
#[derive(Clone, Default)]
pub struct Ask {
    pub stop: StopRules,
    pub forced: Forced,
    pub logprobs: Option<usize>,
    /// The state's context (the stop rules' by default).
    pub state_context: Option<usize>,
    /// The caller cancels after this many tokens.
    pub cancel_after: Option<usize>,
}

pub fn run<B: Backend>(
    m: &Qwen35<B>,
    tok: &Tokenizer,
    prompt: &[u32],
    sampling: &SamplingParams,
    ask: &Ask,
) -> Run {
    let mut st = m
        .new_state(ask.state_context.unwrap_or(ask.stop.max_context))
        .unwrap();
    let cancel = AtomicBool::new(false);
    let req = GenRequest {
        prompt,
        cached: 0,
        sampling,
        stop: ask.stop.clone(),
        logprobs: ask.logprobs,
        forced: ask.forced.clone(),
        constraint: None,
        cancel: &cancel,
    };
    let mut logprobs = Vec::new();
    let mut n = 0;
    let g = generate_ex(m, &mut st, tok, req, |e| {
        logprobs.extend(e.logprob);
        n += e.id.is_some() as usize;
        ask.cancel_after.is_none_or(|c| n < c)
    })
    .unwrap();
    Run {
        ids: g.ids,
        text: g.text,
        finish: g.finish,
        logprobs,
        pos: st.pos,
    }
}

/// The run with the lookahead and without it: equal but for the state's position, which is
/// returned (with, without).
pub fn both<B: Backend>(
    m: &mut Qwen35<B>,
    tok: &Tokenizer,
    prompt: &[u32],
    sampling: &SamplingParams,
    ask: &Ask,
    what: &str,
) -> (Run, usize) {
    m.lookahead = false;
    let off = run(m, tok, prompt, sampling, ask);
    m.lookahead = true;
    let on = run(m, tok, prompt, sampling, ask);
    assert_eq!(
        (&on.ids, &on.text, &on.finish, &on.logprobs),
        (&off.ids, &off.text, &off.finish, &off.logprobs),
        "{what}: with and without the lookahead"
    );
    (on, off.pos)
}

/// Every way a generation ends, with and without the lookahead, and where each leaves the state.
pub fn check_all<B: Backend>(
    m: &mut Qwen35<B>,
    tok: &Tokenizer,
    prompt: &[u32],
    sampling: &SamplingParams,
) {
    let p = prompt.len();
    let n = 24;
    let ctx = 512;
    let budget = Ask {
        stop: StopRules {
            max_tokens: Some(n),
            ..StopRules::new(ctx)
        },
        ..Default::default()
    };
    let what = format!("{sampling:?}");
    // The budget: its last token is never fed, with or without.
    let (full, pos_off) = both(
        m,
        tok,
        prompt,
        sampling,
        &budget,
        &format!("budget, {what}"),
    );
    assert_eq!(full.finish, Some(FinishReason::Length));
    assert_eq!(full.ids.len(), n);
    assert_eq!((full.pos, pos_off), (p + n - 1, p + n - 1), "budget");

    // A stop id mid-way: fed by the lookahead's step (the state holds it), not without.
    let stop_id = full.ids[9];
    let first = full.ids.iter().position(|&t| t == stop_id).unwrap();
    let ask = Ask {
        stop: StopRules {
            stop_ids: vec![stop_id],
            ..budget.stop.clone()
        },
        ..Default::default()
    };
    let (g, pos_off) = both(m, tok, prompt, sampling, &ask, &format!("stop id, {what}"));
    assert_eq!(g.ids, full.ids[..=first]);
    assert_eq!(g.finish, Some(FinishReason::Stop(StopKind::Id(stop_id))));
    let with = if takes_lookahead(m, sampling) {
        p + first + 1
    } else {
        p + first
    };
    assert_eq!((g.pos, pos_off), (with, p + first), "stop id");

    // A stop string: the state may hold the token that completed it.
    let stop: String = full
        .text
        .chars()
        .skip(full.text.chars().count() / 2)
        .take(2)
        .collect();
    if !stop.is_empty() {
        let ask = Ask {
            stop: StopRules {
                stop_strings: vec![stop.clone()],
                ..budget.stop.clone()
            },
            ..Default::default()
        };
        let (g, _) = both(
            m,
            tok,
            prompt,
            sampling,
            &ask,
            &format!("stop string, {what}"),
        );
        assert_eq!(g.text, full.text[..full.text.find(&stop).unwrap()]);
        assert_eq!(g.finish, Some(FinishReason::Stop(StopKind::String(stop))));
        let k = g.ids.len();
        assert!(
            g.pos == p + k - 1 || g.pos == p + k,
            "stop string: {}",
            g.pos
        );
    }

    // The context: 10 tokens fill it; the last is never fed (it would have no position).
    let ask = Ask {
        stop: StopRules::new(p + 10),
        ..Default::default()
    };
    let (g, pos_off) = both(m, tok, prompt, sampling, &ask, &format!("context, {what}"));
    assert_eq!(g.finish, Some(FinishReason::ContextFull));
    assert_eq!(g.ids, full.ids[..10]);
    assert_eq!((g.pos, pos_off), (p + 9, p + 9), "context");
    // A state smaller than the rules' context: the loop never feeds past the state.
    let ask = Ask {
        state_context: Some(p + 5),
        stop: StopRules {
            stop_ids: vec![full.ids[5]],
            ..StopRules::new(ctx)
        },
        ..Default::default()
    };
    both(
        m,
        tok,
        prompt,
        sampling,
        &ask,
        &format!("small state, {what}"),
    );

    // Log-probabilities (the loop without the lookahead: the next step overwrites the logits).
    let ask = Ask {
        logprobs: Some(3),
        ..budget.clone()
    };
    let (g, _) = both(m, tok, prompt, sampling, &ask, &format!("logprobs, {what}"));
    assert_eq!(g.ids, full.ids);
    assert_eq!(g.logprobs.len(), n);

    // Forced tokens, now and after a trigger.
    let ask = Ask {
        forced: Forced {
            now: vec![full.ids[3], 100, 101],
            after: Some((full.ids[6], vec![7, 8, 9])),
        },
        ..budget.clone()
    };
    both(m, tok, prompt, sampling, &ask, &format!("forced, {what}"));
    // A trigger alone (its first occurrence is at most token 6): the forced list follows it.
    let trigger = full.ids[6];
    let ask = Ask {
        forced: Forced {
            now: Vec::new(),
            after: Some((trigger, vec![7, 8, 9])),
        },
        ..budget.clone()
    };
    let (g, _) = both(m, tok, prompt, sampling, &ask, &format!("trigger, {what}"));
    let at = g.ids.iter().position(|&t| t == trigger).unwrap();
    assert_eq!(g.ids[at + 1..at + 4], [7, 8, 9], "trigger");

    // A cancellation by the caller: no token after the one it was given.
    let ask = Ask {
        cancel_after: Some(5),
        ..budget.clone()
    };
    let (g, _) = both(m, tok, prompt, sampling, &ask, &format!("cancel, {what}"));
    assert_eq!(g.ids, full.ids[..5]);
    assert_eq!(g.finish, None);
}

/// Whether a generation with these parameters takes the lookahead on this model: its pick on
/// the backend (plain greedy, or a backend with its own sampler).
pub fn takes_lookahead<B: Backend>(m: &Qwen35<B>, sampling: &SamplingParams) -> bool {
    sampling.is_plain_greedy() || m.device_sampler(sampling, 0, &[]).unwrap().is_some()
}

/// Two turns through the prefix cache, the first ending on a stop id (fed by the lookahead):
/// the second resumes from everything the first state holds and generates what a fresh
/// prefill of its whole prompt generates.
pub fn check_cache<B: Backend>(
    m: &mut Qwen35<B>,
    tok: &Tokenizer,
    prompt: &[u32],
    sampling: &SamplingParams,
) {
    m.lookahead = true;
    let ctx = 512;
    let rules = StopRules {
        max_tokens: Some(16),
        ..StopRules::new(ctx)
    };
    let full = run(
        m,
        tok,
        prompt,
        sampling,
        &Ask {
            stop: rules.clone(),
            ..Default::default()
        },
    );
    let stop_id = full.ids[7];
    let first = full.ids.iter().position(|&t| t == stop_id).unwrap();
    let mut cache = PrefixCache::new(CacheConfig {
        budget: 1 << 30,
        snapshot_every: 4096,
        turn_start: None,
    });
    let cancel = AtomicBool::new(false);
    let turn = |m: &Qwen35<B>, cache: &mut PrefixCache<B>, prompt: &[u32], stop: StopRules| {
        let req = GenRequest {
            prompt,
            cached: 0,
            sampling,
            stop,
            logprobs: None,
            forced: Forced::default(),
            constraint: None,
            cancel: &cancel,
        };
        generate_cached(m, cache, tok, None, ctx, req, &mut |_| {}, |_| true).unwrap()
    };
    let t1 = turn(
        m,
        &mut cache,
        prompt,
        StopRules {
            stop_ids: vec![stop_id],
            ..rules.clone()
        },
    );
    assert_eq!(t1.ids, full.ids[..=first]);
    assert_eq!(
        cache.stats().entries,
        1,
        "the first turn's state was not cached"
    );
    // The next prompt continues the first: its prompt, its reply (the stop id included), more.
    let mut prompt2: Vec<u32> = prompt.iter().chain(&t1.ids).copied().collect();
    prompt2.extend([11, 12, 13, 14, 15]);
    let t2 = turn(m, &mut cache, &prompt2, rules.clone());
    let held = prompt.len() + t1.ids.len();
    assert_eq!(
        t2.stats.cached_tokens, held,
        "the second turn resumes from all the first state holds"
    );
    let fresh = run(
        m,
        tok,
        &prompt2,
        sampling,
        &Ask {
            stop: rules,
            ..Default::default()
        },
    );
    assert_eq!(t2.ids, fresh.ids, "cached second turn against a fresh run");
    assert_eq!(t2.text, fresh.text);
}
