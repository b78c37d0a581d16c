//! The wgpu backend (`--backend wgpu`, cargo feature `wgpu`): WGSL kernels through wgpu, on
//! Metal on a Mac and on Vulkan elsewhere (issue #14). Written once for both; tested in CI on
//! Mesa's lavapipe (a CPU Vulkan), its shaders translated to Metal Shading Language by naga in
//! the tests (`check`), so a shader Metal would reject fails on Linux.
//!
//! Layout: `device` (adapter, pipelines, the shared command encoder, buffers), one file per op
//! family with its WGSL in `shaders/<family>.wgsl` (`norm`, `matmul`, `attention`, `gdn`, `moe`,
//! `output`, `sample`), each prefixed with `shaders/common.wgsl` (and `shaders/quant.wgsl` where
//! it reads weights, `shaders/softfloat.wgsl` for the sampler). The op names are the trait's, the CPU files' and the CUDA kernels'.
//!
//! Element types: activations, the residual stream and states are f32 here (`act_zeros` is
//! `zeros`); the KV cache is f32, or f16 with `LILY_WGPU_KV_F16=1` where the adapter has
//! SHADER_F16 (`kv_zeros`, `WBuf::half`), read into f32 arithmetic; weights stay in the checkpoint's
//! 4/8-bit codes with bf16 scales and biases, dequantized inside the kernels; accumulation f32.
//! Routing, the next token and the recurrent state stay on the GPU, and so does sampling with
//! top-k ≤ 64 (the checkpoint's default among it; `sample`, the CPU's tokens for the same seed;
//! log-probabilities too); top-k off or larger is drawn on the host (`new_sampler` returns
//! `None`).

mod attention;
mod check;
mod device;
mod gdn;
pub mod lab;
mod matmul;
mod moe;
mod norm;
mod output;
mod sample;
#[cfg(not(any(target_os = "macos", target_arch = "wasm32")))]
pub mod stats;

use anyhow::{bail, Result};

use super::{AttnStep, Backend, Dims, GdnParams, KvCache, SharedExpert, TokenRead};
use crate::loader::tensor::HostLinear;
use crate::runtime::sampler::SamplingParams;
pub use check::{not_for_metal, translate_to_msl};
pub use device::AdapterReport;
use device::{as_bytes, Ctx};
use matmul::{OutMode, XIn};

/// The wgpu backend: one device and queue, and the decode steps it recorded.
pub struct Wgpu {
    ctx: Ctx,
    records: std::sync::Mutex<Records>,
}

/// Whether each (named) buffer holds its `need` elements; records the error if not.
fn fits(ctx: &Ctx, op: &str, bufs: &[(&str, &WBuf, usize)]) -> bool {
    if let Some((name, b, need)) = bufs.iter().find(|(_, b, need)| b.len < *need) {
        ctx.fail(format!(
            "{op}: {name} needs {need} elements, its buffer has {}",
            b.len
        ));
        return false;
    }
    true
}

/// Recorded decode steps by key, least recently used first, and the keys seen once.
#[derive(Default)]
struct Records {
    recs: Vec<Record>,
    seen: std::collections::HashSet<u64>,
    /// The step after the last replayed one, encoded ahead: its key, the scratch generation
    /// when encoded, its command buffer.
    ahead: Option<(u64, u64, ::wgpu::CommandBuffer)>,
}

struct Record {
    key: u64,
    /// `Ctx::scratch_gen` when recorded: a scratch buffer replaced since makes it stale.
    gen: u64,
    items: Vec<device::Item>,
}

/// Records kept (sequences decoding at once, samplers and pick kinds included).
const MAX_RECORDS: usize = 16;
/// Keys remembered as seen once before being forgotten.
const MAX_SEEN: usize = 4096;

/// An f32 buffer on the device (`len` elements), or a KV cache's of f16 elements packed two a
/// u32 word (`half`: `Backend::kv_zeros`, attention.rs).
pub struct WBuf {
    buf: ::wgpu::Buffer,
    len: usize,
    half: bool,
}

/// A matrix or stack of `n` matrices `[out, inp]` on the device, in the checkpoint's format
/// (shaders/quant.wgsl): codes `w`, scales `s` and biases `b` (bf16 pairs when `sb16`), or a dense
/// f32 matrix in `w` (`bits` 32).
pub struct WMat {
    n: usize,
    out: usize,
    inp: usize,
    bits: u32,
    gs: usize,
    sb16: bool,
    w: ::wgpu::Buffer,
    s: ::wgpu::Buffer,
    b: ::wgpu::Buffer,
}

impl WMat {
    /// The 8 words of quant.wgsl's `QMat`.
    fn qmat(&self) -> [u32; 8] {
        [
            self.out as u32,
            self.inp as u32,
            self.bits,
            self.gs as u32,
            self.sb16 as u32,
            0,
            0,
            0,
        ]
    }
}

/// Expert routing on the device: `ids` u32 and `weights` f32, `[rows, k]`.
pub struct WRoute {
    ids: ::wgpu::Buffer,
    weights: ::wgpu::Buffer,
    rows: usize,
    k: usize,
}

/// A decode step's token and position on the device: u32 `[token, pos]`.
pub struct WStep {
    buf: ::wgpu::Buffer,
}

impl Wgpu {
    /// The best GPU adapter (`LILY_WGPU_ADAPTER` names one); a software adapter such as
    /// lavapipe only with `allow_software` (tests; `--backend wgpu` asks for it explicitly).
    pub fn new(allow_software: bool) -> Result<Self> {
        Ok(Self {
            ctx: Ctx::new(allow_software)?,
            records: Default::default(),
        })
    }
    /// gemv_q6's least launch in KB of codes from now on (`LILY_WGPU_Q6_MIN_KB`; 0: every
    /// launch gemv_q6 can take); tests compare both paths on one device.
    pub fn set_q6_min_kb(&self, kb: usize) {
        self.ctx
            .sw
            .q6_min_kb
            .store(kb, std::sync::atomic::Ordering::Relaxed);
    }
    /// gemv_q6's workgroups by a launch's size from now on (`LILY_WGPU_Q6_WGS_BY`'s value, ``:
    /// every launch `LILY_WGPU_Q6_WGS`'s).
    pub fn set_q6_wgs_by(&self, v: &str) -> Result<()> {
        let by = device::q6_wgs_by(v)?;
        *self
            .ctx
            .sw
            .q6_wgs_by
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = by;
        Ok(())
    }
    /// gemv_q6w from now on (`LILY_WGPU_Q6W`'s values: 0 off, 1 the projections, 2 the MoE
    /// router's launch too); tests compare it with gemv_q6s on one device.
    pub fn set_q6w(&self, level: u32) {
        self.ctx
            .sw
            .q6w
            .store(level.min(2), std::sync::atomic::Ordering::Relaxed);
    }
    /// The MoE router's launch by gemv_rt with `rows` rows a workgroup (1-3), or gemv_q6w (0),
    /// from now on (`LILY_WGPU_ROUTER`).
    pub fn set_router_rows(&self, rows: u32) {
        self.ctx
            .sw
            .router_rows
            .store(rows.min(3), std::sync::atomic::Ordering::Relaxed);
    }
    /// Takes a decode step's gated delta rule named (`LILY_WGPU_GDN_STEP`'s values: `0`, `y`,
    /// `x`, `yw`) from now on, for tests and `lily lab`.
    pub fn set_gdn_step(&self, name: &str) -> Result<()> {
        let Some(c) = device::gdn_step_code(name) else {
            bail!("unknown GDN step `{name}` (0, y, x, xs or yw)");
        };
        self.ctx
            .sw
            .gdn_step
            .store(c, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
    /// Takes the decode GEMV named (`v4`, `v5`, `v6`, `rw1`, `rw2`, `rw4`, `xs`:
    /// `LILY_WGPU_GEMV`'s values) from now on; tests compare them on one device.
    pub fn set_gemv(&self, name: &str) -> Result<()> {
        let Some(c) = device::gemv_code(name) else {
            bail!("unknown decode GEMV `{name}` (v4, v5, v6, rw1, rw2, rw4 or xs)");
        };
        self.ctx
            .sw
            .gemv
            .store(c, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
    /// Whether `matmul_q` of `rows` rows of x runs on gemm_coop (f16 operands: tests hold it to
    /// their f16 bound, not the f32 one).
    pub fn gemm_is_coop(&self, w: &WMat, rows: usize) -> bool {
        rows > matmul::GEMV_MAX_ROWS && matmul::coop_shader(&self.ctx, w, rows).is_some()
    }
    /// Takes the prefill GEMM named (`big`, `chain`, `coop`, `coop1`, `old`: `LILY_WGPU_GEMM`'s
    /// values) from now on; tests compare them on one device. `coop` and `coop1` run only where
    /// `AdapterReport::coop16` (else the old gemm runs).
    pub fn set_gemm(&self, name: &str) -> Result<()> {
        let Some(c) = device::gemm_code(name) else {
            bail!("unknown prefill GEMM `{name}` (big, chain, coop, coop1 or old)");
        };
        self.ctx
            .sw
            .gemm
            .store(c, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
    /// Takes prefill's grouped expert GEMMs named (`mm8`: moe_mm.wgsl, the default; `old`:
    /// moe.wgsl's moe_gate_up_mm / moe_down_mm; `LILY_WGPU_MOE_MM`'s values) from now on.
    pub fn set_moe_mm(&self, name: &str) -> Result<()> {
        let on = match name {
            "mm8" => true,
            "old" => false,
            _ => bail!("unknown expert GEMM `{name}` (mm8 or old)"),
        };
        self.ctx
            .sw
            .moe_mm8
            .store(on, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
    /// Switches the opt-in router fold (`LILY_WGPU_ROUTE_AHEAD`, Backend::route_ahead) on or off.
    pub fn set_route_ahead(&self, on: bool) {
        self.ctx
            .sw
            .route_ahead
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }
    /// Sets the run-time switches to an arm's values (`LILY_WGPU_*` names and values as the
    /// environment gives them, over the environment's own; `lily bench --arms`): every switch
    /// not named goes back to its value at open. Recorded steps are dropped. Errors (nothing
    /// changed): an unknown name, or one read only when the device opens (`Switches::set_arm`).
    pub fn set_switches(&self, arm: &[(String, String)]) -> Result<()> {
        self.ctx.sw.set_arm(arm)?;
        self.ctx.stale_records();
        self.records
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .ahead
            .take();
        Ok(())
    }
    /// `LILY_WGPU_XQ_AHEAD=fold`'s router fold on or off (with `set_xq_ahead(true)`).
    pub fn set_xq_fold(&self, on: bool) {
        self.ctx
            .sw
            .xq_fold
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }
    /// Switches the stagings of `LILY_WGPU_XQ_AHEAD` on (`1`: all three) or off (`0`); the
    /// default, `down`, is the first alone.
    pub fn set_xq_ahead(&self, on: bool) {
        let sw = &self.ctx.sw;
        sw.xq_ahead.store(on, std::sync::atomic::Ordering::Relaxed);
        sw.xq_moe.store(on, std::sync::atomic::Ordering::Relaxed);
        sw.xq_oproj.store(on, std::sync::atomic::Ordering::Relaxed);
    }
    /// Runs the decode kernels `kernels` names specialised to their launch from now on, the
    /// others not (`LILY_WGPU_SPEC`'s values: `q6`, `moe`, `xq`, `gdn`, `attn`, comma-separated, `all`,
    /// ``).
    pub fn set_spec(&self, kernels: &str) -> Result<()> {
        let s = device::Spec::parse(kernels)?;
        let sw = &self.ctx.sw;
        let r = std::sync::atomic::Ordering::Relaxed;
        sw.q6_spec.store(s.q6, r);
        sw.moe_spec.store(s.moe, r);
        sw.xq_spec.store(s.xq, r);
        sw.gdn_spec.store(s.gdn, r);
        sw.attn_spec.store(s.attn, r);
        Ok(())
    }
    /// The decode MoE block's down kernel (`LILY_WGPU_MOE_DOWN`: `y2`, the default, or `y`).
    pub fn set_moe_down(&self, v: &str) -> Result<()> {
        let Some(code) = device::moe_down_code(v) else {
            bail!("set_moe_down: `{v}` is not y2 or y");
        };
        self.ctx
            .sw
            .moe_down
            .store(code, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
    /// Who stages act for the decode MoE block's down (`LILY_WGPU_MOE_ACT`: `gate` or `down16`,
    /// the default; `Switches::moe_act`) from now on; tests compare them.
    pub fn set_moe_act(&self, v: &str) -> Result<()> {
        let code = match v {
            "gate" => false,
            "down16" => true,
            _ => bail!("set_moe_act: `{v}` is not gate or down16"),
        };
        self.ctx
            .sw
            .moe_act
            .store(code, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
    /// Makes the in-place trace stamp pass boundaries (`LILY_WGPU_TRACE_PASSES`: what an
    /// adapter without TIMESTAMP_QUERY_INSIDE_PASSES gets) or, where it can, inside passes.
    pub fn set_trace_passes(&self, on: bool) {
        self.ctx
            .sw
            .trace_passes
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }
    /// A decode token's MoE block fused (`true`, the default: the shared expert as slot k of the
    /// routed experts' two launches, moe_step_add's route in the first) or as before (`false`:
    /// `LILY_WGPU_MOE_FUSE=0`) from now on; tests compare both on one device.
    pub fn set_moe_fuse(&self, on: bool) {
        self.ctx
            .sw
            .moe_fuse
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }
    /// Starts the in-place trace of replayed decode steps (`lily bench --trace`; device.rs
    /// `Tracer`): a timestamp after every dispatch of the step.
    pub fn trace_begin(&self) -> Result<()> {
        self.ctx.trace_begin()
    }
    /// Stops the trace: one record a launch (its stamps) and the launches, named `entry ×groups`.
    pub fn trace_end(&self) -> Result<crate::backend::trace::Traced> {
        self.ctx.trace_end()
    }
    /// Leaves the kernels whose entry points start with these prefixes out of replayed steps
    /// (`lily bench --in-place`: the step's time without them; the tokens are garbage).
    pub fn set_skip(&self, prefixes: &[&str]) {
        self.ctx.set_skip(prefixes)
    }
    /// moe_xq.wgsl's kernels for the fused MoE block (`LILY_WGPU_MOE_XQ`): 0 off, 1 gate|up
    /// only, 2 both (moe_gate_up_x, moe_down_x), 3 down by moe_down_y, 4 gate|up by
    /// moe_gate_up_y too (tests compare them).
    pub fn set_moe_xq(&self, mode: u32) {
        self.ctx
            .sw
            .moe_xq
            .store(mode, std::sync::atomic::Ordering::Relaxed);
    }
    /// moe_xq.wgsl's shape (`LILY_WGPU_MOE_XQ_SHAPE`, "G,D,S"); false if not one.
    pub fn set_moe_xq_shape(&self, shape: &str) -> bool {
        let Some(c) = device::moe_xq_shape_code(shape) else {
            return false;
        };
        self.ctx
            .sw
            .moe_xq_shape
            .store(c, std::sync::atomic::Ordering::Relaxed);
        true
    }
    /// Whether moe_xq.wgsl's gate|up and down take a fused MoE block of these shapes now
    /// (the switches and the adapter; tests count the launches).
    pub fn moe_xq_takes(&self, hidden: usize, width: usize, k: usize) -> (bool, bool) {
        moe::xq_takes(&self.ctx, hidden, width, k)
    }
    /// `rms_norm_matmul`, returning x's staging where gemv_q6 ran the GEMVs (the buffer
    /// q2x_stage wrote the normed x into, or with `Q6w::Export` gemv_q6w's staging without
    /// the norm's 1 / rms, the bool true: `matmul::gemv_many_xq`).
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_matmul_xq(
        &self,
        h: &WBuf,
        w: &WBuf,
        rows: usize,
        dim: usize,
        eps: f32,
        xn: &mut WBuf,
        ws: &[&WMat],
        outs: &mut [&mut WBuf],
        q6w: matmul::Q6w,
    ) -> Option<(::wgpu::Buffer, bool)> {
        let fused = self.ctx.sw.fuse_norm
            && ws.len() <= 4
            && dim.is_multiple_of(4)
            && w.len >= dim
            && xn.len >= rows * dim
            && ws.iter().all(|m| m.inp == dim)
            && self.many_fits(h, ws, rows, outs);
        if !fused {
            self.rms_norm(h, w, rows, dim, eps, xn);
            self.matmul_q_many(xn, ws, rows, outs);
            return None;
        }
        let xin = XIn::Norm { w, eps, xn };
        matmul::gemv_many_xq(&self.ctx, h, ws, 0, rows, outs, xin, OutMode::Store, q6w)
    }
    /// Records `ops` as the decode step `key` (`Ctx::begin_record`: run as well, or with `dry`
    /// only kept), says the host's time with `LILY_WGPU_STEP_TIMES=1`, and keeps the record
    /// (the least recently used of MAX_RECORDS out) unless an op failed (it reports at the next
    /// check) or a scratch buffer was replaced since `gen`. Whether it was kept.
    fn record(
        &self,
        recs: &mut Records,
        key: u64,
        gen: u64,
        dry: bool,
        ops: &mut dyn FnMut() -> Result<()>,
    ) -> Result<bool> {
        let t0 = std::time::Instant::now();
        self.ctx.begin_record(dry);
        let r = ops();
        let items = self.ctx.end_record();
        // A run step's last dispatches (past the last FLUSH_EVERY) go to the device now, as a
        // replayed step's do, not when the next step is encoded.
        if !dry && self.ctx.sw.ahead {
            self.ctx.flush();
        }
        if self.ctx.sw.step_times {
            let (disp, bind) = self.ctx.host_times();
            eprintln!(
                "wgpu: recorded a decode step{}: {} dispatches and copies, {:.2} ms on the host ({disp:.2} in dispatch_spec, {bind:.2} of it making bind groups)",
                if dry { " ahead" } else { "" },
                items.len(),
                t0.elapsed().as_secs_f64() * 1e3
            );
        }
        r?;
        if self.ctx.has_error() || self.ctx.scratch_gen() != gen {
            return Ok(false);
        }
        recs.recs.retain(|r| r.key != key);
        if recs.recs.len() >= MAX_RECORDS {
            recs.recs.remove(0);
        }
        recs.recs.push(Record { key, gen, items });
        Ok(true)
    }
    /// Whether recorded steps reuse earlier records' bind groups from now on
    /// (`LILY_WGPU_BG_CACHE`); returns the old setting, for a test to put back.
    pub fn set_bg_cache(&self, on: bool) -> bool {
        self.ctx
            .sw
            .bg_cache
            .swap(on, std::sync::atomic::Ordering::Relaxed)
    }
    /// Bind groups made for dispatches so far (tests count a recording's).
    pub fn bind_groups_made(&self) -> u64 {
        self.ctx
            .bind_groups
            .load(std::sync::atomic::Ordering::Relaxed)
    }
    /// Pipelines built so far (tests).
    pub fn pipelines_built(&self) -> usize {
        self.ctx.pipelines_built()
    }
    /// Bind groups kept for later records now (`LILY_WGPU_BG_CACHE`; tests).
    pub fn bind_groups_cached(&self) -> usize {
        self.ctx.bind_groups_cached()
    }
    /// Dispatches encoded so far (op by op, not replays): tests count an op's launches.
    pub fn dispatches(&self) -> u64 {
        self.ctx
            .dispatched
            .load(std::sync::atomic::Ordering::Relaxed)
    }
    /// Launches one decode GEMV of these matrices takes (tests count an op's launches): 2 where
    /// gemv_q6 takes them (q2x_stage first), else 1.
    pub fn gemv_launches(&self, ws: &[&WMat]) -> u64 {
        if matmul::q6_takes(&self.ctx, ws) {
            2
        } else {
            1
        }
    }
    /// softfloat.wgsl on rows of (a, b, c, d) f32 bits, 16 result words a row (sample.wgsl's
    /// `softfloat_check`): the device sampler's arithmetic, for its bit-for-bit test.
    pub fn softfloat_check(&self, rows: &[[u32; 4]]) -> Result<Vec<[u32; 16]>> {
        sample::softfloat_check(&self.ctx, rows)
    }
    /// What the adapter is and offers.
    pub fn report(&self) -> &AdapterReport {
        &self.ctx.report
    }
    /// Uploads host f32 values as a buffer (tests, and the ops' host-side inputs).
    pub fn upload(&self, v: &[f32]) -> Result<WBuf> {
        Ok(WBuf {
            buf: self.ctx.upload(as_bytes(v))?,
            len: v.len(),
            half: false,
        })
    }
    /// Whether `kv_zeros` makes f16 caches now: the adapter has SHADER_F16, and the switch
    /// (`LILY_WGPU_KV_F16`, `set_kv_f16`) asks for f16, or is left to choose and decode
    /// attention runs attn_dec_team (ordered subgroups, the tiled kernels, the team switch on),
    /// the one kernel that reads an f16 cache faster than an f32 one.
    pub fn kv_f16(&self) -> bool {
        let (sw, r) = (&self.ctx.sw, std::sync::atomic::Ordering::Relaxed);
        self.ctx.report.f16
            && match sw.kv_f16.load(r) {
                0 => false,
                1 => true,
                _ => attention::team_on(&self.ctx),
            }
    }
    /// KV caches made from now on in f16 (`true`, where the adapter has SHADER_F16) or f32;
    /// tests compare both on one device. Caches made before keep their type.
    pub fn set_kv_f16(&self, on: bool) {
        self.ctx
            .sw
            .kv_f16
            .store(u32::from(on), std::sync::atomic::Ordering::Relaxed);
    }
    /// Decode attention by attn_dec_team (`true`, where the adapter has ordered subgroups) or
    /// attn_dec_gqa (`LILY_WGPU_ATTN_DEC`); tests and `lily lab` compare both in one process.
    pub fn set_attn_team(&self, on: bool) {
        self.ctx
            .sw
            .attn_team
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }
    /// attn_dec_team with V a block ahead from now on (`LILY_WGPU_ATTN_VAHEAD`).
    pub fn set_attn_vahead(&self, on: bool) {
        self.ctx
            .sw
            .attn_vahead
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }
    /// Decode attention's combine by attn_combine4q, a quarter of a head a workgroup
    /// (`LILY_WGPU_ATTN_CQ`).
    pub fn set_attn_cq(&self, on: bool) {
        self.ctx
            .sw
            .attn_cq
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }
    /// Whether decode attention's combine is attn_combine4q (`LILY_WGPU_ATTN_CQ`).
    pub fn attn_cq(&self) -> bool {
        self.ctx
            .sw
            .attn_cq
            .load(std::sync::atomic::Ordering::Relaxed)
    }
    /// Whether decode attention takes attn_dec_team where the shape allows.
    pub fn attn_team(&self) -> bool {
        self.ctx.report.subgroups
            && self
                .ctx
                .sw
                .attn_team
                .load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Wgpu {
    /// Whether `gemv_v4` takes these projections of `x` at once: decode rows, every matrix in
    /// its layout over x's width, the buffers big enough (else the ops one by one, which
    /// report what is wrong).
    fn many_fits(&self, x: &WBuf, ws: &[&WMat], rows: usize, outs: &[&mut WBuf]) -> bool {
        (1..=matmul::GEMV_MAX_ROWS).contains(&rows)
            && !ws.is_empty()
            && ws.len() == outs.len()
            && ws.iter().zip(outs.iter()).all(|(w, o)| {
                matmul::gemv_takes(&self.ctx, w)
                    && w.n >= 1
                    && w.out >= 1
                    && w.inp == ws[0].inp
                    && o.len >= rows * w.out
            })
            && x.len >= rows * ws[0].inp
    }
}

/// The one-row projection's output mode that folds the MoE router `n` in (gemv_q6 omode 4).
impl Wgpu {
    /// How the projection before the MoE block prepares it (Backend::route_ahead said yes):
    /// x staged ahead (`LILY_WGPU_XQ_AHEAD=1`, `xq_ahead_on`) or the router folded.
    fn ahead_mode<'a>(&self, n: &super::RouteAhead<'a, Wgpu>) -> OutMode<'a> {
        if self.xq_fold_on(n.router, n.shared_gate, n.norm.len) {
            OutMode::AddStageFold {
                router: n.router,
                sgate: n.shared_gate,
                norm: n.norm,
            }
        } else if self.xq_ahead_on(n.router, n.shared_gate, n.norm.len) {
            OutMode::AddStage { norm: n.norm }
        } else {
            OutMode::AddAhead {
                router: n.router,
                sgate: n.shared_gate,
                norm: n.norm,
            }
        }
    }
    /// Whether the projection that stages the MoE block's x ahead (`xq_ahead_on`) folds its
    /// router in too (`LILY_WGPU_XQ_AHEAD=fold`: gemv_q6s omode 6, an 8-bit router and shared
    /// gate of at most 256 rows). A function of the block's weights alone, as `xq_ahead_on`;
    /// moe_step_add then takes the fold where moe_gate_up_y can (else the router reads the
    /// staged x as with `1`: the fold's dots go unread).
    fn xq_fold_on(&self, router: &WMat, sgate: &WMat, norm_len: usize) -> bool {
        self.ctx
            .sw
            .xq_fold
            .load(std::sync::atomic::Ordering::Relaxed)
            && self.xq_ahead_on(router, sgate, norm_len)
            && router.bits == 8
            && sgate.bits == 8
            && router.out <= 256
    }
    /// Whether projections `ws` (≤ 4, one decode row) can read an x staged ahead
    /// (`XIn::StagedRn`: gemv_q6s, rows of `dim`, a multiple of 128).
    fn staged_reads(&self, ws: &[&WMat], dim: usize) -> bool {
        self.ctx
            .sw
            .q6_spec
            .load(std::sync::atomic::Ordering::Relaxed)
            && ws.len() <= 4
            && dim.is_multiple_of(128)
            && ws.iter().all(|m| m.inp == dim)
            && matmul::q6_takes(&self.ctx, ws)
    }
    /// Whether a projection that prepares the MoE block (Backend::route_ahead) stages its x
    /// ahead rather than folding the router: `LILY_WGPU_XQ_AHEAD=1`, and the router and shared
    /// gate read such an x (gemv_q6s, one token, `matmul::stage_ahead_takes`'s shapes). A
    /// function of the block's weights alone, so the projection and moe_step_add agree.
    fn xq_ahead_on(&self, router: &WMat, sgate: &WMat, norm_len: usize) -> bool {
        let sw = &self.ctx.sw;
        let on = |a: &std::sync::atomic::AtomicBool| a.load(std::sync::atomic::Ordering::Relaxed);
        on(&sw.xq_moe)
            && on(&sw.q6_spec)
            && on(&sw.moe_spec)
            && matmul::q6_takes(&self.ctx, &[router, sgate])
            && [router, sgate]
                .iter()
                .all(|m| m.n == 1 && m.inp == router.inp)
            && router.inp.is_multiple_of(128)
            && norm_len >= router.inp
    }
}

impl Backend for Wgpu {
    type Buf = WBuf;
    type Mat = WMat;
    type Vec = WBuf;
    type Route = WRoute;
    type Step = WStep;
    type Sampler = sample::WSampler;

    fn name(&self) -> String {
        let r = &self.ctx.report;
        format!("wgpu ({}, {}, {})", r.name, r.backend, r.device_type)
    }
    /// A decode step is recorded the first time its key is seen (`Ctx::begin_record`: it still
    /// runs) and replayed from then on: the dispatches re-encoded with the parameters and bind
    /// groups made when recorded. A record made while a scratch buffer was replaced (a first
    /// step's ops making their scratch) is not kept: the next step records again. (With
    /// `LILY_WGPU_RECORD_FIRST=0` the first sight runs directly and the second records, as
    /// before: one more step op by op for every new state and every KV cache grown.)
    fn replay(&self, key: u64, ops: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        if !self.ctx.sw.replay {
            return ops();
        }
        let gen = self.ctx.scratch_gen();
        let mut recs = self.records.lock().unwrap_or_else(|e| e.into_inner());
        // A step encoded ahead before a trace began is not traced: encode it again.
        let ahead = recs.ahead.take().filter(|_| !self.ctx.tracing());
        if let Some(i) = recs.recs.iter().position(|r| r.key == key) {
            let r = recs.recs.remove(i);
            if r.gen == gen {
                match ahead.filter(|a| a.0 == key && a.1 == gen) {
                    Some((_, _, cmd)) => self.ctx.submit_ahead(cmd),
                    None => self.ctx.replay_items(&r.items),
                }
                if self.ctx.sw.ahead {
                    // The device starts on this step now; the host encodes the next one (the
                    // same dispatches: a step reads its token and position on the device)
                    // while it runs, instead of after reading this one's token.
                    self.ctx.flush();
                    recs.ahead = self.ctx.encode_ahead(&r.items).map(|c| (key, gen, c));
                }
                recs.recs.push(r);
                return Ok(());
            }
        }
        if recs.seen.len() >= MAX_SEEN {
            recs.seen.clear();
        }
        if !self.ctx.sw.record_first && recs.seen.insert(key) {
            drop(recs);
            return ops();
        }
        self.record(&mut recs, key, gen, false, ops)?;
        Ok(())
    }
    /// The record `replay` would make at the key's first sight, made now without running the
    /// ops (`Ctx::begin_record(true)`), and encoded ahead as the lookahead encodes a replayed
    /// step: the first decode step after a prefill is then a submission. `LILY_WGPU_PRERECORD=0`
    /// leaves the record to the step's first run, as before stop 45.
    fn prerecord(&self, key: u64, ops: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        if !self.ctx.sw.replay || !self.ctx.sw.prerecord || self.ctx.tracing() {
            return Ok(());
        }
        let gen = self.ctx.scratch_gen();
        let mut recs = self.records.lock().unwrap_or_else(|e| e.into_inner());
        if recs.recs.iter().any(|r| r.key == key && r.gen == gen) {
            return Ok(());
        }
        // The prefill's last dispatches go to the device first: it runs them while the host
        // records.
        self.ctx.flush();
        if self.record(&mut recs, key, gen, true, ops)? && self.ctx.sw.ahead {
            let kept = &recs.recs.last().expect("just kept").items;
            recs.ahead = self.ctx.encode_ahead(kept).map(|c| (key, gen, c));
        }
        Ok(())
    }
    /// A decode step recorded without running (`Ctx::begin_record(true)`) and dropped: its
    /// pipelines are built (~0.25 s on the H100 for the full preset, which stop 45's first
    /// prefill paid once the prefill recorded its next step ahead) and, with the bind-group
    /// cache, the weights' bind groups made for the first real record. `LILY_WGPU_WARM_UP=0`
    /// leaves both to the first request.
    fn warm_up(&self, ops: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        if !self.ctx.sw.warm_up || self.ctx.tracing() {
            return Ok(());
        }
        let _recs = self.records.lock().unwrap_or_else(|e| e.into_inner());
        self.ctx.begin_record(true);
        let r = ops();
        drop(self.ctx.end_record());
        r?;
        self.ctx.check()
    }
    fn label(&self, family: &str) {
        self.ctx.set_label(family)
    }
    fn device_times(&self, on: bool) -> Option<super::profile::Report> {
        self.ctx
            .set_timing(on)
            .map(super::profile::Report::from_totals)
    }
    fn sync(&self) -> Result<()> {
        self.ctx.sync()
    }
    /// Blocks of 2048 rows: each expert gets ~64 rows a block (fuller GEMM tiles). Measured on
    /// the H200 at 4K: 1,350.8 tok/s against 1,267.1 at 1024 and 1,093.6 at 512.
    fn prefill_chunk(&self) -> usize {
        2048
    }

    /// The matrix's pages of the mapped checkpoint are let go once uploaded (`release_pages`):
    /// a Mac's unified memory must not hold the model twice while it loads.
    fn upload_mat(&self, m: &HostLinear) -> Result<WMat> {
        let w = matmul::upload_mat(&self.ctx, m)?;
        m.release_pages();
        Ok(w)
    }
    fn upload_vec(&self, v: &[f32]) -> Result<WBuf> {
        self.upload(v)
    }
    fn mat_shape(&self, m: &WMat) -> (usize, usize) {
        (m.out, m.inp)
    }
    fn zeros(&self, len: usize) -> Result<WBuf> {
        Ok(WBuf {
            buf: self.ctx.buffer(4 * len as u64)?,
            len,
            half: false,
        })
    }
    /// f16 where `kv_f16` says so, else f32.
    fn kv_zeros(&self, len: usize) -> Result<WBuf> {
        if !self.kv_f16() {
            return self.zeros(len);
        }
        Ok(WBuf {
            buf: self.ctx.buffer(2 * len as u64)?,
            len,
            half: true,
        })
    }
    fn kv_elem_bytes(&self) -> usize {
        if self.kv_f16() {
            2
        } else {
            4
        }
    }
    fn to_host(&self, b: &WBuf, len: usize) -> Result<Vec<f32>> {
        if len > b.len {
            bail!("to_host: {len} elements asked of a buffer of {}", b.len);
        }
        if b.half {
            let bytes = self.ctx.read(&b.buf, 2 * len as u64)?;
            return Ok(bytes
                .chunks_exact(2)
                .take(len)
                .map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect());
        }
        let bytes = self.ctx.read(&b.buf, 4 * len as u64)?;
        Ok(bytes
            .chunks_exact(4)
            .take(len)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
    /// Between buffers of one type a buffer copy (f16: whole words, even offsets and lengths);
    /// f32 into an f16 cache rounds (attention.rs `kv_store`); f16 into f32 is refused.
    fn copy(&self, src: &WBuf, src_off: usize, dst: &mut WBuf, dst_off: usize, len: usize) {
        if src_off + len > src.len || dst_off + len > dst.len {
            self.ctx.fail(format!(
                "copy: {len} elements from {src_off} of {} into {dst_off} of {}",
                src.len, dst.len
            ));
            return;
        }
        match (src.half, dst.half) {
            (false, false) => self.ctx.copy(
                &src.buf,
                4 * src_off as u64,
                &dst.buf,
                4 * dst_off as u64,
                4 * len as u64,
            ),
            (true, true) if (src_off | dst_off | len).is_multiple_of(2) => self.ctx.copy(
                &src.buf,
                2 * src_off as u64,
                &dst.buf,
                2 * dst_off as u64,
                2 * len as u64,
            ),
            (false, true) => attention::kv_store(&self.ctx, src, src_off, dst, dst_off, len),
            _ => self.ctx.fail(format!(
                "copy: {len} elements from {src_off} of an f16 buffer into {dst_off} of {}: f16 copies are whole words of two, into f16",
                if dst.half { "an f16 one" } else { "an f32 one" }
            )),
        }
    }
    fn new_route(&self, rows: usize, top_k: usize) -> Result<WRoute> {
        Ok(WRoute {
            ids: self.ctx.buffer(4 * (rows * top_k) as u64)?,
            weights: self.ctx.buffer(4 * (rows * top_k) as u64)?,
            rows,
            k: top_k,
        })
    }
    fn new_step(&self) -> Result<WStep> {
        Ok(WStep {
            buf: self.ctx.buffer(8)?,
        })
    }
    fn set_step(&self, step: &mut WStep, token: u32, pos: usize) {
        // A queue write lands before the next submission's commands: submit the ones recorded
        // so far first, so that they still read the step as it was.
        self.ctx.flush();
        self.ctx
            .queue
            .write_buffer(&step.buf, 0, as_bytes(&[token, pos as u32]));
    }
    fn step_token(&self, step: &WStep) -> Result<u32> {
        let b = self.ctx.read(&step.buf, 4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    /// A copy of the token into a mappable buffer, submitted on its own (`Ctx::token_begin`).
    fn step_token_begin(&self, step: &WStep) -> Result<TokenRead> {
        let r = self.ctx.token_begin(&step.buf)?;
        Ok(TokenRead::Pending(Box::new(r)))
    }
    fn step_token_finish(&self, read: TokenRead) -> Result<u32> {
        match read {
            TokenRead::Ready(t) => Ok(t),
            TokenRead::Pending(p) => match p.downcast::<device::TokenRead>() {
                Ok(r) => self.ctx.token_finish(*r),
                Err(_) => bail!("step_token_finish: a read the wgpu backend did not begin"),
            },
        }
    }

    fn embed(&self, table: &WMat, ids: &[u32], out: &mut WBuf) {
        output::embed(&self.ctx, table, ids, out)
    }
    fn embed_step(&self, table: &WMat, step: &WStep, out: &mut WBuf) {
        output::embed_step(&self.ctx, table, step, out)
    }
    fn rms_norm(&self, x: &WBuf, w: &WBuf, rows: usize, dim: usize, eps: f32, out: &mut WBuf) {
        norm::rms_norm(&self.ctx, x, w, rows, dim, eps, out)
    }
    fn add_rms_norm(
        &self,
        h: &mut WBuf,
        r: &WBuf,
        w: &WBuf,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut WBuf,
    ) {
        norm::add_rms_norm(&self.ctx, h, r, w, rows, dim, eps, out)
    }
    fn matmul_q(&self, x: &WBuf, w: &WMat, rows: usize, out: &mut WBuf) {
        matmul::matmul_q(&self.ctx, x, w, 0, rows, out)
    }
    /// A decode row's projections of one input in one `gemv_v4` launch (4 matrices a launch).
    fn matmul_q_many(&self, x: &WBuf, ws: &[&WMat], rows: usize, outs: &mut [&mut WBuf]) {
        if !self.many_fits(x, ws, rows, outs) {
            for (w, o) in ws.iter().zip(outs.iter_mut()) {
                self.matmul_q(x, w, rows, o);
            }
            return;
        }
        for (wc, oc) in ws.chunks(4).zip(outs.chunks_mut(4)) {
            matmul::gemv_many(&self.ctx, x, wc, 0, rows, oc, XIn::Plain, OutMode::Store);
        }
    }
    /// The norm inside the projections' launch: each workgroup normalises its row of `h` (8 KB)
    /// itself and the first writes `xn`, one launch fewer a norm.
    fn rms_norm_matmul(
        &self,
        h: &WBuf,
        w: &WBuf,
        rows: usize,
        dim: usize,
        eps: f32,
        xn: &mut WBuf,
        ws: &[&WMat],
        outs: &mut [&mut WBuf],
    ) {
        self.rms_norm_matmul_xq(h, w, rows, dim, eps, xn, ws, outs, matmul::Q6w::Take);
    }
    /// The residual add in the projection's epilogue (`h += acc`, unrounded).
    fn matmul_q_add(&self, x: &WBuf, w: &WMat, rows: usize, r: &mut WBuf, h: &mut WBuf) {
        if !self.ctx.sw.fuse_epilogue
            || h.len < rows * w.out
            || !self.many_fits(x, &[w], rows, &[&mut *r])
        {
            self.matmul_q(x, w, rows, r);
            self.add(h, r, rows * w.out);
            return;
        }
        matmul::gemv_many(
            &self.ctx,
            x,
            &[w],
            0,
            rows,
            &mut [h],
            XIn::Plain,
            OutMode::Add,
        );
    }
    /// `LILY_WGPU_XQ_AHEAD` down (the default), next or 1: moe_down_ys stages the next op's x
    /// where the block's two launches are moe_gate_up_y and moe_down_y (`moe::stage_next_takes`).
    fn norm_ahead(&self, w: &super::MoeWeights<'_, Self>, next: &WBuf, d: &Dims) -> bool {
        let sh = [w.shared_gate_proj, w.shared_up_proj, w.shared_down_proj];
        self.ctx
            .sw
            .xq_ahead
            .load(std::sync::atomic::Ordering::Relaxed)
            && moe::slot_weights_ok(&self.ctx, w.gate, w.up, w.down, sh, d)
            && moe::stage_next_takes(&self.ctx, d, w.gate, w.up, w.down)
            && d.n_experts <= moe::S_MAX_EXPERTS
            && d.top_k <= d.n_experts
            && next.len >= d.hidden
    }
    /// The staging moe_down_ys left, read by gemv_q6s with Q6_RNG where these projections take
    /// it (one launch: no q2x_stage); else `rms_norm_matmul` from h.
    fn rms_norm_matmul_ahead(
        &self,
        h: &WBuf,
        w: &WBuf,
        dim: usize,
        eps: f32,
        xn: &mut WBuf,
        ws: &[&WMat],
        outs: &mut [&mut WBuf],
    ) {
        if !(self.staged_reads(ws, dim) && self.many_fits(h, ws, 1, outs)) {
            return self.rms_norm_matmul(h, w, 1, dim, eps, xn, ws, outs);
        }
        let xq = match matmul::stage_ahead_scratch(&self.ctx, dim) {
            Ok(b) => b,
            Err(e) => return self.ctx.fail(format!("rms_norm_matmul_ahead: {e:#}")),
        };
        let xin = XIn::StagedRn {
            xq: &xq,
            eps,
            group: dim,
        };
        matmul::gemv_many(&self.ctx, h, ws, 0, 1, outs, xin, OutMode::Store);
    }
    fn route_ahead(&self, out: &WMat, next: &super::RouteAhead<'_, Self>) -> bool {
        let (router, sgate, n) = (next.router, next.shared_gate, next.norm.len);
        if self.xq_ahead_on(router, sgate, n) {
            matmul::stage_ahead_takes(&self.ctx, out, router, sgate, n)
        } else {
            matmul::ahead_takes(&self.ctx, out, router, sgate, n)
        }
    }
    fn matmul_q_add_ahead(
        &self,
        x: &WBuf,
        w: &WMat,
        _r: &mut WBuf,
        h: &mut WBuf,
        next: &super::RouteAhead<'_, Self>,
    ) {
        // The model asked route_ahead first: not folding now would leave moe_step_add's sums
        // empty, so it is an error rather than a silent fallback.
        if !self.route_ahead(w, next) || h.len < w.out || x.len < w.inp {
            return self.ctx.fail(format!(
                "matmul_q_add_ahead: `{}` cannot fold the router (route_ahead said no, or the \
                 buffers are short)",
                w.out
            ));
        }
        let om = self.ahead_mode(next);
        matmul::gemv_many(&self.ctx, x, &[w], 0, 1, &mut [h], XIn::Plain, om);
    }
    /// The GDN mixer with the conv in in_proj's epilogue (gemv_q6's omode 3: one channel a
    /// lane, the state shifted there) and the gated norm in out_proj's staging of x (xq.wgsl
    /// xmode 3): q2x_stage (the norm), in_proj, gdn_recur, q2x_stage (the gated norm) and
    /// out_proj (the residual add in its epilogue), two launches fewer than the composition.
    /// Where in_proj does not take gemv_q6, or with `LILY_WGPU_FUSE_CONV=0`, the composition.
    fn gdn_mixer_decode_add(
        &self,
        h: &mut WBuf,
        norm: &WBuf,
        eps: f32,
        w: &super::GdnWeights<'_, Self>,
        conv: &mut WBuf,
        ssm: &mut WBuf,
        d: &Dims,
        t: super::GdnScratch<'_, Self>,
    ) {
        let c = d.conv_channels();
        let [qkv_w, z_w, b_w, a_w] = w.in_proj;
        let fits = self.ctx.sw.fuse_conv
            && self.ctx.sw.fuse_norm
            && d.conv_kernel == 4
            && qkv_w.out == c
            && w.conv1d.len >= 4 * c
            && conv.len >= 3 * c
            && norm.len >= d.hidden
            && t.xn.len >= d.hidden
            && qkv_w.inp == d.hidden
            && matmul::q6_takes(&self.ctx, &w.in_proj)
            && self.many_fits(
                h,
                &w.in_proj,
                1,
                &[&mut *t.qkv_c, &mut *t.z, &mut *t.b, &mut *t.a],
            );
        if !fits {
            return super::gdn_mixer_compose(self, h, norm, eps, w, conv, ssm, d, t);
        }
        // x staged by the MoE block before (GdnWeights::x_ahead) where in_proj reads it.
        let xq_ahead = if w.x_ahead && self.staged_reads(&w.in_proj, d.hidden) {
            match matmul::stage_ahead_scratch(&self.ctx, d.hidden) {
                Ok(b) => Some(b),
                Err(e) => return self.ctx.fail(format!("gdn_mixer_decode_add: {e:#}")),
            }
        } else {
            None
        };
        let xin = match &xq_ahead {
            Some(xq) => XIn::StagedRn {
                xq,
                eps,
                group: d.hidden,
            },
            None => XIn::Norm {
                w: norm,
                eps,
                xn: t.xn,
            },
        };
        let om = OutMode::Conv {
            w: w.conv1d,
            state: conv,
        };
        let ws = [qkv_w, z_w, b_w, a_w];
        let mut outs = [&mut *t.qkv_c, &mut *t.z, &mut *t.b, &mut *t.a];
        matmul::gemv_many(&self.ctx, h, &ws, 0, 1, &mut outs, xin, om);
        // The gated norm in out_proj's staging of x (xq.wgsl xmode 3) where out_proj takes
        // gemv_q6 and the row fits q2x_stage's head sums (LILY_WGPU_FUSE_GATED_NORM=0: gdn_norm).
        let (hv, dv) = (d.gdn_v_heads, d.gdn_v_dim);
        let gated = self.ctx.sw.fuse_gated_norm
            && dv.is_multiple_of(4)
            && hv * dv <= 4096
            && hv <= 256
            && w.params.norm.len >= dv
            && w.out_proj.inp == hv * dv
            && h.len >= w.out_proj.out
            && matmul::q6_takes(&self.ctx, &[w.out_proj]);
        // The recurrence, the gated norm and out_proj's staging of x in one launch
        // (gdn_step_x; LILY_WGPU_GDN_STEP=y or 0: the recurrence, then q2x_stage's xmode 3).
        if gated && gdn::step_x_takes(&self.ctx, d) {
            // gdn_step_xs (LILY_WGPU_GDN_STEP=xs): the heads' 1 / rms applied by out_proj.
            let split = gdn::step_xs_takes(&self.ctx, d);
            let xq = if split {
                gdn::xs_scratch(&self.ctx, w.out_proj.inp)
            } else {
                matmul::xq_scratch(&self.ctx, 1, w.out_proj.inp)
            };
            let xq = match xq {
                Ok(b) => b,
                Err(e) => return self.ctx.fail(format!("gdn_mixer_decode_add: {e:#}")),
            };
            gdn::gated_delta_x(
                &self.ctx, t.qkv_c, t.z, t.b, t.a, w.params, ssm, d, &xq, split,
            );
            let xin = if split {
                XIn::StagedRn {
                    xq: &xq,
                    eps: d.eps,
                    group: dv,
                }
            } else {
                XIn::Staged { xq: &xq }
            };
            let om = w
                .route_ahead
                .as_ref()
                .map_or(OutMode::Add, |n| self.ahead_mode(n));
            return matmul::gemv_many(&self.ctx, t.y, &[w.out_proj], 0, 1, &mut [h], xin, om);
        }
        gdn::gated_delta_ex(
            &self.ctx, t.qkv_c, t.z, t.b, t.a, w.params, ssm, d, 1, t.y, !gated,
        );
        if !gated {
            return super::out_proj_add(self, t.y, w.out_proj, t.r, h, w.route_ahead.as_ref());
        }
        let xin = XIn::GatedNorm {
            z: t.z,
            w: &w.params.norm,
            eps: d.eps,
            hd: dv,
        };
        let om = w
            .route_ahead
            .as_ref()
            .map_or(OutMode::Add, |n| self.ahead_mode(n));
        matmul::gemv_many(&self.ctx, t.y, &[w.out_proj], 0, 1, &mut [h], xin, om);
    }
    /// Two launches where the shared expert has the stacks' layout (`moe::shared_slot_ok`):
    /// moe_gate_up_s with the shared expert as slot k, moe_down_s with its gate, the routed sum
    /// and the residual add. Else the routed experts, then the shared expert in two launches:
    /// its gate|up, and its down reading silu(gate)·up as it stages x, with the gate, the routed
    /// sum and the residual add in the epilogue (five launches unfused).
    fn moe_decode_add(
        &self,
        x: &WBuf,
        route: &WRoute,
        gate: &WMat,
        up: &WMat,
        down: &WMat,
        shared: &SharedExpert<'_, Self>,
        d: &Dims,
        tmp: super::MoeScratch<'_, Self>,
        h: &mut WBuf,
    ) {
        if moe::shared_slot_ok(&self.ctx, x, route, gate, up, down, shared, d, h) {
            return moe::moe_decode_shared(
                &self.ctx, x, route, gate, up, down, shared, d, h, None, None, None, None,
            );
        }
        let width = shared.gate.out;
        let fits = self.ctx.sw.fuse_epilogue
            && shared.up.out == width
            && shared.down.inp == width
            && shared.down.out == d.hidden
            && h.len >= d.hidden
            && tmp.out.len >= d.hidden
            && shared.logit.len >= 1
            && self.many_fits(x, &[shared.gate, shared.up], 1, &[&mut *tmp.g, &mut *tmp.u])
            && self.many_fits(tmp.g, &[shared.down], 1, &[&mut *tmp.down]);
        if !fits {
            return super::moe_decode_compose(self, x, route, gate, up, down, shared, d, tmp, h);
        }
        moe::moe_experts(&self.ctx, x, route, gate, up, down, d, 1, tmp.out);
        let ctx = &self.ctx;
        let (ws, mut outs) = ([shared.gate, shared.up], [&mut *tmp.g, &mut *tmp.u]);
        matmul::gemv_many(ctx, x, &ws, 0, 1, &mut outs, XIn::Plain, OutMode::Store);
        let xin = XIn::Glu { u: tmp.u };
        let om = OutMode::Residual {
            r: tmp.out,
            s: shared.logit,
        };
        matmul::gemv_many(ctx, tmp.g, &[shared.down], 0, 1, &mut [h], xin, om);
    }
    /// Three launches: the router's (the norm folded in: x, the logits, the shared gate's
    /// logit), then moe_gate_up_s, each of whose routed workgroups routes the token itself
    /// (moe_route's maths) before reading its expert, with the shared expert as slot k, then
    /// moe_down_s (`moe_decode_shared`). Where moe_gate_up_s does not take the block
    /// (`moe::shared_slot_ok`, `moe::route_fold_ok`), moe_router then moe_decode_add.
    fn moe_step_add(
        &self,
        h: &mut WBuf,
        norm: &WBuf,
        eps: f32,
        w: &super::MoeWeights<'_, Self>,
        d: &Dims,
        r: super::RouterScratch<'_, Self>,
        tmp: super::MoeScratch<'_, Self>,
    ) {
        let fused = {
            let shared = SharedExpert {
                gate: w.shared_gate_proj,
                up: w.shared_up_proj,
                down: w.shared_down_proj,
                logit: r.s,
            };
            moe::route_fold_ok(d, r.logits)
                && moe::shared_slot_ok(
                    &self.ctx, r.xn, r.route, w.gate, w.up, w.down, &shared, d, h,
                )
        };
        if w.next_norm.is_some() && !fused {
            // norm_ahead said yes: the op after reads the staging, so it must be written.
            return self.ctx.fail(
                "moe_step_add: the next x to stage, but the block's launches do not take it"
                    .to_string(),
            );
        }
        if !(fused || r.ahead) {
            return super::moe_step_compose(self, h, norm, eps, w, d, r, tmp);
        }
        // After a projection that staged x ahead (`LILY_WGPU_XQ_AHEAD`; it did the residual add
        // either way), the router reads that staging where the experts can too (moe_gate_up_y
        // with MY_RN); else the block stages x from h as usual.
        let xq_ahead = r.ahead && self.xq_ahead_on(w.router, w.shared_gate, norm.len);
        let staged_ahead = xq_ahead
            && fused
            && moe::rn_takes(&self.ctx, d, w.gate, w.up)
            && fits(
                &self.ctx,
                "moe_step_add",
                &[("logits", &*r.logits, w.router.out), ("s", &*r.s, 1)],
            );
        // x staged for the experts (moe_gate_up_x reads it) with the logits: by the router's
        // launches (q2x_stage, then its gemv_q6), after a projection that staged it ahead by
        // the router's gemv_q6s alone, or after a projection that folded the router
        // (RouterScratch::ahead) by q2x_stage_ahead alone, from the projection's sums.
        // The router folded into the projection too (`LILY_WGPU_XQ_AHEAD=fold`): gate|up takes
        // the logits from its partial dots, and no router launch runs.
        let fold = staged_ahead && self.xq_fold_on(w.router, w.shared_gate, norm.len);
        // x staged without its 1 / rms by the router's gemv_q6w.
        let mut rn_x = false;
        let xq = if staged_ahead {
            let xq = match matmul::stage_ahead_scratch(&self.ctx, d.hidden) {
                Ok(b) => b,
                Err(err) => return self.ctx.fail(format!("moe_step_add: {err:#}")),
            };
            if !fold {
                let xin = XIn::StagedRn {
                    xq: &xq,
                    eps,
                    group: d.hidden,
                };
                let ws = [w.router, w.shared_gate];
                let mut outs = [&mut *r.logits, &mut *r.s];
                matmul::gemv_many(&self.ctx, h, &ws, 0, 1, &mut outs, xin, OutMode::Store);
            }
            Some(xq)
        } else if r.ahead && !xq_ahead {
            let (e, hid) = (w.router.out, d.hidden);
            let bufs = [
                ("h", &*h, hid),
                ("norm", norm, hid),
                ("xn", &*r.xn, hid),
                ("logits", &*r.logits, e),
                ("s", &*r.s, 1),
            ];
            if !fits(&self.ctx, "moe_step_add", &bufs) {
                return;
            }
            match matmul::q2x_stage_ahead(&self.ctx, h, norm, eps, r.xn, r.logits, r.s, e, hid) {
                Ok(b) => Some(b),
                Err(err) => return self.ctx.fail(format!("moe_step_add: {err:#}")),
            }
        } else {
            // gemv_q6w may stage x itself and export it without the 1 / rms
            // (`LILY_WGPU_Q6W=2`) where gate|up can read that (as after a projection that
            // staged it ahead).
            let q6w = if fused && moe::rn_takes(&self.ctx, d, w.gate, w.up) {
                matmul::Q6w::Export
            } else {
                matmul::Q6w::Never
            };
            let staged = self.rms_norm_matmul_xq(
                h,
                norm,
                1,
                d.hidden,
                eps,
                r.xn,
                &[w.router, w.shared_gate],
                &mut [&mut *r.logits, &mut *r.s],
                q6w,
            );
            rn_x = staged.as_ref().is_some_and(|s| s.1);
            staged.map(|s| s.0)
        };
        if !fused {
            // Folded, but the experts' launches do not take this block: the composition's route
            // and experts on the fold's x and logits.
            self.moe_route(r.logits, d, 1, r.route);
            return super::moe_experts_add(self, h, w, d, r, tmp);
        }
        let shared = SharedExpert {
            gate: w.shared_gate_proj,
            up: w.shared_up_proj,
            down: w.shared_down_proj,
            logit: r.s,
        };
        moe::moe_decode_shared(
            &self.ctx,
            r.xn,
            r.route,
            w.gate,
            w.up,
            w.down,
            &shared,
            d,
            h,
            Some(r.logits),
            xq.as_ref(),
            (staged_ahead || rn_x).then_some(moe::StagedAhead { eps, fold }),
            w.next_norm,
        );
    }
    fn add(&self, h: &mut WBuf, r: &WBuf, len: usize) {
        norm::add(&self.ctx, h, r, len)
    }

    fn attn_qk_norm_rope(
        &self,
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
        attention::attn_qk_norm_rope(
            &self.ctx, qg, k, q_norm, k_norm, d, rows, pos0, step, q, gate,
        )
    }
    fn attn_prefill(
        &self,
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
        attention::attn_prefill(&self.ctx, q, k, v, gate, kv, d, rows, pos0, out)
    }
    fn attn_decode(
        &self,
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
        attention::attn_decode(&self.ctx, q, k, v, gate, kv, d, pos, step, out)
    }
    /// The norms, RoPE and the cache append in one launch (qk_rope_append_step), then the
    /// attention: one launch fewer a layer than the composition (`LILY_WGPU_FUSE_ROPE=0`).
    fn attn_decode_qk(&self, a: AttnStep<'_, Self>) {
        if !self.ctx.sw.fuse_rope {
            return super::attn_decode_qk_compose(self, a);
        }
        attention::attn_decode_qk(&self.ctx, a, None)
    }
    /// With `LILY_WGPU_XQ_AHEAD` 1, next or oproj, attn_combine4_x stages o_proj's x as it writes
    /// the attention's output, so o_proj's gemv_q6 runs without a q2x_stage; else the ops.
    fn attn_decode_qk_add(&self, mut a: AttnStep<'_, Self>, o: super::OProj<'_, Self>) {
        let staged = self
            .ctx
            .sw
            .xq_oproj
            .load(std::sync::atomic::Ordering::Relaxed)
            && self.ctx.sw.fuse_rope
            && attention::xq_takes(&self.ctx, a.d)
            && o.w.inp == a.d.n_heads * a.d.head_dim
            && matmul::q6_takes(&self.ctx, &[o.w])
            && self.many_fits(a.out, &[o.w], 1, &[&mut *o.h]);
        if !staged {
            self.attn_decode_qk(a.reborrow());
            return super::out_proj_add(self, a.out, o.w, o.r, o.h, o.next.as_ref());
        }
        if o.next.as_ref().is_some_and(|n| !self.route_ahead(o.w, n)) {
            return self.ctx.fail(
                "attn_decode_qk_add: the MoE block to prepare, but route_ahead said no".to_string(),
            );
        }
        let xq = match matmul::xq_scratch(&self.ctx, 1, o.w.inp) {
            Ok(b) => b,
            Err(e) => return self.ctx.fail(format!("attn_decode_qk_add: {e:#}")),
        };
        attention::attn_decode_qk(&self.ctx, a.reborrow(), Some(&xq));
        let om = o.next.as_ref().map_or(OutMode::Add, |n| self.ahead_mode(n));
        let xin = XIn::Staged { xq: &xq };
        matmul::gemv_many(&self.ctx, a.out, &[o.w], 0, 1, &mut [o.h], xin, om);
    }

    fn conv1d_prefill(
        &self,
        x: &WBuf,
        w: &WBuf,
        state: &mut WBuf,
        d: &Dims,
        rows: usize,
        out: &mut WBuf,
    ) {
        gdn::conv1d(&self.ctx, x, w, state, d, rows, out)
    }
    fn conv1d_step(&self, x: &WBuf, w: &WBuf, state: &mut WBuf, d: &Dims, out: &mut WBuf) {
        gdn::conv1d(&self.ctx, x, w, state, d, 1, out)
    }
    fn gdn_prefill(
        &self,
        qkv: &WBuf,
        z: &WBuf,
        b: &WBuf,
        a: &WBuf,
        w: &GdnParams<WBuf>,
        state: &mut WBuf,
        d: &Dims,
        rows: usize,
        out: &mut WBuf,
    ) {
        gdn::gated_delta(&self.ctx, qkv, z, b, a, w, state, d, rows, out)
    }
    fn gdn_decode(
        &self,
        qkv: &WBuf,
        z: &WBuf,
        b: &WBuf,
        a: &WBuf,
        w: &GdnParams<WBuf>,
        state: &mut WBuf,
        d: &Dims,
        out: &mut WBuf,
    ) {
        gdn::gated_delta(&self.ctx, qkv, z, b, a, w, state, d, 1, out)
    }

    fn moe_route(&self, logits: &WBuf, d: &Dims, rows: usize, route: &mut WRoute) {
        moe::moe_route(&self.ctx, logits, d, rows, route)
    }
    fn moe_experts_prefill(
        &self,
        x: &WBuf,
        route: &WRoute,
        gate: &WMat,
        up: &WMat,
        down: &WMat,
        d: &Dims,
        rows: usize,
        out: &mut WBuf,
    ) {
        moe::moe_experts(&self.ctx, x, route, gate, up, down, d, rows, out)
    }
    /// The routed experts only: the model adds the shared expert with its unfused ops.
    fn moe_experts_decode(
        &self,
        x: &WBuf,
        route: &WRoute,
        gate: &WMat,
        up: &WMat,
        down: &WMat,
        _shared: Option<&SharedExpert<'_, Self>>,
        d: &Dims,
        out: &mut WBuf,
    ) -> bool {
        moe::moe_experts(&self.ctx, x, route, gate, up, down, d, 1, out);
        false
    }
    fn swiglu(&self, g: &WBuf, u: &WBuf, len: usize, out: &mut WBuf) {
        norm::swiglu(&self.ctx, g, u, len, out)
    }
    fn add_sigmoid_gated(&self, y: &mut WBuf, shared: &WBuf, s: &WBuf, rows: usize, dim: usize) {
        norm::add_sigmoid_gated(&self.ctx, y, shared, s, rows, dim)
    }

    fn argmax_step(&self, logits: &WBuf, vocab: usize, step: &mut WStep) {
        output::argmax_step(&self.ctx, logits, vocab, step)
    }
    fn mask_logits(&self, logits: &mut WBuf, vocab: usize, allowed: &[u32]) {
        output::mask_logits(&self.ctx, logits, vocab, allowed)
    }

    /// Sampling other than greedy runs on the host (the runtime reads the logits back).
    fn new_sampler(
        &self,
        params: &SamplingParams,
        seed: u64,
        vocab: usize,
        prompt: &[u32],
    ) -> Result<Option<sample::WSampler>> {
        sample::new_sampler(&self.ctx, params, seed, vocab, prompt)
    }
    fn sample_step(&self, logits: &WBuf, vocab: usize, s: &mut sample::WSampler, step: &mut WStep) {
        sample::sample_step(&self.ctx, logits, vocab, s, step)
    }
    fn sample_note(&self, s: &mut sample::WSampler, token: u32) {
        sample::sample_note(&self.ctx, s, token)
    }
    /// On the device (sample.wgsl logprobs_finish): 1 + 2n words read back, not the logits.
    fn logprobs(
        &self,
        logits: &WBuf,
        vocab: usize,
        token: u32,
        n: usize,
    ) -> Result<(f32, Vec<(u32, f32)>)> {
        match sample::logprobs(&self.ctx, logits, vocab, token, n)? {
            Some(r) => Ok(r),
            None => {
                let l = self.to_host(logits, vocab)?;
                Ok(crate::runtime::sampler::token_logprobs(&l, token, n))
            }
        }
    }
}

/// An IEEE half's value (to_host of an f16 KV cache).
fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match exp {
        // Zero and subnormals: man · 2^-24, exact in f32.
        0 => {
            let v = man as f32 / 16_777_216.0;
            return if sign != 0 { -v } else { v };
        }
        0x1f => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}
