// mma.cuh: tensor-core building blocks shared by tc_gemm.cuh (prefill GEMMs) and attention.cu
// (attn_tc_<HD>), written as inline PTX because NVRTC compiles these files without CUDA headers.
//
// * pack_bf16x2: two f32 to one bf16x2 word, round to nearest even (cvt.rn), lo in the low half.
// * ldsm_x4 / ldsm_x4_trans: ldmatrix of four 8x8 b16 matrices from shared memory; lanes 8i..8i+7
//   give the 8 row addresses (16 bytes each, 16-byte aligned) of matrix i; register i of lane l
//   receives matrix i's row l/4, columns 2(l%4), 2(l%4)+1 (.trans: column l/4, rows 2(l%4), +1).
// * mma_bf16_16816: D = A (16x16, row-major) * B (16x8, "col": n-major, k contiguous) + C, bf16
//   operands, f32 accumulators. Fragments (g = lane/4, c = lane%4): A regs {row g, k 2c..2c+1},
//   {row g+8, same k}, {row g, k+8}, {row g+8, k+8}; B regs {k 2c..2c+1, n g}, {k+8, n g};
//   C/D {row g, n 2c, 2c+1}, {row g+8, n 2c, 2c+1}. sm_80 and later (sm_90 here).

// Two floats to a bf16x2 word, round to nearest even (lo in the low half).
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// c += a (16x16 bf16, row) * b (16x8 bf16, col), f32 accumulators.
__device__ __forceinline__ void mma_bf16_16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

