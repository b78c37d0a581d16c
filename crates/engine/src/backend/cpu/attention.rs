//! CPU ops of the gated full-attention layer: q/k RMS norm + partial RoPE, and causal GQA
//! attention over the KV cache with the sigmoid output gate.
//!
//! Layouts: `qg` `[rows, heads, 2·hd]` (query | gate per head, as q_proj emits it); `q`, `gate`
//! `[rows, heads·hd]`; `k`, `v` `[rows, kv_heads·hd]`; the cache `[capacity, kv_heads·hd]`.
//! RoPE is rotate-half (NeoX) on dims `0..rotary_dim`, pairs (i, i + rotary_dim/2), angles in f64
//! then rounded to f32 (positions up to 262K keep full precision). Softmax in f32 with the max
//! subtracted. Threads over (query row, head) pairs.

use rayon::prelude::*;

use super::norm::{rms_norm_row, sigmoid};
use crate::backend::{Dims, KvCache};

/// `a · b` with 8 independent partial sums, so the loop vectorises (a plain iterator sum is one
/// sequential float chain: ~8× slower at long context, where attention is all dot products).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
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
pub fn attn_qk_norm_rope(qg: &[f32], k: &mut [f32], qn: &[f32], kn: &[f32], d: &Dims, rows: usize, pos0: usize, q: &mut [f32], gate: &mut [f32]) {
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

/// Appends k/v at `pos0..pos0+rows`, then for each query row t (absolute position pos0+t) and head:
/// `o = Σ_j softmax_j(q·k_j / √hd) v_j` over j ≤ pos0+t, times `sigmoid(gate)`.
#[allow(clippy::too_many_arguments)]
pub fn attention(q: &[f32], k: &[f32], v: &[f32], gate: &[f32], kv: &mut KvCache<Vec<f32>>, d: &Dims, rows: usize, pos0: usize, out: &mut [f32]) {
    let hd = d.head_dim;
    let kvd = d.n_kv_heads * hd;
    assert!(pos0 + rows <= kv.capacity, "KV cache overflow: checked by the runtime");
    kv.k[pos0 * kvd..(pos0 + rows) * kvd].copy_from_slice(&k[..rows * kvd]);
    kv.v[pos0 * kvd..(pos0 + rows) * kvd].copy_from_slice(&v[..rows * kvd]);
    let (kc, vc) = (&kv.k, &kv.v);
    let group = d.n_heads / d.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    out[..rows * d.n_heads * hd].par_chunks_mut(hd).enumerate().for_each_init(Vec::new, |scores: &mut Vec<f32>, (i, o)| {
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
