// tc_stream.cuh: the weight-streaming decode dot on tensor cores (gemv.cu's tc_gemv_*, moe.cu's
// moe_tc_*): one row of x against 16-row tiles of a 4-bit matrix (group size 64, bf16 scales and
// biases), every weight read once per token. Same function as stream.cuh's SIMT loop
// (s·Σ q·x + b·Σ x per group, f32), to f32 summation order.
//
// Why: the SIMT loop is issue-bound at ~5 instructions per weight per lane (lily lab: 2.3-2.8× a
// pure read of the same bytes). Here a code costs 1.5 instructions (shift, mask|or, one exact
// bf16x2 subtraction per pair) and the multiply-adds are one mma.sync per 128 weights per warp.
//
// Exactness: A is the codes q themselves as bf16 (0x4300|q = 128 + q, exact; minus 128 with one
// bf16x2 FMA, exact), B is x (bf16 activations), so every product is exact in f32 and the mma sums
// them in f32. (Leaving the 128 in and taking 128·Σx out per group would save the subtraction but
// sum values ~17× larger, an f32 error above the op tests' F32_TOL.)
//
// Geometry (mma.cuh's m16n8k16 fragments; lane = 4g + t): a warp covers NS spans of 128 inputs
// of K (span i: inputs 128·(sb + i) .. +127, sb = the warp's first span). In span i, lane t owns
// the chunk of inputs 32t .. 32t + 31 (one 16-byte load per row) of rows g and g + 8 of the tile;
// chunk t lies in group 2(sb + i) + t/2. Mma step s (0..7) of the span takes, in lane t's four
// k-slots (2t, 2t+1, 2t+8, 2t+9), nibbles (p, p+4) and (p+1, p+5) of word s/2 of its chunk,
// p = 2(s % 2): the k order inside a span is permuted, identically for A and B (a dot does not
// care). The group sums come out in separate columns of D: column n of B holds x only at the
// k-slots of the chunks of group n (2i + t/2 for span i), zeros elsewhere, so
// D[row, 2i + h] = Σ q·x over group 2(sb + i) + h for NS ≤ 4 (8 columns). Lane (g, t) then holds
// columns 2t, 2t+1 of rows g, g+8: the two groups of span t (t < NS), which it scales with their
// s and b (one u32 load each: two bf16), and the 4 lanes of a row sum by shuffles.
// B is built once per kernel: lane (g, t) holds x only when g = 2i + t/2 for some span i < NS
// (its chunk: inputs 128·(sb + g/2) + 32t ..), zeros otherwise.

// A lane's share of one 16-row tile: its chunk of rows g and g+8 in each span, and (lanes t < NS)
// the scale and bias pairs (groups 2(sb + t), +1) of those two rows.
template <int NS>
struct TcTile {
    uint4 a[NS], b[NS];
    u32 sa, ba, sb, bb;
};

// Rows r0 + g and r0 + g + 8 of matrix e of m (zeros past `rows`); span base sb (in spans).
template <int NS>
__device__ __forceinline__ void tc_load(const QMat& m, int e, int r0, int rows, int sb, int g, int t, TcTile<NS>& T) {
    const u64 rw = (u64)(m.inp >> 3);  // u32 words per row
    const u32 gpr = (u32)(m.inp >> 6);
    const int ra = r0 + g, rb = r0 + g + 8;
    const u32* wa = (const u32*)m.w + (u64)e * m.wpm + (u64)ra * rw + (u64)sb * 16 + 4 * t;
    const u32* wb = (const u32*)m.w + (u64)e * m.wpm + (u64)rb * rw + (u64)sb * 16 + 4 * t;
#pragma unroll
    for (int i = 0; i < NS; i++) {
        T.a[i] = ra < rows ? ld_stream16(wa + 16 * i) : make_uint4(0u, 0u, 0u, 0u);
        T.b[i] = rb < rows ? ld_stream16(wb + 16 * i) : make_uint4(0u, 0u, 0u, 0u);
    }
    T.sa = T.ba = T.sb = T.bb = 0u;
    if (t < NS) {
        const u64 ga = (u64)e * m.gpm + (u64)ra * gpr + 2 * (sb + t), gb = (u64)e * m.gpm + (u64)rb * gpr + 2 * (sb + t);
        if (ra < rows) {
            T.sa = __ldg((const u32*)((const u16*)m.s + ga));
            T.ba = __ldg((const u32*)((const u16*)m.b + ga));
        }
        if (rb < rows) {
            T.sb = __ldg((const u32*)((const u16*)m.s + gb));
            T.bb = __ldg((const u32*)((const u16*)m.b + gb));
        }
    }
}

// Nibbles p and p+4 of w as a bf16x2 of the codes (nibble p in the low half), exactly.
__device__ __forceinline__ u32 tc_pair(u32 w, int p) {
    const u32 v = ((w >> (4 * p)) & 0x000F000Fu) | 0x43004300u;  // 128 + q, exact in bf16
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(0x3F803F80u), "r"(0xC300C300u));  // (128 + q)·1 − 128
    return r;
}

__device__ __forceinline__ u32 tc_word(const uint4& v, int j) { return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w; }

// d = the tile's group dots (columns as the header says). Two accumulator chains per span, summed
// at the end: one chain of 8·NS dependent mma.sync (~30 cycles each) measured slower than the
// SIMT loop it replaces.
// With 4 spans (the experts' down projection) the spans alone are 4 chains (registers).
template <int NS>
__device__ __forceinline__ void tc_dot(const TcTile<NS>& T, const u32 (&xb)[NS][8][2], float (&d)[4]) {
    constexpr int CH = NS >= 4 ? 1 : 2;
    float c[NS][CH][4];
#pragma unroll
    for (int i = 0; i < NS; i++)
#pragma unroll
        for (int h = 0; h < CH; h++)
#pragma unroll
            for (int r = 0; r < 4; r++) c[i][h][r] = 0.0f;
#pragma unroll
    for (int s = 0; s < 8; s++)
#pragma unroll
        for (int i = 0; i < NS; i++) {
            const u32 wa = tc_word(T.a[i], s / 2), wb = tc_word(T.b[i], s / 2);
            const int p = 2 * (s % 2);
            const u32 a[4] = {tc_pair(wa, p), tc_pair(wb, p), tc_pair(wa, p + 1), tc_pair(wb, p + 1)};
            mma_bf16_16816(c[i][s % CH], a, xb[i][s][0], xb[i][s][1]);
        }
#pragma unroll
    for (int r = 0; r < 4; r++) {
        d[r] = 0.0f;
#pragma unroll
        for (int i = 0; i < NS; i++)
#pragma unroll
            for (int h = 0; h < CH; h++) d[r] += c[i][h][r];
    }
}

// The rows' dots over the warp's spans, in every lane: ra for row g, rb for row g + 8. xs2: Σx of
// the lane's two groups (span t), meaningful for t < NS.
template <int NS>
__device__ __forceinline__ void tc_finish(const TcTile<NS>& T, const float (&d)[4], float xs0, float xs1, int t, float& ra, float& rb) {
    ra = rb = 0.0f;
    if (t < NS) {
        ra = fmaf(bf16_lo(T.sa), d[0], bf16_lo(T.ba) * xs0) + fmaf(bf16_hi(T.sa), d[1], bf16_hi(T.ba) * xs1);
        rb = fmaf(bf16_lo(T.sb), d[2], bf16_lo(T.bb) * xs0) + fmaf(bf16_hi(T.sb), d[3], bf16_hi(T.bb) * xs1);
    }
    ra += __shfl_xor_sync(FULL_MASK, ra, 1);
    rb += __shfl_xor_sync(FULL_MASK, rb, 1);
    ra += __shfl_xor_sync(FULL_MASK, ra, 2);
    rb += __shfl_xor_sync(FULL_MASK, rb, 2);
}

// The chunk whose x lane (g, t) holds for B (in chunks of 32 inputs), or -1: span g/2 of the
// warp when g % 2 == t / 2.
template <int NS>
__device__ __forceinline__ int tc_chunk(int sb, int g, int t) {
    return (g / 2 < NS && (g & 1) == (t >> 1)) ? (sb + g / 2) * 4 + t : -1;
}

// B fragments from the lane's 32 x values (zeros when it holds none: ch < 0).
template <int NS>
__device__ __forceinline__ void tc_build_b(const float (&xv)[32], int ch, int g, u32 (&xb)[NS][8][2]) {
#pragma unroll
    for (int s = 0; s < 8; s++) {
        const int in = 8 * (s / 2) + 2 * (s % 2);
        const u32 b0 = pack_bf16x2(xv[in], xv[in + 4]), b1 = pack_bf16x2(xv[in + 1], xv[in + 5]);
#pragma unroll
        for (int i = 0; i < NS; i++) {
            const bool mine = ch >= 0 && g / 2 == i;
            xb[i][s][0] = mine ? b0 : 0u;
            xb[i][s][1] = mine ? b1 : 0u;
        }
    }
}

// From the lane's 32 x values (chunk ch, or none: ch < 0) and their sum xs: the B fragments, and
// Σx of the lane's two groups (span t of the warp) through shared memory `xsum` [K/32] (chunk
// sums; a block barrier between the writes and the reads, so every thread of the block calls it).
template <int NS>
__device__ __forceinline__ void tc_setup_x(const float (&xv)[32], float xs, int ch, float* xsum, int sb, int g, int t, u32 (&xb)[NS][8][2],
                                           float& xs0, float& xs1) {
    if (ch >= 0) xsum[ch] = xs;
    tc_build_b<NS>(xv, ch, g, xb);
    __syncthreads();
    xs0 = xs1 = 0.0f;
    if (t < NS) {
        const int c0 = (sb + t) * 4;
        xs0 = xsum[c0] + xsum[c0 + 1];
        xs1 = xsum[c0 + 2] + xsum[c0 + 3];
    }
}

// ---- Staging through shared memory (cp.async). Registers bound the bytes a lane can have in
// flight (two register sets of one tile: 32 KB per SM), and at the loaded latency of HBM that caps
// a GEMV near 2 TB/s. Each lane instead copies its own 16-byte chunks (and scale/bias words) of a
// tile straight into a per-warp slot of shared memory, several batches ahead, and reads back only
// what it copied itself: no barrier is needed between the copy and the read, only
// cp.async.wait_group. A tile's slot per warp: 2·NS chunks of 16 B per lane (rows g, g+8 of each
// span) then 16 B per lane of scale/bias words: (2·NS + 1)·512 bytes.

template <int NS>
struct TcSlot {
    static constexpr int BYTES = (2 * NS + 1) * 512;
};

__device__ __forceinline__ void cp16(u32 dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp4(u32 dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(ok ? 4 : 0) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// A norm weight (K f32, 16-byte aligned) copied into shared memory `dst` by the block's T threads
// (16 bytes per copy), in the caller's open commit group: every decode kernel with a norm
// prologue (gemv.cu sw_gemv and tc_gemv with prologue 1, moe.cu's moe_step gate|up)
// issues it before its PDL wait, so that the x of sw_x_norm reads it from shared memory after
// the block's sum of squares. Why not a prefetch into L1 (sw_prefetch_norm, what they did
// before): the PDL wait (griddepcontrol.wait) is an acquire,
// and the L1 lines fetched before it are not what the loads after it read; the weight then came
// from L2 or DRAM after the sum, one more round trip on every normed kernel's critical path
// (the router's x took 5.0 us after its wait at 4K, trace of stop 24).
template <int K, int T>
__device__ __forceinline__ void cp_stage_norm(const float* __restrict__ w, u32 dst) {
    static_assert(K % 4 == 0, "16-byte copies");
#pragma unroll
    for (int i = 0; i < (K / 4 + T - 1) / T; i++) {
        const int q = (int)threadIdx.x + T * i;
        if ((K / 4) % T == 0 || q < K / 4) cp16(dst + 16 * q, w + 4 * q, true);
    }
}

// tc_load's tile, copied into the slot at shared address `slot` (this warp's), zeros past `rows`.
// A source address past the end is never formed for a row that is not copied (src-size 0 still
// needs a valid-looking address: the row is clamped to 0).
template <int NS>
__device__ __forceinline__ void tc_issue(const QMat& m, int e, int r0, int rows, int sb, int g, int t, int lane, u32 slot) {
    const u64 rw = (u64)(m.inp >> 3);
    const u32 gpr = (u32)(m.inp >> 6);
    const int ra = r0 + g, rb = r0 + g + 8;
    const bool oa = ra < rows, ob = rb < rows;
    const u32* wa = (const u32*)m.w + (u64)e * m.wpm + (u64)(oa ? ra : 0) * rw + (u64)sb * 16 + 4 * t;
    const u32* wb = (const u32*)m.w + (u64)e * m.wpm + (u64)(ob ? rb : 0) * rw + (u64)sb * 16 + 4 * t;
#pragma unroll
    for (int i = 0; i < NS; i++) {
        cp16(slot + (2 * i) * 512 + lane * 16, wa + 16 * i, oa);
        cp16(slot + (2 * i + 1) * 512 + lane * 16, wb + 16 * i, ob);
    }
    if (t < NS) {
        const u64 ga = (u64)e * m.gpm + (u64)(oa ? ra : 0) * gpr + 2 * (sb + t), gb = (u64)e * m.gpm + (u64)(ob ? rb : 0) * gpr + 2 * (sb + t);
        const u32 sc = slot + 2 * NS * 512 + lane * 16;
        cp4(sc, (const u16*)m.s + ga, oa);
        cp4(sc + 4, (const u16*)m.b + ga, oa);
        cp4(sc + 8, (const u16*)m.s + gb, ob);
        cp4(sc + 12, (const u16*)m.b + gb, ob);
    }
}

// The lane's share of the tile in `slot` (generic pointer to this warp's slot), once its copies
// have landed.
template <int NS>
__device__ __forceinline__ void tc_fetch(const unsigned char* slot, int t, int lane, TcTile<NS>& T) {
#pragma unroll
    for (int i = 0; i < NS; i++) {
        T.a[i] = *(const uint4*)(slot + (2 * i) * 512 + lane * 16);
        T.b[i] = *(const uint4*)(slot + (2 * i + 1) * 512 + lane * 16);
    }
    if (t < NS) {
        const uint4 v = *(const uint4*)(slot + 2 * NS * 512 + lane * 16);
        T.sa = v.x;
        T.ba = v.y;
        T.sb = v.z;
        T.bb = v.w;
    } else {
        T.sa = T.ba = T.sb = T.bb = 0u;
    }
}
