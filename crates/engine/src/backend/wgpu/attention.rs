//! Gated attention: q/k norm + RoPE, prefill and decode attention (shaders/attention.wgsl;
//! cpu/attention.rs is the twin).

use super::device::{Ctx, Shader};
use super::{WBuf, WStep};
use crate::backend::{Dims, KvCache};

pub const SHADER: Shader = Shader {
    name: "attention",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/attention.wgsl")
    ),
};

#[allow(clippy::too_many_arguments)]
pub fn attn_qk_norm_rope(
    ctx: &Ctx,
    _qg: &WBuf,
    _k: &mut WBuf,
    _q_norm: &WBuf,
    _k_norm: &WBuf,
    _d: &Dims,
    _rows: usize,
    _pos0: usize,
    _step: Option<&WStep>,
    _q: &mut WBuf,
    _gate: &mut WBuf,
) {
    ctx.fail("attn_qk_norm_rope: not written for wgpu yet");
}

#[allow(clippy::too_many_arguments)]
pub fn attn_prefill(
    ctx: &Ctx,
    _q: &WBuf,
    _k: &WBuf,
    _v: &WBuf,
    _gate: &WBuf,
    _kv: &mut KvCache<WBuf>,
    _d: &Dims,
    _rows: usize,
    _pos0: usize,
    _out: &mut WBuf,
) {
    ctx.fail("attn_prefill: not written for wgpu yet");
}

#[allow(clippy::too_many_arguments)]
pub fn attn_decode(
    ctx: &Ctx,
    _q: &WBuf,
    _k: &WBuf,
    _v: &WBuf,
    _gate: &WBuf,
    _kv: &mut KvCache<WBuf>,
    _d: &Dims,
    _pos: usize,
    _step: &WStep,
    _out: &mut WBuf,
) {
    ctx.fail("attn_decode: not written for wgpu yet");
}
