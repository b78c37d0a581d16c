//! The CPU model against MLX-LM (float32 on the CPU) on a synthetic `small` checkpoint: logits per
//! position, the residual stream after every layer, and a greedy continuation. MLX-LM's own
//! bfloat16 run is compared with its float32 run too: the measure of how much precision loss is
//! normal, and the check that the synthetic model is well conditioned.

mod common;

use common::{argmax64, load, oracle, perplexity, prompt_ids, synth, top2_gap};
use lily::model::Logits;

const T: usize = 192;
const GEN: usize = 32;

// Both sides compute in f32 but sum in different orders (and MLX fuses differently): per-op
// relative differences are ~1e-6 and grow slowly through 8 layers. 2e-4 of the logit scale is a
// margin of ~10× over what we observe, and 100× below the smallest top-2 gap that would matter.
const LOGIT_TOL: f64 = 2e-4;
// The residual stream is O(1); same reasoning, absolute.
const HIDDEN_TOL: f64 = 1e-4;
// A greedy step whose top-2 gap is below this is a near-tie: rounding may legitimately pick either.
const TIE_GAP: f32 = 1e-3;

#[test]
fn cpu_matches_mlx_lm_f32_on_small() {
    let dir = synth("small", 0, &[]);
    let m = load(dir.path());
    let v = m.cfg.vocab_size;
    let ids = prompt_ids(T, v);
    let Some(o) = oracle(dir.path(), &ids, GEN) else {
        return;
    };

    // Teacher-forced logits and per-layer hidden states.
    let mut st = m.new_state(T + GEN + 1).unwrap();
    let mut taps = Vec::new();
    let ours = m
        .forward(&mut st, &ids, Logits::All, Some(&mut taps))
        .unwrap();
    let r = o.array("logits_f32.npy");
    assert_eq!(r.shape, vec![T, v]);
    let absmax = r.data.iter().fold(0f64, |m, x| m.max(x.abs()));
    let (mut max_abs, mut agree) = (0f64, 0usize);
    for t in 0..T {
        let (a, b) = (&ours[t * v..(t + 1) * v], &r.data[t * v..(t + 1) * v]);
        for (x, y) in a.iter().zip(b) {
            max_abs = max_abs.max((*x as f64 - y).abs());
        }
        let a64: Vec<f64> = a.iter().map(|&x| x as f64).collect();
        agree += (argmax64(&a64) == argmax64(b)) as usize;
    }
    let hidden = o.array("hidden_f32.npy");
    let n_layers = m.cfg.num_hidden_layers;
    assert_eq!(taps.len(), n_layers);
    let per = T * m.cfg.hidden_size;
    let mut layer_err = Vec::new();
    for (i, tap) in taps.iter().enumerate() {
        let e = tap
            .iter()
            .zip(&hidden.data[i * per..(i + 1) * per])
            .fold(0f64, |e, (a, b)| e.max((*a as f64 - b).abs()));
        layer_err.push(e);
    }

    // MLX-LM bf16 vs f32: what precision loss is normal, and the conditioning of the preset.
    let rb = o.array("logits_bf16.npy");
    let bf16_agree = (0..T)
        .filter(|&t| {
            argmax64(&rb.data[t * v..(t + 1) * v]) == argmax64(&r.data[t * v..(t + 1) * v])
        })
        .count();
    // The CUDA end-to-end test (tests/cuda_ops.rs, on a machine without MLX) must be at least as
    // close to the f32 logits as MLX-LM's bf16 run is: its bar is this fixture, checked here
    // against a fresh oracle run (LILY_WRITE_FIXTURES=1 rewrites it).
    let (ppl32, ppl16) = (perplexity(&r.data, v, &ids), perplexity(&rb.data, v, &ids));
    let mlx = serde_json::json!({
        "what": "MLX-LM bf16 vs f32 on the synthetic `small` preset, seed 0, prompt_ids(192): teacher-forced logits",
        "positions": T,
        "top1_agreement": bf16_agree as f64 / T as f64,
        "perplexity_f32": ppl32,
        "perplexity_bf16": ppl16,
        "perplexity_rel_diff": (ppl16 / ppl32 - 1.0).abs(),
    });
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/mlx_small_bf16_vs_f32.json");
    if std::env::var("LILY_WRITE_FIXTURES").is_ok_and(|v| v == "1") {
        std::fs::write(&fixture, serde_json::to_string_pretty(&mlx).unwrap() + "\n").unwrap();
    }
    let want: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&fixture).expect("fixture")).expect("json");
    eprintln!("oracle small: MLX bf16 vs f32 {mlx}");
    // The oracle runs on the CPU deterministically; 1e-6 relative allows a change of MLX's
    // summation order without hiding a different checkpoint or prompt. Its bf16 run also depends
    // on the CPU: where the CPU has native bf16 arithmetic (AVX512-BF16: seen on an AMD EPYC of
    // this workplace) MLX's bf16 kernels round differently, and the bf16 perplexity moved by
    // 0.17% (35,484 against the fixture's 35,546, the f32 values equal to 1e-6). So the bf16
    // perplexity is held to 1% of the fixture's: a different checkpoint or prompt moves it by
    // far more (the f32 checks catch those sharply), and the fixture stays the CUDA test's bar.
    for (k, tol) in [
        ("top1_agreement", 1e-6),
        ("perplexity_f32", 1e-6),
        ("perplexity_bf16", 1e-2),
    ] {
        let (a, b) = (mlx[k].as_f64().unwrap(), want[k].as_f64().unwrap());
        assert!((a - b).abs() <= tol * b.abs().max(1.0), "fixture {}: {k} is {b}, the oracle gives {a} (tolerance {tol} relative; rerun with LILY_WRITE_FIXTURES=1)", fixture.display());
    }

    // Greedy continuation through lily's prefill + decode path.
    let mut st = m.new_state(T + GEN + 1).unwrap();
    let (gen, _) = lily::runtime::generate_greedy(&m, &mut st, &ids, GEN, &[], |_| {}).unwrap();
    let ref_gen: Vec<u32> = o
        .array("gen_f32.npy")
        .data
        .iter()
        .map(|&x| x as u32)
        .collect();
    let gaps: Vec<f64> = o.array("gen_top2gap_f32.npy").data;
    let near_ties = gaps.iter().filter(|&&g| (g as f32) < TIE_GAP).count();
    let first_diff = gen.iter().zip(&ref_gen).position(|(a, b)| a != b);

    eprintln!(
        "oracle small: logits max abs err {max_abs:.3e} (rel {:.3e}, ref absmax {absmax:.2}), top-1 {agree}/{T}; \
         per-layer hidden max abs err {:.2e}; MLX bf16-vs-f32 top-1 {bf16_agree}/{T} ({:.1}%); \
         greedy {GEN}: first difference {first_diff:?}, near-ties (gap < {TIE_GAP}) {near_ties}",
        max_abs / absmax,
        layer_err.iter().fold(0f64, |a, &b| a.max(b)),
        100.0 * bf16_agree as f64 / T as f64
    );
    assert!(
        max_abs <= LOGIT_TOL * absmax,
        "logits max abs err {max_abs:e} > {LOGIT_TOL} × {absmax}"
    );
    for (i, e) in layer_err.iter().enumerate() {
        assert!(*e <= HIDDEN_TOL, "layer {i}: hidden max abs err {e:e}");
    }
    assert!(agree * 100 >= 99 * T, "top-1 agreement {agree}/{T} < 99%");
    assert!(
        bf16_agree * 100 >= 95 * T,
        "synthetic model badly conditioned: MLX bf16 vs f32 top-1 {bf16_agree}/{T} < 95%"
    );
    if let Some(i) = first_diff {
        assert!(
            (gaps[i] as f32) < TIE_GAP,
            "greedy tokens differ at {i} ({} vs {}) without a near-tie (gap {})",
            gen[i],
            ref_gen[i],
            gaps[i]
        );
    }
    assert!(
        near_ties <= GEN / 8,
        "{near_ties} near-ties in {GEN} greedy steps: the synthetic model's logits tie too often"
    );
    let _ = top2_gap; // used by other tests
}
