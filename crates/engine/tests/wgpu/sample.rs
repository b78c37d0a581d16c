//! The device sampler on wgpu (a module of wgpu_ops.rs): its integer IEEE arithmetic
//! (softfloat.wgsl) bit for bit against Rust's, then the shared sampler tests of
//! common/sampling.rs, the same as CUDA's: the host `Sampler`'s tokens draw for draw, the CPU's
//! distribution (chi-square), log-probabilities.

use super::*;
use crate::sampling;
use lily::runtime::sampler::exp_weight;

/// A finite f32 of any exponent (subnormals and zeros included), either sign.
fn any_finite(rng: &mut Rng) -> f32 {
    loop {
        let x = f32::from_bits(rng.u64() as u32);
        if x.is_finite() {
            return x;
        }
    }
}

/// (a, b, c, d): a and b for the f32 operations and exp_weight, c and d ≥ 0 for the f64 ones.
/// Kinds of rows: any bits; logits and temperatures of a sampler; near-equal pairs (cancellation
/// in a - b); tiny products (subnormal results); exp_weight's range and its edges; weights.
fn softfloat_rows(n: usize) -> Vec<[u32; 4]> {
    let mut rng = Rng(31);
    let mut rows = Vec::with_capacity(n);
    let edges = [
        0.0f32, -0.0, -87.0, -86.99999, -87.00001, -1e-30, -1e-45, 1e-45, 1.0, -1.0, 0.5, 1e-5,
    ];
    for i in 0..n {
        let (a, b) = match i % 6 {
            0 => (any_finite(&mut rng), any_finite(&mut rng)),
            1 => (rng.f() * 40.0, 0.05 + rng.f().abs() * 2.0),
            2 => {
                let a = any_finite(&mut rng);
                let ulps = (rng.u64() % 64) as i32 - 32;
                (
                    a,
                    f32::from_bits((a.to_bits() as i32).wrapping_add(ulps) as u32),
                )
            }
            3 => {
                let s = 1e-19 * (1.0 + rng.f().abs());
                (s * rng.f(), s * rng.f())
            }
            4 => (
                -100.0 * rng.f().abs() + 1.0,
                edges[(rng.u64() as usize) % edges.len()],
            ),
            _ => (edges[i / 6 % edges.len()], rng.f() * 3.0),
        };
        let w = |rng: &mut Rng| match rng.u64() % 3 {
            0 => any_finite(rng).abs(),
            1 => exp_weight(-90.0 * rng.f().abs()),
            _ => rng.f().abs(),
        };
        let (c, d) = (w(&mut rng), w(&mut rng));
        rows.push([a.to_bits(), b.to_bits(), c.to_bits(), d.to_bits()]);
    }
    rows
}

/// Same bits, or both NaN (a NaN's payload is the hardware's).
fn same32(got: u32, want: f32) -> bool {
    got == want.to_bits() || (want.is_nan() && f32::from_bits(got).is_nan())
}

fn words64(w: &[u32; 16], i: usize) -> u64 {
    (w[i] as u64) << 32 | w[i + 1] as u64
}

/// softfloat.wgsl's operations against Rust's IEEE arithmetic on 60,000 rows: every result bit
/// for bit (the device sampler's weights, sums and draw are the CPU's only if these are).
#[test]
fn softfloat_matches_ieee() {
    let Some(g) = gpu() else { return };
    let rows = softfloat_rows(60_000);
    let out = g.softfloat_check(&rows).unwrap();
    let mut bad = Vec::new();
    for (r, w) in rows.iter().zip(&out) {
        let (a, b) = (f32::from_bits(r[0]), f32::from_bits(r[1]));
        let (c, d) = (f32::from_bits(r[2]) as f64, f32::from_bits(r[3]) as f64);
        let (s, m) = (c + d, c * d);
        let n53 = ((r[2] as u64 & 0x1f_ffff) << 32) | r[3] as u64;
        let checks = [
            ("a + b", same32(w[0], a + b)),
            ("a - b", same32(w[1], a - b)),
            ("a * b", same32(w[2], a * b)),
            ("a / b", same32(w[3], a / b)),
            ("exp_weight(a)", w[4] == exp_weight(a).to_bits()),
            ("c + d", words64(w, 5) == s.to_bits()),
            ("c * d", words64(w, 7) == m.to_bits()),
            ("s + m", words64(w, 9) == (s + m).to_bits()),
            ("s * m", words64(w, 11) == (s * m).to_bits()),
            (
                "N * 2^-53",
                words64(w, 13) == (n53 as f64 * (1.0 / (1u64 << 53) as f64)).to_bits(),
            ),
        ];
        for (name, ok) in checks {
            if !ok && bad.len() < 12 {
                bad.push(format!(
                    "{name} at a={a:e} b={b:e} c={c:e} d={d:e}: {w:08x?}"
                ));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "softfloat differs from IEEE:\n{}",
        bad.join("\n")
    );
}

fn upload(g: &Wgpu, l: &[f32]) -> <Wgpu as Backend>::Buf {
    g.upload(l).unwrap()
}

/// The host sampler's tokens draw for draw, every case of common/sampling.rs (penalties, top-k,
/// top-p, min-p, greedy); 60 draws a case on lavapipe (CUDA's test: 300 on the H200).
#[test]
fn sample_step_matches_the_host_sampler() {
    let Some(g) = gpu() else { return };
    sampling::sample_step_matches_the_host_sampler(&g, |l| upload(&g, l), 60);
}

#[test]
fn sample_logprobs_match_the_host() {
    let Some(g) = gpu() else { return };
    sampling::sample_logprobs_match_the_host(&g, |l| upload(&g, l));
}

/// The checkpoint's default against the CPU's distribution: 3,000 draws on lavapipe, every one
/// the host's token for the same seed (the chi-square bound of common/sampling.rs holds at any n).
#[test]
fn sample_distribution_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    sampling::sample_distribution_matches_the_cpu(&g, |l| upload(&g, l), 3000, 3000);
}

/// Log-probabilities on the device (sample.wgsl, log-probability mode) where constrained
/// decoding leaves them: most logits -inf (a mask), one NaN (skipped, as the host skips it),
/// and more alternatives asked than finite logits, so -inf ones are reported too (-inf, in id
/// order). Against runtime::sampler::token_logprobs: the same ids, values within 1e-5 (the
/// device's lse in f32 against the host's f64), -inf where the host has -inf.
#[test]
fn logprobs_on_masked_logits() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(33);
    let vocab = 248_320;
    let mut l = vec![f32::NEG_INFINITY; vocab];
    for id in [3usize, 4000, 131_071, 200_000, 248_319, 77, 9_999, 150_000] {
        l[id] = 4.0 * rng.f();
    }
    l[12_345] = f32::NAN;
    let gl = g.upload(&l).unwrap();
    let mut worst = 0f32;
    for (token, n) in [(4000u32, 20usize), (77, 3), (5, 1)] {
        let (lp, top) = g.logprobs(&gl, vocab, token, n).unwrap();
        let (wlp, wtop) = lily::runtime::sampler::token_logprobs(&l, token, n);
        let close = |a: f32, b: f32| a == b || (a - b).abs() < 1e-5;
        assert!(close(lp, wlp), "token {token}: {lp} vs {wlp}");
        assert_eq!(
            top.iter().map(|x| x.0).collect::<Vec<_>>(),
            wtop.iter().map(|x| x.0).collect::<Vec<_>>(),
            "token {token}: the alternatives' ids"
        );
        for (a, b) in top.iter().zip(&wtop) {
            assert!(
                close(a.1, b.1),
                "token {token}: id {} {} vs {}",
                a.0,
                a.1,
                b.1
            );
            if b.1.is_finite() {
                worst = worst.max((a.1 - b.1).abs());
            }
        }
    }
    println!("logprobs on masked logits: ids equal, worst |Δ| {worst:.2e} (tol 1e-5)");
}
