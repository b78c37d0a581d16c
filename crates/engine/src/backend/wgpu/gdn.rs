//! Gated DeltaNet: the causal conv and the gated delta rule (shaders/gdn.wgsl, and
//! shaders/gdn_sg.wgsl where the adapter has subgroups; cpu/gdn.rs is the twin). Prefill and
//! decode share these entry points (rows = 1 for a step).
//!
//! The recurrence's launches: gdn_recur by default; opt-in (`LILY_WGPU_GDN_FAST=1`, measured
//! slower on the H200) and with subgroups (`fast`), blocks of PREP_MIN_ROWS rows or more run
//! gdn_prep (q/k norms and gates for every token at once) then gdn_scan_sg; shorter blocks and
//! decode steps run gdn_step_sg alone (the same scan with the norms and gates inline: a step is
//! one token, so a pre-pass would only add a launch to its latency). gdn_norm follows each.
//!
//! A decode step (rows = 1) takes gdn_step.wgsl instead (`LILY_WGPU_GDN_STEP`, device.rs
//! `Switches::gdn_step`; `0` brings gdn_recur back): gdn_step_y in gdn_recur's place (every load
//! issued up front, 8 threads a row, no barrier where the adapter has subgroups), and in the
//! step's GDN mixer gdn_step_x (`gated_delta_x`: a head a workgroup, the recurrence, the gated
//! norm and out_proj's x staged for gemv_q6 in one launch).

use std::sync::atomic::Ordering;

use super::device::{Ctx, Shader};
use super::{fits, WBuf};
use crate::backend::{Dims, GdnParams};

pub const SHADER: Shader = Shader {
    name: "gdn",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/gdn.wgsl")
    ),
};

/// The subgroup recurrence (shaders/gdn_sg.wgsl), with gdn.wgsl's declarations before it; a
/// module of its own, made only where the adapter has SUBGROUP (`fast`): wgpu rejects a module
/// using subgroup builtins on a device without the feature. (No `enable subgroups;`: naga 30
/// has the builtins behind the device feature and rejects the directive as unimplemented.)
pub const SHADER_SG: Shader = Shader {
    name: "gdn_sg",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/gdn.wgsl"),
        include_str!("shaders/gdn_sg.wgsl")
    ),
};

/// gdn_step.wgsl's gdn_step_y with its row sums (`gs_rows`: the sum of v over the 8
/// invocations of li's row group, the same bits on all 8) through workgroup memory, two
/// barriers a sum, in the shuffles' order (any adapter). gdn.wgsl comes first for its
/// `softplus_g`.
pub const STEP_SHADER: Shader = Shader {
    name: "gdn_step",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/gdn.wgsl"),
        "
var<workgroup> gs_red: array<vec4<f32>, 256>;

fn gs_rows(v: vec4<f32>, li: u32) -> vec4<f32> {
    gs_red[li] = v;
    workgroupBarrier();
    let g = li & ~7u;
    let s = ((gs_red[g] + gs_red[g + 4u]) + (gs_red[g + 2u] + gs_red[g + 6u]))
        + ((gs_red[g + 1u] + gs_red[g + 5u]) + (gs_red[g + 3u] + gs_red[g + 7u]));
    workgroupBarrier();
    return s;
}
",
        include_str!("shaders/gdn_step.wgsl")
    ),
};

/// The subgroup module: gdn_step.wgsl with the row sums by a butterfly of shuffles (a row group
/// is 8 consecutive lanes of one subgroup; lane 0 adds ((v0 + v4) + (v2 + v6)) + ((v1 + v5) +
/// (v3 + v7)), as `STEP_SHADER`'s), and gdn_step_x.wgsl (the gated norm and out_proj's staging
/// of x, through xq.wgsl's `xq_put`). Made only where the adapter has ordered subgroups of ≥ 8
/// lanes (`step_sg`): wgpu rejects a module with subgroup builtins on a device without them.
pub const STEP_SG_SHADER: Shader = Shader {
    name: "gdn_step_sg",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/q2x.wgsl"),
        include_str!("shaders/q2x_sg.wgsl"),
        include_str!("shaders/xq.wgsl"),
        include_str!("shaders/gdn.wgsl"),
        "
fn gs_rows(v: vec4<f32>, li: u32) -> vec4<f32> {
    let a = v + subgroupShuffleXor(v, 4u);
    let b = a + subgroupShuffleXor(a, 2u);
    return b + subgroupShuffleXor(b, 1u);
}
",
        include_str!("shaders/gdn_step.wgsl"),
        include_str!("shaders/gdn_step_x.wgsl")
    ),
};

/// Rows of the conv an invocation owns (at least K-1: see gdn.wgsl `conv1d`).
const CONV_ROWS: usize = 8;
/// State rows a `gdn_recur` workgroup owns, and the largest Dk it holds (gdn.wgsl).
const RECUR_ROWS: usize = 32;
const MAX_DK: usize = 128;
/// gdn_sg.wgsl: lanes a state row (an aligned group of a subgroup) and rows a workgroup of 64.
const SG_PARTS: u32 = 4;
const SG_ROWS: usize = 16;
/// Blocks of at least this many rows take gdn_prep then gdn_scan_sg; shorter ones (a decode
/// step) gdn_step_sg, norms and gates inline, in one launch. gdn_prep is one more launch (~5 µs
/// on the H200); per token it takes about half of each scan lane's ~375 issue slots away (the
/// raw q/k loads as scalars, their squares, shuffles and scaling, the gates' exps: ~190),
/// ~0.1 µs a token on a GPU whose schedulers each run one of the scan's warps: even at ~50 rows.
const PREP_MIN_ROWS: usize = 64;

/// gdn.wgsl's parameter block.
fn params(d: &Dims, rows: usize, rb: usize) -> [u32; 12] {
    [
        rows as u32,
        d.conv_channels() as u32,
        d.conv_kernel as u32,
        d.conv_kernel.saturating_sub(1) as u32,
        d.gdn_k_heads as u32,
        d.gdn_v_heads as u32,
        d.gdn_k_dim as u32,
        d.gdn_v_dim as u32,
        d.eps.to_bits(),
        (1.0 / (d.gdn_k_dim as f32).sqrt()).to_bits(),
        rb as u32,
        0,
    ]
}

pub fn conv1d(
    ctx: &Ctx,
    x: &WBuf,
    w: &WBuf,
    state: &mut WBuf,
    d: &Dims,
    rows: usize,
    out: &mut WBuf,
) {
    let c = d.conv_channels();
    let k = d.conv_kernel;
    if k == 0 || c == 0 {
        ctx.fail(format!("conv1d: kernel {k} over {c} channels"));
        return;
    }
    if !fits(
        ctx,
        "conv1d",
        &[
            ("x", x, rows * c),
            ("out", out, rows * c),
            ("the weight", w, c * k),
            ("the state", state, (k - 1) * c),
        ],
    ) {
        return;
    }
    let rb = CONV_ROWS.max(k - 1);
    let groups = c.div_ceil(256) * rows.div_ceil(rb);
    ctx.dispatch(
        &SHADER,
        "conv1d",
        &params(d, rows, rb),
        &[&x.buf, &w.buf, &state.buf, &out.buf],
        groups as u32,
    );
}

#[allow(clippy::too_many_arguments)]
pub fn gated_delta(
    ctx: &Ctx,
    qkv: &WBuf,
    z: &WBuf,
    b: &WBuf,
    a: &WBuf,
    w: &GdnParams<WBuf>,
    state: &mut WBuf,
    d: &Dims,
    rows: usize,
    out: &mut WBuf,
) {
    gated_delta_ex(ctx, qkv, z, b, a, w, state, d, rows, out, true)
}

/// `gated_delta`, with the gated norm (gdn_norm) only when `norm`: without it `out` holds the
/// recurrence's y, for a consumer that applies the norm itself (out_proj's q2x_stage, xq.wgsl
/// xmode 3).
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_ex(
    ctx: &Ctx,
    qkv: &WBuf,
    z: &WBuf,
    b: &WBuf,
    a: &WBuf,
    w: &GdnParams<WBuf>,
    state: &mut WBuf,
    d: &Dims,
    rows: usize,
    out: &mut WBuf,
    norm: bool,
) {
    let (hk, hv, dk, dv) = (d.gdn_k_heads, d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim);
    if hk == 0 || hv % hk != 0 || dk == 0 || dk > MAX_DK || dv == 0 {
        ctx.fail(format!(
            "gated_delta: {hk} key heads of {dk}, {hv} value heads of {dv}: the kernel needs \
             value heads a multiple of key heads and a key head dim of 1..={MAX_DK}"
        ));
        return;
    }
    let c = d.conv_channels();
    if !fits(
        ctx,
        "gated_delta",
        &[
            ("qkv", qkv, rows * c),
            ("z", z, rows * hv * dv),
            ("b", b, rows * hv),
            ("a", a, rows * hv),
            ("a_log", &w.a_log, hv),
            ("dt_bias", &w.dt_bias, hv),
            ("the norm", &w.norm, dv),
            ("the state", state, hv * dv * dk),
            ("out", out, rows * hv * dv),
        ],
    ) {
        return;
    }
    if rows == 0 {
        return;
    }
    let p = params(d, rows, 0);
    if rows == 1 && !fast(ctx, d) && step_y_takes(ctx, d) {
        let (sh, groups) = (step_shader(ctx), hv * dv.div_ceil(32));
        step_dispatch(
            ctx,
            sh,
            "gdn_step_y",
            &step_params(d, dv.div_ceil(32)),
            &[
                &qkv.buf,
                &b.buf,
                &a.buf,
                &out.buf,
                &w.a_log.buf,
                &w.dt_bias.buf,
                &state.buf,
            ],
            groups as u32,
        );
    } else if fast(ctx, d) {
        let sg_groups = (hv * dv.div_ceil(SG_ROWS)) as u32;
        // gdn_prep's output: q, k (normed) as (k, k', q, q') per column pair, then (β, g, -, -)
        // per (token, head); a block whose scratch would pass the adapter's largest binding
        // takes the fused scan instead.
        let pre_bytes = 4 * (rows * (2 * hk * dk + 4 * hv)) as u64;
        if rows >= PREP_MIN_ROWS && pre_bytes <= ctx.report.max_binding {
            let pre = match ctx.scratch("gdn.pre", pre_bytes) {
                Ok(b) => b,
                Err(e) => {
                    ctx.fail(format!("gated_delta: the pre-pass's scratch: {e:#}"));
                    return;
                }
            };
            ctx.dispatch(
                &SHADER,
                "gdn_prep",
                &p,
                &[&qkv.buf, &b.buf, &a.buf, &w.a_log.buf, &w.dt_bias.buf, &pre],
                rows as u32,
            );
            sg_dispatch(
                ctx,
                "gdn_scan_sg",
                &p,
                qkv,
                b,
                a,
                w,
                state,
                out,
                &pre,
                sg_groups,
            );
        } else {
            let spare = &ctx.spare[0];
            sg_dispatch(
                ctx,
                "gdn_step_sg",
                &p,
                qkv,
                b,
                a,
                w,
                state,
                out,
                spare,
                sg_groups,
            );
        }
    } else {
        ctx.dispatch(
            &SHADER,
            "gdn_recur",
            &p,
            &[
                &qkv.buf,
                &b.buf,
                &a.buf,
                &w.a_log.buf,
                &w.dt_bias.buf,
                &state.buf,
                &out.buf,
            ],
            (hv * dv.div_ceil(RECUR_ROWS)) as u32,
        );
    }
    if !norm {
        return;
    }
    ctx.dispatch(
        &SHADER,
        "gdn_norm",
        &p,
        &[&z.buf, &w.norm.buf, &out.buf],
        (rows * hv) as u32,
    );
}

/// Dispatches gdn_step.wgsl's `entry` (gdn_step_y, gdn_step_x) with its parameter block `p`
/// (`step_params`), specialised to it (`LILY_WGPU_SPEC` gdn: GC_*, the head counts and sizes
/// as pipeline constants) where that is on.
fn step_dispatch(
    ctx: &Ctx,
    sh: &Shader,
    entry: &'static str,
    p: &[u32; 12],
    bufs: &[&::wgpu::Buffer],
    groups: u32,
) {
    let consts = if ctx.sw.gdn_spec.load(std::sync::atomic::Ordering::Relaxed) {
        let names = [
            "GC_HK",
            "GC_HV",
            "GC_DK",
            "GC_DV",
            "GC_SLICES",
            "GC_W4",
            "GC_W8",
        ];
        let mut c = vec![("GC_ON", 1)];
        c.extend(names.into_iter().zip(p.iter().copied()));
        c
    } else {
        Vec::new()
    };
    ctx.dispatch_spec(sh, entry, &consts, p, bufs, groups);
}

/// gdn_step.wgsl's parameter block (`GS`), `slices` workgroups a value head.
fn step_params(d: &Dims, slices: usize) -> [u32; 12] {
    let x = d.gdn_v_heads * d.gdn_v_dim;
    [
        d.gdn_k_heads as u32,
        d.gdn_v_heads as u32,
        d.gdn_k_dim as u32,
        d.gdn_v_dim as u32,
        slices as u32,
        (x / 32) as u32,
        (x / 16) as u32,
        0,
        d.eps.to_bits(),
        (1.0 / (d.gdn_k_dim as f32).sqrt()).to_bits(),
        0,
        0,
    ]
}

/// Whether gdn_step.wgsl's row sums run by shuffles: ordered subgroups (`subgroups`) of at
/// least 8 lanes (a row group's 8 threads in one subgroup).
fn step_sg(ctx: &Ctx) -> bool {
    ctx.report.subgroups && ctx.report.subgroup_min >= 8
}

/// gdn_step_y's module: the shuffles' where `step_sg` (unless `LILY_WGPU_GDN_STEP=yw`), else
/// workgroup memory's.
fn step_shader(ctx: &Ctx) -> &'static Shader {
    if step_sg(ctx) && ctx.sw.gdn_step.load(Ordering::Relaxed) != 3 {
        &STEP_SG_SHADER
    } else {
        &STEP_SHADER
    }
}

/// Whether a decode step's recurrence takes gdn_step_y (`LILY_WGPU_GDN_STEP` not 0): Dk a
/// multiple of 4 (vec4 columns) up to 128 (8 threads × 4 vec4s).
fn step_y_takes(ctx: &Ctx, d: &Dims) -> bool {
    ctx.sw.gdn_step.load(Ordering::Relaxed) >= 1
        && d.gdn_k_dim.is_multiple_of(4)
        && d.gdn_k_dim <= MAX_DK
}

/// Whether a decode step's GDN mixer takes gdn_step_x (`gated_delta_x`; `LILY_WGPU_GDN_STEP`
/// x, or xs, the default since stop 41, which needs these too): gdn_step_y's shapes, ordered subgroups of ≥ 8 lanes (its row sums and
/// xq_put's shuffles), a head of whole 4-bit words that one workgroup holds (Dv a multiple of
/// 32 up to 128), and the 9 storage buffers it binds. The caller checks that out_proj reads the
/// staged x (gemv_q6) of Hv · Dv inputs.
pub fn step_x_takes(ctx: &Ctx, d: &Dims) -> bool {
    matches!(ctx.sw.gdn_step.load(Ordering::Relaxed), 2 | 4)
        && step_y_takes(ctx, d)
        && step_sg(ctx)
        && d.gdn_v_dim.is_multiple_of(32)
        && d.gdn_v_dim <= 128
        && d.gdn_v_heads % d.gdn_k_heads.max(1) == 0
        && ctx.report.storage_buffers >= 9
}

/// Whether the GDN mixer takes gdn_step_xs (`gated_delta_x` with `split`;
/// `LILY_WGPU_GDN_STEP=xs`, the default): gdn_step_x's conditions (heads of whole 32-row workgroups, Dv / 32
/// a head) and out_proj on gemv_q6s (its Q6_RNG = Dv applies the heads' 1 / rms).
pub fn step_xs_takes(ctx: &Ctx, d: &Dims) -> bool {
    ctx.sw.gdn_step.load(Ordering::Relaxed) == 4
        && step_x_takes(ctx, d)
        && ctx.sw.q6_spec.load(Ordering::Relaxed)
}

/// gdn_step_xs's staging of out_proj's x (`Hv · Dv` inputs): q2x_stage's layouts for the row,
/// then one partial sum of squares a workgroup (Hv · Dv / 32).
pub fn xs_scratch(ctx: &Ctx, x: usize) -> anyhow::Result<::wgpu::Buffer> {
    ctx.scratch(
        "gdn_xq",
        (16 * super::matmul::xq_row(x) + 4 * (x / 32)) as u64,
    )
}

/// One decode token's gated delta rule, its gated norm and out_proj's x staged into `xq` (row 0
/// of q2x_stage's layouts, `matmul::xq_scratch`), in one launch (gdn_step_x.wgsl): y is never
/// written. With `split` (`step_xs_takes`), gdn_step_xs: x staged without the heads' 1 / rms,
/// their partial sums after the row (`xs_scratch`), for out_proj's `XIn::StagedRn` (group Dv). The caller
/// checks `step_x_takes`; the shapes are checked here.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_x(
    ctx: &Ctx,
    qkv: &WBuf,
    z: &WBuf,
    b: &WBuf,
    a: &WBuf,
    w: &GdnParams<WBuf>,
    state: &mut WBuf,
    d: &Dims,
    xq: &::wgpu::Buffer,
    split: bool,
) {
    let (hk, hv, dk, dv) = (d.gdn_k_heads, d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim);
    if hk == 0 || hv % hk != 0 {
        return ctx.fail(format!(
            "gated_delta_x: {hv} value heads over {hk} key heads: not a multiple"
        ));
    }
    if !fits(
        ctx,
        "gated_delta_x",
        &[
            ("qkv", qkv, d.conv_channels()),
            ("z", z, hv * dv),
            ("b", b, hv),
            ("a", a, hv),
            ("a_log", &w.a_log, hv),
            ("dt_bias", &w.dt_bias, hv),
            ("the norm", &w.norm, dv),
            ("the state", state, hv * dv * dk),
        ],
    ) {
        return;
    }
    // gdn_step_xs: 4 workgroups a head (dv / 32), the gated norm's 1 / rms left to out_proj.
    let (entry, slices) = if split {
        ("gdn_step_xs", dv / 32)
    } else {
        ("gdn_step_x", 1)
    };
    step_dispatch(
        ctx,
        &STEP_SG_SHADER,
        entry,
        &step_params(d, slices),
        &[
            &qkv.buf,
            &b.buf,
            &a.buf,
            xq,
            &w.a_log.buf,
            &w.dt_bias.buf,
            &state.buf,
            &z.buf,
            &w.norm.buf,
        ],
        (hv * slices) as u32,
    );
}

/// Whether the subgroup recurrence runs: `LILY_WGPU_GDN_FAST=1`, SUBGROUP with subgroups of at
/// least SG_PARTS lanes, and column pairs (an even Dk).
fn fast(ctx: &Ctx, d: &Dims) -> bool {
    ctx.sw.gdn_fast
        && ctx.report.subgroup
        && ctx.report.subgroup_min >= SG_PARTS
        && d.gdn_k_dim.is_multiple_of(2)
}

#[allow(clippy::too_many_arguments)]
fn sg_dispatch(
    ctx: &Ctx,
    entry: &'static str,
    p: &[u32],
    qkv: &WBuf,
    b: &WBuf,
    a: &WBuf,
    w: &GdnParams<WBuf>,
    state: &WBuf,
    out: &WBuf,
    pre: &::wgpu::Buffer,
    groups: u32,
) {
    ctx.dispatch(
        &SHADER_SG,
        entry,
        p,
        &[
            &qkv.buf,
            &b.buf,
            &a.buf,
            &w.a_log.buf,
            &w.dt_bias.buf,
            &state.buf,
            &out.buf,
            pre,
        ],
        groups,
    );
}
