// quant.cuh: weight formats and the two matrix inner loops shared by matmul.cu and moe.cu.
//
// A weight is a stack of `n` matrices [out, inp] (n = 1 for a plain linear, n = E for experts),
// passed to kernels as a `QMat` by value. Formats (template parameter BITS, scale type SB):
//   BITS = 4 or 8  MLX affine: u32 words [n, out, inp*BITS/32], little-endian codes, lowest bits
//                  first (4-bit: element 8j+i is bits [4i, 4i+4) of word j); scales and biases
//                  [n, out, inp/gs] of type SB (u16 holding bf16 bits, or float); w = s*q + b.
//   BITS = 32      dense f32 [n, out, inp] (the u32 words are float bits; s, b unused).
// Requirements checked on the host at upload: inp % 32 == 0 and gs % 32 == 0, so a word (or a
// k-step of the GEMM) never straddles a group, and every row starts 16-byte aligned.
//
// x (the input of every matrix product) is a bf16 activation, widened to f32 as it is read.
// * warp_dot_rows: one warp, one weight row, up to MAXR rows of x (the GEMV inner loop). Lanes take
//   u32 words of the row in turn (coalesced 128 B per warp load, 8 loads in flight per lane, x
//   loads coalesced too) and never dequantize: they use
//   sum_k (s*q_k + b)*x_k = s*sum_k q_k x_k + b*sum_k x_k per word (as cpu/matmul.rs's GEMV).
//   Each lane returns a partial sum; the caller reduces across the warp.
// * gemm_tile: a 64 (x rows) x 64 (weight rows) output tile over k-steps of 32, 256 threads, each
//   4x4 outputs; W is dequantized (s*q + b) into shared memory per k-step (as cpu/matmul.rs's GEMM).
//   Rows of x and of the output go through index maps so MoE can gather / scatter.

struct QMat {
    u64 w;    // const u32*: codes (or f32 bits)
    u64 s;    // const SB*: scales
    u64 b;    // const SB*: biases
    int out;  // rows of one matrix
    int inp;  // columns
    int gs;   // group size (1 for dense)
    int pad;
    u64 wpm;  // u32 words per matrix
    u64 gpm;  // groups per matrix
};

template <typename SB> __device__ __forceinline__ float ld_sb(const SB* p, u64 i);
template <> __device__ __forceinline__ float ld_sb<u16>(const u16* p, u64 i) { return bf16f(p[i]); }
template <> __device__ __forceinline__ float ld_sb<float>(const float* p, u64 i) { return p[i]; }

template <int BITS> __device__ __forceinline__ void unpack_word(u32 w, float* q) {
    if constexpr (BITS == 32) {
        q[0] = __uint_as_float(w);
    } else {
        constexpr int PER = 32 / BITS;
        constexpr u32 M = (1u << BITS) - 1u;
#pragma unroll
        for (int i = 0; i < PER; i++) q[i] = (float)((w >> (i * BITS)) & M);
    }
}

// One element W[e][o][k], dequantized exactly as MatView::row_f32 does (s*q then + b, no FMA).
template <int BITS, typename SB>
__device__ __forceinline__ float deq_elem(const QMat& m, int e, u64 o, int k) {
    const u32* w = (const u32*)m.w + (u64)e * m.wpm + o * (u64)(m.inp * BITS / 32);
    if constexpr (BITS == 32) {
        return __uint_as_float(w[k]);
    } else {
        constexpr int PER = 32 / BITS;
        constexpr u32 M = (1u << BITS) - 1u;
        u32 code = (w[k / PER] >> ((k % PER) * BITS)) & M;
        u64 g = (u64)e * m.gpm + o * (u64)(m.inp / m.gs) + k / m.gs;
        float s = ld_sb((const SB*)m.s, g), b = ld_sb((const SB*)m.b, g);
        return __fadd_rn(__fmul_rn(s, (float)code), b);
    }
}

// One unit of a weight row as a lane loads it: a u32 word of codes (quantized) or a 16-byte chunk
// of 4 floats (dense), with its group's scale and bias.
struct DotUnit {
    uint4 w;
    float s, b;
};

// The x values of a unit (8 or 4 consecutive bf16: one 16- or 8-byte load), as raw words.
template <int BITS>
__device__ __forceinline__ uint4 load_x_unit(const u16* __restrict__ xp) {
    if constexpr (BITS == 4) return *(const uint4*)xp;
    const uint2 v = *(const uint2*)xp;
    return make_uint4(v.x, v.y, 0u, 0u);
}

// The unit's partial dot with one row of x (xw: its x values as raw bf16 words).
template <int BITS>
__device__ __forceinline__ float dot_unit(const DotUnit& un, uint4 xw) {
    const u32 xs4[4] = {xw.x, xw.y, xw.z, xw.w};
    if constexpr (BITS == 32) {
        return __uint_as_float(un.w.x) * bf16_lo(xs4[0]) + __uint_as_float(un.w.y) * bf16_hi(xs4[0]) +
               __uint_as_float(un.w.z) * bf16_lo(xs4[1]) + __uint_as_float(un.w.w) * bf16_hi(xs4[1]);
    } else {
        constexpr int PER = 32 / BITS;
        float q[PER];
        unpack_word<BITS>(un.w.x, q);
        float dq = 0.0f, xs = 0.0f;
#pragma unroll
        for (int i = 0; i < PER / 4; i++) {
            const float x0 = bf16_lo(xs4[2 * i]), x1 = bf16_hi(xs4[2 * i]), x2 = bf16_lo(xs4[2 * i + 1]), x3 = bf16_hi(xs4[2 * i + 1]);
            dq += q[4 * i] * x0 + q[4 * i + 1] * x1 + q[4 * i + 2] * x2 + q[4 * i + 3] * x3;
            xs += (x0 + x1) + (x2 + x3);
        }
        return un.s * dq + un.b * xs;
    }
}

// Row o of matrix e as the dot loops load it, a unit at a time: its weights (a u32 word of codes,
// or 16 bytes of dense floats) and its group's scale and bias.
template <int BITS, typename SB>
struct DotRow {
    static constexpr int PER = BITS == 32 ? 4 : 32 / BITS;  // x values per unit
    const u32* w;
    const SB* s;
    const SB* b;
    u64 g;  // the row's first group
    int gs;
    __device__ __forceinline__ DotRow(const QMat& m, int e, int o)
        : w((const u32*)m.w + (u64)e * m.wpm + (u64)o * (u64)(m.inp * BITS / 32)), s((const SB*)m.s), b((const SB*)m.b),
          g((u64)e * m.gpm + (u64)o * (u64)(m.inp / m.gs)), gs(m.gs) {}
    __device__ __forceinline__ void word(int u, DotUnit& un) const {
        if constexpr (BITS == 32) un.w = __ldg((const uint4*)w + u);
        else un.w.x = __ldg(w + u);
    }
    __device__ __forceinline__ void group(int u, DotUnit& un) const {
        if constexpr (BITS != 32) {
            const u64 gi = g + (u64)(u * PER / gs);
            un.s = ld_sb(s, gi);
            un.b = ld_sb(b, gi);
        }
    }
};

__device__ __forceinline__ DotUnit zero_unit() {
    DotUnit un;
    un.w = make_uint4(0u, 0u, 0u, 0u);
    un.s = un.b = 0.0f;
    return un;
}

// Loads each lane issues before using any: 8 covers a 2048-wide 4-bit row (256 words) in one
// round trip. A decode GEMV is latency-bound when its matrix has few rows per SM (2048-row
// out_proj: ~2 blocks per SM), so bytes in flight per warp set its speed; 4 took two trips.
#define DOT_IN_FLIGHT 8

// acc[t] += (partial) dot(W[e][o], x[t]) for t < rows (rows <= MAXR), this lane's share; x is a
// bf16 activation [rows, ldx], widened as it is read. Returns per-lane partial sums; the caller
// reduces across the warp.
// Quantized rows go word by word: lane l takes u32 words l, l+32, l+64, ... (each step a coalesced
// 128-byte load per warp), and the x values of a word are then contiguous across the lanes too,
// so x loads coalesce. Dense rows go by 16-byte chunks (4 floats) in the same pattern. The words
// of a batch of DOT_IN_FLIGHT units are loaded before any is used. AHEAD (one x row only) loads
// their scales, biases and x values in the same batch too: one round trip per batch instead of
// two or three, for twice the registers (78-90 instead of 38-40 with one x row). Measured on the
// H200 (decode, full preset, op profile): matrices of few rows per SM, latency-bound, gain (the
// experts' down projection, out_proj, the router: -12 to -17%); the large ones (GDN in_proj,
// q|k|v, lm_head), whose speed comes from the warps an SM holds, lost 18-27%. So the host picks
// AHEAD by a matrix's rows (gemv1a / gemv_manya in matmul.cu).
template <int BITS, typename SB, int MAXR, bool AHEAD = false>
__device__ __forceinline__ void warp_dot_rows(const QMat& m, int e, int o, const u16* __restrict__ x, u64 ldx,
                                              int rows, float* acc, int lane) {
    static_assert(!AHEAD || MAXR == 1, "AHEAD loads the x values of one row");
    constexpr int PER = DotRow<BITS, SB>::PER;
    const DotRow<BITS, SB> row(m, e, o);
    const int nu = m.inp / PER;
    for (int u0 = lane; u0 < nu; u0 += 32 * DOT_IN_FLIGHT) {
        DotUnit un[DOT_IN_FLIGHT];
        uint4 xw[AHEAD ? DOT_IN_FLIGHT : 1];
#pragma unroll
        for (int i = 0; i < DOT_IN_FLIGHT; i++) {
            const int u = u0 + 32 * i;
            un[i] = zero_unit();
            if (u < nu) {
                row.word(u, un[i]);
                if constexpr (AHEAD) {
                    row.group(u, un[i]);
                    xw[i] = load_x_unit<BITS>(x + (u64)u * PER);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < DOT_IN_FLIGHT; i++) {
            const int u = u0 + 32 * i;
            if (u >= nu) continue;
            if constexpr (AHEAD) {
                acc[0] += dot_unit<BITS>(un[i], xw[i]);
            } else {
                row.group(u, un[i]);
#pragma unroll
                for (int t = 0; t < MAXR; t++)
                    if (t < rows) acc[t] += dot_unit<BITS>(un[i], load_x_unit<BITS>(x + (u64)t * ldx + (u64)u * PER));
            }
        }
    }
}

// Two rows of the same width against one row of x (the experts' gate and up rows of a decode
// step): ag, au += this lane's partial dots. One batch of loads covers both rows and their shared
// x values, so the pair costs one round trip per batch where two warp_dot_rows calls cost two.
template <int BITS, typename SB>
__device__ __forceinline__ void warp_dot_pair(const QMat& ma, int ea, const QMat& mb, int eb, int o, const u16* __restrict__ x,
                                              float& aa, float& ab, int lane) {
    constexpr int PER = DotRow<BITS, SB>::PER;
    const DotRow<BITS, SB> ra(ma, ea, o), rb(mb, eb, o);
    const int nu = ma.inp / PER;
    for (int u0 = lane; u0 < nu; u0 += 32 * DOT_IN_FLIGHT) {
        DotUnit ua[DOT_IN_FLIGHT], ub[DOT_IN_FLIGHT];
        uint4 xw[DOT_IN_FLIGHT];
#pragma unroll
        for (int i = 0; i < DOT_IN_FLIGHT; i++) {
            const int u = u0 + 32 * i;
            ua[i] = ub[i] = zero_unit();
            xw[i] = make_uint4(0u, 0u, 0u, 0u);
            if (u < nu) {
                ra.word(u, ua[i]);
                rb.word(u, ub[i]);
                ra.group(u, ua[i]);
                rb.group(u, ub[i]);
                xw[i] = load_x_unit<BITS>(x + (u64)u * PER);
            }
        }
#pragma unroll
        for (int i = 0; i < DOT_IN_FLIGHT; i++) {
            if (u0 + 32 * i >= nu) continue;
            aa += dot_unit<BITS>(ua[i], xw[i]);
            ab += dot_unit<BITS>(ub[i], xw[i]);
        }
    }
}

// ---- GEMM tile
#define GT_M 64
#define GT_N 64
#define GT_K 32
#define GT_PAD 68  // row stride of the shared tiles (floats): keeps float4 alignment

// The 64x64 output tile at weight rows n0.. of matrix e, for tile rows whose x row is xrow[i]
// (-1: padding); x is a bf16 activation. acc[i][j] is output (ty*4+i, tx*4+j) with ty = tid/16,
// tx = tid%16.
template <int BITS, typename SB>
__device__ __forceinline__ void gemm_tile(const QMat& m, int e, int n0, const u16* __restrict__ x, u64 ldx,
                                          const int* xrow, float (*As)[GT_PAD], float (*Ws)[GT_PAD],
                                          float acc[4][4]) {
    const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
    const int lr = tid >> 2, lk = (tid & 3) * 8;  // loader: tile row lr, k offset lk (8 values)
    const int nrow = n0 + lr;
    const bool wvalid = nrow < m.out;
    const u32* wrow = (const u32*)m.w + (u64)e * m.wpm + (u64)(wvalid ? nrow : 0) * (u64)(m.inp * BITS / 32);
    const u64 grow = (u64)e * m.gpm + (u64)(wvalid ? nrow : 0) * (u64)(m.inp / m.gs);
    const int xr = xrow[lr];
    const u16* xp = x + (u64)(xr < 0 ? 0 : xr) * ldx;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;

    for (int k0 = 0; k0 < m.inp; k0 += GT_K) {
        // x tile, transposed into As[k][row]
        float xv[8];
        if (xr >= 0) {
            uint4 a = *(const uint4*)(xp + k0 + lk);
            xv[0] = bf16_lo(a.x); xv[1] = bf16_hi(a.x); xv[2] = bf16_lo(a.y); xv[3] = bf16_hi(a.y);
            xv[4] = bf16_lo(a.z); xv[5] = bf16_hi(a.z); xv[6] = bf16_lo(a.w); xv[7] = bf16_hi(a.w);
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) xv[i] = 0.0f;
        }
        // W tile (8 consecutive k of one row), dequantized, transposed into Ws[k][n]
        float wv[8];
        if (wvalid) {
            int k = k0 + lk;
            if constexpr (BITS == 32) {
                const float4* p = (const float4*)(wrow + k);
                float4 a = p[0], b = p[1];
                wv[0] = a.x; wv[1] = a.y; wv[2] = a.z; wv[3] = a.w; wv[4] = b.x; wv[5] = b.y; wv[6] = b.z; wv[7] = b.w;
            } else {
                constexpr int PER = 32 / BITS;
                u64 g = grow + (u64)(k / m.gs);
                float s = ld_sb((const SB*)m.s, g), bb = ld_sb((const SB*)m.b, g);
#pragma unroll
                for (int wi = 0; wi < 8 / PER; wi++) {
                    float q[PER];
                    unpack_word<BITS>(wrow[k / PER + wi], q);
#pragma unroll
                    for (int i = 0; i < PER; i++) wv[wi * PER + i] = s * q[i] + bb;
                }
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) wv[i] = 0.0f;
        }
        __syncthreads();  // the previous step's reads are done
#pragma unroll
        for (int i = 0; i < 8; i++) {
            As[lk + i][lr] = xv[i];
            Ws[lk + i][lr] = wv[i];
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < GT_K; k++) {
            float4 a = *(const float4*)&As[k][ty * 4];
            float4 b = *(const float4*)&Ws[k][tx * 4];
            float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] += av[i] * bv[j];
        }
    }
}

// Instantiates KERNEL(NAME_SUFFIX, BITS, SB) for every weight format the host uploads.
#define FOR_EACH_FORMAT(KERNEL) \
    KERNEL(q4_bf16, 4, u16)     \
    KERNEL(q8_bf16, 8, u16)     \
    KERNEL(q4_f32, 4, float)    \
    KERNEL(q8_f32, 8, float)    \
    KERNEL(dense, 32, float)
