//! Inputs and checks shared by the device op tests (cuda_ops, wgpu_ops): seeded random vectors
//! and MLX-quantized matrices, the real model shapes, the per-row relative error and its report.
//! Included by `#[path]` from each, so the other test crates do not compile it.
#![allow(dead_code)]

use std::sync::Arc;

use lily::backend::{Backend, Dims, KvCache};
use lily::loader::tensor::{
    bf16_to_f32, f32_to_bf16 as bf16_bits, Dtype, HostLinear, HostTensor, LinearKind, Storage,
};

/// splitmix64: seeded, reproducible inputs.
pub struct Rng(pub u64);
impl Rng {
    pub fn u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn f(&mut self) -> f32 {
        ((self.u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    /// Roughly normal (sum of 4 uniforms, unit variance).
    pub fn n(&mut self) -> f32 {
        (self.f() + self.f() + self.f() + self.f()) * 0.866
    }
    pub fn vec(&mut self, len: usize, scale: f32) -> Vec<f32> {
        (0..len).map(|_| self.n() * scale).collect()
    }
}

/// The real Qwen3.6-35B-A3B shapes (MODEL.md §1).
pub fn qwen_dims() -> Dims {
    Dims {
        hidden: 2048,
        eps: 1e-6,
        n_heads: 16,
        n_kv_heads: 2,
        head_dim: 256,
        rotary_dim: 64,
        rope_theta: 1e7,
        gdn_k_heads: 16,
        gdn_v_heads: 32,
        gdn_k_dim: 128,
        gdn_v_dim: 128,
        conv_kernel: 4,
        n_experts: 256,
        top_k: 8,
        norm_topk: true,
    }
}

/// `x` rounded to bf16 (nearest even), as an f32.
pub fn bf16r(x: f32) -> f32 {
    bf16_to_f32(bf16_bits(x))
}

pub fn tensor_u32(
    name: &str,
    shape: Vec<usize>,
    dtype: Dtype,
    words: Vec<u32>,
    bytes: usize,
) -> HostTensor {
    HostTensor {
        name: name.into(),
        dtype,
        shape,
        data: Storage::Owned(Arc::new(words), bytes),
    }
}

pub fn pack_u16(v: &[u16]) -> Vec<u32> {
    v.chunks(2)
        .map(|c| c[0] as u32 | (*c.get(1).unwrap_or(&0) as u32) << 16)
        .collect()
}

/// A random MLX affine-quantized stack `[n, out, inp]` (codes uniform, scales ~0.01-0.02, biases
/// centring the codes), with bf16 or f32 scales.
pub fn rand_quant(
    rng: &mut Rng,
    n: usize,
    out: usize,
    inp: usize,
    bits: u32,
    gs: usize,
    f32_scales: bool,
) -> HostLinear {
    let words = n * out * inp * bits as usize / 32;
    let w: Vec<u32> = (0..words).map(|_| rng.u64() as u32).collect();
    let ng = n * out * inp / gs;
    let levels = ((1u32 << bits) - 1) as f32;
    let s: Vec<f32> = (0..ng)
        .map(|_| (0.015 + 0.005 * rng.f()) * 15.0 / levels)
        .collect();
    let b: Vec<f32> = s
        .iter()
        .map(|&s| -s * levels / 2.0 * (1.0 + 0.1 * rng.f()))
        .collect();
    let (scales, biases) = if f32_scales {
        (
            tensor_u32(
                "s",
                vec![n, out, inp / gs],
                Dtype::F32,
                s.iter().map(|v| v.to_bits()).collect(),
                4 * ng,
            ),
            tensor_u32(
                "b",
                vec![n, out, inp / gs],
                Dtype::F32,
                b.iter().map(|v| v.to_bits()).collect(),
                4 * ng,
            ),
        )
    } else {
        let sb: Vec<u16> = s.iter().map(|&v| bf16_bits(v)).collect();
        let bb: Vec<u16> = b.iter().map(|&v| bf16_bits(v)).collect();
        (
            tensor_u32(
                "s",
                vec![n, out, inp / gs],
                Dtype::BF16,
                pack_u16(&sb),
                2 * ng,
            ),
            tensor_u32(
                "b",
                vec![n, out, inp / gs],
                Dtype::BF16,
                pack_u16(&bb),
                2 * ng,
            ),
        )
    };
    HostLinear {
        name: format!("rand_q{bits}_{n}x{out}x{inp}"),
        n,
        out,
        inp,
        kind: LinearKind::Quant {
            bits,
            group_size: gs,
            w: tensor_u32(
                "w",
                vec![n, out, words / (n * out)],
                Dtype::U32,
                w,
                4 * words,
            ),
            scales,
            biases,
        },
    }
}

/// A random unquantized bf16 matrix.
pub fn rand_dense(rng: &mut Rng, out: usize, inp: usize) -> HostLinear {
    let v: Vec<u16> = (0..out * inp).map(|_| bf16_bits(rng.n() * 0.03)).collect();
    HostLinear {
        name: format!("rand_dense_{out}x{inp}"),
        n: 1,
        out,
        inp,
        kind: LinearKind::Dense(tensor_u32(
            "w",
            vec![out, inp],
            Dtype::BF16,
            pack_u16(&v),
            2 * out * inp,
        )),
    }
}

/// max over rows of `max |a − b| / max |b|` (rows of `row` values); NaN counts as infinite.
pub fn rel_rows(a: &[f32], b: &[f32], row: usize) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut worst = 0f32;
    for (ra, rb) in a.chunks(row).zip(b.chunks(row)) {
        let scale = rb.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
        let e = ra.iter().zip(rb).fold(0f32, |m, (x, y)| {
            if (x - y).is_nan() {
                f32::INFINITY
            } else {
                m.max((x - y).abs())
            }
        });
        worst = worst.max(e / scale);
    }
    worst
}

pub fn check(what: &str, err: f32, tol: f32) {
    println!("{what:<58} max rel err {err:.2e}  (tol {tol:.0e})");
    assert!(err <= tol, "{what}: error {err:e} above tolerance {tol:e}");
}

/// A cache in the backend's KV element type (f32 on the CPU, bf16 on CUDA), as `SeqState` makes it.
pub fn kv_new<B: Backend>(b: &B, cap: usize, kvd: usize) -> KvCache<B::Buf> {
    KvCache {
        k: b.kv_zeros(cap * kvd).unwrap(),
        v: b.kv_zeros(cap * kvd).unwrap(),
        capacity: cap,
    }
}

/// What `end_to_end` measured of a device backend against the CPU on one synthetic preset.
pub struct E2e {
    /// Positions teacher-forced (192) and those whose top-1 matched the CPU's.
    pub n: usize,
    pub agree: usize,
    /// Max over positions of max |dev − cpu| / max |cpu| of the prefill's logits.
    pub err: f32,
    /// The 8 decode steps after a 184-token prefill: top-1 matches and the same error.
    pub dagree: usize,
    pub derr: f32,
    /// Greedy continuations of 48 tokens: how long they stay identical, and where they part,
    /// the CPU's top-2 gap and max |logit| there.
    pub same: usize,
    pub greedy: usize,
    pub parted: Option<(f32, f32)>,
    /// Teacher-forced perplexity, relative difference to the CPU's.
    pub ppl_diff: f64,
}

/// The whole model on `dev` against the CPU (cuda_ops' and wgpu_ops' end-to-end tests): the
/// `preset` checkpoint at seed 0 teacher-forced over `prompt_ids(192)` (the positions of MLX-LM's
/// bf16-vs-f32 fixture), decode steps after a prefill, greedy continuations with the pick on the
/// device; prints each figure under `tag` and returns them for the caller's bounds.
pub fn end_to_end<B: Backend>(dev: B, preset: &str, tag: &str) -> E2e {
    end_to_end_set(dev, preset, &[], tag)
}

/// `tiny`'s config overrides that `odd_shapes_end_to_end` (cuda_ops, wgpu_ops) runs, each a
/// shape no preset has: a hidden size below 256 and one not a power of two (the GEMVs' K and
/// rows, the norms), head_dim 96 (attention's dims, RoPE's rotary part), GQA groups of 3 (6
/// query heads over 2), a GDN value head dim of 48 (the step's rows a workgroup), 6 experts
/// (the route's top-k over few).
#[allow(dead_code)]
pub const ODD_SHAPES: &[&str] = &[
    "hidden_size=192",
    "hidden_size=320",
    "head_dim=96",
    "num_attention_heads=6",
    "linear_value_head_dim=48",
    "num_experts=6",
];

/// `end_to_end` on the preset with config fields overridden (`lily synth --set`'s syntax).
pub fn end_to_end_set<B: Backend>(dev: B, preset: &str, sets: &[&str], tag: &str) -> E2e {
    try_end_to_end_set(dev, preset, sets, tag).unwrap_or_else(|e| panic!("e2e {preset}: {e:#}"))
}

/// `end_to_end_set`, an error (a shape the backend refuses, say) returned rather than a panic.
pub fn try_end_to_end_set<B: Backend>(
    dev: B,
    preset: &str,
    sets: &[&str],
    tag: &str,
) -> anyhow::Result<E2e> {
    use crate::common::{perplexity, prompt_ids, top2_gap};
    use lily::model::Logits;
    let dir = tempfile::tempdir()?;
    let mut cfg = lily::synth::preset(preset)?;
    for s in sets {
        lily::synth::apply_set(&mut cfg, s)?;
    }
    lily::synth::write_checkpoint(&cfg, dir.path(), 0, &|_, _| {})?;
    let cpu = lily::runtime::load(lily::backend::cpu::Cpu, dir.path())?;
    let gm = lily::runtime::load(dev, dir.path())?;
    println!("backend: {}", gm.backend.name());
    let v = cpu.cfg.vocab_size;
    let n = 192;
    let ids = prompt_ids(n, v);

    let t0 = std::time::Instant::now();
    let mut cs = cpu.new_state(n + 64)?;
    let cl = cpu.forward(&mut cs, &ids, Logits::All, None)?;
    let t_cpu = t0.elapsed();
    let t0 = std::time::Instant::now();
    let mut gs = gm.new_state(n + 64)?;
    let gl = gm.forward(&mut gs, &ids, Logits::All, None)?;
    let t_dev = t0.elapsed();
    let argmax = |r: &[f32]| lily::runtime::argmax(r);
    let agree = (0..n)
        .filter(|&t| argmax(&cl[t * v..][..v]) == argmax(&gl[t * v..][..v]))
        .count();
    let err = rel_rows(&gl, &cl, v);
    println!(
        "e2e {preset}, {n} positions (prefill): top-1 agreement {agree}/{n}, max rel err {err:.2e}; cpu {:.3}s {tag} {:.3}s",
        t_cpu.as_secs_f64(),
        t_dev.as_secs_f64()
    );

    // Decode: prefill 184, then 8 single-token steps, against the same CPU logits.
    let p = n - 8;
    let mut ds = gm.new_state(n + 64)?;
    gm.forward(&mut ds, &ids[..p], Logits::None, None)?;
    let (mut dagree, mut derr) = (0, 0f32);
    for t in p..n {
        let l = gm.forward(&mut ds, &ids[t..t + 1], Logits::Last, None)?;
        dagree += (argmax(&l) == argmax(&cl[t * v..][..v])) as usize;
        derr = derr.max(rel_rows(&l, &cl[t * v..][..v], v));
    }
    println!("e2e {preset}, decode after a {p}-token prefill: top-1 agreement {dagree}/8, max rel err {derr:.2e}");

    // Greedy continuations of a 32-token prompt: the decode loop with the pick on the device.
    let (mut s1, mut s2) = (cpu.new_state(128)?, gm.new_state(128)?);
    let (a, _) = lily::runtime::generate_greedy(&cpu, &mut s1, &ids[..32], 48, &[], |_| {})?;
    let (b, st) = lily::runtime::generate_greedy(&gm, &mut s2, &ids[..32], 48, &[], |_| {})?;
    let same = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let greedy = a.len().min(b.len());
    println!(
        "e2e {preset}, greedy 48 tokens: identical for the first {same}; {tag} decode {:.1} tok/s",
        st.generated as f64 / st.decode_s.max(1e-9)
    );
    let parted = (same < greedy).then(|| {
        let mut s = cpu.new_state(128).unwrap();
        let mut seq = ids[..32].to_vec();
        seq.extend_from_slice(&a[..same]);
        let l = cpu.forward(&mut s, &seq, Logits::Last, None).unwrap();
        let (gap, scale) = (top2_gap(&l), l.iter().fold(0f32, |m, x| m.max(x.abs())));
        println!("e2e {preset}: greedy parts at token {same}, the CPU's top-2 gap {gap:.3e} of max |logit| {scale:.3}");
        (gap, scale)
    });

    let to64 = |l: &[f32]| l.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    let (pc, pg) = (
        perplexity(&to64(&cl), v, &ids),
        perplexity(&to64(&gl), v, &ids),
    );
    let ppl_diff = (pg / pc - 1.0).abs();
    println!("e2e {preset}: perplexity cpu {pc:.4} {tag} {pg:.4} (rel diff {ppl_diff:.2e})");
    Ok(E2e {
        n,
        agree,
        err,
        dagree,
        derr,
        same,
        greedy,
        parted,
        ppl_diff,
    })
}

/// Row i of `mat` against x in f64: the product and Σ |terms| (the scale of its rounding);
/// `row` is scratch of x's length.
pub fn row_exact(mat: &HostLinear, i: usize, x: &[f64], row: &mut [f32]) -> (f64, f64) {
    mat.view(0).row_f32(i, row);
    let exact: f64 = row.iter().zip(x).map(|(&r, &x)| r as f64 * x).sum();
    let a: f64 = row.iter().zip(x).map(|(&r, &x)| (r as f64 * x).abs()).sum();
    (exact, a)
}

/// x = rms_norm(h) · w in f64 (the exact values the ahead tests hold the device to).
#[allow(dead_code)]
pub fn normed_f64(hm: &[f32], nw: &[f32], eps: f32) -> Vec<f64> {
    let ms = hm.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / hm.len() as f64;
    let rr = 1.0 / (ms + eps as f64).sqrt();
    hm.iter()
        .zip(nw)
        .map(|(&v, &w)| v as f64 * rr * w as f64)
        .collect()
}

/// The router folded into the projection before it (Backend::route_ahead): its logits `on` (the
/// router's E, then the shared gate's) against the fold's maths in f64 and against the unfolded
/// router's `off`, from h after the projection `hm` and the MoE norm's weights `nw`. With x̃ =
/// h·rr·w and A_e = Σ_k |R_ek·x̃_k| a row, checks (`what`) the largest |on − exact| / (tol·A_e
/// + 1e-6) and |on − off| / (A_e / 256 + 1e-6) at most 1.
#[allow(clippy::too_many_arguments)]
pub fn check_fold_logits(
    what: &str,
    hm: &[f32],
    nw: &[f32],
    eps: f32,
    router: &HostLinear,
    sgate: &HostLinear,
    on: (&[f32], f32),
    off: (&[f32], f32),
    tol: f32,
) {
    let xt = normed_f64(hm, nw, eps);
    let e = router.out;
    let (mut worst_exact, mut worst_router) = (0f64, 0f64);
    let mut row = vec![0f32; hm.len()];
    let rows = (0..e)
        .map(|i| (router, i, on.0[i], off.0[i]))
        .chain(std::iter::once((sgate, 0, on.1, off.1)));
    for (mat, i, got, base) in rows {
        let (exact, a) = row_exact(mat, i, &xt, &mut row);
        worst_exact = worst_exact.max((got as f64 - exact).abs() / (tol as f64 * a + 1e-6));
        worst_router = worst_router.max((got as f64 - base as f64).abs() / (a / 256.0 + 1e-6));
    }
    check(
        &format!("{what} (logits against f64, / bound)"),
        worst_exact as f32,
        1.0,
    );
    check(
        &format!("{what} (logits against the router's, / bound)"),
        worst_router as f32,
        1.0,
    );
}

/// An MoE block's six weight stacks at `bits` (groups of 64): the routed experts' gate, up
/// ([e, width, hid]) and down ([e, hid, width]), then the shared expert's (one stack each).
/// The MoE block's weights from the router, the shared gate and `m` (gate, up, down, then the
/// shared expert's gate, up and down: `rand_moe`'s order).
#[allow(dead_code)]
pub fn moe_weights<'a, B: Backend>(
    router: &'a B::Mat,
    shared_gate: &'a B::Mat,
    m: [&'a B::Mat; 6],
) -> lily::backend::MoeWeights<'a, B> {
    lily::backend::MoeWeights {
        router,
        shared_gate,
        gate: m[0],
        up: m[1],
        down: m[2],
        shared_gate_proj: m[3],
        shared_up_proj: m[4],
        shared_down_proj: m[5],
        next_norm: None,
    }
}

/// The five MoE scratch buffers of one token (`MoeScratch`): out and down of the hidden size,
/// g, u and act of the experts' width, in the backend's activation type.
#[allow(dead_code)]
pub struct MoeTmp<B: Backend> {
    out: B::Buf,
    g: B::Buf,
    u: B::Buf,
    act: B::Buf,
    down: B::Buf,
}

#[allow(dead_code)]
impl<B: Backend> MoeTmp<B> {
    pub fn new(b: &B, hid: usize, width: usize) -> Self {
        let z = |n| b.act_zeros(n).unwrap();
        Self {
            out: z(hid),
            g: z(width),
            u: z(width),
            act: z(width),
            down: z(hid),
        }
    }
    pub fn tmp(&mut self) -> lily::backend::MoeScratch<'_, B> {
        lily::backend::MoeScratch {
            out: &mut self.out,
            g: &mut self.g,
            u: &mut self.u,
            act: &mut self.act,
            down: &mut self.down,
        }
    }
}

/// The eight GDN mixer scratch buffers of one token (`GdnScratch`), zeroed in the backend's
/// activation type: xn and r of the hidden size, qkv and qkv_c of the conv channels, z and y of
/// Hv · Dv, b and a of Hv.
#[allow(dead_code)]
pub struct GdnTmp<B: Backend> {
    pub xn: B::Buf,
    pub qkv: B::Buf,
    pub qkv_c: B::Buf,
    pub z: B::Buf,
    pub b: B::Buf,
    pub a: B::Buf,
    pub y: B::Buf,
    pub r: B::Buf,
}

#[allow(dead_code)]
impl<B: Backend> GdnTmp<B> {
    pub fn new(be: &B, d: &Dims) -> Self {
        let z = |n| be.act_zeros(n).unwrap();
        let (hid, c, hv) = (d.hidden, d.conv_channels(), d.gdn_v_heads);
        Self {
            xn: z(hid),
            qkv: z(c),
            qkv_c: z(c),
            z: z(hv * d.gdn_v_dim),
            b: z(hv),
            a: z(hv),
            y: z(hv * d.gdn_v_dim),
            r: z(hid),
        }
    }
    pub fn tmp(&mut self) -> lily::backend::GdnScratch<'_, B> {
        lily::backend::GdnScratch {
            xn: &mut self.xn,
            qkv: &mut self.qkv,
            qkv_c: &mut self.qkv_c,
            z: &mut self.z,
            b: &mut self.b,
            a: &mut self.a,
            y: &mut self.y,
            r: &mut self.r,
        }
    }
}

pub fn rand_moe(rng: &mut Rng, e: usize, width: usize, hid: usize, bits: u32) -> [HostLinear; 6] {
    [
        rand_quant(rng, e, width, hid, bits, 64, false),
        rand_quant(rng, e, width, hid, bits, 64, false),
        rand_quant(rng, e, hid, width, bits, 64, false),
        rand_quant(rng, 1, width, hid, bits, 64, false),
        rand_quant(rng, 1, width, hid, bits, 64, false),
        rand_quant(rng, 1, hid, width, bits, 64, false),
    ]
}
