// matmul.cu: out = x . W^T for a (quantized) weight, and the embedding lookup.
// Matches cpu/matmul.rs (`matmul`) and Cpu::embed (MatView::row_f32).
//
// Layouts: x [rows, inp] a bf16 activation, row-major; out [rows, out] (overwritten) f32 (obf = 0:
// logits, router logits, the shared-expert gate logit) or a bf16 activation (obf = 1), rounded
// once from the f32 result; W a QMat (quant.cuh), matrix 0 of its stack. Kernel names end in the weight format: q4_bf16, q8_bf16, q4_f32, q8_f32,
// dense (see FOR_EACH_FORMAT).
//
// gemv<R>_<fmt> (rows <= R, R in 1, 2, 4, 8: decode and tiny batches; memory-bound; the host picks
//             the smallest R, fewer registers = more warps in flight). Block of 256 threads = 8
//             warps, one output row per warp, grid (ceil(out/8), ceil(rows/R)): block y takes x
//             rows R*y .. R*y+R (y = 0 for decode). A prefill of a matrix with at most 64 outputs
//             (GDN b/a, shared-expert gate) runs gemv1 with one block row per token.
//             Each warp streams its weight row once for its rows of x (warp_dot_rows), then
//             reduces with shuffles.
// gemv1a_<fmt>, gemv_manya_<fmt>  the same as gemv1 and gemv_many with each batch's scales, biases
//             and x values loaded with its weight words (warp_dot_rows' AHEAD): for one row of x
//             and matrices of at most GEMV_AHEAD_ROWS outputs (mod.rs), which are latency-bound.
// gemv_many_<fmt> (decode: one row of x) x times up to 4 matrices of one format and width that read
//             the same input (GDN qkv | z | b | a, attention q | k | v, router | shared-expert
//             gate): one launch instead of one each, and one wave of blocks for all of them.
//             Matrix i takes blocks [bstart[i], bstart[i+1]), ceil(out_i / 8) of them, a warp per
//             output row as gemv1 (so each output equals gemv1's bit for bit), written in its
//             output's type obf[i]. Grid bstart[n], 256 threads.
// tc_gemm_<fmt> (rows > 8: prefill; the default). Tensor cores, bf16 operands, f32 accumulation
//             (tc_gemm.cuh): 64x64 output tiles, 128 threads, grid (ceil(out/64), ceil(rows/64)),
//             TC_SMEM(1) bytes of dynamic shared memory.
//             Within the bf16 bound of tc_gemm.cuh of the CPU's f32 result, not equal to it.
// gemm_<fmt>  (rows > 8 with LILY_CUDA_GEMM=simt: the f32 reference path and ablation). 64x64
//             output tiles, 256 threads, same grid; W dequantized into shared memory per k-step
//             of 32; plain f32 FMAs, matching the CPU to f32 rounding.
// embed_<fmt> out[t] = dequant(W[ids[t]]) into the f32 residual stream: grid rows, 256 threads
//             striding over the row.

template <int BITS, typename SB, int GEMV_MAXR, bool AHEAD = false>
__device__ __forceinline__ void gemv_body(const u16* __restrict__ x, QMat m, void* __restrict__ out, int rows, int obf) {
    // Block y takes x rows GEMV_MAXR*y .. (a prefill of a skinny matrix; y = 0 for decode).
    const int r0 = blockIdx.y * GEMV_MAXR;
    x += (u64)r0 * m.inp;
    const u64 obase = (u64)r0 * m.out;
    rows = min(rows - r0, GEMV_MAXR);
    int lane = threadIdx.x & 31;
    int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (o >= m.out) return;
    float acc[GEMV_MAXR];
#pragma unroll
    for (int t = 0; t < GEMV_MAXR; t++) acc[t] = 0.0f;
    warp_dot_rows<BITS, SB, GEMV_MAXR, AHEAD>(m, 0, o, x, (u64)m.inp, rows, acc, lane);
#pragma unroll
    for (int t = 0; t < GEMV_MAXR; t++) {
        if (t < rows) {
            float v = warp_sum(acc[t]);
            if (lane == 0) store_out(out, obase + (u64)t * m.out + o, v, obf);
        }
    }
}

template <int BITS, typename SB>
__device__ __forceinline__ void gemm_body(const u16* __restrict__ x, QMat m, void* __restrict__ out, int rows, int obf) {
    __shared__ __align__(16) float As[GT_K][GT_PAD];
    __shared__ __align__(16) float Ws[GT_K][GT_PAD];
    __shared__ int xrow[GT_M];
    int n0 = blockIdx.x * GT_N, m0 = blockIdx.y * GT_M;
    if (threadIdx.x < GT_M) xrow[threadIdx.x] = m0 + (int)threadIdx.x < rows ? m0 + (int)threadIdx.x : -1;
    __syncthreads();
    float acc[4][4];
    gemm_tile<BITS, SB>(m, 0, n0, x, (u64)m.inp, xrow, As, Ws, acc);
    int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int r = m0 + ty * 4 + i;
        if (r >= rows) continue;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int n = n0 + tx * 4 + j;
            if (n < m.out) store_out(out, (u64)r * m.out + n, acc[i][j], obf);
        }
    }
}

template <int BITS, typename SB>
__device__ __forceinline__ void tc_gemm_body(const u16* __restrict__ x, QMat m, void* __restrict__ out, int rows, int obf) {
    __shared__ int rowmap[TC_M];  // x row = out row = m0 + i, or -1 past the last row
    const int n0 = blockIdx.x * TC_N, m0 = blockIdx.y * TC_M;
    if (threadIdx.x < TC_M) rowmap[threadIdx.x] = m0 + (int)threadIdx.x < rows ? m0 + (int)threadIdx.x : -1;
    __syncthreads();
    float acc[1][2][4][4];
    tc_tile<BITS, SB, 1>(QMats<1>{{m}}, 0, n0, x, (u64)m.inp, rowmap, acc);
    tc_store_out(acc[0], rowmap, n0, m.out, out, (u64)m.out, obf);
}

template <int BITS, typename SB>
__device__ __forceinline__ void embed_body(QMat m, const u32* __restrict__ ids, float* __restrict__ out) {
    int t = blockIdx.x;
    u64 id = ids[t];
    for (int k = threadIdx.x; k < m.inp; k += blockDim.x) out[(u64)t * m.inp + k] = deq_elem<BITS, SB>(m, 0, id, k);
}

// Up to 4 matrices for gemv_many (the Rust side mirrors this layout: struct Many in cuda/mod.rs).
struct Many {
    QMat m[4];
    u64 out[4];      // each matrix's output: float* (obf 0) or u16* (obf 1)
    int bstart[5];   // first block of each matrix; bstart[n] = grid
    int n;
    int obf[4];      // each output's type (store_out)
};

template <int BITS, typename SB, bool AHEAD>
__device__ __forceinline__ void gemv_many_body(const u16* __restrict__ x, const Many& p) {
    int i = 0;
    while (i + 1 < p.n && (int)blockIdx.x >= p.bstart[i + 1]) i++;
    const QMat m = p.m[i];
    const int lane = threadIdx.x & 31;
    const int o = (blockIdx.x - p.bstart[i]) * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (o >= m.out) return;
    float acc[1] = {0.0f};
    warp_dot_rows<BITS, SB, 1, AHEAD>(m, 0, o, x, (u64)m.inp, 1, acc, lane);
    const float v = warp_sum(acc[0]);
    if (lane == 0) store_out((void*)p.out[i], o, v, p.obf[i]);
}

// gemv<R>[a]_<fmt>: one kernel of the gemv family (R rows of x at most, AHEAD loads or not).
#define GEMV_KERNEL(KERNEL, NAME, BITS, SB, R, AHEAD)                                                              \
    extern "C" __global__ void __launch_bounds__(256) KERNEL##_##NAME(const u16* x, QMat m, void* out, int rows, int obf) { \
        KTRACE(); PDL_ENTRY();                                                                                    \
        gemv_body<BITS, SB, R, AHEAD>(x, m, out, rows, obf);                                                      \
    }

#define MATMUL_KERNELS(NAME, BITS, SB)                                                                            \
    extern "C" __global__ void __launch_bounds__(256) gemv_many_##NAME(const u16* x, Many p) { KTRACE(); PDL_ENTRY();        \
        gemv_many_body<BITS, SB, false>(x, p);                                                                    \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(256) gemv_manya_##NAME(const u16* x, Many p) { KTRACE(); PDL_ENTRY();       \
        gemv_many_body<BITS, SB, true>(x, p);                                                                     \
    }                                                                                                             \
    GEMV_KERNEL(gemv1a, NAME, BITS, SB, 1, true)                                                                  \
    GEMV_KERNEL(gemv1, NAME, BITS, SB, 1, false)                                                                  \
    GEMV_KERNEL(gemv2, NAME, BITS, SB, 2, false)                                                                  \
    GEMV_KERNEL(gemv4, NAME, BITS, SB, 4, false)                                                                  \
    GEMV_KERNEL(gemv8, NAME, BITS, SB, 8, false)                                                                  \
    extern "C" __global__ void __launch_bounds__(256) gemm_##NAME(const u16* x, QMat m, void* out, int rows, int obf) { KTRACE(); PDL_ENTRY(); \
        gemm_body<BITS, SB>(x, m, out, rows, obf);                                                                \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) tc_gemm_##NAME(const u16* x, QMat m, void* out, int rows, int obf) { KTRACE(); PDL_ENTRY(); \
        tc_gemm_body<BITS, SB>(x, m, out, rows, obf);                                                             \
    }                                                                                                             \
    extern "C" __global__ void embed_##NAME(QMat m, const u32* ids, float* out) { KTRACE(); PDL_ENTRY(); embed_body<BITS, SB>(m, ids, out); }

FOR_EACH_FORMAT(MATMUL_KERNELS)
