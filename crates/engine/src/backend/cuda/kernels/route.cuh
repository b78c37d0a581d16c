// route.cuh: the top-k routing of one token's router logits by one warp, shared by moe_route
// (moe.cu) and the router GEMV that routes in its last block (gemv.cu). Matches cpu/moe.rs's
// moe_route: f32 softmax (max subtracted, then p /= sum), k rounds of warp arg-max (ties: the lower
// expert id, as the CPU's stable sort), the chosen p summed in slot order for the division
// (norm_topk). Lane l holds experts l, l + 32, ... in registers (unrolled and guarded, not local
// memory). The logits are read through L2 (ld.global.cg): in the GEMV they were just written by
// other blocks. E <= ROUTE_MAXE, k <= 32; lane j < k writes slot j of ids and weights.

#define ROUTE_MAXE 1024  // experts per row at most: 32 per lane in registers

// NPL: experts per lane (E <= 32·NPL): 8 for the model's 256 experts (each of the k arg-max rounds
// scans NPL registers per lane: with 32 for every E, a 256-expert route took ~7 µs on the H200).
template <int NPL>
__device__ __forceinline__ void route_warp_n(const float* __restrict__ l, u32* __restrict__ ids, float* __restrict__ weights, int E, int k,
                                             int norm_topk, int lane) {
    // Lane l holds experts l, l + 32, ... (unrolled and guarded: registers, not local memory).
    float p[NPL];
    float m = NEG_INF;
#pragma unroll
    for (int i = 0; i < NPL; i++) {
        const int e = lane + 32 * i;
        p[i] = e < E ? __ldcg(l + e) : NEG_INF;
        m = fmaxf(m, p[i]);
    }
    m = warp_max(m);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < NPL; i++) {
        if (lane + 32 * i < E) {
            p[i] = expf(p[i] - m);
            s += p[i];
        }
    }
    s = warp_sum(s);
#pragma unroll
    for (int i = 0; i < NPL; i++) p[i] = lane + 32 * i < E ? p[i] / s : NEG_INF;
    float mine_p = 0.0f, sum = 0.0f;
    int mine_i = 0;
    for (int j = 0; j < k; j++) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < NPL; i++)
            if (better(p[i], lane + 32 * i, bv, bi)) { bv = p[i]; bi = lane + 32 * i; }
        warp_argmax(bv, bi);
#pragma unroll
        for (int i = 0; i < NPL; i++)
            if (lane + 32 * i == bi) p[i] = NEG_INF;  // taken
        if (lane == j) { mine_p = bv; mine_i = bi; }
        sum += bv;  // in slot order, as the CPU
    }
    // Lane j < k writes slot j.
    if (lane < k) {
        ids[lane] = (u32)mine_i;
        weights[lane] = mine_p / (norm_topk ? sum : 1.0f);
    }
}

__device__ __forceinline__ void route_warp(const float* __restrict__ l, u32* __restrict__ ids, float* __restrict__ weights, int E, int k,
                                           int norm_topk, int lane) {
    if (E <= 256) route_warp_n<8>(l, ids, weights, E, k, norm_topk, lane);
    else route_warp_n<ROUTE_MAXE / 32>(l, ids, weights, E, k, norm_topk, lane);
}

// route_block: route_warp_n<8>'s function (the same ids and weights, bit for bit) computed by a
// whole block of at least 256 threads over E <= 256 experts: the router's last block (gemv.cu,
// switch `route_block`, the default), and every block of the experts' launches with `late_route`
// (moe.cu moe_late_*: 256 and 288 threads; threads from 256 on only meet the barriers). Called by
// every thread of the block (it holds barriers). ids and weights may be shared or global.
// Why: route_warp picks the k experts in k dependent rounds of a warp arg-max (each ~10 shuffles
// and compares on the critical path): ~3 µs a layer of the router's chain on the H200 (the route
// left out of moe_step, LILY_MOE_STEP_PROBE=2). Here thread e holds expert e's probability and
// counts the experts that beat it (`better`: higher p, ties to the lower id, as the k rounds
// choose): that count is its slot. One pass over 256 values in shared memory, no rounds.
// Arithmetic as route_warp_n<8>: the max is exact in any order; lane l of warp 0 sums p[l + 32i]
// for i = 0..7 in order, then warp_sum; p / s; the chosen p summed in slot order by one thread.
// The shared memory of route_block and route_sort (ps first: read as float4).
struct __align__(16) RouteSmem {
    float ps[256];  // the exponentials, then (route_block) the probabilities
    float top[32];  // the chosen p by slot
    u32 id[32];     // the chosen ids by slot (read by route_weights' publish)
    float wmax[8];  // the warps' maxima
    float ssum;     // the sum of the exponentials, then of the chosen p
};

// route_warp_n<8>'s softmax over a block (route_block's note): thread t's p, NEG_INF from E on.
// Every thread of the block calls it (three barriers).
__device__ __forceinline__ float route_softmax(const float* __restrict__ l, int E, RouteSmem& s) {
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const bool mine = t < 256;  // threads 256 and on (a 288-thread block) only meet the barriers
    const float v = t < E ? __ldcg(l + t) : NEG_INF;
    const float wm = warp_max(v);
    if (lane == 0 && mine) s.wmax[warp] = wm;
    __syncthreads();
    float m = s.wmax[0];
#pragma unroll
    for (int w = 1; w < 8; w++) m = fmaxf(m, s.wmax[w]);
    if (mine) s.ps[t] = t < E ? expf(v - m) : 0.0f;
    __syncthreads();
    if (warp == 0) {
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (lane + 32 * i < E) sum += s.ps[lane + 32 * i];
        sum = warp_sum(sum);
        if (lane == 0) s.ssum = sum;
    }
    __syncthreads();
    return t < E ? s.ps[t] / s.ssum : NEG_INF;
}

// The weights from the chosen p in s.top[0, k) (written before the call): summed in slot order by
// one thread, as route_warp. Every thread of the block calls it (barriers).
// pub (opt-in `route_flag`, the router's last block; k <= 8, ids < 256): the ticket at pub[0],
// the published route at pub + 2 (a u64, moe.cu moe_flag_gate_up polls it). Thread 0 then also
// writes the k weights (the same expression, so the same bits), packs the ids from s.id (id j in
// bits 8j .. 8j + 7, bit 63 set when k < 8, so a published word is never 0), resets the ticket
// and stores the word with release semantics: the barrier above orders every thread's route
// stores, and the blocks' logits, x and shared logit were fenced before their tickets, which
// this block's ticket observed; a release by one thread after a block barrier is the arrive of
// CUTLASS's generic barrier. Why here: no second barrier, no load of the ids back from global
// memory and no sequentially consistent fence (stop 52's trace: publishing after the route
// added 1.0 µs to the router's tail).
__device__ __forceinline__ void route_weights(RouteSmem& s, float* __restrict__ weights, int k, int norm_topk, u32* pub = nullptr) {
    const int t = threadIdx.x;
    __syncthreads();
    if (t == 0) {
        float sum = 0.0f;
        for (int j = 0; j < k; j++) sum += s.top[j];
        s.ssum = sum;
        if (pub != nullptr) {
            u64 v = k < 8 ? 1ull << 63 : 0ull;
            for (int j = 0; j < k; j++) {
                weights[j] = s.top[j] / (norm_topk ? sum : 1.0f);
                v |= (u64)(s.id[j] & 0xffu) << (8 * j);
            }
            pub[0] = 0u;
            asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(pub + 2), "l"(v) : "memory");
        }
    }
    if (pub != nullptr) return;  // uniform: every thread has the same pub
    __syncthreads();
    if (t < k) weights[t] = s.top[t] / (norm_topk ? s.ssum : 1.0f);
}

// route_block (the note above RouteSmem).
__device__ __forceinline__ void route_block(const float* __restrict__ l, u32* __restrict__ ids, float* __restrict__ weights, int E, int k,
                                            int norm_topk, u32* pub = nullptr) {
    __shared__ RouteSmem s;
    const int t = threadIdx.x;
    const float p = route_softmax(l, E, s);
#ifdef SW_TAIL_MARKS
    TRACE_MARK(2);  // the logits read back and the softmax done (gemv.cu's tail probe)
#endif
    __syncthreads();  // every read of the exponentials is done
    if (t < 256) s.ps[t] = p;
    __syncthreads();
    if (t < E) {
        int r = 0;
        const float4* p4 = (const float4*)s.ps;
#pragma unroll 8
        for (int e4 = 0; e4 < 64; e4++) {
            const float4 q = p4[e4];
            r += better(q.x, 4 * e4, p, t) + better(q.y, 4 * e4 + 1, p, t) + better(q.z, 4 * e4 + 2, p, t) + better(q.w, 4 * e4 + 3, p, t);
        }
        if (r < k) {
            s.top[r] = p;
            s.id[r] = (u32)t;
            ids[r] = (u32)t;
        }
    }
    route_weights(s, weights, k, norm_topk, pub);
}

// route_sort: route_block's function (the same ids and weights, bit for bit: the same softmax
// arithmetic, the same `better` order) for top-k of at most 8, by a selection that costs each
// thread ~30 compares instead of E: every warp sorts its 32 experts best first (a bitonic network
// of shuffles: 15 compare-exchanges a lane), the 8 warps' first 8 go to shared memory, and each
// of those 64 candidates counts the candidates of the other warps' lists that beat it (its rank
// among the 64, which is its rank among all E: a warp's 9th is beaten by its first 8). Why:
// route_block's rank loop (every thread against all 256) is ~1,000 instructions a thread; run by
// every block of the experts' launches (opt-in `late_route`) it made gate|up 8 µs a layer slower
// on the H200 (2-3 blocks an SM, and down's blocks routing beside them); with route_sort there,
// late_route is as fast as the default (the route's latency now on gate|up's path). Opt-in
// `route_sort` puts it in the router's last block too, where it is slower than route_block (its
// chain of 15 dependent shuffle stages: the router's tail 4.1 -> 5.1 µs a layer). Called by every thread of a block of at least
// 256 (threads from 256 on only meet the barriers); E <= 256, k <= 8.
__device__ __forceinline__ void route_sort(const float* __restrict__ l, u32* __restrict__ ids, float* __restrict__ weights, int E, int k,
                                           int norm_topk, u32* pub = nullptr) {
    __shared__ RouteSmem s;
    __shared__ float cv[64];
    __shared__ int ci[64];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    float p = route_softmax(l, E, s);
    if (t < 256) {
        // The warp's 32 (p, id) best first: bitonic, lane 0 ends with the best. In a run of kk
        // lanes sorted best first ((lane & kk) == 0) the lower lane of each pair keeps the better.
        int id = t;
#pragma unroll
        for (int kk = 2; kk <= 32; kk <<= 1) {
#pragma unroll
            for (int j = kk >> 1; j > 0; j >>= 1) {
                const float op = __shfl_xor_sync(0xffffffffu, p, j);
                const int oi = __shfl_xor_sync(0xffffffffu, id, j);
                const bool ob = better(op, oi, p, id);
                const bool keep_better = ((lane & j) == 0) == ((lane & kk) == 0 || kk == 32);
                if (keep_better == ob) {
                    p = op;
                    id = oi;
                }
            }
        }
        if (lane < 8) {
            cv[warp * 8 + lane] = p;
            ci[warp * 8 + lane] = id;
        }
    }
    __syncthreads();
    if (t < 64) {
        const float c = cv[t];
        const int id = ci[t], w = t >> 3;
        int r = t & 7;  // beaten by the candidates before it in its own list
#pragma unroll
        for (int o = 0; o < 8; o++) {
            if (o == w) continue;
#pragma unroll
            for (int q = 0; q < 8; q++) r += better(cv[o * 8 + q], ci[o * 8 + q], c, id);
        }
        if (r < k) {
            s.top[r] = c;
            s.id[r] = (u32)id;
            ids[r] = (u32)id;
        }
    }
    route_weights(s, weights, k, norm_topk, pub);
}

// The route of `rblock` (gemv.cu's ROUTE and route_ahead, moe.cu's late routes; decode.rs
// route_kind): 2 route_sort (k <= 8, else route_block), 1 route_block, 0 route_warp by warp 0.
// Called by every thread of the block. pub: route_weights' publish (route_block and route_sort
// only: the host never asks it of route_warp).
__device__ __forceinline__ void route_by(int rblock, const float* __restrict__ l, u32* __restrict__ ids, float* __restrict__ weights, int E, int k,
                                         int norm_topk, u32* pub = nullptr) {
    if (rblock == 2 && k <= 8) route_sort(l, ids, weights, E, k, norm_topk, pub);
    else if (rblock) route_block(l, ids, weights, E, k, norm_topk, pub);
    else if (threadIdx.x < 32) route_warp(l, ids, weights, E, k, norm_topk, threadIdx.x);
}
