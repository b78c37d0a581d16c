//! Gated DeltaNet: the causal conv and the gated delta rule (shaders/gdn.wgsl; cpu/gdn.rs is the
//! twin). Prefill and decode share these entry points (rows = 1 for a step).

use super::device::{Ctx, Shader};
use super::WBuf;
use crate::backend::{Dims, GdnParams};

pub const SHADER: Shader = Shader {
    name: "gdn",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/gdn.wgsl")
    ),
};

pub fn conv1d(
    ctx: &Ctx,
    _x: &WBuf,
    _w: &WBuf,
    _state: &mut WBuf,
    _d: &Dims,
    _rows: usize,
    _out: &mut WBuf,
) {
    ctx.fail("conv1d: not written for wgpu yet");
}

#[allow(clippy::too_many_arguments)]
pub fn gated_delta(
    ctx: &Ctx,
    _qkv: &WBuf,
    _z: &WBuf,
    _b: &WBuf,
    _a: &WBuf,
    _w: &GdnParams<WBuf>,
    _state: &mut WBuf,
    _d: &Dims,
    _rows: usize,
    _out: &mut WBuf,
) {
    ctx.fail("gated_delta: not written for wgpu yet");
}
