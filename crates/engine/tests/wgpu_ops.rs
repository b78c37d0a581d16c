//! Every wgpu op against the CPU op (the oracle), on seeded random inputs at the real
//! Qwen3.6-35B-A3B shapes, and the shaders' translation to Metal Shading Language. Built only with
//! `--features wgpu`. In CI the adapter is Mesa's lavapipe (a CPU Vulkan, subgroups of 8); each
//! test skips with a message when no adapter is found (LILY_REQUIRE_WGPU=1 makes that a failure).
//!
//! Types and tolerances. The wgpu backend keeps activations and states in f32 (the CPU's types),
//! the KV cache in f32 or f16 (the attention tests run both; wgpu/attention.rs states the f16
//! bound), and reads the same quantized weights, so what differs is summation order, FMA
//! contraction and the reduction trees:
//! * `EXACT` (0): copies, the residual add (one f32 add on both sides), elementwise ops whose
//!   expression is the CPU's (`swiglu`, `add_sigmoid_gated`: `exp` may differ by an ulp or two on
//!   a GPU, so these get `ELEM_TOL`).
//! * `F32_TOL` = 1e-5 as `max |gpu − cpu| / max |cpu|` per output row (the row's scale) for sums
//!   of f32 products (norms, GEMV/GEMM over K ≤ 4096): about 100 f32 epsilons, where a real bug
//!   (a wrong index, group or scale) moves outputs by O(1e-1).
#![cfg(feature = "wgpu")]

mod common;
#[path = "common/lookahead.rs"]
mod lookahead;
#[path = "common/ops.rs"]
mod ops;
#[path = "common/sampling.rs"]
mod sampling;
// One op family a file.
#[path = "wgpu/attention.rs"]
mod attention;
#[path = "wgpu/e2e.rs"]
mod e2e;
#[path = "wgpu/gdn.rs"]
mod gdn;
#[path = "wgpu/gemm_coop.rs"]
mod gemm_coop;
#[path = "wgpu/moe.rs"]
mod moe;
#[path = "wgpu/moe_step.rs"]
mod moe_step;
#[path = "wgpu/output.rs"]
mod output;
#[path = "wgpu/sample.rs"]
mod sample;

use lily::backend::cpu::Cpu;
use lily::backend::wgpu::Wgpu;
use lily::backend::Backend;
use ops::{check, qwen_dims, rand_dense, rand_quant, rel_rows, GdnTmp, Rng};

const EXACT: f32 = 0.0;
const F32_TOL: f32 = 1e-5;
/// gemv_v5 and gemv_q6 (the default decode GEMVs): x in two int8 levels per 16-byte code word (x ≈ d·(q1 + q2/254),
/// d = max |x| / 127 over the word), each element within max |x| / 64,516 of itself (15 bits);
/// a row's error measures 2-5e-5 of its largest output on wide matrices, but up to 4.5e-4 on a
/// one-output matrix (the router's shared gate), whose "largest output" is one sum that
/// cancellation can make small against its terms. 1e-3 still fails x at one int8 level (~4e-3)
/// and stays below bf16 activations' 2^-9.
const Q2X_TOL: f32 = 1e-3;
/// Elementwise transcendental ops: a GPU's `exp` is within a few ulps of the host's.
const ELEM_TOL: f32 = 1e-6;

/// The test adapter: the best GPU, else a software one (lavapipe); `None` skips the test.
fn gpu() -> Option<Wgpu> {
    match Wgpu::new(true) {
        Ok(g) => {
            let r = g.report();
            eprintln!(
                "wgpu adapter: {} ({}, {}), subgroups {}-{}, f16 {}, workgroup memory {} B, coop16 {}, memory {}",
                r.name,
                r.backend,
                r.device_type,
                r.subgroup_min,
                r.subgroup_max,
                r.f16,
                r.workgroup_storage,
                r.coop16,
                r.memory
                    .map_or("unknown".into(), |m| format!("{:.1} GiB", m as f64 / (1u64 << 30) as f64))
            );
            // The op tests count gemv_q6's launches with its q2x_stage (`gemv_launches`);
            // gemv_q6w (`LILY_WGPU_Q6W`'s default, 2) has tests of its own, which set it, and
            // the end-to-end tests run the default (e2e.rs).
            g.set_q6w(0);
            Some(g)
        }
        Err(e) => {
            if std::env::var("LILY_REQUIRE_WGPU").as_deref() == Ok("1") {
                panic!("LILY_REQUIRE_WGPU=1 but no wgpu adapter: {e:#}");
            }
            eprintln!("skipping: no wgpu adapter ({e:#})");
            None
        }
    }
}

fn h(g: &Wgpu, b: &<Wgpu as Backend>::Buf, len: usize) -> Vec<f32> {
    let v = g.to_host(b, len).expect("to_host");
    g.sync().expect("the ops before this read");
    v
}

/// Every shader validates (naga, with subgroups, f16 and cooperative matrices) and, except the
/// files `not_for_metal` lists with a reason (gemm_coop: 16×16 f16 cooperative matrices, which
/// Apple's 8×8 simdgroup matrices are not), translates to MSL.
#[test]
fn shaders_validate_and_translate_to_msl() {
    let out = lily::backend::wgpu::translate_to_msl()
        .expect("every shader is valid WGSL and translates to MSL");
    // Kept as an artifact of the build for review (not committed): target/wgsl-msl/<file>.metal.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/wgsl-msl");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, msl) in &out {
        assert!(
            msl.contains("kernel void") || !msl.contains("@compute"),
            "{name}: no kernel in the MSL"
        );
        std::fs::write(dir.join(format!("{name}.metal")), msl).unwrap();
        println!("{name}.wgsl -> {} bytes of MSL", msl.len());
    }
    // Validated above (with cooperative matrices) but not translated, each for its reason.
    for (name, why) in lily::backend::wgpu::not_for_metal() {
        assert!(
            out.iter().all(|(n, _)| *n != name),
            "{name}: translated although listed as not for Metal"
        );
        println!("{name}.wgsl: validated, not translated to MSL: {why}");
    }
}

/// The Vulkan driver's statistics of `gemv_v4` (`lily lab --pipeline-stats`): at least one. A
/// driver without VK_KHR_pipeline_executable_properties (lavapipe) only compiles it; no Vulkan
/// skips, as `gpu()` does.
#[cfg(not(target_os = "macos"))]
#[test]
fn pipeline_stats_of_gemv_v4() {
    let rep = match lily::backend::wgpu::stats::pipeline_stats(Some("matmul gemv_v4"), true) {
        Ok(r) => r,
        Err(e) => {
            if std::env::var("LILY_REQUIRE_WGPU").as_deref() == Ok("1") {
                panic!("LILY_REQUIRE_WGPU=1 but the probe found no Vulkan device: {e:#}");
            }
            eprintln!("skipping: {e:#}");
            return;
        }
    };
    eprintln!("{}", rep.header());
    assert_eq!(rep.entries.len(), 1, "one entry point matches");
    let e = &rep.entries[0];
    eprintln!("{}", e.summary());
    assert_eq!((e.module.as_str(), e.entry.as_str()), ("matmul", "gemv_v4"));
    let exes = e.result.as_ref().expect("gemv_v4 compiles");
    assert!(e.spirv_words > 0 && e.capabilities.iter().any(|c| c == "Shader"));
    if rep.stats_offered {
        assert!(
            exes.iter().any(|x| !x.stats.is_empty()),
            "the driver reports no statistic for gemv_v4"
        );
    } else {
        eprintln!("the driver has no VK_KHR_pipeline_executable_properties: compiled only");
    }
}

/// A Vulkan adapter says how much memory it has (`AdapterReport::memory`, its largest
/// DEVICE_LOCAL heap: what `lily serve` sizes the prefix cache from); Metal leaves it unknown.
#[test]
fn a_vulkan_adapter_reports_its_memory() {
    let Some(g) = gpu() else { return };
    let r = g.report();
    if r.backend == "Vulkan" {
        let m = r
            .memory
            .expect("a Vulkan adapter without a DEVICE_LOCAL heap");
        assert!(m >= 256 << 20, "{m} bytes of device memory");
    }
}

#[test]
fn copies_and_reads_back_exactly() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(11);
    let a = rng.vec(1000, 1.0);
    let src = g.upload(&a).unwrap();
    let mut dst = g.zeros(1200).unwrap();
    g.copy(&src, 100, &mut dst, 150, 700);
    let back = h(&g, &dst, 1200);
    let mut want = vec![0.0; 1200];
    want[150..850].copy_from_slice(&a[100..800]);
    check(
        "copy (700 of 1000 into 1200)",
        rel_rows(&back, &want, 1200),
        EXACT,
    );
}

#[test]
fn norms_and_elementwise() {
    let Some(g) = gpu() else { return };
    let d = qwen_dims();
    let mut rng = Rng(2);
    for rows in [1usize, 7, 64] {
        let dim = d.hidden;
        let x = rng.vec(rows * dim, 1.0);
        let w = rng.vec(dim, 0.5);
        let r = rng.vec(rows * dim, 0.3);
        // rms_norm
        let mut c_out = vec![0.0; rows * dim];
        Cpu.rms_norm(&x, &w, rows, dim, d.eps, &mut c_out);
        let (gx, gw) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
        let mut g_out = g.zeros(rows * dim).unwrap();
        g.rms_norm(&gx, &gw, rows, dim, d.eps, &mut g_out);
        check(
            &format!("rms_norm rows {rows}"),
            rel_rows(&h(&g, &g_out, rows * dim), &c_out, dim),
            F32_TOL,
        );
        // add_rms_norm: h and the normed output
        let mut c_h = x.clone();
        Cpu.add_rms_norm(&mut c_h, &r, &w, rows, dim, d.eps, &mut c_out);
        let mut g_h = g.upload(&x).unwrap();
        let gr = g.upload(&r).unwrap();
        g.add_rms_norm(&mut g_h, &gr, &gw, rows, dim, d.eps, &mut g_out);
        check(
            &format!("add_rms_norm rows {rows} (h)"),
            rel_rows(&h(&g, &g_h, rows * dim), &c_h, dim),
            EXACT,
        );
        check(
            &format!("add_rms_norm rows {rows} (out)"),
            rel_rows(&h(&g, &g_out, rows * dim), &c_out, dim),
            F32_TOL,
        );
        // add
        let mut c_a = x.clone();
        Cpu.add(&mut c_a, &r, rows * dim);
        let mut g_a = g.upload(&x).unwrap();
        g.add(&mut g_a, &gr, rows * dim);
        check(
            &format!("add rows {rows}"),
            rel_rows(&h(&g, &g_a, rows * dim), &c_a, dim),
            EXACT,
        );
        // swiglu at the shared expert's width
        let n = rows * 512;
        let (gg, uu) = (rng.vec(n, 2.0), rng.vec(n, 1.0));
        let mut c_s = vec![0.0; n];
        Cpu.swiglu(&gg, &uu, n, &mut c_s);
        let mut g_s = g.zeros(n).unwrap();
        g.swiglu(
            &g.upload(&gg).unwrap(),
            &g.upload(&uu).unwrap(),
            n,
            &mut g_s,
        );
        check(
            &format!("swiglu rows {rows}"),
            rel_rows(&h(&g, &g_s, n), &c_s, 512),
            ELEM_TOL,
        );
        // add_sigmoid_gated
        let s = rng.vec(rows, 2.0);
        let sh = rng.vec(rows * dim, 1.0);
        let mut c_y = x.clone();
        Cpu.add_sigmoid_gated(&mut c_y, &sh, &s, rows, dim);
        let mut g_y = g.upload(&x).unwrap();
        g.add_sigmoid_gated(
            &mut g_y,
            &g.upload(&sh).unwrap(),
            &g.upload(&s).unwrap(),
            rows,
            dim,
        );
        check(
            &format!("add_sigmoid_gated rows {rows}"),
            rel_rows(&h(&g, &g_y, rows * dim), &c_y, dim),
            ELEM_TOL,
        );
    }
}

#[test]
fn matmul_q_gemv_and_gemm() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(3);
    // (out, inp, bits, group, f32 scales): the model's in_proj-like, out_proj-like, 8-bit
    // router-like shapes, odd output counts, f32 scales; gemv_v4 over several x passes (8192, and
    // 4160: a short last pass); shapes gemv_v4 does not take (2-bit, a 4-bit group of 16, an
    // 8-bit group of 8: scalar gemv) and gemm's per-element staging (an 8-bit group of 4).
    let cases: [(usize, usize, u32, usize, bool); 11] = [
        (1000, 2048, 4, 64, false),
        (2048, 4096, 4, 64, false),
        (256, 2048, 8, 64, false),
        (37, 512, 4, 32, true),
        (300, 1024, 8, 128, true),
        (70, 8192, 4, 64, false),
        (50, 4160, 8, 64, false),
        (33, 256, 2, 32, false),
        (20, 256, 4, 16, false),
        (24, 96, 8, 8, true),
        (10, 40, 8, 4, false),
    ];
    // Rows: gemv_v4 (≤ 8), gemm at one tile, past it, several with a ragged last one.
    let all_rows = [1usize, 2, 7, 8, 9, 17, 64, 65, 300];
    for (out, inp, bits, gs, f32s) in cases {
        let m = rand_quant(&mut rng, 1, out, inp, bits, gs, f32s);
        let gm = g.upload_mat(&m).unwrap();
        for rows in all_rows {
            let x = rng.vec(rows * inp, 1.0);
            let mut c = vec![0.0; rows * out];
            Cpu.matmul_q(&x, &m, rows, &mut c);
            let mut o = g.zeros(rows * out).unwrap();
            g.matmul_q(&g.upload(&x).unwrap(), &gm, rows, &mut o);
            let what = format!(
                "matmul_q {bits}-bit g{gs}{} [{out}, {inp}] rows {rows}",
                if f32s { " f32 scales" } else { "" }
            );
            // Up to 8 rows of 4/8-bit codes take the decode GEMV (gemv_q6 or gemv_v5: x in two int8 levels).
            let tol = if rows <= 8 && matches!(bits, 4 | 8) {
                Q2X_TOL
            } else if g.gemm_is_coop(&gm, rows) {
                // The default prefill GEMM where the adapter has cooperative matrices (the
                // H200): f16 operands (gemm_coop.rs says why this bound).
                gemm_coop::COOP_TOL
            } else {
                F32_TOL
            };
            check(&what, rel_rows(&h(&g, &o, rows * out), &c, out), tol);
        }
    }
    let m = rand_dense(&mut rng, 70, 256);
    let gm = g.upload_mat(&m).unwrap();
    for rows in [1usize, 3, 70] {
        let x = rng.vec(rows * 256, 1.0);
        let mut c = vec![0.0; rows * 70];
        Cpu.matmul_q(&x, &m, rows, &mut c);
        let mut o = g.zeros(rows * 70).unwrap();
        g.matmul_q(&g.upload(&x).unwrap(), &gm, rows, &mut o);
        check(
            &format!("matmul_q dense [70, 256] rows {rows}"),
            rel_rows(&h(&g, &o, rows * 70), &c, 70),
            F32_TOL,
        );
    }
}

/// Prefill's GEMM past 64 rows (`Wgpu::set_gemm`, LILY_WGPU_GEMM): gemm.wgsl's gemm_big with
/// each 16-k step summed apart (`big`, the default), with one FMA chain an output (`chain`),
/// and matmul.wgsl's gemm (`old`), against the CPU's matmul at the model's prefill shapes:
/// in_proj-like 2048→8192 and out_proj-like 4096→2048 (4-bit, groups of 64, bf16 scales), an
/// 8-bit router-like matrix, f32 scales in groups of 128, 32 and 16 (gemm_big's smallest), rows
/// and outputs off the 128 × 128 tile (65: one row into a second block; 129 and 300 ragged) and
/// a shape gemm_big leaves to the old kernel (a 4-bit group of 8). F32_TOL (1e-5 of a row's
/// largest output): f32 sums of f32 products on both sides in different orders; gemm_big
/// measures ~1e-6 on lavapipe (`chain` alike at these widths: ~2^-24·√in relative), where a
/// wrong index, group or scale moves outputs by O(1e-1).
#[test]
fn gemm_big_matches_the_cpu() {
    let mut rng = Rng(41);
    // (out, inp, bits, group, f32 scales, rows).
    let cases: [(usize, usize, u32, usize, bool, usize); 7] = [
        (8192, 2048, 4, 64, false, 300),
        (2048, 4096, 4, 64, false, 129),
        (257, 2048, 8, 64, false, 65),
        (300, 1024, 8, 128, true, 200),
        (131, 512, 4, 32, true, 300),
        (70, 256, 4, 16, false, 129),
        (40, 64, 4, 8, false, 100),
    ];
    let mats: Vec<_> = cases
        .iter()
        .map(|&(out, inp, bits, gs, f32s, _)| rand_quant(&mut rng, 1, out, inp, bits, gs, f32s))
        .collect();
    let xs: Vec<Vec<f32>> = cases
        .iter()
        .map(|&(_, inp, _, _, _, rows)| rng.vec(rows * inp, 1.0))
        .collect();
    let want: Vec<Vec<f32>> = cases
        .iter()
        .zip(mats.iter().zip(&xs))
        .map(|(&(out, _, _, _, _, rows), (m, x))| {
            let mut c = vec![0.0; rows * out];
            Cpu.matmul_q(x, m, rows, &mut c);
            c
        })
        .collect();
    for v in ["big", "chain", "old"] {
        let Some(g) = gpu() else { return };
        g.set_gemm(v).unwrap();
        for (i, &(out, inp, bits, gs, f32s, rows)) in cases.iter().enumerate() {
            // The old kernel at the two big shapes is matmul_q_gemv_and_gemm's (lavapipe time).
            if v == "old" && i < 2 {
                continue;
            }
            let gm = g.upload_mat(&mats[i]).unwrap();
            let mut o = g.zeros(rows * out).unwrap();
            g.matmul_q(&g.upload(&xs[i]).unwrap(), &gm, rows, &mut o);
            check(
                &format!(
                    "gemm {v} {bits}-bit g{gs}{} [{out}, {inp}] rows {rows}",
                    if f32s { " f32 scales" } else { "" }
                ),
                rel_rows(&h(&g, &o, rows * out), &want[i], out),
                F32_TOL,
            );
        }
    }
}

/// `matmul_q_many` (up to 4 matrices a gemv_v4 launch, more in launches of 4) and
/// `rms_norm_matmul` (the norm inside each workgroup, xn written by the first) at the model's
/// projection sets, mixed 4/8-bit sets and odd output counts, against the CPU's matmul_q one by
/// one (Q2X_TOL: the default gemv_q6 / gemv_v5) and its rms_norm (xn: F32_TOL per row).
#[test]
fn matmul_q_many_and_rms_norm_matmul() {
    let Some(g) = gpu() else { return };
    many_and_norm_case(&g, Q2X_TOL);
}

/// The projection sets the GEMV tests launch, (out, bits) per matrix: GDN in_proj (qkv, z, b,
/// a), the router and shared gate, q/k/v, five matrices (two launches), a mixed set with odd
/// counts.
fn projection_sets() -> Vec<Vec<(usize, u32)>> {
    vec![
        vec![(8192, 4), (4096, 4), (32, 4), (32, 4)],
        vec![(256, 8), (1, 8)],
        vec![(8192, 4), (512, 4), (512, 4)],
        vec![(100, 4), (37, 8), (1000, 4), (5, 4), (260, 8)],
        vec![(1, 4)],
    ]
}

fn many_and_norm_case(g: &Wgpu, tol: f32) {
    let d = qwen_dims();
    let hid = d.hidden;
    let mut rng = Rng(31);
    let sets = projection_sets();
    for set in sets {
        let mats: Vec<_> = set
            .iter()
            .map(|&(out, bits)| rand_quant(&mut rng, 1, out, hid, bits, 64, false))
            .collect();
        let gm: Vec<_> = mats.iter().map(|m| g.upload_mat(m).unwrap()).collect();
        let refs: Vec<_> = gm.iter().collect();
        for rows in [1usize, 3] {
            let hx = rng.vec(rows * hid, 1.0);
            let nw = rng.vec(hid, 0.5);
            let mut cxn = vec![0.0; rows * hid];
            Cpu.rms_norm(&hx, &nw, rows, hid, d.eps, &mut cxn);
            let gh = g.upload(&hx).unwrap();
            let gnw = g.upload(&nw).unwrap();
            for fused_norm in [false, true] {
                let mut outs: Vec<_> = set
                    .iter()
                    .map(|&(o, _)| g.zeros(rows * o).unwrap())
                    .collect();
                let mut om: Vec<_> = outs.iter_mut().collect();
                let mut gxn = g.zeros(rows * hid).unwrap();
                let xin = if fused_norm {
                    g.rms_norm_matmul(&gh, &gnw, rows, hid, d.eps, &mut gxn, &refs, &mut om);
                    check(
                        &format!("rms_norm_matmul {set:?} rows {rows} (xn)"),
                        rel_rows(&h(g, &gxn, rows * hid), &cxn, hid),
                        F32_TOL,
                    );
                    &cxn
                } else {
                    g.matmul_q_many(&gh, &refs, rows, &mut om);
                    &hx
                };
                for (i, m) in mats.iter().enumerate() {
                    let mut c = vec![0.0; rows * m.out];
                    Cpu.matmul_q(xin, m, rows, &mut c);
                    check(
                        &format!(
                            "{} matrix {i} [{}, {hid}] {}-bit rows {rows}",
                            if fused_norm {
                                "rms_norm_matmul"
                            } else {
                                "matmul_q_many"
                            },
                            m.out,
                            set[i].1
                        ),
                        rel_rows(&h(g, &outs[i], rows * m.out), &c, m.out),
                        tol,
                    );
                }
            }
        }
    }
}

/// The decode epilogues: `matmul_q_add` (h += x·Wᵀ in the projection's launch) and
/// `moe_decode_add` (the shared expert's swiglu read as x is staged, its gate, the routed sum and
/// the residual add in its down projection's epilogue) against the CPU's ops (Q2X_TOL on h:
/// the default GEMVs' x in two int8 levels; F32_TOL under gemv_v4, in the variants test).
#[test]
fn decode_epilogues_match_the_cpu() {
    let Some(g) = gpu() else { return };
    epilogues_case(&g, Q2X_TOL);
}

/// The decode GEMVs other than the default (`Wgpu::set_gemv`; the default `v6` is gemv_q6 for
/// launches of 8 MB of codes or more, gemv_v5 below): gemv_v4, gemv_rw with 1, 2 and 4 rows a
/// team and gemv_xs (F32_TOL: x in f32), gemv_v5 alone and gemv_q6 for every launch (Q2X_TOL:
/// x in two int8 levels) through the same projection sets, norms and epilogues as the two tests
/// above, gemv_q6 also with its teams changed by launch size (`set_q6_wgs_by`). On an adapter
/// without ordered subgroups gemv_rw and gemv_xs fall back to gemv_v4 (and pass as it),
/// gemv_q6 to gemv_v5.
#[test]
fn gemv_variants_match_the_cpu() {
    // One device for all (the H200's Vulkan driver refused a 27th device in one process).
    let Some(g) = gpu() else { return };
    for (v, tol) in [
        ("v4", F32_TOL),
        ("rw1", F32_TOL),
        ("rw2", F32_TOL),
        ("rw4", F32_TOL),
        ("xs", F32_TOL),
        ("v5", Q2X_TOL),
        ("v6", Q2X_TOL),
    ] {
        g.set_gemv(v).unwrap();
        g.set_q6_min_kb(0);
        eprintln!("LILY_WGPU_GEMV={v}");
        many_and_norm_case(&g, tol);
        epilogues_case(&g, tol);
    }
    // gemv_q6 with the launches under 1 MB of codes (most of the sets here) on as few
    // workgroups as they take, then on 64, the larger ones on 256 (`LILY_WGPU_Q6_WGS_BY`:
    // other teams and rows).
    for by in ["1:1", "1:64,64:256"] {
        g.set_q6_wgs_by(by).unwrap();
        eprintln!("LILY_WGPU_GEMV=v6 LILY_WGPU_Q6_WGS_BY={by}");
        many_and_norm_case(&g, Q2X_TOL);
    }
    assert!(g.set_q6_wgs_by("1:0").is_err() && g.set_q6_wgs_by("x").is_err());
    g.set_q6_wgs_by("").unwrap();
}

/// gemv_q6w (`LILY_WGPU_Q6W=1`, `Wgpu::set_q6w`: x quantized in each workgroup, no
/// q2x_stage launch) through the projection sets, norms and epilogues of the tests above
/// against the CPU (Q2X_TOL: x in two int8 levels, as gemv_q6; rows of 1 take it, rows of 3
/// gemv_q6s as before; xn, written by its first workgroup, F32_TOL), and its launches: one
/// where gemv_q6s with q2x_stage takes two.
#[test]
fn gemv_q6w_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    g.set_q6w(1);
    many_and_norm_case(&g, Q2X_TOL);
    epilogues_case(&g, Q2X_TOL);
    // Launches: GDN in_proj's four matrices with the norm, o_proj's residual add.
    let d = qwen_dims();
    let mut rng = Rng(58);
    let set = [(8192usize, 4u32), (4096, 4), (32, 4), (32, 4)];
    let gm: Vec<_> = set
        .iter()
        .map(|&(o, b)| {
            g.upload_mat(&rand_quant(&mut rng, 1, o, d.hidden, b, 64, false))
                .unwrap()
        })
        .collect();
    let refs: Vec<_> = gm.iter().collect();
    let gh = g.upload(&rng.vec(d.hidden, 1.0)).unwrap();
    let gnw = g.upload(&rng.vec(d.hidden, 0.5)).unwrap();
    let wo = g
        .upload_mat(&rand_quant(&mut rng, 1, d.hidden, 4096, 4, 64, false))
        .unwrap();
    let x = g.upload(&rng.vec(4096, 1.0)).unwrap();
    let mut launches = Vec::new();
    for level in [1, 0] {
        g.set_q6w(level);
        let mut outs: Vec<_> = set.iter().map(|&(o, _)| g.zeros(o).unwrap()).collect();
        let mut om: Vec<_> = outs.iter_mut().collect();
        let mut gxn = g.zeros(d.hidden).unwrap();
        let (mut hh, mut r) = (g.zeros(d.hidden).unwrap(), g.zeros(d.hidden).unwrap());
        let n0 = g.dispatches();
        g.rms_norm_matmul(&gh, &gnw, 1, d.hidden, d.eps, &mut gxn, &refs, &mut om);
        g.matmul_q_add(&x, &wo, 1, &mut r, &mut hh);
        launches.push(g.dispatches() - n0);
    }
    let q6 = g.gemv_launches(&refs) + g.gemv_launches(&[&wo]);
    if q6 == 4 && g.report().subgroups {
        assert_eq!(
            launches,
            [2, 4],
            "gemv_q6w's launches (in_proj, o_proj), then without"
        );
    }
    eprintln!("gemv_q6w: launches {launches:?} (with, without)");
}

/// gemv_q6s and q2x_stage specialised (`LILY_WGPU_SPEC=q6,xq`: each launch's shape as pipeline
/// constants) against gemv_q6 and q2x_stage reading their parameters, on one device: the same
/// projection sets as above (one to five matrices a launch, 4- and 8-bit, odd output counts),
/// 1 and 3 rows, the norm fused or not (x modes 1 and 0), and the residual add of out_proj /
/// o_proj. The specialised entries share their arithmetic with the others (q6_dot, q6_tail,
/// xq_stage), so the outputs must be equal bit for bit; a constant in the wrong slot moves them
/// by O(1). The conv, gated-norm and router-fold epilogues: the whole suite, which runs the
/// specialised kernels (LILY_WGPU_SPEC's default, `all`) against the CPU.
#[test]
fn gemv_q6_specialised_equals_gemv_q6() {
    let Some(g) = gpu() else { return };
    let d = qwen_dims();
    let hid = d.hidden;
    let mut rng = Rng(57);
    let bits = |g: &Wgpu, b: &<Wgpu as Backend>::Buf, n: usize| -> Vec<u32> {
        h(g, b, n).iter().map(|v| v.to_bits()).collect()
    };
    let sets = projection_sets();
    let mut launches = 0;
    for set in sets {
        let mats: Vec<_> = set
            .iter()
            .map(|&(out, b)| rand_quant(&mut rng, 1, out, hid, b, 64, false))
            .collect();
        let gm: Vec<_> = mats.iter().map(|m| g.upload_mat(m).unwrap()).collect();
        let refs: Vec<_> = gm.iter().collect();
        for rows in [1usize, 3] {
            let gh = g.upload(&rng.vec(rows * hid, 1.0)).unwrap();
            let gnw = g.upload(&rng.vec(hid, 0.5)).unwrap();
            for fused_norm in [false, true] {
                let mut got = Vec::new();
                for spec in [false, true] {
                    g.set_spec(if spec { "q6,xq" } else { "" }).unwrap();
                    let mut outs: Vec<_> = set
                        .iter()
                        .map(|&(o, _)| g.zeros(rows * o).unwrap())
                        .collect();
                    let mut om: Vec<_> = outs.iter_mut().collect();
                    let mut gxn = g.zeros(rows * hid).unwrap();
                    if fused_norm {
                        g.rms_norm_matmul(&gh, &gnw, rows, hid, d.eps, &mut gxn, &refs, &mut om);
                    } else {
                        g.matmul_q_many(&gh, &refs, rows, &mut om);
                    }
                    let o: Vec<Vec<u32>> = outs
                        .iter()
                        .zip(&set)
                        .map(|(b, &(n, _))| bits(&g, b, rows * n))
                        .collect();
                    got.push(o);
                }
                launches += 1;
                assert!(
                    got[0] == got[1],
                    "gemv_q6s differs from gemv_q6: {set:?} rows {rows} norm {fused_norm}"
                );
            }
        }
    }
    // The residual add (omode 1): out_proj-like and o_proj-like.
    for (out, inp, rows) in [(2048usize, 4096usize, 1usize), (2048, 2048, 3)] {
        let m = g
            .upload_mat(&rand_quant(&mut rng, 1, out, inp, 4, 64, false))
            .unwrap();
        let x = g.upload(&rng.vec(rows * inp, 1.0)).unwrap();
        let h0 = rng.vec(rows * out, 3.0);
        let mut got = Vec::new();
        for spec in [false, true] {
            g.set_spec(if spec { "q6,xq" } else { "" }).unwrap();
            let mut gh = g.upload(&h0).unwrap();
            let mut gr = g.zeros(rows * out).unwrap();
            g.matmul_q_add(&x, &m, rows, &mut gr, &mut gh);
            got.push(bits(&g, &gh, rows * out));
        }
        launches += 1;
        assert!(
            got[0] == got[1],
            "gemv_q6s differs from gemv_q6: add [{out}, {inp}] rows {rows}"
        );
    }
    g.set_spec("").unwrap();
    eprintln!("gemv_q6s: {launches} launch shapes bit-equal to gemv_q6");
}

fn epilogues_case(g: &Wgpu, tol: f32) {
    use lily::backend::{MoeScratch, SharedExpert};
    let d = lily::backend::Dims {
        n_experts: 16,
        top_k: 4,
        ..qwen_dims()
    };
    let hid = d.hidden;
    let mut rng = Rng(41);
    // matmul_q_add: out_proj-like and o_proj-like.
    for (out, inp, rows) in [
        (2048usize, 4096usize, 1usize),
        (2048, 2048, 1),
        (2048, 2048, 3),
    ] {
        let m = rand_quant(&mut rng, 1, out, inp, 4, 64, false);
        let gm = g.upload_mat(&m).unwrap();
        let x = rng.vec(rows * inp, 1.0);
        let h0 = rng.vec(rows * out, 3.0);
        let mut ch = h0.clone();
        let mut cr = vec![0.0; rows * out];
        Cpu.matmul_q_add(&x, &m, rows, &mut cr, &mut ch);
        let mut gh = g.upload(&h0).unwrap();
        let mut gr = g.zeros(rows * out).unwrap();
        g.matmul_q_add(&g.upload(&x).unwrap(), &gm, rows, &mut gr, &mut gh);
        check(
            &format!("matmul_q_add [{out}, {inp}] rows {rows}"),
            rel_rows(&h(g, &gh, rows * out), &ch, out),
            tol,
        );
    }
    // moe_decode_add: 16 experts of width 512, top-4, the shared expert of width 512.
    let w = 512;
    let gate = rand_quant(&mut rng, d.n_experts, w, hid, 4, 64, false);
    let up = rand_quant(&mut rng, d.n_experts, w, hid, 4, 64, false);
    let down = rand_quant(&mut rng, d.n_experts, hid, w, 4, 64, false);
    let sg = rand_quant(&mut rng, 1, w, hid, 4, 64, false);
    let su = rand_quant(&mut rng, 1, w, hid, 4, 64, false);
    let sd = rand_quant(&mut rng, 1, hid, w, 4, 64, false);
    let (ggate, gup, gdown) = (
        g.upload_mat(&gate).unwrap(),
        g.upload_mat(&up).unwrap(),
        g.upload_mat(&down).unwrap(),
    );
    let (gsg, gsu, gsd) = (
        g.upload_mat(&sg).unwrap(),
        g.upload_mat(&su).unwrap(),
        g.upload_mat(&sd).unwrap(),
    );
    for logit in [-1.5f32, 0.7] {
        let x = rng.vec(hid, 1.0);
        let h0 = rng.vec(hid, 3.0);
        let logits = rng.vec(d.n_experts, 2.0);
        // The CPU.
        let mut croute = Cpu.new_route(1, d.top_k).unwrap();
        Cpu.moe_route(&logits, &d, 1, &mut croute);
        let cl = vec![logit];
        let mut ch = h0.clone();
        let (mut o, mut g1, mut u1, mut a1, mut d1) = (
            vec![0.0; hid],
            vec![0.0; w],
            vec![0.0; w],
            vec![0.0; w],
            vec![0.0; hid],
        );
        Cpu.moe_decode_add(
            &x,
            &croute,
            &gate,
            &up,
            &down,
            &SharedExpert {
                gate: &sg,
                up: &su,
                down: &sd,
                logit: &cl,
            },
            &d,
            MoeScratch {
                out: &mut o,
                g: &mut g1,
                u: &mut u1,
                act: &mut a1,
                down: &mut d1,
            },
            &mut ch,
        );
        // The GPU.
        let mut groute = g.new_route(1, d.top_k).unwrap();
        g.moe_route(&g.upload(&logits).unwrap(), &d, 1, &mut groute);
        let gl = g.upload(&cl).unwrap();
        let mut gh = g.upload(&h0).unwrap();
        let (mut o, mut g1, mut u1, mut a1, mut d1) = (
            g.zeros(hid).unwrap(),
            g.zeros(w).unwrap(),
            g.zeros(w).unwrap(),
            g.zeros(w).unwrap(),
            g.zeros(hid).unwrap(),
        );
        g.moe_decode_add(
            &g.upload(&x).unwrap(),
            &groute,
            &ggate,
            &gup,
            &gdown,
            &SharedExpert {
                gate: &gsg,
                up: &gsu,
                down: &gsd,
                logit: &gl,
            },
            &d,
            MoeScratch {
                out: &mut o,
                g: &mut g1,
                u: &mut u1,
                act: &mut a1,
                down: &mut d1,
            },
            &mut gh,
        );
        check(
            &format!("moe_decode_add (16 experts, top-4, shared gate logit {logit})"),
            rel_rows(&h(g, &gh, hid), &ch, hid),
            // The routed experts' gate|up take moe_gate_up_q (x in two int8 levels) whatever
            // the GEMV.
            tol.max(Q2X_TOL),
        );
    }
}

#[test]
fn bad_shapes_are_errors_not_crashes() {
    let Some(g) = gpu() else { return };
    let x = g.zeros(10).unwrap();
    let mut o = g.zeros(10).unwrap();
    let w = g.zeros(2048).unwrap();
    g.rms_norm(&x, &w, 4, 2048, 1e-6, &mut o);
    let e = g
        .sync()
        .expect_err("a norm over more elements than the buffers hold");
    assert!(e.to_string().contains("rms_norm"), "{e}");
    // The backend goes on working after the error was returned.
    g.add(&mut o, &x, 10);
    g.sync().expect("a valid op after the error");
    assert!(g.to_host(&o, 11).is_err());
}
