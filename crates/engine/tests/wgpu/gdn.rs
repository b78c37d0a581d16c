//! wgpu gdn ops against the CPU (a module of wgpu_ops.rs; its header states the tolerances): the
//! causal conv over prefill blocks and steps, and the gated delta rule over a prefill then decode
//! steps, each side carrying its own conv and recurrent states.

use super::*;
use lily::backend::{Dims, GdnParams};
use lily::loader::tensor::HostLinear;

type WB = <Wgpu as Backend>::Buf;
type WM = <Wgpu as Backend>::Mat;

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

/// The default path, gdn_recur (workgroup memory) for blocks, at the real shape and ragged ones;
/// the decode steps by each `LILY_WGPU_GDN_STEP` recurrence: `0` gdn_recur, `y` gdn_step_y
/// (shuffles where the adapter has ordered subgroups of ≥ 8 lanes: lavapipe's 8), `yw`
/// gdn_step_y with its row sums in workgroup memory. Ragged: Dv = 40 (gdn_step_y's second
/// slice of a head partial), Dk = 60 (its last vec4 columns empty: 15 of 32), 3 value heads a
/// key head; Dk = 16, Dv = 8 (most of a thread's columns and a workgroup's rows empty); an odd
/// Dk (gdn_recur whatever the switch).
#[test]
fn gdn_fallback_prefill_then_decode() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(53);
    for step in ["0", "y", "yw"] {
        eprintln!("LILY_WGPU_GDN_STEP={step}");
        g.set_gdn_step(step).unwrap();
        gdn_case(&g, &qwen_dims(), &mut rng, &[40, 1, 1, 100, 1, 1]);
        let mut d = qwen_dims();
        (d.gdn_k_heads, d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim) = (2, 6, 60, 40);
        gdn_case(&g, &d, &mut rng, &[9, 1, 70, 1, 1]);
        let mut d = qwen_dims();
        (d.gdn_k_heads, d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim) = (20, 40, 16, 8);
        gdn_case(&g, &d, &mut rng, &[5, 1, 1]);
        let mut d = qwen_dims();
        (d.gdn_k_heads, d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim) = (2, 4, 61, 24);
        gdn_case(&g, &d, &mut rng, &[3, 1]);
    }
    g.set_gdn_step("x").unwrap();
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

/// One token's GDN mixer (`gdn_mixer_decode_add`) at the real shapes, three tokens, against the
/// CPU: by default the conv runs in in_proj's epilogue (gemv_q6's omode 3), which leaves the raw
/// projection scratch `qkv` unwritten, and the gated norm in out_proj's staging of x (xq.wgsl
/// xmode 3), which leaves `y` un-normed (both asserted, so the fused paths are known to have
/// run); with gemv_v5 the composition. Each token's CPU reference starts from the wgpu side's own h and
/// states, so errors do not compound. Q2X_TOL on everything: in_proj's and out_proj's x is in two
/// int8 levels (Q2X_TOL's note); the conv state holds in_proj's raw outputs, the recurrent state
/// and h's update are linear in them up to the l2 and RMS norms (which do not amplify a relative
/// error), measured 3e-5 to 5e-4 on lavapipe.
#[test]
fn gdn_mixer_step_with_the_conv_and_the_norm_fused() {
    let Some(g) = gpu() else { return };
    mixer_case(&g, &qwen_dims(), &mut Rng(54));
    // A ragged shape gdn_step_x still takes: Dv = 64 (two of a thread's 4 rows empty, a head of
    // two 4-bit words: 8 staging threads), Dk = 60, 3 value heads a key head.
    let mut d = qwen_dims();
    (d.gdn_k_heads, d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim) = (2, 6, 60, 64);
    mixer_case(&g, &d, &mut Rng(55));
}

/// The GDN mixer's weights at shape d on the host: in_proj's four matrices, out_proj, the conv's
/// weights, the layer's parameters and the input norm's weights.
struct MixerHost {
    mats: Vec<HostLinear>,
    outp: HostLinear,
    conv_w: Vec<f32>,
    cp: GdnParams<Vec<f32>>,
    in_norm: Vec<f32>,
}

fn mixer_host(d: &Dims, rng: &mut Rng) -> MixerHost {
    let (hid, c) = (d.hidden, d.conv_channels());
    let (hv, dv) = (d.gdn_v_heads, d.gdn_v_dim);
    let mats = [c, hv * dv, hv, hv]
        .iter()
        .map(|&o| rand_quant(rng, 1, o, hid, 4, 64, false))
        .collect();
    let outp = rand_quant(rng, 1, hid, hv * dv, 4, 64, false);
    let conv_w = rng.vec(c * d.conv_kernel, 0.5);
    let a_log: Vec<f32> = (0..hv)
        .map(|_| (1.0 + 7.5 * (rng.f() + 1.0)).ln())
        .collect();
    let cp = GdnParams {
        a_log,
        dt_bias: (0..hv).map(|_| rng.f()).collect(),
        norm: (0..dv).map(|_| 1.0 + 0.1 * rng.f()).collect(),
    };
    let in_norm = (0..hid).map(|_| 1.0 + 0.1 * rng.f()).collect();
    MixerHost {
        mats,
        outp,
        conv_w,
        cp,
        in_norm,
    }
}

/// `MixerHost` on the device: in_proj's matrices, out_proj, the conv's weights, the parameters,
/// the input norm's weights.
type MixerDev = (Vec<WM>, WM, WB, GdnParams<WB>, WB);

fn mixer_upload(g: &Wgpu, m: &MixerHost) -> MixerDev {
    (
        m.mats.iter().map(|w| g.upload_mat(w).unwrap()).collect(),
        g.upload_mat(&m.outp).unwrap(),
        g.upload_vec(&m.conv_w).unwrap(),
        GdnParams {
            a_log: g.upload_vec(&m.cp.a_log).unwrap(),
            dt_bias: g.upload_vec(&m.cp.dt_bias).unwrap(),
            norm: g.upload_vec(&m.cp.norm).unwrap(),
        },
        g.upload_vec(&m.in_norm).unwrap(),
    )
}

/// One token's `gdn_mixer_decode_add` on the device from fresh zeroed scratch, returned.
#[allow(clippy::too_many_arguments)]
fn gpu_mixer_token(
    g: &Wgpu,
    d: &Dims,
    gh: &mut WB,
    gnorm: &WB,
    gw: &lily::backend::GdnWeights<'_, Wgpu>,
    gconv: &mut WB,
    gssm: &mut WB,
) -> GdnTmp<Wgpu> {
    let mut s = GdnTmp::new(g, d);
    g.gdn_mixer_decode_add(gh, gnorm, d.eps, gw, gconv, gssm, d, s.tmp());
    s
}

/// `gdn_mixer_decode_add` at shape d, by each path: v6 with `LILY_WGPU_GDN_STEP` x (gdn_step_x:
/// the recurrence, the gated norm and out_proj's x staged in one launch, `y` never written,
/// asserted), xs (gdn_step_xs: Dv / 32 workgroups a head, the gated norm's 1 / rms applied by
/// out_proj's gemv_q6s; y not written either), y (gdn_step_y then q2x_stage's xmode 3) and 0
/// (gdn_recur then xmode 3); v5's composition. Lavapipe, xs against x at the model's shape:
/// h's update 0.8-1.2e-4 against 0.8-1.2e-4 (Q2X_TOL); without the heads' 1 / rms, 0.99.
fn mixer_case(g: &Wgpu, d: &Dims, rng: &mut Rng) {
    let (hid, c) = (d.hidden, d.conv_channels());
    let (hv, dv, dk) = (d.gdn_v_heads, d.gdn_v_dim, d.gdn_k_dim);
    let host = mixer_host(d, rng);
    let MixerHost {
        mats,
        outp,
        conv_w,
        cp,
        in_norm,
    } = &host;
    let h0 = rng.vec(hid, 4.0);
    let conv0 = rng.vec((d.conv_kernel - 1) * c, 1.0);
    let ssm0 = rng.vec(hv * dv * dk, 0.05);
    // The CPU's side: its own weights (the same values).
    let cm: Vec<_> = mats.iter().map(|m| Cpu.upload_mat(m).unwrap()).collect();
    let cout = Cpu.upload_mat(outp).unwrap();
    let cw = lily::backend::GdnWeights {
        in_proj: [&cm[0], &cm[1], &cm[2], &cm[3]],
        conv1d: conv_w,
        params: cp,
        out_proj: &cout,
        route_ahead: None,
        x_ahead: false,
    };
    let (gm, gout, gconv_w, gp, gnorm) = mixer_upload(g, &host);
    let gw = lily::backend::GdnWeights {
        in_proj: [&gm[0], &gm[1], &gm[2], &gm[3]],
        conv1d: &gconv_w,
        params: &gp,
        out_proj: &gout,
        route_ahead: None,
        x_ahead: false,
    };
    let paths = [
        ("conv in in_proj, gdn_step_x", "v6", "x"),
        ("conv in in_proj, gdn_step_xs", "v6", "xs"),
        ("conv in in_proj, gdn_step_y", "v6", "y"),
        ("conv in in_proj, gdn_recur", "v6", "0"),
        ("composition", "v5", "x"),
    ];
    for (path, gemv, step) in paths {
        g.set_gemv(gemv).unwrap();
        g.set_gdn_step(step).unwrap();
        let (mut gh, mut gconv, mut gssm) = (
            g.upload(&h0).unwrap(),
            g.upload(&conv0).unwrap(),
            g.upload(&ssm0).unwrap(),
        );
        for tok in 0..3 {
            let (hb, convb, ssmb) = (
                h(&g, &gh, hid),
                h(&g, &gconv, conv0.len()),
                h(&g, &gssm, ssm0.len()),
            );
            let s = gpu_mixer_token(g, d, &mut gh, &gnorm, &gw, &mut gconv, &mut gssm);
            let raw = h(&g, &s.qkv, c);
            if gemv != "v5" {
                assert!(
                    raw.iter().all(|&v| v == 0.0),
                    "gdn mixer ({path}): in_proj's raw output was written: the conv did not run \
                     in its epilogue"
                );
            }
            let (mut ch, mut cconv, mut cssm) = (hb.clone(), convb, ssmb);
            let mut cs = GdnTmp::new(&Cpu, d);
            Cpu.gdn_mixer_decode_add(
                &mut ch,
                in_norm,
                d.eps,
                &cw,
                &mut cconv,
                &mut cssm,
                d,
                cs.tmp(),
            );
            if gemv != "v5" && (step == "x" || step == "xs") {
                assert!(
                    h(&g, &s.y, hv * dv).iter().all(|&v| v == 0.0),
                    "gdn mixer ({path}): y was written: gdn_step_x did not stage out_proj's x"
                );
            } else if gemv != "v5" {
                // The gated norm ran in out_proj's staging: y is the recurrence's, not normed.
                let e = rel_rows(&h(&g, &s.y, hv * dv), &cs.y, hv * dv);
                assert!(
                    e > 0.1,
                    "gdn mixer ({path}): y is the normed one (rel {e:e}): the gated norm did not \
                     run in out_proj's staging"
                );
            }
            let upd = |v: &[f32]| -> Vec<f32> { v.iter().zip(&hb).map(|(a, b)| a - b).collect() };
            check(
                &format!("gdn mixer ({path}) token {tok}: h's update"),
                rel_rows(&upd(&h(&g, &gh, hid)), &upd(&ch), hid),
                Q2X_TOL,
            );
            check(
                &format!("gdn mixer ({path}) token {tok}: conv state"),
                rel_rows(&h(&g, &gconv, cconv.len()), &cconv, c),
                Q2X_TOL,
            );
            check(
                &format!("gdn mixer ({path}) token {tok}: recurrent state"),
                rel_rows(&h(&g, &gssm, cssm.len()), &cssm, dv * dk),
                Q2X_TOL,
            );
        }
    }
    g.set_gemv("v6").unwrap();
    g.set_gdn_step("x").unwrap();
}

/// `LILY_WGPU_SPEC` (the default `all`; `Wgpu::set_spec`): the GDN mixer's decode step with every
/// specialised kernel on (`all`: gdn_step_x / gdn_step_y with the heads' counts and sizes as
/// pipeline constants, in_proj's and out_proj's gemv_q6s and q2x_stage) against the same device
/// with none, two tokens from the same states: h, the conv state and the recurrent state must be
/// the same bits (the same arithmetic), at the real shapes and at the ragged one above, through
/// gdn_step_x and gdn_step_y.
#[test]
fn gdn_mixer_specialised_equals_the_mixer() {
    let Some(g) = gpu() else { return };
    let mut ragged = qwen_dims();
    (
        ragged.gdn_k_heads,
        ragged.gdn_v_heads,
        ragged.gdn_k_dim,
        ragged.gdn_v_dim,
    ) = (2, 6, 60, 64);
    for (d, seed) in [(qwen_dims(), 56), (ragged, 57)] {
        let mut rng = Rng(seed);
        let (hid, c) = (d.hidden, d.conv_channels());
        let (hv, dv, dk) = (d.gdn_v_heads, d.gdn_v_dim, d.gdn_k_dim);
        let (gm, gout, gconv_w, gp, gnorm) = mixer_upload(&g, &mixer_host(&d, &mut rng));
        let gw = lily::backend::GdnWeights {
            in_proj: [&gm[0], &gm[1], &gm[2], &gm[3]],
            conv1d: &gconv_w,
            params: &gp,
            out_proj: &gout,
            route_ahead: None,
            x_ahead: false,
        };
        let (h0, conv0, ssm0) = (
            rng.vec(hid, 4.0),
            rng.vec((d.conv_kernel - 1) * c, 1.0),
            rng.vec(hv * dv * dk, 0.05),
        );
        for step in ["x", "y"] {
            g.set_gdn_step(step).unwrap();
            let mut got = Vec::new();
            for spec in ["", "all"] {
                g.set_spec(spec).unwrap();
                let (mut gh, mut gconv, mut gssm) = (
                    g.upload(&h0).unwrap(),
                    g.upload(&conv0).unwrap(),
                    g.upload(&ssm0).unwrap(),
                );
                for _ in 0..2 {
                    gpu_mixer_token(&g, &d, &mut gh, &gnorm, &gw, &mut gconv, &mut gssm);
                }
                let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
                got.push([
                    bits(h(&g, &gh, hid)),
                    bits(h(&g, &gconv, conv0.len())),
                    bits(h(&g, &gssm, ssm0.len())),
                ]);
            }
            g.set_spec("").unwrap();
            for (i, what) in ["h", "the conv state", "the recurrent state"]
                .iter()
                .enumerate()
            {
                assert!(
                    got[0][i] == got[1][i],
                    "gdn mixer specialised (step {step}, {hv}×{dv} heads): {what} differs"
                );
            }
        }
        g.set_gdn_step("x").unwrap();
        eprintln!("gdn mixer specialised: {hv} value heads of {dv}, key {dk}: bit-equal");
    }
}
