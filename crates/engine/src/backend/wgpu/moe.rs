//! The MoE block: routing (softmax, top-k) and the routed experts (shaders/moe.wgsl;
//! cpu/moe.rs is the twin).

use super::device::{Ctx, Shader};
use super::{WBuf, WMat, WRoute};
use crate::backend::Dims;

pub const SHADER: Shader = Shader {
    name: "moe",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/quant.wgsl"),
        include_str!("shaders/moe.wgsl")
    ),
};

pub fn moe_route(ctx: &Ctx, _logits: &WBuf, _d: &Dims, _rows: usize, _route: &mut WRoute) {
    ctx.fail("moe_route: not written for wgpu yet");
}

#[allow(clippy::too_many_arguments)]
pub fn moe_experts(
    ctx: &Ctx,
    _x: &WBuf,
    _route: &WRoute,
    _gate: &WMat,
    _up: &WMat,
    _down: &WMat,
    _d: &Dims,
    _rows: usize,
    _out: &mut WBuf,
) {
    ctx.fail("moe_experts: not written for wgpu yet");
}
