//! Quantized matrices on the device and `matmul_q` (shaders/matmul.wgsl; cpu/matmul.rs is the
//! twin). For up to `GEMV_MAX_ROWS` rows of x, when the codes are 4- or 8-bit in groups of whole
//! 16-byte words (every matrix of the model), `matmul_q` takes the decode GEMV `gemv_many` picks
//! (`LILY_WGPU_GEMV`): gemv_q6 (matmul_sg.wgsl, x staged once by xq.wgsl's q2x_stage) for
//! launches of `LILY_WGPU_Q6_MIN_KB` of codes on adapters with ordered subgroups of one width,
//! else gemv_v5 (x quantized in every workgroup), or gemv_v4 / gemv_rw / gemv_xs (x in f32).
//! Otherwise the scalar `gemv` for one row of anything else, and the register-tiled `gemm` for
//! the rest (matmul.wgsl's 64 × 64; gemm.wgsl's 128 × 128 `gemm_big` with
//! `LILY_WGPU_GEMM=big`, past `GEMM_BIG_MIN_ROWS` rows of 4/8-bit codes in groups of 16;
//! gemm_coop.wgsl's 64 × 128 `gemm_coop` on cooperative matrices with `LILY_WGPU_GEMM=coop`
//! or `coop1`, where the adapter has them: `coop_shader`).

use std::sync::atomic::Ordering;

use anyhow::{bail, Result};

use super::device::{as_bytes, Ctx, Shader};
use super::{WBuf, WMat};
use crate::loader::tensor::{Dtype, HostLinear, LinearKind};

pub const SHADER: Shader = Shader {
    name: "matmul",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/quant.wgsl"),
        include_str!("shaders/gemv_io.wgsl"),
        include_str!("shaders/q2x.wgsl"),
        include_str!("shaders/matmul.wgsl")
    ),
};

/// q2x_stage (xq.wgsl): x quantized once a launch for gemv_q6.
pub const XQ_SHADER: Shader = Shader {
    name: "xq",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/q2x.wgsl"),
        include_str!("shaders/q2x_sg.wgsl"),
        include_str!("shaders/xq.wgsl"),
        include_str!("shaders/xq_route.wgsl")
    ),
};

/// Vec4s of x as q2x_stage stages a row of `inp` elements (xq.wgsl: both layouts, 5.5 bytes an
/// element).
pub fn xq_row(inp: usize) -> usize {
    5 * (inp / 32) + 3 * (inp / 16)
}

/// gemm.wgsl's `gemm_big` with each k step's products summed apart (`LILY_WGPU_GEMM=big`).
pub const GEMM_SHADER: Shader = Shader {
    name: "gemm",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/quant.wgsl"),
        "const GB_APART: bool = true;\n",
        include_str!("shaders/gemm.wgsl")
    ),
};

/// gemm.wgsl's `gemm_big` with one FMA chain an output (`LILY_WGPU_GEMM=chain`).
pub const GEMM_CHAIN_SHADER: Shader = Shader {
    name: "gemm_chain",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/quant.wgsl"),
        "const GB_APART: bool = false;\n",
        include_str!("shaders/gemm.wgsl")
    ),
};

/// gemm_coop.wgsl's `gemm_coop` (`LILY_WGPU_GEMM=coop`): cooperative matrices, f16 operands
/// and f32 sums, the staged tiles as vec4<f16> elements. Its module only validates where naga
/// has cooperative matrices and f16 (the `enable`s first: WGSL wants them before any
/// declaration); it runs only where `AdapterReport::coop16`.
pub const GEMM_COOP_SHADER: Shader = Shader {
    name: "gemm_coop",
    src: concat!(
        "enable f16;\nenable wgpu_cooperative_matrix;\n",
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/quant.wgsl"),
        "alias GcT = vec4<f16>;
const GC_V: u32 = 4u;
fn gc_put_x4(at: u32, v: vec4<f16>) { gc_x[at / 4u] = v; }
fn gc_put_w4(at: u32, v: vec4<f16>) { gc_w[at / 4u] = v; }
",
        include_str!("shaders/gemm_coop.wgsl")
    ),
};

/// The same with the staged tiles as f16 scalars (`LILY_WGPU_GEMM=coop1`): the fallback should
/// a driver mishandle cooperative loads through vector elements.
pub const GEMM_COOP1_SHADER: Shader = Shader {
    name: "gemm_coop1",
    src: concat!(
        "enable f16;\nenable wgpu_cooperative_matrix;\n",
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/quant.wgsl"),
        "alias GcT = f16;
const GC_V: u32 = 1u;
fn gc_put_x4(at: u32, v: vec4<f16>) {
    gc_x[at] = v.x; gc_x[at + 1u] = v.y; gc_x[at + 2u] = v.z; gc_x[at + 3u] = v.w;
}
fn gc_put_w4(at: u32, v: vec4<f16>) {
    gc_w[at] = v.x; gc_w[at + 1u] = v.y; gc_w[at + 2u] = v.z; gc_w[at + 3u] = v.w;
}
",
        include_str!("shaders/gemm_coop.wgsl")
    ),
};

/// `gemm_coop`'s block: rows of x and outputs a workgroup, and the k step its inputs must be a
/// multiple of.
pub const COOP_ROWS: usize = 64;
pub const COOP_OUTS: usize = 128;
pub const COOP_K: usize = 32;

/// Rows of x past which `gemm_big` (128-row blocks) is taken over matmul.wgsl's `gemm` (64-row
/// blocks). Up to 64 rows the old tile wastes nothing and, with half as many outputs a block,
/// makes twice the workgroups (a 2048-output matrix: 32 against 16, on a GPU of 132 SMs: the
/// wave is what is short there, not the FMAs); past it a 128-row block wastes at most half
/// its rows once (65 rows: as much as the old tile's second block) and gets the bigger tile's
/// FMA rate.
pub const GEMM_BIG_MIN_ROWS: usize = 64;

/// The module of `gemm_big` for this matrix and rows of x (`Switches::gemm`), `None` for
/// matmul.wgsl's `gemm`: its 4/8-bit codes in groups of a multiple of its k step (16; every
/// matrix of the model), more than `GEMM_BIG_MIN_ROWS` rows.
pub fn gemm_shader(ctx: &Ctx, w: &WMat, rows: usize) -> Option<&'static Shader> {
    let takes = matches!(w.bits, 4 | 8)
        && w.gs.is_multiple_of(16)
        && w.inp > 0
        && w.inp.is_multiple_of(w.gs)
        && rows > GEMM_BIG_MIN_ROWS;
    match ctx.sw.gemm.load(Ordering::Relaxed) {
        1 if takes => Some(&GEMM_SHADER),
        2 if takes => Some(&GEMM_CHAIN_SHADER),
        _ => None,
    }
}

/// The `gemm_coop` module that takes this matrix and rows of x under `LILY_WGPU_GEMM=coop`
/// (`Switches::gemm` 3: `GEMM_COOP_SHADER`) or `coop1` (4: `GEMM_COOP1_SHADER`), if any: an
/// adapter with `coop16` (16×16×16 f16 · f16 + f32 cooperative matrices, subgroups of at most
/// 32: the header's warp tiles), 4/8-bit codes in groups of a multiple of 8 (a staged chunk of
/// 8 codes in one group), inputs a multiple of the k step (32), more than `GEMM_BIG_MIN_ROWS`
/// rows. Anything else takes the old `gemm`.
pub fn coop_shader(ctx: &Ctx, w: &WMat, rows: usize) -> Option<&'static Shader> {
    let sh = match ctx.sw.gemm.load(Ordering::Relaxed) {
        3 => &GEMM_COOP_SHADER,
        4 => &GEMM_COOP1_SHADER,
        _ => return None,
    };
    let takes = ctx.report.coop16
        && matches!(w.bits, 4 | 8)
        && w.gs > 0
        && w.gs.is_multiple_of(8)
        && w.inp > 0
        && w.inp.is_multiple_of(COOP_K)
        && w.inp.is_multiple_of(w.gs)
        && rows > GEMM_BIG_MIN_ROWS;
    takes.then_some(sh)
}

/// matmul_sg.wgsl made whole: its per-matrix parts for each of the 4 matrix slots, its per-rows
/// part for each slot and R, its entries for each R / NW, gemv_q6's parts (the file's header
/// says why).
pub fn sg_shader() -> Shader {
    static SRC: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let src = SRC.get_or_init(|| {
        let t = include_str!("shaders/matmul_sg.wgsl");
        // The file's parts: the head, then each `//@@ name` marker's text up to the next.
        let mut parts = t.split("//@@ ");
        let head = parts.next().unwrap_or_default();
        let part = |name: &str| -> String {
            t.split("//@@ ")
                .find_map(|p| p.strip_prefix(name).filter(|r| r.starts_with('\n')))
                .unwrap_or_else(|| panic!("matmul_sg.wgsl: no //@@ {name} part"))
                .to_string()
        };
        let (matrix, rows, entry, xs, xsentry, q6, q6entry) = (
            part("matrix"),
            part("rows"),
            part("entry"),
            part("xs"),
            part("xsentry"),
            part("q6"),
            part("q6entry"),
        );
        let mut s = String::from(include_str!("shaders/common.wgsl"));
        s += include_str!("shaders/gemv_io.wgsl");
        s += include_str!("shaders/q2x.wgsl");
        s += include_str!("shaders/q2x_sg.wgsl");
        s += head;
        let sub = |t: &str, m: u32, r: u32| {
            t.replace("{M}", &m.to_string())
                .replace("{R}", &r.to_string())
                .replace("{NW}", &r.to_string())
        };
        for m in 0..4 {
            s += &sub(&matrix, m, 0);
        }
        for r in SG_ROWS {
            for m in 0..4 {
                s += &sub(&rows, m, r);
            }
            s += &sub(&entry, 0, r);
        }
        for nw in XS_WORDS {
            for m in 0..4 {
                s += &sub(&xs, m, nw);
            }
            s += &sub(&xsentry, 0, nw);
        }
        for m in 0..4 {
            s += &sub(&q6, m, 0);
        }
        s + &q6entry
    });
    Shader {
        name: "matmul_sg",
        src,
    }
}

/// The code words a lane of gemv_xs takes in a row: its entry points (gemv_xs1 … gemv_xs8).
pub const XS_WORDS: [u32; 4] = [1, 2, 4, 8];

/// The rows a thread of gemv_rw takes: its entry points (gemv_rw1, gemv_rw2, gemv_rw4).
pub const SG_ROWS: [u32; 3] = [1, 2, 4];

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
            if !matches!(bits, 2 | 4 | 8) || *group_size == 0 || !m.inp.is_multiple_of(*group_size)
            {
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

/// Rows of x up to which `gemv_v4` (one pass over the weights per row of x, the rows of a block
/// side by side so that the weights come from the cache after the first) is taken over `gemm`.
pub const GEMV_MAX_ROWS: usize = 8;

/// Threads a row for `gemv_v4`: 16 (each thread 4 code words of a 2048-wide 4-bit row per
/// pass), doubled while the workgroups (1024 / lanes rows each) are fewer than `want`
/// (`Switches::gemv_wgs`, 1024 by default), so that a big GPU gets several waves; never more than the row's 16-byte words of a pass (no idle
/// lanes), at least 4 (a row group's first 4 lanes write its 4 outputs).
fn gemv_lanes(out: usize, v4_pass: usize, want: usize) -> usize {
    let mut lanes = 16;
    while lanes < 256 && lanes < v4_pass && out.div_ceil(1024 / lanes) < want {
        lanes *= 2;
    }
    while lanes > 4 && lanes > v4_pass {
        lanes /= 2;
    }
    lanes
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
    if rows == 0 || w.out == 0 {
        return;
    }
    if rows <= GEMV_MAX_ROWS && gemv_takes(ctx, w) {
        gemv_many(
            ctx,
            x,
            &[w],
            e,
            rows,
            &mut [out],
            XIn::Plain,
            OutMode::Store,
        );
        return;
    }
    let bufs = [&w.w, &w.s, &w.b, &x.buf, &out.buf];
    let mut p = w.qmat().to_vec();
    p.extend([rows as u32, e as u32, 0, 0, 0, 0, 0, 0]);
    if rows == 1 {
        ctx.dispatch(&SHADER, "gemv", &p, &bufs, w.out.div_ceil(8) as u32);
    } else if let Some(sh) = coop_shader(ctx, w, rows) {
        // x_off and out_off are 0 (x read as vec4s, whole tiles stored by coopStoreT: offsets
        // a multiple of 4).
        let tiles = w.out.div_ceil(COOP_OUTS) * rows.div_ceil(COOP_ROWS);
        ctx.dispatch(sh, "gemm_coop", &p, &bufs, tiles as u32);
    } else if let Some(sh) = gemm_shader(ctx, w, rows) {
        // x_off and out_off are 0 (gemm_big reads x as vec4s: offsets a multiple of 4).
        let tiles = w.out.div_ceil(128) * rows.div_ceil(128);
        ctx.dispatch(sh, "gemm_big", &p, &bufs, tiles as u32);
    } else {
        let tiles = w.out.div_ceil(64) * rows.div_ceil(64);
        ctx.dispatch(&SHADER, "gemm", &p, &bufs, tiles as u32);
    }
}

/// Storage buffers a gemv_v4 launch binds (4 matrices × 3, x, 4 outputs, 4 for the modes);
/// gemv_q6 binds one more (the router fold's sums, binding 22: `q6_takes`).
const GEMV_BUFFERS: u32 = 21;

/// Whether `gemv_v4` reads this matrix: 4- or 8-bit codes whose 16-byte words each lie in one
/// scale group (every matrix of the model), on an adapter with the storage buffers it binds.
pub fn gemv_takes(ctx: &Ctx, w: &WMat) -> bool {
    matches!(w.bits, 4 | 8)
        && w.gs.is_multiple_of(128 / w.bits as usize)
        && w.inp.is_multiple_of(4)
        && ctx.report.storage_buffers >= GEMV_BUFFERS
}

/// How `gemv_v4` reads its x.
pub enum XIn<'a> {
    /// As it is.
    Plain,
    /// `rms_norm(h) · w` of the h given (each workgroup normalises its row itself), also
    /// written to `xn` (by the first workgroup of each row).
    Norm { w: &'a WBuf, eps: f32, xn: &'a WBuf },
    /// `silu(x) · u` (the shared expert's swiglu, x being its gate projection).
    Glu { u: &'a WBuf },
    /// gemv_q6 only (`q6_takes`): the GDN layer's gated norm, `rms_norm(x_h) · w · silu(z_h)`
    /// for each head h of `hd` elements (gdn.wgsl gdn_norm), applied as q2x_stage stages x
    /// (xq.wgsl xmode 3): out_proj reads y and z, one launch fewer a GDN layer.
    GatedNorm {
        z: &'a WBuf,
        w: &'a WBuf,
        eps: f32,
        hd: usize,
    },
    /// gemv_q6 only (`q6_takes`): x already staged in q2x_stage's layouts in `xq` (from
    /// `xq_scratch`; gdn.rs `gated_delta_x` writes it), so no q2x_stage runs and the `x` given
    /// to `gemv_many` is not read.
    Staged { xq: &'a ::wgpu::Buffer },
    /// gemv_q6s only, one row: x staged without its norm's 1 / rms by the launch that wrote
    /// what it norms, with a partial sum of squares for every 32 elements after the row: x =
    /// rms_norm(h) · w by the projection or the MoE block before (`OutMode::AddStage`,
    /// moe_down_ys; `stage_ahead_scratch`; `group` = the row), or the gated norm of each head by
    /// gdn_step_xs (`gdn::xs_scratch`; `group` = the head size, a multiple of 32). The dots are
    /// scaled by each group's 1 / rms (matmul_sg.wgsl q6_rn, q6_hscale; Q6_RNG), with `eps`.
    StagedRn {
        xq: &'a ::wgpu::Buffer,
        eps: f32,
        group: usize,
    },
}

/// The scratch a projection with `OutMode::AddStage` stages the MoE block's x into: q2x's
/// layouts for one row of `n` (`xq_row(n)` vec4s), then the workgroups' n / 32 partial sums of
/// squares.
pub fn stage_ahead_scratch(ctx: &Ctx, n: usize) -> Result<::wgpu::Buffer> {
    ctx.scratch("xq_ahead", (16 * xq_row(n) + 4 * (n / 32)) as u64)
}

/// gemv_q6's team (T, R) for `OutMode::AddStage`: 32 rows a workgroup (256 R / T = 32, T = 8 R),
/// R = 4 where the row has 32 code words or more, else fewer.
fn stage_ahead_shape(words: usize) -> (usize, usize) {
    match words {
        32.. => (32, 4),
        16.. => (16, 2),
        _ => (8, 1),
    }
}

/// Whether gemv_q6 can stage the MoE block's x ahead (`OutMode::AddStage`) in the one-row
/// projection `w` added into h, for a router `router` | `sgate` and experts read through
/// gemv_q6s and moe_gate_up_y (the caller checks those: `LILY_WGPU_XQ_AHEAD=1`): `w` on gemv_q6
/// with its pipeline constants, 8 or more code words a row, out a multiple of 128 (whole
/// words, the partial sums in vec4s) and the norm's weights as long.
pub fn stage_ahead_takes(
    ctx: &Ctx,
    w: &WMat,
    router: &WMat,
    sgate: &WMat,
    norm_len: usize,
) -> bool {
    ctx.sw.xq_moe.load(Ordering::Relaxed)
        && ctx.sw.q6_spec.load(Ordering::Relaxed)
        && ctx.sw.fuse_epilogue
        && w.n == 1
        && q6_takes(ctx, &[w])
        && q6_takes(ctx, &[router, sgate])
        && w.inp / (128 / w.bits as usize) >= 8
        && w.out.is_multiple_of(128)
        && [router, sgate].iter().all(|m| m.n == 1 && m.inp == w.out)
        && norm_len >= w.out
}

/// The scratch q2x_stage stages `rows` rows of x of `inp` elements into (xq.wgsl's layouts),
/// for a kernel that stages x itself before `gemv_many` with `XIn::Staged`.
pub fn xq_scratch(ctx: &Ctx, rows: usize, inp: usize) -> Result<::wgpu::Buffer> {
    ctx.scratch("gemv_xq", (16 * rows * xq_row(inp)) as u64)
}

/// How `gemv_v4` writes its outputs.
pub enum OutMode<'a> {
    Store,
    /// `out += acc` (a projection added into the residual stream).
    Add,
    /// `out += r + sigmoid(s[t]) · acc`: the shared expert's down projection, gated, with the
    /// routed experts' sum `r` and the residual add of the MoE block.
    Residual {
        r: &'a WBuf,
        s: &'a WBuf,
    },
    /// gemv_q6 only (`q6_takes`): matrix 0's outputs are the GDN layer's conv input for one
    /// token; its epilogue runs the causal conv of kernel 4 and SiLU on them (gdn.wgsl
    /// `conv1d`, one channel a lane: `out = silu(Σ_tap w[ch, tap] · in[tap])`, in = the 3 state
    /// rows then the new value) and shifts the new value into `state` [3, C]. The other
    /// matrices' outputs are stored. One launch fewer a GDN layer.
    Conv {
        w: &'a WBuf,
        state: &'a WBuf,
    },
    /// gemv_q6 only, one row (`Backend::route_ahead`): `Add`, with the MoE router that follows
    /// folded in (matmul_sg.wgsl omode 4): the launch's workgroups sum each row of `router`
    /// (8-bit, [E, out]) and of `sgate` ([1, out]) against their rows of the new h times `norm`,
    /// into the scratch `route_ahead` (`ahead_sums`), which `q2x_stage_ahead` consumes.
    AddAhead {
        router: &'a WMat,
        sgate: &'a WMat,
        norm: &'a WBuf,
    },
    /// gemv_q6s only, one row (`Backend::route_ahead` with `LILY_WGPU_XQ_AHEAD=1`): `Add`, then
    /// the MoE block's x = rms_norm(h) · `norm` staged from the new h without the 1 / rms, with
    /// the workgroups' partial sums of squares after it (matmul_sg.wgsl omode 5), into
    /// `stage_ahead_scratch`: the block reads it through `XIn::StagedRn` and moe_gate_up_y's
    /// MY_RN, and no q2x_stage runs before the router.
    AddStage {
        norm: &'a WBuf,
    },
    /// gemv_q6s only, one row (`LILY_WGPU_XQ_AHEAD=fold`): `AddStage`, and the router `router`
    /// | `sgate` folded in without atomics (matmul_sg.wgsl omode 6): each workgroup's dots of
    /// every router row with its 32 rows of h · `norm` after the sums of squares
    /// (`fold_ahead_scratch`), which moe_gate_up_y (MY_FOLD) turns into the logits: the block
    /// runs no router launch.
    AddStageFold {
        router: &'a WMat,
        sgate: &'a WMat,
        norm: &'a WBuf,
    },
}

/// The scratch a projection with `OutMode::AddStageFold` writes: `stage_ahead_scratch`'s, then
/// the E + 1 router rows' dots from each of the n / 32 workgroups (a row's contiguous).
pub fn fold_ahead_scratch(ctx: &Ctx, n: usize, e: usize) -> Result<::wgpu::Buffer> {
    ctx.scratch(
        "xq_ahead",
        (16 * xq_row(n) + 4 * (n / 32) + 4 * (n / 32) * (e + 1)) as u64,
    )
}

/// The fold's sums (gemv_q6 omode 4 → q2x_stage_ahead): `[E + 1]` fixed-point values, six u32
/// each (matmul_sg.wgsl fold_add; zeroed when made, q2x_stage_ahead leaves them at zero).
fn ahead_sums(ctx: &Ctx, e: usize) -> Result<::wgpu::Buffer> {
    ctx.scratch("route_ahead", (24 * (e + 1)) as u64)
}

/// Whether gemv_q6 can fold the MoE router `router` | `sgate` (norm weights of `norm_len`) into
/// the one-row projection `w` added into h (OutMode::AddAhead): opt-in `LILY_WGPU_ROUTE_AHEAD=1`,
/// `w` on gemv_q6, an 8-bit router and shared gate of K = w's rows, and a workgroup's rows
/// (256 R / T, q6_shape) a multiple of 4 up to 256 (q6_fx).
pub fn ahead_takes(ctx: &Ctx, w: &WMat, router: &WMat, sgate: &WMat, norm_len: usize) -> bool {
    let sgw = ctx.report.subgroup_min as usize;
    let words = w.inp / (128 / w.bits as usize);
    let (t, r) = q6_shape(w.out, words, sgw, q6_wants(ctx, &[w]));
    let rb = 256 / t * r;
    ctx.sw.route_ahead.load(Ordering::Relaxed)
        && ctx.sw.fuse_epilogue
        && w.n == 1
        && q6_takes(ctx, &[w])
        && rb.is_multiple_of(4)
        && rb <= 256
        && [router, sgate]
            .iter()
            .all(|m| m.bits == 8 && m.n == 1 && m.inp == w.out && m.gs.is_multiple_of(4))
        && sgate.out == 1
        && norm_len >= w.out
}

/// The MoE block's router after a projection that folded it (xq_route.wgsl q2x_stage_ahead):
/// h's row staged as q2x_stage stages rms_norm(h) · norm (written to `xn` too), the router's
/// `e` logits and the shared gate's logit from the sums, which it zeroes. Returns the staging
/// (`xq_scratch`), for the experts' gate|up.
#[allow(clippy::too_many_arguments)]
pub fn q2x_stage_ahead(
    ctx: &Ctx,
    h: &WBuf,
    norm: &WBuf,
    eps: f32,
    xn: &WBuf,
    logits: &WBuf,
    s: &WBuf,
    e: usize,
    hidden: usize,
) -> Result<::wgpu::Buffer> {
    let xq = xq_scratch(ctx, 1, hidden)?;
    let acc = ahead_sums(ctx, e)?;
    let xp = [hidden as u32, 1, 1, eps.to_bits(), 0, e as u32, 0, 0];
    stage(
        ctx,
        "q2x_stage_ahead",
        &xp,
        &[
            &h.buf,
            &norm.buf,
            &xn.buf,
            &xq,
            &ctx.spare[5],
            &acc,
            &logits.buf,
            &s.buf,
        ],
        1,
    );
    Ok(xq)
}

/// One `gemv_v4` launch for up to 4 matrices reading the same x (`rows` ≤ GEMV_MAX_ROWS rows):
/// `outs[i] = x · W_i,eᵀ`, each matrix its own range of workgroups, x read and the outputs
/// written as `xin` and `omode` say. The caller checks `gemv_takes` and the shapes.
#[allow(clippy::too_many_arguments)]
pub fn gemv_many(
    ctx: &Ctx,
    x: &WBuf,
    ws: &[&WMat],
    e: usize,
    rows: usize,
    outs: &mut [&mut WBuf],
    xin: XIn,
    omode: OutMode,
) {
    gemv_many_xq(ctx, x, ws, e, rows, outs, xin, omode, Q6w::Take);
}

/// `gemv_many`, returning the buffer x was staged in where gemv_q6 ran (xq.wgsl's layouts,
/// `xq_row` vec4s a row; the scratch `gemv_xq`, valid until the next GEMV stages) and whether
/// it was staged without its norm's 1 / rms (`XIn::StagedRn`'s layout, with the partial sums
/// of squares): the MoE block's moe_gate_up_x reads the router's staging of the normed x.
/// `q6w` says whether gemv_q6w may take the launch (`q6w_takes`), and whether it exports
/// its staging (`Q6w::Export`: the caller reads x staged without its 1 / rms).
#[allow(clippy::too_many_arguments)]
pub fn gemv_many_xq(
    ctx: &Ctx,
    x: &WBuf,
    ws: &[&WMat],
    e: usize,
    rows: usize,
    outs: &mut [&mut WBuf],
    xin: XIn,
    omode: OutMode,
    q6w: Q6w,
) -> Option<(::wgpu::Buffer, bool)> {
    debug_assert!(!ws.is_empty() && ws.len() <= 4 && ws.len() == outs.len());
    // Unused bindings take the device's spare buffers: outputs 1-3, then aux, xn, r, s.
    let dummies = &ctx.spare;
    let mut p: Vec<u32> = Vec::with_capacity(52);
    let (mut lanes, mut start, mut end) = ([0u32; 4], [0u32; 4], [0u32; 4]);
    let mut blocks = 0usize;
    // gemv_xs (8) or gemv_rw with `rw` rows a team where the adapter's subgroups allow it,
    // else gemv_v4 (0).
    let sgw = ctx.report.subgroup_min as usize;
    let fixed = ctx.report.subgroups && ctx.report.subgroup_min == ctx.report.subgroup_max;
    let mut nw = 1usize;
    let rw = match ctx.sw.gemv.load(Ordering::Relaxed) {
        8 if fixed => {
            for w in ws {
                nw = nw.max(
                    (w.inp / (128 / w.bits as usize))
                        .div_ceil(sgw)
                        .next_power_of_two(),
                );
            }
            if nw <= 8 {
                8
            } else {
                0
            }
        }
        r @ (1 | 2 | 4) if ctx.report.subgroups => r as usize,
        _ => 0,
    };
    // gemv_v5 (16) takes gemv_v4's launch; gemv_q6 (32) where `q6_takes`.
    let q6 = q6_takes(ctx, ws);
    let v5 = ctx.sw.gemv.load(Ordering::Relaxed) >= 16;
    let want = ctx.sw.gemv_wgs.load(Ordering::Relaxed);
    let q6_want = q6_wants(ctx, ws);
    for i in 0..4 {
        let w = ws[i.min(ws.len() - 1)];
        p.extend(w.qmat());
        if i < ws.len() {
            let words = w.inp / (128 / w.bits as usize);
            let (l, per) = if q6 {
                let (t, r) = if matches!(
                    omode,
                    OutMode::AddStage { .. } | OutMode::AddStageFold { .. }
                ) {
                    stage_ahead_shape(words)
                } else {
                    q6_shape(w.out, words, sgw, q6_want)
                };
                (t | r << 16, 256 / t * r)
            } else if rw == 8 {
                // Rows a workgroup: a pair for each subgroup at least, more while the
                // workgroups would exceed `want`.
                let pair = 2 * (256 / sgw);
                let rpw = w.out.div_ceil(want).next_multiple_of(pair).max(pair);
                (rpw, rpw)
            } else if rw > 0 {
                let l = rw_lanes(w.out, words, rw, want);
                (l, 256 / l * rw)
            } else {
                let l = gemv_lanes(w.out, w.inp.min(4096) / (128 / w.bits as usize), want);
                (l, 1024 / l)
            };
            lanes[i] = l as u32;
            start[i] = blocks as u32;
            blocks += w.out.div_ceil(per);
            end[i] = blocks as u32;
        }
    }
    let (xmode, eps, aux, xn) = match &xin {
        XIn::Plain => (0u32, 0.0f32, &dummies[3], &dummies[4]),
        XIn::Norm { w, eps, xn } => (1, *eps, &w.buf, &xn.buf),
        XIn::Glu { u } => (2, 0.0, &u.buf, &dummies[4]),
        XIn::GatedNorm { .. } if !q6 => {
            ctx.fail("gemv_many: the gated norm without gemv_q6".to_string());
            return None;
        }
        XIn::GatedNorm { z, eps, .. } => (3, *eps, &z.buf, &dummies[4]),
        XIn::Staged { .. } if !q6 => {
            ctx.fail("gemv_many: a staged x without gemv_q6".to_string());
            return None;
        }
        XIn::Staged { .. } => (0, 0.0, &dummies[3], &dummies[4]),
        XIn::StagedRn { .. } if !(q6 && rows == 1 && ctx.sw.q6_spec.load(Ordering::Relaxed)) => {
            ctx.fail("gemv_many: x staged ahead without gemv_q6s on one row".to_string());
            return None;
        }
        XIn::StagedRn { eps, .. } => (0, *eps, &dummies[3], &dummies[4]),
    };
    let (om, r, s) = match &omode {
        OutMode::Store => (0u32, &dummies[5], &dummies[6]),
        OutMode::Add => (1, &dummies[5], &dummies[6]),
        OutMode::Residual { r, s } => (2, &r.buf, &s.buf),
        OutMode::Conv { .. } if !q6 => {
            ctx.fail("gemv_many: the conv epilogue without gemv_q6".to_string());
            return None;
        }
        OutMode::Conv { .. } => (3, &dummies[5], &dummies[6]),
        OutMode::AddAhead { .. } if !(q6 && rows == 1) => {
            ctx.fail("gemv_many: the router folded in without gemv_q6 on one row".to_string());
            return None;
        }
        OutMode::AddAhead { .. } => (4, &dummies[5], &dummies[6]),
        OutMode::AddStage { .. } | OutMode::AddStageFold { .. }
            if !(q6 && rows == 1 && ws.len() == 1 && ctx.sw.q6_spec.load(Ordering::Relaxed)) =>
        {
            ctx.fail("gemv_many: x staged ahead without gemv_q6s on one row".to_string());
            return None;
        }
        OutMode::AddStage { .. } => (5, &dummies[5], &dummies[6]),
        OutMode::AddStageFold { .. } => (6, &dummies[5], &dummies[6]),
    };
    p.extend([ws.len() as u32, rows as u32, e as u32, xmode]);
    let xmode_at = p.len() - 1;
    p.extend(lanes);
    p.extend(start);
    p.extend(end);
    let ablate = if rw == 0 {
        ctx.sw.ablate.load(Ordering::Relaxed)
    } else {
        0
    };
    p.extend([eps.to_bits(), om, ablate, 0]);
    let mut bufs: Vec<&::wgpu::Buffer> = Vec::with_capacity(21);
    for i in 0..4 {
        let w = ws[i.min(ws.len() - 1)];
        bufs.extend([&w.w, &w.s, &w.b]);
    }
    bufs.push(&x.buf);
    for i in 0..4 {
        bufs.push(match outs.get(i) {
            Some(o) => &o.buf,
            None => &dummies[i - 1],
        });
    }
    bufs.extend([aux, xn, r, s]);
    if q6 {
        // Neither gemv_q6 nor gemv_q6w reads x's mode (q2x_stage or the workgroup's staging
        // applies it); the conv's weights and state take aux's and xn's bindings.
        p[xmode_at] = 0;
        if let OutMode::Conv { w, state } = &omode {
            bufs[17] = &w.buf;
            bufs[18] = &state.buf;
        }
    }
    if q6 && q6w_takes(ctx, ws, rows, &xin, om, blocks, q6w) {
        let export = q6w == Q6w::Export;
        // gemv_q6w: x staged in each workgroup, no q2x_stage launch. The raw x stays at binding
        // 13, the norm's weights go to 20 (vr: no output mode of gemv_q6w reads r; 18 holds
        // them too but for the conv's weights), the export to 22, xn stays at 19 but for the
        // conv's state.
        let inp = ws[0].inp;
        let exported = if export {
            match stage_ahead_scratch(ctx, inp) {
                Ok(b) => Some(b),
                Err(e) => {
                    ctx.fail(format!("gemv_q6w: {e:#}"));
                    return None;
                }
            }
        } else {
            None
        };
        if let XIn::Norm { w, .. } = &xin {
            bufs[19] = &w.buf;
        }
        bufs.push(exported.as_ref().unwrap_or(&dummies[7]));
        let mut consts = q6_spec(ctx, ws, rows, om, &lanes, &start);
        consts.extend([
            ("Q6W_XMODE", xmode),
            ("Q6W_L4", ws.iter().any(|w| w.bits == 4) as u32),
            ("Q6W_L8", ws.iter().any(|w| w.bits == 8) as u32),
            ("Q6W_EXPORT", export as u32),
            // xn by the first workgroup where the conv's state does not hold binding 19.
            ("Q6W_XN", (xmode == 1 && om != 3) as u32),
        ]);
        let rt = rt_rows(ctx, ws, xmode, om);
        if rt > 0 {
            // gemv_rt: the same bindings and constants, RT_R rows a workgroup.
            consts.push(("RT_R", rt as u32));
            let groups: usize = ws.iter().map(|w| w.out.div_ceil(rt)).sum();
            ctx.dispatch_spec(&sg_shader(), "gemv_rt", &consts, &p, &bufs, groups as u32);
            return exported.map(|b| (b, true));
        }
        let groups = (blocks * rows) as u32;
        ctx.dispatch_spec(&sg_shader(), "gemv_q6w", &consts, &p, &bufs, groups);
        return exported.map(|b| (b, true));
    }
    if q6 {
        let inp = ws[0].inp;
        let staged;
        let xq = if let XIn::Staged { xq } | XIn::StagedRn { xq, .. } = &xin {
            *xq
        } else {
            staged = match xq_scratch(ctx, rows, inp) {
                Ok(b) => b,
                Err(e) => {
                    ctx.fail(format!("gemv_q6: {e:#}"));
                    return None;
                }
            };
            // q2x_stage takes the x mode; gemv_q6 reads the staged x as it is.
            let (hd, gw) = match &xin {
                XIn::GatedNorm { hd, w, .. } => (*hd as u32, &w.buf),
                _ => (0, &dummies[5]),
            };
            let xp = [inp as u32, rows as u32, xmode, eps.to_bits(), hd, 0, 0, 0];
            stage(
                ctx,
                "q2x_stage",
                &xp,
                &[&x.buf, aux, xn, &staged, gw],
                rows as u32,
            );
            &staged
        };
        bufs[12] = xq;
        // The folds (omodes 4 and 6): the router and the shared gate in matrix slots 1 and 2
        // (no workgroups of their own), the norm's weights at aux, at binding 22 omode 4's
        // fixed-point sums or omode 6's staging with the workgroups' dots after it.
        let acc;
        let fold = match &omode {
            OutMode::AddAhead {
                router,
                sgate,
                norm,
            } => Some((ahead_sums(ctx, router.out), *router, *sgate, *norm)),
            OutMode::AddStageFold {
                router,
                sgate,
                norm,
            } => Some((
                fold_ahead_scratch(ctx, ws[0].out, router.out),
                *router,
                *sgate,
                *norm,
            )),
            _ => None,
        };
        if let Some((scratch, router, sgate, norm)) = fold {
            acc = match scratch {
                Ok(b) => b,
                Err(e) => {
                    ctx.fail(format!("gemv_q6: {e:#}"));
                    return None;
                }
            };
            p[8..16].copy_from_slice(&router.qmat());
            p[16..24].copy_from_slice(&sgate.qmat());
            bufs[3..6].copy_from_slice(&[&router.w, &router.s, &router.b]);
            bufs[6..9].copy_from_slice(&[&sgate.w, &sgate.s, &sgate.b]);
            bufs[17] = &norm.buf;
            bufs.push(&acc);
        } else if let OutMode::AddStage { norm } = &omode {
            // omode 5: the norm's weights at aux, the MoE block's staged x at binding 22.
            acc = match stage_ahead_scratch(ctx, ws[0].out) {
                Ok(b) => b,
                Err(e) => {
                    ctx.fail(format!("gemv_q6: {e:#}"));
                    return None;
                }
            };
            bufs[17] = &norm.buf;
            bufs.push(&acc);
        } else {
            // A spare no other binding of the launch takes (read-only and read-write uses of
            // one buffer may not meet in a dispatch).
            bufs.push(&dummies[7]);
        }
        let groups = (blocks * rows) as u32;
        if ctx.sw.q6_spec.load(Ordering::Relaxed) {
            let mut consts = q6_spec(ctx, ws, rows, om, &lanes, &start);
            let group = match xin {
                XIn::StagedRn { group, .. } => group as u32,
                _ => 0,
            };
            consts.push(("Q6_RNG", group));
            ctx.dispatch_spec(&sg_shader(), "gemv_q6s", &consts, &p, &bufs, groups);
        } else {
            ctx.dispatch(&sg_shader(), "gemv_q6", &p, &bufs, groups);
        }
        let rn = matches!(xin, XIn::StagedRn { .. });
        return Some((xq.clone(), rn));
    }
    match rw {
        0 => {
            let entry = if v5 { "gemv_v5" } else { "gemv_v4" };
            ctx.dispatch(&SHADER, entry, &p, &bufs, (blocks * rows) as u32)
        }
        8 => {
            let entry =
                ["gemv_xs1", "gemv_xs2", "gemv_xs4", "gemv_xs8"][nw.trailing_zeros() as usize];
            ctx.dispatch(&sg_shader(), entry, &p, &bufs, (blocks * rows) as u32)
        }
        r => {
            let entry = match r {
                1 => "gemv_rw1",
                2 => "gemv_rw2",
                _ => "gemv_rw4",
            };
            ctx.dispatch(&sg_shader(), entry, &p, &bufs, (blocks * rows) as u32)
        }
    }
    None
}

/// x's `rows` rows of `inp` staged by q2x_stage as it is (xmode 0) into the scratch `name`
/// (xq.wgsl's layouts; `xq_row(inp)` vec4s a row): moe_decode_shared's x where no GEMV staged
/// it. The caller checks `q6_takes`'s adapter conditions and inp % 32 == 0.
pub fn q2x_stage(
    ctx: &Ctx,
    x: &WBuf,
    inp: usize,
    rows: usize,
    name: &'static str,
) -> Result<::wgpu::Buffer> {
    let xq = ctx.scratch(name, (16 * rows * xq_row(inp)) as u64)?;
    let xp = [inp as u32, rows as u32, 0, 0, 0, 0, 0, 0];
    let d = &ctx.spare;
    stage(
        ctx,
        "q2x_stage",
        &xp,
        &[&x.buf, &d[3], &d[4], &xq, &d[5]],
        rows as u32,
    );
    Ok(xq)
}

/// Dispatches xq.wgsl's `entry` (q2x_stage, q2x_stage_ahead) with the parameter block `xp`
/// (xq.wgsl's XP), specialised to it (`LILY_WGPU_SPEC` xq: the row length, x mode, head size
/// and the adapter's one subgroup width as pipeline constants) where that is on and the
/// adapter's subgroups have one width.
pub(super) fn stage(
    ctx: &Ctx,
    entry: &'static str,
    xp: &[u32; 8],
    bufs: &[&::wgpu::Buffer],
    groups: u32,
) {
    let r = &ctx.report;
    let consts = if ctx.sw.xq_spec.load(Ordering::Relaxed) && r.subgroup_min == r.subgroup_max {
        vec![
            ("SQ_ON", 1),
            ("SQ_INP", xp[0]),
            ("SQ_XMODE", xp[2]),
            ("SQ_HD", xp[4]),
            ("SQ_SG", r.subgroup_min),
        ]
    } else {
        Vec::new()
    };
    ctx.dispatch_spec(&XQ_SHADER, entry, &consts, xp, bufs, groups);
}

/// Whether `gemv_many` runs these matrices by gemv_q6 (x staged by q2x_stage): `LILY_WGPU_GEMV`
/// v6 (the default), an adapter whose subgroups are in order and of one width and that binds
/// gemv_q6's 22 storage buffers, rows a whole number of 4-bit words, and a launch of at least
/// `q6_min_kb` of codes (else gemv_v5).
pub fn q6_takes(ctx: &Ctx, ws: &[&WMat]) -> bool {
    let fixed = ctx.report.subgroups && ctx.report.subgroup_min == ctx.report.subgroup_max;
    let code_kb = code_bytes(ws) / 1024;
    ctx.sw.gemv.load(Ordering::Relaxed) == 32
        && fixed
        && ctx.report.storage_buffers > GEMV_BUFFERS
        && ws.iter().all(|w| w.inp.is_multiple_of(32))
        && code_kb >= ctx.sw.q6_min_kb.load(Ordering::Relaxed)
}

/// Whether gemv_q6w may take a launch of `gemv_many_xq` (`q6w_takes`; `LILY_WGPU_Q6W`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Q6w {
    /// Not: the caller reads x's staging by q2x_stage (the MoE block's router where gate|up
    /// cannot read gemv_q6w's export).
    Never,
    /// With `LILY_WGPU_Q6W` 1 or more, staging nothing outside the launch (xn written by its
    /// first workgroup where binding 19 is free, i.e. but with the conv epilogue).
    Take,
    /// With `LILY_WGPU_Q6W` 2: the first workgroup also exports the staging (the MoE router's
    /// launch, for gate|up).
    Export,
}

/// gemv_q6w's workgroups at most: past them (the lm_head's 7,760) x staged in each would cost
/// more than the q2x_stage launch it saves.
const Q6W_MAX_WGS: usize = 2048;

/// Whether gemv_q6w takes a gemv_q6 launch (matmul_sg.wgsl's header at gemv_q6w): `use_`
/// allows it and `LILY_WGPU_Q6W` is 1 or more (2 where the launch exports its staging), the
/// specialised kernels, one row of x as it is or rms-normed, an output mode that leaves
/// bindings 20 and 22 free (store, add, the conv), rows of ≤ 4,096 elements of 4- or 8-bit
/// codes whose layouts fit q6_wx, and at most `Q6W_MAX_WGS` workgroups.
fn q6w_takes(
    ctx: &Ctx,
    ws: &[&WMat],
    rows: usize,
    xin: &XIn,
    om: u32,
    blocks: usize,
    use_: Q6w,
) -> bool {
    let inp = ws[0].inp;
    let l4 = ws.iter().any(|w| w.bits == 4);
    let l8 = ws.iter().any(|w| w.bits == 8);
    let words = if l4 { 5 * inp / 32 } else { 0 } + if l8 { 3 * inp / 16 } else { 0 };
    let level = match use_ {
        Q6w::Never => return false,
        Q6w::Take => 1,
        Q6w::Export => 2,
    };
    ctx.sw.q6w.load(Ordering::Relaxed) >= level
        && ctx.sw.q6_spec.load(Ordering::Relaxed)
        && rows == 1
        && matches!(xin, XIn::Plain | XIn::Norm { .. })
        && matches!(om, 0 | 1 | 3)
        && ws
            .iter()
            .all(|w| (w.bits == 4 || w.bits == 8) && w.inp == inp)
        && inp.is_multiple_of(32)
        && inp <= 4096
        && words <= 768
        && blocks <= Q6W_MAX_WGS
        && {
            let mb = ctx.sw.q6w_max_mb.load(Ordering::Relaxed);
            mb == 0 || code_bytes(ws) < mb << 20
        }
}

/// gemv_rt's rows a workgroup for a gemv_q6w launch (`LILY_WGPU_ROUTER`), or 0 where it
/// does not take it: 8-bit matrices only, x = rms_norm(h) · w (xmode 1), outputs stored, a
/// group size of 8 or more dividing the row (a thread's 8 elements in one group).
fn rt_rows(ctx: &Ctx, ws: &[&WMat], xmode: u32, om: u32) -> usize {
    let rows = ctx.sw.router_rows.load(Ordering::Relaxed) as usize;
    let ok = xmode == 1
        && om == 0
        && ws.iter().all(|w| {
            w.bits == 8 && w.gs >= 8 && w.gs.is_multiple_of(8) && w.inp.is_multiple_of(w.gs)
        });
    if ok {
        rows.min(3)
    } else {
        0
    }
}

/// The code bytes of a launch's matrices (one matrix of each stack).
fn code_bytes(ws: &[&WMat]) -> usize {
    ws.iter().map(|w| w.out * w.inp * w.bits as usize / 8).sum()
}

/// gemv_q6s's pipeline constants for one launch (matmul_sg.wgsl's overrides): the launch's
/// matrix count, x rows (1, or 0: read at run time, so that prefill's row counts do not each
/// build a pipeline), output mode `om`, the adapter's subgroup width and the slots' first
/// blocks, then each matrix's shape and team (`lanes`: T | R << 16, as gemv_q6 reads them).
fn q6_spec(
    ctx: &Ctx,
    ws: &[&WMat],
    rows: usize,
    om: u32,
    lanes: &[u32; 4],
    start: &[u32; 4],
) -> Vec<(&'static str, u32)> {
    const SLOT: [[&str; 7]; 4] = [
        [
            "Q6_OUT0", "Q6_INP0", "Q6_BITS0", "Q6_GS0", "Q6_SB160", "Q6_T0", "Q6_R0",
        ],
        [
            "Q6_OUT1", "Q6_INP1", "Q6_BITS1", "Q6_GS1", "Q6_SB161", "Q6_T1", "Q6_R1",
        ],
        [
            "Q6_OUT2", "Q6_INP2", "Q6_BITS2", "Q6_GS2", "Q6_SB162", "Q6_T2", "Q6_R2",
        ],
        [
            "Q6_OUT3", "Q6_INP3", "Q6_BITS3", "Q6_GS3", "Q6_SB163", "Q6_T3", "Q6_R3",
        ],
    ];
    let mut c = vec![
        ("Q6_NM", ws.len() as u32),
        ("Q6_ROWS", if rows == 1 { 1 } else { 0 }),
        ("Q6_OMODE", om),
        ("Q6_SG", ctx.report.subgroup_min),
        ("Q6_S1", start[1]),
        ("Q6_S2", start[2]),
        ("Q6_S3", start[3]),
    ];
    for (i, w) in ws.iter().enumerate() {
        let m = w.qmat();
        let vals = [
            m[0],
            m[1],
            m[2],
            m[3],
            m[4],
            lanes[i] & 0xffff,
            lanes[i] >> 16,
        ];
        c.extend(SLOT[i].iter().copied().zip(vals));
    }
    c
}

/// The workgroups gemv_q6 aims at for a launch of `ws`: the first `LILY_WGPU_Q6_WGS_BY` entry
/// above the launch's code bytes, else `LILY_WGPU_Q6_WGS`. (The lock is taken when a launch is
/// encoded op by op or recorded; a replayed decode step does not come here.)
fn q6_wants(ctx: &Ctx, ws: &[&WMat]) -> usize {
    let bytes = code_bytes(ws);
    let by = ctx.sw.q6_wgs_by.lock().unwrap_or_else(|e| e.into_inner());
    by.iter()
        .find(|&&(b, _)| bytes < b)
        .map_or_else(|| ctx.sw.q6_wgs.load(Ordering::Relaxed), |&(_, n)| n)
}

/// gemv_q6's team of T lanes and R rows for a matrix of `out` rows of `words` code words on
/// subgroups of `sg`: T the largest power of two ≤ the subgroup and the row's words (the team's
/// sum by shuffles alone), R = 4 (x's loads shared by 4 rows); then, while the matrix has fewer
/// than `want` workgroups (256 R / T rows each), T doubled up to the row's words and 256 (a
/// lane a word of each row; past the subgroup the sum meets in workgroup memory), then R
/// halved down to 1, so that the small matrices (router, shared expert, out_proj) spread over
/// the GPU.
fn q6_shape(out: usize, words: usize, sg: usize, want: usize) -> (usize, usize) {
    let mut t = 1;
    while t * 2 <= sg.min(words) {
        t *= 2;
    }
    let mut r = 4;
    while out.div_ceil(256 / t * r) < want {
        if t * 2 <= words.min(256) {
            t *= 2;
        } else if r > 1 {
            r /= 2;
        } else {
            break;
        }
    }
    (t, r)
}

/// Lanes a team for `gemv_rw` (`r` rows a team, `words` 16-byte code words a row): a power of
/// two, at least the 32 lanes that cover a 2048-wide 4-bit row in 2 loads a row (or the row's
/// words where fewer), doubled while the workgroups ((256 / lanes) · r rows each) are fewer than
/// `want` and a lane keeps a word a row.
fn rw_lanes(out: usize, words: usize, r: usize, want: usize) -> usize {
    let mut lanes = 1;
    while lanes < 32 && lanes * 2 <= words {
        lanes *= 2;
    }
    while lanes < 256 && lanes * 2 <= words && out.div_ceil(256 / lanes * r) < want {
        lanes *= 2;
    }
    lanes
}
