//! The token's way in and out: the embedding lookup, the greedy pick into the step, the
//! constrained-decoding mask (shaders/output.wgsl; cpu/mod.rs is the twin).

use super::device::{as_bytes, Ctx, Shader};
use super::{WBuf, WMat, WStep};

pub const SHADER: Shader = Shader {
    name: "output",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/quant.wgsl"),
        include_str!("shaders/output.wgsl")
    ),
};

/// Logits an `argmax_partial` workgroup reduces (output.wgsl's AM_BLOCK).
const AM_BLOCK: usize = 4096;

/// output.wgsl's parameter block: a matrix (or zeros), n, words.
fn params(m: Option<&WMat>, n: usize, words: usize) -> Vec<u32> {
    let mut p = m.map_or([0; 8], |m| m.qmat()).to_vec();
    p.extend([n as u32, words as u32, 0, 0]);
    p
}

fn embed_rows(ctx: &Ctx, table: &WMat, ids: &::wgpu::Buffer, rows: usize, out: &mut WBuf) {
    if out.len < rows * table.inp {
        ctx.fail(format!(
            "embed: {rows} rows of {} into a buffer of {}",
            table.inp, out.len
        ));
        return;
    }
    let bufs = [&table.w, &table.s, &table.b, ids, &out.buf];
    ctx.dispatch(
        &SHADER,
        "embed",
        &params(Some(table), rows, 0),
        &bufs,
        rows as u32,
    );
}

pub fn embed(ctx: &Ctx, table: &WMat, ids: &[u32], out: &mut WBuf) {
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= table.out) {
        ctx.fail(format!(
            "embed: token id {bad} past the vocabulary of {}",
            table.out
        ));
        return;
    }
    if ids.is_empty() {
        return;
    }
    match ctx.upload(as_bytes(ids)) {
        Ok(b) => embed_rows(ctx, table, &b, ids.len(), out),
        Err(e) => ctx.fail(format!("embed: {e:#}")),
    }
}

pub fn embed_step(ctx: &Ctx, table: &WMat, step: &WStep, out: &mut WBuf) {
    embed_rows(ctx, table, &step.buf, 1, out)
}

pub fn argmax_step(ctx: &Ctx, logits: &WBuf, vocab: usize, step: &mut WStep) {
    if vocab == 0 || logits.len < vocab {
        ctx.fail(format!(
            "argmax_step: {vocab} logits asked of a buffer of {}",
            logits.len
        ));
        return;
    }
    let blocks = vocab.div_ceil(AM_BLOCK);
    let (pv, pi) = match (
        ctx.scratch("argmax.v", 4 * blocks as u64),
        ctx.scratch("argmax.i", 4 * blocks as u64),
    ) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => return ctx.fail(format!("argmax_step: {e:#}")),
    };
    ctx.dispatch(
        &SHADER,
        "argmax_partial",
        &params(None, vocab, 0),
        &[&logits.buf, &pv, &pi],
        blocks as u32,
    );
    ctx.dispatch(
        &SHADER,
        "argmax_final",
        &params(None, vocab, blocks),
        &[&pv, &pi, &step.buf],
        1,
    );
}

pub fn mask_logits(ctx: &Ctx, logits: &mut WBuf, vocab: usize, allowed: &[u32]) {
    if logits.len < vocab {
        ctx.fail(format!(
            "mask_logits: {vocab} logits asked of a buffer of {}",
            logits.len
        ));
        return;
    }
    let words = if allowed.is_empty() {
        &[0u32][..]
    } else {
        allowed
    };
    match ctx.upload(as_bytes(words)) {
        Ok(m) => ctx.dispatch(
            &SHADER,
            "mask_logits",
            &params(None, vocab, allowed.len()),
            &[&logits.buf, &m],
            vocab.div_ceil(256) as u32,
        ),
        Err(e) => ctx.fail(format!("mask_logits: {e:#}")),
    }
}
