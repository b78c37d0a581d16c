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
use crate::runtime::sampler::SamplingParams;

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
const SEEN: u32 = 1 << 31;

/// A sequence's sampler on the device (module header).
pub struct Sampler {
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
    /// Penalty counts [vocab] (u32), when a penalty is on.
    counts: Option<Mem>,
    /// xoshiro256++ state (4 u64).
    rng: Mem,
    /// sample_topk_partial's output: [blocks, k] u64.
    cands: Mem,
}

impl Sampler {
    fn blocks(&self) -> usize {
        self.vocab.div_ceil(SLICE)
    }
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
        p.validate()?;
        if vocab == 0 {
            bail!("new_sampler: empty vocabulary");
        }
        let greedy = p.is_greedy();
        let k = if greedy { 1 } else { p.top_k };
        // The slices' candidates must fit the finishing block (8 per thread).
        if k == 0 || k > KMAX || (!greedy && k >= vocab) || vocab.div_ceil(SLICE) * k > FIN_CANDS {
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
            Some(self.upload_u32(&c)?)
        } else {
            None
        };
        let st = Rng::splitmix(seed).state();
        // SAFETY: u64 words viewed as bytes.
        let rng =
            self.upload_bytes(unsafe { std::slice::from_raw_parts(st.as_ptr() as *const u8, 32) })?;
        let cands = self.alloc(8 * vocab.div_ceil(SLICE) * k)?;
        Ok(Some(Sampler {
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
        if !(self.ensure(vocab == s.vocab, || {
            format!("{op}: {vocab} logits for a sampler of {}", s.vocab)
        }) && self.buf_ok(logits, vocab, "logits", op))
        {
            return;
        }
        let p = s.blocks();
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
                Arg::I(s.k as i32),
                Arg::F(s.rep),
                Arg::F(s.pres),
                Arg::F(s.freq),
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
                Arg::I((p * s.k) as i32),
                Arg::I(s.k as i32),
                Arg::P(step.mem.ptr),
                Arg::P(s.counts_ptr()),
                Arg::P(s.rng.ptr),
                Arg::F(s.temperature),
                Arg::F(s.top_p),
                Arg::F(s.min_p),
                Arg::I(s.greedy as i32),
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
            if self.ensure((token as usize) < s.vocab, || {
                format!(
                    "sample_note: token {token} outside the vocabulary of {}",
                    s.vocab
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
