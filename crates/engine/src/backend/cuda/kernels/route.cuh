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
// SMEM: the logits are in this block's shared memory (gemv.cu's router_cluster), read plainly.
template <int NPL, bool SMEM = false>
__device__ __forceinline__ void route_warp_n(const float* __restrict__ l, u32* __restrict__ ids, float* __restrict__ weights, int E, int k,
                                             int norm_topk, int lane) {
    // Lane l holds experts l, l + 32, ... (unrolled and guarded: registers, not local memory).
    float p[NPL];
    float m = NEG_INF;
#pragma unroll
    for (int i = 0; i < NPL; i++) {
        const int e = lane + 32 * i;
        p[i] = e < E ? (SMEM ? l[e] : __ldcg(l + e)) : NEG_INF;
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
