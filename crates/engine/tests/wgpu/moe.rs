//! wgpu moe ops against the CPU (a module of wgpu_ops.rs; its header states the tolerances).
//!
//! Routing: the expert ids must equal the CPU's (same order, lower id first on ties), the weights
//! within 1e-6 absolute (both sides compute the softmax with the same expression and summation
//! order; the shader's exp is within an ulp or two of the host's).
//! Experts: `F32_TOL` per output row relative to the row's largest |value|. Both sides dequantize
//! the same codes in f32 and differ only in summation order and FMA contraction: each GEMV over
//! K ≤ 2560 is ~1e-7 relative of Σ|w·x|, silu(g)·u passes that on (silu's slope is below 1.1),
//! the down GEMV adds its own, and the slot sum runs in the same order on both sides. Measured on
//! lavapipe: 5e-7 to 2.8e-6 (the grouped GEMM over 300 rows the highest; 3.5× under the
//! tolerance), while a wrong expert, slot, group or weight moves outputs by O(1e-1). Below 64
//! rows, 4- and 8-bit gate|up take moe_gate_up_q (x in two int8 levels): `Q2X_TOL` there.

use super::*;
use lily::backend::cpu::moe::Route as CpuRoute;
use lily::backend::Dims;
use lily::loader::tensor::{HostLinear, LinearKind};

/// Routes `logits` on both sides; asserts equal ids and checks the weights. Returns both routes.
fn route_both(
    g: &Wgpu,
    logits: &[f32],
    d: &Dims,
    rows: usize,
    what: &str,
) -> (CpuRoute, <Wgpu as Backend>::Route) {
    let (e, k) = (d.n_experts, d.top_k);
    let mut cr = CpuRoute::default();
    Cpu.moe_route(&logits.to_vec(), d, rows, &mut cr);
    let mut gr = g.new_route(rows, k).unwrap();
    g.moe_route(&g.upload(logits).unwrap(), d, rows, &mut gr);
    let (ids, w) = g.route_to_host(&gr, rows).unwrap();
    g.sync().unwrap();
    let mismatched = ids.iter().zip(&cr.ids).filter(|(a, b)| a != b).count();
    println!(
        "moe_route {what} [{rows}, {e}] top-{k}: {mismatched} of {} ids differ",
        ids.len()
    );
    assert_eq!(ids, cr.ids, "moe_route {what}: expert ids differ");
    let werr = w
        .iter()
        .zip(&cr.weights)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    check(
        &format!("moe_route {what} [{rows}, {e}] top-{k} (weights, abs)"),
        werr,
        1e-6,
    );
    (cr, gr)
}

#[test]
fn moe_route_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let d = qwen_dims();
    let mut rng = Rng(61);
    let e = d.n_experts;
    for rows in [1usize, 7, 300] {
        let mut logits = rng.vec(rows * e, 3.0);
        // Expert 3 popular with every token.
        for t in 0..rows {
            logits[t * e + 3] += 8.0;
        }
        route_both(&g, &logits, &d, rows, "random");
    }
    // Ties: logits on a coarse grid (many exactly equal probabilities), and a row of zeros
    // (all equal: the route is experts 0..k, as the CPU's stable sort gives).
    let rows = 9;
    let mut logits: Vec<f32> = rng
        .vec(rows * e, 1.0)
        .iter()
        .map(|v| (v * 2.0).round() / 2.0)
        .collect();
    logits[..e].iter_mut().for_each(|v| *v = 0.0);
    let (cr, _) = route_both(&g, &logits, &d, rows, "ties");
    assert_eq!(cr.ids[..d.top_k], (0..d.top_k as u32).collect::<Vec<_>>());
    // Other shapes: fewer experts than a workgroup, more than one stride, no renormalisation.
    for (n_experts, top_k, norm_topk) in [(60usize, 4usize, false), (1000, 10, true), (5, 5, true)]
    {
        let dd = Dims {
            n_experts,
            top_k,
            norm_topk,
            ..d
        };
        let rows = 13;
        let logits = rng.vec(rows * n_experts, 2.0);
        route_both(&g, &logits, &dd, rows, "other shape");
    }
}

/// Experts on both sides for `rows` tokens: the CPU's decode (rows = 1) or prefill against the
/// wgpu op, each with its own route from the same logits (equal ids, checked first). Expert 3
/// gets `boost` added to every token's logit (100: every token's first choice).
#[allow(clippy::too_many_arguments)]
fn experts_case(
    g: &Wgpu,
    rng: &mut Rng,
    mats: [&HostLinear; 3],
    gmats: [&<Wgpu as Backend>::Mat; 3],
    d: &Dims,
    rows: usize,
    boost: f32,
    what: &str,
) {
    let hid = d.hidden;
    let mut logits = rng.vec(rows * d.n_experts, 3.0);
    for t in 0..rows {
        logits[t * d.n_experts + 3 % d.n_experts] += boost;
    }
    let (cr, gr) = route_both(g, &logits, d, rows, what);
    let x = rng.vec(rows * hid, 1.0);
    let mut c = vec![0f32; rows * hid];
    let [gate, up, down] = mats;
    let [gg, gu, gd] = gmats;
    let gx = g.upload(&x).unwrap();
    let mut go = g.zeros(rows * hid).unwrap();
    if rows == 1 {
        assert!(!Cpu.moe_experts_decode(&x, &cr, gate, up, down, None, d, &mut c));
        assert!(!g.moe_experts_decode(&gx, &gr, gg, gu, gd, None, d, &mut go));
    } else {
        Cpu.moe_experts_prefill(&x, &cr, gate, up, down, d, rows, &mut c);
        g.moe_experts_prefill(&gx, &gr, gg, gu, gd, d, rows, &mut go);
    }
    let got = h(g, &go, rows * hid);
    assert!(
        c.iter().any(|v| v.abs() > 1e-3),
        "{what}: the CPU output is all but zero"
    );
    // Below 64 rows, 4- and 8-bit gate|up in whole words take moe_gate_up_q: x in two int8
    // levels (Q2X_TOL).
    let q = rows < 64
        && match &mats[0].kind {
            LinearKind::Quant {
                bits, group_size, ..
            } => matches!(bits, 4 | 8) && group_size % (128 / *bits as usize) == 0,
            _ => false,
        };
    check(
        &format!(
            "moe_experts_{} {what} rows {rows}",
            if rows == 1 { "decode" } else { "prefill" }
        ),
        rel_rows(&got, &c, hid),
        if q { Q2X_TOL } else { F32_TOL },
    );
}

#[test]
fn moe_experts_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let d = qwen_dims();
    let mut rng = Rng(62);
    // The real stacks: 256 experts, gate/up [512, 2048], down [2048, 512], 4-bit, bf16 scales.
    let (e, hid, width) = (d.n_experts, d.hidden, 512);
    let gate = rand_quant(&mut rng, e, width, hid, 4, 64, false);
    let up = rand_quant(&mut rng, e, width, hid, 4, 64, false);
    let down = rand_quant(&mut rng, e, hid, width, 4, 64, false);
    let gm = [
        &g.upload_mat(&gate).unwrap(),
        &g.upload_mat(&up).unwrap(),
        &g.upload_mat(&down).unwrap(),
    ];
    // Decode and short blocks (a slot a workgroup; 17 · 8 · 64 = 69,632 moe_gate_up_v
    // workgroups, past the 65,535 of one dimension, folded into y; 63 the last below the GEMM),
    // then the grouped GEMM from 64 rows (300: tiles of 32 and partial ones, experts with no
    // rows).
    for rows in [1usize, 2, 3, 4, 5, 17, 33, 63, 64, 300] {
        experts_case(
            &g,
            &mut rng,
            [&gate, &up, &down],
            gm,
            &d,
            rows,
            8.0,
            "4-bit 256×[512, 2048]",
        );
    }
    // Top-1 with every token on expert 3 (one expert's 300 rows in 10 tiles, 255 experts with
    // none) and top-10 (moe_down_v's 6 outputs × 10 slots a workgroup).
    for (k, boost) in [(1usize, 100.0f32), (10, 8.0)] {
        let dk = Dims { top_k: k, ..d };
        for rows in [1usize, 3, 300] {
            experts_case(
                &g,
                &mut rng,
                [&gate, &up, &down],
                gm,
                &dk,
                rows,
                boost,
                &format!("4-bit 256×[512, 2048] top-{k}"),
            );
        }
    }
    // Other formats and shapes: 8-bit with f32 scales over hidden 2560 (x staged in two chunks),
    // 2-bit with bf16 scales over width 2560 (moe_down_v's act staged in two chunks, the first
    // versions' too), top-3 without renormalisation; 4-bit in groups of 16 at width 48, which
    // neither fast path takes (groups split a vec4 of codes; no whole tile of 64 outputs): the
    // first versions.
    let cases = [
        (8u32, 32usize, true, 16, 2560, 64, 3, false),
        (2, 64, false, 10, 128, 2560, 4, true),
        (4, 16, false, 12, 256, 48, 4, true),
    ];
    for (bits, gs, f32s, n, hid, width, k, norm) in cases {
        let dd = Dims {
            hidden: hid,
            n_experts: n,
            top_k: k,
            norm_topk: norm,
            ..d
        };
        let gate = rand_quant(&mut rng, n, width, hid, bits, gs, f32s);
        let up = rand_quant(&mut rng, n, width, hid, bits, gs, f32s);
        let down = rand_quant(&mut rng, n, hid, width, bits, gs, f32s);
        let gm = [
            &g.upload_mat(&gate).unwrap(),
            &g.upload_mat(&up).unwrap(),
            &g.upload_mat(&down).unwrap(),
        ];
        let what = format!(
            "{bits}-bit g{gs}{} {n}×[{width}, {hid}]",
            if f32s { " f32 scales" } else { "" }
        );
        for rows in [1usize, 6, 70] {
            experts_case(&g, &mut rng, [&gate, &up, &down], gm, &dd, rows, 8.0, &what);
        }
    }
}

#[test]
fn moe_bad_shapes_and_ids_are_errors_not_crashes() {
    let Some(g) = gpu() else { return };
    let d = qwen_dims();
    let mut rng = Rng(63);
    // Logits shorter than rows · experts.
    let mut gr = g.new_route(4, d.top_k).unwrap();
    g.moe_route(&g.zeros(100).unwrap(), &d, 4, &mut gr);
    let err = g.sync().expect_err("moe_route over too few logits");
    assert!(err.to_string().contains("moe_route"), "{err}");
    // A route of another k.
    let mut gr3 = g.new_route(1, 3).unwrap();
    g.moe_route(&g.zeros(d.n_experts).unwrap(), &d, 1, &mut gr3);
    assert!(g.sync().is_err(), "a route of top-3 for a top-8 router");

    // Small stacks of 16 experts.
    let (n, hid, width) = (16usize, 128usize, 64usize);
    let dd = Dims {
        hidden: hid,
        n_experts: n,
        ..d
    };
    let gate = rand_quant(&mut rng, n, width, hid, 4, 64, false);
    let up = rand_quant(&mut rng, n, width, hid, 4, 64, false);
    let down = rand_quant(&mut rng, n, hid, width, 4, 64, false);
    let (gg, gu, gd) = (
        g.upload_mat(&gate).unwrap(),
        g.upload_mat(&up).unwrap(),
        g.upload_mat(&down).unwrap(),
    );
    let gx = g.upload(&rng.vec(2 * hid, 1.0)).unwrap();
    // out too small.
    let mut route = g.new_route(2, d.top_k).unwrap();
    g.moe_route(&g.upload(&rng.vec(2 * n, 1.0)).unwrap(), &dd, 2, &mut route);
    let mut small = g.zeros(hid).unwrap();
    g.moe_experts_prefill(&gx, &route, &gg, &gu, &gd, &dd, 2, &mut small);
    let err = g.sync().expect_err("experts into too small an output");
    assert!(err.to_string().contains("moe_experts"), "{err}");
    // Stacks that disagree (up as down).
    let mut o = g.zeros(2 * hid).unwrap();
    g.moe_experts_prefill(&gx, &route, &gg, &gu, &gu, &dd, 2, &mut o);
    assert!(g.sync().is_err(), "down of the wrong shape");
    // Ids past the stack (a route over 256 experts with stacks of 16): the host cannot see them;
    // the shaders clamp them, so nothing is read out of bounds and the output stays finite.
    let mut wide = g.new_route(2, d.top_k).unwrap();
    let mut logits = rng.vec(2 * d.n_experts, 1.0);
    logits[200] += 20.0;
    logits[d.n_experts + 255] += 20.0;
    g.moe_route(&g.upload(&logits).unwrap(), &d, 2, &mut wide);
    let (ids, _) = g.route_to_host(&wide, 2).unwrap();
    assert!(ids.iter().any(|&i| i as usize >= n));
    g.moe_experts_prefill(&gx, &wide, &gg, &gu, &gd, &dd, 2, &mut o);
    let out = h(&g, &o, 2 * hid);
    assert!(out.iter().all(|v| v.is_finite()));
    // The backend goes on working after the errors.
    g.moe_experts_prefill(&gx, &route, &gg, &gu, &gd, &dd, 2, &mut o);
    g.sync().expect("a valid op after the errors");
}

/// Prefill's grouped expert GEMMs both ways (`Wgpu::set_moe_mm`, LILY_WGPU_MOE_MM): moe_mm.wgsl's
/// 8 × 8 entries (`mm8`, the default) and moe.wgsl's moe_gate_up_mm / moe_down_mm (`old`), at
/// the model's expert shapes with 32 experts (lavapipe time; the 256 of the model are
/// moe_experts_match_the_cpu's): 4-bit, 64 rows top-8 (~16 slots an expert: tiles of ≤ 16
/// rows, which skip their upper half, and of 17-32), 300 rows (full tiles and partial ones),
/// top-1 with 300 rows on one expert (9 full tiles and one of 12); and 8-bit codes with f32
/// scales in groups of 32 at hidden 512, width 256. F32_TOL as the header says (one f32 chain
/// a dot product on both sides, K ≤ 2048).
#[test]
fn moe_grouped_gemms_both_ways() {
    let d = Dims {
        n_experts: 32,
        ..qwen_dims()
    };
    let mut rng = Rng(63);
    let (e, hid, width) = (d.n_experts, d.hidden, 512);
    let gate = rand_quant(&mut rng, e, width, hid, 4, 64, false);
    let up = rand_quant(&mut rng, e, width, hid, 4, 64, false);
    let down = rand_quant(&mut rng, e, hid, width, 4, 64, false);
    let d8 = Dims {
        hidden: 512,
        n_experts: 16,
        top_k: 3,
        ..d
    };
    let gate8 = rand_quant(&mut rng, 16, 256, 512, 8, 32, true);
    let up8 = rand_quant(&mut rng, 16, 256, 512, 8, 32, true);
    let down8 = rand_quant(&mut rng, 16, 512, 256, 8, 32, true);
    for v in ["mm8", "old"] {
        let Some(g) = gpu() else { return };
        g.set_moe_mm(v).unwrap();
        let gm = [
            &g.upload_mat(&gate).unwrap(),
            &g.upload_mat(&up).unwrap(),
            &g.upload_mat(&down).unwrap(),
        ];
        let mats = [&gate, &up, &down];
        let what = format!("{v} 4-bit 32×[512, 2048]");
        for rows in [64usize, 300] {
            experts_case(&g, &mut rng, mats, gm, &d, rows, 8.0, &what);
        }
        let d1 = Dims { top_k: 1, ..d };
        experts_case(
            &g,
            &mut rng,
            mats,
            gm,
            &d1,
            300,
            100.0,
            &format!("{what} top-1"),
        );
        let gm8 = [
            &g.upload_mat(&gate8).unwrap(),
            &g.upload_mat(&up8).unwrap(),
            &g.upload_mat(&down8).unwrap(),
        ];
        let what8 = format!("{v} 8-bit g32 f32 scales 16×[256, 512]");
        experts_case(
            &g,
            &mut rng,
            [&gate8, &up8, &down8],
            gm8,
            &d8,
            100,
            8.0,
            &what8,
        );
    }
}
