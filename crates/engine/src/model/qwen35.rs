//! THE forward pass of Qwen3.5/3.6-MoE (MODEL.md §2), written once against `Backend`:
//!
//! ```text
//! h = embed[ids]
//! for each layer:
//!     x = rms_norm(h, input_norm)
//!     h = h + (gdn(x) | attention(x))
//!     h = h + moe(rms_norm(h, post_norm))
//! logits = lm_head(rms_norm(h, norm))
//! ```
//! Each norm is fused with the projections that read it (`rms_norm_matmul`) and each residual add
//! with the op that produces it (`matmul_q_add`, `moe_decode_add`). A prompt is fed in
//! chunks of at most `chunk` tokens (bounded scratch); a single token takes the decode ops
//! ([`Qwen35::decode`], [`Qwen35::decode_step`]): its token and position are read from the
//! state's `Step` on the backend and the next pick (the greedy arg-max, or a draw of the
//! sequence's [`DeviceSampler`]) is written back there, so a step has no host input and is
//! recorded once and replayed (`Backend::replay`, a CUDA graph) until a buffer it touches changes.

use anyhow::{bail, Result};

use crate::backend::{
    add_shared_expert, AttnStep, Backend, Dims, GdnParams, GdnScratch, GdnWeights, MoeScratch,
    MoeWeights, OProj, RouteAhead, RouterScratch, SharedExpert,
};
use crate::loader::{HostWeights, Mixer};
use crate::model::state::{LayerState, SeqState};
use crate::runtime::sampler::SamplingParams;
use crate::Config;

/// Which logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// None (prefill of a prefix whose next token is known).
    None,
    /// The last position only `[1, vocab]`.
    Last,
    /// The last position's logits computed and left on the device with their greedy pick in the
    /// state's step, nothing read back (a generation that picks on the device: the host then
    /// records the next step ahead while the device runs the prefill).
    Device,
    /// Every position `[rows, vocab]` (teacher forcing, evaluation).
    All,
}

struct GdnLayer<B: Backend> {
    in_proj_qkv: B::Mat,
    in_proj_z: B::Mat,
    in_proj_b: B::Mat,
    in_proj_a: B::Mat,
    conv1d: B::Vec,
    params: GdnParams<B::Vec>,
    out_proj: B::Mat,
}

struct AttnLayer<B: Backend> {
    q_proj: B::Mat,
    k_proj: B::Mat,
    v_proj: B::Mat,
    o_proj: B::Mat,
    q_norm: B::Vec,
    k_norm: B::Vec,
}

enum MixerLayer<B: Backend> {
    Gdn(GdnLayer<B>),
    Attn(AttnLayer<B>),
}

struct MoeLayer<B: Backend> {
    router: B::Mat,
    gate_proj: B::Mat,
    up_proj: B::Mat,
    down_proj: B::Mat,
    shared_gate_proj: B::Mat,
    shared_up_proj: B::Mat,
    shared_down_proj: B::Mat,
    shared_expert_gate: B::Mat,
}

struct Layer<B: Backend> {
    input_norm: B::Vec,
    post_norm: B::Vec,
    mixer: MixerLayer<B>,
    moe: MoeLayer<B>,
}

/// What a decode step gives back to the host.
#[derive(Clone, Debug, PartialEq)]
pub enum Next {
    /// The greedy pick, made on the backend (4 bytes read back).
    Token(u32),
    /// The next token's logits `[vocab]` (for sampling, log-probabilities, penalties).
    Logits(Vec<f32>),
}

/// How a decode step picks its next token.
pub enum Pick<'a, B: Backend> {
    /// The greedy arg-max, on the backend.
    Argmax,
    /// Drawn by the sequence's sampler on the backend.
    Sample(&'a mut DeviceSampler<B>),
    /// Not in the step: [`Qwen35::pick_masked`] picks once a grammar's mask is known.
    Later,
}

impl<'a, B: Backend> From<Option<&'a mut DeviceSampler<B>>> for Pick<'a, B> {
    /// Drawn by the sampler when there is one, else the arg-max.
    fn from(sampler: Option<&'a mut DeviceSampler<B>>) -> Self {
        match sampler {
            Some(d) => Pick::Sample(d),
            None => Pick::Argmax,
        }
    }
}

/// A sequence's sampler on the backend (`Qwen35::device_sampler`), with the id that keys the
/// recorded steps it takes part in.
pub struct DeviceSampler<B: Backend> {
    inner: B::Sampler,
    id: u64,
}

/// Scratch activations for a block of up to `rows` tokens: in the backend's activation type
/// (`act_zeros`, bf16 on CUDA) except the f32 ones: the residual stream `h` and its last row,
/// the logits, the router logits and the shared expert's gate logit `s`.
struct Scratch<B: Backend> {
    rows: usize,
    /// Identifies these buffers for a recorded decode step (see `SeqState::buffers_id`).
    id: u64,
    /// The decode step's logits `[vocab]`.
    logits: B::Buf,
    h: B::Buf,
    xn: B::Buf,
    r: B::Buf,
    // GDN
    qkv: B::Buf,
    qkv_c: B::Buf,
    z: B::Buf,
    b: B::Buf,
    a: B::Buf,
    y: B::Buf,
    // attention
    qg: B::Buf,
    q: B::Buf,
    gate: B::Buf,
    k: B::Buf,
    v: B::Buf,
    o: B::Buf,
    // MoE
    router_logits: B::Buf,
    route: B::Route,
    moe: B::Buf,
    sg: B::Buf,
    su: B::Buf,
    sa: B::Buf,
    sd: B::Buf,
    s: B::Buf,
    last: B::Buf,
}

impl<B: Backend> Scratch<B> {
    fn new(b: &B, c: &Config, rows: usize) -> Result<Self> {
        let (h, vd, si) = (
            c.hidden_size,
            c.gdn_v_dim(),
            c.shared_expert_intermediate_size,
        );
        let hv = c.linear_num_value_heads;
        Ok(Self {
            rows,
            id: crate::model::state::new_buffers_id(),
            logits: b.zeros(c.vocab_size)?,
            h: b.zeros(rows * h)?,
            xn: b.act_zeros(rows * h)?,
            r: b.act_zeros(rows * h)?,
            qkv: b.act_zeros(rows * c.gdn_qkv_dim())?,
            qkv_c: b.act_zeros(rows * c.gdn_qkv_dim())?,
            z: b.act_zeros(rows * vd)?,
            b: b.act_zeros(rows * hv)?,
            a: b.act_zeros(rows * hv)?,
            y: b.act_zeros(rows * vd)?,
            qg: b.act_zeros(rows * 2 * c.attn_q_dim())?,
            q: b.act_zeros(rows * c.attn_q_dim())?,
            gate: b.act_zeros(rows * c.attn_q_dim())?,
            k: b.act_zeros(rows * c.attn_kv_dim())?,
            v: b.act_zeros(rows * c.attn_kv_dim())?,
            o: b.act_zeros(rows * c.attn_q_dim())?,
            router_logits: b.zeros(rows * c.num_experts)?,
            route: b.new_route(rows, c.num_experts_per_tok)?,
            moe: b.act_zeros(rows * h)?,
            sg: b.act_zeros(rows * si)?,
            su: b.act_zeros(rows * si)?,
            sa: b.act_zeros(rows * si)?,
            sd: b.act_zeros(rows * h)?,
            s: b.zeros(rows)?,
            last: b.zeros(h)?,
        })
    }
}

/// The model on a backend.
pub struct Qwen35<B: Backend> {
    pub cfg: Config,
    pub dims: Dims,
    pub backend: B,
    /// Largest block of prompt tokens one forward call processes (bounds scratch memory).
    pub chunk: usize,
    /// Whether decode loops enqueue the next step before they read this step's token
    /// ([`Self::picked_ahead`]), so that a device never waits for the host between steps. On by
    /// default; `LILY_LOOKAHEAD=0` turns it off (an A/B switch; tests set it).
    pub lookahead: bool,
    embed: B::Mat,
    layers: Vec<Layer<B>>,
    norm: B::Vec,
    lm_head: B::Mat,
    scratch: std::sync::Mutex<Option<Scratch<B>>>,
}

impl<B: Backend> Qwen35<B> {
    /// Places the weights on the backend.
    pub fn new(backend: B, cfg: Config, w: &HostWeights) -> Result<Self> {
        Self::new_with_progress(backend, cfg, w, &|_, _| {})
    }

    /// As [`Self::new`]; `progress(done, total)` is called after each layer (uploading 20 GB to
    /// a GPU takes seconds, reading it from disk the first time much longer).
    pub fn new_with_progress(
        backend: B,
        cfg: Config,
        w: &HostWeights,
        progress: &dyn Fn(usize, usize),
    ) -> Result<Self> {
        let chunk = backend.prefill_chunk();
        let b = &backend;
        let mut layers = Vec::with_capacity(w.layers.len());
        for l in &w.layers {
            let mixer = match &l.mixer {
                Mixer::Gdn(g) => MixerLayer::Gdn(GdnLayer {
                    in_proj_qkv: b.upload_mat(&g.in_proj_qkv)?,
                    in_proj_z: b.upload_mat(&g.in_proj_z)?,
                    in_proj_b: b.upload_mat(&g.in_proj_b)?,
                    in_proj_a: b.upload_mat(&g.in_proj_a)?,
                    conv1d: b.upload_vec(&g.conv1d)?,
                    params: GdnParams {
                        a_log: b.upload_vec(&g.a_log)?,
                        dt_bias: b.upload_vec(&g.dt_bias)?,
                        norm: b.upload_vec(&g.norm)?,
                    },
                    out_proj: b.upload_mat(&g.out_proj)?,
                }),
                Mixer::Attn(a) => MixerLayer::Attn(AttnLayer {
                    q_proj: b.upload_mat(&a.q_proj)?,
                    k_proj: b.upload_mat(&a.k_proj)?,
                    v_proj: b.upload_mat(&a.v_proj)?,
                    o_proj: b.upload_mat(&a.o_proj)?,
                    q_norm: b.upload_vec(&a.q_norm)?,
                    k_norm: b.upload_vec(&a.k_norm)?,
                }),
            };
            let m = &l.moe;
            layers.push(Layer {
                input_norm: b.upload_vec(&l.input_norm)?,
                post_norm: b.upload_vec(&l.post_norm)?,
                mixer,
                moe: MoeLayer {
                    router: b.upload_mat(&m.router)?,
                    gate_proj: b.upload_mat(&m.gate_proj)?,
                    up_proj: b.upload_mat(&m.up_proj)?,
                    down_proj: b.upload_mat(&m.down_proj)?,
                    shared_gate_proj: b.upload_mat(&m.shared_gate_proj)?,
                    shared_up_proj: b.upload_mat(&m.shared_up_proj)?,
                    shared_down_proj: b.upload_mat(&m.shared_down_proj)?,
                    shared_expert_gate: b.upload_mat(&m.shared_expert_gate)?,
                },
            });
            progress(layers.len(), w.layers.len());
        }
        Ok(Self {
            dims: Dims::from_config(&cfg),
            embed: b.upload_mat(&w.embed)?,
            norm: b.upload_vec(&w.norm)?,
            lm_head: b.upload_mat(&w.lm_head)?,
            layers,
            cfg,
            backend,
            chunk,
            lookahead: std::env::var("LILY_LOOKAHEAD").as_deref() != Ok("0"),
            scratch: std::sync::Mutex::new(None),
        })
    }

    /// Lets the backend build a decode step's kernels now (`Backend::warm_up`), on a state of
    /// up to 256 positions made for it and dropped: the first request then does not wait for
    /// them. A backend with nothing to build does not make the state.
    pub fn warm_up(&self) -> Result<()> {
        let b = &self.backend;
        b.warm_up(&mut || {
            let mut st = self.new_state(self.cfg.max_position_embeddings.clamp(1, 256))?;
            st.reserve(b, &self.dims, 1)?;
            let mut guard = self.scratch_for(1)?;
            let s = guard.as_mut().expect("just made");
            self.decode_ops(&mut st, s, &mut Pick::Argmax)
        })
    }

    pub fn new_state(&self, max_context: usize) -> Result<SeqState<B>> {
        SeqState::new(&self.backend, &self.cfg, max_context)
    }

    /// Feeds `ids` after the state's current position. Returns the requested logits (host f32,
    /// `[1 or rows, vocab]`); one token without taps is a [`Self::decode`] step. With `taps`, the residual stream after each layer is appended
    /// (`[rows, hidden]` per layer, per chunk) — for tests against the oracle.
    pub fn forward(
        &self,
        st: &mut SeqState<B>,
        ids: &[u32],
        want: Logits,
        mut taps: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Vec<f32>> {
        if ids.is_empty() {
            bail!("forward: no tokens");
        }
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            bail!(
                "token id {bad} is out of range (vocab_size {})",
                self.cfg.vocab_size
            );
        }
        if st.pos + ids.len() > st.max_context {
            bail!(
                "context length exceeded: {} tokens in the state + {} new > {} max",
                st.pos,
                ids.len(),
                st.max_context
            );
        }
        if ids.len() == 1 && taps.is_none() {
            // The decode path (recorded and replayed); its logits are read back.
            if want == Logits::Device {
                self.decode_step(st, Some(ids[0]), None)?;
                return Ok(Vec::new());
            }
            return match self.decode(st, Some(ids[0]), want == Logits::None)? {
                Next::Logits(l) => Ok(l),
                Next::Token(_) => Ok(Vec::new()),
            };
        }
        // Room for the token these logits pick too: a prompt that fills the KV cache's capacity
        // (a power of two) would otherwise grow it at the first decode step, on the path to the
        // second token (the cache copied, the step recorded anew for the new buffers).
        // `LILY_PREFILL_ROOM=0` reserves the prompt alone, as before stop 44 (to measure it).
        let room = usize::from(prefill_room());
        let need = (st.pos + ids.len() + room).min(st.max_context);
        st.reserve(&self.backend, &self.dims, need)?;
        let mut out = Vec::new();
        let n_chunks = ids.len().div_ceil(self.chunk);
        for (i, part) in ids.chunks(self.chunk).enumerate() {
            let w = match want {
                Logits::All => Logits::All,
                Logits::Last if i + 1 == n_chunks => Logits::Last,
                Logits::Device if i + 1 == n_chunks => Logits::Device,
                _ => Logits::None,
            };
            let tap_start = taps.as_ref().map(|t| t.len());
            out.extend(self.forward_chunk(st, part, w, taps.as_deref_mut())?);
            // Concatenate per-layer taps across chunks.
            if let (Some(t), Some(s)) = (taps.as_deref_mut(), tap_start) {
                if s > 0 {
                    let new: Vec<Vec<f32>> = t.drain(s..).collect();
                    for (dst, src) in t.iter_mut().zip(new) {
                        dst.extend(src);
                    }
                }
            }
        }
        Ok(out)
    }

    /// One decode step: feeds `feed` at the state's position — or, with `None`, the token the
    /// previous step picked on the backend, which never leaves the device — and computes the next
    /// token: its greedy pick (`greedy`, 4 bytes read back) or its logits.
    pub fn decode(&self, st: &mut SeqState<B>, feed: Option<u32>, greedy: bool) -> Result<Next> {
        self.decode_step(st, feed, None)?;
        if greedy {
            Ok(Next::Token(self.picked(st)?))
        } else {
            Ok(Next::Logits(self.step_logits()?))
        }
    }

    /// Enqueues one decode step (nothing is read back): feeds `feed`, or with `None` the token
    /// the previous step picked on the backend, and picks the next token there: drawn by
    /// `sampler`, or the greedy arg-max without one. [`Self::picked`] reads the pick,
    /// [`Self::step_logits`] / [`Self::logprobs`] the step's logits. On a device the step runs
    /// while the host goes on (until it reads).
    pub fn decode_step(
        &self,
        st: &mut SeqState<B>,
        feed: Option<u32>,
        sampler: Option<&mut DeviceSampler<B>>,
    ) -> Result<()> {
        self.decode_step_ex(st, feed, Pick::from(sampler))
    }

    /// [`Self::decode_step`] with the pick chosen: `Pick::Later` computes the logits only (the
    /// step records without a pick), for [`Self::pick_masked`] once a grammar's mask is known.
    pub fn decode_step_ex(
        &self,
        st: &mut SeqState<B>,
        feed: Option<u32>,
        mut pick: Pick<'_, B>,
    ) -> Result<()> {
        let b = &self.backend;
        match feed {
            Some(id) if id as usize >= self.cfg.vocab_size => bail!(
                "token id {id} is out of range (vocab_size {})",
                self.cfg.vocab_size
            ),
            Some(id) => b.set_step(&mut st.step, id, st.pos),
            None if !st.step_ready => bail!("decode: no token was picked on the backend to feed"),
            None => {}
        }
        if st.pos + 1 > st.max_context {
            bail!(
                "context length exceeded: {} tokens in the state + 1 new > {} max",
                st.pos,
                st.max_context
            );
        }
        st.reserve(b, &self.dims, st.pos + 1)?;
        let mut guard = self.scratch_for(1)?;
        let s = guard.as_mut().expect("just made");
        let later = matches!(pick, Pick::Later);
        let key = step_key(st, s, pick_sid(&pick));
        let r = b.replay(key, &mut || self.decode_ops(st, s, &mut pick));
        st.step_ready = r.is_ok() && !later;
        r?;
        st.pos += 1;
        Ok(())
    }

    /// Picks the next token from the last step's logits (a `Pick::Later` step, or a forward's
    /// last position) under a grammar's mask (`Backend::mask_logits`: `allowed` as u32 words,
    /// LSB first): drawn by `sampler`, or the arg-max. The logits keep the mask afterwards.
    pub fn pick_masked(
        &self,
        st: &mut SeqState<B>,
        allowed: &[u32],
        sampler: Option<&mut DeviceSampler<B>>,
    ) -> Result<()> {
        if st.pos == 0 {
            bail!("pick_masked: nothing was fed");
        }
        let b = &self.backend;
        let v = self.cfg.vocab_size;
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let s = guard
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("pick_masked: no logits were computed"))?;
        b.mask_logits(&mut s.logits, v, allowed);
        // The step's position is the fed token's; the pick moves it on by one, as in a step.
        b.set_step(&mut st.step, 0, st.pos - 1);
        match sampler {
            Some(d) => b.sample_step(&s.logits, v, &mut d.inner, &mut st.step),
            None => b.argmax_step(&s.logits, v, &mut st.step),
        }
        st.step_ready = true;
        Ok(())
    }

    /// The token the last step picked on the backend (waits for it: 4 bytes read back).
    pub fn picked(&self, st: &SeqState<B>) -> Result<u32> {
        if !st.step_ready {
            bail!("picked: no token was picked on the backend");
        }
        self.backend.step_token(&st.step)
    }

    /// The token the last step picked, read while `next` runs: its read begins (a copy queued
    /// behind the step), then `next` is enqueued — the step that feeds this token from the
    /// backend and picks the one after it — and only then does the host wait, for the copy
    /// alone. A device so always has a step queued while the host works out this token (the
    /// one-step lookahead of the decode loops). The state then holds the returned token too.
    pub fn picked_ahead(&self, st: &mut SeqState<B>, next: Pick<'_, B>) -> Result<u32> {
        if !st.step_ready {
            bail!("picked_ahead: no token was picked on the backend");
        }
        let read = self.backend.step_token_begin(&st.step)?;
        self.decode_step_ex(st, None, next)?;
        self.backend.step_token_finish(read)
    }

    /// The logits `[vocab]` of the last step or of a forward's last position (read back).
    pub fn step_logits(&self) -> Result<Vec<f32>> {
        let guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let s = guard
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("step_logits: nothing was computed yet"))?;
        self.backend.to_host(&s.logits, self.cfg.vocab_size)
    }

    /// OpenAI log-probabilities from the raw logits of the last step (or of a forward's last
    /// position): `token`'s and the `n` most likely (`Backend::logprobs`: on a device only
    /// these are read back). Call before the next step is enqueued.
    pub fn logprobs(&self, token: u32, n: usize) -> Result<(f32, Vec<(u32, f32)>)> {
        let guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let s = guard
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("logprobs: nothing was computed yet"))?;
        self.backend
            .logprobs(&s.logits, self.cfg.vocab_size, token, n)
    }

    /// A sampler on the backend for `params` with `seed` (see `Backend::new_sampler`); `None`
    /// when the backend leaves these parameters to the host.
    pub fn device_sampler(
        &self,
        params: &SamplingParams,
        seed: u64,
        prompt: &[u32],
    ) -> Result<Option<DeviceSampler<B>>> {
        Ok(self
            .backend
            .new_sampler(params, seed, self.cfg.vocab_size, prompt)?
            .map(|inner| DeviceSampler {
                inner,
                id: crate::model::state::new_buffers_id(),
            }))
    }

    /// Draws the next token from the logits of a forward's last position (`Logits::Last`) into
    /// the state's step, as a decode step does: the first token of a generation.
    pub fn sample_last(&self, st: &mut SeqState<B>, sampler: &mut DeviceSampler<B>) -> Result<()> {
        if st.pos == 0 {
            bail!("sample_last: nothing was fed");
        }
        let b = &self.backend;
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let s = guard
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("sample_last: no logits were computed"))?;
        b.set_step(&mut st.step, 0, st.pos - 1);
        b.sample_step(
            &s.logits,
            self.cfg.vocab_size,
            &mut sampler.inner,
            &mut st.step,
        );
        st.step_ready = true;
        Ok(())
    }

    /// Records the decode step after the state's position ahead (`Backend::prerecord`) for its
    /// pick, after a prefill that left its logits on the device (`Logits::Device`) and picked
    /// there (`sample_last`): the host records while the device still runs the prefill. A
    /// no-op without the prefill's room for the step's KV row, or on a backend that records
    /// nothing ahead.
    pub fn prerecord_next(&self, st: &mut SeqState<B>, mut pick: Pick<'_, B>) -> Result<()> {
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        match guard.as_mut() {
            Some(s) => self.prerecord_with(st, s, &mut pick),
            None => Ok(()),
        }
    }

    /// `prerecord_next` with the scratch held: the step's key as `decode_step_ex` makes it,
    /// where the KV caches already have room for the step (else the step grows them: new
    /// buffers, another key).
    fn prerecord_with(
        &self,
        st: &mut SeqState<B>,
        s: &mut Scratch<B>,
        pick: &mut Pick<'_, B>,
    ) -> Result<()> {
        if st.pos >= st.max_context || !st.has_room(st.pos + 1) {
            return Ok(());
        }
        let key = step_key(st, s, pick_sid(pick));
        self.backend
            .prerecord(key, &mut || self.decode_ops(st, s, pick))
    }

    /// Counts `token` for the sampler's penalties without a draw (a forced token).
    pub fn note(&self, sampler: &mut DeviceSampler<B>, token: u32) {
        self.backend.sample_note(&mut sampler.inner, token)
    }

    /// The ops of a decode step (recorded): the layers on the step's token, the logits of the
    /// next token, and its pick (drawn by `sampler`, or the greedy arg-max) written back to the
    /// step (position + 1).
    fn decode_ops(
        &self,
        st: &mut SeqState<B>,
        s: &mut Scratch<B>,
        pick: &mut Pick<'_, B>,
    ) -> Result<()> {
        let (b, d) = (&self.backend, &self.dims);
        let hd = self.cfg.hidden_size;
        // logits = lm_head(rms_norm(h, norm)), x staged by the last MoE block where it could.
        let ahead = self.layers_ops(st, s, None, 1, None)?;
        let (ws, mut outs) = ([&self.lm_head], [&mut s.logits]);
        norm_matmul(
            b, ahead, &s.h, &self.norm, 1, hd, d.eps, &mut s.xn, &ws, &mut outs,
        );
        match pick {
            Pick::Sample(d) => {
                b.sample_step(&s.logits, self.cfg.vocab_size, &mut d.inner, &mut st.step)
            }
            Pick::Argmax => b.argmax_step(&s.logits, self.cfg.vocab_size, &mut st.step),
            Pick::Later => {}
        }
        Ok(())
    }

    /// The scratch, grown to at least `t` rows (a prefill's chunk at once: no regrowth later).
    fn scratch_for(&self, t: usize) -> Result<std::sync::MutexGuard<'_, Option<Scratch<B>>>> {
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if guard.as_ref().is_none_or(|s| s.rows < t) {
            *guard = Some(Scratch::new(
                &self.backend,
                &self.cfg,
                if t == 1 { 1 } else { t.max(self.chunk) },
            )?);
        }
        Ok(guard)
    }

    /// One chunk of ≤ `chunk` prompt tokens, then the requested logits. After the last position's
    /// logits the state's step holds their greedy pick, ready for [`Self::decode`] with `None`.
    fn forward_chunk(
        &self,
        st: &mut SeqState<B>,
        ids: &[u32],
        want: Logits,
        mut taps: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Vec<f32>> {
        let b = &self.backend;
        let d = &self.dims;
        let c = &self.cfg;
        let t = ids.len();
        let hd = c.hidden_size;
        let mut guard = self.scratch_for(t)?;
        let s = guard.as_mut().expect("just made");
        if t == 1 {
            // A single token (with taps) still takes the decode ops, which read the step.
            b.set_step(&mut st.step, ids[0], st.pos);
        }
        self.layers_ops(st, s, (t > 1).then_some(ids), t, taps.as_deref_mut())?;
        st.pos += t;
        st.step_ready = false;
        if let Some(tp) = taps {
            tp.push(b.to_host(&s.h, t * hd)?);
        }
        // logits = lm_head(rms_norm(h, norm))
        let v = c.vocab_size;
        match want {
            Logits::None => Ok(Vec::new()),
            Logits::Last | Logits::Device => {
                b.copy(&s.h, (t - 1) * hd, &mut s.last, 0, hd);
                b.rms_norm(&s.last, &self.norm, 1, hd, d.eps, &mut s.xn);
                b.matmul_q(&s.xn, &self.lm_head, 1, &mut s.logits);
                b.set_step(&mut st.step, 0, st.pos - 1);
                b.argmax_step(&s.logits, v, &mut st.step);
                st.step_ready = true;
                // The greedy decode step after this one recorded while the device runs the
                // prefill: the host's ~1-3 ms of recording (H100, stop 45) is then off the path
                // to the second token.
                if st.greedy_next {
                    self.prerecord_with(st, s, &mut Pick::Argmax)?;
                }
                if want == Logits::Device {
                    return Ok(Vec::new());
                }
                b.to_host(&s.logits, v)
            }
            Logits::All => {
                b.rms_norm(&s.h, &self.norm, t, hd, d.eps, &mut s.xn);
                let mut logits = b.zeros(t * v)?;
                b.matmul_q(&s.xn, &self.lm_head, t, &mut logits);
                b.to_host(&logits, t * v)
            }
        }
    }

    /// The list of named ops over every layer for `t` tokens at the state's position: `ids`
    /// (a prefill) or the step's token (`None`, the decode ops). Each residual add lands in the
    /// f32 stream `s.h` (on a GPU decode step inside the kernel that produces it), and each norm
    /// is fused with the projections that read it. Returns whether the last MoE block staged the
    /// final norm's x (`Backend::norm_ahead`).
    fn layers_ops(
        &self,
        st: &mut SeqState<B>,
        s: &mut Scratch<B>,
        ids: Option<&[u32]>,
        t: usize,
        mut taps: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<bool> {
        let b = &self.backend;
        let d = &self.dims;
        let hd = self.cfg.hidden_size;
        let decode = ids.is_none();
        // Whether the MoE block before staged this layer's x (a decode step's
        // Backend::norm_ahead).
        let mut x_ahead = false;
        let pos0 = st.pos;
        let step = &st.step;
        match ids {
            Some(ids) => b.embed(&self.embed, ids, &mut s.h),
            None => b.embed_step(&self.embed, step, &mut s.h),
        }
        for (i, (layer, ls)) in self.layers.iter().zip(st.layers.iter_mut()).enumerate() {
            if i > 0 {
                if let Some(tp) = taps.as_deref_mut() {
                    tp.push(b.to_host(&s.h, t * hd)?);
                }
            }
            // A decode step may fold the MoE block's router into the mixer's output projection
            // (Backend::route_ahead): the projection then leaves the router's sums for moe().
            let next = RouteAhead {
                router: &layer.moe.router,
                shared_gate: &layer.moe.shared_expert_gate,
                norm: &layer.post_norm,
            };
            let out_proj = match &layer.mixer {
                MixerLayer::Gdn(g) => &g.out_proj,
                MixerLayer::Attn(a) => &a.o_proj,
            };
            let ahead = (decode && b.route_ahead(out_proj, &next)).then_some(next);
            // h = h + mixer(rms_norm(h, input_norm))
            match (&layer.mixer, ls) {
                (MixerLayer::Gdn(g), LayerState::Gdn { conv, ssm }) if decode => {
                    let w = GdnWeights {
                        in_proj: [&g.in_proj_qkv, &g.in_proj_z, &g.in_proj_b, &g.in_proj_a],
                        conv1d: &g.conv1d,
                        params: &g.params,
                        out_proj: &g.out_proj,
                        route_ahead: ahead,
                        x_ahead,
                    };
                    let tmp = GdnScratch {
                        xn: &mut s.xn,
                        qkv: &mut s.qkv,
                        qkv_c: &mut s.qkv_c,
                        z: &mut s.z,
                        b: &mut s.b,
                        a: &mut s.a,
                        y: &mut s.y,
                        r: &mut s.r,
                    };
                    b.gdn_mixer_decode_add(
                        &mut s.h,
                        &layer.input_norm,
                        d.eps,
                        &w,
                        conv,
                        ssm,
                        d,
                        tmp,
                    );
                }
                (MixerLayer::Gdn(g), LayerState::Gdn { conv, ssm }) => {
                    b.rms_norm_matmul(
                        &s.h,
                        &layer.input_norm,
                        t,
                        hd,
                        d.eps,
                        &mut s.xn,
                        &[&g.in_proj_qkv, &g.in_proj_z, &g.in_proj_b, &g.in_proj_a],
                        &mut [&mut s.qkv, &mut s.z, &mut s.b, &mut s.a],
                    );
                    b.conv1d_prefill(&s.qkv, &g.conv1d, conv, d, t, &mut s.qkv_c);
                    b.gdn_prefill(&s.qkv_c, &s.z, &s.b, &s.a, &g.params, ssm, d, t, &mut s.y);
                    b.matmul_q_add(&s.y, &g.out_proj, t, &mut s.r, &mut s.h);
                }
                (MixerLayer::Attn(a), LayerState::Attn(kv)) => {
                    let qkv = [&a.q_proj, &a.k_proj, &a.v_proj];
                    let mut outs = [&mut s.qg, &mut s.k, &mut s.v];
                    let (h, w, xn) = (&s.h, &layer.input_norm, &mut s.xn);
                    norm_matmul(b, x_ahead, h, w, t, hd, d.eps, xn, &qkv, &mut outs);
                    if decode {
                        // attn_qk_norm_rope + attn_decode, then h = h + o_proj(o) (a GPU may
                        // fold the first two into one launch and stage o_proj's x in the last)
                        let o = OProj {
                            w: &a.o_proj,
                            r: &mut s.r,
                            h: &mut s.h,
                            next: ahead,
                        };
                        let at = AttnStep {
                            qg: &s.qg,
                            k: &mut s.k,
                            v: &s.v,
                            q_norm: &a.q_norm,
                            k_norm: &a.k_norm,
                            kv,
                            d,
                            pos: pos0,
                            step,
                            q: &mut s.q,
                            gate: &mut s.gate,
                            out: &mut s.o,
                        };
                        b.attn_decode_qk_add(at, o);
                    } else {
                        b.attn_qk_norm_rope(
                            &s.qg,
                            &mut s.k,
                            &a.q_norm,
                            &a.k_norm,
                            d,
                            t,
                            pos0,
                            None,
                            &mut s.q,
                            &mut s.gate,
                        );
                        b.attn_prefill(&s.q, &s.k, &s.v, &s.gate, kv, d, t, pos0, &mut s.o);
                        b.matmul_q_add(&s.o, &a.o_proj, t, &mut s.r, &mut s.h);
                    }
                }
                _ => bail!("layer {i}: state does not match the layer kind"),
            }
            // h = h + moe(rms_norm(h, post_norm)), staging the next norm's x where it can
            let next = self.layers.get(i + 1).map_or(&self.norm, |l| &l.input_norm);
            x_ahead = self.moe(layer, s, t, decode, ahead.is_some(), next);
        }
        Ok(x_ahead)
    }

    /// h += Σ_j w_j · expert_j(x) + sigmoid(shared_gate(x)) · shared_expert(x), x = rms_norm(h, post_norm).
    /// `ahead`: the projection before folded the router (Backend::route_ahead). A decode step
    /// may stage the x of the op after the block (`next`, its norm): returns whether it did
    /// (Backend::norm_ahead).
    fn moe(
        &self,
        layer: &Layer<B>,
        s: &mut Scratch<B>,
        t: usize,
        decode: bool,
        ahead: bool,
        next: &B::Vec,
    ) -> bool {
        let b = &self.backend;
        let d = &self.dims;
        let m = &layer.moe;
        let hd = self.cfg.hidden_size;
        let tmp = MoeScratch {
            out: &mut s.moe,
            g: &mut s.sg,
            u: &mut s.su,
            act: &mut s.sa,
            down: &mut s.sd,
        };
        if decode {
            // One token: the router and the experts as one op (a GPU folds them together).
            let mut w = MoeWeights {
                router: &m.router,
                shared_gate: &m.shared_expert_gate,
                gate: &m.gate_proj,
                up: &m.up_proj,
                down: &m.down_proj,
                shared_gate_proj: &m.shared_gate_proj,
                shared_up_proj: &m.shared_up_proj,
                shared_down_proj: &m.shared_down_proj,
                next_norm: None,
            };
            if b.norm_ahead(&w, next, d) {
                w.next_norm = Some(next);
            }
            let r = RouterScratch {
                xn: &mut s.xn,
                logits: &mut s.router_logits,
                s: &mut s.s,
                route: &mut s.route,
                ahead,
            };
            b.moe_step_add(&mut s.h, &layer.post_norm, d.eps, &w, d, r, tmp);
            return w.next_norm.is_some();
        }
        b.moe_router(
            &s.h,
            &layer.post_norm,
            t,
            d.eps,
            &mut s.xn,
            &m.router,
            &m.shared_expert_gate,
            d,
            &mut s.router_logits,
            &mut s.s,
            &mut s.route,
        );
        let shared = SharedExpert {
            gate: &m.shared_gate_proj,
            up: &m.shared_up_proj,
            down: &m.shared_down_proj,
            logit: &s.s,
        };
        b.moe_experts_prefill(
            &s.xn,
            &s.route,
            &m.gate_proj,
            &m.up_proj,
            &m.down_proj,
            d,
            t,
            &mut *tmp.out,
        );
        add_shared_expert(b, &s.xn, &shared, t, hd, tmp);
        b.add(&mut s.h, &s.moe, t * hd);
        false
    }
}

/// `rms_norm_matmul` of `t` rows, or of one decode row whose x the MoE block before staged
/// (`ahead`: Backend::norm_ahead said yes; `rms_norm_matmul_ahead`).
#[allow(clippy::too_many_arguments)]
fn norm_matmul<B: Backend>(
    b: &B,
    ahead: bool,
    h: &B::Buf,
    w: &B::Vec,
    t: usize,
    dim: usize,
    eps: f32,
    xn: &mut B::Buf,
    ws: &[&B::Mat],
    outs: &mut [&mut B::Buf],
) {
    if ahead {
        b.rms_norm_matmul_ahead(h, w, dim, eps, xn, ws, outs);
    } else {
        b.rms_norm_matmul(h, w, t, dim, eps, xn, ws, outs);
    }
}

/// A pick's part of a decode step's record key: a sampler's buffers and parameters are part of
/// the record (its own key); a step without a pick is another record.
fn pick_sid<B: Backend>(pick: &Pick<'_, B>) -> u64 {
    match pick {
        Pick::Argmax => 0,
        Pick::Sample(d) => d.id.wrapping_mul(0xD1B5_4A32_D192_ED03),
        Pick::Later => 0x5157_4E4F_5049_434B,
    }
}

/// A decode step's record key: the state's buffers, the scratch's, and the pick's kind (`sid`:
/// 0 the greedy arg-max; a sampler's buffers and parameters are part of the record).
fn step_key<B: Backend>(st: &SeqState<B>, s: &Scratch<B>, sid: u64) -> u64 {
    st.buffers_id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ s.id ^ sid
}

/// Whether a prefill reserves the KV cache for the token its logits pick (`LILY_PREFILL_ROOM`,
/// on unless `0`; read once).
fn prefill_room() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("LILY_PREFILL_ROOM").as_deref() != Ok("0"))
}
