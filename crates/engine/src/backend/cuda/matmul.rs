//! The matrix products of a prefill and of the decode rows the streaming GEMVs (decode.rs) do not
//! take: kernel choice by shape (matmul.cu: warp-per-row GEMVs, skinny matrices, tensor-core and
//! SIMT GEMMs).

use super::*;

impl Cuda {
    /// `out (type obf: 0 f32, 1 bf16, 2 f32 +=) = x · Wᵀ` by shape: the streaming GEMV for one
    /// row where it fits, the warp-per-row GEMVs up to 8 rows, skinny matrices, then the
    /// tensor-core (or SIMT) GEMM. The caller checked the operands.
    pub(super) fn matmul_into(&self, x: &Buf, w: &Mat, rows: usize, out: u64, obf: i32) {
        if rows == 1 && self.sw_fits(&[w]) {
            self.sw_gemv(decode::SwX::Act(x), &[w], &[(out, obf)]);
            return;
        }
        let args = [
            Arg::P(x.mem.ptr),
            Arg::Q(w.q()),
            Arg::P(out),
            Arg::I(rows as i32),
            Arg::I(obf),
        ];
        if rows <= 8 {
            let r = rows.next_power_of_two();
            let ahead = if r == 1 { gemv_ahead(w.out) } else { "" };
            self.launch(
                &format!("gemv{r}{ahead}_{}", w.fmt.suffix()),
                (grid1(w.out, 8), 1, 1),
                256,
                0,
                &args,
            );
        } else if w.out <= SKINNY_OUT {
            // Block y takes row y: each warp one (row, output) dot, x rows shared through L1.
            self.launch(
                &format!("gemv1_{}", w.fmt.suffix()),
                (grid1(w.out, 8), rows as u32, 1),
                256,
                0,
                &args,
            );
        } else if self.tensor_core_gemm() {
            self.launch(
                &format!("tc_gemm_{}", w.fmt.suffix()),
                (grid1(w.out, 64), grid1(rows, 64), 1),
                128,
                TC_SMEM_1,
                &args,
            );
        } else {
            self.launch(
                &format!("gemm_{}", w.fmt.suffix()),
                (grid1(w.out, 64), grid1(rows, 64), 1),
                256,
                0,
                &args,
            );
        }
    }

    /// matmul_q_many on the warp-per-row kernels of matmul.cu (one launch for a decode row of
    /// matrices in one format; otherwise one matmul_q each).
    pub(super) fn matmul_q_many_warp(
        &self,
        x: &Buf,
        ws: &[&Mat],
        rows: usize,
        outs: &mut [&mut Buf],
    ) {
        let fmt = ws.first().map(|w| w.fmt);
        let one = rows == 1
            && (1..=4).contains(&ws.len())
            && ws.len() == outs.len()
            && ws
                .iter()
                .all(|w| Some(w.fmt) == fmt && w.n == 1 && w.inp == ws[0].inp);
        if !one {
            for (w, o) in ws.iter().zip(outs.iter_mut()) {
                self.matmul_q(x, w, rows, o);
            }
            return;
        }
        let op = "matmul_q_many";
        if !self.act_ok(x, ws[0].inp, "x", op)
            || !ws
                .iter()
                .zip(outs.iter())
                .all(|(w, o)| self.out_ok(o, w.out, "out", op))
        {
            return;
        }
        let mut p = Many {
            m: [QMat::none(); 4],
            out: [0; 4],
            bstart: [0; 5],
            n: ws.len() as i32,
            obf: [0; 4],
        };
        for (i, (w, o)) in ws.iter().zip(outs.iter()).enumerate() {
            p.m[i] = w.q();
            p.out[i] = o.mem.ptr;
            p.obf[i] = o.bf16();
            p.bstart[i + 1] = p.bstart[i] + grid1(w.out, 8) as i32;
        }
        for i in ws.len() + 1..5 {
            p.bstart[i] = p.bstart[ws.len()];
        }
        let blocks = p.bstart[ws.len()] as u32;
        let ahead = gemv_ahead(ws.iter().map(|w| w.out).sum());
        self.launch(
            &format!("gemv_many{ahead}_{}", ws[0].fmt.suffix()),
            (blocks, 1, 1),
            256,
            0,
            &[Arg::P(x.mem.ptr), Arg::M(Box::new(p))],
        );
    }
}
