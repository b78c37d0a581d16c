//! Per-sequence state: the KV cache of each attention layer, the conv and fp32 recurrent state of
//! each Gated DeltaNet layer, and the position.
//!
//! Prefix reuse (runtime/cache.rs) needs to go back to an earlier position. Attention KV can be
//! cut back to any length: rows past `pos` are simply never read and get overwritten. The GDN
//! state cannot — it folds every token in — so a [`GdnSnapshot`] copies it at chosen positions
//! and [`SeqState::restore`] puts it back (with `pos` set to the snapshot's).

use anyhow::Result;

use crate::backend::{Backend, Dims, KvCache};
use crate::Config;

pub enum LayerState<B: Backend> {
    /// `conv` `[K-1, C]` pre-conv rows, `ssm` `[Hv, Dv, Dk]` fp32.
    Gdn {
        conv: B::Buf,
        ssm: B::Buf,
    },
    Attn(KvCache<B::Buf>),
}

pub struct SeqState<B: Backend> {
    /// Tokens consumed so far (the next token's position).
    pub pos: usize,
    /// Hard limit on positions (the context length).
    pub max_context: usize,
    pub layers: Vec<LayerState<B>>,
    /// The decode step's token and position on the backend (`Qwen35::decode`).
    pub(crate) step: B::Step,
    /// The step holds the token the last decode chose on the backend, at `pos`: the next decode
    /// may feed it without the host sending it.
    pub(crate) step_ready: bool,
    /// Identifies this state's buffers for a recorded decode step: unique per state, and bumped
    /// whenever a buffer is replaced (the KV cache growing).
    pub(crate) buffers_id: u64,
    /// Bytes per KV-cache element on the backend (`Backend::kv_elem_bytes`: 4 for f32, 2 for bf16).
    kv_elem_bytes: usize,
    /// The decode step after a prefill picks its token greedily on the backend (the default):
    /// a prefill that returns its last logits then records that step ahead while the device
    /// runs it (`Backend::prerecord`). A caller whose next step draws from a sampler clears
    /// it (the step's record is another: no host time spent on one it will not replay).
    pub greedy_next: bool,
}

/// Source of `buffers_id`: never reused, so a record of a dropped state is never replayed.
static NEXT_BUFFERS_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

pub(crate) fn new_buffers_id() -> u64 {
    NEXT_BUFFERS_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
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
                    LayerState::Attn(KvCache {
                        k: b.kv_zeros(cap * kvd)?,
                        v: b.kv_zeros(cap * kvd)?,
                        capacity: cap,
                    })
                } else {
                    LayerState::Gdn {
                        conv: b.zeros((d.conv_kernel - 1) * d.conv_channels())?,
                        ssm: b.zeros(d.gdn_v_heads * d.gdn_v_dim * d.gdn_k_dim)?,
                    }
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            pos: 0,
            max_context,
            layers,
            step: b.new_step()?,
            step_ready: false,
            buffers_id: new_buffers_id(),
            kv_elem_bytes: b.kv_elem_bytes(),
            greedy_next: true,
        })
    }

    /// Whether every KV cache has room for positions `< need` (`reserve` would change nothing).
    pub fn has_room(&self, need: usize) -> bool {
        self.layers.iter().all(|l| match l {
            LayerState::Attn(kv) => kv.capacity >= need,
            _ => true,
        })
    }

    /// Makes room for positions `< need` in every KV cache (copying what is there).
    pub fn reserve(&mut self, b: &B, d: &Dims, need: usize) -> Result<()> {
        let kvd = d.n_kv_heads * d.head_dim;
        for l in &mut self.layers {
            if let LayerState::Attn(kv) = l {
                if kv.capacity < need {
                    let cap = need
                        .next_power_of_two()
                        .max(kv.capacity * 2)
                        .min(self.max_context.max(need));
                    let mut k = b.kv_zeros(cap * kvd)?;
                    let mut v = b.kv_zeros(cap * kvd)?;
                    b.copy(&kv.k, 0, &mut k, 0, self.pos * kvd);
                    b.copy(&kv.v, 0, &mut v, 0, self.pos * kvd);
                    *kv = KvCache {
                        k,
                        v,
                        capacity: cap,
                    };
                    self.buffers_id = new_buffers_id();
                }
            }
        }
        Ok(())
    }

    /// Bytes held by this state: KV at current capacity (the backend's KV element size: f32 on
    /// the CPU, bf16 on CUDA) + recurrent state (f32 elements × 4).
    pub fn nbytes(&self, d: &Dims) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Attn(kv) => kv_layer_bytes(d, kv.capacity, self.kv_elem_bytes),
                LayerState::Gdn { .. } => gdn_layer_bytes(d),
            })
            .sum()
    }
}

/// One attention layer's K and V at `capacity` positions, `kv_elem` bytes a value.
pub fn kv_layer_bytes(d: &Dims, capacity: usize, kv_elem: usize) -> usize {
    2 * capacity * d.n_kv_heads * d.head_dim * kv_elem
}

/// One GDN layer's conv and recurrent state (f32).
pub fn gdn_layer_bytes(d: &Dims) -> usize {
    let (nc, ns) = gdn_sizes(d);
    (nc + ns) * 4
}

/// The GDN conv + recurrent state of every GDN layer at one position.
pub struct GdnSnapshot<B: Backend> {
    pub pos: usize,
    /// `(conv, ssm)` per GDN layer, in layer order.
    layers: Vec<(B::Buf, B::Buf)>,
    bytes: usize,
}

impl<B: Backend> GdnSnapshot<B> {
    /// Bytes held (f32 elements × 4).
    pub fn nbytes(&self) -> usize {
        self.bytes
    }
}

/// Elements of one GDN layer's (conv, ssm) state.
fn gdn_sizes(d: &Dims) -> (usize, usize) {
    (
        (d.conv_kernel - 1) * d.conv_channels(),
        d.gdn_v_heads * d.gdn_v_dim * d.gdn_k_dim,
    )
}

impl<B: Backend> SeqState<B> {
    /// Copies the GDN state at the current position.
    pub fn snapshot(&self, b: &B, d: &Dims) -> Result<GdnSnapshot<B>> {
        let (nc, ns) = gdn_sizes(d);
        let mut layers = Vec::new();
        for l in &self.layers {
            if let LayerState::Gdn { conv, ssm } = l {
                let mut c = b.zeros(nc)?;
                let mut s = b.zeros(ns)?;
                b.copy(conv, 0, &mut c, 0, nc);
                b.copy(ssm, 0, &mut s, 0, ns);
                layers.push((c, s));
            }
        }
        let bytes = layers.len() * (nc + ns) * 4;
        Ok(GdnSnapshot {
            pos: self.pos,
            layers,
            bytes,
        })
    }

    /// Goes back to `snap.pos` (which must not be past the current position): the GDN state is
    /// copied back, the KV cache is cut back.
    pub fn restore(&mut self, b: &B, d: &Dims, snap: &GdnSnapshot<B>) -> Result<()> {
        if snap.pos > self.pos {
            anyhow::bail!(
                "cannot restore a snapshot at {} into a state at {}",
                snap.pos,
                self.pos
            );
        }
        let (nc, ns) = gdn_sizes(d);
        let mut it = snap.layers.iter();
        for l in &mut self.layers {
            if let LayerState::Gdn { conv, ssm } = l {
                let (c, s) = it.next().ok_or_else(|| {
                    anyhow::anyhow!("snapshot has fewer GDN layers than the state")
                })?;
                b.copy(c, 0, conv, 0, nc);
                b.copy(s, 0, ssm, 0, ns);
            }
        }
        self.pos = snap.pos;
        self.step_ready = false;
        Ok(())
    }

    /// A new state holding this one's first `snap.pos` positions: KV rows copied, GDN state
    /// from the snapshot. `self` is left as it is.
    pub fn fork(&self, b: &B, cfg: &Config, snap: &GdnSnapshot<B>) -> Result<SeqState<B>> {
        let d = Dims::from_config(cfg);
        let mut st = SeqState::new(b, cfg, self.max_context)?;
        st.reserve(b, &d, snap.pos.max(1))?;
        let kvd = d.n_kv_heads * d.head_dim;
        for (dst, src) in st.layers.iter_mut().zip(&self.layers) {
            if let (LayerState::Attn(dk), LayerState::Attn(sk)) = (dst, src) {
                b.copy(&sk.k, 0, &mut dk.k, 0, snap.pos * kvd);
                b.copy(&sk.v, 0, &mut dk.v, 0, snap.pos * kvd);
            }
        }
        st.pos = snap.pos;
        st.restore(b, &d, snap)?;
        Ok(st)
    }
}
