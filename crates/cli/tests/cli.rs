//! The command-line contract (other tools script against it): flags, output formats, and clear
//! one-line errors with exit status 1 for bad input.

use std::path::Path;
use std::process::{Command, Output};

fn lily(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(args)
        .output()
        .expect("run lily")
}

fn ok(args: &[&str]) -> String {
    let o = lily(args);
    assert!(
        o.status.success(),
        "lily {args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

/// Runs a command that must fail; returns its stderr (one `lily: error:` line).
fn fails(args: &[&str]) -> String {
    let o = lily(args);
    assert_eq!(
        o.status.code(),
        Some(1),
        "lily {args:?} should fail with status 1"
    );
    let e = String::from_utf8(o.stderr).unwrap();
    let last = e.lines().last().unwrap_or("").to_string();
    assert!(last.starts_with("lily: error: "), "{e}");
    last
}

fn synth_tiny(dir: &Path) {
    ok(&[
        "synth",
        "--preset",
        "tiny",
        "--out",
        dir.to_str().unwrap(),
        "--seed",
        "5",
        "--threads",
        "2",
    ]);
}

#[test]
fn help_lists_every_subcommand_and_flag() {
    let h = ok(&["--help"]);
    for s in ["synth", "generate", "eval", "bench"] {
        assert!(h.contains(s), "{h}");
    }
    let g = ok(&["generate", "--help"]);
    for f in [
        "--model",
        "--prompt-ids",
        "--prompt",
        "--max-tokens",
        "--temperature",
        "--ids",
        "--backend",
        "--threads",
    ] {
        assert!(g.contains(f), "generate --help lacks {f}");
    }
    assert!(ok(&["synth", "--help"]).contains("--set"));
    assert!(ok(&["eval", "--help"]).contains("--reference"));
    assert!(ok(&["bench", "--help"]).contains("--json"));
}

#[test]
fn generate_prints_ids_on_one_line_and_is_deterministic() {
    let d = tempfile::tempdir().unwrap();
    let m = d.path().join("m");
    synth_tiny(&m);
    let args = [
        "generate",
        "--model",
        m.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3",
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        "--ids",
        "--ignore-eos",
        "--backend",
        "cpu",
    ];
    let out = ok(&args);
    assert_eq!(out.lines().count(), 1, "{out}");
    let ids: Vec<u32> = out.trim().split(',').map(|x| x.parse().unwrap()).collect();
    assert_eq!(ids.len(), 6);
    assert_eq!(ok(&args), out, "greedy generation must be deterministic");
    // Text prompts go through the checkpoint's tokenizer.
    let text = ok(&[
        "generate",
        "--model",
        m.to_str().unwrap(),
        "--prompt",
        "hello world",
        "--max-tokens",
        "3",
        "--ids",
        "--ignore-eos",
    ]);
    assert_eq!(text.trim().split(',').count(), 3);
}

#[test]
fn eval_writes_npy_and_compares_with_a_reference() {
    let d = tempfile::tempdir().unwrap();
    let m = d.path().join("m");
    synth_tiny(&m);
    let npy = d.path().join("l.npy");
    let ms = m.to_str().unwrap();
    ok(&[
        "eval",
        "--model",
        ms,
        "--prompt-ids",
        "5,6,7,8",
        "--logits-out",
        npy.to_str().unwrap(),
    ]);
    let a = lily::npy::read(&npy).unwrap();
    assert_eq!(a.shape[0], 4);
    let rep = ok(&[
        "eval",
        "--model",
        ms,
        "--prompt-ids",
        "5,6,7,8",
        "--reference",
        npy.to_str().unwrap(),
        "--chunk",
        "3",
    ]);
    let v: serde_json::Value = serde_json::from_str(rep.trim()).unwrap();
    assert!(v["max_abs_err"].as_f64().unwrap() < 1e-4, "{v}");
    assert_eq!(v["top1_agreement"].as_f64().unwrap(), 1.0);
    assert!(
        (v["perplexity"].as_f64().unwrap() / v["reference_perplexity"].as_f64().unwrap() - 1.0)
            .abs()
            < 1e-4
    );
    // A reference of the wrong shape is an error.
    let e = fails(&[
        "eval",
        "--model",
        ms,
        "--prompt-ids",
        "5,6,7",
        "--reference",
        npy.to_str().unwrap(),
    ]);
    assert!(e.contains("shape"), "{e}");
}

#[test]
fn bench_writes_json() {
    let d = tempfile::tempdir().unwrap();
    let m = d.path().join("m");
    synth_tiny(&m);
    let j = d.path().join("b.json");
    let out = ok(&[
        "bench",
        "--model",
        m.to_str().unwrap(),
        "--prefill",
        "16,32",
        "--decode",
        "16",
        "--decode-tokens",
        "4",
        "--rounds",
        "1",
        "--json",
        j.to_str().unwrap(),
    ]);
    assert!(out.contains("prefill") && out.contains("decode"), "{out}");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&j).unwrap()).unwrap();
    let rows = v["results"].as_array().unwrap();
    assert_eq!(rows.len(), 3);
    assert!(rows
        .iter()
        .all(|r| r["tok_s"].as_f64().unwrap() > 0.0
            && r["roofline_fraction"].as_f64().unwrap() > 0.0));
}

#[test]
fn bench_in_place_and_trace_need_a_gpu_backend() {
    // The in-place probe leaves kernels out of recorded GPU steps (CUDA, wgpu), the trace stamps
    // them: on the CPU both are a clear error before any model is loaded, and the probe does not
    // combine with --profile.
    let e = fails(&["bench", "--backend", "cpu", "--in-place", "default"]);
    assert!(e.contains("GPU backend"), "{e}");
    let e = fails(&["bench", "--backend", "cpu", "--trace"]);
    assert!(e.contains("GPU backend"), "{e}");
    let e = fails(&[
        "bench",
        "--backend",
        "cpu",
        "--in-place",
        "attn_",
        "--profile",
    ]);
    assert!(e.contains("--profile"), "{e}");
}

#[test]
fn bad_input_gets_a_one_line_error() {
    let d = tempfile::tempdir().unwrap();
    let m = d.path().join("m");
    synth_tiny(&m);
    let ms = m.to_str().unwrap();
    assert!(fails(&["generate", "--model", "/nonexistent/x", "--prompt-ids", "1"]).contains("not"));
    assert!(fails(&["generate", "--model", ms, "--prompt-ids", "1,x"]).contains("`x`"));
    assert!(
        fails(&["generate", "--model", ms, "--prompt-ids", "999999999"]).contains("out of range")
    );
    assert!(fails(&[
        "generate",
        "--model",
        ms,
        "--prompt-ids",
        "1,2,3",
        "--max-context",
        "2"
    ])
    .contains("context"));
    assert!(fails(&[
        "generate",
        "--model",
        ms,
        "--prompt-ids",
        "1",
        "--backend",
        "cuda"
    ])
    .contains("cuda"));
    assert!(fails(&[
        "synth",
        "--preset",
        "huge",
        "--out",
        d.path().join("x").to_str().unwrap()
    ])
    .contains("huge"));
    assert!(fails(&[
        "synth",
        "--preset",
        "tiny",
        "--out",
        d.path().join("y").to_str().unwrap(),
        "--set",
        "nope=1"
    ])
    .contains("nope"));
    assert!(fails(&[
        "generate",
        "--model",
        ms,
        "--prompt-ids",
        "1",
        "--threads",
        "0"
    ])
    .contains("threads"));
}

#[test]
fn demo_streams_one_completion_over_http() {
    let d = tempfile::tempdir().unwrap();
    synth_tiny(d.path());
    let o = lily(&[
        "demo",
        "--model",
        d.path().to_str().unwrap(),
        "--max-tokens",
        "6",
        "--backend",
        "cpu",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("random weights produce noise"), "{err}");
    assert!(
        err.contains("6 generated (finish: length)") && err.contains("time to first token"),
        "{err}"
    );
    assert!(String::from_utf8_lossy(&o.stdout).contains("assistant:"));
}

#[test]
fn serve_refuses_bad_setups_with_one_line() {
    let d = tempfile::tempdir().unwrap();
    assert!(fails(&["serve", "--model", d.path().to_str().unwrap()]).contains("tokenizer.json"));
    synth_tiny(d.path());
    assert!(fails(&[
        "serve",
        "--model",
        d.path().to_str().unwrap(),
        "--max-context",
        "99999999"
    ])
    .contains("max_position_embeddings"));
    assert!(fails(&[
        "serve",
        "--model",
        d.path().to_str().unwrap(),
        "--queue",
        "0",
        "--port",
        "0"
    ])
    .contains("--queue"));
    let h = ok(&["serve", "--help"]);
    for f in [
        "--host",
        "--port",
        "--max-context",
        "--api-key",
        "--cache-mem",
        "--queue",
        "--backend",
    ] {
        assert!(h.contains(f), "serve --help lacks {f}");
    }
}
