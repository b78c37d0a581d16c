//! The CPU backend: the reference every other backend is checked against, and a usable fallback.
//!
//! Activations and state are `Vec<f32>`; weights are read in place from the memory-mapped
//! checkpoint (dequantized inside the matmul inner loop). One file per op family:
//! `norm` (norms, elementwise), `matmul` (quantized GEMV/GEMM), `attention`, `gdn`, `moe`.
//! Threads come from rayon's global pool (`--threads`).

pub mod attention;
pub mod gdn;
pub mod matmul;
pub mod moe;
pub mod norm;

use anyhow::{bail, Result};

use super::{Backend, Dims, GdnParams, KvCache, SharedExpert};
use crate::loader::tensor::HostLinear;
use crate::runtime::sampler::{Sampler, SamplingParams};

#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

/// A decode step's token and position (host memory: nothing to save on a CPU, but the ops read
/// them from here exactly as a device does).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuStep {
    pub token: u32,
    pub pos: usize,
}

/// The CPU twin of a device sampler: the host [`Sampler`] itself, with the request's prompt and
/// the tokens generated so far (which a device keeps as counts).
pub struct CpuSampler {
    sampler: Sampler,
    prompt: Vec<u32>,
    generated: Vec<u32>,
}

impl Backend for Cpu {
    type Buf = Vec<f32>;
    type Mat = HostLinear;
    type Vec = Vec<f32>;
    type Route = moe::Route;
    type Step = CpuStep;
    type Sampler = CpuSampler;

    fn name(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn upload_mat(&self, m: &HostLinear) -> Result<HostLinear> {
        Ok(m.clone())
    }
    fn upload_vec(&self, v: &[f32]) -> Result<Vec<f32>> {
        Ok(v.to_vec())
    }
    fn mat_shape(&self, m: &HostLinear) -> (usize, usize) {
        (m.out, m.inp)
    }
    fn zeros(&self, len: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }
    fn to_host(&self, b: &Vec<f32>, len: usize) -> Result<Vec<f32>> {
        if len > b.len() {
            bail!("to_host: {len} elements asked of a buffer of {}", b.len());
        }
        Ok(b[..len].to_vec())
    }
    fn copy(&self, src: &Vec<f32>, src_off: usize, dst: &mut Vec<f32>, dst_off: usize, len: usize) {
        dst[dst_off..dst_off + len].copy_from_slice(&src[src_off..src_off + len]);
    }
    fn new_route(&self, rows: usize, top_k: usize) -> Result<moe::Route> {
        Ok(moe::Route {
            ids: vec![0; rows * top_k],
            weights: vec![0.0; rows * top_k],
            k: top_k,
        })
    }
    fn new_step(&self) -> Result<CpuStep> {
        Ok(CpuStep::default())
    }
    fn set_step(&self, step: &mut CpuStep, token: u32, pos: usize) {
        *step = CpuStep { token, pos };
    }
    fn step_token(&self, step: &CpuStep) -> Result<u32> {
        Ok(step.token)
    }

    fn embed(&self, table: &HostLinear, ids: &[u32], out: &mut Vec<f32>) {
        let v = table.view(0);
        let h = table.inp;
        for (t, &id) in ids.iter().enumerate() {
            v.row_f32(id as usize, &mut out[t * h..(t + 1) * h]);
        }
    }
    fn embed_step(&self, table: &HostLinear, step: &CpuStep, out: &mut Vec<f32>) {
        self.embed(table, &[step.token], out)
    }
    fn rms_norm(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Vec<f32>,
    ) {
        norm::rms_norm(x, w, rows, dim, eps, out)
    }
    fn add_rms_norm(
        &self,
        h: &mut Vec<f32>,
        r: &Vec<f32>,
        w: &Vec<f32>,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Vec<f32>,
    ) {
        norm::add_rms_norm(h, r, w, rows, dim, eps, out)
    }
    fn matmul_q(&self, x: &Vec<f32>, w: &HostLinear, rows: usize, out: &mut Vec<f32>) {
        matmul::matmul(
            &x[..rows * w.inp],
            rows,
            &w.view(0),
            &mut out[..rows * w.out],
        )
    }
    fn add(&self, h: &mut Vec<f32>, r: &Vec<f32>, len: usize) {
        h[..len]
            .iter_mut()
            .zip(&r[..len])
            .for_each(|(a, b)| *a += b);
    }

    fn attn_qk_norm_rope(
        &self,
        qg: &Vec<f32>,
        k: &mut Vec<f32>,
        qn: &Vec<f32>,
        kn: &Vec<f32>,
        d: &Dims,
        rows: usize,
        pos0: usize,
        step: Option<&CpuStep>,
        q: &mut Vec<f32>,
        gate: &mut Vec<f32>,
    ) {
        let pos0 = step.map_or(pos0, |s| s.pos);
        attention::attn_qk_norm_rope(qg, k, qn, kn, d, rows, pos0, q, gate)
    }
    fn attn_prefill(
        &self,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        gate: &Vec<f32>,
        kv: &mut KvCache<Vec<f32>>,
        d: &Dims,
        rows: usize,
        pos0: usize,
        out: &mut Vec<f32>,
    ) {
        attention::attention(q, k, v, gate, kv, d, rows, pos0, out)
    }
    fn attn_decode(
        &self,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        gate: &Vec<f32>,
        kv: &mut KvCache<Vec<f32>>,
        d: &Dims,
        pos: usize,
        step: &CpuStep,
        out: &mut Vec<f32>,
    ) {
        debug_assert_eq!(
            pos, step.pos,
            "attn_decode: the step is not at the state's position"
        );
        attention::attention(q, k, v, gate, kv, d, 1, step.pos, out)
    }

    fn conv1d_prefill(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        state: &mut Vec<f32>,
        d: &Dims,
        rows: usize,
        out: &mut Vec<f32>,
    ) {
        gdn::conv1d(x, w, state, d, rows, out)
    }
    fn conv1d_step(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        state: &mut Vec<f32>,
        d: &Dims,
        out: &mut Vec<f32>,
    ) {
        gdn::conv1d(x, w, state, d, 1, out)
    }
    fn gdn_prefill(
        &self,
        qkv: &Vec<f32>,
        z: &Vec<f32>,
        b: &Vec<f32>,
        a: &Vec<f32>,
        w: &GdnParams<Vec<f32>>,
        state: &mut Vec<f32>,
        d: &Dims,
        rows: usize,
        out: &mut Vec<f32>,
    ) {
        let p = gdn::GdnParamsRef {
            a_log: &w.a_log,
            dt_bias: &w.dt_bias,
            norm: &w.norm,
        };
        gdn::gated_delta(qkv, z, b, a, &p, state, d, rows, out)
    }
    fn gdn_decode(
        &self,
        qkv: &Vec<f32>,
        z: &Vec<f32>,
        b: &Vec<f32>,
        a: &Vec<f32>,
        w: &GdnParams<Vec<f32>>,
        state: &mut Vec<f32>,
        d: &Dims,
        out: &mut Vec<f32>,
    ) {
        self.gdn_prefill(qkv, z, b, a, w, state, d, 1, out)
    }

    fn moe_route(&self, logits: &Vec<f32>, d: &Dims, rows: usize, route: &mut moe::Route) {
        moe::moe_route(logits, d, rows, route)
    }
    fn moe_experts_prefill(
        &self,
        x: &Vec<f32>,
        route: &moe::Route,
        gate: &HostLinear,
        up: &HostLinear,
        down: &HostLinear,
        d: &Dims,
        rows: usize,
        out: &mut Vec<f32>,
    ) {
        moe::moe_experts_prefill(x, route, gate, up, down, d, rows, out)
    }
    /// The routed experts only: the model adds the shared expert with its unfused ops.
    fn moe_experts_decode(
        &self,
        x: &Vec<f32>,
        route: &moe::Route,
        gate: &HostLinear,
        up: &HostLinear,
        down: &HostLinear,
        _shared: Option<&SharedExpert<'_, Self>>,
        d: &Dims,
        out: &mut Vec<f32>,
    ) -> bool {
        moe::moe_experts_decode(x, route, gate, up, down, d, out);
        false
    }
    fn swiglu(&self, g: &Vec<f32>, u: &Vec<f32>, len: usize, out: &mut Vec<f32>) {
        norm::swiglu(&g[..len], &u[..len], &mut out[..len])
    }
    fn add_sigmoid_gated(
        &self,
        y: &mut Vec<f32>,
        shared: &Vec<f32>,
        s: &Vec<f32>,
        rows: usize,
        dim: usize,
    ) {
        norm::add_sigmoid_gated(y, shared, s, rows, dim)
    }

    fn argmax_step(&self, logits: &Vec<f32>, vocab: usize, step: &mut CpuStep) {
        *step = CpuStep {
            token: crate::runtime::argmax(&logits[..vocab]),
            pos: step.pos + 1,
        };
    }
    fn mask_logits(&self, logits: &mut Vec<f32>, vocab: usize, allowed: &[u32]) {
        crate::runtime::constrain::apply_mask(&mut logits[..vocab], allowed);
    }

    /// Every parameter set: the CPU samples with `runtime::Sampler` itself.
    fn new_sampler(
        &self,
        params: &SamplingParams,
        seed: u64,
        vocab: usize,
        prompt: &[u32],
    ) -> Result<Option<CpuSampler>> {
        let sampler = Sampler::new(
            SamplingParams {
                seed: Some(seed),
                ..params.clone()
            },
            vocab,
        )?;
        Ok(Some(CpuSampler {
            sampler,
            prompt: prompt.to_vec(),
            generated: Vec::new(),
        }))
    }
    fn sample_step(&self, logits: &Vec<f32>, vocab: usize, s: &mut CpuSampler, step: &mut CpuStep) {
        // The sampler penalises its row in place: a copy keeps the logits raw, as on a device.
        let mut row = logits[..vocab].to_vec();
        let token = s.sampler.sample_split(&mut row, &s.prompt, &s.generated);
        s.generated.push(token);
        *step = CpuStep {
            token,
            pos: step.pos + 1,
        };
    }
    fn sample_note(&self, s: &mut CpuSampler, token: u32) {
        s.generated.push(token);
    }
}
