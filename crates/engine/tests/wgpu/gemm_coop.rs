//! gemm_coop (gemm_coop.wgsl: prefill's GEMM on cooperative matrices, f16 operands, f32 sums;
//! `LILY_WGPU_GEMM=coop`) against the CPU (a module of wgpu_ops.rs; its header states the f32
//! tolerances). The kernel runs only where the adapter offers 16×16×16 f16 · f16 + f32
//! cooperative matrices (`AdapterReport::coop16`: the H200 through Vulkan, not lavapipe); the
//! GPU test skips with a message elsewhere, and fails under LILY_REQUIRE_COOP=1.
//!
//! Tolerance (`COOP_TOL`): x and w reach the matrix units rounded to f16 (11 significant bits:
//! each within 2^-11 of itself, nearest-even), the products exact in f32 and summed in f32. Each
//! product is then off by up to ~2^-10 relative, with random sign, so over K terms a row's
//! outputs are off by ~√K·2^-11·|x·w| against outputs of ~√K·|x·w|: ~5e-4 of an output's own
//! scale; taken as max |error| over max |output| per row (the other tests' measure) ~1e-3.
//! `f16_operands_error_is_within_coop_tol` measures it on the CPU alone (f16-rounded x and w
//! through the CPU's matmul against the f32 one): 2.7e-4 (4-bit, K = 2048), 3.1e-4 (4-bit,
//! K = 4096), 4.5e-4 (8-bit, K = 2048) on these inputs. COOP_TOL = 2e-3 leaves 4-7× margin (a
//! driver rounding to f16 toward zero doubles the error; tensor cores' f32 sums are not exactly
//! IEEE), and stays far below what a wrong index, group, scale or missing k step does (≥ 1/64
//! ≈ 1.6e-2 for one step of 32 lost out of 2048; O(1e-1) for the rest). The GPU's outputs are
//! also compared with the CPU on the f16-rounded operands (printed, not held to a bound: ~1e-6
//! to 1e-5 where the GPU converts to f16 nearest-even as the CPU does, the rest being summation
//! order and tensor cores' truncating f32 sums; a driver may round toward zero, which Vulkan
//! allows, and land at ~1e-3 there).

use super::*;

/// max |gemm_coop − cpu matmul| / max |cpu| per row (the header says why 2e-3).
pub const COOP_TOL: f32 = 2e-3;

/// `v` rounded to f16 (nearest even) and back.
fn f16r(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

/// The matrix dequantized on the host (`MatView::row_f32`: scale·code + bias in f32), each
/// weight rounded to f16, as a dense f16 matrix: what gemm_coop stages.
fn f16_weights(m: &lily::loader::tensor::HostLinear) -> lily::loader::tensor::HostLinear {
    use lily::loader::tensor::{Dtype, HostLinear, LinearKind};
    let (out, inp) = (m.out, m.inp);
    let v = m.view(0);
    let mut row = vec![0f32; inp];
    let mut bits: Vec<u16> = Vec::with_capacity(out * inp);
    for r in 0..out {
        v.row_f32(r, &mut row);
        bits.extend(row.iter().map(|&w| half::f16::from_f32(w).to_bits()));
    }
    HostLinear {
        name: format!("{}_f16", m.name),
        n: 1,
        out,
        inp,
        kind: LinearKind::Dense(ops::tensor_u32(
            "w",
            vec![out, inp],
            Dtype::F16,
            ops::pack_u16(&bits),
            2 * out * inp,
        )),
    }
}

/// The CPU's matmul on f32 inputs (the truth) and on f16-rounded x and w (what the matrix units
/// multiply).
fn references(
    m: &lily::loader::tensor::HostLinear,
    x: &<Cpu as Backend>::Buf,
    rows: usize,
) -> (Vec<f32>, Vec<f32>) {
    let mut exact = vec![0.0; rows * m.out];
    Cpu.matmul_q(x, m, rows, &mut exact);
    let x16: Vec<f32> = x.iter().map(|&v| f16r(v)).collect();
    let mut f16 = vec![0.0; rows * m.out];
    Cpu.matmul_q(&x16, &f16_weights(m), rows, &mut f16);
    (exact, f16)
}

/// The measure COOP_TOL bounds, on the CPU alone (runs everywhere): f16-rounded operands against
/// f32 ones at the model's inner widths, bits and group sizes.
#[test]
fn f16_operands_error_is_within_coop_tol() {
    let mut rng = Rng(57);
    // (out, inp, bits, group, rows).
    for (out, inp, bits, gs, rows) in [
        (512, 2048, 4, 64, 64),
        (256, 4096, 4, 64, 64),
        (256, 2048, 8, 64, 64),
        (512, 512, 4, 64, 64),
    ] {
        let m = rand_quant(&mut rng, 1, out, inp, bits, gs, false);
        let x = rng.vec(rows * inp, 1.0);
        let (exact, f16) = references(&m, &x, rows);
        let err = rel_rows(&f16, &exact, out);
        check(
            &format!("f16 operands {bits}-bit g{gs} [{out}, {inp}] (cpu)"),
            err,
            COOP_TOL / 2.0,
        );
    }
}

/// gemm_coop against the CPU's matmul: prefill's shapes at 2048 rows (in_proj-like 2048→8192,
/// the GDN in_proj's 2048→12352 with a ragged last block of outputs) and 300 rows (a ragged last
/// row block: 300 = 4·64 + 44) for 2048→8192 and out_proj-like 4096→2048; the 8-bit router and
/// shared-expert gate (256 and 1 outputs) at 129 and 65 rows; f32 scales in groups of 128, 32,
/// 16 and 8 (its smallest: a staged chunk of 8 in one group); outputs not a multiple of 4 (257:
/// no tile stored straight); and a matrix gemm_coop leaves to the old gemm (40 inputs: not a
/// multiple of its k step of 32; F32_TOL there).
#[test]
fn gemm_coop_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let r = g.report();
    if !r.coop16 {
        let msg = format!(
            "skipping gemm_coop: {} has no 16x16x16 f16>f32 cooperative matrices usable here \
             (configurations: [{}]; f16 {}, subgroups {}-{}, {} B workgroup memory)",
            r.name, r.coop, r.f16, r.subgroup_min, r.subgroup_max, r.workgroup_storage
        );
        if std::env::var("LILY_REQUIRE_COOP").as_deref() == Ok("1") {
            panic!("LILY_REQUIRE_COOP=1 but {msg}");
        }
        eprintln!("{msg}");
        return;
    }
    eprintln!("cooperative matrices: [{}]", r.coop);
    let mut rng = Rng(43);
    let mut failed: Vec<String> = Vec::new();
    // (out, inp, bits, group, f32 scales, rows).
    let cases: [(usize, usize, u32, usize, bool, usize); 13] = [
        (8192, 2048, 4, 64, false, 2048),
        (12352, 2048, 4, 64, false, 2048),
        (8192, 2048, 4, 64, false, 300),
        (2048, 4096, 4, 64, false, 300),
        (2048, 4096, 4, 64, false, 129),
        (256, 2048, 8, 64, false, 129),
        (1, 2048, 8, 64, false, 65),
        (257, 2048, 8, 64, false, 65),
        (300, 1024, 8, 128, true, 200),
        (131, 512, 4, 32, true, 300),
        (70, 256, 4, 16, false, 129),
        (40, 64, 4, 8, false, 100),
        (10, 40, 8, 4, false, 100),
    ];
    for (out, inp, bits, gs, f32s, rows) in cases {
        let m = rand_quant(&mut rng, 1, out, inp, bits, gs, f32s);
        let x = rng.vec(rows * inp, 1.0);
        let (exact, f16) = references(&m, &x, rows);
        let gm = g.upload_mat(&m).unwrap();
        let xg = g.upload(&x).unwrap();
        // coop: tiles staged as vec4<f16>; coop1: as f16 scalars (the fallback).
        for v in ["coop", "coop1"] {
            g.set_gemm(v).unwrap();
            let mut o = g.zeros(rows * out).unwrap();
            g.matmul_q(&xg, &gm, rows, &mut o);
            let got = h(&g, &o, rows * out);
            let what = format!(
                "gemm {v} {bits}-bit g{gs}{} [{out}, {inp}] rows {rows}",
                if f32s { " f32 scales" } else { "" }
            );
            // 40 inputs: not gemm_coop's (the old gemm, f32 throughout).
            let tol = if inp % 32 == 0 { COOP_TOL } else { F32_TOL };
            // The scale of a row's error is its largest output; a matrix of a few outputs (the
            // shared expert's gate: one) has no such scale in a row, whose one sum cancellation
            // can make small against its terms (H200, stop 32: 3.0e-3 of that one output, while
            // 1.5e-5 from the f16-operand reference): there, the largest output of all rows.
            let span = if out >= 8 { out } else { rows * out };
            let err = rel_rows(&got, &exact, span);
            println!(
                "{what:<58} max rel err {err:.2e}  (tol {tol:.0e})  vs f16 operands {:.2e}",
                rel_rows(&got, &f16, span)
            );
            // Every case of both variants runs before the verdict: one run on the GPU says
            // which of them work.
            if err.is_nan() || err > tol {
                failed.push(format!("{what}: error {err:e} above tolerance {tol:e}"));
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// naga writes gemm_coop's SPIR-V as wgpu-hal would (no device needed; runs everywhere): its
/// SPIR-V writer can fail where the validator passed (naga 30 panicked on expressions written
/// inside coopStore's arguments), which `shaders_validate_and_translate_to_msl` would not see
/// for a file it does not translate. The words go to target/wgsl-spv/ for `spirv-val
/// --target-env vulkan1.3` (SPIRV-Tools 2024 or later knows SPV_KHR_cooperative_matrix).
#[cfg(not(target_os = "macos"))]
#[test]
fn gemm_coop_translates_to_spirv() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/wgsl-spv");
    std::fs::create_dir_all(&dir).unwrap();
    // Vulkan 1.1, 1.2, 1.3 devices (wgpu-hal picks the version by the device's API).
    for (module, (maj, min)) in ["gemm_coop", "gemm_coop1"]
        .into_iter()
        .flat_map(|m| [(m, (1u8, 3u8)), (m, (1, 5)), (m, (1, 6))])
    {
        let (words, caps) = lily::backend::wgpu::stats::spirv_of(module, "gemm_coop", (maj, min))
            .expect("naga writes gemm_coop's SPIR-V");
        for c in ["CooperativeMatrixKHR", "VulkanMemoryModel", "Float16"] {
            assert!(
                caps.iter().any(|x| x == c),
                "{module} SPIR-V {maj}.{min}: no {c} capability in {caps:?}"
            );
        }
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        std::fs::write(dir.join(format!("{module}.spv{maj}{min}.spv")), bytes).unwrap();
        println!(
            "{module}: SPIR-V {maj}.{min}, {} words, capabilities {}",
            words.len(),
            caps.join(", ")
        );
    }
}
