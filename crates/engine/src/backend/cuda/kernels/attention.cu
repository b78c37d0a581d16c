// attention.cu: the gated full-attention layer's ops. Matches cpu/attention.rs.
//
// attn_qk_norm_rope  qg [rows, H, 2*hd] (query | gate per head) -> q [rows, H*hd] (rms-normed by
//                    q_norm, then RoPE) and gate [rows, H*hd]; k [rows, KV*hd] rms-normed by k_norm
//                    and RoPE'd in place. RoPE: rotate-half (NeoX) on dims 0..rot, pairs
//                    (i, i + rot/2), angle pos * theta^(-2i/rot) computed in double and its sin/cos
//                    rounded to f32 (as the CPU). Grid (rows, H + KV): block y < H is query head y,
//                    the rest are key heads; 128 threads; dynamic shared memory hd floats.
// attn_rows          causal GQA attention of `rows` queries at positions pos0.. over the cache
//                    [cap, KV*hd] (K and V already appended), times sigmoid(gate):
//                    out[t, h] = sum_j softmax_j(q.k_j / sqrt(hd)) v_j * sigmoid(gate[t, h]),
//                    j <= pos0 + t, query head h reads KV head h / (H/KV). Grid (rows, H), 256
//                    threads = 8 warps; warp w takes keys w, w+8, ... with an online softmax (f32,
//                    running max), lane l owns dims l, l+32, ... (hd <= 256, hd % 32 == 0); the 8
//                    partial states are merged through shared memory. Used for prefill (rows > 1)
//                    and decode (rows = 1).
// attn_decode_split + attn_decode_combine  decode (one query) split over the context: grid
//                    (H, ceil(n/256)) blocks each do 256 keys as above and write a partial state
//                    (max, normaliser, unnormalised output); the combine merges them per head
//                    (grid H). Query heads of one KV group still read K/V separately (sharing the
//                    loads across the 8 heads of a group is a later step).

extern "C" __global__ void __launch_bounds__(128)
attn_qk_norm_rope(const float* __restrict__ qg, float* __restrict__ k, const float* __restrict__ qn,
                  const float* __restrict__ kn, float* __restrict__ q, float* __restrict__ gate, int H, int KV, int hd,
                  int rot, double theta, int pos0, float eps) {
    extern __shared__ float y[];
    __shared__ float sh[32];
    int t = blockIdx.x, hh = blockIdx.y;
    const float* src;
    float* dst;
    const float* w;
    if (hh < H) {
        src = qg + ((u64)t * H + hh) * 2 * hd;
        dst = q + ((u64)t * H + hh) * hd;
        w = qn;
        float* g = gate + ((u64)t * H + hh) * hd;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) g[i] = src[hd + i];
    } else {
        src = k + ((u64)t * KV + (hh - H)) * hd;
        dst = (float*)src;
        w = kn;
    }
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float v = src[i];
        y[i] = v;
        ss += v * v;
    }
    ss = block_sum(ss, sh);  // its barriers also order the y[] writes above
    float r = 1.0f / sqrtf(ss / (float)hd + eps);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) y[i] = y[i] * r * w[i];
    __syncthreads();
    int half = rot / 2;
    double pos = (double)(pos0 + t);
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        double inv = pow(theta, -(2.0 * (double)i) / (double)rot);
        double ang = pos * inv;
        float s = (float)sin(ang), c = (float)cos(ang);
        float a = y[i], b = y[i + half];
        y[i] = a * c - b * s;
        y[i + half] = a * s + b * c;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < hd; i += blockDim.x) dst[i] = y[i];
}

#define ATT_WARPS 8
#define ATT_MAXD 8      // hd / 32 at most
#define ATT_SPLIT 256   // keys per block of the split decode kernel

// One block's online softmax over keys [j0, j1) for the query at qp (KV head kvh): warp w takes
// keys j0+w, j0+w+8, ...; the warps' states are merged through shared memory. On return (after a
// barrier) sacc[w][d] * f[w] summed over w is the unnormalised output, M the running max and L the
// normaliser; an empty range gives L = 0.
__device__ __forceinline__ void attn_range(const float* __restrict__ qp, const float* __restrict__ kc,
                                           const float* __restrict__ vc, int kvh, u64 kvd, int hd, int j0, int j1,
                                           float scale, float* sm, float* sl, float (*sacc)[ATT_MAXD * 32], float* f,
                                           float& M, float& L) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nd = hd >> 5;
    float qv[ATT_MAXD], acc[ATT_MAXD];
#pragma unroll
    for (int i = 0; i < ATT_MAXD; i++) {
        qv[i] = i < nd ? qp[lane + 32 * i] : 0.0f;
        acc[i] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (int j = j0 + warp; j < j1; j += ATT_WARPS) {
        const float* kp = kc + (u64)j * kvd + (u64)kvh * hd;
        const float* vp = vc + (u64)j * kvd + (u64)kvh * hd;
        float d = 0.0f;
#pragma unroll
        for (int i = 0; i < ATT_MAXD; i++)
            if (i < nd) d += qv[i] * kp[lane + 32 * i];
        float s = warp_sum(d) * scale;
        float mn = fmaxf(m, s);
        float c = expf(m - mn), p = expf(s - mn);
        l = l * c + p;
#pragma unroll
        for (int i = 0; i < ATT_MAXD; i++)
            if (i < nd) acc[i] = acc[i] * c + p * vp[lane + 32 * i];
        m = mn;
    }
    if (lane == 0) { sm[warp] = m; sl[warp] = l; }
#pragma unroll
    for (int i = 0; i < ATT_MAXD; i++)
        if (i < nd) sacc[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    M = NEG_INF;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; w++)
        if (sl[w] > 0.0f) M = fmaxf(M, sm[w]);
    L = 0.0f;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; w++) {
        f[w] = sl[w] > 0.0f ? expf(sm[w] - M) : 0.0f;
        L += sl[w] * f[w];
    }
}

extern "C" __global__ void __launch_bounds__(256)
attn_rows(const float* __restrict__ q, const float* __restrict__ gate, const float* __restrict__ kc,
          const float* __restrict__ vc, float* __restrict__ out, int H, int KV, int hd, int pos0, float scale) {
    __shared__ float sm[ATT_WARPS], sl[ATT_WARPS];
    __shared__ float sacc[ATT_WARPS][ATT_MAXD * 32];
    const int t = blockIdx.x, h = blockIdx.y;
    float f[ATT_WARPS], M, L;
    attn_range(q + ((u64)t * H + h) * hd, kc, vc, h / (H / KV), (u64)KV * hd, hd, 0, pos0 + t + 1, scale, sm, sl, sacc, f, M, L);
    const float* gp = gate + ((u64)t * H + h) * hd;
    float* op = out + ((u64)t * H + h) * hd;
    for (int dd = threadIdx.x; dd < hd; dd += blockDim.x) {
        float o = 0.0f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; w++) o += sacc[w][dd] * f[w];
        op[dd] = o / L * sigmoid_f(gp[dd]);
    }
}

// Decode, split over the context: block (h, s) does keys [s*ATT_SPLIT, ..) of the n = pos + 1
// keys and writes its partial state part[h][s] = (M, L, o[hd] unnormalised); grid (H, ceil(n/256)).
extern "C" __global__ void __launch_bounds__(256)
attn_decode_split(const float* __restrict__ q, const float* __restrict__ kc, const float* __restrict__ vc,
                  float* __restrict__ part, int H, int KV, int hd, int n, float scale) {
    __shared__ float sm[ATT_WARPS], sl[ATT_WARPS];
    __shared__ float sacc[ATT_WARPS][ATT_MAXD * 32];
    const int h = blockIdx.x, s = blockIdx.y, ns = gridDim.y;
    const int j0 = s * ATT_SPLIT, j1 = min(n, j0 + ATT_SPLIT);
    float f[ATT_WARPS], M, L;
    attn_range(q + (u64)h * hd, kc, vc, h / (H / KV), (u64)KV * hd, hd, j0, j1, scale, sm, sl, sacc, f, M, L);
    float* pp = part + ((u64)h * ns + s) * (hd + 2);
    if (threadIdx.x == 0) { pp[0] = M; pp[1] = L; }
    for (int dd = threadIdx.x; dd < hd; dd += blockDim.x) {
        float o = 0.0f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; w++) o += sacc[w][dd] * f[w];
        pp[2 + dd] = o;
    }
}

// Merges the ns partial states of each head, normalises and applies the gate: grid H, 256 threads.
extern "C" __global__ void __launch_bounds__(256)
attn_decode_combine(const float* __restrict__ part, const float* __restrict__ gate, float* __restrict__ out, int hd, int ns) {
    const int h = blockIdx.x;
    const float* pp = part + (u64)h * ns * (hd + 2);
    float M = NEG_INF;
    for (int s = 0; s < ns; s++)
        if (pp[(u64)s * (hd + 2) + 1] > 0.0f) M = fmaxf(M, pp[(u64)s * (hd + 2)]);
    for (int dd = threadIdx.x; dd < hd; dd += blockDim.x) {
        float L = 0.0f, o = 0.0f;
        for (int s = 0; s < ns; s++) {
            const float* ps = pp + (u64)s * (hd + 2);
            float l = ps[1];
            if (l > 0.0f) {
                float fs = expf(ps[0] - M);
                L += l * fs;
                o += ps[2 + dd] * fs;
            }
        }
        out[(u64)h * hd + dd] = o / L * sigmoid_f(gate[(u64)h * hd + dd]);
    }
}
