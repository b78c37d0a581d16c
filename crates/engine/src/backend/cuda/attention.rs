//! Decode and prefill attention (attention.cu): the ops of `Backend` for this family; the trait impl in mod.rs delegates here.

use super::*;
use crate::backend::AttnStep;

/// `struct DecQk` of attention.cu (same layout): attn_decode_qk_<HD>'s extra arguments.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct DecQk {
    qn: u64,
    kn: u64,
    gate: u64,
    rot: i32,
    theta: f64,
    eps: f32,
}

impl Cuda {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attn_qk_norm_rope_op(
        &self,
        qg: &Buf,
        k: &mut Buf,
        q_norm: &Buf,
        k_norm: &Buf,
        d: &Dims,
        rows: usize,
        pos0: usize,
        step: Option<&Step>,
        q: &mut Buf,
        gate: &mut Buf,
    ) {
        let op = "attn_qk_norm_rope";
        let (h, kv, hd) = (d.n_heads, d.n_kv_heads, d.head_dim);
        if rows == 0
            || !(self.ensure(
                hd % 32 == 0 && hd <= 256 && d.rotary_dim <= hd && d.rotary_dim.is_multiple_of(2),
                || {
                    format!(
                        "{op}: head_dim {hd} / rotary {} not supported",
                        d.rotary_dim
                    )
                },
            ) && self.act_ok(qg, rows * h * 2 * hd, "qg", op)
                && self.act_ok(k, rows * kv * hd, "k", op)
                && self.buf_ok(q_norm, hd, "q_norm", op)
                && self.buf_ok(k_norm, hd, "k_norm", op)
                && self.act_ok(q, rows * h * hd, "q", op)
                && self.act_ok(gate, rows * h * hd, "gate", op))
        {
            return;
        }
        self.launch(
            op,
            (rows as u32, (h + kv) as u32, 1),
            128,
            (4 * hd) as u32,
            &[
                Arg::P(qg.mem.ptr),
                Arg::P(k.mem.ptr),
                Arg::P(q_norm.mem.ptr),
                Arg::P(k_norm.mem.ptr),
                Arg::P(q.mem.ptr),
                Arg::P(gate.mem.ptr),
                Arg::I(h as i32),
                Arg::I(kv as i32),
                Arg::I(hd as i32),
                Arg::I(d.rotary_dim as i32),
                Arg::D(d.rope_theta),
                Arg::I(pos0 as i32),
                Arg::F(d.eps),
                Arg::P(step.map_or(0, |s| s.pos_ptr())),
            ],
        );
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn attn_prefill_op(
        &self,
        q: &Buf,
        k: &Buf,
        v: &Buf,
        gate: &Buf,
        kv: &mut KvCache<Buf>,
        d: &Dims,
        rows: usize,
        pos0: usize,
        out: &mut Buf,
    ) {
        let op = "attention";
        let (h, kvh, hd) = (d.n_heads, d.n_kv_heads, d.head_dim);
        let kvd = kvh * hd;
        if rows == 0
            || !(self.ensure(hd % 32 == 0 && hd <= 256 && kvh > 0 && h % kvh == 0, || {
                format!("{op}: {h} heads / {kvh} kv heads of {hd} not supported")
            }) && self.kv_ok(kv, kvd, op)
                && self.ensure(pos0 + rows <= kv.capacity, || {
                    format!(
                        "{op}: KV cache overflow ({pos0} + {rows} > {})",
                        kv.capacity
                    )
                })
                && self.act_ok(q, rows * h * hd, "q", op)
                && self.act_ok(k, rows * kvd, "k", op)
                && self.act_ok(v, rows * kvd, "v", op)
                && self.act_ok(gate, rows * h * hd, "gate", op)
                && self.act_ok(out, rows * h * hd, "out", op))
        {
            return;
        }
        // k, v -> rows pos0.. of the caches (bf16 to bf16): four values per thread.
        self.launch(
            "kv_append",
            (grid1(rows * kvd / 4, 256), 1, 1),
            256,
            0,
            &[
                Arg::P(k.mem.ptr),
                Arg::P(v.mem.ptr),
                Arg::P(kv.k.mem.ptr),
                Arg::P(kv.v.mem.ptr),
                Arg::I(kvd as i32),
                Arg::I(rows as i32),
                Arg::I(pos0 as i32),
                Arg::P(0),
            ],
        );
        let scale = 1.0 / (hd as f32).sqrt();
        let group = h / kvh;
        // Both kernels take (q, gate, K, V, out, H, KV, <rows | hd>, pos0, scale).
        let (name, grid, threads, smem, rows_or_hd) =
            if self.tensor_core_attention() && matches!(hd, 64 | 128 | 256) && 64 % group == 0 {
                // attn_tc_<hd>: 64 query rows (64/group tokens × group heads) per block, Q/K/V tiles of
                // 64 × (hd + 8) bf16 in dynamic shared memory.
                let tq = 64 / group;
                (
                    format!("attn_tc_{hd}"),
                    (grid1(rows, tq), kvh as u32, 1),
                    128,
                    (3 * 64 * (hd + 8) * 2) as u32,
                    rows,
                )
            } else {
                (
                    "attn_rows".to_string(),
                    (rows as u32, h as u32, 1),
                    256,
                    0,
                    hd,
                )
            };
        self.launch(
            &name,
            grid,
            threads,
            smem,
            &[
                Arg::P(q.mem.ptr),
                Arg::P(gate.mem.ptr),
                Arg::P(kv.k.mem.ptr),
                Arg::P(kv.v.mem.ptr),
                Arg::P(out.mem.ptr),
                Arg::I(h as i32),
                Arg::I(kvh as i32),
                Arg::I(rows_or_hd as i32),
                Arg::I(pos0 as i32),
                Arg::F(scale),
            ],
        );
    }

    /// Backend::attn_decode_qk: with `attn_fold` on (and a RoPE the folded kernel takes), one
    /// launch attn_decode_qk_<HD> (attn_qk_norm_rope inside attn_decode) and the combine; else
    /// the composition.
    pub(super) fn attn_decode_qk_op(&self, a: AttnStep<'_, Cuda>) {
        let d = a.d;
        let hd = d.head_dim;
        let fold = self.opted_in("attn_fold")
            && d.rotary_dim <= hd
            && d.rotary_dim.is_multiple_of(2)
            && self.buf_ok(a.q_norm, hd, "q_norm", "attn_decode_qk")
            && self.buf_ok(a.k_norm, hd, "k_norm", "attn_decode_qk")
            && self.act_ok(a.qg, d.n_heads * 2 * hd, "qg", "attn_decode_qk");
        if !fold {
            return crate::backend::attn_decode_qk_compose(self, a);
        }
        let f = DecQk {
            qn: a.q_norm.mem.ptr,
            kn: a.k_norm.mem.ptr,
            gate: a.gate.mem.ptr,
            rot: d.rotary_dim as i32,
            theta: d.rope_theta,
            eps: d.eps,
        };
        self.attn_decode_op(
            a.qg,
            a.k,
            a.v,
            a.gate,
            a.kv,
            d,
            a.pos,
            a.step,
            a.out,
            Some(f),
        );
    }

    /// attn_decode, or with `qk` attn_decode_qk_<HD> reading q_proj's output (`q` is then qg).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attn_decode_op(
        &self,
        q: &Buf,
        k: &Buf,
        v: &Buf,
        gate: &Buf,
        kv: &mut KvCache<Buf>,
        d: &Dims,
        pos: usize,
        step: &Step,
        out: &mut Buf,
        qk: Option<DecQk>,
    ) {
        let op = "attn_decode";
        let (h, kvh, hd) = (d.n_heads, d.n_kv_heads, d.head_dim);
        let kvd = kvh * hd;
        let qlen = if qk.is_some() { h * 2 * hd } else { h * hd };
        if !(self.ensure(matches!(hd, 64 | 128 | 256) && kvh > 0 && h % kvh == 0, || format!("{op}: {h} heads / {kvh} kv heads of {hd} not supported (head_dim 64, 128 or 256)"))
            && self.kv_ok(kv, kvd, op)
            && self.ensure(pos < kv.capacity, || format!("{op}: KV cache overflow ({pos} + 1 > {})", kv.capacity))
            && self.act_ok(q, qlen, "q", op)
            && self.act_ok(k, kvd, "k", op)
            && self.act_ok(v, kvd, "v", op)
            && self.act_ok(gate, h * hd, "gate", op)
            && self.act_ok(out, h * hd, "out", op))
        {
            return;
        }
        // Everything below depends on the capacity and the device, not on `pos`: the position is
        // read from the step on the device (a recorded step serves every position below the
        // capacity), and so is the split of the keys over the blocks (dec_blocks in attention.cu).
        let posp = step.pos_ptr();
        // Blocks of up to 8 query heads sharing a KV head (x = KV head × group), and per block
        // row `ns` splits: one block per SM in all (the kernel's 8 warps of 218 registers leave
        // no room for a second block), so every SM streams the cache at every position; a small
        // capacity takes fewer (at least 64 keys per block).
        let groups = (h / kvh).div_ceil(8);
        let x = kvh * groups;
        let sms = self
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_or(1, |n| n.max(1) as usize);
        let ns = (sms / x)
            .max(1)
            .min(kv.capacity.div_ceil(ATT_DEC_WARPS * ATT_DEC_KEYS));
        // Partial states: the unnormalised outputs (8 head slots × hd f32 per block), then (max,
        // normaliser) per head slot.
        let (po, pml) = (x * ns * 8 * hd, x * ns * 16);
        let mut sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let Some(part) = self.scratch(&mut sc, "attn_part", 4 * (po + pml)) else {
            return;
        };
        let pml_ptr = part + 4 * po as u64;
        let scale = 1.0 / (hd as f32).sqrt();
        // This step's k, v are read from their buffers and written into cache row pos by the
        // same launch (no kv_append). Dynamic shared memory: the 8 warps' output fragments, f32.
        let mut args = vec![
            Arg::P(q.mem.ptr),
            Arg::P(k.mem.ptr),
            Arg::P(v.mem.ptr),
            Arg::P(kv.k.mem.ptr),
            Arg::P(kv.v.mem.ptr),
            Arg::P(part),
            Arg::P(pml_ptr),
            Arg::I(h as i32),
            Arg::I(kvh as i32),
            Arg::P(posp),
            Arg::F(scale),
        ];
        let name = match qk {
            Some(f) => {
                args.push(Arg::A(Box::new(f)));
                format!("attn_decode_qk_{hd}")
            }
            // The plain kernel: every early form (the opt-ins below too) is off with
            // `attn_early`.
            None if !self.on("attn_early") => format!("attn_decode_{hd}"),
            // attn_decode_pf with p in P·V as two / one bf16 pieces (opt-ins; not bit-equal),
            // and / or the rescale skipped when its factor is 1 (opt-in `attn_lazy`), and / or
            // the next chunk's V requested with its K (opt-in `attn_ve`): all attn_pf's kernel
            // otherwise, whatever `attn_pf` is set to.
            None if ["attn_p1", "attn_p2", "attn_lazy", "attn_ve"]
                .iter()
                .any(|&n| self.opted_in(n)) =>
            {
                let p = if self.opted_in("attn_p1") {
                    "p1"
                } else if self.opted_in("attn_p2") {
                    "p2"
                } else {
                    ""
                };
                let lz = if self.opted_in("attn_lazy") { "lz" } else { "" };
                let ve = if self.opted_in("attn_ve") { "ve" } else { "" };
                format!("attn_decode_{p}{lz}{ve}_{hd}")
            }
            // The early form plus an L2 prefetch two chunks ahead in the key loop (switch
            // `attn_pf`, the default).
            None if self.on("attn_pf") => format!("attn_decode_pf_{hd}"),
            // The warps' first chunks requested before the PDL wait (switch `attn_early`).
            None => format!("attn_decode_early_{hd}"),
        };
        self.launch(
            &name,
            (x as u32, ns as u32, 1),
            (ATT_DEC_WARPS * 32) as u32,
            (ATT_DEC_WARPS * 8 * hd * 4) as u32,
            &args,
        );
        // One block per (head group, fragment row of 32 outputs); shared memory: ns × 8 factors.
        self.launch(
            "attn_decode_combine",
            (x as u32, (hd / 4) as u32, 1),
            256,
            (ns * 8 * 4) as u32,
            &[
                Arg::P(part),
                Arg::P(pml_ptr),
                Arg::P(gate.mem.ptr),
                Arg::P(out.mem.ptr),
                Arg::I(h as i32),
                Arg::I(kvh as i32),
                Arg::I(hd as i32),
                Arg::I(ns as i32),
                Arg::P(posp),
            ],
        );
    }
}
