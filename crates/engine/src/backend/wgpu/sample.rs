//! Sampling on the device (`Backend::sample_step`): launch glue for shaders/sample.wgsl, the
//! twin of cuda/sample.rs.
//!
//! A [`WSampler`] holds one sequence's sampling state in device memory: the xoshiro256++ state
//! (4 u64, seeded on the host exactly as `runtime::Sampler` seeds its generator), the penalty
//! counts (u32 per vocabulary entry: generated count | SEEN for prompt tokens; only when a
//! penalty is on) and the candidates of the first pass. The parameters travel in the dispatches'
//! parameter blocks: they are fixed for the sampler's life, so a recorded step (whose key
//! includes the sampler, `Qwen35::decode_step`) replays them.
//!
//! `logprobs`: `Backend::logprobs` by the same first pass in log-probability mode and
//! logprobs_finish.
//!
//! Covered: greedy with penalties, and top-k of 1..=[`KMAX`] (below the vocabulary) with any
//! temperature, top-p, min-p and penalties — the checkpoint's default (top-k 20, top-p 0.95)
//! among them — with the CPU's tokens for the same seed (softfloat.wgsl says how). Top-k off or
//! larger declines (`None`): the host samples, as on CUDA.

use anyhow::{bail, Result};

use super::device::{as_bytes, Ctx, Shader};
use super::{WBuf, WStep};
use crate::rng::Rng;
use crate::runtime::sampler::{DevicePlan, SamplingParams};

pub const SHADER: Shader = Shader {
    name: "sample",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/softfloat.wgsl"),
        include_str!("shaders/sample.wgsl")
    ),
};

/// Invocations of a workgroup (SMP_T) and candidates each holds (SMP_PER).
const THREADS: usize = 256;
const PER: usize = 16;
/// Logits a sample_topk_partial workgroup takes (SMP_SLICE).
const SLICE: usize = THREADS * PER;
/// Largest top-k on the device (SMP_KMAX).
pub const KMAX: usize = 64;

/// A sequence's sampler on the device (module header).
pub struct WSampler {
    plan: DevicePlan,
    /// Penalty counts [vocab] (u32), when a penalty is on; else a dummy word (bound, unread).
    counts: ::wgpu::Buffer,
    /// xoshiro256++ state (4 u64, low word first).
    rng: ::wgpu::Buffer,
    /// sample_topk_partial's output: [blocks, k] candidates of two u32.
    cands: ::wgpu::Buffer,
}

impl WSampler {
    /// sample.wgsl's parameter block.
    fn params(&self, ncand: usize, token: u32) -> Vec<u32> {
        let p = &self.plan;
        let flags = p.greedy as u32 | (p.penalties as u32) << 1;
        vec![
            p.vocab as u32,
            p.k as u32,
            ncand as u32,
            flags,
            p.rep.to_bits(),
            p.pres.to_bits(),
            p.freq.to_bits(),
            p.temperature.to_bits(),
            p.top_p.to_bits(),
            p.min_p.to_bits(),
            token,
            0,
            0,
            0,
            0,
            0,
        ]
    }
}

/// `Backend::new_sampler`: `None` for parameters the kernels do not cover (module header).
pub fn new_sampler(
    ctx: &Ctx,
    p: &SamplingParams,
    seed: u64,
    vocab: usize,
    prompt: &[u32],
) -> Result<Option<WSampler>> {
    // The slices' candidates must fit the finishing workgroup (PER an invocation).
    let Some(plan) = DevicePlan::new(p, vocab, KMAX, SLICE, THREADS * PER)? else {
        return Ok(None);
    };
    let counts = match plan.counts(prompt) {
        Some(c) => ctx.upload(as_bytes(&c))?,
        None => ctx.buffer(4)?,
    };
    let rng = ctx.upload(as_bytes(&Rng::splitmix(seed).state()))?;
    let cands = ctx.buffer(8 * (plan.blocks() * plan.k) as u64)?;
    Ok(Some(WSampler {
        plan,
        counts,
        rng,
        cands,
    }))
}

/// `Backend::sample_step`: the two launches (module header); nothing comes to the host.
pub fn sample_step(ctx: &Ctx, logits: &WBuf, vocab: usize, s: &mut WSampler, step: &mut WStep) {
    let (k, sv) = (s.plan.k, s.plan.vocab);
    if vocab != sv || logits.len < vocab || logits.half {
        ctx.fail(format!(
            "sample_step: {vocab} logits (a buffer of {}{}) for a sampler of {}",
            logits.len,
            if logits.half { ", f16" } else { "" },
            sv
        ));
        return;
    }
    let blocks = s.plan.blocks();
    ctx.dispatch(
        &SHADER,
        "sample_topk_partial",
        &s.params(0, 0),
        &[&logits.buf, &s.counts, &s.cands, &ctx.spare[0]],
        blocks as u32,
    );
    ctx.dispatch(
        &SHADER,
        "sample_topk_finish",
        &s.params(blocks * k, 0),
        &[&s.cands, &step.buf, &s.counts, &s.rng],
        1,
    );
}

/// `Backend::sample_note`: a forced token counts for the penalties as a drawn one.
pub fn sample_note(ctx: &Ctx, s: &mut WSampler, token: u32) {
    if !s.plan.penalties {
        return;
    }
    if token as usize >= s.plan.vocab {
        ctx.fail(format!(
            "sample_note: token {token} outside the vocabulary of {}",
            s.plan.vocab
        ));
        return;
    }
    ctx.dispatch(
        &SHADER,
        "sample_count",
        &s.params(0, token),
        &[&s.counts],
        1,
    );
}

/// Most log-probability alternatives (OpenAI's `top_logprobs` allows 20).
const LP_MAX: usize = 20;

/// A token's log-probability and the most likely `(id, logprob)`: `Backend::logprobs`'s answer.
type TokenLogprobs = (f32, Vec<(u32, f32)>);

/// `Backend::logprobs` on the device: sample_topk_partial in log-probability mode, then
/// logprobs_finish; only 1 + 2n words come back (the host's way read 1 MB and took its exps).
/// `None` where the kernels do not take the shape (the caller then reads the logits).
pub fn logprobs(
    ctx: &Ctx,
    logits: &WBuf,
    vocab: usize,
    token: u32,
    n: usize,
) -> Result<Option<TokenLogprobs>> {
    if n > LP_MAX {
        bail!("logprobs: {n} alternatives asked, at most {LP_MAX}");
    }
    if token as usize >= vocab || vocab == 0 {
        bail!("logprobs: token {token} outside the vocabulary of {vocab}");
    }
    let (kc, blocks) = (n.max(1), vocab.div_ceil(SLICE));
    if blocks * kc > THREADS * PER || logits.len < vocab || logits.half {
        return Ok(None);
    }
    let out_len = 1 + 2 * n;
    let cands = ctx.scratch("lp.cands", (8 * blocks * kc) as u64)?;
    let part = ctx.scratch("lp.part", (8 * blocks) as u64)?;
    let out = ctx.scratch("lp.out", (4 * out_len) as u64)?;
    let mut p = vec![0u32; 16];
    p[0] = vocab as u32;
    p[1] = kc as u32;
    p[2] = (blocks * kc) as u32;
    p[3] = 4;
    p[10] = token;
    p[11] = blocks as u32;
    p[12] = n as u32;
    ctx.dispatch(
        &SHADER,
        "sample_topk_partial",
        &p,
        &[&logits.buf, &ctx.spare[0], &cands, &part],
        blocks as u32,
    );
    ctx.dispatch(
        &SHADER,
        "logprobs_finish",
        &p,
        &[&cands, &part, &logits.buf, &out],
        1,
    );
    ctx.check()?;
    let b = ctx.read(&out, (4 * out_len) as u64)?;
    let w: Vec<u32> = b
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let top = (0..n)
        .map(|j| (w[1 + 2 * j], f32::from_bits(w[2 + 2 * j])))
        .filter(|&(id, _)| (id as usize) < vocab)
        .collect();
    Ok(Some((f32::from_bits(w[0]), top)))
}

/// Runs softfloat.wgsl on `rows` of (a, b, c, d) f32 bits: 16 words a row (sample.wgsl's
/// `softfloat_check` says which). For the bit-for-bit test against Rust's arithmetic.
pub fn softfloat_check(ctx: &Ctx, rows: &[[u32; 4]]) -> Result<Vec<[u32; 16]>> {
    let n = rows.len();
    if n == 0 {
        return Ok(Vec::new());
    }
    let flat: Vec<u32> = rows.iter().flatten().copied().collect();
    let input = ctx.upload(as_bytes(&flat))?;
    let out = ctx.buffer(64 * n as u64)?;
    let mut p = vec![0u32; 16];
    p[11] = n as u32;
    ctx.dispatch(
        &SHADER,
        "softfloat_check",
        &p,
        &[&input, &out],
        n.div_ceil(64) as u32,
    );
    ctx.check()?;
    let b = ctx.read(&out, 64 * n as u64)?;
    Ok(b.chunks_exact(64)
        .map(|r| {
            let mut w = [0u32; 16];
            for (i, c) in r.chunks_exact(4).enumerate() {
                w[i] = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            w
        })
        .collect())
}
