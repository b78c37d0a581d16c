// gemv.cu: the weight-streaming decode GEMVs, one row of x against up to 4 matrices of one format
// and width that read the same input (stream.cuh has the inner loop and why). Matches
// cpu/matmul.rs (`matmul` with one row) and, with the prologues and epilogues below, the
// compositions the Backend trait's defaults make: rms_norm + matmul_q_many (rms_norm_matmul),
// matmul_q + add (matmul_q_add).
//
// sw_gemv_<B>_<U>_<PRO>: B = 4 or 8 bits (bf16 scales and biases), U chunks in flight per lane,
// PRO the prologue:
//   PRO 0: x is a bf16 activation [K].
//   PRO 1: x = bf16(rms_norm(h) * w): h f32 [K] (the residual stream), w f32 [K]; every block
//          computes the norm itself (h is 8 KB: cheaper than a launch), with the rms_norm kernel's
//          exact arithmetic (same 256-thread strided sum, same block_sum, same expression), so
//          its x equals rms_norm's output bit for bit; block 0 also writes x to `xn` when given.
//   PRO 2: x = the GDN gated norm of y (f32 [K], the scan's output) per value head of dv with
//          z (bf16) and the norm weight [dv] (opt-in `fuse_gdn`: out_proj's input, not stored).
// Geometry: 256 threads = 8 warps; K (a multiple of 256 with C = K/256 dividing 32) is cut into
// 8 warp slices, lane l of warp w owns chunk w·C + l%C and row l/C of each load of RW = 32/C
// rows. A batch is RB = RW·U consecutive rows of one matrix; matrix i has batches
// [bstart[i], bstart[i+1]). Blocks walk batches bt = blockIdx.x, + gridDim.x, … (the host sizes
// the grid to the blocks the GPU holds at once), issuing batch bt + gridDim.x's loads before
// computing batch bt (two register sets), then reducing: shuffles over the C lanes of a row,
// then the 8 warps' partials summed in warp order through shared memory (double-buffered: one
// barrier per batch). Tried and measured slower on the H200 (lily lab, same run): staging the
// batches in shared memory with cp.async, 3 batches ahead (in_proj 16.2 against 14.3 µs, the
// experts 15.5 against 14.2): bytes in flight are not what limits these kernels.
// Epilogue per output (obf[i]): 0 f32 store, 1 bf16 store (rounded once), 2 f32 add (out[o] += v:
// the residual stream; the sum is not rounded to bf16 first, unlike the unfused add), 3 the GDN
// conv step of output 0's channel o (opt-in `fuse_gdn`: conv1d_step in the in_proj epilogue).
// Trace marks (`lily bench --trace`): 1 x ready, 2 every batch stored. The probe
// LILY_CUDA_DEFINE=SW_TAIL_MARKS=1 moves them into the router's tail instead (every sw_gemv loses
// its usual marks): 1 after the fence and the ticket, 2 after route_block's softmax (the logits
// read back), so the last block's columns split the tail (stop 50: 4.2 µs from its stores to
// its end) into ticket, logits + softmax, rank + weights.
// ROUTE (rids != 0: the router | shared-gate launch of an MoE block, Backend::moe_router): the
// last block to finish routes the token from matrix 0's f32 logits (route.cuh), saving the
// moe_route launch; blocks count themselves on `counter` after a __threadfence. The route is
// route_block (the whole block, a rank per expert; `rblock`, switch `route_block`, E <= 256: the
// default, 2-3% faster decode), route_sort (`rblock` 2, opt-in `route_sort`: per-warp bitonic
// sorts and a 64-candidate rank, k <= 8) or route_warp (one warp, k arg-max rounds): the same ids
// and weights (route.cuh route_by). With `rflag` (opt-in `route_flag`) the last block also
// publishes the ids as one u64 that moe.cu's moe_flag_gate_up polls (route.cuh route_weights).
// AHEAD (fe != 0: a decode step's out_proj / o_proj folding the next MoE block's router,
// Backend::route_ahead; one f32-add output, no route): after each batch's residual add the block
// takes the batch's RB new rows of h, times the block's norm weight, and every thread e of the
// block sums router row e (and the shared gate's, e = E) over those RB columns: the router
// logits before the norm's scale, Σ_k R[e, k] · w[k] · h[k], split by rows of h across the
// blocks. Each block adds its sums into facc as 2^-32 fixed point (integer atomics: the total is
// the same whatever order the blocks arrive in, so a recorded step equals its op-by-op run);
// route_ahead_<C> (below) scales them by the norm's 1 / rms and routes. Why: the router's own
// launch (norm prologue, 0.6 MB of dots, route in a last block) is a chain of ~10 µs a layer in
// place on the H200 for 1.8% of the step's bytes. Needs RB a multiple of 4 (of 16 past 16)
// dividing the router's group size (a batch's columns in one group) and E + 1 <= 512 (two sums
// a thread).

#define SW_MAXRB 128  // rows per batch at most (C = 1, U = 4)

struct SwArgs {
    QMat m[4];
    u64 out[4];
    int obf[4];
    int bstart[5];
    int n;
    u64 x;    // PRO 0: const u16* [K]; PRO 1: const float* h [K]
    u64 nw;   // PRO 1: const float* norm weight [K]
    u64 xn;   // PRO 1: u16* [K] written by block 0, or 0
    u64 rids;     // ROUTE: u32* [rk] expert ids of the top-rk of out[0] (f32 router logits), or 0
    u64 rwts;     // ROUTE: float* [rk] their weights
    u64 counter;  // ROUTE: u32 zeroed before the first launch; the last block resets it. With
                  // rflag, the u64 at counter + 8 is the published route (route.cuh route_weights)
    float eps;
    int re;       // ROUTE: experts (rows of matrix 0)
    int rk;       // ROUTE: top-k
    int ntopk;    // ROUTE: renormalise the top-k weights
    u64 cw;       // obf 3 (GDN conv of output 0): taps const float* [C, ck], C = m[0].out
    u64 cst;      // obf 3: the conv state float* [ck - 1, C], read and replaced
    u64 zp;       // PRO 2: z, const u16* [K]
    int ck;       // obf 3: conv taps
    int dv;       // PRO 2: value head size (a multiple of 32, dv / 32 a power of two)
    int rblock;   // ROUTE: route.cuh route_by's form (E <= 256): 1 route_block, 2 route_sort
    int rflag;    // ROUTE: 1 publish the ids at counter + 8 (opt-in `route_flag`; E <= 256, rk <= 8)
    QMat fr;      // AHEAD: the router, 8-bit [E, out[0]'s rows]
    QMat fs;      // AHEAD: the shared expert's gate, 8-bit [1, out[0]'s rows]
    u64 fnw;      // AHEAD: the MoE block's norm weight, const float* [out[0]'s rows]
    u64 facc;     // AHEAD: long long* [E + 1] fixed-point sums, left at zero by route_ahead
    int fe;       // AHEAD: E (0: no fold)
    int fpad;
};

// AHEAD: router row e's words over columns row0 .. row0 + RB (RB / 4 u32 of 8-bit codes) and
// their group's scale and bias (raw bf16): row e of the router, or e = E the shared gate's row.
// Requested before the PDL wait for a block's first batch (they depend on nothing written), so
// the fold after the residual add waits on no DRAM round trip.
template <int RB>
struct AheadW {
    u32 w[RB / 4];
    u16 s, b;
};

template <int RB>
__device__ __forceinline__ void sw_ahead_load(const SwArgs& p, int e, int row0, AheadW<RB>& a) {
    // Selected by value, as sw_mat does (a dynamic choice of parameter address would copy the
    // argument block to local memory).
    QMat m = p.fr;
    if (e >= p.fe) m = p.fs;
    const int o = e < p.fe ? e : 0;
    const u32* w = (const u32*)m.w + ((u64)o * (u64)m.inp + (u64)row0) / 4;
    const u64 g = (u64)o * (u64)(m.inp / m.gs) + (u64)(row0 / m.gs);
#pragma unroll
    for (int j = 0; j < RB / 4; j++) a.w[j] = __ldg(w + j);
    a.s = __ldg((const unsigned short*)m.s + g);
    a.b = __ldg((const unsigned short*)m.b + g);
}

// The row's sum over the batch's columns, x = the new h times the norm weight (shared memory):
// s·Σ q·x + b·Σ x, the affine 8-bit dequantisation of cpu/matmul.rs.
template <int RB>
__device__ __forceinline__ float sw_ahead_dot(const AheadW<RB>& a, const float* x) {
    float q = 0.0f, xs = 0.0f;
#pragma unroll
    for (int j = 0; j < RB / 4; j++) {
#pragma unroll
        for (int b = 0; b < 4; b++) {
            q = fmaf((float)((a.w[j] >> (8 * b)) & 0xFFu), x[4 * j + b], q);
            xs += x[4 * j + b];
        }
    }
    return bf16f(a.s) * q + bf16f(a.b) * xs;
}

__device__ __forceinline__ void sw_locate(const SwArgs& p, int bt, int rb, int& mi, int& row0) {
    mi = 0;
#pragma unroll
    for (int j = 1; j < 4; j++)
        if (j < p.n && bt >= p.bstart[j]) mi = j;
    row0 = (bt - p.bstart[mi]) * rb;
}

// Matrix i of the argument block, selected without indexing the parameter array dynamically
// (which would copy it to local memory).
__device__ __forceinline__ QMat sw_mat(const SwArgs& p, int i) {
    QMat m = p.m[0];
#pragma unroll
    for (int j = 1; j < 4; j++)
        if (i == j) m = p.m[j];
    return m;
}

__device__ __forceinline__ void sw_store(const SwArgs& p, int i, int o, float v) {
    u64 out = p.out[0];
    int obf = p.obf[0];
#pragma unroll
    for (int j = 1; j < 4; j++)
        if (i == j) { out = p.out[j]; obf = p.obf[j]; }
    if (obf == 3) {
        // The GDN conv step of channel o (gdn.cu's conv_rows for one row, the same arithmetic):
        // this output, rounded to the bf16 the unfused conv reads, is the newest input. One
        // thread owns channel o, so it reads and replaces the channel's state alone.
        const int C = p.m[0].out, K = p.ck;
        const float xt = bf16f(bf16_rn(v));
        const float* w = (const float*)p.cw + (u64)o * K;
        float* st = (float*)p.cst;
        float acc = 0.0f;
        for (int k = 0; k < K - 1; k++) acc += w[k] * st[(u64)k * C + o];
        acc += w[K - 1] * xt;
        ((u16*)out)[o] = bf16_rn(silu_f(acc));
        for (int k = 0; k < K - 2; k++) st[(u64)k * C + o] = st[(u64)(k + 1) * C + o];
        st[(u64)(K - 2) * C + o] = xt;
        return;
    }
    store_out((void*)out, (u64)o, v, obf);
}

// The lane's 32 x values (inputs 32ch ..) of prologue PRO (module header) and their sum; with PRO
// 1, block 0's lanes of row r = 0 also write x to `xn`. Every thread of the block calls it (PRO 1
// sums over the block).
// nw: PRO 1's norm weight (p.nw itself, or the block's copy in shared memory, cp_stage_norm).
template <int C, int PRO>
__device__ __forceinline__ float sw_x_pro(const SwArgs& p, const float* nw, int ch, int r, float* sh, float (&xv)[32]) {
    constexpr int K = 256 * C;
    float xs;
    if constexpr (PRO == 0) {
        xs = sw_x_act((const u16*)p.x, ch, xv);
    } else if constexpr (PRO == 2) {
        // x = bf16(rms_norm(y_head) · w · silu(z)) (gdn.cu's gdn_gated_norm, the same expression):
        // the dv / 32 lanes of a head (consecutive c) share its sum of squares by shuffles.
        sw_ld32((const float*)p.x + ch * 32, xv);
        float ss = 0.0f;
#pragma unroll
        for (int i = 0; i < 32; i++) ss += xv[i] * xv[i];
        for (int off = 1; off < p.dv / 32; off <<= 1) ss += __shfl_xor_sync(FULL_MASK, ss, off);
        const float rr = 1.0f / sqrtf(ss / (float)p.dv + p.eps);
        const int w0 = (ch * 32) % p.dv;
        const float* w = (const float*)p.nw;
        float zf[32];
        sw_x_act((const u16*)p.zp, ch, zf);
        xs = 0.0f;
#pragma unroll
        for (int i = 0; i < 32; i++) {
            xv[i] = bf16f(bf16_rn(xv[i] * rr * w[w0 + i] * silu_f(zf[i])));
            xs += xv[i];
        }
    } else {
        const float* h = (const float*)p.x;
        const float rr = sw_rms_scale<K, 256>(h, p.eps, sh);
        xs = sw_x_norm(h, nw, rr, ch, xv);
        if (blockIdx.x == 0 && p.xn != 0 && r == 0) {
            uint4* o = (uint4*)((u16*)p.xn + ch * 32);
#pragma unroll
            for (int i = 0; i < 4; i++) o[i] = sw_pack8(xv, i);
        }
    }
    return xs;
}

template <int BITS, int C, int U, int PRO, bool AHEAD = false>
__device__ __forceinline__ void sw_gemv_body(const SwArgs& p) {
    constexpr int RW = 32 / C, RB = RW * U;
    static_assert(RB <= SW_MAXRB, "batch larger than the reduction buffer");
    __shared__ float red[2][SW_WARPS][RB];
    __shared__ float sh[32];
    __shared__ float fx[AHEAD ? RB : 1];  // AHEAD: the batch's new rows of h times the norm weight
    __shared__ __align__(16) float wn[PRO == 1 ? 256 * C : 4];  // PRO 1: the norm weight
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int c = lane & (C - 1), r = lane / C;
    const SwLane ln = sw_lane(p.m[0], warp * C + c);
    const int ch = ln.ch;
    const int total = p.bstart[p.n];
    int bt = blockIdx.x;
    if (bt >= total) return;

    // The first batch's weights are requested before x is known: they do not depend on it.
    int mi, row0;
    sw_locate(p, bt, RB, mi, row0);
    QMat m = sw_mat(p, mi);
    SwUnit<BITS> un[U], un2[U];
    auto load = [&](SwUnit<BITS> (&dst)[U]) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int o = row0 + u * RW + r;
            if (o < m.out) sw_load<BITS>(m, 0, o, ln, dst[u]);
            else sw_zero<BITS>(dst[u]);
        }
    };
    load(un);
    // AHEAD: the first batch's router words (two rows a thread), requested with its weights
    // where a batch is at most 16 rows (PF: the decode model's out_proj and o_proj, 8). Wider
    // batches (small models) read theirs in 16-column pieces at the fold: held across the batch
    // loop, 64 columns' words spilled sw_gemv_4_2_4_* to local memory.
    constexpr bool AH = AHEAD && RB % 4 == 0 && (RB <= 16 || RB % 16 == 0);
    constexpr bool PF = AH && RB <= 16;
    AheadW<PF ? RB : 4> aw[2];
    bool aw_first = PF;
    if constexpr (PF) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int e = tid + 256 * i;
            if (e <= p.fe) sw_ahead_load<RB>(p, e, row0, aw[i]);
        }
    }
    if constexpr (PRO == 1) {
        cp_stage_norm<256 * C, 256>((const float*)p.nw, smem_u32(wn));
        cp_commit();
    }
    // Only now may x (written by the previous kernel) be read: with programmatic dependent launch
    // (LILY_CUDA_PDL=1) the weights above were requested while that kernel finished.
    PDL_WAIT();
    // This thread's copies of the norm weight have landed; sw_rms_scale's barrier publishes them
    // to the block before sw_x_norm reads them.
    if constexpr (PRO == 1) cp_wait<0>();

    float xv[32];
    const float xs = sw_x_pro<C, PRO>(p, wn, ch, r, sh, xv);
#ifndef SW_TAIL_MARKS
    TRACE_MARK(1);  // x ready
#endif

    // AHEAD: this thread's router sums (rows tid and tid + 256 of [router; shared gate]).
    float za[2] = {0.0f, 0.0f};
    // Two register sets: batch bt in `cur` while batch bt + gridDim.x loads into `nxt`.
    int par = 0;
    auto step = [&](SwUnit<BITS> (&cur)[U], SwUnit<BITS> (&nxt)[U]) -> bool {
        const int cur_mi = mi, cur_row0 = row0, cur_out = m.out;
        const int nbt = bt + gridDim.x;
        if (nbt < total) {
            sw_locate(p, nbt, RB, mi, row0);
            m = sw_mat(p, mi);
            load(nxt);
        }
        float part[U];
        sw_dots<BITS, U, C>(cur, xv, xs, part);
        if (c == 0) {
#pragma unroll
            for (int u = 0; u < U; u++) red[par][warp][u * RW + r] = part[u];
        }
        __syncthreads();
        if (tid < RB) {
            float v = 0.0f;
#pragma unroll
            for (int w = 0; w < SW_WARPS; w++) v += red[par][w][tid];
            const int o = cur_row0 + tid;
            if constexpr (AH) {
                // AHEAD (one f32-add output): the residual add as store_out's obf 2, then the new
                // row times the norm weight for the router sums.
                float hn = 0.0f;
                if (o < cur_out) {
                    float* hp = (float*)p.out[0] + o;
                    hn = *hp + v;
                    *hp = hn;
                    hn *= ((const float*)p.fnw)[o];
                }
                fx[tid] = hn;
            } else if (o < cur_out) {
                sw_store(p, cur_mi, o, v);
            }
        }
        if constexpr (AH) {
            {  // the fold (AHEAD)
                __syncthreads();
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    const int e = tid + 256 * i;
                    if (e > p.fe) continue;
                    if constexpr (PF) {
                        // A later batch (rare: the grid holds about every batch) loads its own.
                        if (!aw_first) sw_ahead_load<PF ? RB : 4>(p, e, cur_row0, aw[i]);
                        za[i] += sw_ahead_dot<PF ? RB : 4>(aw[i], fx);
                    } else {
#pragma unroll
                        for (int c0 = 0; c0 < RB; c0 += 16) {
                            AheadW<16> a;
                            sw_ahead_load<16>(p, e, cur_row0 + c0, a);
                            za[i] += sw_ahead_dot<16>(a, fx + c0);
                        }
                    }
                }
                aw_first = false;
                // fx is rewritten by the next batch only after its own barrier (above).
            }
        }
        par ^= 1;
        bt = nbt;
        return nbt < total;
    };
    while (step(un, un2) && step(un2, un)) {
    }
#ifndef SW_TAIL_MARKS
    TRACE_MARK(2);  // every batch reduced and stored
#endif
    if constexpr (AH) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int e = tid + 256 * i;
            if (e <= p.fe && za[i] != 0.0f)
                atomicAdd((unsigned long long*)p.facc + e, (unsigned long long)__float2ll_rn(za[i] * 4294967296.0f));
        }
    }
    if (p.rids != 0) {
        // Route in the last block to finish (moe_route's arithmetic, route.cuh): each block makes
        // its logits visible, then takes a ticket; the last ticket's block routes and resets the
        // counter for the next launch (a recorded step replays this one).
        __shared__ int last;
        __threadfence();
        __syncthreads();
        if (tid == 0) last = atomicAdd((u32*)p.counter, 1u) == gridDim.x - 1;
        __syncthreads();
#ifdef SW_TAIL_MARKS
        TRACE_MARK(1);  // the fence and the ticket done (the probe's placement, header)
#endif
        if (last) {
            // rflag (opt-in `route_flag`, the 8-bit router only: the other kernels' code stays as
            // it was): route.cuh route_weights publishes the ids at counter + 8 for moe.cu's
            // moe_flag_gate_up and resets the counter itself.
            u32* pub = BITS == 8 && p.rflag ? (u32*)p.counter : nullptr;
            route_by(p.rblock, (const float*)p.out[0], (u32*)p.rids, (float*)p.rwts, p.re, p.rk, p.ntopk, pub);
            if (pub == nullptr && tid == 0) *(u32*)p.counter = 0u;
        }
    }
}

// sw_gemv_<B>_<C>_<U>_<PRO>: K = 256·C inputs (C = 1, 2, 4, 8, 16: K = 256 … 4096).
#define SW_GEMV_KERNEL(BITS, C, U, PRO)                                                                    \
    extern "C" __global__ void __launch_bounds__(256, SW_MINB) sw_gemv_##BITS##_##C##_##U##_##PRO(SwArgs p) { \
        KTRACE();                                                                                          \
        PDL_LAUNCH();                                                                                      \
        sw_gemv_body<BITS, C, U, PRO>(p);                                                                  \
    }
#define SW_GEMV_PRO(BITS, C, U) SW_GEMV_KERNEL(BITS, C, U, 0) SW_GEMV_KERNEL(BITS, C, U, 1) SW_GEMV_KERNEL(BITS, C, U, 2)
#define SW_GEMV_C(BITS, U) SW_GEMV_PRO(BITS, 1, U) SW_GEMV_PRO(BITS, 2, U) SW_GEMV_PRO(BITS, 4, U) SW_GEMV_PRO(BITS, 8, U) SW_GEMV_PRO(BITS, 16, U)

SW_GEMV_C(4, 4)
SW_GEMV_C(4, 2)
SW_GEMV_C(8, 2)

// sw_gemv_ahead_<B>_<C>_<U>_<PRO>: the same with the router folded in (AHEAD; PRO 0, out_proj's and
// o_proj's x, and 2, fuse_gdn's gated norm). Kernels of their own: the fold's registers (the
// prefetched router words) made sw_gemv_4_8_4_1 spill when every instantiation carried them.
#define SW_GEMV_AHEAD_KERNEL(BITS, C, U, PRO)                                                                    \
    extern "C" __global__ void __launch_bounds__(256, SW_MINB) sw_gemv_ahead_##BITS##_##C##_##U##_##PRO(SwArgs p) { \
        KTRACE();                                                                                                \
        PDL_LAUNCH();                                                                                            \
        sw_gemv_body<BITS, C, U, PRO, true>(p);                                                                  \
    }
#define SW_GEMV_AHEAD_C(BITS, U, PRO) SW_GEMV_AHEAD_KERNEL(BITS, 1, U, PRO) SW_GEMV_AHEAD_KERNEL(BITS, 2, U, PRO) SW_GEMV_AHEAD_KERNEL(BITS, 4, U, PRO) SW_GEMV_AHEAD_KERNEL(BITS, 8, U, PRO) SW_GEMV_AHEAD_KERNEL(BITS, 16, U, PRO)
SW_GEMV_AHEAD_C(4, 4, 0)
SW_GEMV_AHEAD_C(4, 2, 0)
SW_GEMV_AHEAD_C(8, 2, 0)
SW_GEMV_AHEAD_C(4, 4, 2)
SW_GEMV_AHEAD_C(4, 2, 2)
SW_GEMV_AHEAD_C(8, 2, 2)

// ---- route_ahead_<C> (Backend::moe_step_add with RouterScratch::ahead): the MoE block's router
// after a projection that folded it (AHEAD above). One block of 256 threads, K = 256·C:
//   rr = 1 / rms(h) (sw_rms_scale: the rms_norm kernel's arithmetic), xn = bf16(h · rr · w) (the
//   norm prologue's expression, so the experts read the bits moe_router's launch writes), the
//   logits = rr · (the projection's sums) and the shared gate's logit likewise, the sums reset
//   to zero for the next layer's projection, then the route (route.cuh: route_block, route_sort
//   or route_warp, as the router's last block) from the logits.
// Matches Backend::moe_router (rms_norm_matmul + moe_route) but for where x is rounded: the
// logits are Σ R·w·h scaled once, not Σ R·bf16(h·rr·w) (cuda_ops route_ahead test states the
// bound). It launches its dependents first (the experts' gate|up requests its shared expert's
// weights before its wait).

struct RaArgs {
    u64 h;       // const float* [K]: the residual stream after the projection's add
    u64 nw;      // const float* [K]: the MoE block's norm weight
    u64 acc;     // long long* [E + 1]: the projection's 2^-32 fixed-point sums; zeroed here
    u64 xn;      // u16* [K]
    u64 logits;  // float* [E]
    u64 s;       // the shared gate's logit [1] (store_out type sbf)
    u64 ids;     // u32* [k]
    u64 wts;     // float* [k]
    float eps;
    int e;       // experts, E <= 511
    int k;
    int ntopk;
    int rblock;  // route.cuh route_by's (gemv.cu's ROUTE)
    int sbf;
};

template <int C>
__device__ __forceinline__ void route_ahead_body(const RaArgs& p) {
    constexpr int K = 256 * C;
    __shared__ float sh[32];
    const int tid = threadIdx.x;
    PDL_WAIT();
    const float* h = (const float*)p.h;
    const float* w = (const float*)p.nw;
    const float rr = sw_rms_scale<K, 256>(h, p.eps, sh);
#pragma unroll
    for (int j = 0; j < C; j++) {
        const int i = tid + 256 * j;
        ((u16*)p.xn)[i] = bf16_rn(h[i] * rr * w[i]);
    }
    for (int e = tid; e <= p.e; e += 256) {
        long long* a = (long long*)p.acc + e;
        const float v = (float)*a * (1.0f / 4294967296.0f) * rr;
        *a = 0;
        if (e < p.e) ((float*)p.logits)[e] = v;
        else store_out((void*)p.s, 0, v, p.sbf);
    }
    __syncthreads();  // the logits, written above, visible to the block's route
    route_by(p.rblock, (const float*)p.logits, (u32*)p.ids, (float*)p.wts, p.e, p.k, p.ntopk);
}

#define ROUTE_AHEAD_KERNEL(C)                                                               \
    extern "C" __global__ void __launch_bounds__(256) route_ahead_##C(RaArgs p) {          \
        KTRACE();                                                                           \
        PDL_LAUNCH();                                                                       \
        route_ahead_body<C>(p);                                                             \
    }
ROUTE_AHEAD_KERNEL(1)
ROUTE_AHEAD_KERNEL(2)
ROUTE_AHEAD_KERNEL(4)
ROUTE_AHEAD_KERNEL(8)
ROUTE_AHEAD_KERNEL(16)

// ---- tc_gemv_<NS>_<NW>_<U>_<S>_<PRO>: the same products on tensor cores (tc_stream.cuh has the
// dot, its exactness and fragment geometry): 4-bit, group size 64, K = 128·NS·NW, NW warps each
// owning NS spans of 128 inputs; a batch is U tiles of 16 rows. Switch `tc_gemv`. Prologues 0 and
// 1 (1 only with 8 warps: the rms_norm kernel's exact 256-thread arithmetic), every epilogue of
// sw_store; not the route (the router is 8-bit).
// The block's batches (bt = blockIdx.x + n·gridDim.x) are staged through shared memory by
// cp.async, S - 1 batches ahead (tc_stream.cuh: a warp's slot per tile and stage; dynamic shared
// memory S·NW·U·TcSlot<NS>::BYTES), the warps' partials summed in warp order through shared
// memory as above (double-buffered: one barrier per batch).

template <int NS, int NW, int U, int S, int PRO>
__device__ __forceinline__ void tc_gemv_body(const SwArgs& p) {
    constexpr int K = 128 * NS * NW, RB = 16 * U, SLOT = TcSlot<NS>::BYTES;
    static_assert(PRO == 0 || (PRO == 1 && NW == SW_WARPS), "the norm prologue needs 256 threads");
    static_assert(S >= 2, "at least one batch ahead");
    extern __shared__ __align__(16) unsigned char tcs[];
    __shared__ float red[2][NW][RB];
    __shared__ float xsum[K / 32];
    __shared__ float sh[32];
    __shared__ __align__(16) float wn[PRO == 1 ? K : 4];  // PRO 1: the norm weight
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int sb = warp * NS;
    const int total = p.bstart[p.n];
    if ((int)blockIdx.x >= total) return;
    const u32 base = smem_u32(tcs);
    auto slot = [&](int st, int u) { return ((st * NW + warp) * U + u) * SLOT; };
    // Batch n of this block into stage n % S (an empty group past the end keeps the count).
    auto issue = [&](int n) {
        const int b = blockIdx.x + n * gridDim.x;
        if (b < total) {
            int mi, row0;
            sw_locate(p, b, RB, mi, row0);
            const QMat m = sw_mat(p, mi);
#pragma unroll
            for (int u = 0; u < U; u++) tc_issue<NS>(m, 0, row0 + 16 * u, m.out, sb, g, t, lane, base + slot(n % S, u));
        }
        cp_commit();
    };
    // PRO 1: the norm weight first, in a commit group of its own (group 0; batch n is group n + 1).
    if constexpr (PRO == 1) {
        cp_stage_norm<K, 32 * NW>((const float*)p.nw, smem_u32(wn));
        cp_commit();
    }
    // The first batches' weights are requested before x is known: they do not depend on it.
#pragma unroll
    for (int n = 0; n < S - 1; n++) issue(n);
    const int ch = tc_chunk<NS>(sb, g, t);
    PDL_WAIT();
    // The norm weight's group has landed (the S - 1 batches' may be pending); sw_rms_scale's
    // barrier publishes it to the block.
    if constexpr (PRO == 1) cp_wait<S - 1>();

    float xv[32];
#pragma unroll
    for (int i = 0; i < 32; i++) xv[i] = 0.0f;
    float xs = 0.0f;
    if constexpr (PRO == 0) {
        if (ch >= 0) xs = sw_x_act((const u16*)p.x, ch, xv);
    } else {
        const float* h = (const float*)p.x;
        const float rr = sw_rms_scale<K, 32 * NW>(h, p.eps, sh);
        if (ch >= 0) {
            xs = sw_x_norm(h, wn, rr, ch, xv);
            if (blockIdx.x == 0 && p.xn != 0) {
                uint4* o = (uint4*)((u16*)p.xn + ch * 32);
#pragma unroll
                for (int i = 0; i < 4; i++) o[i] = sw_pack8(xv, i);
            }
        }
    }
    u32 xb[NS][8][2];
    float xs0, xs1;
    tc_setup_x<NS>(xv, xs, ch, xsum, sb, g, t, xb, xs0, xs1);
    TRACE_MARK(1);  // x ready

    for (int n = 0;; n++) {
        const int b = blockIdx.x + n * gridDim.x;
        if (b >= total) break;
        cp_wait<S - 2>();
        TcTile<NS> T[U];
#pragma unroll
        for (int u = 0; u < U; u++) tc_fetch<NS>(tcs + slot(n % S, u), t, lane, T[u]);
        // The slot of batch n - 1 is free (this lane read it last round): batch n + S - 1 goes there.
        issue(n + S - 1);
        const int par = n & 1;
#pragma unroll
        for (int u = 0; u < U; u++) {
            float d[4];
            tc_dot<NS>(T[u], xb, d);
            float ra, rb;
            tc_finish<NS>(T[u], d, xs0, xs1, t, ra, rb);
            if (t == 0) {
                red[par][warp][16 * u + g] = ra;
                red[par][warp][16 * u + g + 8] = rb;
            }
        }
        __syncthreads();
        if (n == 0) TRACE_MARK(2);  // the first batch computed
        if (tid < RB) {
            int mi, row0;
            sw_locate(p, b, RB, mi, row0);
            const QMat m = sw_mat(p, mi);
            float v = 0.0f;
#pragma unroll
            for (int w = 0; w < NW; w++) v += red[par][w][tid];
            const int o = row0 + tid;
            if (o < m.out) sw_store(p, mi, o, v);
        }
    }
    cp_wait<0>();
}

// tc_gemv_<NS>_<NW>_<U>_<S>_<PRO>: K = 128·NS·NW (1024: 2·4, 2048: 2·8, 4096: 2·16; 512: 1·4).
#define TC_GEMV_KERNEL(NS, NW, U, S, PRO)                                                                         \
    extern "C" __global__ void TC_BOUNDS(32 * NW) tc_gemv_##NS##_##NW##_##U##_##S##_##PRO(SwArgs p) {                \
        KTRACE();                                                                                                 \
        PDL_LAUNCH();                                                                                             \
        tc_gemv_body<NS, NW, U, S, PRO>(p);                                                                       \
    }
TC_GEMV_KERNEL(2, 8, 1, 3, 0)
TC_GEMV_KERNEL(2, 8, 1, 3, 1)
TC_GEMV_KERNEL(2, 8, 1, 4, 0)
TC_GEMV_KERNEL(2, 8, 1, 4, 1)
TC_GEMV_KERNEL(2, 8, 2, 3, 0)
TC_GEMV_KERNEL(2, 8, 2, 3, 1)
TC_GEMV_KERNEL(2, 8, 2, 4, 0)
TC_GEMV_KERNEL(2, 8, 2, 4, 1)
TC_GEMV_KERNEL(2, 16, 1, 3, 0)
TC_GEMV_KERNEL(2, 16, 1, 4, 0)
TC_GEMV_KERNEL(2, 4, 1, 4, 0)
TC_GEMV_KERNEL(1, 4, 1, 4, 0)
