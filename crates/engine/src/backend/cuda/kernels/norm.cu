// norm.cu: RMS norm (plain and fused with the residual add) and the small elementwise ops.
// Matches cpu/norm.rs: rms_norm, add_rms_norm, swiglu, add_sigmoid_gated, and Cpu::add.
//
// Layouts: row-major [rows, dim]. The residual stream h (x of rms_norm) and the shared-expert gate
// logit s are f32; the rest are bf16 activations (common.cuh). Norms: one block of 256 threads
// per row (grid = rows), f32 sum of squares reduced in the block; r = 1/sqrt(ss/dim + eps);
// out = (x*r)*w, the CPU's order, rounded to bf16. Elementwise ops: one thread per element,
// 256-thread blocks, grid = ceil(len/256), f32 arithmetic on the widened values.

extern "C" __global__ void __launch_bounds__(256)
rms_norm(const float* __restrict__ x, const float* __restrict__ w, u16* __restrict__ out, int dim, float eps) { KTRACE(); PDL_ENTRY();
    __shared__ float sh[32];
    const float* xr = x + (u64)blockIdx.x * dim;
    u16* o = out + (u64)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, sh);
    float r = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = bf16_rn(xr[i] * r * w[i]);
}

// h += r (in place), then out = rms_norm(h) * w.
extern "C" __global__ void __launch_bounds__(256)
add_rms_norm(float* __restrict__ h, const u16* __restrict__ res, const float* __restrict__ w, u16* __restrict__ out,
             int dim, float eps) { KTRACE(); PDL_ENTRY();
    __shared__ float sh[32];
    float* hr = h + (u64)blockIdx.x * dim;
    const u16* rr = res + (u64)blockIdx.x * dim;
    u16* o = out + (u64)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = hr[i] + bf16f(rr[i]);
        hr[i] = v;
        ss += v * v;
    }
    ss = block_sum(ss, sh);
    float r = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = bf16_rn(hr[i] * r * w[i]);
}

extern "C" __global__ void add_inplace(float* __restrict__ h, const u16* __restrict__ r, u64 len) { KTRACE(); PDL_ENTRY();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) h[i] += bf16f(r[i]);
}

extern "C" __global__ void swiglu(const u16* __restrict__ g, const u16* __restrict__ u, u16* __restrict__ out, u64 len) { KTRACE(); PDL_ENTRY();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) out[i] = bf16_rn(silu_f(bf16f(g[i])) * bf16f(u[i]));
}

// y[t, :] += sigmoid(s[t]) * shared[t, :]
extern "C" __global__ void add_sigmoid_gated(u16* __restrict__ y, const u16* __restrict__ shared, const float* __restrict__ s,
                                             int rows, int dim) { KTRACE(); PDL_ENTRY();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)rows * dim) return;
    float g = sigmoid_f(s[i / dim]);
    y[i] = bf16_rn(bf16f(y[i]) + g * bf16f(shared[i]));
}
