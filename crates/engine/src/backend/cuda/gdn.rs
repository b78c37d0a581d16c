//! The Gated DeltaNet ops (gdn.cu): conv and the gated delta rule; the trait impl in mod.rs delegates here.

use super::*;

impl Cuda {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gdn_prefill_op(
        &self,
        qkv: &Buf,
        z: &Buf,
        b: &Buf,
        a: &Buf,
        w: &GdnParams<Buf>,
        state: &mut Buf,
        d: &Dims,
        rows: usize,
        out: &mut Buf,
    ) {
        self.gdn_scan_norm(qkv, z, b, a, w, state, d, rows, Some(out));
    }

    /// The gated delta rule over `rows` tokens into the f32 scratch y (returned), then, with
    /// `out`, the gated norm into it; without, the caller normalises y itself (the fused GDN
    /// mixer's out_proj prologue).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gdn_scan_norm(
        &self,
        qkv: &Buf,
        z: &Buf,
        b: &Buf,
        a: &Buf,
        w: &GdnParams<Buf>,
        state: &mut Buf,
        d: &Dims,
        rows: usize,
        out: Option<&mut Buf>,
    ) -> Option<u64> {
        let op = "gdn";
        let (hk, hv, dk, dv) = (d.gdn_k_heads, d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim);
        let c = d.conv_channels();
        if rows == 0
            || !(self.ensure(
                matches!(dk, 32 | 64 | 128) && dv % 4 == 0 && hk > 0 && hv % hk == 0,
                || format!("{op}: key dim {dk} / value dim {dv} / heads {hk}:{hv} not supported"),
            ) && self.act_ok(qkv, rows * c, "qkv", op)
                && self.act_ok(z, rows * hv * dv, "z", op)
                && self.act_ok(b, rows * hv, "b", op)
                && self.act_ok(a, rows * hv, "a", op)
                && self.buf_ok(&w.a_log, hv, "a_log", op)
                && self.buf_ok(&w.dt_bias, hv, "dt_bias", op)
                && self.buf_ok(&w.norm, dv, "norm", op)
                && self.buf_ok(state, hv * dv * dk, "state", op)
                && out
                    .as_ref()
                    .is_none_or(|o| self.act_ok(o, rows * hv * dv, "out", op)))
        {
            return None;
        }
        let mut sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let y = self.scratch(&mut sc, "gdn_y", 4 * rows * hv * dv)?;
        let rpw = if rows == 1 {
            GDN_RPW_DECODE
        } else {
            GDN_RPW_PREFILL
        };
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
        if let Some(out) = out {
            self.launch(
                "gdn_gated_norm",
                (rows as u32, hv as u32, 1),
                128,
                0,
                &[
                    Arg::P(y),
                    Arg::P(z.mem.ptr),
                    Arg::P(w.norm.mem.ptr),
                    Arg::P(out.mem.ptr),
                    Arg::I(hv as i32),
                    Arg::I(dv as i32),
                    Arg::F(d.eps),
                ],
            );
        }
        Some(y)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn conv(
        &self,
        x: &Buf,
        w: &Buf,
        state: &mut Buf,
        d: &Dims,
        rows: usize,
        out: &mut Buf,
        name: &str,
    ) {
        let (c, k) = (d.conv_channels(), d.conv_kernel);
        if rows == 0
            || !(self.ensure((1..=8).contains(&k), || {
                format!("{name}: conv kernel {k} not supported (1..=8)")
            }) && self.act_ok(x, rows * c, "x", name)
                && self.buf_ok(w, c * k, "w", name)
                && self.buf_ok(state, (k - 1) * c, "state", name)
                && self.act_ok(out, rows * c, "out", name))
        {
            return;
        }
        let args = [
            Arg::P(x.mem.ptr),
            Arg::P(w.mem.ptr),
            Arg::P(state.mem.ptr),
            Arg::P(out.mem.ptr),
            Arg::I(c as i32),
            Arg::I(k as i32),
            Arg::I(rows as i32),
        ];
        if name == "conv1d_prefill" {
            // Rows split over blocks (CONV_RPT in gdn.cu), then the state replaced by its own launch.
            self.launch(
                name,
                (grid1(c, 256), grid1(rows, CONV_RPT), 1),
                256,
                0,
                &args,
            );
            self.launch(
                "conv1d_state",
                (grid1(c, 256), 1, 1),
                256,
                0,
                &[
                    Arg::P(x.mem.ptr),
                    Arg::P(state.mem.ptr),
                    Arg::I(c as i32),
                    Arg::I(k as i32),
                    Arg::I(rows as i32),
                ],
            );
        } else {
            self.launch(name, (grid1(c, 256), 1, 1), 256, 0, &args[..6]);
        }
    }

    /// The fused GDN decode mixer (opt-in `fuse_gdn`): in_proj with the norm prologue and the conv
    /// epilogue on qkv (gemv.cu obf 3), the scan into its f32 scratch, out_proj with the gated
    /// norm prologue (PRO 2) and the residual add. `false`: the shapes or formats do not fit (or
    /// the switch is off): nothing was launched.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gdn_mixer_fused(
        &self,
        h: &mut Buf,
        norm: &Buf,
        eps: f32,
        w: &super::super::GdnWeights<'_, Cuda>,
        conv: &mut Buf,
        ssm: &mut Buf,
        d: &Dims,
        t: &super::super::GdnScratch<'_, Cuda>,
    ) -> bool {
        let op = "gdn_mixer_decode_add";
        let (c, kc, hv, dv) = (d.conv_channels(), d.conv_kernel, d.gdn_v_heads, d.gdn_v_dim);
        let [qkv, z, b, a] = w.in_proj;
        let fits = self.opted_in("fuse_gdn")
            && self.sw_fits(&w.in_proj)
            && self.sw_fits(&[w.out_proj])
            && qkv.out == c
            && qkv.inp == d.hidden
            && w.out_proj.inp == hv * dv
            && w.out_proj.out == d.hidden
            && (2..=8).contains(&kc)
            && dv.is_multiple_of(32)
            && (dv / 32).is_power_of_two()
            && dv / 32 <= w.out_proj.inp / 256;
        if !fits {
            return false;
        }
        if !(self.buf_ok(h, d.hidden, "h", op)
            && self.buf_ok(norm, d.hidden, "norm", op)
            && self.buf_ok(w.conv1d, c * kc, "conv1d", op)
            && self.buf_ok(conv, (kc - 1) * c, "conv state", op)
            && self.act_ok(t.xn, d.hidden, "xn", op)
            && self.act_ok(t.qkv_c, c, "qkv_c", op)
            && self.act_ok(t.z, z.out, "z", op)
            && self.act_ok(t.b, b.out, "b", op)
            && self.act_ok(t.a, a.out, "a", op))
        {
            return true;
        }
        let outs = [
            (t.qkv_c.mem.ptr, 3),
            (t.z.mem.ptr, 1),
            (t.b.mem.ptr, 1),
            (t.a.mem.ptr, 1),
        ];
        self.sw_gemv_route(
            super::decode::SwX::Norm {
                h,
                w: norm,
                eps,
                xn: Some(t.xn),
            },
            &w.in_proj,
            &outs,
            None,
            Some(super::decode::SwConv {
                w: w.conv1d,
                state: conv,
                k: kc,
            }),
            None,
        );
        let Some(y) = self.gdn_scan_norm(t.qkv_c, t.z, t.b, t.a, w.params, ssm, d, 1, None) else {
            return true;
        };
        let x = super::decode::SwX::Gated {
            y,
            z: t.z,
            w: &w.params.norm,
            eps: d.eps,
            dv,
        };
        match &w.route_ahead {
            Some(n) => self.ahead_gemv(x, w.out_proj, h, n),
            None => self.sw_gemv(x, &[w.out_proj], &[(h.mem.ptr, 2)]),
        }
        true
    }

    /// The GDN decode mixer with the opt-in `gdn_step`: in_proj (with the norm, rms_norm_matmul),
    /// ONE launch for the conv, the gated delta step and the gated norm (gdn.cu's gdn_step_<K>),
    /// out_proj with the residual add: 3 kernels where the composition runs 5. The scratch holds
    /// what the composition leaves there (qkv, qkv_c, z, b, a, y). `false`: the switch is off or
    /// the shapes do not fit the kernel (Dk = 128, Dv a multiple of 32 up to 128, clusters of at
    /// most 8 blocks, 2 to 4 conv taps, sm_90): nothing was launched.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gdn_mixer_step(
        &self,
        h: &mut Buf,
        norm: &Buf,
        eps: f32,
        w: &super::super::GdnWeights<'_, Cuda>,
        conv: &mut Buf,
        ssm: &mut Buf,
        d: &Dims,
        t: &mut super::super::GdnScratch<'_, Cuda>,
    ) -> bool {
        let Some(cl) = self.gdn_step_cluster(d) else {
            return false;
        };
        self.rms_norm_matmul(
            h,
            norm,
            1,
            d.hidden,
            eps,
            t.xn,
            &w.in_proj,
            &mut [&mut *t.qkv, &mut *t.z, &mut *t.b, &mut *t.a],
        );
        self.gdn_step(
            t.qkv, t.z, t.b, t.a, w.conv1d, w.params, conv, ssm, d, cl, t.qkv_c, t.y,
        );
        super::super::out_proj_add(self, t.y, w.out_proj, t.r, h, w.route_ahead.as_ref());
        true
    }

    /// The cluster size of gdn_step (blocks per key head: (Hv/Hk)·(Dv/32)) when the switch is on
    /// and the shapes fit it.
    fn gdn_step_cluster(&self, d: &Dims) -> Option<usize> {
        let (hk, hv, dk, dv, kc) = (
            d.gdn_k_heads,
            d.gdn_v_heads,
            d.gdn_k_dim,
            d.gdn_v_dim,
            d.conv_kernel,
        );
        let fits = self.on("gdn_step")
            && self.pdl_ok
            && dk == 128
            && dv.is_multiple_of(32)
            && (32..=128).contains(&dv)
            && hk > 0
            && hv.is_multiple_of(hk)
            && (2..=4).contains(&kc);
        let cl = if fits { hv / hk * (dv / 32) } else { 0 };
        (1..=8).contains(&cl).then_some(cl)
    }

    /// One token's conv1d_step + gdn_decode (the delta rule and the gated norm) as one launch:
    /// `qkv` is in_proj's output before the conv; writes the conv output to `qkv_c` and the gated
    /// norm's output to `out`, and replaces both states. Grid Hk·cl blocks of 256 threads in
    /// clusters of cl (gdn.cu's header).
    #[allow(clippy::too_many_arguments)]
    fn gdn_step(
        &self,
        qkv: &Buf,
        z: &Buf,
        b: &Buf,
        a: &Buf,
        cw: &Buf,
        p: &GdnParams<Buf>,
        conv: &mut Buf,
        ssm: &mut Buf,
        d: &Dims,
        cl: usize,
        qkv_c: &mut Buf,
        out: &mut Buf,
    ) {
        let op = "gdn_step";
        let (hk, hv, dk, dv, kc) = (
            d.gdn_k_heads,
            d.gdn_v_heads,
            d.gdn_k_dim,
            d.gdn_v_dim,
            d.conv_kernel,
        );
        let c = d.conv_channels();
        if !(self.act_ok(qkv, c, "qkv", op)
            && self.act_ok(z, hv * dv, "z", op)
            && self.act_ok(b, hv, "b", op)
            && self.act_ok(a, hv, "a", op)
            && self.buf_ok(cw, c * kc, "conv1d", op)
            && self.buf_ok(conv, (kc - 1) * c, "conv state", op)
            && self.buf_ok(&p.a_log, hv, "a_log", op)
            && self.buf_ok(&p.dt_bias, hv, "dt_bias", op)
            && self.buf_ok(&p.norm, dv, "norm", op)
            && self.buf_ok(ssm, hv * dv * dk, "state", op)
            && self.act_ok(qkv_c, c, "qkv_c", op)
            && self.act_ok(out, hv * dv, "out", op))
        {
            return;
        }
        self.launch_ex(
            &format!("gdn_step_{kc}"),
            ((hk * cl) as u32, 1, 1),
            256,
            0,
            cl as u32,
            &[
                Arg::P(qkv.mem.ptr),
                Arg::P(z.mem.ptr),
                Arg::P(b.mem.ptr),
                Arg::P(a.mem.ptr),
                Arg::P(cw.mem.ptr),
                Arg::P(conv.mem.ptr),
                Arg::P(p.a_log.mem.ptr),
                Arg::P(p.dt_bias.mem.ptr),
                Arg::P(p.norm.mem.ptr),
                Arg::P(ssm.mem.ptr),
                Arg::P(qkv_c.mem.ptr),
                Arg::P(out.mem.ptr),
                Arg::I(hk as i32),
                Arg::I(hv as i32),
                Arg::I(dv as i32),
                Arg::F(d.eps),
            ],
        );
    }
}
