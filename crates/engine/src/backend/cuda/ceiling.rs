//! The device's own ceilings for `lily bench` (`Backend::measure_ceilings`), measured on the
//! backend's stream and timed with CUDA events (warm-up, then the best of `REPS`).
//!
//! * Copy bandwidth: a device-to-device copy of a buffer of up to 4 GiB (far above the L2), counted
//!   as bytes read + written (2 × size / time). `cuMemcpyDtoDAsync` and our vectorised copy kernel
//!   (`ceiling_copy` in kernels/ceiling.cu) are both timed and the higher figure is taken.
//! * bf16 matrix rate: cuBLAS `cublasGemmEx`, 8192³, bf16 A/B/C, f32 compute, A transposed (the
//!   "TN" layout cuBLAS is fastest at), on pseudo-random operands (zeros draw less power and would
//!   clock higher). cuBLAS is loaded at first use (cudarc `dynamic-loading`) from the loader path,
//!   like NVRTC. Without cuBLAS the rate falls back to `ceiling_mma` (mma.sync m16n8k16 with operands
//!   in registers), which `method` says: that is the mma.sync issue rate, below what cuBLAS's
//!   Hopper (wgmma) kernels reach.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};

use anyhow::{anyhow, bail, Context, Result};
use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{result as dr, sys as drv_sys, CudaFunction};

use super::{Cuda, Mem};
use crate::backend::Ceilings;

/// Timed repetitions per figure (the best is kept: a ceiling).
const REPS: usize = 10;
const WARMUP: usize = 3;
/// Largest copy buffer (two are allocated).
const COPY_MAX: usize = 4 << 30;
/// Smallest copy buffer worth measuring: several times the H200's 50 MB L2.
const COPY_MIN: usize = 256 << 20;
/// GEMM side (square, bf16): 1.1 TFLOP per call, about 1.4 ms on an H200.
const GEMM_N: usize = 8192;
/// cuBLAS's major version: the soname cudarc asks for with `cuda-13000` (`libcublas.so.13`).
const CUBLAS_MAJOR: u32 = 13;
/// `ceiling_mma` launch: steps per thread and accumulator chains per warp (MMA_CHAINS in ceiling.cu).
const MMA_ITERS: i32 = 8192;
const MMA_CHAINS: u64 = 8;

impl Cuda {
    /// Copy bandwidth and bf16 matrix rate of this GPU, measured now (a second or so).
    pub fn measure_ceilings_now(&self) -> Result<Ceilings> {
        // A failed backend launches nothing: the timings would be of empty streams.
        self.check()
            .context("CUDA ceilings: the backend is in a failed state")?;
        let (bandwidth, copy) = self
            .measure_copy()
            .context("CUDA ceilings: measuring the copy bandwidth")?;
        let (flops, matmul) = self
            .measure_matmul()
            .context("CUDA ceilings: measuring the bf16 matrix rate")?;
        Ok(Ceilings {
            bandwidth,
            flops,
            method: format!("copy: {copy}; matmul: {matmul}"),
        })
    }

    fn measure_copy(&self) -> Result<(f64, String)> {
        let (free, _) = self.mem_info()?;
        // Two buffers in at most half of the free memory, whole MiBs of 16-byte words.
        let size = COPY_MAX.min(free / 4) & !((1 << 20) - 1);
        if size < COPY_MIN {
            bail!("{} MiB free on the device: too little for a copy well above the L2 ({} MiB needed)", free >> 20, (4 * COPY_MIN) >> 20);
        }
        let (src, dst) = (self.alloc(size)?, self.alloc(size)?);
        let stream = self.stream.cu_stream();
        let t_memcpy = self.time_best(|| {
            // SAFETY: both allocations hold `size` bytes and do not overlap.
            unsafe { dr::memcpy_dtod_async(dst.ptr, src.ptr, size, stream) }
                .context("cuMemcpyDtoDAsync")
        })?;
        let f = self.ceiling_fn("ceiling_copy")?;
        let blocks = 4 * self.sm_count()?; // 2048 threads per SM: one full wave
        let words = (size / 16) as u64;
        let t_kernel = self.time_best(|| {
            self.launch_raw(
                &f,
                "ceiling_copy",
                blocks,
                512,
                &mut [arg(&src.ptr), arg(&dst.ptr), arg(&words)],
            )
        })?;
        let bw = |t: f64| 2.0 * size as f64 / t;
        let (best, which) = if t_kernel < t_memcpy {
            (t_kernel, "copy kernel")
        } else {
            (t_memcpy, "cuMemcpyDtoD")
        };
        let gib = size as f64 / (1u64 << 30) as f64;
        let method = format!("{which} 2×{gib:.2} GiB (read + written), best of {REPS} [cuMemcpyDtoD {:.0} GB/s, copy kernel {:.0} GB/s]", bw(t_memcpy) / 1e9, bw(t_kernel) / 1e9);
        Ok((bw(best), method))
    }

    fn measure_matmul(&self) -> Result<(f64, String)> {
        let why = match load_cublas() {
            Ok(from) => {
                // cudarc panics on a missing symbol (e.g. an older cuBLAS found first): catch it.
                match catch_unwind(AssertUnwindSafe(|| self.cublas_gemm())) {
                    Ok(Ok(flops)) => {
                        return Ok((
                            flops,
                            format!(
                            "cuBLAS GemmEx bf16 {GEMM_N}³ TN, f32 compute, best of {REPS} ({from})"
                        ),
                        ))
                    }
                    Ok(Err(e)) => format!("cuBLAS failed: {e:#}"),
                    Err(p) => format!("cuBLAS panicked: {}", panic_text(&p)),
                }
            }
            Err(e) => e,
        };
        let flops = self
            .mma_rate()
            .with_context(|| format!("the mma.sync fallback (after: {why})"))?;
        Ok((flops, format!("mma.sync m16n8k16 bf16 issue rate, registers only, best of {REPS} (no cuBLAS GEMM: {why})")))
    }

    /// FLOP/s of cublasGemmEx at GEMM_N³ (bf16 in and out, f32 compute).
    fn cublas_gemm(&self) -> Result<f64> {
        let n = GEMM_N;
        let bytes = 2 * n * n;
        let (free, _) = self.mem_info()?;
        if free < 4 * bytes {
            bail!(
                "{} MiB free on the device, {} MiB needed for a {n}³ GEMM",
                free >> 20,
                (4 * bytes) >> 20
            );
        }
        let (a, b, c) = (self.alloc(bytes)?, self.alloc(bytes)?, self.alloc(bytes)?);
        self.fill_bf16(&a, 1)?;
        self.fill_bf16(&b, 2)?;
        self.ctx.bind_to_thread()?;
        let h = Handle(blas::create_handle().map_err(|e| anyhow!("cublasCreate: {e}"))?);
        // SAFETY: a live handle and the backend's live stream.
        unsafe { blas::set_stream(h.0, self.stream.cu_stream() as _) }
            .map_err(|e| anyhow!("cublasSetStream: {e}"))?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let ni = n as i32;
        let t = self.time_best(|| {
            // SAFETY: A, B, C hold n×n bf16 each; alpha/beta are host f32 (the default pointer
            // mode, and the scale type of CUBLAS_COMPUTE_32F).
            unsafe {
                blas::gemm_ex(
                    h.0,
                    blas_sys::cublasOperation_t::CUBLAS_OP_T,
                    blas_sys::cublasOperation_t::CUBLAS_OP_N,
                    ni,
                    ni,
                    ni,
                    &alpha as *const f32 as *const c_void,
                    a.ptr as *const c_void,
                    blas_sys::cudaDataType::CUDA_R_16BF,
                    ni,
                    b.ptr as *const c_void,
                    blas_sys::cudaDataType::CUDA_R_16BF,
                    ni,
                    &beta as *const f32 as *const c_void,
                    c.ptr as *mut c_void,
                    blas_sys::cudaDataType::CUDA_R_16BF,
                    ni,
                    blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| anyhow!("cublasGemmEx: {e}"))
        })?;
        Ok(2.0 * (n as f64).powi(3) / t)
    }

    /// FLOP/s of `ceiling_mma` over the whole GPU.
    fn mma_rate(&self) -> Result<f64> {
        let f = self.ceiling_fn("ceiling_mma")?;
        let blocks = 4 * self.sm_count()?;
        let threads = blocks as u64 * 256;
        let out = self.alloc(4 * threads as usize)?;
        let iters = MMA_ITERS;
        let t = self.time_best(|| {
            self.launch_raw(
                &f,
                "ceiling_mma",
                blocks,
                256,
                &mut [arg(&out.ptr), arg(&iters)],
            )
        })?;
        let mmas = threads / 32 * iters as u64 * MMA_CHAINS;
        Ok((mmas * 2 * 16 * 8 * 16) as f64 / t)
    }

    /// Pseudo-random bf16 values in [-1, 1) over all of `m`.
    fn fill_bf16(&self, m: &Mem, seed: u32) -> Result<()> {
        let f = self.ceiling_fn("ceiling_fill_bf16")?;
        let n = (m.bytes / 2) as u64;
        self.launch_raw(
            &f,
            "ceiling_fill_bf16",
            4 * self.sm_count()?,
            256,
            &mut [arg(&m.ptr), arg(&n), arg(&seed)],
        )
    }

    /// Seconds of the fastest of REPS runs of `f` (after WARMUP), between events on the stream.
    fn time_best(&self, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
        self.ctx.bind_to_thread()?;
        for _ in 0..WARMUP {
            f()?;
        }
        let timing = Some(drv_sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut best = f64::INFINITY;
        for _ in 0..REPS {
            let t0 = self.stream.record_event(timing)?;
            f()?;
            let t1 = self.stream.record_event(timing)?;
            // Waits for the work: an asynchronous fault surfaces here.
            best = best.min(t0.elapsed_ms(&t1).context("timing (a device error?)")? as f64 / 1e3);
        }
        if !(best.is_finite() && best > 0.0) {
            bail!("a measured time of {best} s");
        }
        Ok(best)
    }

    /// A kernel of ceiling.cu; looked up here (not with `func`) so that a missing file is this
    /// measurement's error rather than the backend's sticky one.
    fn ceiling_fn(&self, name: &str) -> Result<CudaFunction> {
        self.modules
            .iter()
            .find_map(|m| m.load_function(name).ok())
            .ok_or_else(|| {
                anyhow!(
                    "no kernel `{name}`: kernels/ceiling.cu is not among the compiled kernel files"
                )
            })
    }

    /// Launches `f` on the stream, returning its error (unlike `launch`, which keeps it).
    fn launch_raw(
        &self,
        f: &CudaFunction,
        name: &str,
        grid: u32,
        block: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        self.ctx.bind_to_thread()?;
        // SAFETY: every caller passes the arguments of the kernel's declaration in ceiling.cu, by
        // address of locals that outlive the (enqueue-only) call.
        unsafe {
            dr::launch_kernel(
                f.cu_function(),
                (grid, 1, 1),
                (block, 1, 1),
                0,
                self.stream.cu_stream(),
                args,
            )
        }
        .with_context(|| format!("launching {name}"))
    }

    fn sm_count(&self) -> Result<u32> {
        Ok(self
            .ctx
            .attribute(drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            .max(1) as u32)
    }
}

/// A cuBLAS handle, destroyed on every path out.
struct Handle(blas_sys::cublasHandle_t);

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: created by cublasCreate, destroyed once.
        let _ = unsafe { blas::destroy_handle(self.0) };
    }
}

/// A kernel argument: the address of its value (cuLaunchKernel's convention).
fn arg<T>(v: &T) -> *mut c_void {
    v as *const T as *mut c_void
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(no message)".into())
}

/// Whether cudarc can load cuBLAS (by soname, from the loader path: on the H200 image
/// `/usr/local/cuda/lib64`, which NVRTC needs on LD_LIBRARY_PATH anyway); says why not.
fn load_cublas() -> Result<String, String> {
    // SAFETY: probing opens and closes the library; no preconditions.
    if unsafe { blas_sys::is_culib_present() } {
        Ok("libcublas from the loader path".into())
    } else {
        Err(format!("libcublas.so.{CUBLAS_MAJOR} is not on the loader path (add the CUDA lib64 folder to LD_LIBRARY_PATH)"))
    }
}
