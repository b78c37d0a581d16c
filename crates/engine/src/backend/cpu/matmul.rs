//! The CPU matmul: `out = x · Wᵀ` with W an `[out, in]` matrix that is MLX affine-quantized
//! (4- or 8-bit) or dense (bf16 / f16 / f32).
//!
//! Layouts: `x` is row-major `[rows, inp]` f32, `out` row-major `[rows, out]` f32 (overwritten),
//! `out[t·n_out + o] = Σ_k x[t·inp + k] · W[o, k]`. A quantized W row is `inp·bits/32` u32 words
//! (4-bit: element `8j+i` is bits `[4i, 4i+4)` of word `j`; 8-bit: element `4j+i` is byte `i`),
//! with one `(scale, bias)` per group of `group_size` inputs: `W[o, k] = s·q + b`. The result must
//! match the dequantize-then-dot reference built on `MatView::row_f32` (see the tests), up to f32
//! rounding.
//!
//! Two SIMD paths (AVX2 + FMA + F16C, chosen at run time; everything else takes the portable
//! scalar path, which is also what non-x86 builds get):
//!
//! * GEMV (rows ≤ `GEMV_MAX_ROWS`: decode and tiny batches) streams the weights once; it is
//!   memory-bound. It never dequantizes: it uses `Σ_k (s·q_k + b)·x_k = s·Σ q_k x_k + b·Σ x_k` with
//!   the 64-block sums `Σ x_k` computed once per row of x. The codes are extracted without any
//!   shuffle: a 256-bit load holds 8 words (4-bit: one block of 64 codes), and `word & (0xF << 4i)`
//!   is code `8j+i` in lane `j` times `16^i`; the matching x values are put in that "slot order"
//!   and pre-scaled by `16^-i` once per call (exact: powers of two), so 8 codes cost one `and`,
//!   one `cvt` and one FMA per row of x. Up to 4 rows of x share each extracted code vector
//!   (more rows run in chunks of 4 over the same 4 weight rows, which are then in L1). A software
//!   prefetch 8 KiB ahead in the weight stream doubles the single-thread rate from DRAM.
//! * GEMM (prefill, rows > `GEMV_MAX_ROWS`) is compute-bound. x is packed once per call into
//!   16-row column blocks (`[k][16]`, k in slot order for quantized W); each task dequantizes a
//!   panel of `NP` output rows × `KC` inputs into an f32 tile (48 KiB, L2; `s·q + b` in slot
//!   order: one load per 8 words, an immediate shift + mask per 8 codes) and a 6×16
//!   register-blocked FMA micro-kernel (6 weight rows broadcast × 16 rows of x in two ymm) runs
//!   over it; the tile is reused by up to `MC` rows of x. A last block of ≤ 8 rows of x uses a
//!   12×8 kernel instead, so small batches (MoE experts get ~16 rows each) pay for what they use.
//!
//! Threading: rayon's global pool. GEMV splits the output rows into chunks; GEMM splits into
//! (output panel × x-row range) tasks. Work below a size threshold runs on the calling thread,
//! since a rayon dispatch costs more than a tiny matrix. Scratch is per task/thread and bounded
//! (the packed/permuted copy of x is the size of x).

use crate::loader::tensor::MatView;
use rayon::prelude::*;

/// Which implementation [`matmul_with`] runs. `Auto` is what [`matmul`] does; the others exist
/// so tests and benchmarks can force a path (a forced SIMD path still falls back to scalar when
/// the CPU or the format does not support it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    Auto,
    Scalar,
    Gemv,
    Gemm,
}

/// Above this many rows of x, the tiled GEMM beats the GEMV (measured: see benches/matmul.rs).
pub const GEMV_MAX_ROWS: usize = 8;

/// Weight bytes below which the work stays on the calling thread (a rayon dispatch costs a few µs).
const PAR_MIN_BYTES: usize = 128 << 10;

/// out[t*n_out + o] = Σ_k x[t*inp + k] · W[o, k]  for t < rows; x row-major [rows, inp] f32,
/// out row-major [rows, out] f32 (overwritten). W quantized (4- or 8-bit) or dense (bf16/f16/f32).
pub fn matmul(x: &[f32], rows: usize, w: &MatView, out: &mut [f32]) {
    matmul_with(x, rows, w, out, Path::Auto)
}

/// [`matmul`] with the implementation chosen by the caller (tests, benchmarks).
pub fn matmul_with(x: &[f32], rows: usize, w: &MatView, out: &mut [f32], path: Path) {
    let (n_out, inp) = (w.out(), w.inp());
    assert!(
        x.len() >= rows * inp,
        "matmul: x has {} values, {rows}×{inp} needed",
        x.len()
    );
    assert!(
        out.len() >= rows * n_out,
        "matmul: out has {} values, {rows}×{n_out} needed",
        out.len()
    );
    let (x, out) = (&x[..rows * inp], &mut out[..rows * n_out]);
    if rows == 0 || n_out == 0 {
        return;
    }
    match w {
        MatView::Quant(q) => {
            assert!(
                q.bits > 0 && 32 % q.bits == 0,
                "matmul: {}-bit codes not supported",
                q.bits
            );
            assert!(
                q.group_size > 0 && inp % q.group_size == 0,
                "matmul: inp {inp} not a multiple of group {}",
                q.group_size
            );
            assert!(
                q.w.len() >= n_out * inp * q.bits as usize / 32,
                "matmul: weight words too short"
            );
            let ng = n_out * inp / q.group_size;
            assert!(
                q.scales.len() >= ng && q.biases.len() >= ng,
                "matmul: scales/biases too short"
            );
        }
        MatView::Dense(d) => assert!(d.w.len() >= n_out * inp, "matmul: dense weight too short"),
    }
    if inp == 0 {
        out.fill(0.0);
        return;
    }
    if path != Path::Scalar && simd_supported(w) {
        #[cfg(target_arch = "x86_64")]
        {
            let gemm = match path {
                Path::Gemv => false,
                Path::Gemm => true,
                _ => rows > GEMV_MAX_ROWS,
            };
            // SAFETY: simd_supported checked avx2 + fma + f16c at run time; shapes asserted above.
            unsafe {
                if gemm {
                    x86::gemm(x, rows, w, out)
                } else {
                    match w {
                        MatView::Quant(q) => x86::gemv_quant(x, rows, q, out),
                        MatView::Dense(_) => x86::gemv_dense(x, rows, w, out),
                    }
                }
            }
            return;
        }
    }
    scalar::matmul(x, rows, w, out)
}

/// Whether the SIMD paths can run this matrix on this CPU.
fn simd_supported(w: &MatView) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let cpu = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        cpu && match w {
            // The SIMD kernels work in blocks of 64 inputs; a larger group that is a multiple of 64
            // simply repeats its scale over several blocks.
            MatView::Quant(q) => (q.bits == 4 || q.bits == 8) && q.group_size % 64 == 0,
            MatView::Dense(_) => true,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = w;
        false
    }
}

/// A raw output pointer shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: every task writes a disjoint set of elements (distinct output columns or tiles).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}
impl OutPtr {
    // A method, so closures capture the whole (Send) struct and not the raw field.
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Runs `f(0..n)`, on rayon's pool when `parallel` and more than one thread is available.
fn for_each_task(n: usize, parallel: bool, f: impl Fn(usize) + Sync + Send) {
    if parallel && n > 1 && rayon::current_num_threads() > 1 {
        (0..n).into_par_iter().for_each(f)
    } else {
        (0..n).for_each(f)
    }
}

/// Splits `n` output rows into chunks (a multiple of `align`) for `threads`: a few chunks per
/// thread so an uneven finish costs little. Returns (chunk, parallel).
fn split_rows(n: usize, bytes: usize, align: usize) -> (usize, bool) {
    let threads = rayon::current_num_threads();
    if threads <= 1 || bytes < PAR_MIN_BYTES || n < 2 * align {
        return (n, false);
    }
    let chunk = n.div_ceil(threads * 4).div_ceil(align) * align;
    (chunk.max(align), true)
}

/// The portable path: any bits dividing 32, any group size, any dense type. Correct first;
/// still uses the affine identity and splits the output rows over threads.
mod scalar {
    use super::*;

    pub fn matmul(x: &[f32], rows: usize, w: &MatView, out: &mut [f32]) {
        let (n_out, inp) = (w.out(), w.inp());
        let bytes = match w {
            MatView::Quant(q) => n_out * inp * q.bits as usize / 8,
            MatView::Dense(_) => n_out * inp * 2,
        };
        let (chunk, par) = split_rows(n_out, bytes * rows.min(8), 1);
        let optr = OutPtr(out.as_mut_ptr());
        // Group sums of x, once per row of x (affine identity).
        let gsums: Vec<f32> = match w {
            MatView::Quant(q) => x.chunks(q.group_size).map(|g| g.iter().sum()).collect(),
            MatView::Dense(_) => Vec::new(),
        };
        for_each_task(n_out.div_ceil(chunk), par, |c| {
            let (o0, o1) = (c * chunk, ((c + 1) * chunk).min(n_out));
            let o = optr.get();
            let mut row = vec![0f32; inp];
            for r in o0..o1 {
                match w {
                    MatView::Quant(q) => {
                        let (bits, gs) = (q.bits as usize, q.group_size);
                        let per = 32 / bits;
                        let mask = (1u32 << bits) - 1;
                        let ng = inp / gs;
                        // Codes of row r as f32 (q, not s·q + b).
                        let words = &q.w[r * inp / per..(r + 1) * inp / per];
                        for (k, d) in row.iter_mut().enumerate() {
                            *d = ((words[k / per] >> ((k % per) * bits)) & mask) as f32;
                        }
                        for t in 0..rows {
                            let xt = &x[t * inp..(t + 1) * inp];
                            let mut acc = 0f32;
                            for g in 0..ng {
                                let dq: f32 = row[g * gs..(g + 1) * gs]
                                    .iter()
                                    .zip(&xt[g * gs..(g + 1) * gs])
                                    .map(|(a, b)| a * b)
                                    .sum();
                                acc += q.scales.get(r * ng + g) * dq
                                    + q.biases.get(r * ng + g) * gsums[t * ng + g];
                            }
                            // SAFETY: (t, r) is owned by this task (r in its chunk).
                            unsafe { *o.add(t * n_out + r) = acc };
                        }
                    }
                    MatView::Dense(_) => {
                        w.row_f32(r, &mut row);
                        for t in 0..rows {
                            let acc: f32 = row
                                .iter()
                                .zip(&x[t * inp..(t + 1) * inp])
                                .map(|(a, b)| a * b)
                                .sum();
                            // SAFETY: as above.
                            unsafe { *o.add(t * n_out + r) = acc };
                        }
                    }
                }
            }
        });
    }
}

#[cfg(target_arch = "x86_64")]
// The kernels index register-blocked accumulator arrays by (row, x-row) on purpose, and take
// raw pointers + strides rather than structs so everything stays in registers.
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
mod x86 {
    use super::*;
    use crate::loader::tensor::{bf16_to_f32, DenseView, Floats, QuantView};
    use std::arch::x86_64::*;
    use std::cell::RefCell;

    // ---------------------------------------------------------------- helpers

    /// Copies `n` floats from `f[start..]` into `dst`, each repeated `rep` times (a group of 64·rep
    /// inputs becomes `rep` blocks of 64). Tight per-type loops (inlined into the SIMD callers so
    /// they vectorize with AVX2): this runs once per block of weight rows.
    #[inline(always)]
    fn expand_floats(f: Floats, start: usize, n: usize, rep: usize, dst: &mut [f32]) {
        let dst = &mut dst[..n * rep];
        match (f, rep) {
            (Floats::F32(v), 1) => dst.copy_from_slice(&v[start..start + n]),
            (Floats::Bf16(v), 1) => dst
                .iter_mut()
                .zip(&v[start..start + n])
                .for_each(|(d, &s)| *d = bf16_to_f32(s)),
            _ => {
                for i in 0..n {
                    let v = f.get(start + i);
                    dst[i * rep..(i + 1) * rep].fill(v);
                }
            }
        }
    }

    /// Scales and biases of rows `o..o+n` as one f32 per 64-input block (`n·inp/64` each; the
    /// rows are contiguous in the source, so this is one pass).
    #[inline(always)]
    fn rows_affine(q: &QuantView, o: usize, n: usize, s: &mut [f32], b: &mut [f32]) {
        let gpr = q.inp / q.group_size;
        let rep = q.group_size / 64;
        expand_floats(q.scales, o * gpr, n * gpr, rep, s);
        expand_floats(q.biases, o * gpr, n * gpr, rep, b);
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot(a: *const f32, b: *const f32, n: usize) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i + 8 <= n {
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), acc);
            i += 8;
        }
        let mut s = hsum(acc);
        while i < n {
            s += *a.add(i) * *b.add(i);
            i += 1;
        }
        s
    }

    /// Dense element types, as a const parameter so the loads are resolved at compile time.
    const F32: u8 = 0;
    const BF16: u8 = 1;
    const F16: u8 = 2;

    /// 8 consecutive dense elements `p[i..i+8]` as f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8<const DT: u8>(p: *const u8, i: usize) -> __m256 {
        match DT {
            F32 => _mm256_loadu_ps((p as *const f32).add(i)),
            BF16 => {
                let h = _mm_loadu_si128((p as *const u16).add(i) as *const __m128i);
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            }
            _ => _mm256_cvtph_ps(_mm_loadu_si128((p as *const u16).add(i) as *const __m128i)),
        }
    }

    #[inline]
    unsafe fn load1<const DT: u8>(p: *const u8, i: usize) -> f32 {
        match DT {
            F32 => *(p as *const f32).add(i),
            BF16 => bf16_to_f32(*(p as *const u16).add(i)),
            _ => half::f16::from_bits(*(p as *const u16).add(i)).to_f32(),
        }
    }

    fn dense_parts(d: &DenseView) -> (u8, *const u8) {
        match d.w {
            Floats::F32(v) => (F32, v.as_ptr() as *const u8),
            Floats::Bf16(v) => (BF16, v.as_ptr() as *const u8),
            Floats::F16(v) => (F16, v.as_ptr() as *const u8),
        }
    }

    // ---------------------------------------------------------------- GEMV, quantized

    /// Slot order of a 64-block: position `p = 8·slot + j` holds element `slot_elem(bits, p)`,
    /// so that lane `j` of a 256-bit load of the block's words, shifted and masked for `slot`,
    /// is that element's code:
    /// 4-bit: slot i = nibble i of words 0..8 → element 8j+i;
    /// 8-bit: slot 4h+i = byte i of words 8h..8h+8 → element 4(8h+j)+i.
    #[inline]
    fn slot_elem(bits: u32, p: usize) -> usize {
        let (slot, j) = (p / 8, p % 8);
        if bits == 4 {
            8 * j + slot
        } else {
            4 * (8 * (slot / 4) + j) + slot % 4
        }
    }

    /// x row in slot order and pre-scaled for the shift-free code extraction of the GEMV kernel,
    /// plus its 64-block sums. The GEMV masks without shifting (`word & (mask << b·i)` is the
    /// code times 2^(b·i)), so slot i (but the last, which is shifted down) is pre-scaled by
    /// 2^-(b·i); these are powers of two, so `(q·2^e)·(x·2^-e)` rounds exactly like `q·x`.
    fn prep_x(bits: u32, x: &[f32], xp: &mut [f32], xs: &mut [f32]) {
        let spv = 32 / bits as usize; // slots per word vector
        for (g, xg) in x.chunks_exact(64).enumerate() {
            xs[g] = xg.iter().sum();
            for p in 0..64 {
                let i = (p / 8) % spv;
                let sc = if i + 1 == spv {
                    1.0
                } else {
                    (-((bits as usize * i) as f32)).exp2()
                };
                xp[g * 64 + p] = xg[slot_elem(bits, p)] * sc;
            }
        }
    }

    /// R weight rows × T rows of x, whole inp. `A` accumulators per (row, x-row) split the FMA
    /// chain when there are few (R·T) of them. Per 64-block: the code·x dot in `acc` (fresh each
    /// block, so consecutive blocks overlap in the out-of-order window), then `tot += s·acc`; the
    /// bias part `Σ_g b_g·xs_g` is one short dot at the end.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn gemv_q_kern<const B: u32, const R: usize, const T: usize, const A: usize>(
        w: *const u32,
        wpr: usize,
        s: *const f32,
        b: *const f32,
        nb: usize,
        xp: *const f32,
        xs: *const f32,
        inp: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        let wpb = 2 * B as usize; // words per 64-block
        let vpb = B as usize / 4; // 256-bit word vectors per block
        let spv = 32 / B as usize; // code slots per word vector
        let mut tot = [[_mm256_setzero_ps(); T]; R];
        for g in 0..nb {
            let mut acc = [[[_mm256_setzero_ps(); A]; T]; R];
            for vi in 0..vpb {
                let mut v = [_mm256_setzero_si256(); R];
                for (r, vr) in v.iter_mut().enumerate() {
                    *vr = _mm256_loadu_si256(w.add(r * wpr + g * wpb + vi * 8) as *const __m256i);
                }
                for i in 0..spv {
                    let slot = vi * spv + i;
                    let mut d = [_mm256_setzero_ps(); R];
                    for r in 0..R {
                        let c = if i + 1 == spv {
                            if B == 4 {
                                _mm256_srli_epi32::<28>(v[r])
                            } else {
                                _mm256_srli_epi32::<24>(v[r])
                            }
                        } else {
                            _mm256_and_si256(
                                v[r],
                                _mm256_set1_epi32((((1u32 << B) - 1) << (B as usize * i)) as i32),
                            )
                        };
                        d[r] = _mm256_cvtepi32_ps(c);
                    }
                    for t in 0..T {
                        let xv = _mm256_loadu_ps(xp.add(t * inp + g * 64 + slot * 8));
                        for r in 0..R {
                            acc[r][t][slot % A] = _mm256_fmadd_ps(d[r], xv, acc[r][t][slot % A]);
                        }
                    }
                }
            }
            for r in 0..R {
                let sv = _mm256_broadcast_ss(&*s.add(r * nb + g));
                for t in 0..T {
                    let mut a = acc[r][t][0];
                    for j in 1..A {
                        a = _mm256_add_ps(a, acc[r][t][j]);
                    }
                    tot[r][t] = _mm256_fmadd_ps(sv, a, tot[r][t]);
                }
            }
        }
        for r in 0..R {
            for t in 0..T {
                *out.add(t * ldo + r) = hsum(tot[r][t]) + dot(b.add(r * nb), xs.add(t * nb), nb);
            }
        }
    }

    /// The multi-row variant: R weight rows × T (≥ 2) rows of x. The scale is folded into the
    /// code vector once (`d = cvt(code)·s`, shared by the T rows), so the R·T accumulators run
    /// across blocks: no per-block reduction and no second set of registers, which lets R·T = 8.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn gemv_q_kern_ps<const B: u32, const R: usize, const T: usize>(
        w: *const u32,
        wpr: usize,
        s: *const f32,
        b: *const f32,
        nb: usize,
        xp: *const f32,
        xs: *const f32,
        inp: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        let wpb = 2 * B as usize;
        let vpb = B as usize / 4;
        let spv = 32 / B as usize;
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        for g in 0..nb {
            let mut sv = [_mm256_setzero_ps(); R];
            for (r, v) in sv.iter_mut().enumerate() {
                *v = _mm256_broadcast_ss(&*s.add(r * nb + g));
            }
            for vi in 0..vpb {
                let mut v = [_mm256_setzero_si256(); R];
                for (r, vr) in v.iter_mut().enumerate() {
                    *vr = _mm256_loadu_si256(w.add(r * wpr + g * wpb + vi * 8) as *const __m256i);
                }
                for i in 0..spv {
                    let slot = vi * spv + i;
                    let mut d = [_mm256_setzero_ps(); R];
                    for r in 0..R {
                        let c = if i + 1 == spv {
                            if B == 4 {
                                _mm256_srli_epi32::<28>(v[r])
                            } else {
                                _mm256_srli_epi32::<24>(v[r])
                            }
                        } else {
                            _mm256_and_si256(
                                v[r],
                                _mm256_set1_epi32((((1u32 << B) - 1) << (B as usize * i)) as i32),
                            )
                        };
                        d[r] = _mm256_mul_ps(_mm256_cvtepi32_ps(c), sv[r]);
                    }
                    for t in 0..T {
                        let xv = _mm256_loadu_ps(xp.add(t * inp + g * 64 + slot * 8));
                        for r in 0..R {
                            acc[r][t] = _mm256_fmadd_ps(d[r], xv, acc[r][t]);
                        }
                    }
                }
            }
        }
        for r in 0..R {
            for t in 0..T {
                *out.add(t * ldo + r) = hsum(acc[r][t]) + dot(b.add(r * nb), xs.add(t * nb), nb);
            }
        }
    }

    /// `nr` (≤ 4) weight rows × T (≤ 4) rows of x. The blockings were chosen by measurement
    /// (benches/matmul.rs, 2048×2048): R·T·A ≥ 4 independent FMA chains, ≤ 16 ymm registers.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn gemv_q_block<const B: u32, const T: usize>(
        nr: usize,
        w: *const u32,
        wpr: usize,
        s: *const f32,
        b: *const f32,
        nb: usize,
        xp: *const f32,
        xs: *const f32,
        inp: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        macro_rules! k {
            ($R:literal, $A:literal, $r:expr) => {
                gemv_q_kern::<B, $R, T, $A>(
                    w.add($r * wpr),
                    wpr,
                    s.add($r * nb),
                    b.add($r * nb),
                    nb,
                    xp,
                    xs,
                    inp,
                    out.add($r),
                    ldo,
                )
            };
        }
        macro_rules! kp {
            ($R:literal, $r:expr) => {
                gemv_q_kern_ps::<B, $R, T>(
                    w.add($r * wpr),
                    wpr,
                    s.add($r * nb),
                    b.add($r * nb),
                    nb,
                    xp,
                    xs,
                    inp,
                    out.add($r),
                    ldo,
                )
            };
        }
        let mut r = 0;
        match T {
            1 => {
                if nr == 4 {
                    k!(4, 2, 0);
                    r = 4;
                }
                while r < nr {
                    k!(1, 2, r);
                    r += 1;
                }
            }
            2 | 3 => {
                while r + 2 <= nr {
                    if T == 2 {
                        k!(2, 2, r)
                    } else {
                        k!(2, 1, r)
                    }
                    r += 2;
                }
                if r < nr {
                    k!(1, 2, r)
                }
            }
            _ => {
                while r + 2 <= nr {
                    kp!(2, r);
                    r += 2;
                }
                if r < nr {
                    kp!(1, r)
                }
            }
        }
    }

    /// Prefetch distance of the GEMV weight stream (4–16 KiB measured about equal; 0 is 2× slower).
    const PF_BYTES: usize = 8192;
    /// Output rows `o0..o1`, all rows of x, in blocks of 4 weight rows whose words stay in L1
    /// while every ≤4-row chunk of x passes over them (more rows per chunk would spill registers).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn gemv_q_range(
        q: &QuantView,
        o0: usize,
        o1: usize,
        xp: &[f32],
        xs: &[f32],
        rows: usize,
        out: *mut f32,
    ) {
        let (inp, n_out) = (q.inp, q.out);
        let nb = inp / 64;
        let wpr = inp * q.bits as usize / 32;
        let mut sb = vec![0f32; 8 * nb];
        let (sbuf, bbuf) = sb.split_at_mut(4 * nb);
        let mut o = o0;
        while o < o1 {
            let nr = (o1 - o).min(4);
            rows_affine(q, o, nr, sbuf, bbuf);
            let w = q.w.as_ptr().add(o * wpr);
            {
                // Software prefetch PF_BYTES ahead in this task's weight stream: the hardware
                // prefetcher alone keeps too few DRAM misses in flight (measured 3.4 → 7.8 GB/s
                // on one thread for a 127 MB matrix).
                let end = q.w.as_ptr().add(o1 * wpr) as usize;
                let mut a = w as usize + PF_BYTES;
                let stop = (a + nr * wpr * 4).min(end);
                while a < stop {
                    _mm_prefetch::<_MM_HINT_T0>(a as *const i8);
                    a += 64;
                }
            }
            let mut t = 0;
            while t < rows {
                let tn = (rows - t).min(4);
                let (xpt, xst, ot) = (
                    xp.as_ptr().add(t * inp),
                    xs.as_ptr().add(t * nb),
                    out.add(t * n_out + o),
                );
                macro_rules! go {
                    ($B:literal) => {
                        match tn {
                            1 => gemv_q_block::<$B, 1>(
                                nr,
                                w,
                                wpr,
                                sbuf.as_ptr(),
                                bbuf.as_ptr(),
                                nb,
                                xpt,
                                xst,
                                inp,
                                ot,
                                n_out,
                            ),
                            2 => gemv_q_block::<$B, 2>(
                                nr,
                                w,
                                wpr,
                                sbuf.as_ptr(),
                                bbuf.as_ptr(),
                                nb,
                                xpt,
                                xst,
                                inp,
                                ot,
                                n_out,
                            ),
                            3 => gemv_q_block::<$B, 3>(
                                nr,
                                w,
                                wpr,
                                sbuf.as_ptr(),
                                bbuf.as_ptr(),
                                nb,
                                xpt,
                                xst,
                                inp,
                                ot,
                                n_out,
                            ),
                            _ => gemv_q_block::<$B, 4>(
                                nr,
                                w,
                                wpr,
                                sbuf.as_ptr(),
                                bbuf.as_ptr(),
                                nb,
                                xpt,
                                xst,
                                inp,
                                ot,
                                n_out,
                            ),
                        }
                    };
                }
                if q.bits == 4 {
                    go!(4)
                } else {
                    go!(8)
                }
                t += tn;
            }
            o += nr;
        }
    }

    /// # Safety
    /// avx2, fma and f16c are available; bits ∈ {4, 8}, group_size % 64 == 0; shapes checked.
    pub unsafe fn gemv_quant(x: &[f32], rows: usize, q: &QuantView, out: &mut [f32]) {
        let inp = q.inp;
        let nb = inp / 64;
        let mut xp = vec![0f32; rows * inp];
        let mut xs = vec![0f32; rows * nb];
        for t in 0..rows {
            prep_x(
                q.bits,
                &x[t * inp..(t + 1) * inp],
                &mut xp[t * inp..(t + 1) * inp],
                &mut xs[t * nb..(t + 1) * nb],
            );
        }
        let bytes = q.out * inp * q.bits as usize / 8;
        let (chunk, par) = split_rows(q.out, bytes, 16);
        let optr = OutPtr(out.as_mut_ptr());
        for_each_task(q.out.div_ceil(chunk), par, |c| {
            let o0 = c * chunk;
            // SAFETY: task c writes only output columns o0..o1 (of every row of x).
            unsafe { gemv_q_range(q, o0, (o0 + chunk).min(q.out), &xp, &xs, rows, optr.get()) }
        });
    }

    // ---------------------------------------------------------------- GEMV, dense

    /// R weight rows × T rows of x over the whole (any) inp; natural x order.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn gemv_d_kern<const DT: u8, const R: usize, const T: usize>(
        w: *const u8,
        o: usize,
        inp: usize,
        x: *const f32,
        out: *mut f32,
        ldo: usize,
    ) {
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let mut k = 0;
        while k + 8 <= inp {
            let mut wv = [_mm256_setzero_ps(); R];
            for (r, v) in wv.iter_mut().enumerate() {
                *v = load8::<DT>(w, (o + r) * inp + k);
            }
            for t in 0..T {
                let xv = _mm256_loadu_ps(x.add(t * inp + k));
                for r in 0..R {
                    acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
                }
            }
            k += 8;
        }
        for r in 0..R {
            for t in 0..T {
                let mut s = hsum(acc[r][t]);
                for kk in k..inp {
                    s += load1::<DT>(w, (o + r) * inp + kk) * *x.add(t * inp + kk);
                }
                *out.add(t * ldo + o + r) = s;
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn gemv_d_range<const DT: u8>(
        w: *const u8,
        o0: usize,
        o1: usize,
        inp: usize,
        n_out: usize,
        x: &[f32],
        rows: usize,
        out: *mut f32,
    ) {
        let esz = if DT == F32 { 4 } else { 2 };
        let end = w as usize + o1 * inp * esz;
        let mut o = o0;
        while o < o1 {
            let nr = (o1 - o).min(4);
            // Software prefetch, as in gemv_q_range.
            let mut a = w as usize + o * inp * esz + PF_BYTES;
            let stop = (a + nr * inp * esz).min(end);
            while a < stop {
                _mm_prefetch::<_MM_HINT_T0>(a as *const i8);
                a += 64;
            }
            let mut t = 0;
            while t < rows {
                let tn = (rows - t).min(4);
                let (xt, ot) = (x.as_ptr().add(t * inp), out.add(t * n_out));
                macro_rules! k {
                    ($R:literal, $T:literal) => {{
                        let mut r = 0;
                        while r + $R <= nr {
                            gemv_d_kern::<DT, $R, $T>(w, o + r, inp, xt, ot, n_out);
                            r += $R;
                        }
                        while r < nr {
                            gemv_d_kern::<DT, 1, $T>(w, o + r, inp, xt, ot, n_out);
                            r += 1;
                        }
                    }};
                }
                match tn {
                    1 => k!(4, 1),
                    2 => k!(4, 2),
                    3 => k!(2, 3),
                    _ => k!(2, 4),
                }
                t += tn;
            }
            o += nr;
        }
    }

    /// # Safety
    /// avx2, fma and f16c are available; `w` is dense; shapes checked.
    pub unsafe fn gemv_dense(x: &[f32], rows: usize, w: &MatView, out: &mut [f32]) {
        let MatView::Dense(d) = w else { unreachable!() };
        let (dt, wp) = dense_parts(d);
        let (n_out, inp) = (d.out, d.inp);
        let bytes = n_out * inp * if dt == F32 { 4 } else { 2 };
        let (chunk, par) = split_rows(n_out, bytes, 16);
        let optr = OutPtr(out.as_mut_ptr());
        let wp = wp as usize; // a usize, so the closure is Send
        for_each_task(n_out.div_ceil(chunk), par, |c| {
            let (o0, o1) = (c * chunk, ((c + 1) * chunk).min(n_out));
            let wp = wp as *const u8;
            // SAFETY: task c writes only output columns o0..o1.
            unsafe {
                match dt {
                    F32 => gemv_d_range::<F32>(wp, o0, o1, inp, n_out, x, rows, optr.get()),
                    BF16 => gemv_d_range::<BF16>(wp, o0, o1, inp, n_out, x, rows, optr.get()),
                    _ => gemv_d_range::<F16>(wp, o0, o1, inp, n_out, x, rows, optr.get()),
                }
            }
        });
    }

    // ---------------------------------------------------------------- GEMM

    /// Micro-kernel: 6 weight rows (broadcast) × 16 rows of x (two ymm).
    const MR: usize = 6;
    const NR: usize = 16;
    /// Inputs per tile: a packed x block `KC×16` f32 is 16 KiB and stays in L1 while the 8
    /// micro-kernels of a panel run over it.
    const KC: usize = 256;
    /// Output rows per panel (a multiple of 2·MR): the dequantized tile `NP×KC` is 48 KiB (L2).
    const NP: usize = 48;
    /// Rows of x per task (a multiple of NR): the tile is dequantized once per MC rows of x.
    const MC: usize = 256;

    /// 64-byte aligned f32 storage (whole cache lines for the packed blocks and tiles).
    #[derive(Clone, Copy)]
    #[repr(C, align(64))]
    struct Line([f32; 16]);

    fn lines(n_f32: usize) -> Vec<Line> {
        vec![Line([0.0; 16]); n_f32.div_ceil(16)]
    }

    thread_local! {
        /// Per-thread GEMM scratch: the tile `NP×KC` then the transposed output block `NP×MC`.
        static SCRATCH: RefCell<Vec<Line>> = RefCell::new(lines(NP * KC + NP * MC));
    }

    /// c[r][0..16] (+)= Σ_k w[r][k] · xb[k][0..16] for r < 6.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn kern_6x16(
        w: *const f32,
        ldw: usize,
        xb: *const f32,
        kcl: usize,
        c: *mut f32,
        ldc: usize,
        first: bool,
    ) {
        let mut acc = [[_mm256_setzero_ps(); 2]; MR];
        let (w0, w1, w2, w3, w4, w5) = (
            w,
            w.add(ldw),
            w.add(2 * ldw),
            w.add(3 * ldw),
            w.add(4 * ldw),
            w.add(5 * ldw),
        );
        let mut xb = xb;
        for k in 0..kcl {
            let x0 = _mm256_load_ps(xb);
            let x1 = _mm256_load_ps(xb.add(8));
            xb = xb.add(NR);
            macro_rules! row {
                ($r:expr, $p:expr) => {
                    let b = _mm256_broadcast_ss(&*$p.add(k));
                    acc[$r][0] = _mm256_fmadd_ps(b, x0, acc[$r][0]);
                    acc[$r][1] = _mm256_fmadd_ps(b, x1, acc[$r][1]);
                };
            }
            row!(0, w0);
            row!(1, w1);
            row!(2, w2);
            row!(3, w3);
            row!(4, w4);
            row!(5, w5);
        }
        for (r, a) in acc.iter().enumerate() {
            for (j, v) in a.iter().enumerate() {
                let p = c.add(r * ldc + j * 8);
                if first {
                    _mm256_storeu_ps(p, *v);
                } else {
                    _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), *v));
                }
            }
        }
    }

    /// The narrow variant for an x block with ≤ 8 valid rows: 12 weight rows × 8 rows of x
    /// (the first half of each 16-wide packed row), still 12 accumulators, so a partial block
    /// does not pay for 16 rows.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn kern_12x8(
        w: *const f32,
        ldw: usize,
        xb: *const f32,
        kcl: usize,
        c: *mut f32,
        ldc: usize,
        first: bool,
    ) {
        let mut acc = [_mm256_setzero_ps(); 12];
        let mut xb = xb;
        for k in 0..kcl {
            let x0 = _mm256_load_ps(xb);
            xb = xb.add(NR);
            for (r, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(_mm256_broadcast_ss(&*w.add(r * ldw + k)), x0, *a);
            }
        }
        for (r, v) in acc.iter().enumerate() {
            let p = c.add(r * ldc);
            if first {
                _mm256_storeu_ps(p, *v);
            } else {
                _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), *v));
            }
        }
    }

    /// Dequantizes W[o, k0..k0+n] into `dst`: quantized rows in slot order (see `slot_elem`;
    /// n a multiple of 64), dense rows in natural order. Slot order lets one 256-bit load feed 8
    /// slots with an immediate shift + mask each, instead of a broadcast + variable shift per word.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dequant_seg(w: &MatView, o: usize, k0: usize, n: usize, dst: *mut f32) {
        match w {
            MatView::Quant(q) => {
                let wpr = q.inp * q.bits as usize / 32;
                let gpr = q.inp / q.group_size;
                let words = q.w.as_ptr().add(o * wpr);
                for blk in 0..n / 64 {
                    let k = k0 + blk * 64;
                    let g = o * gpr + k / q.group_size;
                    let sv = _mm256_set1_ps(q.scales.get(g));
                    let bv = _mm256_set1_ps(q.biases.get(g));
                    let d = dst.add(blk * 64);
                    macro_rules! slot {
                        ($slot:expr, $c:expr) => {
                            _mm256_storeu_ps(
                                d.add($slot * 8),
                                _mm256_fmadd_ps(_mm256_cvtepi32_ps($c), sv, bv),
                            )
                        };
                    }
                    if q.bits == 4 {
                        let v = _mm256_loadu_si256(words.add(k / 8) as *const __m256i);
                        let m = _mm256_set1_epi32(0xF);
                        slot!(0, _mm256_and_si256(v, m));
                        slot!(1, _mm256_and_si256(_mm256_srli_epi32::<4>(v), m));
                        slot!(2, _mm256_and_si256(_mm256_srli_epi32::<8>(v), m));
                        slot!(3, _mm256_and_si256(_mm256_srli_epi32::<12>(v), m));
                        slot!(4, _mm256_and_si256(_mm256_srli_epi32::<16>(v), m));
                        slot!(5, _mm256_and_si256(_mm256_srli_epi32::<20>(v), m));
                        slot!(6, _mm256_and_si256(_mm256_srli_epi32::<24>(v), m));
                        slot!(7, _mm256_srli_epi32::<28>(v));
                    } else {
                        let m = _mm256_set1_epi32(0xFF);
                        for h in 0..2 {
                            let v = _mm256_loadu_si256(words.add(k / 4 + h * 8) as *const __m256i);
                            slot!(4 * h, _mm256_and_si256(v, m));
                            slot!(4 * h + 1, _mm256_and_si256(_mm256_srli_epi32::<8>(v), m));
                            slot!(4 * h + 2, _mm256_and_si256(_mm256_srli_epi32::<16>(v), m));
                            slot!(4 * h + 3, _mm256_srli_epi32::<24>(v));
                        }
                    }
                }
            }
            MatView::Dense(dv) => {
                let (dt, wp) = dense_parts(dv);
                let base = o * dv.inp + k0;
                macro_rules! conv {
                    ($DT:expr) => {{
                        let mut i = 0;
                        while i + 8 <= n {
                            _mm256_storeu_ps(dst.add(i), load8::<$DT>(wp, base + i));
                            i += 8;
                        }
                        while i < n {
                            *dst.add(i) = load1::<$DT>(wp, base + i);
                            i += 1;
                        }
                    }};
                }
                match dt {
                    F32 => conv!(F32),
                    BF16 => conv!(BF16),
                    _ => conv!(F16),
                }
            }
        }
    }

    /// One task: output rows `p·NP..` (≤ NP of them) × rows of x `tr·MC..` (≤ MC).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn gemm_task(
        w: &MatView,
        p: usize,
        tr: usize,
        xt: *const f32,
        rows: usize,
        out: *mut f32,
        scratch: &mut [Line],
    ) {
        let (n_out, inp) = (w.out(), w.inp());
        let wt = scratch.as_mut_ptr() as *mut f32;
        let ct = wt.add(NP * KC);
        let o0 = p * NP;
        let np = NP.min(n_out - o0);
        // Rows of the tile, zero-padded to a multiple of 12 (both micro-kernels' heights divide it).
        let npad = np.div_ceil(2 * MR) * 2 * MR;
        let t0 = tr * MC;
        let tl = MC.min(rows - t0);
        let tpad = tl.div_ceil(NR) * NR;
        // Padding rows of the tile are zero (never written by dequant_seg below).
        std::ptr::write_bytes(wt.add(np * KC), 0, (npad - np) * KC);
        let mut k0 = 0;
        while k0 < inp {
            let kcl = KC.min(inp - k0);
            for r in 0..np {
                dequant_seg(w, o0 + r, k0, kcl, wt.add(r * KC));
            }
            for tb in (0..tpad).step_by(NR) {
                let xb = xt.add(((t0 + tb) / NR) * inp * NR + k0 * NR);
                if tl - tb <= NR / 2 {
                    for rb in (0..npad).step_by(2 * MR) {
                        kern_12x8(
                            wt.add(rb * KC),
                            KC,
                            xb,
                            kcl,
                            ct.add(rb * MC + tb),
                            MC,
                            k0 == 0,
                        );
                    }
                } else {
                    for rb in (0..npad).step_by(MR) {
                        kern_6x16(
                            wt.add(rb * KC),
                            KC,
                            xb,
                            kcl,
                            ct.add(rb * MC + tb),
                            MC,
                            k0 == 0,
                        );
                    }
                }
            }
            k0 += kcl;
        }
        // ct is out transposed ([o][t]); write the valid part.
        for t in 0..tl {
            let orow = out.add((t0 + t) * n_out + o0);
            for r in 0..np {
                *orow.add(r) = *ct.add(r * MC + t);
            }
        }
    }

    /// # Safety
    /// avx2, fma and f16c are available; quant bits ∈ {4, 8} with group_size % 64 == 0; shapes checked.
    pub unsafe fn gemm(x: &[f32], rows: usize, w: &MatView, out: &mut [f32]) {
        let (n_out, inp) = (w.out(), w.inp());
        // Pack x into blocks of 16 rows, k-major: xt[blk][k][0..16] (zero rows past the end).
        let nblk = rows.div_ceil(NR);
        let mut xt = lines(nblk * inp * NR);
        let xtf = std::slice::from_raw_parts_mut(xt.as_mut_ptr() as *mut f32, nblk * inp * NR);
        // Quantized tiles are dequantized in slot order (`dequant_seg`): x follows the same order.
        let perm: Vec<usize> = match w {
            MatView::Quant(q) => (0..64).map(|p| slot_elem(q.bits, p)).collect(),
            MatView::Dense(_) => (0..64).collect(),
        };
        let pack = |(bi, dst): (usize, &mut [f32])| {
            for tt in 0..NR.min(rows - bi * NR) {
                let src = &x[(bi * NR + tt) * inp..][..inp];
                for k0 in (0..inp).step_by(64) {
                    for (p, &e) in perm.iter().enumerate().take(inp - k0) {
                        dst[(k0 + p) * NR + tt] = src[k0 + e];
                    }
                }
            }
        };
        if nblk > 1 && rows * inp >= 1 << 16 {
            xtf.par_chunks_mut(inp * NR).enumerate().for_each(pack);
        } else {
            xtf.chunks_mut(inp * NR).enumerate().for_each(pack);
        }
        let xtp = xt.as_ptr() as usize; // usize: Send
        let np_count = n_out.div_ceil(NP);
        let ntask = np_count * rows.div_ceil(MC);
        // 2·rows·out·inp FLOP; below ~2 MFLOP (tens of µs) a rayon dispatch is not worth it.
        let par = rows * n_out * inp >= 1 << 20;
        let optr = OutPtr(out.as_mut_ptr());
        for_each_task(ntask, par, |i| {
            SCRATCH.with(|s| {
                let mut s = s.borrow_mut();
                // SAFETY: task (p, tr) writes only out[tr-rows][p-columns].
                unsafe {
                    gemm_task(
                        w,
                        i % np_count,
                        i / np_count,
                        xtp as *const f32,
                        rows,
                        optr.get(),
                        &mut s,
                    )
                }
            })
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loader::tensor::{DenseView, Floats, QuantView};

    /// splitmix64: deterministic test data without a crate.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        /// Uniform in [-1, 1).
        fn f(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
    }

    #[derive(Clone, Copy, PartialEq)]
    enum Ty {
        F32,
        Bf16,
        F16,
    }

    /// Owned float storage in one of the three types.
    enum Store {
        F32(Vec<f32>),
        U16(Vec<u16>, Ty),
    }
    impl Store {
        fn new(v: Vec<f32>, ty: Ty) -> Self {
            match ty {
                Ty::F32 => Store::F32(v),
                Ty::Bf16 => Store::U16(
                    v.iter()
                        .map(|&x| half::bf16::from_f32(x).to_bits())
                        .collect(),
                    ty,
                ),
                Ty::F16 => Store::U16(
                    v.iter()
                        .map(|&x| half::f16::from_f32(x).to_bits())
                        .collect(),
                    ty,
                ),
            }
        }
        fn floats(&self) -> Floats<'_> {
            match self {
                Store::F32(v) => Floats::F32(v),
                Store::U16(v, Ty::Bf16) => Floats::Bf16(v),
                Store::U16(v, _) => Floats::F16(v),
            }
        }
    }

    enum Mat {
        Quant {
            out: usize,
            inp: usize,
            bits: u32,
            gs: usize,
            w: Vec<u32>,
            s: Store,
            b: Store,
        },
        Dense {
            out: usize,
            inp: usize,
            w: Store,
        },
    }
    impl Mat {
        /// Random codes; scales in [0.002, 0.02]; biases ≈ -s·2^(bits-1) (as MLX's min-based
        /// quantization gives: weights centred on 0) plus noise.
        fn quant(rng: &mut Rng, out: usize, inp: usize, bits: u32, gs: usize, ty: Ty) -> Self {
            let w = (0..out * inp * bits as usize / 32)
                .map(|_| rng.next() as u32)
                .collect();
            let ng = out * inp / gs;
            let sv: Vec<f32> = (0..ng).map(|_| 0.011 + 0.009 * rng.f()).collect();
            let bv: Vec<f32> = sv
                .iter()
                .map(|&s| -s * (1u32 << (bits - 1)) as f32 * (1.0 + 0.2 * rng.f()))
                .collect();
            Mat::Quant {
                out,
                inp,
                bits,
                gs,
                w,
                s: Store::new(sv, ty),
                b: Store::new(bv, ty),
            }
        }
        fn dense(rng: &mut Rng, out: usize, inp: usize, ty: Ty) -> Self {
            Mat::Dense {
                out,
                inp,
                w: Store::new((0..out * inp).map(|_| 0.1 * rng.f()).collect(), ty),
            }
        }
        fn view(&self) -> MatView<'_> {
            match self {
                Mat::Quant {
                    out,
                    inp,
                    bits,
                    gs,
                    w,
                    s,
                    b,
                } => MatView::Quant(QuantView {
                    out: *out,
                    inp: *inp,
                    bits: *bits,
                    group_size: *gs,
                    w,
                    scales: s.floats(),
                    biases: b.floats(),
                }),
                Mat::Dense { out, inp, w } => MatView::Dense(DenseView {
                    out: *out,
                    inp: *inp,
                    w: w.floats(),
                }),
            }
        }
    }

    /// Reference: dequantize each row with `MatView::row_f32`, dot in f64. Returns the values and
    /// Σ_k |w_k·x_k| per output (the scale of the rounding error of any f32 summation order).
    fn reference(x: &[f32], rows: usize, w: &MatView) -> (Vec<f64>, Vec<f64>) {
        let (n, k) = (w.out(), w.inp());
        let mut y = vec![0f64; rows * n];
        let mut mag = vec![0f64; rows * n];
        let mut row = vec![0f32; k];
        for o in 0..n {
            w.row_f32(o, &mut row);
            for t in 0..rows {
                let xt = &x[t * k..(t + 1) * k];
                y[t * n + o] = row.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
                mag[t * n + o] = row
                    .iter()
                    .zip(xt)
                    .map(|(&a, &b)| (a as f64 * b as f64).abs())
                    .sum();
            }
        }
        (y, mag)
    }

    /// Tolerance: f32 accumulation of K products has a worst-case relative error of about K·ε
    /// (ε = 6e-8) of Σ|w·x|, typically √K·ε; the affine identity adds the rounding of s·Σqx and
    /// b·Σx, whose terms are at most a few times Σ|w·x| here. So |err| ≤ 1e-4·Σ|w·x| + 1e-6:
    /// ≥ 10× the typical error even at K = 2048, and it scales with the problem instead of being
    /// a loose fixed number. A wrong code, scale or lane order gives errors of order Σ|w·x|/K and
    /// up, far above it.
    fn check(x: &[f32], rows: usize, w: &MatView, path: Path, what: &str) {
        let (y, mag) = reference(x, rows, w);
        let mut out = vec![f32::NAN; rows * w.out()];
        matmul_with(x, rows, w, &mut out, path);
        for i in 0..out.len() {
            let err = (out[i] as f64 - y[i]).abs();
            let tol = 1e-4 * mag[i] + 1e-6;
            assert!(err <= tol, "{what} {path:?} rows={rows} out={} inp={}: [{}] = {} vs {} (err {err:e} > tol {tol:e})", w.out(), w.inp(), i, out[i], y[i]);
        }
    }

    fn xs(rng: &mut Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.f()).collect()
    }

    const ROWS: [usize; 6] = [1, 2, 3, 7, 64, 130];
    const OUTS: [usize; 3] = [1, 31, 257];
    const INPS: [usize; 3] = [64, 512, 2048];

    fn grid(make: impl Fn(&mut Rng, usize, usize) -> Mat, what: &str, paths: &[Path]) {
        let mut rng = Rng(0x5EED ^ what.len() as u64);
        for &inp in &INPS {
            for &out in &OUTS {
                let m = make(&mut rng, out, inp);
                for &rows in &ROWS {
                    let x = xs(&mut rng, rows * inp);
                    for &p in paths {
                        check(&x, rows, &m.view(), p, what);
                    }
                }
            }
        }
    }

    const SIMD: [Path; 3] = [Path::Auto, Path::Gemv, Path::Gemm];

    #[test]
    fn q4_bf16() {
        grid(
            |r, o, i| Mat::quant(r, o, i, 4, 64, Ty::Bf16),
            "q4 bf16",
            &SIMD,
        );
    }
    #[test]
    fn q8_bf16() {
        grid(
            |r, o, i| Mat::quant(r, o, i, 8, 64, Ty::Bf16),
            "q8 bf16",
            &SIMD,
        );
    }
    #[test]
    fn q4_f32_scales() {
        grid(
            |r, o, i| Mat::quant(r, o, i, 4, 64, Ty::F32),
            "q4 f32",
            &SIMD,
        );
    }
    #[test]
    fn q8_f32_scales() {
        grid(
            |r, o, i| Mat::quant(r, o, i, 8, 64, Ty::F32),
            "q8 f32",
            &SIMD,
        );
    }
    #[test]
    fn q4_q8_f16_scales() {
        grid(
            |r, o, i| Mat::quant(r, o, i, 4, 64, Ty::F16),
            "q4 f16",
            &SIMD,
        );
        grid(
            |r, o, i| Mat::quant(r, o, i, 8, 64, Ty::F16),
            "q8 f16",
            &SIMD,
        );
    }
    #[test]
    fn dense_bf16() {
        grid(|r, o, i| Mat::dense(r, o, i, Ty::Bf16), "dense bf16", &SIMD);
    }
    #[test]
    fn dense_f32_f16() {
        grid(|r, o, i| Mat::dense(r, o, i, Ty::F32), "dense f32", &SIMD);
        grid(|r, o, i| Mat::dense(r, o, i, Ty::F16), "dense f16", &SIMD);
    }
    #[test]
    fn scalar_fallback() {
        let p = [Path::Scalar];
        grid(
            |r, o, i| Mat::quant(r, o, i, 4, 64, Ty::Bf16),
            "q4 bf16",
            &p,
        );
        grid(|r, o, i| Mat::quant(r, o, i, 8, 64, Ty::F32), "q8 f32", &p);
        grid(|r, o, i| Mat::dense(r, o, i, Ty::Bf16), "dense bf16", &p);
        grid(|r, o, i| Mat::dense(r, o, i, Ty::F16), "dense f16", &p);
    }
    /// Groups of 128 (SIMD: scale repeated over two 64-blocks) and 32 (scalar only), 2-bit
    /// (scalar only), dense with an inp that is not a multiple of 8 (SIMD tails).
    #[test]
    fn other_formats() {
        let mut rng = Rng(7);
        let all = [Path::Auto, Path::Gemv, Path::Gemm, Path::Scalar];
        for (bits, gs) in [(4, 128), (8, 128), (4, 32), (2, 64)] {
            let m = Mat::quant(&mut rng, 37, 512, bits, gs, Ty::Bf16);
            for rows in [1, 5, 20] {
                let x = xs(&mut rng, rows * 512);
                for p in all {
                    check(&x, rows, &m.view(), p, &format!("q{bits} gs{gs}"));
                }
            }
        }
        for inp in [1, 13, 100] {
            let m = Mat::dense(&mut rng, 19, inp, Ty::Bf16);
            for rows in [1, 3, 17] {
                let x = xs(&mut rng, rows * inp);
                for p in all {
                    check(&x, rows, &m.view(), p, "dense odd inp");
                }
            }
        }
    }
    /// Several GEMM x-row ranges (rows > MC), several panels and GEMV chunks (parallel tasks),
    /// and a longer x/out than needed (only the first rows·inp / rows·out are used / written).
    #[test]
    fn large_and_slices() {
        let mut rng = Rng(11);
        let m = Mat::quant(&mut rng, 300, 1024, 4, 64, Ty::Bf16);
        let x = xs(&mut rng, 600 * 1024);
        for p in SIMD {
            check(&x, 600, &m.view(), p, "large");
        }
        let rows = 3;
        let mut out = vec![-7.0f32; rows * 300 + 5];
        matmul(&x[..rows * 1024 + 9], rows, &m.view(), &mut out);
        assert!(out[rows * 300..].iter().all(|&v| v == -7.0));
        let mut o2 = vec![0f32; rows * 300];
        matmul_with(&x[..rows * 1024], rows, &m.view(), &mut o2, Path::Scalar);
        for (a, b) in out.iter().zip(&o2) {
            assert!((a - b).abs() <= 1e-3 * (1.0 + b.abs()));
        }
    }
    /// Single-threaded pool and a 2-thread pool give the same answers (chunking is thread-count
    /// dependent).
    #[test]
    fn thread_counts() {
        let mut rng = Rng(13);
        let m = Mat::quant(&mut rng, 1000, 2048, 4, 64, Ty::Bf16);
        let x = xs(&mut rng, 40 * 2048);
        for n in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .unwrap();
            pool.install(|| {
                for rows in [1, 4, 40] {
                    check(&x, rows, &m.view(), Path::Auto, &format!("{n} threads"));
                }
            });
        }
    }
}
