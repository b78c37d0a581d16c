// ceiling.cu: the device's own ceilings for `lily bench` (backend/cuda/ceiling.rs). These kernels
// only measure; they compute nothing the model uses, so they have no CPU twin and no op test
// (tests/cuda_ceiling.rs checks that the figures are plausible).
//
// ceiling_fill_bf16  p [n] bf16 (raw u16) <- hash(i, seed) as a value in [-1, 1): GEMM operands
//                    that toggle bits like real data (zeros would draw less power and clock
//                    higher). Grid-stride; any grid, 256 threads.
// ceiling_copy       dst [n] <- src [n], n in 16-byte words (uint4), both 16-byte aligned: the
//                    copy-bandwidth probe, raced against cuMemcpyDtoD. Grid-stride with four loads
//                    in flight per thread before the stores; launch 4 blocks of 512 per SM (one wave).
// ceiling_mma        the bf16 tensor-core rate of mma.sync m16n8k16 (f32 accumulators) with every
//                    operand in registers (no memory traffic): the fallback matrix ceiling when
//                    cuBLAS cannot be loaded. Each warp runs MMA_CHAINS independent accumulator
//                    chains for `iters` steps (4096 FLOP per mma); A/B fragments come from a hash
//                    of the thread, so nothing folds. out [gridDim.x·blockDim.x] f32 receives each
//                    thread's accumulator sum (keeps the work live). Launch 4 blocks of 256 per SM.

#define MMA_CHAINS 8

// A bf16 in [-1, 1) from 24 random bits (upper half of the f32's bits: the bf16 itself).
__device__ __forceinline__ u16 ceiling_bf16(u32 h) {
    float v = (float)(h >> 8) * (2.0f / 16777216.0f) - 1.0f;
    return (u16)(__float_as_uint(v) >> 16);
}

extern "C" __global__ void __launch_bounds__(256)
ceiling_fill_bf16(u16* __restrict__ p, u64 n, u32 seed) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        p[i] = ceiling_bf16(mix_hash(i ^ ((u64)seed << 40)));
}

extern "C" __global__ void __launch_bounds__(512)
ceiling_copy(const uint4* __restrict__ src, uint4* __restrict__ dst, u64 n) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
        dst[i] = a;
        dst[i + stride] = b;
        dst[i + 2 * stride] = c;
        dst[i + 3 * stride] = d;
    }
    for (; i < n; i += stride) dst[i] = src[i];
}

extern "C" __global__ void __launch_bounds__(256)
ceiling_mma(float* __restrict__ out, int iters) {
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u32 a[4], b[2];
#pragma unroll
    for (int r = 0; r < 4; r++) {
        u32 h = mix_hash(4 * t + r);
        a[r] = (u32)ceiling_bf16(h) | ((u32)ceiling_bf16(h * 2654435761u) << 16);
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        u32 h = mix_hash(~(2 * t + r));
        b[r] = (u32)ceiling_bf16(h) | ((u32)ceiling_bf16(h * 2654435761u) << 16);
    }
    float c[MMA_CHAINS][4];
#pragma unroll
    for (int j = 0; j < MMA_CHAINS; j++) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.0f;
    for (int i = 0; i < iters; i++) {
#pragma unroll
        for (int j = 0; j < MMA_CHAINS; j++) mma_bf16_16816(c[j], a, b[0], b[1]);
    }
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < MMA_CHAINS; j++) s += c[j][0] + c[j][1] + c[j][2] + c[j][3];
    out[t] = s;
}
