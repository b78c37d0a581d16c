//! The conditioned weights: what every row of every tensor holds (see the module doc of
//! `synth/mod.rs` for why each scale is what it is). A [`Plan`] holds the few global choices (the
//! structured dimensions, token clusters, next-token map, per-layer expert sets and GDN gate
//! ranges); [`Plan::fill_row`] produces any row of any tensor from (seed, tensor, row) alone.

use crate::config::Config;

use super::rng::{hash, Rng};

/// Embedding value on the dimension shared by all tokens (the "common" dim: a bias channel).
pub const ZETA_COMMON: f32 = 3.0;
/// Embedding value on a token's cluster dimension.
pub const ZETA_CLUSTER: f32 = 4.0;
/// Router logit added to a token's assigned experts (at unit residual RMS).
pub const ROUTER_BOOST: f32 = 10.0;
/// Popularity bias of the router logits: from +spread (most popular) to −spread.
pub const ROUTER_BIAS_SPREAD: f32 = 1.0;
/// Std of the context-dependent part of the router logits.
pub const ROUTER_NOISE: f32 = 0.3;
/// Next-token logit of a token's successor (at unit residual RMS), and the std of the random
/// background logit each lm_head row adds, as a fraction of it.
pub const LM_BETA: f32 = 14.0;
pub const LM_BACKGROUND: f32 = 0.05;
/// Variance that all sublayers together add to the unit-RMS embedding.
pub const RESIDUAL_BUDGET: f32 = 0.5;
/// Std of the deviation of norm weights from 1.
pub const NORM_JITTER: f32 = 0.02;
/// Stored attention q_norm / k_norm level: sharpens attention (score std ≈ level²).
pub const QK_NORM_LEVEL: f32 = 1.4;
/// Rows of output projections on the structured dims are scaled by this: sublayers (almost)
/// never write into the token's cluster and common coordinates.
pub const WRITER_SD_SCALE: f32 = 0.01;
/// RMS of the inputs of the output projections, per unit-RMS pre-activation, used to size them:
/// silu(g)·u (experts), rms_norm(y)·silu(z) (GDN), attention output · sigmoid(gate).
pub const RMS_SWIGLU: f32 = 0.6;
pub const RMS_GDN_OUT: f32 = 0.56;
pub const RMS_ATTN_OUT: f32 = 0.21;
/// Share of the MoE output variance from the routed experts vs the shared expert.
pub const ROUTED_SHARE: f32 = 0.8;
pub const SHARED_SHARE: f32 = 0.6;
/// Shared expert gate logit offset (sigmoid(0.5) ≈ 0.62 on average).
pub const SHARED_GATE_OFFSET: f32 = 0.5;

/// Stream id of the token-specific embedding noise (shared by the embedding and the lm_head).
const TOKEN_STREAM: u64 = 0x70C3_4E11_0000_0001;

/// What a tensor's rows hold.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Gen {
    Embed,
    LmHead,
    /// A norm weight: `level + NORM_JITTER·N`.
    Norm {
        level: f32,
    },
    /// A random matrix of this std; `writer` = an output projection into the residual stream
    /// whose rows (`row % out`) on structured dims are scaled down.
    Dense {
        std: f32,
        writer: bool,
        out: usize,
    },
    Router {
        layer: usize,
    },
    SharedGate,
    GdnB {
        layer: usize,
    },
    GdnA,
    /// conv1d rows: `[K]` per channel, mostly the current token.
    Conv,
    ALog {
        layer: usize,
    },
    DtBias {
        layer: usize,
    },
}

struct LayerPlan {
    /// `member[e * nc + c]`: expert e is among cluster c's chosen experts.
    member: Vec<bool>,
    /// Router popularity bias per expert.
    bias: Vec<f32>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    beta_offset: Vec<f32>,
}

/// How the vocabulary is laid out (from the tokenizer).
#[derive(Clone, Copy, Debug)]
pub struct VocabInfo {
    /// Ids `[0, n_text)` are real byte-level tokens (bytes and merges).
    pub n_text: usize,
    /// Id of `<|im_end|>`.
    pub im_end: usize,
}

pub struct Plan {
    seed: u64,
    d: usize,
    /// `sd[0]` = common dim, `sd[1 + c]` = cluster c's dim.
    sd: Vec<usize>,
    is_sd: Vec<bool>,
    nc: usize,
    /// Per-entry std of the token-specific embedding noise (unit row RMS overall).
    nu: f32,
    /// Predecessors of each token id (CSR): the tokens whose successor it is.
    pred_start: Vec<u32>,
    pred: Vec<u32>,
    succ: Vec<u32>,
    layers: Vec<LayerPlan>,
    /// Output RMS of each sublayer.
    pub sublayer_rms: f32,
}

impl Plan {
    pub fn new(cfg: &Config, seed: u64, vocab: VocabInfo) -> Self {
        let d = cfg.hidden_size;
        let nc = (d / 8).max(1);
        let mut r = Rng::new(hash(&[seed, 0x5D_D1A5]));
        let mut dims: Vec<usize> = (0..d).collect();
        r.shuffle(&mut dims);
        let sd: Vec<usize> = dims[..nc + 1].to_vec();
        let mut is_sd = vec![false; d];
        sd.iter().for_each(|&i| is_sd[i] = true);
        let free = (d - nc - 1) as f32;
        let nu = ((d as f32 - ZETA_COMMON * ZETA_COMMON - ZETA_CLUSTER * ZETA_CLUSTER)
            .max(0.25 * free)
            / free)
            .sqrt();

        // Next-token map: a permutation of the text tokens; other ids (added, filler, padding)
        // point at random text tokens; a few text tokens point at <|im_end|>.
        let v = cfg.vocab_size;
        let n_text = vocab.n_text.min(v);
        let mut succ: Vec<u32> = (0..n_text as u32).collect();
        let mut r = Rng::new(hash(&[seed, 0x5E_ED]));
        r.shuffle(&mut succ);
        for _ in n_text..v {
            succ.push(r.below(n_text as u64) as u32);
        }
        let n_end = (d / 128).clamp(1, 8);
        for _ in 0..n_end {
            let t = r.below(n_text as u64) as usize;
            succ[t] = vocab.im_end as u32;
        }
        let mut count = vec![0u32; v + 1];
        succ.iter().for_each(|&s| count[s as usize + 1] += 1);
        for i in 0..v {
            count[i + 1] += count[i];
        }
        let pred_start = count.clone();
        let mut pred = vec![0u32; v];
        let mut fill = count;
        for (t, &s) in succ.iter().enumerate() {
            pred[fill[s as usize] as usize] = t as u32;
            fill[s as usize] += 1;
        }

        let layers = (0..cfg.num_hidden_layers)
            .map(|l| Self::layer_plan(cfg, seed, l, nc))
            .collect();
        let sublayer_rms = (RESIDUAL_BUDGET / (2 * cfg.num_hidden_layers) as f32).sqrt();
        Self {
            seed,
            d,
            sd,
            is_sd,
            nc,
            nu,
            pred_start,
            pred,
            succ,
            layers,
            sublayer_rms,
        }
    }

    fn layer_plan(cfg: &Config, seed: u64, l: usize, nc: usize) -> LayerPlan {
        let mut r = Rng::new(hash(&[seed, 0x1A7E, l as u64]));
        let (e, k) = (cfg.num_experts, cfg.num_experts_per_tok);
        // Popularity: a random order of the experts; Zipf-like weights 1/(rank+1)^0.8.
        let mut order: Vec<usize> = (0..e).collect();
        r.shuffle(&mut order);
        let mut rank = vec![0usize; e];
        order.iter().enumerate().for_each(|(i, &x)| rank[x] = i);
        let bias: Vec<f32> = (0..e)
            .map(|x| {
                if e > 1 {
                    ROUTER_BIAS_SPREAD * (1.0 - 2.0 * rank[x] as f32 / (e - 1) as f32)
                } else {
                    0.0
                }
            })
            .collect();
        let weight: Vec<f64> = (0..e)
            .map(|x| 1.0 / (rank[x] as f64 + 1.0).powf(0.8))
            .collect();
        let total: f64 = weight.iter().sum();
        // Each expert is chosen by at least one cluster (while slots last), the rest by popularity.
        let mut member = vec![false; e * nc];
        let mut round_robin = order.clone();
        r.shuffle(&mut round_robin);
        let mut next = 0usize;
        for c in 0..nc {
            let mut chosen = Vec::with_capacity(k);
            while chosen.len() < k && next < e {
                chosen.push(round_robin[next]);
                next += 1;
            }
            while chosen.len() < k {
                let mut u = r.uniform() as f64 * total;
                let mut x = 0;
                while x + 1 < e && u >= weight[x] {
                    u -= weight[x];
                    x += 1;
                }
                if !chosen.contains(&x) {
                    chosen.push(x);
                }
            }
            chosen.iter().for_each(|&x| member[x * nc + c] = true);
        }
        // GDN gates: per value head a target decay in (0.6, 0.97) at a typical a = 0, through
        // softplus(dt_bias) ∈ (0.4, 0.9) and A = −ln(decay)/softplus(dt_bias).
        let hv = cfg.linear_num_value_heads;
        let (mut a_log, mut dt_bias, mut beta_offset) = (vec![], vec![], vec![]);
        for h in 0..hv {
            let decay = 0.6 + 0.37 * (h as f32 + r.uniform()) / hv as f32;
            let sp = 0.4 + 0.5 * r.uniform();
            dt_bias.push((sp.exp() - 1.0).ln());
            a_log.push((-decay.ln() / sp).ln());
            beta_offset.push(-0.5 + 2.0 * r.uniform());
        }
        LayerPlan {
            member,
            bias,
            a_log,
            dt_bias,
            beta_offset,
        }
    }

    /// The cluster of a token.
    pub fn cluster(&self, t: usize) -> usize {
        (hash(&[self.seed, 0xC1_0057, t as u64]) % self.nc as u64) as usize
    }

    /// The structured dims: `[common, cluster 0, cluster 1, …]`.
    pub fn structured_dims(&self) -> &[usize] {
        &self.sd
    }

    /// The expected next token of each token (its successor), for tests and reports.
    pub fn successor(&self, t: usize) -> usize {
        self.succ[t] as usize
    }

    /// Token-specific embedding noise of token `t` (structured dims zero), `nu` per entry.
    fn token_noise(&self, t: usize, out: &mut [f32]) {
        let mut r = Rng::for_row(self.seed, TOKEN_STREAM, t as u64);
        r.fill_normal(out, self.nu);
        for &i in &self.sd {
            out[i] = 0.0;
        }
    }

    /// Fills row `row` (over all stacked matrices: expert e's row r is `e·out + r`) of tensor
    /// `tensor` (its name id) with its f32 values.
    pub fn fill_row(&self, gen: Gen, tensor: u64, row: usize, out: &mut [f32]) {
        let d = self.d;
        let sqd = (d as f32).sqrt();
        let mut r = Rng::for_row(self.seed, tensor, row as u64);
        match gen {
            Gen::Embed => {
                self.token_noise(row, out);
                out[self.sd[0]] = ZETA_COMMON;
                out[self.sd[1 + self.cluster(row)]] = ZETA_CLUSTER;
            }
            Gen::LmHead => {
                r.fill_normal(out, LM_BACKGROUND * LM_BETA / sqd);
                let coef = LM_BETA / (d as f32 * self.nu);
                let mut tmp = vec![0f32; d];
                for &p in
                    &self.pred[self.pred_start[row] as usize..self.pred_start[row + 1] as usize]
                {
                    self.token_noise(p as usize, &mut tmp);
                    out.iter_mut().zip(&tmp).for_each(|(o, &x)| *o += coef * x);
                }
            }
            Gen::Norm { level } => out
                .iter_mut()
                .for_each(|x| *x = level + NORM_JITTER * r.normal()),
            Gen::Dense {
                std,
                writer,
                out: n_out,
            } => {
                let s = if writer && self.is_sd.get(row % n_out).copied().unwrap_or(false) {
                    std * WRITER_SD_SCALE
                } else {
                    std
                };
                r.fill_normal(out, s);
            }
            Gen::Router { layer } => {
                let lp = &self.layers[layer];
                r.fill_normal(out, ROUTER_NOISE / sqd);
                for c in 0..self.nc {
                    out[self.sd[1 + c]] = if lp.member[row * self.nc + c] {
                        ROUTER_BOOST / ZETA_CLUSTER
                    } else {
                        0.0
                    };
                }
                out[self.sd[0]] = lp.bias[row] / ZETA_COMMON;
            }
            Gen::SharedGate => {
                r.fill_normal(out, 1.0 / sqd);
                out[self.sd[0]] = SHARED_GATE_OFFSET / ZETA_COMMON;
            }
            Gen::GdnB { layer } => {
                r.fill_normal(out, 1.0 / sqd);
                out[self.sd[0]] = self.layers[layer].beta_offset[row] / ZETA_COMMON;
            }
            Gen::GdnA => r.fill_normal(out, 0.3 / sqd),
            Gen::Conv => {
                let k = out.len();
                for (j, x) in out.iter_mut().enumerate() {
                    *x = if j + 1 == k {
                        0.7 + 0.1 * r.normal()
                    } else {
                        0.2 * r.normal()
                    };
                }
            }
            Gen::ALog { layer } => out.copy_from_slice(&self.layers[layer].a_log),
            Gen::DtBias { layer } => out.copy_from_slice(&self.layers[layer].dt_bias),
        }
    }
}
