// lab.cu: the kernel lab of `lily lab` (backend/cuda/lab.rs). These kernels only measure: they make
// weights that nobody checks and read memory to time it, so they have no CPU twin and no op test.
//
// lab_fill_mat  A weight stack in the MLX bf16-scale format (quant.cuh, Fmt::Q4Bf16 / Q8Bf16) filled
//               on the device, so that a lab case needs no host upload (one lm_head copy is 286 MB):
//               w [nw] u32 code words <- hash(i, seed) (every code uniform); s, b [ng] bf16 bits:
//               scale uniform in [0.01, 0.02), bias = -zero * scale (zero = 8 for 4-bit, 128 for
//               8-bit: codes centred on zero, as a quantizer's biases are). Grid-stride over both
//               arrays; any grid, 256 threads.
// lab_read      The pure streaming read the lab sets beside each op: reads n 16-byte words (uint4)
//               of src, 16-byte aligned, grid-stride with four loads in flight per thread before
//               their sum; each block's sum goes to sink[blockIdx.x] (gridDim.x floats) so that no
//               load is optimised away. Launch one wave: at most 4 blocks of 256 per SM, fewer when
//               n is small (about one word per thread).
// lab_touch     One 16-byte word every `stride` words of src, `pages` of them (grid-stride; each
//               block's sum to sink[blockIdx.x]): with a 2 MB stride over tens of GB, every GPU
//               page-table cache entry is replaced while the L2 takes only a line a page
//               (LILY_LAB_FLUSH=2, lab.rs time_graph). Any grid, 256 threads.
// All start with PDL_ENTRY like every kernel of the backend (common.cuh): with LILY_CUDA_PDL=1 a
// pure read waits for the kernel before it and lets the next one launch early, as the ops do.

extern "C" __global__ void __launch_bounds__(256)
lab_fill_mat(u32* __restrict__ w, u64 nw, u16* __restrict__ s, u16* __restrict__ b, u64 ng, u32 seed, float zero) { KTRACE(); PDL_ENTRY();
    u64 stride = (u64)gridDim.x * blockDim.x;
    u64 salt = (u64)seed << 40;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < nw; i += stride) w[i] = mix_hash(i ^ salt);
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < ng; i += stride) {
        u32 h = mix_hash(~(i ^ salt));
        float sc = bf16f(bf16_rn(0.01f + 0.01f * (float)(h >> 8) * (1.0f / 16777216.0f)));
        s[i] = bf16_rn(sc);
        b[i] = bf16_rn(-zero * sc);
    }
}

__device__ __forceinline__ u32 lab_mix(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

extern "C" __global__ void __launch_bounds__(256)
lab_read(const uint4* __restrict__ src, u64 n, float* __restrict__ sink) { KTRACE(); PDL_ENTRY();
    __shared__ float sh[32];
    u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u32 acc = 0;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
        acc += lab_mix(a) + lab_mix(b) + lab_mix(c) + lab_mix(d);
    }
    for (; i < n; i += stride) acc += lab_mix(src[i]);
    float t = block_sum((float)acc, sh);
    if (threadIdx.x == 0) sink[blockIdx.x] = t;
}

extern "C" __global__ void __launch_bounds__(256)
lab_touch(const uint4* __restrict__ src, u64 pages, u64 stride, float* __restrict__ sink) { KTRACE(); PDL_ENTRY();
    __shared__ float sh[32];
    u32 acc = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < pages; i += (u64)gridDim.x * blockDim.x) acc += lab_mix(src[i * stride]);
    float t = block_sum((float)acc, sh);
    if (threadIdx.x == 0) sink[blockIdx.x] = t;
}
