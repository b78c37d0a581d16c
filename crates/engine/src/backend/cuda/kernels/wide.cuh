// wide.cuh: the "wide" weight loads of the one-wave decode kernels (moe.cu's moe_wide_*; gemv.cu's
// gemv_wide_* too until stop 55, measured slower: 0.86x): every block requests ALL of its weights
// at once, before computing anything. Each lane copies its own stream.cuh chunks (16 B of codes
// per 32 inputs, and the 4-byte words holding its group's bf16 scale and bias) into its own slots
// of shared memory with cp.async, one commit group per row group, then computes row group after
// row group as they land (cp.async.wait_group, no barrier: a lane reads back only what it
// copied). Nothing is held in registers while in flight, so the depth costs no registers.
// moe.cu's moe_wide note says why (bytes in flight against the DRAM latency on the H200).
// Needs stream.cuh (SwUnit, SwLane) and tc_stream.cuh (cp16, cp4, cp_wait).

// cp.async.wait_group with a count known only after unrolling.
__device__ __forceinline__ void cp_wait_n(int n) {
    switch (n) {
    case 0: cp_wait<0>(); break;
    case 1: cp_wait<1>(); break;
    case 2: cp_wait<2>(); break;
    case 3: cp_wait<3>(); break;
    case 4: cp_wait<4>(); break;
    case 5: cp_wait<5>(); break;
    case 6: cp_wait<6>(); break;
    case 7: cp_wait<7>(); break;
    case 8: cp_wait<8>(); break;
    case 9: cp_wait<9>(); break;
    case 10: cp_wait<10>(); break;
    case 11: cp_wait<11>(); break;
    case 12: cp_wait<12>(); break;
    case 13: cp_wait<13>(); break;
    case 14: cp_wait<14>(); break;
    default: cp_wait<15>(); break;
    }
}

// sw_load's chunk (row o of matrix e, the lane's chunk), copied into shared memory: its BITS/4
// 16-byte code parts at code, code + cstride, ...; the 4-byte words holding its group's scale and
// bias at sw and bw (the group's half: its parity, gch & 1, as groups per row and per matrix are
// even). ok false: zeros are written (src-size 0; the caller passes a row that exists, e.g. 0).
template <int BITS>
__device__ __forceinline__ void wide_issue(const QMat& m, int e, int o, const SwLane& l, u32 code, u32 cstride, u32 sw, u32 bw, bool ok) {
    constexpr int WSHIFT = BITS == 4 ? 3 : 2;
    const u32* row = (const u32*)m.w + (u64)e * m.wpm + (u64)o * (u64)(m.inp >> WSHIFT);
    const uint4* p = (const uint4*)row + l.ch * (BITS / 4);
#pragma unroll
    for (int i = 0; i < BITS / 4; i++) cp16(code + i * cstride, p + i, ok);
    const u64 g = (u64)e * m.gpm + (u64)o * l.gpr + l.gch;
    cp4(sw, (const u32*)m.s + (g >> 1), ok);
    cp4(bw, (const u32*)m.b + (g >> 1), ok);
}

// The chunk wide_issue copied, back from shared memory (generic pointers into the same slots).
template <int BITS>
__device__ __forceinline__ void wide_fetch(const unsigned char* code, int cstride, const u32* sw, const u32* bw, int half, SwUnit<BITS>& un) {
#pragma unroll
    for (int i = 0; i < BITS / 4; i++) un.w[i] = *(const uint4*)(code + i * cstride);
    un.s = (u16)(*sw >> (16 * half));
    un.b = (u16)(*bw >> (16 * half));
}

// ---- The same weights fetched by the Tensor Memory Accelerator (switch `down_tma`, on by
// default: moe.cu's moe_tma_down_*; until stop 56 also the opt-ins gu_tma, proj_tma and tc_tma,
// moe.cu's gate|up and gemv.cu's projections, all measured slower on the H100). One thread issues
// cp.async.bulk copies of contiguous rows (codes, then scales, then biases: three copies, each a
// multiple of 16 bytes at 16-byte aligned addresses, the host checks) into shared memory in the
// matrices' own row-major layout, counted on an mbarrier; the lanes that read them wait on its
// phase. Why: stop 27's skeleton found a block's weights copied by per-thread 16-byte cp.async
// land at ~1.6 TB/s however deep the ring, and a bulk copy moves kilobytes an instruction; stop
// 54's skeleton (tools/probes/step_skeleton.cu, chainT) put a chain phase of 8.4 MB at 3.90 µs
// this way against 4.45 (H100). A bulk copy's operands are uniform: lanes of one warp that issue
// copies do so one after another.
__device__ __forceinline__ void mbar_init1(u64* m) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(m)) : "memory");
    // The initialisation visible to the async proxy (the copies' complete_tx) before any copy.
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Spins until the mbarrier's phase `parity` has completed (every expected byte landed). Call from
// a whole warp: it reconverges before returning, so the shuffles after it need no fallback path
// (a spin left to each lane made ptxas duplicate the dot loop under WARPSYNC / ENDCOLLECTIVE).
__device__ __forceinline__ void mbar_wait_parity(u64* m, u32 parity) {
    u32 done = 0;
    while (!done) {
        asm volatile(
            "{\n\t.reg .pred p;\n\t"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
            "selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"(smem_u32(m)), "r"(parity)
            : "memory");
        done = __all_sync(FULL_MASK, done);
    }
}
// The arrival that opens the phase: `bytes` of copies expected on m.
__device__ __forceinline__ void mbar_expect(u64* m, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(m)), "r"(bytes) : "memory");
}
// `bytes` (a multiple of 16) from global src into shared dst, completion counted on m.
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u64* m) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst), "l"(src), "r"(bytes),
                 "r"(smem_u32(m))
                 : "memory");
}

// Rows o0 .. o0 + n - 1 of matrix e of m (4- or 8-bit, bf16 scales and biases): codes
// [n][inp·BITS/8], then scales [n][gpr] u16, then biases [n][gpr] u16 at `dst`, counted on mb.
// One thread calls it.
template <int BITS>
__device__ __forceinline__ void tma_rows(const QMat& m, int e, int o0, int n, u32 dst, u64* mb) {
    const u32 rowb = (u32)m.inp * BITS / 8, gpr = (u32)(m.inp / m.gs);
    const u32 cb = (u32)n * rowb, sb = (u32)n * gpr * 2;
    mbar_expect(mb, cb + 2 * sb);
    const unsigned char* w = (const unsigned char*)m.w + ((u64)e * m.wpm) * 4 + (u64)o0 * rowb;
    const u64 g = (u64)e * m.gpm + (u64)o0 * gpr;
    bulk_copy(dst, w, cb, mb);
    bulk_copy(dst + cb, (const u16*)m.s + g, sb, mb);
    bulk_copy(dst + cb + sb, (const u16*)m.b + g, sb, mb);
}

// The lane's chunk of row `row` of what tma_rows copied to `base` (n rows), as sw_load reads it
// from global memory: the same SwUnit, so the same dot.
template <int BITS>
__device__ __forceinline__ void tma_fetch(const unsigned char* base, int n, int rowb, int gpr, int row, const SwLane& l, SwUnit<BITS>& un) {
    const uint4* p = (const uint4*)(base + row * rowb) + l.ch * (BITS / 4);
#pragma unroll
    for (int i = 0; i < BITS / 4; i++) un.w[i] = p[i];
    // The bf16 scales after the n rows' codes (row i's group c at [i·gpr + c]), the biases n·gpr
    // further.
    const u16* s = (const u16*)(base + n * rowb);
    un.s = s[row * gpr + l.gch];
    un.b = s[n * gpr + row * gpr + l.gch];
}
