//! `lily synth`: seeded synthetic checkpoints in the exact MLX layout (MODEL.md §3), at any size
//! from `tiny` to the full Qwen3.6-35B-A3B shape, for tests and benchmarks.
//!
//! [`preset`] and [`apply_set`] make a [`Config`]; [`write_checkpoint`] writes `config.json`,
//! safetensors (one file, or ≤ 4 GB shards with `model.safetensors.index.json`), `tokenizer.json`,
//! `tokenizer_config.json`, `generation_config.json` and `chat_template.jinja`. Each file's header
//! is written first; the data is generated, quantized (MLX's affine rule, `quant.rs`) and written
//! in row chunks in parallel, so memory stays small even for the 19 GB preset. Every row has its
//! own random stream seeded by (seed, tensor name, row): same seed, same bytes, whatever the
//! thread count.
//!
//! # Conditioning: why the weights look the way they do
//!
//! Carelessly scaled random weights make a chaotic network: bf16 rounding flips expert choices and
//! the argmax, and then no comparison between two implementations means anything. The weights
//! here are random but shaped so every discrete decision has a wide margin (`plan.rs` has the
//! constants):
//!
//! - **Structured dims.** A seeded set of `1 + hidden/8` coordinates carries token identity: the
//!   *common* dim (value 3.0 in every embedding row, a bias channel for later layers) and one
//!   *cluster* dim per token cluster (value 4.0 on the token's own cluster dim, 0 on the others).
//!   The other coordinates hold token-specific noise, scaled so each embedding row has RMS 1. Every
//!   output projection (`o_proj`, `out_proj`, expert and shared `down_proj`) has its rows on the
//!   structured dims scaled by 0.01, so layers hardly write there: the structure survives to the
//!   last layer unchanged, whatever the context.
//! - **Router.** Each layer assigns every cluster its top-k experts (first covering every expert,
//!   then by a Zipf-like popularity, so some experts are much more popular, as in real models:
//!   on `small` the busiest expert takes 9–14 % of the routing slots, 4× the uniform share).
//!   Router row e has `10/4` on the cluster dims of the clusters that chose e, 0 on the others, and
//!   a popularity bias in [−1, 1] on the common dim, plus N(0, 0.3²) logit noise from the other
//!   dims. A token's chosen experts thus lead the rest by about 10/rms(h) − 2 − noise ≥ 5 logits
//!   (measured in MLX-LM on `small`, every token and layer: min 5.2) against bf16 noise of ~0.05:
//!   routing never flips, yet the top-k weights vary with the bias and the context noise.
//! - **Residual scales.** Input projections have std 1/√in (unit-RMS pre-activations after the
//!   norms). Output projections are sized so each sublayer adds RMS `√(0.5 / (2·layers))`:
//!   together the layers add variance 0.5 to the unit-RMS embedding, at any depth, so the hidden
//!   state stays O(1) (RMS ≈ 1 → 1.2) and each layer is a small correction to the residual. The
//!   MoE output splits its variance 0.8² routed : 0.6² shared.
//! - **Gates and decay.** GDN: conv weights favour the current token (0.7 ± 0.1, others 0.2);
//!   `A_log`/`dt_bias` per value head give decay = exp(−A·softplus(a + dt_bias)) ∈ ~(0.55, 0.98)
//!   (target (0.6, 0.97) at a = 0, `a` ~ N(0, 0.3²)); β = sigmoid(b) with per-head offsets in
//!   [−0.5, 1.5] through the common dim. Attention: q_norm/k_norm weights ≈ 1.4 make score std ≈ 2
//!   (attention that picks a few positions rather than a uniform blur); output gates
//!   sigmoid(N(0,1)). Shared-expert gate sigmoid(0.5 + N(0,1)). Norm weights 1 ± 0.02 (stored as
//!   MLX does, already `1 + w`).
//! - **lm_head.** Every token has a successor (a permutation of the text tokens; a few tokens are
//!   followed by `<|im_end|>`, so generation can stop). lm_head row v is 14/(hidden·ν) times the
//!   noise part of its predecessors' embeddings plus background N(0, (0.05·14)²/hidden): the
//!   successor's logit is ≈ 14·ν/rms(h) ≈ 11 while the other logits are ~N(0, 0.7²) (max ≈ 3–5).
//!   On `small` (MLX-LM, 192 positions): top-1 minus top-2 ≥ 3.6, median 7.0, p(top) median 0.83
//!   (min 0.36), so sampling still has something to sample, and bf16 agrees with f32 on 100 % of
//!   top-1s and greedy tokens. The context moves the rest of the distribution, not the argmax.
//! - **Quantization.** 4-bit (8-bit for `mlp.gate`, `mlp.shared_expert_gate`), group 64, MLX's
//!   affine rule with the scale and zero point nudged so each group is a fixed point of it
//!   (`quant.rs`): re-quantizing the dequantized weights with `mlx.core.quantize` gives back the
//!   same bytes, an exact format check (`tools/synth_check.py`).
//!
//! Vocabulary layout and tokenizer: see `tokenizer.rs` (full vocabulary: the real merges and the
//! real added-token ids 248044…; smaller ones: the first merges that fit and the 33 added tokens
//! at the top ids, so `<|endoftext|>` = vocab_size − 33, `<|im_end|>` = vocab_size − 31).

mod layout;
mod plan;
pub mod quant;
pub use crate::rng;
mod tokenizer;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use rayon::prelude::*;

use crate::config::{Config, QuantSpec, Quantization};

pub use layout::StDtype;
pub use plan::{Gen, Plan, VocabInfo};
pub use tokenizer::Vocab;

/// Largest safetensors file written (a module never straddles two).
pub const SHARD_BYTES: u64 = 4_000_000_000;

/// The preset names [`preset`] accepts.
pub const PRESETS: &[&str] = &["tiny", "small", "cpu-bench", "qwen3.6-35b-a3b"];

/// What [`write_checkpoint`] wrote.
#[derive(Clone, Debug)]
pub struct SynthReport {
    pub files: Vec<PathBuf>,
    /// Bytes of all files written.
    pub bytes_written: u64,
    /// Tensors stored in the safetensors files.
    pub tensors: usize,
    pub seconds: f64,
}

#[allow(clippy::too_many_arguments)]
fn shape(
    hidden: usize,
    layers: usize,
    (nh, nkv, hd): (usize, usize, usize),
    (lk, lv, ld): (usize, usize, usize),
    (experts, top_k, width): (usize, usize, usize),
    vocab: usize,
) -> Config {
    let mut c = Config {
        model_type: "qwen3_5_moe_text".into(),
        hidden_size: hidden,
        num_hidden_layers: layers,
        full_attention_interval: 4,
        num_attention_heads: nh,
        num_key_value_heads: nkv,
        head_dim: hd,
        attn_output_gate: true,
        partial_rotary_factor: 0.25,
        rope_theta: 10_000_000.0,
        rms_norm_eps: 1e-6,
        linear_num_key_heads: lk,
        linear_num_value_heads: lv,
        linear_key_head_dim: ld,
        linear_value_head_dim: ld,
        linear_conv_kernel_dim: 4,
        num_experts: experts,
        num_experts_per_tok: top_k,
        moe_intermediate_size: width,
        shared_expert_intermediate_size: width,
        vocab_size: vocab,
        tie_word_embeddings: false,
        max_position_embeddings: 262_144,
        norm_topk_prob: true,
        layer_is_attention: vec![],
        quantization: Quantization {
            default: Some(QuantSpec {
                bits: 4,
                group_size: 64,
            }),
            overrides: Default::default(),
        },
    };
    relayout(&mut c, 8);
    c
}

/// Recomputes `layer_is_attention` and the 8-bit gate overrides (`gate_bits`) for every layer.
fn relayout(c: &mut Config, gate_bits: u32) {
    c.layer_is_attention = (0..c.num_hidden_layers)
        .map(|i| (i + 1) % c.full_attention_interval.max(1) == 0)
        .collect();
    c.quantization.overrides.clear();
    if let Some(d) = c.quantization.default {
        for i in 0..c.num_hidden_layers {
            for m in ["mlp.gate", "mlp.shared_expert_gate"] {
                c.quantization.overrides.insert(
                    format!("model.layers.{i}.{m}"),
                    Some(QuantSpec {
                        bits: gate_bits,
                        group_size: d.group_size,
                    }),
                );
            }
        }
    }
}

fn gate_bits(c: &Config) -> u32 {
    c.quantization
        .overrides
        .values()
        .flatten()
        .map(|s| s.bits)
        .next()
        .unwrap_or(8)
}

/// A named configuration: `tiny`, `small`, `cpu-bench` or `qwen3.6-35b-a3b` (alias `full`).
pub fn preset(name: &str) -> Result<Config> {
    Ok(match name {
        "tiny" => shape(128, 4, (2, 1, 64), (2, 4, 32), (8, 2, 64), 1024 + 64),
        "small" => shape(512, 8, (4, 2, 128), (4, 8, 64), (32, 4, 256), 4096 + 64),
        "cpu-bench" => shape(1024, 8, (8, 2, 256), (8, 16, 128), (64, 8, 512), 248_320),
        "qwen3.6-35b-a3b" | "full" => shape(
            2048,
            40,
            (16, 2, 256),
            (16, 32, 128),
            (256, 8, 512),
            248_320,
        ),
        _ => bail!(
            "unknown synth preset `{name}` (known: {})",
            PRESETS.join(", ")
        ),
    })
}

const USIZE_FIELDS: &[&str] = &[
    "hidden_size",
    "num_hidden_layers",
    "full_attention_interval",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "vocab_size",
    "max_position_embeddings",
];
const F64_FIELDS: &[&str] = &["partial_rotary_factor", "rope_theta", "rms_norm_eps"];
const BOOL_FIELDS: &[&str] = &[
    "attn_output_gate",
    "tie_word_embeddings",
    "norm_topk_prob",
    "quantize",
];
const QUANT_FIELDS: &[&str] = &["bits", "group_size", "gate_bits"];

/// Applies one `--set field=value` override (config.json field names; plus `bits`, `group_size`,
/// `gate_bits` for the quantization and `quantize=false` for an unquantized bf16 checkpoint), then
/// validates. Errors are one line.
pub fn apply_set(cfg: &mut Config, assignment: &str) -> Result<()> {
    let Some((key, val)) = assignment.split_once('=') else {
        bail!("--set `{assignment}`: expected FIELD=VALUE");
    };
    let (key, val) = (key.trim(), val.trim());
    let int = || -> Result<usize> {
        val.parse::<usize>()
            .with_context(|| format!("--set {key}={val}: expected a non-negative integer"))
    };
    let num = || -> Result<f64> {
        val.parse::<f64>()
            .ok()
            .filter(|x| x.is_finite())
            .with_context(|| format!("--set {key}={val}: expected a number"))
    };
    let boolean = || -> Result<bool> {
        match val {
            "true" | "1" | "yes" => Ok(true),
            "false" | "0" | "no" => Ok(false),
            _ => bail!("--set {key}={val}: expected true or false"),
        }
    };
    let mut c = cfg.clone();
    let gb = gate_bits(&c);
    let mut relay = false;
    match key {
        k if USIZE_FIELDS.contains(&k) => {
            let v = int()?;
            match k {
                "hidden_size" => c.hidden_size = v,
                "num_hidden_layers" => {
                    c.num_hidden_layers = v;
                    relay = true;
                }
                "full_attention_interval" => {
                    if v == 0 {
                        bail!("--set full_attention_interval=0: must be positive");
                    }
                    c.full_attention_interval = v;
                    relay = true;
                }
                "num_attention_heads" => c.num_attention_heads = v,
                "num_key_value_heads" => c.num_key_value_heads = v,
                "head_dim" => c.head_dim = v,
                "linear_num_key_heads" => c.linear_num_key_heads = v,
                "linear_num_value_heads" => c.linear_num_value_heads = v,
                "linear_key_head_dim" => c.linear_key_head_dim = v,
                "linear_value_head_dim" => c.linear_value_head_dim = v,
                "linear_conv_kernel_dim" => c.linear_conv_kernel_dim = v,
                "num_experts" => c.num_experts = v,
                "num_experts_per_tok" => c.num_experts_per_tok = v,
                "moe_intermediate_size" => c.moe_intermediate_size = v,
                "shared_expert_intermediate_size" => c.shared_expert_intermediate_size = v,
                "vocab_size" => c.vocab_size = v,
                "max_position_embeddings" => c.max_position_embeddings = v,
                _ => unreachable!(),
            }
        }
        k if F64_FIELDS.contains(&k) => {
            let v = num()?;
            match k {
                "partial_rotary_factor" => c.partial_rotary_factor = v,
                "rope_theta" => c.rope_theta = v,
                _ => c.rms_norm_eps = v,
            }
        }
        k if BOOL_FIELDS.contains(&k) => {
            let v = boolean()?;
            match k {
                "attn_output_gate" => c.attn_output_gate = v,
                "tie_word_embeddings" => c.tie_word_embeddings = v,
                "norm_topk_prob" => c.norm_topk_prob = v,
                _ => {
                    c.quantization.default = if v {
                        Some(c.quantization.default.unwrap_or(QuantSpec {
                            bits: 4,
                            group_size: 64,
                        }))
                    } else {
                        None
                    };
                    relay = true;
                }
            }
        }
        k if QUANT_FIELDS.contains(&k) => {
            let v = int()? as u32;
            let Some(d) = c.quantization.default.as_mut() else {
                bail!(
                    "--set {key}={val}: the checkpoint is not quantized (set quantize=true first)"
                );
            };
            match k {
                "bits" => d.bits = v,
                "group_size" => d.group_size = v as usize,
                _ => {}
            }
            relayout(&mut c, if k == "gate_bits" { v } else { gb });
        }
        _ => bail!(
            "--set: unknown field `{key}` (known: {}, {}, {}, {})",
            USIZE_FIELDS.join(", "),
            F64_FIELDS.join(", "),
            BOOL_FIELDS.join(", "),
            QUANT_FIELDS.join(", ")
        ),
    }
    if relay {
        relayout(&mut c, gb);
    }
    validate(&c).map_err(|e| anyhow::anyhow!("--set {key}={val}: {e:#}"))?;
    *cfg = c;
    Ok(())
}

/// Checks a config can be synthesized: [`Config::validate`] plus the synthesizer's own limits.
pub fn validate(c: &Config) -> Result<()> {
    c.validate()?;
    if c.hidden_size < 32 {
        bail!(
            "hidden_size {} is too small for a synthetic checkpoint (at least 32)",
            c.hidden_size
        );
    }
    let n_add = tokenizer::n_added();
    if c.vocab_size < 256 + 32 + n_add {
        bail!(
            "vocab_size {} is too small for the synthetic tokenizer (at least {})",
            c.vocab_size,
            256 + 32 + n_add
        );
    }
    let specs = c
        .quantization
        .default
        .into_iter()
        .chain(c.quantization.overrides.values().flatten().copied());
    for q in specs {
        if q.group_size != 64 {
            bail!(
                "quantization group_size {} is not supported (64)",
                q.group_size
            );
        }
        if !matches!(q.bits, 4 | 8) {
            bail!("quantization: {}-bit is not supported (4 or 8)", q.bits);
        }
    }
    Ok(())
}

/// Positional write (parallel writers share one file handle).
fn write_at(f: &File, buf: &[u8], off: u64) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::FileExt::write_all_at(f, buf, off)
    }
    #[cfg(windows)]
    {
        let mut done = 0;
        while done < buf.len() {
            done += std::os::windows::fs::FileExt::seek_write(f, &buf[done..], off + done as u64)?;
        }
        Ok(())
    }
}

/// A range of rows of one module, and where each of its stored parts lives.
struct Unit {
    module: usize,
    rows: std::ops::Range<usize>,
}

/// Generates and writes one unit; returns the bytes written.
fn run_unit(
    plan: &Plan,
    m: &layout::Module,
    u: &Unit,
    files: &[File],
    places: &[(usize, u64)],
) -> Result<u64> {
    let cols = m.cols;
    let nrows = u.rows.len();
    let mut vals = vec![0f32; nrows * cols];
    for (i, r) in u.rows.clone().enumerate() {
        plan.fill_row(m.gen, m.id, r, &mut vals[i * cols..(i + 1) * cols]);
    }
    let put = |part: usize, bytes: &[u8], elem_offset_bytes: u64| -> Result<()> {
        let (shard, base) = places[part];
        write_at(&files[shard], bytes, base + elem_offset_bytes)
            .with_context(|| format!("writing `{}`", m.path))
    };
    let bf16 = |v: &[f32]| -> Vec<u8> {
        let mut b = vec![0u8; v.len() * 2];
        b.chunks_exact_mut(2)
            .zip(v)
            .for_each(|(d, &x)| d.copy_from_slice(&quant::bf16_bits(x).to_le_bytes()));
        b
    };
    let r0 = u.rows.start as u64;
    Ok(match &m.kind {
        layout::Kind::Linear { quant: Some(q), .. } => {
            let (bits, g) = (q.bits, q.group_size);
            let wpr = cols * bits as usize / 32;
            let gpr = cols / g;
            let mut words = vec![0u32; nrows * wpr];
            let mut scales = Vec::with_capacity(nrows * gpr * 2);
            let mut biases = Vec::with_capacity(nrows * gpr * 2);
            let mut codes = vec![0u8; g];
            let per = 32 / bits as usize;
            for (gi, grp) in vals.chunks_exact(g).enumerate() {
                let p = quant::encode_group(grp, bits, &mut codes);
                quant::pack(&codes, bits, &mut words[gi * g / per..(gi + 1) * g / per]);
                scales.extend(p.scale.to_le_bytes());
                biases.extend(p.bias.to_le_bytes());
            }
            let mut wb = vec![0u8; words.len() * 4];
            wb.chunks_exact_mut(4)
                .zip(&words)
                .for_each(|(d, w)| d.copy_from_slice(&w.to_le_bytes()));
            put(0, &wb, r0 * wpr as u64 * 4)?;
            put(1, &scales, r0 * gpr as u64 * 2)?;
            put(2, &biases, r0 * gpr as u64 * 2)?;
            (wb.len() + scales.len() + biases.len()) as u64
        }
        layout::Kind::Linear { quant: None, .. }
        | layout::Kind::Plain {
            dtype: StDtype::BF16,
            ..
        } => {
            let b = bf16(&vals);
            put(0, &b, r0 * cols as u64 * 2)?;
            b.len() as u64
        }
        layout::Kind::Plain {
            dtype: StDtype::F32,
            ..
        } => {
            let mut b = vec![0u8; vals.len() * 4];
            b.chunks_exact_mut(4)
                .zip(&vals)
                .for_each(|(d, x)| d.copy_from_slice(&x.to_le_bytes()));
            put(0, &b, r0 * cols as u64 * 4)?;
            b.len() as u64
        }
        layout::Kind::Plain {
            dtype: StDtype::U32,
            ..
        } => bail!("internal: plain U32 tensor `{}`", m.path),
    })
}

/// Writes a synthetic checkpoint of `cfg` into `dir` (created if needed; an older checkpoint's
/// safetensors there are replaced). `progress(done, total)` is called on the calling thread with
/// safetensors bytes written so far.
pub fn write_checkpoint(
    cfg: &Config,
    dir: &Path,
    seed: u64,
    progress: &dyn Fn(u64, u64),
) -> Result<SynthReport> {
    write_with(cfg, dir, seed, progress, SHARD_BYTES)
}

fn write_with(
    cfg: &Config,
    dir: &Path,
    seed: u64,
    progress: &dyn Fn(u64, u64),
    shard_bytes: u64,
) -> Result<SynthReport> {
    let t0 = Instant::now();
    validate(cfg)?;
    std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    for e in std::fs::read_dir(dir)
        .with_context(|| format!("{}: cannot list", dir.display()))?
        .flatten()
    {
        let name = e.file_name().to_string_lossy().to_string();
        if name == "model.safetensors.index.json"
            || (name.starts_with("model") && name.ends_with(".safetensors"))
        {
            std::fs::remove_file(e.path())
                .with_context(|| format!("{}: cannot remove the old file", e.path().display()))?;
        }
    }
    let vocab = Vocab::build(cfg.vocab_size)?;
    let plan = Plan::new(
        cfg,
        seed,
        VocabInfo {
            n_text: vocab.n_text,
            im_end: vocab.im_end(),
        },
    );
    let modules = layout::modules(cfg, &plan);
    let shards = layout::shards(&modules, shard_bytes);

    // Files: size them, write the headers, note where each module's parts go.
    let mut files = Vec::new();
    let mut out_files = Vec::new();
    let mut places: Vec<Vec<(usize, u64)>> = vec![vec![(0, 0); 3]; modules.len()];
    let mut tensors = 0;
    for (si, s) in shards.iter().enumerate() {
        let p = dir.join(&s.file);
        let f = File::create(&p).with_context(|| format!("{}: cannot create", p.display()))?;
        f.set_len(s.file_bytes())
            .with_context(|| format!("{}: cannot size", p.display()))?;
        write_at(&f, &s.header, 0).with_context(|| format!("{}: cannot write", p.display()))?;
        for (t, off) in &s.tensors {
            places[t.module][t.part] = (si, s.header.len() as u64 + off);
            tensors += 1;
        }
        files.push(f);
        out_files.push(p);
    }
    let total: u64 = shards.iter().map(|s| s.file_bytes()).sum();
    let mut done: u64 = shards.iter().map(|s| s.header.len() as u64).sum();
    progress(done, total);

    // Work: row chunks of ~1M values; processed in parallel batches of ~64M values.
    let mut units = Vec::new();
    for (i, m) in modules.iter().enumerate() {
        let step = ((1usize << 20) / m.cols.max(1)).max(1);
        let mut r = 0;
        while r < m.rows {
            units.push(Unit {
                module: i,
                rows: r..(r + step).min(m.rows),
            });
            r += step;
        }
    }
    let mut start = 0;
    while start < units.len() {
        let mut end = start;
        let mut vals = 0usize;
        while end < units.len() && vals < (64 << 20) {
            vals += units[end].rows.len() * modules[units[end].module].cols;
            end += 1;
        }
        let bytes: Result<Vec<u64>> = units[start..end]
            .par_iter()
            .map(|u| run_unit(&plan, &modules[u.module], u, &files, &places[u.module]))
            .collect();
        done += bytes?.iter().sum::<u64>();
        progress(done, total);
        start = end;
    }
    for (f, p) in files.iter().zip(&out_files) {
        f.sync_all()
            .with_context(|| format!("{}: cannot flush", p.display()))?;
    }
    drop(files);

    // config.json (eos ids of this vocabulary), index, tokenizer files.
    let mut config = cfg.to_json();
    config["text_config"]["eos_token_id"] = vocab.endoftext().into();
    let mut put_json = |name: &str, v: &serde_json::Value| -> Result<()> {
        let p = dir.join(name);
        std::fs::write(&p, serde_json::to_string_pretty(v)? + "\n")
            .with_context(|| format!("{}: cannot write", p.display()))?;
        out_files.push(p);
        Ok(())
    };
    put_json("config.json", &config)?;
    if shards.len() > 1 {
        put_json("model.safetensors.index.json", &layout::index_json(&shards))?;
    }
    out_files.extend(vocab.write(dir)?);
    let bytes_written = out_files
        .iter()
        .map(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .sum();
    Ok(SynthReport {
        files: out_files,
        bytes_written,
        tensors,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests;
