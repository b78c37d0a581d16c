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
//                    and decode (rows = 1). Split-K over long contexts for decode is a later step.

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
#define ATT_MAXD 8  // hd / 32 at most

extern "C" __global__ void __launch_bounds__(256)
attn_rows(const float* __restrict__ q, const float* __restrict__ gate, const float* __restrict__ kc,
          const float* __restrict__ vc, float* __restrict__ out, int H, int KV, int hd, int pos0, float scale) {
    __shared__ float sm[ATT_WARPS], sl[ATT_WARPS];
    __shared__ float sacc[ATT_WARPS][ATT_MAXD * 32];
    const int t = blockIdx.x, h = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nd = hd >> 5;
    const int kvh = h / (H / KV);
    const u64 kvd = (u64)KV * hd;
    const int n = pos0 + t + 1;
    const float* qp = q + ((u64)t * H + h) * hd;
    float qv[ATT_MAXD], acc[ATT_MAXD];
#pragma unroll
    for (int i = 0; i < ATT_MAXD; i++) {
        qv[i] = i < nd ? qp[lane + 32 * i] : 0.0f;
        acc[i] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (int j = warp; j < n; j += ATT_WARPS) {
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
    float M = NEG_INF;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, sm[w]);
    float L = 0.0f, f[ATT_WARPS];
#pragma unroll
    for (int w = 0; w < ATT_WARPS; w++) {
        f[w] = sl[w] > 0.0f ? expf(sm[w] - M) : 0.0f;
        L += sl[w] * f[w];
    }
    const float* gp = gate + ((u64)t * H + h) * hd;
    float* op = out + ((u64)t * H + h) * hd;
    for (int dd = threadIdx.x; dd < hd; dd += blockDim.x) {
        float o = 0.0f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; w++) o += sacc[w][dd] * f[w];
        op[dd] = o / L * sigmoid_f(gp[dd]);
    }
}
