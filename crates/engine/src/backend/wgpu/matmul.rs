//! Quantized matrices on the device and `matmul_q` (shaders/matmul.wgsl; cpu/matmul.rs is the
//! twin).

use anyhow::{bail, Result};

use super::device::{as_bytes, Ctx, Shader};
use super::{WBuf, WMat};
use crate::loader::tensor::{Dtype, HostLinear, LinearKind};

pub const SHADER: Shader = Shader {
    name: "matmul",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/quant.wgsl"),
        include_str!("shaders/matmul.wgsl")
    ),
};

/// Uploads a (stack of) matrices in the checkpoint's format: codes as they are, scales and
/// biases as bf16 pairs when the checkpoint has bf16 (its type), else widened to f32; a dense
/// matrix as f32.
pub fn upload_mat(ctx: &Ctx, m: &HostLinear) -> Result<WMat> {
    match &m.kind {
        LinearKind::Quant {
            bits,
            group_size,
            w,
            scales,
            biases,
        } => {
            if !matches!(bits, 2 | 4 | 8) || *group_size == 0 || m.inp % group_size != 0 {
                bail!("{}: {bits}-bit codes in groups of {group_size} over {} inputs: not a layout the wgpu kernels read", m.name, m.inp);
            }
            let sb16 = scales.dtype == Dtype::BF16 && biases.dtype == Dtype::BF16;
            let sb = |t: &crate::loader::tensor::HostTensor| -> Result<::wgpu::Buffer> {
                if sb16 {
                    ctx.upload(t.bytes())
                } else {
                    let f = t.floats()?;
                    let v: Vec<f32> = (0..f.len()).map(|i| f.get(i)).collect();
                    ctx.upload(as_bytes(&v))
                }
            };
            Ok(WMat {
                n: m.n,
                out: m.out,
                inp: m.inp,
                bits: *bits,
                gs: *group_size,
                sb16,
                w: ctx.upload(as_bytes(w.u32s()))?,
                s: sb(scales)?,
                b: sb(biases)?,
            })
        }
        LinearKind::Dense(t) => {
            let f = t.floats()?;
            let v: Vec<f32> = (0..f.len()).map(|i| f.get(i)).collect();
            Ok(WMat {
                n: m.n,
                out: m.out,
                inp: m.inp,
                bits: 32,
                gs: 1,
                sb16: false,
                w: ctx.upload(as_bytes(&v))?,
                s: ctx.buffer(4)?,
                b: ctx.buffer(4)?,
            })
        }
    }
}

/// `out[t] = x[t] · W_eᵀ` for matrix `e` of the stack, `rows` rows of x.
pub fn matmul_q(ctx: &Ctx, x: &WBuf, w: &WMat, e: usize, rows: usize, out: &mut WBuf) {
    if e >= w.n || x.len < rows * w.inp || out.len < rows * w.out {
        ctx.fail(format!(
            "matmul_q: matrix {e} of {} [{}, {}], {rows} rows: x has {}, out {} elements",
            w.n, w.out, w.inp, x.len, out.len
        ));
        return;
    }
    let mut p = w.qmat().to_vec();
    p.extend([rows as u32, e as u32, 0, 0]);
    let bufs = [&w.w, &w.s, &w.b, &x.buf, &out.buf];
    if rows == 1 {
        ctx.dispatch(&SHADER, "gemv", &p, &bufs, w.out.div_ceil(8) as u32);
    } else {
        let tiles = w.out.div_ceil(16) * rows.div_ceil(16);
        ctx.dispatch(&SHADER, "gemm", &p, &bufs, tiles as u32);
    }
}
