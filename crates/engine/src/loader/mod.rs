//! Checkpoint loading: safetensors (memory-mapped), MLX affine quantization, name mapping and the
//! load-time fixes ("sanitize") of MODEL.md.
//!
//! Every tensor the config implies is checked for presence, dtype and shape before anything runs;
//! a problem is a one-line error naming the tensor (or file) and what was expected.
//!
//! Accepted:
//! - MLX checkpoints (`language_model.model.…`, `language_model.lm_head`), quantized (4/8-bit,
//!   bf16/f16/f32 scales) or not, single file or sharded;
//! - flat text-only names (`model.…`, `lm_head`) and Hugging Face names (`model.language_model.…`);
//! - Hugging Face layout of the conv (`[C, 1, K]`) which also means the five zero-centred norms are
//!   stored as `w` and need `1 + w`; the fused HF experts (`mlp.experts.gate_up_proj`,
//!   `mlp.experts.down_proj`) are split at load.
//!
//! Vision tensors and the multi-token-prediction head (`mtp.`) are skipped.

pub mod safetensors;
pub mod tensor;

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::config::Config;
use tensor::{Dtype, HostLinear, HostTensor, LinearKind};

/// One Gated DeltaNet (`linear_attn`) layer's weights.
#[derive(Clone, Debug)]
pub struct GdnWeights {
    pub in_proj_qkv: HostLinear,
    pub in_proj_z: HostLinear,
    pub in_proj_b: HostLinear,
    pub in_proj_a: HostLinear,
    /// `[C, K]` f32 (MLX stores `[C, K, 1]`); `conv[c*K + K-1]` multiplies the current token.
    pub conv1d: Vec<f32>,
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    /// Gated RMS norm weight over the value head dim (never shifted).
    pub norm: Vec<f32>,
    pub out_proj: HostLinear,
}

/// One gated full-attention (`self_attn`) layer's weights.
#[derive(Clone, Debug)]
pub struct AttnWeights {
    pub q_proj: HostLinear,
    pub k_proj: HostLinear,
    pub v_proj: HostLinear,
    pub o_proj: HostLinear,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

#[derive(Clone, Debug)]
pub enum Mixer {
    Gdn(GdnWeights),
    Attn(AttnWeights),
}

/// The MoE block: router, stacked routed experts, shared expert and its gate.
#[derive(Clone, Debug)]
pub struct MoeWeights {
    pub router: HostLinear,
    pub gate_proj: HostLinear,
    pub up_proj: HostLinear,
    pub down_proj: HostLinear,
    pub shared_gate_proj: HostLinear,
    pub shared_up_proj: HostLinear,
    pub shared_down_proj: HostLinear,
    pub shared_expert_gate: HostLinear,
}

#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    pub mixer: Mixer,
    pub moe: MoeWeights,
}

/// All weights of the text model, as host (memory-mapped) tensors.
#[derive(Clone, Debug)]
pub struct HostWeights {
    pub embed: HostLinear,
    pub layers: Vec<LayerWeights>,
    pub norm: Vec<f32>,
    pub lm_head: HostLinear,
}

impl HostWeights {
    /// Bytes of weights one decoded token reads (for bandwidth figures): every non-expert matrix,
    /// `k + 1` experts per layer, one embedding row, the lm_head.
    pub fn decode_bytes_per_token(&self, cfg: &Config) -> u64 {
        let mut b = self.lm_head.nbytes() as u64 + (self.embed.nbytes() / cfg.vocab_size) as u64;
        for l in &self.layers {
            b += match &l.mixer {
                Mixer::Gdn(g) => [
                    &g.in_proj_qkv,
                    &g.in_proj_z,
                    &g.in_proj_b,
                    &g.in_proj_a,
                    &g.out_proj,
                ]
                .iter()
                .map(|m| m.nbytes() as u64)
                .sum::<u64>(),
                Mixer::Attn(a) => [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj]
                    .iter()
                    .map(|m| m.nbytes() as u64)
                    .sum(),
            };
            let m = &l.moe;
            let per_expert =
                (m.gate_proj.nbytes() + m.up_proj.nbytes() + m.down_proj.nbytes()) / m.gate_proj.n;
            b += (per_expert * cfg.num_experts_per_tok) as u64;
            b += [
                &m.router,
                &m.shared_gate_proj,
                &m.shared_up_proj,
                &m.shared_down_proj,
                &m.shared_expert_gate,
            ]
            .iter()
            .map(|m| m.nbytes() as u64)
            .sum::<u64>();
        }
        b
    }
}

/// A loaded checkpoint: its config and weights.
pub struct Checkpoint {
    pub config: Config,
    pub weights: HostWeights,
}

/// Maps a stored name to the canonical text-model name (`model.…` / `lm_head.…`), or `None` for
/// tensors a text-only engine skips (vision tower, MTP head).
fn canonical_name(name: &str) -> Option<String> {
    if name.contains("mtp.")
        || name.contains("visual")
        || name.contains("vision_tower")
        || name.contains("multi_modal_projector")
    {
        return None;
    }
    let n = crate::config::normalize_module_path(name);
    if n.starts_with("model.") || n.starts_with("lm_head.") {
        Some(n)
    } else {
        None
    }
}

struct Tensors {
    map: HashMap<String, HostTensor>,
    cfg: Config,
    /// Raw Hugging Face layout: norms need `1 + w`.
    hf_layout: bool,
}

fn shape_str(s: &[usize]) -> String {
    format!("{s:?}")
}

impl Tensors {
    fn take(&self, name: &str) -> Result<&HostTensor> {
        self.map
            .get(name)
            .with_context(|| format!("checkpoint: missing tensor `{name}`"))
    }

    fn expect(&self, name: &str, shape: &[usize], float: bool) -> Result<&HostTensor> {
        let t = self.take(name)?;
        if t.shape != shape {
            bail!(
                "checkpoint: tensor `{name}` has shape {} but the config implies {}",
                shape_str(&t.shape),
                shape_str(shape)
            );
        }
        if float && !matches!(t.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
            bail!(
                "checkpoint: tensor `{name}` has dtype {} but a float (BF16/F16/F32) is expected",
                t.dtype.name()
            );
        }
        Ok(t)
    }

    /// A float vector of `len` (norm, bias, gate parameter) as f32.
    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        self.expect(name, &[len], true)?.to_f32_vec()
    }

    /// A zero-centred RMS norm weight: stored as `1 + w` by MLX, as `w` by Hugging Face.
    fn norm(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let mut v = self.vector(name, len)?;
        if self.hf_layout {
            v.iter_mut().for_each(|x| *x += 1.0);
        }
        Ok(v)
    }

    /// A linear layer `module` with `n` stacked matrices (None = a plain `[out, in]` matrix).
    fn linear(&self, module: &str, n: Option<usize>, out: usize, inp: usize) -> Result<HostLinear> {
        let lead: Vec<usize> = n.into_iter().collect();
        let dims = |last: usize, rows: usize| -> Vec<usize> {
            lead.iter().copied().chain([rows, last]).collect()
        };
        let wname = format!("{module}.weight");
        let sname = format!("{module}.scales");
        let kind = if self.map.contains_key(&sname) {
            let spec = self.cfg.quantization.spec_for(module).with_context(|| {
                format!("checkpoint: `{sname}` exists but config.json has no quantization for `{module}` (add a `quantization` block)")
            })?;
            let w = self.take(&wname)?;
            if w.dtype != Dtype::U32 {
                bail!(
                    "checkpoint: tensor `{wname}` has dtype {} but a quantized weight is U32",
                    w.dtype.name()
                );
            }
            let packed = inp * spec.bits as usize / 32;
            if w.shape != dims(packed, out) {
                let stored_bits = w.shape.last().map(|c| c * 32 / inp.max(1)).unwrap_or(0);
                bail!(
                    "checkpoint: tensor `{wname}` has shape {} but {}-bit quantization of [{out}, {inp}] implies {} (stored as {stored_bits}-bit? check the quantization overrides)",
                    shape_str(&w.shape),
                    spec.bits,
                    shape_str(&dims(packed, out))
                );
            }
            let groups = inp / spec.group_size;
            let scales = self.expect(&sname, &dims(groups, out), true)?;
            let biases = self.expect(&format!("{module}.biases"), &dims(groups, out), true)?;
            LinearKind::Quant {
                bits: spec.bits,
                group_size: spec.group_size,
                w: w.clone().aligned(),
                scales: scales.clone().aligned(),
                biases: biases.clone().aligned(),
            }
        } else if self.map.contains_key(&wname) {
            LinearKind::Dense(
                self.expect(&wname, &dims(inp, out), true)?
                    .clone()
                    .aligned(),
            )
        } else {
            bail!("checkpoint: missing tensor `{wname}`");
        };
        Ok(HostLinear {
            name: module.to_string(),
            n: n.unwrap_or(1),
            out,
            inp,
            kind,
        })
    }

    /// Routed experts: MLX stacks them (`switch_mlp.P` [E, out, in]); the Hugging Face release
    /// fuses gate and up (`experts.gate_up_proj` [E, 2·I, H], gate rows first) and stores
    /// `experts.down_proj` [E, H, I]: those are split (copied, unquantized only) at load.
    fn experts(&self, mlp: &str, proj: &str, out: usize, inp: usize) -> Result<HostLinear> {
        let stacked = format!("{mlp}.switch_mlp.{proj}");
        let e = self.cfg.num_experts;
        if self.map.contains_key(&format!("{stacked}.weight")) {
            return self.linear(&stacked, Some(e), out, inp);
        }
        let (src, rows) = match proj {
            "down_proj" => (format!("{mlp}.experts.down_proj"), 0..out),
            "gate_proj" => (format!("{mlp}.experts.gate_up_proj"), 0..out),
            _ => (format!("{mlp}.experts.gate_up_proj"), out..2 * out),
        };
        if !self.map.contains_key(&src) {
            bail!("checkpoint: missing tensor `{stacked}.weight` (MLX stacked experts) or `{src}` (Hugging Face fused experts)");
        }
        let full_rows = if proj == "down_proj" { out } else { 2 * out };
        let all = self
            .expect(&src, &[e, full_rows, inp], true)?
            .to_f32_vec()?;
        let mut data = Vec::with_capacity(e * out * inp);
        for j in 0..e {
            data.extend_from_slice(
                &all[(j * full_rows + rows.start) * inp..(j * full_rows + rows.end) * inp],
            );
        }
        Ok(HostLinear {
            name: stacked.clone(),
            n: e,
            out,
            inp,
            kind: LinearKind::Dense(HostTensor::from_f32(
                &format!("{stacked}.weight"),
                vec![e, out, inp],
                data,
            )),
        })
    }
}

impl Checkpoint {
    /// Opens, maps and checks a checkpoint directory.
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            bail!(
                "{}: not a directory (expected a checkpoint with config.json and *.safetensors)",
                dir.display()
            );
        }
        let config = Config::from_dir(dir)?;
        let raw = safetensors::read_dir(dir)?;
        let mut map = HashMap::with_capacity(raw.len());
        for (name, mut t) in raw {
            if let Some(c) = canonical_name(&name) {
                t.name = c.clone();
                if let Some(prev) = map.insert(c.clone(), t) {
                    bail!(
                        "checkpoint: tensor `{c}` is stored twice (as `{}` and `{name}`)",
                        prev.name
                    );
                }
            }
        }
        let weights = build(&config, map)?;
        Ok(Self { config, weights })
    }
}

fn build(cfg: &Config, map: HashMap<String, HostTensor>) -> Result<HostWeights> {
    let c = cfg;
    let h = c.hidden_size;
    // The conv weight's layout tells the convention: MLX `[C, K, 1]`, Hugging Face `[C, 1, K]`.
    let first_gdn = c.layer_is_attention.iter().position(|a| !a);
    let hf_layout = match first_gdn {
        Some(i) => {
            let name = format!("model.layers.{i}.linear_attn.conv1d.weight");
            let t = map
                .get(&name)
                .with_context(|| format!("checkpoint: missing tensor `{name}`"))?;
            let (cdim, k) = (c.gdn_qkv_dim(), c.linear_conv_kernel_dim);
            if t.shape == [cdim, k, 1] {
                false
            } else if t.shape == [cdim, 1, k] {
                true
            } else {
                bail!("checkpoint: tensor `{name}` has shape {:?}; expected [{cdim}, {k}, 1] (MLX) or [{cdim}, 1, {k}] (Hugging Face)", t.shape);
            }
        }
        None => false,
    };
    let t = Tensors {
        map,
        cfg: cfg.clone(),
        hf_layout,
    };
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let mixer = if c.layer_is_attention[i] {
            let a = format!("{p}.self_attn");
            Mixer::Attn(AttnWeights {
                q_proj: t.linear(&format!("{a}.q_proj"), None, 2 * c.attn_q_dim(), h)?,
                k_proj: t.linear(&format!("{a}.k_proj"), None, c.attn_kv_dim(), h)?,
                v_proj: t.linear(&format!("{a}.v_proj"), None, c.attn_kv_dim(), h)?,
                o_proj: t.linear(&format!("{a}.o_proj"), None, h, c.attn_q_dim())?,
                q_norm: t.norm(&format!("{a}.q_norm.weight"), c.head_dim)?,
                k_norm: t.norm(&format!("{a}.k_norm.weight"), c.head_dim)?,
            })
        } else {
            let g = format!("{p}.linear_attn");
            let (cdim, k) = (c.gdn_qkv_dim(), c.linear_conv_kernel_dim);
            let conv_name = format!("{g}.conv1d.weight");
            let conv = t.take(&conv_name)?;
            let want = if hf_layout {
                vec![cdim, 1, k]
            } else {
                vec![cdim, k, 1]
            };
            if conv.shape != want {
                bail!(
                    "checkpoint: tensor `{conv_name}` has shape {:?} but {:?} is expected",
                    conv.shape,
                    want
                );
            }
            Mixer::Gdn(GdnWeights {
                in_proj_qkv: t.linear(&format!("{g}.in_proj_qkv"), None, cdim, h)?,
                in_proj_z: t.linear(&format!("{g}.in_proj_z"), None, c.gdn_v_dim(), h)?,
                in_proj_b: t.linear(
                    &format!("{g}.in_proj_b"),
                    None,
                    c.linear_num_value_heads,
                    h,
                )?,
                in_proj_a: t.linear(
                    &format!("{g}.in_proj_a"),
                    None,
                    c.linear_num_value_heads,
                    h,
                )?,
                // [C, K, 1] and [C, 1, K] have the same element order: c major, k minor.
                conv1d: conv.to_f32_vec()?,
                a_log: t.vector(&format!("{g}.A_log"), c.linear_num_value_heads)?,
                dt_bias: t.vector(&format!("{g}.dt_bias"), c.linear_num_value_heads)?,
                norm: t.vector(&format!("{g}.norm.weight"), c.linear_value_head_dim)?,
                out_proj: t.linear(&format!("{g}.out_proj"), None, h, c.gdn_v_dim())?,
            })
        };
        let m = format!("{p}.mlp");
        let (ei, si) = (c.moe_intermediate_size, c.shared_expert_intermediate_size);
        let moe = MoeWeights {
            router: t.linear(&format!("{m}.gate"), None, c.num_experts, h)?,
            gate_proj: t.experts(&m, "gate_proj", ei, h)?,
            up_proj: t.experts(&m, "up_proj", ei, h)?,
            down_proj: t.experts(&m, "down_proj", h, ei)?,
            shared_gate_proj: t.linear(&format!("{m}.shared_expert.gate_proj"), None, si, h)?,
            shared_up_proj: t.linear(&format!("{m}.shared_expert.up_proj"), None, si, h)?,
            shared_down_proj: t.linear(&format!("{m}.shared_expert.down_proj"), None, h, si)?,
            shared_expert_gate: t.linear(&format!("{m}.shared_expert_gate"), None, 1, h)?,
        };
        layers.push(LayerWeights {
            input_norm: t.norm(&format!("{p}.input_layernorm.weight"), h)?,
            post_norm: t.norm(&format!("{p}.post_attention_layernorm.weight"), h)?,
            mixer,
            moe,
        });
    }
    Ok(HostWeights {
        embed: t.linear("model.embed_tokens", None, c.vocab_size, h)?,
        layers,
        norm: t.norm("model.norm.weight", h)?,
        lm_head: t.linear("lm_head", None, c.vocab_size, h)?,
    })
}
