// sample.cu: picking the next token on the device. Matches Cpu::argmax_step (runtime::argmax:
// the first index on ties). Sampling with temperature / top-k / top-p comes later, here.
//
// argmax_partial + argmax_step  the decode loop's greedy pick, fed back on the device: logits
//         [vocab] -> the Step (u32 token, i32 position): token = argmax, position += 1
//         (Cpu::argmax_step). One block reading 1 MB of logits took ~90 us, so the row is split:
//         argmax_partial (grid P, 256 threads) writes each contiguous slice's best (value, index),
//         argmax_step (one block of 1024 threads, P <= 1024) reduces them and writes the step.
//         Ties go to the lower index at both levels, so the pick is the first maximum's.

extern "C" __global__ void __launch_bounds__(256)
argmax_partial(const float* __restrict__ logits, float* __restrict__ pv, int* __restrict__ pi, int vocab) { PDL_ENTRY();
    __shared__ float shv[32];
    __shared__ int shi[32];
    const int per = (vocab + gridDim.x - 1) / gridDim.x;
    const int a = blockIdx.x * per, b = min(vocab, a + per);
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = a + threadIdx.x; i < b; i += blockDim.x) {
        float v = logits[i];
        if (better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    block_argmax(bv, bi, shv, shi);
    if (threadIdx.x == 0) { pv[blockIdx.x] = bv; pi[blockIdx.x] = bi; }
}

extern "C" __global__ void __launch_bounds__(1024)
argmax_step(const float* __restrict__ pv, const int* __restrict__ pi, u32* __restrict__ step, int nparts) { PDL_ENTRY();
    __shared__ float shv[32];
    __shared__ int shi[32];
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < nparts; i += blockDim.x)
        if (better(pv[i], pi[i], bv, bi)) { bv = pv[i]; bi = pi[i]; }
    block_argmax(bv, bi, shv, shi);
    if (threadIdx.x == 0) {
        step[0] = (u32)(bi == 0x7fffffff ? 0 : bi);
        step[1] += 1;
    }
}
