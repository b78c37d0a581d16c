//! The CUDA backend (feature `cuda`): every op of the vocabulary as a CUDA C++ kernel.
//!
//! * Loading: cudarc with dynamic loading, so the crate builds with no CUDA installed; `Cuda::new`
//!   says clearly when there is no driver or no device. Kernels are the `kernels/*.cu` files (one
//!   op family each, named like the CPU files), embedded in the binary and compiled with NVRTC for
//!   the device's architecture when the backend is created, cached on disk by source hash
//!   (`nvrtc.rs`; `$LILY_CACHE_DIR`, default `~/.cache/lily`). NVRTC (`libnvrtc.so.13`) is loaded
//!   only on a cache miss and must then be on the loader path (on the H200 image:
//!   `LD_LIBRARY_PATH=/usr/local/cuda/lib64`). `scripts/check-kernels` compiles every file the same
//!   way in CI, without a GPU. Tests: `tests/cuda_ops.rs` (each op against the CPU op).
//! * Memory: weights are uploaded once and stay in their checkpoint format: 4-/8-bit codes as u32
//!   words, scales and biases as bf16 (f16 / f32 scales become f32); unquantized matrices become
//!   f32. The KV cache is bf16 (`kv_zeros`: `Buf`s of 2-byte elements, u16 bits; k and v are
//!   appended as the bf16 activations they are): long-context attention is bound by reading it.
//! * Activations between ops are bf16 (`act_zeros`: `Buf`s of 2-byte elements): every kernel
//!   widens its inputs to f32, computes and accumulates in f32 and rounds each activation it writes
//!   once, to nearest even. f32 stays where a value accumulates or is compared: the residual
//!   stream (a sum over every layer's output; a bf16 stream would lose the small updates), the
//!   logits and router logits (the greedy pick and the expert choice compare them), the shared
//!   expert's gate logit, and the GDN and conv states (the recurrence carries them over the whole
//!   context). Each op checks its operands' types (`buf_ok`, `act_ok`, `out_ok`); a GEMM writes
//!   the type of the output it is given. At batch 1 activations are a few KiB against megabytes of
//!   weights, so this is mostly a prefill saving (each chunk's activations are read several times)
//!   and the memory of a 2048-token chunk's scratch.
//! * Decode (one row): the weight-streaming GEMVs of `decode.rs` (gemv.cu, moe.cu's `moe_sw_*`,
//!   stream.cuh), for 4-/8-bit bf16-scale matrices whose width K has K/256 dividing 16, carry
//!   the step's small ops too: the RMS norm before a layer's projections (`rms_norm_matmul`,
//!   `moe_router`), the residual add after its output projection (`matmul_q_add`), the top-8
//!   routing (the router's last block), the MoE combine, shared-expert gate and residual add
//!   (`moe_decode_add`). Each has a switch (`SWITCHES` in switches.rs, `LILY_CUDA_DISABLE`).
//! * GEMM by shape: `matmul_q` with rows ≤ 8 (decode, tiny batches) runs the GEMV kernels (f32 FMAs),
//!   which stream each weight row once and are memory-bound (one row: the streaming GEMVs above
//!   where they fit, else the warp-per-row kernels of matmul.cu); so do matrices of at most 64 outputs
//!   at any row count (`SKINNY_OUT`: GDN b/a, shared-expert gate; one x row per block row). Above
//!   8 rows (prefill) the rest runs the tensor-core GEMM (`tc_gemm.cuh`: bf16 operands, f32
//!   accumulation), as do the routed experts of a prefill (`moe_tc_gemm`; a fused gate+up
//!   kernel was tried and measured no faster, so gate and up stay two GEMMs). 8 is where the GEMV's per-row x registers run out
//!   and where a 64-row tile starts to amortise its dequantisation. `LILY_CUDA_GEMM=simt` (read
//!   when the backend is created, or `set_tensor_core_gemm`) swaps all of these back to the f32
//!   SIMT GEMMs, which match the CPU to f32 rounding (before the output's bf16 rounding): the
//!   ablation switch and the reference path.
//! * Prefill attention likewise runs on tensor cores (`attn_tc_<HD>` in attention.cu: flash
//!   attention, bf16 q/k/v/p, f32 softmax and accumulators); `LILY_CUDA_ATTN=f32` (or
//!   `set_tensor_core_attention`) swaps back to the f32 `attn_rows`. Decode attention
//!   (`attn_decode_<HD>` + `attn_decode_combine`) is flash decoding on tensor cores as well, but
//!   f32-accurate (p split exactly into three bf16), with the step's k/v append in the same launch;
//!   one block per SM streams its share of the bf16 cache at every position.
//! * Execution: one stream; every op only enqueues work (no host sync) except `to_host` and
//!   `step_token`, which return results. Routing stays on the device (`moe_route`
//!   writes expert ids and weights that the expert kernels read). A prompt's ids come from the
//!   host (`embed` takes `&[u32]`); a decode step reads its token and position from its [`Step`]
//!   (8 bytes of device memory), where `argmax_step` writes the next greedy token, so the decode
//!   loop feeds tokens back on the device and reads 4 bytes per token for the host.
//! * Recorded decode steps (`replay`): a step is hundreds of kernel launches (324 on the
//!   full model) whose host cost (~10 µs each through the driver) was most of its time. The first time a key is seen its ops run
//!   directly (allocating every scratch buffer); the second time they are captured into a CUDA
//!   graph, which is launched then and on every later call with the same key: one launch per
//!   token. Nothing in a step depends on host values that change between steps (positions are
//!   read from the Step; decode attention's grid depends only on the KV capacity and the
//!   device). A record also becomes stale when any scratch buffer of this backend is reallocated (a generation counter); an
//!   allocation while capturing is an error, never a silent use of freed memory.
//!   `LILY_CUDA_GRAPH=0` (or `set_graphs(false)`) runs every step directly: the ablation switch.
//! * Errors: ops cannot return `Result` (the trait's choice), so the first failure (a bad shape, a
//!   launch error) is kept and returned by the next `to_host` / `step_token` / `check`; after it the
//!   backend launches nothing more.
//! * Files: this one holds the types, the constructor and the `Backend` impl (small ops inline,
//!   the rest delegated); `device.rs` the plumbing under every op (memory, launches, reads,
//!   operand checks); one file per op family's host side (`attention.rs`, `gdn.rs`,
//!   `experts.rs`, `matmul.rs`, `sample.rs`, and `decode.rs` for the streaming decode kernels);
//!   `switches.rs` the ablation switches and opt-in variants with what each measured; `lab.rs`
//!   and `ceiling.rs` the measuring tools; `nvrtc.rs` the kernel compilation and its cache.

mod attention;
mod ceiling;
mod decode;
mod device;
mod experts;
mod gdn;
pub mod lab;
mod matmul;
mod nvrtc;
mod sample;
mod switches;
mod trace;

pub use switches::{OPT_IN, SWITCHES};

use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{
    result as dr, sys, CudaContext, CudaFunction, CudaGraph, CudaModule, CudaSlice, CudaStream,
    DevicePtr,
};

use super::{
    Backend, Dims, GdnParams, KvCache, MoeScratch, MoeWeights, RouteAhead, RouterScratch,
    SharedExpert,
};
use crate::loader::tensor::{bf16_to_f32, f32_to_bf16, Dtype, HostLinear, HostTensor, LinearKind};

/// The kernel files, compiled in this order (`*.cuh` headers are prepended to each).
const HEADERS: &[(&str, &str)] = &[
    ("common.cuh", include_str!("kernels/common.cuh")),
    ("mma.cuh", include_str!("kernels/mma.cuh")),
    ("quant.cuh", include_str!("kernels/quant.cuh")),
    ("route.cuh", include_str!("kernels/route.cuh")),
    ("stream.cuh", include_str!("kernels/stream.cuh")),
    ("tc_gemm.cuh", include_str!("kernels/tc_gemm.cuh")),
    ("tc_stream.cuh", include_str!("kernels/tc_stream.cuh")),
    ("wide.cuh", include_str!("kernels/wide.cuh")),
];
const FILES: &[(&str, &str)] = &[
    ("norm.cu", include_str!("kernels/norm.cu")),
    ("matmul.cu", include_str!("kernels/matmul.cu")),
    ("gemv.cu", include_str!("kernels/gemv.cu")),
    ("attention.cu", include_str!("kernels/attention.cu")),
    ("gdn.cu", include_str!("kernels/gdn.cu")),
    ("moe.cu", include_str!("kernels/moe.cu")),
    ("sample.cu", include_str!("kernels/sample.cu")),
    ("ceiling.cu", include_str!("kernels/ceiling.cu")),
    ("lab.cu", include_str!("kernels/lab.cu")),
];

/// The full source NVRTC compiles for kernel file `name` (headers prepended in name order).
pub fn kernel_source(name: &str) -> Option<String> {
    let (_, body) = FILES.iter().find(|(n, _)| *n == name)?;
    let mut s = String::new();
    for (_, h) in HEADERS {
        s.push_str(h);
        s.push('\n');
    }
    s.push_str(body);
    Some(s)
}

/// Compiles every kernel file for `arch` (e.g. `sm_90`) with NVRTC, bypassing the cache; returns
/// each file's cubin size. Needs NVRTC but no GPU (the compile check of tests/cuda_ops.rs).
pub fn compile_kernels(arch: &str) -> Result<Vec<(&'static str, usize)>> {
    let mut opts = vec![format!("--gpu-architecture={arch}")];
    opts.extend(nvrtc::OPTIONS.iter().map(|s| s.to_string()));
    FILES
        .iter()
        .map(|(f, _)| {
            Ok((
                *f,
                nvrtc::compile(f, &kernel_source(f).expect("listed"), &opts)?.len(),
            ))
        })
        .collect()
}

/// Compiles (or finds in the disk cache) every kernel file for `arch`: fills the cache ahead of a
/// run, e.g. for a machine without NVRTC. Returns the cache directory.
pub fn precompile_kernels(arch: &str) -> Result<std::path::PathBuf> {
    for (f, _) in FILES {
        nvrtc::cubin_cached(f, &kernel_source(f).expect("listed"), arch)?;
    }
    Ok(nvrtc::cache_dir())
}

/// `LILY_CUDA_DEFINE=NAME=VALUE,...`: compile-time parameters of the kernel files (those a file
/// guards with `#ifndef`, e.g. gemv.cu's SW_MINB) overridden for a measurement, as `#define`
/// lines ahead of every file (the cubin cache keys on the source, so each setting compiles once).
/// A lab knob: the defaults are what was measured best.
fn lab_defines() -> Result<String> {
    let Ok(v) = std::env::var("LILY_CUDA_DEFINE") else {
        return Ok(String::new());
    };
    let mut s = String::new();
    for d in v.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let (name, val) = d.split_once('=').unwrap_or((d, "1"));
        let ok =
            |t: &str| !t.is_empty() && t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ok(name) || !ok(val) {
            bail!("LILY_CUDA_DEFINE: `{d}` is not NAME=VALUE (letters, digits, _)");
        }
        s += &format!("#define {name} {val}\n");
    }
    Ok(s)
}

/// A device allocation (bytes) and its raw address.
struct Mem {
    _slice: CudaSlice<u8>,
    ptr: u64,
    bytes: usize,
}

/// A buffer on the device: f32 (`zeros`, `upload_vec`: the residual stream, logits, states,
/// parameters) or bf16 (`act_zeros`, `upload_act`: activations between ops; `kv_zeros`: the KV
/// cache).
pub struct Buf {
    mem: Mem,
    len: usize,
    /// Bytes per element: 4 (f32) or 2 (bf16 bits). Every op checks each operand's type by its
    /// role (`buf_ok`: f32, `act_ok`: bf16, `out_ok`: a GEMM output, either), so a buffer of the
    /// wrong type is an error, never misread memory.
    elem: usize,
}

impl Buf {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    fn at(&self, off: usize) -> u64 {
        self.mem.ptr + (self.elem * off) as u64
    }
    /// The kernels' output-type flag (`store_out` in common.cuh): 1 for bf16, 0 for f32.
    fn bf16(&self) -> i32 {
        (self.elem == 2) as i32
    }
}

/// Weight formats (the kernels' name suffixes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fmt {
    Q4Bf16,
    Q8Bf16,
    Q4F32,
    Q8F32,
    Dense,
}

impl Fmt {
    fn suffix(self) -> &'static str {
        match self {
            Fmt::Q4Bf16 => "q4_bf16",
            Fmt::Q8Bf16 => "q8_bf16",
            Fmt::Q4F32 => "q4_f32",
            Fmt::Q8F32 => "q8_f32",
            Fmt::Dense => "dense",
        }
    }
}

/// The kernels' view of a weight stack (`struct QMat` in quant.cuh; same layout).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct QMat {
    w: u64,
    s: u64,
    b: u64,
    out: i32,
    inp: i32,
    gs: i32,
    pad: i32,
    wpm: u64,
    gpm: u64,
}

/// Format, codes, scales, biases, group size of an uploaded matrix.
type MatParts = (Fmt, Mem, Option<Mem>, Option<Mem>, usize);

/// A weight stack resident on the device: `n` matrices `[out, inp]`.
pub struct Mat {
    pub n: usize,
    pub out: usize,
    pub inp: usize,
    fmt: Fmt,
    gs: usize,
    w: Mem,
    s: Option<Mem>,
    b: Option<Mem>,
}

impl QMat {
    /// No matrix (an absent optional operand; kernels test the flag that goes with it).
    fn none() -> Self {
        QMat {
            w: 0,
            s: 0,
            b: 0,
            out: 0,
            inp: 0,
            gs: 1,
            pad: 0,
            wpm: 0,
            gpm: 0,
        }
    }
}

/// Up to 4 matrices of one decode GEMV launch (`struct Many` in matmul.cu; same layout).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Many {
    m: [QMat; 4],
    out: [u64; 4],
    bstart: [i32; 5],
    n: i32,
    obf: [i32; 4],
}

impl Mat {
    fn q(&self) -> QMat {
        let bits = match self.fmt {
            Fmt::Q4Bf16 | Fmt::Q4F32 => 4,
            Fmt::Q8Bf16 | Fmt::Q8F32 => 8,
            Fmt::Dense => 32,
        };
        QMat {
            w: self.w.ptr,
            s: self.s.as_ref().map_or(0, |m| m.ptr),
            b: self.b.as_ref().map_or(0, |m| m.ptr),
            out: self.out as i32,
            inp: self.inp as i32,
            gs: self.gs as i32,
            pad: 0,
            wpm: (self.out * self.inp * bits / 32) as u64,
            gpm: (self.out * self.inp / self.gs) as u64,
        }
    }
    /// Bytes on the device.
    pub fn nbytes(&self) -> usize {
        self.w.bytes
            + self.s.as_ref().map_or(0, |m| m.bytes)
            + self.b.as_ref().map_or(0, |m| m.bytes)
    }
}

/// Expert routing of a block of tokens, on the device: ids `[rows, k]` u32, weights `[rows, k]` f32.
pub struct Route {
    ids: Mem,
    weights: Mem,
    /// Capacity in (row, slot) entries.
    cap: usize,
    /// Slots per row of the last routing.
    k: usize,
}

/// A decode step on the device: `[token u32, position i32]` (argmax_step in sample.cu).
pub struct Step {
    mem: Mem,
}

impl Step {
    fn pos_ptr(&self) -> u64 {
        self.mem.ptr + 4
    }
}

/// A recorded decode step.
struct Record {
    key: u64,
    /// The scratch generation it was captured at.
    gen: u64,
    graph: CudaGraph,
    /// The kernels it launches, in order (kept only when tracing: trace.rs).
    launches: Vec<crate::backend::trace::Launch>,
}

/// Recorded steps, most recently used last, and the keys seen once (run directly, to warm up).
#[derive(Default)]
struct Records {
    recs: Vec<Record>,
    seen: HashSet<u64>,
}

// SAFETY: a CudaGraph is only used under the `records` mutex, on the backend's one stream.
unsafe impl Send for Records {}

/// Records kept: one per live sequence state in practice (the prefix cache forks a few).
const MAX_RECORDS: usize = 8;
/// Keys remembered as seen once (a server makes a state per forked request: bounded memory).
const MAX_SEEN: usize = 4096;

/// A kernel argument (passed to cuLaunchKernel by address).
enum Arg {
    P(u64),
    I(i32),
    F(f32),
    D(f64),
    Q(QMat),
    M(Box<Many>),
    S(Box<decode::SwArgs>),
    E(Box<decode::SwMoe>),
    T(Box<decode::SwStep>),
    R(Box<decode::RaArgs>),
    A(Box<attention::DecQk>),
}

/// Reads of at least this many bytes go through the page-locked staging buffer.
const PINNED_MIN: usize = 64 * 1024;
/// Token read slots kept (`step_token_begin`): the decode loop has one read in flight at a
/// time; a spare or two cover a caller that begins the next before finishing.
const TOKEN_READS: usize = 3;
/// Most slices of the greedy pick's first pass (argmax_partial in sample.cu): 128 blocks of 256
/// threads cover the 248K-entry vocabulary in one wave.
const ARGMAX_PARTS: usize = 128;
/// A one-row GEMV of at most this many outputs (in all, for gemv_many) loads each batch's scales,
/// biases and x with its weights (gemv1a / gemv_manya, AHEAD in quant.cuh): such matrices (out_proj,
/// o_proj: 2048; the router and shared-expert gate: 257) fill a fraction of the GPU's warp slots,
/// so latency sets their speed. Larger ones (GDN in_proj 12,352, attention q|k|v 9,216, lm_head)
/// keep the lean loop, whose 38-40 registers let an SM hold enough warps to stream the weights.
const GEMV_AHEAD_ROWS: usize = 4096;
/// Rows (one warp each) per block of moe_route (ROUTE_WARPS in moe.cu).
const ROUTE_WARPS: usize = 4;
/// Decode attention (attn_decode_<HD> in attention.cu): warps per block (DEC_W) and keys per
/// warp step (DEC_KEYS). A block takes at least one step per warp, so a capacity of c keys needs
/// at most c / 64 blocks per group of query heads.
const ATT_DEC_WARPS: usize = 8;
const ATT_DEC_KEYS: usize = 8;
/// Dynamic shared memory of a tensor-core GEMM tile with one weight stream (TC_SMEM(1) in
/// tc_gemm.cuh: two buffers of 2 tiles of 64 × 72 bf16).
const TC_SMEM_1: u32 = 2 * 2 * 64 * 72 * 2;
/// Rows per thread of conv1d_prefill (CONV_RPT in gdn.cu).
const CONV_RPT: usize = 16;
/// Rows of GDN state per warp of gdn_scan_<NC>_<RPW> (gdn.cu): more warps for a prefill, fewer
/// redundant q/k norms for a decode step.
const GDN_RPW_PREFILL: usize = 2;
const GDN_RPW_DECODE: usize = 4;
/// At or below this many outputs a matrix of a prefill (GDN b/a: 32, shared-expert gate: 1) runs
/// gemv1 with one block row per token (grid.y = rows) instead of the tensor-core GEMM: a 64×64 tile
/// grid of one column block has too few blocks to hide its k-loop latency. Profiled per call at
/// 256 rows on the H200 (each figure includes the profiler's ~12 µs sync): 37–40 µs as a
/// tensor-core GEMM, 25–28 µs as 8-row GEMV slices (which re-read x from L1 for every weight row),
/// 18–22 µs this way. The router (256 outputs) stays on the tensor cores: 29 µs in the op timing,
/// against 45 µs as 8-row GEMV slices.
const SKINNY_OUT: usize = 64;

/// The kernel-name suffix of a one-row GEMV of `out` outputs in all: "a" (gemv1a, gemv_manya)
/// up to GEMV_AHEAD_ROWS, else "" (the lean loop).
fn gemv_ahead(out: usize) -> &'static str {
    if out <= GEMV_AHEAD_ROWS {
        "a"
    } else {
        ""
    }
}

fn grid1(n: usize, per: usize) -> u32 {
    n.div_ceil(per).max(1) as u32
}

pub struct Cuda {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    modules: Vec<Arc<CudaModule>>,
    funcs: Mutex<HashMap<String, CudaFunction>>,
    err: Mutex<Option<String>>,
    scratch: Mutex<HashMap<&'static str, Mem>>,
    device: String,
    /// Prefill GEMMs on tensor cores (bf16 operands) rather than f32 SIMT.
    tc_gemm: AtomicBool,
    /// Prefill attention on tensor cores (attn_tc_<HD>) rather than f32 SIMT (attn_rows).
    tc_attn: AtomicBool,
    /// Decode steps recorded as CUDA graphs and replayed.
    graphs: AtomicBool,
    records: Mutex<Records>,
    /// Bumped whenever a scratch buffer is (re)allocated: records of older generations are stale.
    scratch_gen: AtomicU64,
    /// A step is being captured: allocations are refused.
    capturing: AtomicBool,
    /// Every kernel launched with programmatic dependent launch (sm_90 and later,
    /// `LILY_CUDA_PDL=1`; see `launch`). Off by default: measured on the H200 (full preset,
    /// alternated on/off/on) it gave prefill at 4K -5.5% (11.1K against 11.8K tok/s). Inside a
    /// recorded decode step it is on by default instead (`pdl_ok` and switch `pdl_step`): there
    /// it measured decode 471 against 457 tok/s at 4K, 431 against 424 at 32K (two rounds each,
    /// alternated). Every kernel starts with PDL_ENTRY, a no-op without the launch attribute; the
    /// streaming GEMVs (gemv.cu) let their dependent launch at entry and request their first
    /// weights before waiting, so the next layer's weights stream while the previous kernel
    /// finishes.
    pdl: bool,
    /// The device has programmatic dependent launch (sm_90 and later).
    pdl_ok: bool,
    /// Page-locked staging for large device → host reads (`read`).
    pinned: Mutex<Option<cudarc::driver::PinnedHostSlice<u8>>>,
    /// Free slots of token reads (`step_token_begin`), at most `TOKEN_READS`.
    token_slots: Mutex<Vec<device::TokenSlot>>,
    /// Decode-path optimisations switched off (ablations): names from [`SWITCHES`], set by
    /// `LILY_CUDA_DISABLE=a,b` when the backend is created or by [`Cuda::set_disabled`].
    disabled: std::sync::RwLock<HashSet<&'static str>>,
    /// Opt-in variants switched on (names from [`OPT_IN`], `LILY_CUDA_ENABLE`).
    enabled: std::sync::RwLock<HashSet<&'static str>>,
    /// Resident blocks per kernel (the streaming kernels' grids: one wave).
    occupancy: decode::Occupancy,
    /// Streaming multiprocessors of the device.
    sm_count: u32,
    /// A timing probe, never for results: kernels whose names start with one of these prefixes
    /// are left out of recorded decode steps (`LILY_CUDA_SKIP=gdn_step,attn_`). The step's time
    /// without them, against the full step's, is their cost in place (overlap with their
    /// neighbours included), which neither the lab nor ncu's kernel-by-kernel times give.
    /// `lily bench --in-place` sets it per measurement ([`Cuda::set_skip`]).
    skip: std::sync::RwLock<Vec<String>>,
    /// The in-place trace (`LILY_CUDA_TRACE=1` at creation; trace.rs), or None.
    tracer: Option<trace::Tracer>,
}

impl Cuda {
    /// The first GPU.
    pub fn new() -> Result<Self> {
        Self::with_device(0)
    }

    /// GPU `ordinal`: creates the context and stream and loads (compiling if needed) every kernel.
    pub fn with_device(ordinal: usize) -> Result<Self> {
        Self::with_options(ordinal, false)
    }

    /// GPU `ordinal` with the in-place trace (trace.rs; as `LILY_CUDA_TRACE=1`): every kernel
    /// built with it, [`Cuda::trace_begin`] and [`Cuda::trace_end`] usable.
    pub fn with_trace(ordinal: usize) -> Result<Self> {
        Self::with_options(ordinal, true)
    }

    fn with_options(ordinal: usize, trace: bool) -> Result<Self> {
        // SAFETY: probing for the library has no preconditions.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            bail!("CUDA backend: no NVIDIA driver found (libcuda.so could not be loaded); use --backend cpu");
        }
        let n = CudaContext::device_count()
            .map_err(|e| anyhow!("CUDA backend: the driver did not initialise: {e}"))?;
        if n <= 0 {
            bail!("CUDA backend: the driver sees no GPU");
        }
        if ordinal >= n as usize {
            bail!("CUDA backend: GPU {ordinal} asked for, {n} present");
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| anyhow!("CUDA backend: cannot create a context on GPU {ordinal}: {e}"))?;
        // One stream, ordered work: cudarc's per-buffer event tracking is not needed.
        // SAFETY: set before any allocation; all work goes to the one stream below.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let (major, minor) = ctx.compute_capability()?;
        let arch = format!("sm_{major}{minor}");
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_or(1, |n| n.max(1) as u32);
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        // The in-place trace (trace.rs): every file compiled with LILY_TRACE.
        let tracing = trace || std::env::var("LILY_CUDA_TRACE").is_ok_and(|v| v == "1");
        let defines = lab_defines()?;
        // Compile (or read from the cache) all files in parallel; NVRTC is thread-safe.
        let cubins: Vec<Result<Vec<u8>>> = std::thread::scope(|s| {
            let hs: Vec<_> = FILES
                .iter()
                .map(|(f, _)| {
                    let (arch, defines) = (&arch, &defines);
                    s.spawn(move || {
                        let src = kernel_source(f).expect("listed");
                        let src = if tracing {
                            trace::traced_source(src)
                        } else {
                            src
                        };
                        nvrtc::cubin_cached(f, &format!("{defines}{src}"), arch)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow!("kernel compilation panicked")))
                })
                .collect()
        });
        let mut modules = Vec::new();
        for ((f, _), c) in FILES.iter().zip(cubins) {
            let c = c?;
            let m = ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(c))
                .with_context(|| format!("loading kernels {f} on {name} ({arch})"))?;
            modules.push(m);
        }
        Ok(Self {
            ctx,
            stream,
            modules,
            funcs: Mutex::new(HashMap::new()),
            err: Mutex::new(None),
            scratch: Mutex::new(HashMap::new()),
            device: format!("{name}, {arch}"),
            tc_gemm: AtomicBool::new(std::env::var("LILY_CUDA_GEMM").map_or(true, |v| v != "simt")),
            tc_attn: AtomicBool::new(std::env::var("LILY_CUDA_ATTN").map_or(true, |v| v != "f32")),
            graphs: AtomicBool::new(std::env::var("LILY_CUDA_GRAPH").map_or(true, |v| v != "0")),
            records: Mutex::new(Records::default()),
            scratch_gen: AtomicU64::new(0),
            capturing: AtomicBool::new(false),
            pinned: Mutex::new(None),
            token_slots: Mutex::new(Vec::new()),
            pdl: major >= 9 && std::env::var("LILY_CUDA_PDL").is_ok_and(|v| v == "1"),
            pdl_ok: major >= 9,
            disabled: std::sync::RwLock::new(HashSet::new()),
            enabled: std::sync::RwLock::new(HashSet::new()),
            occupancy: decode::Occupancy::default(),
            sm_count,
            skip: std::sync::RwLock::new(
                std::env::var("LILY_CUDA_SKIP")
                    .map(|v| {
                        v.split(',')
                            .map(|s| s.trim().to_string())
                            .filter(|s| !s.is_empty())
                            .collect()
                    })
                    .unwrap_or_default(),
            ),
            tracer: None,
        })
        .and_then(|mut c: Self| {
            if tracing {
                c.tracer = Some(c.make_tracer().context("LILY_CUDA_TRACE")?);
            }
            let env_names = |var: &str| {
                std::env::var(var)
                    .map(|v| {
                        v.split(',')
                            .map(|s| s.trim().to_string())
                            .filter(|s| !s.is_empty())
                            .collect::<Vec<_>>()
                    })
                    .unwrap_or_default()
            };
            let (off, on) = (
                env_names("LILY_CUDA_DISABLE"),
                env_names("LILY_CUDA_ENABLE"),
            );
            c.set_disabled(&off.iter().map(String::as_str).collect::<Vec<_>>())
                .context("LILY_CUDA_DISABLE")?;
            c.set_enabled(&on.iter().map(String::as_str).collect::<Vec<_>>())
                .context("LILY_CUDA_ENABLE")?;
            Ok(c)
        })
    }

    /// Waits for all enqueued work and returns the first error of any op since the last check.
    pub fn check(&self) -> Result<()> {
        self.ctx.bind_to_thread()?;
        if let Err(e) = self.stream.synchronize() {
            self.fail(format!("device error: {e}"));
        }
        match self.err.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            Some(e) => bail!("CUDA backend: {e}"),
            None => Ok(()),
        }
    }

    /// Prefill GEMMs (`matmul_q` above 8 rows, routed experts of a prefill) on tensor cores with
    /// bf16 operands (`true`, the default) or in f32 SIMT (`false`, as `LILY_CUDA_GEMM=simt`).
    pub fn set_tensor_core_gemm(&self, on: bool) {
        self.tc_gemm.store(on, Ordering::Relaxed);
    }
    pub fn tensor_core_gemm(&self) -> bool {
        self.tc_gemm.load(Ordering::Relaxed)
    }
    /// Prefill attention on tensor cores (`true`, the default: attn_tc_<HD>, bf16 q/k/v/p) or in
    /// f32 SIMT (`false`, as `LILY_CUDA_ATTN=f32`: attn_rows, equal to the CPU to f32 rounding).
    pub fn set_tensor_core_attention(&self, on: bool) {
        self.tc_attn.store(on, Ordering::Relaxed);
    }
    pub fn tensor_core_attention(&self) -> bool {
        self.tc_attn.load(Ordering::Relaxed)
    }

    /// Decode steps recorded and replayed as CUDA graphs (`true`, the default) or run op by op
    /// (`false`, as `LILY_CUDA_GRAPH=0`).
    pub fn set_graphs(&self, on: bool) {
        self.graphs.store(on, Ordering::Relaxed);
        if !on {
            *self.records.lock().unwrap_or_else(|e| e.into_inner()) = Records::default();
        }
    }
    pub fn graphs(&self) -> bool {
        self.graphs.load(Ordering::Relaxed)
    }
}

impl Backend for Cuda {
    type Buf = Buf;
    type Mat = Mat;
    type Vec = Buf;
    type Route = Route;
    type Step = Step;
    type Sampler = sample::Sampler;

    fn name(&self) -> String {
        format!("cuda ({})", self.device)
    }
    fn sync(&self) -> Result<()> {
        self.check()
    }

    fn replay(&self, key: u64, ops: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        if !self.graphs() || self.failed() {
            return ops();
        }
        let gen = self.scratch_gen.load(Ordering::Relaxed);
        let mut recs = self.records.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = recs.recs.iter().position(|r| r.key == key) {
            if recs.recs[i].gen == gen {
                let r = recs.recs.remove(i);
                let launched = r.graph.launch();
                self.trace_replayed(&r.launches);
                recs.recs.push(r);
                return launched
                    .map_err(|e| anyhow!("CUDA backend: launching a recorded decode step: {e}"));
            }
            recs.recs.remove(i); // stale: a scratch buffer it uses was replaced
        }
        if recs.seen.len() >= MAX_SEEN {
            // Keys of states long dropped (ids are never reused); forgetting one only costs a
            // live state one more direct step before it is recorded again.
            recs.seen.clear();
        }
        if recs.seen.insert(key) {
            // First sight: run directly, so that every buffer the step needs exists.
            drop(recs);
            return ops();
        }
        match self.capture(ops) {
            Ok(graph) => {
                let launched = graph.launch();
                let launches = self.trace_captured();
                self.trace_replayed(&launches);
                if recs.recs.len() >= MAX_RECORDS {
                    recs.recs.remove(0);
                }
                recs.recs.push(Record {
                    key,
                    gen,
                    graph,
                    launches,
                });
                launched.map_err(|e| anyhow!("CUDA backend: launching a recorded decode step: {e}"))
            }
            Err(e) => {
                // Nothing was run while capturing: report and run the step directly. An op that
                // recorded its own failure keeps it (sticky), so that run reports it too.
                eprintln!("lily: CUDA backend: could not record a decode step ({e:#}); running it op by op");
                drop(recs);
                ops()
            }
        }
    }

    /// 2048: measured on the H200 (full preset, 4K context): 4.9K tok/s at 256, 9.7K at 1024,
    /// 12.0K at 2048 — each chunk streams every routed expert's weights once.
    fn prefill_chunk(&self) -> usize {
        2048
    }

    fn measure_ceilings(&self) -> Option<Result<super::Ceilings>> {
        Some(self.measure_ceilings_now())
    }

    fn upload_mat(&self, m: &HostLinear) -> Result<Mat> {
        if !m.inp.is_multiple_of(32) {
            bail!(
                "`{}`: input width {} is not a multiple of 32 (needed by the CUDA kernels)",
                m.name,
                m.inp
            );
        }
        let (fmt, w, s, b, gs) = self.mat_fmt(m)?;
        Ok(Mat {
            n: m.n,
            out: m.out,
            inp: m.inp,
            fmt,
            gs,
            w,
            s,
            b,
        })
    }
    fn upload_vec(&self, v: &[f32]) -> Result<Buf> {
        Ok(Buf {
            mem: self.upload_f32(v)?,
            len: v.len(),
            elem: 4,
        })
    }
    fn mat_shape(&self, m: &Mat) -> (usize, usize) {
        (m.out, m.inp)
    }
    fn zeros(&self, len: usize) -> Result<Buf> {
        Ok(Buf {
            mem: self.alloc(4 * len)?,
            len,
            elem: 4,
        })
    }
    /// bf16 (u16 bits): activations between ops (module header).
    fn act_zeros(&self, len: usize) -> Result<Buf> {
        Ok(Buf {
            mem: self.alloc(2 * len)?,
            len,
            elem: 2,
        })
    }
    fn act_elem_bytes(&self) -> usize {
        2
    }
    /// The cache holds k and v as the activations they are: bf16, half the bytes every attention
    /// op reads (module header).
    fn kv_zeros(&self, len: usize) -> Result<Buf> {
        self.act_zeros(len)
    }
    fn kv_elem_bytes(&self) -> usize {
        self.act_elem_bytes()
    }
    fn to_host(&self, b: &Buf, len: usize) -> Result<Vec<f32>> {
        if len > b.len {
            bail!("to_host: {len} elements asked of a buffer of {}", b.len);
        }
        if b.elem == 2 {
            // A bf16 activation or KV cache, widened exactly (taps, tests and debugging read it).
            return Ok(self
                .read::<u16>(b.mem.ptr, len)?
                .into_iter()
                .map(bf16_to_f32)
                .collect());
        }
        Ok(self
            .read::<u32>(b.mem.ptr, len)?
            .into_iter()
            .map(f32::from_bits)
            .collect())
    }
    fn copy(&self, src: &Buf, src_off: usize, dst: &mut Buf, dst_off: usize, len: usize) {
        // Raw bytes: both sides must hold the same element type (f32 to f32, a bf16 KV cache to another).
        if self.ensure(src.elem == dst.elem, || {
            format!("copy: {}-byte elements to {}-byte ones", src.elem, dst.elem)
        }) && self.ensure(src_off + len <= src.len && dst_off + len <= dst.len, || {
            format!(
                "copy: {len} values at {src_off} of {} to {dst_off} of {}",
                src.len, dst.len
            )
        }) {
            self.dtod(src.at(src_off), dst.at(dst_off), src.elem * len);
        }
    }
    fn new_route(&self, rows: usize, top_k: usize) -> Result<Route> {
        Ok(Route {
            ids: self.alloc(4 * rows * top_k)?,
            weights: self.alloc(4 * rows * top_k)?,
            cap: rows * top_k,
            k: top_k,
        })
    }

    fn new_step(&self) -> Result<Step> {
        Ok(Step {
            mem: self.alloc(8)?,
        })
    }
    fn set_step(&self, step: &mut Step, token: u32, pos: usize) {
        if self.failed() {
            return;
        }
        if !self.ensure(pos <= i32::MAX as usize, || {
            format!("set_step: position {pos} out of range")
        }) {
            return;
        }
        let rec = [token, pos as u32];
        // SAFETY: the step holds 8 bytes; staged copy from pageable memory (ordered on the stream).
        if let Err(e) =
            unsafe { dr::memcpy_htod_async(step.mem.ptr, &rec[..], self.stream.cu_stream()) }
        {
            self.fail(format!("set_step: {e}"));
        }
    }
    fn step_token(&self, step: &Step) -> Result<u32> {
        Ok(self.read::<u32>(step.mem.ptr, 1)?[0])
    }
    /// An asynchronous copy into page-locked memory and an event after it (`token_begin`).
    fn step_token_begin(&self, step: &Step) -> Result<super::TokenRead> {
        let slot = self.token_begin(step.mem.ptr)?;
        Ok(super::TokenRead::Pending(Box::new(slot)))
    }
    fn step_token_finish(&self, read: super::TokenRead) -> Result<u32> {
        match read {
            super::TokenRead::Ready(t) => Ok(t),
            super::TokenRead::Pending(p) => match p.downcast::<device::TokenSlot>() {
                Ok(slot) => self.token_finish(*slot),
                Err(_) => bail!("step_token_finish: a read the CUDA backend did not begin"),
            },
        }
    }
    fn embed_step(&self, table: &Mat, step: &Step, out: &mut Buf) {
        if !self.buf_ok(out, table.inp, "out", "embed_step") {
            return;
        }
        // The step's first word is the token id: the embed kernel of one row reads it as its ids.
        let name = format!("embed_{}", table.fmt.suffix());
        self.launch(
            &name,
            (1, 1, 1),
            256,
            0,
            &[Arg::Q(table.q()), Arg::P(step.mem.ptr), Arg::P(out.mem.ptr)],
        );
    }
    fn embed(&self, table: &Mat, ids: &[u32], out: &mut Buf) {
        let rows = ids.len();
        if rows == 0 || !self.buf_ok(out, rows * table.inp, "out", "embed") {
            return;
        }
        let mut sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let Some(dids) = self.scratch(&mut sc, "embed_ids", 4 * rows) else {
            return;
        };
        // SAFETY: the scratch buffer holds `rows` u32; staged copy from pageable memory.
        if let Err(e) = unsafe { dr::memcpy_htod_async(dids, ids, self.stream.cu_stream()) } {
            self.fail(format!("embed: uploading ids: {e}"));
            return;
        }
        let name = format!("embed_{}", table.fmt.suffix());
        self.launch(
            &name,
            (rows as u32, 1, 1),
            256,
            0,
            &[Arg::Q(table.q()), Arg::P(dids), Arg::P(out.mem.ptr)],
        );
    }
    fn rms_norm(&self, x: &Buf, w: &Buf, rows: usize, dim: usize, eps: f32, out: &mut Buf) {
        if rows == 0
            || !(self.buf_ok(x, rows * dim, "x", "rms_norm")
                && self.buf_ok(w, dim, "w", "rms_norm")
                && self.act_ok(out, rows * dim, "out", "rms_norm"))
        {
            return;
        }
        self.launch(
            "rms_norm",
            (rows as u32, 1, 1),
            256,
            0,
            &[
                Arg::P(x.mem.ptr),
                Arg::P(w.mem.ptr),
                Arg::P(out.mem.ptr),
                Arg::I(dim as i32),
                Arg::F(eps),
            ],
        );
    }
    fn add_rms_norm(
        &self,
        h: &mut Buf,
        r: &Buf,
        w: &Buf,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Buf,
    ) {
        let op = "add_rms_norm";
        if rows == 0
            || !(self.buf_ok(h, rows * dim, "h", op)
                && self.act_ok(r, rows * dim, "r", op)
                && self.buf_ok(w, dim, "w", op)
                && self.act_ok(out, rows * dim, "out", op))
        {
            return;
        }
        self.launch(
            op,
            (rows as u32, 1, 1),
            256,
            0,
            &[
                Arg::P(h.mem.ptr),
                Arg::P(r.mem.ptr),
                Arg::P(w.mem.ptr),
                Arg::P(out.mem.ptr),
                Arg::I(dim as i32),
                Arg::F(eps),
            ],
        );
    }
    fn matmul_q(&self, x: &Buf, w: &Mat, rows: usize, out: &mut Buf) {
        let op = "matmul_q";
        if rows == 0
            || !(self.ensure(w.n == 1, || format!("{op}: a stack of {} matrices", w.n))
                && self.act_ok(x, rows * w.inp, "x", op)
                && self.out_ok(out, rows * w.out, "out", op))
        {
            return;
        }
        self.matmul_into(x, w, rows, out.mem.ptr, out.bf16());
    }
    fn matmul_q_many(&self, x: &Buf, ws: &[&Mat], rows: usize, outs: &mut [&mut Buf]) {
        // One launch for a decode row when every matrix takes the GEMV path in one format;
        // otherwise (prefill, mixed formats) one matmul_q each.
        if rows == 1 && ws.len() == outs.len() && self.sw_fits(ws) {
            let op = "matmul_q_many";
            if self.act_ok(x, ws[0].inp, "x", op)
                && ws
                    .iter()
                    .zip(outs.iter())
                    .all(|(w, o)| self.out_ok(o, w.out, "out", op))
            {
                let o: Vec<(u64, i32)> = outs.iter().map(|o| (o.mem.ptr, o.bf16())).collect();
                self.sw_gemv(decode::SwX::Act(x), ws, &o);
            }
            return;
        }
        self.matmul_q_many_warp(x, ws, rows, outs)
    }
    fn rms_norm_matmul(
        &self,
        h: &Buf,
        w: &Buf,
        rows: usize,
        dim: usize,
        eps: f32,
        xn: &mut Buf,
        ws: &[&Mat],
        outs: &mut [&mut Buf],
    ) {
        let op = "rms_norm_matmul";
        if rows == 1
            && ws.len() == outs.len()
            && self.sw_fits(ws)
            && ws[0].inp == dim
            && self.on("fuse_norm")
        {
            if self.buf_ok(h, dim, "h", op)
                && self.buf_ok(w, dim, "w", op)
                && self.act_ok(xn, dim, "xn", op)
                && ws
                    .iter()
                    .zip(outs.iter())
                    .all(|(m, o)| self.out_ok(o, m.out, "out", op))
            {
                let o: Vec<(u64, i32)> = outs.iter().map(|o| (o.mem.ptr, o.bf16())).collect();
                self.sw_gemv(
                    decode::SwX::Norm {
                        h,
                        w,
                        eps,
                        xn: Some(xn),
                    },
                    ws,
                    &o,
                );
            }
            return;
        }
        self.rms_norm(h, w, rows, dim, eps, xn);
        self.matmul_q_many(xn, ws, rows, outs);
    }
    fn moe_router(
        &self,
        h: &Buf,
        w: &Buf,
        rows: usize,
        eps: f32,
        xn: &mut Buf,
        router: &Mat,
        shared_gate: &Mat,
        d: &Dims,
        logits: &mut Buf,
        s: &mut Buf,
        route: &mut Route,
    ) {
        let op = "moe_router";
        let (e, k, dim) = (d.n_experts, d.top_k, d.hidden);
        let ws = [router, shared_gate];
        let fits = rows == 1
            && self.on("fuse_route")
            && self.on("fuse_norm")
            && self.sw_fits(&ws)
            && router.inp == dim
            && router.out == e
            && e <= 1024
            && (1..=32).contains(&k)
            && k <= e;
        if !fits {
            self.rms_norm_matmul(h, w, rows, dim, eps, xn, &ws, &mut [logits, s]);
            self.moe_route(logits, d, rows, route);
            return;
        }
        if self.buf_ok(h, dim, "h", op)
            && self.buf_ok(w, dim, "w", op)
            && self.act_ok(xn, dim, "xn", op)
            && self.buf_ok(logits, e, "logits", op)
            && self.out_ok(s, shared_gate.out, "s", op)
            && self.ensure(k <= route.cap, || {
                format!("{op}: route holds {} entries, {k} needed", route.cap)
            })
        {
            route.k = k;
            let x = decode::SwX::Norm {
                h,
                w,
                eps,
                xn: Some(xn),
            };
            let outs = [(logits.mem.ptr, 0), (s.mem.ptr, s.bf16())];
            let route = Some((&*route, k, d.norm_topk, false));
            self.sw_gemv_route(x, &ws, &outs, route, None, None);
        }
    }
    fn gdn_mixer_decode_add(
        &self,
        h: &mut Buf,
        norm: &Buf,
        eps: f32,
        w: &super::GdnWeights<'_, Self>,
        conv: &mut Buf,
        ssm: &mut Buf,
        d: &Dims,
        mut tmp: super::GdnScratch<'_, Self>,
    ) {
        // gdn_step first (with fuse_gdn also on, it wins), then fuse_gdn, else the composition.
        if !(self.gdn_mixer_step(h, norm, eps, w, conv, ssm, d, &mut tmp)
            || self.gdn_mixer_fused(h, norm, eps, w, conv, ssm, d, &tmp))
        {
            super::gdn_mixer_compose(self, h, norm, eps, w, conv, ssm, d, tmp);
        }
    }
    fn matmul_q_add(&self, x: &Buf, w: &Mat, rows: usize, r: &mut Buf, h: &mut Buf) {
        let op = "matmul_q_add";
        if !self.on("fuse_residual") || !(rows > 1 || self.sw_fits(&[w])) {
            // Unfused (the switch), or a one-row GEMV of the warp kernels: product, then add.
            self.matmul_q(x, w, rows, r);
            self.add(h, r, rows * w.out);
            return;
        }
        if rows == 0
            || !(self.ensure(w.n == 1, || format!("{op}: a stack of {} matrices", w.n))
                && self.act_ok(x, rows * w.inp, "x", op)
                && self.buf_ok(h, rows * w.out, "h", op))
        {
            return;
        }
        if rows == 1 {
            self.sw_gemv(decode::SwX::Act(x), &[w], &[(h.mem.ptr, 2)]);
        } else {
            // The prefill GEMMs add into h in their epilogue (store_out's obf 2).
            self.matmul_into(x, w, rows, h.mem.ptr, 2);
        }
    }
    fn route_ahead(&self, out: &Mat, next: &RouteAhead<'_, Self>) -> bool {
        self.ahead_fits(out, next)
    }
    fn matmul_q_add_ahead(
        &self,
        x: &Buf,
        w: &Mat,
        _r: &mut Buf,
        h: &mut Buf,
        next: &RouteAhead<'_, Self>,
    ) {
        let op = "matmul_q_add_ahead";
        // The model asked route_ahead first: not folding now would leave moe_step_add's sums
        // empty, so it is an error rather than a silent fallback.
        if !(self.ensure(self.ahead_fits(w, next), || {
            format!("{op}: the projection cannot fold the router (route_ahead said no)")
        }) && self.act_ok(x, w.inp, "x", op)
            && self.buf_ok(h, w.out, "h", op))
        {
            return;
        }
        self.ahead_gemv(decode::SwX::Act(x), w, h, next);
    }
    fn moe_decode_add(
        &self,
        x: &Buf,
        route: &Route,
        gate: &Mat,
        up: &Mat,
        down: &Mat,
        shared: &SharedExpert<'_, Self>,
        d: &Dims,
        tmp: MoeScratch<'_, Self>,
        h: &mut Buf,
    ) {
        let op = "moe_decode_add";
        if !(self.experts_ok(gate, up, down, d, op)
            && self.act_ok(x, d.hidden, "x", op)
            && self.buf_ok(h, d.hidden, "h", op)
            && self.buf_ok(shared.logit, 1, "shared logit", op))
        {
            return;
        }
        if !self.moe_sw(x, route, gate, up, down, shared, h) {
            super::moe_decode_compose(self, x, route, gate, up, down, shared, d, tmp, h);
        }
    }
    fn moe_step_add(
        &self,
        h: &mut Buf,
        norm: &Buf,
        eps: f32,
        w: &MoeWeights<'_, Self>,
        d: &Dims,
        mut r: RouterScratch<'_, Self>,
        tmp: MoeScratch<'_, Self>,
    ) {
        if r.ahead {
            // The projection before summed the router (matmul_q_add_ahead): route from its sums,
            // then the experts as after moe_router.
            if self.moe_step_operands_ok(h, norm, w, d, &r) {
                self.route_ahead_launch(h, norm, eps, w.router.out, d, &mut r);
            }
            return super::moe_experts_add(self, h, w, d, r, tmp);
        }
        if !self.moe_step(h, norm, eps, w, d, &mut r) {
            super::moe_step_compose(self, h, norm, eps, w, d, r, tmp);
        }
    }
    fn add(&self, h: &mut Buf, r: &Buf, len: usize) {
        if len == 0 || !(self.buf_ok(h, len, "h", "add") && self.act_ok(r, len, "r", "add")) {
            return;
        }
        self.launch(
            "add_inplace",
            (grid1(len, 256), 1, 1),
            256,
            0,
            &[Arg::P(h.mem.ptr), Arg::P(r.mem.ptr), Arg::P(len as u64)],
        );
    }

    fn attn_qk_norm_rope(
        &self,
        qg: &Buf,
        k: &mut Buf,
        q_norm: &Buf,
        k_norm: &Buf,
        d: &Dims,
        rows: usize,
        pos0: usize,
        step: Option<&Step>,
        q: &mut Buf,
        gate: &mut Buf,
    ) {
        self.attn_qk_norm_rope_op(qg, k, q_norm, k_norm, d, rows, pos0, step, q, gate)
    }
    fn attn_prefill(
        &self,
        q: &Buf,
        k: &Buf,
        v: &Buf,
        gate: &Buf,
        kv: &mut KvCache<Buf>,
        d: &Dims,
        rows: usize,
        pos0: usize,
        out: &mut Buf,
    ) {
        self.attn_prefill_op(q, k, v, gate, kv, d, rows, pos0, out)
    }
    fn attn_decode(
        &self,
        q: &Buf,
        k: &Buf,
        v: &Buf,
        gate: &Buf,
        kv: &mut KvCache<Buf>,
        d: &Dims,
        pos: usize,
        step: &Step,
        out: &mut Buf,
    ) {
        self.attn_decode_op(q, k, v, gate, kv, d, pos, step, out, None)
    }
    fn attn_decode_qk(&self, a: crate::backend::AttnStep<'_, Self>) {
        self.attn_decode_qk_op(a)
    }

    fn conv1d_prefill(
        &self,
        x: &Buf,
        w: &Buf,
        state: &mut Buf,
        d: &Dims,
        rows: usize,
        out: &mut Buf,
    ) {
        self.conv(x, w, state, d, rows, out, "conv1d_prefill")
    }
    fn conv1d_step(&self, x: &Buf, w: &Buf, state: &mut Buf, d: &Dims, out: &mut Buf) {
        self.conv(x, w, state, d, 1, out, "conv1d_step")
    }
    fn gdn_prefill(
        &self,
        qkv: &Buf,
        z: &Buf,
        b: &Buf,
        a: &Buf,
        w: &GdnParams<Buf>,
        state: &mut Buf,
        d: &Dims,
        rows: usize,
        out: &mut Buf,
    ) {
        self.gdn_prefill_op(qkv, z, b, a, w, state, d, rows, out)
    }
    fn gdn_decode(
        &self,
        qkv: &Buf,
        z: &Buf,
        b: &Buf,
        a: &Buf,
        w: &GdnParams<Buf>,
        state: &mut Buf,
        d: &Dims,
        out: &mut Buf,
    ) {
        self.gdn_prefill(qkv, z, b, a, w, state, d, 1, out)
    }

    fn moe_route(&self, logits: &Buf, d: &Dims, rows: usize, route: &mut Route) {
        self.moe_route_op(logits, d, rows, route)
    }
    fn moe_experts_prefill(
        &self,
        x: &Buf,
        route: &Route,
        gate: &Mat,
        up: &Mat,
        down: &Mat,
        d: &Dims,
        rows: usize,
        out: &mut Buf,
    ) {
        self.moe_experts_prefill_op(x, route, gate, up, down, d, rows, out)
    }
    fn moe_experts_decode(
        &self,
        x: &Buf,
        route: &Route,
        gate: &Mat,
        up: &Mat,
        down: &Mat,
        shared: Option<&SharedExpert<'_, Self>>,
        d: &Dims,
        out: &mut Buf,
    ) -> bool {
        self.moe_experts_decode_op(x, route, gate, up, down, shared, d, out)
    }
    fn swiglu(&self, g: &Buf, u: &Buf, len: usize, out: &mut Buf) {
        if len == 0
            || !(self.act_ok(g, len, "g", "swiglu")
                && self.act_ok(u, len, "u", "swiglu")
                && self.act_ok(out, len, "out", "swiglu"))
        {
            return;
        }
        self.launch(
            "swiglu",
            (grid1(len, 256), 1, 1),
            256,
            0,
            &[
                Arg::P(g.mem.ptr),
                Arg::P(u.mem.ptr),
                Arg::P(out.mem.ptr),
                Arg::P(len as u64),
            ],
        );
    }
    fn add_sigmoid_gated(&self, y: &mut Buf, shared: &Buf, s: &Buf, rows: usize, dim: usize) {
        let op = "add_sigmoid_gated";
        if rows == 0
            || !(self.act_ok(y, rows * dim, "y", op)
                && self.act_ok(shared, rows * dim, "shared", op)
                && self.buf_ok(s, rows, "s", op))
        {
            return;
        }
        self.launch(
            op,
            (grid1(rows * dim, 256), 1, 1),
            256,
            0,
            &[
                Arg::P(y.mem.ptr),
                Arg::P(shared.mem.ptr),
                Arg::P(s.mem.ptr),
                Arg::I(rows as i32),
                Arg::I(dim as i32),
            ],
        );
    }

    fn argmax_step(&self, logits: &Buf, vocab: usize, step: &mut Step) {
        if vocab == 0 || !self.buf_ok(logits, vocab, "logits", "argmax_step") {
            return;
        }
        // Slices of at least 2048 logits, at most ARGMAX_PARTS of them (sample.cu).
        let parts = vocab.div_ceil(2048).min(ARGMAX_PARTS);
        let mut sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let (Some(pv), Some(pi)) = (
            self.scratch(&mut sc, "argmax_pv", 4 * ARGMAX_PARTS),
            self.scratch(&mut sc, "argmax_pi", 4 * ARGMAX_PARTS),
        ) else {
            return;
        };
        self.launch(
            "argmax_partial",
            (parts as u32, 1, 1),
            256,
            0,
            &[
                Arg::P(logits.mem.ptr),
                Arg::P(pv),
                Arg::P(pi),
                Arg::I(vocab as i32),
            ],
        );
        self.launch(
            "argmax_step",
            (1, 1, 1),
            1024,
            0,
            &[
                Arg::P(pv),
                Arg::P(pi),
                Arg::P(step.mem.ptr),
                Arg::I(parts as i32),
            ],
        );
    }

    fn mask_logits(&self, logits: &mut Buf, vocab: usize, allowed: &[u32]) {
        self.mask_logits_op(logits, vocab, allowed)
    }

    // Sampling on the device: sample.rs.
    fn new_sampler(
        &self,
        params: &crate::runtime::sampler::SamplingParams,
        seed: u64,
        vocab: usize,
        prompt: &[u32],
    ) -> Result<Option<sample::Sampler>> {
        self.new_sampler_op(params, seed, vocab, prompt)
    }
    fn sample_step(&self, logits: &Buf, vocab: usize, s: &mut sample::Sampler, step: &mut Step) {
        self.sample_step_op(logits, vocab, s, step)
    }
    fn sample_note(&self, s: &mut sample::Sampler, token: u32) {
        self.sample_note_op(s, token)
    }
    fn logprobs(
        &self,
        logits: &Buf,
        vocab: usize,
        token: u32,
        n: usize,
    ) -> Result<(f32, Vec<(u32, f32)>)> {
        self.logprobs_op(logits, vocab, token, n)
    }
}
