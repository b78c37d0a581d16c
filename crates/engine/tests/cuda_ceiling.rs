//! The CUDA backend's own ceilings (`Backend::measure_ceilings`, backend/cuda/ceiling.rs): copy
//! bandwidth and bf16 matrix rate are measured and must be plausible for any datacenter GPU. Built
//! only with `--features cuda`; skips with a message when no GPU is found (LILY_REQUIRE_CUDA=1 makes
//! that a failure). On an H200 expect about 4.2 TB/s (bytes read + written) and about 790 TFLOP/s
//! with cuBLAS (less with the mma.sync fallback, which the method line names).
#![cfg(feature = "cuda")]

mod common;

use lily::backend::Backend;

#[test]
fn ceilings_are_measured_and_plausible() {
    let Some(g) = common::gpu() else { return };
    let c = g
        .measure_ceilings()
        .expect("the CUDA backend measures its own ceilings")
        .expect("measuring the ceilings");
    eprintln!(
        "{}: copy {:.0} GB/s, bf16 matrix {:.1} TFLOP/s\n  {}",
        g.name(),
        c.bandwidth / 1e9,
        c.flops / 1e12,
        c.method
    );
    assert!(
        c.bandwidth.is_finite() && (100e9..20e12).contains(&c.bandwidth),
        "copy bandwidth {:.3e} B/s is implausible ({})",
        c.bandwidth,
        c.method
    );
    assert!(
        c.flops.is_finite() && (1e12..5e15).contains(&c.flops),
        "bf16 matrix rate {:.3e} FLOP/s is implausible ({})",
        c.flops,
        c.method
    );
    assert!(
        c.method.contains("copy:") && c.method.contains("matmul:"),
        "method line: {}",
        c.method
    );
    // The backend is still usable afterwards (the measurement leaves no sticky error behind).
    g.check().expect("backend healthy after measuring");
    let b = g.upload_vec(&[1.0, 2.0, 3.0]).unwrap();
    assert_eq!(g.to_host(&b, 3).unwrap(), vec![1.0, 2.0, 3.0]);
}
