// wide.cuh: the "wide" weight loads of the one-wave decode kernels (moe.cu's moe_wide_*, gemv.cu's
// gemv_wide_*): every block requests ALL of its weights at once, before computing anything. Each
// lane copies its own stream.cuh chunks (16 B of codes per 32 inputs, and the 4-byte words holding
// its group's bf16 scale and bias) into its own slots of shared memory with cp.async, one commit
// group per row group, then computes row group after row group as they land
// (cp.async.wait_group, no barrier: a lane reads back only what it copied). Nothing is held in
// registers while in flight, so the depth costs no registers. moe.cu's moe_wide note says why
// (bytes in flight against the DRAM latency on the H200).
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
