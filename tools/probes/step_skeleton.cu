// step_skeleton.cu: what one dependent phase of a decode step costs at the floor, in the two
// designs issue #13 names, measured side by side on the same work:
//   chain    one kernel per phase, launched with programmatic dependent launch (PDL) and replayed
//            from a CUDA graph: today's decode step (each block requests its weights, waits for
//            the previous kernel with griddepcontrol.wait, lets its dependent launch, reads x);
//   early    the chain with each kernel letting its dependent launch first thing, before its
//            own wait (stop 26's `chain`: every phase slower, even with no weights);
//   plain    the same chain without PDL (each kernel starts when the previous one has ended);
//   persist  one persistent kernel, every block resident, the phases ordered on the device by a
//            grid barrier (fence, atomic arrival, spin on the count: cooperative groups' pattern),
//            each block requesting its next phase's weights before it waits for this phase.
//   deepS    persist with a ring of S weight slices a block (S = 3, 4, 6): S - 1 phases' weights
//            in flight ahead of the one computed, the weight stream running ahead of the
//            dependency chain as in a megakernel (Hazy Research's Llama-1B). Whether a phase then
//            costs the barrier and the arithmetic only, which a chain of kernels cannot reach
//            (PDL lets one kernel ahead request its weights, not several).
//   chainT   chain with the block's weight slice fetched by the Tensor Memory Accelerator: one
//            thread issues cp.async.bulk copies of 16 KB (global -> shared, completion counted on
//            an mbarrier) before the wait, instead of every thread issuing 16-byte cp.async
//   tmaS     deepS with the ring filled the same way (S = 3, 6): the one form stop 27 left
//            unmeasured. Stop 27 found a persistent phase reading at ~1.6 TB/s through cp.async
//            whatever the ring's depth; whether the bulk copies lift that (and the chain's
//            weighted phases) says whether a megakernel's weight stream can run ahead at all.
//   cluster  persist with the dependency cluster-local: clusters of 8 blocks, cluster c owning
//            rows [c·2048/ncl, (c+1)·2048/ncl) of every phase and reading only its own rows of
//            y_p (a block-diagonal GEMV: the same weight bytes), phases ordered by the hardware
//            cluster barrier. What a phase costs when a fusion keeps its dependency inside a
//            cluster (an expert's gate|up -> down, a key head's in_proj -> delta step). Its
//            function differs from the others' (no bit check).
// Each phase p is the decode step's typical op, a normed streaming GEMV of the residual:
//   x = y_p (2048 f32, written by the previous phase: every block reads all of it from L2),
//   rr = 1 / sqrt(mean(x²) + 1e-6) (a block reduction), xq = int8(round(32·x·rr)) (clamped),
//   y_{p+1}[i] = x[i]·rr + 1e-3 · rr · Σ_j W_p[i, j] · xq[j mod 2048]
// (the dot by dp4a, 4 bytes an instruction, so that 8 MB a phase is memory-bound: stop 26's
// scalar loop ran at 0.4 TB/s)
// with W_p int8 [2048, KW] (KW bytes a row, 0 to 4096: 0 to 8 MB a phase), each phase's weights
// distinct, N phases in a row (N·KW·2048 bytes: for KW >= 1024, hundreds of MB, so every phase's
// weights come from DRAM, as in a decode step, where 1.67 GB a token pass through a 60 MB L2).
// Every design computes the same bits (a row by one warp, the same order): checked.
// Launch shape: G blocks of 256 threads (G = 128 or 256: 16 or 8 rows a block, 2 or 1 a warp),
// each block's slice of W_p (rows [b·2048/G, (b+1)·2048/G), contiguous) copied to shared memory
// by cp.async before the wait (double-buffered in persist).
// Why: the in-place trace (lily bench --trace) puts a decode kernel's first phase after its wait
// at 1-5 µs and a token's 264 kernels at 6.7 µs each; 1,000 tok/s at 4K needs ~3.8. This says
// what the chain costs a phase when the work is minimal, what a persistent kernel would, and
// the bandwidth floor (one streaming read of all N phases' weights) beside them.
//
// First it prints how many clusters of 4-16 blocks the GPU holds at once at 32-200 KB of shared
// memory a block: a cluster per MoE slot (9 a layer) needs all 9 resident.
//
// Build and run on the GPU machine (scripts/h200-run skeleton):
//   nvcc -O3 -arch=sm_90 -std=c++17 tools/probes/step_skeleton.cu -o /tmp/skeleton && /tmp/skeleton
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#define CK(x)                                                                 \
    do {                                                                      \
        cudaError_t e_ = (x);                                                 \
        if (e_ != cudaSuccess) {                                              \
            printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                          \
        }                                                                     \
    } while (0)

constexpr int D = 2048;  // the hidden size: every phase's input and output
constexpr int T = 256;   // threads a block (8 warps)

struct Args {
    const int8_t* w;    // phase p's weights at w + p·D·kw: [D][kw] int8
    int kw;             // bytes a row (a multiple of 512; 0: no weights)
    float* y;           // [nph + 1][D]: y[0] the input, y[p + 1] phase p's output
    int nph;            // phases
    unsigned* bar;      // persist: the grid barrier's arrival count (monotonic over launches)
    unsigned epoch;     // persist: arrivals before this launch (launch index · nph · G)
};

__device__ __forceinline__ void cp16(uint32_t dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// The block's slice of phase p's weights into shared memory `dst` (one commit group).
__device__ __forceinline__ void issue_slice(const Args& a, int p, int rpb, unsigned char* dst) {
    if (a.kw > 0) {
        const unsigned char* src = (const unsigned char*)a.w + ((size_t)p * D + (size_t)blockIdx.x * rpb) * a.kw;
        const int n16 = rpb * a.kw / 16;
        for (int i = threadIdx.x; i < n16; i += T) cp16(smem_u32(dst + 16 * i), src + 16 * i);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The block's rpb rows of y_{p+1} from its weight slice ws (kw bytes a row), one warp a row:
// the row's dot of int8 weights with xq (XL int8, cycled) by dp4a.
__device__ __forceinline__ void rows_out(const unsigned char* ws, int kw, int rpb, const int8_t* xq, int XL, const float* xs, float rr,
                                         float* out) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int r = warp; r < rpb; r += 8) {
        int acc = 0;
        if (kw > 0) {
            const uint4* wr = (const uint4*)(ws + (size_t)r * kw);
            for (int c = lane; c < kw / 16; c += 32) {
                const uint4 v = wr[c];
                const uint4 q = *(const uint4*)(xq + ((c * 16) & (XL - 1)));
                acc = __dp4a((int)v.x, (int)q.x, acc);
                acc = __dp4a((int)v.y, (int)q.y, acc);
                acc = __dp4a((int)v.z, (int)q.z, acc);
                acc = __dp4a((int)v.w, (int)q.w, acc);
            }
            acc = __reduce_add_sync(0xffffffffu, acc);
        }
        const int row = blockIdx.x * rpb + r;
        if (lane == 0) out[row] = xs[row & (XL - 1)] * rr + 1e-3f * (float)acc * rr;
    }
}

// x·rr quantized for the dot (every thread of the block; a barrier after).
__device__ __forceinline__ void quantize_x(const float* xs, float rr, int XL, int8_t* xq) {
    for (int i = threadIdx.x; i < XL; i += T) xq[i] = (int8_t)rintf(fminf(fmaxf(32.0f * xs[i] * rr, -127.0f), 127.0f));
    __syncthreads();
}

// rr = 1 / sqrt(Σ x² / n + 1e-6) from each thread's partial sum of squares ss (a block reduction;
// wait_slice runs between the warps' sums and the barrier). Every thread calls it.
template <typename W>
__device__ __forceinline__ float block_rr(float ss, float* sh, int n, W wait_slice) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    ss = warp_sum(ss);
    if (lane == 0) sh[warp] = ss;
    wait_slice();
    __syncthreads();
    if (warp == 0) {
        float t = lane < 8 ? sh[lane] : 0.0f;
        t = warp_sum(t);
        if (lane == 0) sh[8] = t;
    }
    __syncthreads();
    return rsqrtf(sh[8] / (float)n + 1e-6f);
}

// Phase p after its dependency is met: x from L2 into shared memory with the block's sum of
// squares, then (once `wait_slice` has the slice landed) the dots and the block's rows of y_{p+1}.
template <typename W>
__device__ __forceinline__ void phase_body(const Args& a, int p, int rpb, const unsigned char* ws, W wait_slice) {
    __shared__ float xs[D];
    __shared__ float sh[9];
    const int tid = threadIdx.x;
    const float* x = a.y + (size_t)p * D;
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < D / T; i++) {
        const float v = __ldcg(x + tid + T * i);  // L2: written by another block / kernel
        xs[tid + T * i] = v;
        ss += v * v;
    }
    const float rr = block_rr(ss, sh, D, wait_slice);
    __shared__ __align__(16) int8_t xq[D];
    quantize_x(xs, rr, D, xq);
    rows_out(ws, a.kw, rpb, xq, D, xs, rr, a.y + (size_t)(p + 1) * D);
}

// One phase as its own kernel (chain, early: launched with PDL; plain: without, where the
// griddepcontrol instructions do nothing). EARLY: the dependent may launch before this wait.
template <bool EARLY>
__global__ void __launch_bounds__(T) chain_phase(Args a, int p) {
    extern __shared__ __align__(16) unsigned char wsm[];
    const int rpb = D / gridDim.x;
    if (EARLY) asm volatile("griddepcontrol.launch_dependents;" :::);
    issue_slice(a, p, rpb, wsm);  // weights never depend on the previous phase
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (!EARLY) asm volatile("griddepcontrol.launch_dependents;" :::);
    phase_body(a, p, rpb, wsm, [] { asm volatile("cp.async.wait_group 0;" ::: "memory"); });
}

// cp.async.wait_group n for a run-time n (0-7): all but the newest n commit groups have landed.
__device__ __forceinline__ void cp_wait_pending(int n) {
    switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
    case 6: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
    }
}

// ---- The Tensor Memory Accelerator's bulk copies (chainT, tmaS). A slot's mbarrier counts one
// arrival (thread 0's, with the slice's byte count as its transaction count) and completes when
// every byte of the slot's copies has landed; a waiter spins on the phase's parity.
__device__ __forceinline__ void mbar_init(uint64_t* m) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(m)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* m, unsigned parity) {
    asm volatile(
        "{\n\t.reg .pred p;\n"
        "W_%=:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t"
        "@!p bra W_%=;\n}" ::"r"(smem_u32(m)),
        "r"(parity)
        : "memory");
}
constexpr int TMA_PIECE = 16384;  // bytes a bulk copy
// Thread 0: the block's slice of phase p's weights into `dst`, counted on m (bytes a multiple of 16).
__device__ __forceinline__ void tma_slice(const Args& a, int p, int rpb, unsigned char* dst, uint64_t* m) {
    const unsigned bytes = (unsigned)(rpb * a.kw);
    const unsigned char* src = (const unsigned char*)a.w + ((size_t)p * D + (size_t)blockIdx.x * rpb) * a.kw;
    // Earlier generic reads of dst (the previous use of the slot) before the async proxy's writes.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(m)), "r"(bytes) : "memory");
    for (unsigned o = 0; o < bytes; o += TMA_PIECE) {
        const unsigned n = min((unsigned)TMA_PIECE, bytes - o);
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_u32(dst + o)),
                     "l"(src + o), "r"(n), "r"(smem_u32(m))
                     : "memory");
    }
}

// Every phase in one kernel; all blocks resident (the host checks the occupancy). The block's
// weight slices sit in a ring of S buffers: S - 1 phases' weights are in flight ahead of the
// phase being computed (S = 2: one phase ahead, `persist`; S > 2: `deep`, the megakernel form,
// where the weight stream runs ahead of the dependency chain; a buffer is refilled only after
// its phase's dots, so the refill is issued at the top of the next phase). TMA (`tmaS`): the
// ring filled by bulk copies, slot q % S counted on mbarrier q % S, whose use q / S is the
// parity a phase waits for.
template <int S, bool TMA = false>
__global__ void __launch_bounds__(T) persist(Args a) {
    extern __shared__ __align__(16) unsigned char wsm[];
    __shared__ __align__(8) uint64_t mb[TMA ? S : 1];
    const int G = gridDim.x, rpb = D / G;
    const size_t slice = (size_t)rpb * a.kw;
    auto issue = [&](int q) {
        if constexpr (TMA) {
            if (threadIdx.x == 0) tma_slice(a, q, rpb, wsm + (q % S) * slice, &mb[q % S]);
        } else {
            issue_slice(a, q, rpb, wsm + (q % S) * slice);
        }
    };
    if constexpr (TMA) {
        if (threadIdx.x == 0) {
            for (int i = 0; i < S; i++) mbar_init(&mb[i]);
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncthreads();
    }
    for (int q = 0; q < S - 1 && q < a.nph; q++) issue(q);
    for (int p = 0; p < a.nph; p++) {
        const int ahead = p + S - 1;  // the buffer of phase p - 1, free since its dots
        if (ahead < a.nph) issue(ahead);
        if (p > 0) {
            // Wait until every block has finished phase p - 1.
            if (threadIdx.x == 0) {
                const unsigned target = a.epoch + (unsigned)p * G;
                unsigned seen;
                do {
                    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(a.bar) : "memory");
                } while ((int)(seen - target) < 0);
            }
            __syncthreads();
        }
        const int newer = min(S - 1, a.nph - 1 - p);  // groups committed after phase p's
        uint64_t* m = &mb[p % (TMA ? S : 1)];
        const unsigned par = (unsigned)(p / S) & 1u;
        phase_body(a, p, rpb, wsm + (p % S) * slice, [newer, m, par] {
            if constexpr (TMA) mbar_wait(m, par);
            else cp_wait_pending(newer);
        });
        // Arrive: this block's rows of y_{p+1} are written.
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(a.bar, 1u);
        }
    }
}

// chain with the slice fetched by bulk copies (kw > 0 only).
__global__ void __launch_bounds__(T) chain_tma(Args a, int p) {
    extern __shared__ __align__(16) unsigned char wsm[];
    __shared__ __align__(8) uint64_t mb;
    const int rpb = D / gridDim.x;
    if (threadIdx.x == 0) {
        mbar_init(&mb);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        tma_slice(a, p, rpb, wsm, &mb);  // weights never depend on the previous phase
    }
    __syncthreads();  // the barrier's init, before any thread waits on it
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
    uint64_t* m = &mb;
    phase_body(a, p, rpb, wsm, [m] { mbar_wait(m, 0); });
}

// persist with cluster-local dependencies (the `cluster` design above): launched with clusters
// of CL blocks; x is the cluster's own XL = D / ncl rows of y_p.
__global__ void __launch_bounds__(T) clustered(Args a) {
    extern __shared__ __align__(16) unsigned char wsm[];
    __shared__ float xs[D];
    __shared__ __align__(16) int8_t xq[D];
    __shared__ float sh[9];
    const int G = gridDim.x, rpb = D / G;
    uint32_t cl, ncl;
    asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(cl));
    asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(ncl));
    const int XL = D / (int)ncl;  // a power of two (G, CL powers of two)
    const size_t slice = (size_t)rpb * a.kw;
    const int tid = threadIdx.x;
    issue_slice(a, 0, rpb, wsm);
    for (int p = 0; p < a.nph; p++) {
        const bool more = p + 1 < a.nph;
        if (more) issue_slice(a, p + 1, rpb, wsm + ((p + 1) & 1) * slice);
        if (p > 0) {
            // Every block of the cluster has written its rows of y_p (global, through L2).
            asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
            asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
        }
        const float* x = a.y + (size_t)p * D + (size_t)cl * XL;
        float ss = 0.0f;
        for (int i = tid; i < XL; i += T) {
            const float v = __ldcg(x + i);
            xs[i] = v;
            ss += v * v;
        }
        const float rr = block_rr(ss, sh, XL, [more] {
            if (more) asm volatile("cp.async.wait_group 1;" ::: "memory");
            else asm volatile("cp.async.wait_group 0;" ::: "memory");
        });
        quantize_x(xs, rr, XL, xq);
        rows_out(wsm + (p & 1) * slice, a.kw, rpb, xq, XL, xs, rr, a.y + (size_t)(p + 1) * D);
        __syncthreads();  // xs is rewritten by the next phase
    }
}

// The bandwidth floor: one streaming read of n16 16-byte words.
__global__ void __launch_bounds__(512) read_all(const uint4* __restrict__ p, size_t n16, unsigned* sink) {
    unsigned acc = 0;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
#pragma unroll 4
    for (; i < n16; i += stride) {
        const uint4 v = __ldcs(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

__global__ void fill_weights(int8_t* w, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ (uint32_t)(i >> 32);
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        w[i] = (int8_t)((int)(h % 17u) - 8);
    }
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char** argv) {
    const int nph = argc > 1 ? atoi(argv[1]) : 240;
    const int reps = 9;
    const int kws[] = {0, 512, 1024, 2048, 3072, 4096};
    const int grids[] = {128, 256};
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const size_t wbytes = (size_t)nph * D * 4096;
    int8_t* w;
    float* y;
    unsigned *bar, *sink;
    CK(cudaMalloc(&w, wbytes));
    CK(cudaMalloc(&y, (size_t)(nph + 1) * D * 4));
    CK(cudaMalloc(&bar, 4));
    CK(cudaMalloc(&sink, 4));
    CK(cudaMemset(bar, 0, 4));
    // Weights in [-8, 8] (a hash of the index), the input of unit scale: deterministic.
    fill_weights<<<sms * 8, 256>>>(w, wbytes);
    {
        std::vector<float> hy(D);
        for (int i = 0; i < D; i++) hy[i] = (float)((i * 37) % 101 - 50) / 29.0f;
        CK(cudaMemcpy(y, hy.data(), D * 4, cudaMemcpyHostToDevice));
    }
    CK(cudaDeviceSynchronize());
    CK(cudaFuncSetAttribute(chain_phase<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024));
    CK(cudaFuncSetAttribute(chain_phase<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024));
    CK(cudaFuncSetAttribute(persist<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    CK(cudaFuncSetAttribute(persist<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    CK(cudaFuncSetAttribute(persist<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    CK(cudaFuncSetAttribute(persist<6>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    CK(cudaFuncSetAttribute(clustered, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    CK(cudaFuncSetAttribute(chain_tma, cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024));
    CK(cudaFuncSetAttribute(persist<3, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    CK(cudaFuncSetAttribute(persist<6, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    auto timed = [&](auto&& launch) {
        std::vector<double> t;
        for (int r = 0; r < reps + 2; r++) {
            CK(cudaEventRecord(e0, st));
            launch();
            CK(cudaEventRecord(e1, st));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            if (r >= 2) t.push_back(ms * 1e3);
        }
        return median(t);
    };
    // How many thread-block clusters of CL blocks (256 threads, SMEM KB of dynamic shared memory
    // each) the GPU holds at once: whether an MoE layer's 9 slots (8 routed experts and the shared
    // one), a cluster each, can all be resident (cudaOccupancyMaxActiveClusters; CL > 8 needs the
    // non-portable size, allowed here).
    CK(cudaFuncSetAttribute(clustered, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    printf("clusters resident at once (cudaOccupancyMaxActiveClusters), 256 threads a block:\n%10s", "smem KB");
    const int cls[] = {4, 8, 12, 14, 16};
    for (int cl : cls) printf(" %8s%-3d", "CL=", cl);
    printf("\n");
    for (int kb : {32, 64, 110, 150, 200}) {
        printf("%10d", kb);
        for (int cl : cls) {
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(cl * 16);
            cfg.blockDim = dim3(T);
            cfg.dynamicSmemBytes = (size_t)kb * 1024;
            cudaLaunchAttribute at[1];
            at[0].id = cudaLaunchAttributeClusterDimension;
            at[0].val.clusterDim.x = cl;
            at[0].val.clusterDim.y = 1;
            at[0].val.clusterDim.z = 1;
            cfg.attrs = at;
            cfg.numAttrs = 1;
            int n = 0;
            const cudaError_t e = cudaOccupancyMaxActiveClusters(&n, clustered, &cfg);
            if (e != cudaSuccess) {
                (void)cudaGetLastError();
                printf(" %11s", "error");
            } else {
                printf(" %11d", n);
            }
        }
        printf("\n");
    }
    unsigned launches = 0;  // persist launches so far (its barrier's epoch)
    printf("step_skeleton: %d phases, %d SMs; us a phase (median of %d), the phase's weights over that time\n", nph, sms, reps);
    printf("%6s %8s %5s | %9s %7s | %9s %7s | %9s %7s | %9s %7s | %9s %7s | %9s %7s | %9s %7s | %9s %7s | %9s %7s | %s\n", "KW",
           "MB/phase", "G", "floor us", "TB/s", "chain us", "TB/s", "early us", "TB/s", "plain us", "TB/s", "persist", "TB/s", "deep3",
           "TB/s", "deep4", "TB/s", "deep6", "TB/s", "cluster", "TB/s", "bits");
    // The Tensor Memory Accelerator's forms, after the row above (the same phases and bits).
    printf("%6s %8s %5s | %9s %7s | %9s %7s | %9s %7s | %s\n", "KW", "MB/phase", "G", "chainT us", "TB/s", "tma3", "TB/s", "tma6", "TB/s", "bits");
    for (int kw : kws) {
        const double mb = (double)D * kw / 1e6;
        // The floor: all nph phases' weights in one streaming read.
        double floor_us = 0.0;
        if (kw > 0) {
            const size_t n16 = (size_t)nph * D * kw / 16;
            floor_us = timed([&] { read_all<<<sms * 4, 512, 0, st>>>((const uint4*)w, n16, sink); }) / nph;
        }
        for (int G : grids) {
            const size_t slice = (size_t)(D / G) * kw;
            Args a{w, kw, y, nph, bar, 0};
            // A recorded graph of nph launches of one phase kernel (PDL or not): µs a phase, and
            // y_nph into `out`.
            auto run_chain = [&](void (*kern)(Args, int), bool pdl, std::vector<float>& out) {
                cudaGraph_t g;
                cudaGraphExec_t ge;
                CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
                for (int p = 0; p < nph; p++) {
                    cudaLaunchConfig_t cfg = {};
                    cfg.gridDim = dim3(G);
                    cfg.blockDim = dim3(T);
                    cfg.dynamicSmemBytes = slice;
                    cfg.stream = st;
                    cudaLaunchAttribute at[1];
                    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
                    at[0].val.programmaticStreamSerializationAllowed = 1;
                    cfg.attrs = at;
                    cfg.numAttrs = pdl ? 1 : 0;
                    CK(cudaLaunchKernelEx(&cfg, kern, a, p));
                }
                CK(cudaStreamEndCapture(st, &g));
                CK(cudaGraphInstantiate(&ge, g, 0));
                const double us = timed([&] { CK(cudaGraphLaunch(ge, st)); }) / nph;
                out.resize(D);
                CK(cudaMemcpy(out.data(), y + (size_t)nph * D, D * 4, cudaMemcpyDeviceToHost));
                CK(cudaGraphExecDestroy(ge));
                CK(cudaGraphDestroy(g));
                return us;
            };
            // One persistent launch with a ring of S slices (every block resident: else -1, not
            // run): µs a phase, and y_nph into `out`.
            auto run_persist = [&](void (*kern)(Args), int S, std::vector<float>& out) {
                int per_sm = 0;
                if (S * slice > 200 * 1024) return -1.0;
                CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, T, S * slice));
                if (per_sm * sms < G) return -1.0;
                const double us = timed([&] {
                                      a.epoch = launches * (unsigned)nph * (unsigned)G;
                                      launches++;
                                      kern<<<G, T, S * slice, st>>>(a);
                                  }) /
                                  nph;
                // Later launches continue the count from here: reset it (its epoch restarts).
                CK(cudaStreamSynchronize(st));
                CK(cudaMemset(bar, 0, 4));
                launches = 0;
                out.resize(D);
                CK(cudaMemcpy(out.data(), y + (size_t)nph * D, D * 4, cudaMemcpyDeviceToHost));
                return us;
            };
            // chain (v 0: PDL, dependents after the wait), early (v 1: PDL, before it) and plain
            // (v 2: no PDL), each a recorded graph of nph launches.
            double chain_us[3];
            std::vector<float> outs[3];
            for (int v = 0; v < 3; v++) chain_us[v] = run_chain(v == 1 ? chain_phase<true> : chain_phase<false>, v < 2, outs[v]);
            // persist (a ring of 2 slices) and deep (3, 4, 6): every block resident at once.
            double persist_us[4] = {-1.0, -1.0, -1.0, -1.0};
            const int rings[4] = {2, 3, 4, 6};
            std::vector<float> pouts[4];
            for (int v = 0; v < 4; v++) {
                const int S = rings[v];
                if (v > 0 && kw == 0) continue;  // no weights: the ring changes nothing
                persist_us[v] = run_persist(S == 2 ? persist<2> : S == 3 ? persist<3> : S == 4 ? persist<4> : persist<6>, S, pouts[v]);
            }
            // cluster: clusters of 8, every cluster resident at once (checked).
            double cluster_us = -1.0;
            {
                cudaLaunchConfig_t cfg = {};
                cfg.gridDim = dim3(G);
                cfg.blockDim = dim3(T);
                cfg.dynamicSmemBytes = 2 * slice;
                cfg.stream = st;
                cudaLaunchAttribute at[1];
                at[0].id = cudaLaunchAttributeClusterDimension;
                at[0].val.clusterDim.x = 8;
                at[0].val.clusterDim.y = 1;
                at[0].val.clusterDim.z = 1;
                cfg.attrs = at;
                cfg.numAttrs = 1;
                int ncl = 0;
                CK(cudaOccupancyMaxActiveClusters(&ncl, clustered, &cfg));
                if (ncl * 8 >= G) cluster_us = timed([&] { CK(cudaLaunchKernelEx(&cfg, clustered, a)); }) / nph;
            }
            // chainT (a recorded graph, as chain) and tma3 / tma6 (as deep3 / deep6).
            double tma_us[3] = {-1.0, -1.0, -1.0};
            std::vector<float> touts[3];
            if (kw > 0) {
                tma_us[0] = run_chain(chain_tma, true, touts[0]);
                tma_us[1] = run_persist(persist<3, true>, 3, touts[1]);
                tma_us[2] = run_persist(persist<6, true>, 6, touts[2]);
            }
            CK(cudaGetLastError());
            bool same = true;
            for (int v = 1; v < 3; v++) same = same && (outs[v].empty() || memcmp(outs[0].data(), outs[v].data(), D * 4) == 0);
            for (int v = 0; v < 4; v++) same = same && (pouts[v].empty() || memcmp(outs[0].data(), pouts[v].data(), D * 4) == 0);
            auto tbs = [&](double us) { return us > 0 && kw > 0 ? mb / us : 0.0; };
            printf("%6d %8.2f %5d | %9.2f %7.2f | %9.2f %7.2f | %9.2f %7.2f | %9.2f %7.2f", kw, mb, G, floor_us, tbs(floor_us),
                   chain_us[0], tbs(chain_us[0]), chain_us[1], tbs(chain_us[1]), chain_us[2], tbs(chain_us[2]));
            for (int v = 0; v < 4; v++) printf(" | %9.2f %7.2f", persist_us[v], tbs(persist_us[v]));
            printf(" | %9.2f %7.2f | %s\n", cluster_us, tbs(cluster_us), same ? "equal" : "DIFFER");
            if (kw > 0) {
                bool tsame = true;
                for (int v = 0; v < 3; v++) tsame = tsame && (touts[v].empty() || memcmp(outs[0].data(), touts[v].data(), D * 4) == 0);
                printf("%6d %8.2f %5d | %9.2f %7.2f | %9.2f %7.2f | %9.2f %7.2f | %s\n", kw, mb, G, tma_us[0], tbs(tma_us[0]), tma_us[1],
                       tbs(tma_us[1]), tma_us[2], tbs(tma_us[2]), tsame ? "equal" : "DIFFER");
            }
        }
    }
    printf("a token of the full preset runs 264 kernels and reads 1.67 GB (~6.3 MB a kernel); 1,000 tok/s needs ~3.8 us a kernel\n");
    return 0;
}
