//! Micro-benchmark of the CPU matmul (`backend::cpu::matmul`) on synthetic 4-bit matrices.
//!
//! `cargo bench -p lily-engine --bench matmul` (optionally `-- quick` for fewer repetitions).
//! Prints: memory read/copy bandwidth for comparison; GEMV GB/s of weight bytes read
//! (codes + scales + biases) for 2048×2048 and the lm_head-like 248320×1024; GEMM GFLOP/s at
//! rows = 512 for 4096×1024 and 512×1024; and the GEMV/GEMM crossover at small rows. Each with a
//! 1-thread and a 2-thread rayon pool. Times are the best of several runs (the steady state).

use std::time::Instant;

use lily::backend::cpu::matmul::{matmul_with, Path};
use lily::loader::tensor::{Floats, MatView, QuantView};
use rayon::prelude::*;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

struct Q {
    out: usize,
    inp: usize,
    w: Vec<u32>,
    s: Vec<u16>,
    b: Vec<u16>,
}
impl Q {
    fn new(out: usize, inp: usize) -> Self {
        let mut r = Rng(0x1234_5678_9ABC_DEF1 ^ (out * 31 + inp) as u64);
        let w = (0..out * inp / 8).map(|_| r.next() as u32).collect();
        let ng = out * inp / 64;
        let bf = |v: f32| half::bf16::from_f32(v).to_bits();
        let s: Vec<u16> = (0..ng).map(|_| bf(0.01 + 0.005 * r.f())).collect();
        let b = (0..ng).map(|_| bf(-0.08 + 0.01 * r.f())).collect();
        Q { out, inp, w, s, b }
    }
    fn view(&self) -> MatView<'_> {
        MatView::Quant(QuantView {
            out: self.out,
            inp: self.inp,
            bits: 4,
            group_size: 64,
            w: &self.w,
            scales: Floats::Bf16(&self.s),
            biases: Floats::Bf16(&self.b),
        })
    }
    fn bytes(&self) -> usize {
        self.w.len() * 4 + self.s.len() * 2 + self.b.len() * 2
    }
}

/// This thread's CPU time in seconds, if available: `clock_gettime(CLOCK_THREAD_CPUTIME_ID)`,
/// declared here because libc is linked by std anyway (no crate needed). Not
/// /proc/thread-self/schedstat: for the running thread that is only updated at scheduler ticks.
#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
fn thread_cpu() -> Option<f64> {
    #[repr(C)]
    struct Timespec {
        tv_sec: i64,
        tv_nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clk: i32, tp: *mut Timespec) -> i32;
    }
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut ts = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a plain libc call writing into a valid timespec.
    let rc = unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    (rc == 0).then(|| ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9)
}
#[cfg(not(all(target_os = "linux", target_pointer_width = "64")))]
fn thread_cpu() -> Option<f64> {
    None
}

/// Best wall time (s) of `f` over at least `reps` runs and ~`min_s` seconds, after a warm-up;
/// and the best CPU time of the calling thread (meaningful for 1-thread runs: it is immune to
/// other processes sharing the cores, which wall time is not).
fn best(reps: usize, min_s: f64, mut f: impl FnMut()) -> f64 {
    best2(reps, min_s, &mut f).0
}
fn best2(reps: usize, min_s: f64, mut f: impl FnMut()) -> (f64, f64) {
    // Warm up for ≥ 0.1 s, not one call: a fresh pool's first calls run measurably slower.
    let warm = Instant::now();
    f();
    while warm.elapsed().as_secs_f64() < 0.1 {
        f();
    }
    let start = Instant::now();
    let (mut best, mut best_cpu) = (f64::MAX, f64::MAX);
    let mut n = 0;
    while n < reps || start.elapsed().as_secs_f64() < min_s {
        let c = thread_cpu();
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
        if let (Some(c0), Some(c1)) = (c, thread_cpu()) {
            best_cpu = best_cpu.min(c1 - c0);
        }
        n += 1;
    }
    (best, best_cpu)
}

/// " (cpu: …)" for a 1-thread run, empty otherwise.
fn cpu_note(th: usize, cpu: f64, per_s: f64, unit: &str) -> String {
    if th == 1 && cpu < f64::MAX && cpu > 0.0 {
        format!("   [thread CPU time: {:.1} {unit}]", per_s / cpu)
    } else {
        String::new()
    }
}

fn pool(n: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build()
        .unwrap()
}

fn main() {
    let quick = std::env::args().any(|a| a == "quick");
    let (reps, min_s) = if quick { (3, 0.2) } else { (5, 1.0) };
    let threads = [1usize, 2];

    // Memory bandwidth: read (sum of u64 over 512 MiB, like a GEMV's weight stream) and copy.
    let n = 64 << 20; // u64s = 512 MiB
    let src: Vec<u64> = (0..n as u64).collect();
    let mut dst = vec![0u64; n];
    println!("== memory bandwidth (512 MiB buffers)");
    let mut read_bw = [0f64; 2];
    for (i, &th) in threads.iter().enumerate() {
        pool(th).install(|| {
            let t = best(reps, min_s, || {
                let s: u64 = src.par_chunks(n / th).map(|c| c.iter().fold(0u64, |a, &v| a.wrapping_add(v))).sum();
                std::hint::black_box(s);
            });
            read_bw[i] = (n * 8) as f64 / t / 1e9;
            let tc = best(reps, min_s, || {
                dst.par_chunks_mut(n / th).zip(src.par_chunks(n / th)).for_each(|(d, s)| d.copy_from_slice(s));
            });
            println!("  {th} thread(s): read {:6.2} GB/s   copy {:6.2} GB/s (bytes copied/s; read+write traffic is 2×)", read_bw[i], (n * 8) as f64 / tc / 1e9);
        });
    }
    drop(src);
    drop(dst);

    println!("== GEMV (rows = 1), 4-bit, bf16 scales: GB/s of weight bytes read");
    for (out, inp) in [(2048, 2048), (248320, 1024)] {
        let q = Q::new(out, inp);
        let x: Vec<f32> = (0..inp)
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5)
            .collect();
        let mut y = vec![0f32; out];
        for (i, &th) in threads.iter().enumerate() {
            pool(th).install(|| {
                let (t, c) = best2(reps * 4, min_s, || matmul_with(&x, 1, &q.view(), &mut y, Path::Auto));
                let gbs = q.bytes() as f64 / t / 1e9;
                println!(
                    "  {out:>6}×{inp:<5} {th} thread(s): {:9.1} µs  {gbs:6.2} GB/s  ({:.0}% of {th}-thread read bandwidth){}",
                    t * 1e6,
                    100.0 * gbs / read_bw[i],
                    cpu_note(th, c, q.bytes() as f64 / 1e9, "GB/s")
                );
            });
        }
    }

    println!("== GEMM (rows = 512), 4-bit, bf16 scales: GFLOP/s (2·rows·out·inp)");
    for (out, inp) in [(4096, 1024), (512, 1024), (512, 2048), (2048, 512)] {
        let q = Q::new(out, inp);
        let rows = 512;
        let x: Vec<f32> = (0..rows * inp)
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5)
            .collect();
        let mut y = vec![0f32; rows * out];
        for &th in &threads {
            pool(th).install(|| {
                let (t, c) = best2(reps, min_s, || matmul_with(&x, rows, &q.view(), &mut y, Path::Auto));
                let fl = 2.0 * (rows * out * inp) as f64 / 1e9;
                println!(
                    "  {out:>5}×{inp:<5} {th} thread(s): {:8.2} ms  {:6.1} GFLOP/s  ({:.1} per thread){}",
                    t * 1e3,
                    fl / t,
                    fl / t / th as f64,
                    cpu_note(th, c, fl, "GFLOP/s")
                );
            });
        }
    }

    println!("== crossover: 2048×2048 4-bit, 1 thread, µs per call (GEMV path vs GEMM path; thread CPU time)");
    let q = Q::new(2048, 2048);
    pool(1).install(|| {
        for rows in [1, 2, 4, 8, 12, 16, 32, 64] {
            let x: Vec<f32> = (0..rows * 2048).map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5).collect();
            let mut y = vec![0f32; rows * 2048];
            // Thread CPU time where available (inside `install` this is the 1-thread pool's
            // worker, which runs all the work): immune to other load on the machine.
            let (tv, cv) = best2(reps, min_s / 4.0, || matmul_with(&x, rows, &q.view(), &mut y, Path::Gemv));
            let (tm, cm) = best2(reps, min_s / 4.0, || matmul_with(&x, rows, &q.view(), &mut y, Path::Gemm));
            let (tv, tm) = if cv > 0.0 && cm > 0.0 && cv < f64::MAX && cm < f64::MAX { (cv, cm) } else { (tv, tm) };
            let fl = 2.0 * (rows * 2048 * 2048) as f64;
            println!(
                "  rows {rows:>3}: GEMV {:8.1} µs ({:5.1} GFLOP/s)   GEMM {:8.1} µs ({:5.1} GFLOP/s)",
                tv * 1e6,
                fl / tv / 1e9,
                tm * 1e6,
                fl / tm / 1e9
            );
        }
    });
}
