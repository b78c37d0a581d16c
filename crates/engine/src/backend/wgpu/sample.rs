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
//! Covered: greedy with penalties, and top-k of 1..=[`KMAX`] (below the vocabulary) with any
//! temperature, top-p, min-p and penalties — the checkpoint's default (top-k 20, top-p 0.95)
//! among them — with the CPU's tokens for the same seed (softfloat.wgsl says how). Top-k off or
//! larger declines (`None`): the host samples, as on CUDA.

use anyhow::{bail, Result};

use super::device::{as_bytes, Ctx, Shader};
use super::{WBuf, WStep};
use crate::rng::Rng;
use crate::runtime::sampler::SamplingParams;

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
const SEEN: u32 = 1 << 31;

/// A sequence's sampler on the device (module header).
pub struct WSampler {
    vocab: usize,
    /// Candidates kept per slice and in the end: `top_k`, or 1 when greedy.
    k: usize,
    greedy: bool,
    temperature: f32,
    top_p: f32,
    min_p: f32,
    rep: f32,
    pres: f32,
    freq: f32,
    /// Penalty counts [vocab] (u32), when a penalty is on; else a dummy word (bound, unread).
    counts: ::wgpu::Buffer,
    pen: bool,
    /// xoshiro256++ state (4 u64, low word first).
    rng: ::wgpu::Buffer,
    /// sample_topk_partial's output: [blocks, k] candidates of two u32.
    cands: ::wgpu::Buffer,
}

impl WSampler {
    fn blocks(&self) -> usize {
        self.vocab.div_ceil(SLICE)
    }

    /// sample.wgsl's parameter block.
    fn params(&self, ncand: usize, token: u32) -> Vec<u32> {
        let flags = self.greedy as u32 | (self.pen as u32) << 1;
        vec![
            self.vocab as u32,
            self.k as u32,
            ncand as u32,
            flags,
            self.rep.to_bits(),
            self.pres.to_bits(),
            self.freq.to_bits(),
            self.temperature.to_bits(),
            self.top_p.to_bits(),
            self.min_p.to_bits(),
            token,
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
    p.validate()?;
    if vocab == 0 {
        bail!("new_sampler: empty vocabulary");
    }
    let greedy = p.is_greedy();
    let k = if greedy { 1 } else { p.top_k };
    // The slices' candidates must fit the finishing workgroup (PER an invocation).
    if k == 0 || k > KMAX || (!greedy && k >= vocab) || vocab.div_ceil(SLICE) * k > THREADS * PER {
        return Ok(None);
    }
    let pen =
        p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
    let counts = if pen {
        let mut c = vec![0u32; vocab];
        for &t in prompt {
            if (t as usize) < vocab {
                c[t as usize] |= SEEN;
            }
        }
        ctx.upload(as_bytes(&c))?
    } else {
        ctx.buffer(4)?
    };
    let st = Rng::splitmix(seed).state();
    let words: Vec<u32> = st
        .iter()
        .flat_map(|&w| [w as u32, (w >> 32) as u32])
        .collect();
    let rng = ctx.upload(as_bytes(&words))?;
    let cands = ctx.buffer(8 * (vocab.div_ceil(SLICE) * k) as u64)?;
    Ok(Some(WSampler {
        vocab,
        k,
        greedy,
        temperature: p.temperature,
        top_p: p.top_p,
        min_p: p.min_p,
        rep: p.repetition_penalty,
        pres: p.presence_penalty,
        freq: p.frequency_penalty,
        counts,
        pen,
        rng,
        cands,
    }))
}

/// `Backend::sample_step`: the two launches (module header); nothing comes to the host.
pub fn sample_step(ctx: &Ctx, logits: &WBuf, vocab: usize, s: &mut WSampler, step: &mut WStep) {
    if vocab != s.vocab || logits.len < vocab || logits.half {
        ctx.fail(format!(
            "sample_step: {vocab} logits (a buffer of {}{}) for a sampler of {}",
            logits.len,
            if logits.half { ", f16" } else { "" },
            s.vocab
        ));
        return;
    }
    let blocks = s.blocks();
    ctx.dispatch(
        &SHADER,
        "sample_topk_partial",
        &s.params(0, 0),
        &[&logits.buf, &s.counts, &s.cands],
        blocks as u32,
    );
    ctx.dispatch(
        &SHADER,
        "sample_topk_finish",
        &s.params(blocks * s.k, 0),
        &[&s.cands, &step.buf, &s.counts, &s.rng],
        1,
    );
}

/// `Backend::sample_note`: a forced token counts for the penalties as a drawn one.
pub fn sample_note(ctx: &Ctx, s: &mut WSampler, token: u32) {
    if !s.pen {
        return;
    }
    if token as usize >= s.vocab {
        ctx.fail(format!(
            "sample_note: token {token} outside the vocabulary of {}",
            s.vocab
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
    let mut p = vec![0u32; 12];
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
