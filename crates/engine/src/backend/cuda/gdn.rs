//! The Gated DeltaNet ops (gdn.cu): conv and the gated delta rule; the trait impl in mod.rs delegates here.

use super::*;

impl Cuda {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gdn_prefill_op(&self, qkv: &Buf, z: &Buf, b: &Buf, a: &Buf, w: &GdnParams<Buf>, state: &mut Buf, d: &Dims, rows: usize, out: &mut Buf) {
        let op = "gdn";
        let (hk, hv, dk, dv) = (d.gdn_k_heads, d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim);
        let c = d.conv_channels();
        if rows == 0
            || !(self.ensure(matches!(dk, 32 | 64 | 128) && dv % 4 == 0 && hk > 0 && hv % hk == 0, || format!("{op}: key dim {dk} / value dim {dv} / heads {hk}:{hv} not supported"))
                && self.act_ok(qkv, rows * c, "qkv", op)
                && self.act_ok(z, rows * hv * dv, "z", op)
                && self.act_ok(b, rows * hv, "b", op)
                && self.act_ok(a, rows * hv, "a", op)
                && self.buf_ok(&w.a_log, hv, "a_log", op)
                && self.buf_ok(&w.dt_bias, hv, "dt_bias", op)
                && self.buf_ok(&w.norm, dv, "norm", op)
                && self.buf_ok(state, hv * dv * dk, "state", op)
                && self.act_ok(out, rows * hv * dv, "out", op))
        {
            return;
        }
        let mut sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let Some(y) = self.scratch(&mut sc, "gdn_y", 4 * rows * hv * dv) else { return };
        let rpw = if rows == 1 { GDN_RPW_DECODE } else { GDN_RPW_PREFILL };
        let warps = hv * dv / rpw;
        self.launch(
            &format!("gdn_scan_{}_{rpw}", dk / 32),
            (grid1(warps, 4), 1, 1),
            128,
            0,
            &[
                Arg::P(qkv.mem.ptr),
                Arg::P(b.mem.ptr),
                Arg::P(a.mem.ptr),
                Arg::P(w.a_log.mem.ptr),
                Arg::P(w.dt_bias.mem.ptr),
                Arg::P(state.mem.ptr),
                Arg::P(y),
                Arg::I(rows as i32),
                Arg::I(hk as i32),
                Arg::I(hv as i32),
                Arg::I(dv as i32),
            ],
        );
        self.launch(
            "gdn_gated_norm",
            (rows as u32, hv as u32, 1),
            128,
            0,
            &[Arg::P(y), Arg::P(z.mem.ptr), Arg::P(w.norm.mem.ptr), Arg::P(out.mem.ptr), Arg::I(hv as i32), Arg::I(dv as i32), Arg::F(d.eps)],
        );
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn conv(&self, x: &Buf, w: &Buf, state: &mut Buf, d: &Dims, rows: usize, out: &mut Buf, name: &str) {
        let (c, k) = (d.conv_channels(), d.conv_kernel);
        if rows == 0
            || !(self.ensure((1..=8).contains(&k), || format!("{name}: conv kernel {k} not supported (1..=8)"))
                && self.act_ok(x, rows * c, "x", name)
                && self.buf_ok(w, c * k, "w", name)
                && self.buf_ok(state, (k - 1) * c, "state", name)
                && self.act_ok(out, rows * c, "out", name))
        {
            return;
        }
        let args = [Arg::P(x.mem.ptr), Arg::P(w.mem.ptr), Arg::P(state.mem.ptr), Arg::P(out.mem.ptr), Arg::I(c as i32), Arg::I(k as i32), Arg::I(rows as i32)];
        if name == "conv1d_prefill" {
            // Rows split over blocks (CONV_RPT in gdn.cu), then the state replaced by its own launch.
            self.launch(name, (grid1(c, 256), grid1(rows, CONV_RPT), 1), 256, 0, &args);
            self.launch("conv1d_state", (grid1(c, 256), 1, 1), 256, 0, &[Arg::P(x.mem.ptr), Arg::P(state.mem.ptr), Arg::I(c as i32), Arg::I(k as i32), Arg::I(rows as i32)]);
        } else {
            self.launch(name, (grid1(c, 256), 1, 1), 256, 0, &args[..6]);
        }
    }
}
