//! MLX affine quantization, bit for bit.
//!
//! [`mlx_quantize_group`] is MLX's rule (`mlx.core.quantize`, affine mode, CPU backend), in f32
//! exactly as MLX computes it: per group, `scale = max((w_max − w_min)/n, 1e-7)`, the edge with the
//! larger magnitude (`w_min` if `|w_min| > |w_max|`, else `w_max`, in which case the scale is
//! negative) is made exact: `q0 = rint(edge/scale)`, and if `q0 ≠ 0`, `scale = edge/q0`,
//! `bias = edge`; codes are `clamp(rint((w − bias)/scale), 0, n)`, computed with the f32 scale and
//! bias; scale and bias are then stored in the weight's dtype (bf16 here).
//!
//! [`encode_group`] is what the writer uses: the same rule, with each group's scale and zero
//! point chosen so the result is a *fixed point* of MLX's rule: dequantizing the stored codes with
//! the stored bf16 scale and bias (in f32) and quantizing again with `mlx.core.quantize` gives back
//! the identical codes, scale and bias, so "re-quantize with MLX and compare" is an exact test of
//! the format (`tools/synth_check.py`). It needs the codes 0 and n both present (the group's two
//! extreme elements are pinned to them), the bias (bf16) within MLX's re-derivation of `K·scale`
//! for an integer zero point `K`, and MLX's `bias/K` rounding back to the stored bf16 scale. At
//! 4-bit the natural `K` and the nearest bf16 scale almost always pass a two-line check; otherwise
//! (and at 8-bit) nearby candidates are tried and each verified by running MLX's rule on its
//! dequantized values, with `K·scale` exact in bf16 (scale rounded to `8 − bits(K)` significant
//! bits) as the always-valid fallback. Dequantized values stay within half a step of the weights
//! except the pinned extremes (within about one step).

/// f32 → bf16 bits (round to nearest even) and back: the loader's conversions.
pub use crate::loader::tensor::{bf16_to_f32 as bf16_value, f32_to_bf16 as bf16_bits};

/// Round half to even (as C's `rint` in the default mode) without a libm call: adding and
/// subtracting 1.5·2²³ rounds any |x| < 2²² to an integer (IEEE nearest-even).
trait Rne {
    fn rne(self) -> f32;
}

/// Round half to even for |x| < 2²² (callers clamp first): no branch, no libm call.
#[inline(always)]
fn rne_small(x: f32) -> f32 {
    const M: f32 = 12_582_912.0;
    (x + M) - M
}

impl Rne for f32 {
    #[inline(always)]
    fn rne(self) -> f32 {
        const M: f32 = 12_582_912.0;
        if self.abs() < 4_194_304.0 {
            (self + M) - M
        } else {
            self.round_ties_even()
        }
    }
}

/// One encoded group: codes (one byte each, < 2^bits) and bf16 scale and bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupParams {
    pub scale: u16,
    pub bias: u16,
}

/// MLX's affine quantization of one group, f32 arithmetic, scale/bias returned in f32 (cast them
/// to the weight dtype to store). `codes.len() == w.len()`.
pub fn mlx_quantize_group(w: &[f32], bits: u32, codes: &mut [u8]) -> (f32, f32) {
    let n_bins = ((1u32 << bits) - 1) as f32;
    let eps = 1e-7f32;
    let mut w_min = f32::INFINITY;
    let mut w_max = -w_min;
    for &x in w {
        // std::max(a, b) = a < b ? b : a; std::min(a, b) = b < a ? b : a
        w_max = if w_max < x { x } else { w_max };
        w_min = if x < w_min { x } else { w_min };
    }
    let mask = w_min.abs() > w_max.abs();
    let mut scale = (w_max - w_min) / n_bins;
    scale = if scale < eps { eps } else { scale };
    scale = if mask { scale } else { -scale };
    let edge = if mask { w_min } else { w_max };
    let q0 = (edge / scale).rne();
    let mut bias = 0.0f32;
    if q0 != 0.0 {
        scale = edge / q0;
        bias = edge;
    }
    for (c, &x) in codes.iter_mut().zip(w) {
        // Clamping to [−1, n+1] before rounding changes nothing (rint is monotonic).
        let mut q = rne_small(((x - bias) / scale).clamp(-1.0, n_bins + 1.0));
        q = if q < 0.0 { 0.0 } else { q };
        q = if n_bins < q { n_bins } else { q };
        *c = q as u8;
    }
    (scale, bias)
}

/// Significant bits of a positive integer.
fn sig_bits(k: u32) -> u32 {
    32 - k.leading_zeros() - k.trailing_zeros()
}

/// Positive normal `x` rounded (to nearest, ties to even) to `p` significant bits.
fn round_sig(x: f32, p: u32) -> f32 {
    let b = x.to_bits();
    let drop = 24 - p;
    let lsb = (b >> drop) & 1;
    let r = b + (1 << (drop - 1)) - 1 + lsb;
    f32::from_bits(r & !((1u32 << drop) - 1))
}

/// Minimum and maximum, in 8 lanes (vectorizes).
#[inline]
fn min_max(w: &[f32]) -> (f32, f32) {
    let mut lo = [f32::INFINITY; 8];
    let mut hi = [f32::NEG_INFINITY; 8];
    let mut chunks = w.chunks_exact(8);
    for c in &mut chunks {
        for i in 0..8 {
            lo[i] = if c[i] < lo[i] { c[i] } else { lo[i] };
            hi[i] = if c[i] > hi[i] { c[i] } else { hi[i] };
        }
    }
    for &x in chunks.remainder() {
        lo[0] = if x < lo[0] { x } else { lo[0] };
        hi[0] = if x > hi[0] { x } else { hi[0] };
    }
    (
        lo.iter().fold(f32::INFINITY, |a, &x| a.min(x)),
        hi.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x)),
    )
}

/// Codes of `w` for a given scale and bias (MLX's formula), with the group's edge value pinned to
/// code 0 and the opposite extreme to n.
fn codes_for(
    w: &[f32],
    bits: u32,
    scale: f32,
    bias: f32,
    v_edge: f32,
    v_far: f32,
    codes: &mut [u8],
) {
    let n = (1i32 << bits) - 1;
    let inv = 1.0 / scale;
    const M: f32 = 12_582_912.0;
    let m_bits = M.to_bits() as i32;
    let hi = n as f32 + 2.0;
    let codes = &mut codes[..w.len()];
    for i in 0..w.len() {
        // After clamping to [−2, n+2] and adding 1.5·2²³, the rounded integer sits in the low
        // mantissa bits (nearest-even rounding, as rint); branch-free so the loop vectorizes.
        let q = (w[i] - bias) * inv;
        let q = if q < -2.0 {
            -2.0
        } else if q > hi {
            hi
        } else {
            q
        };
        let qi = ((q + M).to_bits() as i32 - m_bits).max(0).min(n);
        let qi = if w[i] == v_edge { 0 } else { qi };
        codes[i] = (if w[i] == v_far { n } else { qi }) as u8;
    }
}

/// Whether (codes, scale, bias) is a fixed point of MLX's rule; returns the max abs error to `w`.
fn verify(w: &[f32], bits: u32, codes: &[u8], p: GroupParams) -> Option<f32> {
    let mut deq = [0f32; 256];
    let mut c2 = [0u8; 256];
    let g = w.len().min(256);
    dequant_group(codes, p, &mut deq[..g]);
    let (s2, b2) = mlx_quantize_group(&deq[..g], bits, &mut c2[..g]);
    if bf16_bits(s2) != p.scale || bf16_bits(b2) != p.bias || c2[..g] != codes[..g] {
        return None;
    }
    Some(
        w.iter()
            .zip(&deq[..g])
            .fold(0f32, |m, (a, b)| m.max((a - b).abs())),
    )
}

/// Encodes one group so the stored result is a fixed point of MLX's rule (see the module doc).
/// Falls back to MLX's rule unchanged for degenerate groups (constant, or zero edge).
pub fn encode_group(w: &[f32], bits: u32, codes: &mut [u8]) -> GroupParams {
    let n = (1u32 << bits) - 1;
    let (w_min, w_max) = min_max(w);
    let d = (w_max - w_min) / n as f32;
    let mask = w_min.abs() > w_max.abs();
    let edge = if mask { w_min } else { w_max };
    let far = if mask { w_max } else { w_min };
    let sgn = if mask { 1.0f32 } else { -1.0 };
    let q0 = if d > 1e-7 {
        (edge / (sgn * d)).rne()
    } else {
        0.0
    };
    if q0 >= 0.0 || w_min == w_max || d.is_nan() || d <= 1e-30 || w.len() > 256 {
        let (s, b) = mlx_quantize_group(w, bits, codes);
        return GroupParams {
            scale: bf16_bits(s),
            bias: bf16_bits(b),
        };
    }
    let k_nat = (-q0) as u32;
    let straddles = k_nat <= n;
    let s8 = bf16_bits(d);

    // Fast path (4-bit, the bulk of every checkpoint): zero points K near the natural one and bf16
    // scales S near the natural one, bias = bf16(K·S). MLX's re-derivation then gets q0 = −K and
    // the codes back exactly (K·2⁻⁸ and 15·2⁻⁸ are below ½), and the only condition left is that
    // its scale bias/K rounds back to S in bf16: two divisions per candidate, no per-element work.
    // Among the candidates that pass, the one that moves the two pinned extremes least wins. (K is
    // kept ≥ (n+1)/2: a symmetric group can round to K = n/2 − ½, where the re-derived edge would
    // switch sides.)
    if bits == 4 && straddles {
        let k0 = k_nat.max(n.div_ceil(2));
        let mut best: Option<(f32, f32, f32)> = None;
        // Candidates nearest first; stop at the first within 0.55 of a step at both ends.
        const ORDER: [(i32, i32); 15] = [
            (0, 0),
            (0, -1),
            (0, 1),
            (-1, 0),
            (1, 0),
            (0, -2),
            (0, 2),
            (-1, -1),
            (-1, 1),
            (1, -1),
            (1, 1),
            (-1, -2),
            (-1, 2),
            (1, -2),
            (1, 2),
        ];
        for (dk, u) in ORDER {
            let k = k0 as i32 + dk;
            if k < (n.div_ceil(2)) as i32 || k > n as i32 {
                continue;
            }
            let k = k as u32;
            {
                let s = bf16_value((s8 as i32 + u).clamp(1, 0x7F7F) as u16);
                let scale = sgn * s;
                let bias = bf16_value(bf16_bits(-(k as f32) * scale));
                let q0b = (bias / scale).rne();
                if q0b != -(k as f32) || bf16_bits(bias / q0b) != bf16_bits(scale) {
                    continue;
                }
                let err = (bias - edge)
                    .abs()
                    .max((bias + n as f32 * scale - far).abs());
                if best.is_none_or(|b| err < b.0) {
                    best = Some((err, scale, bias));
                }
                if err <= 0.55 * s {
                    break;
                }
            }
        }
        let (scale, bias) = match best {
            Some((_, s, b)) => (s, b),
            None => {
                // Always valid: K·S exact in bf16 (S rounded to 8 − bits(K) significant bits).
                let s = sgn * round_sig(d, 8 - sig_bits(k0));
                (s, -(k0 as f32) * s)
            }
        };
        codes_for(w, bits, scale, bias, edge, far, codes);
        return GroupParams {
            scale: bf16_bits(scale),
            bias: bf16_bits(bias),
        };
    }

    // General path: candidates around the natural (K, S), each checked by running MLX's rule on
    // its dequantized values; plus the always-exact ones with K·S exact in bf16 (S rounded to
    // 8 − bits(K) significant bits). The candidate closest to `w` wins.
    let (lo, hi) = if straddles {
        (n.div_ceil(2), n)
    } else {
        (1, u32::MAX)
    };
    let radius = if straddles { 2 } else { (k_nat / 8).max(2) };
    let mut best: Option<(f32, GroupParams, [u8; 256])> = None;
    let mut tmp = [0u8; 256];
    let g = w.len();
    let mut consider = |k: u32, s: f32, best: &mut Option<(f32, GroupParams, [u8; 256])>| {
        if s.is_nan() || s <= 0.0 || !s.is_finite() {
            return;
        }
        let scale = sgn * s;
        let bias = bf16_value(bf16_bits(-(k as f32) * scale));
        let p = GroupParams {
            scale: bf16_bits(scale),
            bias: bf16_bits(bias),
        };
        codes_for(w, bits, scale, bias, edge, far, &mut tmp[..g]);
        if let Some(err) = verify(w, bits, &tmp[..g], p) {
            if best.as_ref().is_none_or(|b| err < b.0) {
                *best = Some((err, p, tmp));
            }
        }
    };
    for k in k_nat.saturating_sub(radius).max(lo)..=(k_nat.saturating_add(radius)).min(hi) {
        for u in -2i32..=2 {
            let sb = (s8 as i32 + u).clamp(1, 0x7F7F) as u16;
            consider(k, bf16_value(sb), &mut best);
        }
        let j = sig_bits(k);
        if j <= 7 {
            consider(k, round_sig(d, 8 - j), &mut best);
        }
    }
    if bits > 4 {
        // 8-bit: K·S must come out exact far more often than by luck. Try biases a few bf16 ulps
        // around the edge and zero points around K; keep the pairs whose scale |bias|/K is exact.
        let eb = bf16_bits(edge.abs()) as i32;
        for db in -6i32..=6 {
            let b = bf16_value((eb + db).clamp(1, 0x7F7F) as u16);
            for k in k_nat.saturating_sub(8).max(lo)..=(k_nat.saturating_add(8)).min(hi) {
                let s = b / k as f32;
                if s * k as f32 == b && bf16_value(bf16_bits(s)) == s {
                    consider(k, s, &mut best);
                }
            }
        }
    }
    if bits > 4 && best.as_ref().is_none_or(|b| b.0 > d) {
        // Still more than a step off: a wider neighbourhood of (K, S).
        for k in k_nat.saturating_sub(10).max(lo)..=(k_nat.saturating_add(10)).min(hi) {
            for u in -5i32..=5 {
                let sb = (s8 as i32 + u).clamp(1, 0x7F7F) as u16;
                consider(k, bf16_value(sb), &mut best);
            }
        }
    }
    if best.is_none() {
        // Wider: zero points with few significant bits (always exact with a coarser scale).
        let r = k_nat / 4 + 2;
        for k in k_nat.saturating_sub(r).max(lo)..=(k_nat.saturating_add(r)).min(hi) {
            if sig_bits(k) <= 4 {
                consider(k, round_sig(d, 8 - sig_bits(k)), &mut best);
            }
        }
    }
    match best {
        Some((_, p, c)) => {
            codes.copy_from_slice(&c[..g]);
            p
        }
        None => {
            let (s, b) = mlx_quantize_group(w, bits, codes);
            GroupParams {
                scale: bf16_bits(s),
                bias: bf16_bits(b),
            }
        }
    }
}

/// Packs codes little-endian into u32 words, lowest bits first (4-bit: 8 per word; 8-bit: 4).
pub fn pack(codes: &[u8], bits: u32, out: &mut [u32]) {
    match bits {
        4 => out
            .iter_mut()
            .zip(codes.chunks_exact(8))
            .for_each(|(w, c)| {
                *w = c
                    .iter()
                    .enumerate()
                    .fold(0u32, |v, (i, &x)| v | (x as u32 & 15) << (4 * i));
            }),
        8 => out
            .iter_mut()
            .zip(codes.chunks_exact(4))
            .for_each(|(w, c)| *w = u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        _ => {
            let per = (32 / bits) as usize;
            for (j, word) in out.iter_mut().enumerate() {
                *word = (0..per).fold(0u32, |v, i| {
                    v | (codes[j * per + i] as u32) << (i as u32 * bits)
                });
            }
        }
    }
}

/// Dequantizes one group (f32 arithmetic: `scale·q + bias`).
pub fn dequant_group(codes: &[u8], p: GroupParams, out: &mut [f32]) {
    let (s, b) = (bf16_value(p.scale), bf16_value(p.bias));
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = s * c as f32 + b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::rng::Rng;

    fn random_group(r: &mut Rng, g: usize, kind: u32) -> Vec<f32> {
        let mut w = vec![0f32; g];
        let std = [0.02f32, 1.0, 3e-4, 50.0][kind as usize % 4];
        r.fill_normal(&mut w, std);
        match kind % 5 {
            1 => w[r.below(g as u64) as usize] = 6.0 * std, // an outlier
            2 => w.iter_mut().for_each(|x| *x += 0.5 * std), // skewed
            3 => w.iter_mut().for_each(|x| *x = x.abs() + std), // one-signed
            4 => {
                // symmetric: max = −min exactly (K = 7.5 at 4-bit)
                let m = w.iter().fold(0f32, |a, &x| a.max(x.abs()));
                w[0] = m;
                w[1] = -m;
            }
            _ => {}
        }
        w
    }

    #[test]
    fn encoded_groups_are_mlx_fixed_points_and_close() {
        let mut r = Rng::new(1);
        for bits in [4u32, 8] {
            let mut worst = 0f32;
            let n = (1u32 << bits) - 1;
            for t in 0..4000 {
                let w = random_group(&mut r, 64, t);
                let mut codes = vec![0u8; 64];
                let p = encode_group(&w, bits, &mut codes);
                assert!(codes.iter().all(|&c| c as u32 <= n));
                let mut deq = vec![0f32; 64];
                dequant_group(&codes, p, &mut deq);
                // Within one step of the original (half a step plus the nudge).
                let step = bf16_value(p.scale).abs();
                let wmax = w.iter().fold(0f32, |a, &x| a.max(x.abs()));
                for (a, b) in w.iter().zip(&deq) {
                    worst = worst.max((a - b).abs() / step);
                    assert!(
                        (a - b).abs() <= step * if bits == 4 { 1.0 } else { 6.0 } + 1e-6 * wmax,
                        "bits {bits} t {t}: {a} vs {b}, step {step}"
                    );
                }
                // MLX's rule on the dequantized values gives back the same bytes.
                let mut c2 = vec![0u8; 64];
                let (s2, b2) = mlx_quantize_group(&deq, bits, &mut c2);
                assert_eq!(codes, c2, "bits {bits} t {t}");
                assert_eq!(
                    (bf16_bits(s2), bf16_bits(b2)),
                    (p.scale, p.bias),
                    "bits {bits} t {t}"
                );
            }
            eprintln!("{bits}-bit: worst error {worst:.2} steps");
        }
    }

    #[test]
    fn mlx_rule_within_one_step() {
        let mut r = Rng::new(2);
        for t in 0..1000 {
            let w = random_group(&mut r, 64, t);
            let mut codes = vec![0u8; 64];
            let (s, b) = mlx_quantize_group(&w, 4, &mut codes);
            for (x, &c) in w.iter().zip(&codes) {
                assert!(
                    (s * c as f32 + b - x).abs() <= s.abs() * 1.0001 + 1e-6,
                    "{t}"
                );
            }
        }
    }

    #[test]
    fn packing_order() {
        let codes: Vec<u8> = (0..16).collect();
        let mut w = [0u32; 2];
        pack(&codes, 4, &mut w);
        assert_eq!(w, [0x7654_3210, 0xFEDC_BA98]);
        let mut w8 = [0u32; 4];
        pack(&codes, 8, &mut w8);
        assert_eq!(w8[1], 0x0706_0504);
    }

    #[test]
    fn helpers() {
        assert_eq!(sig_bits(208), 4);
        assert_eq!(sig_bits(128), 1);
        assert_eq!(round_sig(1.0 + 1.0 / 16.0 + 1.0 / 64.0, 5), 1.0625);
    }
}
