// kv_read.cu: the decode attention's read of the bf16 KV cache as pure reads (no arithmetic), to
// say what bounds attn_decode_<HD> at long context (issue #13's "bf16 KV read at >= 70% of the
// ceiling from 32K to 128K"). On the H100 at stop 56 attn_decode_256 read 268 MB in 98.2 us at
// 131,072 keys (2.73 TB/s) and 67 MB in 32.9 us at 32,768 (2.04 TB/s); a second chunk in flight a
// warp (attn_ring, through shared memory) made it slower. This probe keeps the kernel's grid and
// its lanes' 16-byte pieces and changes one thing at a time:
//   layout  0: lily's cache, [pos][KV head][hd] (a head's 512-byte rows at a 1 KiB stride);
//           1: head-major, [KV head][pos][hd] (each block's share contiguous);
//   depth   chunks of 8 keys in flight a warp, in registers (1: the kernel's; 2, 3);
//   warps   a block (8: the kernel's, one block an SM; 16, at depth 1: 128 registers a thread).
// Each warp walks chunks c0 + w, c0 + w + W, ... of its block's share as attn_decode does: lane
// (g, t) reads K row g's 16-byte pieces t + 4a (a < 8) and V rows 2t, 2t + 1's pieces g + 8cc
// (cc < 4), so every row is read whole by the warp. Grid (2 KV heads, ns = SMs / 2 splits).
// Beside it: a plain streaming read of the same bytes (read_ramp's kernel). Every launch reads a
// different cache of a 4 GiB pool (L2-cold); back to back in a CUDA graph, µs a launch.
// Stop 58 added kv_work: the same pieces in the attention's order (K requested after "S", V after
// "PV") with a chain of dependent FMAs a chunk standing for its arithmetic, at depth 1 and 2:
// whether the arithmetic between the loads is what costs the attention at 128K in place. It is
// (stop 59, H100: 150 FMAs a chunk take 131,072 keys from 86.1 to 101.6 µs, 2.64 TB/s, the
// attention's in-place rate). Stop 59 added kv_work_ve: V requested with K (attn_ve's order).
// Build and run on the GPU machine (scripts/h200-run kvread):
//   nvcc -O3 -arch=sm_90 -std=c++17 tools/probes/kv_read.cu -o /tmp/kv_read && /tmp/kv_read
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>
#define CK(x)                                                                   \
    do {                                                                        \
        cudaError_t e = (x);                                                    \
        if (e != cudaSuccess) {                                                 \
            printf("%s: %s\n", #x, cudaGetErrorString(e));                      \
            return 1;                                                           \
        }                                                                       \
    } while (0)

constexpr int KVH = 2;   // KV heads (the model's)
constexpr int ROW = 32;  // 16-byte pieces of a 256-dim bf16 row (512 bytes)
constexpr int KEYS = 8;  // keys a chunk

__device__ __forceinline__ size_t row_at(int layout, int kvh, int j, int n) {
    return (layout == 0 ? (size_t)j * KVH + kvh : (size_t)kvh * n + j) * ROW;
}

// A thread's place: block (kvh, s)'s share [c0, c1) of the n keys' chunks (as attn_decode's
// dec_share), its warp, and its lane (g, t) = (lane / 4, lane % 4).
struct Place {
    int kvh, warp, g, t, c0, c1;
};
__device__ __forceinline__ Place place(int n) {
    const int s = blockIdx.y, ns = gridDim.y, chunks = n / KEYS, lane = threadIdx.x & 31;
    return {(int)blockIdx.x, (int)threadIdx.x >> 5, lane >> 2, lane & 3, (int)((long long)s * chunks / ns),
            (int)((long long)(s + 1) * chunks / ns)};
}

// Lane (g, t)'s 16-byte pieces of chunk c, as attn_decode_<HD> reads them: K row g's pieces
// t + 4a (a < 8), and V rows 2t, 2t + 1's pieces g + 8cc (cc < 4), eight of each into d.
__device__ __forceinline__ void load_k8(const uint4* __restrict__ k, int layout, const Place& pl, int c, int n, uint4* d) {
    const uint4* kp = k + row_at(layout, pl.kvh, c * KEYS + pl.g, n) + pl.t;
#pragma unroll
    for (int a = 0; a < 8; a++) d[a] = kp[4 * a];
}
__device__ __forceinline__ void load_v8(const uint4* __restrict__ v, int layout, const Place& pl, int c, int n, uint4* d) {
#pragma unroll
    for (int e = 0; e < 2; e++) {
        const uint4* vp = v + row_at(layout, pl.kvh, c * KEYS + 2 * pl.t + e, n) + pl.g;
#pragma unroll
        for (int cc = 0; cc < 4; cc++) d[4 * e + cc] = vp[8 * cc];
    }
}

// One block an SM, as attn_decode_<HD> (whose 218 registers a thread allow no second block).
template <int DEPTH, int W>
__global__ void __launch_bounds__(32 * W, 1) kv_chunks(const uint4* __restrict__ k, const uint4* __restrict__ v, int n,
                                                      int layout, unsigned* sink) {
    const Place pl = place(n);
    const int warp = pl.warp, c0 = pl.c0, c1 = pl.c1;
    uint4 r[DEPTH][16];
    unsigned acc = 0;
    auto load = [&](uint4(&d)[16], int c) {
        load_k8(k, layout, pl, c, n, d);
        load_v8(v, layout, pl, c, n, d + 8);
    };
    auto use = [&](const uint4(&d)[16]) {
#pragma unroll
        for (int i = 0; i < 16; i++) acc ^= d[i].x ^ d[i].y ^ d[i].z ^ d[i].w;
    };
    int c = c0 + warp;
#pragma unroll
    for (int i = 0; i < DEPTH; i++)
        if (c + W * i < c1) load(r[i], c + W * i);
#pragma unroll 1
    for (; c < c1; c += W * DEPTH) {
#pragma unroll
        for (int i = 0; i < DEPTH; i++) {
            const int ci = c + W * i;
            if (ci < c1) {
                use(r[i]);
                if (ci + W * DEPTH < c1) load(r[i], ci + W * DEPTH);
            }
        }
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;  // never true in practice; keeps the loads alive
}

// The attention's order with arithmetic between the loads (stop 58's question: at 128K the
// decode attention reads at 2.66 TB/s in place, its read pattern alone here at the plain read's
// rate). As attn_decode_<HD>: chunk c's K and V pieces in registers (DEPTH chunks a warp); "S" (a
// third of `work`, after K has landed) then chunk c + W·DEPTH's K requested; "PV" (the rest,
// after V has landed) then its V requested. `work` dependent FMAs a chunk stand for the
// arithmetic (~600-700 cycles a chunk a warp in attn_decode_256: 16 + 48 mma, the softmax's
// shuffles and exps; an FMA is ~4 cycles, so ~150). Layout 0 (lily's).
// kv_work's chain step: it depends on every loaded word, so it waits for them as the mma would.
__device__ __forceinline__ float fold(const uint4 (&d)[8], float f) {
    unsigned x = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) x ^= d[i].x ^ d[i].y ^ d[i].z ^ d[i].w;
    return fmaf(f, 1.0f, (float)(x & 1u));
}

template <int DEPTH, int W>
__global__ void __launch_bounds__(32 * W, 1) kv_work(const uint4* __restrict__ k, const uint4* __restrict__ v, int n,
                                                    int work, unsigned* sink) {
    const Place pl = place(n);
    const int warp = pl.warp, c0 = pl.c0, c1 = pl.c1;
    uint4 kr[DEPTH][8], vr[DEPTH][8];
    auto load_k = [&](uint4(&d)[8], int c) { load_k8(k, 0, pl, c, n, d); };
    auto load_v = [&](uint4(&d)[8], int c) { load_v8(v, 0, pl, c, n, d); };
    const int ws = work / 3;
    float f = 1.0f;
    int c = c0 + warp;
#pragma unroll
    for (int i = 0; i < DEPTH; i++)
        if (c + W * i < c1) {
            load_k(kr[i], c + W * i);
            load_v(vr[i], c + W * i);
        }
#pragma unroll 1
    for (; c < c1; c += W * DEPTH) {
#pragma unroll
        for (int i = 0; i < DEPTH; i++) {
            const int ci = c + W * i, cn = ci + W * DEPTH;
            if (ci < c1) {
                f = fold(kr[i], f);
#pragma unroll 1
                for (int j = 0; j < ws; j++) f = fmaf(f, 0.999f, 0.5f);
                if (cn < c1) load_k(kr[i], cn);
                f = fold(vr[i], f);
#pragma unroll 1
                for (int j = ws; j < work; j++) f = fmaf(f, 0.999f, 0.5f);
                if (cn < c1) load_v(vr[i], cn);
            }
        }
    }
    if (f == 1234.5f) sink[0] = __float_as_uint(f);  // never true in practice; keeps the chain alive
}

// kv_work's order with V requested together with K (right after "S") into the other of two V
// buffers, whose roles swap chunk by chunk (unrolled by two: a copy would wait on the load it
// copies): attention.cu's `attn_ve` (stop 59). One chunk a warp in flight, as depth 1; only the
// moment V is requested moves (V's round trip then overlaps "PV" too).
template <int W>
__global__ void __launch_bounds__(32 * W, 1) kv_work_ve(const uint4* __restrict__ k, const uint4* __restrict__ v, int n,
                                                       int work, unsigned* sink) {
    const Place pl = place(n);
    const int warp = pl.warp, c1 = pl.c1;
    uint4 kr[8], va[8], vb[8];
    const int ws = work / 3;
    float f = 1.0f;
    auto chunk = [&](int ci, const uint4(&vc)[8], uint4(&vn)[8]) {
        const int cn = ci + W;
        f = fold(kr, f);
#pragma unroll 1
        for (int j = 0; j < ws; j++) f = fmaf(f, 0.999f, 0.5f);
        if (cn < c1) {
            load_k8(k, 0, pl, cn, n, kr);
            load_v8(v, 0, pl, cn, n, vn);
        }
        f = fold(vc, f);
#pragma unroll 1
        for (int j = ws; j < work; j++) f = fmaf(f, 0.999f, 0.5f);
    };
    int c = pl.c0 + warp;
    if (c < c1) {
        load_k8(k, 0, pl, c, n, kr);
        load_v8(v, 0, pl, c, n, va);
    }
#pragma unroll 1
    for (; c < c1; c += 2 * W) {
        chunk(c, va, vb);
        if (c + W >= c1) break;
        chunk(c + W, vb, va);
    }
    if (f == 1234.5f) sink[0] = __float_as_uint(f);  // never true in practice; keeps the chain alive
}

__global__ void __launch_bounds__(512) read_bytes(const uint4* __restrict__ p, size_t n16, unsigned* sink) {
    unsigned acc = 0;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
#pragma unroll 4
    for (; i < n16; i += stride) {
        uint4 x = __ldcs(p + i);
        acc ^= x.x ^ x.y ^ x.z ^ x.w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

int main() {
    const size_t pool = 4ull << 30;
    char* buf;
    unsigned* sink;
    CK(cudaMalloc(&buf, pool));
    CK(cudaMalloc(&sink, 4));
    CK(cudaMemset(buf, 1, pool));
    int sms;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    const int ns = sms / KVH;
    printf("%8s %8s  %-34s %10s %8s\n", "keys", "MB", "variant", "us/launch", "TB/s");
    for (int n : {32768, 131072}) {
        const size_t half = (size_t)n * KVH * ROW * 16, bytes = 2 * half;  // K and V
        const size_t slots = pool / bytes;
        struct Variant {
            const char* name;
            int kind, layout, warps;  // kind: kv_chunks of that depth (1..3), 0 the plain read,
                                      // 4 / 5 kv_work of depth 1 / 2, 6 kv_work_ve
            int work;                 // kv_work: dependent FMAs a chunk
        };
        const Variant vs[] = {
            {"plain read (read_ramp)", 0, 0, 0},       {"[pos][kvh] depth 1, 8 warps (lily)", 1, 0, 8},
            {"[kvh][pos] depth 1, 8 warps", 1, 1, 8}, {"[pos][kvh] depth 2, 8 warps", 2, 0, 8},
            {"[kvh][pos] depth 2, 8 warps", 2, 1, 8}, {"[pos][kvh] depth 3, 8 warps", 3, 0, 8},
            {"[pos][kvh] depth 1, 16 warps", 1, 0, 16}, {"[kvh][pos] depth 1, 16 warps", 1, 1, 16},
            {"attn order depth 1, no work", 4, 0, 8, 0}, {"attn order depth 1, work 150", 4, 0, 8, 150},
            {"attn order depth 1, work 300", 4, 0, 8, 300}, {"attn order depth 2, work 150", 5, 0, 8, 150},
            {"attn order depth 2, work 300", 5, 0, 8, 300},
            {"attn order, V with K, no work", 6, 0, 8, 0}, {"attn order, V with K, work 150", 6, 0, 8, 150},
            {"attn order, V with K, work 300", 6, 0, 8, 300},
        };
        for (int round = 0; round < 2; round++) {
            for (const Variant& x : vs) {
                const int K = 24;
                cudaGraph_t gr;
                cudaGraphExec_t ge;
                CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
                for (int i = 0; i < K; i++) {
                    const char* base = buf + (i % slots) * bytes;
                    const uint4 *kp = (const uint4*)base, *vp = (const uint4*)(base + half);
                    const dim3 grid(KVH, ns);
                    switch (x.kind * 100 + x.warps) {
                        case 0: read_bytes<<<sms * 4, 512, 0, st>>>(kp, bytes / 16, sink); break;
                        case 108: kv_chunks<1, 8><<<grid, 256, 0, st>>>(kp, vp, n, x.layout, sink); break;
                        case 208: kv_chunks<2, 8><<<grid, 256, 0, st>>>(kp, vp, n, x.layout, sink); break;
                        case 308: kv_chunks<3, 8><<<grid, 256, 0, st>>>(kp, vp, n, x.layout, sink); break;
                        case 116: kv_chunks<1, 16><<<grid, 512, 0, st>>>(kp, vp, n, x.layout, sink); break;
                        case 408: kv_work<1, 8><<<grid, 256, 0, st>>>(kp, vp, n, x.work, sink); break;
                        case 508: kv_work<2, 8><<<grid, 256, 0, st>>>(kp, vp, n, x.work, sink); break;
                        case 608: kv_work_ve<8><<<grid, 256, 0, st>>>(kp, vp, n, x.work, sink); break;
                    }
                }
                CK(cudaStreamEndCapture(st, &gr));
                CK(cudaGraphInstantiate(&ge, gr, 0));
                CK(cudaGraphLaunch(ge, st));
                CK(cudaStreamSynchronize(st));
                std::vector<float> tg;
                for (int r = 0; r < 7; r++) {
                    cudaEventRecord(a, st);
                    cudaGraphLaunch(ge, st);
                    cudaEventRecord(b, st);
                    cudaEventSynchronize(b);
                    float ms;
                    cudaEventElapsedTime(&ms, a, b);
                    tg.push_back(ms);
                }
                CK(cudaGetLastError());
                std::sort(tg.begin(), tg.end());
                const double us = tg[tg.size() / 2] * 1e3 / K;
                printf("%8d %8.1f  %-34s %10.1f %8.2f\n", n, bytes / 1e6, x.name, us, bytes / us / 1e6);
                cudaGraphExecDestroy(ge);
                cudaGraphDestroy(gr);
            }
        }
    }
    return 0;
}
