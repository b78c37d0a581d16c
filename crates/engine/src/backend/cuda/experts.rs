//! Routing and the routed experts (moe.cu) of a prefill and of the warp-per-row decode path (the streaming decode path is decode.rs); the trait impl in mod.rs delegates here.

use super::*;

impl Cuda {
    pub(super) fn moe_route_op(&self, logits: &Buf, d: &Dims, rows: usize, route: &mut Route) {
        let op = "moe_route";
        let (e, k) = (d.n_experts, d.top_k);
        if rows == 0
            || !(self.ensure(e <= 1024 && k <= 32 && k <= e && k > 0, || {
                format!("{op}: {e} experts / top-{k} not supported")
            }) && self.ensure(rows * k <= route.cap, || {
                format!("{op}: route holds {} entries, {rows}×{k} needed", route.cap)
            }) && self.buf_ok(logits, rows * e, "logits", op))
        {
            return;
        }
        route.k = k;
        // One warp per row, ROUTE_WARPS rows per block (moe.cu).
        self.launch(
            op,
            (grid1(rows, ROUTE_WARPS), 1, 1),
            32 * ROUTE_WARPS as u32,
            0,
            &[
                Arg::P(logits.mem.ptr),
                Arg::P(route.ids.ptr),
                Arg::P(route.weights.ptr),
                Arg::I(e as i32),
                Arg::I(k as i32),
                Arg::I(d.norm_topk as i32),
                Arg::I(rows as i32),
            ],
        );
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_experts_prefill_op(
        &self,
        x: &Buf,
        route: &Route,
        gate: &Mat,
        up: &Mat,
        down: &Mat,
        d: &Dims,
        rows: usize,
        out: &mut Buf,
    ) {
        let op = "moe_experts_prefill";
        let (h, k, ne) = (d.hidden, route.k, d.n_experts);
        let width = gate.out;
        if rows == 0
            || !(self.experts_ok(gate, up, down, d, op)
                && self.ensure(rows * k <= route.cap, || {
                    format!("{op}: route of {} entries, {rows}×{k} needed", route.cap)
                })
                && self.act_ok(x, rows * h, "x", op)
                && self.act_ok(out, rows * h, "out", op))
        {
            return;
        }
        let n = rows * k;
        let max_tiles = n.div_ceil(64) + ne.min(n);
        let mut sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let bufs = (|| {
            Some((
                self.scratch(&mut sc, "moe_counts", 4 * ne)?,
                self.scratch(&mut sc, "moe_offsets", 4 * (ne + 1))?,
                self.scratch(&mut sc, "moe_cursor", 4 * ne)?,
                self.scratch(&mut sc, "moe_tiles", 12 * max_tiles)?,
                self.scratch(&mut sc, "moe_ntiles", 4)?,
                self.scratch(&mut sc, "moe_perm", 4 * n)?,
            ))
        })();
        let Some((counts, offsets, cursor, tiles, ntiles, perm)) = bufs else {
            return;
        };
        // The op's intermediates are bf16 activations (moe.cu).
        let acts = (|| {
            Some((
                self.scratch(&mut sc, "moe_g", 2 * n * width)?,
                self.scratch(&mut sc, "moe_u", 2 * n * width)?,
                self.scratch(&mut sc, "moe_act", 2 * n * width)?,
                self.scratch(&mut sc, "moe_y", 2 * n * h)?,
            ))
        })();
        let Some((g, u, act, y)) = acts else { return };
        self.memset0(counts, 4 * ne);
        self.launch(
            "moe_count",
            (grid1(n, 256), 1, 1),
            256,
            0,
            &[Arg::P(route.ids.ptr), Arg::P(counts), Arg::I(n as i32)],
        );
        self.launch(
            "moe_plan",
            (1, 1, 1),
            32,
            0,
            &[
                Arg::P(counts),
                Arg::P(offsets),
                Arg::P(cursor),
                Arg::P(tiles),
                Arg::P(ntiles),
                Arg::I(ne as i32),
            ],
        );
        self.launch(
            "moe_scatter",
            (grid1(n, 256), 1, 1),
            256,
            0,
            &[
                Arg::P(route.ids.ptr),
                Arg::P(cursor),
                Arg::P(perm),
                Arg::I(n as i32),
            ],
        );
        let tc = self.tensor_core_gemm();
        let (kernel, threads, smem) = if tc {
            ("moe_tc_gemm", 128, TC_SMEM_1)
        } else {
            ("moe_gemm", 256, 0)
        };
        let gemm = |m: &Mat, src: u64, dst: u64, mode: i32| {
            self.launch(
                &format!("{kernel}_{}", m.fmt.suffix()),
                (grid1(m.out, 64), max_tiles as u32, 1),
                threads,
                smem,
                &[
                    Arg::P(src),
                    Arg::Q(m.q()),
                    Arg::P(perm),
                    Arg::P(tiles),
                    Arg::P(ntiles),
                    Arg::P(dst),
                    Arg::I(k as i32),
                    Arg::I(mode),
                ],
            )
        };
        gemm(gate, x.mem.ptr, g, 0);
        gemm(up, x.mem.ptr, u, 0);
        self.launch(
            "swiglu",
            (grid1(n * width, 256), 1, 1),
            256,
            0,
            &[
                Arg::P(g),
                Arg::P(u),
                Arg::P(act),
                Arg::P((n * width) as u64),
            ],
        );
        gemm(down, act, y, 1);
        self.launch(
            "moe_combine",
            (rows as u32, grid1(h, 256), 1),
            256,
            0,
            &[
                Arg::P(y),
                Arg::P(route.weights.ptr),
                Arg::P(out.mem.ptr),
                Arg::I(k as i32),
                Arg::I(h as i32),
                Arg::P(0),
            ],
        );
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_experts_decode_op(
        &self,
        x: &Buf,
        route: &Route,
        gate: &Mat,
        up: &Mat,
        down: &Mat,
        shared: Option<&SharedExpert<'_, Self>>,
        d: &Dims,
        out: &mut Buf,
    ) -> bool {
        let op = "moe_experts_decode";
        let (h, k) = (d.hidden, route.k);
        let width = gate.out;
        if !(self.experts_ok(gate, up, down, d, op)
            && self.ensure(gate.fmt == up.fmt, || {
                format!("{op}: gate and up weights in different formats")
            })
            && self.act_ok(x, h, "x", op)
            && self.act_ok(out, h, "out", op))
        {
            return false;
        }
        if let Some(sh) = shared {
            let ws = sh.gate.out;
            if !(self.ensure(sh.gate.n == 1 && sh.up.n == 1 && sh.down.n == 1 && sh.gate.inp == h && sh.up.inp == h && sh.up.out == ws && sh.down.inp == ws && sh.down.out == h, || {
                format!("{op}: shared expert shapes gate {}×{}, up {}×{}, down {}×{} do not fit hidden {h}", sh.gate.out, sh.gate.inp, sh.up.out, sh.up.inp, sh.down.out, sh.down.inp)
            }) && self.buf_ok(sh.logit, 1, "shared logit", op))
            {
                return false;
            }
        }
        // The shared expert rides in the routed kernels as slot k when it has their format;
        // otherwise the model adds it with its unfused ops.
        let fold = shared.filter(|sh| {
            sh.gate.fmt == gate.fmt && sh.up.fmt == gate.fmt && sh.down.fmt == down.fmt
        });
        let mut sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let ws = fold.map_or(0, |sh| sh.gate.out);
        let slots = k + fold.is_some() as usize;
        let Some(act) = self.scratch(&mut sc, "moe_act1", 2 * (k * width + ws)) else {
            return false;
        };
        let Some(y) = self.scratch(&mut sc, "moe_y1", 2 * slots * h) else {
            return false;
        };
        let none = QMat::none();
        let (sg, su, sd, slogit) = match fold {
            Some(sh) => (sh.gate.q(), sh.up.q(), sh.down.q(), sh.logit.mem.ptr),
            None => (none, none, none, 0),
        };
        self.launch(
            &format!("moe_gate_up_{}", gate.fmt.suffix()),
            (grid1(width.max(ws), 8), slots as u32, 1),
            256,
            0,
            &[
                Arg::P(x.mem.ptr),
                Arg::Q(gate.q()),
                Arg::Q(up.q()),
                Arg::P(route.ids.ptr),
                Arg::P(act),
                Arg::Q(sg),
                Arg::Q(su),
                Arg::I(k as i32),
            ],
        );
        self.launch(
            &format!("moe_down_{}", down.fmt.suffix()),
            (grid1(h, 8), slots as u32, 1),
            256,
            0,
            &[
                Arg::P(act),
                Arg::Q(down.q()),
                Arg::P(route.ids.ptr),
                Arg::P(y),
                Arg::I(k as i32),
                Arg::Q(sd),
            ],
        );
        self.launch(
            "moe_combine",
            (1, grid1(h, 256), 1),
            256,
            0,
            &[
                Arg::P(y),
                Arg::P(route.weights.ptr),
                Arg::P(out.mem.ptr),
                Arg::I(k as i32),
                Arg::I(h as i32),
                Arg::P(slogit),
            ],
        );
        fold.is_some()
    }

    pub(super) fn experts_ok(&self, gate: &Mat, up: &Mat, down: &Mat, d: &Dims, op: &str) -> bool {
        self.ensure(
            gate.n == d.n_experts && up.n == d.n_experts && down.n == d.n_experts && gate.inp == d.hidden && up.inp == d.hidden && up.out == gate.out && down.inp == gate.out && down.out == d.hidden,
            || format!("{op}: expert shapes gate {}×{}×{}, up {}×{}×{}, down {}×{}×{} do not fit hidden {} / {} experts", gate.n, gate.out, gate.inp, up.n, up.out, up.inp, down.n, down.out, down.inp, d.hidden, d.n_experts),
        )
    }
}
