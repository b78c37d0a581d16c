// tc_gemm.cuh: the tensor-core GEMM tile for prefill, shared by matmul.cu (tc_gemm_<fmt>) and
// moe.cu (moe_tc_gemm_<fmt>). Same function as gemm_tile in quant.cuh (out = x . W^T over a 64 x 64
// output tile, rows of x and of out through index maps), with bf16 operands:
//
//   x  a bf16 activation [*, inp] in global memory, copied into shared memory as it is;
//   W  a QMat (quant.cuh): 4-bit codes with bf16 scales (the checkpoint's format) dequantised by
//      packed bf16 FMAs, s*q + b rounded once to bf16 (tc_deq8_bf16); other formats as (s*q) + b
//      in f32 with the CPU's operation order (MatView::row_f32), then rounded to bf16; dense f32
//      rounded likewise. Either way the staged weight is within 2^-8 relative of the CPU's;
//   products bf16 x bf16 (exact in f32), accumulated in f32 by mma.sync.m16n8k16; the output is
//   written as f32 or rounded to a bf16 activation (tc_store_out).
// So against the f32 product of the same (bf16) x each product carries one bf16 rounding of w
// (relative 2^-8) and the sum the f32 accumulation error: |y - y_f32| <= (2^-8 + K*2^-22) *
// sum_k |x_k w_k|, plus the output's own rounding when it is an activation (the op test's bounds).
//
// Tile: TC_M = 64 rows of x by TC_N = 64 weight rows (output columns), k-steps of TC_K = 64;
// 128 threads = 4 warps in 2 x 2, each warp 32 x 32 = 2 (m16) x 4 (n8) mma tiles. NW = 2 weight
// matrices can share the staged x tile (the experts' gate and up, fused). Dynamic shared memory:
// two buffers (double buffering, one barrier per k-step) of As[64][72] and NW x Ws[64][72] bf16 =
// 36 KiB (NW = 1) or 54 KiB (NW = 2); the row stride of 72 bf16 (144 B) puts the 8 row addresses of each ldmatrix on distinct
// banks. Per k-step each thread loads the next step's global data into registers (TcStage: 4 uint4
// of x (8 bf16 each), the 32 codes of one half weight row with its group's scale and bias) before the mma work
// on the current buffer, then converts and stores it into the other buffer. The warps' fragments
// come from shared memory by ldmatrix (x4), without transposes: x tiles are [row][k] (the mma's
// row-major A) and W tiles [n][k] (its column-major B).
//
// The PTX helpers (ldmatrix, mma, bf16 packing) and the fragment layouts are in mma.cuh.
//
// Requirements (checked on the host at upload): inp % 32 == 0, gs % 32 == 0, so a half k-step of
// 32 never straddles a quantisation group and every load is 16-byte aligned; a k-step past inp
// (inp % 64 == 32) is zero-filled.

#define TC_M 64
#define TC_N 64
#define TC_K 64
#define TC_LD 72  // bf16 row stride of the shared tiles
#define TC_THREADS 128

// Whether a format takes the packed bf16 dequantisation (4-bit codes with bf16 scales: every large
// matrix of an MLX checkpoint). Its tiles hold k in the order 0,4,1,5,2,6,3,7 within each aligned
// group of 8, in x and W alike, which leaves every dot product unchanged.
template <int BITS, typename SB>
struct TcFast {
    static constexpr bool value = false;
};
template <>
struct TcFast<4, u16> {
    static constexpr bool value = true;
};

// What one thread carries from global memory to shared memory per k-step, for one weight matrix.
template <int BITS>
struct TcW {
    u32 w[BITS];  // W: weight row tid/2, columns (tid%2)*32 .. +32: 32 codes = BITS words
    float s, b;   // that half row's group scale and bias (f32 path)
    u32 sb;       // fast path: scale bits | bias bits << 16
};

// ... and for x plus NW weight matrices that share it (NW = 2: the experts' gate and up).
template <int BITS, int NW>
struct TcStage {
    uint4 x[4];  // x: row i*16 + tid/8 (i < 4), columns (tid%8)*8 .. +8 of the k-step (8 bf16)
    TcW<BITS> w[NW];
};

template <int BITS, int NW>
__device__ __forceinline__ void tc_load_x(int inp, const u16* __restrict__ x, u64 ldx, const int* xrow, int k0,
                                          TcStage<BITS, NW>& st) {
    const int tid = threadIdx.x;
    // x: 8 threads cover one row's 64 columns (128 contiguous bytes), so loads coalesce.
    const int kc = k0 + (tid & 7) * 8;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int xr = xrow[i * 16 + (tid >> 3)];
        st.x[i] = (xr >= 0 && kc < inp) ? *(const uint4*)(x + (u64)xr * ldx + kc) : make_uint4(0u, 0u, 0u, 0u);
    }
}

template <int BITS, typename SB>
__device__ __forceinline__ void tc_load_w(const QMat& m, int e, int n0, int k0, TcW<BITS>& st) {
    const int tid = threadIdx.x;
    // W: two threads per weight row, 16 (4-bit) / 32 (8-bit) / 128 (dense) contiguous bytes each.
    const int n = n0 + (tid >> 1), kk = k0 + (tid & 1) * 32;
    if (n < m.out && kk < m.inp) {
        const u32* wp = (const u32*)m.w + (u64)e * m.wpm + (u64)n * (u64)(m.inp * BITS / 32) + kk * BITS / 32;
#pragma unroll
        for (int i = 0; i < BITS / 4; i++) {
            uint4 v = __ldg((const uint4*)wp + i);
            st.w[4 * i] = v.x; st.w[4 * i + 1] = v.y; st.w[4 * i + 2] = v.z; st.w[4 * i + 3] = v.w;
        }
        if constexpr (BITS != 32) {
            const u64 g = (u64)e * m.gpm + (u64)n * (u64)(m.inp / m.gs) + kk / m.gs;
            if constexpr (TcFast<BITS, SB>::value) {
                st.sb = (u32)__ldg((const u16*)m.s + g) | ((u32)__ldg((const u16*)m.b + g) << 16);
            } else {
                st.s = ld_sb((const SB*)m.s, g);
                st.b = ld_sb((const SB*)m.b, g);
            }
        }
    } else {
        // Zero codes with zero scale and bias dequantise to 0 (dense: 0.0f bits).
#pragma unroll
        for (int i = 0; i < BITS; i++) st.w[i] = 0u;
        st.s = 0.0f;
        st.b = 0.0f;
        st.sb = 0u;
    }
}

// Element i (< 32) of a thread's half row, dequantised as the CPU does: (s*q) + b in f32, two
// roundings, no FMA. q is made exactly as a float from its bits (2^23 + q, minus 2^23), which
// avoids the quarter-rate integer-to-float conversion.
template <int BITS>
__device__ __forceinline__ float tc_deq(const TcW<BITS>& st, int i) {
    if constexpr (BITS == 32) {
        return __uint_as_float(st.w[i]);
    } else {
        constexpr int PER = 32 / BITS;
        const u32 q = (st.w[i / PER] >> ((i % PER) * BITS)) & ((1u << BITS) - 1u);
        const float qf = __uint_as_float(0x4B000000u | q) - 8388608.0f;
        return __fadd_rn(__fmul_rn(st.s, qf), st.b);
    }
}

__device__ __forceinline__ u32 fma_bf16x2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// The fast path's 8 codes of word w as 4 bf16x2 words in the order (0,4) (1,5) (2,6) (3,7):
// 0x4300 | q is the bf16 of 128 + q (q < 16 fits the 7-bit mantissa), minus 128 is q exactly, and
// s*q + b is then one bf16 FMA: w rounded once to bf16 (the f32 path rounds s*q, then + b, then to
// bf16; the two differ in the last bf16 bit only when the f32 value lands on a bf16 halfway point).
__device__ __forceinline__ void tc_deq8_bf16(u32 w, u32 sb, u32* out) {
    const u32 s2 = (sb & 0xffffu) * 0x10001u, b2 = (sb >> 16) * 0x10001u;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const u32 t = ((w >> (4 * i)) & 0x000f000fu) | 0x43004300u;  // 128 + q_i | 128 + q_{i+4}
        const u32 q = fma_bf16x2(t, 0x3f803f80u, 0xc300c300u);        // t * 1 - 128, exact
        out[i] = fma_bf16x2(q, s2, b2);
    }
}

// One buffer of a stage: the x tile, then the NW weight tiles, each [64][TC_LD] bf16.
#define TC_TILE (TC_M * TC_LD)
static_assert(TC_M == TC_N, "x and weight tiles share one size");

// Stores a stage into the buffer at `buf`.
template <int BITS, typename SB, int NW>
__device__ __forceinline__ void tc_store(const TcStage<BITS, NW>& st, u16* buf) {
    u16(*As)[TC_LD] = (u16(*)[TC_LD])buf;
    constexpr bool FAST = TcFast<BITS, SB>::value;
    const int tid = threadIdx.x;
    const int kc = (tid & 7) * 8;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        uint4 v = st.x[i];
        // The fast path's k order within 8: (0,4) (1,5) (2,6) (3,7), one 16-bit half from each word.
        if (FAST)
            v = make_uint4(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632), __byte_perm(v.y, v.w, 0x5410),
                           __byte_perm(v.y, v.w, 0x7632));
        *(uint4*)&As[i * 16 + (tid >> 3)][kc] = v;
    }
#pragma unroll
    for (int m = 0; m < NW; m++) {
        u16* wr = buf + (1 + m) * TC_TILE + (tid >> 1) * TC_LD + (tid & 1) * 32;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            u32 p[4];
            if constexpr (FAST) {
                tc_deq8_bf16(st.w[m].w[j], st.w[m].sb, p);
            } else {
#pragma unroll
                for (int i = 0; i < 4; i++)
                    p[i] = pack_bf16x2(tc_deq<BITS>(st.w[m], 8 * j + 2 * i), tc_deq<BITS>(st.w[m], 8 * j + 2 * i + 1));
            }
            *(uint4*)(wr + 8 * j) = make_uint4(p[0], p[1], p[2], p[3]);
        }
    }
}

// Dynamic shared memory of a tc_tile with NW weight matrices: two buffers of (1 + NW) 64 x TC_LD
// bf16 tiles (36 KiB for NW = 1, 54 KiB for NW = 2).
#define TC_SMEM(NW) (2 * (1 + (NW)) * TC_M * TC_LD * 2)

// The 64x64 output tiles at weight rows n0.. of matrix e of each of the NW matrices m[i] (same
// input width), for the tile rows whose x row is xrow[i] (-1: padding; xrow in shared memory,
// written before a barrier). acc[i][mi][ni][r] is output (row, col) of matrix i with row = wm*32 +
// mi*16 + lane/4 (+8 for r >= 2), col = wn*32 + ni*8 + 2*(lane%4) + (r & 1), warp = 2*wm + wn (the
// mma accumulator layout). Shared memory: the kernel's dynamic buffer of TC_SMEM(NW) bytes.
template <int NW>
struct QMats {
    QMat m[NW];  // by value, indexed by constants only: stays in registers (a pointer would not)
};

template <int BITS, typename SB, int NW>
__device__ __forceinline__ void tc_tile(const QMats<NW> mats, int e, int n0, const u16* __restrict__ x, u64 ldx,
                                        const int* xrow, float acc[NW][2][4][4]) {
    const QMat* m = mats.m;
    extern __shared__ __align__(16) u16 tc_smem[];
    typedef u16(*Tile)[TC_LD];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = warp >> 1, wn = warp & 1;
    const int inp = m[0].inp;
    // Buffer b starts at tc_smem + b * (1 + NW) * TC_TILE (computed, not tabled: a table of
    // pointers indexed by the running buffer number would live in local memory).
#pragma unroll
    for (int i = 0; i < NW; i++)
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int ni = 0; ni < 4; ni++)
#pragma unroll
                for (int r = 0; r < 4; r++) acc[i][mi][ni][r] = 0.0f;

    TcStage<BITS, NW> st;
    tc_load_x<BITS, NW>(inp, x, ldx, xrow, 0, st);
#pragma unroll
    for (int i = 0; i < NW; i++) tc_load_w<BITS, SB>(m[i], e, n0, 0, st.w[i]);
    tc_store<BITS, SB, NW>(st, tc_smem);
    __syncthreads();
    const int nk = (inp + TC_K - 1) / TC_K;
    for (int kt = 0; kt < nk; kt++) {
        u16* cur = tc_smem + (kt & 1) * (1 + NW) * TC_TILE;
        const Tile As = (Tile)cur;
        // Issue the next step's global loads first: their latency hides behind the mma work.
        if (kt + 1 < nk) {
            tc_load_x<BITS, NW>(inp, x, ldx, xrow, (kt + 1) * TC_K, st);
#pragma unroll
            for (int i = 0; i < NW; i++) tc_load_w<BITS, SB>(m[i], e, n0, (kt + 1) * TC_K, st.w[i]);
        }
#pragma unroll
        for (int ks = 0; ks < TC_K / 16; ks++) {
            // A fragments (ldmatrix x4: lanes 0-15 give rows 0-15 at k 0, lanes 16-31 at k 8).
            u32 a[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
                ldsm_x4(smem_u32(&As[wm * 32 + mi * 16 + (lane & 15)][ks * 16 + (lane >> 4) * 8]), a[mi][0], a[mi][1],
                        a[mi][2], a[mi][3]);
#pragma unroll
            for (int i = 0; i < NW; i++) {
                const Tile Ws = (Tile)(cur + (1 + i) * TC_TILE);
                // B fragments: W rows are the mma's n, contiguous in k ("col" layout) -> ldmatrix
                // without transpose; one x4 covers two n8 tiles (n 0-7 k 0 | n 0-7 k 8 | n 8-15 k 0 | n 8-15 k 8).
                u32 b[4][2];
#pragma unroll
                for (int nj = 0; nj < 2; nj++)
                    ldsm_x4(smem_u32(&Ws[wn * 32 + nj * 16 + (lane & 7) + ((lane >> 4) << 3)][ks * 16 + ((lane >> 3) & 1) * 8]),
                            b[2 * nj][0], b[2 * nj][1], b[2 * nj + 1][0], b[2 * nj + 1][1]);
#pragma unroll
                for (int mi = 0; mi < 2; mi++)
#pragma unroll
                    for (int ni = 0; ni < 4; ni++) mma_bf16_16816(acc[i][mi][ni], a[mi], b[ni][0], b[ni][1]);
            }
        }
        // The other buffer was last read in step kt-1, which every thread finished before the
        // barrier that ended it.
        if (kt + 1 < nk) tc_store<BITS, SB, NW>(st, tc_smem + ((kt + 1) & 1) * (1 + NW) * TC_TILE);
        __syncthreads();
    }
}

// Writes the tile: out[orow[row] * ldo + n0 + col] for rows with orow >= 0 and columns < m.out,
// f32 (obf = 0) or rounded to bf16 (obf = 1).
__device__ __forceinline__ void tc_store_out(const float acc[2][4][4], const int* orow, int n0, int nout, void* __restrict__ out,
                                             u64 ldo, int obf) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = warp >> 1, wn = warp & 1;
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = orow[wm * 32 + mi * 16 + (lane >> 2) + 8 * h];
            if (r < 0) continue;
            const u64 base = (u64)r * ldo;
#pragma unroll
            for (int ni = 0; ni < 4; ni++) {
                const int c = n0 + wn * 32 + ni * 8 + 2 * (lane & 3);
                if (c < nout) store_out(out, base + c, acc[mi][ni][2 * h], obf);
                if (c + 1 < nout) store_out(out, base + c + 1, acc[mi][ni][2 * h + 1], obf);
            }
        }
}
