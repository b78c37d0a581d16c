use std::collections::BTreeMap;
use std::path::Path;

use super::*;

fn no_progress(_: u64, _: u64) {}

fn write(cfg: &Config, dir: &Path, seed: u64) -> SynthReport {
    write_checkpoint(cfg, dir, seed, &no_progress).unwrap()
}

/// All stored tensors of a checkpoint directory: name → (dtype, shape, bytes).
fn read_all(dir: &Path) -> BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if e.path().extension().is_some_and(|x| x == "safetensors") {
            let bytes = std::fs::read(e.path()).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            for (name, t) in st.tensors() {
                out.insert(
                    name,
                    (
                        format!("{:?}", t.dtype()),
                        t.shape().to_vec(),
                        t.data().to_vec(),
                    ),
                );
            }
        }
    }
    out
}

/// What MODEL.md §3 says a checkpoint of `c` holds: name → (dtype, shape).
fn expected(c: &Config) -> BTreeMap<String, (String, Vec<usize>)> {
    let mut m = BTreeMap::new();
    let mut lin = |path: &str, lead: Option<usize>, out: usize, inp: usize| {
        let dims =
            |last: usize| -> Vec<usize> { lead.iter().copied().chain([out, last]).collect() };
        match c.quantization.spec_for(path) {
            Some(q) => {
                m.insert(
                    format!("{path}.weight"),
                    ("U32".into(), dims(inp * q.bits as usize / 32)),
                );
                m.insert(format!("{path}.scales"), ("BF16".into(), dims(inp / 64)));
                m.insert(format!("{path}.biases"), ("BF16".into(), dims(inp / 64)));
            }
            None => {
                m.insert(format!("{path}.weight"), ("BF16".into(), dims(inp)));
            }
        }
    };
    let d = c.hidden_size;
    let p = "language_model.model";
    lin(&format!("{p}.embed_tokens"), None, c.vocab_size, d);
    lin("language_model.lm_head", None, c.vocab_size, d);
    let mut plain = BTreeMap::new();
    plain.insert(format!("{p}.norm.weight"), ("BF16".to_string(), vec![d]));
    for i in 0..c.num_hidden_layers {
        let l = format!("{p}.layers.{i}");
        plain.insert(
            format!("{l}.input_layernorm.weight"),
            ("BF16".into(), vec![d]),
        );
        plain.insert(
            format!("{l}.post_attention_layernorm.weight"),
            ("BF16".into(), vec![d]),
        );
        if (i + 1) % c.full_attention_interval == 0 {
            let a = format!("{l}.self_attn");
            let (q, kv) = (
                c.num_attention_heads * c.head_dim,
                c.num_key_value_heads * c.head_dim,
            );
            lin(&format!("{a}.q_proj"), None, 2 * q, d);
            lin(&format!("{a}.k_proj"), None, kv, d);
            lin(&format!("{a}.v_proj"), None, kv, d);
            lin(&format!("{a}.o_proj"), None, d, q);
            plain.insert(
                format!("{a}.q_norm.weight"),
                ("BF16".into(), vec![c.head_dim]),
            );
            plain.insert(
                format!("{a}.k_norm.weight"),
                ("BF16".into(), vec![c.head_dim]),
            );
        } else {
            let g = format!("{l}.linear_attn");
            let kd = c.linear_num_key_heads * c.linear_key_head_dim;
            let vd = c.linear_num_value_heads * c.linear_value_head_dim;
            let hv = c.linear_num_value_heads;
            lin(&format!("{g}.in_proj_qkv"), None, 2 * kd + vd, d);
            lin(&format!("{g}.in_proj_z"), None, vd, d);
            lin(&format!("{g}.in_proj_b"), None, hv, d);
            lin(&format!("{g}.in_proj_a"), None, hv, d);
            lin(&format!("{g}.out_proj"), None, d, vd);
            plain.insert(
                format!("{g}.conv1d.weight"),
                (
                    "BF16".into(),
                    vec![2 * kd + vd, c.linear_conv_kernel_dim, 1],
                ),
            );
            plain.insert(format!("{g}.A_log"), ("F32".into(), vec![hv]));
            plain.insert(format!("{g}.dt_bias"), ("BF16".into(), vec![hv]));
            plain.insert(
                format!("{g}.norm.weight"),
                ("BF16".into(), vec![c.linear_value_head_dim]),
            );
        }
        let mlp = format!("{l}.mlp");
        let (e, f, fs) = (
            c.num_experts,
            c.moe_intermediate_size,
            c.shared_expert_intermediate_size,
        );
        lin(&format!("{mlp}.gate"), None, e, d);
        lin(&format!("{mlp}.switch_mlp.gate_proj"), Some(e), f, d);
        lin(&format!("{mlp}.switch_mlp.up_proj"), Some(e), f, d);
        lin(&format!("{mlp}.switch_mlp.down_proj"), Some(e), d, f);
        lin(&format!("{mlp}.shared_expert.gate_proj"), None, fs, d);
        lin(&format!("{mlp}.shared_expert.up_proj"), None, fs, d);
        lin(&format!("{mlp}.shared_expert.down_proj"), None, d, fs);
        lin(&format!("{mlp}.shared_expert_gate"), None, 1, d);
    }
    m.extend(plain);
    m
}

fn check_layout(cfg: &Config, dir: &Path) {
    let got: BTreeMap<String, (String, Vec<usize>)> = read_all(dir)
        .into_iter()
        .map(|(k, (d, s, _))| (k, (d, s)))
        .collect();
    let want = expected(cfg);
    for (k, v) in &want {
        assert_eq!(got.get(k), Some(v), "tensor `{k}`");
    }
    assert_eq!(
        got.len(),
        want.len(),
        "extra tensors: {:?}",
        got.keys()
            .filter(|k| !want.contains_key(*k))
            .collect::<Vec<_>>()
    );
}

#[test]
fn tiny_writes_fast_and_has_the_mlx_layout() {
    let cfg = preset("tiny").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let calls = std::cell::Cell::new(0u64);
    let last = std::cell::Cell::new((0u64, 0u64));
    let rep = write_checkpoint(&cfg, dir.path(), 1, &|d, t| {
        calls.set(calls.get() + 1);
        assert!(d >= last.get().0 && d <= t);
        last.set((d, t));
    })
    .unwrap();
    assert!(rep.seconds < 1.0, "tiny took {:.2} s", rep.seconds);
    assert!(calls.get() >= 2 && last.get().0 == last.get().1);
    check_layout(&cfg, dir.path());
    // 8-bit gates, 4-bit elsewhere; A_log f32.
    let all = read_all(dir.path());
    assert_eq!(
        all["language_model.model.layers.0.mlp.gate.weight"].1,
        vec![8, 32]
    );
    assert_eq!(
        all["language_model.model.layers.0.mlp.switch_mlp.up_proj.weight"].1,
        vec![8, 64, 16]
    );
    assert_eq!(rep.tensors, all.len());
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "chat_template.jinja",
        "model.safetensors",
    ] {
        assert!(dir.path().join(f).exists(), "{f}");
    }
    // config.json round-trips through the config parser.
    let back = Config::from_dir(dir.path()).unwrap();
    assert_eq!(back, cfg);
    let gen: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("generation_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        gen["eos_token_id"],
        serde_json::json!([1088 - 31, 1088 - 33])
    );
}

#[test]
fn sharded_and_unquantized_layouts() {
    let cfg = preset("tiny").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let rep = write_with(&cfg, dir.path(), 3, &no_progress, 300_000).unwrap();
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let shards = rep
        .files
        .iter()
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .count();
    assert!(shards > 2, "{shards}");
    assert!(dir
        .path()
        .join(format!("model-00001-of-{shards:05}.safetensors"))
        .exists());
    assert_eq!(index["weight_map"].as_object().unwrap().len(), rep.tensors);
    check_layout(&cfg, dir.path());
    // Same bytes per tensor as the single-file checkpoint.
    let one = tempfile::tempdir().unwrap();
    write(&cfg, one.path(), 3);
    assert!(read_all(one.path()) == read_all(dir.path()));

    let mut bf = cfg.clone();
    apply_set(&mut bf, "quantize=false").unwrap();
    let d2 = tempfile::tempdir().unwrap();
    write(&bf, d2.path(), 3);
    check_layout(&bf, d2.path());
    let cj: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d2.path().join("config.json")).unwrap())
            .unwrap();
    assert!(cj.get("quantization").is_none());
}

#[test]
fn deterministic_across_thread_counts_and_seed_sensitive() {
    let mut cfg = preset("tiny").unwrap();
    apply_set(&mut cfg, "num_hidden_layers=2").unwrap();
    let run = |threads: usize, seed: u64| {
        let dir = tempfile::tempdir().unwrap();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| write(&cfg, dir.path(), seed));
        let mut files = BTreeMap::new();
        for e in std::fs::read_dir(dir.path()).unwrap().flatten() {
            files.insert(
                e.file_name().to_string_lossy().to_string(),
                std::fs::read(e.path()).unwrap(),
            );
        }
        files
    };
    let a = run(1, 42);
    let b = run(3, 42);
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (k, v) in &a {
        assert!(v == &b[k], "{k} differs between 1 and 3 threads");
    }
    let c = run(2, 43);
    assert!(a["model.safetensors"] != c["model.safetensors"]);
    assert!(a["tokenizer.json"] == c["tokenizer.json"]);
}

/// Dequantized f32 matrix of a quantized module (all stacked matrices, rows concatenated).
fn dequant(
    all: &BTreeMap<String, (String, Vec<usize>, Vec<u8>)>,
    path: &str,
) -> (Vec<f32>, usize, u32) {
    let (_, wshape, w) = &all[&format!("{path}.weight")];
    let (_, sshape, s) = &all[&format!("{path}.scales")];
    let b = &all[&format!("{path}.biases")].2;
    let groups = *sshape.last().unwrap();
    let cols = groups * 64;
    let bits = (*wshape.last().unwrap() * 32 / cols) as u32;
    let words: Vec<u32> = w
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let u16s = |v: &[u8]| -> Vec<u16> {
        v.chunks_exact(2)
            .map(|c| u16::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let (sc, bi) = (u16s(s), u16s(b));
    let per = 32 / bits as usize;
    let mask = (1u32 << bits) - 1;
    let n = words.len() * per;
    let mut out = vec![0f32; n];
    for (i, o) in out.iter_mut().enumerate() {
        let code = (words[i / per] >> ((i % per) as u32 * bits)) & mask;
        let g = i / 64;
        *o = quant::bf16_value(sc[g]) * code as f32 + quant::bf16_value(bi[g]);
    }
    (out, cols, bits)
}

fn bf16_vec(all: &BTreeMap<String, (String, Vec<usize>, Vec<u8>)>, name: &str) -> Vec<f32> {
    all[name]
        .2
        .chunks_exact(2)
        .map(|c| quant::bf16_value(u16::from_le_bytes([c[0], c[1]])))
        .collect()
}

fn plan_for(cfg: &Config, seed: u64) -> Plan {
    let v = Vocab::build(cfg.vocab_size).unwrap();
    Plan::new(
        cfg,
        seed,
        VocabInfo {
            n_text: v.n_text,
            im_end: v.im_end(),
        },
    )
}

#[test]
fn quantization_round_trip() {
    let cfg = preset("tiny").unwrap();
    let dir = tempfile::tempdir().unwrap();
    write(&cfg, dir.path(), 5);
    let all = read_all(dir.path());
    let plan = plan_for(&cfg, 5);
    let mods = layout::modules(&cfg, &plan);
    for path in [
        "language_model.model.embed_tokens",
        "language_model.lm_head",
        "language_model.model.layers.0.mlp.gate",
        "language_model.model.layers.1.mlp.switch_mlp.down_proj",
        "language_model.model.layers.3.self_attn.q_proj",
        "language_model.model.layers.2.linear_attn.in_proj_b",
        "language_model.model.layers.2.mlp.shared_expert_gate",
    ] {
        let m = mods.iter().find(|m| m.path == path).unwrap();
        let (deq, cols, bits) = dequant(&all, path);
        assert_eq!(cols, m.cols);
        let (sc, _) = (bf16_vec(&all, &format!("{path}.scales")), ());
        let mut row = vec![0f32; cols];
        let (mut within_half, mut total) = (0usize, 0usize);
        for r in 0..m.rows {
            plan.fill_row(m.gen, m.id, r, &mut row);
            for (i, &x) in row.iter().enumerate() {
                let step = sc[(r * cols + i) / 64].abs();
                let err = (deq[r * cols + i] - x).abs();
                // Half a step, plus the nudge that makes groups MLX fixed points (module doc of quant.rs).
                assert!(
                    err <= step * if bits == 4 { 1.0 } else { 4.0 } + 1e-7,
                    "{path} row {r} col {i}: {x} vs {} (step {step})",
                    deq[r * cols + i]
                );
                within_half += (err <= step * 0.5 + 1e-7) as usize;
                total += 1;
            }
        }
        assert!(
            within_half as f64 >= 0.97 * total as f64,
            "{path}: only {within_half}/{total} within half a step"
        );
    }
}

fn rms_norm(x: &[f32], w: &[f32]) -> Vec<f32> {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let s = 1.0 / (ms + 1e-6).sqrt();
    x.iter().zip(w).map(|(a, b)| a * s * b).collect()
}

fn matvec(w: &[f32], cols: usize, x: &[f32]) -> Vec<f32> {
    w.chunks_exact(cols)
        .map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

/// The conditioning, checked on the embeddings alone (the layers only add a bounded correction):
/// every token's top-k experts lead by a wide margin in every layer, and the lm_head puts the
/// token's successor first by a wide margin.
#[test]
fn routing_and_next_token_margins() {
    for name in ["tiny", "small"] {
        let cfg = preset(name).unwrap();
        let dir = tempfile::tempdir().unwrap();
        write(&cfg, dir.path(), 7);
        let all = read_all(dir.path());
        let plan = plan_for(&cfg, 7);
        let p = "language_model.model";
        let (emb, d, _) = dequant(&all, &format!("{p}.embed_tokens"));
        let (head, _, _) = dequant(&all, "language_model.lm_head");
        let final_norm = bf16_vec(&all, &format!("{p}.norm.weight"));
        let k = cfg.num_experts_per_tok;
        let mut min_route = f32::INFINITY;
        let (mut top1_ok, mut margins) = (0, vec![]);
        let tokens: Vec<usize> = (0..cfg.vocab_size)
            .step_by(if name == "small" { 7 } else { 1 })
            .collect();
        for l in 0..cfg.num_hidden_layers {
            let (router, _, bits) = dequant(&all, &format!("{p}.layers.{l}.mlp.gate"));
            assert_eq!(bits, 8);
            let post = bf16_vec(
                &all,
                &format!("{p}.layers.{l}.post_attention_layernorm.weight"),
            );
            for &t in &tokens {
                let x = rms_norm(&emb[t * d..(t + 1) * d], &post);
                let mut lg = matvec(&router, d, &x);
                lg.sort_by(|a, b| b.partial_cmp(a).unwrap());
                min_route = min_route.min(lg[k - 1] - lg[k]);
            }
        }
        for &t in &tokens {
            let x = rms_norm(&emb[t * d..(t + 1) * d], &final_norm);
            let lg = matvec(&head, d, &x);
            let best = (0..lg.len())
                .max_by(|&a, &b| lg[a].partial_cmp(&lg[b]).unwrap())
                .unwrap();
            top1_ok += (best == plan.successor(t)) as usize;
            let second = lg
                .iter()
                .enumerate()
                .filter(|&(i, _)| i != best)
                .map(|(_, &v)| v)
                .fold(f32::MIN, f32::max);
            margins.push(lg[best] - second);
        }
        margins.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let n = tokens.len();
        eprintln!("{name}: min routing margin {min_route:.2}, top-1 = successor {top1_ok}/{n}, margin p1 {:.2} p50 {:.2}", margins[n / 100], margins[n / 2]);
        assert!(min_route > 3.0, "{name}: routing margin {min_route}");
        assert!(top1_ok as f64 >= 0.99 * n as f64, "{name}: {top1_ok}/{n}");
        assert!(
            margins[n / 100] > 2.0,
            "{name}: 1st percentile top-1 margin {}",
            margins[n / 100]
        );
    }
}

#[test]
fn apply_set_overrides_and_errors() {
    let mut c = preset("small").unwrap();
    apply_set(&mut c, "num_hidden_layers=2").unwrap();
    assert_eq!(c.layer_is_attention, vec![false, false]);
    assert_eq!(c.quantization.overrides.len(), 4);
    apply_set(&mut c, "full_attention_interval=2").unwrap();
    assert_eq!(c.layer_is_attention, vec![false, true]);
    apply_set(&mut c, "vocab_size=2048").unwrap();
    assert_eq!(c.vocab_size, 2048);
    apply_set(&mut c, "bits=8").unwrap();
    assert_eq!(c.quantization.default.unwrap().bits, 8);
    assert_eq!(
        c.quantization
            .spec_for("model.layers.1.mlp.gate")
            .unwrap()
            .bits,
        8
    );
    apply_set(&mut c, "rope_theta=1e6").unwrap();
    assert_eq!(c.rope_theta, 1e6);
    apply_set(&mut c, "quantize=false").unwrap();
    assert!(c.quantization.default.is_none() && c.quantization.overrides.is_empty());
    apply_set(&mut c, "quantize=true").unwrap();
    assert_eq!(
        c.quantization
            .spec_for("model.layers.1.mlp.shared_expert_gate")
            .unwrap()
            .bits,
        8
    );

    let before = c.clone();
    for (bad, needle) in [
        ("frobnicate=3", "unknown field `frobnicate`"),
        ("hidden_size=abc", "non-negative integer"),
        ("hidden_size=100", "multiple of"),
        ("num_attention_heads=3", "num_key_value_heads"),
        ("rope_theta=fast", "expected a number"),
        ("quantize=maybe", "true or false"),
        ("bits=3", "3-bit"),
        ("vocab_size=100", "too small"),
        ("num_experts_per_tok=99", "exceeds"),
        ("hidden_size", "FIELD=VALUE"),
    ] {
        let e = format!("{:#}", apply_set(&mut c, bad).unwrap_err());
        assert!(e.contains(needle), "{bad}: {e}");
        assert!(!e.contains('\n'), "{bad}: {e}");
    }
    assert_eq!(c, before, "a failed --set leaves the config unchanged");
    assert!(preset("nope").unwrap_err().to_string().contains("tiny"));
}

#[test]
fn presets_are_valid() {
    for p in PRESETS {
        let c = preset(p).unwrap();
        validate(&c).unwrap();
        assert_eq!(Config::from_json(&c.to_json()).unwrap(), c, "{p}");
    }
    let full = preset("qwen3.6-35b-a3b").unwrap();
    assert_eq!(full.num_attention_layers(), 10);
    assert_eq!(full.quantization.overrides.len(), 80);
    // About 19.4 GB.
    let plan_bytes: u64 = {
        let v = Vocab::build(full.vocab_size).unwrap();
        let plan = Plan::new(
            &full,
            0,
            VocabInfo {
                n_text: v.n_text,
                im_end: v.im_end(),
            },
        );
        layout::shards(&layout::modules(&full, &plan), SHARD_BYTES)
            .iter()
            .map(|s| s.file_bytes())
            .sum()
    };
    assert!(
        (19.0e9..20.0e9).contains(&(plan_bytes as f64)),
        "{plan_bytes}"
    );
}

/// lily's own loader accepts the checkpoint.
#[test]
fn loader_opens_synthetic_checkpoint() {
    let cfg = preset("tiny").unwrap();
    let dir = tempfile::tempdir().unwrap();
    write(&cfg, dir.path(), 9);
    let ck = crate::loader::Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.config, cfg);
    assert_eq!(ck.weights.layers.len(), 4);
}

/// Writes the full 35B-shape preset (19.4 GB) to `$LILY_SYNTH_FULL_DIR` for timing; run with
/// `cargo test --release -p lily-engine synth::tests::write_full_preset -- --ignored --nocapture`.
#[test]
#[ignore]
fn write_full_preset() {
    let Ok(dir) = std::env::var("LILY_SYNTH_FULL_DIR") else {
        return;
    };
    let name = std::env::var("LILY_SYNTH_PRESET").unwrap_or("qwen3.6-35b-a3b".into());
    let cfg = preset(&name).unwrap();
    let last = std::cell::Cell::new(0u64);
    let rep = write_checkpoint(&cfg, Path::new(&dir), 0, &|d, t| {
        if d - last.get() > 2_000_000_000 || d == t {
            eprintln!("{:.1} / {:.1} GB", d as f64 / 1e9, t as f64 / 1e9);
            last.set(d);
        }
    })
    .unwrap();
    eprintln!(
        "{name}: {} files, {} tensors, {:.2} GB in {:.1} s",
        rep.files.len(),
        rep.tensors,
        rep.bytes_written as f64 / 1e9,
        rep.seconds
    );
}
