//! Which tensors a config implies (MLX names, dtypes, shapes), how they are sharded, and the
//! safetensors headers. Everything here is known before a single weight is generated, so each
//! file's header is written first and the data streamed into place.

use std::collections::BTreeMap;

use crate::config::{Config, QuantSpec};

use super::plan::{
    Gen, Plan, QK_NORM_LEVEL, RMS_ATTN_OUT, RMS_GDN_OUT, RMS_SWIGLU, ROUTED_SHARE,
    SHARED_GATE_OFFSET, SHARED_SHARE,
};
use super::rng::name_id;

/// Element type of a stored tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StDtype {
    U32,
    F32,
    BF16,
}

impl StDtype {
    pub fn size(self) -> usize {
        match self {
            Self::U32 | Self::F32 => 4,
            Self::BF16 => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::U32 => "U32",
            Self::F32 => "F32",
            Self::BF16 => "BF16",
        }
    }
}

/// One logical parameter: a (possibly stacked) linear layer, or a vector-like tensor.
#[derive(Clone, Debug)]
pub struct Module {
    /// MLX module path (`language_model.model.layers.0.mlp.gate`), or for a plain tensor its full
    /// name (`language_model.model.norm.weight`).
    pub path: String,
    pub id: u64,
    pub gen: Gen,
    /// Rows to generate (all stacked matrices together) and values per row.
    pub rows: usize,
    pub cols: usize,
    pub kind: Kind,
}

#[derive(Clone, Debug)]
pub enum Kind {
    /// A linear layer `[n?, out, in]`: quantized (`weight`, `scales`, `biases`) or bf16 `weight`.
    Linear {
        lead: Option<usize>,
        out: usize,
        quant: Option<QuantSpec>,
    },
    /// A plain tensor of this shape and dtype (norms, conv, A_log, dt_bias).
    Plain { shape: Vec<usize>, dtype: StDtype },
}

/// One tensor as stored in a file.
#[derive(Clone, Debug)]
pub struct Stored {
    pub name: String,
    pub dtype: StDtype,
    pub shape: Vec<usize>,
    /// Index into the module list, and which part: 0 = weight / plain, 1 = scales, 2 = biases.
    pub module: usize,
    pub part: usize,
}

impl Stored {
    pub fn bytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.size() as u64
    }
}

impl Module {
    /// The tensors this module stores.
    pub fn stored(&self, index: usize) -> Vec<Stored> {
        match &self.kind {
            Kind::Plain { shape, dtype } => vec![Stored {
                name: self.path.clone(),
                dtype: *dtype,
                shape: shape.clone(),
                module: index,
                part: 0,
            }],
            Kind::Linear { lead, out, quant } => {
                let dims = |last: usize| -> Vec<usize> {
                    lead.iter().copied().chain([*out, last]).collect()
                };
                match quant {
                    None => vec![Stored {
                        name: format!("{}.weight", self.path),
                        dtype: StDtype::BF16,
                        shape: dims(self.cols),
                        module: index,
                        part: 0,
                    }],
                    Some(q) => vec![
                        Stored {
                            name: format!("{}.weight", self.path),
                            dtype: StDtype::U32,
                            shape: dims(self.cols * q.bits as usize / 32),
                            module: index,
                            part: 0,
                        },
                        Stored {
                            name: format!("{}.scales", self.path),
                            dtype: StDtype::BF16,
                            shape: dims(self.cols / q.group_size),
                            module: index,
                            part: 1,
                        },
                        Stored {
                            name: format!("{}.biases", self.path),
                            dtype: StDtype::BF16,
                            shape: dims(self.cols / q.group_size),
                            module: index,
                            part: 2,
                        },
                    ],
                }
            }
        }
    }
}

/// Every parameter of the text model for `cfg`, in model order.
pub fn modules(cfg: &Config, plan: &Plan) -> Vec<Module> {
    let c = cfg;
    let d = c.hidden_size;
    let sqd = (d as f32).sqrt();
    let res = plan.sublayer_rms;
    let mut v = Vec::new();
    let lin = |v: &mut Vec<Module>,
               path: String,
               lead: Option<usize>,
               out: usize,
               inp: usize,
               gen: Gen| {
        let quant = c.quantization.spec_for(&path);
        v.push(Module {
            id: name_id(&path),
            gen,
            rows: lead.unwrap_or(1) * out,
            cols: inp,
            kind: Kind::Linear { lead, out, quant },
            path,
        });
    };
    let plain = |v: &mut Vec<Module>, path: String, shape: Vec<usize>, dtype: StDtype, gen: Gen| {
        let cols = *shape.get(1).unwrap_or(&shape[0]);
        let rows = if shape.len() > 1 { shape[0] } else { 1 };
        v.push(Module {
            id: name_id(&path),
            gen,
            rows,
            cols,
            kind: Kind::Plain { shape, dtype },
            path,
        });
    };
    let input = |std: f32| Gen::Dense {
        std,
        writer: false,
        out: 1,
    };
    let writer = |std: f32, out: usize| Gen::Dense {
        std,
        writer: true,
        out,
    };
    let norm1 = Gen::Norm { level: 1.0 };

    lin(
        &mut v,
        "language_model.model.embed_tokens".into(),
        None,
        c.vocab_size,
        d,
        Gen::Embed,
    );
    for l in 0..c.num_hidden_layers {
        let p = format!("language_model.model.layers.{l}");
        plain(
            &mut v,
            format!("{p}.input_layernorm.weight"),
            vec![d],
            StDtype::BF16,
            norm1,
        );
        if c.layer_is_attention[l] {
            let a = format!("{p}.self_attn");
            let (qd, kvd, hd) = (c.attn_q_dim(), c.attn_kv_dim(), c.head_dim);
            lin(
                &mut v,
                format!("{a}.q_proj"),
                None,
                2 * qd,
                d,
                input(1.0 / sqd),
            );
            lin(
                &mut v,
                format!("{a}.k_proj"),
                None,
                kvd,
                d,
                input(1.0 / sqd),
            );
            lin(
                &mut v,
                format!("{a}.v_proj"),
                None,
                kvd,
                d,
                input(1.0 / sqd),
            );
            lin(
                &mut v,
                format!("{a}.o_proj"),
                None,
                d,
                qd,
                writer(res / (RMS_ATTN_OUT * (qd as f32).sqrt()), d),
            );
            plain(
                &mut v,
                format!("{a}.q_norm.weight"),
                vec![hd],
                StDtype::BF16,
                Gen::Norm {
                    level: QK_NORM_LEVEL,
                },
            );
            plain(
                &mut v,
                format!("{a}.k_norm.weight"),
                vec![hd],
                StDtype::BF16,
                Gen::Norm {
                    level: QK_NORM_LEVEL,
                },
            );
        } else {
            let g = format!("{p}.linear_attn");
            let (cd, vd, hv, k) = (
                c.gdn_qkv_dim(),
                c.gdn_v_dim(),
                c.linear_num_value_heads,
                c.linear_conv_kernel_dim,
            );
            lin(
                &mut v,
                format!("{g}.in_proj_qkv"),
                None,
                cd,
                d,
                input(1.0 / sqd),
            );
            lin(
                &mut v,
                format!("{g}.in_proj_z"),
                None,
                vd,
                d,
                input(1.0 / sqd),
            );
            lin(
                &mut v,
                format!("{g}.in_proj_b"),
                None,
                hv,
                d,
                Gen::GdnB { layer: l },
            );
            lin(&mut v, format!("{g}.in_proj_a"), None, hv, d, Gen::GdnA);
            plain(
                &mut v,
                format!("{g}.conv1d.weight"),
                vec![cd, k, 1],
                StDtype::BF16,
                Gen::Conv,
            );
            plain(
                &mut v,
                format!("{g}.A_log"),
                vec![hv],
                StDtype::F32,
                Gen::ALog { layer: l },
            );
            plain(
                &mut v,
                format!("{g}.dt_bias"),
                vec![hv],
                StDtype::BF16,
                Gen::DtBias { layer: l },
            );
            plain(
                &mut v,
                format!("{g}.norm.weight"),
                vec![c.linear_value_head_dim],
                StDtype::BF16,
                norm1,
            );
            lin(
                &mut v,
                format!("{g}.out_proj"),
                None,
                d,
                vd,
                writer(res / (RMS_GDN_OUT * (vd as f32).sqrt()), d),
            );
        }
        plain(
            &mut v,
            format!("{p}.post_attention_layernorm.weight"),
            vec![d],
            StDtype::BF16,
            norm1,
        );
        let m = format!("{p}.mlp");
        let (e, k, f, fs) = (
            c.num_experts,
            c.num_experts_per_tok,
            c.moe_intermediate_size,
            c.shared_expert_intermediate_size,
        );
        lin(
            &mut v,
            format!("{m}.gate"),
            None,
            e,
            d,
            Gen::Router { layer: l },
        );
        lin(
            &mut v,
            format!("{m}.switch_mlp.gate_proj"),
            Some(e),
            f,
            d,
            input(1.0 / sqd),
        );
        lin(
            &mut v,
            format!("{m}.switch_mlp.up_proj"),
            Some(e),
            f,
            d,
            input(1.0 / sqd),
        );
        let routed = res * ROUTED_SHARE * (k as f32).sqrt() / (RMS_SWIGLU * (f as f32).sqrt());
        lin(
            &mut v,
            format!("{m}.switch_mlp.down_proj"),
            Some(e),
            d,
            f,
            writer(routed, d),
        );
        lin(
            &mut v,
            format!("{m}.shared_expert.gate_proj"),
            None,
            fs,
            d,
            input(1.0 / sqd),
        );
        lin(
            &mut v,
            format!("{m}.shared_expert.up_proj"),
            None,
            fs,
            d,
            input(1.0 / sqd),
        );
        let sigmoid_mean = 1.0 / (1.0 + (-SHARED_GATE_OFFSET).exp());
        let shared = res * SHARED_SHARE / (sigmoid_mean * RMS_SWIGLU * (fs as f32).sqrt());
        lin(
            &mut v,
            format!("{m}.shared_expert.down_proj"),
            None,
            d,
            fs,
            writer(shared, d),
        );
        lin(
            &mut v,
            format!("{m}.shared_expert_gate"),
            None,
            1,
            d,
            Gen::SharedGate,
        );
    }
    plain(
        &mut v,
        "language_model.model.norm.weight".into(),
        vec![d],
        StDtype::BF16,
        norm1,
    );
    lin(
        &mut v,
        "language_model.lm_head".into(),
        None,
        c.vocab_size,
        d,
        Gen::LmHead,
    );
    v
}

/// One output file: its tensors with byte offsets relative to the data start.
#[derive(Clone, Debug)]
pub struct Shard {
    pub file: String,
    /// `(stored tensor, offset in the data section)`.
    pub tensors: Vec<(Stored, u64)>,
    /// The header bytes (length prefix, JSON, padding) as written at the start of the file.
    pub header: Vec<u8>,
}

impl Shard {
    pub fn data_bytes(&self) -> u64 {
        self.tensors.iter().map(|(s, _)| s.bytes()).sum()
    }
    pub fn file_bytes(&self) -> u64 {
        self.header.len() as u64 + self.data_bytes()
    }
}

/// Splits the modules into files of at most `max_bytes` (a module never straddles two files) and
/// lays out each file: 4-byte tensors first, so every U32/F32 tensor is 4-byte aligned.
pub fn shards(modules: &[Module], max_bytes: u64) -> Vec<Shard> {
    let mut groups: Vec<Vec<Stored>> = vec![vec![]];
    let mut size = 0u64;
    for (i, m) in modules.iter().enumerate() {
        let st = m.stored(i);
        let b: u64 = st.iter().map(Stored::bytes).sum();
        if size > 0 && size + b > max_bytes {
            groups.push(vec![]);
            size = 0;
        }
        size += b;
        groups.last_mut().unwrap().extend(st);
    }
    let n = groups.len();
    groups
        .into_iter()
        .enumerate()
        .map(|(i, mut g)| {
            g.sort_by_key(|s| std::cmp::Reverse(s.dtype.size()));
            let mut off = 0u64;
            let tensors: Vec<(Stored, u64)> = g
                .into_iter()
                .map(|s| {
                    let o = off;
                    off += s.bytes();
                    (s, o)
                })
                .collect();
            let file = if n == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
            };
            let header = header_bytes(&tensors);
            Shard {
                file,
                tensors,
                header,
            }
        })
        .collect()
}

fn header_bytes(tensors: &[(Stored, u64)]) -> Vec<u8> {
    let mut m = serde_json::Map::new();
    m.insert("__metadata__".into(), serde_json::json!({"format": "mlx"}));
    for (s, off) in tensors {
        m.insert(s.name.clone(), serde_json::json!({"dtype": s.dtype.name(), "shape": s.shape, "data_offsets": [off, off + s.bytes()]}));
    }
    let mut json = serde_json::to_vec(&serde_json::Value::Object(m)).expect("header serializes");
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend(json);
    out
}

/// `model.safetensors.index.json` for several shards.
pub fn index_json(shards: &[Shard]) -> serde_json::Value {
    let mut map = BTreeMap::new();
    let mut total = 0u64;
    for s in shards {
        for (t, _) in &s.tensors {
            map.insert(t.name.clone(), s.file.clone());
            total += t.bytes();
        }
    }
    serde_json::json!({"metadata": {"total_size": total}, "weight_map": map})
}
