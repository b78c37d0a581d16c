// gdn.cu: the Gated DeltaNet layer's ops. Matches cpu/gdn.rs (conv1d, gated_delta).
// Types: x, qkv, z, b, a and out are bf16 activations (common.cuh); the conv state, the recurrent
// state, the parameters and the scan's y (pre-norm, op-internal) are f32.
//
// conv1d_prefill / conv1d_step  causal depthwise conv (kernel K <= 8, no bias) + SiLU over the C
//     channels of x [rows, C]; conv weight [C, K] (tap K-1 multiplies the current token); state
//     [K-1, C] = the last K-1 pre-conv rows, read and replaced.
//     conv1d_prefill: grid (ceil(C/256), ceil(rows/CONV_RPT)), 256 threads; a thread walks
//     CONV_RPT rows of one channel with its window in registers, the window's first K-1 inputs
//     read from x or, before row 0, from the state. The rows are split over blocks because one
//     walk over a 256-row chunk was bound by the latency of its 256 dependent-looking loads
//     (148 us per layer on the H200, 32 blocks). The state is then replaced by
//     conv1d_state (grid ceil(C/256)), a separate launch so that no block can overwrite it
//     while another still reads it.
//     conv1d_step: the same walk for one row, one thread per channel (reads and replaces the
//     state itself: one thread owns a channel, so no barrier is needed).
// gdn_scan_<NC>_<RPW>  the gated delta rule, fp32, state [Hv, Dv, Dk]. Each warp owns RPW rows of
//     one value head's state, held in registers for the whole scan (lane l holds columns
//     l*NC .. l*NC+NC-1, NC = Dk/32 in {1, 2, 4}); per token it l2-normalises q and k (redundantly
//     per warp, shuffles only), computes the gates and, per row r:
//         s *= g;  delta = (v_r - s.k) * beta;  s += delta k;  y_r = s.q
//     exactly the CPU's per-row order. No shared memory and no barriers: warps are independent.
//     Grid: Hv * Dv/RPW warps in blocks of 4 warps. Writes y [rows,
//     Hv*Dv] (pre-norm). The next token's q, k, v, b, a are loaded before the current token's
//     arithmetic (they do not depend on the state), so the scan waits on shuffles, not on memory.
//     RPW = 2 for prefill (2048 warps: twice the warps in flight of RPW = 4, at the price of more
//     redundant q/k norms; with the prefetch, 350 -> 246 us per 256-token layer on the H200);
//     RPW = 4 for a decode step (one token: no latency to hide, fewer redundant norms).
// gdn_gated_norm  out = rms_norm(y[t,h], norm[Dv]) * silu(z[t,h]) per value head: grid (rows, Hv),
//     128 threads.
// Decode uses the same kernels with rows = 1 (a chunked WY form for long prefills comes later),
// or, with the opt-in switch `gdn_step`, the one kernel below for all three.
// gdn_step  one decode token's conv1d_step + gated delta step + gated RMSNorm in ONE launch (see
//     its own header at the end of this file).

#define CONV_MAXK 8

// Rows t0..t1 of channel c: out = silu(w · window), the window (the K-1 inputs before row t, in
// registers) sliding one row per step. Shared by the decode walk and the row-split prefill.
__device__ __forceinline__ void conv_rows(const u16* __restrict__ x, u16* __restrict__ out, const float (&wt)[CONV_MAXK],
                                          float (&win)[CONV_MAXK], int C, int K, int c, int t0, int t1) {
    for (int t = t0; t < t1; t++) {
        float xt = bf16f(x[(u64)t * C + c]);
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < CONV_MAXK; i++) {
            if (i < K - 1) acc += wt[i] * win[i];
            else if (i == K - 1) acc += wt[i] * xt;
        }
        out[(u64)t * C + c] = bf16_rn(silu_f(acc));
#pragma unroll
        for (int i = 0; i < CONV_MAXK - 1; i++)
            if (i < K - 2) win[i] = win[i + 1];
#pragma unroll
        for (int i = 0; i < CONV_MAXK; i++)
            if (i == K - 2) win[i] = xt;
    }
}

__device__ __forceinline__ void conv_walk(const u16* __restrict__ x, const float* __restrict__ w, float* __restrict__ state,
                                          u16* __restrict__ out, int C, int K, int rows) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float wt[CONV_MAXK], win[CONV_MAXK];
#pragma unroll
    for (int i = 0; i < CONV_MAXK; i++) {
        wt[i] = i < K ? w[(u64)c * K + i] : 0.0f;
        win[i] = i < K - 1 ? state[(u64)i * C + c] : 0.0f;
    }
    conv_rows(x, out, wt, win, C, K, c, 0, rows);
#pragma unroll
    for (int i = 0; i < CONV_MAXK; i++)
        if (i < K - 1) state[(u64)i * C + c] = win[i];
}

#define CONV_RPT 16

extern "C" __global__ void __launch_bounds__(256)
conv1d_prefill(const u16* __restrict__ x, const float* __restrict__ w, const float* __restrict__ state,
               u16* __restrict__ out, int C, int K, int rows) { KTRACE(); PDL_ENTRY();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int t0 = blockIdx.y * CONV_RPT;
    if (c >= C) return;
    float wt[CONV_MAXK], win[CONV_MAXK];
#pragma unroll
    for (int i = 0; i < CONV_MAXK; i++) {
        wt[i] = i < K ? w[(u64)c * K + i] : 0.0f;
        // input row t0 - (K-1) + i; rows before 0 are state rows (state row K-1+r holds row r < 0)
        const int r = t0 - (K - 1) + i;
        win[i] = i < K - 1 ? (r >= 0 ? bf16f(x[(u64)r * C + c]) : state[(u64)(K - 1 + r) * C + c]) : 0.0f;
    }
    const int t1 = min(rows, t0 + CONV_RPT);
    conv_rows(x, out, wt, win, C, K, c, t0, t1);
}

// state <- the last K-1 pre-conv rows of (old state, x): row rows-(K-1)+i for i < K-1. With
// rows < K-1 the old rows shift down in place (ascending i reads old[i + rows] before it is written).
extern "C" __global__ void conv1d_state(const u16* __restrict__ x, float* __restrict__ state, int C, int K, int rows) { KTRACE(); PDL_ENTRY();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    for (int i = 0; i < K - 1; i++) {
        const int r = rows - (K - 1) + i;
        state[(u64)i * C + c] = r >= 0 ? bf16f(x[(u64)r * C + c]) : state[(u64)(K - 1 + r) * C + c];
    }
}

extern "C" __global__ void conv1d_step(const u16* x, const float* w, float* state, u16* out, int C, int K) { KTRACE(); PDL_ENTRY();
    conv_walk(x, w, state, out, C, K, 1);
}

template <int NC, int GDN_RPW>
__device__ __forceinline__ void gdn_scan_body(const u16* __restrict__ qkv, const u16* __restrict__ bb,
                                              const u16* __restrict__ aa, const float* __restrict__ a_log,
                                              const float* __restrict__ dt_bias, float* __restrict__ state,
                                              float* __restrict__ y, int rows, int hk, int hv, int dv) {
    const int dk = NC * 32;
    const int lane = threadIdx.x & 31;
    const int gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int wph = dv / GDN_RPW;  // warps per head
    const int h = gw / wph, r0 = (gw % wph) * GDN_RPW;
    if (h >= hv) return;
    const int kh = h / (hv / hk);
    const u64 C = (u64)2 * hk * dk + (u64)hv * dv;
    float* sp = state + ((u64)h * dv + r0) * dk + lane * NC;
    float S[GDN_RPW][NC];
#pragma unroll
    for (int r = 0; r < GDN_RPW; r++)
#pragma unroll
        for (int c = 0; c < NC; c++) S[r][c] = sp[(u64)r * dk + c];
    const float decay_rate = expf(a_log[h]);
    const float dtb = dt_bias[h];
    const float qscale = 1.0f / sqrtf((float)dk);
    // This token's inputs (nq, nk, nv, nb, na: loaded one token ahead), kept as raw bf16 bits and
    // widened only when used: a widening right after the load would wait for it there, and the
    // prefetch would hide nothing (measured: the scan took 29% longer that way).
    u16 nq[NC], nk[NC], nv[GDN_RPW], nb = 0, na = 0;
    auto load = [&](int t) {
        const u16* row = qkv + (u64)t * C;
#pragma unroll
        for (int c = 0; c < NC; c++) {
            nq[c] = row[(u64)kh * dk + lane * NC + c];
            nk[c] = row[(u64)hk * dk + (u64)kh * dk + lane * NC + c];
        }
#pragma unroll
        for (int r = 0; r < GDN_RPW; r++) nv[r] = row[(u64)2 * hk * dk + (u64)h * dv + r0 + r];
        nb = bb[(u64)t * hv + h];
        na = aa[(u64)t * hv + h];
    };
    if (rows > 0) load(0);
    for (int t = 0; t < rows; t++) {
        float q[NC], k[NC], v[GDN_RPW];
        float qs = 0.0f, ks = 0.0f;
#pragma unroll
        for (int c = 0; c < NC; c++) {
            q[c] = bf16f(nq[c]);
            k[c] = bf16f(nk[c]);
            qs += q[c] * q[c];
            ks += k[c] * k[c];
        }
#pragma unroll
        for (int r = 0; r < GDN_RPW; r++) v[r] = bf16f(nv[r]);
        const float bt = bf16f(nb), at = bf16f(na);
        if (t + 1 < rows) load(t + 1);
        qs = warp_sum(qs);
        ks = warp_sum(ks);
        const float rq = qscale / sqrtf(qs + 1e-6f), rk = 1.0f / sqrtf(ks + 1e-6f);
#pragma unroll
        for (int c = 0; c < NC; c++) {
            q[c] *= rq;
            k[c] *= rk;
        }
        const float beta = sigmoid_f(bt);
        const float g = expf(-decay_rate * softplus_f(at + dtb));
        float yv[GDN_RPW];
#pragma unroll
        for (int r = 0; r < GDN_RPW; r++) {
            float part = 0.0f;
#pragma unroll
            for (int c = 0; c < NC; c++) {
                S[r][c] *= g;
                part += S[r][c] * k[c];
            }
            const float kv = warp_sum(part);
            const float delta = (v[r] - kv) * beta;
            float part2 = 0.0f;
#pragma unroll
            for (int c = 0; c < NC; c++) {
                S[r][c] += delta * k[c];
                part2 += S[r][c] * q[c];
            }
            yv[r] = warp_sum(part2);
        }
        if (lane < GDN_RPW) {
            float mine = 0.0f;
#pragma unroll
            for (int r = 0; r < GDN_RPW; r++)
                if (r == lane) mine = yv[r];
            y[(u64)t * hv * dv + (u64)h * dv + r0 + lane] = mine;
        }
    }
#pragma unroll
    for (int r = 0; r < GDN_RPW; r++)
#pragma unroll
        for (int c = 0; c < NC; c++) sp[(u64)r * dk + c] = S[r][c];
}

#define GDN_SCAN(NC, RPW)                                                                                   \
    extern "C" __global__ void __launch_bounds__(128)                                                       \
    gdn_scan_##NC##_##RPW(const u16* qkv, const u16* b, const u16* a, const float* a_log,                   \
                          const float* dt_bias, float* state, float* y, int rows, int hk, int hv, int dv) { KTRACE(); PDL_ENTRY(); \
        gdn_scan_body<NC, RPW>(qkv, b, a, a_log, dt_bias, state, y, rows, hk, hv, dv);                      \
    }
GDN_SCAN(1, 2)
GDN_SCAN(2, 2)
GDN_SCAN(4, 2)
GDN_SCAN(1, 4)
GDN_SCAN(2, 4)
GDN_SCAN(4, 4)

extern "C" __global__ void __launch_bounds__(128)
gdn_gated_norm(const float* __restrict__ y, const u16* __restrict__ z, const float* __restrict__ w, u16* __restrict__ out,
               int hv, int dv, float eps) { KTRACE(); PDL_ENTRY();
    __shared__ float sh[32];
    const u64 base = ((u64)blockIdx.x * hv + blockIdx.y) * dv;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dv; i += blockDim.x) ss += y[base + i] * y[base + i];
    ss = block_sum(ss, sh);
    const float r = 1.0f / sqrtf(ss / (float)dv + eps);
    for (int i = threadIdx.x; i < dv; i += blockDim.x) out[base + i] = bf16_rn(y[base + i] * r * w[i] * silu_f(bf16f(z[base + i])));
}

// ---- gdn_step: conv1d_step + the gated delta rule (one token) + gdn_gated_norm, one launch.
// Opt-in switch `gdn_step` (gdn.rs's gdn_mixer_step); a decode step's GDN layer is then in_proj,
// gdn_step, out_proj: 3 kernels where the default runs 5 (-60 launches per token).
//
// What it computes (the same function, the same f32 arithmetic in the same order, as the
// kernels it replaces: conv1d_step, gdn_scan_<4>_<4> and gdn_gated_norm, so its outputs and
// states are those of the unfused CUDA path bit for bit; the CPU twins are cpu/gdn.rs's conv1d
// (one row) and gated_delta (one row) with the bf16 rounding of the conv output between them,
// as Backend::gdn_mixer_compose runs them):
//     xc  = bf16(silu(Σ_k W[c,k]·in[k]))   per channel of qkv (conv state + this token's row)
//     q, k = l2norm(xc_q)/sqrt(Dk), l2norm(xc_k);  v = xc_v;  beta, decay from b, a
//     S[h] = S·decay;  delta = (v − S·k)·beta;  S += delta ⊗ k;  y = S·q
//     out = bf16(rms_norm(y[h], norm) · silu(z[h]))
// Layouts: qkv [C] bf16, pre-conv (in_proj's output; C = 2·Hk·Dk + Hv·Dv: q | k | v); conv taps
// W [C, K] f32; conv state [K-1, C] f32 (read and replaced); z [Hv·Dv], b, a [Hv] bf16; A_log,
// dt_bias [Hv], norm [Dv] f32; recurrent state [Hv, Dv, Dk] f32 (read and replaced); writes out
// [Hv·Dv] bf16 (out_proj's input) and qkv_c [C] bf16 (the conv output, as conv1d_step writes it).
// Dk = 128 (256 threads = the q and k channels of one key head); Dv a multiple of 32.
//
// Launch: grid Hk·CL blocks of 256 threads in clusters of CL = (Hv/Hk)·(Dv/32) blocks (8 for
// the model: 128 blocks), so one cluster = one key head: its Hv/Hk value heads × Dv/32 slices
// of 32 value rows. Block (key head kh, rank cr): value head h = kh·Hv/Hk + cr/(Dv/32), rows
// 32·(cr % (Dv/32)) .. +32. Per block:
//   reads  its 32 rows of S[h] (16 KB, 4 float4 per thread), the 256 q|k channels of kh and its
//          32 v channels: taps, conv state, the qkv row (each q|k channel read by the CL blocks
//          of the cluster, from L2), z of its rows, b[h], a[h];
//   writes its 32 rows of S[h], its 32 out values, its v channels' conv state and qkv_c, and
//          1/CL of the key head's q|k channels' conv state and qkv_c (channel i by rank i % CL).
// Threads: the conv of q|k channel tid (and of v channel tid for tid < 32), each block
// redundantly (4 taps: cheaper than a launch and a grid-wide barrier); row tid/8 of the block's
// 32, 8 lanes per row, lane p holding columns 4p + 32m + c (m, c < 4). That split gives the
// row's two dot products as 2 in-thread adds + 3 shuffles (gdn_scan: 5 shuffles per dot, 4 rows
// in turn per warp), and the SAME sums as gdn_scan's warp_sum tree: its lane L = p + 8m is this
// thread's chunk m, so its xor-16 and xor-8 levels are the in-thread (m0 + m2) + (m1 + m3) and
// the xor 4, 2, 1 levels are shuffles among the row's 8 lanes. The q and k norms are each
// warp's own gdn_scan-ordered sums over shared memory (no barrier beyond the one after the conv).
// Why this shape (issue #13, decode at the bandwidth roofline): the step is bound by the 2 MB
// read + 2 MB write of S (1 µs at 4.3 TB/s); 128 blocks of 16 KB put every byte in flight at
// once over ~all SMs, and the state load is issued BEFORE the PDL wait (PDL_LAUNCH first, as the
// streaming GEMVs): S and the conv state are written only by this layer's gdn_step of the
// previous token, which a recorded step ends before the next begins, and with LILY_CUDA_PDL=1
// many PDL_ENTRY kernels (attention, sampling: they launch their dependents only after their
// own wait) lie between two tokens' calls; only qkv, z, b and a come from in_proj. The old opt-in
// `fuse_gdn` moved the conv into in_proj's epilogue (a dependent chain of conv-state loads behind
// each batch's store in the heaviest GEMV) and the gated norm into out_proj's prologue (every
// out_proj block re-reads y and z and normalises before its first dot): it lengthened the two
// weight streams by more than the two launches it saved (439 against 457 tok/s).
// Two cluster barriers, both off the DRAM path: (1) arrive at entry, wait before the first
// remote shared-memory store (every block of the cluster has started: the DSMEM rule);
// (2) after each block stored its head partial sum of y² into the shared memory of the blocks
// of its value head (mapa + st.shared::cluster): it publishes those sums AND tells the writers of
// the q|k conv state that every block has read the old one (the release orders the reads).
// The gated norm's sum over the 128 values of a head: each block's warp 0 sums its 32 y² as
// gdn_gated_norm's warp s does, and the Dv/32 partials are added by the same block_sum tree.
#define GDN_STEP_DK 128
#define GDN_STEP_THREADS 256

__device__ __forceinline__ u32 gdn_cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// v into the float at `p` (an address in this block's shared memory) of block `rank`'s copy.
__device__ __forceinline__ void gdn_st_cluster_f32(const float* p, u32 rank, float v) {
    u32 a;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"((u32)__cvta_generic_to_shared(p)), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(a), "f"(v) : "memory");
}
__device__ __forceinline__ void gdn_cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
__device__ __forceinline__ void gdn_cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void gdn_cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

// One channel's conv step (conv_rows for one row, the same expression): returns the bf16 output;
// `win` ends as the channel's new state (its last K-1 inputs).
template <int K>
__device__ __forceinline__ u16 gdn_conv1(const float (&wt)[K], float (&win)[K], float xt) {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < K - 1; i++) acc += wt[i] * win[i];
    acc += wt[K - 1] * xt;
#pragma unroll
    for (int i = 0; i < K - 2; i++) win[i] = win[i + 1];
    win[K - 2] = xt;
    return bf16_rn(silu_f(acc));
}

template <int K>
__device__ __forceinline__ void gdn_conv_load(const float* __restrict__ cw, const float* __restrict__ cst, int C, int c, float (&wt)[K], float (&win)[K]) {
#pragma unroll
    for (int i = 0; i < K; i++) wt[i] = cw[(u64)c * K + i];
#pragma unroll
    for (int i = 0; i < K - 1; i++) win[i] = cst[(u64)i * C + c];
    win[K - 1] = 0.0f;
}

template <int K>
__device__ __forceinline__ void gdn_conv_store(float* __restrict__ cst, int C, int c, const float (&win)[K]) {
#pragma unroll
    for (int i = 0; i < K - 1; i++) cst[(u64)i * C + c] = win[i];
}

template <int K>
__device__ __forceinline__ void gdn_step_body(const u16* __restrict__ qkv, const u16* __restrict__ z, const u16* __restrict__ bb,
                                              const u16* __restrict__ aa, const float* __restrict__ cw, float* __restrict__ cst,
                                              const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                                              const float* __restrict__ nw, float* __restrict__ state, u16* __restrict__ qkv_c,
                                              u16* __restrict__ out, int hk, int hv, int dv, float eps) {
    constexpr int DK = GDN_STEP_DK;
    __shared__ __align__(16) float qk_sh[2 * DK];  // this token's conv outputs (bf16 values): q | k of the key head
    __shared__ float v_sh[32];                      // the block's 32 v channels
    __shared__ float y_sh[32];                      // the block's 32 y (pre-norm)
    __shared__ float part_sh[4];                    // the head's Dv/32 partial sums of y²
    PDL_LAUNCH();
    gdn_cluster_arrive_relaxed();  // barrier 1: this block has started

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ns = dv / 32, rep = hv / hk, cl = rep * ns;
    const int cr = (int)gdn_cluster_rank();
    const int kh = blockIdx.x / cl, h = kh * rep + cr / ns, s = cr % ns;
    const int C = 2 * hk * DK + hv * dv;
    const int row = tid >> 3, p = tid & 7;  // the thread's row of the block's 32, its lane in the row

    // Nothing below up to PDL_WAIT reads what the previous kernel writes (the header says why the
    // states qualify): the 16 KB of S, the taps, the conv state, the parameters.
    float* sp = state + ((u64)h * dv + s * 32 + row) * DK + 4 * p;
    float S[4][4];
#pragma unroll
    for (int m = 0; m < 4; m++) {
        const float4 t = *(const float4*)(sp + 32 * m);
        S[m][0] = t.x;
        S[m][1] = t.y;
        S[m][2] = t.z;
        S[m][3] = t.w;
    }
    // q | k channel of this thread: q (tid < DK) or k of key head kh.
    const int cqk = (tid / DK) * hk * DK + kh * DK + (tid % DK);
    const int cv = 2 * hk * DK + h * dv + s * 32 + lane;  // v channel (warp 0)
    float wqk[K], winqk[K], wv[K], winv[K];
    gdn_conv_load<K>(cw, cst, C, cqk, wqk, winqk);
    if (warp == 0) gdn_conv_load<K>(cw, cst, C, cv, wv, winv);
    const float decay_rate = expf(a_log[h]);
    const float dtb = dt_bias[h];
    const float wn = warp == 0 ? nw[s * 32 + lane] : 0.0f;
    PDL_WAIT();

    // This token's inputs (in_proj's outputs), raw bf16 until used.
    const u16 xqk = qkv[cqk];
    const u16 xv = warp == 0 ? qkv[cv] : 0;
    const u16 zr = warp == 0 ? z[(u64)h * dv + s * 32 + lane] : 0;
    const u16 braw = bb[h], araw = aa[h];

    // The conv: every block all 2·DK q|k channels of its key head, warp 0 its 32 v channels.
    {
        const u16 o = gdn_conv1<K>(wqk, winqk, bf16f(xqk));
        qk_sh[tid] = bf16f(o);
        if (tid % cl == cr) qkv_c[cqk] = o;
    }
    if (warp == 0) {
        const u16 o = gdn_conv1<K>(wv, winv, bf16f(xv));
        v_sh[lane] = bf16f(o);
        qkv_c[cv] = o;
        gdn_conv_store<K>(cst, C, cv, winv);  // v channels: this block is their only reader
    }
    __syncthreads();

    // q, k l2 norms, each warp for itself in gdn_scan's order (lane l: elements 4l .. 4l+3).
    float qs = 0.0f, ks = 0.0f;
    {
        const float4 q4 = *(const float4*)(qk_sh + 4 * lane), k4 = *(const float4*)(qk_sh + DK + 4 * lane);
        qs += q4.x * q4.x;
        qs += q4.y * q4.y;
        qs += q4.z * q4.z;
        qs += q4.w * q4.w;
        ks += k4.x * k4.x;
        ks += k4.y * k4.y;
        ks += k4.z * k4.z;
        ks += k4.w * k4.w;
    }
    qs = warp_sum(qs);
    ks = warp_sum(ks);
    const float qscale = 1.0f / sqrtf((float)DK);
    const float rq = qscale / sqrtf(qs + 1e-6f), rk = 1.0f / sqrtf(ks + 1e-6f);
    const float beta = sigmoid_f(bf16f(braw));
    const float g = expf(-decay_rate * softplus_f(bf16f(araw) + dtb));
    const float v = v_sh[row];

    // The row's step, gdn_scan's per-row order: s *= g; delta = (v - s.k)·beta; s += delta k; y = s.q.
    float kk[4][4], qq[4][4];
#pragma unroll
    for (int m = 0; m < 4; m++) {
        const float4 q4 = *(const float4*)(qk_sh + 4 * p + 32 * m), k4 = *(const float4*)(qk_sh + DK + 4 * p + 32 * m);
        qq[m][0] = q4.x * rq;
        qq[m][1] = q4.y * rq;
        qq[m][2] = q4.z * rq;
        qq[m][3] = q4.w * rq;
        kk[m][0] = k4.x * rk;
        kk[m][1] = k4.y * rk;
        kk[m][2] = k4.z * rk;
        kk[m][3] = k4.w * rk;
    }
    float part[4];
#pragma unroll
    for (int m = 0; m < 4; m++) {
        part[m] = 0.0f;
#pragma unroll
        for (int c = 0; c < 4; c++) {
            S[m][c] *= g;
            part[m] += S[m][c] * kk[m][c];
        }
    }
    // gdn_scan's warp_sum over lanes L = p + 8m: levels 16 and 8 in the thread, 4, 2, 1 by shuffles.
    float kv = (part[0] + part[2]) + (part[1] + part[3]);
    kv += __shfl_xor_sync(FULL_MASK, kv, 4);
    kv += __shfl_xor_sync(FULL_MASK, kv, 2);
    kv += __shfl_xor_sync(FULL_MASK, kv, 1);
    const float delta = (v - kv) * beta;
#pragma unroll
    for (int m = 0; m < 4; m++) {
        part[m] = 0.0f;
#pragma unroll
        for (int c = 0; c < 4; c++) {
            S[m][c] += delta * kk[m][c];
            part[m] += S[m][c] * qq[m][c];
        }
    }
    float y = (part[0] + part[2]) + (part[1] + part[3]);
    y += __shfl_xor_sync(FULL_MASK, y, 4);
    y += __shfl_xor_sync(FULL_MASK, y, 2);
    y += __shfl_xor_sync(FULL_MASK, y, 1);
#pragma unroll
    for (int m = 0; m < 4; m++) *(float4*)(sp + 32 * m) = make_float4(S[m][0], S[m][1], S[m][2], S[m][3]);
    if (p == 0) y_sh[row] = y;
    __syncthreads();

    // The gated norm: warp 0 sums its 32 y² (gdn_gated_norm's warp s), lane j < ns sends the sum
    // to block j of this value head (and itself), barrier 2, the head's ns sums added as block_sum.
    float yv = 0.0f, ss = 0.0f;
    if (warp == 0) {
        yv = y_sh[lane];
        ss += yv * yv;
        ss = warp_sum(ss);
    }
    gdn_cluster_wait();  // barrier 1: every block of the cluster has started (long since)
    if (warp == 0 && lane < ns) gdn_st_cluster_f32(&part_sh[s], (u32)((cr / ns) * ns + lane), ss);
    gdn_cluster_arrive();  // barrier 2: the partial sums stored, the old conv state read
    gdn_cluster_wait();
    // The q|k conv state: channel tid by rank tid % cl, now that every block has read the old one.
    if (tid % cl == cr) gdn_conv_store<K>(cst, C, cqk, winqk);
    if (warp == 0) {
        float t = lane < ns ? part_sh[lane] : 0.0f;
        t = warp_sum(t);
        const float r = 1.0f / sqrtf(t / (float)dv + eps);
        out[(u64)h * dv + s * 32 + lane] = bf16_rn(yv * r * wn * silu_f(bf16f(zr)));
    }
}

// gdn_step_<K>: K conv taps (2 to 4; the model has 4).
#define GDN_STEP_KERNEL(K)                                                                                             \
    extern "C" __global__ void GDN_BOUNDS(GDN_STEP_THREADS)                                                                 \
    gdn_step_##K(const u16* qkv, const u16* z, const u16* b, const u16* a, const float* cw, float* cst, const float* a_log, \
                 const float* dt_bias, const float* nw, float* state, u16* qkv_c, u16* out, int hk, int hv, int dv, float eps) { \
        KTRACE();                                                                                                      \
        gdn_step_body<K>(qkv, z, b, a, cw, cst, a_log, dt_bias, nw, state, qkv_c, out, hk, hv, dv, eps);                  \
    }
GDN_STEP_KERNEL(2)
GDN_STEP_KERNEL(3)
GDN_STEP_KERNEL(4)
