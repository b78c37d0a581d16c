//! `lily lab`: the kernel lab. Each weight-reading op of a decode step at the shapes of a synth
//! preset (default the full `qwen3.6-35b-a3b`), run alone over copies of its weights that the cache
//! cannot hold, beside a pure streaming read of the same bytes in the same run. CUDA (default):
//! replayed in a CUDA graph with the backend's decode optimisations on and off (engine:
//! backend/cuda/lab.rs). `--backend wgpu`: in one compute pass timed by timestamps, for each
//! GEMV variant of `--variants`, plus the dispatch floor and pure reads by size (engine:
//! backend/wgpu/lab.rs). Prints a table; `--json FILE` writes the rows. `--backend wgpu
//! --pipeline-stats FILE` runs no case: it asks the Vulkan driver what it compiled each WGSL entry
//! point to (registers, spills, its IR and machine code; engine: backend/wgpu/stats.rs).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

#[derive(Args)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct LabArgs {
    /// Which backend's kernels: cuda or wgpu.
    #[arg(long, default_value = "cuda")]
    backend: String,
    /// Cases to run, comma-separated (default: all). CUDA: in_proj, qkv, out_proj, o_proj,
    /// router, route, experts, lm_head. wgpu: floor, read, in_proj, attn_qkv, out_proj, router,
    /// shared_gu, shared_down, lm_head, route, experts, gemm (prefill's GEMMs at 2048 rows under
    /// each LILY_WGPU_GEMM kernel: old, big, chain, and coop and coop1 where the adapter has
    /// 16x16x16 f16 cooperative matrices), moe_mm (prefill's routed experts at 2048
    /// and 300 rows under each LILY_WGPU_MOE_MM: old, mm8), gdn_step, attn; alloc only when
    /// named (a 16 MB read before and after LILY_LAB_BALLAST_GB, default 16, more GB are
    /// allocated: 2x that on the GPU, 20 s idle).
    #[arg(long)]
    cases: Option<String>,
    /// wgpu: the GEMV variants, comma-separated: v4, v5, v6 (gemv_q6, the default decode
    /// GEMV), v6s (gemv_q6 specialised to the launch), rw1, rw2, rw4, xs, each optionally @N
    /// workgroups aimed at a matrix (default 1024; 256 for v6 and v6s); v4~B skips parts of
    /// gemv_v4 to time the rest (bits: 1 x staging, 2 the final tree, 4 the norm's pre-pass, 8
    /// the dot products).
    #[arg(long, default_value = "v4,rw1,rw2,rw4,rw2@256,rw2@4096")]
    variants: String,
    /// wgpu: MB of weights a cycle through a case's copies reads (more than the GPU's cache).
    #[arg(long, default_value_t = 200)]
    cycle_mb: usize,
    /// Calls per recorded graph (rounded up to whole cycles through a case's weight copies; the
    /// lm_head runs an eighth of them).
    #[arg(long, default_value_t = 64)]
    calls: usize,
    /// Synth preset whose shapes are measured.
    #[arg(long, default_value = "qwen3.6-35b-a3b")]
    preset: String,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// wgpu on Vulkan: run no case; instead compile every compute entry point as wgpu would and
    /// print the driver's statistics for each (VK_KHR_pipeline_executable_properties: registers,
    /// spills, …), writing them with the driver's internal representations (IR, machine code) to
    /// this file (binary ones beside it, as FILE.<module>.<entry>.<n>.<name>).
    #[arg(long, value_name = "FILE")]
    pipeline_stats: Option<PathBuf>,
    /// With --pipeline-stats: only the entry points whose `module entry` contains this.
    #[arg(long, value_name = "SUBSTR", requires = "pipeline_stats")]
    pipeline_stats_filter: Option<String>,
}

/// `--cases` as a list (empty: all).
#[cfg_attr(not(any(feature = "cuda", feature = "wgpu")), allow(dead_code))]
fn case_list(a: &LabArgs) -> Vec<&str> {
    a.cases
        .as_deref()
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect()
}

/// `--json`: the document, pretty, to `p`.
#[cfg_attr(not(any(feature = "cuda", feature = "wgpu")), allow(dead_code))]
fn write_json(p: &std::path::Path, doc: &serde_json::Value) -> Result<()> {
    use anyhow::Context;
    std::fs::write(p, serde_json::to_string_pretty(doc)? + "\n")
        .with_context(|| format!("{}: cannot write", p.display()))?;
    eprintln!("lily: wrote {}", p.display());
    Ok(())
}

pub fn run(a: LabArgs) -> Result<()> {
    if let Some(file) = &a.pipeline_stats {
        if a.backend != "wgpu" {
            anyhow::bail!("--pipeline-stats: with --backend wgpu (the Vulkan driver's view of the WGSL kernels)");
        }
        return pipeline_stats(file, a.pipeline_stats_filter.as_deref());
    }
    match a.backend.as_str() {
        "cuda" => run_cuda(a),
        "wgpu" => run_wgpu(a),
        b => anyhow::bail!("--backend {b}: cuda or wgpu"),
    }
}

#[cfg(not(feature = "wgpu"))]
fn run_wgpu(_a: LabArgs) -> Result<()> {
    anyhow::bail!(
        "lily lab --backend wgpu: this build has no wgpu backend (build with `--features wgpu`)"
    )
}

#[cfg(not(all(feature = "wgpu", not(target_os = "macos"))))]
fn pipeline_stats(_file: &std::path::Path, _filter: Option<&str>) -> Result<()> {
    anyhow::bail!("--pipeline-stats: needs the wgpu backend on Vulkan (not a Mac; build with `--features wgpu`)")
}

/// `--pipeline-stats FILE`: one line per entry point on stdout, the full dump in `file`.
#[cfg(all(feature = "wgpu", not(target_os = "macos")))]
fn pipeline_stats(file: &std::path::Path, filter: Option<&str>) -> Result<()> {
    use anyhow::Context;
    let rep = lily::backend::wgpu::stats::pipeline_stats(filter, false)?;
    println!("lily lab --pipeline-stats: {}", rep.header());
    for e in &rep.entries {
        println!("{}", e.summary());
    }
    std::fs::write(file, rep.dump())
        .with_context(|| format!("{}: cannot write", file.display()))?;
    let mut n = 0;
    for (key, bytes) in rep.binaries() {
        let mut p = file.as_os_str().to_owned();
        p.push(format!(".{key}"));
        std::fs::write(&p, bytes)
            .with_context(|| format!("{}: cannot write", std::path::Path::new(&p).display()))?;
        n += 1;
    }
    let failed = rep.entries.iter().filter(|e| e.result.is_err()).count();
    eprintln!(
        "lily: {} entry points ({failed} failed); wrote {}{}",
        rep.entries.len(),
        file.display(),
        if n > 0 {
            format!(" and {n} binary representations beside it")
        } else {
            String::new()
        }
    );
    if rep.entries.is_empty() {
        anyhow::bail!(
            "--pipeline-stats-filter {:?}: no compute entry point matches",
            filter.unwrap_or("")
        );
    }
    Ok(())
}

#[cfg(feature = "wgpu")]
fn run_wgpu(a: LabArgs) -> Result<()> {
    use lily::backend::wgpu::lab::{self, LabRow};
    use lily::backend::Backend;

    let cfg = lily::synth::preset(&a.preset)?;
    let cases = case_list(&a);
    if let Some(c) = cases.iter().find(|c| !lab::CASES.contains(c)) {
        anyhow::bail!(
            "--cases: unknown case `{c}` (known: {})",
            lab::CASES.join(", ")
        );
    }
    let variants = lab::parse_variants(&a.variants)?;
    let calls = a.calls.min(lab::MAX_CALLS);
    let w = lily::backend::wgpu::Wgpu::new(true)?;
    let r = w.report();
    println!(
        "lily lab: {} (preset {}), subgroups {}-{} ({}), {} calls a timed pass, median of {}",
        w.name(),
        a.preset,
        r.subgroup_min,
        r.subgroup_max,
        if r.subgroups {
            "used"
        } else {
            "not used: gemv_rw runs as gemv_v4"
        },
        calls,
        lab::REPS
    );
    println!(
        "lily lab: cooperative matrices [{}]: gemm_coop {}",
        r.coop,
        if r.coop16 {
            "runs"
        } else {
            "cannot run (no 16x16x16 f16>f32, f16, subgroups ≤ 32 or 32 KiB): its rows are skipped"
        }
    );
    let opt = |v: Option<f64>, f: &dyn Fn(f64) -> String| v.map_or_else(|| "-".to_string(), f);
    println!(
        "{:<12} {:<16} {:>9} {:>9} {:>7} {:>9} {:>9} {:>6} {:>9} {:>6}",
        "case",
        "variant",
        "MB/call",
        "µs/call",
        "TB/s",
        "read µs",
        "read TB/s",
        "ratio",
        "check",
        "copies"
    );
    let mut print = |r: &LabRow| {
        println!(
            "{:<12} {:<16} {:>9.2} {:>9.2} {:>7} {:>9} {:>9} {:>6} {:>9} {:>6}",
            r.case,
            r.variant,
            r.bytes as f64 / 1e6,
            r.op_s * 1e6,
            opt(r.op_bw(), &|b| format!("{:.2}", b / 1e12)),
            opt(r.read_s, &|t| format!("{:.2}", t * 1e6)),
            opt(r.read_bw(), &|b| format!("{:.2}", b / 1e12)),
            opt(r.read_s, &|t| format!("{:.2}", r.op_s / t)),
            opt(r.check, &|c| format!("{c:.1e}")),
            r.copies,
        );
    };
    let rows = w.run_lab(
        &cfg,
        &cases,
        calls,
        a.cycle_mb * 1_000_000,
        &variants,
        &mut print,
    )?;
    if let Some(p) = &a.json {
        let rows: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "case": r.case,
                    "variant": r.variant,
                    "bytes_per_call": r.bytes,
                    "copies": r.copies,
                    "calls": r.calls,
                    "us_per_call": r.op_s * 1e6,
                    "tb_per_s": r.op_bw().map(|b| b / 1e12),
                    "read_us_per_call": r.read_s.map(|t| t * 1e6),
                    "read_tb_per_s": r.read_bw().map(|b| b / 1e12),
                    "check": r.check,
                })
            })
            .collect();
        let doc = serde_json::json!({
            "device": w.name(),
            "backend": "wgpu",
            "preset": a.preset,
            "rows": rows,
        });
        write_json(p, &doc)?;
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(_a: LabArgs) -> Result<()> {
    anyhow::bail!("lily lab measures CUDA kernels: this build has no CUDA backend (build with `--features cuda`)")
}

#[cfg(feature = "cuda")]
fn run_cuda(a: LabArgs) -> Result<()> {
    use lily::backend::cuda::lab::LabRow;
    use lily::backend::Backend;

    let cfg = lily::synth::preset(&a.preset)?;
    let cases = case_list(&a);
    let known = lily::backend::cuda::lab::CASES;
    if let Some(c) = cases.iter().find(|c| !known.iter().any(|k| k.short == **c)) {
        anyhow::bail!(
            "--cases: unknown case `{c}` (known: {})",
            known.iter().map(|k| k.short).collect::<Vec<_>>().join(", ")
        );
    }
    if a.calls == 0 || a.calls > lily::backend::cuda::lab::MAX_CALLS {
        anyhow::bail!(
            "--calls {}: 1 to {} calls per graph",
            a.calls,
            lily::backend::cuda::lab::MAX_CALLS
        );
    }
    // Checked before the device is opened (creating the backend compiles the kernels).
    let cuda = lily::backend::cuda::Cuda::new()?;
    println!(
        "lily lab: {} (preset {}), switches off in `off` rows: {}",
        cuda.name(),
        a.preset,
        lily::backend::cuda::SWITCHES.join(", ")
    );
    // LILY_CUDA_ENABLE holds in both rows (an opt-in variant of a switched-off path is not reached).
    let on = cuda.enabled();
    if !on.is_empty() {
        println!(
            "lily lab: opt-in variants on (LILY_CUDA_ENABLE): {}",
            on.join(", ")
        );
    }
    let opt = |v: Option<f64>, f: &dyn Fn(f64) -> String| v.map_or_else(|| "-".to_string(), f);
    println!(
        "{:<30} {:>4} {:>9} {:>9} {:>7} {:>9} {:>9} {:>6} {:>8} {:>6}",
        "op",
        "opts",
        "MB/call",
        "µs/call",
        "TB/s",
        "read µs",
        "read TB/s",
        "ratio",
        "kernels",
        "calls"
    );
    let mut print = |r: &LabRow| {
        println!(
            "{:<30} {:>4} {:>9} {:>9.2} {:>7} {:>9} {:>9} {:>6} {:>8.2} {:>6}",
            r.name,
            r.opts,
            if r.bytes > 0 {
                format!("{:.2}", r.bytes as f64 / 1e6)
            } else {
                "0".into()
            },
            r.op_s * 1e6,
            opt(r.op_bw(), &|b| format!("{:.2}", b / 1e12)),
            opt(r.read_s, &|t| format!("{:.2}", t * 1e6)),
            opt(r.read_bw(), &|b| format!("{:.2}", b / 1e12)),
            opt(r.ratio(), &|x| format!("{x:.2}")),
            r.kernels_per_call,
            r.calls,
        );
    };
    let rep = cuda.run_lab(&cfg, &cases, a.calls, &mut print)?;
    println!(
        "L2 {:.1} MB; each copy is read again after at least {:.0} MB; µs per call: median of {} graph launches; ratio = op time / pure-read time",
        rep.l2_bytes as f64 / 1e6,
        rep.cycle_bytes as f64 / 1e6,
        lily::backend::cuda::lab::REPS
    );
    if let Some(p) = &a.json {
        let rows: Vec<serde_json::Value> = rep
            .rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "case": r.short,
                    "op": r.name,
                    "opts": r.opts,
                    "bytes_per_call": r.bytes,
                    "copies": r.copies,
                    "calls": r.calls,
                    "us_per_call": r.op_s * 1e6,
                    "tb_per_s": r.op_bw().map(|b| b / 1e12),
                    "read_us_per_call": r.read_s.map(|t| t * 1e6),
                    "read_tb_per_s": r.read_bw().map(|b| b / 1e12),
                    "ratio": r.ratio(),
                    "kernels_per_call": r.kernels_per_call,
                    "other_nodes_per_call": r.other_nodes_per_call,
                })
            })
            .collect();
        let doc = serde_json::json!({
            "device": rep.device,
            "preset": a.preset,
            "l2_bytes": rep.l2_bytes,
            "cycle_bytes": rep.cycle_bytes,
            "switches_off_in_off_rows": lily::backend::cuda::SWITCHES,
            "rows": rows,
        });
        write_json(p, &doc)?;
    }
    Ok(())
}
