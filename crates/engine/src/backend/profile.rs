//! `Profiled<B>`: any backend, with wall time per op family when switched on (`lily bench --profile`).
//!
//! A wrapper that implements `Backend` by delegating every op to the inner backend. While the
//! profiler is on, each op is bracketed by `sync()` of the inner backend (wait for all enqueued
//! device work) and a host clock, so the time charged to an op is: its host-side launch cost + its
//! device time + one synchronisation round trip (a few µs on CUDA). Ops of a GPU backend normally
//! overlap their launches with earlier kernels; here they cannot, so a profiled step is slower than
//! an unprofiled one — `lily bench --profile` prints both. The figure is exact for long ops
//! (prefill GEMMs, scans) and an upper bound for µs-sized decode ops. On the CPU `sync` is a no-op
//! (its ops are synchronous) and the times are plain wall time.
//!
//! Families: the trait's op names, except `matmul_q`, which is split by the matrix it multiplies
//! (`matmul_q linear_attn.in_proj_qkv`, the layer number dropped), since those are the different
//! GEMM shapes. The model is generic over the backend, so `Qwen35<Profiled<Cuda>>` needs no change
//! to the model; when the profiler is off an op costs one relaxed atomic load more.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::Result;

use super::{
    AttnStep, Backend, Dims, GdnParams, GdnScratch, GdnWeights, KvCache, MoeScratch, MoeWeights,
    OProj, RouteAhead, RouterScratch, SharedExpert,
};
use crate::loader::tensor::HostLinear;

/// Switch and accumulated times; shared between the wrapper and whoever reads the report.
#[derive(Default)]
pub struct Profiler {
    on: AtomicBool,
    stats: Mutex<HashMap<String, (u64, f64)>>,
}

/// One op family's total over a profiled region.
#[derive(Clone, Debug)]
pub struct OpTime {
    pub family: String,
    pub calls: u64,
    pub seconds: f64,
}

/// The op families of a profiled region, longest first.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub ops: Vec<OpTime>,
}

impl Profiler {
    /// Clears the totals and starts charging ops.
    pub fn start(&self) {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.on.store(true, Ordering::Relaxed);
    }

    /// Stops charging and returns what was charged since `start`.
    pub fn stop(&self) -> Report {
        self.on.store(false, Ordering::Relaxed);
        let stats = std::mem::take(&mut *self.stats.lock().unwrap_or_else(|e| e.into_inner()));
        Report::from_totals(stats.into_iter().map(|(f, (c, s))| (f, c, s)))
    }

    fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    fn charge(&self, family: &str, seconds: f64) {
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        match s.get_mut(family) {
            Some(v) => {
                v.0 += 1;
                v.1 += seconds;
            }
            None => {
                s.insert(family.to_string(), (1, seconds));
            }
        }
    }
}

impl Report {
    /// A report from `(family, calls, seconds)` totals, longest first.
    pub fn from_totals(t: impl IntoIterator<Item = (String, u64, f64)>) -> Report {
        let mut ops: Vec<OpTime> = t
            .into_iter()
            .map(|(family, calls, seconds)| OpTime {
                family,
                calls,
                seconds,
            })
            .collect();
        ops.sort_by(|a, b| {
            b.seconds
                .total_cmp(&a.seconds)
                .then_with(|| a.family.cmp(&b.family))
        });
        Report { ops }
    }

    pub fn total(&self) -> f64 {
        self.ops.iter().map(|o| o.seconds).sum()
    }

    /// Divides every total by `n` (a report over n identical steps → per step; calls rounded).
    pub fn per(&self, n: usize) -> Report {
        let n = n.max(1);
        Report {
            ops: self
                .ops
                .iter()
                .map(|o| OpTime {
                    family: o.family.clone(),
                    calls: o.calls.div_ceil(n as u64),
                    seconds: o.seconds / n as f64,
                })
                .collect(),
        }
    }

    /// A table: op family, calls, total ms, µs per call, share of the summed op time; then the
    /// `matmul_q` families summed.
    pub fn table(&self) -> String {
        let total = self.total().max(1e-12);
        let mut s = format!(
            "{:<44} {:>7} {:>10} {:>10} {:>7}\n",
            "op family", "calls", "total ms", "us/call", "share"
        );
        for o in &self.ops {
            s += &format!(
                "{:<44} {:>7} {:>10.3} {:>10.1} {:>6.1}%\n",
                o.family,
                o.calls,
                o.seconds * 1e3,
                o.seconds * 1e6 / o.calls.max(1) as f64,
                100.0 * o.seconds / total
            );
        }
        let (mc, ms) = self
            .ops
            .iter()
            .filter(|o| o.family.starts_with("matmul_q"))
            .fold((0, 0.0), |(c, t), o| (c + o.calls, t + o.seconds));
        s += &format!(
            "{:<44} {:>7} {:>10.3} {:>10} {:>6.1}%\n",
            "(matmul_q, all matrices)",
            mc,
            ms * 1e3,
            "",
            100.0 * ms / total
        );
        s += &format!(
            "{:<44} {:>7} {:>10.3}\n",
            "(sum of ops)",
            self.ops.iter().map(|o| o.calls).sum::<u64>(),
            total * 1e3
        );
        s
    }

    pub fn to_json(&self) -> serde_json::Value {
        let total = self.total().max(1e-12);
        serde_json::json!({
            "total_ms": self.total() * 1e3,
            "ops": self.ops.iter().map(|o| serde_json::json!({
                "family": o.family, "calls": o.calls, "total_ms": o.seconds * 1e3, "share": o.seconds / total,
            })).collect::<Vec<_>>(),
        })
    }
}

/// A matrix of the inner backend with the family name its products are charged to.
pub struct PMat<M> {
    pub inner: M,
    family: String,
}

/// `model.layers.7.linear_attn.in_proj_qkv` → `linear_attn.in_proj_qkv`; `lm_head` stays.
fn matrix_label(name: &str) -> String {
    if let Some(i) = name.find("layers.") {
        let rest = &name[i + "layers.".len()..];
        let rest = rest.trim_start_matches(|c: char| c.is_ascii_digit());
        return rest.trim_start_matches('.').to_string();
    }
    name.rsplit('.').next().unwrap_or(name).to_string()
}

/// Any backend, with per-op timing when its profiler is on.
pub struct Profiled<B> {
    pub inner: B,
    prof: Arc<Profiler>,
}

impl<B: Backend> Profiled<B> {
    /// Wraps `inner`; the profiler starts off.
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            prof: Arc::new(Profiler::default()),
        }
    }

    /// The switch and the totals (keep a clone to start / stop around a region).
    pub fn profiler(&self) -> Arc<Profiler> {
        self.prof.clone()
    }

    fn time<R>(&self, family: &str, f: impl FnOnce() -> R) -> R {
        if !self.prof.is_on() {
            return f();
        }
        // Errors are left to the inner backend: an op that failed reports at the next check.
        let _ = self.inner.sync();
        self.inner.label(family);
        let t0 = Instant::now();
        let r = f();
        let _ = self.inner.sync();
        self.prof.charge(family, t0.elapsed().as_secs_f64());
        r
    }
}

impl<B: Backend> Backend for Profiled<B> {
    type Buf = B::Buf;
    type Mat = PMat<B::Mat>;
    type Vec = B::Vec;
    type Route = B::Route;
    type Step = B::Step;
    type Sampler = B::Sampler;

    fn name(&self) -> String {
        self.inner.name()
    }
    fn sync(&self) -> Result<()> {
        self.inner.sync()
    }
    fn prefill_chunk(&self) -> usize {
        self.inner.prefill_chunk()
    }
    fn measure_ceilings(&self) -> Option<Result<super::Ceilings>> {
        self.inner.measure_ceilings()
    }
    fn label(&self, family: &str) {
        self.inner.label(family)
    }
    fn device_times(&self, on: bool) -> Option<Report> {
        self.inner.device_times(on)
    }
    /// A profiled step runs op by op (each bracketed by syncs, which a record cannot hold);
    /// with the profiler off the inner backend records and replays as usual.
    fn replay(&self, key: u64, ops: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        if self.prof.is_on() {
            ops()
        } else {
            self.inner.replay(key, ops)
        }
    }

    fn prerecord(&self, key: u64, ops: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        if self.prof.is_on() {
            Ok(())
        } else {
            self.inner.prerecord(key, ops)
        }
    }

    fn warm_up(&self, ops: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        self.inner.warm_up(ops)
    }

    fn upload_mat(&self, m: &HostLinear) -> Result<Self::Mat> {
        Ok(PMat {
            inner: self.inner.upload_mat(m)?,
            family: format!("matmul_q {}", matrix_label(&m.name)),
        })
    }
    fn upload_vec(&self, v: &[f32]) -> Result<Self::Vec> {
        self.inner.upload_vec(v)
    }
    fn mat_shape(&self, m: &Self::Mat) -> (usize, usize) {
        self.inner.mat_shape(&m.inner)
    }
    fn zeros(&self, len: usize) -> Result<Self::Buf> {
        self.time("zeros (allocation)", || self.inner.zeros(len))
    }
    fn act_zeros(&self, len: usize) -> Result<Self::Buf> {
        self.time("zeros (allocation)", || self.inner.act_zeros(len))
    }
    fn act_elem_bytes(&self) -> usize {
        self.inner.act_elem_bytes()
    }
    fn kv_zeros(&self, len: usize) -> Result<Self::Buf> {
        self.time("zeros (allocation)", || self.inner.kv_zeros(len))
    }
    fn kv_elem_bytes(&self) -> usize {
        self.inner.kv_elem_bytes()
    }
    fn to_host(&self, b: &Self::Buf, len: usize) -> Result<Vec<f32>> {
        self.time("to_host", || self.inner.to_host(b, len))
    }
    fn copy(
        &self,
        src: &Self::Buf,
        src_off: usize,
        dst: &mut Self::Buf,
        dst_off: usize,
        len: usize,
    ) {
        self.time("copy", || self.inner.copy(src, src_off, dst, dst_off, len))
    }
    fn new_route(&self, rows: usize, top_k: usize) -> Result<Self::Route> {
        self.inner.new_route(rows, top_k)
    }
    fn new_step(&self) -> Result<Self::Step> {
        self.inner.new_step()
    }
    fn set_step(&self, step: &mut Self::Step, token: u32, pos: usize) {
        self.time("set_step", || self.inner.set_step(step, token, pos))
    }
    fn step_token(&self, step: &Self::Step) -> Result<u32> {
        self.time("step_token", || self.inner.step_token(step))
    }
    fn step_token_begin(&self, step: &Self::Step) -> Result<super::TokenRead> {
        self.time("step_token", || self.inner.step_token_begin(step))
    }
    fn step_token_finish(&self, read: super::TokenRead) -> Result<u32> {
        self.time("step_token", || self.inner.step_token_finish(read))
    }

    fn embed(&self, table: &Self::Mat, ids: &[u32], out: &mut Self::Buf) {
        self.time("embed", || self.inner.embed(&table.inner, ids, out))
    }
    fn embed_step(&self, table: &Self::Mat, step: &Self::Step, out: &mut Self::Buf) {
        self.time("embed", || self.inner.embed_step(&table.inner, step, out))
    }
    fn rms_norm(
        &self,
        x: &Self::Buf,
        w: &Self::Vec,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Self::Buf,
    ) {
        self.time("rms_norm", || {
            self.inner.rms_norm(x, w, rows, dim, eps, out)
        })
    }
    fn add_rms_norm(
        &self,
        h: &mut Self::Buf,
        r: &Self::Buf,
        w: &Self::Vec,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Self::Buf,
    ) {
        self.time("add_rms_norm", || {
            self.inner.add_rms_norm(h, r, w, rows, dim, eps, out)
        })
    }
    fn matmul_q(&self, x: &Self::Buf, w: &Self::Mat, rows: usize, out: &mut Self::Buf) {
        self.time(&w.family, || self.inner.matmul_q(x, &w.inner, rows, out))
    }
    fn matmul_q_many(
        &self,
        x: &Self::Buf,
        ws: &[&Self::Mat],
        rows: usize,
        outs: &mut [&mut Self::Buf],
    ) {
        let inner: Vec<&B::Mat> = ws.iter().map(|w| &w.inner).collect();
        if !self.prof.is_on() {
            return self.inner.matmul_q_many(x, &inner, rows, outs);
        }
        let family = format!(
            "matmul_q many ({})",
            ws.iter()
                .map(|w| w.family.trim_start_matches("matmul_q "))
                .collect::<Vec<_>>()
                .join(" | ")
        );
        self.time(&family, || self.inner.matmul_q_many(x, &inner, rows, outs))
    }
    fn add(&self, h: &mut Self::Buf, r: &Self::Buf, len: usize) {
        self.time("add", || self.inner.add(h, r, len))
    }
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
        let inner: Vec<&B::Mat> = ws.iter().map(|w| &w.inner).collect();
        if !self.prof.is_on() {
            return self
                .inner
                .rms_norm_matmul(h, w, rows, dim, eps, xn, &inner, outs);
        }
        let family = format!(
            "rms_norm + matmul_q ({})",
            ws.iter()
                .map(|w| w.family.trim_start_matches("matmul_q "))
                .collect::<Vec<_>>()
                .join(" | ")
        );
        self.time(&family, || {
            self.inner
                .rms_norm_matmul(h, w, rows, dim, eps, xn, &inner, outs)
        })
    }
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
        self.time(
            "moe_router (rms_norm + router | shared gate + moe_route)",
            || {
                self.inner.moe_router(
                    h,
                    w,
                    rows,
                    eps,
                    xn,
                    &router.inner,
                    &shared_gate.inner,
                    d,
                    logits,
                    s,
                    route,
                )
            },
        )
    }
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
        if !self.prof.is_on() {
            let wi = GdnWeights::<B> {
                in_proj: w.in_proj.map(|m| &m.inner),
                conv1d: w.conv1d,
                params: w.params,
                out_proj: &w.out_proj.inner,
                route_ahead: w.route_ahead.as_ref().map(inner_ahead),
                x_ahead: w.x_ahead,
            };
            let ti = GdnScratch::<B> {
                xn: tmp.xn,
                qkv: tmp.qkv,
                qkv_c: tmp.qkv_c,
                z: tmp.z,
                b: tmp.b,
                a: tmp.a,
                y: tmp.y,
                r: tmp.r,
            };
            return self
                .inner
                .gdn_mixer_decode_add(h, norm, eps, &wi, conv, ssm, d, ti);
        }
        // Profiled: the unfused ops, each charged to its own family.
        super::gdn_mixer_compose(self, h, norm, eps, w, conv, ssm, d, tmp)
    }
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
        if !self.prof.is_on() {
            let wi = inner_moe(w);
            let ri = RouterScratch::<B> {
                xn: r.xn,
                logits: r.logits,
                s: r.s,
                route: r.route,
                ahead: r.ahead,
            };
            return self
                .inner
                .moe_step_add(h, norm, eps, &wi, d, ri, inner_moe_scratch(tmp));
        }
        // Profiled: the router and the experts, each charged to its own family.
        super::moe_step_compose(self, h, norm, eps, w, d, r, tmp)
    }
    fn matmul_q_add(
        &self,
        x: &Self::Buf,
        w: &Self::Mat,
        rows: usize,
        r: &mut Self::Buf,
        h: &mut Self::Buf,
    ) {
        let family = format!("{} + add", w.family);
        self.time(&family, || self.inner.matmul_q_add(x, &w.inner, rows, r, h))
    }
    // Profiled, the ops run unfused (each charged to its own family): no fold.
    fn route_ahead(&self, out: &Self::Mat, next: &RouteAhead<'_, Self>) -> bool {
        !self.prof.is_on() && self.inner.route_ahead(&out.inner, &inner_ahead(next))
    }
    fn norm_ahead(&self, w: &MoeWeights<'_, Self>, next: &Self::Vec, d: &Dims) -> bool {
        !self.prof.is_on() && self.inner.norm_ahead(&inner_moe(w), next, d)
    }
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
        if self.prof.is_on() {
            return self.rms_norm_matmul(h, w, 1, dim, eps, xn, ws, outs);
        }
        let inner: Vec<&B::Mat> = ws.iter().map(|w| &w.inner).collect();
        self.inner
            .rms_norm_matmul_ahead(h, w, dim, eps, xn, &inner, outs)
    }
    fn matmul_q_add_ahead(
        &self,
        x: &Self::Buf,
        w: &Self::Mat,
        r: &mut Self::Buf,
        h: &mut Self::Buf,
        next: &RouteAhead<'_, Self>,
    ) {
        let family = format!("{} + add", w.family);
        let n = inner_ahead(next);
        self.time(&family, || {
            self.inner.matmul_q_add_ahead(x, &w.inner, r, h, &n)
        })
    }
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
        let sh = SharedExpert::<B> {
            gate: &shared.gate.inner,
            up: &shared.up.inner,
            down: &shared.down.inner,
            logit: shared.logit,
        };
        let tmp = inner_moe_scratch(tmp);
        self.time("moe_decode_add", || {
            self.inner.moe_decode_add(
                x,
                route,
                &gate.inner,
                &up.inner,
                &down.inner,
                &sh,
                d,
                tmp,
                h,
            )
        })
    }

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
    ) {
        self.time("attn_qk_norm_rope", || {
            self.inner
                .attn_qk_norm_rope(qg, k, q_norm, k_norm, d, rows, pos0, step, q, gate)
        })
    }
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
    ) {
        self.time("attn_prefill", || {
            self.inner
                .attn_prefill(q, k, v, gate, kv, d, rows, pos0, out)
        })
    }
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
    ) {
        self.time("attn_decode", || {
            self.inner.attn_decode(q, k, v, gate, kv, d, pos, step, out)
        })
    }
    fn attn_decode_qk(&self, a: AttnStep<'_, Self>) {
        if !self.prof.is_on() {
            return self.inner.attn_decode_qk(inner_step(a));
        }
        // Profiled: attn_qk_norm_rope and attn_decode, each charged to its own family.
        super::attn_decode_qk_compose(self, a)
    }
    fn attn_decode_qk_add(&self, mut a: AttnStep<'_, Self>, o: OProj<'_, Self>) {
        if !self.prof.is_on() {
            let oi = OProj::<B> {
                w: &o.w.inner,
                r: o.r,
                h: o.h,
                next: o.next.as_ref().map(inner_ahead),
            };
            return self.inner.attn_decode_qk_add(inner_step(a), oi);
        }
        // Profiled: the ops, each charged to its own family.
        self.attn_decode_qk(a.reborrow());
        super::out_proj_add(self, a.out, o.w, o.r, o.h, o.next.as_ref());
    }

    fn conv1d_prefill(
        &self,
        x: &Self::Buf,
        w: &Self::Vec,
        state: &mut Self::Buf,
        d: &Dims,
        rows: usize,
        out: &mut Self::Buf,
    ) {
        self.time("conv1d_prefill", || {
            self.inner.conv1d_prefill(x, w, state, d, rows, out)
        })
    }
    fn conv1d_step(
        &self,
        x: &Self::Buf,
        w: &Self::Vec,
        state: &mut Self::Buf,
        d: &Dims,
        out: &mut Self::Buf,
    ) {
        self.time("conv1d_step", || {
            self.inner.conv1d_step(x, w, state, d, out)
        })
    }
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
    ) {
        self.time("gdn_prefill", || {
            self.inner.gdn_prefill(qkv, z, b, a, w, state, d, rows, out)
        })
    }
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
    ) {
        self.time("gdn_decode", || {
            self.inner.gdn_decode(qkv, z, b, a, w, state, d, out)
        })
    }

    fn moe_route(&self, logits: &Self::Buf, d: &Dims, rows: usize, route: &mut Self::Route) {
        self.time("moe_route", || self.inner.moe_route(logits, d, rows, route))
    }
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
    ) {
        self.time("moe_experts_prefill", || {
            self.inner.moe_experts_prefill(
                x,
                route,
                &gate.inner,
                &up.inner,
                &down.inner,
                d,
                rows,
                out,
            )
        })
    }
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
    ) -> bool {
        let sh = shared.map(|s| SharedExpert::<B> {
            gate: &s.gate.inner,
            up: &s.up.inner,
            down: &s.down.inner,
            logit: s.logit,
        });
        // Includes the shared expert where the inner backend folds it in (a GPU).
        self.time("moe_experts_decode", || {
            self.inner.moe_experts_decode(
                x,
                route,
                &gate.inner,
                &up.inner,
                &down.inner,
                sh.as_ref(),
                d,
                out,
            )
        })
    }
    fn swiglu(&self, g: &Self::Buf, u: &Self::Buf, len: usize, out: &mut Self::Buf) {
        self.time("swiglu", || self.inner.swiglu(g, u, len, out))
    }
    fn add_sigmoid_gated(
        &self,
        y: &mut Self::Buf,
        shared: &Self::Buf,
        s: &Self::Buf,
        rows: usize,
        dim: usize,
    ) {
        self.time("add_sigmoid_gated", || {
            self.inner.add_sigmoid_gated(y, shared, s, rows, dim)
        })
    }

    fn argmax_step(&self, logits: &Self::Buf, vocab: usize, step: &mut Self::Step) {
        self.time("argmax", || self.inner.argmax_step(logits, vocab, step))
    }
    fn mask_logits(&self, logits: &mut Self::Buf, vocab: usize, allowed: &[u32]) {
        self.time("mask", || self.inner.mask_logits(logits, vocab, allowed))
    }
    fn new_sampler(
        &self,
        params: &crate::runtime::sampler::SamplingParams,
        seed: u64,
        vocab: usize,
        prompt: &[u32],
    ) -> Result<Option<Self::Sampler>> {
        self.inner.new_sampler(params, seed, vocab, prompt)
    }
    fn sample_step(
        &self,
        logits: &Self::Buf,
        vocab: usize,
        s: &mut Self::Sampler,
        step: &mut Self::Step,
    ) {
        self.time("sample", || self.inner.sample_step(logits, vocab, s, step))
    }
    fn sample_note(&self, s: &mut Self::Sampler, token: u32) {
        self.inner.sample_note(s, token)
    }
    fn logprobs(
        &self,
        logits: &Self::Buf,
        vocab: usize,
        token: u32,
        n: usize,
    ) -> Result<(f32, Vec<(u32, f32)>)> {
        self.time("logprobs", || self.inner.logprobs(logits, vocab, token, n))
    }
}

/// The MoE scratch of the wrapper as the inner backend's (the same buffers).
fn inner_moe_scratch<B: Backend>(t: MoeScratch<'_, Profiled<B>>) -> MoeScratch<'_, B> {
    MoeScratch {
        out: t.out,
        g: t.g,
        u: t.u,
        act: t.act,
        down: t.down,
    }
}

/// The wrapped backend's view of a folded router.
fn inner_ahead<'a, B: Backend>(n: &RouteAhead<'a, Profiled<B>>) -> RouteAhead<'a, B> {
    RouteAhead {
        router: &n.router.inner,
        shared_gate: &n.shared_gate.inner,
        norm: n.norm,
    }
}

/// The inner backend's view of a decode step's attention (the same buffers: only the weights'
/// type wraps the inner one).
fn inner_step<'a, B: Backend>(a: AttnStep<'a, Profiled<B>>) -> AttnStep<'a, B> {
    AttnStep {
        qg: a.qg,
        k: a.k,
        v: a.v,
        q_norm: a.q_norm,
        k_norm: a.k_norm,
        kv: a.kv,
        d: a.d,
        pos: a.pos,
        step: a.step,
        q: a.q,
        gate: a.gate,
        out: a.out,
    }
}

/// The inner backend's view of an MoE block's weights.
fn inner_moe<'a, B: Backend>(w: &MoeWeights<'a, Profiled<B>>) -> MoeWeights<'a, B> {
    MoeWeights::<B> {
        router: &w.router.inner,
        shared_gate: &w.shared_gate.inner,
        gate: &w.gate.inner,
        up: &w.up.inner,
        down: &w.down.inner,
        shared_gate_proj: &w.shared_gate_proj.inner,
        shared_up_proj: &w.shared_up_proj.inner,
        shared_down_proj: &w.shared_down_proj.inner,
        next_norm: w.next_norm,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Cpu;

    #[test]
    fn labels_drop_the_layer() {
        assert_eq!(
            matrix_label("model.layers.7.linear_attn.in_proj_qkv"),
            "linear_attn.in_proj_qkv"
        );
        assert_eq!(
            matrix_label("language_model.model.layers.39.mlp.switch_mlp.gate_proj"),
            "mlp.switch_mlp.gate_proj"
        );
        assert_eq!(matrix_label("lm_head"), "lm_head");
        assert_eq!(matrix_label("model.embed_tokens"), "embed_tokens");
    }

    #[test]
    fn charges_ops_only_while_on() {
        let p = Profiled::new(Cpu);
        let prof = p.profiler();
        let x = p.upload_vec(&[1.0, 2.0]).unwrap();
        let mut h = p.zeros(2).unwrap();
        p.add(&mut h, &x, 2);
        prof.start();
        p.add(&mut h, &x, 2);
        p.add(&mut h, &x, 2);
        let r = prof.stop();
        p.add(&mut h, &x, 2);
        assert_eq!(h, vec![4.0, 8.0]);
        assert_eq!(r.ops.len(), 1);
        assert_eq!((r.ops[0].family.as_str(), r.ops[0].calls), ("add", 2));
        assert!(r.table().contains("add"));
    }
}
