//! `lily bench`: the DESIGN.md benchmark contract.
//!
//! Batch 1, greedy, prompt ids `(i·2654435761 mod 2^32) mod vocab`, a warm-up of the exact shape,
//! then per length: prefill throughput = prompt tokens / time to first token, and decode
//! throughput = 64 generated tokens / their time after a context of that length. Median of
//! `--rounds`. Each row also gives the fraction of the hardware limit (the roofline), both ceilings
//! measured in the same run on the hardware the model runs on:
//! * decode: bytes/s (weights of the active experts and layers, GDN state read and written, KV of
//!   the context read; see `decode_bytes_per_token`) against the memory bandwidth: on a GPU the
//!   measured device-to-device copy bandwidth (bytes read + written), on the CPU a parallel read
//!   of a 1 GiB buffer;
//! * prefill: FLOP/s (2 per active weight + attention) against the matrix rate: on a GPU the
//!   measured dense bf16 GEMM rate (f32 accumulation; cuBLAS), on the CPU the f32 FMA peak.
//!
//! A backend that measures its own ceilings (`Backend::measure_ceilings`, the CUDA backend) is
//! asked; otherwise the CPU is measured. `--bandwidth` / `--peak-flops` replace a measurement with
//! the given figure. The figures, how they were obtained (`ceilings_method`) and whether each was
//! measured or given go to the JSON.
//!
//! `--in-place` (CUDA, wgpu) measures what each kernel family costs inside a recorded decode step: the
//! step with the family's kernels left out against the full step (see `in_place`).
//!
//! `--trace` (CUDA, wgpu) says where a recorded decode step's time goes, kernel by kernel: on
//! CUDA every block of every kernel stamps the global timer (kernels built with the trace:
//! LILY_CUDA_TRACE, set by the flag); on wgpu a timestamp query follows every dispatch of the
//! replayed step (device.rs `Tracer`: one record a launch, named `entry ×workgroups`). backend/trace.rs
//! sums per kernel name its time in place, split into its own work after its wait and the
//! boundary to the next kernel (see `trace`; on wgpu the split is not known: all of it is body).
//!
//! `--profile` adds time per op family (backend/profile.rs: every op bracketed by a device sync)
//! for one prefill chunk and one decode step, at `--profile-context` (default 4K) tokens of
//! context: after an unprofiled prefill of that context, one chunk of `--chunk` tokens (default
//! 256, the model's) is timed unprofiled, then the next chunk profiled (so the profiled chunk sits
//! at positions ctx+chunk .. ctx+2·chunk); then `--profile-steps` decode steps (default 8, greedy,
//! logits of the last position read back as in the decode benchmark) are timed unprofiled and as
//! many profiled, reported per step. Both the unprofiled and the profiled wall times are printed:
//! their difference is the cost of the syncs. With `--profile`, the benchmark rows run on the
//! same wrapped backend with the profiler off (one atomic load per op).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use rayon::prelude::*;
use serde_json::json;

use lily::backend::profile::{Profiled, Profiler};
use lily::backend::trace::Traced;
use lily::backend::{Backend, Dims};
use lily::loader::Checkpoint;
use lily::model::{Logits, Pick, Qwen35, SeqState};
use lily::runtime::argmax;

use crate::Common;

#[derive(Args)]
pub struct BenchArgs {
    /// Checkpoint directory (default: the `cpu-bench` preset, synthesized once into
    /// `.cache/lily/cpu-bench`).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt lengths for prefill (comma-separated).
    #[arg(long, default_value = "256,512")]
    prefill: String,
    /// Context lengths after which 64 tokens are decoded (comma-separated).
    #[arg(long, default_value = "256")]
    decode: String,
    /// Tokens generated per decode measurement.
    #[arg(long, default_value_t = 64)]
    decode_tokens: usize,
    /// Measured rounds per row (the median is reported).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Prefill block size.
    #[arg(long)]
    chunk: Option<usize>,
    /// Memory bandwidth ceiling in bytes/s (default: measured in this run: the GPU's copy
    /// bandwidth, or the CPU's read bandwidth).
    #[arg(long)]
    bandwidth: Option<f64>,
    /// Compute ceiling in FLOP/s (default: measured in this run: the GPU's bf16 GEMM rate, or the
    /// CPU's f32 FMA peak).
    #[arg(long)]
    peak_flops: Option<f64>,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Time per op family for one prefill chunk and one decode step (see the module header).
    #[arg(long)]
    profile: bool,
    /// Also measure constrained decoding at each `--decode` context: the generation loop with
    /// and without this JSON schema (`builtin`: a 1 KB plan schema; or a file), greedy and
    /// sampled (bench_schema.rs).
    #[arg(long)]
    schema: Option<String>,
    /// Context before the profiled chunk and steps.
    #[arg(long, default_value = "4k")]
    profile_context: String,
    /// Decode steps averaged in the profile.
    #[arg(long, default_value_t = 8)]
    profile_steps: usize,
    /// Each kernel family's cost inside a recorded decode step (CUDA, wgpu): at each `--decode`
    /// context, decode with the family's kernels left out of the step (garbage tokens, true
    /// times), alternated with the full step, `--rounds` times. `default` (the families of a
    /// layer) or comma-separated kernel-name prefixes; on wgpu a prefix written `+name` encodes
    /// that family's launches twice instead (one more launch of each in place).
    #[arg(long)]
    in_place: Option<String>,
    /// Trace `--trace-steps` recorded decode steps at each `--decode` context (CUDA: kernels
    /// built with the trace, so the other rows of this run are not the contract's; wgpu: a
    /// timestamp after every dispatch): per kernel name, µs a step in place, its body after the
    /// PDL wait, the gap to the next kernel.
    #[arg(long)]
    trace: bool,
    /// Decode steps traced per context (32 bytes per block per step are kept on the device).
    #[arg(long, default_value_t = 8)]
    trace_steps: usize,
    /// A/B arms in one process (CUDA, wgpu; see `arms`): `;`-separated arms, each `+`-joined
    /// `NAME=VALUE` switches as the environment would give them (wgpu: `LILY_WGPU_*` that can
    /// change while the device is open; CUDA: `LILY_CUDA_DISABLE`, `LILY_CUDA_ENABLE`), against
    /// the defaults of this process, at each `--decode` context, `--rounds` rounds alternated.
    #[arg(long)]
    arms: Option<String>,
    #[command(flatten)]
    common: Common,
}

fn lengths(s: &str, flag: &str) -> Result<Vec<usize>> {
    s.split(',')
        .filter(|x| !x.trim().is_empty())
        .map(|x| {
            let x = x.trim().to_ascii_lowercase();
            let (num, mul) = if let Some(n) = x.strip_suffix('k') {
                (n.to_string(), 1024)
            } else {
                (x.clone(), 1)
            };
            num.parse::<usize>()
                .map(|n| n * mul)
                .map_err(|_| anyhow::anyhow!("--{flag}: `{x}` is not a length"))
        })
        .collect()
}

/// The serving loop's greedy path, `n` tokens after a prefill: each token picked and fed back
/// on the backend (its step recorded and replayed on a GPU), 4 bytes read back per token, with
/// the serving loop's lookahead (`Qwen35::picked_ahead`: the read of a token begun, the step
/// that feeds it enqueued, then the wait; `LILY_LOOKAHEAD=0`: the read before the next step).
/// With LILY_BENCH_READ_EVERY=k (a measurement, not the contract) the pick is read every k
/// steps only, so the host enqueues steps while the device runs: what a step costs without the
/// host's round trip per token.
fn decode_greedy<B: Backend>(
    m: &Qwen35<B>,
    st: &mut SeqState<B>,
    n: usize,
    read_every: usize,
) -> Result<()> {
    let read = |i: usize| (i + 1).is_multiple_of(read_every) || i + 1 == n;
    if !m.lookahead {
        for i in 0..n {
            if read(i) {
                std::hint::black_box(m.decode(st, None, true)?);
            } else {
                m.decode_step(st, None, None)?;
            }
        }
        return Ok(());
    }
    // Step i's pick is read while step i + 1 runs: the same n steps and reads.
    if n > 0 {
        m.decode_step(st, None, None)?;
    }
    for i in 0..n {
        let next = i + 1 < n;
        match (read(i), next) {
            (true, true) => {
                std::hint::black_box(m.picked_ahead(st, Pick::Argmax)?);
            }
            (true, false) => {
                std::hint::black_box(m.picked(st)?);
            }
            (false, true) => m.decode_step(st, None, None)?,
            (false, false) => {}
        }
    }
    Ok(())
}

/// The contract's synthetic prompt.
pub fn prompt_ids(n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i as u64 * 2654435761) % (1u64 << 32) % vocab as u64) as u32)
        .collect()
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Memory read bandwidth (bytes/s): all threads summing disjoint parts of a 1 GiB buffer.
fn measure_bandwidth() -> f64 {
    let n = (1usize << 30) / 4;
    let buf: Vec<f32> = (0..n).into_par_iter().map(|i| (i & 7) as f32).collect();
    let mut best = 0.0f64;
    for _ in 0..3 {
        let t0 = Instant::now();
        let s: f32 = buf.par_chunks(1 << 16).map(|c| c.iter().sum::<f32>()).sum();
        let dt = t0.elapsed().as_secs_f64();
        std::hint::black_box(s);
        best = best.max((n * 4) as f64 / dt);
    }
    best
}

/// Peak f32 FMA rate (FLOP/s) over all threads: independent register FMA chains.
fn measure_flops() -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            #[target_feature(enable = "avx2,fma")]
            unsafe fn chains(iters: usize) -> f32 {
                use std::arch::x86_64::*;
                let m = _mm256_set1_ps(0.999_999);
                let a = _mm256_set1_ps(1e-7);
                let mut acc = [_mm256_set1_ps(1.0); 10];
                for _ in 0..iters {
                    for x in acc.iter_mut() {
                        *x = _mm256_fmadd_ps(*x, m, a);
                    }
                }
                let mut s = _mm256_setzero_ps();
                for x in acc {
                    s = _mm256_add_ps(s, x);
                }
                let mut o = [0f32; 8];
                _mm256_storeu_ps(o.as_mut_ptr(), s);
                o.iter().sum()
            }
            let iters = 20_000_000;
            let threads = rayon::current_num_threads();
            let t0 = Instant::now();
            // SAFETY: the features were detected above.
            let s: f32 = (0..threads)
                .into_par_iter()
                .map(|_| unsafe { chains(iters) })
                .sum();
            std::hint::black_box(s);
            return (threads * iters * 10 * 8 * 2) as f64 / t0.elapsed().as_secs_f64();
        }
    }
    f64::NAN
}

/// Bytes per element of the GDN recurrent state (f32 on every backend, by design).
const GDN_STATE_BYTES: usize = 4;

/// Bytes moved per decoded token at a mean context of `ctx` tokens: the active weights, the GDN
/// state read and written, and K and V of every cached position read.
fn decode_bytes_per_token(
    cfg: &lily::Config,
    d: &Dims,
    weight_bytes: f64,
    ctx: f64,
    kv_elem: usize,
) -> f64 {
    let gdn_layers = (cfg.num_hidden_layers - cfg.num_attention_layers()) as f64;
    let state =
        gdn_layers * (d.gdn_v_heads * d.gdn_v_dim * d.gdn_k_dim * GDN_STATE_BYTES * 2) as f64;
    let kv =
        cfg.num_attention_layers() as f64 * (2 * d.n_kv_heads * d.head_dim * kv_elem) as f64 * ctx;
    weight_bytes + state + kv
}

/// The roofline's two ceilings and where they came from.
struct Roofline {
    bandwidth: f64,
    flops: f64,
    /// How they were obtained (printed and in the JSON).
    method: String,
    bandwidth_measured: bool,
    flops_measured: bool,
}

/// Measured on the backend's device when it can, else on the CPU; a figure given on the command
/// line replaces its measurement.
fn ceilings<B: Backend>(
    b: &B,
    bandwidth: Option<f64>,
    peak_flops: Option<f64>,
) -> Result<Roofline> {
    let given = |what: &str, v: f64| format!("{what}: given ({v:.4e})");
    if let (Some(bw), Some(fl)) = (bandwidth, peak_flops) {
        return Ok(Roofline {
            bandwidth: bw,
            flops: fl,
            method: format!("{}; {}", given("bandwidth", bw), given("matrix rate", fl)),
            bandwidth_measured: false,
            flops_measured: false,
        });
    }
    let (bw, fl, method) = match b.measure_ceilings() {
        Some(r) => {
            let c = r?;
            (c.bandwidth, c.flops, c.method)
        }
        None => {
            let threads = rayon::current_num_threads();
            let bw = if bandwidth.is_none() {
                measure_bandwidth()
            } else {
                f64::NAN
            };
            let fl = if peak_flops.is_none() {
                measure_flops()
            } else {
                f64::NAN
            };
            let mut parts = Vec::new();
            if bandwidth.is_none() {
                parts.push(format!(
                    "memory: parallel read of a 1 GiB f32 buffer, {threads} threads, best of 3"
                ));
            }
            if peak_flops.is_none() {
                parts.push(if fl.is_nan() {
                    "FMA: not measured (no AVX2 + FMA)".into()
                } else {
                    format!("FMA: f32 AVX2 FMA chains, {threads} threads")
                });
            }
            (bw, fl, format!("CPU: {}", parts.join("; ")))
        }
    };
    // A device measures both at once: its line stays whole, the given figure is named first.
    let method = match (bandwidth, peak_flops) {
        (Some(v), _) => format!("{}; measured: {method}", given("bandwidth", v)),
        (_, Some(v)) => format!("{}; measured: {method}", given("matrix rate", v)),
        _ => method,
    };
    Ok(Roofline {
        bandwidth: bandwidth.unwrap_or(bw),
        flops: peak_flops.unwrap_or(fl),
        method,
        bandwidth_measured: bandwidth.is_none(),
        flops_measured: peak_flops.is_none(),
    })
}

/// `4.21e12` → "4.21 T" (bytes or FLOP per second).
fn si(v: f64) -> String {
    if v >= 1e12 {
        format!("{:.2} T", v / 1e12)
    } else {
        format!("{:.1} G", v / 1e9)
    }
}

/// FLOPs of prefilling one token at position `pos`: 2 per active matrix weight (routed experts,
/// shared expert, projections, router; lm_head only for the last token) + attention.
fn prefill_flops_per_token(c: &lily::Config, pos: usize) -> f64 {
    let h = c.hidden_size as f64;
    let mut params = 0.0;
    for &attn in &c.layer_is_attention {
        params += if attn {
            h * (2 * c.attn_q_dim() + 2 * c.attn_kv_dim()) as f64 + (c.attn_q_dim() as f64) * h
        } else {
            h * (c.gdn_qkv_dim() + c.gdn_v_dim() + 2 * c.linear_num_value_heads) as f64
                + c.gdn_v_dim() as f64 * h
        };
        params += 3.0
            * h
            * (c.moe_intermediate_size * c.num_experts_per_tok + c.shared_expert_intermediate_size)
                as f64;
        params += h * (c.num_experts + 1) as f64;
    }
    let attn = c.num_attention_layers() as f64
        * 4.0
        * (c.num_attention_heads * c.head_dim) as f64
        * pos as f64;
    2.0 * params + attn
}

/// Leaves the kernels whose names start with these prefixes out of recorded decode steps (a
/// timing probe of the backend: `--in-place`).
type SkipHook<B> = fn(&B, &[&str]);
/// An arm's switches: `NAME=VALUE` pairs (`--arms`).
type Switches = [(String, String)];
/// Sets the backend's run-time switches to an arm's (`--arms`).
type ArmHook<B> = fn(&B, &Switches) -> Result<()>;
/// `--arms`' list: each arm's text and switches.
type ArmList = Vec<(String, Vec<(String, String)>)>;

/// The GPU backends' timing probes (CUDA, wgpu), seen by the generic benchmark.
struct Probes<B> {
    skip: SkipHook<B>,
    /// Starts the in-place trace (`--trace`).
    trace_begin: fn(&B) -> Result<()>,
    /// Stops it: the block records and the launches they belong to.
    trace_end: fn(&B) -> Result<Traced>,
    /// `--in-place default`: the kernel-name prefixes of the backend's decode families.
    families: &'static [(&'static str, &'static str)],
    /// `--arms`: sets the backend's run-time switches to an arm's (`NAME=VALUE` over the
    /// environment's; the empty arm: the defaults), dropping its recorded steps.
    arm: ArmHook<B>,
}

pub fn run(a: BenchArgs) -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        if a.trace {
            // Read once, by the backend's constructor below: every kernel built with the trace.
            std::env::set_var("LILY_CUDA_TRACE", "1");
        }
        if let Some(b) = crate::pick_cuda(&a.common)? {
            let probes = Probes::<lily::backend::cuda::Cuda> {
                skip: |b, p| b.set_skip(p),
                trace_begin: |b| b.trace_begin(),
                trace_end: |b| b.trace_end(),
                families: IN_PLACE_FAMILIES,
                arm: cuda_arm,
            };
            return run_on(b, a, Some(probes));
        }
    }
    #[cfg(feature = "wgpu")]
    if let Some(b) = crate::pick_wgpu(&a.common)? {
        crate::setup_threads(&a.common)?;
        let probes = Probes::<lily::backend::wgpu::Wgpu> {
            skip: |b, p| b.set_skip(p),
            trace_begin: |b| b.trace_begin(),
            trace_end: |b| b.trace_end(),
            families: IN_PLACE_FAMILIES_WGPU,
            arm: |b, sets| b.set_switches(sets),
        };
        return run_on(b, a, Some(probes));
    }
    let b = crate::setup(&a.common)?;
    run_on(b, a, None)
}

fn run_on<B: Backend>(b: B, a: BenchArgs, probes: Option<Probes<B>>) -> Result<()> {
    if a.profile {
        if a.in_place.is_some() || a.trace {
            bail!(
                "--in-place, --trace and --profile measure different things: ask for one at a time"
            );
        }
        let p = Profiled::new(b);
        let prof = p.profiler();
        bench(p, a, Some(prof), None)
    } else {
        bench(b, a, None, probes)
    }
}

/// `--arms` on CUDA: an arm's `LILY_CUDA_DISABLE` and `LILY_CUDA_ENABLE` lists (over the
/// environment's) become the backend's switches (`Cuda::set_disabled`, `set_enabled`).
#[cfg(feature = "cuda")]
fn cuda_arm(b: &lily::backend::cuda::Cuda, arm: &Switches) -> Result<()> {
    const NAMES: [&str; 2] = ["LILY_CUDA_DISABLE", "LILY_CUDA_ENABLE"];
    if let Some((n, _)) = arm.iter().find(|(n, _)| !NAMES.contains(&n.as_str())) {
        bail!("`{n}`: an arm on CUDA sets LILY_CUDA_DISABLE or LILY_CUDA_ENABLE");
    }
    let list = |k: &str| -> Vec<String> {
        let v = arm
            .iter()
            .rev()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
            .or_else(|| std::env::var(k).ok())
            .unwrap_or_default();
        v.split(',')
            .map(str::trim)
            .filter(|x| !x.is_empty())
            .map(String::from)
            .collect()
    };
    let (d, e) = (list(NAMES[0]), list(NAMES[1]));
    b.set_disabled(&d.iter().map(String::as_str).collect::<Vec<_>>())?;
    b.set_enabled(&e.iter().map(String::as_str).collect::<Vec<_>>())
}

/// `--in-place default`: kernel-name prefixes of the CUDA backend's decode families, each with
/// what it holds.
#[cfg(feature = "cuda")]
const IN_PLACE_FAMILIES: &[(&str, &str)] = &[
    ("tc_gemv", "GDN in_proj, attention q|k|v (+ norm), lm_head"),
    ("gdn_step", "GDN conv + gated delta step + gated norm"),
    ("sw_gemv_4", "out_proj, o_proj (+ residual)"),
    ("sw_gemv_8", "router | shared gate (+ norm, + route)"),
    (
        "sw_gemv_ahead",
        "out_proj, o_proj (+ residual, + the router folded: route_ahead)",
    ),
    ("route_ahead", "the folded router's norm, logits and route"),
    ("moe_wide_gate", "experts gate|up (8 routed + shared)"),
    ("moe_wide_down", "experts down (+ combine, + residual)"),
    ("attn_", "attention: qk norm + RoPE, decode, combine"),
    ("sample_", "sampling (greedy: none)"),
];

/// `--in-place default` on the wgpu backend: the entry-point prefixes of its decode families.
#[cfg(feature = "wgpu")]
const IN_PLACE_FAMILIES_WGPU: &[(&str, &str)] = &[
    (
        "q2x_stage",
        "x staged for the GEMVs (+ RMS norm, + GDN gated norm, + the folded router's logits)",
    ),
    (
        "gemv_q6",
        "every GEMV: in_proj (+ conv), out_proj, q|k|v, o_proj, router, lm_head",
    ),
    ("gdn_", "GDN gated delta step"),
    ("qk_", "attention q/k norms + RoPE + KV append"),
    ("attn_", "attention decode + combine"),
    ("moe_gate_up", "experts gate|up (+ route, + shared)"),
    ("moe_down", "experts down (+ shared, + residual)"),
];

fn bench<B: Backend>(
    b: B,
    a: BenchArgs,
    prof: Option<Arc<Profiler>>,
    probes: Option<Probes<B>>,
) -> Result<()> {
    if a.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let families: Vec<(String, String)> = match a.in_place.as_deref() {
        None => Vec::new(),
        Some("default") => probes
            .as_ref()
            .map_or(&[][..], |p| p.families)
            .iter()
            .map(|(p, w)| (p.to_string(), w.to_string()))
            .collect(),
        Some(list) => list
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| (p.to_string(), String::new()))
            .collect(),
    };
    if a.trace && probes.is_none() {
        bail!("--trace needs a GPU backend (cuda or wgpu)");
    }
    if a.in_place.is_some() && (probes.is_none() || families.is_empty()) {
        bail!("--in-place needs a GPU backend and at least one kernel-name prefix (or `default`)");
    }
    let arm_list = match &a.arms {
        Some(s) if probes.is_none() => {
            bail!("--arms `{s}` needs a GPU backend (cuda or wgpu), and no --profile")
        }
        Some(s) => parse_arms(s)?,
        None => Vec::new(),
    };
    let dir = match &a.model {
        Some(d) => d.clone(),
        None => {
            let d = PathBuf::from(".cache/lily/cpu-bench");
            if !d.join("config.json").exists() {
                eprintln!(
                    "lily bench: synthesizing the cpu-bench preset into {} (once)",
                    d.display()
                );
                let cfg = lily::synth::preset("cpu-bench")?;
                lily::synth::write_checkpoint(&cfg, &d, 0, &|_, _| {})?;
            }
            d
        }
    };
    let prefill = lengths(&a.prefill, "prefill")?;
    let decode = lengths(&a.decode, "decode")?;
    let ck = Checkpoint::open(&dir)?;
    let cfg = ck.config.clone();
    let weight_bytes = ck.weights.decode_bytes_per_token(&cfg) as f64;
    let mut m = Qwen35::new(b, ck.config, &ck.weights)?;
    if let Some(hwm) = peak_host_memory() {
        eprintln!(
            "lily bench: peak host memory while loading: {:.2} GiB (VmHWM)",
            hwm as f64 / (1u64 << 30) as f64
        );
    }
    if let Some(c) = a.chunk {
        m.chunk = c.max(1);
    }
    // Every arm is checked before anything is measured.
    if let Some(p) = probes.as_ref().filter(|_| !arm_list.is_empty()) {
        for (_, sets) in &arm_list {
            (p.arm)(&m.backend, sets)?;
        }
        (p.arm)(&m.backend, &[])?;
    }
    let d = Dims::from_config(&cfg);
    eprintln!("lily bench: measuring the machine's ceilings…");
    let ceil = ceilings(&m.backend, a.bandwidth, a.peak_flops)?;
    let (bw, peak) = (ceil.bandwidth, ceil.flops);
    let src = |measured: bool| if measured { "measured" } else { "given" };
    let threads = rayon::current_num_threads();
    eprintln!(
        "lily bench: {} | bandwidth {}B/s ({}) | matrix peak {}FLOP/s ({}) | {} threads",
        m.backend.name(),
        si(bw),
        src(ceil.bandwidth_measured),
        si(peak),
        src(ceil.flops_measured),
        threads
    );
    eprintln!("lily bench: ceilings: {}", ceil.method);
    // Decode's roofline counts K and V as the backend stores them (f32 on the CPU, bf16 on CUDA).
    let kv_elem = m.backend.kv_elem_bytes();
    let max_len = prefill
        .iter()
        .chain(decode.iter())
        .copied()
        .max()
        .unwrap_or(0)
        + a.decode_tokens
        + 1;
    let mut rows = Vec::new();
    println!(
        "{:<8} {:>8} {:>12} {:>10} {:>10}",
        "phase", "length", "tok/s", "time s", "roofline"
    );

    for &n in &prefill {
        let ids = prompt_ids(n, cfg.vocab_size);
        let mut times = Vec::new();
        for r in 0..=a.rounds {
            let mut st = m.new_state(max_len)?;
            let t0 = Instant::now();
            let logits = m.forward(&mut st, &ids, Logits::Last, None)?;
            std::hint::black_box(argmax(&logits));
            let dt = t0.elapsed().as_secs_f64();
            if r > 0 {
                times.push(dt); // round 0 is the warm-up of the exact shape
            }
        }
        let t = median(times);
        let flops: f64 = (0..n)
            .map(|p| prefill_flops_per_token(&cfg, p))
            .sum::<f64>()
            + 2.0 * (cfg.vocab_size * cfg.hidden_size) as f64;
        let frac = flops / t / peak;
        println!(
            "{:<8} {:>8} {:>12.1} {:>10.3} {:>9.1}%",
            "prefill",
            n,
            n as f64 / t,
            t,
            100.0 * frac
        );
        rows.push(
            json!({"phase": "prefill", "length": n, "tok_s": n as f64 / t, "seconds": t,
            "flop_s": flops / t, "roofline_fraction": frac}),
        );
    }

    // Diagnosis only (not the contract): `LILY_BENCH_WARM=N` decodes N tokens untimed after each
    // prefill, before the timed ones, to see what the first steps after a prefill cost (a new
    // state's recording, the KV cache growing).
    let warm = std::env::var("LILY_BENCH_WARM")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(0);
    if warm > 0 {
        eprintln!("lily bench: LILY_BENCH_WARM={warm}: {warm} untimed decode tokens before each timed run (not the contract)");
    }
    let read_every = std::env::var("LILY_BENCH_READ_EVERY")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&k| k > 0)
        .unwrap_or(1);
    for &n in &decode {
        let ids = prompt_ids(n, cfg.vocab_size);
        let mut times = Vec::new();
        for r in 0..=a.rounds {
            let mut st = m.new_state(max_len + warm)?;
            m.forward(&mut st, &ids, Logits::Last, None)?;
            decode_greedy(&m, &mut st, warm, 1)?;
            let t0 = Instant::now();
            decode_greedy(&m, &mut st, a.decode_tokens, read_every)?;
            if r > 0 {
                times.push(t0.elapsed().as_secs_f64());
            }
        }
        let t = median(times);
        let tps = a.decode_tokens as f64 / t;
        // The mean context over the generated tokens.
        let bytes = decode_bytes_per_token(
            &cfg,
            &d,
            weight_bytes,
            n as f64 + a.decode_tokens as f64 / 2.0,
            kv_elem,
        );
        let frac = bytes * tps / bw;
        println!(
            "{:<8} {:>8} {:>12.2} {:>10.3} {:>9.1}%",
            "decode",
            n,
            tps,
            t,
            100.0 * frac
        );
        rows.push(json!({"phase": "decode", "context": n, "tokens": a.decode_tokens, "tok_s": tps, "seconds": t,
            "bytes_per_token": bytes, "roofline_fraction": frac}));
    }
    if let Some(p) = probes.as_ref().filter(|_| !families.is_empty()) {
        rows.extend(in_place(&m, p.skip, &families, &decode, &a, max_len)?);
    }
    if let Some(p) = probes.as_ref().filter(|_| a.trace) {
        rows.extend(trace(&m, p, &decode, &a, max_len)?);
    }
    if let Some(p) = probes.as_ref().filter(|_| !arm_list.is_empty()) {
        rows.extend(arms(&m, p.arm, &arm_list, &decode, &a, max_len)?);
    }
    if let Some(sch) = &a.schema {
        rows.extend(crate::bench_schema::rows(
            &m,
            &dir,
            sch,
            &decode,
            a.decode_tokens,
            a.rounds,
        )?);
    }
    let profile = match &prof {
        Some(p) => Some(profile(&m, p, &a)?),
        None => None,
    };
    if let Some(p) = &a.json {
        let machine = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
            })
            .unwrap_or_default();
        let out = json!({
            "model": dir.display().to_string(),
            "backend": m.backend.name(),
            "threads": threads,
            "machine": machine,
            "memory_bandwidth_bytes_s": bw,
            "peak_flop_s": peak,
            "ceilings_method": ceil.method,
            "ceilings_source": {"memory_bandwidth": src(ceil.bandwidth_measured), "peak_flop": src(ceil.flops_measured)},
            "kv_bytes_per_elem": kv_elem,
            "act_bytes_per_elem": m.backend.act_elem_bytes(),
            "weight_bytes_per_token": weight_bytes,
            "rounds": a.rounds,
            "results": rows,
            "profile": profile,
        });
        std::fs::write(p, serde_json::to_string_pretty(&out)?)?;
    }
    Ok(())
}

/// `--arms`' list: arms separated by `;`, each `+`-joined `NAME=VALUE` (an empty arm is an
/// error: the defaults are always measured).
fn parse_arms(s: &str) -> Result<ArmList> {
    s.split(';')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(|arm| {
            let sets = arm
                .split('+')
                .map(|kv| match kv.trim().split_once('=') {
                    Some((k, v)) if !k.trim().is_empty() => {
                        Ok((k.trim().to_string(), v.trim().to_string()))
                    }
                    _ => bail!("--arms: `{kv}` in `{arm}` is not NAME=VALUE"),
                })
                .collect::<Result<Vec<_>>>()?;
            Ok((arm.to_string(), sets))
        })
        .collect::<Result<Vec<_>>>()
        .and_then(|v| {
            if v.is_empty() {
                bail!("--arms: no arm in `{s}`");
            }
            Ok(v)
        })
}

/// A decode context prefilled once and measured many times: each measurement restores the
/// prefill's snapshot (the GDN state; the KV cache cut back), feeds the prefill's greedy token
/// and decodes `WARM` tokens untimed (recording the step as the backend is set now).
struct Point<B: Backend> {
    st: SeqState<B>,
    snap: lily::model::state::GdnSnapshot<B>,
    first: u32,
}

const WARM: usize = 4;
/// What a `Point` times: decode on the model and the state.
type Timed<'a, B> = dyn FnMut(&Qwen35<B>, &mut SeqState<B>) -> Result<()> + 'a;

impl<B: Backend> Point<B> {
    fn new(m: &Qwen35<B>, n: usize, max_len: usize) -> Result<Self> {
        let mut st = m.new_state(max_len + WARM)?;
        let first = argmax(&m.forward(
            &mut st,
            &prompt_ids(n, m.cfg.vocab_size),
            Logits::Last,
            None,
        )?);
        let snap = st.snapshot(&m.backend, &m.dims)?;
        Ok(Self { st, snap, first })
    }

    /// Back to the prefill, warmed up, then `timed` on the state: its seconds.
    fn time(&mut self, m: &Qwen35<B>, timed: &mut Timed<B>) -> Result<f64> {
        self.st.restore(&m.backend, &m.dims, &self.snap)?;
        std::hint::black_box(m.decode(&mut self.st, Some(self.first), true)?);
        for _ in 1..WARM {
            std::hint::black_box(m.decode(&mut self.st, None, true)?);
        }
        let t0 = Instant::now();
        timed(m, &mut self.st)?;
        Ok(t0.elapsed().as_secs_f64())
    }
}

/// `--arms`: at each decode context, the contract's greedy decode loop (`decode_greedy`, with
/// the lookahead) of `--decode-tokens` tokens timed under each arm's switches and under the
/// defaults, `--rounds` times, the order reversed every other round; the median per arm and
/// its ratio to the defaults' median. One process and one prefill per context (a state per KV
/// element type, as an arm may change it) instead of a load and a prefill per arm: on the H200
/// the full preset loads in tens of seconds, a 4K context decodes 128 tokens in 0.4.
fn arms<B: Backend>(
    m: &Qwen35<B>,
    set: ArmHook<B>,
    list: &ArmList,
    decode: &[usize],
    a: &BenchArgs,
    max_len: usize,
) -> Result<Vec<serde_json::Value>> {
    let mut all: Vec<(&str, &Switches)> = vec![("defaults", &[])];
    all.extend(list.iter().map(|(n, s)| (n.as_str(), s.as_slice())));
    let mut rows = Vec::new();
    println!(
        "{:<8} {:>8} {:>10} {:>8}  {:<40} rounds",
        "arm", "context", "tok/s", "×", "switches"
    );
    for &n in decode {
        let mut points: Vec<(usize, Point<B>)> = Vec::new();
        let mut times = vec![Vec::new(); all.len()];
        for r in 0..a.rounds {
            let order: Vec<usize> = if r % 2 == 0 {
                (0..all.len()).collect()
            } else {
                (0..all.len()).rev().collect()
            };
            for i in order {
                set(&m.backend, all[i].1)?;
                let kv = m.backend.kv_elem_bytes();
                if !points.iter().any(|p| p.0 == kv) {
                    points.push((kv, Point::new(m, n, max_len)?));
                }
                let p = &mut points.iter_mut().find(|p| p.0 == kv).unwrap().1;
                let t = p.time(m, &mut |m, st| decode_greedy(m, st, a.decode_tokens, 1))?;
                times[i].push(a.decode_tokens as f64 / t);
            }
        }
        set(&m.backend, &[])?;
        let base = median(times[0].clone());
        for ((name, _), ts) in all.iter().zip(&times) {
            let tps = median(ts.clone());
            let each: Vec<String> = ts.iter().map(|t| format!("{t:.2}")).collect();
            println!(
                "{:<8} {:>8} {:>10.2} {:>8.3}  {:<40} {}",
                "arm",
                n,
                tps,
                tps / base,
                name,
                each.join(" ")
            );
            rows.push(
                json!({"phase": "arm", "context": n, "arm": name, "tokens": a.decode_tokens,
                "tok_s": tps, "vs_defaults": tps / base, "rounds_tok_s": ts}),
            );
        }
    }
    Ok(rows)
}

/// `--in-place`: at each decode context, the greedy decode loop timed with each family's kernels
/// left out of the recorded step and with the full step, alternated, `--rounds` times; the
/// step's time saved is the family's cost in place (its post-wait work on the critical path, the
/// overlap with its neighbours included). The context is prefilled once per length; each
/// measurement goes back to it (the GDN state restored from a snapshot, the KV cache cut back),
/// feeds the prefill's greedy token, and decodes 4 tokens untimed first (recording the step with
/// this skip set). (A prefill per measurement made 128K take 2 × families × rounds prefills of
/// 17 s each.)
fn in_place<B: Backend>(
    m: &Qwen35<B>,
    skip: SkipHook<B>,
    families: &[(String, String)],
    decode: &[usize],
    a: &BenchArgs,
    max_len: usize,
) -> Result<Vec<serde_json::Value>> {
    let mut rows = Vec::new();
    println!(
        "{:<8} {:>8} {:<16} {:>10} {:>12}  holds",
        "in-place", "context", "left out", "tok/s", "µs step|saved"
    );
    for &n in decode {
        let mut point = Point::new(m, n, max_len)?;
        let mut time = |prefixes: &[&str]| -> Result<f64> {
            skip(&m.backend, prefixes);
            let t = point.time(m, &mut |m, st| {
                for _ in 0..a.decode_tokens {
                    std::hint::black_box(m.decode(st, None, true)?);
                }
                Ok(())
            })?;
            Ok(t / a.decode_tokens as f64)
        };
        let (mut full, mut without) = (Vec::new(), vec![Vec::new(); families.len()]);
        for r in 0..a.rounds {
            for (i, (p, _)) in families.iter().enumerate() {
                // Alternated: the full step before each family on even rounds, after on odd.
                if r % 2 == 0 {
                    full.push(time(&[])?);
                }
                without[i].push(time(&[p.as_str()])?);
                if r % 2 == 1 {
                    full.push(time(&[])?);
                }
            }
        }
        skip(&m.backend, &[]);
        let step = median(full);
        println!(
            "{:<8} {:>8} {:<16} {:>10.1} {:>12.1}  the full step",
            "in-place",
            n,
            "none",
            1.0 / step,
            1e6 * step
        );
        rows.push(json!({"phase": "in_place", "context": n, "left_out": null, "tok_s": 1.0 / step, "step_us": 1e6 * step}));
        for ((p, what), w) in families.iter().zip(without) {
            let t = median(w);
            println!(
                "{:<8} {:>8} {:<16} {:>10.1} {:>12.1}  {what}",
                "in-place",
                n,
                p,
                1.0 / t,
                1e6 * (step - t)
            );
            rows.push(
                json!({"phase": "in_place", "context": n, "left_out": p, "holds": what,
                "tok_s": 1.0 / t, "step_us": 1e6 * t, "step_us_saved": 1e6 * (step - t)}),
            );
        }
    }
    Ok(rows)
}

/// `--trace`: at each decode context (one prefill), `--trace-steps` greedy decode steps timed
/// untraced, then as many traced (the trace's cost is the difference), and the traced steps'
/// kernels summed per name (backend/trace.rs).
fn trace<B: Backend>(
    m: &Qwen35<B>,
    p: &Probes<B>,
    decode: &[usize],
    a: &BenchArgs,
    max_len: usize,
) -> Result<Vec<serde_json::Value>> {
    const WARM: usize = 4;
    let steps = a.trace_steps.max(1);
    let mut rows = Vec::new();
    for &n in decode {
        let ids = prompt_ids(n, m.cfg.vocab_size);
        let mut st = m.new_state(max_len.max(n + WARM + 2 * steps + 1))?;
        let first = argmax(&m.forward(&mut st, &ids, Logits::Last, None)?);
        std::hint::black_box(m.decode(&mut st, Some(first), true)?);
        for _ in 1..WARM {
            std::hint::black_box(m.decode(&mut st, None, true)?);
        }
        let run = |st: &mut lily::model::SeqState<B>| -> Result<f64> {
            let t0 = Instant::now();
            for _ in 0..steps {
                std::hint::black_box(m.decode(st, None, true)?);
            }
            Ok(t0.elapsed().as_secs_f64() / steps as f64)
        };
        let plain = run(&mut st)?;
        (p.trace_begin)(&m.backend)?;
        let traced = run(&mut st);
        let (recs, launches) = (p.trace_end)(&m.backend)?;
        let traced = traced?;
        let spans = lily::backend::trace::attribute(&recs, &launches)?;
        let table = lily::backend::trace::summarize(&launches, &spans, &recs, steps);
        println!();
        println!(
            "trace at context {n}: a step {:.1} µs untraced, {:.1} µs traced (wall clock, {steps} steps each)",
            plain * 1e6,
            traced * 1e6
        );
        print!("{}", table.text());
        let mut j = table.json();
        j["phase"] = json!("trace");
        j["context"] = json!(n);
        j["step_us_untraced"] = json!(plain * 1e6);
        j["step_us_traced"] = json!(traced * 1e6);
        rows.push(j);
    }
    Ok(rows)
}

/// The process's peak resident memory so far in bytes (Linux: `VmHWM`), `None` elsewhere.
fn peak_host_memory() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let l = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = l.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// `--profile`: one prefill chunk and one decode step at `--profile-context`, per op family.
fn profile<B: Backend>(m: &Qwen35<B>, prof: &Profiler, a: &BenchArgs) -> Result<serde_json::Value> {
    let ctx = lengths(&a.profile_context, "profile-context")?
        .first()
        .copied()
        .unwrap_or(0);
    let (chunk, steps) = (m.chunk, a.profile_steps.max(1));
    let n = ctx + 2 * chunk + 2 * steps + 1;
    let ids = prompt_ids(n, m.cfg.vocab_size);
    let mut st = m.new_state(n)?;
    if ctx > 0 {
        m.forward(&mut st, &ids[..ctx], Logits::None, None)?;
    }
    let b = &m.backend;
    let timed = |st: &mut lily::model::SeqState<B>, from: usize| -> Result<f64> {
        b.sync()?;
        let t0 = Instant::now();
        m.forward(st, &ids[from..from + chunk], Logits::None, None)?;
        b.sync()?;
        Ok(t0.elapsed().as_secs_f64())
    };
    let plain_chunk = timed(&mut st, ctx)?;
    prof.start();
    b.device_times(true);
    let prof_chunk = timed(&mut st, ctx + chunk);
    let prefill_dev = b.device_times(false);
    let prefill = prof.stop();
    let prof_chunk = prof_chunk?;

    let mut next = argmax(&m.forward(&mut st, &ids[ctx + 2 * chunk..][..1], Logits::Last, None)?); // warm-up step
    let mut decode_steps = |st: &mut lily::model::SeqState<B>| -> Result<f64> {
        let t0 = Instant::now();
        for _ in 0..steps {
            next = argmax(&m.forward(st, &[next], Logits::Last, None)?);
        }
        Ok(t0.elapsed().as_secs_f64() / steps as f64)
    };
    let plain_step = decode_steps(&mut st)?;
    prof.start();
    b.device_times(true);
    let prof_step = decode_steps(&mut st);
    let decode_dev = b.device_times(false).map(|r| r.per(steps));
    let decode = prof.stop().per(steps);
    let prof_step = prof_step?;

    println!();
    println!(
        "profile: one prefill chunk of {chunk} tokens at context {}: {:.2} ms unprofiled, {:.2} ms profiled",
        ctx + chunk,
        plain_chunk * 1e3,
        prof_chunk * 1e3
    );
    print!("{}", prefill.table());
    if let Some(r) = &prefill_dev {
        println!("device time of the same chunk per op family · kernel (timestamp queries):");
        print!("{}", r.table());
    }
    println!();
    println!(
        "profile: one decode step at context {} (mean of {steps}): {:.3} ms unprofiled, {:.3} ms profiled",
        ctx + 2 * chunk + 1,
        plain_step * 1e3,
        prof_step * 1e3
    );
    print!("{}", decode.table());
    if let Some(r) = &decode_dev {
        println!("device time of the same step per op family · kernel (timestamp queries):");
        print!("{}", r.table());
    }
    let mut pj = prefill.to_json();
    pj["context"] = json!(ctx + chunk);
    pj["tokens"] = json!(chunk);
    pj["unprofiled_ms"] = json!(plain_chunk * 1e3);
    pj["profiled_ms"] = json!(prof_chunk * 1e3);
    if let Some(r) = &prefill_dev {
        pj["device"] = r.to_json();
    }
    let mut dj = decode.to_json();
    dj["context"] = json!(ctx + 2 * chunk + 1);
    dj["steps_averaged"] = json!(steps);
    dj["unprofiled_ms"] = json!(plain_step * 1e3);
    dj["profiled_ms"] = json!(prof_step * 1e3);
    if let Some(r) = &decode_dev {
        dj["device"] = r.to_json();
    }
    Ok(json!({"prefill_chunk": pj, "decode_step": dj}))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: BenchArgs,
    }

    /// `--arms`' syntax: `;` between arms, `+` between a arm's switches, values kept whole (they
    /// may hold commas: LILY_WGPU_SPEC's lists); an empty list or a switch without `=` is an
    /// error.
    #[test]
    fn arms_parse() {
        let a = parse_arms("A=1; B=q6,moe+C=x ;").unwrap();
        assert_eq!(a.len(), 2);
        assert_eq!(a[0], ("A=1".to_string(), vec![("A".into(), "1".into())]));
        assert_eq!(
            a[1].1,
            vec![("B".into(), "q6,moe".into()), ("C".into(), "x".into())]
        );
        assert!(parse_arms(" ; ").is_err());
        assert!(parse_arms("A=1;B").is_err());
        assert!(parse_arms("=1").is_err());
    }

    /// `--in-place` runs its measurements from one prefill per context (a snapshot restored each
    /// time): on the CPU, with a hook that skips nothing, every measurement must come back from the
    /// same position, so the state never runs past its capacity however many are taken, and each
    /// family gets its row.
    #[test]
    fn in_place_measures_from_one_prefill() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = lily::synth::preset("tiny").unwrap();
        lily::synth::write_checkpoint(&cfg, dir.path(), 0, &|_, _| {}).unwrap();
        let m = lily::runtime::load(lily::backend::cpu::Cpu, dir.path()).unwrap();
        let a = Cli::try_parse_from(["t", "--decode-tokens", "3", "--rounds", "2"])
            .unwrap()
            .a;
        let families = vec![
            ("a_".to_string(), "family a".to_string()),
            ("b_".to_string(), "family b".to_string()),
        ];
        static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let hook: SkipHook<lily::backend::cpu::Cpu> = |_, _| {
            CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        };
        // Capacity for one measurement only (context + warm-up + timed tokens): 2 rounds × (2
        // families + 2 full steps) = 8 measurements would overrun it without the restore.
        let rows = in_place(&m, hook, &families, &[16], &a, 16 + 3).unwrap();
        assert_eq!(rows.len(), 1 + families.len());
        assert_eq!(CALLS.load(std::sync::atomic::Ordering::Relaxed), 8 + 1);
        for r in &rows {
            assert!(r["tok_s"].as_f64().unwrap() > 0.0, "{r}");
        }
    }
}
