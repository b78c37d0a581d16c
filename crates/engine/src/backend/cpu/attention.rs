//! CPU ops of the gated full-attention layer: q/k RMS norm + partial RoPE, and causal GQA
//! attention over the KV cache with the sigmoid output gate.
//!
//! Layouts: `qg` `[rows, heads, 2·hd]` (query | gate per head, as q_proj emits it); `q`, `gate`
//! `[rows, heads·hd]`; `k`, `v` `[rows, kv_heads·hd]`; the cache `[capacity, kv_heads·hd]`.
//! RoPE is rotate-half (NeoX) on dims `0..rotary_dim`, pairs (i, i + rotary_dim/2), angles in f64
//! then rounded to f32 (positions up to 262K keep full precision). Softmax in f32 with the max
//! subtracted.
//!
//! Prefill is tiled (flash-style): a task takes one KV head and a tile of `TQ` query rows (all the
//! query heads that share that KV head), walks the keys in blocks of `TK` with an online softmax,
//! so each K/V block is read once per tile while it sits in L1/L2. The untiled form re-read the
//! whole cache for every (query, head) and was memory-bound: 1.6 GFLOP/s at 8K context on two
//! cores. Decode (one row) keeps the direct form, threaded over heads.

use rayon::prelude::*;

use super::norm::{rms_norm_row, sigmoid};
use crate::backend::{Dims, KvCache};

/// `a · b` with 8 independent partial sums, so the loop vectorises (a plain iterator sum is one
/// sequential float chain: ~8× slower at long context, where attention is all dot products).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `o += p · v`.
#[inline]
fn axpy(o: &mut [f32], p: f32, v: &[f32]) {
    for (a, &b) in o.iter_mut().zip(v) {
        *a += p * b;
    }
}

fn rope_in_place(x: &mut [f32], pos: usize, rot: usize, theta: f64) {
    let half = rot / 2;
    for i in 0..half {
        let inv = theta.powf(-(2.0 * i as f64) / rot as f64);
        let ang = pos as f64 * inv;
        let (s, c) = (ang.sin() as f32, ang.cos() as f32);
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * c - b * s;
        x[i + half] = a * s + b * c;
    }
}

#[allow(clippy::too_many_arguments)]
pub fn attn_qk_norm_rope(
    qg: &[f32],
    k: &mut [f32],
    qn: &[f32],
    kn: &[f32],
    d: &Dims,
    rows: usize,
    pos0: usize,
    q: &mut [f32],
    gate: &mut [f32],
) {
    let hd = d.head_dim;
    for t in 0..rows {
        for h in 0..d.n_heads {
            let src = &qg[(t * d.n_heads + h) * 2 * hd..][..2 * hd];
            let qo = &mut q[(t * d.n_heads + h) * hd..][..hd];
            rms_norm_row(&src[..hd], qn, d.eps, qo);
            rope_in_place(qo, pos0 + t, d.rotary_dim, d.rope_theta);
            gate[(t * d.n_heads + h) * hd..][..hd].copy_from_slice(&src[hd..]);
        }
        for h in 0..d.n_kv_heads {
            let kh = &mut k[(t * d.n_kv_heads + h) * hd..][..hd];
            let src = kh.to_vec();
            rms_norm_row(&src, kn, d.eps, kh);
            rope_in_place(kh, pos0 + t, d.rotary_dim, d.rope_theta);
        }
    }
}

/// Query rows per prefill tile and keys per block (see the module header).
const TQ: usize = 16;
const TK: usize = 64;

/// Causal attention of `rows > 1` query rows over the cache (already holding their k/v), tiled;
/// the same result as [`attention`] up to float rounding (online softmax).
#[allow(clippy::too_many_arguments)]
fn attention_tiled(
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    gate: &[f32],
    d: &Dims,
    rows: usize,
    pos0: usize,
    out: &mut [f32],
) {
    let hd = d.head_dim;
    let kvd = d.n_kv_heads * hd;
    let group = d.n_heads / d.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let tiles = rows.div_ceil(TQ);
    let tasks: Vec<(usize, usize)> = (0..d.n_kv_heads)
        .flat_map(|g| (0..tiles).map(move |t| (g, t * TQ)))
        .collect();
    let results: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(g, t0)| {
            let tn = TQ.min(rows - t0);
            // Query qi = r·group + hh: row t0 + r, head g·group + hh.
            let nq = tn * group;
            let qv = |qi: usize| {
                &q[((t0 + qi / group) * d.n_heads + g * group + qi % group) * hd..][..hd]
            };
            let (mut m, mut l) = (vec![f32::NEG_INFINITY; nq], vec![0.0f32; nq]);
            let mut acc = vec![0.0f32; nq * hd];
            let mut s = vec![0.0f32; TK];
            let keys = pos0 + t0 + tn;
            for j0 in (0..keys).step_by(TK) {
                let jn = TK.min(keys - j0);
                for qi in 0..nq {
                    // Causal: row t0 + r sees keys < pos0 + t0 + r + 1.
                    let limit = (pos0 + t0 + qi / group + 1).saturating_sub(j0).min(jn);
                    if limit == 0 {
                        continue;
                    }
                    let x = qv(qi);
                    let mut bm = f32::NEG_INFINITY;
                    for (jj, sc) in s[..limit].iter_mut().enumerate() {
                        *sc = dot(x, &kc[(j0 + jj) * kvd + g * hd..][..hd]) * scale;
                        bm = bm.max(*sc);
                    }
                    let nm = m[qi].max(bm);
                    let corr = (m[qi] - nm).exp();
                    let a = &mut acc[qi * hd..][..hd];
                    if corr != 1.0 {
                        l[qi] *= corr;
                        a.iter_mut().for_each(|v| *v *= corr);
                    }
                    for (jj, &sc) in s[..limit].iter().enumerate() {
                        let p = (sc - nm).exp();
                        l[qi] += p;
                        axpy(a, p, &vc[(j0 + jj) * kvd + g * hd..][..hd]);
                    }
                    m[qi] = nm;
                }
            }
            for qi in 0..nq {
                let h = g * group + qi % group;
                let gt = &gate[((t0 + qi / group) * d.n_heads + h) * hd..][..hd];
                for (v, &gv) in acc[qi * hd..][..hd].iter_mut().zip(gt) {
                    *v = *v / l[qi] * sigmoid(gv);
                }
            }
            acc
        })
        .collect();
    for (&(g, t0), acc) in tasks.iter().zip(results) {
        for (qi, a) in acc.chunks_exact(hd).enumerate() {
            let h = g * group + qi % group;
            out[((t0 + qi / group) * d.n_heads + h) * hd..][..hd].copy_from_slice(a);
        }
    }
}

/// Appends k/v at `pos0..pos0+rows`, then for each query row t (absolute position pos0+t) and head:
/// `o = Σ_j softmax_j(q·k_j / √hd) v_j` over j ≤ pos0+t, times `sigmoid(gate)`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    gate: &[f32],
    kv: &mut KvCache<Vec<f32>>,
    d: &Dims,
    rows: usize,
    pos0: usize,
    out: &mut [f32],
) {
    let hd = d.head_dim;
    let kvd = d.n_kv_heads * hd;
    assert!(
        pos0 + rows <= kv.capacity,
        "KV cache overflow: checked by the runtime"
    );
    kv.k[pos0 * kvd..(pos0 + rows) * kvd].copy_from_slice(&k[..rows * kvd]);
    kv.v[pos0 * kvd..(pos0 + rows) * kvd].copy_from_slice(&v[..rows * kvd]);
    let (kc, vc) = (&kv.k, &kv.v);
    if rows > 1 {
        return attention_tiled(q, kc, vc, gate, d, rows, pos0, out);
    }
    let group = d.n_heads / d.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    out[..rows * d.n_heads * hd]
        .par_chunks_mut(hd)
        .enumerate()
        .for_each_init(Vec::new, |scores: &mut Vec<f32>, (i, o)| {
            let (t, h) = (i / d.n_heads, i % d.n_heads);
            let kvh = h / group;
            let qv = &q[i * hd..][..hd];
            let n = pos0 + t + 1;
            scores.clear();
            let mut m = f32::NEG_INFINITY;
            for j in 0..n {
                let kj = &kc[j * kvd + kvh * hd..][..hd];
                let s = dot(qv, kj) * scale;
                m = m.max(s);
                scores.push(s);
            }
            let mut denom = 0.0f32;
            for s in scores.iter_mut() {
                *s = (*s - m).exp();
                denom += *s;
            }
            o.iter_mut().for_each(|x| *x = 0.0);
            for (j, &p) in scores.iter().enumerate() {
                axpy(o, p, &vc[j * kvd + kvh * hd..][..hd]);
            }
            let g = &gate[i * hd..][..hd];
            for (a, &gv) in o.iter_mut().zip(g) {
                *a = *a / denom * sigmoid(gv);
            }
        });
}
