// common.cuh: the prelude of every kernel file.
//
// What: integer typedefs, bf16 <-> f32 (activations between ops are bf16, see below), the scalar
// activations (matching cpu/norm.rs: sigmoid,
// silu, softplus), and warp / block reductions. No CUDA headers are included: NVRTC compiles
// these files with no include path (bf16 is handled as raw u16 bits).
//
// How it is compiled: backend/cuda/mod.rs (and scripts/check-kernels) prepend every `*.cuh` of
// this folder, in name order, to each `*.cu` file and compile the result with NVRTC for the
// device's architecture (sm_90 on an H200). Kernels are `extern "C"` so their names are stable.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu

// The in-place trace (`lily bench --trace`, LILY_CUDA_TRACE=1: mod.rs then compiles every file with
// LILY_TRACE defined; without it KTRACE and TRACE_WAITED are empty and the kernels are the
// measured ones, instruction for instruction). Every kernel's first statement is KTRACE(): thread 0
// of each block takes the global time (%globaltimer, ns, the same clock on every SM) as it starts,
// after its PDL wait returns (PDL_WAIT / PDL_ENTRY, TRACE_WAITED), where the kernel marks two phases
// of its body (TRACE_MARK(1), TRACE_MARK(2): e.g. x ready, the weights' loop done) and as its scope ends
// (the destructor, on every return path), and appends one record per block to the buffer the host
// set in `lily_trace_buf` (a u32 cursor padded to 32 bytes, then `lily_trace_cap` records). The
// host (cuda/trace.rs, backend/trace.rs) groups the records by launch: a kernel's waits all return
// after the previous kernel completes, so sorted by the wait, the blocks fall into the recorded
// step's launches in order. What it adds: ~10 instructions and one atomic a block.
#ifdef LILY_TRACE
struct TraceRec {
    u64 start, wait, mark1, mark2, end;
    u32 blocks, smid;
};
__device__ u64 lily_trace_buf;  // 0: not tracing
__device__ u32 lily_trace_cap;
__device__ __forceinline__ u64 trace_now() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ bool trace_thread0() { return threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0; }
// Thread 0's stamps of the block: when its PDL wait returned (slot 0; 0: the kernel has no wait)
// and when it passed TRACE_MARK(1), TRACE_MARK(2) (slots 1, 2; 0: unmarked).
__device__ __forceinline__ u64* trace_slots() {
    __shared__ u64 w[3];
    return w;
}
struct TraceScope {
    u64 t0;
    __device__ __forceinline__ TraceScope() {
        t0 = trace_now();
        if (trace_thread0()) trace_slots()[0] = trace_slots()[1] = trace_slots()[2] = 0;
    }
    __device__ __forceinline__ ~TraceScope() {
        if (!trace_thread0() || lily_trace_buf == 0) return;
        const u64* sl = trace_slots();
        const u64 w = sl[0], t1 = trace_now();
        u32 smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        const u32 i = atomicAdd((u32*)lily_trace_buf, 1u);
        if (i < lily_trace_cap) {
            TraceRec* r = (TraceRec*)(lily_trace_buf + 32) + i;
            r->start = t0;
            r->wait = w ? w : t0;
            r->mark1 = sl[1];
            r->mark2 = sl[2];
            r->end = t1;
            r->blocks = gridDim.x * gridDim.y * gridDim.z;
            r->smid = smid;
        }
    }
};
#define KTRACE() TraceScope lily_trace_scope_
#define TRACE_WAITED() TRACE_MARK(0)
#define TRACE_MARK(i)                                        \
    do {                                                     \
        if (trace_thread0()) trace_slots()[i] = trace_now(); \
    } while (0)
#else
#define KTRACE() \
    do {         \
    } while (0)
#define TRACE_WAITED() \
    do {               \
    } while (0)
#define TRACE_MARK(i) \
    do {              \
    } while (0)
#endif

// Programmatic dependent launch (Hopper; opt-in, LILY_CUDA_PDL=1, see `pdl` in mod.rs for the
// measurement): the host launches every kernel allowed to start while the previous kernel still
// runs; each kernel's first statement waits until that kernel has completed and its writes are
// visible, so stream order holds as before. Then it lets its own dependent launch: the next
// kernel's launch and block scheduling overlap this one's work instead of following it. Both are
// no-ops without the launch attribute and before sm_90.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_ENTRY()                                              \
    do {                                                         \
        asm volatile("griddepcontrol.wait;" ::: "memory");       \
        TRACE_WAITED();                                          \
        asm volatile("griddepcontrol.launch_dependents;" :::);   \
    } while (0)
// The two halves, for a kernel that does independent work first (the streaming GEMVs request
// their first weights, which nothing writes, before waiting): PDL_LAUNCH lets the next kernel
// launch, PDL_WAIT waits for the previous one. A kernel that launches before it waits lets its
// dependent start while its own predecessor may still run, so the dependent's own pre-wait work
// must touch nothing any kernel writes (weights only).
#define PDL_LAUNCH() asm volatile("griddepcontrol.launch_dependents;" :::)
#define PDL_WAIT()                                         \
    do {                                                   \
        asm volatile("griddepcontrol.wait;" ::: "memory"); \
        TRACE_WAITED();                                    \
    } while (0)
#else
#define PDL_ENTRY() \
    do {            \
    } while (0)
#define PDL_LAUNCH() \
    do {             \
    } while (0)
#define PDL_WAIT() \
    do {           \
    } while (0)
#endif
#define NEG_INF __int_as_float(0xff800000)

// Blocks per SM the decode step's main kernels are compiled for (the second argument of their
// __launch_bounds__, which caps their registers at 64K / (threads · MINB)): the measured
// defaults, overridable for a measurement by LILY_CUDA_DEFINE (mod.rs). The streaming kernels'
// grids are sized to the blocks the GPU holds (decode.rs resident_blocks), so these also decide
// whether the next kernel's blocks fit beside a running one (programmatic dependent launch).
#ifndef SW_MINB
#define SW_MINB 2  // sw_gemv_*: 256 threads
#endif
// tc_gemv_*, gdn_step_*: no minimum unless one is given (a minimum of 1 is not the same code).
#ifdef TC_MINB
#define TC_BOUNDS(T) __launch_bounds__(T, TC_MINB)
#else
#define TC_BOUNDS(T) __launch_bounds__(T)
#endif
#ifdef GDN_MINB
#define GDN_BOUNDS(T) __launch_bounds__(T, GDN_MINB)
#else
#define GDN_BOUNDS(T) __launch_bounds__(T)
#endif
#ifndef MWG_MINB
#define MWG_MINB 3  // moe_*_gate_up_* (moe_wide, moe_route, moe_step): 256 threads
#endif
#ifndef MWD_MINB
#define MWD_MINB 2  // moe_wide_down_*: 32·SWD_MAXSLOTS threads
#endif

// Activations between ops are bf16 (u16 bits: the CUDA backend's act_zeros): a kernel widens
// them to f32 as it reads, computes and accumulates in f32, and rounds its activation outputs once
// to nearest even as it writes (bf16_rn). The f32 buffers are the residual stream, logits, router
// logits, the shared-expert gate logit, the GDN and conv states, and parameters (mod.rs).
__device__ __forceinline__ float bf16f(u16 x) { return __uint_as_float(((u32)x) << 16); }
__device__ __forceinline__ u16 bf16_rn(float x) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}
// The two bf16 of a 32-bit word (element 2i in the low half, as in memory).
__device__ __forceinline__ float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }
// Element i of a GEMM output that is f32 (obf = 0: logits, router logits), an activation (obf = 1),
// or added into f32 (obf = 2: the residual stream of matmul_q_add; each output has one writer).
__device__ __forceinline__ void store_out(void* out, u64 i, float v, int obf) {
    if (obf == 1) ((u16*)out)[i] = bf16_rn(v);
    else if (obf == 2) ((float*)out)[i] += v;
    else ((float*)out)[i] = v;
}

// Same formulas as cpu/norm.rs (accurate expf / log1pf: the kernels are compiled without fast math).
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float silu_f(float x) { return x * sigmoid_f(x); }
__device__ __forceinline__ float softplus_f(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// A 64 -> 32-bit mixing hash (the splitmix64 finaliser): device-side fills of measuring buffers
// (ceiling.cu, lab.cu) that toggle bits like real data.
__device__ __forceinline__ u32 mix_hash(u64 x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (u32)x;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024). `sh` is 32 floats of shared
// memory; every thread gets the result. Contains barriers: call from all threads.
__device__ __forceinline__ float block_sum(float v, float* sh) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // sh may still be read by a previous call
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* sh) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : NEG_INF;
    return warp_max(v);
}

// (value, index) arg-max with the first index winning ties (as the CPU's `v > best` scan).
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(FULL_MASK, v, o);
        int oi = __shfl_xor_sync(FULL_MASK, i, o);
        if (better(ov, oi, v, i)) { v = ov; i = oi; }
    }
}

// Block arg-max; `shv`, `shi` are 32 entries of shared memory. Every thread gets the result.
__device__ __forceinline__ void block_argmax(float& v, int& i, float* shv, int* shi) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    warp_argmax(v, i);
    __syncthreads();
    if (lane == 0) { shv[warp] = v; shi[warp] = i; }
    __syncthreads();
    if (lane < nw) { v = shv[lane]; i = shi[lane]; } else { v = NEG_INF; i = 0x7fffffff; }
    warp_argmax(v, i);
}
