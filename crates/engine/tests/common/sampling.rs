//! The device sampler's tests, shared by cuda_ops and wgpu_ops: `Backend::sample_step` against
//! the host `Sampler` (its CPU twin) draw for draw, its empirical distribution against the CPU's
//! `distribution()` (chi-square), and `Backend::logprobs` against the host's.
#![allow(dead_code)]

use crate::ops::Rng;
use lily::backend::Backend;
use lily::runtime::sampler::{Sampler, SamplingParams};

/// The checkpoint's default sampling (generation_config.json: temperature 1, top-k 20, top-p
/// 0.95), seeded: what `lily serve` draws with, and the device sampler must take.
pub fn checkpoint_default(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_k: 20,
        top_p: 0.95,
        seed: Some(seed),
        ..Default::default()
    }
}

/// Peaked logits at the full vocabulary: N(0, 1) noise with a few strong tokens.
pub fn peaked_logits(rng: &mut Rng, vocab: usize) -> (Vec<f32>, [usize; 5]) {
    let mut l = rng.vec(vocab, 1.0);
    let peaks = [17, 4096, 100_003, 200_000, vocab - 1];
    for (j, &i) in peaks.iter().enumerate() {
        l[i] = 12.0 - 0.5 * j as f32;
    }
    (l, peaks)
}

/// The logits after sampler.rs's steps 1-2, written out here on their own for the tests' rules:
/// the repetition penalty once on each token of the prompt or the generated ones (divide a
/// positive logit, multiply the others), then presence + frequency · count on generated tokens.
pub fn penalised(l: &[f32], p: &SamplingParams, prompt: &[u32], generated: &[u32]) -> Vec<f32> {
    let mut out = l.to_vec();
    let mut count = std::collections::HashMap::<u32, u32>::new();
    for &t in generated {
        *count.entry(t).or_default() += 1;
    }
    let mut seen: Vec<u32> = prompt.iter().chain(generated).copied().collect();
    seen.sort_unstable();
    seen.dedup();
    for t in seen {
        let x = &mut out[t as usize];
        if p.repetition_penalty != 1.0 {
            *x = if *x > 0.0 {
                *x / p.repetition_penalty
            } else {
                *x * p.repetition_penalty
            };
        }
        if let Some(&c) = count.get(&t) {
            *x -= p.presence_penalty + p.frequency_penalty * c as f32;
        }
    }
    out
}

/// The ids of the n largest values (value desc, id asc).
pub fn top_ids(l: &[f32], n: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..l.len() as u32).collect();
    let cmp = |&a: &u32, &b: &u32| l[b as usize].total_cmp(&l[a as usize]).then(a.cmp(&b));
    if n < ids.len() {
        ids.select_nth_unstable_by(n, cmp);
        ids.truncate(n);
    }
    ids.sort_by(cmp);
    ids
}

/// `sample_step` on the device with a fixed seed against the host `Sampler` (the CPU twin): the
/// same tokens draw for draw (the weights are the CPU's bit for bit and the f64 sums run in the
/// CPU's order, so the tokens are equal), penalties counted on the device, and each truncation
/// excluding what it must: top-k, top-p, min-p, the repetition penalty on prompt tokens,
/// presence / frequency on generated ones. Greedy parameters give exactly the arg-max.
///
/// `draws` per case (300 on a GPU); `upload` puts host logits on the backend.
pub fn sample_step_matches_the_host_sampler<B: Backend>(
    g: &B,
    upload: impl Fn(&[f32]) -> B::Buf,
    draws: usize,
) {
    let mut rng = Rng(21);
    let vocab = 248_320;
    let (l, peaks) = peaked_logits(&mut rng, vocab);
    let gl = upload(&l);
    let base = SamplingParams {
        temperature: 1.0,
        seed: Some(5),
        ..Default::default()
    };
    // (params, prompt, what every draw must satisfy given the peaks and the logits after the
    // penalties, worked out here on their own: `penalised` below)
    type Rule = fn(u32, &[usize; 5], &[f32]) -> bool;
    let cases: Vec<(SamplingParams, Vec<u32>, Rule)> = vec![
        (
            SamplingParams {
                top_k: 2,
                ..base.clone()
            },
            vec![],
            |t, p, _| t as usize == p[0] || t as usize == p[1],
        ),
        // p(peak j) ∝ e^{-0.5 j}, the noise's top 15 adding < 0.4%: the cumulative masses are
        // 0.43, 0.69, 0.84, 0.94, 0.997, so top-p 0.95 keeps the 5 peaks, 0.9 the best 4 and
        // 0.5 the best 2.
        (
            SamplingParams {
                top_k: 20,
                top_p: 0.95,
                ..base.clone()
            },
            vec![],
            |t, p, _| p.contains(&(t as usize)),
        ),
        (
            SamplingParams {
                top_k: 20,
                top_p: 0.9,
                ..base.clone()
            },
            vec![],
            |t, p, _| p[..4].contains(&(t as usize)),
        ),
        (
            SamplingParams {
                top_k: 40,
                top_p: 0.5,
                ..base.clone()
            },
            vec![],
            |t, p, _| p[..2].contains(&(t as usize)),
        ),
        // min-p 0.5: w ≥ 0.5 keeps peaks 0 and 1 (w = 1, e^{-0.5} = 0.61), not 2 (0.37).
        (
            SamplingParams {
                top_k: 64,
                min_p: 0.5,
                ..base.clone()
            },
            vec![],
            |t, p, _| p[..2].contains(&(t as usize)),
        ),
        // The best token in the prompt with a repetition penalty of 4: 12 / 4 = 3 drops it below
        // peaks 1-3 at first; each drawn peak is divided by 4 in turn, so later draws reach peak 4,
        // peak 0 again or the noise. What holds at every draw: the token is one of the 3 best of
        // the penalised logits (logit desc, id asc), so never the prompt's peak 0 (at 3.0 from
        // the first draw on) while 3 others rank above it.
        (
            SamplingParams {
                top_k: 3,
                repetition_penalty: 4.0,
                ..base.clone()
            },
            vec![17, 5, 6],
            |t, p, pl| pl[p[0]] == 3.0 && top_ids(pl, 3).contains(&t),
        ),
        // Presence 2 + frequency 2 per draw: a drawn peak loses ≥ 4 at once, so the draws spread
        // over the peaks (checked against the host below, draw for draw), always among the 10
        // best after the penalties.
        (
            SamplingParams {
                top_k: 10,
                temperature: 0.5,
                presence_penalty: 2.0,
                frequency_penalty: 2.0,
                ..base.clone()
            },
            vec![],
            |t, _, pl| top_ids(pl, 10).contains(&t),
        ),
        // Greedy (temperature 0; top-k 1): the arg-max, with and without a penalty.
        (
            SamplingParams {
                temperature: 0.0,
                ..base.clone()
            },
            vec![],
            |t, p, _| t as usize == p[0],
        ),
        (
            SamplingParams {
                top_k: 1,
                ..base.clone()
            },
            vec![],
            |t, p, _| t as usize == p[0],
        ),
        // Greedy with the repetition penalty: peak 0 (prompt) at 3.0, each pick divided by 4 in
        // turn, so the picks walk down peaks 1-4 and on: always the penalised arg-max.
        (
            SamplingParams {
                temperature: 0.0,
                repetition_penalty: 4.0,
                ..base.clone()
            },
            vec![17],
            |t, p, pl| pl[p[0]] == 3.0 && top_ids(pl, 1) == [t],
        ),
    ];
    for (p, prompt, rule) in cases {
        let mut dev = g
            .new_sampler(&p, 5, vocab, &prompt)
            .unwrap()
            .expect("these parameters are sampled on the device");
        let mut host = Sampler::new(p.clone(), vocab).unwrap();
        let mut step = g.new_step().unwrap();
        g.set_step(&mut step, 0, 1000);
        let mut generated = Vec::new();
        for i in 0..draws {
            g.sample_step(&gl, vocab, &mut dev, &mut step);
            let t = g.step_token(&step).unwrap();
            let want = host.sample_split(&mut l.clone(), &prompt, &generated);
            assert_eq!(t, want, "{p:?}: draw {i}");
            assert!(
                rule(t, &peaks, &penalised(&l, &p, &prompt, &generated)),
                "{p:?}: draw {i} picked {t}"
            );
            generated.push(t);
        }
        if p.is_plain_greedy() {
            assert!(generated.iter().all(|&t| t == lily::runtime::argmax(&l)));
        }
        // The position advanced once per draw; the logits were not changed.
        g.set_step(&mut step, 0, 0);
    }
    assert_eq!(
        g.to_host(&gl, vocab).unwrap(),
        l,
        "sample_step changed its logits"
    );
    // Parameters the device does not cover are declined, never sampled wrongly.
    let off = SamplingParams {
        top_k: 0,
        ..base.clone()
    };
    assert!(g.new_sampler(&off, 1, vocab, &[]).unwrap().is_none());
    assert!(g
        .new_sampler(&SamplingParams { top_k: 65, ..base }, 1, vocab, &[])
        .unwrap()
        .is_none());
}

/// Log-probabilities on the device against the host's: the same top ids (ties are measure-zero
/// here), values to 1e-5 (f64 sums in another order, then f32).
pub fn sample_logprobs_match_the_host<B: Backend>(g: &B, upload: impl Fn(&[f32]) -> B::Buf) {
    let mut rng = Rng(22);
    let vocab = 248_320;
    let l = rng.vec(vocab, 3.0);
    let gl = upload(&l);
    let mut worst = 0f32;
    for (token, n) in [(5u32, 20usize), (200_000, 1), (7, 0)] {
        let (lp, top) = g.logprobs(&gl, vocab, token, n).unwrap();
        let (wlp, wtop) = lily::runtime::sampler::token_logprobs(&l, token, n);
        assert!((lp - wlp).abs() < 1e-5, "{lp} vs {wlp}");
        assert_eq!(
            top.iter().map(|x| x.0).collect::<Vec<_>>(),
            wtop.iter().map(|x| x.0).collect::<Vec<_>>()
        );
        assert!(top.iter().zip(&wtop).all(|(a, b)| (a.1 - b.1).abs() < 1e-5));
        worst = top
            .iter()
            .zip(&wtop)
            .map(|(a, b)| (a.1 - b.1).abs())
            .fold(worst.max((lp - wlp).abs()), f32::max);
    }
    println!("logprobs: ids equal, worst |Δ| {worst:.2e} (tol 1e-5)");
}

/// The upper quantile of chi-square with `df` degrees of freedom at z standard deviations
/// (Wilson–Hilferty: accurate to a few percent for df ≥ 3 at these tails).
pub fn chi2_quantile(df: f64, z: f64) -> f64 {
    let a = 2.0 / (9.0 * df);
    df * (1.0 - a + z * a.sqrt()).powi(3)
}

/// The device sampler's empirical distribution against the CPU sampler's `distribution()` at the
/// full vocabulary with the checkpoint's default (temperature 1, top-k 20, top-p 0.95), from fixed
/// random logits: `n` draws. Bound: Pearson's chi-square over the kept tokens (bins of expected
/// count below 5 merged) below its 1 - 1e-4 quantile (z = 3.719), so a correct sampler fails with
/// probability 1e-4 while a wrong kept set, a wrong temperature or a biased draw moves it by
/// hundreds; no draw outside the kept set at all. The seed is fixed, so the test is deterministic.
/// Also prints the device time per token.
///
/// `n` draws (20,000 on a GPU), the first `exact` of them compared with the host's draw for
/// draw; `upload` puts host logits on the backend.
pub fn sample_distribution_matches_the_cpu<B: Backend>(
    g: &B,
    upload: impl Fn(&[f32]) -> B::Buf,
    n: usize,
    exact: usize,
) {
    let mut rng = Rng(23);
    let vocab = 248_320;
    // Scale 3: a spread-out top (about 20 tokens within a few units of the best), so top-k and
    // top-p both cut.
    let l = rng.vec(vocab, 3.0);
    let gl = upload(&l);
    let p = checkpoint_default(99);
    let dist = Sampler::new(p.clone(), vocab)
        .unwrap()
        .distribution(&mut l.clone(), &[]);
    assert!(dist.len() > 3 && dist.len() <= 20, "kept {}", dist.len());
    let mut dev = g
        .new_sampler(&p, 99, vocab, &[])
        .unwrap()
        .expect("the default is sampled on the device");
    let mut step = g.new_step().unwrap();
    g.set_step(&mut step, 0, 0);
    let mut host = Sampler::new(p.clone(), vocab).unwrap();
    let mut count = std::collections::HashMap::<u32, usize>::new();
    for i in 0..n {
        g.sample_step(&gl, vocab, &mut dev, &mut step);
        let t = g.step_token(&step).unwrap();
        if i < exact {
            // The same seed draws the CPU's tokens.
            assert_eq!(t, host.sample(&mut l.clone(), &[]), "draw {i}");
        }
        *count.entry(t).or_default() += 1;
    }
    let outside: usize = count
        .iter()
        .filter(|(t, _)| !dist.iter().any(|d| d.0 == **t))
        .map(|x| x.1)
        .sum();
    assert_eq!(outside, 0, "{outside} draws outside the kept set");
    let (mut chi2, mut bins, mut small_e, mut small_o) = (0.0, 0, 0.0, 0.0);
    for &(t, q) in &dist {
        let (e, o) = (q * n as f64, *count.get(&t).unwrap_or(&0) as f64);
        if e < 5.0 {
            (small_e, small_o) = (small_e + e, small_o + o);
        } else {
            chi2 += (o - e).powi(2) / e;
            bins += 1;
        }
    }
    if small_e > 0.0 {
        chi2 += (small_o - small_e).powi(2) / small_e.max(1e-9);
        bins += 1;
    }
    let limit = chi2_quantile((bins - 1) as f64, 3.719);
    println!(
        "sample_step: {} kept tokens, chi-square {chi2:.1} over {bins} bins (limit {limit:.1})",
        dist.len()
    );
    assert!(chi2 < limit, "chi-square {chi2} ≥ {limit}");
    // Time per token, the step's pick without the read (graph-free launches: an upper bound).
    let reps = (n / 10).max(1);
    g.sync().unwrap();
    let t0 = std::time::Instant::now();
    for _ in 0..reps {
        g.sample_step(&gl, vocab, &mut dev, &mut step);
    }
    g.sync().unwrap();
    println!(
        "sample_step at vocab {vocab}, top-k 20 top-p 0.95: {:.1} µs per token (launches included)",
        t0.elapsed().as_secs_f64() * 1e6 / reps as f64
    );
}

/// The device sampler on masked logits (constrained decoding picks this way): a sparse mask
/// leaves most of the first pass's slices with no candidate and fewer allowed ids than top-k,
/// so both of the select's short cases run. Every draw must be allowed and the host sampler's
/// token for the same seed (the same 5 survivors and weights, bit for bit).
pub fn sample_step_on_masked_logits<B: Backend>(g: &B, upload: impl Fn(&[f32]) -> B::Buf) {
    let mut rng = Rng(29);
    let vocab = 248_320;
    let mut l = rng.vec(vocab, 3.0);
    let mut mask = vec![0u32; vocab.div_ceil(32)];
    let ids = [3usize, 4000, 131_071, 200_000, 248_319];
    // Close logits (weights 1, 0.82, 0.67, 0.55, 0.45): top-p 0.95 keeps all five.
    for (j, id) in ids.into_iter().enumerate() {
        mask[id / 32] |= 1 << (id % 32);
        l[id] = 1.0 - 0.2 * j as f32;
    }
    let mut want = l.clone();
    lily::runtime::constrain::apply_mask(&mut want, &mask);
    let mut gl = upload(&l);
    g.mask_logits(&mut gl, vocab, &mask);
    let p = checkpoint_default(7);
    let mut dev = g
        .new_sampler(&p, 7, vocab, &[])
        .unwrap()
        .expect("top-k 20 samples on the device");
    let mut host = Sampler::new(p, vocab).unwrap();
    let mut step = g.new_step().unwrap();
    g.set_step(&mut step, 0, 10);
    let mut seen = std::collections::HashSet::new();
    for i in 0..50 {
        g.sample_step(&gl, vocab, &mut dev, &mut step);
        let t = g.step_token(&step).unwrap();
        assert!(ids.contains(&(t as usize)), "draw {i}: disallowed id {t}");
        assert_eq!(t, host.sample(&mut want.clone(), &[]), "draw {i}");
        seen.insert(t);
    }
    println!(
        "sample_step on a 5-id mask: 50 draws, the host's, {} distinct",
        seen.len()
    );
    assert_eq!(seen.len(), 5, "top-p 0.95 keeps the five allowed ids");
}
