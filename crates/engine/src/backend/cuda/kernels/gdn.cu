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
// Decode uses the same kernels with rows = 1 (a chunked WY form for long prefills comes later).

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
               u16* __restrict__ out, int C, int K, int rows) { PDL_ENTRY();
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
extern "C" __global__ void conv1d_state(const u16* __restrict__ x, float* __restrict__ state, int C, int K, int rows) { PDL_ENTRY();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    for (int i = 0; i < K - 1; i++) {
        const int r = rows - (K - 1) + i;
        state[(u64)i * C + c] = r >= 0 ? bf16f(x[(u64)r * C + c]) : state[(u64)(K - 1 + r) * C + c];
    }
}

extern "C" __global__ void conv1d_step(const u16* x, const float* w, float* state, u16* out, int C, int K) { PDL_ENTRY();
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
                          const float* dt_bias, float* state, float* y, int rows, int hk, int hv, int dv) { PDL_ENTRY(); \
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
               int hv, int dv, float eps) { PDL_ENTRY();
    __shared__ float sh[32];
    const u64 base = ((u64)blockIdx.x * hv + blockIdx.y) * dv;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dv; i += blockDim.x) ss += y[base + i] * y[base + i];
    ss = block_sum(ss, sh);
    const float r = 1.0f / sqrtf(ss / (float)dv + eps);
    for (int i = threadIdx.x; i < dv; i += blockDim.x) out[base + i] = bf16_rn(y[base + i] * r * w[i] * silu_f(bf16f(z[base + i])));
}
