//! Gated DeltaNet: the causal conv and the gated delta rule (shaders/gdn.wgsl; cpu/gdn.rs is the
//! twin). Prefill and decode share these entry points (rows = 1 for a step).

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

/// Rows of the conv an invocation owns (at least K-1: see gdn.wgsl `conv1d`).
const CONV_ROWS: usize = 8;
/// State rows a `gdn_recur` workgroup owns, and the largest Dk it holds (gdn.wgsl).
const RECUR_ROWS: usize = 32;
const MAX_DK: usize = 128;

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
    ctx.dispatch(
        &SHADER,
        "gdn_norm",
        &p,
        &[&z.buf, &w.norm.buf, &out.buf],
        (rows * hv) as u32,
    );
}
