//! CPU ops of the Gated DeltaNet layer: the causal depthwise conv (prefill and step share one
//! loop here; on a GPU they are different kernels) and the gated delta rule.
//!
//! Layouts: `x`/`out` `[rows, C]` with C = q(Hk·Dk) | k(Hk·Dk) | v(Hv·Dv); conv weight `[C, K]`
//! (tap K-1 multiplies the current token); conv state `[K-1, C]` = the last K-1 pre-conv rows;
//! recurrent state `[Hv, Dv, Dk]` f32; `b`, `a` `[rows, Hv]`; `z`, `out` `[rows, Hv·Dv]`.
//!
//! The recurrence is computed row by row of S: for value row r of head h,
//! `s ← g·s; δ = (v_r − s·k)·β; s ← s + δ·k; y_r = s·q`. Each row is independent, so one pass over
//! S per token does decay, read, update and output (MODEL.md §2 step 5, in the same order).
//! Threads over value heads.

use rayon::prelude::*;

use super::norm::{rms_norm_row, sigmoid, silu, softplus};
use crate::backend::Dims;

pub fn conv1d(x: &[f32], w: &[f32], state: &mut [f32], d: &Dims, rows: usize, out: &mut [f32]) {
    let c = d.conv_channels();
    let k = d.conv_kernel;
    let hist = k - 1;
    // in = state rows (hist) ++ x rows; out[t] uses in[t .. t+k].
    let at = |j: usize, ch: usize| -> f32 {
        if j < hist {
            state[j * c + ch]
        } else {
            x[(j - hist) * c + ch]
        }
    };
    out[..rows * c]
        .par_chunks_mut(c)
        .enumerate()
        .for_each(|(t, o)| {
            for (ch, ov) in o.iter_mut().enumerate() {
                let mut acc = 0.0f32;
                for tap in 0..k {
                    acc += w[ch * k + tap] * at(t + tap, ch);
                }
                *ov = silu(acc);
            }
        });
    // New state: the last `hist` rows of (state ++ x).
    let mut next = vec![0.0f32; hist * c];
    for j in 0..hist {
        let src = rows + j; // index into (state ++ x)
        for ch in 0..c {
            next[j * c + ch] = at(src, ch);
        }
    }
    state[..hist * c].copy_from_slice(&next);
}

/// `x · rsqrt(Σx² + 1e-6)`, the l2 norm GDN applies to q and k.
fn l2norm(x: &[f32], scale: f32, out: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let r = scale / (ss + 1e-6).sqrt();
    for (o, &v) in out.iter_mut().zip(x) {
        *o = v * r;
    }
}

/// `s ← g·s`, returns `s·k`. Eight partial sums (one per SIMD lane) so the compiler vectorises
/// the reduction; f32 addition is not associative, so it would not reorder a single running sum.
#[inline(always)]
fn decay_dot(s: &mut [f32], k: &[f32], g: f32) -> f32 {
    let mut acc = [0f32; 8];
    let n8 = s.len() / 8 * 8;
    for (sv, kk) in s[..n8].chunks_exact_mut(8).zip(k[..n8].chunks_exact(8)) {
        for i in 0..8 {
            sv[i] *= g;
            acc[i] += sv[i] * kk[i];
        }
    }
    let mut tail = 0f32;
    for (sv, &kk) in s[n8..].iter_mut().zip(&k[n8..]) {
        *sv *= g;
        tail += *sv * kk;
    }
    acc.iter().sum::<f32>() + tail
}

/// `s ← s + δ·k`, returns `s·q` (read after the update), vectorised like [`decay_dot`].
#[inline(always)]
fn update_dot(s: &mut [f32], k: &[f32], q: &[f32], delta: f32) -> f32 {
    let mut acc = [0f32; 8];
    let n8 = s.len() / 8 * 8;
    for ((sv, kk), qq) in s[..n8]
        .chunks_exact_mut(8)
        .zip(k[..n8].chunks_exact(8))
        .zip(q[..n8].chunks_exact(8))
    {
        for i in 0..8 {
            sv[i] += delta * kk[i];
            acc[i] += sv[i] * qq[i];
        }
    }
    let mut tail = 0f32;
    for ((sv, &kk), &qq) in s[n8..].iter_mut().zip(&k[n8..]).zip(&q[n8..]) {
        *sv += delta * kk;
        tail += *sv * qq;
    }
    acc.iter().sum::<f32>() + tail
}

pub struct GdnParamsRef<'a> {
    pub a_log: &'a [f32],
    pub dt_bias: &'a [f32],
    pub norm: &'a [f32],
}

#[allow(clippy::too_many_arguments)]
pub fn gated_delta(
    qkv: &[f32],
    z: &[f32],
    b: &[f32],
    a: &[f32],
    p: &GdnParamsRef,
    state: &mut [f32],
    d: &Dims,
    rows: usize,
    out: &mut [f32],
) {
    let (hk, hv, dk, dv) = (d.gdn_k_heads, d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim);
    let c = d.conv_channels();
    let rep = hv / hk;
    let qscale = 1.0 / (dk as f32).sqrt();
    let ys: Vec<Vec<f32>> = state[..hv * dv * dk]
        .par_chunks_mut(dv * dk)
        .enumerate()
        .map(|(h, s)| {
            let kh = h / rep;
            let mut q = vec![0.0f32; dk];
            let mut k = vec![0.0f32; dk];
            let mut y = vec![0.0f32; rows * dv];
            let decay_rate = p.a_log[h].exp();
            for t in 0..rows {
                let row = &qkv[t * c..][..c];
                l2norm(&row[kh * dk..][..dk], qscale, &mut q);
                l2norm(&row[hk * dk + kh * dk..][..dk], 1.0, &mut k);
                let v = &row[2 * hk * dk + h * dv..][..dv];
                let beta = sigmoid(b[t * hv + h]);
                let g = (-decay_rate * softplus(a[t * hv + h] + p.dt_bias[h])).exp();
                let yt = &mut y[t * dv..][..dv];
                for (r, s_row) in s.chunks_mut(dk).enumerate() {
                    let kv = decay_dot(s_row, &k, g);
                    let delta = (v[r] - kv) * beta;
                    yt[r] = update_dot(s_row, &k, &q, delta);
                }
            }
            y
        })
        .collect();
    // Gated RMS norm per value head: o = rms_norm(y, norm) · silu(z).
    let mut tmp = vec![0.0f32; dv];
    for t in 0..rows {
        for (h, y) in ys.iter().enumerate() {
            rms_norm_row(&y[t * dv..][..dv], p.norm, d.eps, &mut tmp);
            let zs = &z[t * hv * dv + h * dv..][..dv];
            let o = &mut out[t * hv * dv + h * dv..][..dv];
            for ((o, &yv), &zv) in o.iter_mut().zip(&tmp).zip(zs) {
                *o = yv * silu(zv);
            }
        }
    }
}
