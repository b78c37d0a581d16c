//! The wgpu device under the backend: adapter choice, the shader and pipeline cache, buffers,
//! and the one command encoder every op records into.
//!
//! Ops record their dispatches into one compute pass of a shared encoder (wgpu orders the
//! dispatches of a pass by their buffer uses, as separate passes would be, without a pass's
//! begin and end each); a copy ends the pass. Nothing reaches the GPU until something needs a
//! result (`to_host`, `step_token`, `sync`) or the encoder has grown long (`FLUSH_EVERY`
//! dispatches), when it is finished and submitted.
//!
//! A decode step is recorded once (`begin_record` / `end_record`: each dispatch's parameters in
//! a buffer of its own, its bind group made once) and replayed every token by `replay_items`,
//! which only re-encodes the dispatches: no parameter write, bind group or pipeline lookup per
//! op (wgpu cannot resubmit a command buffer; this is the nearest to a CUDA graph it has).
//!
//! With timestamps on (`set_timing`, `lily bench --profile`), every dispatch gets a pass of its
//! own bracketed by the GPU's timestamps, and each flush waits for them: the device time of
//! each kernel, charged to the op family the `Profiled` wrapper names (`set_label`). The `Backend` trait's ops
//! return nothing, so an error inside one (a validation error wgpu reports, a shape past the
//! adapter's limits) is kept and returned by the next call that returns a `Result`, as the CUDA
//! backend does.
//!
//! Parameters reach a kernel as a small uniform block (`binding 0`, u32 words, f32 by bits);
//! storage buffers follow at bindings 1, 2, … in the order the op passes them. The blocks of one
//! submission live in one arena buffer, each at its own aligned offset, written by the queue
//! (its writes land before the submission's commands run, after the earlier submissions'):
//! no buffer is created per dispatch.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use ::wgpu::util::DeviceExt;
use anyhow::{anyhow, bail, Context, Result};

/// Dispatches recorded before the encoder is submitted on its own: long prefill blocks keep the
/// GPU busy while the host records the rest.
const FLUSH_EVERY: usize = 256;
/// Parameter slots of a recorded step's arena buffer (`Ctx::rec_arena`).
const REC_SLOTS: usize = 512;
/// Parameter blocks `Ctx::cached_bind` keeps by content at most: their arenas live as long as
/// the device, `stride` (2 KB) a block, so at most 8 MB. A full decode step has ~265; each new
/// KV capacity adds its attention's few.
const BG_PARAMS_MAX: usize = 4096;

/// A recorded dispatch's bind group by its pipeline (the pipeline cache's, so its address is
/// stable), parameter block (arena and offset) and buffers (`Ctx::cached_bind`).
type BgKey = (usize, ::wgpu::Buffer, u64, Vec<::wgpu::Buffer>);

/// `LILY_WGPU_BG_CACHE`'s bind groups and parameter blocks (`Ctx::cached_bind`).
#[derive(Default)]
struct BgCache {
    /// Parameter blocks by content: arena and offset.
    params: HashMap<Vec<u32>, (::wgpu::Buffer, u64)>,
    /// The arena being filled and its slots used.
    arena: Option<(::wgpu::Buffer, usize)>,
    /// Bind groups and the tick of their last use.
    groups: HashMap<BgKey, (::wgpu::BindGroup, u64)>,
    tick: u64,
    /// The tick at the start of each of the last BG_KEEP_RECORDS records (`Ctx::begin_record`).
    starts: std::collections::VecDeque<u64>,
}
/// Records whose bind groups `Ctx::cached_bind` keeps: when a record begins, a group the
/// record before it did not use goes (`Ctx::begin_record`), so the cache holds at most two
/// records' groups (~265 each on the full preset). The weights' groups serve every record and
/// stay; a dropped state's (its KV caches, conv and recurrent state: ~0.2 GB at 4K, GBs at long
/// context) go with the next record but one.
const BG_KEEP_RECORDS: usize = 1;
/// Bytes of the parameter arena a dispatch may use (a QMat and a few words; attention passes its RoPE frequencies).
const PARAM_BYTES: u64 = 2048;
/// Spare buffers (`Ctx::spare`): as many as a launch may leave unused.
const SPARE: usize = 8;
/// Read-backs up to this size share one mappable buffer.
const SMALL_READ: u64 = 1 << 16;
/// Mappable buffers kept for token reads in flight (`token_begin`): the decode loop has one
/// in flight at a time, a spare or two cover a caller that begins the next before finishing.
const TOKEN_READS: usize = 3;

/// One WGSL file: its name (for errors and the MSL check) and its text.
#[derive(Clone, Copy)]
pub struct Shader {
    pub name: &'static str,
    pub src: &'static str,
}

/// Every WGSL file of the backend (the naga check translates each of them).
pub fn shaders() -> Vec<Shader> {
    vec![
        super::norm::SHADER,
        super::matmul::SHADER,
        super::matmul::sg_shader(),
        super::matmul::XQ_SHADER,
        super::matmul::GEMM_SHADER,
        super::matmul::GEMM_CHAIN_SHADER,
        super::matmul::GEMM_COOP_SHADER,
        super::matmul::GEMM_COOP1_SHADER,
        super::attention::SHADER,
        super::attention::SHADER_H,
        super::attention::DEC_SG_SHADER,
        super::attention::DEC_SG_SHADER_H,
        super::attention::ATTN_X_SHADER,
        super::gdn::SHADER,
        super::gdn::SHADER_SG,
        super::gdn::STEP_SHADER,
        super::gdn::STEP_SG_SHADER,
        super::moe::SHADER,
        super::moe::MM8_SHADER,
        super::moe::XQ_SHADER,
        super::output::SHADER,
        super::sample::SHADER,
        super::lab::SHADER,
        SG_PROBE,
    ]
}

/// The shader files naga validates but does not translate to MSL (`check`), and why.
pub const NOT_FOR_METAL: &[(&str, &str)] = &[
    ("gemm_coop", COOP_NOT_METAL),
    ("gemm_coop1", COOP_NOT_METAL),
];

/// Why gemm_coop's modules are not translated to MSL.
const COOP_NOT_METAL: &str = "16×16 cooperative matrices with f16 operands: Apple's simdgroup \
     matrices are 8×8 (simdgroup_half8x8, simdgroup_float8x8), so naga's simdgroup_half16x16 is \
     no Metal type; the Mac would need an 8×8 variant";

/// Whether the invocations of a workgroup fill its subgroups in order (subgroup i holds
/// local indices i·w .. i·w + w - 1), which the subgroup kernels' teams rely on; WGSL does not
/// promise it, so `Ctx::new` runs this once. Writes 1 a linear invocation, and the width.
const SG_PROBE: Shader = Shader {
    name: "sg_probe",
    src: "@group(0) @binding(0) var<uniform> unused: vec4<u32>;
@group(0) @binding(1) var<storage, read_write> probe: array<u32>;
@compute @workgroup_size(256)
fn sg_probe(@builtin(local_invocation_index) li: u32, @builtin(subgroup_size) w: u32,
            @builtin(subgroup_invocation_id) i: u32) {
    let first = subgroupBroadcastFirst(li);
    probe[li] = select(0u, 1u, i == li % w && first == li - i);
    probe[256u + li] = w + unused.x;
}
",
};

/// How the adapter was chosen and what it offers (printed by `lily` when it picks it).
#[derive(Clone, Debug)]
pub struct AdapterReport {
    pub name: String,
    pub backend: String,
    pub device_type: String,
    pub driver: String,
    pub subgroup: bool,
    pub f16: bool,
    pub subgroup_min: u32,
    pub subgroup_max: u32,
    pub workgroup_storage: u32,
    pub max_binding: u64,
    pub max_buffer: u64,
    pub storage_buffers: u32,
    /// Subgroup operations usable by the subgroup kernels: the feature, at least 4 lanes, and
    /// the invocations filling the subgroups in order (`SG_PROBE`).
    pub subgroups: bool,
    /// The cooperative-matrix configurations the adapter offers through wgpu
    /// (`Adapter::cooperative_matrix_properties`), as `MxNxK ab>cr` (e.g. `16x16x16 f16>f32`),
    /// comma-separated; empty without EXPERIMENTAL_COOPERATIVE_MATRIX (or with
    /// LILY_WGPU_COOP=0, which leaves the feature off the device).
    pub coop: String,
    /// gemm_coop can run (`LILY_WGPU_GEMM=coop`): the feature enabled on the device with a
    /// 16×16×16 f16 · f16 + f32 configuration, f16 and subgroups (its `subgroup_id`), subgroups
    /// at most 32 wide (8 warp tiles a 256-invocation workgroup), 32 KiB of workgroup memory.
    pub coop16: bool,
    /// The adapter's own memory in bytes where its backend says (Vulkan: its largest
    /// DEVICE_LOCAL heap, a discrete GPU's VRAM; on an integrated GPU or lavapipe the share of
    /// the machine's memory it may use); `None` on Metal, whose GPU shares the machine's memory
    /// (`lily serve` sizes from that).
    pub memory: Option<u64>,
    /// The device has robust buffer access (wgpu's default where offered); `false` when opened
    /// without it (`LILY_WGPU_ROBUST=0`, `open_unrobust`).
    pub robust: bool,
}

/// `AdapterReport::memory`: Vulkan's largest DEVICE_LOCAL heap of the adapter.
#[cfg(not(any(target_os = "macos", target_arch = "wasm32")))]
fn adapter_memory(adapter: &::wgpu::Adapter) -> Option<u64> {
    use ash::vk;
    // SAFETY: the raw adapter's instance and physical device are only read, for one query of
    // its memory heaps; nothing is created, destroyed or kept past this call.
    let hal = unsafe { adapter.as_hal::<::wgpu::hal::api::Vulkan>() }?;
    let inst = hal.shared_instance().raw_instance();
    // SAFETY: a valid physical device of this live instance (wgpu's own).
    let props = unsafe { inst.get_physical_device_memory_properties(hal.raw_physical_device()) };
    props
        .memory_heaps_as_slice()
        .iter()
        .filter(|h| h.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL))
        .map(|h| h.size)
        .max()
}

#[cfg(any(target_os = "macos", target_arch = "wasm32"))]
fn adapter_memory(_: &::wgpu::Adapter) -> Option<u64> {
    None
}

/// `LILY_WGPU_ROBUST=0` (opt-in; on the H200 at 4K, stop 38: 352.61 against 352.75 tok/s,
/// no difference, and on top of the router fold it did not help either): the Vulkan device opened as wgpu
/// opens it (wgpu-hal's extensions and features for `desc`) but without robust buffer access
/// (robustBufferAccess, robustBufferAccess2), which wgpu-hal 30 enables wherever offered. With
/// it every storage access may carry a bounds check in the driver's code (`LILY_STATS_ROBUST=0`
/// shows the difference); lily's kernels stay in bounds (the op tests), its modules are trusted
/// (no naga checks) either way, so an out-of-range index would then read or write memory
/// undefined instead of returning zeros. `None`: not a Vulkan adapter.
#[cfg(not(any(target_os = "macos", target_arch = "wasm32")))]
fn open_unrobust(
    adapter: &::wgpu::Adapter,
    desc: &::wgpu::DeviceDescriptor<'_>,
) -> Option<Result<(::wgpu::Device, ::wgpu::Queue)>> {
    use ash::vk;
    // SAFETY: wgpu's own adapter, borrowed for this function; every Vulkan object made here
    // is handed to wgpu (`device_from_raw` without a drop callback: wgpu-hal owns the device).
    let hal = unsafe { adapter.as_hal::<::wgpu::hal::api::Vulkan>() }?;
    let features = desc.required_features;
    let exts = hal.required_device_extensions(features);
    let mut phd = hal.physical_device_features(&exts, features);
    let prio = [1.0f32];
    // Family 0, as wgpu-hal 30's own `open` takes it.
    let families = [vk::DeviceQueueCreateInfo::default()
        .queue_family_index(0)
        .queue_priorities(&prio)];
    let names: Vec<_> = exts.iter().map(|e| e.as_ptr()).collect();
    let pre = vk::DeviceCreateInfo::default()
        .queue_create_infos(&families)
        .enabled_extension_names(&names);
    let mut info = phd.add_to_device_create(pre);
    // SAFETY: `add_to_device_create` points the core features and the p_next chain into `phd`,
    // alive and otherwise untouched until vkCreateDevice returns; the core features are copied,
    // robustness2's struct (if chained) is written in place, nothing else.
    let core = unsafe {
        let mut c = *info.p_enabled_features;
        c.robust_buffer_access = vk::FALSE;
        let mut p = info.p_next as *mut vk::BaseOutStructure<'_>;
        while !p.is_null() {
            if (*p).s_type == vk::StructureType::PHYSICAL_DEVICE_ROBUSTNESS_2_FEATURES_EXT {
                (*(p as *mut vk::PhysicalDeviceRobustness2FeaturesEXT<'_>)).robust_buffer_access2 =
                    vk::FALSE;
            }
            p = (*p).p_next;
        }
        c
    };
    info.p_enabled_features = &core;
    let inst = hal.shared_instance().raw_instance();
    // SAFETY: the create info above, for this physical device of wgpu's live instance.
    let raw = match unsafe { inst.create_device(hal.raw_physical_device(), &info, None) } {
        Ok(d) => d,
        Err(e) => {
            return Some(Err(anyhow!(
                "vkCreateDevice without robust buffer access: {e}"
            )))
        }
    };
    // SAFETY: `raw` was created from this adapter with family 0 and exactly `exts` and
    // `phd`'s features (robust buffer access aside, which wgpu-hal never requires).
    let open = unsafe {
        hal.device_from_raw(
            raw,
            None,
            &exts,
            features,
            &desc.required_limits,
            &desc.memory_hints,
            0,
            0,
        )
    };
    drop(hal);
    Some(match open {
        Err(e) => Err(anyhow!(
            "wgpu-hal on the device without robust buffer access: {e}"
        )),
        // SAFETY: the hal device was opened from this adapter for `desc`'s features and limits.
        Ok(o) => unsafe { adapter.create_device_from_hal(o, desc) }
            .map_err(|e| anyhow!("wgpu on the device without robust buffer access: {e}")),
    })
}

#[cfg(any(target_os = "macos", target_arch = "wasm32"))]
fn open_unrobust(
    _: &::wgpu::Adapter,
    _: &::wgpu::DeviceDescriptor<'_>,
) -> Option<Result<(::wgpu::Device, ::wgpu::Queue)>> {
    None
}

/// A buffer-to-buffer copy into `open` (outside its compute pass).
fn copy_into(
    open: &mut Open,
    src: &::wgpu::Buffer,
    so: u64,
    dst: &::wgpu::Buffer,
    dof: u64,
    bytes: u64,
) {
    open.pass = None;
    open.enc.copy_buffer_to_buffer(src, so, dst, dof, bytes);
}

/// One op of a recorded decode step.
pub(super) enum Item {
    Dispatch {
        entry: &'static str,
        pipe: Arc<::wgpu::ComputePipeline>,
        bg: ::wgpu::BindGroup,
        gx: u32,
        gy: u32,
    },
    Copy {
        src: ::wgpu::Buffer,
        so: u64,
        dst: ::wgpu::Buffer,
        dof: u64,
        bytes: u64,
    },
}

/// The encoder being recorded: its open compute pass, dispatches since the last submission,
/// parameter-arena slots used, and the kernels of its timed passes (two queries each).
struct Open {
    enc: ::wgpu::CommandEncoder,
    pass: Option<::wgpu::ComputePass<'static>>,
    n: usize,
    slots: usize,
    timed: Vec<String>,
}

/// The timestamp profiler (`set_timing`): the query set and its buffers, the op family being
/// charged, and the totals per `family · kernel`.
struct Timing {
    on: bool,
    label: String,
    qs: ::wgpu::QuerySet,
    resolve: ::wgpu::Buffer,
    back: ::wgpu::Buffer,
    totals: HashMap<String, (u64, f64)>,
}

/// The in-place trace (`Ctx::trace_begin`): a timestamp before a replayed step's first dispatch
/// and after each of its dispatches and copies, all in the step's own passes, so that each
/// kernel's share of the step is the difference of two stamps: its own time, its barrier and
/// the launch of the next (what `lily bench --trace` sums per kernel on CUDA). The stamps become
/// `trace::BlockRec`s of one block a launch, so backend/trace.rs sums them.
struct Tracer {
    qs: ::wgpu::QuerySet,
    resolve: ::wgpu::Buffer,
    back: ::wgpu::Buffer,
    recs: Vec<crate::backend::trace::BlockRec>,
    launches: Vec<crate::backend::trace::Launch>,
}

/// Ends `open`'s pass and begins one whose end writes timestamp `at` of `qs`: left open for the
/// op that follows (`keep`), else ended at once (an empty pass: a stamp after a copy).
fn stamp_pass(open: &mut Open, qs: &::wgpu::QuerySet, at: u32, keep: bool) {
    open.pass = None;
    let pass = open
        .enc
        .begin_compute_pass(&::wgpu::ComputePassDescriptor {
            label: None,
            timestamp_writes: Some(::wgpu::ComputePassTimestampWrites {
                query_set: qs,
                beginning_of_pass_write_index: None,
                end_of_pass_write_index: Some(at),
            }),
        })
        .forget_lifetime();
    if keep {
        open.pass = Some(pass);
    }
}

/// Timestamps a traced step may write (wgpu's largest query set): a decode step has ~400
/// dispatches.
const TRACE_QUERIES: u32 = 4096;

/// Which decode kernels run specialised to their launch (`LILY_WGPU_SPEC`, `Wgpu::set_spec`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Spec {
    pub q6: bool,
    pub moe: bool,
    pub xq: bool,
    pub gdn: bool,
    pub attn: bool,
}

impl Spec {
    /// `q6,moe,xq,gdn,attn` (any of them, comma-separated), `all` or `1` for all, `` or `0`
    /// for none.
    pub fn parse(s: &str) -> Result<Self> {
        let mut spec = Self::default();
        for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            match name {
                "q6" => spec.q6 = true,
                "moe" => spec.moe = true,
                "xq" => spec.xq = true,
                "gdn" => spec.gdn = true,
                "attn" => spec.attn = true,
                "all" | "1" => {
                    spec = Self {
                        q6: true,
                        moe: true,
                        xq: true,
                        gdn: true,
                        attn: true,
                    }
                }
                "0" | "none" => {}
                _ => bail!("unknown kernel `{name}` (q6, moe, xq, gdn, attn, all or none)"),
            }
        }
        Ok(spec)
    }
}

/// A pipeline's shader, entry point and pipeline constants (empty for none).
type PipelineKey = (&'static str, &'static str, Vec<(&'static str, u32)>);

/// The backend's switches and tuning knobs, read once from the environment when the device
/// opens (ablations for `lily bench` A/B runs; every default is the measured best).
pub(super) struct Switches {
    /// `LILY_WGPU_REPLAY=0`: every decode step op by op, none recorded.
    pub replay: bool,
    /// `LILY_WGPU_RECORD_FIRST=0`: a decode step's first sight (a new state, or a KV cache
    /// grown) runs op by op and its second is recorded, as before stop 44; by default the first
    /// is recorded (it still runs), so the second replays. A step recorded while a scratch
    /// buffer was replaced is dropped as before (`Wgpu::replay`).
    pub record_first: bool,
    /// `LILY_WGPU_WARM_UP=0`: loading does not build the decode step's pipelines
    /// (`Wgpu::warm_up`); the first request does.
    pub warm_up: bool,
    /// `LILY_WGPU_PRERECORD=0`: a prefill does not record the decode step after it ahead
    /// (`Wgpu::prerecord`); the step's first run records it, as before stop 45.
    pub prerecord: bool,
    /// `LILY_WGPU_STEP_TIMES=1` (diagnosis): the host's time to record each decode step, on
    /// stderr (a contract row's first step after its prefill costs ~7.5 ms more than a steady
    /// one on the H100, stop 44).
    pub step_times: bool,
    /// `LILY_WGPU_BG_CACHE` (on; `0` the ablation): a step being recorded reuses the bind groups
    /// of earlier records (`BgCache`: by pipeline, parameter block and buffers; the parameter
    /// blocks deduplicated by content), so that a new state's first step makes only those of
    /// its own buffers (the KV caches, the conv and recurrent state). On lavapipe most of a
    /// recording's host time is making bind groups (stop 44). On the H100 (stop 45) a full
    /// step's recording went 6.2-6.9 → 2.9-4.3 ms of host time and the contract's 4K row
    /// 362.31 / 362.25 → 377.73 / 376.58 tok/s (+4.2%). Atomic for the tests
    /// (`Wgpu::set_bg_cache`).
    pub bg_cache: std::sync::atomic::AtomicBool,
    /// `LILY_WGPU_GQA=0`: attention a query head a workgroup instead of a KV head's group.
    pub gqa: bool,
    /// `LILY_WGPU_FUSE_NORM=0`: the norm before the projections as a launch of its own.
    pub fuse_norm: bool,
    /// `LILY_WGPU_FUSE_EPILOGUE=0`: the residual adds, the shared expert's swiglu and gate as
    /// launches of their own.
    pub fuse_epilogue: bool,
    /// `LILY_WGPU_FUSE_CONV=0`: a decode step's GDN conv as a launch of its own, not in
    /// in_proj's epilogue (gemv_q6's omode 3).
    pub fuse_conv: bool,
    /// `LILY_WGPU_FUSE_ROPE=0`: a decode step's q/k norms and RoPE, and its KV append, as two
    /// launches (qk_norm_rope_step, kv_append_step) instead of qk_rope_append_step.
    pub fuse_rope: bool,
    /// `LILY_WGPU_FUSE_GATED_NORM=0`: a decode step's GDN gated norm as a launch of its own
    /// (gdn_norm), not in out_proj's staging of x (xq.wgsl xmode 3).
    pub fuse_gated_norm: bool,
    /// `LILY_WGPU_GEMV_WGS`: workgroups the decode GEMVs aim a matrix at (fewer, longer
    /// workgroups keep more loads in flight a thread; more fill more of the GPU). Atomic so that
    /// `lily lab` can compare settings in one process.
    pub gemv_wgs: AtomicUsize,
    /// `LILY_WGPU_Q6_WGS`: the same for gemv_q6, which widens its teams and narrows their rows
    /// until a matrix has this many workgroups (matmul.rs `q6_shape`). 256 since stop 43, with
    /// gemv_q6w staging x in each workgroup (fewer workgroups, fewer stagings: 4K on the H200
    /// 1.017× against Q6W=0 at 512, where Q6W=2 at 512 ran 0.974×); 512 at stops 41-42 (over
    /// 256 without gemv_q6w: 1.019×; 128: 0.963×, 1024: 1.003×). Atomic for `lily lab`.
    pub q6_wgs: AtomicUsize,
    /// `LILY_WGPU_Q6_WGS_BY` (opt-in; unset: every launch `q6_wgs`): workgroups by a launch's
    /// size, `MB:N,MB:N,…`: a launch of fewer code bytes than an entry's MB (the first such
    /// entry) aims at its N. The lab timed the router (0.53 MB) level from 256 to 1,024
    /// (H100, stop 42: 7.05-7.22 µs against a 2.87 µs read) and in_proj (12.7 MB of codes) at
    /// 12.68 µs on 256 against 13.37 on 512; `1:16,12:512,64:256` would give the router 16,
    /// out_proj, o_proj and q|k|v 512, in_proj 256 and leave the lm_head at `q6_wgs`.
    /// Sorted by MB; a Mutex for the lab and the arms.
    pub q6_wgs_by: Mutex<Vec<(usize, usize)>>,
    /// `LILY_WGPU_Q6_MIN_KB`: the code bytes a gemv_q6 launch's matrices must reach (one
    /// matrix of the stack, all of the launch's together); smaller launches take gemv_v5.
    /// 0 (every launch) by default: in the lab gemv_v5 was up to 15% faster alone on the small
    /// matrices (router, shared expert, out_proj), but in a step, 4K decode on the H200 ran at
    /// 195.8 / 195.9 tok/s with 0 against 193.6 / 190.9 with 8,192 (stop 32, call 2: 3 rounds
    /// of 128 tokens, alternated). Atomic for `lily lab`.
    pub q6_min_kb: AtomicUsize,
    /// `LILY_WGPU_ROUTE_AHEAD=1` (opt-in: measured slower on the H200 at 4K, stop 38: 332.66
    /// against 352.75 tok/s with the specialised kernels): the MoE router folded into the decode
    /// projection before it (Backend::route_ahead: gemv_q6 omode 4, then xq_route.wgsl
    /// q2x_stage_ahead in place of q2x_stage + the router's gemv_q6). One launch fewer a layer,
    /// but out_proj's gemv_q6 then carries 129 more rows a launch and q2x_stage_ahead the
    /// fold's sums. Atomic for the op tests (`Wgpu::set_route_ahead`).
    pub route_ahead: std::sync::atomic::AtomicBool,
    /// `LILY_WGPU_XQ_AHEAD` (`down`, the default since stop 49: this alone, 1.013× at 4K on the
    /// H100; `next`: this and `xq_oproj`; `1` or `all`: and `xq_moe`; `0` off): the MoE block's
    /// down stages the next layer's x (moe_down_ys, Backend::norm_ahead), so in_proj, q|k|v and
    /// the lm_head read it by gemv_q6s instead of staging it in each of their workgroups
    /// (gemv_q6w) or in a q2x_stage launch. Atomic for the op tests (`Wgpu::set_xq_ahead`).
    pub xq_ahead: std::sync::atomic::AtomicBool,
    /// o_proj's x staged by the attention's combine (attn_combine4_x): with `LILY_WGPU_XQ_AHEAD`
    /// 1, next and fold, and alone with `oproj` (to measure it apart from moe_down_ys; `down`
    /// is moe_down_ys without it).
    pub xq_oproj: std::sync::atomic::AtomicBool,
    /// With `LILY_WGPU_XQ_AHEAD` 1 / all: the MoE block's x staged by the projection before it
    /// (Backend::route_ahead: gemv_q6s omode 5 stages rms_norm(h) · w without the 1 / rms, with
    /// partial sums of squares; the router's gemv_q6s and moe_gate_up_y apply the 1 / rms), one
    /// launch fewer a layer, but out_proj / o_proj on 32 rows a workgroup (64 workgroups, not
    /// 256): `next` leaves it out to measure that apart. Takes precedence over `route_ahead`.
    pub xq_moe: std::sync::atomic::AtomicBool,
    /// `LILY_WGPU_XQ_AHEAD=fold` (opt-in, not yet measured on the H200): `1`, and the router
    /// folded into that projection too (gemv_q6s omode 6: each workgroup's dots of every router
    /// row with its rows of h, no atomics), moe_gate_up_y taking the logits from them (MY_FOLD):
    /// the MoE block without a router launch, two launches (gate|up, down). Atomic for the op
    /// tests (`Wgpu::set_xq_fold`).
    pub xq_fold: std::sync::atomic::AtomicBool,
    /// `LILY_WGPU_SPEC` (default `all`; `none` for the ablation; `Spec::parse`): decode kernels
    /// specialised to each launch by WGSL pipeline constants, one pipeline a launch shape
    /// (H200 at 4K, stop 38: 356.5 against 290.4 tok/s with none):
    /// `q6` gemv_q6s (matmul.rs `q6_spec`), `moe` moe_gate_up_y and moe_down_y (moe.rs
    /// `y_spec`), `xq` q2x_stage (matmul.rs `stage`), `gdn` gdn_step_x and gdn_step_y (gdn.rs
    /// `step_dispatch`), `attn` attn_dec_gqa and attn_combine4 (attention.rs `decode_attend`).
    /// Atomic for the op tests and `lily lab` (`Wgpu::set_spec`).
    pub q6_spec: std::sync::atomic::AtomicBool,
    pub moe_spec: std::sync::atomic::AtomicBool,
    pub xq_spec: std::sync::atomic::AtomicBool,
    pub gdn_spec: std::sync::atomic::AtomicBool,
    pub attn_spec: std::sync::atomic::AtomicBool,
    /// `LILY_WGPU_TRACE_PASSES=1`: the in-place trace stamps pass boundaries (each op in a pass
    /// of its own) even where the adapter can stamp inside a pass; adapters that cannot (Apple's
    /// GPUs through Metal) always do. Atomic for the tests (`Wgpu::set_trace_passes`).
    pub trace_passes: std::sync::atomic::AtomicBool,
    /// `LILY_WGPU_GEMV`: the decode GEMV, `v4` (gemv_v4, any adapter), `rw1` / `rw2` / `rw4`
    /// (gemv_rw with 1, 2 or 4 rows a team; adapters with subgroups in order) or `xs` (gemv_xs;
    /// subgroups in order of one fixed width), `v5` (gemv_v5: x in two int8 levels, integer
    /// dot products; any adapter: 145-152 against 130-132 tok/s at 4K on the H200, the lm_head
    /// 172 against 275 µs), `v6` (the default: gemv_q6 against x staged once a launch, for
    /// launches of `q6_min_kb` on adapters with subgroups in order of one width; gemv_v5 for
    /// the rest). Stored as 0 (v4), the rows, 8 (xs), 16 (v5) or 32 (v6).
    pub gemv: AtomicU32,
    /// `lily lab` only: parts of gemv_v4, moe_gate_up_v and moe_down_v skipped to time the rest
    /// (gemv_io.wgsl and moe.wgsl `ablate`); 0 otherwise.
    pub ablate: AtomicU32,
    /// `LILY_WGPU_ATTN_KEYS`: the capacity's keys a decode attention split covers at least (so
    /// the splits a KV head: capacity / this, at most 256). 32 since stop 43 (4K on the H200:
    /// 1.021× against 64, 128 0.963×; the first arms that took it: stop 42's `ATTN_KEYS=32`
    /// ran the defaults). Atomic so that `lily bench --arms` sweeps it in one process.
    pub attn_keys: AtomicUsize,
    /// `LILY_WGPU_ATTN_VAHEAD=1` (opt-in until measured): attn_dec_team issues a block's V words
    /// with its K words, a block ahead (attn_dec_sg.wgsl AD_VAHEAD). Atomic for the op tests
    /// and the arms (`Wgpu::set_attn_vahead`).
    pub attn_vahead: std::sync::atomic::AtomicBool,
    /// `LILY_WGPU_ATTN_CQ` (the default since stop 48; `0` for attn_combine4): decode
    /// attention's combine by attention.wgsl's attn_combine4q (and attn_combine4q_x), a quarter
    /// of a head's dims a workgroup, 16 split groups a quarter, in attn_combine4's place: stop
    /// 47 read attn_combine4's 16 workgroups as 5 round trips to L2 in a row at 4K (129
    /// splits), 2 here. H100, `lily bench --arms` at 4K (3 rounds of 3 × 128 tokens): 400.22
    /// against 393.88 tok/s (1.016×). Atomic for the op tests and the arms
    /// (`Wgpu::set_attn_cq`).
    pub attn_cq: std::sync::atomic::AtomicBool,
    /// `LILY_WGPU_GDN_FAST=1`: the gated delta rule by the subgroup kernels (gdn_sg.wgsl) where
    /// the adapter has subgroups, instead of gdn_recur. Opt-in: on the H200 (Vulkan) they were
    /// slower, 24.4 against 14.8 ms a 2048-row block and 28.4 against 21.6 µs a decode step.
    pub gdn_fast: bool,
    /// `LILY_WGPU_GDN_STEP`: a decode token's gated delta rule. `0`: gdn_recur (then gdn_norm,
    /// or the gated norm in out_proj's q2x_stage), as before; `y`: gdn_step.wgsl's gdn_step_y
    /// (every load up front, 8 threads a row, Hv · Dv / 32 workgroups) in gdn_recur's place;
    /// the default, `x`: in a step's GDN mixer gdn_step_x (a head a workgroup: the recurrence,
    /// the gated norm and out_proj's x staged for gemv_q6, one launch for two; gdn_step_y where
    /// it does not take the shape or the adapter). `yw`: `y` with the row sums in workgroup
    /// memory on any adapter (the fallback, for the tests). `xs`, the default since stop 41
    /// (on the H200 1.006× `x` at 4K, 1.001× at 32K, `lily bench --arms`): gdn_step_xs, `y`'s
    /// split (4 workgroups a head) with `x`'s epilogue, the gated norm's 1 / rms deferred to
    /// out_proj's gemv_q6s (`x` where it does not take the shape).
    /// Stored as 0, 1, 2, 3 or 4; atomic so that tests and `lily lab` compare them in one
    /// process.
    pub gdn_step: AtomicU32,
    /// `LILY_WGPU_ATTN_TILE=0`: prefill attention a (row, KV head) a workgroup (attn_rows_gqa,
    /// K/V read once a row) instead of tiles of query rows (attn_tile_gqa), and decode by
    /// stop 28's attn_split_gqa + attn_combine instead of attn_dec_gqa + attn_combine4.
    pub attn_tile: bool,
    /// The KV cache's element type (`Wgpu::kv_f16`): f16 (halves packed two a word;
    /// attention.rs) where the adapter has SHADER_F16 and decode attention runs attn_dec_team,
    /// the default since stop 41 (2); `LILY_WGPU_KV_F16=1` f16 with either kernel (1), `=0`
    /// f32 (0). Read by attn_dec_gqa the f16 cache lost (stop 33: 261.6 against 276.3 tok/s
    /// at 4K; stop 41: 0.960× at 4K, 0.918× at 32K), read by attn_dec_team it wins (stop 41,
    /// `lily bench --arms`, 4 rounds of 128 tokens on the H200: 1.037× at 4K, 1.064× at 32K).
    /// Atomic so that tests compare both in one process (`Wgpu::set_kv_f16`; a cache keeps its
    /// type).
    pub kv_f16: AtomicU32,
    /// Decode attention by attn_dec_sg.wgsl's attn_dec_team (a query head a 32-lane team, its
    /// dims across the lanes, q and the sums in registers) where the adapter has ordered
    /// subgroups, the default since stop 41 (with the f16 cache: see `kv_f16`);
    /// `LILY_WGPU_ATTN_DEC=gqa`: attn_dec_gqa (stop 41 at 4K over an f16 cache: 0.955×). On the H200 (stop 38,
    /// lab) it is level with attn_dec_gqa on an f32 cache at 4K (26.65 against 26.62 µs) and
    /// slower at 32K and 128K (128.3 against 96.9, 425.8 against 278.2 µs), faster on an f16
    /// cache (21.0 against 29.4 µs at 4K, 88.5 against 121.3 at 32K, 286.7 against 324.3 at
    /// 128K); with an f16 cache at 4K end to end 355.63 against 352.75 tok/s (one round).
    /// Atomic so that tests and `lily lab` compare both in one process (`Wgpu::set_attn_team`).
    pub attn_team: std::sync::atomic::AtomicBool,
    /// `LILY_WGPU_CHECKS=1`: the shaders compiled with wgpu's runtime checks (index clamping,
    /// a counter in every loop, checked integer division), as for untrusted WGSL. Off by
    /// default: the shaders are ours, every index in range by construction (the op tests hold
    /// them to the CPU), and the driver's robust buffer access still bounds every load.
    pub checks: bool,
    /// `LILY_WGPU_MOE_Q=0`: the routed experts' gate|up for decode by moe_gate_up_v (x in f32)
    /// instead of moe_gate_up_q (x in two int8 levels, integer dot products). Atomic so that
    /// `lily lab` compares both in one process.
    pub moe_q: std::sync::atomic::AtomicBool,
    /// `LILY_WGPU_MOE_FUSE=0`: a decode token's MoE block as before: the router's launch,
    /// moe_route, the routed experts' gate|up and down, the shared expert's gate|up and down
    /// (6 launches), instead of the router's launch, moe_gate_up_s routing the token itself
    /// with the shared expert as slot k, and moe_down_s with the shared expert's gate and the
    /// residual add (3; moe_decode_add alone: 2 instead of 4). Atomic so that tests and `lily
    /// lab` compare both in one process.
    pub moe_fuse: std::sync::atomic::AtomicBool,
    /// `LILY_WGPU_MOE_XQ=0`: the fused decode MoE block (moe_fuse) by moe_step.wgsl's
    /// moe_gate_up_s and moe_down_s (x quantized in every gate|up workgroup, act staged in f32
    /// in every down workgroup) instead of moe_xq.wgsl's moe_gate_up_x and moe_down_x (x as the
    /// router's q2x_stage staged it, act quantized once in gate|up's epilogue, teams of lanes
    /// and shuffles as gemv_q6; the route by fewer barriers); `gate`: moe_gate_up_x with
    /// moe_down_s; `x`: both, as moe_gate_up_x and moe_down_x; `ydown`: down by moe_down_y
    /// (every load of a lane at once); the default: gate|up by moe_gate_up_y too, each y kernel
    /// where it takes the block (else its x twin). Where the adapter has ordered subgroups of
    /// one width. Stored as 0 (off), 1 (gate), 2 (x), 3 (ydown) or 4; atomic so that tests and
    /// `lily lab` compare them in one process.
    pub moe_xq: AtomicU32,
    /// `LILY_WGPU_MOE_DOWN`: the decode MoE block's down where moe_down_y takes it with its
    /// constants: `y2` (the default since stop 42) moe_xq.wgsl's moe_down_y2, two outputs a team
    /// (64 workgroups at hidden 2048; act's words read once for both), or `y` moe_down_y (one a
    /// team, 128 workgroups). Bit-equal sums. 4K decode on the H100, one process: 1.034× (y2
    /// over y). Stored as 1 (y2) or 0 (y). (Stop 46 removed `y2h`, moe_down_y2 in workgroups of
    /// 128: 128 workgroups, 0.970× on the H100 at 4K.)
    pub moe_down: AtomicU32,
    /// `LILY_WGPU_MOE_ACT`: who stages act (silu(gate) · up) for down's integer dots, where the
    /// y pair with their constants takes the block and down is moe_down_y2 (moe.rs
    /// `act_takes`): `down16` (true, the default since stop 46) moe_down_y2q, each of its
    /// workgroups from act in f32 while its weights are in flight, gate|up ending without a
    /// barrier on 16 outputs a workgroup (288 at the full preset on 132 SMs, not 144 of 64 KB:
    /// moe_xq.wgsl MY_NOQ); `gate` (false) gate|up's epilogue (a barrier and the quantizing of
    /// its workgroup's 32 outputs). Bit-equal sums. H100 at 4K (`lily bench --arms`, stop 46):
    /// 1.017× and 1.011× over gate (3 rounds: 394.71 against 390.47). The lab: gate|up alone
    /// 9.7-10.2 µs with gate, 8.0 with down16; down alone 6.0 against 6.9. Measured and
    /// removed: `down` (gate|up on 32 outputs, 1.007×) and `down8` (on 8, 0.980×).
    pub moe_act: std::sync::atomic::AtomicBool,
    /// `LILY_WGPU_MOE_A8=1` (the ablation): gate|up's epilogue stages act's 8-bit layout even
    /// where down is 4-bit and reads only the 4-bit one (moe_xq.wgsl MY_A8; with the y pair's
    /// constants, else it always does).
    pub moe_a8: std::sync::atomic::AtomicBool,
    /// `LILY_WGPU_Q6W`: gemv_q6w, x quantized in each workgroup of the decode projections
    /// instead of by a q2x_stage launch before them (matmul_sg.wgsl's header at gemv_q6w;
    /// matmul.rs `q6w_takes`): `1` in_proj, q|k|v and o_proj (50 launches fewer a step of the
    /// full preset), `2` (the default since stop 43) also the MoE router's launch, whose first
    /// workgroup exports the staging to gate|up (40 more); 0 off. H200, 4K, stop 43 (arms, 3
    /// rounds, against Q6W=0 with 512 workgroups): 2 with `Q6_WGS` 256 1.017×, 2 with 512
    /// 0.974×, 1 0.962× (the lab: in_proj 13.72 µs against 12.06 with its q2x_stage, o_proj
    /// 9.34 against 12.18, the router 8.42 against 10.97). Atomic for the op tests and the
    /// arms (`Wgpu::set_q6w`).
    pub q6w: AtomicU32,
    /// `LILY_WGPU_ROUTER` (`f32`, the default since stop 48; `f32:2`, `f32:3` the rows a
    /// workgroup, 1 for `f32`; `q6w` the ablation): a gemv_q6w launch of 8-bit matrices on a
    /// normed x (the MoE router's) by matmul_sg.wgsl's gemv_rt, x read in f32 and not staged,
    /// RT_R rows a workgroup. H100, `lily bench --arms` at 4K (3 rounds of 3 × 128 tokens,
    /// stop 48 call 2): one row 405.72 (1.018×), two rows 399.76 (1.003×), gemv_q6w 398.43.
    /// Stored as the rows (0: gemv_q6w). Atomic for the op tests and the arms
    /// (`Wgpu::set_router_rows`).
    pub router_rows: AtomicU32,
    /// `LILY_WGPU_Q6W_MAX_MB` (0, none, by default): launches of at least this many MB of codes
    /// keep q2x_stage and gemv_q6s (in_proj's 12.7 MB, whose workgroups each staging the row
    /// lost in the lab).
    pub q6w_max_mb: AtomicUsize,
    /// `LILY_WGPU_MOE_XQ_SHAPE=G,D,S` (default 32,16,2): moe_gate_up_x's lanes a team (8, 16 or
    /// 32: G / 8 outputs a team, 32 a workgroup), moe_down_x's lanes a team (4, 8 or 16: one
    /// output each; fewer when a row of down has fewer code words) and its teams an output (1,
    /// 2 or 4, each a range of the routed slots). Packed G | D << 8 | S << 16; atomic for `lily
    /// lab`.
    pub moe_xq_shape: AtomicU32,
    /// `LILY_WGPU_AHEAD=0`: a replayed decode step encoded when the runtime asks for it, not
    /// ahead (the host's encoding of ~450 dispatches then leaves the device idle between steps).
    pub ahead: bool,
    /// `LILY_WGPU_REPLAY_FLUSH`: dispatches of a replayed decode step encoded before they are
    /// submitted (at most `FLUSH_EVERY`, the default): the device starts a step once the host
    /// has encoded this many of its dispatches; each submission costs the host its own time.
    pub replay_flush: usize,
    /// `LILY_WGPU_ZERO_WG=1`: workgroup memory zeroed at every workgroup's start (WebGPU's
    /// rule). Off by default: every kernel writes its workgroup memory before it reads it.
    pub zero_wg: bool,
    /// `LILY_WGPU_GEMM`: prefill's GEMM past 64 rows of x (matmul.rs `gemm_shader`): `old`
    /// (matmul.wgsl `gemm`, 64 × 64), `big` (gemm.wgsl `gemm_big`, a 128 × 128
    /// tile, each step's products summed apart) or `chain` (gemm_big with one FMA chain an
    /// output). On the H200 (stop 31, call 3) gemm_big was 5% faster at 2048 rows (22.6 against
    /// 21.6 TFLOP/s on 2048 → 8192) but 1.4-1.8× slower at 300 rows, and 4K prefill fell from
    /// 3,121 to 2,987 tok/s with it: opt-in. `coop` (gemm_coop.wgsl `gemm_coop`: 64 × 128
    /// tiles on cooperative matrices, f16 operands, f32 sums; `coop1`: its scalar-staged
    /// fallback) where the adapter has them (`AdapterReport::coop16`; else the old gemm): the
    /// default (stop 32, call 4: 55-70 against 20-22 TFLOP/s in the lab, 38.7 against 11.7 at
    /// 300 rows; 4K prefill 4,444 / 4,434 against 3,118 / 3,118 tok/s). `LILY_WGPU_COOP=0` keeps wgpu's EXPERIMENTAL_COOPERATIVE_MATRIX
    /// off the device altogether (read when it opens; coop then runs the old gemm). Stored as
    /// 1 (big), 2 (chain), 3 (coop), 4 (coop1) or 0 (old); atomic so that `lily lab` compares
    /// them in one process.
    pub gemm: AtomicU32,
    /// `LILY_WGPU_MOE_MM=mm8`: prefill's grouped expert GEMMs by moe_mm.wgsl's 8 × 8 entries
    /// instead of moe.wgsl's moe_gate_up_mm and moe_down_mm (4 × 4 a thread; the default until
    /// the 8 × 8 ones measure faster). Atomic so that tests and `lily lab` compare both in one
    /// process.
    pub moe_mm8: std::sync::atomic::AtomicBool,
}

impl Switches {
    fn from_env() -> Self {
        Self::from_lookup(&|k| std::env::var(k).ok())
    }

    /// The switches as `get` (a variable's value, `None` where unset) says them: the
    /// environment at open, or an arm of `lily bench --arms` over it (`Wgpu::set_switches`).
    fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Self {
        let on = |v: &str| get(v).as_deref() != Some("0");
        let num = |v: &str, d: usize| {
            get(v)
                .and_then(|s| s.parse().ok())
                .filter(|&n: &usize| n > 0)
                .unwrap_or(d)
        };
        // An unknown name is reported and ignored (the defaults are the measured ones).
        let spec = Spec::parse(&get("LILY_WGPU_SPEC").unwrap_or_else(|| "all".into()))
            .unwrap_or_else(|e| {
                eprintln!("LILY_WGPU_SPEC: {e:#}; no kernel specialised");
                Spec::default()
            });
        // LILY_WGPU_XQ_AHEAD: 0 off, 1 `next`, 2 `1` / `all`, 3 `fold`, 4 `oproj`, 5 `down`
        // (`next` without o_proj's: the default since stop 49, 1.013x at 4K on the H100).
        let xq_ahead = match get("LILY_WGPU_XQ_AHEAD").as_deref() {
            Some("down") | None => 5,
            Some("oproj") => 4,
            Some("fold") => 3,
            Some("1" | "all") => 2,
            Some("next") => 1,
            Some("0" | "") => 0,
            Some(v) => {
                eprintln!(
                    "LILY_WGPU_XQ_AHEAD={v}: not 1, all, next, fold, oproj, down or 0; the default, down"
                );
                5
            }
        };
        Self {
            replay: on("LILY_WGPU_REPLAY"),
            record_first: on("LILY_WGPU_RECORD_FIRST"),
            prerecord: on("LILY_WGPU_PRERECORD"),
            warm_up: on("LILY_WGPU_WARM_UP"),
            step_times: get("LILY_WGPU_STEP_TIMES").as_deref() == Some("1"),
            bg_cache: std::sync::atomic::AtomicBool::new(on("LILY_WGPU_BG_CACHE")),
            gqa: on("LILY_WGPU_GQA"),
            fuse_norm: on("LILY_WGPU_FUSE_NORM"),
            fuse_epilogue: on("LILY_WGPU_FUSE_EPILOGUE"),
            fuse_conv: on("LILY_WGPU_FUSE_CONV"),
            fuse_rope: on("LILY_WGPU_FUSE_ROPE"),
            fuse_gated_norm: on("LILY_WGPU_FUSE_GATED_NORM"),
            gemv_wgs: AtomicUsize::new(num("LILY_WGPU_GEMV_WGS", 1024)),
            q6_wgs: AtomicUsize::new(num("LILY_WGPU_Q6_WGS", 256)),
            q6_wgs_by: Mutex::new(match get("LILY_WGPU_Q6_WGS_BY") {
                Some(v) => q6_wgs_by(&v).unwrap_or_else(|e| {
                    eprintln!("LILY_WGPU_Q6_WGS_BY={v}: {e:#}; unset");
                    Vec::new()
                }),
                None => Vec::new(),
            }),
            ahead: on("LILY_WGPU_AHEAD"),
            route_ahead: std::sync::atomic::AtomicBool::new(
                get("LILY_WGPU_ROUTE_AHEAD").is_some_and(|v| v == "1"),
            ),
            xq_ahead: std::sync::atomic::AtomicBool::new(matches!(xq_ahead, 1..=3 | 5)),
            xq_oproj: std::sync::atomic::AtomicBool::new(!matches!(xq_ahead, 0 | 5)),
            xq_moe: std::sync::atomic::AtomicBool::new(matches!(xq_ahead, 2 | 3)),
            xq_fold: std::sync::atomic::AtomicBool::new(xq_ahead == 3),
            q6_spec: std::sync::atomic::AtomicBool::new(spec.q6),
            moe_spec: std::sync::atomic::AtomicBool::new(spec.moe),
            xq_spec: std::sync::atomic::AtomicBool::new(spec.xq),
            gdn_spec: std::sync::atomic::AtomicBool::new(spec.gdn),
            attn_spec: std::sync::atomic::AtomicBool::new(spec.attn),
            trace_passes: std::sync::atomic::AtomicBool::new(
                get("LILY_WGPU_TRACE_PASSES").is_some_and(|v| v == "1"),
            ),
            replay_flush: num("LILY_WGPU_REPLAY_FLUSH", FLUSH_EVERY).min(FLUSH_EVERY),
            q6_min_kb: AtomicUsize::new(
                get("LILY_WGPU_Q6_MIN_KB")
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0),
            ),
            ablate: AtomicU32::new(0),
            gemv: AtomicU32::new(
                get("LILY_WGPU_GEMV")
                    .and_then(|v| gemv_code(&v))
                    .unwrap_or(32),
            ),
            attn_keys: AtomicUsize::new(num("LILY_WGPU_ATTN_KEYS", 32)),
            attn_vahead: std::sync::atomic::AtomicBool::new(
                get("LILY_WGPU_ATTN_VAHEAD").as_deref() == Some("1"),
            ),
            attn_cq: std::sync::atomic::AtomicBool::new(
                get("LILY_WGPU_ATTN_CQ").as_deref() != Some("0"),
            ),
            gdn_fast: get("LILY_WGPU_GDN_FAST").as_deref() == Some("1"),
            gdn_step: AtomicU32::new(
                get("LILY_WGPU_GDN_STEP")
                    .and_then(|v| gdn_step_code(&v))
                    .unwrap_or(4),
            ),
            attn_tile: on("LILY_WGPU_ATTN_TILE"),
            kv_f16: AtomicU32::new(match get("LILY_WGPU_KV_F16").as_deref() {
                Some("0") => 0,
                Some("1") => 1,
                _ => 2,
            }),
            attn_team: std::sync::atomic::AtomicBool::new(
                get("LILY_WGPU_ATTN_DEC").as_deref() != Some("gqa"),
            ),
            moe_q: std::sync::atomic::AtomicBool::new(on("LILY_WGPU_MOE_Q")),
            moe_fuse: std::sync::atomic::AtomicBool::new(on("LILY_WGPU_MOE_FUSE")),
            moe_xq: AtomicU32::new(match get("LILY_WGPU_MOE_XQ").as_deref() {
                Some("0") => 0,
                Some("gate") => 1,
                Some("x") => 2,
                Some("ydown") => 3,
                _ => 4,
            }),
            moe_a8: std::sync::atomic::AtomicBool::new(
                get("LILY_WGPU_MOE_A8").is_some_and(|v| v == "1"),
            ),
            moe_act: std::sync::atomic::AtomicBool::new(
                match get("LILY_WGPU_MOE_ACT").as_deref() {
                    Some("gate") => false,
                    Some("" | "down16") | None => true,
                    Some(v) => {
                        eprintln!("LILY_WGPU_MOE_ACT={v}: not gate or down16; down16");
                        true
                    }
                },
            ),
            moe_down: AtomicU32::new(match get("LILY_WGPU_MOE_DOWN").as_deref() {
                Some("") | None => 1,
                Some(v) => moe_down_code(v).unwrap_or_else(|| {
                    eprintln!("LILY_WGPU_MOE_DOWN={v}: not y or y2; y2");
                    1
                }),
            }),
            q6w_max_mb: AtomicUsize::new(
                get("LILY_WGPU_Q6W_MAX_MB")
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0),
            ),
            q6w: AtomicU32::new(match get("LILY_WGPU_Q6W").as_deref() {
                Some("" | "2") | None => 2,
                Some("0") => 0,
                Some("1") => 1,
                Some(v) => {
                    eprintln!("LILY_WGPU_Q6W={v}: not 0, 1 or 2; 2");
                    2
                }
            }),
            router_rows: AtomicU32::new(match get("LILY_WGPU_ROUTER").as_deref() {
                None | Some("" | "f32" | "f32:1") => 1,
                Some("q6w") => 0,
                Some("f32:2") => 2,
                Some("f32:3") => 3,
                Some(v) => {
                    eprintln!("LILY_WGPU_ROUTER={v}: not f32, f32:2, f32:3 or q6w; f32");
                    1
                }
            }),
            moe_xq_shape: AtomicU32::new(
                get("LILY_WGPU_MOE_XQ_SHAPE")
                    .and_then(|v| moe_xq_shape_code(&v))
                    .unwrap_or(MOE_XQ_SHAPE),
            ),
            checks: get("LILY_WGPU_CHECKS").as_deref() == Some("1"),
            zero_wg: get("LILY_WGPU_ZERO_WG").as_deref() == Some("1"),
            gemm: AtomicU32::new(
                get("LILY_WGPU_GEMM")
                    .and_then(|v| gemm_code(&v))
                    .unwrap_or(3),
            ),
            moe_mm8: std::sync::atomic::AtomicBool::new(
                get("LILY_WGPU_MOE_MM").as_deref() == Some("mm8"),
            ),
        }
    }
}

impl Switches {
    /// Takes an arm's values (`LILY_WGPU_*` names over the environment's, as `lily bench --arms`
    /// gives them) for the switches that can change while the device is open: the atomic ones.
    /// An unknown name, or a switch read only when the device opens given another value, is an
    /// error, and then nothing changes. The caller drops the recorded steps (they hold the old
    /// kernels: `Wgpu::set_switches`).
    pub fn set_arm(&self, arm: &[(String, String)]) -> Result<()> {
        let read = std::cell::RefCell::new(std::collections::HashSet::new());
        let fresh = Self::from_lookup(&|k| {
            read.borrow_mut().insert(k.to_string());
            arm.iter()
                .rev()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.clone())
                .or_else(|| std::env::var(k).ok())
        });
        if let Some((n, _)) = arm.iter().find(|(n, _)| !read.borrow().contains(n)) {
            bail!("`{n}` is not a wgpu switch (LILY_WGPU_*: backend/wgpu/device.rs Switches)");
        }
        let fixed = [
            ("LILY_WGPU_REPLAY", self.replay != fresh.replay),
            (
                "LILY_WGPU_RECORD_FIRST",
                self.record_first != fresh.record_first,
            ),
            ("LILY_WGPU_PRERECORD", self.prerecord != fresh.prerecord),
            ("LILY_WGPU_WARM_UP", self.warm_up != fresh.warm_up),
            ("LILY_WGPU_GQA", self.gqa != fresh.gqa),
            ("LILY_WGPU_FUSE_NORM", self.fuse_norm != fresh.fuse_norm),
            (
                "LILY_WGPU_FUSE_EPILOGUE",
                self.fuse_epilogue != fresh.fuse_epilogue,
            ),
            ("LILY_WGPU_FUSE_CONV", self.fuse_conv != fresh.fuse_conv),
            ("LILY_WGPU_FUSE_ROPE", self.fuse_rope != fresh.fuse_rope),
            (
                "LILY_WGPU_FUSE_GATED_NORM",
                self.fuse_gated_norm != fresh.fuse_gated_norm,
            ),
            ("LILY_WGPU_GDN_FAST", self.gdn_fast != fresh.gdn_fast),
            ("LILY_WGPU_ATTN_TILE", self.attn_tile != fresh.attn_tile),
            ("LILY_WGPU_CHECKS", self.checks != fresh.checks),
            ("LILY_WGPU_AHEAD", self.ahead != fresh.ahead),
            (
                "LILY_WGPU_REPLAY_FLUSH",
                self.replay_flush != fresh.replay_flush,
            ),
            ("LILY_WGPU_ZERO_WG", self.zero_wg != fresh.zero_wg),
        ];
        if let Some((n, _)) = fixed.iter().find(|f| f.1) {
            bail!("{n} is read when the device opens: measure it in a process of its own");
        }
        let r = Ordering::Relaxed;
        macro_rules! take {
            ($($f:ident),*) => { $( self.$f.store(fresh.$f.load(r), r); )* };
        }
        take!(
            gemv_wgs,
            q6_wgs,
            q6_min_kb,
            route_ahead,
            xq_ahead,
            xq_oproj,
            xq_moe,
            xq_fold,
            q6_spec,
            moe_spec,
            xq_spec,
            gdn_spec,
            attn_spec,
            trace_passes,
            gemv,
            gdn_step,
            kv_f16,
            attn_team,
            attn_keys,
            attn_vahead,
            attn_cq,
            moe_q,
            moe_fuse,
            moe_xq,
            moe_down,
            moe_act,
            moe_a8,
            q6w,
            router_rows,
            q6w_max_mb,
            bg_cache,
            moe_xq_shape,
            gemm,
            moe_mm8
        );
        *self.q6_wgs_by.lock().unwrap_or_else(|e| e.into_inner()) = fresh
            .q6_wgs_by
            .into_inner()
            .unwrap_or_else(|e| e.into_inner());
        Ok(())
    }
}

/// `LILY_WGPU_Q6_WGS_BY`'s value (`MB:N,…`, MB > 0 a decimal, N > 0 workgroups) as (bytes, N)
/// sorted by bytes.
pub(super) fn q6_wgs_by(v: &str) -> Result<Vec<(usize, usize)>> {
    let mut out = Vec::new();
    for e in v.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let parsed = e.split_once(':').and_then(|(mb, n)| {
            let mb: f64 = mb
                .trim()
                .parse()
                .ok()
                .filter(|m: &f64| *m > 0.0 && m.is_finite())?;
            let n: usize = n.trim().parse().ok().filter(|&n| n > 0)?;
            Some(((mb * 1048576.0) as usize, n))
        });
        match parsed {
            Some(p) => out.push(p),
            None => bail!("`{e}` is not MB:workgroups (MB > 0, workgroups > 0)"),
        }
    }
    out.sort_unstable();
    Ok(out)
}

/// moe_gate_up_x's and moe_down_x's default shape (`Switches::moe_xq_shape`): 32 lanes a
/// gate|up team (4 outputs), 16 lanes a down team, 2 teams a down output.
pub(super) const MOE_XQ_SHAPE: u32 = 32 | 16 << 8 | 2 << 16;

/// `Switches::moe_xq_shape`'s code for `G,D,S` (`LILY_WGPU_MOE_XQ_SHAPE`), `None` if not one.
pub(super) fn moe_xq_shape_code(v: &str) -> Option<u32> {
    let n: Vec<u32> = v
        .split(',')
        .map(|x| x.trim().parse().ok())
        .collect::<Option<_>>()?;
    match n[..] {
        [g @ (8 | 16 | 32), d @ (4 | 8 | 16), s @ (1 | 2 | 4)] => Some(g | d << 8 | s << 16),
        _ => None,
    }
}

/// `Switches::gemm`'s code for a prefill GEMM's name (`LILY_WGPU_GEMM`), `None` if unknown.
pub(super) fn gemm_code(name: &str) -> Option<u32> {
    match name {
        "old" => Some(0),
        "big" => Some(1),
        "chain" => Some(2),
        "coop" => Some(3),
        "coop1" => Some(4),
        _ => None,
    }
}

/// The cooperative-matrix configurations as `AdapterReport::coop` lists them.
fn coop_configs(props: &[::wgpu::CooperativeMatrixProperties]) -> String {
    let ty = |t: ::wgpu::CooperativeScalarType| match t {
        ::wgpu::CooperativeScalarType::F32 => "f32",
        ::wgpu::CooperativeScalarType::F16 => "f16",
        ::wgpu::CooperativeScalarType::I32 => "i32",
        ::wgpu::CooperativeScalarType::U32 => "u32",
    };
    props
        .iter()
        .map(|c| {
            format!(
                "{}x{}x{} {}>{}{}",
                c.m_size,
                c.n_size,
                c.k_size,
                ty(c.ab_type),
                ty(c.cr_type),
                if c.saturating_accumulation {
                    " sat"
                } else {
                    ""
                }
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// `Switches::gdn_step`'s code for `LILY_WGPU_GDN_STEP`'s value (`0` / `old`, `y`, `x` / `1`,
/// `yw`: `y` with its row sums in workgroup memory where the adapter has subgroups, for the
/// tests, and `xs`: gdn_step_xs), `None` if unknown.
pub(super) fn gdn_step_code(name: &str) -> Option<u32> {
    match name {
        "0" | "old" => Some(0),
        "y" => Some(1),
        "x" | "1" => Some(2),
        "yw" => Some(3),
        "xs" => Some(4),
        _ => None,
    }
}

/// `Switches::moe_down`'s code for a down kernel's name (`LILY_WGPU_MOE_DOWN`), `None` if
/// unknown.
pub(super) fn moe_down_code(name: &str) -> Option<u32> {
    match name {
        "y" => Some(0),
        "y2" => Some(1),
        _ => None,
    }
}

/// `Switches::gemv`'s code for a decode GEMV's name (`LILY_WGPU_GEMV`), `None` if unknown.
pub(super) fn gemv_code(name: &str) -> Option<u32> {
    match name {
        "v4" => Some(0),
        "rw1" => Some(1),
        "rw2" => Some(2),
        "rw4" => Some(4),
        "xs" => Some(8),
        "v5" => Some(16),
        "v6" => Some(32),
        _ => None,
    }
}

pub(super) struct Ctx {
    pub sw: Switches,
    pub device: ::wgpu::Device,
    pub queue: ::wgpu::Queue,
    pub report: AdapterReport,
    /// Pipelines by shader, entry point and pipeline constants (`dispatch_spec`; none: empty).
    pipelines: Mutex<HashMap<PipelineKey, Arc<::wgpu::ComputePipeline>>>,
    modules: Mutex<HashMap<&'static str, Arc<::wgpu::ShaderModule>>>,
    /// The encoder being recorded (`None` between submissions).
    enc: Mutex<Option<Open>>,
    /// The ops of a decode step being recorded (`begin_record`).
    rec: Mutex<Option<Vec<Item>>>,
    /// The parameter arena of the step being recorded and its slots used: the record's
    /// dispatches keep their parameters there (`REC_SLOTS` a buffer, another when full), not in
    /// a buffer each (a decode step's ~265 buffer creations on the way to its second token).
    rec_arena: Mutex<Option<(::wgpu::Buffer, usize)>>,
    /// `LILY_WGPU_STEP_TIMES`: nanoseconds in `dispatch_spec` and in its bind groups' creation
    /// since the last `begin_record` (`Ctx::host_times`).
    host_ns: [std::sync::atomic::AtomicU64; 2],
    /// Recorded steps' bind groups for reuse (`LILY_WGPU_BG_CACHE`).
    bg_cache: Mutex<BgCache>,
    /// Bind groups made by `dispatch_spec` (tests count them).
    pub bind_groups: std::sync::atomic::AtomicU64,
    /// `None` where the adapter has no timestamp queries.
    timing: Mutex<Option<Timing>>,
    /// Whether timing is on (read without the lock on every dispatch).
    timing_on: std::sync::atomic::AtomicBool,
    /// The in-place trace of replayed steps (`trace_begin`), made when first asked for.
    tracer: Mutex<Option<Tracer>>,
    /// Whether replayed steps are traced.
    trace_on: std::sync::atomic::AtomicBool,
    /// Kernel-name prefixes a replayed step encodes other than once (`set_skip`, `lily bench
    /// --in-place`): 0 times (left out) or 2 (`+prefix`); and whether there are any (read
    /// without the lock on every replayed dispatch).
    skip: Mutex<Vec<(String, usize)>>,
    skip_any: std::sync::atomic::AtomicBool,
    /// Whether the adapter writes timestamps between the dispatches of a pass.
    ts_inside: bool,
    /// Small buffers for the bindings a launch does not use this time (a fused kernel's unused
    /// matrices, outputs and mode inputs): distinct, so no two writable bindings alias.
    pub spare: Vec<::wgpu::Buffer>,
    /// Bumped whenever a scratch buffer is replaced: records holding the old one are stale.
    scratch_gen: std::sync::atomic::AtomicU64,
    /// Dispatches `dispatch` has encoded (tests count an op's launches: `Wgpu::dispatches`);
    /// those of a record made ahead are not (they do not run).
    pub dispatched: std::sync::atomic::AtomicU64,
    /// The record being made is made ahead (`begin_record(true)`, `Wgpu::prerecord`): its
    /// dispatches and copies are kept for replays, not encoded.
    dry: std::sync::atomic::AtomicBool,
    /// A mappable buffer for small read-backs (the step's token every decode step).
    readback: Mutex<Option<::wgpu::Buffer>>,
    /// Free mappable buffers of token reads (`token_begin`), at most `TOKEN_READS`.
    token_reads: Mutex<Vec<::wgpu::Buffer>>,
    err: Arc<Mutex<Option<String>>>,
    /// FLUSH_EVERY parameter blocks, `stride` bytes apart (the adapter's uniform offset alignment).
    arena: ::wgpu::Buffer,
    stride: u64,
    /// Scratch buffers of the ops, by name, kept from call to call (`scratch`).
    scratch: Mutex<HashMap<&'static str, ::wgpu::Buffer>>,
}

/// Adapter types in the order `auto` prefers them; software adapters (lavapipe reports `Cpu`)
/// only when asked for: the CPU backend is faster than a CPU emulating a GPU.
fn rank(t: ::wgpu::DeviceType) -> u32 {
    match t {
        ::wgpu::DeviceType::DiscreteGpu => 0,
        ::wgpu::DeviceType::IntegratedGpu => 1,
        ::wgpu::DeviceType::VirtualGpu => 2,
        ::wgpu::DeviceType::Other => 3,
        ::wgpu::DeviceType::Cpu => 4,
    }
}

impl Ctx {
    /// The best adapter: `LILY_WGPU_ADAPTER` (a substring of its name) if set, else by type; a
    /// software adapter only with `allow_software`.
    pub fn new(allow_software: bool) -> Result<Self> {
        if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
            // The Vulkan loader warns on every start without it; any writable folder will do.
            std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir());
        }
        let mut d = ::wgpu::InstanceDescriptor::new_without_display_handle();
        d.backends = ::wgpu::Backends::VULKAN | ::wgpu::Backends::METAL;
        let inst = ::wgpu::Instance::new(d);
        let adapters = pollster::block_on(inst.enumerate_adapters(d_backends()));
        let want = std::env::var("LILY_WGPU_ADAPTER").ok();
        let mut cands: Vec<_> = adapters
            .into_iter()
            .filter(|a| {
                let i = a.get_info();
                match &want {
                    Some(w) => i.name.to_lowercase().contains(&w.to_lowercase()),
                    None => allow_software || i.device_type != ::wgpu::DeviceType::Cpu,
                }
            })
            .collect();
        cands.sort_by_key(|a| rank(a.get_info().device_type));
        let Some(adapter) = cands.into_iter().next() else {
            bail!(
                "no {}GPU adapter found through Vulkan or Metal{}",
                if allow_software { "" } else { "hardware " },
                match &want {
                    Some(w) => format!(" named like LILY_WGPU_ADAPTER={w:?}"),
                    None => String::new(),
                }
            );
        };
        let info = adapter.get_info();
        let feats = adapter.features();
        // Cooperative matrices where offered (gemm_coop), unless LILY_WGPU_COOP=0: enabling the
        // feature only changes the SPIR-V of the modules that use them (naga declares the Vulkan
        // memory model in those).
        let mut wanted = ::wgpu::Features::SUBGROUP
            | ::wgpu::Features::SHADER_F16
            | ::wgpu::Features::TIMESTAMP_QUERY
            | ::wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES;
        if std::env::var("LILY_WGPU_COOP").as_deref() != Ok("0") {
            wanted |= ::wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
        }
        let mut required = feats & wanted;
        let limits = adapter.limits();
        let unrobust = std::env::var("LILY_WGPU_ROBUST").as_deref() == Ok("0")
            && cfg!(not(any(target_os = "macos", target_arch = "wasm32")));
        let open = |required: ::wgpu::Features| {
            let experimental = if required.intersects(::wgpu::Features::all_experimental_mask()) {
                // SAFETY: wgpu asks for this token before it enables an EXPERIMENTAL feature
                // (here cooperative matrices only), acknowledging that its implementation may
                // have bugs. Only gemm_coop uses the feature, opt-in (LILY_WGPU_GEMM=coop), on an
                // adapter that lists the configuration it uses; its known gap (naga's SPIR-V
                // declares the Vulkan memory model without availability operations on barriers,
                // wgpu #8805) is in the header of gemm_coop.wgsl, and the op test holds the
                // kernel to the CPU.
                unsafe { ::wgpu::ExperimentalFeatures::enabled() }
            } else {
                ::wgpu::ExperimentalFeatures::disabled()
            };
            let desc = ::wgpu::DeviceDescriptor {
                label: Some("lily"),
                required_features: required,
                required_limits: limits.clone(),
                experimental_features: experimental,
                ..Default::default()
            };
            if unrobust {
                match open_unrobust(&adapter, &desc) {
                    Some(r) => return r,
                    None => eprintln!(
                        "lily: LILY_WGPU_ROBUST=0 takes a Vulkan adapter; {} keeps its default",
                        info.name
                    ),
                }
            }
            pollster::block_on(adapter.request_device(&desc)).map_err(anyhow::Error::from)
        };
        // A device refused with cooperative matrices is asked for again without them: the
        // opt-in kernel must not cost the backend its device.
        let coop = ::wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
        let mut coop_refused = None;
        let opened = match open(required) {
            Err(e) if required.contains(coop) => {
                coop_refused = Some(format!("the device refused them: {e}"));
                required.remove(coop);
                open(required)
            }
            r => r,
        };
        let (device, queue) =
            opened.with_context(|| format!("opening the wgpu device {}", info.name))?;
        let err = Arc::new(Mutex::new(None::<String>));
        let e2 = err.clone();
        device.on_uncaptured_error(Arc::new(move |e: ::wgpu::Error| {
            let mut g = e2.lock().unwrap();
            if g.is_none() {
                *g = Some(format!("wgpu: {e}"));
            }
        }));
        let report = AdapterReport {
            name: info.name.clone(),
            backend: format!("{:?}", info.backend),
            device_type: format!("{:?}", info.device_type),
            driver: format!("{} {}", info.driver, info.driver_info)
                .trim()
                .to_string(),
            subgroup: feats.contains(::wgpu::Features::SUBGROUP),
            f16: feats.contains(::wgpu::Features::SHADER_F16),
            subgroup_min: info.subgroup_min_size,
            subgroup_max: info.subgroup_max_size,
            workgroup_storage: limits.max_compute_workgroup_storage_size,
            max_binding: limits.max_storage_buffer_binding_size as u64,
            max_buffer: limits.max_buffer_size,
            storage_buffers: limits.max_storage_buffers_per_shader_stage,
            subgroups: false,
            coop: String::new(),
            coop16: false,
            memory: adapter_memory(&adapter),
            robust: !unrobust,
        };
        let stride = PARAM_BYTES.max(limits.min_uniform_buffer_offset_alignment as u64);
        let arena = device.create_buffer(&::wgpu::BufferDescriptor {
            label: Some("params"),
            size: stride * FLUSH_EVERY as u64,
            usage: ::wgpu::BufferUsages::UNIFORM | ::wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let timing = feats.contains(::wgpu::Features::TIMESTAMP_QUERY).then(|| {
            let n = 2 * FLUSH_EVERY as u64;
            Timing {
                on: false,
                label: String::new(),
                qs: device.create_query_set(&::wgpu::QuerySetDescriptor {
                    label: Some("timestamps"),
                    ty: ::wgpu::QueryType::Timestamp,
                    count: n as u32,
                }),
                resolve: device.create_buffer(&::wgpu::BufferDescriptor {
                    label: Some("timestamps resolved"),
                    size: 8 * n,
                    usage: ::wgpu::BufferUsages::QUERY_RESOLVE | ::wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: false,
                }),
                back: device.create_buffer(&::wgpu::BufferDescriptor {
                    label: Some("timestamps read back"),
                    size: 8 * n,
                    usage: ::wgpu::BufferUsages::MAP_READ | ::wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                }),
                totals: HashMap::new(),
            }
        });
        let spare = (0..SPARE)
            .map(|_| {
                device.create_buffer(&::wgpu::BufferDescriptor {
                    label: Some("spare"),
                    size: 16,
                    usage: storage_usage(),
                    mapped_at_creation: false,
                })
            })
            .collect();
        let mut report = report;
        if let Some(why) = coop_refused {
            report.coop = why;
        }
        if required.contains(coop) {
            let props = adapter.cooperative_matrix_properties();
            report.coop = coop_configs(&props);
            report.coop16 = props.iter().any(|c| {
                (c.m_size, c.n_size, c.k_size) == (16, 16, 16)
                    && c.ab_type == ::wgpu::CooperativeScalarType::F16
                    && c.cr_type == ::wgpu::CooperativeScalarType::F32
            }) && report.f16
                && report.subgroup
                && (1..=32).contains(&report.subgroup_max)
                && report.workgroup_storage >= 32768
                && limits.max_compute_invocations_per_workgroup >= 256;
        }
        let mut ctx = Self {
            sw: Switches::from_env(),
            device,
            queue,
            report,
            pipelines: Mutex::new(HashMap::new()),
            modules: Mutex::new(HashMap::new()),
            enc: Mutex::new(None),
            rec: Mutex::new(None),
            rec_arena: Mutex::new(None),
            host_ns: Default::default(),
            bg_cache: Mutex::new(BgCache::default()),
            bind_groups: std::sync::atomic::AtomicU64::new(0),
            timing: Mutex::new(timing),
            timing_on: std::sync::atomic::AtomicBool::new(false),
            tracer: Mutex::new(None),
            trace_on: std::sync::atomic::AtomicBool::new(false),
            skip: Mutex::new(Vec::new()),
            skip_any: std::sync::atomic::AtomicBool::new(false),
            ts_inside: required.contains(::wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES),
            spare,
            scratch_gen: std::sync::atomic::AtomicU64::new(0),
            dispatched: std::sync::atomic::AtomicU64::new(0),
            dry: std::sync::atomic::AtomicBool::new(false),
            readback: Mutex::new(None),
            token_reads: Mutex::new(Vec::new()),
            err,
            arena,
            stride,
            scratch: Mutex::new(HashMap::new()),
        };
        if ctx.report.subgroup && ctx.report.subgroup_min >= 4 {
            ctx.report.subgroups = ctx.subgroups_in_order()?;
        }
        Ok(ctx)
    }

    /// Runs `SG_PROBE`: whether every invocation of a 256-wide workgroup sits in its subgroup
    /// where a linear filling puts it, the width at least 4 and the same for all.
    fn subgroups_in_order(&self) -> Result<bool> {
        let b = self.buffer(2048)?;
        self.dispatch(&SG_PROBE, "sg_probe", &[0], &[&b], 1);
        let v = self.read(&b, 2048)?;
        let w: Vec<u32> = v
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        Ok(w[..256].iter().all(|&x| x == 1) && w[256..].iter().all(|&x| x >= 4 && x == w[256]))
    }

    /// Keeps the first error (later ones are usually its consequences).
    pub fn fail(&self, msg: impl Into<String>) {
        let mut g = self.err.lock().unwrap();
        if g.is_none() {
            *g = Some(msg.into());
        }
    }

    /// Whether an op failed since the last check.
    pub fn has_error(&self) -> bool {
        self.err.lock().unwrap().is_some()
    }

    /// The first error since the last check, as an `Err` (and cleared).
    pub fn check(&self) -> Result<()> {
        match self.err.lock().unwrap().take() {
            Some(e) => Err(anyhow!(e)),
            None => Ok(()),
        }
    }

    fn pipeline(
        &self,
        sh: &Shader,
        entry: &'static str,
        consts: &[(&'static str, u32)],
    ) -> Arc<::wgpu::ComputePipeline> {
        // No constants: an empty Vec, no allocation on the dispatch path.
        let key = (sh.name, entry, consts.to_vec());
        if let Some(p) = self.pipelines.lock().unwrap().get(&key) {
            return p.clone();
        }
        let module = {
            let mut m = self.modules.lock().unwrap();
            m.entry(sh.name)
                .or_insert_with(|| {
                    let desc = ::wgpu::ShaderModuleDescriptor {
                        label: Some(sh.name),
                        source: ::wgpu::ShaderSource::Wgsl(sh.src.into()),
                    };
                    Arc::new(if self.sw.checks {
                        self.device.create_shader_module(desc)
                    } else {
                        // SAFETY: the WGSL is this crate's own (no loop without a bound, no
                        // index out of range: the op tests run every kernel against the CPU),
                        // and the device keeps Vulkan's robust buffer access where it has it.
                        unsafe {
                            self.device.create_shader_module_trusted(
                                desc,
                                ::wgpu::ShaderRuntimeChecks::unchecked(),
                            )
                        }
                    })
                })
                .clone()
        };
        let constants: Vec<(&str, f64)> = consts.iter().map(|&(k, v)| (k, v as f64)).collect();
        let p = Arc::new(
            self.device
                .create_compute_pipeline(&::wgpu::ComputePipelineDescriptor {
                    label: Some(entry),
                    layout: None,
                    module: &module,
                    entry_point: Some(entry),
                    compilation_options: ::wgpu::PipelineCompilationOptions {
                        constants: &constants,
                        zero_initialize_workgroup_memory: self.sw.zero_wg,
                    },
                    cache: None,
                }),
        );
        self.pipelines.lock().unwrap().insert(key, p.clone());
        p
    }

    /// Records one dispatch of `entry` in `sh`: `params` as the uniform block at binding 0,
    /// `bufs` at bindings 1.., `groups` workgroups (x may exceed the 65,535 a dimension allows:
    /// it is folded into y, and the kernel reads its flat index from `wg_index`).
    pub fn dispatch(
        &self,
        sh: &Shader,
        entry: &'static str,
        params: &[u32],
        bufs: &[&::wgpu::Buffer],
        groups: u32,
    ) {
        self.dispatch_spec(sh, entry, &[], params, bufs, groups);
    }

    /// `dispatch` of a pipeline specialised by `consts` (WGSL `override` names and values; one
    /// pipeline for each set, built at its first use).
    pub fn dispatch_spec(
        &self,
        sh: &Shader,
        entry: &'static str,
        consts: &[(&'static str, u32)],
        params: &[u32],
        bufs: &[&::wgpu::Buffer],
        groups: u32,
    ) {
        if groups == 0 {
            return;
        }
        let pipe = self.pipeline(sh, entry, consts);
        let mut words = params.to_vec();
        words.resize(words.len().div_ceil(4).max(1) * 4, 0);
        if 4 * words.len() as u64 > PARAM_BYTES {
            self.fail(format!(
                "{entry}: {} bytes of parameters, at most {PARAM_BYTES}",
                4 * words.len()
            ));
            return;
        }
        let (gx, gy) = if groups <= 65535 {
            (groups, 1)
        } else {
            (65535, groups.div_ceil(65535))
        };
        let timed = self.sw.step_times.then(std::time::Instant::now);
        let bind = |buffer: &::wgpu::Buffer, offset: u64| {
            let t0 = timed.map(|_| std::time::Instant::now());
            let mut entries = vec![::wgpu::BindGroupEntry {
                binding: 0,
                resource: ::wgpu::BindingResource::Buffer(::wgpu::BufferBinding {
                    buffer,
                    offset,
                    size: ::wgpu::BufferSize::new(4 * words.len() as u64),
                }),
            }];
            for (i, b) in bufs.iter().enumerate() {
                entries.push(::wgpu::BindGroupEntry {
                    binding: i as u32 + 1,
                    resource: b.as_entire_binding(),
                });
            }
            let bg = self.device.create_bind_group(&::wgpu::BindGroupDescriptor {
                label: None,
                layout: &pipe.get_bind_group_layout(0),
                entries: &entries,
            });
            if let Some(t0) = t0 {
                self.host_ns[1].fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
            self.bind_groups.fetch_add(1, Ordering::Relaxed);
            bg
        };
        // A recorded dispatch's bind group, and the item it adds to the record.
        let record = |items: &mut Vec<Item>| {
            let bg = if self.sw.bg_cache.load(Ordering::Relaxed) {
                self.cached_bind(&pipe, &words, bufs, &bind)
            } else {
                self.record_bind(&words, &bind)
            };
            items.push(Item::Dispatch {
                entry,
                pipe: pipe.clone(),
                bg: bg.clone(),
                gx,
                gy,
            });
            bg
        };
        let mut rec = self.rec.lock().unwrap();
        // A record made ahead (`begin_record(true)`): the dispatch is kept, not run.
        if let Some(items) = rec.as_mut().filter(|_| self.dry.load(Ordering::Relaxed)) {
            record(items);
            drop(rec);
            if let Some(t0) = timed {
                self.host_ns[0].fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
            return;
        }
        self.dispatched.fetch_add(1, Ordering::Relaxed);
        let mut g = self.enc.lock().unwrap();
        let open = g.get_or_insert_with(|| self.open());
        let bg = if let Some(items) = rec.as_mut() {
            record(items)
        } else {
            // slots ≤ n < FLUSH_EVERY here: the encoder is submitted when n reaches it.
            let off = open.slots as u64 * self.stride;
            open.slots += 1;
            self.queue.write_buffer(&self.arena, off, as_bytes(&words));
            bind(&self.arena, off)
        };
        drop(rec);
        self.encode(open, entry, &pipe, &bg, gx, gy);
        if open.n >= FLUSH_EVERY {
            let o = g.take().unwrap();
            self.submit(o);
        }
        if let Some(t0) = timed {
            self.host_ns[0].fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
    }

    /// A recorded dispatch's bind group, its parameters in the record's own arena: read at
    /// every replay (the bind groups keep the arena alive); the queue's write lands before the
    /// submission of the dispatch that reads it.
    fn record_bind(
        &self,
        words: &[u32],
        bind: &dyn Fn(&::wgpu::Buffer, u64) -> ::wgpu::BindGroup,
    ) -> ::wgpu::BindGroup {
        let (ab, off) = self.param_slot(&mut self.rec_arena.lock().unwrap(), words);
        bind(&ab, off)
    }

    /// `words` written into the next slot of a recorded dispatches' parameter arena (a new
    /// uniform buffer of REC_SLOTS blocks where there is none or it is full): the buffer and
    /// the slot's offset.
    fn param_slot(
        &self,
        arena: &mut Option<(::wgpu::Buffer, usize)>,
        words: &[u32],
    ) -> (::wgpu::Buffer, u64) {
        if arena.as_ref().is_none_or(|(_, n)| *n >= REC_SLOTS) {
            let b = self.device.create_buffer(&::wgpu::BufferDescriptor {
                label: Some("recorded params"),
                size: self.stride * REC_SLOTS as u64,
                usage: ::wgpu::BufferUsages::UNIFORM | ::wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            *arena = Some((b, 0));
        }
        let (ab, n) = arena.as_mut().expect("just made");
        let off = *n as u64 * self.stride;
        *n += 1;
        self.queue.write_buffer(ab, off, as_bytes(words));
        (ab.clone(), off)
    }

    /// `LILY_WGPU_BG_CACHE`: a recorded dispatch's bind group from earlier records where one
    /// binds the same pipeline, parameter block and buffers, else made and kept. Parameter
    /// blocks are kept by content in arenas that live as long as the device (at most
    /// BG_PARAMS_MAX blocks; past that a block is written for this dispatch alone). The bind
    /// groups keep their buffers alive: a group left unused by the last BG_KEEP_RECORDS records
    /// goes when the next begins (`begin_record`).
    fn cached_bind(
        &self,
        pipe: &Arc<::wgpu::ComputePipeline>,
        words: &[u32],
        bufs: &[&::wgpu::Buffer],
        bind: &dyn Fn(&::wgpu::Buffer, u64) -> ::wgpu::BindGroup,
    ) -> ::wgpu::BindGroup {
        let mut c = self.bg_cache.lock().unwrap();
        c.tick += 1;
        let tick = c.tick;
        let (pb, off) = match c.params.get(words) {
            Some(p) => p.clone(),
            None => {
                let (ab, off) = self.param_slot(&mut c.arena, words);
                if c.params.len() < BG_PARAMS_MAX {
                    c.params.insert(words.to_vec(), (ab.clone(), off));
                }
                (ab, off)
            }
        };
        let key: BgKey = (
            Arc::as_ptr(pipe) as usize,
            pb.clone(),
            off,
            bufs.iter().map(|b| (*b).clone()).collect(),
        );
        if let Some((bg, t)) = c.groups.get_mut(&key) {
            *t = tick;
            return bg.clone();
        }
        let bg = bind(&pb, off);
        c.groups.insert(key, (bg.clone(), tick));
        bg
    }

    /// A fresh encoder with no pass open.
    fn open(&self) -> Open {
        Open {
            enc: self.device.create_command_encoder(&Default::default()),
            pass: None,
            n: 0,
            slots: 0,
            timed: Vec::new(),
        }
    }

    /// Encodes one dispatch into `open`: into its compute pass, or, with timestamps on, into a
    /// pass of its own with its start and end written to the next two queries.
    fn encode(
        &self,
        open: &mut Open,
        entry: &'static str,
        pipe: &::wgpu::ComputePipeline,
        bg: &::wgpu::BindGroup,
        gx: u32,
        gy: u32,
    ) {
        let on = self.timing_on.load(Ordering::Relaxed);
        let t = on.then(|| self.timing.lock().unwrap());
        match t.as_ref().and_then(|t| t.as_ref()).filter(|t| t.on) {
            Some(t) => {
                open.pass = None;
                let i = 2 * open.timed.len() as u32;
                let mut cp = open.enc.begin_compute_pass(&::wgpu::ComputePassDescriptor {
                    label: None,
                    timestamp_writes: Some(::wgpu::ComputePassTimestampWrites {
                        query_set: &t.qs,
                        beginning_of_pass_write_index: Some(i),
                        end_of_pass_write_index: Some(i + 1),
                    }),
                });
                cp.set_pipeline(pipe);
                cp.set_bind_group(0, bg, &[]);
                cp.dispatch_workgroups(gx, gy, 1);
                open.timed.push(if t.label.is_empty() {
                    entry.to_string()
                } else {
                    format!("{} · {entry}", t.label)
                });
            }
            None => {
                drop(t);
                let enc = &mut open.enc;
                let cp = open.pass.get_or_insert_with(|| {
                    enc.begin_compute_pass(&Default::default())
                        .forget_lifetime()
                });
                cp.set_pipeline(pipe);
                cp.set_bind_group(0, bg, &[]);
                cp.dispatch_workgroups(gx, gy, 1);
            }
        }
        open.n += 1;
    }

    /// Records a buffer-to-buffer copy (byte offsets and size multiples of 4).
    pub fn copy(&self, src: &::wgpu::Buffer, so: u64, dst: &::wgpu::Buffer, dof: u64, bytes: u64) {
        if bytes == 0 {
            return;
        }
        if let Some(items) = self.rec.lock().unwrap().as_mut() {
            items.push(Item::Copy {
                src: src.clone(),
                so,
                dst: dst.clone(),
                dof,
                bytes,
            });
            if self.dry.load(Ordering::Relaxed) {
                return;
            }
        }
        self.copy_now(src, so, dst, dof, bytes);
    }

    /// A copy into the encoder, never part of a record.
    fn copy_now(&self, src: &::wgpu::Buffer, so: u64, dst: &::wgpu::Buffer, dof: u64, bytes: u64) {
        let mut g = self.enc.lock().unwrap();
        let open = g.get_or_insert_with(|| self.open());
        copy_into(open, src, so, dst, dof, bytes);
    }

    /// A recorded step encoded into a command buffer of its own, to be submitted later
    /// (`submit_ahead`): the host encodes the next decode step while the device runs this one.
    /// `None` while dispatches are timed (each then needs its own pass and queries).
    pub fn encode_ahead(&self, items: &[Item]) -> Option<::wgpu::CommandBuffer> {
        if self.timing_on.load(Ordering::Relaxed) || self.tracing() {
            return None;
        }
        let mut open = self.open();
        for it in items {
            self.encode_item(&mut open, it);
        }
        open.pass = None;
        Some(open.enc.finish())
    }

    /// Submits a step encoded ahead, after whatever the encoder holds (the ops before it).
    pub fn submit_ahead(&self, cmd: ::wgpu::CommandBuffer) {
        self.flush();
        self.queue.submit([cmd]);
    }

    /// Ends the pass, submits, and with timed passes waits for their timestamps and charges
    /// each kernel its time.
    fn submit(&self, mut open: Open) {
        open.pass = None;
        let mut t = self.timing.lock().unwrap();
        let timed = std::mem::take(&mut open.timed);
        match t.as_mut().filter(|_| !timed.is_empty()) {
            None => {
                drop(t);
                self.queue.submit([open.enc.finish()]);
            }
            Some(t) => {
                let ticks = self.finish_timed(t, open.enc, 2 * timed.len() as u32);
                let period = self.queue.get_timestamp_period() as f64 * 1e-9;
                for (i, name) in timed.into_iter().enumerate() {
                    let (a, b) = (ticks.get(2 * i), ticks.get(2 * i + 1));
                    if let (Some(&a), Some(&b)) = (a, b) {
                        let e = t.totals.entry(name).or_insert((0, 0.0));
                        e.0 += 1;
                        e.1 += b.saturating_sub(a) as f64 * period;
                    }
                }
            }
        }
    }

    /// Resolves the first `q` timestamps into `enc`, submits it, waits and returns them (empty
    /// if the wait or the mapping failed).
    fn finish_timed(&self, t: &Timing, mut enc: ::wgpu::CommandEncoder, q: u32) -> Vec<u64> {
        enc.resolve_query_set(&t.qs, 0..q, &t.resolve, 0);
        enc.copy_buffer_to_buffer(&t.resolve, 0, &t.back, 0, 8 * q as u64);
        self.queue.submit([enc.finish()]);
        let slice = t.back.slice(..8 * q as u64);
        slice.map_async(::wgpu::MapMode::Read, |_| {});
        if self
            .device
            .poll(::wgpu::PollType::wait_indefinitely())
            .is_err()
        {
            return Vec::new();
        }
        let ticks = match slice.get_mapped_range() {
            Ok(r) => r
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            Err(_) => Vec::new(),
        };
        t.back.unmap();
        ticks
    }

    /// The GPU time of the dispatches `f` records, all in one compute pass between two
    /// timestamps (the kernel lab: back-to-back kernels with wgpu's barriers between them, as in
    /// a replayed decode step). At most `FLUSH_EVERY - 1` dispatches and no copies.
    pub fn time_pass(&self, f: impl FnOnce()) -> Result<f64> {
        self.flush();
        {
            let t = self.timing.lock().unwrap();
            let Some(t) = t.as_ref() else {
                bail!("{}: no timestamp queries on this adapter", self.report.name);
            };
            let mut open = self.open();
            let pass = open
                .enc
                .begin_compute_pass(&::wgpu::ComputePassDescriptor {
                    label: Some("timed"),
                    timestamp_writes: Some(::wgpu::ComputePassTimestampWrites {
                        query_set: &t.qs,
                        beginning_of_pass_write_index: Some(0),
                        end_of_pass_write_index: Some(1),
                    }),
                })
                .forget_lifetime();
            open.pass = Some(pass);
            *self.enc.lock().unwrap() = Some(open);
        }
        f();
        let open = self.enc.lock().unwrap().take();
        let Some(mut open) = open.filter(|o| o.pass.is_some()) else {
            bail!("time_pass: the pass was submitted or ended inside (too many dispatches, or a copy)");
        };
        open.pass = None;
        let t = self.timing.lock().unwrap();
        let ticks = self.finish_timed(t.as_ref().unwrap(), open.enc, 2);
        self.check()?;
        match ticks[..] {
            [a, b] => {
                Ok(b.saturating_sub(a) as f64 * self.queue.get_timestamp_period() as f64 * 1e-9)
            }
            _ => bail!("time_pass: the timestamps were not read back"),
        }
    }

    /// Submits whatever is recorded.
    pub fn flush(&self) {
        let o = self.enc.lock().unwrap().take();
        if let Some(o) = o {
            self.submit(o);
        }
    }

    /// Submits and waits for the GPU to finish; the first error since the last check.
    pub fn sync(&self) -> Result<()> {
        self.flush();
        self.device
            .poll(::wgpu::PollType::wait_indefinitely())
            .map_err(|e| anyhow!("wgpu: waiting for the device: {e}"))?;
        self.check()
    }

    /// Starts recording the ops that follow as a replayable step: they still run, or with
    /// `dry` they are only kept (a record made ahead, `Wgpu::prerecord`).
    pub fn begin_record(&self, dry: bool) {
        *self.rec_arena.lock().unwrap() = None;
        self.dry.store(dry, Ordering::Relaxed);
        {
            let mut c = self.bg_cache.lock().unwrap();
            let now = c.tick;
            c.starts.push_back(now);
            if c.starts.len() > BG_KEEP_RECORDS {
                let cut = c.starts.pop_front().unwrap_or(0);
                c.groups.retain(|_, v| v.1 > cut);
            }
        }
        for t in &self.host_ns {
            t.store(0, Ordering::Relaxed);
        }
        *self.rec.lock().unwrap() = Some(Vec::new());
    }

    /// Pipelines built so far (tests: the warm-up builds the decode step's).
    pub fn pipelines_built(&self) -> usize {
        self.pipelines.lock().unwrap().len()
    }

    /// Bind groups `cached_bind` keeps now (tests).
    pub fn bind_groups_cached(&self) -> usize {
        self.bg_cache.lock().unwrap().groups.len()
    }

    /// Milliseconds in `dispatch_spec`, and in its bind groups' creation, since the last
    /// `begin_record` (`LILY_WGPU_STEP_TIMES=1`; zeros without it).
    pub fn host_times(&self) -> (f64, f64) {
        let ms = |t: &std::sync::atomic::AtomicU64| t.load(Ordering::Relaxed) as f64 * 1e-6;
        (ms(&self.host_ns[0]), ms(&self.host_ns[1]))
    }

    /// The ops recorded since `begin_record`.
    pub fn end_record(&self) -> Vec<Item> {
        *self.rec_arena.lock().unwrap() = None;
        self.dry.store(false, Ordering::Relaxed);
        self.rec.lock().unwrap().take().unwrap_or_default()
    }

    /// Encodes a recorded step again: its dispatches with their own parameters and bind groups,
    /// submitted every `replay_flush` dispatches.
    pub fn replay_items(&self, items: &[Item]) {
        if self.tracing() {
            return self.replay_traced(items);
        }
        for it in items {
            let mut g = self.enc.lock().unwrap();
            let open = g.get_or_insert_with(|| self.open());
            self.encode_item(open, it);
            if open.n >= self.sw.replay_flush {
                let o = g.take().unwrap();
                self.submit(o);
            }
        }
    }

    /// One recorded op into `open` (twice where `set_skip`'s `+prefix` says).
    fn encode_item(&self, open: &mut Open, it: &Item) {
        for _ in 0..self.times(it) {
            self.encode_once(open, it);
        }
    }

    /// How many times a replay encodes `it` (`set_skip`): 0 when left out, 2 when doubled,
    /// else 1.
    fn times(&self, it: &Item) -> usize {
        match it {
            Item::Dispatch { entry, .. } if self.skip_any.load(Ordering::Relaxed) => self
                .skip
                .lock()
                .unwrap()
                .iter()
                .find(|(p, _)| entry.starts_with(p.as_str()))
                .map_or(1, |&(_, n)| n),
            _ => 1,
        }
    }

    fn encode_once(&self, open: &mut Open, it: &Item) {
        match it {
            Item::Dispatch {
                entry,
                pipe,
                bg,
                gx,
                gy,
            } => self.encode(open, entry, pipe, bg, *gx, *gy),
            Item::Copy {
                src,
                so,
                dst,
                dof,
                bytes,
            } => copy_into(open, src, *so, dst, *dof, *bytes),
        }
    }

    /// Whether replayed steps are traced (`trace_begin`).
    pub fn tracing(&self) -> bool {
        self.trace_on.load(Ordering::Relaxed)
    }

    /// Leaves the dispatches whose entry point starts with one of `prefixes` out of replayed
    /// steps (a timing probe: the step computes garbage; `lily bench --in-place`). Empty: none.
    /// A prefix written `+name` instead encodes those dispatches twice (the step then costs one
    /// more launch of each in place, where leaving one out also saves its neighbours' waits).
    pub fn set_skip(&self, prefixes: &[&str]) {
        *self.skip.lock().unwrap() = prefixes
            .iter()
            .map(|p| match p.strip_prefix('+') {
                Some(name) => (name.to_string(), 2),
                None => (p.to_string(), 0),
            })
            .collect();
        self.skip_any.store(!prefixes.is_empty(), Ordering::Relaxed);
    }

    /// Starts tracing replayed steps (`Tracer`): each is then encoded on its own, with a
    /// timestamp after every dispatch, submitted and read back before the step returns (so the
    /// traced steps run slower; the stamps' differences are device times). Where the adapter
    /// cannot stamp inside a compute pass (TIMESTAMP_QUERY_INSIDE_PASSES: Apple's GPUs through
    /// Metal), each op runs in a pass of its own whose end is stamped (`trace_passes`).
    pub fn trace_begin(&self) -> Result<()> {
        if self.timing.lock().unwrap().is_none() {
            bail!(
                "trace: {} has no timestamp queries (TIMESTAMP_QUERY)",
                self.report.name
            );
        }
        self.sync()?;
        let mut g = self.tracer.lock().unwrap();
        let t = g.get_or_insert_with(|| {
            let n = TRACE_QUERIES as u64;
            let buf = |label, usage| {
                self.device.create_buffer(&::wgpu::BufferDescriptor {
                    label: Some(label),
                    size: 8 * n,
                    usage,
                    mapped_at_creation: false,
                })
            };
            Tracer {
                qs: self.device.create_query_set(&::wgpu::QuerySetDescriptor {
                    label: Some("trace"),
                    ty: ::wgpu::QueryType::Timestamp,
                    count: TRACE_QUERIES,
                }),
                resolve: buf(
                    "trace resolved",
                    ::wgpu::BufferUsages::QUERY_RESOLVE | ::wgpu::BufferUsages::COPY_SRC,
                ),
                back: buf(
                    "trace read back",
                    ::wgpu::BufferUsages::MAP_READ | ::wgpu::BufferUsages::COPY_DST,
                ),
                recs: Vec::new(),
                launches: Vec::new(),
            }
        });
        t.recs.clear();
        t.launches.clear();
        self.trace_on.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Stops tracing: a record a launch of every traced step, and the launches.
    pub fn trace_end(&self) -> Result<crate::backend::trace::Traced> {
        self.trace_on.store(false, Ordering::Relaxed);
        self.sync()?;
        let mut g = self.tracer.lock().unwrap();
        let Some(t) = g.as_mut() else {
            bail!("trace: trace_end without trace_begin");
        };
        Ok((std::mem::take(&mut t.recs), std::mem::take(&mut t.launches)))
    }

    /// A recorded step encoded on its own with a timestamp before its first op and after each
    /// op (`Tracer`), submitted, and its stamps read back into the trace.
    fn replay_traced(&self, items: &[Item]) {
        use crate::backend::trace::{BlockRec, Launch};
        self.flush();
        let mut g = self.tracer.lock().unwrap();
        let Some(t) = g.as_mut() else {
            return self.fail("trace: tracing on without a tracer");
        };
        // Each op is encoded as a replay encodes it (`encode_item`), then stamped: a dispatch
        // in its pass, a copy (which ends the pass) by the first stamp of a new one. Without
        // stamps inside passes (`trace_passes`), each op in a pass of its own whose end is
        // stamped, a copy's by an empty pass after it: the stamps then also hold the passes'
        // boundaries, as a replay without them does not.
        let inside = self.ts_inside && !self.sw.trace_passes.load(Ordering::Relaxed);
        let mut open = self.open();
        if inside {
            let mut pass = open.enc.begin_compute_pass(&Default::default());
            pass.write_timestamp(&t.qs, 0);
            open.pass = Some(pass.forget_lifetime());
        } else {
            stamp_pass(&mut open, &t.qs, 0, false);
        }
        let mut names = Vec::with_capacity(items.len());
        'items: for it in items {
            let name = match it {
                Item::Dispatch { entry, gx, gy, .. } => format!("{entry} ×{}", gx * gy),
                _ => "copy".to_string(),
            };
            for _ in 0..self.times(it) {
                if names.len() + 1 >= TRACE_QUERIES as usize {
                    break 'items;
                }
                let at = names.len() as u32 + 1;
                if !inside {
                    let dispatch = matches!(it, Item::Dispatch { .. });
                    if dispatch {
                        stamp_pass(&mut open, &t.qs, at, true);
                    }
                    self.encode_once(&mut open, it);
                    if !dispatch {
                        stamp_pass(&mut open, &t.qs, at, false);
                    }
                    open.pass = None;
                    names.push(name.clone());
                    continue;
                }
                self.encode_once(&mut open, it);
                if open.pass.is_none() {
                    let p = open.enc.begin_compute_pass(&Default::default());
                    open.pass = Some(p.forget_lifetime());
                }
                let pass = open.pass.as_mut().expect("a pass is open");
                pass.write_timestamp(&t.qs, at);
                names.push(name.clone());
            }
        }
        open.pass = None;
        let mut enc = open.enc;
        let q = names.len() as u32 + 1;
        enc.resolve_query_set(&t.qs, 0..q, &t.resolve, 0);
        enc.copy_buffer_to_buffer(&t.resolve, 0, &t.back, 0, 8 * q as u64);
        self.queue.submit([enc.finish()]);
        let slice = t.back.slice(..8 * q as u64);
        slice.map_async(::wgpu::MapMode::Read, |_| {});
        if let Err(e) = self.device.poll(::wgpu::PollType::wait_indefinitely()) {
            return self.fail(format!("trace: waiting for the step: {e}"));
        }
        let ticks: Vec<u64> = match slice.get_mapped_range() {
            Ok(r) => r
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            Err(e) => return self.fail(format!("trace: reading the stamps: {e}")),
        };
        t.back.unmap();
        let ns = self.queue.get_timestamp_period() as f64;
        let at = |i: usize| (ticks[i] as f64 * ns) as u64;
        for (i, name) in names.into_iter().enumerate() {
            let (a, b) = (at(i), at(i + 1).max(at(i)));
            t.recs.push(BlockRec {
                start: a,
                wait: a,
                end: b,
                blocks: 1,
                ..Default::default()
            });
            t.launches.push(Launch { name, blocks: 1 });
        }
    }

    /// How many times a scratch buffer was replaced (a record made before is stale).
    /// Makes every recorded step stale (they hold the pipelines and bind groups of the switches
    /// they were recorded under): the next run of each records it again.
    pub fn stale_records(&self) {
        self.scratch_gen.fetch_add(1, Ordering::Relaxed);
    }

    pub fn scratch_gen(&self) -> u64 {
        self.scratch_gen.load(Ordering::Relaxed)
    }

    /// Starts (clearing the totals) or stops timing every dispatch; stopping returns each
    /// `family · kernel`'s calls and seconds of device time.
    pub fn set_timing(&self, on: bool) -> Option<Vec<(String, u64, f64)>> {
        self.flush();
        let mut t = self.timing.lock().unwrap();
        let t = t.as_mut()?;
        t.on = on;
        self.timing_on.store(on, Ordering::Relaxed);
        if on {
            t.totals.clear();
            return Some(Vec::new());
        }
        Some(
            std::mem::take(&mut t.totals)
                .into_iter()
                .map(|(k, (c, s))| (k, c, s))
                .collect(),
        )
    }

    /// The op family the next dispatches are charged to while timing.
    pub fn set_label(&self, family: &str) {
        if let Some(t) = self.timing.lock().unwrap().as_mut().filter(|t| t.on) {
            t.label.clear();
            t.label.push_str(family);
        }
    }

    /// A storage buffer of `bytes` (at least 4), zero-filled (wgpu zero-initialises).
    pub fn buffer(&self, bytes: u64) -> Result<::wgpu::Buffer> {
        let bytes = bytes.max(4).next_multiple_of(4);
        self.fits(bytes)?;
        Ok(self.device.create_buffer(&::wgpu::BufferDescriptor {
            label: None,
            size: bytes,
            usage: storage_usage(),
            mapped_at_creation: false,
        }))
    }

    /// The op's scratch buffer `name` of at least `bytes`, kept for the next call (grown to a
    /// power of two when too small): an op's intermediates (the arg-max partials, the experts'
    /// activations, the decode attention's splits) are not allocated again every token. Every
    /// use is a dispatch recorded in order on the one queue, so a later call's writes come after
    /// an earlier call's reads.
    pub fn scratch(&self, name: &'static str, bytes: u64) -> Result<::wgpu::Buffer> {
        let mut m = self.scratch.lock().unwrap();
        if let Some(b) = m.get(name) {
            if b.size() >= bytes {
                return Ok(b.clone());
            }
        }
        let b = self.buffer(
            bytes
                .max(4)
                .next_power_of_two()
                .min(self.report.max_binding),
        )?;
        if m.insert(name, b.clone()).is_some() {
            self.scratch_gen.fetch_add(1, Ordering::Relaxed);
        }
        Ok(b)
    }

    /// A storage buffer holding `data` (padded to 4 bytes).
    pub fn upload(&self, data: &[u8]) -> Result<::wgpu::Buffer> {
        let mut owned;
        let data = if data.len() % 4 != 0 || data.is_empty() {
            owned = data.to_vec();
            owned.resize(data.len().max(4).next_multiple_of(4), 0);
            &owned[..]
        } else {
            data
        };
        self.fits(data.len() as u64)?;
        Ok(self
            .device
            .create_buffer_init(&::wgpu::util::BufferInitDescriptor {
                label: None,
                contents: data,
                usage: storage_usage(),
            }))
    }

    fn fits(&self, bytes: u64) -> Result<()> {
        if bytes > self.report.max_binding {
            bail!(
                "a buffer of {bytes} bytes exceeds this adapter's largest storage binding ({} bytes, {})",
                self.report.max_binding,
                self.report.name
            );
        }
        Ok(())
    }

    /// `bytes` bytes of `b` from offset 0, after everything recorded so far.
    pub fn read(&self, b: &::wgpu::Buffer, bytes: u64) -> Result<Vec<u8>> {
        let bytes = bytes.next_multiple_of(4);
        if bytes == 0 {
            return Ok(Vec::new());
        }
        if self.rec.lock().unwrap().is_some() {
            bail!("wgpu: a read-back inside a recorded decode step");
        }
        // Small reads (a step's token, a few logits) reuse one buffer instead of making one.
        let mut cached = self.readback.lock().unwrap();
        let st = match cached.as_ref().filter(|c| c.size() >= bytes) {
            Some(c) => c.clone(),
            None => {
                let st = self.device.create_buffer(&::wgpu::BufferDescriptor {
                    label: Some("readback"),
                    size: bytes.max(SMALL_READ),
                    usage: ::wgpu::BufferUsages::MAP_READ | ::wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                if bytes <= SMALL_READ {
                    *cached = Some(st.clone());
                }
                st
            }
        };
        self.copy_now(b, 0, &st, 0, bytes);
        self.flush();
        let slot = Arc::new(Mutex::new(None));
        let s2 = slot.clone();
        st.slice(..bytes)
            .map_async(::wgpu::MapMode::Read, move |r| {
                *s2.lock().unwrap() = Some(r);
            });
        self.device
            .poll(::wgpu::PollType::wait_indefinitely())
            .map_err(|e| anyhow!("wgpu: waiting for the device: {e}"))?;
        self.check()?;
        match slot.lock().unwrap().take() {
            Some(Ok(())) => {}
            Some(Err(e)) => bail!("wgpu: mapping a read-back buffer: {e}"),
            None => bail!("wgpu: a read-back buffer was not mapped after the wait"),
        }
        let out = st
            .slice(..bytes)
            .get_mapped_range()
            .map_err(|e| anyhow!("wgpu: reading a mapped buffer: {e:?}"))?
            .to_vec();
        st.unmap();
        Ok(out)
    }
}

/// A token read in flight (`Ctx::token_begin`): its mappable buffer, the submission that copies
/// into it, and the outcome of its mapping once the device has run that submission.
pub(super) struct TokenRead {
    buf: ::wgpu::Buffer,
    index: ::wgpu::SubmissionIndex,
    mapped: Arc<Mutex<Option<Result<(), ::wgpu::BufferAsyncError>>>>,
}

impl Ctx {
    /// Begins reading the u32 at the start of `src` after everything recorded so far: the
    /// recorded work is submitted, then a copy into a mappable buffer as a submission of its
    /// own, whose index `token_finish` waits for. Work submitted later (the next decode step)
    /// does not delay the read, and a write into `src` by it comes after the copy.
    pub fn token_begin(&self, src: &::wgpu::Buffer) -> Result<TokenRead> {
        if self.rec.lock().unwrap().is_some() {
            bail!("wgpu: a read-back inside a recorded decode step");
        }
        let buf = self.token_reads.lock().unwrap().pop();
        let buf = buf.unwrap_or_else(|| {
            self.device.create_buffer(&::wgpu::BufferDescriptor {
                label: Some("token read"),
                size: 8,
                usage: ::wgpu::BufferUsages::MAP_READ | ::wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        });
        self.flush();
        let mut enc = self.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(src, 0, &buf, 0, 4);
        let index = self.queue.submit([enc.finish()]);
        // Mapping is asked after the submission that writes the buffer (a buffer with a map
        // pending cannot be submitted); it completes when that submission has run.
        let mapped = Arc::new(Mutex::new(None));
        let m2 = mapped.clone();
        buf.slice(..4).map_async(::wgpu::MapMode::Read, move |r| {
            *m2.lock().unwrap() = Some(r);
        });
        Ok(TokenRead { buf, index, mapped })
    }

    /// The u32 of a read begun by `token_begin`: waits for its submission only (and the ones
    /// before it), reports the first error since the last check, and keeps the buffer for the
    /// next read.
    pub fn token_finish(&self, r: TokenRead) -> Result<u32> {
        self.device
            .poll(::wgpu::PollType::Wait {
                submission_index: Some(r.index),
                timeout: None,
            })
            .map_err(|e| anyhow!("wgpu: waiting for the device: {e}"))?;
        self.check()?;
        match r.mapped.lock().unwrap().take() {
            Some(Ok(())) => {}
            Some(Err(e)) => bail!("wgpu: mapping a token read-back buffer: {e}"),
            None => bail!("wgpu: a token read-back buffer was not mapped after the wait"),
        }
        let token = {
            let v = r
                .buf
                .slice(..4)
                .get_mapped_range()
                .map_err(|e| anyhow!("wgpu: reading a mapped buffer: {e:?}"))?;
            u32::from_le_bytes([v[0], v[1], v[2], v[3]])
        };
        r.buf.unmap();
        let mut free = self.token_reads.lock().unwrap();
        if free.len() < TOKEN_READS {
            free.push(r.buf);
        }
        Ok(token)
    }
}

fn d_backends() -> ::wgpu::Backends {
    ::wgpu::Backends::VULKAN | ::wgpu::Backends::METAL
}

fn storage_usage() -> ::wgpu::BufferUsages {
    ::wgpu::BufferUsages::STORAGE | ::wgpu::BufferUsages::COPY_SRC | ::wgpu::BufferUsages::COPY_DST
}

pub fn as_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data slices (u32, f32) viewed as their bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every switch an arm of `lily bench --arms` can change while the device is open changes
    /// when an arm names it with another value: stop 43 found `LILY_WGPU_ATTN_KEYS` read but
    /// not taken by `set_arm`, so stop 42's arm of it had run the defaults. A switch added to
    /// `Switches` without a row here is not checked: add one with it.
    #[test]
    fn arms_take_every_switch_they_name() {
        const R: Ordering = Ordering::Relaxed;
        type Get = fn(&Switches) -> u64;
        // A row whose switch is one atomic field: its value as u64.
        macro_rules! load {
            ($n:literal, $v:literal, $f:ident) => {
                ($n, $v, (|s: &Switches| s.$f.load(R) as u64) as Get)
            };
        }
        let cases: &[(&str, &str, Get)] = &[
            load!("LILY_WGPU_GEMV_WGS", "7", gemv_wgs),
            load!("LILY_WGPU_Q6_WGS", "7", q6_wgs),
            ("LILY_WGPU_Q6_WGS_BY", "1:16", |s| {
                s.q6_wgs_by.lock().map_or(0, |v| v.len() as u64)
            }),
            load!("LILY_WGPU_Q6_MIN_KB", "7", q6_min_kb),
            load!("LILY_WGPU_ROUTE_AHEAD", "1", route_ahead),
            ("LILY_WGPU_XQ_AHEAD", "1", |s| {
                s.xq_ahead.load(R) as u64 + 2 * s.xq_moe.load(R) as u64
            }),
            load!("LILY_WGPU_XQ_AHEAD", "oproj", xq_oproj),
            load!("LILY_WGPU_XQ_AHEAD", "fold", xq_fold),
            ("LILY_WGPU_SPEC", "none", |s| {
                [
                    &s.q6_spec,
                    &s.moe_spec,
                    &s.xq_spec,
                    &s.gdn_spec,
                    &s.attn_spec,
                ]
                .iter()
                .map(|a| a.load(R) as u64)
                .sum()
            }),
            load!("LILY_WGPU_TRACE_PASSES", "1", trace_passes),
            load!("LILY_WGPU_GEMV", "v4", gemv),
            load!("LILY_WGPU_GDN_STEP", "y", gdn_step),
            load!("LILY_WGPU_KV_F16", "0", kv_f16),
            load!("LILY_WGPU_ATTN_DEC", "gqa", attn_team),
            load!("LILY_WGPU_ATTN_KEYS", "7", attn_keys),
            load!("LILY_WGPU_ATTN_VAHEAD", "1", attn_vahead),
            load!("LILY_WGPU_ATTN_CQ", "0", attn_cq),
            load!("LILY_WGPU_MOE_Q", "0", moe_q),
            load!("LILY_WGPU_MOE_FUSE", "0", moe_fuse),
            load!("LILY_WGPU_MOE_XQ", "0", moe_xq),
            load!("LILY_WGPU_MOE_DOWN", "y", moe_down),
            load!("LILY_WGPU_MOE_ACT", "gate", moe_act),
            load!("LILY_WGPU_MOE_A8", "1", moe_a8),
            load!("LILY_WGPU_Q6W", "0", q6w),
            load!("LILY_WGPU_ROUTER", "q6w", router_rows),
            load!("LILY_WGPU_Q6W_MAX_MB", "8", q6w_max_mb),
            load!("LILY_WGPU_BG_CACHE", "0", bg_cache),
            load!("LILY_WGPU_MOE_XQ_SHAPE", "8,4,1", moe_xq_shape),
            load!("LILY_WGPU_GEMM", "old", gemm),
            load!("LILY_WGPU_MOE_MM", "mm8", moe_mm8),
        ];
        for &(name, value, get) in cases {
            // (An environment that already sets this value leaves nothing to change.)
            if std::env::var(name).as_deref() == Ok(value) {
                continue;
            }
            // The switches as the environment gives them, then the arm over them.
            let s = Switches::from_env();
            let before = get(&s);
            s.set_arm(&[(name.to_string(), value.to_string())])
                .unwrap_or_else(|e| panic!("{name}={value}: {e:#}"));
            assert_ne!(
                get(&s),
                before,
                "{name}={value}: the arm left its switch as it was"
            );
        }
    }

    /// `LILY_WGPU_XQ_AHEAD`'s values: unset, `down` and an unknown value give the default (the
    /// next x staged by down alone), `0` none, `next` o_proj's too, `1` the MoE block's too.
    #[test]
    fn xq_ahead_values() {
        let at = |v: Option<&str>| {
            let s = Switches::from_lookup(&|k| {
                if k == "LILY_WGPU_XQ_AHEAD" {
                    v.map(str::to_string)
                } else {
                    None
                }
            });
            [&s.xq_ahead, &s.xq_oproj, &s.xq_moe, &s.xq_fold].map(|a| a.load(Ordering::Relaxed))
        };
        let down = [true, false, false, false];
        assert_eq!(at(None), down);
        assert_eq!(at(Some("down")), down);
        assert_eq!(at(Some("Down")), down);
        assert_eq!(at(Some("0")), [false; 4]);
        assert_eq!(at(Some("next")), [true, true, false, false]);
        assert_eq!(at(Some("oproj")), [false, true, false, false]);
        assert_eq!(at(Some("1")), [true, true, true, false]);
        assert_eq!(at(Some("fold")), [true; 4]);
    }
}
