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

#define ROUTE_MAXE 1024  // experts per row at most: 32 per lane in registers
#define ROUTE_WARPS 4     // rows per block

extern "C" __global__ void __launch_bounds__(32 * ROUTE_WARPS)
moe_route(const float* __restrict__ logits, u32* __restrict__ ids, float* __restrict__ weights, int E, int k, int norm_topk,
          int rows) { PDL_ENTRY();
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * ROUTE_WARPS + (threadIdx.x >> 5);
    if (t >= rows) return;
    const float* l = logits + (u64)t * E;
    // Lane l holds experts l, l + 32, ... (unrolled and guarded: registers, not local memory).
    float p[ROUTE_MAXE / 32];
    float m = NEG_INF;
#pragma unroll
    for (int i = 0; i < ROUTE_MAXE / 32; i++) {
        const int e = lane + 32 * i;
        p[i] = e < E ? l[e] : NEG_INF;
        m = fmaxf(m, p[i]);
    }
    m = warp_max(m);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < ROUTE_MAXE / 32; i++) {
        if (lane + 32 * i < E) {
            p[i] = expf(p[i] - m);
            s += p[i];
        }
    }
    s = warp_sum(s);
#pragma unroll
    for (int i = 0; i < ROUTE_MAXE / 32; i++) p[i] = lane + 32 * i < E ? p[i] / s : NEG_INF;
    float mine_p = 0.0f, sum = 0.0f;
    int mine_i = 0;
    for (int j = 0; j < k; j++) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < ROUTE_MAXE / 32; i++)
            if (better(p[i], lane + 32 * i, bv, bi)) { bv = p[i]; bi = lane + 32 * i; }
        warp_argmax(bv, bi);
#pragma unroll
        for (int i = 0; i < ROUTE_MAXE / 32; i++)
            if (lane + 32 * i == bi) p[i] = NEG_INF;  // taken
        if (lane == j) { mine_p = bv; mine_i = bi; }
        sum += bv;  // in slot order, as the CPU
    }
    // Lane j < k writes slot j.
    if (lane < k) {
        ids[(u64)t * k + lane] = (u32)mine_i;
        weights[(u64)t * k + lane] = mine_p / (norm_topk ? sum : 1.0f);
    }
}

extern "C" __global__ void moe_count(const u32* __restrict__ ids, int* __restrict__ counts, int n) { PDL_ENTRY();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(&counts[ids[i]], 1);
}

// tiles: int3 (expert, first position, rows) as 3 ints each.
extern "C" __global__ void moe_plan(const int* __restrict__ counts, int* __restrict__ offsets, int* __restrict__ cursor,
                                    int* __restrict__ tiles, int* __restrict__ ntiles, int E) { PDL_ENTRY();
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

extern "C" __global__ void moe_scatter(const u32* __restrict__ ids, int* __restrict__ cursor, int* __restrict__ perm, int n) { PDL_ENTRY();
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
                                       int k, int dim, const float* __restrict__ slogit) { PDL_ENTRY();
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
                    int mode) { PDL_ENTRY();                                                                     \
        moe_gemm_body<BITS, SB>(x, m, perm, tiles, ntiles, out, k, mode);                                        \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(TC_THREADS)                                                     \
    moe_tc_gemm_##NAME(const u16* x, QMat m, const int* perm, const int* tiles, const int* ntiles, u16* out, int k, \
                       int mode) { PDL_ENTRY();                                                                  \
        moe_tc_gemm_body<BITS, SB>(x, m, perm, tiles, ntiles, out, k, mode);                                     \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(256)                                                            \
    moe_gate_up_##NAME(const u16* x, QMat g, QMat u, const u32* ids, u16* act, QMat sg, QMat su, int k) { PDL_ENTRY(); \
        moe_gate_up_body<BITS, SB>(x, g, u, ids, act, sg, su, k);                                                \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(256)                                                            \
    moe_down_##NAME(const u16* act, QMat d, const u32* ids, u16* y, int k, QMat sd) { PDL_ENTRY();               \
        moe_down_body<BITS, SB>(act, d, ids, y, k, sd);                                                          \
    }

FOR_EACH_FORMAT(MOE_KERNELS)
