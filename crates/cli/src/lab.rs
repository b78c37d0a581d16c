//! `lily lab`: the kernel lab (CUDA only). Each weight-reading op of a decode step at the shapes of
//! a synth preset (default the full `qwen3.6-35b-a3b`), replayed alone and L2-cold in a CUDA graph,
//! beside a pure streaming read of the same bytes in the same run, with the backend's decode
//! optimisations on and off (engine: backend/cuda/lab.rs says how). Prints a table; `--json FILE`
//! writes the rows.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

#[derive(Args)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct LabArgs {
    /// Cases to run, comma-separated: in_proj, qkv, out_proj, o_proj, router, route, experts,
    /// lm_head (default: all).
    #[arg(long)]
    cases: Option<String>,
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
}

#[cfg(not(feature = "cuda"))]
pub fn run(_a: LabArgs) -> Result<()> {
    anyhow::bail!("lily lab measures CUDA kernels: this build has no CUDA backend (build with `--features cuda`)")
}

#[cfg(feature = "cuda")]
pub fn run(a: LabArgs) -> Result<()> {
    use anyhow::Context;
    use lily::backend::cuda::lab::LabRow;
    use lily::backend::Backend;

    let cfg = lily::synth::preset(&a.preset)?;
    let cases: Vec<&str> = a
        .cases
        .as_deref()
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
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
        std::fs::write(p, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("{}: cannot write", p.display()))?;
        eprintln!("lily: wrote {}", p.display());
    }
    Ok(())
}
