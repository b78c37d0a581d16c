//! Shared test helpers: synthetic checkpoints and the MLX-LM oracle.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use lily::backend::cpu::Cpu;
use lily::model::Qwen35;

/// The first GPU, or `None` (the test then skips with a message) when there is none; with
/// LILY_REQUIRE_CUDA set, no GPU is a failure.
#[cfg(feature = "cuda")]
pub fn gpu() -> Option<lily::backend::cuda::Cuda> {
    match lily::backend::cuda::Cuda::new() {
        Ok(c) => Some(c),
        Err(e) => {
            assert!(
                std::env::var("LILY_REQUIRE_CUDA").is_err(),
                "no usable GPU: {e:#}"
            );
            eprintln!("SKIPPED: no usable GPU: {e:#}");
            None
        }
    }
}

/// The benchmark contract's synthetic prompt: `(i·2654435761 mod 2^32) mod vocab`.
pub fn prompt_ids(n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i as u64 * 2654435761) % (1u64 << 32) % vocab as u64) as u32)
        .collect()
}

/// Writes a preset checkpoint (with `--set` overrides) into a fresh temporary directory.
pub fn synth(preset: &str, seed: u64, sets: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = lily::synth::preset(preset).expect("preset");
    for s in sets {
        lily::synth::apply_set(&mut cfg, s).expect("set");
    }
    lily::synth::write_checkpoint(&cfg, dir.path(), seed, &|_, _| {}).expect("synth");
    dir
}

pub fn load(dir: &Path) -> Qwen35<Cpu> {
    lily::runtime::load(Cpu, dir).expect("load")
}

/// The oracle's outputs for one prompt (see tools/oracle/oracle.py).
pub struct Oracle {
    pub out: PathBuf,
    _keep: tempfile::TempDir,
}

impl Oracle {
    pub fn array(&self, name: &str) -> lily::npy::Array {
        lily::npy::read(&self.out.join(name))
            .unwrap_or_else(|e| panic!("oracle output {name}: {e:#}"))
    }
    pub fn summary(&self) -> serde_json::Value {
        serde_json::from_str(
            &std::fs::read_to_string(self.out.join("summary.json")).expect("summary.json"),
        )
        .expect("json")
    }
}

/// Runs MLX-LM on `dir` for `ids` (+ `gen` greedy tokens). `None` when the oracle is not set up
/// (`scripts/test` sets it up; with LILY_REQUIRE_ORACLE=1 a missing oracle is a failure).
pub fn oracle(dir: &Path, ids: &[u32], gen: usize) -> Option<Oracle> {
    let (py, script) = match (
        std::env::var("LILY_ORACLE_PY"),
        std::env::var("LILY_ORACLE_SCRIPT"),
    ) {
        (Ok(p), Ok(s)) => (p, s),
        _ => {
            assert!(
                std::env::var("LILY_REQUIRE_ORACLE").is_err(),
                "LILY_ORACLE_PY / LILY_ORACLE_SCRIPT not set"
            );
            eprintln!("SKIPPED: MLX-LM oracle not set up (run scripts/test)");
            return None;
        }
    };
    let keep = tempfile::tempdir().expect("tempdir");
    let out = keep.path().join("oracle");
    let ids_s: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    let st = Command::new(py)
        .arg(script)
        .arg("--model")
        .arg(dir)
        .arg("--ids")
        .arg(ids_s.join(","))
        .arg("--gen")
        .arg(gen.to_string())
        .arg("--out")
        .arg(&out)
        .status()
        .expect("run oracle");
    assert!(st.success(), "oracle failed");
    Some(Oracle { out, _keep: keep })
}

/// Teacher-forced perplexity of `ids` under logits `[T, vocab]` (row t predicts ids[t + 1]).
pub fn perplexity(logits: &[f64], vocab: usize, ids: &[u32]) -> f64 {
    let n = ids.len() - 1;
    let nll: f64 = (0..n)
        .map(|t| {
            let row = &logits[t * vocab..(t + 1) * vocab];
            let m = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
            let lse = m + row.iter().map(|&x| (x - m).exp()).sum::<f64>().ln();
            lse - row[ids[t + 1] as usize]
        })
        .sum();
    (nll / n as f64).exp()
}

pub fn argmax64(row: &[f64]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// Gap between the largest and second-largest value of a row.
pub fn top2_gap(row: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in row {
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
    }
    a - b
}
