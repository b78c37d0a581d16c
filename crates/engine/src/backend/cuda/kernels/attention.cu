// attention.cu: the gated full-attention layer's ops. Matches cpu/attention.rs.
//
// Types: qg, q, k, v, gate and out are bf16 activations (common.cuh); scores, softmax state and
// output accumulators are f32. The K/V caches are bf16 too (u16 bits, the CUDA backend's
// kv_zeros): [cap, KV*hd] each, row p holding position p, KV head g at columns g*hd.. .
// kv_append copies k, v into them; every kernel reading them widens to f32 or feeds bf16 tensor
// cores. The CPU keeps f32: the tests give it the same bf16-representable inputs.
//
// attn_qk_norm_rope  qg [rows, H, 2*hd] (query | gate per head) -> q [rows, H*hd] (rms-normed by
//                    q_norm, then RoPE) and gate [rows, H*hd]; k [rows, KV*hd] rms-normed by k_norm
//                    and RoPE'd in place. RoPE: rotate-half (NeoX) on dims 0..rot, pairs
//                    (i, i + rot/2), angle pos * theta^(-2i/rot) computed in double and its sin/cos
//                    rounded to f32 (as the CPU); the f32 results rounded once to bf16. Grid
//                    (rows, H + KV): block y < H is query head y,
//                    the rest are key heads; 128 threads; dynamic shared memory hd floats.
//                    A decode step passes posp (its Step's position, device memory) instead of
//                    pos0, so that a recorded step is valid at every position.
// attn_rows          causal GQA attention of `rows` queries at positions pos0.. over the bf16
//                    caches [cap, KV*hd] (K and V already appended), times sigmoid(gate):
//                    out[t, h] = sum_j softmax_j(q.k_j / sqrt(hd)) v_j * sigmoid(gate[t, h]),
//                    j <= pos0 + t, query head h reads KV head h / (H/KV). Grid (rows, H), 256
//                    threads = 8 warps; warp w takes keys w, w+8, ... with an online softmax (f32,
//                    running max), lane l owns dims l, l+32, ... (hd <= 256, hd % 32 == 0); the 8
//                    partial states are merged through shared memory. K and V are widened to f32
//                    as they are read. The f32 reference path of prefill (LILY_CUDA_ATTN=f32).
// attn_tc_<HD>       (HD in 64, 128, 256; prefill, the default) the same function as attn_rows as
//                    a flash-attention kernel on tensor cores: bf16 q, k, v, p, f32 scores,
//                    softmax state and output accumulators. Block = one KV head and tq = 64/G
//                    query tokens (G = H/KV query heads share that KV head), i.e. 64 query rows
//                    r = token_in_block * G + head_in_group, so each K/V tile is read once for
//                    all G heads. 128 threads = 4 warps of 16 rows. Per tile of 64 keys the block
//                    copies K and V (bf16 already: 16-byte loads, rows of HD bf16 are 16-byte
//                    aligned as HD % 64 == 0) into shared memory; each warp computes S = Q K^T
//                    (16 x 64, mma), masks keys past its rows' positions, updates the online
//                    softmax (running max and sum per row, reduced over the 4 lanes of a row),
//                    and adds P V (P re-packed from the accumulators as bf16 A fragments, V by
//                    ldmatrix.trans) into O (16 x HD f32 per warp, HD/2 registers per thread).
//                    Dynamic shared memory: Q, K, V tiles of 64 x (HD + 8) bf16 (101 KiB at
//                    HD = 256, two blocks per SM). Grid (ceil(rows / tq), KV). Needs 64 % G == 0.
//                    Error, against f32 arithmetic on the same bf16 inputs: the products of bf16
//                    q and k are exact, so a score carries only its f32 accumulation error
//                    (|ds| <= HD 2^-22 scale sum_d |q_d k_d|); p is rounded to bf16 where it
//                    multiplies v, and the output once as an activation; tests/cuda_ops.rs
//                    propagates that bound. LILY_CUDA_ATTN=f32 selects attn_rows instead.
// kv_append          k, v [rows, KV*hd] (bf16) copied to rows p0 .. p0 + rows of the caches,
//                    p0 = *posp for a decode step (rows = 1, the position read on the device),
//                    else pos0 (prefill). Four values per thread (KV*hd % 32 == 0: 8 aligned
//                    bytes in and out); grid ceil(rows * KV*hd / 4 / 256), 256 threads. (The
//                    append in cpu/attention.rs.)
// attn_decode_split + attn_decode_combine  decode (one query per head at position *posp, n =
//                    *posp + 1 keys) split over the context: grid (KV, ns_max) with ns_max and
//                    the split length chosen from the cache's capacity (mod.rs: at most 256
//                    splits of a multiple of 32 keys), so that a recorded step serves every
//                    position below it. Block (kvh, s), 256 threads = 8 warps, stages its keys
//                    in tiles of 32 (K and V copied as bf16 with 16-byte loads: 2 * 32 * hd u16 =
//                    32 KiB of dynamic shared memory at hd = 256, half of f32 tiles, so more
//                    blocks fit an SM to hide the cache's latency; widened to f32 as each warp
//                    reads them) and warp w runs query head kvh * G + w (and + 8 when G > 8) over
//                    each tile: the G heads of a group share one read of the cache. Lane l owns dims
//                    l, l + 32, ... (hd <= 256, hd % 32 == 0). Each writes a partial state
//                    (max, normaliser, unnormalised output) at part[h][s], or the block returns
//                    at once when its keys start past n. The combine (grid H) merges the first
//                    ceil(n / split) of them per head and applies the gate.

extern "C" __global__ void __launch_bounds__(128)
attn_qk_norm_rope(const u16* __restrict__ qg, u16* __restrict__ k, const float* __restrict__ qn,
                  const float* __restrict__ kn, u16* __restrict__ q, u16* __restrict__ gate, int H, int KV, int hd,
                  int rot, double theta, int pos0, float eps, const int* __restrict__ posp) { PDL_ENTRY();
    extern __shared__ float y[];
    __shared__ float sh[32];
    int t = blockIdx.x, hh = blockIdx.y;
    const u16* src;
    u16* dst;
    const float* w;
    if (hh < H) {
        src = qg + ((u64)t * H + hh) * 2 * hd;
        dst = q + ((u64)t * H + hh) * hd;
        w = qn;
        u16* g = gate + ((u64)t * H + hh) * hd;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) g[i] = src[hd + i];  // bf16 to bf16: a copy
    } else {
        src = k + ((u64)t * KV + (hh - H)) * hd;
        dst = (u16*)src;
        w = kn;
    }
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float v = bf16f(src[i]);
        y[i] = v;
        ss += v * v;
    }
    ss = block_sum(ss, sh);  // its barriers also order the y[] writes above
    float r = 1.0f / sqrtf(ss / (float)hd + eps);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) y[i] = y[i] * r * w[i];
    __syncthreads();
    int half = rot / 2;
    double pos = (double)((posp ? posp[0] : pos0) + t);
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        double inv = pow(theta, -(2.0 * (double)i) / (double)rot);
        double ang = pos * inv;
        float s = (float)sin(ang), c = (float)cos(ang);
        float a = y[i], b = y[i + half];
        y[i] = a * c - b * s;
        y[i + half] = a * s + b * c;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < hd; i += blockDim.x) dst[i] = bf16_rn(y[i]);
}

#define ATT_WARPS 8
#define ATT_MAXD 8      // hd / 32 at most

// One block's online softmax over keys [j0, j1) for the query at qp (KV head kvh): warp w takes
// keys j0+w, j0+w+8, ...; the warps' states are merged through shared memory. On return (after a
// barrier) sacc[w][d] * f[w] summed over w is the unnormalised output, M the running max and L the
// normaliser; an empty range gives L = 0.
__device__ __forceinline__ void attn_range(const u16* __restrict__ qp, const u16* __restrict__ kc,
                                           const u16* __restrict__ vc, int kvh, u64 kvd, int hd, int j0, int j1,
                                           float scale, float* sm, float* sl, float (*sacc)[ATT_MAXD * 32], float* f,
                                           float& M, float& L) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nd = hd >> 5;
    float qv[ATT_MAXD], acc[ATT_MAXD];
#pragma unroll
    for (int i = 0; i < ATT_MAXD; i++) {
        qv[i] = i < nd ? bf16f(qp[lane + 32 * i]) : 0.0f;
        acc[i] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (int j = j0 + warp; j < j1; j += ATT_WARPS) {
        const u16* kp = kc + (u64)j * kvd + (u64)kvh * hd;
        const u16* vp = vc + (u64)j * kvd + (u64)kvh * hd;
        float d = 0.0f;
#pragma unroll
        for (int i = 0; i < ATT_MAXD; i++)
            if (i < nd) d += qv[i] * bf16f(kp[lane + 32 * i]);
        float s = warp_sum(d) * scale;
        float mn = fmaxf(m, s);
        float c = expf(m - mn), p = expf(s - mn);
        l = l * c + p;
#pragma unroll
        for (int i = 0; i < ATT_MAXD; i++)
            if (i < nd) acc[i] = acc[i] * c + p * bf16f(vp[lane + 32 * i]);
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
attn_rows(const u16* __restrict__ q, const u16* __restrict__ gate, const u16* __restrict__ kc,
          const u16* __restrict__ vc, u16* __restrict__ out, int H, int KV, int hd, int pos0, float scale) { PDL_ENTRY();
    __shared__ float sm[ATT_WARPS], sl[ATT_WARPS];
    __shared__ float sacc[ATT_WARPS][ATT_MAXD * 32];
    const int t = blockIdx.x, h = blockIdx.y;
    float f[ATT_WARPS], M, L;
    attn_range(q + ((u64)t * H + h) * hd, kc, vc, h / (H / KV), (u64)KV * hd, hd, 0, pos0 + t + 1, scale, sm, sl, sacc, f, M, L);
    const u16* gp = gate + ((u64)t * H + h) * hd;
    u16* op = out + ((u64)t * H + h) * hd;
    for (int dd = threadIdx.x; dd < hd; dd += blockDim.x) {
        float o = 0.0f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; w++) o += sacc[w][dd] * f[w];
        op[dd] = bf16_rn(o / L * sigmoid_f(bf16f(gp[dd])));
    }
}

extern "C" __global__ void __launch_bounds__(256)
kv_append(const u16* __restrict__ k, const u16* __restrict__ v, u16* __restrict__ kc, u16* __restrict__ vc,
          int kvd, int rows, int pos0, const int* __restrict__ posp) { PDL_ENTRY();
    // Element i .. i+3 of the rows (kvd % 4 == 0: the four stay in one row, and the 8-byte loads
    // and stores at i and at (p0 * kvd + i) bf16 are aligned).
    const u64 i = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (i >= (u64)rows * kvd) return;
    const u64 at = (u64)(posp ? posp[0] : pos0) * kvd + i;
    *(uint2*)(kc + at) = *(const uint2*)(k + i);
    *(uint2*)(vc + at) = *(const uint2*)(v + i);
}

// Decode, split over the context, one block per (KV head, split): the block stages tiles of
// ATT_TILE keys of its KV head (K and V, bf16 as cached) in shared memory once, and warp w runs the online
// softmax of query head kvh*G + w (w + 8, ... when G > 8) over them, so the G query heads of a
// group read the cache once. Split s covers keys [s*split, s*split + split) of the n = *posp + 1;
// it writes part[h][s] = (M, L, o[hd] unnormalised) for each of its heads; grid (KV, ns_max).
#define ATT_TILE 32
extern "C" __global__ void __launch_bounds__(256)
attn_decode_split(const u16* __restrict__ q, const u16* __restrict__ kc, const u16* __restrict__ vc,
                  float* __restrict__ part, int H, int KV, int hd, const int* __restrict__ posp, int split, float scale) { PDL_ENTRY();
    extern __shared__ __align__(16) u16 kvtile[];  // K then V: [ATT_TILE][hd] bf16 each
    u16* ks = kvtile;
    u16* vs = kvtile + ATT_TILE * hd;
    const int kvh = blockIdx.x, s = blockIdx.y, ns_max = gridDim.y;
    const int n = posp[0] + 1;
    const int j0 = s * split, j1 = min(n, j0 + split);
    if (j0 >= n) return;  // past the context (the grid covers the capacity)
    const int G = H / KV, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nd = hd >> 5;
    const u64 kvd = (u64)KV * hd;
    // Each warp keeps the state of up to two heads (G <= 16).
    float qv[2][ATT_MAXD], acc[2][ATT_MAXD], m[2], l[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int g = warp + 8 * r;
        m[r] = NEG_INF;
        l[r] = 0.0f;
#pragma unroll
        for (int i = 0; i < ATT_MAXD; i++) {
            qv[r][i] = (g < G && i < nd) ? bf16f(q[(u64)(kvh * G + g) * hd + lane + 32 * i]) : 0.0f;
            acc[r][i] = 0.0f;
        }
    }
    for (int t0 = j0; t0 < j1; t0 += ATT_TILE) {
        // 16-byte copies of 8 bf16: a head's row (hd * 2 bytes, hd % 32 == 0) and its offset in the
        // cache row (kvh * hd * 2) are multiples of 64 bytes.
        const int nk = min(ATT_TILE, j1 - t0), q8 = hd >> 3;
        __syncthreads();  // the previous tile is consumed
        for (int i = threadIdx.x; i < nk * q8; i += blockDim.x) {
            const int r = i / q8, c = i - r * q8;
            const u64 at = (u64)(t0 + r) * kvd + (u64)kvh * hd;
            ((uint4*)ks)[i] = ((const uint4*)(kc + at))[c];
            ((uint4*)vs)[i] = ((const uint4*)(vc + at))[c];
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < 2; r++) {
            if (warp + 8 * r >= G) continue;
            for (int j = 0; j < nk; j++) {
                float d = 0.0f;
#pragma unroll
                for (int i = 0; i < ATT_MAXD; i++)
                    if (i < nd) d += qv[r][i] * bf16f(ks[j * hd + lane + 32 * i]);
                const float sc = warp_sum(d) * scale;
                const float mn = fmaxf(m[r], sc);
                const float c = expf(m[r] - mn), p = expf(sc - mn);
                l[r] = l[r] * c + p;
#pragma unroll
                for (int i = 0; i < ATT_MAXD; i++)
                    if (i < nd) acc[r][i] = acc[r][i] * c + p * bf16f(vs[j * hd + lane + 32 * i]);
                m[r] = mn;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int g = warp + 8 * r;
        if (g >= G) continue;
        float* pp = part + ((u64)(kvh * G + g) * ns_max + s) * (hd + 2);
        if (lane == 0) { pp[0] = m[r]; pp[1] = l[r]; }
#pragma unroll
        for (int i = 0; i < ATT_MAXD; i++)
            if (i < nd) pp[2 + lane + 32 * i] = acc[r][i];
    }
}

// Merges the used partial states of each head (part[h] holds ns_max), normalises and applies the
// gate: grid H, 256 threads.
extern "C" __global__ void __launch_bounds__(256)
attn_decode_combine(const float* __restrict__ part, const u16* __restrict__ gate, u16* __restrict__ out, int hd,
                    int ns_max, const int* __restrict__ posp, int split) { PDL_ENTRY();
    const int h = blockIdx.x;
    const int ns = (posp[0] + split) / split;  // ceil((pos + 1) / split)
    const float* pp = part + (u64)h * ns_max * (hd + 2);
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
        out[(u64)h * hd + dd] = bf16_rn(o / L * sigmoid_f(bf16f(gate[(u64)h * hd + dd])));
    }
}

// ---- tensor-core prefill attention (attn_tc_<HD>)
#define FA_M 64  // query rows per block
#define FA_N 64  // keys per tile

template <int HD>
__device__ __forceinline__ void attn_tc_body(const u16* __restrict__ q, const u16* __restrict__ gate,
                                             const u16* __restrict__ kc, const u16* __restrict__ vc,
                                             u16* __restrict__ out, int H, int KV, int rows, int pos0, float scale) {
    constexpr int LD = HD + 8;  // bf16 row stride: 16-byte rows, ldmatrix rows on distinct banks
    constexpr int NT = HD / 8;  // n8 tiles of the output
    extern __shared__ __align__(16) u16 fa_smem[];
    u16(*Qs)[LD] = (u16(*)[LD])fa_smem;
    u16(*Ks)[LD] = (u16(*)[LD])(fa_smem + FA_M * LD);
    u16(*Vs)[LD] = (u16(*)[LD])(fa_smem + (FA_M + FA_N) * LD);
    const int G = H / KV, tq = FA_M / G;
    const int kvh = blockIdx.y, t0 = blockIdx.x * tq;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u64 kvd = (u64)KV * HD;

    // Q rows of this block (bf16); rows past the chunk are zeros.
#pragma unroll 4
    for (int i = tid; i < FA_M * HD / 4; i += 128) {
        const int r = i / (HD / 4), c4 = (i % (HD / 4)) * 4;
        const int t = t0 + r / G, h = kvh * G + r % G;
        *(uint2*)&Qs[r][c4] = t < rows ? *(const uint2*)(q + ((u64)t * H + h) * HD + c4) : make_uint2(0u, 0u);
    }
    // This thread's two rows (g and g + 8 of its warp) and the last key each may see; rows past the
    // chunk take the chunk's last position (finite softmax, output not written).
    const int ra = warp * 16 + (lane >> 2), rb = ra + 8;
    const int pa = pos0 + min(t0 + ra / G, rows - 1), pb = pos0 + min(t0 + rb / G, rows - 1);
    const int nkeys = pos0 + min(t0 + tq, rows);
    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float ma = NEG_INF, mb = NEG_INF, la = 0.0f, lb = 0.0f;

    for (int j0 = 0; j0 < nkeys; j0 += FA_N) {
        __syncthreads();  // the previous tile's K/V reads are done (and Q is staged, the first time)
        // The cache is bf16 already: 16-byte copies of 8 values (cache rows of a head and shared
        // rows of LD bf16 are 16-byte aligned). Keys from nkeys on are zeros: masked, their p is
        // 0, and zero V rows keep p * v finite.
#pragma unroll 4
        for (int i = tid; i < FA_N * HD / 8; i += 128) {
            const int j = i / (HD / 8), c8 = (i % (HD / 8)) * 8;
            const int key = j0 + j;
            uint4 kv = make_uint4(0u, 0u, 0u, 0u), vv = kv;
            if (key < nkeys) {
                kv = *(const uint4*)(kc + (u64)key * kvd + (u64)kvh * HD + c8);
                vv = *(const uint4*)(vc + (u64)key * kvd + (u64)kvh * HD + c8);
            }
            *(uint4*)&Ks[j][c8] = kv;
            *(uint4*)&Vs[j][c8] = vv;
        }
        __syncthreads();

        // S = Q K^T: 16 rows x 64 keys per warp (8 n8 tiles).
        float s[8][4];
#pragma unroll
        for (int n = 0; n < 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            u32 a[4];
            ldsm_x4(smem_u32(&Qs[warp * 16 + (lane & 15)][kk * 16 + (lane >> 4) * 8]), a[0], a[1], a[2], a[3]);
#pragma unroll
            for (int nj = 0; nj < 4; nj++) {
                u32 b0, b1, b2, b3;
                ldsm_x4(smem_u32(&Ks[nj * 16 + (lane & 7) + ((lane >> 4) << 3)][kk * 16 + ((lane >> 3) & 1) * 8]), b0, b1, b2, b3);
                mma_bf16_16816(s[2 * nj], a, b0, b1);
                mma_bf16_16816(s[2 * nj + 1], a, b2, b3);
            }
        }
        // Scale, causal mask, online softmax (row max over the 4 lanes holding a row).
        float mxa = ma, mxb = mb;
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int key = j0 + n * 8 + 2 * (lane & 3) + e;
                s[n][e] = key <= pa ? s[n][e] * scale : NEG_INF;
                s[n][2 + e] = key <= pb ? s[n][2 + e] * scale : NEG_INF;
                mxa = fmaxf(mxa, s[n][e]);
                mxb = fmaxf(mxb, s[n][2 + e]);
            }
        mxa = fmaxf(mxa, __shfl_xor_sync(FULL_MASK, mxa, 1));
        mxa = fmaxf(mxa, __shfl_xor_sync(FULL_MASK, mxa, 2));
        mxb = fmaxf(mxb, __shfl_xor_sync(FULL_MASK, mxb, 1));
        mxb = fmaxf(mxb, __shfl_xor_sync(FULL_MASK, mxb, 2));
        // Key 0 is in the first tile and visible to every row, so mxa, mxb are finite from here on.
        const float ca = expf(ma - mxa), cb = expf(mb - mxb);
        ma = mxa;
        mb = mxb;
        la *= ca;
        lb *= cb;
#pragma unroll
        for (int n = 0; n < NT; n++) {
            o[n][0] *= ca;
            o[n][1] *= ca;
            o[n][2] *= cb;
            o[n][3] *= cb;
        }
        // P = exp(S - m) (masked keys give 0), summed in f32, then packed as bf16 A fragments: the
        // accumulators of n8 tiles 2kk and 2kk+1 are exactly the A fragment of keys 16kk..16kk+15.
        u32 pf[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            float p[2][4];
#pragma unroll
            for (int h2 = 0; h2 < 2; h2++) {
                const int n = 2 * kk + h2;
                p[h2][0] = expf(s[n][0] - ma);
                p[h2][1] = expf(s[n][1] - ma);
                p[h2][2] = expf(s[n][2] - mb);
                p[h2][3] = expf(s[n][3] - mb);
                la += p[h2][0] + p[h2][1];
                lb += p[h2][2] + p[h2][3];
            }
            pf[kk][0] = pack_bf16x2(p[0][0], p[0][1]);
            pf[kk][1] = pack_bf16x2(p[0][2], p[0][3]);
            pf[kk][2] = pack_bf16x2(p[1][0], p[1][1]);
            pf[kk][3] = pack_bf16x2(p[1][2], p[1][3]);
        }
        // O += P V: V tiles [key][d] read transposed (k = key, n = d).
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
#pragma unroll
            for (int dj = 0; dj < HD / 16; dj++) {
                u32 b0, b1, b2, b3;
                ldsm_x4_trans(smem_u32(&Vs[kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8][dj * 16 + (lane >> 4) * 8]), b0, b1, b2, b3);
                mma_bf16_16816(o[2 * dj], pf[kk], b0, b1);
                mma_bf16_16816(o[2 * dj + 1], pf[kk], b2, b3);
            }
    }
    // Row sums over the 4 lanes of a row, then out = O / l * sigmoid(gate).
    la += __shfl_xor_sync(FULL_MASK, la, 1);
    la += __shfl_xor_sync(FULL_MASK, la, 2);
    lb += __shfl_xor_sync(FULL_MASK, lb, 1);
    lb += __shfl_xor_sync(FULL_MASK, lb, 2);
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int r = half ? rb : ra;
        const int t = t0 + r / G, h = kvh * G + r % G;
        if (t >= rows) continue;
        const float inv = 1.0f / (half ? lb : la);
        const u64 base = ((u64)t * H + h) * HD;
#pragma unroll
        for (int n = 0; n < NT; n++) {
            const int d = n * 8 + 2 * (lane & 3);
            const u32 gv = *(const u32*)(gate + base + d);
            *(u32*)(out + base + d) = pack_bf16x2(o[n][2 * half] * inv * sigmoid_f(bf16_lo(gv)),
                                                   o[n][2 * half + 1] * inv * sigmoid_f(bf16_hi(gv)));
        }
    }
}

#define ATTN_TC(HD)                                                                                              \
    extern "C" __global__ void __launch_bounds__(128)                                                            \
    attn_tc_##HD(const u16* q, const u16* gate, const u16* kc, const u16* vc, u16* out, int H, int KV,           \
                 int rows, int pos0, float scale) { PDL_ENTRY();                                                              \
        attn_tc_body<HD>(q, gate, kc, vc, out, H, KV, rows, pos0, scale);                                        \
    }
ATTN_TC(64)
ATTN_TC(128)
ATTN_TC(256)
