//! Per-sequence state: the KV cache of each attention layer, the conv and fp32 recurrent state of
//! each Gated DeltaNet layer, and the position. Snapshots (for prefix reuse) come later; the state
//! is plain data so a snapshot is a copy.

use anyhow::Result;

use crate::backend::{Backend, Dims, KvCache};
use crate::Config;

pub enum LayerState<B: Backend> {
    /// `conv` `[K-1, C]` pre-conv rows, `ssm` `[Hv, Dv, Dk]` fp32.
    Gdn { conv: B::Buf, ssm: B::Buf },
    Attn(KvCache<B::Buf>),
}

pub struct SeqState<B: Backend> {
    /// Tokens consumed so far (the next token's position).
    pub pos: usize,
    /// Hard limit on positions (the context length).
    pub max_context: usize,
    pub layers: Vec<LayerState<B>>,
}

impl<B: Backend> SeqState<B> {
    /// A fresh state; KV caches start small and grow (doubling) up to `max_context`.
    pub fn new(b: &B, cfg: &Config, max_context: usize) -> Result<Self> {
        let d = Dims::from_config(cfg);
        let kvd = d.n_kv_heads * d.head_dim;
        let cap = max_context.min(256);
        let layers = cfg
            .layer_is_attention
            .iter()
            .map(|&attn| -> Result<LayerState<B>> {
                Ok(if attn {
                    LayerState::Attn(KvCache { k: b.zeros(cap * kvd)?, v: b.zeros(cap * kvd)?, capacity: cap })
                } else {
                    LayerState::Gdn {
                        conv: b.zeros((d.conv_kernel - 1) * d.conv_channels())?,
                        ssm: b.zeros(d.gdn_v_heads * d.gdn_v_dim * d.gdn_k_dim)?,
                    }
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self { pos: 0, max_context, layers })
    }

    /// Makes room for positions `< need` in every KV cache (copying what is there).
    pub fn reserve(&mut self, b: &B, d: &Dims, need: usize) -> Result<()> {
        let kvd = d.n_kv_heads * d.head_dim;
        for l in &mut self.layers {
            if let LayerState::Attn(kv) = l {
                if kv.capacity < need {
                    let cap = need.next_power_of_two().max(kv.capacity * 2).min(self.max_context.max(need));
                    let mut k = b.zeros(cap * kvd)?;
                    let mut v = b.zeros(cap * kvd)?;
                    b.copy(&kv.k, 0, &mut k, 0, self.pos * kvd);
                    b.copy(&kv.v, 0, &mut v, 0, self.pos * kvd);
                    *kv = KvCache { k, v, capacity: cap };
                }
            }
        }
        Ok(())
    }

    /// Bytes held by this state (KV at current capacity + recurrent state), in f32 elements × 4.
    pub fn nbytes(&self, d: &Dims) -> usize {
        let kvd = d.n_kv_heads * d.head_dim;
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Attn(kv) => 2 * kv.capacity * kvd * 4,
                LayerState::Gdn { .. } => ((d.conv_kernel - 1) * d.conv_channels() + d.gdn_v_heads * d.gdn_v_dim * d.gdn_k_dim) * 4,
            })
            .sum()
    }
}
