// sample.cu: picking the next token on the device. Matches Cpu::argmax (first index on ties).
//
// argmax  logits [rows, vocab] f32 -> out [rows] u32. One block of 1024 threads per row; each
//         thread scans a strided slice, then a block arg-max (value, then lower index) reduces.
//         Sampling with temperature / top-k / top-p comes later, here.

extern "C" __global__ void __launch_bounds__(1024)
argmax(const float* __restrict__ logits, u32* __restrict__ out, int vocab) {
    __shared__ float shv[32];
    __shared__ int shi[32];
    const float* l = logits + (u64)blockIdx.x * vocab;
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = l[i];
        if (better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    block_argmax(bv, bi, shv, shi);
    if (threadIdx.x == 0) out[blockIdx.x] = (u32)(bi == 0x7fffffff ? 0 : bi);
}
