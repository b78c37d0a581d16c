//! Model hyper-parameters, with the names `config.json` uses.
//!
//! The published Qwen3.6 checkpoint nests the text model under `text_config` and puts RoPE settings
//! under `rope_parameters`; a flat config (all fields at the top level) is accepted too. Every value
//! the engine depends on is checked here, so an unsupported checkpoint fails at load with one line
//! naming the field, never later inside a kernel.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Quantization of one module: MLX affine, `w = scale * q + bias` per group of `group_size`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuantSpec {
    pub bits: u32,
    pub group_size: usize,
}

/// The `quantization` block of an MLX config: defaults plus per-module overrides.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Quantization {
    /// Default for every quantized module; `None` for an unquantized (bf16) checkpoint.
    pub default: Option<QuantSpec>,
    /// Overrides keyed by the module path, normalised to `model.layers.N.…` / `lm_head` (the
    /// `language_model.` prefix spellings are folded); `None` = explicitly not quantized (`false`).
    pub overrides: BTreeMap<String, Option<QuantSpec>>,
}

impl Quantization {
    /// The quantization of a module path (any accepted spelling).
    pub fn spec_for(&self, module: &str) -> Option<QuantSpec> {
        match self.overrides.get(&normalize_module_path(module)) {
            Some(o) => *o,
            None => self.default,
        }
    }
}

/// Folds the prefixes MLX and Hugging Face use for the text model into one spelling:
/// `language_model.model.layers.3.x` / `model.language_model.layers.3.x` → `model.layers.3.x`,
/// `language_model.lm_head` → `lm_head`.
pub fn normalize_module_path(p: &str) -> String {
    if let Some(rest) = p.strip_prefix("language_model.model.") {
        format!("model.{rest}")
    } else if let Some(rest) = p.strip_prefix("model.language_model.") {
        format!("model.{rest}")
    } else if let Some(rest) = p.strip_prefix("language_model.") {
        rest.to_string()
    } else {
        p.to_string()
    }
}

/// Text-model hyper-parameters of a qwen3_5_moe checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub model_type: String,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub full_attention_interval: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub attn_output_gate: bool,
    pub partial_rotary_factor: f64,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    pub vocab_size: usize,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub norm_topk_prob: bool,
    /// `true` = attention layer, `false` = Gated DeltaNet layer, one entry per layer.
    pub layer_is_attention: Vec<bool>,
    pub quantization: Quantization,
}

fn get<'a>(obj: &'a Value, outer: &'a Value, key: &str) -> Option<&'a Value> {
    obj.get(key).or_else(|| outer.get(key))
}

fn req_usize(text: &Value, outer: &Value, key: &str) -> Result<usize> {
    let v = get(text, outer, key).with_context(|| format!("config.json: missing field `{key}`"))?;
    v.as_u64().map(|x| x as usize).with_context(|| {
        format!("config.json: field `{key}` must be a non-negative integer, got {v}")
    })
}

fn opt_f64(text: &Value, outer: &Value, key: &str) -> Result<Option<f64>> {
    match get(text, outer, key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .with_context(|| format!("config.json: field `{key}` must be a number, got {v}")),
    }
}

fn opt_bool(text: &Value, outer: &Value, key: &str) -> Result<Option<bool>> {
    match get(text, outer, key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .with_context(|| format!("config.json: field `{key}` must be true or false, got {v}")),
    }
}

fn parse_quant_spec(v: &Value, what: &str) -> Result<Option<QuantSpec>> {
    if v == &Value::Bool(false) || v.is_null() {
        return Ok(None);
    }
    let bits = v
        .get("bits")
        .and_then(Value::as_u64)
        .with_context(|| format!("config.json: quantization {what}: missing integer `bits`"))?;
    let gs = v
        .get("group_size")
        .and_then(Value::as_u64)
        .with_context(|| {
            format!("config.json: quantization {what}: missing integer `group_size`")
        })?;
    if let Some(mode) = v.get("mode").and_then(Value::as_str) {
        if mode != "affine" {
            bail!(
                "config.json: quantization {what}: mode `{mode}` is not supported (only `affine`)"
            );
        }
    }
    if bits != 4 && bits != 8 {
        bail!("config.json: quantization {what}: {bits}-bit is not supported (4 or 8)");
    }
    if gs != 64 {
        bail!("config.json: quantization {what}: group_size {gs} is not supported (64)");
    }
    Ok(Some(QuantSpec {
        bits: bits as u32,
        group_size: gs as usize,
    }))
}

impl Quantization {
    fn from_json(v: Option<&Value>) -> Result<Self> {
        let Some(v) = v else {
            return Ok(Self::default());
        };
        let Some(obj) = v.as_object() else {
            bail!("config.json: `quantization` must be an object")
        };
        let default = parse_quant_spec(v, "defaults")?;
        let mut overrides = BTreeMap::new();
        for (k, val) in obj {
            if matches!(k.as_str(), "bits" | "group_size" | "mode") {
                continue;
            }
            if val.is_object() || val == &Value::Bool(false) {
                overrides.insert(
                    normalize_module_path(k),
                    parse_quant_spec(val, &format!("override `{k}`"))?,
                );
            }
        }
        Ok(Self { default, overrides })
    }

    fn to_json(&self, prefix: &str) -> Value {
        let mut m = serde_json::Map::new();
        if let Some(d) = self.default {
            m.insert("group_size".into(), d.group_size.into());
            m.insert("bits".into(), d.bits.into());
            m.insert("mode".into(), "affine".into());
        }
        for (k, o) in &self.overrides {
            let key = format!("{prefix}{k}");
            m.insert(
                key,
                match o {
                    Some(s) => serde_json::json!({"group_size": s.group_size, "bits": s.bits}),
                    None => Value::Bool(false),
                },
            );
        }
        Value::Object(m)
    }
}

impl Config {
    /// Reads and checks `DIR/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let p = dir.join("config.json");
        let text =
            std::fs::read_to_string(&p).with_context(|| format!("{}: cannot read", p.display()))?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: not valid JSON", p.display()))?;
        Self::from_json(&v)
    }

    /// Parses a config (nested `text_config` or flat) and checks every supported value.
    pub fn from_json(outer: &Value) -> Result<Self> {
        let text = outer.get("text_config").unwrap_or(outer);
        let model_type = get(text, outer, "model_type")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let outer_type = outer
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or("");
        let ok_types = ["qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"];
        if !ok_types.contains(&model_type.as_str()) && !ok_types.contains(&outer_type) {
            bail!(
                "config.json: model_type `{}` is not supported (lily runs qwen3_5_moe: Qwen3.5/3.6-MoE)",
                if model_type.is_empty() { outer_type } else { &model_type }
            );
        }
        let rope = get(text, outer, "rope_parameters")
            .cloned()
            .unwrap_or(Value::Null);
        let rope_f = |k: &str| -> Result<Option<f64>> {
            match rope.get(k) {
                Some(v) => v
                    .as_f64()
                    .map(Some)
                    .with_context(|| format!("config.json: rope_parameters.{k} must be a number")),
                None => opt_f64(text, outer, k),
            }
        };
        let hidden_size = req_usize(text, outer, "hidden_size")?;
        let num_hidden_layers = req_usize(text, outer, "num_hidden_layers")?;
        let num_attention_heads = req_usize(text, outer, "num_attention_heads")?;
        let head_dim = match get(text, outer, "head_dim") {
            Some(_) => req_usize(text, outer, "head_dim")?,
            None => hidden_size / num_attention_heads.max(1),
        };
        let full_attention_interval = match get(text, outer, "full_attention_interval") {
            Some(_) => req_usize(text, outer, "full_attention_interval")?,
            None => 4,
        };
        let layer_is_attention = match get(text, outer, "layer_types") {
            Some(Value::Array(a)) => {
                let mut out = Vec::with_capacity(a.len());
                for (i, t) in a.iter().enumerate() {
                    out.push(match t.as_str() {
                        Some("full_attention") => true,
                        Some("linear_attention") => false,
                        _ => bail!("config.json: layer_types[{i}] = {t} is not `full_attention` or `linear_attention`"),
                    });
                }
                out
            }
            _ => (0..num_hidden_layers)
                .map(|i| (i + 1) % full_attention_interval.max(1) == 0)
                .collect(),
        };
        let c = Config {
            model_type: if model_type.is_empty() {
                outer_type.to_string()
            } else {
                model_type
            },
            hidden_size,
            num_hidden_layers,
            full_attention_interval,
            num_attention_heads,
            num_key_value_heads: req_usize(text, outer, "num_key_value_heads")?,
            head_dim,
            attn_output_gate: opt_bool(text, outer, "attn_output_gate")?.unwrap_or(true),
            partial_rotary_factor: rope_f("partial_rotary_factor")?.unwrap_or(0.25),
            rope_theta: rope_f("rope_theta")?.unwrap_or(10_000_000.0),
            rms_norm_eps: opt_f64(text, outer, "rms_norm_eps")?.unwrap_or(1e-6),
            linear_num_key_heads: req_usize(text, outer, "linear_num_key_heads")?,
            linear_num_value_heads: req_usize(text, outer, "linear_num_value_heads")?,
            linear_key_head_dim: req_usize(text, outer, "linear_key_head_dim")?,
            linear_value_head_dim: req_usize(text, outer, "linear_value_head_dim")?,
            linear_conv_kernel_dim: req_usize(text, outer, "linear_conv_kernel_dim")?,
            num_experts: req_usize(text, outer, "num_experts")?,
            num_experts_per_tok: req_usize(text, outer, "num_experts_per_tok")?,
            moe_intermediate_size: req_usize(text, outer, "moe_intermediate_size")?,
            shared_expert_intermediate_size: req_usize(
                text,
                outer,
                "shared_expert_intermediate_size",
            )?,
            vocab_size: req_usize(text, outer, "vocab_size")?,
            tie_word_embeddings: opt_bool(text, outer, "tie_word_embeddings")?.unwrap_or(false),
            max_position_embeddings: match get(text, outer, "max_position_embeddings") {
                Some(_) => req_usize(text, outer, "max_position_embeddings")?,
                None => 262_144,
            },
            norm_topk_prob: opt_bool(text, outer, "norm_topk_prob")?.unwrap_or(true),
            layer_is_attention,
            quantization: Quantization::from_json(
                outer
                    .get("quantization")
                    .or_else(|| outer.get("quantization_config")),
            )?,
        };
        c.validate()?;
        Ok(c)
    }

    /// Checks that the engine supports these values; one line naming the field otherwise.
    pub fn validate(&self) -> Result<()> {
        let nz = [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("linear_num_key_heads", self.linear_num_key_heads),
            ("linear_num_value_heads", self.linear_num_value_heads),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
            ("num_experts", self.num_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("moe_intermediate_size", self.moe_intermediate_size),
            (
                "shared_expert_intermediate_size",
                self.shared_expert_intermediate_size,
            ),
            ("vocab_size", self.vocab_size),
        ];
        for (k, v) in nz {
            if v == 0 {
                bail!("config.json: `{k}` must be positive");
            }
        }
        if self.layer_is_attention.len() != self.num_hidden_layers {
            bail!(
                "config.json: layer_types lists {} layers but num_hidden_layers is {}",
                self.layer_is_attention.len(),
                self.num_hidden_layers
            );
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            bail!("config.json: num_attention_heads ({}) must be a multiple of num_key_value_heads ({})", self.num_attention_heads, self.num_key_value_heads);
        }
        if self.linear_num_value_heads % self.linear_num_key_heads != 0 {
            bail!(
                "config.json: linear_num_value_heads ({}) must be a multiple of linear_num_key_heads ({})",
                self.linear_num_value_heads,
                self.linear_num_key_heads
            );
        }
        if self.num_experts_per_tok > self.num_experts {
            bail!(
                "config.json: num_experts_per_tok ({}) exceeds num_experts ({})",
                self.num_experts_per_tok,
                self.num_experts
            );
        }
        if !self.attn_output_gate {
            bail!("config.json: attn_output_gate = false is not supported (Qwen3.5/3.6 gate every attention head)");
        }
        if self.tie_word_embeddings {
            bail!("config.json: tie_word_embeddings = true is not supported (Qwen3.6-35B-A3B has a separate lm_head)");
        }
        let rot = self.rotary_dim();
        if rot == 0 || rot % 2 != 0 || rot > self.head_dim {
            bail!("config.json: partial_rotary_factor {} gives {rot} rotary dims of {}: must be even and ≤ head_dim", self.partial_rotary_factor, self.head_dim);
        }
        if self.linear_conv_kernel_dim < 2 {
            bail!("config.json: linear_conv_kernel_dim must be at least 2");
        }
        // Every matrix's input dim must split into whole quantization groups and whole packed words.
        if let Some(q) = self.quantization.default {
            for (k, v) in [
                ("hidden_size", self.hidden_size),
                ("moe_intermediate_size", self.moe_intermediate_size),
                (
                    "shared_expert_intermediate_size",
                    self.shared_expert_intermediate_size,
                ),
                (
                    "num_attention_heads*head_dim",
                    self.num_attention_heads * self.head_dim,
                ),
                (
                    "linear_num_value_heads*linear_value_head_dim",
                    self.linear_num_value_heads * self.linear_value_head_dim,
                ),
            ] {
                if v % q.group_size != 0 {
                    bail!("config.json: {k} = {v} is not a multiple of the quantization group size {}", q.group_size);
                }
            }
        }
        Ok(())
    }

    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor).round() as usize
    }
    /// Width of the GDN `in_proj_qkv` output: q | k | v.
    pub fn gdn_qkv_dim(&self) -> usize {
        2 * self.linear_num_key_heads * self.linear_key_head_dim + self.gdn_v_dim()
    }
    pub fn gdn_k_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }
    pub fn gdn_v_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }
    pub fn attn_q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }
    pub fn attn_kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }
    pub fn num_attention_layers(&self) -> usize {
        self.layer_is_attention.iter().filter(|&&a| a).count()
    }

    /// Writes the config as the published checkpoint does: nested `text_config`, `rope_parameters`,
    /// `quantization` (and its copy `quantization_config`) with overrides spelled
    /// `language_model.model.layers.N…`.
    pub fn to_json(&self) -> Value {
        let layer_types: Vec<&str> = self
            .layer_is_attention
            .iter()
            .map(|&a| {
                if a {
                    "full_attention"
                } else {
                    "linear_attention"
                }
            })
            .collect();
        let text = serde_json::json!({
            "model_type": "qwen3_5_moe_text",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "full_attention_interval": self.full_attention_interval,
            "layer_types": layer_types,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "attn_output_gate": self.attn_output_gate,
            "rms_norm_eps": self.rms_norm_eps,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "mtp_num_hidden_layers": 0,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": true
            },
            "eos_token_id": 248044,
        });
        let mut outer = serde_json::json!({
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "text_config": text,
            "tie_word_embeddings": self.tie_word_embeddings,
        });
        if self.quantization.default.is_some() {
            let q = self.quantization.to_json("language_model.");
            outer["quantization"] = q.clone();
            outer["quantization_config"] = q;
        }
        outer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn published_like() -> Value {
        serde_json::json!({
            "model_type": "qwen3_5_moe",
            "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
                "language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
                "model.language_model.layers.1.mlp.shared_expert_gate": {"group_size": 64, "bits": 8},
                "language_model.model.layers.2.mlp.gate": false},
            "text_config": {
                "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
                "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2,
                "head_dim": 256, "attn_output_gate": true, "rms_norm_eps": 1e-6,
                "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256,
                "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                "vocab_size": 248320, "tie_word_embeddings": false, "max_position_embeddings": 262144,
                "rope_parameters": {"rope_theta": 10000000, "partial_rotary_factor": 0.25, "mrope_section": [11,11,10]}
            }
        })
    }

    #[test]
    fn parses_nested_published_config() {
        let c = Config::from_json(&published_like()).unwrap();
        assert_eq!(c.num_attention_layers(), 10);
        assert!(c.layer_is_attention[3] && c.layer_is_attention[39] && !c.layer_is_attention[0]);
        assert_eq!(c.rotary_dim(), 64);
        assert_eq!(c.gdn_qkv_dim(), 8192);
        assert_eq!(c.rope_theta, 1e7);
        let q = &c.quantization;
        assert_eq!(
            q.spec_for("language_model.model.layers.0.mlp.gate")
                .unwrap()
                .bits,
            8
        );
        assert_eq!(
            q.spec_for("model.layers.1.mlp.shared_expert_gate")
                .unwrap()
                .bits,
            8
        );
        assert_eq!(q.spec_for("model.layers.2.mlp.gate"), None);
        assert_eq!(q.spec_for("model.layers.5.mlp.gate").unwrap().bits, 4);
    }

    #[test]
    fn flat_config_and_round_trip() {
        let c = Config::from_json(&published_like()).unwrap();
        let again = Config::from_json(&c.to_json()).unwrap();
        assert_eq!(c, again);
        // Flat: the text fields at the top level.
        let mut flat = published_like()["text_config"].clone();
        flat["model_type"] = "qwen3_5_moe".into();
        let f = Config::from_json(&flat).unwrap();
        assert_eq!(f.hidden_size, 2048);
        assert_eq!(f.quantization.default, None);
    }

    #[test]
    fn unsupported_values_are_one_line_errors() {
        for (field, val, needle) in [
            ("model_type", Value::from("llama"), "model_type"),
            ("num_attention_heads", Value::from(3), "num_key_value_heads"),
            ("hidden_size", Value::from("big"), "hidden_size"),
            (
                "linear_conv_kernel_dim",
                Value::from(1),
                "linear_conv_kernel_dim",
            ),
        ] {
            let mut v = published_like();
            if field == "model_type" {
                v["model_type"] = val.clone();
                v["text_config"]["model_type"] = val;
            } else {
                v["text_config"][field] = val;
            }
            let e = format!("{:#}", Config::from_json(&v).unwrap_err());
            assert!(e.contains(needle), "{e}");
            assert!(!e.contains('\n'), "{e}");
        }
        let mut v = published_like();
        v["quantization"]["bits"] = 3.into();
        assert!(format!("{:#}", Config::from_json(&v).unwrap_err()).contains("3-bit"));
        let mut v = published_like();
        v["text_config"]
            .as_object_mut()
            .unwrap()
            .remove("vocab_size");
        assert!(format!("{:#}", Config::from_json(&v).unwrap_err()).contains("vocab_size"));
    }
}
