//! `lily lab --backend wgpu`: the decode step's weight-reading GEMVs at the model's shapes,
//! each alone, back to back in one compute pass timed by the GPU's timestamps, over distinct
//! copies of its weights (so that the cache does not hold them), beside a pure streaming read of
//! the same bytes in the same run (shaders/lab.wgsl `lab_read`), for each kernel variant asked
//! (gemv_v4, gemv_rw with 1, 2 or 4 rows a team, gemv_xs, and the workgroups they aim at). Also the floor
//! under every dispatch (`lab_touch`: a chain of dependent dispatches doing nothing) and pure
//! reads of sizes from 0.5 MB to 256 MB. Each variant's outputs are compared with gemv_v4's on
//! the same data (`check`: max |difference| over max |output|). The CUDA lab
//! (backend/cuda/lab.rs) is the model for this one.

use std::sync::atomic::Ordering;

use anyhow::{bail, Result};

use super::device::{as_bytes, Shader};
use super::matmul::{gemv_many, OutMode, XIn};
use super::{WBuf, WMat, WRoute, Wgpu};
use crate::backend::{Backend, Dims};
use crate::config::Config;

pub const SHADER: Shader = Shader {
    name: "lab",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/lab.wgsl")
    ),
};

/// The cases, in the order they run.
pub const CASES: &[&str] = &[
    "floor",
    "read",
    "alloc",
    "in_proj",
    "attn_qkv",
    "out_proj",
    "router",
    "shared_gu",
    "shared_down",
    "lm_head",
    "route",
    "ahead",
    "experts",
    "gemm",
    "moe_mm",
    "gdn_step",
    "attn",
];

/// Dispatches in one timed pass at most (the device submits at 256).
pub const MAX_CALLS: usize = 200;
/// Timed passes a row; the median is reported.
pub const REPS: usize = 7;
/// Seconds of a row's own calls run before its timed passes (`lab_median`).
pub const WARM_S: f64 = 0.3;

/// One measured row.
pub struct LabRow {
    pub case: &'static str,
    pub variant: String,
    /// Bytes one call reads from memory (weights; 0 for the floor).
    pub bytes: usize,
    pub copies: usize,
    pub calls: usize,
    /// Seconds a call (median pass / calls).
    pub op_s: f64,
    /// Seconds a call of the pure read of `bytes`.
    pub read_s: Option<f64>,
    /// Max |this variant − gemv_v4| / max |gemv_v4| on the first copy's data.
    pub check: Option<f64>,
}

impl LabRow {
    /// A pure read's row (cases read and alloc): its own time is its read's.
    fn pure_read(
        case: &'static str,
        variant: String,
        bytes: usize,
        copies: usize,
        calls: usize,
        s: f64,
    ) -> Self {
        LabRow {
            case,
            variant,
            bytes,
            copies,
            calls,
            op_s: s,
            read_s: Some(s),
            check: None,
        }
    }
    pub fn op_bw(&self) -> Option<f64> {
        (self.bytes > 0).then(|| self.bytes as f64 / self.op_s)
    }
    pub fn read_bw(&self) -> Option<f64> {
        self.read_s.map(|t| self.bytes as f64 / t)
    }
}

/// A GEMV variant: `v4`, `rw1` / `rw2` / `rw4` or `xs`, optionally `@N` workgroups aimed at,
/// and for v4 `~B`: the parts of gemv_v4 that bits B skip (1 x staging, 2 the final tree, 4 the
/// norm's pre-pass, 8 the dot products, 16 the scale and bias loads; gemv_io.wgsl `ablate`),
/// to time what is left (its outputs are then wrong: `check` says by how much). `v6s`: gemv_q6
/// specialised to the launch (gemv_q6s, `LILY_WGPU_SPEC=q6`); `v6w`: gemv_q6w (x quantized in
/// each workgroup, no q2x_stage launch: `LILY_WGPU_Q6W=1`).
pub struct Variant {
    pub name: String,
    gemv: u32,
    want: usize,
    ablate: u32,
    spec: bool,
    q6w: bool,
}

/// Parses `v4,rw2,rw2@4096,...`.
pub fn parse_variants(s: &str) -> Result<Vec<Variant>> {
    s.split(',')
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(|v| {
            let (v0, ablate) = match v.split_once('~') {
                Some((k, b)) => match b.parse::<u32>() {
                    Ok(b) if b < 32 => (k, b),
                    _ => bail!("variant `{v}`: ~ takes ablation bits 0 to 31"),
                },
                None => (v, 0),
            };
            // gemv_q6's workgroups (`@`) are `Switches::q6_wgs`, the others' `gemv_wgs`.
            let (k, want) = match v0.split_once('@') {
                Some((k, n)) => (k, n.parse::<usize>().ok().filter(|&n| n > 0)),
                None => (v0, Some(if v0.starts_with("v6") { 256 } else { 1024 })),
            };
            let gemv = match k {
                "v4" => 0,
                "rw1" => 1,
                "rw2" => 2,
                "rw4" => 4,
                "xs" => 8,
                "v5" => 16,
                "v6" | "v6s" | "v6w" => 32,
                _ => {
                    bail!(
                        "variant `{v}`: v4, v5, v6, v6s, v6w, rw1, rw2, rw4 or xs, optionally @workgroups"
                    )
                }
            };
            let Some(want) = want else {
                bail!("variant `{v}`: @ takes a positive number of workgroups")
            };
            if ablate != 0 && gemv != 0 {
                bail!("variant `{v}`: ablations (~) are gemv_v4's only");
            }
            Ok(Variant {
                name: v.to_string(),
                gemv,
                want,
                ablate,
                spec: matches!(k, "v6s" | "v6w"),
                q6w: k == "v6w",
            })
        })
        .collect()
}

/// How a case's x is read and its outputs written (the decode step's own modes).
#[derive(Clone, Copy)]
enum Mode {
    /// rms_norm folded in, outputs stored (in_proj, q|k|v, router, lm_head).
    Norm,
    /// x as it is, outputs stored (the shared expert's gate|up).
    Plain,
    /// silu(x)·u, then out += r + sigmoid(s)·acc (the shared expert's down).
    GluResidual,
    /// x as it is, out += acc (out_proj, o_proj).
    Add,
}

/// A GEMV case: its name, its matrices (outputs, inputs, bits), how x and the outputs are taken.
type GemvCase = (&'static str, Vec<(usize, usize, u32)>, Mode);

/// A deterministic fill (xorshift64*), so every run reads the same data.
fn words(n: usize, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            (s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) as u32
        })
        .collect()
}

fn floats(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    words(n, seed)
        .into_iter()
        .map(|w| lo + (hi - lo) * (w >> 8) as f32 / (1u32 << 24) as f32)
        .collect()
}

/// bf16 pairs of n values in [lo, hi) (truncated), element 2i in the low half of word i.
fn bf16_pairs(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<u32> {
    let f = floats(n.next_multiple_of(2), seed, lo, hi);
    f.chunks_exact(2)
        .map(|p| (p[0].to_bits() >> 16) | (p[1].to_bits() & 0xffff_0000))
        .collect()
}

/// Another handle on the same route buffers (the ops take `&mut`; the lab's calls run one after
/// another on this thread).
fn alias(r: &WRoute) -> WRoute {
    WRoute {
        ids: r.ids.clone(),
        weights: r.weights.clone(),
        rows: r.rows,
        k: r.k,
    }
}

impl Wgpu {
    /// Case `ahead`: GDN out_proj (+ residual) then the MoE block's router as the step runs them
    /// (`apart`: q2x_stage + the router's gemv_q6, xn and the logits written), against out_proj
    /// with the router folded in (gemv_q6 omode 4) then q2x_stage_ahead (`folded`,
    /// Backend::route_ahead), over copies of out_proj, the router and the shared gate.
    #[allow(clippy::too_many_arguments)]
    fn lab_ahead(
        &self,
        cfg: &Config,
        bits: u32,
        gs: usize,
        cycle: usize,
        calls: usize,
        time: &dyn Fn(&dyn Fn(usize)) -> Result<f64>,
        read: &dyn Fn(usize) -> Result<(f64, usize)>,
        print: &mut dyn FnMut(&LabRow),
    ) -> Result<Vec<LabRow>> {
        let ctx = &self.ctx;
        let d = Dims::from_config(cfg);
        let (h, gdn_v) = (
            cfg.hidden_size,
            cfg.linear_num_value_heads * cfg.linear_value_head_dim,
        );
        let nbytes = |o: usize, i: usize, b: u32| o * i * b as usize / 8 + 4 * (o * i / gs);
        let bytes = nbytes(h, gdn_v, bits) + nbytes(d.n_experts + 1, h, 8);
        let copies = cycle.div_ceil(bytes).clamp(2, 256);
        let sets: Vec<[WMat; 3]> = (0..copies)
            .map(|c| -> Result<[WMat; 3]> {
                let seed = 900 + 8 * c as u64;
                Ok([
                    self.lab_mat(h, gdn_v, bits, gs, seed)?,
                    self.lab_mat(d.n_experts, h, 8, gs, seed + 1)?,
                    self.lab_mat(1, h, 8, gs, seed + 2)?,
                ])
            })
            .collect::<Result<_>>()?;
        let y = self.lab_buf(&floats(gdn_v, 901, -1.0, 1.0))?;
        let hb = self.lab_buf(&floats(h, 902, -1.0, 1.0))?;
        let nw = self.lab_buf(&floats(h, 903, 0.5, 1.5))?;
        let xn = self.lab_buf(&vec![0.0; h])?;
        let lg = self.lab_buf(&vec![0.0; d.n_experts])?;
        let sl = self.lab_buf(&[0.0])?;
        let alias = |b: &WBuf| WBuf {
            buf: b.buf.clone(),
            len: b.len,
            half: b.half,
        };
        let (read_s, _) = read(bytes)?;
        let was = ctx.sw.route_ahead.load(Ordering::Relaxed);
        let mut rows = Vec::new();
        for (variant, fold) in [("apart", false), ("folded", true)] {
            ctx.sw.route_ahead.store(fold, Ordering::Relaxed);
            let m = &sets[0];
            if fold && !super::matmul::ahead_takes(ctx, &m[0], &m[1], &m[2], h) {
                eprintln!("lab: ahead folded skipped: gemv_q6 does not fold on this adapter");
                continue;
            }
            let op_s = time(&|i| {
                let m = &sets[i % copies];
                let mut hi = alias(&hb);
                if fold {
                    let om = OutMode::AddAhead {
                        router: &m[1],
                        sgate: &m[2],
                        norm: &nw,
                    };
                    gemv_many(ctx, &y, &[&m[0]], 0, 1, &mut [&mut hi], XIn::Plain, om);
                    let e = d.n_experts;
                    let staged =
                        super::matmul::q2x_stage_ahead(ctx, &hi, &nw, 1e-6, &xn, &lg, &sl, e, h);
                    if let Err(err) = staged {
                        ctx.fail(format!("lab ahead: {err:#}"));
                    }
                } else {
                    gemv_many(
                        ctx,
                        &y,
                        &[&m[0]],
                        0,
                        1,
                        &mut [&mut hi],
                        XIn::Plain,
                        OutMode::Add,
                    );
                    let xin = XIn::Norm {
                        w: &nw,
                        eps: 1e-6,
                        xn: &xn,
                    };
                    let mut outs = [&mut alias(&lg), &mut alias(&sl)];
                    gemv_many(
                        ctx,
                        &hi,
                        &[&m[1], &m[2]],
                        0,
                        1,
                        &mut outs,
                        xin,
                        OutMode::Store,
                    );
                }
            })?;
            let row = LabRow {
                case: "ahead",
                variant: variant.to_string(),
                bytes,
                copies,
                calls,
                op_s,
                read_s: Some(read_s),
                check: None,
            };
            print(&row);
            rows.push(row);
        }
        ctx.sw.route_ahead.store(was, Ordering::Relaxed);
        Ok(rows)
    }

    fn lab_buf(&self, v: &[f32]) -> Result<WBuf> {
        Ok(WBuf {
            buf: self.ctx.upload(as_bytes(v))?,
            len: v.len(),
            half: false,
        })
    }

    /// A random quantized matrix [out, inp] in the checkpoint's format (bf16 scales and biases).
    fn lab_mat(&self, out: usize, inp: usize, bits: u32, gs: usize, seed: u64) -> Result<WMat> {
        let groups = out * inp / gs;
        Ok(WMat {
            n: 1,
            out,
            inp,
            bits,
            gs,
            sb16: true,
            w: self
                .ctx
                .upload(as_bytes(&words(out * inp * bits as usize / 32, seed)))?,
            s: self
                .ctx
                .upload(as_bytes(&bf16_pairs(groups, seed + 1, 0.002, 0.02)))?,
            b: self
                .ctx
                .upload(as_bytes(&bf16_pairs(groups, seed + 2, -0.1, 0.0)))?,
        })
    }

    /// Runs the lab: `cases` (all when empty), `calls` dispatches a timed pass, enough copies of
    /// each case's weights that a cycle through them reads `cycle` bytes, the GEMV `variants`;
    /// `print` sees each row as it is measured.
    pub fn run_lab(
        &self,
        cfg: &Config,
        cases: &[&str],
        calls: usize,
        cycle: usize,
        variants: &[Variant],
        print: &mut dyn FnMut(&LabRow),
    ) -> Result<Vec<LabRow>> {
        if calls == 0 || calls > MAX_CALLS {
            bail!("lab: 1 to {MAX_CALLS} calls a pass");
        }
        let ctx = &self.ctx;
        let (old_gemv, old_want, old_q6, old_min) = (
            ctx.sw.gemv.load(Ordering::Relaxed),
            ctx.sw.gemv_wgs.load(Ordering::Relaxed),
            ctx.sw.q6_wgs.load(Ordering::Relaxed),
            ctx.sw.q6_min_kb.load(Ordering::Relaxed),
        );
        let old_spec = ctx.sw.q6_spec.load(Ordering::Relaxed);
        let old_by =
            std::mem::take(&mut *ctx.sw.q6_wgs_by.lock().unwrap_or_else(|e| e.into_inner()));
        let mut rows = Vec::new();
        // Median seconds a call of `f(i)` for i in 0..calls (lab_median).
        let time = |f: &dyn Fn(usize)| lab_median(ctx, calls, f);
        let dst = self.lab_buf(&[0.0; 64])?;
        let src = self.lab_buf(&[0.0; 4])?;
        // A pure read of `bytes` per call, over copies making a `cycle`.
        let read = |bytes: usize| -> Result<(f64, usize)> {
            let n16 = bytes.div_ceil(16);
            let copies = cycle.div_ceil(bytes).clamp(2, 256);
            let bufs: Vec<::wgpu::Buffer> = (0..copies)
                .map(|c| ctx.upload(as_bytes(&words(4 * n16, 1000 + c as u64))))
                .collect::<Result<_>>()?;
            let s = time(&|i| lab_read(ctx, &bufs[i % copies], &dst.buf, n16))?;
            Ok((s, copies))
        };
        let all = cases.is_empty();
        let want_case = |c: &str| all || cases.contains(&c);
        if want_case("floor") {
            // A dependent dispatch doing next to nothing: on one buffer, on 8 in turn, and
            // binding 22 storage buffers (a decode GEMV's count: whether descriptors cost).
            let mut floor = |variant: &str, copies: usize, s: f64| {
                let r = LabRow {
                    case: "floor",
                    variant: variant.into(),
                    bytes: 0,
                    copies,
                    calls,
                    op_s: s,
                    read_s: None,
                    check: None,
                };
                print(&r);
                rows.push(r);
            };
            let s = time(&|_| ctx.dispatch(&SHADER, "lab_touch", &[1], &[&src.buf, &dst.buf], 1))?;
            floor("one buffer", 1, s);
            let bufs: Vec<WBuf> = (0..8)
                .map(|_| self.lab_buf(&[0.0; 64]))
                .collect::<Result<_>>()?;
            let s = time(&|i| {
                let b = &bufs[i % 8].buf;
                ctx.dispatch(&SHADER, "lab_touch", &[1], &[&src.buf, b], 1)
            })?;
            floor("8 buffers", 8, s);
            let mut many: Vec<&::wgpu::Buffer> = vec![&src.buf, &dst.buf];
            many.extend(std::iter::repeat_n(&src.buf, 20));
            let s = time(&|_| ctx.dispatch(&SHADER, "lab_touch22", &[1], &many, 1))?;
            floor("22 bindings", 1, s);
        }
        if want_case("read") {
            for mb in [0.5f64, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 256.0] {
                let bytes = (mb * 1e6) as usize;
                if bytes as u64 > ctx.report.max_binding {
                    continue;
                }
                let (s, copies) = read(bytes)?;
                let r = LabRow::pure_read("read", format!("{mb} MB"), bytes, copies, calls, s);
                print(&r);
                rows.push(r);
            }
        }
        // Only when asked for by name: it allocates 2 × LILY_LAB_BALLAST_GB and idles 20 s.
        if cases.contains(&"alloc") {
            rows.extend(self.lab_alloc(calls, print)?);
        }
        let (bits, gs) = match &cfg.quantization.default {
            Some(q) => (q.bits, q.group_size),
            None => (4, 64),
        };
        let h = cfg.hidden_size;
        let gdn_qkv = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
            + cfg.linear_num_value_heads * cfg.linear_value_head_dim;
        let gdn_v = cfg.linear_num_value_heads * cfg.linear_value_head_dim;
        let nh_hd = cfg.num_attention_heads * cfg.head_dim;
        let kv = cfg.num_key_value_heads * cfg.head_dim;
        let gemv_cases: Vec<GemvCase> = vec![
            (
                "in_proj",
                vec![
                    (gdn_qkv, h, bits),
                    (gdn_v, h, bits),
                    (cfg.linear_num_value_heads, h, bits),
                    (cfg.linear_num_value_heads, h, bits),
                ],
                Mode::Norm,
            ),
            (
                "attn_qkv",
                vec![(2 * nh_hd, h, bits), (kv, h, bits), (kv, h, bits)],
                Mode::Norm,
            ),
            ("out_proj", vec![(h, gdn_v, bits)], Mode::Add),
            (
                "router",
                vec![(cfg.num_experts, h, 8), (1, h, 8)],
                Mode::Norm,
            ),
            (
                "shared_gu",
                vec![
                    (cfg.shared_expert_intermediate_size, h, bits),
                    (cfg.shared_expert_intermediate_size, h, bits),
                ],
                Mode::Plain,
            ),
            (
                "shared_down",
                vec![(h, cfg.shared_expert_intermediate_size, bits)],
                Mode::GluResidual,
            ),
            ("lm_head", vec![(cfg.vocab_size, h, bits)], Mode::Norm),
        ];
        for (case, shapes, mode) in gemv_cases {
            if !want_case(case) {
                continue;
            }
            let bytes: usize = shapes
                .iter()
                .map(|&(o, i, b)| o * i * b as usize / 8 + 2 * (o * i / gs).next_multiple_of(2) * 2)
                .sum();
            let copies = cycle.div_ceil(bytes).clamp(2, 256);
            if shapes
                .iter()
                .any(|&(o, i, b)| (o * i * b as usize / 8) as u64 > ctx.report.max_binding)
            {
                eprintln!("lab: {case} skipped: a matrix exceeds this adapter's largest binding");
                continue;
            }
            let mats: Vec<Vec<WMat>> = (0..copies)
                .map(|c| {
                    shapes
                        .iter()
                        .enumerate()
                        .map(|(k, &(o, i, b))| {
                            self.lab_mat(o, i, b, gs, (c * 8 + k) as u64 * 7 + 3)
                        })
                        .collect::<Result<_>>()
                })
                .collect::<Result<_>>()?;
            let inp = shapes[0].1;
            let x = self.lab_buf(&floats(inp, 11, -1.0, 1.0))?;
            let aux = self.lab_buf(&floats(inp, 12, 0.5, 1.5))?;
            let xn = self.lab_buf(&vec![0.0; inp])?;
            let outs: Vec<WBuf> = shapes
                .iter()
                .map(|&(o, _, _)| self.lab_buf(&vec![0.0; o]))
                .collect::<Result<_>>()?;
            let r = self.lab_buf(&floats(shapes[0].0, 13, -1.0, 1.0))?;
            let s = self.lab_buf(&[0.3])?;
            let call = |c: usize| {
                let ws: Vec<&WMat> = mats[c % copies].iter().collect();
                // The outputs are distinct buffers per matrix, shared by every call (as in a step).
                let mut os: Vec<WBuf> = outs
                    .iter()
                    .map(|o| WBuf {
                        buf: o.buf.clone(),
                        len: o.len,
                        half: o.half,
                    })
                    .collect();
                let mut om: Vec<&mut WBuf> = os.iter_mut().collect();
                let (xin, omode) = match mode {
                    Mode::Norm => (
                        XIn::Norm {
                            w: &aux,
                            eps: 1e-6,
                            xn: &xn,
                        },
                        OutMode::Store,
                    ),
                    Mode::Plain => (XIn::Plain, OutMode::Store),
                    Mode::GluResidual => (XIn::Glu { u: &aux }, OutMode::Residual { r: &r, s: &s }),
                    Mode::Add => (XIn::Plain, OutMode::Add),
                };
                gemv_many(ctx, &x, &ws, 0, 1, &mut om, xin, omode);
            };
            let (read_s, _) = read(bytes)?;
            // The outputs of one call on copy 0 from zeroed outputs (the check).
            let one_call = || -> Result<Vec<f32>> {
                for o in &outs {
                    ctx.queue
                        .write_buffer(&o.buf, 0, as_bytes(&vec![0.0f32; o.len]));
                }
                call(0);
                let mut v = Vec::new();
                for o in &outs {
                    let b = ctx.read(&o.buf, 4 * o.len as u64)?;
                    v.extend(
                        b.chunks_exact(4)
                            .map(|c| f32::from_le_bytes(c.try_into().unwrap())),
                    );
                }
                Ok(v)
            };
            let mut reference: Option<Vec<f32>> = None;
            for v in variants {
                ctx.sw.gemv.store(v.gemv, Ordering::Relaxed);
                if v.gemv == 32 {
                    // The kernel itself, whatever the launch's size.
                    ctx.sw.q6_min_kb.store(0, Ordering::Relaxed);
                    ctx.sw.q6_wgs.store(v.want, Ordering::Relaxed);
                } else {
                    ctx.sw.gemv_wgs.store(v.want, Ordering::Relaxed);
                }
                ctx.sw.ablate.store(v.ablate, Ordering::Relaxed);
                ctx.sw.q6_spec.store(v.spec, Ordering::Relaxed);
                let old_q6w = ctx.sw.q6w.swap(v.q6w as u32, Ordering::Relaxed);
                let op_s = time(&call)?;
                // One call from zeroed outputs on copy 0, against gemv_v4's.
                let got = one_call()?;
                ctx.sw.ablate.store(0, Ordering::Relaxed);
                ctx.sw.q6_spec.store(old_spec, Ordering::Relaxed);
                ctx.sw.q6w.store(old_q6w, Ordering::Relaxed);
                if reference.is_none() {
                    ctx.sw.gemv.store(0, Ordering::Relaxed);
                    reference = Some(one_call()?);
                }
                let want = reference.as_ref().unwrap();
                let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
                let diff = got
                    .iter()
                    .zip(want)
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                let row = LabRow {
                    case,
                    variant: match v.gemv {
                        _ if ctx.report.subgroups => v.name.clone(),
                        0 | 16 => v.name.clone(),
                        32 => format!("{} (= v5: no subgroups)", v.name),
                        _ => format!("{} (= v4: no subgroups)", v.name),
                    },
                    bytes,
                    copies,
                    calls,
                    op_s,
                    read_s: Some(read_s),
                    check: Some((diff / scale) as f64),
                };
                print(&row);
                rows.push(row);
            }
        }
        ctx.sw.gemv.store(old_gemv, Ordering::Relaxed);
        ctx.sw.gemv_wgs.store(old_want, Ordering::Relaxed);
        ctx.sw.q6_wgs.store(old_q6, Ordering::Relaxed);
        *ctx.sw.q6_wgs_by.lock().unwrap_or_else(|e| e.into_inner()) = old_by;
        ctx.sw.q6_min_kb.store(old_min, Ordering::Relaxed);
        // The router's top-k of one row, and the routed experts of one token (moe_experts_decode:
        // gate|up then down and the slot sum), over routes from distinct logits so that the
        // experts read differ from call to call.
        let d = Dims::from_config(cfg);
        let nroutes = 64;
        let logits: Vec<WBuf> = (0..nroutes)
            .map(|i| self.lab_buf(&floats(d.n_experts, 500 + i as u64, -4.0, 4.0)))
            .collect::<Result<_>>()?;
        let routes: Vec<WRoute> = (0..nroutes)
            .map(|_| self.new_route(1, d.top_k))
            .collect::<Result<_>>()?;
        if want_case("route") {
            let op_s = time(&|i| {
                let mut r = alias(&routes[i % nroutes]);
                super::moe::moe_route(ctx, &logits[i % nroutes], &d, 1, &mut r)
            })?;
            let row = LabRow {
                case: "route",
                variant: format!("top-{} of {}", d.top_k, d.n_experts),
                bytes: 0,
                copies: nroutes,
                calls,
                op_s,
                read_s: None,
                check: None,
            };
            print(&row);
            rows.push(row);
        }
        if want_case("ahead") {
            rows.extend(self.lab_ahead(cfg, bits, gs, cycle, calls, &time, &read, print)?);
        }
        if want_case("experts") {
            for (l, r) in logits.iter().zip(routes.iter()) {
                super::moe::moe_route(ctx, l, &d, 1, &mut alias(r));
            }
            let (w, hdim) = (cfg.moe_intermediate_size, cfg.hidden_size);
            let mk = |out: usize, inp: usize, seed: u64| -> Result<WMat> {
                let m = self.lab_mat(d.n_experts * out, inp, bits, gs, seed)?;
                Ok(WMat {
                    n: d.n_experts,
                    out,
                    ..m
                })
            };
            let (gate, up, down) = (mk(w, hdim, 71)?, mk(w, hdim, 72)?, mk(hdim, w, 73)?);
            let bits_w = bits;
            let x = self.lab_buf(&floats(hdim, 74, -1.0, 1.0))?;
            let out = self.lab_buf(&vec![0.0; hdim])?;
            let per = |o: usize, i: usize| o * i * bits as usize / 8 + 4 * (o * i / gs);
            let bytes = d.top_k * (2 * per(w, hdim) + per(hdim, w));
            let (read_s, _) = read(bytes)?;
            // The ablations the variants ask for (`~B`), read by the MoE kernels (bits 1, 2, 8).
            let mut bits: Vec<u32> = vec![0];
            for v in variants {
                if !bits.contains(&v.ablate) {
                    bits.push(v.ablate);
                }
            }
            // moe_gate_up_q first (x in two int8 levels), then moe_gate_up_v with each ablation.
            let old_q = ctx.sw.moe_q.load(Ordering::Relaxed);
            let runs: Vec<(bool, u32)> = std::iter::once((true, 0))
                .chain(bits.iter().map(|&b| (false, b)))
                .collect();
            for (q, b) in runs {
                ctx.sw.moe_q.store(q, Ordering::Relaxed);
                ctx.sw.ablate.store(b, Ordering::Relaxed);
                let op_s = time(&|i| {
                    let mut o = WBuf {
                        buf: out.buf.clone(),
                        len: out.len,
                        half: out.half,
                    };
                    let r = &routes[i % nroutes];
                    super::moe::moe_experts(ctx, &x, r, &gate, &up, &down, &d, 1, &mut o)
                })?;
                ctx.sw.ablate.store(0, Ordering::Relaxed);
                let row = LabRow {
                    case: "experts",
                    variant: if q {
                        format!("top-{} gate_up_q", d.top_k)
                    } else if b == 0 {
                        format!("top-{} decode", d.top_k)
                    } else {
                        format!("top-{} ~{b}", d.top_k)
                    },
                    bytes,
                    copies: nroutes,
                    calls,
                    op_s,
                    read_s: Some(read_s),
                    check: None,
                };
                print(&row);
                rows.push(row);
            }
            ctx.sw.moe_q.store(old_q, Ordering::Relaxed);
            // The MoE block with the shared expert (one copy of its weights, ~1.5 MB, read by
            // every call: the GPU's cache may hold it across calls, the same for both ways):
            // `shared/4` as moe_decode_add ran it, the routed experts' two launches and the
            // shared expert's two GEMVs, against `shared/2` (moe_gate_up_s and moe_down_s), and
            // `route/5` with moe_route before them against `route/2` (moe_gate_up_s routing the
            // token itself): the number is the launches (LILY_WGPU_MOE_FUSE=0 / 1). h is
            // added to every call (its values drift; the timing does not care). Fewer calls a
            // pass where a call is several launches (a pass holds at most 255).
            let (sg, su, sd) = (
                self.lab_mat(w, hdim, bits_w, gs, 75)?,
                self.lab_mat(w, hdim, bits_w, gs, 76)?,
                self.lab_mat(hdim, w, bits_w, gs, 77)?,
            );
            let logit = self.lab_buf(&[0.3])?;
            let (g1, u1) = (self.lab_buf(&vec![0.0; w])?, self.lab_buf(&vec![0.0; w])?);
            let routed = self.lab_buf(&vec![0.0; hdim])?;
            let hbuf = self.lab_buf(&vec![0.0; hdim])?;
            let bytes_sh = bytes + 2 * per(w, hdim) + per(hdim, w);
            let sh = crate::backend::SharedExpert {
                gate: &sg,
                up: &su,
                down: &sd,
                logit: &logit,
            };
            let clone = |b: &WBuf| WBuf {
                buf: b.buf.clone(),
                len: b.len,
                half: b.half,
            };
            let old_fuse = ctx.sw.moe_fuse.load(Ordering::Relaxed);
            ctx.sw.moe_fuse.store(true, Ordering::Relaxed);
            let slot_ok =
                super::moe::shared_slot_ok(ctx, &x, &routes[0], &gate, &up, &down, &sh, &d, &hbuf)
                    && super::moe::route_fold_ok(&d, &logits[0]);
            ctx.sw.moe_fuse.store(old_fuse, Ordering::Relaxed);
            if !slot_ok {
                eprintln!("lab: experts shared/2, route/2 skipped: moe_gate_up_s does not take these (adapter or layout)");
            }
            // moe_xq.wgsl's kernels (LILY_WGPU_MOE_XQ) beside moe_step.wgsl's: `…/2 old` with
            // moe_gate_up_s and moe_down_s, `…/2 xq G,D,S` with moe_gate_up_x and moe_down_x in
            // that shape (x staged once before the timing, as the router's launch stages it in
            // a decode step), `…/2 xq-gate` moe_gate_up_x with moe_down_s, `…/2 xq-ydown`
            // moe_gate_up_x with moe_down_y, `…/2 xq-y` moe_gate_up_y with moe_down_y (`xq-ys`:
            // specialised to the launch, `LILY_WGPU_SPEC` moe, the down by moe_down_y2 as in a
            // decode step; `xq-ys down-y`: by moe_down_y, `LILY_WGPU_MOE_DOWN=y`).
            // `LILY_LAB_STACKS=N`: N - 1 more copies of the three stacks, which the `×N` variant
            // cycles through as a decode step's 40 layers do (whether the spread of the weights
            // over GBs, not their bytes, costs the step: address translation).
            let nstacks: usize = std::env::var("LILY_LAB_STACKS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(1);
            let mut spread = Vec::new();
            for c in 1..nstacks.max(1) {
                let s = 1000 * c as u64;
                spread.push((
                    mk(w, hdim, 71 + s)?,
                    mk(w, hdim, 72 + s)?,
                    mk(hdim, w, 73 + s)?,
                ));
            }
            let (xq_gate, _) = super::moe::xq_takes(ctx, hdim, w, d.top_k);
            let staged = if xq_gate {
                Some(super::matmul::q2x_stage(ctx, &x, hdim, 1, "lab.xq")?)
            } else {
                eprintln!("lab: experts xq variants skipped: moe_gate_up_x does not take these (adapter or layout)");
                None
            };
            let (old_xq, old_shape) = (
                ctx.sw.moe_xq.load(Ordering::Relaxed),
                ctx.sw.moe_xq_shape.load(Ordering::Relaxed),
            );
            // (variant, launches a call, whether it needs the fused kernels, moe_xq mode, shape)
            let mut seqs: Vec<(String, usize, bool, u32, &str)> = vec![
                ("shared/4".into(), 4, false, 0, ""),
                ("shared/2 old".into(), 2, true, 0, ""),
                ("route/5".into(), 5, false, 0, ""),
                ("route/2 old".into(), 2, true, 0, ""),
            ];
            if staged.is_some() {
                for shape in [
                    "32,16,2", "16,16,2", "8,16,2", "32,16,1", "32,16,4", "32,8,2",
                ] {
                    seqs.push((format!("shared/2 xq {shape}"), 2, true, 2, shape));
                    seqs.push((format!("route/2 xq {shape}"), 2, true, 2, shape));
                }
                seqs.push(("route/2 xq-gate".into(), 2, true, 1, "32,16,2"));
                seqs.push(("shared/2 xq-ydown".into(), 2, true, 3, "32,16,2"));
                seqs.push(("route/2 xq-ydown".into(), 2, true, 3, "32,16,2"));
                seqs.push(("shared/2 xq-y".into(), 2, true, 4, "32,16,2"));
                seqs.push(("route/2 xq-y".into(), 2, true, 4, "32,16,2"));
                // The y pair specialised to the launch (`LILY_WGPU_SPEC` moe), beside it.
                seqs.push(("shared/2 xq-ys".into(), 2, true, 4, "32,16,2"));
                seqs.push(("route/2 xq-ys".into(), 2, true, 4, "32,16,2"));
                seqs.push(("route/2 xq-ys down-y".into(), 2, true, 4, "32,16,2"));
                // One launch of the pair alone (moe.rs `LAB_GATE_ONLY` / `LAB_DOWN_ONLY`):
                // gate|up with and without its route, and down after a route made before.
                seqs.push(("route/1 xq-ys gate-only".into(), 1, true, 4, "32,16,2"));
                seqs.push(("shared/1 xq-ys gate-only".into(), 1, true, 4, "32,16,2"));
                seqs.push(("shared/1 xq-ys down-only".into(), 1, true, 4, "32,16,2"));
                // gate|up's workgroups against the SMs: (k + 1) · 16 at k routed slots (144
                // at 8 on 132 SMs; 128 at 7, 112 at 6), the same kernel on fewer slots.
                for k in [7, 6, 4] {
                    seqs.push((
                        format!("shared/1 xq-ys k{k} gate-only"),
                        1,
                        true,
                        4,
                        "32,16,2",
                    ));
                }
                // gate|up staging act's 8-bit layout too (`LILY_WGPU_MOE_A8=1`, as before).
                seqs.push(("shared/1 xq-ys a8 gate-only".into(), 1, true, 4, "32,16,2"));
                // Act staged by down (`LILY_WGPU_MOE_ACT`): the block, and each launch alone.
                seqs.push(("route/2 xq-ys act-down16".into(), 2, true, 4, "32,16,2"));
                seqs.push((
                    "shared/1 xq-ys act-down16 gate-only".into(),
                    1,
                    true,
                    4,
                    "32,16,2",
                ));
                seqs.push((
                    "shared/1 xq-ys act-down16 down-only".into(),
                    1,
                    true,
                    4,
                    "32,16,2",
                ));
                // gate|up without its dot products (~8) or its act staging (~32).
                for a in ["~8", "~32", "~40"] {
                    seqs.push((
                        format!("shared/1 xq-ys {a} gate-only"),
                        1,
                        true,
                        4,
                        "32,16,2",
                    ));
                }
                // The y pair then the x pair on the next route, each call: against the two rows
                // above, whether a kernel pays for the other's code and data between its calls
                // (as in a decode step, where 8 other kernels run between two MoE blocks).
                seqs.push(("route/2 xq-y+x".into(), 4, true, 4, "32,16,2"));
                if !spread.is_empty() {
                    seqs.push((
                        format!("route/2 xq-y ×{}", spread.len() + 1),
                        2,
                        true,
                        4,
                        "32,16,2",
                    ));
                }
            }
            let old_spec = ctx.sw.moe_spec.load(Ordering::Relaxed);
            let old_down = ctx.sw.moe_down.load(Ordering::Relaxed);
            let old_act = ctx.sw.moe_act.load(Ordering::Relaxed);
            let old_a8 = ctx.sw.moe_a8.load(Ordering::Relaxed);
            for (name, launches, fused, xq_mode, shape) in seqs {
                let name = name.as_str();
                ctx.sw.moe_xq.store(xq_mode, Ordering::Relaxed);
                let down_code = if name.ends_with("down-y") { 0 } else { 1 };
                ctx.sw.moe_down.store(down_code, Ordering::Relaxed);
                // Act staged by down (the default) only in the `act-down16` rows, so that the
                // rows before stop 46 keep their meaning.
                ctx.sw
                    .moe_act
                    .store(name.contains("act-down16"), Ordering::Relaxed);
                ctx.sw
                    .moe_a8
                    .store(name.contains(" a8 "), Ordering::Relaxed);
                let skip = if name.ends_with("gate-only") {
                    super::moe::LAB_GATE_ONLY
                } else if name.ends_with("down-only") {
                    super::moe::LAB_DOWN_ONLY
                } else {
                    0
                };
                // `~B` in the name: the kernels' ablation bits B (moe.wgsl `ablate`).
                let bits = name
                    .split(' ')
                    .find_map(|w| w.strip_prefix('~')?.parse::<u32>().ok())
                    .unwrap_or(0);
                ctx.sw.ablate.store(skip | bits, Ordering::Relaxed);
                // Only the `xq-ys` rows specialised, whatever LILY_WGPU_SPEC says.
                ctx.sw
                    .moe_spec
                    .store(name.contains("xq-ys"), Ordering::Relaxed);
                if let Some(c) = super::device::moe_xq_shape_code(shape) {
                    ctx.sw.moe_xq_shape.store(c, Ordering::Relaxed);
                }
                if fused && !slot_ok {
                    continue;
                }
                let n = calls.min(255 / launches);
                // A row's routed slots (`kN` in its name), else the model's.
                let mut dk = d;
                if let Some(k) = name
                    .split(' ')
                    .find_map(|w| w.strip_prefix('k')?.parse::<usize>().ok())
                {
                    dk.top_k = k.min(d.top_k);
                }
                let call = |i: usize| {
                    let r = &routes[i % nroutes];
                    let mut h = clone(&hbuf);
                    let with_route = name.starts_with("route");
                    if fused {
                        let l = with_route.then(|| &logits[i % nroutes]);
                        let (gate, up, down) = match i % (spread.len() + 1) {
                            c if c > 0 && name.contains('×') => {
                                let t = &spread[c - 1];
                                (&t.0, &t.1, &t.2)
                            }
                            _ => (&gate, &up, &down),
                        };
                        let mut block = |r: &WRoute, l: Option<&WBuf>| {
                            super::moe::moe_decode_shared(
                                ctx,
                                &x,
                                r,
                                gate,
                                up,
                                down,
                                &sh,
                                &dk,
                                &mut h,
                                l,
                                staged.as_ref(),
                                None,
                                None,
                            )
                        };
                        block(r, l);
                        if name.ends_with("+x") {
                            let j = (i + 1) % nroutes;
                            ctx.sw.moe_xq.store(2, Ordering::Relaxed);
                            block(&routes[j], Some(&logits[j]));
                            ctx.sw.moe_xq.store(xq_mode, Ordering::Relaxed);
                        }
                        return;
                    }
                    if with_route {
                        super::moe::moe_route(ctx, &logits[i % nroutes], &d, 1, &mut alias(r));
                    }
                    let mut o = clone(&routed);
                    super::moe::moe_experts(ctx, &x, r, &gate, &up, &down, &d, 1, &mut o);
                    let (mut g, mut u) = (clone(&g1), clone(&u1));
                    gemv_many(
                        ctx,
                        &x,
                        &[&sg, &su],
                        0,
                        1,
                        &mut [&mut g, &mut u],
                        XIn::Plain,
                        OutMode::Store,
                    );
                    let om = OutMode::Residual {
                        r: &routed,
                        s: &logit,
                    };
                    gemv_many(
                        ctx,
                        &g1,
                        &[&sd],
                        0,
                        1,
                        &mut [&mut h],
                        XIn::Glu { u: &u1 },
                        om,
                    );
                };
                let op_s = lab_median(ctx, n, &call)?;
                let row = LabRow {
                    case: "experts",
                    variant: format!("top-{} {name}", d.top_k),
                    bytes: bytes_sh,
                    copies: nroutes,
                    calls: n,
                    op_s,
                    read_s: Some(read_s),
                    check: None,
                };
                print(&row);
                rows.push(row);
            }
            ctx.sw.ablate.store(0, Ordering::Relaxed);
            ctx.sw.moe_act.store(old_act, Ordering::Relaxed);
            ctx.sw.moe_a8.store(old_a8, Ordering::Relaxed);
            ctx.sw.moe_xq.store(old_xq, Ordering::Relaxed);
            ctx.sw.moe_spec.store(old_spec, Ordering::Relaxed);
            ctx.sw.moe_down.store(old_down, Ordering::Relaxed);
            ctx.sw.moe_xq_shape.store(old_shape, Ordering::Relaxed);
        }
        if want_case("gemm") {
            rows.extend(self.lab_gemm(calls, print)?);
        }
        if want_case("moe_mm") {
            rows.extend(self.lab_moe_mm(cfg, calls, print)?);
        }
        if want_case("gdn_step") {
            rows.extend(self.lab_gdn_step(cfg, calls, cycle, print)?);
        }
        if want_case("attn") {
            rows.extend(self.lab_attn(cfg, calls, print)?);
        }
        ctx.check()?;
        Ok(rows)
    }
}

impl Wgpu {
    /// Case "alloc": whether reads slow down once GBs are allocated, not only where they spread
    /// (stop 34: the GEMV lab at `--cycle-mb 16000` read its 16 MB copies 2.75x slower than at
    /// 200; a decode step holds 19 GB). Stop 35's answer: no; what slowed them was the SM clock
    /// falling while the host built the copies (`lab_median` now warms each row up).
    /// One 16 MB read over 16 copies (256 MB, L2-cold) timed
    /// alone; after `LILY_LAB_BALLAST_GB` (16) GiB more are allocated in 256 MB buffers and each
    /// read once (wgpu clears a buffer before its first use: the pages are really there); after
    /// 20 s idle; over 16 new copies each allocated after a 16th of that more (the reads spread
    /// over the GBs, as a model's layers are); chains of dependent loads at 4 KB, 64 KB and 2 MB
    /// strides over 32 MB to 1 GB (translation's reach and page size); and with the ballast
    /// dropped.
    fn lab_alloc(&self, calls: usize, print: &mut dyn FnMut(&LabRow)) -> Result<Vec<LabRow>> {
        let ctx = &self.ctx;
        let gb: usize = std::env::var("LILY_LAB_BALLAST_GB")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(16);
        let (bytes, copies) = (16usize << 20, 16);
        let n16 = bytes / 16;
        let dst = self.lab_buf(&[0.0; 64])?;
        let read_all = |bufs: &[::wgpu::Buffer]| -> Result<f64> {
            lab_median(ctx, calls, &|i| {
                lab_read(ctx, &bufs[i % bufs.len()], &dst.buf, n16)
            })
        };
        // Allocates `mib` MiB in buffers of up to 256 MB (the adapter's largest binding) and
        // reads each once.
        let chunk = (256u64 << 20).min(ctx.report.max_binding / 16 * 16);
        let ballast = |mib: usize| -> Result<Vec<::wgpu::Buffer>> {
            let b: Vec<::wgpu::Buffer> = (0..((mib as u64) << 20).div_ceil(chunk))
                .map(|_| ctx.buffer(chunk))
                .collect::<Result<_>>()?;
            for x in &b {
                lab_read(ctx, x, &dst.buf, (chunk / 16) as usize);
            }
            ctx.sync()?;
            Ok(b)
        };
        let mut rows = Vec::new();
        let mut put = |r: LabRow| {
            print(&r);
            rows.push(r);
        };
        let rd =
            |variant: String, s: f64| LabRow::pure_read("alloc", variant, bytes, copies, calls, s);
        let bufs: Vec<::wgpu::Buffer> = (0..copies)
            .map(|c| ctx.upload(as_bytes(&words(4 * n16, 3000 + c as u64))))
            .collect::<Result<_>>()?;
        put(rd("16 MB alone".into(), read_all(&bufs)?));
        let big = ballast(gb << 10)?;
        put(rd(format!("+{gb} GB"), read_all(&bufs)?));
        std::thread::sleep(std::time::Duration::from_secs(20));
        put(rd(format!("+{gb} GB, 20 s idle"), read_all(&bufs)?));
        let mut spread = Vec::with_capacity(copies);
        let mut more = Vec::new();
        for c in 0..copies {
            more.extend(ballast((gb << 10) / copies)?);
            spread.push(ctx.upload(as_bytes(&words(4 * n16, 4000 + c as u64)))?);
        }
        put(rd(
            format!("+{gb} GB, copies {} MB apart", (gb << 10) / copies),
            read_all(&spread)?,
        ));
        // Dependent loads (lab_chase) at strides of 64 KB and 2 MB over growing footprints
        // while the ballast is there: where a stride's latency steps up says how far address
        // translation reaches, and at which page size (4 KB strides fill a small footprint).
        let span = (1u64 << 30).min(ctx.report.max_binding / 16 * 16);
        let chain = ctx.buffer(span)?;
        let steps = 4096u32;
        for (stride, foot) in [
            (4u64 << 10, 32u64 << 20),
            (64 << 10, 32 << 20),
            (64 << 10, 256 << 20),
            (64 << 10, 1 << 30),
            (2 << 20, 32 << 20),
            (2 << 20, 256 << 20),
            (2 << 20, 1 << 30),
        ] {
            if foot > span {
                continue;
            }
            let (n, st) = ((foot / 4) as u32, (stride / 4) as u32);
            ctx.dispatch(
                &SHADER,
                "lab_chain_init",
                &[n, 0, st, 0],
                &[&dst.buf, &chain],
                (n / st).div_ceil(64),
            );
            let f = |_: usize| {
                ctx.dispatch(
                    &SHADER,
                    "lab_chase",
                    &[n, 0, steps, 0],
                    &[&chain, &dst.buf],
                    1,
                )
            };
            let s = lab_median(ctx, calls.min(8), &f)? / steps as f64;
            let r = LabRow::pure_read(
                "alloc",
                format!(
                    "chase {} KB stride, {} MB (µs a load)",
                    stride >> 10,
                    foot >> 20
                ),
                0,
                1,
                calls.min(8),
                s,
            );
            put(r);
        }
        drop((big, more, spread, chain));
        ctx.sync()?;
        put(rd("ballast dropped".into(), read_all(&bufs)?));
        Ok(rows)
    }
}

/// lab.wgsl's lab_read of `src`'s first `n16` 16-byte words (`dst` its never-written output).
fn lab_read(ctx: &super::device::Ctx, src: &::wgpu::Buffer, dst: &::wgpu::Buffer, n16: usize) {
    ctx.dispatch(
        &SHADER,
        "lab_read",
        &[n16 as u32, 0x1234_5678, 0, 0],
        &[src, dst],
        n16.div_ceil(1024) as u32,
    );
}

/// Median seconds a call of `f(i)`, i in 0..calls a pass, after `WARM_S` of warm-up passes.
///
/// The warm-up is what brings the clock up: on the H200 the SM clock falls from 1,980 MHz to
/// 600 after ~1.5 s of a mostly idle GPU and to 345 ~1.5 s later (stop 35, nvidia-smi every
/// 50 ms: while the lab built the next case's copies on the host); it comes back within ~0.1 s
/// of sustained work, which a row's few milliseconds of timed passes are not. So since stop 31
/// rows timed after such a pause read up to 2.5x slower (the "slow state": a 256 MB read 143 µs
/// against 58). Decode keeps the GPU busy and ran at 1,980 MHz throughout.
///
/// `LILY_LAB_BETWEEN_MB=N`: a pure read of N MB (over two copies) after every call, its own
/// median time taken off: the call as a decode step meets it, its small inputs and its code
/// pushed out of L2 by other work, not warm from the call before.
pub(super) fn lab_median(ctx: &super::device::Ctx, calls: usize, f: &dyn Fn(usize)) -> Result<f64> {
    let Some((bufs, alone)) = lab_between(ctx)? else {
        return warm_median(ctx, calls, f);
    };
    let n16 = (bufs[0].size() / 16) as usize;
    let s = warm_median(ctx, calls, &|i| {
        f(i);
        lab_read(ctx, &bufs[i % 2], &bufs[2], n16);
    })?;
    Ok(s - alone)
}

/// The median of `REPS` timed passes of `calls` calls of `f`, after `WARM_S` of them.
fn warm_median(ctx: &super::device::Ctx, calls: usize, f: &dyn Fn(usize)) -> Result<f64> {
    let t0 = std::time::Instant::now();
    while t0.elapsed().as_secs_f64() < WARM_S {
        ctx.time_pass(|| (0..calls).for_each(f))?;
    }
    let mut v = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        v.push(ctx.time_pass(|| (0..calls).for_each(f))? / calls as f64);
    }
    v.sort_by(f64::total_cmp);
    Ok(v[v.len() / 2])
}

/// `LILY_LAB_BETWEEN_MB`'s two copies and sink, made for a row, and the median seconds of
/// their read alone, timed just before the row (`None` when unset).
fn lab_between(ctx: &super::device::Ctx) -> Result<Option<([::wgpu::Buffer; 3], f64)>> {
    let mb: u64 = match std::env::var("LILY_LAB_BETWEEN_MB")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        Some(mb) if mb > 0 => mb,
        _ => return Ok(None),
    };
    let bytes = (mb << 20).min(ctx.report.max_binding / 16 * 16);
    let bufs = [ctx.buffer(bytes)?, ctx.buffer(bytes)?, ctx.buffer(64)?];
    let n16 = (bytes / 16) as usize;
    let s = warm_median(ctx, 64, &|i| lab_read(ctx, &bufs[i % 2], &bufs[2], n16))?;
    Ok(Some((bufs, s)))
}

/// Reads `n` f32 values back (case "gemm" and "moe_mm").
fn lab_floats(ctx: &super::device::Ctx, b: &WBuf) -> Result<Vec<f32>> {
    Ok(ctx
        .read(&b.buf, 4 * b.len as u64)?
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect())
}

/// max |got − want| / max |want|.
fn lab_rel(got: &[f32], want: &[f32]) -> f64 {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    let diff = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    (diff / scale) as f64
}

/// Prefill's GEMMs timed (case "gemm"): each `LILY_WGPU_GEMM` kernel (`coop` and `coop1` only
/// where the adapter has `coop16`).
const GEMM_VARIANTS: [(&str, u32); 5] = [
    ("old", 0),
    ("big", 1),
    ("chain", 2),
    ("coop", 3),
    ("coop1", 4),
];

impl Wgpu {
    /// Case "gemm": prefill's GEMM (`matmul_q` past 64 rows, 4-bit codes in groups of 64) at
    /// 2048 rows of x for in_proj's 2048→8192 and 2048→4096 and out_proj's 4096→2048, and at
    /// 300 rows (a short last chunk: few workgroups of 128 rows) for 2048→8192 and 4096→2048,
    /// under each of `GEMM_VARIANTS` (matmul.wgsl's gemm, gemm.wgsl's gemm_big summing each
    /// step apart, and with one chain, gemm_coop.wgsl's cooperative-matrix gemm_coop and its
    /// scalar-staged coop1 where the adapter has `coop16`: f16 operands, so their `check` is
    /// ~1e-3 where the others' is ~1e-6),
    /// over two copies of the weights; also 2048 rows of in_proj's 2048→12352 (the GDN layers'
    /// qkvz|ba output: a ragged last block of outputs). The variant's name
    /// reads `kernel rows×in>out rate`, the rate 2·rows·in·out / time in TFLOP/s; `check` is
    /// max |this − old| / max |old| on copy 0's outputs. At most 20 calls a timed pass (a call
    /// is milliseconds).
    fn lab_gemm(&self, calls: usize, print: &mut dyn FnMut(&LabRow)) -> Result<Vec<LabRow>> {
        let ctx = &self.ctx;
        let saved = ctx.sw.gemm.load(Ordering::Relaxed);
        let calls = calls.min(20);
        let mut res = Vec::new();
        let shapes: [(usize, usize, usize); 6] = [
            (2048, 8192, 2048),
            (2048, 12352, 2048),
            (2048, 4096, 2048),
            (2048, 2048, 4096),
            (300, 8192, 2048),
            (300, 2048, 4096),
        ];
        for (rows, out, inp) in shapes {
            if (4 * rows * out.max(inp)) as u64 > ctx.report.max_binding {
                eprintln!("lab: gemm {inp}>{out} skipped: x or out exceeds the largest binding");
                continue;
            }
            let mats = [
                self.lab_mat(out, inp, 4, 64, 301)?,
                self.lab_mat(out, inp, 4, 64, 302)?,
            ];
            let x = self.lab_buf(&floats(rows * inp, 303, -1.0, 1.0))?;
            let o = self.lab_buf(&vec![0.0; rows * out])?;
            let bytes = out * inp / 2 + 2 * 2 * (out * inp / 64);
            let call = |i: usize| {
                let mut ob = WBuf {
                    buf: o.buf.clone(),
                    len: o.len,
                    half: o.half,
                };
                super::matmul::matmul_q(ctx, &x, &mats[i % 2], 0, rows, &mut ob);
            };
            let mut reference: Option<Vec<f32>> = None;
            for (name, code) in GEMM_VARIANTS {
                if code >= 3 && !ctx.report.coop16 {
                    continue;
                }
                ctx.sw.gemm.store(code, Ordering::Relaxed);
                let op_s = lab_median(ctx, calls, &call)?;
                call(0);
                let got = lab_floats(ctx, &o)?;
                let want = reference.get_or_insert_with(|| got.clone());
                let check = lab_rel(&got, want);
                let tflops = 2.0 * (rows * inp * out) as f64 / op_s / 1e12;
                let row = LabRow {
                    case: "gemm",
                    variant: if tflops >= 1.0 {
                        format!("{name} {rows}x{inp}>{out} {tflops:.1}TF")
                    } else {
                        format!("{name} {rows}x{inp}>{out} {tflops:.4}TF")
                    },
                    bytes,
                    copies: 2,
                    calls,
                    op_s,
                    read_s: None,
                    check: Some(check),
                };
                print(&row);
                res.push(row);
            }
        }
        ctx.sw.gemm.store(saved, Ordering::Relaxed);
        Ok(res)
    }

    /// Case "moe_mm": prefill's routed experts (`moe_experts` from 64 rows: moe_sort, the
    /// grouped gate|up and down GEMMs, moe_combine) at 2048 and 300 rows of x over the preset's
    /// expert stacks (random routes), with moe_mm.wgsl's 8 × 8 entries (`mm8`) and moe.wgsl's
    /// (`old`, the default; `LILY_WGPU_MOE_MM=mm8` for the other). The variant's name reads `kernels rows rate`, the rate
    /// 2·rows·k·3·width·hidden / time in TFLOP/s (the whole op: sort and combine included);
    /// `check` is max |this − old| / max |old|. At most 20 calls a timed pass.
    fn lab_moe_mm(
        &self,
        cfg: &Config,
        calls: usize,
        print: &mut dyn FnMut(&LabRow),
    ) -> Result<Vec<LabRow>> {
        let ctx = &self.ctx;
        let saved = ctx.sw.moe_mm8.load(Ordering::Relaxed);
        let calls = calls.min(20);
        let d = Dims::from_config(cfg);
        let (bits, gs) = match &cfg.quantization.default {
            Some(q) => (q.bits, q.group_size),
            None => (4, 64),
        };
        let (w, hid) = (cfg.moe_intermediate_size, cfg.hidden_size);
        let mk = |out: usize, inp: usize, seed: u64| -> Result<WMat> {
            let m = self.lab_mat(d.n_experts * out, inp, bits, gs, seed)?;
            Ok(WMat {
                n: d.n_experts,
                out,
                ..m
            })
        };
        let (gate, up, down) = (mk(w, hid, 81)?, mk(w, hid, 82)?, mk(hid, w, 83)?);
        let bytes = 3 * d.n_experts * (w * hid * bits as usize / 8 + 4 * (w * hid / gs));
        let mut res = Vec::new();
        for rows in [2048usize, 300] {
            let logits = self.lab_buf(&floats(rows * d.n_experts, 84, -4.0, 4.0))?;
            let mut route = self.new_route(rows, d.top_k)?;
            super::moe::moe_route(ctx, &logits, &d, rows, &mut route);
            let x = self.lab_buf(&floats(rows * hid, 85, -1.0, 1.0))?;
            let out = self.lab_buf(&vec![0.0; rows * hid])?;
            let call = |_: usize| {
                let mut o = WBuf {
                    buf: out.buf.clone(),
                    len: out.len,
                    half: out.half,
                };
                super::moe::moe_experts(ctx, &x, &route, &gate, &up, &down, &d, rows, &mut o)
            };
            let mut reference: Option<Vec<f32>> = None;
            for (name, on) in [("old", false), ("mm8", true)] {
                ctx.sw.moe_mm8.store(on, Ordering::Relaxed);
                let op_s = lab_median(ctx, calls, &call)?;
                call(0);
                let got = lab_floats(ctx, &out)?;
                let want = reference.get_or_insert_with(|| got.clone());
                let check = lab_rel(&got, want);
                let flops = 2.0 * (rows * d.top_k * 3 * w * hid) as f64;
                let tflops = flops / op_s / 1e12;
                let row = LabRow {
                    case: "moe_mm",
                    variant: if tflops >= 1.0 {
                        format!("{name} {rows} {tflops:.1}TF")
                    } else {
                        format!("{name} {rows} {tflops:.4}TF")
                    },
                    bytes,
                    copies: 1,
                    calls,
                    op_s,
                    read_s: None,
                    check: Some(check),
                };
                print(&row);
                res.push(row);
            }
        }
        ctx.sw.moe_mm8.store(saved, Ordering::Relaxed);
        Ok(res)
    }

    /// Case "gdn_step": a decode token's recurrence and the staging of out_proj's x at the
    /// preset's GDN shape, each `LILY_WGPU_GDN_STEP` path: `old` gdn_recur then q2x_stage's
    /// xmode 3 (the gated norm as it stages x), `y` gdn_step_y then the same q2x_stage, `x`
    /// gdn_step_x alone (where the adapter takes it); also each recurrence alone (`recur`,
    /// `step_y`) and q2x_stage alone (`stage`). Over enough copies of the 2 MB-a-layer state
    /// that a cycle reads `cycle` bytes (the step's own state is not in the cache either: 30
    /// layers' weights pass between two of its uses). `bytes` is the state read and written;
    /// `check` is max |state − old's| / max |old's| after one call of each path from the same
    /// state.
    fn lab_gdn_step(
        &self,
        cfg: &Config,
        calls: usize,
        cycle: usize,
        print: &mut dyn FnMut(&LabRow),
    ) -> Result<Vec<LabRow>> {
        use crate::backend::GdnParams;
        let ctx = &self.ctx;
        let saved = ctx.sw.gdn_step.load(Ordering::Relaxed);
        let d = Dims::from_config(cfg);
        let (hk, hv, dk, dv) = (d.gdn_k_heads, d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim);
        let c = d.conv_channels();
        let n = hv * dv * dk;
        let copies = cycle.div_ceil(4 * n).clamp(2, 64);
        let init = floats(n, 701, -0.05, 0.05);
        let states: Vec<WBuf> = (0..copies)
            .map(|_| self.lab_buf(&init))
            .collect::<Result<_>>()?;
        let qkv = self.lab_buf(&floats(c, 702, -1.0, 1.0))?;
        let z = self.lab_buf(&floats(hv * dv, 703, -1.0, 1.0))?;
        let b = self.lab_buf(&floats(hv, 704, -1.5, 1.5))?;
        let a = self.lab_buf(&floats(hv, 705, -1.5, 1.5))?;
        let w = GdnParams {
            a_log: self.lab_buf(&floats(hv, 706, 1.0, 2.5))?,
            dt_bias: self.lab_buf(&floats(hv, 707, -1.0, 1.0))?,
            norm: self.lab_buf(&floats(dv, 708, 0.9, 1.1))?,
        };
        let y = self.lab_buf(&vec![0.0; hv * dv])?;
        let xq = super::matmul::xq_scratch(ctx, 1, hv * dv)?;
        let spare = &ctx.spare[4];
        // q2x_stage in xmode 3 alone (as gemv_many runs it before out_proj's gemv_q6).
        let stage = || {
            let xp = [(hv * dv) as u32, 1, 3, d.eps.to_bits(), dv as u32, 0, 0, 0];
            let bufs = [&y.buf, &z.buf, spare, &xq, &w.norm.buf];
            super::matmul::stage(ctx, "q2x_stage", &xp, &bufs, 1);
        };
        let recur = |i: usize| {
            let mut st = WBuf {
                buf: states[i % copies].buf.clone(),
                len: n,
                half: false,
            };
            let mut yb = WBuf {
                buf: y.buf.clone(),
                len: y.len,
                half: false,
            };
            super::gdn::gated_delta_ex(ctx, &qkv, &z, &b, &a, &w, &mut st, &d, 1, &mut yb, false);
        };
        let fused = |i: usize| {
            let mut st = WBuf {
                buf: states[i % copies].buf.clone(),
                len: n,
                half: false,
            };
            super::gdn::gated_delta_x(ctx, &qkv, &z, &b, &a, &w, &mut st, &d, &xq, false);
        };
        let mut res = Vec::new();
        let mut reference: Option<Vec<f32>> = None;
        let x_ok = {
            ctx.sw.gdn_step.store(2, Ordering::Relaxed);
            super::gdn::step_x_takes(ctx, &d)
        };
        // (name, GDN_STEP code, what a call runs: 0 the recurrence, 1 it and q2x_stage, 2 the
        // fused kernel, 3 q2x_stage alone)
        let variants: [(&str, u32, u32); 6] = [
            ("old", 0, 1),
            ("y", 1, 1),
            ("x", 2, 2),
            ("recur", 0, 0),
            ("step_y", 1, 0),
            ("stage", 0, 3),
        ];
        for (name, code, what) in variants {
            if what == 2 && !x_ok {
                eprintln!("lab: gdn_step x skipped: the adapter or the shape does not take it");
                continue;
            }
            ctx.sw.gdn_step.store(code, Ordering::Relaxed);
            let call = |i: usize| match what {
                0 => recur(i),
                1 => {
                    recur(i);
                    stage();
                }
                2 => fused(i),
                _ => stage(),
            };
            let op_s = lab_median(ctx, calls, &call)?;
            // One call from the initial state: the state it leaves against old's.
            let check = if what != 3 {
                ctx.flush();
                ctx.queue.write_buffer(&states[0].buf, 0, as_bytes(&init));
                call(0);
                let got = lab_floats(ctx, &states[0])?;
                let want = reference.get_or_insert_with(|| got.clone());
                Some(lab_rel(&got, want))
            } else {
                None
            };
            let row = LabRow {
                case: "gdn_step",
                variant: format!("{name} Hk {hk} Hv {hv} Dk {dk} Dv {dv}"),
                bytes: if what == 3 { 0 } else { 2 * 4 * n },
                copies,
                calls,
                op_s,
                read_s: None,
                check,
            };
            print(&row);
            res.push(row);
        }
        ctx.sw.gdn_step.store(saved, Ordering::Relaxed);
        Ok(res)
    }
}

impl Wgpu {
    /// Case "attn": one decode step's attention over the cache (`attn_decode`: kv_append_step,
    /// attn_dec_gqa, attn_combine4) at 4K, 32K and 128K of context, the cache in f32 and in f16
    /// (where the adapter has SHADER_F16), its capacity the power of two above the context + 64
    /// (as a bench run grows it: the split count follows the capacity). Over copies of the
    /// caches making ≥ 256 MB (so that L2 does not hold them). `bytes` is the K and V rows
    /// read (2 · context · kv_dim · element size); the variant reads `f16 32K`, `team f16 32K`
    /// for attn_dec_team in attn_dec_gqa's place (adapters with ordered subgroups), or
    /// `team+cq f16 32K` with attn_combine4q merging its splits (`LILY_WGPU_ATTN_CQ`).
    fn lab_attn(
        &self,
        cfg: &Config,
        calls: usize,
        print: &mut dyn FnMut(&LabRow),
    ) -> Result<Vec<LabRow>> {
        let ctx = &self.ctx;
        let d = Dims::from_config(cfg);
        let (hq, kvd) = (d.n_heads, d.n_kv_heads * d.head_dim);
        let calls = calls.min(50);
        let mut res = Vec::new();
        let q = self.lab_buf(&floats(hq * d.head_dim, 401, -1.0, 1.0))?;
        let gate = self.lab_buf(&floats(hq * d.head_dim, 402, -1.0, 1.0))?;
        let kv1 = self.lab_buf(&floats(kvd, 403, -1.0, 1.0))?;
        let o = self.lab_buf(&vec![0.0; hq * d.head_dim])?;
        let mut step = self.new_step()?;
        for n in [4096usize, 32768, 131072] {
            let cap = (n + 64).next_power_of_two();
            for half in [false, true] {
                if half && !ctx.report.f16 {
                    continue;
                }
                let esize = if half { 2 } else { 4 };
                let buf_bytes = (cap * kvd * esize) as u64;
                if buf_bytes > ctx.report.max_binding {
                    eprintln!("lab: attn at {n} skipped: a cache of {buf_bytes} B exceeds the largest binding");
                    continue;
                }
                let copies = (256usize << 20).div_ceil(2 * n * kvd * esize).clamp(1, 8);
                let caches: Vec<(WBuf, WBuf)> = (0..copies)
                    .map(|_| -> Result<(WBuf, WBuf)> {
                        let mk = || -> Result<WBuf> {
                            Ok(WBuf {
                                buf: ctx.buffer(buf_bytes)?,
                                len: cap * kvd,
                                half,
                            })
                        };
                        Ok((mk()?, mk()?))
                    })
                    .collect::<Result<_>>()?;
                self.set_step(&mut step, 0, n - 1);
                let call = |i: usize| {
                    let (k, v) = &caches[i % copies];
                    let clone = |b: &WBuf| WBuf {
                        buf: b.buf.clone(),
                        len: b.len,
                        half: b.half,
                    };
                    let mut kv = crate::backend::KvCache {
                        k: clone(k),
                        v: clone(v),
                        capacity: cap,
                    };
                    let mut ob = clone(&o);
                    super::attention::attn_decode(
                        ctx,
                        &q,
                        &kv1,
                        &kv1,
                        &gate,
                        &mut kv,
                        &d,
                        n - 1,
                        &step,
                        &mut ob,
                    );
                };
                let saved = (self.attn_team(), self.attn_cq());
                // (attn_dec_team, attn_combine4q.)
                for (team, cq) in [(false, false), (true, false), (true, true)] {
                    if team && !ctx.report.subgroups {
                        continue;
                    }
                    self.set_attn_team(team);
                    self.set_attn_cq(cq);
                    let op_s = lab_median(ctx, calls, &call);
                    self.set_attn_team(saved.0);
                    self.set_attn_cq(saved.1);
                    let row = LabRow {
                        case: "attn",
                        variant: format!(
                            "{}{} {}K",
                            match (team, cq) {
                                (true, true) => "team+cq ",
                                (true, false) => "team ",
                                (false, _) => "",
                            },
                            if half { "f16" } else { "f32" },
                            n / 1024
                        ),
                        bytes: 2 * n * kvd * esize,
                        copies,
                        calls,
                        op_s: op_s?,
                        read_s: None,
                        check: None,
                    };
                    print(&row);
                    res.push(row);
                }
            }
        }
        Ok(res)
    }
}
