//! wgpu gdn ops against the CPU (a module of wgpu_ops.rs; its header states the tolerances): the
//! causal conv over prefill blocks and steps, and the gated delta rule over a prefill then decode
//! steps, each side carrying its own conv and recurrent states.

use super::*;
use lily::backend::{Dims, GdnParams};

/// The conv: prefill blocks (more rows than an invocation's block, fewer rows than the state
/// holds) and steps, the state carried; the outputs (F32_TOL per row: K products summed) and the
/// state (EXACT: copies of input rows) after each call.
fn conv_case(g: &Wgpu, d: &Dims, rng: &mut Rng, blocks: &[usize]) {
    let c = d.conv_channels();
    let w = rng.vec(c * d.conv_kernel, 0.5);
    let gw = g.upload_vec(&w).unwrap();
    let mut cst = rng.vec((d.conv_kernel - 1) * c, 1.0);
    let mut gst = g.upload(&cst).unwrap();
    for &rows in blocks {
        let x = rng.vec(rows * c, 1.0);
        let mut co = vec![0f32; rows * c];
        let mut go = g.zeros(rows * c).unwrap();
        let gx = g.upload(&x).unwrap();
        let kind = if rows == 1 { "step" } else { "prefill" };
        if rows == 1 {
            Cpu.conv1d_step(&x, &w, &mut cst, d, &mut co);
            g.conv1d_step(&gx, &gw, &mut gst, d, &mut go);
        } else {
            Cpu.conv1d_prefill(&x, &w, &mut cst, d, rows, &mut co);
            g.conv1d_prefill(&gx, &gw, &mut gst, d, rows, &mut go);
        }
        check(
            &format!("conv1d_{kind} C {c} K {} {rows} rows (out)", d.conv_kernel),
            rel_rows(&h(g, &go, rows * c), &co, c),
            F32_TOL,
        );
        check(
            &format!(
                "conv1d_{kind} C {c} K {} {rows} rows (state)",
                d.conv_kernel
            ),
            rel_rows(&h(g, &gst, cst.len()), &cst, c),
            EXACT,
        );
    }
}

#[test]
fn conv1d_prefill_then_steps() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(51);
    let d = qwen_dims();
    conv_case(&g, &d, &mut rng, &[50, 1, 1, 2, 1, 17, 513, 1]);
    // An odd channel count (a partial workgroup) and a longer kernel than the row block.
    let mut d = qwen_dims();
    (d.gdn_k_heads, d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim) = (1, 3, 5, 7);
    d.conv_kernel = 11;
    conv_case(&g, &d, &mut rng, &[3, 1, 25, 1, 12]);
}

/// The gated delta rule: blocks of rows (prefill, or a decode step for 1), the f32 state carried
/// by each side; the output per token (F32_TOL over the token's Hv·Dv: a head whose y = S·q
/// nearly cancels is scaled up by its RMS norm, where f32 itself is ill-conditioned, so the row is
/// the token's) and the state per value head (F32_TOL) after each call. The inputs are the same
/// on both sides each call and nothing is fed back, so nothing compounds.
fn gdn_case(g: &Wgpu, d: &Dims, rng: &mut Rng, blocks: &[usize]) {
    let c = d.conv_channels();
    let (hv, dv, dk) = (d.gdn_v_heads, d.gdn_v_dim, d.gdn_k_dim);
    let a_log: Vec<f32> = (0..hv)
        .map(|_| (1.0 + 7.5 * (rng.f() + 1.0)).ln())
        .collect();
    let dt_bias: Vec<f32> = (0..hv).map(|_| rng.f()).collect();
    let norm: Vec<f32> = (0..dv).map(|_| 1.0 + 0.1 * rng.f()).collect();
    let cp = GdnParams {
        a_log: a_log.clone(),
        dt_bias: dt_bias.clone(),
        norm: norm.clone(),
    };
    let gp = GdnParams {
        a_log: g.upload_vec(&a_log).unwrap(),
        dt_bias: g.upload_vec(&dt_bias).unwrap(),
        norm: g.upload_vec(&norm).unwrap(),
    };
    let mut cs = rng.vec(hv * dv * dk, 0.05);
    let mut gs = g.upload(&cs).unwrap();
    for (call, &rows) in blocks.iter().enumerate() {
        let qkv = rng.vec(rows * c, 1.0);
        let z = rng.vec(rows * hv * dv, 1.0);
        let b = rng.vec(rows * hv, 1.5);
        let a = rng.vec(rows * hv, 1.5);
        let mut co = vec![0f32; rows * hv * dv];
        let mut go = g.zeros(rows * hv * dv).unwrap();
        let (gqkv, gz, gb, ga) = (
            g.upload(&qkv).unwrap(),
            g.upload(&z).unwrap(),
            g.upload(&b).unwrap(),
            g.upload(&a).unwrap(),
        );
        let kind = if rows == 1 {
            Cpu.gdn_decode(&qkv, &z, &b, &a, &cp, &mut cs, d, &mut co);
            g.gdn_decode(&gqkv, &gz, &gb, &ga, &gp, &mut gs, d, &mut go);
            "gdn_decode"
        } else {
            Cpu.gdn_prefill(&qkv, &z, &b, &a, &cp, &mut cs, d, rows, &mut co);
            g.gdn_prefill(&gqkv, &gz, &gb, &ga, &gp, &mut gs, d, rows, &mut go);
            "gdn_prefill"
        };
        let shape = format!("Hk {} Hv {hv} Dk {dk} Dv {dv}", d.gdn_k_heads);
        check(
            &format!("{kind} {shape} call {call}, {rows} rows (out)"),
            rel_rows(&h(g, &go, co.len()), &co, hv * dv),
            F32_TOL,
        );
        check(
            &format!("{kind} {shape} call {call}, {rows} rows (state)"),
            rel_rows(&h(g, &gs, cs.len()), &cs, dv * dk),
            F32_TOL,
        );
    }
}

/// Blocks that take each path of gdn.rs (with subgroups: gdn_step_sg below PREP_MIN_ROWS = 64
/// rows, gdn_prep + gdn_scan_sg from it; else gdn_recur), decode steps between them, the state
/// carried through all of them.
const QWEN_BLOCKS: &[usize] = &[
    40, 1, 1, 1, 1, 1, 1, 1, 1, 7, 1, 1, 1, 512, 1, 63, 64, 1, 65, 2, 200, 1, 1,
];

/// The subgroup path (opt-in: `LILY_WGPU_GDN_FAST=1`, set only while this test's device opens;
/// a device another test opens meanwhile takes it too and must pass as well).
#[test]
fn gdn_prefill_then_decode() {
    std::env::set_var("LILY_WGPU_GDN_FAST", "1");
    let g = gpu();
    std::env::remove_var("LILY_WGPU_GDN_FAST");
    let Some(g) = g else { return };
    let mut rng = Rng(52);
    let d = qwen_dims();
    gdn_case(&g, &d, &mut rng, QWEN_BLOCKS);
    // Dims that fill neither a workgroup's rows (gdn_recur 32, gdn_sg 16) nor the 128 elements
    // of a row: Dv = 40 (the last slice partial), Dk = 60 (the last column pairs empty), 3 value
    // heads a key head; blocks on both sides of the pre-pass.
    let mut d = qwen_dims();
    (d.gdn_k_heads, d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim) = (2, 6, 60, 40);
    gdn_case(&g, &d, &mut rng, &[9, 1, 1, 3, 1, 70, 1, 64, 1]);
    // More q/k vectors than gdn_prep's workgroup covers at once (2 · 20 > 32), small heads.
    let mut d = qwen_dims();
    (d.gdn_k_heads, d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim) = (20, 40, 16, 8);
    gdn_case(&g, &d, &mut rng, &[100, 1, 5, 1]);
    // An odd Dk (no column pairs): gdn_recur on every adapter.
    let mut d = qwen_dims();
    (d.gdn_k_heads, d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim) = (2, 4, 61, 24);
    gdn_case(&g, &d, &mut rng, &[66, 1, 3, 1]);
}

/// The default path, gdn_recur (workgroup memory), at the real shape and a ragged one.
#[test]
fn gdn_fallback_prefill_then_decode() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(53);
    gdn_case(&g, &qwen_dims(), &mut rng, &[40, 1, 1, 100, 1, 1]);
    let mut d = qwen_dims();
    (d.gdn_k_heads, d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim) = (2, 6, 60, 40);
    gdn_case(&g, &d, &mut rng, &[9, 1, 70, 1]);
}

#[test]
fn gdn_bad_shapes_are_errors() {
    let Some(g) = gpu() else { return };
    let d = qwen_dims();
    let c = d.conv_channels();
    let (hv, dv, dk) = (d.gdn_v_heads, d.gdn_v_dim, d.gdn_k_dim);
    let w = g.zeros(c * d.conv_kernel).unwrap();
    // conv: x shorter than rows × C, then a state shorter than K-1 rows.
    let x = g.zeros(3 * c - 1).unwrap();
    let mut st = g.zeros((d.conv_kernel - 1) * c).unwrap();
    let mut o = g.zeros(3 * c).unwrap();
    g.conv1d_prefill(&x, &w, &mut st, &d, 3, &mut o);
    let e = g.sync().expect_err("a conv over more rows than x holds");
    assert!(e.to_string().contains("conv1d"), "{e}");
    let x1 = g.zeros(c).unwrap();
    let mut st_small = g.zeros(c).unwrap();
    g.conv1d_step(&x1, &w, &mut st_small, &d, &mut o);
    let e = g.sync().expect_err("a conv state of one row");
    assert!(e.to_string().contains("conv1d"), "{e}");
    // gated delta: a state one element short, then value heads not a multiple of key heads.
    let p = GdnParams {
        a_log: g.zeros(hv).unwrap(),
        dt_bias: g.zeros(hv).unwrap(),
        norm: g.zeros(dv).unwrap(),
    };
    let (qkv, z, b, a) = (
        g.zeros(c).unwrap(),
        g.zeros(hv * dv).unwrap(),
        g.zeros(hv).unwrap(),
        g.zeros(hv).unwrap(),
    );
    let mut s = g.zeros(hv * dv * dk - 1).unwrap();
    let mut y = g.zeros(hv * dv).unwrap();
    g.gdn_decode(&qkv, &z, &b, &a, &p, &mut s, &d, &mut y);
    let e = g.sync().expect_err("a recurrent state too small");
    assert!(e.to_string().contains("gated_delta"), "{e}");
    let mut d2 = qwen_dims();
    d2.gdn_k_heads = 12;
    let mut s = g.zeros(hv * dv * dk).unwrap();
    g.gdn_decode(&qkv, &z, &b, &a, &p, &mut s, &d2, &mut y);
    let e = g.sync().expect_err("32 value heads over 12 key heads");
    assert!(e.to_string().contains("gated_delta"), "{e}");
    // The backend goes on working.
    g.gdn_decode(&qkv, &z, &b, &a, &p, &mut s, &d, &mut y);
    g.sync().expect("a valid step after the errors");
}
