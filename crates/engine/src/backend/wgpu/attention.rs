//! Gated attention: q/k norm + RoPE, prefill and decode attention (shaders/attention.wgsl;
//! cpu/attention.rs is the twin).
//!
//! Prefill appends k/v with buffer copies, then `attn_tile_gqa`: a workgroup per (tile of query
//! rows, KV head), each K/V row staged in workgroup memory once for the tile's 32 (row, head)
//! slots, online softmax (flash-attention style). When the tiles are few and the keys many (a
//! prompt's short last chunk deep in a long context) the keys are split over several workgroups
//! (`attn_tile_gqa_part`) and `attn_combine4` merges them. `LILY_WGPU_ATTN_TILE=0` takes stop
//! 28's `attn_rows_gqa` (a workgroup per row and KV head: K/V read once a row, quadratic);
//! `attn_rows` (a workgroup per row and query head) takes the shapes the grouped kernels cannot.
//! Decode reads its position from the step on the device: `qk_rope_append_step` (the norms and
//! RoPE, `attn_decode_qk`) or `kv_append_step` (`attn_decode`) writes the row,
//! `attn_dec_gqa` spreads the keys over `splits` ranges per KV head (the count chosen from the
//! capacity, so the launch is the same at every position; the ranges from the position), its
//! query heads together, `attn_combine4` merges them (`LILY_WGPU_ATTN_TILE=0`: stop 28's
//! `attn_split_gqa` + `attn_combine`; `attn_split`, a query head a workgroup, takes the shapes
//! the grouped kernels cannot).
//!
//! The KV cache is f32 or f16 (`WBuf::half`: `Backend::kv_zeros` makes f16 ones where
//! `Wgpu::kv_f16` says: SHADER_F16 and attn_dec_team, or `LILY_WGPU_KV_F16=1`): attention.wgsl is one source built
//! twice, `attention` over kv_f32.wgsl and `attention_h` over kv_f16.wgsl (the cache's element
//! type and its accessors), and each op takes the module of the cache it is given. An f16
//! cache's prefill append is `kv_store` (rounds k and v into the cache) instead of buffer copies.

use super::device::{Ctx, Shader};
use super::{fits, WBuf, WStep, Wgpu};
use crate::backend::{AttnStep, Dims, KvCache};

pub const SHADER: Shader = Shader {
    name: "attention",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/kv_f32.wgsl"),
        include_str!("shaders/attn_params.wgsl"),
        include_str!("shaders/attention.wgsl")
    ),
};

/// attention.wgsl over an f16 KV cache (halves packed two a u32 word).
pub const SHADER_H: Shader = Shader {
    name: "attention_h",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/kv_f16.wgsl"),
        include_str!("shaders/attn_params.wgsl"),
        include_str!("shaders/attention.wgsl")
    ),
};

/// attn_dec_sg.wgsl's attn_dec_team over an f32 cache (`LILY_WGPU_ATTN_DEC=team`; subgroup
/// builtins: made only where the adapter has ordered subgroups).
pub const DEC_SG_SHADER: Shader = Shader {
    name: "attn_dec_sg",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/kv_f32.wgsl"),
        include_str!("shaders/attn_params.wgsl"),
        include_str!("shaders/attn_dec_sg.wgsl")
    ),
};

/// attn_dec_team over an f16 cache.
pub const DEC_SG_SHADER_H: Shader = Shader {
    name: "attn_dec_sg_h",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/kv_f16.wgsl"),
        include_str!("shaders/attn_params.wgsl"),
        include_str!("shaders/attn_dec_sg.wgsl")
    ),
};

/// attn_combine_x.wgsl's attn_combine4_x (o_proj's x staged by the combine; subgroup builtins:
/// made only where the adapter has ordered subgroups, `xq_takes`). The combine reads no K/V:
/// the f32 cache's module serves both.
pub const ATTN_X_SHADER: Shader = Shader {
    name: "attn_x",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/kv_f32.wgsl"),
        include_str!("shaders/attn_params.wgsl"),
        include_str!("shaders/attention.wgsl"),
        include_str!("shaders/q2x.wgsl"),
        include_str!("shaders/q2x_sg.wgsl"),
        include_str!("shaders/xq.wgsl"),
        include_str!("shaders/attn_combine_x.wgsl")
    ),
};

/// Whether attn_decode_qk can stage o_proj's x in its combine (`attn_combine4_x`, with `xq`):
/// the attn_dec_gqa path (`LILY_WGPU_ATTN_TILE`, GQA), an adapter with ordered subgroups of one
/// width ≥ 4 (q2x_words' shuffles), heads of a multiple of 32 up to 256.
pub fn xq_takes(ctx: &Ctx, d: &Dims) -> bool {
    let r = &ctx.report;
    gqa(ctx, d)
        && ctx.sw.attn_tile
        && r.subgroups
        && r.subgroup_min == r.subgroup_max
        && r.subgroup_min >= 4
        && d.head_dim.is_multiple_of(32)
        && d.head_dim <= 256
}

/// The module of a cache's element type (`kv_ok` has checked K and V agree).
fn shader(kv: &KvCache<WBuf>) -> &'static Shader {
    if kv.k.half {
        &SHADER_H
    } else {
        &SHADER
    }
}

/// Whether a cache's K and V agree in type and an f16 one takes the head (whole words of two
/// halves a row); records the error if not.
fn kv_ok(ctx: &Ctx, op: &str, kv: &KvCache<WBuf>, d: &Dims) -> bool {
    if kv.k.half != kv.v.half {
        ctx.fail(format!(
            "{op}: the K and V caches differ in type (f16 and f32)"
        ));
        return false;
    }
    if kv.k.half && !d.head_dim.is_multiple_of(2) {
        ctx.fail(format!(
            "{op}: an f16 KV cache takes heads of an even dim, not {} (leave LILY_WGPU_KV_F16 unset for f32)",
            d.head_dim
        ));
        return false;
    }
    true
}

/// `dst[dst_off ..][..len] = src[src_off ..][..len]` rounded into an f16 cache buffer (kv_store;
/// `Backend::copy` from an f32 buffer into an f16 one). `dst_off` and `len` even (whole words).
pub fn kv_store(ctx: &Ctx, src: &WBuf, src_off: usize, dst: &WBuf, dst_off: usize, len: usize) {
    if !dst.half || src.half || !dst_off.is_multiple_of(2) || !len.is_multiple_of(2) {
        ctx.fail(format!(
            "kv_store: {len} elements from {src_off} into {dst_off} of an f16 cache: not whole words of f32 into f16"
        ));
        return;
    }
    if src_off + len > u32::MAX as usize || dst_off / 2 + len / 2 > u32::MAX as usize {
        ctx.fail(format!("kv_store: offsets {src_off}, {dst_off} past u32"));
        return;
    }
    let n = len / 2;
    ctx.dispatch(
        &SHADER_H,
        "kv_store",
        &[n as u32, src_off as u32, (dst_off / 2) as u32, 0],
        &[&src.buf, &dst.buf],
        n.div_ceil(256) as u32,
    );
}

/// The largest head the kernels take (two dims a thread of 256) and rotated dims (the turn
/// table of 128 pairs in the parameter block).
const MAX_HD: usize = 512;
const MAX_ROT: usize = 256;
/// Keys a workgroup scores at once (attention.wgsl `CHUNK`); most splits of a decode.
const CHUNK: usize = 256;
const MAX_SPLITS: usize = 32;
/// attn_split_gqa: query heads a KV head it takes (attention.wgsl `GQ_MAXG`) and the splits at
/// most (a KV head's keys over up to 128 workgroups: 256 on the model's two KV heads, enough
/// for a big GPU); the capacity's keys a split at least are `Switches::attn_keys` (32).
const GQA_MAX_GROUP: usize = 8;
const GQA_MAX_SPLITS: usize = 128;
/// attn_tile_gqa: query slots a tile (attention.wgsl `TQ`: rows · group), keys a step (`TK`).
const TILE_SLOTS: usize = 32;
const TILE_KEYS: usize = 8;
/// Prefill key splits: when a launch has fewer than `TILE_WGS` workgroups (about two an SM of
/// a big GPU: the H200 has 132), the keys are split so that it has about that many, each split
/// at least `TILE_SPLIT_KEYS` keys (below that the combine costs more than the split saves).
const TILE_WGS: usize = 256;
const TILE_SPLIT_KEYS: usize = 512;
/// attn_dec_gqa: keys a chunk of an f32 cache (attention.wgsl `DK`; twice that in f16), the fewest keys a split takes (so a short
/// context fills fewer splits, the rest stop at once), the splits at most (attn_combine4's
/// tree: 256; 512 workgroups on the model's two KV heads).
const DEC_CHUNK: usize = 32;
const DEC_MAX_SPLITS: usize = 256;
/// attn_dec_team: the fewest keys a split takes (4 of its 8-key blocks a team).
const TEAM_SPAN: usize = 32;

/// Whether the grouped kernels (`attn_split_gqa`, `attn_rows_gqa`) take this shape: up to 8
/// query heads a KV head, heads of up to 256 in vec4s (the model's: 8 of 256). Others go a
/// query head a workgroup. `LILY_WGPU_GQA=0` sends every shape that way (the ablation).
fn gqa(ctx: &Ctx, d: &Dims) -> bool {
    ctx.sw.gqa
        && d.n_heads / d.n_kv_heads <= GQA_MAX_GROUP
        && d.head_dim <= 256
        && d.head_dim.is_multiple_of(4)
}

/// Whether decode attention takes attn_dec_team where the head shape lets attn_dec_gqa run
/// (the default; `LILY_WGPU_ATTN_DEC=gqa`): the tiled kernels on, ordered subgroups. Also what
/// `Wgpu::kv_f16` chooses the cache's type by.
pub fn team_on(ctx: &Ctx) -> bool {
    ctx.sw.attn_tile
        && ctx.report.subgroups
        && ctx.sw.attn_team.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether the head shape is one the kernels take; records the error if not.
fn dims_ok(ctx: &Ctx, op: &str, d: &Dims) -> bool {
    let hd = d.head_dim;
    if hd == 0
        || hd > MAX_HD
        || d.n_kv_heads == 0
        || !d.n_heads.is_multiple_of(d.n_kv_heads)
        || !d.rotary_dim.is_multiple_of(2)
        || d.rotary_dim > hd
        || d.rotary_dim > MAX_ROT
    {
        ctx.fail(format!(
            "{op}: {} heads over {} KV heads of {hd} dims, {} rotated: not a shape the wgpu kernels take (head dim ≤ {MAX_HD}, rotated dims even and ≤ min(head dim, {MAX_ROT}))",
            d.n_heads, d.n_kv_heads, d.rotary_dim
        ));
        return false;
    }
    true
}

/// attn_params.wgsl's `P` (attention.wgsl, attn_dec_sg.wgsl).
fn params(d: &Dims, rows: usize, pos0: usize, cap: usize, splits: usize, span: usize) -> [u32; 12] {
    [
        rows as u32,
        d.n_heads as u32,
        d.n_kv_heads as u32,
        d.head_dim as u32,
        pos0 as u32,
        cap as u32,
        splits as u32,
        span as u32,
        (1.0 / (d.head_dim as f32).sqrt()).to_bits(),
        0,
        0,
        0,
    ]
}

/// qk_norm_rope's parameter block (attention.wgsl PR): 8 words, then inv_freq(i) / 2π as 2^-64
/// turns, (lo, hi) a pair, room for 128 pairs (1056 bytes: the block is bound at its full
/// size). inv_freq as the CPU computes it (f64); pos · inv_freq is then exact mod one turn in
/// the shader. `cap`: the KV cache's rows (qk_rope_append_step), else 0.
fn rope_params(d: &Dims, rows: usize, pos0: usize, cap: usize) -> Vec<u32> {
    let mut p = vec![0u32; 8 + 4 * 64];
    p[..8].copy_from_slice(&[
        rows as u32,
        d.n_heads as u32,
        d.n_kv_heads as u32,
        d.head_dim as u32,
        d.rotary_dim as u32,
        pos0 as u32,
        d.eps.to_bits(),
        cap as u32,
    ]);
    let rot = d.rotary_dim;
    for i in 0..rot / 2 {
        let inv = d.rope_theta.powf(-(2.0 * i as f64) / rot as f64);
        // Below 1 turn a position: the fraction's 64 bits (f64's 53 significant ones).
        let f = ((inv / (2.0 * std::f64::consts::PI)).fract() * 18446744073709551616.0) as u64;
        p[8 + 2 * i] = f as u32;
        p[9 + 2 * i] = (f >> 32) as u32;
    }
    p
}

/// One decode step's attention from q_proj's output (Backend `attn_decode_qk`): the norms, RoPE
/// and the cache append in one launch (qk_rope_append_step), then attention over the cache as
/// `attn_decode` runs it. Where the capacity passes u32, the composition.
pub fn attn_decode_qk(ctx: &Ctx, a: AttnStep<'_, Wgpu>, xq: Option<&::wgpu::Buffer>) {
    const OP: &str = "attn_decode_qk";
    let AttnStep {
        qg,
        k,
        v,
        q_norm,
        k_norm,
        kv,
        d,
        pos,
        step,
        q,
        gate,
        out,
    } = a;
    let (hq, kvh, hd) = (d.n_heads, d.n_kv_heads, d.head_dim);
    if !dims_ok(ctx, OP, d)
        || !fits(
            ctx,
            OP,
            &[
                ("qg", qg, hq * 2 * hd),
                ("k", k, kvh * hd),
                ("q_norm", q_norm, hd),
                ("k_norm", k_norm, hd),
                ("q", q, hq * hd),
                ("gate", gate, hq * hd),
            ],
        )
        || !decode_ok(ctx, OP, q, k, v, gate, kv, d, pos, out)
    {
        return;
    }
    let p = rope_params(d, 1, pos, kv.capacity);
    ctx.dispatch(
        shader(kv),
        "qk_rope_append_step",
        &p,
        &[
            &qg.buf,
            &k.buf,
            &q_norm.buf,
            &k_norm.buf,
            &q.buf,
            &gate.buf,
            &step.buf,
            &v.buf,
            &kv.k.buf,
            &kv.v.buf,
        ],
        (hq + kvh) as u32,
    );
    decode_attend(ctx, q, gate, kv, d, step, out, xq);
}

#[allow(clippy::too_many_arguments)]
pub fn attn_qk_norm_rope(
    ctx: &Ctx,
    qg: &WBuf,
    k: &mut WBuf,
    q_norm: &WBuf,
    k_norm: &WBuf,
    d: &Dims,
    rows: usize,
    pos0: usize,
    step: Option<&WStep>,
    q: &mut WBuf,
    gate: &mut WBuf,
) {
    const OP: &str = "attn_qk_norm_rope";
    let (hq, kvh, hd) = (d.n_heads, d.n_kv_heads, d.head_dim);
    if !dims_ok(ctx, OP, d)
        || !fits(
            ctx,
            OP,
            &[
                ("qg", qg, rows * hq * 2 * hd),
                ("k", k, rows * kvh * hd),
                ("q_norm", q_norm, hd),
                ("k_norm", k_norm, hd),
                ("q", q, rows * hq * hd),
                ("gate", gate, rows * hq * hd),
            ],
        )
    {
        return;
    }
    if step.is_some() && rows != 1 {
        ctx.fail(format!("{OP}: a step is one row, {rows} asked"));
        return;
    }
    if pos0 + rows > u32::MAX as usize {
        ctx.fail(format!("{OP}: positions {pos0}+{rows} past u32"));
        return;
    }
    let p = rope_params(d, rows, pos0, 0);
    let groups = (rows * (hq + kvh)) as u32;
    match step {
        Some(s) => ctx.dispatch(
            &SHADER,
            "qk_norm_rope_step",
            &p,
            &[
                &qg.buf,
                &k.buf,
                &q_norm.buf,
                &k_norm.buf,
                &q.buf,
                &gate.buf,
                &s.buf,
            ],
            groups,
        ),
        None => ctx.dispatch(
            &SHADER,
            "qk_norm_rope",
            &p,
            &[&qg.buf, &k.buf, &q_norm.buf, &k_norm.buf, &q.buf, &gate.buf],
            groups,
        ),
    }
}

#[allow(clippy::too_many_arguments)]
pub fn attn_prefill(
    ctx: &Ctx,
    q: &WBuf,
    k: &WBuf,
    v: &WBuf,
    gate: &WBuf,
    kv: &mut KvCache<WBuf>,
    d: &Dims,
    rows: usize,
    pos0: usize,
    out: &mut WBuf,
) {
    const OP: &str = "attn_prefill";
    let (hq, kvh, hd) = (d.n_heads, d.n_kv_heads, d.head_dim);
    let kvd = kvh * hd;
    if !dims_ok(ctx, OP, d) || !kv_ok(ctx, OP, kv, d) {
        return;
    }
    if pos0 + rows > kv.capacity {
        ctx.fail(format!(
            "{OP}: positions {pos0}..{} past the KV cache's capacity {}",
            pos0 + rows,
            kv.capacity
        ));
        return;
    }
    if !fits(
        ctx,
        OP,
        &[
            ("q", q, rows * hq * hd),
            ("k", k, rows * kvd),
            ("v", v, rows * kvd),
            ("gate", gate, rows * hq * hd),
            ("out", out, rows * hq * hd),
            ("the K cache", &kv.k, kv.capacity * kvd),
            ("the V cache", &kv.v, kv.capacity * kvd),
        ],
    ) {
        return;
    }
    if kv.k.half {
        kv_store(ctx, k, 0, &kv.k, pos0 * kvd, rows * kvd);
        kv_store(ctx, v, 0, &kv.v, pos0 * kvd, rows * kvd);
    } else {
        let (at, bytes) = (4 * (pos0 * kvd) as u64, 4 * (rows * kvd) as u64);
        ctx.copy(&k.buf, 0, &kv.k.buf, at, bytes);
        ctx.copy(&v.buf, 0, &kv.v.buf, at, bytes);
    }
    if gqa(ctx, d) && ctx.sw.attn_tile {
        tile_prefill(ctx, q, kv, gate, d, rows, pos0, out);
        return;
    }
    let (entry, groups) = if gqa(ctx, d) {
        ("attn_rows_gqa", rows * kvh)
    } else {
        ("attn_rows", rows * hq)
    };
    ctx.dispatch(
        shader(kv),
        entry,
        &params(d, rows, pos0, kv.capacity, 1, 0),
        &[&q.buf, &kv.k.buf, &kv.v.buf, &gate.buf, &out.buf],
        groups as u32,
    );
}

/// The key splits of a tiled prefill of `rows` rows at `pos0`: (splits, keys a split, a multiple
/// of `TILE_KEYS`). One split unless the tiles leave most of a big GPU idle.
fn tile_splits(d: &Dims, rows: usize, pos0: usize) -> (usize, usize) {
    let tiles = rows.div_ceil(TILE_SLOTS / (d.n_heads / d.n_kv_heads));
    let wgs = tiles * d.n_kv_heads;
    let keys = pos0 + rows;
    let want = TILE_WGS
        .div_ceil(wgs)
        .min(keys / TILE_SPLIT_KEYS)
        .min(DEC_MAX_SPLITS);
    if want <= 1 {
        return (1, keys.next_multiple_of(TILE_KEYS));
    }
    let span = keys.div_ceil(want).next_multiple_of(TILE_KEYS);
    (keys.div_ceil(span), span)
}

/// attn_tile_gqa (one split) or attn_tile_gqa_part + attn_combine4 (the K/V appended already).
#[allow(clippy::too_many_arguments)]
fn tile_prefill(
    ctx: &Ctx,
    q: &WBuf,
    kv: &KvCache<WBuf>,
    gate: &WBuf,
    d: &Dims,
    rows: usize,
    pos0: usize,
    out: &mut WBuf,
) {
    let (hq, hd) = (d.n_heads, d.head_dim);
    let tiles = rows.div_ceil(TILE_SLOTS / (hq / d.n_kv_heads));
    let (splits, span) = tile_splits(d, rows, pos0);
    let p = params(d, rows, pos0, kv.capacity, splits, span);
    let groups = (tiles * d.n_kv_heads * splits) as u32;
    let sh = shader(kv);
    if splits == 1 {
        ctx.dispatch(
            sh,
            "attn_tile_gqa",
            &p,
            &[&q.buf, &kv.k.buf, &kv.v.buf, &gate.buf, &out.buf],
            groups,
        );
        return;
    }
    let part = match ctx.scratch(
        "attn_prefill.part",
        4 * (rows * hq * splits * (hd + 4)) as u64,
    ) {
        Ok(b) => b,
        Err(e) => {
            ctx.fail(format!("attn_prefill: the splits' scratch: {e:#}"));
            return;
        }
    };
    ctx.dispatch(
        sh,
        "attn_tile_gqa_part",
        &p,
        &[&q.buf, &kv.k.buf, &kv.v.buf, &part],
        groups,
    );
    ctx.dispatch(
        sh,
        "attn_combine4",
        &p,
        &[&part, &gate.buf, &out.buf],
        (rows * hq) as u32,
    );
}

/// Keys a decode split covers, and the split count, for a cache of `cap` rows: at most
/// `MAX_SPLITS` splits of whole chunks.
fn split(cap: usize) -> (usize, usize) {
    let span = cap.div_ceil(MAX_SPLITS).next_multiple_of(CHUNK).max(CHUNK);
    (span, cap.div_ceil(span).max(1))
}

#[allow(clippy::too_many_arguments)]
pub fn attn_decode(
    ctx: &Ctx,
    q: &WBuf,
    k: &WBuf,
    v: &WBuf,
    gate: &WBuf,
    kv: &mut KvCache<WBuf>,
    d: &Dims,
    pos: usize,
    step: &WStep,
    out: &mut WBuf,
) {
    const OP: &str = "attn_decode";
    if !dims_ok(ctx, OP, d) || !decode_ok(ctx, OP, q, k, v, gate, kv, d, pos, out) {
        return;
    }
    let kvd = d.n_kv_heads * d.head_dim;
    let p = params(d, 1, 0, kv.capacity, 0, 0);
    // A thread a word of the row (two elements in an f16 cache).
    let words = if kv.k.half { kvd / 2 } else { kvd };
    ctx.dispatch(
        shader(kv),
        "kv_append_step",
        &p,
        &[&k.buf, &v.buf, &step.buf, &kv.k.buf, &kv.v.buf],
        words.div_ceil(256) as u32,
    );
    decode_attend(ctx, q, gate, kv, d, step, out, None);
}

/// The decode attention's operands checked (a failure is recorded).
#[allow(clippy::too_many_arguments)]
fn decode_ok(
    ctx: &Ctx,
    op: &str,
    q: &WBuf,
    k: &WBuf,
    v: &WBuf,
    gate: &WBuf,
    kv: &KvCache<WBuf>,
    d: &Dims,
    pos: usize,
    out: &WBuf,
) -> bool {
    let (hq, kvd, hd) = (d.n_heads, d.n_kv_heads * d.head_dim, d.head_dim);
    if !kv_ok(ctx, op, kv, d) {
        return false;
    }
    // The device reads the step's position (equal to `pos`); the host checks this one.
    if pos >= kv.capacity || kv.capacity > u32::MAX as usize {
        ctx.fail(format!(
            "{op}: position {pos} past the KV cache's capacity {}",
            kv.capacity
        ));
        return false;
    }
    fits(
        ctx,
        op,
        &[
            ("q", q, hq * hd),
            ("k", k, kvd),
            ("v", v, kvd),
            ("gate", gate, hq * hd),
            ("out", out, hq * hd),
            ("the K cache", &kv.k, kv.capacity * kvd),
            ("the V cache", &kv.v, kv.capacity * kvd),
        ],
    )
}

/// Attention of one decode row over the cache rows 0..=pos (the row at pos already appended):
/// the splits, then their combine with the gate; with `xq` (`xq_takes`), the combine also
/// stages the output for o_proj (attn_combine4_x, in q2x_stage's layouts).
#[allow(clippy::too_many_arguments)]
fn decode_attend(
    ctx: &Ctx,
    q: &WBuf,
    gate: &WBuf,
    kv: &KvCache<WBuf>,
    d: &Dims,
    step: &WStep,
    out: &mut WBuf,
    xq: Option<&::wgpu::Buffer>,
) {
    const OP: &str = "attn_decode";
    let (hq, kvh, hd) = (d.n_heads, d.n_kv_heads, d.head_dim);
    let gqa = gqa(ctx, d);
    let tile = gqa && ctx.sw.attn_tile;
    // attn_dec_gqa: `span` is the fewest keys a split takes (the device spreads pos + 1 keys over
    // the splits, at least a chunk each); attn_split_gqa: 0 (every split used); attn_split:
    // whole chunks.
    // attn_dec_team: attn_dec_gqa's shapes, where `team_on`.
    let team = gqa && team_on(ctx);
    let keys = ctx.sw.attn_keys.load(std::sync::atomic::Ordering::Relaxed);
    let (span, splits) = if team {
        (
            TEAM_SPAN,
            kv.capacity.div_ceil(keys).clamp(1, DEC_MAX_SPLITS),
        )
    } else if tile {
        (
            // attention.wgsl's DK: 32 · KV_PACK.
            if kv.k.half { 2 * DEC_CHUNK } else { DEC_CHUNK },
            kv.capacity.div_ceil(keys).clamp(1, DEC_MAX_SPLITS),
        )
    } else if gqa {
        (0, (kv.capacity / keys).clamp(1, GQA_MAX_SPLITS))
    } else {
        split(kv.capacity)
    };
    // Records of hd + 2 floats (attn_split*, attn_combine) or hd / 4 + 1 vec4s (attn_dec_gqa).
    let part = match ctx.scratch("attn_decode.part", 4 * (hq * splits * (hd + 4)) as u64) {
        Ok(b) => b,
        Err(e) => {
            ctx.fail(format!("{OP}: the splits' scratch: {e:#}"));
            return;
        }
    };
    let p = params(d, 1, 0, kv.capacity, splits, span);
    let (entry, groups, combine) = if tile {
        ("attn_dec_gqa", kvh * splits, "attn_combine4")
    } else if gqa {
        ("attn_split_gqa", kvh * splits, "attn_combine")
    } else {
        ("attn_split", hq * splits, "attn_combine")
    };
    let sh = shader(kv);
    let dec_sh = match (team, kv.k.half) {
        (false, _) => sh,
        (true, false) => &DEC_SG_SHADER,
        (true, true) => &DEC_SG_SHADER_H,
    };
    let entry = if team { "attn_dec_team" } else { entry };
    // attn_dec_gqa (or attn_dec_team) and attn_combine4 specialised to the shapes (`LILY_WGPU_SPEC` attn).
    let consts: Vec<(&str, u32)> =
        if tile && ctx.sw.attn_spec.load(std::sync::atomic::Ordering::Relaxed) {
            let names = ["AD_NH", "AD_NKV", "AD_HD", "AD_CAP", "AD_SPLITS", "AD_SPAN"];
            let vals = [p[1], p[2], p[3], p[5], p[6], p[7]];
            std::iter::once(("AD_ON", 1))
                .chain(names.into_iter().zip(vals))
                .collect()
        } else {
            Vec::new()
        };
    // attn_dec_team's V a block ahead (`LILY_WGPU_ATTN_VAHEAD`): its module's constant alone.
    let mut dec_consts = consts.clone();
    if team
        && ctx
            .sw
            .attn_vahead
            .load(std::sync::atomic::Ordering::Relaxed)
    {
        dec_consts.push(("AD_VAHEAD", 1));
    }
    ctx.dispatch_spec(
        dec_sh,
        entry,
        &dec_consts,
        &p,
        &[&q.buf, &kv.k.buf, &kv.v.buf, &step.buf, &part],
        groups as u32,
    );
    // attn_combine4q (`LILY_WGPU_ATTN_CQ`, the default; `0`: attn_combine4): attn_combine4 on
    // ceil(hd / 64) workgroups a head.
    let quarters = if tile && ctx.sw.attn_cq.load(std::sync::atomic::Ordering::Relaxed) {
        Some((hd / 4).div_ceil(16))
    } else {
        None
    };
    if let Some(xq) = xq {
        if !(tile && xq_takes(ctx, d)) {
            return ctx.fail(format!("{OP}: o_proj's x staged without attn_combine4_x"));
        }
        let bufs = [&part, &gate.buf, &out.buf, xq];
        let (entry, groups) = match quarters {
            Some(nq) => ("attn_combine4q_x", hq * nq),
            None => ("attn_combine4_x", hq),
        };
        ctx.dispatch_spec(&ATTN_X_SHADER, entry, &consts, &p, &bufs, groups as u32);
        return;
    }
    let (combine, groups) = match quarters {
        Some(nq) => ("attn_combine4q", hq * nq),
        None => (combine, hq),
    };
    ctx.dispatch_spec(
        sh,
        combine,
        &consts,
        &p,
        &[&part, &gate.buf, &out.buf],
        groups as u32,
    );
}
