//! CPU ops: RMS norm (plain and fused with the residual add) and small elementwise ops.
//! Layout: row-major `[rows, dim]` f32. Reductions in f32 like MLX's `fast.rms_norm` (which
//! accumulates in f32), threads over rows when there are enough of them.

use rayon::prelude::*;

/// Rows per rayon task: norms are cheap, so only split big blocks.
const ROWS_PER_TASK: usize = 16;

#[inline]
pub fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let r = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * r * g;
    }
}

/// `out[t] = rms_norm(x[t]) * w`.
pub fn rms_norm(x: &[f32], w: &[f32], rows: usize, dim: usize, eps: f32, out: &mut [f32]) {
    out[..rows * dim]
        .par_chunks_mut(dim * ROWS_PER_TASK)
        .zip(x[..rows * dim].par_chunks(dim * ROWS_PER_TASK))
        .for_each(|(o, x)| {
            for (o, x) in o.chunks_mut(dim).zip(x.chunks(dim)) {
                rms_norm_row(x, w, eps, o);
            }
        });
}

/// `h[t] += r[t]; out[t] = rms_norm(h[t]) * w`.
pub fn add_rms_norm(
    h: &mut [f32],
    r: &[f32],
    w: &[f32],
    rows: usize,
    dim: usize,
    eps: f32,
    out: &mut [f32],
) {
    out[..rows * dim]
        .par_chunks_mut(dim * ROWS_PER_TASK)
        .zip(h[..rows * dim].par_chunks_mut(dim * ROWS_PER_TASK))
        .zip(r[..rows * dim].par_chunks(dim * ROWS_PER_TASK))
        .for_each(|((o, h), r)| {
            for ((o, h), r) in o.chunks_mut(dim).zip(h.chunks_mut(dim)).zip(r.chunks(dim)) {
                h.iter_mut().zip(r).for_each(|(a, b)| *a += b);
                rms_norm_row(h, w, eps, o);
            }
        });
}

#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `softplus(x) = log(1 + e^x)`, stable for large |x|.
#[inline(always)]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

pub fn swiglu(g: &[f32], u: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        *o = silu(g) * u;
    }
}

/// `y[t] += sigmoid(s[t]) · shared[t]`.
pub fn add_sigmoid_gated(y: &mut [f32], shared: &[f32], s: &[f32], rows: usize, dim: usize) {
    for t in 0..rows {
        let g = sigmoid(s[t]);
        for (a, &b) in y[t * dim..(t + 1) * dim]
            .iter_mut()
            .zip(&shared[t * dim..(t + 1) * dim])
        {
            *a += g * b;
        }
    }
}
