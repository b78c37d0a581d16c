//! Sampling on the device (`Backend::sample_step`, `logprobs`): launch glue for sample.cu.
//!
//! A [`Sampler`] holds one sequence's sampling state in device memory: the xoshiro256++ state
//! (4 u64, seeded on the host exactly as `runtime::Sampler` seeds its generator), the penalty
//! counts (u32 per vocabulary entry: generated count | SEEN for prompt tokens; only when a
//! penalty is on) and the candidate buffer of the top-k pass. The parameters are kernel
//! arguments: they are fixed for the sampler's life, so a recorded step (whose key includes the
//! sampler, `Qwen35::decode_step`) replays them.
//!
//! Covered on the device: greedy with penalties, and top-k of 1..=[`KMAX`] (below the
//! vocabulary) with any temperature, top-p, min-p and penalties — the checkpoint's default
//! (top-k 20, top-p 0.95) among them. The rest (top-k off or larger) needs the full-vocabulary
//! pass (weights histogram, as sampler.rs's bins), not written yet: `new_sampler` returns
//! `None` and the caller samples on the host.

use anyhow::{bail, Result};

use cudarc::driver::result as dr;

use super::{Arg, Buf, Cuda, Mem, Step};
use crate::rng::Rng;
use crate::runtime::sampler::{DevicePlan, SamplingParams};

/// Threads of sample_topk_partial (SMP_THREADS in sample.cu), 8 logits each.
const THREADS: usize = 256;
/// Logits per block of sample_topk_partial (SMP_SLICE).
const SLICE: usize = 8 * THREADS;
/// Threads of sample_topk_finish and logprobs_finish (FIN_THREADS).
const FIN_THREADS: usize = 1024;
/// Most candidates the finishing block selects from (FIN_THREADS · FIN_PER).
const FIN_CANDS: usize = 8 * FIN_THREADS;
/// Largest top-k on the device (SMP_KMAX).
pub const KMAX: usize = 64;
/// Most log-probability alternatives (OpenAI's `top_logprobs` allows 20).
const LP_MAX: usize = 20;

/// A sequence's sampler on the device (module header).
pub struct Sampler {
    plan: DevicePlan,
    /// Penalty counts [vocab] (u32), when a penalty is on.
    counts: Option<Mem>,
    /// xoshiro256++ state (4 u64).
    rng: Mem,
    /// sample_topk_partial's output: [blocks, k] u64.
    cands: Mem,
}

impl Sampler {
    fn counts_ptr(&self) -> u64 {
        self.counts.as_ref().map_or(0, |m| m.ptr)
    }
}

impl Cuda {
    pub(super) fn new_sampler_op(
        &self,
        p: &SamplingParams,
        seed: u64,
        vocab: usize,
        prompt: &[u32],
    ) -> Result<Option<Sampler>> {
        // The slices' candidates must fit the finishing block (8 per thread).
        let Some(plan) = DevicePlan::new(p, vocab, KMAX, SLICE, FIN_CANDS)? else {
            return Ok(None);
        };
        let counts = match plan.counts(prompt) {
            Some(c) => Some(self.upload_u32(&c)?),
            None => None,
        };
        let st = Rng::splitmix(seed).state();
        // SAFETY: u64 words viewed as bytes.
        let rng =
            self.upload_bytes(unsafe { std::slice::from_raw_parts(st.as_ptr() as *const u8, 32) })?;
        let cands = self.alloc(8 * plan.blocks() * plan.k)?;
        Ok(Some(Sampler {
            plan,
            counts,
            rng,
            cands,
        }))
    }

    fn upload_u32(&self, v: &[u32]) -> Result<Mem> {
        // SAFETY: u32 slice viewed as bytes.
        self.upload_bytes(unsafe {
            std::slice::from_raw_parts(v.as_ptr() as *const u8, 4 * v.len())
        })
    }

    pub(super) fn sample_step_op(
        &self,
        logits: &Buf,
        vocab: usize,
        s: &mut Sampler,
        step: &mut Step,
    ) {
        let op = "sample_step";
        let pl = &s.plan;
        if !(self.ensure(vocab == pl.vocab, || {
            format!("{op}: {vocab} logits for a sampler of {}", pl.vocab)
        }) && self.buf_ok(logits, vocab, "logits", op))
        {
            return;
        }
        let p = pl.blocks();
        self.launch(
            "sample_topk_partial",
            (p as u32, 1, 1),
            THREADS as u32,
            0,
            &[
                Arg::P(logits.mem.ptr),
                Arg::P(s.counts_ptr()),
                Arg::P(s.cands.ptr),
                Arg::P(0),
                Arg::I(vocab as i32),
                Arg::I(pl.k as i32),
                Arg::F(pl.rep),
                Arg::F(pl.pres),
                Arg::F(pl.freq),
                Arg::I(0),
            ],
        );
        self.launch(
            "sample_topk_finish",
            (1, 1, 1),
            FIN_THREADS as u32,
            0,
            &[
                Arg::P(s.cands.ptr),
                Arg::I((p * pl.k) as i32),
                Arg::I(pl.k as i32),
                Arg::P(step.mem.ptr),
                Arg::P(s.counts_ptr()),
                Arg::P(s.rng.ptr),
                Arg::F(pl.temperature),
                Arg::F(pl.top_p),
                Arg::F(pl.min_p),
                Arg::I(pl.greedy as i32),
            ],
        );
    }

    /// The allowed-token words go up (31 KB at the full vocabulary; the copy from pageable
    /// memory may wait for the step in flight, which the mask was computed behind anyway), then
    /// one thread per logit clears the disallowed ones.
    pub(super) fn mask_logits_op(&self, logits: &mut Buf, vocab: usize, allowed: &[u32]) {
        let op = "mask_logits";
        if vocab == 0
            || !self.buf_ok(logits, vocab, "logits", op)
            || !self.ensure(logits.elem == 4, || format!("{op}: logits must be f32"))
        {
            return;
        }
        let nwords = allowed.len().min(vocab.div_ceil(32));
        let words = {
            let mut sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
            let Some(p) = self.scratch(&mut sc, "mask_words", 4 * nwords.max(1)) else {
                return;
            };
            p
        };
        if nwords > 0 {
            // SAFETY: the scratch holds at least nwords u32; a copy from pageable memory is staged
            // before the call returns.
            if let Err(e) =
                unsafe { dr::memcpy_htod_async(words, &allowed[..nwords], self.stream.cu_stream()) }
            {
                self.fail(format!("{op}: {e}"));
                return;
            }
        }
        self.launch(
            op,
            (vocab.div_ceil(256) as u32, 1, 1),
            256,
            0,
            &[
                Arg::P(logits.mem.ptr),
                Arg::P(words),
                Arg::I(vocab as i32),
                Arg::I(nwords as i32),
            ],
        );
    }

    pub(super) fn sample_note_op(&self, s: &mut Sampler, token: u32) {
        if let Some(c) = &s.counts {
            if self.ensure((token as usize) < s.plan.vocab, || {
                format!(
                    "sample_note: token {token} outside the vocabulary of {}",
                    s.plan.vocab
                )
            }) {
                self.launch(
                    "sample_count",
                    (1, 1, 1),
                    32,
                    0,
                    &[Arg::P(c.ptr), Arg::I(token as i32)],
                );
            }
        }
    }

    pub(super) fn logprobs_op(
        &self,
        logits: &Buf,
        vocab: usize,
        token: u32,
        n: usize,
    ) -> Result<(f32, Vec<(u32, f32)>)> {
        let op = "logprobs";
        if n > LP_MAX {
            bail!("{op}: {n} alternatives asked, at most {LP_MAX}");
        }
        if (token as usize) >= vocab || vocab == 0 {
            bail!("{op}: token {token} outside the vocabulary of {vocab}");
        }
        let kc = n.max(1);
        let p = vocab.div_ceil(SLICE);
        if p * kc > FIN_CANDS {
            bail!("{op}: a vocabulary of {vocab} is too large for the device kernels");
        }
        if !self.buf_ok(logits, vocab, "logits", op) {
            self.check()?;
            bail!("{op}: bad logits");
        }
        let out_len = 1 + 2 * n;
        let (cands, part, out) = {
            let mut sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
            let c = self.scratch(&mut sc, "lp_cands", 8 * p * kc);
            let pt = self.scratch(&mut sc, "lp_part", 16 * p);
            let o = self.scratch(&mut sc, "lp_out", 4 * out_len);
            match (c, pt, o) {
                (Some(c), Some(pt), Some(o)) => (c, pt, o),
                _ => {
                    drop(sc);
                    self.check()?;
                    bail!("{op}: no scratch memory");
                }
            }
        };
        self.launch(
            "sample_topk_partial",
            (p as u32, 1, 1),
            THREADS as u32,
            0,
            &[
                Arg::P(logits.mem.ptr),
                Arg::P(0),
                Arg::P(cands),
                Arg::P(part),
                Arg::I(vocab as i32),
                Arg::I(kc as i32),
                Arg::F(1.0),
                Arg::F(0.0),
                Arg::F(0.0),
                Arg::I(1),
            ],
        );
        self.launch(
            "logprobs_finish",
            (1, 1, 1),
            FIN_THREADS as u32,
            0,
            &[
                Arg::P(cands),
                Arg::I((p * kc) as i32),
                Arg::I(n as i32),
                Arg::P(part),
                Arg::I(p as i32),
                Arg::P(logits.mem.ptr),
                Arg::I(token as i32),
                Arg::P(out),
            ],
        );
        let v = self.read::<u32>(out, out_len)?;
        let top = (0..n)
            .map(|j| (v[1 + 2 * j], f32::from_bits(v[2 + 2 * j])))
            .filter(|&(id, _)| (id as usize) < vocab)
            .collect();
        Ok((f32::from_bits(v[0]), top))
    }
}
