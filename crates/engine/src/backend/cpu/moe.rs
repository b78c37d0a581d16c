//! CPU ops of the MoE block: routing (softmax, top-k, renormalise) and the routed experts.
//!
//! Layouts: router logits `[rows, E]`; a route holds `ids`/`weights` `[rows, k]`; expert stacks
//! `[E, out, in]`. Prefill groups the block's tokens by expert and runs each expert once as a
//! small GEMM (weights streamed once per block); decode runs the k chosen experts in parallel as
//! GEMVs. Both sum `w_j · expert_j(x)` in slot order j = 0..k so the two paths agree exactly.

use rayon::prelude::*;

use super::matmul::matmul;
use super::norm::swiglu;
use crate::backend::Dims;
use crate::loader::tensor::HostLinear;

/// Expert choices of a block of tokens.
#[derive(Clone, Debug, Default)]
pub struct Route {
    pub ids: Vec<u32>,
    pub weights: Vec<f32>,
    pub k: usize,
}

/// `p = softmax(logits)` (f32, max subtracted); the k largest (lower id first on ties);
/// weights renormalised to sum 1 when `norm_topk`.
pub fn moe_route(logits: &[f32], d: &Dims, rows: usize, route: &mut Route) {
    let (e, k) = (d.n_experts, d.top_k);
    route.k = k;
    route.ids.resize(rows * k, 0);
    route.weights.resize(rows * k, 0.0);
    let mut p = vec![0.0f32; e];
    let mut order: Vec<u32> = Vec::with_capacity(e);
    for t in 0..rows {
        let l = &logits[t * e..][..e];
        let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for (pv, &lv) in p.iter_mut().zip(l) {
            *pv = (lv - m).exp();
            sum += *pv;
        }
        p.iter_mut().for_each(|v| *v /= sum);
        order.clear();
        order.extend(0..e as u32);
        // Stable: equal probabilities keep the lower expert id first.
        order.sort_by(|&a, &b| p[b as usize].total_cmp(&p[a as usize]));
        let top = &order[..k];
        let s: f32 = if d.norm_topk {
            top.iter().map(|&i| p[i as usize]).sum()
        } else {
            1.0
        };
        for j in 0..k {
            route.ids[t * k + j] = top[j];
            route.weights[t * k + j] = p[top[j] as usize] / s;
        }
    }
}

/// One expert's SwiGLU MLP on `n` rows: `down(silu(gate(x)) · up(x))`.
fn expert_mlp(
    x: &[f32],
    n: usize,
    e: usize,
    gate: &HostLinear,
    up: &HostLinear,
    down: &HostLinear,
) -> Vec<f32> {
    let width = gate.out;
    let mut g = vec![0.0f32; n * width];
    let mut u = vec![0.0f32; n * width];
    matmul(x, n, &gate.view(e), &mut g);
    matmul(x, n, &up.view(e), &mut u);
    let mut act = vec![0.0f32; n * width];
    swiglu(&g, &u, &mut act);
    let mut y = vec![0.0f32; n * down.out];
    matmul(&act, n, &down.view(e), &mut y);
    y
}

#[allow(clippy::too_many_arguments)]
pub fn moe_experts_prefill(
    x: &[f32],
    route: &Route,
    gate: &HostLinear,
    up: &HostLinear,
    down: &HostLinear,
    d: &Dims,
    rows: usize,
    out: &mut [f32],
) {
    let (h, k) = (d.hidden, route.k);
    // Tokens (and their slot) per expert.
    let mut groups: Vec<Vec<(usize, usize)>> = vec![Vec::new(); d.n_experts];
    for t in 0..rows {
        for j in 0..k {
            groups[route.ids[t * k + j] as usize].push((t, j));
        }
    }
    // Per-slot results so the final sum runs in slot order, like the decode path.
    let mut per_slot = vec![0.0f32; rows * k * h];
    for (e, members) in groups.iter().enumerate() {
        if members.is_empty() {
            continue;
        }
        let mut xe = Vec::with_capacity(members.len() * h);
        for &(t, _) in members {
            xe.extend_from_slice(&x[t * h..][..h]);
        }
        let ye = expert_mlp(&xe, members.len(), e, gate, up, down);
        for (i, &(t, j)) in members.iter().enumerate() {
            per_slot[(t * k + j) * h..][..h].copy_from_slice(&ye[i * h..][..h]);
        }
    }
    for t in 0..rows {
        let o = &mut out[t * h..][..h];
        o.iter_mut().for_each(|v| *v = 0.0);
        for j in 0..k {
            let w = route.weights[t * k + j];
            for (a, &b) in o.iter_mut().zip(&per_slot[(t * k + j) * h..][..h]) {
                *a += w * b;
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub fn moe_experts_decode(
    x: &[f32],
    route: &Route,
    gate: &HostLinear,
    up: &HostLinear,
    down: &HostLinear,
    d: &Dims,
    out: &mut [f32],
) {
    let (h, k) = (d.hidden, route.k);
    let ys: Vec<Vec<f32>> = (0..k)
        .into_par_iter()
        .map(|j| expert_mlp(&x[..h], 1, route.ids[j] as usize, gate, up, down))
        .collect();
    let o = &mut out[..h];
    o.iter_mut().for_each(|v| *v = 0.0);
    for (j, y) in ys.iter().enumerate() {
        let w = route.weights[j];
        for (a, &b) in o.iter_mut().zip(y) {
            *a += w * b;
        }
    }
}
