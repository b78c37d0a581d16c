// stream.cuh: the weight-streaming inner loop of the decode GEMVs (gemv.cu; moe.cu's moe_sw_*),
// one row of x against matrices whose every weight is read once per token.
//
// Why: a decode step is a byte budget (1.67 GB of weights per token at 4.3 TB/s is 0.39 ms), and
// the warp-per-row loop of quant.cuh reached 0.3-1.1 TB/s. It converted each code with I2F
// (a quarter-rate instruction on Hopper: 8 per word caps a GEMV near 2.3 TB/s before anything
// else), re-read x for every row, and had 32 bytes in flight per lane.
//
// The unit of work is a chunk: 32 consecutive inputs of one weight row, i.e. one 16-byte load of
// 4-bit codes (two for 8-bit), plus the group's scale and bias (a chunk never straddles a group:
// the group size is a multiple of 32). A lane owns one chunk position of the row for the whole
// kernel and keeps its 32 x values in registers as f32 (x is the same for every row), so the loop
// loads weights only, U chunks (of U different rows) in flight per lane before any is used.
//
// Dequantisation without conversions: a code is placed by one byte permute (PRMT) into the
// mantissa of the float 0.5, which then holds exactly 0.5 + q·2^-m. 4-bit: the word is shifted
// and masked once per 8 codes so each nibble sits in bits 3..6 of a byte, permuted into bits
// 16..23: f = 0.5 + q/32, one FMA per code into Σ f·x, the 0.5·Σx taken out per chunk (2 + 1/4
// instructions per weight, 3.4 with an exact subtraction per code: the loop is issue-bound on
// the H200 near the bandwidth roofline, so each instruction per weight matters). 8-bit (the
// router, 0.6 MB): the byte in bits 8..15, 0.5 subtracted exactly per code (Sterbenz). Then the
// chunk contributes s·Σ q_k x_k + b·Σ x_k, as cpu/matmul.rs computes per word.
// Each batch's loads are issued before the previous batch is computed (two register sets of U
// chunks), so a warp has its next weights in flight while it computes and reduces.

// Layout requirements (checked on the host): bf16 scales/biases, BITS 4 or 8, inp a multiple of
// 32, the group size a multiple of 32; the matrix's rows are 16-byte aligned (inp·BITS/8 is).

// Warps per block of the streaming GEMVs (each takes one slice of K).
#define SW_WARPS 8

// One chunk as a lane loads it: 32 codes (one uint4 of 4-bit, two of 8-bit) and the raw bf16 bits
// of its group's scale and bias (widened where they are used: widening at the load would make
// the lane wait for the load there, serialising the chunks in flight).
template <int BITS>
struct SwUnit {
    uint4 w[BITS / 4];
    u16 s, b;
};

// Where a lane's chunk sits in every row of the matrices of one launch (all of one width `inp`
// and group size, checked on the host): computed once per kernel, so that a load costs no
// integer division.
struct SwLane {
    int ch;   // the chunk: inputs 32ch .. 32ch+31
    u32 gpr;  // groups per row (inp / gs)
    u32 gch;  // the chunk's group within its row (32ch / gs)
};

__device__ __forceinline__ SwLane sw_lane(const QMat& m, int ch) {
    SwLane l;
    l.ch = ch;
    l.gpr = (u32)(m.inp / m.gs);
    l.gch = (u32)(ch * 32 / m.gs);
    return l;
}

// A streaming 16-byte load: read once per token, so it should not displace x, scales or states in
// L1 (the data still passes through L2).
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// The lane's chunk of row o of matrix e.
template <int BITS>
__device__ __forceinline__ void sw_load(const QMat& m, int e, int o, const SwLane& l, SwUnit<BITS>& un) {
    constexpr int WSHIFT = BITS == 4 ? 3 : 2;  // u32 words per row = inp >> WSHIFT
    const u32* row = (const u32*)m.w + (u64)e * m.wpm + (u64)o * (u64)(m.inp >> WSHIFT);
    const uint4* p = (const uint4*)row + l.ch * (BITS / 4);
#pragma unroll
    for (int i = 0; i < BITS / 4; i++) un.w[i] = ld_stream16(p + i);
    const u64 g = (u64)e * m.gpm + (u64)o * l.gpr + l.gch;
    un.s = __ldg((const unsigned short*)m.s + g);
    un.b = __ldg((const unsigned short*)m.b + g);
}

template <int BITS>
__device__ __forceinline__ void sw_zero(SwUnit<BITS>& un) {
#pragma unroll
    for (int i = 0; i < BITS / 4; i++) un.w[i] = make_uint4(0u, 0u, 0u, 0u);
    un.s = un.b = 0;
}

// 8-bit: q·2^-16 for the code byte b (0..3) of w: the byte permuted into bits 8..15 of 0.5
// (bytes [0, q, 0, 0x3F]: 0.5 + q·2^-16), then 0.5 subtracted, exactly (Sterbenz).
__device__ __forceinline__ float code8_f(u32 w, int b) {
    return __uint_as_float(__byte_perm(w, 0x3F000000u, 0x7404u | ((u32)b << 4))) - 0.5f;
}

// 4-bit: 0.5 + q/32 for the nibble in bits 3..6 of byte b of w (the word pre-shifted and masked
// by sw_dot: one shift and one mask per 8 codes), permuted into bits 16..23 of 0.5 (bytes [0, 0,
// q << 3, 0x3F]). The 0.5 is left in and taken out per chunk (Σ f·x = Σ x / 2 + Σ q·x / 32): one
// instruction per code fewer, for partial sums about three times the magnitude of Σ q·x / 32, so
// an f32 rounding error about three times the CPU's (module header of tests/cuda_ops.rs: F32_TOL
// is ~100 ulps).
__device__ __forceinline__ float code4_f(u32 w, int b) {
    return __uint_as_float(__byte_perm(w, 0x3F000000u, 0x7044u | ((u32)b << 8)));
}

// The chunk's dot with the lane's 32 x values (xs = their sum): s·Σ q·x + b·Σ x.
// 4-bit element 8j + i is nibble i of word j (lowest first); 8-bit element 4j + i is byte i of word j.
template <int BITS>
__device__ __forceinline__ float sw_dot(const SwUnit<BITS>& un, const float (&x)[32], float xs) {
    float a0 = 0.0f, a1 = 0.0f;  // two chains for ILP
    if constexpr (BITS == 4) {
        const u32 ws[4] = {un.w[0].x, un.w[0].y, un.w[0].z, un.w[0].w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            // Nibble 2b (lo) and 2b + 1 (hi) of the word in bits 3..6 of byte b.
            const u32 lo = (ws[j] << 3) & 0x78787878u, hi = (ws[j] >> 1) & 0x78787878u;
#pragma unroll
            for (int b = 0; b < 4; b++) {
                a0 = fmaf(code4_f(lo, b), x[8 * j + 2 * b], a0);
                a1 = fmaf(code4_f(hi, b), x[8 * j + 2 * b + 1], a1);
            }
        }
        // Σ q·x = 32·Σ f·x − 16·Σ x.
        return bf16f(un.s) * fmaf(32.0f, a0 + a1, -16.0f * xs) + bf16f(un.b) * xs;
    } else {
        const u32 ws[8] = {un.w[0].x, un.w[0].y, un.w[0].z, un.w[0].w, un.w[1].x, un.w[1].y, un.w[1].z, un.w[1].w};
#pragma unroll
        for (int j = 0; j < 8; j++) {
#pragma unroll
            for (int b = 0; b < 4; b += 2) {
                a0 = fmaf(code8_f(ws[j], b), x[4 * j + b], a0);
                a1 = fmaf(code8_f(ws[j], b + 1), x[4 * j + b + 1], a1);
            }
        }
        return bf16f(un.s) * (65536.0f * (a0 + a1)) + bf16f(un.b) * xs;
    }
}

// part[u] = the dot of chunk un[u] with the lane's x, summed over the C lanes that share its row
// (lanes r·C .. r·C + C - 1, C a power of two): each row's partial for this warp's slice of K.
template <int BITS, int U, int C>
__device__ __forceinline__ void sw_dots(const SwUnit<BITS> (&un)[U], const float (&xv)[32], float xs, float (&part)[U]) {
#pragma unroll
    for (int u = 0; u < U; u++) part[u] = sw_dot<BITS>(un[u], xv, xs);
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
        for (int off = C >> 1; off > 0; off >>= 1) part[u] += __shfl_xor_sync(FULL_MASK, part[u], off);
}

// The 8 bf16 of one 16-byte word of x widened into xv[8i .. 8i+8).
__device__ __forceinline__ void sw_widen8(const uint4 v, float (&xv)[32], int i) {
    const u32 w4[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        xv[8 * i + 2 * j] = bf16_lo(w4[j]);
        xv[8 * i + 2 * j + 1] = bf16_hi(w4[j]);
    }
}

// The lane's 32 x values from a bf16 activation (inputs 32ch ..), widened, and their sum.
__device__ __forceinline__ float sw_x_act(const u16* __restrict__ x, int ch, float (&xv)[32]) {
    const uint4* p = (const uint4*)(x + (u64)ch * 32);
    float xs = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) sw_widen8(p[i], xv, i);
#pragma unroll
    for (int i = 0; i < 32; i++) xs += xv[i];
    return xs;
}

// The 8 bf16 of xv[8i .. 8i+8) packed as a uint4 (for writing x back out).
__device__ __forceinline__ uint4 sw_pack8(const float (&xv)[32], int i) {
    u32 w[4];
#pragma unroll
    for (int j = 0; j < 4; j++) w[j] = (u32)bf16_rn(xv[8 * i + 2 * j]) | ((u32)bf16_rn(xv[8 * i + 2 * j + 1]) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// 32 consecutive f32 values (16-byte aligned) into registers.
__device__ __forceinline__ void sw_ld32(const float* __restrict__ p, float (&xv)[32]) {
    const float4* p4 = (const float4*)p;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const float4 v = p4[i];
        xv[4 * i] = v.x;
        xv[4 * i + 1] = v.y;
        xv[4 * i + 2] = v.z;
        xv[4 * i + 3] = v.w;
    }
}

// The lane's 32 x values of the norm prologue, bf16(h · rr · w) widened (inputs 32ch ..), with the
// rms_norm kernel's exact expression, and their sum.
__device__ __forceinline__ float sw_x_norm(const float* __restrict__ h, const float* __restrict__ w, float rr, int ch, float (&xv)[32]) {
    const float4* h4 = (const float4*)(h + ch * 32);
    const float4* w4 = (const float4*)(w + ch * 32);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const float4 hv = h4[i], wv = w4[i];
        xv[4 * i] = bf16f(bf16_rn(hv.x * rr * wv.x));
        xv[4 * i + 1] = bf16f(bf16_rn(hv.y * rr * wv.y));
        xv[4 * i + 2] = bf16f(bf16_rn(hv.z * rr * wv.z));
        xv[4 * i + 3] = bf16f(bf16_rn(hv.w * rr * wv.w));
    }
    float xs = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; i++) xs += xv[i];
    return xs;
}

// 1 / sqrt(mean(h²) + eps) over a block of T threads, with the rms_norm kernel's exact arithmetic
// (thread t sums h[t]², h[t + T]², ... in that order, then the same block_sum, the same
// expression). K and T compile-time, the loads unrolled: all K / T of a thread's loads are in
// flight at once. With the loop's stride read from blockDim (as rms_norm's), they were K / T
// dependent L2 round trips on every normed decode kernel's critical path: leaving the norm out
// of moe_step_gate_up made decode at 4K 568 against 494 tok/s (LILY_MOE_STEP_PROBE=4), 6.6 µs
// a layer for an 8 KB read.
template <int K, int T>
__device__ __forceinline__ float sw_rms_scale(const float* __restrict__ h, float eps, float* sh) {
    static_assert(K % T == 0, "the block's threads must divide K");
    float v[K / T];
#pragma unroll
    for (int j = 0; j < K / T; j++) v[j] = h[threadIdx.x + T * j];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < K / T; j++) ss += v[j] * v[j];
    ss = block_sum(ss, sh);
    return 1.0f / sqrtf(ss / (float)K + eps);
}
