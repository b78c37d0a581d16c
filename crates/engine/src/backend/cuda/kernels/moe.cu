// moe.cu: routing and the routed experts. Matches cpu/moe.rs (moe_route, moe_experts_prefill,
// moe_experts_decode). Everything stays on the device: no host sync inside an MoE layer.
// Types: router logits and route weights f32; x, out and the op's intermediates (gate, up, their
// silu product, each slot's down output) are bf16 activations, as between ops (common.cuh); dot
// products, the softmax and the weighted sum are f32.
//
// moe_route        logits [rows, E] -> ids [rows, k] u32, weights [rows, k] f32. One warp per row
//                  (ROUTE_WARPS rows per block, grid ceil(rows / ROUTE_WARPS)), the row's
//                  probabilities in registers (lane l holds experts l, l + 32, ...): f32 softmax
//                  (max subtracted, then p /= sum), k rounds of warp arg-max (ties: lower expert
//                  id, as the CPU's stable sort), the chosen p summed in slot order for the
//                  division (norm_topk). No shared memory and no barriers: a block of 256 threads
//                  per row spent its time in the ~25 barriers of its block reductions (a decode
//                  step routes 40 times). E <= 1024, k <= 32.
// Prefill (grouped by expert, as the CPU):
//   moe_count      counts[e] += 1 per slot (t, j) (atomics; counts zeroed before).
//   moe_plan       one thread: offsets = exclusive scan of counts, cursor = offsets, and the tile
//                  list (expert, first position, rows) of 64-row tiles; ntiles.
//   moe_scatter    perm[cursor[e]++] = slot: positions grouped by expert (order inside a group is
//                  arbitrary and harmless: every row's arithmetic is independent of its position).
//   moe_tc_gemm_<fmt> grouped GEMM on tensor cores (the default; tc_gemm.cuh: bf16 operands, f32
//                  accumulation, 128 threads), grid (ceil(out/64), max tiles); block y reads tile
//                  y (or exits). A tile is one expert's rows (at most 64; about 8 at a 256-token
//                  chunk), so each block dequantises a 64-row slice of that expert's weights
//                  once for all its rows: weight streaming, not FLOPs, sets its speed.
//                  mode 0 (gate/up): x row = perm[p] / k, out row = p.
//                  mode 1 (down):    x row = p, out row = perm[p] (the slot t*k + j).
//   moe_gemm_<fmt> the same in f32 SIMT (256 threads; LILY_CUDA_GEMM=simt: reference, ablation).
//   swiglu (norm.cu) between them, then
//   moe_combine    out[t] = sum_j w[t,j] * y[t*k + j], in slot order; with `slogit` (the decode
//                  kernels' folded shared expert, rows = 1) then + sigmoid(slogit[t]) * y[rows*k + t]:
//                  the order of cpu/moe.rs's experts followed by add_sigmoid_gated. Grid
//                  (rows, ceil(dim/256)), 256 threads, one output each.
// Decode (one token, fused gather-GEMV), the shared expert folded in as slot k when `shared`:
//   moe_gate_up_<fmt>  act[j, o] = silu(gate_e . x) * (up_e . x), e = ids[j] for j < k; slot k
//                      (shared) uses the shared expert's gate/up (width_s rows, act at k * width).
//                      Warp per output row, its gate and up rows loaded in one batch
//                      (warp_dot_pair), grid (ceil(max(width, width_s)/8), k + shared), 256
//                      threads.
//   moe_down_<fmt>     y[j, o] = down_{ids[j]} . act_j (slot k: the shared expert's down): warp per
//                      (slot, output row), grid (ceil(hidden/8), k + shared). One dot per warp:
//                      a warp that walked all 9 slots of a row measured ~20 us per layer on the
//                      H200, a chain of dependent loads (id, weights, scales) per slot.
//   moe_combine        (above) with the shared slot. The shared expert must have the experts'
//                      format (checked on the host; otherwise the op returns false and the model
//                      adds it with its unfused ops).

#define ROUTE_WARPS 4     // rows per block

extern "C" __global__ void __launch_bounds__(32 * ROUTE_WARPS)
moe_route(const float* __restrict__ logits, u32* __restrict__ ids, float* __restrict__ weights, int E, int k, int norm_topk,
          int rows) { KTRACE(); PDL_ENTRY();
    const int t = blockIdx.x * ROUTE_WARPS + (threadIdx.x >> 5);
    if (t >= rows) return;
    route_warp(logits + (u64)t * E, ids + (u64)t * k, weights + (u64)t * k, E, k, norm_topk, threadIdx.x & 31);
}

extern "C" __global__ void moe_count(const u32* __restrict__ ids, int* __restrict__ counts, int n) { KTRACE(); PDL_ENTRY();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(&counts[ids[i]], 1);
}

// tiles: int3 (expert, first position, rows) as 3 ints each.
extern "C" __global__ void moe_plan(const int* __restrict__ counts, int* __restrict__ offsets, int* __restrict__ cursor,
                                    int* __restrict__ tiles, int* __restrict__ ntiles, int E) { KTRACE(); PDL_ENTRY();
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    int off = 0, nt = 0;
    for (int e = 0; e < E; e++) {
        int c = counts[e];
        offsets[e] = off;
        cursor[e] = off;
        for (int s = 0; s < c; s += GT_M) {
            tiles[3 * nt] = e;
            tiles[3 * nt + 1] = off + s;
            tiles[3 * nt + 2] = min(GT_M, c - s);
            nt++;
        }
        off += c;
    }
    offsets[E] = off;
    *ntiles = nt;
}

extern "C" __global__ void moe_scatter(const u32* __restrict__ ids, int* __restrict__ cursor, int* __restrict__ perm, int n) { KTRACE(); PDL_ENTRY();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        int p = atomicAdd(&cursor[ids[i]], 1);
        perm[p] = i;
    }
}

static_assert(GT_M == TC_M, "moe_plan's tiles (and moe_tile_rows) feed both grouped GEMMs");

// A grouped-GEMM block's tile (block y): its expert, and the x row / output row of each of its
// GT_M tile rows in xrow / orow (-1: padding), per `mode` (see moe_tc_gemm in the header).
// Returns -1 when the block has no tile. Ends with a barrier; call from all threads.
__device__ __forceinline__ int moe_tile_rows(const int* __restrict__ perm, const int* __restrict__ tiles,
                                             const int* __restrict__ ntiles, int k, int mode, int* xrow, int* orow) {
    const int tile = blockIdx.y;
    if (tile >= *ntiles) return -1;  // uniform over the block: no thread reaches the barrier
    const int e = tiles[3 * tile], p0 = tiles[3 * tile + 1], cnt = tiles[3 * tile + 2];
    if (threadIdx.x < GT_M) {
        const int i = threadIdx.x;
        if (i < cnt) {
            const int p = p0 + i;
            xrow[i] = mode == 0 ? perm[p] / k : p;
            orow[i] = mode == 0 ? p : perm[p];
        } else {
            xrow[i] = -1;
            orow[i] = -1;
        }
    }
    __syncthreads();
    return e;
}

template <int BITS, typename SB>
__device__ __forceinline__ void moe_gemm_body(const u16* __restrict__ x, QMat m, const int* __restrict__ perm,
                                              const int* __restrict__ tiles, const int* __restrict__ ntiles,
                                              u16* __restrict__ out, int k, int mode) {
    __shared__ __align__(16) float As[GT_K][GT_PAD];
    __shared__ __align__(16) float Ws[GT_K][GT_PAD];
    __shared__ int xrow[GT_M];
    __shared__ int orow[GT_M];
    const int e = moe_tile_rows(perm, tiles, ntiles, k, mode, xrow, orow);
    if (e < 0) return;
    const int n0 = blockIdx.x * GT_N;
    float acc[4][4];
    gemm_tile<BITS, SB>(m, e, n0, x, (u64)m.inp, xrow, As, Ws, acc);
    int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int r = orow[ty * 4 + i];
        if (r < 0) continue;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int n = n0 + tx * 4 + j;
            if (n < m.out) out[(u64)r * m.out + n] = bf16_rn(acc[i][j]);
        }
    }
}

template <int BITS, typename SB>
__device__ __forceinline__ void moe_tc_gemm_body(const u16* __restrict__ x, QMat m, const int* __restrict__ perm,
                                                 const int* __restrict__ tiles, const int* __restrict__ ntiles,
                                                 u16* __restrict__ out, int k, int mode) {
    __shared__ int xrow[TC_M];
    __shared__ int orow[TC_M];
    const int e = moe_tile_rows(perm, tiles, ntiles, k, mode, xrow, orow);
    if (e < 0) return;
    const int n0 = blockIdx.x * TC_N;
    float acc[1][2][4][4];
    tc_tile<BITS, SB, 1>(QMats<1>{{m}}, e, n0, x, (u64)m.inp, xrow, acc);
    tc_store_out(acc[0], orow, n0, m.out, out, (u64)m.out, 1);
}

extern "C" __global__ void moe_combine(const u16* __restrict__ y, const float* __restrict__ w, u16* __restrict__ out,
                                       int k, int dim, const float* __restrict__ slogit) { KTRACE(); PDL_ENTRY();
    const int t = blockIdx.x, rows = gridDim.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= dim) return;
    float o = 0.0f;
    for (int j = 0; j < k; j++) o += w[(u64)t * k + j] * bf16f(y[((u64)t * k + j) * dim + i]);
    if (slogit) o += sigmoid_f(slogit[t]) * bf16f(y[((u64)rows * k + t) * dim + i]);
    out[(u64)t * dim + i] = bf16_rn(o);
}

template <int BITS, typename SB>
__device__ __forceinline__ void moe_gate_up_body(const u16* __restrict__ x, QMat g, QMat u, const u32* __restrict__ ids,
                                                 u16* __restrict__ act, QMat sg, QMat su, int k) {
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int j = blockIdx.y;
    const bool shared = j == k;  // only launched with shared
    const QMat G = shared ? sg : g, U = shared ? su : u;
    if (o >= G.out) return;
    const int e = shared ? 0 : ids[j];
    float ag = 0.0f, au = 0.0f;
    warp_dot_pair<BITS, SB>(G, e, U, e, o, x, ag, au, lane);
    float gv = warp_sum(ag), uv = warp_sum(au);
    if (lane == 0) act[(u64)j * g.out + o] = bf16_rn(silu_f(gv) * uv);
}

template <int BITS, typename SB>
__device__ __forceinline__ void moe_down_body(const u16* __restrict__ act, QMat d, const u32* __restrict__ ids,
                                              u16* __restrict__ y, int k, QMat sd) {
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int j = blockIdx.y;
    if (o >= d.out) return;
    const bool shared = j == k;  // only launched with shared
    const QMat D = shared ? sd : d;  // a named copy: a temporary passed by reference lives on the stack
    float part[1] = {0.0f};
    warp_dot_rows<BITS, SB, 1, true>(D, shared ? 0 : ids[j], o, act + (u64)j * d.inp, 0, 1, part, lane);
    const float v = warp_sum(part[0]);
    if (lane == 0) y[(u64)j * d.out + o] = bf16_rn(v);
}

#define MOE_KERNELS(NAME, BITS, SB)                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                                            \
    moe_gemm_##NAME(const u16* x, QMat m, const int* perm, const int* tiles, const int* ntiles, u16* out, int k,   \
                    int mode) { KTRACE(); PDL_ENTRY();                                                           \
        moe_gemm_body<BITS, SB>(x, m, perm, tiles, ntiles, out, k, mode);                                        \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(TC_THREADS)                                                     \
    moe_tc_gemm_##NAME(const u16* x, QMat m, const int* perm, const int* tiles, const int* ntiles, u16* out, int k, \
                       int mode) { KTRACE(); PDL_ENTRY();                                                        \
        moe_tc_gemm_body<BITS, SB>(x, m, perm, tiles, ntiles, out, k, mode);                                     \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(256)                                                            \
    moe_gate_up_##NAME(const u16* x, QMat g, QMat u, const u32* ids, u16* act, QMat sg, QMat su, int k) { KTRACE(); PDL_ENTRY(); \
        moe_gate_up_body<BITS, SB>(x, g, u, ids, act, sg, su, k);                                                \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(256)                                                            \
    moe_down_##NAME(const u16* act, QMat d, const u32* ids, u16* y, int k, QMat sd) { KTRACE(); PDL_ENTRY();     \
        moe_down_body<BITS, SB>(act, d, ids, y, k, sd);                                                          \
    }

FOR_EACH_FORMAT(MOE_KERNELS)

// ---- Decode, weight-streaming (stream.cuh; the default where the formats allow, switch
// `fuse_moe`): the routed experts and the shared expert of one token in two launches.
//   moe_sw_gate_up_<B>_<U>  act[j·W + o] = bf16(silu(gate_e · x) · (up_e · x)) for slots j < k
//                  (e = ids[j]) and slot k (the shared expert, its own matrices): gemv.cu's
//                  geometry (8 warps cut K = hidden, x in registers, two register sets of
//                  batches), a batch being RB = RW·U rows of one slot, each row's gate and up
//                  chunks loaded together. Batches (k + 1)·ceil(W / RB), walked by a grid of
//                  resident blocks, 256 threads.
//   moe_sw_down_<B>_<U>     h[o] += Σ_j w_j · (down_e · act_j) + sigmoid(slogit) · (down_s · act_k):
//                  the weighted combine (slot order, then the shared expert: cpu/moe.rs followed
//                  by add_sigmoid_gated) and the residual add in the epilogue. Warp j is slot j
//                  (32·(k+1) threads), covering the whole row (K = W ≤ 1024: C = K/32 chunks,
//                  RW = 32/C rows per load) with act_j's chunk in registers; a batch is RB = RW·U
//                  output rows, the slots' partials summed through shared memory. The per-slot
//                  down outputs and the MoE output are not rounded to bf16 (they were, unfused).
// Matches Backend::moe_decode_add's default (moe_experts_decode + the shared expert + add).
//   moe_wide_*     (opt-in `moe_wide`, at the end of this file) the same two launches with every
//                  block's weights requested at once through cp.async: see its section.

#define SWG_MAXRB 128  // gate|up rows per batch at most
#define SWD_MAXSLOTS 10
#define SWD_MAXRB 64

struct SwMoe {
    QMat g, u, d;     // routed stacks [E, W, H], [E, W, H], [E, H, W]
    QMat sg, su, sd;  // the shared expert
    u64 x;            // const u16* [H]: the normed input
    u64 ids;          // const u32* [k]
    u64 wts;          // const float* [k]
    u64 slogit;       // const float* [1]
    u64 act;          // u16* [(k + 1)·W]
    u64 h;            // float* [H]: the residual stream
    int k;
    int re;           // moe_late: the experts routed from `logits` (0: the route is in ids, wts)
    u64 counter;      // moe_step: u32 router blocks done; moe_flag: the router's published route
                      // (u64, route.cuh route_weights). moe_wide_down zeroes its 8 bytes (0: none)
    u64 logits;       // moe_late: const float* [re], the router's logits (each block routes)
    int ntopk;        // moe_late: renormalise the top-k weights
    int rblock;       // moe_late: the route's form (route.cuh route_by: 2, route_sort for k <= 8)
    u64 done;         // down_flag: u32 [2], gate|up blocks done, then down blocks past their poll
                      // (moe_flag_gate_up counts, moe_flag_down polls and resets; 0: none)
    int dn;           // down_flag: gate|up's grid, the count moe_flag_down waits for
    int dpad;
};

template <int BITS, int C, int U>
__device__ __forceinline__ void moe_sw_gate_up_body(const SwMoe& p) {
    constexpr int K = 256 * C, RW = 32 / C, RB = RW * U;
    static_assert(RB <= SWG_MAXRB, "batch larger than the reduction buffer");
    __shared__ float red[2][2][SW_WARPS][RB];
    const int W = p.g.out;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int c = lane & (C - 1), r = lane / C;
    const SwLane ln = sw_lane(p.g, warp * C + c);
    const int nb = (W + RB - 1) / RB, total = (p.k + 1) * nb;
    const u32* ids = (const u32*)p.ids;
    int bt = blockIdx.x;
    if (bt >= total) return;

    // Two register sets (gate and up chunks of U rows each): the next batch loads while this
    // one is computed.
    SwUnit<BITS> ga[U], ua[U], gb[U], ub[U];
    int j = bt / nb, row0 = (bt % nb) * RB;
    auto load = [&](SwUnit<BITS> (&lg)[U], SwUnit<BITS> (&lu)[U]) {
        const bool routed = j < p.k;
        const int e = routed ? (int)ids[j] : 0;
        const QMat G = routed ? p.g : p.sg, Uq = routed ? p.u : p.su;
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int o = row0 + u * RW + r;
            if (o < W) {
                sw_load<BITS>(G, e, o, ln, lg[u]);
                sw_load<BITS>(Uq, e, o, ln, lu[u]);
            } else {
                sw_zero<BITS>(lg[u]);
                sw_zero<BITS>(lu[u]);
            }
        }
    };
    load(ga, ua);
    float xv[32];
    const float xs = sw_x_act((const u16*)p.x, ln.ch, xv);

    int par = 0;
    auto step = [&](SwUnit<BITS> (&cg)[U], SwUnit<BITS> (&cu)[U], SwUnit<BITS> (&ng)[U], SwUnit<BITS> (&nu)[U]) -> bool {
        const int cj = j, crow0 = row0;
        const int nbt = bt + gridDim.x;
        if (nbt < total) {
            j = nbt / nb;
            row0 = (nbt % nb) * RB;
            load(ng, nu);
        }
        float pg[U], pu[U];
        sw_dots<BITS, U, C>(cg, xv, xs, pg);
        sw_dots<BITS, U, C>(cu, xv, xs, pu);
        if (c == 0) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                red[par][0][warp][u * RW + r] = pg[u];
                red[par][1][warp][u * RW + r] = pu[u];
            }
        }
        __syncthreads();
        if (tid < RB) {
            float g = 0.0f, uv = 0.0f;
#pragma unroll
            for (int w = 0; w < SW_WARPS; w++) {
                g += red[par][0][w][tid];
                uv += red[par][1][w][tid];
            }
            const int o = crow0 + tid;
            if (o < W) ((u16*)p.act)[(u64)cj * W + o] = bf16_rn(silu_f(g) * uv);
        }
        par ^= 1;
        bt = nbt;
        return nbt < total;
    };
    while (step(ga, ua, gb, ub) && step(gb, ub, ga, ua)) {
    }
}

// The down kernels' epilogue for output o (< H): the slots' partials red[s·stride + i] weighted
// and summed in slot order (cpu/moe.rs's combine, then the shared expert), added to h[o].
__device__ __forceinline__ void moe_down_add(const float* red, int stride, const float* wt, int nslot, int i, int o, int H, float* h) {
    float v = 0.0f;
    for (int s = 0; s < nslot; s++) v += wt[s] * red[s * stride + i];
    if (o < H) h[o] += v;
}

template <int BITS, int C, int U>
__device__ __forceinline__ void moe_sw_down_body(const SwMoe& p) {
    constexpr int K = 32 * C, RW = 32 / C, RB = RW * U;
    static_assert(RB <= SWD_MAXRB, "batch larger than the reduction buffer");
    __shared__ float red[2][SWD_MAXSLOTS][RB];
    __shared__ float wt[SWD_MAXSLOTS];
    const int H = p.d.out;
    const int tid = threadIdx.x, j = tid >> 5, lane = tid & 31;
    const int c = lane & (C - 1), r = lane / C;
    const int nslot = p.k + 1;
    const int nb = (H + RB - 1) / RB;
    int bt = blockIdx.x;
    if (bt >= nb) return;

    const bool routed = j < p.k;
    const int e = routed ? (int)((const u32*)p.ids)[j] : 0;
    const QMat D = routed ? p.d : p.sd;
    const SwLane ln = sw_lane(p.d, c);
    SwUnit<BITS> ua[U], ub[U];
    auto load = [&](int row0, SwUnit<BITS> (&un)[U]) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int o = row0 + u * RW + r;
            if (o < H) sw_load<BITS>(D, e, o, ln, un[u]);
            else sw_zero<BITS>(un[u]);
        }
    };
    load(bt * RB, ua);
    if (lane == 0) wt[j] = routed ? ((const float*)p.wts)[j] : sigmoid_f(((const float*)p.slogit)[0]);
    float xv[32];
    const float xs = sw_x_act((const u16*)p.act + (u64)j * K, c, xv);

    int par = 0;
    auto step = [&](SwUnit<BITS> (&cur)[U], SwUnit<BITS> (&nxt)[U]) -> bool {
        const int crow0 = bt * RB;
        const int nbt = bt + gridDim.x;
        if (nbt < nb) load(nbt * RB, nxt);
        float part[U];
        sw_dots<BITS, U, C>(cur, xv, xs, part);
        if (c == 0) {
#pragma unroll
            for (int u = 0; u < U; u++) red[par][j][u * RW + r] = part[u];
        }
        __syncthreads();
        if (tid < RB) moe_down_add(&red[par][0][0], RB, wt, nslot, tid, crow0 + tid, H, (float*)p.h);
        par ^= 1;
        bt = nbt;
        return nbt < nb;
    };
    while (step(ua, ub) && step(ub, ua)) {
    }
}

// moe_sw_gate_up_<B>_<C>_<U> (hidden = 256·C) and moe_sw_down_<B>_<C>_<U> (width = 32·C).
#define MOE_SW_GATE_UP(BITS, C, U)                                                                          \
    extern "C" __global__ void __launch_bounds__(256, 2) moe_sw_gate_up_##BITS##_##C##_##U(SwMoe p) {        \
        KTRACE(); PDL_ENTRY();                                                                              \
        moe_sw_gate_up_body<BITS, C, U>(p);                                                                 \
    }
#define MOE_SW_DOWN(BITS, C, U)                                                                             \
    extern "C" __global__ void __launch_bounds__(32 * SWD_MAXSLOTS, 2) moe_sw_down_##BITS##_##C##_##U(SwMoe p) { \
        KTRACE(); PDL_ENTRY();                                                                              \
        moe_sw_down_body<BITS, C, U>(p);                                                                    \
    }
#define MOE_SW_KERNELS(BITS)                                                                                \
    MOE_SW_GATE_UP(BITS, 1, 2) MOE_SW_GATE_UP(BITS, 2, 2) MOE_SW_GATE_UP(BITS, 4, 2) MOE_SW_GATE_UP(BITS, 8, 2) \
    MOE_SW_GATE_UP(BITS, 16, 2) MOE_SW_DOWN(BITS, 2, 2) MOE_SW_DOWN(BITS, 4, 2) MOE_SW_DOWN(BITS, 8, 2)       \
    MOE_SW_DOWN(BITS, 16, 2) MOE_SW_DOWN(BITS, 32, 2)

MOE_SW_KERNELS(4)
MOE_SW_KERNELS(8)

// ---- Decode on tensor cores (tc_stream.cuh's dot; switch `tc_gemv` with `fuse_moe`): the same
// two launches and epilogues as moe_sw_* above, for 4-bit experts of group size 64.
//   moe_tc_gate_up_<NS>_<NW>_<S>  hidden = 128·NS·NW (NW warps cut K as tc_gemv); a batch is
//                  one slot's 16-row tile of gate and the same rows of up (two tiles), batches
//                  (k + 1)·ceil(W / 16), staged through shared memory S - 1 batches ahead
//                  (tc_gemv's pipeline: dynamic shared memory S·NW·2·TcSlot<NS>::BYTES).
//                  act[j·W + o] = bf16(silu(g)·u).
//   moe_tc_down_<NS>         W = 128·NS (NS ≤ 4): warp j is slot j (32·(k+1) threads) over the
//                  whole row, act_j as its B fragments; a batch is 16 output rows, the slots'
//                  partials summed in slot order through shared memory, then h[o] += v.

template <int NS, int NW, int S>
__device__ __forceinline__ void moe_tc_gate_up_body(const SwMoe& p) {
    constexpr int K = 128 * NS * NW, SLOT = TcSlot<NS>::BYTES;
    extern __shared__ __align__(16) unsigned char tcs[];
    __shared__ float red[2][2][NW][16];
    __shared__ float xsum[K / 32];
    const int W = p.g.out;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int sb = warp * NS;
    const int nb = (W + 15) / 16, total = (p.k + 1) * nb;
    const u32* ids = (const u32*)p.ids;
    if ((int)blockIdx.x >= total) return;
    const u32 base = smem_u32(tcs);
    auto slot = [&](int st, int u) { return ((st * NW + warp) * 2 + u) * SLOT; };
    auto issue = [&](int n) {
        const int bt = blockIdx.x + n * gridDim.x;
        if (bt < total) {
            const int j = bt / nb, row0 = (bt % nb) * 16;
            const bool routed = j < p.k;
            const int e = routed ? (int)ids[j] : 0;
            tc_issue<NS>(routed ? p.g : p.sg, e, row0, W, sb, g, t, lane, base + slot(n % S, 0));
            tc_issue<NS>(routed ? p.u : p.su, e, row0, W, sb, g, t, lane, base + slot(n % S, 1));
        }
        cp_commit();
    };
#pragma unroll
    for (int n = 0; n < S - 1; n++) issue(n);

    const int ch = tc_chunk<NS>(sb, g, t);
    float xv[32];
#pragma unroll
    for (int i = 0; i < 32; i++) xv[i] = 0.0f;
    const float xs = ch >= 0 ? sw_x_act((const u16*)p.x, ch, xv) : 0.0f;
    u32 xb[NS][8][2];
    float xs0, xs1;
    tc_setup_x<NS>(xv, xs, ch, xsum, sb, g, t, xb, xs0, xs1);

    for (int n = 0;; n++) {
        const int bt = blockIdx.x + n * gridDim.x;
        if (bt >= total) break;
        cp_wait<S - 2>();
        TcTile<NS> tg, tu;
        tc_fetch<NS>(tcs + slot(n % S, 0), t, lane, tg);
        tc_fetch<NS>(tcs + slot(n % S, 1), t, lane, tu);
        issue(n + S - 1);
        const int par = n & 1;
        float dg[4], du[4];
        tc_dot<NS>(tg, xb, dg);
        tc_dot<NS>(tu, xb, du);
        float ga_, gb_, ua_, ub_;
        tc_finish<NS>(tg, dg, xs0, xs1, t, ga_, gb_);
        tc_finish<NS>(tu, du, xs0, xs1, t, ua_, ub_);
        if (t == 0) {
            red[par][0][warp][g] = ga_;
            red[par][0][warp][g + 8] = gb_;
            red[par][1][warp][g] = ua_;
            red[par][1][warp][g + 8] = ub_;
        }
        __syncthreads();
        if (tid < 16) {
            float gv = 0.0f, uv = 0.0f;
#pragma unroll
            for (int w = 0; w < NW; w++) {
                gv += red[par][0][w][tid];
                uv += red[par][1][w][tid];
            }
            const int j = bt / nb, o = (bt % nb) * 16 + tid;
            if (o < W) ((u16*)p.act)[(u64)j * W + o] = bf16_rn(silu_f(gv) * uv);
        }
    }
    cp_wait<0>();
}

template <int NS>
__device__ __forceinline__ void moe_tc_down_body(const SwMoe& p) {
    constexpr int K = 128 * NS;
    __shared__ float red[2][SWD_MAXSLOTS][16];
    __shared__ float xsum[SWD_MAXSLOTS][K / 32];
    __shared__ float wt[SWD_MAXSLOTS];
    const int H = p.d.out;
    const int tid = threadIdx.x, j = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int nslot = p.k + 1;
    const int nb = (H + 15) / 16;
    int bt = blockIdx.x;
    if (bt >= nb) return;

    const bool routed = j < p.k;
    const int e = routed ? (int)((const u32*)p.ids)[j] : 0;
    const QMat D = routed ? p.d : p.sd;
    TcTile<NS> ta, tb;
    tc_load<NS>(D, e, bt * 16, H, 0, g, t, ta);
    if (lane == 0) wt[j] = routed ? ((const float*)p.wts)[j] : sigmoid_f(((const float*)p.slogit)[0]);
    const int ch = tc_chunk<NS>(0, g, t);
    float xv[32];
#pragma unroll
    for (int i = 0; i < 32; i++) xv[i] = 0.0f;
    const float xs = ch >= 0 ? sw_x_act((const u16*)p.act + (u64)j * K, ch, xv) : 0.0f;
    u32 xb[NS][8][2];
    float xs0, xs1;
    tc_setup_x<NS>(xv, xs, ch, xsum[j], 0, g, t, xb, xs0, xs1);

    int par = 0;
    auto step = [&](TcTile<NS>& cur, TcTile<NS>& nxt) -> bool {
        const int crow0 = bt * 16;
        const int nbt = bt + gridDim.x;
        if (nbt < nb) tc_load<NS>(D, e, nbt * 16, H, 0, g, t, nxt);
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        tc_dot<NS>(cur, xb, d);
        float ra, rb;
        tc_finish<NS>(cur, d, xs0, xs1, t, ra, rb);
        if (t == 0) {
            red[par][j][g] = ra;
            red[par][j][g + 8] = rb;
        }
        __syncthreads();
        if (tid < 16) moe_down_add(&red[par][0][0], 16, wt, nslot, tid, crow0 + tid, H, (float*)p.h);
        par ^= 1;
        bt = nbt;
        return nbt < nb;
    };
    while (step(ta, tb) && step(tb, ta)) {
    }
}

#define MOE_TC_GATE_UP(NS, NW, S)                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * NW) moe_tc_gate_up_##NS##_##NW##_##S(SwMoe p) {      \
        KTRACE(); PDL_ENTRY();                                                                              \
        moe_tc_gate_up_body<NS, NW, S>(p);                                                                  \
    }
#define MOE_TC_DOWN(NS)                                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * SWD_MAXSLOTS) moe_tc_down_##NS(SwMoe p) {             \
        KTRACE(); PDL_ENTRY();                                                                              \
        moe_tc_down_body<NS>(p);                                                                            \
    }
MOE_TC_GATE_UP(2, 4, 4)
MOE_TC_GATE_UP(2, 8, 3)
MOE_TC_GATE_UP(2, 8, 4)
MOE_TC_GATE_UP(2, 16, 2)
MOE_TC_DOWN(1)
MOE_TC_DOWN(2)
MOE_TC_DOWN(4)

// ---- Decode, wide (opt-in switch `moe_wide`): the same two launches and the same function as
// moe_sw_* above (bit for bit: the same chunk dot, the same shuffle and warp summation order, the
// same epilogues), with the loads shaped for the bytes in flight that a one-wave kernel needs.
// Matches Backend::moe_decode_add's default (cpu/moe.rs moe_experts_decode + the shared expert,
// add_sigmoid_gated, then the residual add), f32 accumulation, act stored as bf16.
//
// Why. Full model: H = 2048, W = 512, k = 8 routed + 1 shared slot, 4-bit, group 64. gate|up
// reads 9·512 row pairs of 2304 B (2·1024 B of codes + 2·32 groups of bf16 scale and bias) =
// 10.6 MB, i.e. ~80 KB per SM of the H200's 132; down reads 9·2048 rows of 288 B = 5.3 MB, ~40 KB
// per SM. At 4.3 TB/s and ~1 µs of loaded DRAM latency the GPU needs ~4.3 MB (~33 KB per SM) in
// flight just to stream, and each SM's whole share is only 2.5 (gate|up) and 1.2 (down) of those
// latencies long. moe_sw walks batches with two register sets (16 KB per block per set, ~2.2
// batches per block): every batch after the first is requested only when the previous has
// arrived, so the kernel pays the latency 3-4 times in a row (ids -> batch 0 -> batch 1 ...),
// then a barrier per batch; down the same. Measured: 9.7 + 7.5 µs (ncu) for 2.5 + 1.2 µs of
// reading. So here every block requests ALL of its weights at once, before computing anything:
// each lane copies its own chunks (16 B of codes per 32 inputs, and the 4-byte words holding its
// group's bf16 scale and bias) into its own slots of shared memory with cp.async, one commit group
// per row group, then computes row group after row group as they land (cp.async.wait_group,
// no barrier: a lane reads back only what it copied). A lane's share in flight is its whole
// share: the SM's ~80 KB of gate|up and ~40 KB of down are all requested within the first
// microsecond. Nothing is held in registers while in flight, so the depth costs no registers
// (the tensor-core attempt, tc_all, spilled at 4 stages of registers in down).
//
// The latency chain at the start is cut where it can be:
// * gate|up's blocks are ordered shared expert first (slot index 0 in the grid, written at act
//   slot k as before): those need no expert id, so they request their weights before
//   griddepcontrol.wait, while the router still runs. The routed blocks wait, read their id (one
//   L2 round trip), then request theirs. Each block lets its dependent (down) launch right after
//   its wait. moe_flag_gate_up (opt-in `route_flag`) replaces the wait and the id's round trip by
//   a poll of the one u64 in which the router's last block publishes the ids (GU_FLAG below).
// * down's blocks request all their weights BEFORE griddepcontrol.wait: launched (PDL) as soon
//   as every gate|up block has passed its own wait, they stream down's 5.3 MB while gate|up
//   computes, then wait for act. Their expert ids are read before the wait too, which is safe:
//   the router that wrote them completed before any gate|up block got past its wait, hence
//   before down was launched; they are read with ld.global.cg (L2, never a stale L1 line). The
//   route weights and the shared gate logit are read after the wait (only the epilogue needs
//   them). Without PDL (tests, LILY_CUDA_GRAPH=0) the wait and launch are no-ops: stream order.
//
//   moe_wide_gate_up_<B>_<C>_<RPB>  hidden = 256·C (C = 8: 2048), the gemv geometry (8 warps cut
//                  K, lane = (row r of RW = 32/C, chunk c)), x in registers. A block is RPB rows
//                  of one slot (G = RPB/RW row groups, each a commit group); grid (k+1)·W/RPB
//                  blocks of 256 threads (288 at RPB 16: 2-3 per SM, all resident), dynamic
//                  shared memory G·(2·BITS/4·4 KB + 4 KB) (48 KB at 4-bit, RPB 16).
//                  act[j·W + o] = bf16(silu(Σ_w gate_w) · Σ_w up_w), one barrier per block.
//   moe_wide_down_<B>_<C>_<DR>      width = 32·C (C = 16: 512). Warp j is slot j (32·(k+1)
//                  threads), a block is DR output rows of every slot (G = DR/RW row groups, RW =
//                  32/C), grid H/DR (128 at DR 16: one per SM), dynamic shared memory
//                  G·32·(k+1)·(16·BITS/4 + 8) bytes (55 KB at 4-bit, DR 16). The slots' partials
//                  combined in slot order, + sigmoid(slogit)·shared, added to h (moe_down_add).
// Host requirements (decode.rs moe_wide): bf16 scales, groups per row even (the scale word
// holding a lane's group has the group's parity), W % RPB == 0, H % DR == 0, k + 1 ≤ 10.
// Tunables: LILY_CUDA_MOE_WIDE=RPB,DR (gate|up rows per block 8|16|32, down rows per block
// 4|8|16|32; default 16,8: measured fastest of 16,16 / 8,16 / 32,16 / 16,8 / 16,32 on the H200). ptxas (sm_90, 4-bit): gate|up 64 / 77 / 80 registers at RPB 8 / 16 /
// 32, down 78 / 72 / 96 at DR 8 / 16 / 32, no spills; 8-bit alike. At 16,16: gate|up 3 blocks per
// SM by registers (all 288 resident), ~36 KB of DRAM bytes per block, ~80 KB per SM in flight;
// down ~41 KB per block and per SM, requested while gate|up runs on SMs with room (2 gate|up
// blocks + 1 down block fit in registers and shared memory).

// cp_wait_n, wide_issue and wide_fetch: wide.cuh.

// ---- moe_step_gate_up_<B>_<C>_<RPB> (opt-in `moe_step`, Backend::moe_step_add): the router folded
// into moe_wide's gate|up launch. Matches moe_step_compose: moe_router (rms_norm + router | shared
// gate as sw_gemv_8 computes them, bit for bit: the same x, chunk dot, shuffles and warp order;
// the route as route.cuh) then moe_decode_add (moe_wide, unchanged).
//
// Why. In a recorded step the router's own launch cost 12 µs a layer (decode at 4K without it:
// 674 against 509 tok/s, LILY_CUDA_SKIP), for 0.6 MB of weights: its 33 blocks are a chain (wait
// for out_proj, norm, dot, fence, ticket, route in the last block, grid completion) and only
// then may gate|up read its expert ids and request the experts' 8.4 MB. Here every gate|up block
// normalises h itself (8 KB), the first NRJ = ceil((E + 1) / RW) blocks each compute RW router
// rows (their weights requested before the PDL wait), store the logits and count themselves on
// `counter`; the routed blocks wait for the count (one thread polls with ld.acquire), route in
// their first warp from the logits in L2 (route.cuh, each block for itself: no second round
// trip), then request their expert's rows. The shared expert's blocks never wait for the router.
// The first routed block writes ids and weights for down, then lets it launch (down reads them
// before its own PDL wait); down resets the counter after its wait, when every gate|up block is
// done.
// Progress: a routed block spins until the router blocks (the lowest indices, scheduled first)
// are done, so the whole grid must be resident at once: the host checks it (resident_blocks).
// Measured on the H200 (full preset, decode at 4K): correct, bit-equal to the composition, but
// slower: 505 against 535 tok/s. Its phases left out one at a time (LILY_MOE_STEP_PROBE, before
// sw_rms_scale was unrolled): the wait for the count 3.1 µs a layer, the route 3.1, the norm 6.6
// (now unrolled everywhere), the fence nothing. The router's own launch it replaces cost about
// as much as the wait and the route together, so it stays opt-in.

struct SwStep {
    SwMoe m;
    QMat r, rs;       // the router [E, H] and the shared expert's gate [1, H], 8-bit
    u64 nw;           // const float* [H]: the norm weight (the norm's input is m.h)
    u64 xn;           // u16* [H]: x, written by block 0
    u64 logits;       // float* [E]
    u64 s;            // the shared gate's logit [1] (store_out with sobf)
    float eps;
    int e;            // experts
    int ntopk;        // renormalise the top-k weights
    int sobf;
    int probe;        // timing probes only (LILY_MOE_STEP_PROBE, wrong results): 1 no count
                      // wait, 2 no route (the last ids), 4 no norm (x from xn), 8 no fence
    int pad;
};

__device__ __forceinline__ u32 ld_acquire_u32(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// The first routed block of a gate|up launch that routes itself (blockIdx.x == bps: moe_step):
// the route for down (read before its own PDL wait) and the host, visible before this
// block lets down launch. Every thread of the block calls it (a barrier).
__device__ __forceinline__ void moe_publish_route(const SwMoe& p, const u32* rid, const float* rwt, int bps, int tid) {
    if ((int)blockIdx.x != bps) return;
    if (tid < p.k) {
        ((u32*)p.ids)[tid] = rid[tid];
        ((float*)p.wts)[tid] = rwt[tid];
        __threadfence();
    }
    __syncthreads();
}

__device__ __forceinline__ u64 ld_acquire_u64(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// GU_FLAG: the route the router's last block published (route.cuh route_weights: id j in bits
// 8j .. 8j + 7, never 0 once published), polled by one thread of the block. Why it cannot hang:
// a PDL launch starts only after every block of the router has let it (PDL_LAUNCH, after the
// router's own wait), so all of the router's blocks are resident or done and its last block
// publishes. A word never published (a host bug) traps after ~2^22 polls (seconds) instead.
__device__ __forceinline__ u64 moe_wait_route(const u64* f) {
    u64 v;
    for (u32 n = 0; (v = ld_acquire_u64(f)) == 0; n++)
        if (n == 1u << 22) __trap();
    return v;
}

// What a gate|up launch does between its PDL wait and its routed rows' requests (MODE):
// GU_PLAIN  (moe_wide_gate_up): the ids the router wrote, then x.
// GU_FLAG   (moe_flag_gate_up, opt-in `route_flag`): no PDL wait. Thread 0 polls the route the
//           router's last block published (moe_wait_route; its acquire and the barrier make
//           everything the router wrote visible to the block, x included), the ids taken from
//           that word; then as GU_PLAIN.
// GU_STEP   (moe_step_gate_up, opt-in `moe_step`): the router inside this launch (below).
// GU_LATE   (moe_late_gate_up, opt-in `late_route`): x, then each routed block routes the
//           logits itself (route.cuh route_by: route_sort for k <= 8, else route_block), then
//           requests its expert's rows.
// ST: SwStep with GU_STEP, else unused (the kernel passes p again): a reference,
// not a pointer, so the kernel's parameter is read in place (its address would copy it to the
// stack).
enum GuMode { GU_PLAIN, GU_STEP, GU_LATE, GU_FLAG };
template <int BITS, int C, int RPB, int MODE, typename ST>
__device__ __forceinline__ void moe_wide_gate_up_body(const SwMoe& p, const ST& st) {
    constexpr int RW = 32 / C, G = RPB / RW, NP = BITS / 4, T = 256;
    static_assert(G * RW == RPB && G >= 1 && G <= 16, "rows per block: a multiple of RW, at most 16 groups");
    // Shared memory: codes [G][2 (gate, up)][NP][T] of 16 B, then scale words [G][2][T] and bias
    // words [G][2][T] of 4 B: lane-consecutive, so copies and reads are conflict-free.
    constexpr int CODES = G * 2 * NP * T * 16, SBW = G * 2 * T * 4;
    extern __shared__ __align__(16) unsigned char wsm[];
    __shared__ float red[2][SW_WARPS][RPB];
    const int W = p.g.out;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int c = lane & (C - 1), r = lane / C;
    const SwLane ln = sw_lane(p.g, warp * C + c);
    const int half = (int)(ln.gch & 1u);
    const int bps = W / RPB;  // blocks per slot
    const int s = blockIdx.x / bps, row0 = (blockIdx.x % bps) * RPB;
    const bool shared = s == 0;  // grid slot 0: the shared expert, act slot k
    const int j = shared ? p.k : s - 1;
    const u32 base = smem_u32(wsm);
    auto code_at = [&](int q, int mt) { return ((q * 2 + mt) * NP * T + tid) * 16; };
    auto sw_at = [&](int q, int mt) { return CODES + ((q * 2 + mt) * T + tid) * 4; };
    auto issue = [&](int e) {
        const QMat Gm = shared ? p.sg : p.g, Um = shared ? p.su : p.u;
#pragma unroll
        for (int q = 0; q < G; q++) {
            const int o = row0 + q * RW + r;
            wide_issue<BITS>(Gm, e, o, ln, base + code_at(q, 0), T * 16, base + sw_at(q, 0), base + SBW + sw_at(q, 0), true);
            wide_issue<BITS>(Um, e, o, ln, base + code_at(q, 1), T * 16, base + sw_at(q, 1), base + SBW + sw_at(q, 1), true);
            cp_commit();
        }
    };
    // GU_STEP: the norm weight first, in a commit group of its own (row group q is group q + 1).
    __shared__ __align__(16) float wn[MODE == GU_STEP ? 256 * C : 4];
    if constexpr (MODE == GU_STEP) {
        cp_stage_norm<256 * C, T>((const float*)st.nw, smem_u32(wn));
        cp_commit();
    }
    // The shared expert's weights do not depend on the router: requested before the wait.
    if (shared) issue(0);
    float xv[32];
    float xs;
    if constexpr (MODE == GU_PLAIN) {
        PDL_WAIT();
        PDL_LAUNCH();
        if (!shared) issue((int)((const u32*)p.ids)[j]);
        xs = sw_x_act((const u16*)p.x, ln.ch, xv);
    } else if constexpr (MODE == GU_FLAG) {
        __shared__ u64 rv;
        if (tid == 0) rv = moe_wait_route((const u64*)p.counter);
        __syncthreads();
        TRACE_WAITED();
        PDL_LAUNCH();
        if (!shared) issue((int)((rv >> (8 * j)) & 0xffu));
        xs = sw_x_act((const u16*)p.x, ln.ch, xv);
    } else if constexpr (MODE == GU_LATE) {
        __shared__ u32 rid[32];
        __shared__ float rwt[32];
        PDL_WAIT();
        PDL_LAUNCH();
        // x's loads first: they overlap the logits' round trip and the route.
        xs = sw_x_act((const u16*)p.x, ln.ch, xv);
        if (!shared) {
            // ids published by the route's barriers.
            route_by(p.rblock, (const float*)p.logits, rid, rwt, p.re, p.k, p.ntopk);
            issue((int)rid[j]);
        }
    } else {
        // Router rows o = RW·b + r of [router; shared gate] for the first NRJ blocks b, requested
        // before the wait like the shared expert's weights.
        __shared__ float sh[32];
        __shared__ float rred[SW_WARPS][RW];
        __shared__ u32 rid[32];
        __shared__ float rwt[32];
        const int E = st.e, nrj = (E + 1 + RW - 1) / RW;
        const bool rjob = (int)blockIdx.x < nrj;
        const SwLane rl = sw_lane(st.r, warp * C + c);
        SwUnit<8> ru[1];
        const int ro = blockIdx.x * RW + r;
        if (rjob && ro < E) sw_load<8>(st.r, 0, ro, rl, ru[0]);
        else if (rjob && ro == E) sw_load<8>(st.rs, 0, 0, rl, ru[0]);
        else sw_zero<8>(ru[0]);
        PDL_WAIT();
        cp_wait_n(shared ? G : 0);  // the norm weight's group (sw_rms_scale's barrier publishes it)
        // x = bf16(rms_norm(h) · w) as sw_gemv's prologue 1 (sw_x_pro), block 0 storing it.
        const float* hh = (const float*)p.h;
        if (st.probe & 4) {
            xs = sw_x_act((const u16*)p.x, ln.ch, xv);
        } else {
            const float rr = sw_rms_scale<256 * C, 256>(hh, st.eps, sh);
            xs = sw_x_norm(hh, wn, rr, ln.ch, xv);
        }
        if (blockIdx.x == 0 && r == 0 && !(st.probe & 4)) {
            uint4* o = (uint4*)((u16*)st.xn + ln.ch * 32);
#pragma unroll
            for (int i = 0; i < 4; i++) o[i] = sw_pack8(xv, i);
        }
        if (rjob) {
            float part[1];
            sw_dots<8, 1, C>(ru, xv, xs, part);
            if (c == 0) rred[warp][r] = part[0];
            __syncthreads();
            if (tid < RW) {
                float v = 0.0f;
#pragma unroll
                for (int w = 0; w < SW_WARPS; w++) v += rred[w][tid];
                const int o = blockIdx.x * RW + tid;
                if (o < E) ((float*)st.logits)[o] = v;
                else if (o == E) store_out((void*)st.s, 0, v, st.sobf);
            }
            // Make the logits visible, then count this block (gemv.cu's route ticket).
            if (!(st.probe & 8)) __threadfence();
            __syncthreads();
            if (tid == 0) atomicAdd((u32*)p.counter, 1u);
        }
        if (shared) {
            PDL_LAUNCH();
        } else {
            if (tid == 0 && !(st.probe & 1))
                while (ld_acquire_u32((const u32*)p.counter) < (u32)nrj) {
                }
            __syncthreads();
            // E <= 256 (the host checks): 8 experts per lane (the general route_warp spills here).
            if (st.probe & 2) {
                if (tid < p.k) {
                    rid[tid] = __ldcg((const unsigned int*)p.ids + tid);
                    rwt[tid] = __ldcg((const float*)p.wts + tid);
                }
            } else if (warp == 0) {
                route_warp_n<8>((const float*)st.logits, rid, rwt, E, p.k, st.ntopk, lane);
            }
            __syncthreads();
            moe_publish_route(p, rid, rwt, bps, tid);
            PDL_LAUNCH();
            issue((int)rid[j]);
        }
    }
    TRACE_MARK(1);  // x ready, the routed rows requested
#pragma unroll
    for (int q = 0; q < G; q++) {
        cp_wait_n(G - 1 - q);
        SwUnit<BITS> ug[1], uu[1];
        wide_fetch<BITS>(wsm + code_at(q, 0), T * 16, (const u32*)(wsm + sw_at(q, 0)), (const u32*)(wsm + SBW + sw_at(q, 0)), half, ug[0]);
        wide_fetch<BITS>(wsm + code_at(q, 1), T * 16, (const u32*)(wsm + sw_at(q, 1)), (const u32*)(wsm + SBW + sw_at(q, 1)), half, uu[0]);
        float pg[1], pu[1];
        sw_dots<BITS, 1, C>(ug, xv, xs, pg);
        sw_dots<BITS, 1, C>(uu, xv, xs, pu);
        if (c == 0) {
            red[0][warp][q * RW + r] = pg[0];
            red[1][warp][q * RW + r] = pu[0];
        }
    }
    TRACE_MARK(2);  // every row group's dots done
    __syncthreads();
    if (tid < RPB) {
        float g = 0.0f, uv = 0.0f;
#pragma unroll
        for (int w = 0; w < SW_WARPS; w++) {
            g += red[0][w][tid];
            uv += red[1][w][tid];
        }
        ((u16*)p.act)[(u64)j * W + row0 + tid] = bf16_rn(silu_f(g) * uv);
    }
    // down_flag (GU_FLAG only): count this block done for moe_flag_down's poll. The barrier
    // orders the act stores before thread 0's release add (the arrive of CUTLASS's generic
    // barrier: no separate fence).
    if constexpr (MODE == GU_FLAG) {
        if (p.done != 0) {
            __syncthreads();
            if (tid == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p.done) : "memory");
        }
    }
}

// LATE (moe_late_down, opt-in `late_route`): the block routes the logits itself before its wait
// (route.cuh route_sort or route_block; the router completed before any gate|up block passed
// its wait, hence before this launch), block 0 writing the route for the host.
// FLAG (moe_flag_down, opt-in `down_flag` beside `route_flag`): no PDL wait. Thread 0 polls the
// count of gate|up blocks done (p.done[0], moe_flag_gate_up's end) up to p.dn with ld.acquire,
// and the barrier hands what they wrote (act; the route they acquired) to the block. It cannot
// hang: this launch starts only after every gate|up block has let it (PDL_LAUNCH, after their
// poll of the route), so they are all resident or done. A count never reached (a host bug) traps
// after ~2^22 polls. Block 0 then zeroes the published route (p.counter) before the launch lets
// the next kernel start, as moe_wide_down does after its wait. Each block counts itself past its
// poll in p.done[1] (the atomic's result is read only at the block's end, off its critical path);
// the last one resets both words for the next launch: every block is past its poll and every
// gate|up block has counted. Returns that ticket (thread 0; the others 0).
__device__ __forceinline__ u32 moe_wait_done(const SwMoe& p, int tid) {
    u32 ticket = 0u;
    if (tid == 0) {
        u32* d = (u32*)p.done;
        for (u32 n = 0; ld_acquire_u32(d) < (u32)p.dn; n++)
            if (n == 1u << 22) __trap();
        if (blockIdx.x == 0) {
            *(u64*)p.counter = 0ull;
            __threadfence();
        }
        ticket = atomicAdd(d + 1, 1u);
    }
    __syncthreads();
    TRACE_WAITED();
    return ticket;
}

// TMA (moe_tma_down, switch `down_tma`, the default since stop 54: 1.015x at 4K, 1.005x at 128K
// on an H100; stop 56's ablation 1.013x and 1.011x): each slot's DR rows (codes, scales, biases)
// fetched by three bulk copies that the slot's lane 0 issues (wide.cuh tma_rows), laid out
// row-major in the slot's part of shared memory (DR·(W·BITS/8 + 4·W/gs) bytes), the warp waiting
// on the slot's mbarrier before its first dot: the same SwUnit values (tma_fetch), so the same
// bits.
template <int BITS, int C, int DR, bool LATE, bool FLAG = false, bool TMA = false>
__device__ __forceinline__ void moe_wide_down_body(const SwMoe& p) {
    constexpr int K = 32 * C, RW = 32 / C, G = DR / RW, NP = BITS / 4;
    static_assert(G * RW == DR && G >= 1 && G <= 16, "rows per block: a multiple of RW, at most 16 groups");
    // Shared memory (T = 32·(k+1) threads): codes [G][NP][T] of 16 B, scale words [G][T], bias
    // words [G][T].
    extern __shared__ __align__(16) unsigned char wsm[];
    __shared__ float red[SWD_MAXSLOTS][DR];
    __shared__ float wt[SWD_MAXSLOTS];
    const int H = p.d.out, T = blockDim.x;
    const int tid = threadIdx.x, j = tid >> 5, lane = tid & 31;
    const int c = lane & (C - 1), r = lane / C;
    const int nslot = p.k + 1;
    const int row0 = blockIdx.x * DR;
    const int codes = G * NP * T * 16, sbw = G * T * 4;
    const bool routed = j < p.k;
    __shared__ u32 rid[LATE ? 32 : 1];
    __shared__ float rwt[LATE ? 32 : 1];
    if constexpr (LATE) {
        route_by(p.rblock, (const float*)p.logits, rid, rwt, p.re, p.k, p.ntopk);
        __syncthreads();  // the weights (written after the route's last barrier)
        if (blockIdx.x == 0 && tid < p.k) {
            ((u32*)p.ids)[tid] = rid[tid];
            ((float*)p.wts)[tid] = rwt[tid];
        }
    }
    // Before the wait (module note above): the router that wrote the ids has completed.
    const int e = !routed ? 0 : LATE ? (int)rid[j] : (int)__ldcg((const unsigned int*)p.ids + j);
    const QMat D = routed ? p.d : p.sd;
    const SwLane ln = sw_lane(p.d, c);
    const int half = (int)(ln.gch & 1u);
    const u32 base = smem_u32(wsm);
    // TMA: slot j's rows at wsm + j·slotb (rowb bytes of codes a row, then gpr scales and gpr
    // biases a row); its mbarrier mb[j], initialised and armed by the slot's lane 0.
    // The slots share one layout: the host checks that the shared expert's group size is the
    // routed experts'.
    __shared__ __align__(8) u64 mb[TMA ? SWD_MAXSLOTS : 1];
    const int rowb = K * BITS / 8, gpr = K / p.d.gs;
    const int slotb = DR * (rowb + 4 * gpr);
    if constexpr (TMA) {
        if (lane == 0) {
            mbar_init1(&mb[j]);
            tma_rows<BITS>(D, e, row0, DR, base + j * slotb, &mb[j]);
        }
        __syncwarp();  // the slot's mbarrier initialised before any of its lanes waits on it
    } else {
#pragma unroll
        for (int q = 0; q < G; q++) {
            const int o = row0 + q * RW + r;
            wide_issue<BITS>(D, e, o, ln, base + (q * NP * T + tid) * 16, T * 16, base + codes + (q * T + tid) * 4, base + codes + sbw + (q * T + tid) * 4, true);
            cp_commit();
        }
    }
    u32 ticket = 0u;
    if constexpr (FLAG) {
        ticket = moe_wait_done(p, tid);
    } else {
        PDL_WAIT();
        // moe_step / route_flag: every gate|up block is done (the wait above), so the router
        // count or the published route goes back to 0 for the next launch, and before this
        // launch lets the next kernel start: with route_flag a later MoE block's gate|up polls
        // that word without a wait, and PDL launches cascade (each kernel lets the next launch
        // before its own wait), so it must never find this block's word still set.
        if (p.counter != 0) {
            if (blockIdx.x == 0 && tid == 0) {
                *(u64*)p.counter = 0ull;
                __threadfence();
            }
            __syncthreads();
        }
    }
    PDL_LAUNCH();
    if (lane == 0) wt[j] = routed ? (LATE ? rwt[j] : ((const float*)p.wts)[j]) : sigmoid_f(((const float*)p.slogit)[0]);
    float xv[32];
    const float xs = sw_x_act((const u16*)p.act + (u64)j * K, c, xv);
    TRACE_MARK(1);  // x ready
    if constexpr (TMA) mbar_wait_parity(&mb[j], 0u);  // every lane, after lane 0 armed it (same warp)
#pragma unroll
    for (int q = 0; q < G; q++) {
        SwUnit<BITS> un[1];
        if constexpr (TMA) {
            tma_fetch<BITS>(wsm + j * slotb, DR, rowb, gpr, q * RW + r, ln, un[0]);
        } else {
            cp_wait_n(G - 1 - q);
            wide_fetch<BITS>(wsm + (q * NP * T + tid) * 16, T * 16, (const u32*)(wsm + codes + (q * T + tid) * 4), (const u32*)(wsm + codes + sbw + (q * T + tid) * 4), half, un[0]);
        }
        float part[1];
        sw_dots<BITS, 1, C>(un, xv, xs, part);
        if (c == 0) red[j][q * RW + r] = part[0];
    }
    TRACE_MARK(2);  // every row group's dots done
    __syncthreads();
    if (tid < DR) moe_down_add(&red[0][0], DR, wt, nslot, tid, row0 + tid, H, (float*)p.h);
    if (FLAG && tid == 0 && ticket == gridDim.x - 1) {
        ((u32*)p.done)[0] = 0u;
        ((u32*)p.done)[1] = 0u;
    }
}

// No PDL_ENTRY: each body places its own wait (above).
#define MOE_WIDE_GATE_UP(BITS, C, RPB)                                                                      \
    extern "C" __global__ void __launch_bounds__(256, MWG_MINB) moe_wide_gate_up_##BITS##_##C##_##RPB(SwMoe p) {  \
        KTRACE();                                                                                            \
        moe_wide_gate_up_body<BITS, C, RPB, GU_PLAIN>(p, p);                                                \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(256, MWG_MINB) moe_step_gate_up_##BITS##_##C##_##RPB(SwStep q) { \
        KTRACE();                                                                                           \
        moe_wide_gate_up_body<BITS, C, RPB, GU_STEP>(q.m, q);                                               \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(256, MWG_MINB) moe_late_gate_up_##BITS##_##C##_##RPB(SwMoe p) { \
        KTRACE();                                                                                           \
        moe_wide_gate_up_body<BITS, C, RPB, GU_LATE>(p, p);                                                 \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(256, MWG_MINB) moe_flag_gate_up_##BITS##_##C##_##RPB(SwMoe p) { \
        KTRACE();                                                                                           \
        moe_wide_gate_up_body<BITS, C, RPB, GU_FLAG>(p, p);                                                 \
    }
#define MOE_WIDE_DOWN(BITS, C, DR)                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * SWD_MAXSLOTS, MWD_MINB) moe_wide_down_##BITS##_##C##_##DR(SwMoe p) { \
        KTRACE();                                                                                           \
        moe_wide_down_body<BITS, C, DR, false>(p);                                                          \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * SWD_MAXSLOTS, MWD_MINB) moe_late_down_##BITS##_##C##_##DR(SwMoe p) { \
        KTRACE();                                                                                           \
        moe_wide_down_body<BITS, C, DR, true>(p);                                                           \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * SWD_MAXSLOTS, MWD_MINB) moe_flag_down_##BITS##_##C##_##DR(SwMoe p) { \
        KTRACE();                                                                                           \
        moe_wide_down_body<BITS, C, DR, false, true>(p);                                                    \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * SWD_MAXSLOTS, MWD_MINB) moe_tma_down_##BITS##_##C##_##DR(SwMoe p) { \
        KTRACE();                                                                                           \
        moe_wide_down_body<BITS, C, DR, false, false, true>(p);                                             \
    }
#define MOE_WIDE_KERNELS(BITS)                                                                              \
    MOE_WIDE_GATE_UP(BITS, 8, 8) MOE_WIDE_GATE_UP(BITS, 8, 16) MOE_WIDE_GATE_UP(BITS, 8, 32)                 \
    MOE_WIDE_DOWN(BITS, 16, 4) MOE_WIDE_DOWN(BITS, 16, 8) MOE_WIDE_DOWN(BITS, 16, 16)                       \
    MOE_WIDE_DOWN(BITS, 16, 32)

MOE_WIDE_KERNELS(4)
MOE_WIDE_KERNELS(8)
