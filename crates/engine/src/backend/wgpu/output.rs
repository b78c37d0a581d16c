//! The token's way in and out: the embedding lookup, the greedy pick into the step, the
//! constrained-decoding mask (shaders/output.wgsl).

use super::device::{Ctx, Shader};
use super::{WBuf, WMat, WStep};

pub const SHADER: Shader = Shader {
    name: "output",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/quant.wgsl"),
        include_str!("shaders/output.wgsl")
    ),
};

pub fn embed(ctx: &Ctx, _table: &WMat, _ids: &[u32], _out: &mut WBuf) {
    ctx.fail("embed: not written for wgpu yet");
}

pub fn embed_step(ctx: &Ctx, _table: &WMat, _step: &WStep, _out: &mut WBuf) {
    ctx.fail("embed_step: not written for wgpu yet");
}

pub fn argmax_step(ctx: &Ctx, _logits: &WBuf, _vocab: usize, _step: &mut WStep) {
    ctx.fail("argmax_step: not written for wgpu yet");
}

pub fn mask_logits(ctx: &Ctx, _logits: &mut WBuf, _vocab: usize, _allowed: &[u32]) {
    ctx.fail("mask_logits: not written for wgpu yet");
}
