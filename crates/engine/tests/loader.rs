//! Checkpoint loading: accepted layouts load to the same model; every broken checkpoint is a
//! one-line error naming the file or tensor and what was expected — never a panic.

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::{load, prompt_ids, synth};
use lily::loader::Checkpoint;
use lily::model::Logits;
use safetensors::tensor::{Dtype, TensorView};

/// All tensors of a single-file checkpoint as (name, dtype, shape, bytes).
type Raw = Vec<(String, Dtype, Vec<usize>, Vec<u8>)>;

fn read_raw(dir: &Path) -> Raw {
    let bytes = std::fs::read(dir.join("model.safetensors")).expect("single-file checkpoint");
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Raw = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn write_raw(path: &Path, raw: &Raw) {
    let views: Vec<(String, TensorView)> = raw
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// Opens a checkpoint that must fail; returns the one-line message.
fn load_err(dir: &Path) -> String {
    let e = match Checkpoint::open(dir) {
        Ok(_) => panic!("{}: loaded, but an error was expected", dir.display()),
        Err(e) => format!("{e:#}"),
    };
    assert!(!e.contains('\n'), "error is not one line: {e}");
    e
}

fn logits(dir: &Path, n: usize) -> Vec<f32> {
    let m = load(dir);
    let ids = prompt_ids(n, m.cfg.vocab_size);
    let mut st = m.new_state(n).unwrap();
    m.forward(&mut st, &ids, Logits::All, None).unwrap()
}

fn edit(dir: &Path, f: impl FnOnce(&mut Raw)) {
    let mut raw = read_raw(dir);
    f(&mut raw);
    write_raw(&dir.join("model.safetensors"), &raw);
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

const NORM0: &str = "language_model.model.layers.0.input_layernorm.weight";

#[test]
fn missing_files() {
    let d = synth("tiny", 0, &[]);
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    assert!(load_err(d.path()).contains("config.json"));

    let d = synth("tiny", 0, &[]);
    std::fs::remove_file(d.path().join("model.safetensors")).unwrap();
    assert!(load_err(d.path()).contains("no *.safetensors"));

    // An index naming a shard that is not there.
    let d = synth("tiny", 0, &[]);
    let raw = read_raw(d.path());
    let mut map = serde_json::Map::new();
    for (i, (n, ..)) in raw.iter().enumerate() {
        let f = if i % 2 == 0 {
            "model.safetensors"
        } else {
            "model-00002-of-00002.safetensors"
        };
        map.insert(n.clone(), f.into());
    }
    std::fs::write(
        d.path().join("model.safetensors.index.json"),
        serde_json::json!({"weight_map": map}).to_string(),
    )
    .unwrap();
    let e = load_err(d.path());
    assert!(
        e.contains("model-00002-of-00002.safetensors") && e.contains("missing"),
        "{e}"
    );

    assert!(load_err(Path::new("/nonexistent/lily-model")).contains("not a directory"));
}

#[test]
fn truncated_and_corrupt_files() {
    let d = synth("tiny", 0, &[]);
    let p = d.path().join("model.safetensors");
    let len = std::fs::metadata(&p).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(len - 100).unwrap();
    let e = load_err(d.path());
    assert!(
        e.contains("truncated") && e.contains("model.safetensors"),
        "{e}"
    );

    f.set_len(5).unwrap();
    assert!(load_err(d.path()).contains("truncated"));

    std::fs::write(&p, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all").unwrap();
    assert!(load_err(d.path()).contains("corrupt safetensors header"));
}

#[test]
fn wrong_shape_dtype_or_missing_tensor() {
    let d = synth("tiny", 0, &[]);
    edit(d.path(), |raw| {
        let t = raw.iter_mut().find(|t| t.0 == NORM0).unwrap();
        t.2 = vec![t.2[0] / 2];
        t.3.truncate(t.3.len() / 2);
    });
    let e = load_err(d.path());
    assert!(
        e.contains(NORM0.trim_start_matches("language_model.")) && e.contains("shape"),
        "{e}"
    );

    let d = synth("tiny", 0, &[]);
    let gone = "language_model.model.layers.1.mlp.shared_expert.down_proj.biases";
    edit(d.path(), |raw| raw.retain(|t| t.0 != gone));
    let e = load_err(d.path());
    assert!(
        e.contains("missing tensor") && e.contains("shared_expert.down_proj.biases"),
        "{e}"
    );

    let d = synth("tiny", 0, &[]);
    edit(d.path(), |raw| {
        raw.retain(|t| !t.0.contains("layers.2.mlp.switch_mlp.up_proj"))
    });
    let e = load_err(d.path());
    assert!(
        e.contains("missing tensor") && e.contains("layers.2.mlp.switch_mlp.up_proj"),
        "{e}"
    );

    let d = synth("tiny", 0, &[]);
    edit(d.path(), |raw| {
        let t = raw
            .iter_mut()
            .find(|t| t.0.ends_with("layers.0.linear_attn.A_log"))
            .unwrap();
        let n: usize = t.2.iter().product();
        t.1 = Dtype::U8;
        t.3 = vec![0; n];
    });
    let e = load_err(d.path());
    assert!(e.contains("A_log") && e.contains("dtype"), "{e}");

    // The router is stored at 8 bits; a config that forgets the override gets a hint.
    let d = synth("tiny", 0, &[]);
    edit_config(d.path(), |v| {
        for q in ["quantization", "quantization_config"] {
            let o = v[q].as_object_mut().unwrap();
            o.retain(|k, _| !k.contains("layers.0.mlp.gate"));
        }
    });
    let e = load_err(d.path());
    assert!(
        e.contains("layers.0.mlp.gate.weight") && e.contains("8-bit"),
        "{e}"
    );
}

#[test]
fn unsupported_config_values() {
    for (field, value, needle) in [
        ("bits", serde_json::json!(3), "3-bit"),
        ("group_size", serde_json::json!(32), "group_size"),
    ] {
        let d = synth("tiny", 0, &[]);
        edit_config(d.path(), |v| v["quantization"][field] = value.clone());
        assert!(load_err(d.path()).contains(needle));
    }
    let d = synth("tiny", 0, &[]);
    edit_config(d.path(), |v| {
        v["text_config"]["hidden_size"] = serde_json::json!(192)
    });
    let e = load_err(d.path());
    assert!(e.contains("shape") || e.contains("multiple"), "{e}");
    let d = synth("tiny", 0, &[]);
    std::fs::write(d.path().join("config.json"), "{ not json").unwrap();
    assert!(load_err(d.path()).contains("not valid JSON"));
}

#[test]
fn skipped_tensors_hf_layout_and_shards_load_the_same_model() {
    let d = synth("tiny", 3, &[]);
    let want = logits(d.path(), 12);

    // Vision and MTP tensors are ignored.
    edit(d.path(), |raw| {
        raw.push(("mtp.fc.weight".into(), Dtype::F32, vec![2], vec![0; 8]));
        raw.push((
            "vision_tower.blocks.0.attn.qkv.weight".into(),
            Dtype::F32,
            vec![2],
            vec![0; 8],
        ));
        raw.push((
            "language_model.model.mtp.layers.0.norm.weight".into(),
            Dtype::BF16,
            vec![2],
            vec![0; 4],
        ));
    });
    assert_eq!(logits(d.path(), 12), want);

    // Hugging Face layout: conv [C, 1, K] and zero-centred norms stored as w (not 1 + w), in f32.
    let d2 = synth("tiny", 3, &[]);
    let norms = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "q_norm.weight",
        "k_norm.weight",
    ];
    edit(d2.path(), |raw| {
        for t in raw.iter_mut() {
            let is_norm =
                norms.iter().any(|n| t.0.ends_with(n)) || t.0 == "language_model.model.norm.weight";
            if t.0.ends_with("conv1d.weight") {
                t.2 = vec![t.2[0], 1, t.2[1]];
            } else if is_norm {
                assert_eq!(t.1, Dtype::BF16);
                let vals: Vec<f32> = t
                    .3
                    .chunks(2)
                    .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16) - 1.0)
                    .collect();
                t.1 = Dtype::F32;
                t.3 = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
            }
        }
    });
    assert_eq!(
        logits(d2.path(), 12),
        want,
        "HF layout must load to the same model"
    );

    // Sharded: two files and an index.
    let d3 = synth("tiny", 3, &[]);
    let raw = read_raw(d3.path());
    let mut files: HashMap<&str, Raw> = HashMap::new();
    let mut map = serde_json::Map::new();
    for (i, t) in raw.iter().enumerate() {
        let f = if i % 2 == 0 {
            "model-00001-of-00002.safetensors"
        } else {
            "model-00002-of-00002.safetensors"
        };
        map.insert(t.0.clone(), f.into());
        files.entry(f).or_default().push(t.clone());
    }
    std::fs::remove_file(d3.path().join("model.safetensors")).unwrap();
    for (f, r) in &files {
        write_raw(&d3.path().join(f), r);
    }
    std::fs::write(
        d3.path().join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    assert_eq!(
        logits(d3.path(), 12),
        want,
        "sharded checkpoint must load to the same model"
    );
}

#[test]
fn unquantized_checkpoint_runs() {
    let d = synth("tiny", 0, &["quantize=false"]);
    let raw = read_raw(d.path());
    assert!(
        !raw.iter().any(|t| t.0.ends_with(".scales")),
        "quantize=false wrote scales"
    );
    let l = logits(d.path(), 8);
    assert!(l.iter().all(|x| x.is_finite()));
}

/// A raw Hugging Face directory (the official release layout, unquantized): `model.language_model.`
/// names, fused `experts.gate_up_proj` [E, 2I, H] + `experts.down_proj`, conv [C, 1, K], norms as
/// `w`. It must load to the same model as the MLX-layout directory of the same weights.
#[test]
fn hf_raw_directory_loads_like_mlx() {
    let d = synth("tiny", 4, &["quantize=false"]);
    let want = logits(d.path(), 10);
    let raw = read_raw(d.path());
    let get = |n: &str| {
        raw.iter()
            .find(|t| t.0 == n)
            .cloned()
            .unwrap_or_else(|| panic!("{n}"))
    };
    let mut out: Raw = Vec::new();
    let norms = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "q_norm.weight",
        "k_norm.weight",
    ];
    for t in &raw {
        let name =
            t.0.replacen("language_model.model.", "model.language_model.", 1)
                .replacen("language_model.lm_head", "lm_head", 1);
        if t.0.contains("switch_mlp.up_proj") {
            continue; // fused with gate below
        }
        if t.0.contains("switch_mlp.gate_proj") {
            let up = get(&t.0.replace("gate_proj", "up_proj"));
            let (e, i, h) = (t.2[0], t.2[1], t.2[2]);
            let per = i * h * 2; // bytes of one expert's matrix (bf16)
            let mut fused = Vec::with_capacity(2 * t.3.len());
            for j in 0..e {
                fused.extend_from_slice(&t.3[j * per..(j + 1) * per]);
                fused.extend_from_slice(&up.3[j * per..(j + 1) * per]);
            }
            out.push((
                name.replace("switch_mlp.gate_proj.weight", "experts.gate_up_proj"),
                t.1,
                vec![e, 2 * i, h],
                fused,
            ));
            continue;
        }
        let mut t2 = (
            name.replace("switch_mlp.down_proj.weight", "experts.down_proj"),
            t.1,
            t.2.clone(),
            t.3.clone(),
        );
        if t.0.ends_with("conv1d.weight") {
            t2.2 = vec![t.2[0], 1, t.2[1]];
        } else if norms.iter().any(|n| t.0.ends_with(n))
            || t.0 == "language_model.model.norm.weight"
        {
            let vals: Vec<f32> =
                t.3.chunks(2)
                    .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16) - 1.0)
                    .collect();
            t2.1 = Dtype::F32;
            t2.3 = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        }
        out.push(t2);
    }
    write_raw(&d.path().join("model.safetensors"), &out);
    assert_eq!(logits(d.path(), 10), want);
}
