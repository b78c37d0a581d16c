//! The op vocabulary the forward pass is written against.
//!
//! Ops are named after what the model does (DESIGN.md), not a general tensor algebra. Prefill and
//! decode are separate ops where they are different algorithms (attention, conv, GDN, experts).
//! One op keeps one name here, in the CPU file, in a GPU kernel file and in its test.
//!
//! Buffers are row-major `[rows, cols]` activations owned by the backend (`f32` on the CPU);
//! shapes are passed explicitly so a device backend needs no host metadata.
//!
//! Element types by role (a device backend may store activations narrower than f32, the CPU is
//! the f32 reference): **activations** passed between ops ([`Backend::act_zeros`]: bf16 on CUDA)
//! and **f32** buffers ([`Backend::zeros`]): the residual stream `h` (a sum over 40 layers, an
//! accumulator), logits and router logits (sampling and expert choice compare them), the shared
//! expert's gate logit, the GDN and conv states. Each op's doc says which of its buffers are f32;
//! every other buffer is an activation. `matmul_q`'s output may be either, by the buffer given.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod profile;
pub mod trace;
#[cfg(feature = "wgpu")]
pub mod wgpu;

use anyhow::Result;

use crate::loader::tensor::HostLinear;
use crate::runtime::sampler::SamplingParams;

/// Per-sequence shapes the ops need (copied from the config once).
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub hidden: usize,
    pub eps: f32,
    // attention
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub rope_theta: f64,
    // Gated DeltaNet
    pub gdn_k_heads: usize,
    pub gdn_v_heads: usize,
    pub gdn_k_dim: usize,
    pub gdn_v_dim: usize,
    pub conv_kernel: usize,
    // MoE
    pub n_experts: usize,
    pub top_k: usize,
    pub norm_topk: bool,
}

impl Dims {
    pub fn from_config(c: &crate::Config) -> Self {
        Self {
            hidden: c.hidden_size,
            eps: c.rms_norm_eps as f32,
            n_heads: c.num_attention_heads,
            n_kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            rotary_dim: c.rotary_dim(),
            rope_theta: c.rope_theta,
            gdn_k_heads: c.linear_num_key_heads,
            gdn_v_heads: c.linear_num_value_heads,
            gdn_k_dim: c.linear_key_head_dim,
            gdn_v_dim: c.linear_value_head_dim,
            conv_kernel: c.linear_conv_kernel_dim,
            n_experts: c.num_experts,
            top_k: c.num_experts_per_tok,
            norm_topk: c.norm_topk_prob,
        }
    }
    /// Channels of the GDN conv: q | k | v.
    pub fn conv_channels(&self) -> usize {
        2 * self.gdn_k_heads * self.gdn_k_dim + self.gdn_v_heads * self.gdn_v_dim
    }
}

/// A backend: where buffers live and how each op runs.
pub trait Backend: Send + Sync {
    /// An activation / state buffer of f32-valued elements (storage type is the backend's).
    type Buf: Send;
    /// A matrix (or stack of expert matrices) resident on the backend.
    type Mat: Send + Sync;
    /// A small parameter vector (norm weights, gate parameters, conv taps).
    type Vec: Send + Sync;
    /// Expert routing of a block of tokens: chosen expert ids and their weights.
    type Route: Send;
    /// A decode step's token and position, held where the ops run. On a GPU `argmax_step` writes
    /// the next token here and the next step's `embed_step` reads it: the decode loop feeds its
    /// tokens without a host round trip, and a recorded step (`replay`) reads its position here.
    type Step: Send;
    /// One sequence's sampler on the backend (`new_sampler`): its parameters, generator state
    /// and penalty counts, kept where the ops run so that a sampled decode step needs no host
    /// input and reads back only the token.
    type Sampler: Send;

    fn name(&self) -> String;
    /// Waits until every op enqueued so far has finished (a device backend's stream), returning
    /// the first error of any op; backends whose ops are synchronous keep the default.
    fn sync(&self) -> Result<()> {
        Ok(())
    }

    /// Tokens per prefill block. 256 keeps a CPU's working set in cache; a GPU wants long blocks
    /// so each expert's weights are streamed once for many rows.
    fn prefill_chunk(&self) -> usize {
        256
    }

    /// The device's own ceilings, measured now (`lily bench` divides by them). `None`: the
    /// backend has no measurement of its own and the bench measures the CPU it runs on.
    fn measure_ceilings(&self) -> Option<Result<Ceilings>> {
        None
    }

    /// Runs `ops`, the enqueueing of one decode step. A device backend records them the first
    /// time after a warm-up (a CUDA graph) and from then on replays the record while `key` is
    /// the same, skipping the host work and the launch cost of each op. The caller changes `key`
    /// whenever any buffer the ops touch or any host-side shape changes; every value that moves
    /// from step to step must be read from a `Step`. The default runs them.
    fn replay(&self, key: u64, ops: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let _ = key;
        ops()
    }

    /// Records `ops`, one decode step's enqueueing under `key`, without running them, so that
    /// the step's first run replays: called while the device still runs the prefill before
    /// it, the host's recording overlaps that instead of delaying the first decode step. A
    /// backend that records nothing ahead (the default, and the CPU) does nothing: `ops` is not
    /// called. The same rules as `replay` hold for `key` and `ops`, which must not change
    /// host-side state that the step's real run would change again.
    fn prerecord(&self, key: u64, ops: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let _ = (key, ops);
        Ok(())
    }

    /// Builds what `ops` (one decode step's enqueueing, on a state made for the purpose) needs
    /// on the device, without running them or keeping a record: a backend that compiles its
    /// kernels at their first use (wgpu's pipelines) compiles the decode step's when the model
    /// loads, not in the first request. The default does nothing: `ops` is not called.
    fn warm_up(&self, ops: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let _ = ops;
        Ok(())
    }

    /// Names the op family whose device work is enqueued next, for a backend that times its
    /// kernels on the device (`device_times`); the `Profiled` wrapper calls it before each op.
    fn label(&self, family: &str) {
        let _ = family;
    }

    /// Device time per kernel from the device's own clock (timestamp queries): `true` starts
    /// timing every kernel (totals cleared), `false` stops and returns the totals per `family ·
    /// kernel`. `None`: the backend cannot (the CPU; CUDA has Nsight Compute).
    fn device_times(&self, on: bool) -> Option<profile::Report> {
        let _ = on;
        None
    }

    // ---- memory
    fn upload_mat(&self, m: &HostLinear) -> Result<Self::Mat>;
    fn upload_vec(&self, v: &[f32]) -> Result<Self::Vec>;
    /// `(out, inp)` of each matrix of an uploaded stack.
    fn mat_shape(&self, m: &Self::Mat) -> (usize, usize);
    /// A zero-filled buffer of `len` elements.
    fn zeros(&self, len: usize) -> Result<Self::Buf>;
    /// A zero-filled activation buffer of `len` elements, in the backend's activation type: f32
    /// by default (the CPU); the CUDA backend stores bf16 (products and sums inside its kernels stay
    /// f32), which halves the bytes between ops. `to_host` widens it to f32.
    fn act_zeros(&self, len: usize) -> Result<Self::Buf> {
        self.zeros(len)
    }
    /// Bytes per element of an [`Backend::act_zeros`] buffer.
    fn act_elem_bytes(&self) -> usize {
        4
    }
    /// A zero-filled KV-cache buffer of `len` elements, stored in the backend's KV element type:
    /// f32 by default (the CPU, the reference); the CUDA backend keeps bf16, which halves the
    /// bytes long-context attention reads. Such a buffer goes only to the attention ops, to
    /// `copy` with another KV buffer, and to `to_host` (which widens it to f32).
    fn kv_zeros(&self, len: usize) -> Result<Self::Buf> {
        self.zeros(len)
    }
    /// Bytes per element of a [`Backend::kv_zeros`] buffer (memory accounting, the bench's roofline).
    fn kv_elem_bytes(&self) -> usize {
        4
    }
    fn to_host(&self, b: &Self::Buf, len: usize) -> Result<Vec<f32>>;
    /// `dst[dst_off .. dst_off+len] = src[src_off .. src_off+len]`.
    fn copy(
        &self,
        src: &Self::Buf,
        src_off: usize,
        dst: &mut Self::Buf,
        dst_off: usize,
        len: usize,
    );
    fn new_route(&self, rows: usize, top_k: usize) -> Result<Self::Route>;
    fn new_step(&self) -> Result<Self::Step>;
    /// Host → step: the token to feed next and its position.
    fn set_step(&self, step: &mut Self::Step, token: u32, pos: usize);
    /// The step's token (after the work enqueued so far).
    fn step_token(&self, step: &Self::Step) -> Result<u32>;
    /// Begins reading the step's token as it is after the work enqueued so far, before anything
    /// enqueued later: a device queues a copy into host-readable memory and returns at once, so
    /// the caller can enqueue the next step (which overwrites the step's token) before it waits.
    /// [`Backend::step_token_finish`] waits for that copy only. The default reads now.
    fn step_token_begin(&self, step: &Self::Step) -> Result<TokenRead> {
        Ok(TokenRead::Ready(self.step_token(step)?))
    }
    /// The token of a read begun by [`Backend::step_token_begin`]: waits for its copy, not for
    /// the work enqueued after it (errors of ops enqueued before it are reported here).
    fn step_token_finish(&self, read: TokenRead) -> Result<u32> {
        match read {
            TokenRead::Ready(t) => Ok(t),
            TokenRead::Pending(_) => {
                anyhow::bail!("step_token_finish: a read this backend did not begin")
            }
        }
    }

    // ---- embedding, norms, projections
    /// `out[t] = dequant(table[ids[t]])`. `out` is f32 (the residual stream).
    fn embed(&self, table: &Self::Mat, ids: &[u32], out: &mut Self::Buf);
    /// `out[0] = dequant(table[step.token])` (the decode step's input).
    fn embed_step(&self, table: &Self::Mat, step: &Self::Step, out: &mut Self::Buf);
    /// `out[t] = rms_norm(x[t]) * w` over `dim`. `x` is f32 (the residual stream).
    fn rms_norm(
        &self,
        x: &Self::Buf,
        w: &Self::Vec,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Self::Buf,
    );
    /// `h[t] += r[t]; out[t] = rms_norm(h[t]) * w`: the residual add fused with the next norm.
    /// `h` is f32.
    fn add_rms_norm(
        &self,
        h: &mut Self::Buf,
        r: &Self::Buf,
        w: &Self::Vec,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Self::Buf,
    );
    /// `out[t] = x[t] · Wᵀ` for a (quantized) matrix; `x` is `[rows, in]`, `out` `[rows, out]`.
    fn matmul_q(&self, x: &Self::Buf, w: &Self::Mat, rows: usize, out: &mut Self::Buf);
    /// `outs[i] = matmul_q(x, ws[i])` for matrices that read the same input (a GDN layer's four
    /// projections, attention's q/k/v, the router and the shared-expert gate): one launch on a
    /// GPU for a decode row. The default runs them one by one.
    fn matmul_q_many(
        &self,
        x: &Self::Buf,
        ws: &[&Self::Mat],
        rows: usize,
        outs: &mut [&mut Self::Buf],
    ) {
        for (w, o) in ws.iter().zip(outs.iter_mut()) {
            self.matmul_q(x, w, rows, o);
        }
    }
    /// `h[t] += r[t]`. `h` is f32.
    fn add(&self, h: &mut Self::Buf, r: &Self::Buf, len: usize);

    // ---- fused forms (a GPU decode step folds the small ops into the weight-streaming kernels;
    // each default composes the ops above, which makes it the CPU twin)
    /// `xn[t] = rms_norm(h[t]) * w` over `dim`, then `outs[i] = matmul_q(xn, ws[i])`: the norm
    /// before a layer's projections. `h` is f32; `xn` is written too (the experts read it). A GPU
    /// decode step normalises `h` inside each block of the projections' launch (8 KB) instead of
    /// launching a norm.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_matmul(
        &self,
        h: &Self::Buf,
        w: &Self::Vec,
        rows: usize,
        dim: usize,
        eps: f32,
        xn: &mut Self::Buf,
        ws: &[&Self::Mat],
        outs: &mut [&mut Self::Buf],
    ) {
        self.rms_norm(h, w, rows, dim, eps, xn);
        self.matmul_q_many(xn, ws, rows, outs);
    }
    /// An MoE block's router: `xn = rms_norm(h) · w`, its f32 router `logits` and shared-expert
    /// gate logit `s`, then `route = moe_route(logits)`. A GPU decode step routes in the last
    /// block of the router's launch.
    #[allow(clippy::too_many_arguments)]
    fn moe_router(
        &self,
        h: &Self::Buf,
        w: &Self::Vec,
        rows: usize,
        eps: f32,
        xn: &mut Self::Buf,
        router: &Self::Mat,
        shared_gate: &Self::Mat,
        d: &Dims,
        logits: &mut Self::Buf,
        s: &mut Self::Buf,
        route: &mut Self::Route,
    ) {
        self.rms_norm_matmul(
            h,
            w,
            rows,
            d.hidden,
            eps,
            xn,
            &[router, shared_gate],
            &mut [logits, s],
        );
        self.moe_route(logits, d, rows, route);
    }
    /// One token's Gated DeltaNet mixer added into the residual stream: `h += out_proj(gdn(conv(
    /// in_proj(rms_norm(h) · norm))))`, reading and updating the layer's conv and recurrent states.
    /// A GPU may run it as three launches (the conv in the projections' epilogue, the gated norm
    /// in out_proj's prologue).
    #[allow(clippy::too_many_arguments)]
    fn gdn_mixer_decode_add(
        &self,
        h: &mut Self::Buf,
        norm: &Self::Vec,
        eps: f32,
        w: &GdnWeights<'_, Self>,
        conv: &mut Self::Buf,
        ssm: &mut Self::Buf,
        d: &Dims,
        tmp: GdnScratch<'_, Self>,
    ) {
        gdn_mixer_compose(self, h, norm, eps, w, conv, ssm, d, tmp)
    }
    /// `h[t] += x[t] · Wᵀ`: a layer's output projection added into the f32 residual stream. `r`
    /// (`[rows, out]` activations) is scratch the backend may use for the product; its contents
    /// afterwards are unspecified. A GPU adds in the projection's own epilogue, unrounded.
    fn matmul_q_add(
        &self,
        x: &Self::Buf,
        w: &Self::Mat,
        rows: usize,
        r: &mut Self::Buf,
        h: &mut Self::Buf,
    ) {
        self.matmul_q(x, w, rows, r);
        self.add(h, r, rows * self.mat_shape(w).0);
    }
    /// Whether this backend folds the router of the MoE block that follows a decode step's
    /// output projection `out` (the layer's out_proj or o_proj) into that projection's launch.
    /// If so, the model passes `next` to the projection (`matmul_q_add_ahead`, or
    /// `GdnWeights::route_ahead`) and sets `RouterScratch::ahead` for the `moe_step_add` after it,
    /// which then skips the router's own pass over h. Why: the router is 0.6 MB of weights in a
    /// launch of its own, whose dependent chain (wait, norm, dots, route) costs the step ~10 µs a
    /// layer on the H200; its logits are linear in h, so the projection's blocks can sum each
    /// router row against the rows of h they have just written. A backend may prepare the
    /// block another way under the same contract: the wgpu backend's `LILY_WGPU_XQ_AHEAD=1`
    /// stages the block's x in the projection's epilogue instead (x = rms_norm(h) · w is h · w
    /// times one number). Default: no.
    fn route_ahead(&self, out: &Self::Mat, next: &RouteAhead<'_, Self>) -> bool {
        let _ = (out, next);
        false
    }
    /// Whether this backend's `moe_step_add` (one decode token, weights `w`) can stage the x of
    /// the op after the block, `rms_norm(h) · next`, as it writes h. If so, the model passes
    /// `MoeWeights::next_norm` to the block and tells the op after it (`rms_norm_matmul_ahead`,
    /// `GdnWeights::x_ahead`), which then reads that staging instead of normalising h. Why: on
    /// the wgpu backend the staging is a launch of its own (q2x_stage, ~4 µs in place on the
    /// H200) before each layer's first projection; the block's last launch writes h and can
    /// stage it itself. Default: no.
    fn norm_ahead(&self, w: &MoeWeights<'_, Self>, next: &Self::Vec, d: &Dims) -> bool {
        let _ = (w, next, d);
        false
    }
    /// `rms_norm_matmul` of one decode row after an MoE block that staged its x
    /// (`Backend::norm_ahead` said yes for `w`): the backend reads that staging. `xn` need not
    /// be written. Default (backends that never stage): `rms_norm_matmul`.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_matmul_ahead(
        &self,
        h: &Self::Buf,
        w: &Self::Vec,
        dim: usize,
        eps: f32,
        xn: &mut Self::Buf,
        ws: &[&Self::Mat],
        outs: &mut [&mut Self::Buf],
    ) {
        self.rms_norm_matmul(h, w, 1, dim, eps, xn, ws, outs)
    }
    /// `matmul_q_add` of one row whose output feeds the MoE block `next` (only called where
    /// `route_ahead` said yes): the backend also leaves, in its own scratch, `next`'s router
    /// logits before the norm's scale (Σ_k router[e, k] · norm[k] · h[k], and the same for the
    /// shared expert's gate), which `moe_step_add` with `RouterScratch::ahead` turns into the
    /// logits, the normed x and the route. The default (never folding) is `matmul_q_add`.
    fn matmul_q_add_ahead(
        &self,
        x: &Self::Buf,
        w: &Self::Mat,
        r: &mut Self::Buf,
        h: &mut Self::Buf,
        next: &RouteAhead<'_, Self>,
    ) {
        let _ = next;
        self.matmul_q_add(x, w, 1, r, h);
    }
    /// One token's MoE block added into the residual stream: `h += Σ_j w_j · expert_j(x) +
    /// sigmoid(logit) · shared(x)` for the routed experts of `route` (one row) and the shared
    /// expert. `tmp` is scratch for the unfused sequence. A GPU runs it as two weight-streaming
    /// launches (gate|up of every slot; down with the weighted combine, the shared expert's gate
    /// and the residual add in its epilogue).
    #[allow(clippy::too_many_arguments)]
    fn moe_decode_add(
        &self,
        x: &Self::Buf,
        route: &Self::Route,
        gate: &Self::Mat,
        up: &Self::Mat,
        down: &Self::Mat,
        shared: &SharedExpert<'_, Self>,
        d: &Dims,
        tmp: MoeScratch<'_, Self>,
        h: &mut Self::Buf,
    ) {
        moe_decode_compose(self, x, route, gate, up, down, shared, d, tmp, h)
    }

    /// One token's whole MoE block added into the residual stream: `moe_router` (x = rms_norm(h)
    /// · norm into `r.xn`, the router logits, the shared gate's logit `r.s`, the top-k `r.route`),
    /// then `moe_decode_add` on that x. A GPU folds the router into the experts' first launch: it
    /// is 0.6 MB of weights between two launches that each wait for the one before.
    #[allow(clippy::too_many_arguments)]
    fn moe_step_add(
        &self,
        h: &mut Self::Buf,
        norm: &Self::Vec,
        eps: f32,
        w: &MoeWeights<'_, Self>,
        d: &Dims,
        r: RouterScratch<'_, Self>,
        tmp: MoeScratch<'_, Self>,
    ) {
        moe_step_compose(self, h, norm, eps, w, d, r, tmp)
    }

    // ---- gated attention
    /// Splits `q_proj` output `[rows, heads, 2·hd]` into query (rms-normed, RoPE) and gate, and
    /// rms-norms + RoPEs `k` in place. Positions are `pos0 .. pos0 + rows`; with a `step` (a
    /// decode step, one row) the position is read from it (it equals `pos0`).
    #[allow(clippy::too_many_arguments)]
    fn attn_qk_norm_rope(
        &self,
        qg: &Self::Buf,
        k: &mut Self::Buf,
        q_norm: &Self::Vec,
        k_norm: &Self::Vec,
        d: &Dims,
        rows: usize,
        pos0: usize,
        step: Option<&Self::Step>,
        q: &mut Self::Buf,
        gate: &mut Self::Buf,
    );
    /// Appends `k`, `v` at `pos0..pos0+rows` of the layer's cache, then causal attention of the
    /// `rows` queries over positions `0..pos0+rows`; `out = attn · sigmoid(gate)`.
    #[allow(clippy::too_many_arguments)]
    fn attn_prefill(
        &self,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        gate: &Self::Buf,
        kv: &mut KvCache<Self::Buf>,
        d: &Dims,
        rows: usize,
        pos0: usize,
        out: &mut Self::Buf,
    );
    /// One query (the decode path) at the step's position, which equals `pos`: the device reads
    /// it from `step`, so that a recorded step is valid at any position below the capacity.
    #[allow(clippy::too_many_arguments)]
    fn attn_decode(
        &self,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        gate: &Self::Buf,
        kv: &mut KvCache<Self::Buf>,
        d: &Dims,
        pos: usize,
        step: &Self::Step,
        out: &mut Self::Buf,
    );
    /// One decode step's attention from q_proj's output (`AttnStep`): `attn_qk_norm_rope` (one
    /// row, at the step's position) then `attn_decode`. A GPU folds the first into the second's
    /// launch. `q` and `gate` are scratch; so is `k` afterwards (the composition leaves it
    /// normed and rotated, a fused kernel as it was): the cache row `pos` holds the normed,
    /// rotated key.
    fn attn_decode_qk(&self, a: AttnStep<'_, Self>) {
        attn_decode_qk_compose(self, a)
    }

    /// `attn_decode_qk`, then the attention's output projection added into h (`o.w`; with
    /// `o.next` the MoE block after prepared, `matmul_q_add_ahead`, else `matmul_q_add`): a
    /// decode step's attention mixer after q|k|v. A GPU may stage o_proj's x in the attention's
    /// last launch. Default: the ops.
    fn attn_decode_qk_add(&self, mut a: AttnStep<'_, Self>, o: OProj<'_, Self>) {
        self.attn_decode_qk(a.reborrow());
        out_proj_add(self, a.out, o.w, o.r, o.h, o.next.as_ref());
    }

    // ---- Gated DeltaNet
    /// Causal depthwise conv (kernel K, no bias) + SiLU over `rows` new rows of `x` `[rows, C]`,
    /// reading and updating the conv state (the last K-1 pre-conv rows, f32).
    fn conv1d_prefill(
        &self,
        x: &Self::Buf,
        w: &Self::Vec,
        state: &mut Self::Buf,
        d: &Dims,
        rows: usize,
        out: &mut Self::Buf,
    );
    fn conv1d_step(
        &self,
        x: &Self::Buf,
        w: &Self::Vec,
        state: &mut Self::Buf,
        d: &Dims,
        out: &mut Self::Buf,
    );
    /// The gated delta rule over `rows` tokens: l2-norm q/k, gates from `b`, `a`, the fp32
    /// recurrence on `state` `[Hv, Dv, Dk]` (f32), then `rms_norm(y) · silu(z)`. `out` is `[rows, Hv·Dv]`.
    #[allow(clippy::too_many_arguments)]
    fn gdn_prefill(
        &self,
        qkv: &Self::Buf,
        z: &Self::Buf,
        b: &Self::Buf,
        a: &Self::Buf,
        w: &GdnParams<Self::Vec>,
        state: &mut Self::Buf,
        d: &Dims,
        rows: usize,
        out: &mut Self::Buf,
    );
    #[allow(clippy::too_many_arguments)]
    fn gdn_decode(
        &self,
        qkv: &Self::Buf,
        z: &Self::Buf,
        b: &Self::Buf,
        a: &Self::Buf,
        w: &GdnParams<Self::Vec>,
        state: &mut Self::Buf,
        d: &Dims,
        out: &mut Self::Buf,
    );

    // ---- MoE
    /// Softmax over router logits `[rows, E]` (f32), top-k, renormalised weights.
    fn moe_route(&self, logits: &Self::Buf, d: &Dims, rows: usize, route: &mut Self::Route);
    /// `out[t] = Σ_j w_tj · down_e(silu(gate_e(x_t)) · up_e(x_t))` over the chosen experts
    /// (grouped by expert for a block of tokens).
    #[allow(clippy::too_many_arguments)]
    fn moe_experts_prefill(
        &self,
        x: &Self::Buf,
        route: &Self::Route,
        gate: &Self::Mat,
        up: &Self::Mat,
        down: &Self::Mat,
        d: &Dims,
        rows: usize,
        out: &mut Self::Buf,
    );
    /// The same for one token (fused gather-GEMV on a GPU). With `shared`, a backend may fold the
    /// shared expert in, added as `add_sigmoid_gated` would: `out += sigmoid(logit) ·
    /// down(silu(gate(x)) · up(x))` (on a GPU in the same launches as the routed experts), and
    /// then returns `true`. `false`: it did not, and the caller adds the shared expert with its
    /// unfused ops, as a prefill does (the CPU; a GPU whose shared expert has another format).
    #[allow(clippy::too_many_arguments)]
    fn moe_experts_decode(
        &self,
        x: &Self::Buf,
        route: &Self::Route,
        gate: &Self::Mat,
        up: &Self::Mat,
        down: &Self::Mat,
        shared: Option<&SharedExpert<'_, Self>>,
        d: &Dims,
        out: &mut Self::Buf,
    ) -> bool;
    /// `out[t] = silu(g[t]) · u[t]` (the shared expert's activation).
    fn swiglu(&self, g: &Self::Buf, u: &Self::Buf, len: usize, out: &mut Self::Buf);
    /// `y[t] += sigmoid(s[t]) · shared[t]` (the shared expert's scalar gate, `s` is `[rows, 1]`, f32).
    fn add_sigmoid_gated(
        &self,
        y: &mut Self::Buf,
        shared: &Self::Buf,
        s: &Self::Buf,
        rows: usize,
        dim: usize,
    );

    // ---- output
    /// The greedy pick of a decode step on the backend: `step.token = argmax(logits[0])` (the
    /// first on ties, as `runtime::argmax`; logits are f32), `step.pos += 1`: the step is then
    /// ready to feed that token.
    fn argmax_step(&self, logits: &Self::Buf, vocab: usize, step: &mut Self::Step);
    /// Constrained decoding: `logits[i] = -inf` for every `i < vocab` whose bit in `allowed` is
    /// clear (bit i of word i / 32, LSB first; ids past the mask's words are disallowed), before
    /// `argmax_step` or `sample_step` picks. `runtime::constrain::apply_mask` on the host.
    fn mask_logits(&self, logits: &mut Self::Buf, vocab: usize, allowed: &[u32]);

    /// A sampler for one sequence that draws as `runtime::Sampler` with `params` and `seed`
    /// (the seed resolved by the caller: `Sampler::seed`), the `prompt`'s tokens counting for the
    /// repetition penalty (vLLM's split, `Sampler::sample_split`). `Ok(None)`: this backend does
    /// not sample these parameters itself, and the caller samples the logits on the host.
    fn new_sampler(
        &self,
        params: &SamplingParams,
        seed: u64,
        vocab: usize,
        prompt: &[u32],
    ) -> Result<Option<Self::Sampler>>;
    /// The sampled pick of a decode step on the backend: `step.token` = the token
    /// `Sampler::sample_split(logits[0], prompt, generated)` draws, `generated` being every token
    /// this sampler drew or was told of (`sample_note`); the token is counted, the generator
    /// advanced (one `u64` per draw, none when greedy) and `step.pos += 1`, as `argmax_step`.
    /// Logits are f32 and are not changed (log-probabilities read them raw).
    fn sample_step(
        &self,
        logits: &Self::Buf,
        vocab: usize,
        s: &mut Self::Sampler,
        step: &mut Self::Step,
    );
    /// Counts `token` as generated (for the penalties) without drawing: a token forced instead
    /// of sampled.
    fn sample_note(&self, s: &mut Self::Sampler, token: u32);
    /// OpenAI log-probabilities of the raw `logits[0..vocab]` (after the work enqueued so far):
    /// `token`'s and the `n` most likely `(id, logprob)`, most likely first (ties: lower id),
    /// as `runtime::sampler::top_logprobs`. The default reads the logits back and computes them
    /// on the host; a device computes them where the logits are and reads back only these.
    fn logprobs(
        &self,
        logits: &Self::Buf,
        vocab: usize,
        token: u32,
        n: usize,
    ) -> Result<(f32, Vec<(u32, f32)>)> {
        let l = self.to_host(logits, vocab)?;
        Ok(crate::runtime::sampler::token_logprobs(&l, token, n))
    }
}

/// A read of a step's token begun by [`Backend::step_token_begin`], finished by
/// [`Backend::step_token_finish`] of the same backend.
pub enum TokenRead {
    /// Read already (backends whose ops are synchronous, and the default).
    Ready(u32),
    /// A device's copy in flight: what its backend needs to wait for it and read it. Dropped
    /// unfinished (an error between begin and finish), it waits for its copy if it must.
    Pending(Box<dyn std::any::Any + Send>),
}

/// An MoE layer's shared expert, for an op that folds it in: its three matrices and the logit
/// of its scalar gate `[1]` (computed beforehand, with the router).
pub struct SharedExpert<'a, B: Backend + ?Sized> {
    pub gate: &'a B::Mat,
    pub up: &'a B::Mat,
    pub down: &'a B::Mat,
    pub logit: &'a B::Buf,
}

/// Scratch of the unfused MoE sequence (`moe_decode_add`, `add_shared_expert`): the MoE output
/// `out` `[rows, hidden]` and the shared expert's gate, up, activation `[rows, width]` and down
/// `[rows, hidden]` outputs, all activations.
pub struct MoeScratch<'a, B: Backend + ?Sized> {
    pub out: &'a mut B::Buf,
    pub g: &'a mut B::Buf,
    pub u: &'a mut B::Buf,
    pub act: &'a mut B::Buf,
    pub down: &'a mut B::Buf,
}

/// `tmp.out += sigmoid(logit) · down(silu(gate(x)) · up(x))`: the shared expert as its unfused
/// ops (every prefill; a decode step whose backend did not fold it into the routed experts).
pub fn add_shared_expert<B: Backend + ?Sized>(
    b: &B,
    x: &B::Buf,
    sh: &SharedExpert<'_, B>,
    rows: usize,
    hidden: usize,
    tmp: MoeScratch<'_, B>,
) {
    let width = b.mat_shape(sh.gate).0;
    b.matmul_q_many(x, &[sh.gate, sh.up], rows, &mut [&mut *tmp.g, &mut *tmp.u]);
    b.swiglu(tmp.g, tmp.u, rows * width, tmp.act);
    b.matmul_q(tmp.act, sh.down, rows, tmp.down);
    b.add_sigmoid_gated(tmp.out, tmp.down, sh.logit, rows, hidden);
}

/// One token's MoE block as `moe_experts_decode` (which may fold the shared expert in), the shared
/// expert's unfused ops where it did not, and the residual add (the default of `moe_decode_add`,
/// and a GPU's fallback).
#[allow(clippy::too_many_arguments)]
pub fn moe_decode_compose<B: Backend + ?Sized>(
    b: &B,
    x: &B::Buf,
    route: &B::Route,
    gate: &B::Mat,
    up: &B::Mat,
    down: &B::Mat,
    shared: &SharedExpert<'_, B>,
    d: &Dims,
    tmp: MoeScratch<'_, B>,
    h: &mut B::Buf,
) {
    if !b.moe_experts_decode(x, route, gate, up, down, Some(shared), d, tmp.out) {
        add_shared_expert(
            b,
            x,
            shared,
            1,
            d.hidden,
            MoeScratch {
                out: &mut *tmp.out,
                g: &mut *tmp.g,
                u: &mut *tmp.u,
                act: &mut *tmp.act,
                down: &mut *tmp.down,
            },
        );
    }
    b.add(h, tmp.out, d.hidden);
}

/// One decode step's attention as its two ops (the default of `attn_decode_qk`, a GPU's
/// fallback, and a profiled run's split): attn_qk_norm_rope at the step's position, then
/// attn_decode.
pub fn attn_decode_qk_compose<B: Backend + ?Sized>(b: &B, a: AttnStep<'_, B>) {
    let (d, pos, step) = (a.d, a.pos, a.step);
    b.attn_qk_norm_rope(
        a.qg,
        a.k,
        a.q_norm,
        a.k_norm,
        d,
        1,
        pos,
        Some(step),
        a.q,
        a.gate,
    );
    b.attn_decode(a.q, a.k, a.v, a.gate, a.kv, d, pos, step, a.out);
}

/// A decode step's attention after q|k|v (`Backend::attn_decode_qk`): q_proj's output `qg`
/// (each head's query then its gate), the new key and value, the q/k norms' weights, the layer's
/// cache, the step's position (`pos`, which the device reads from `step`), the scratch `q` and
/// `gate`, and `out`, the attention's output.
pub struct AttnStep<'a, B: Backend + ?Sized> {
    pub qg: &'a B::Buf,
    pub k: &'a mut B::Buf,
    pub v: &'a B::Buf,
    pub q_norm: &'a B::Vec,
    pub k_norm: &'a B::Vec,
    pub kv: &'a mut KvCache<B::Buf>,
    pub d: &'a Dims,
    pub pos: usize,
    pub step: &'a B::Step,
    pub q: &'a mut B::Buf,
    pub gate: &'a mut B::Buf,
    pub out: &'a mut B::Buf,
}

impl<B: Backend + ?Sized> AttnStep<'_, B> {
    /// The same step borrowed again (to run it and then read `out`).
    pub fn reborrow(&mut self) -> AttnStep<'_, B> {
        AttnStep {
            qg: self.qg,
            k: &mut *self.k,
            v: self.v,
            q_norm: self.q_norm,
            k_norm: self.k_norm,
            kv: &mut *self.kv,
            d: self.d,
            pos: self.pos,
            step: self.step,
            q: &mut *self.q,
            gate: &mut *self.gate,
            out: &mut *self.out,
        }
    }
}

/// A decode step's attention output projection (`attn_decode_qk_add`): o_proj, its product's
/// scratch `r`, the residual stream `h` it adds into, and the MoE router that follows when the
/// projection prepares it (`Backend::route_ahead` said yes).
pub struct OProj<'a, B: Backend + ?Sized> {
    pub w: &'a B::Mat,
    pub r: &'a mut B::Buf,
    pub h: &'a mut B::Buf,
    pub next: Option<RouteAhead<'a, B>>,
}

/// An MoE block's weights, for `moe_step_add`: the router and the shared expert's gate (one row),
/// the routed experts' stacks, and the shared expert.
pub struct MoeWeights<'a, B: Backend + ?Sized> {
    pub router: &'a B::Mat,
    pub shared_gate: &'a B::Mat,
    pub gate: &'a B::Mat,
    pub up: &'a B::Mat,
    pub down: &'a B::Mat,
    pub shared_gate_proj: &'a B::Mat,
    pub shared_up_proj: &'a B::Mat,
    pub shared_down_proj: &'a B::Mat,
    /// The norm of the op after the block (a decode step: the next layer's input norm, or the
    /// final norm), whose x this block stages as it writes h (`Backend::norm_ahead` said yes);
    /// None: the op after normalises h itself.
    pub next_norm: Option<&'a B::Vec>,
}

/// What `moe_router` writes, for `moe_step_add`: the normed x (activation), the router's f32
/// logits `[experts]`, the shared gate's logit `[1]` and the route.
pub struct RouterScratch<'a, B: Backend + ?Sized> {
    pub xn: &'a mut B::Buf,
    pub logits: &'a mut B::Buf,
    pub s: &'a mut B::Buf,
    pub route: &'a mut B::Route,
    /// The projection before prepared this block (`Backend::route_ahead`): the router's sums, or
    /// on wgpu with `LILY_WGPU_XQ_AHEAD` the staged x, wait in the backend's scratch, and
    /// `moe_step_add` must consume them.
    pub ahead: bool,
}

/// The MoE router that follows a decode step's output projection (`Backend::route_ahead`): its
/// weights, the shared expert's gate and the block's norm weight (`post_norm`).
pub struct RouteAhead<'a, B: Backend + ?Sized> {
    pub router: &'a B::Mat,
    pub shared_gate: &'a B::Mat,
    pub norm: &'a B::Vec,
}

impl<B: Backend + ?Sized> Clone for RouteAhead<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend + ?Sized> Copy for RouteAhead<'_, B> {}

/// One token's MoE block as its two ops (the default of `moe_step_add`, and a GPU's fallback):
/// the router, then the experts with the shared expert, added into h.
#[allow(clippy::too_many_arguments)]
pub fn moe_step_compose<B: Backend + ?Sized>(
    b: &B,
    h: &mut B::Buf,
    norm: &B::Vec,
    eps: f32,
    w: &MoeWeights<'_, B>,
    d: &Dims,
    r: RouterScratch<'_, B>,
    tmp: MoeScratch<'_, B>,
) {
    b.moe_router(
        h,
        norm,
        1,
        eps,
        r.xn,
        w.router,
        w.shared_gate,
        d,
        r.logits,
        r.s,
        r.route,
    );
    moe_experts_add(b, h, w, d, r, tmp);
}

/// The second half of `moe_step_compose`, once the router's outputs are in `r` (x, the shared
/// gate's logit, the route): the routed and shared experts added into h (`moe_decode_add`).
pub fn moe_experts_add<B: Backend + ?Sized>(
    b: &B,
    h: &mut B::Buf,
    w: &MoeWeights<'_, B>,
    d: &Dims,
    r: RouterScratch<'_, B>,
    tmp: MoeScratch<'_, B>,
) {
    let shared = SharedExpert {
        gate: w.shared_gate_proj,
        up: w.shared_up_proj,
        down: w.shared_down_proj,
        logit: r.s,
    };
    b.moe_decode_add(r.xn, r.route, w.gate, w.up, w.down, &shared, d, tmp, h);
}

/// A GDN layer's weights, for `gdn_mixer_decode_add`: in_proj qkv, z, b, a; the conv taps; the
/// gates' parameters and output norm; out_proj.
pub struct GdnWeights<'a, B: Backend + ?Sized> {
    pub in_proj: [&'a B::Mat; 4],
    pub conv1d: &'a B::Vec,
    pub params: &'a GdnParams<B::Vec>,
    pub out_proj: &'a B::Mat,
    /// The MoE block for out_proj to prepare (`Backend::route_ahead` said yes), or None.
    pub route_ahead: Option<RouteAhead<'a, B>>,
    /// The MoE block before staged this mixer's x (`Backend::norm_ahead` said yes): in_proj
    /// reads that staging instead of normalising h.
    pub x_ahead: bool,
}

/// Scratch of one token's GDN mixer (activations): the normed x, the projections (qkv before and
/// after the conv, z, b, a), the recurrence's output y and out_proj's product r.
pub struct GdnScratch<'a, B: Backend + ?Sized> {
    pub xn: &'a mut B::Buf,
    pub qkv: &'a mut B::Buf,
    pub qkv_c: &'a mut B::Buf,
    pub z: &'a mut B::Buf,
    pub b: &'a mut B::Buf,
    pub a: &'a mut B::Buf,
    pub y: &'a mut B::Buf,
    pub r: &'a mut B::Buf,
}

/// The GDN mixer of one token as its unfused ops (the default of `gdn_mixer_decode_add`, and a
/// GPU's fallback): the equations of MODEL.md §2 in order.
#[allow(clippy::too_many_arguments)]
pub fn gdn_mixer_compose<B: Backend + ?Sized>(
    b: &B,
    h: &mut B::Buf,
    norm: &B::Vec,
    eps: f32,
    w: &GdnWeights<'_, B>,
    conv: &mut B::Buf,
    ssm: &mut B::Buf,
    d: &Dims,
    t: GdnScratch<'_, B>,
) {
    b.rms_norm_matmul(
        h,
        norm,
        1,
        d.hidden,
        eps,
        t.xn,
        &w.in_proj,
        &mut [&mut *t.qkv, &mut *t.z, &mut *t.b, &mut *t.a],
    );
    b.conv1d_step(t.qkv, w.conv1d, conv, d, t.qkv_c);
    b.gdn_decode(t.qkv_c, t.z, t.b, t.a, w.params, ssm, d, t.y);
    out_proj_add(b, t.y, w.out_proj, t.r, h, w.route_ahead.as_ref());
}

/// A decode step's output projection added into h, folding the MoE router `next` into it when
/// the backend said it would (`Backend::route_ahead`).
pub fn out_proj_add<B: Backend + ?Sized>(
    b: &B,
    x: &B::Buf,
    w: &B::Mat,
    r: &mut B::Buf,
    h: &mut B::Buf,
    next: Option<&RouteAhead<'_, B>>,
) {
    match next {
        Some(n) => b.matmul_q_add_ahead(x, w, r, h, n),
        None => b.matmul_q_add(x, w, 1, r, h),
    }
}

/// Hardware limits measured on the machine a backend runs on.
#[derive(Clone, Debug)]
pub struct Ceilings {
    /// Memory bandwidth in bytes/s (bytes read + written by a large device-to-device copy).
    pub bandwidth: f64,
    /// Dense matrix rate in FLOP/s (bf16 operands, f32 accumulation on a GPU).
    pub flops: f64,
    /// How each was measured (printed and written to the bench JSON).
    pub method: String,
}

/// The GDN layer's small parameters, resident on the backend.
pub struct GdnParams<V> {
    pub a_log: V,
    pub dt_bias: V,
    pub norm: V,
}

/// One attention layer's KV cache: `[capacity, n_kv_heads·head_dim]` for K and for V, allocated
/// with [`Backend::kv_zeros`] (in the backend's KV element type).
pub struct KvCache<B> {
    pub k: B,
    pub v: B,
    pub capacity: usize,
}
