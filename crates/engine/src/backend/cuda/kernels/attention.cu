// attention.cu: the gated full-attention layer's ops. Matches cpu/attention.rs.
//
// Types: qg, q, k, v, gate and out are bf16 activations (common.cuh); scores, softmax state and
// output accumulators are f32. The K/V caches are bf16 too (u16 bits, the CUDA backend's
// kv_zeros): [cap, KV*hd] each, row p holding position p, KV head g at columns g*hd.. .
// kv_append (prefill) and attn_decode_<HD> (decode) copy k, v into them; every kernel reading them
// widens to f32 or feeds bf16 tensor cores. The CPU keeps f32: the tests give it the same
// bf16-representable inputs.
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
//                    p0 = pos0 (prefill; p0 = *posp when posp is not null, which no caller passes
//                    now: a decode step's append is part of attn_decode_<HD>). Four values per
//                    thread (KV*hd % 32 == 0: 8 aligned bytes in and out); grid
//                    ceil(rows * KV*hd / 4 / 256), 256 threads. (The append in cpu/attention.rs.)
// attn_decode_<HD> + attn_decode_combine  (HD in 64, 128, 256) decode: the append and the
//                    attention of one query per head at position pos = *posp over n = pos + 1 keys
//                    (cpu/attention.rs `attention` with rows = 1), flash-decoding on tensor cores.
//                    Why: at long context a decode step is bound by reading the cache, and the
//                    SIMT form it replaces (a warp per query head: per key, scalar 2-byte
//                    shared-memory reads, a 5-shuffle dot product and two expf, after a
//                    synchronous tile copy) was instruction-bound at 0.55 TB/s on the H200; here
//                    a warp spends about 440 instructions (64 mma) on 8 keys of all 8 heads.
//                    Grid (KV * HG, ns): HG = ceil(G / 8) groups of at most 8 of the G = H/KV query
//                    heads of a KV head, ns splits per group chosen by mod.rs from the SM count and
//                    the capacity only (one block per SM, ns <= ceil(cap / 64)), so a recorded step
//                    serves every position below the capacity. On the device the n keys' chunks of
//                    8 are spread evenly over the first nb = min(ns, ceil(chunks / 8)) blocks
//                    (dec_blocks: at least one chunk per warp); the rest return at once. So at every
//                    position all SMs stream the cache while it is long, and a short context is
//                    not cut into more partial states than it has chunks. Block: 256 threads = 8
//                    warps, each an independent online softmax over chunks w, w + 8, ... of the
//                    block's share, computing S^T = K Q^T and O^T += V^T P^T with mma.sync (bf16
//                    in, f32 accumulators; the G heads of the group share each K/V load), K and V
//                    loaded from global memory straight into fragments (16-byte loads, the next
//                    chunk requested while this one is computed: ~8 KiB in flight per warp, 64 KiB
//                    per SM). f32-accurate: p is split exactly into three bf16 for P V, so every
//                    product is exact and sums are f32 (tests hold it to F32_TOL, as the f32
//                    kernels). The newest key comes from the k, v inputs; block (kvh, group 0,
//                    split 0) writes them into cache row pos, which no block of the launch reads.
//                    The 8 warps merge through dynamic shared memory (8 * 8 * HD f32: 64 KiB at
//                    HD = 256) into one partial state per block (max and normaliser per head slot,
//                    unnormalised output in mma-fragment order). attn_decode_combine (grid
//                    (KV * HG, hd / 4), 256 threads) merges the nb partial states per head in a
//                    fixed order (bit-reproducible), normalises, applies sigmoid(gate) and writes
//                    out [H, hd]. Details and the fragment layouts at the kernels.
// attn_decode_early_<HD> (switch `attn_early`) attn_decode_<HD> with each warp's first
//                    chunk of keys requested before the PDL wait (the position is the step's, so
//                    the block's share is known; the launch writes only row pos): the same partial
//                    states bit for bit, for attn_decode_combine.
// attn_decode_pf_<HD> (switch `attn_pf`, the default since stop 59) attn_decode_early_<HD> with
//                    each warp's chunk two steps ahead requested into the L2 in the key loop: the
//                    same partial states.
// attn_decode_lz_<HD> (opt-in `attn_lazy`) attn_decode_pf_<HD> with the output's rescale skipped
//                    when no lane's factor moved (a warp vote): the same partial states.
// attn_decode_ve_<HD> (opt-in `attn_ve`; attn_decode_lzve_<HD> with `attn_lazy`) attn_decode_pf_<HD>
//                    with the next chunk's V requested with its K into a second buffer (dec_chunk):
//                    the same partial states.
// attn_decode_p2_<HD>, attn_decode_p1_<HD> (opt-ins `attn_p2`, `attn_p1`; attn_decode_p2lz_<HD>,
//                    attn_decode_p1lz_<HD> with `attn_lazy` too) attn_decode_pf_<HD> with p in P V
//                    as its first two bf16 pieces / one bf16 (as attn_tc_<HD>) instead of three
//                    (with `attn_ve` too: attn_decode_{p2,p1}[lz]ve_<HD>):
//                    2/3 / 1/3 of the P V mma. Not f32-exact: tests/cuda_ops.rs holds them to
//                    attn_tc's propagated bound.
// attn_decode_qk_<HD> (opt-in `attn_fold`, Backend::attn_decode_qk) attn_qk_norm_rope folded into
//                    attn_decode_<HD>: the same grid, taking q_proj's output qg [H, 2 hd] instead
//                    of q. Each block with keys norms and rotates its group's query heads (and,
//                    in the two blocks that use it, its KV head's key) itself, one warp a row,
//                    into shared memory (attn_qk_norm_rope's
//                    arithmetic in its order: the same bits, dec_qk_row says how), reads q from
//                    there and the newest key through a pointer to it; the blocks of split 0
//                    write the gate halves for the combine. The angles and norm weights come
//                    before the PDL wait. One launch boundary (~5 µs in place) fewer per layer;
//                    k (the input) is left as it was, un-normed.

// Launched with 128 threads (mod.rs), hd <= 256: a thread owns elements tid and tid + 128
// (QNR_PER of them, loads unrolled: with a stride read from blockDim the loops made dependent
// round trips). What never depends on the previous kernel comes before the PDL wait: the norm
// weight (read after the block's sum, it would add a DRAM round trip to the step's critical
// path) and the RoPE angles (f64 pow, sin and cos of the step's position, constant during a
// replayed step: the previous step wrote it before this step's graph started).
#define QNR_T 128
#define QNR_PER 2
extern "C" __global__ void __launch_bounds__(QNR_T)
attn_qk_norm_rope(const u16* __restrict__ qg, u16* __restrict__ k, const float* __restrict__ qn,
                  const float* __restrict__ kn, u16* __restrict__ q, u16* __restrict__ gate, int H, int KV, int hd,
                  int rot, double theta, int pos0, float eps, const int* __restrict__ posp) {
    KTRACE();
    extern __shared__ float y[];
    __shared__ float sh[32];
    const int t = blockIdx.x, hh = blockIdx.y, tid = threadIdx.x;
    const float* w = hh < H ? qn : kn;
    float wv[QNR_PER];
#pragma unroll
    for (int j = 0; j < QNR_PER; j++) wv[j] = tid + QNR_T * j < hd ? w[tid + QNR_T * j] : 0.0f;
    const int half = rot / 2;
    float rs = 0.0f, rc = 1.0f;  // sin, cos of pair tid (tid < half)
    if (tid < half) {
        const double pos = (double)((posp ? posp[0] : pos0) + t);
        const double inv = pow(theta, -(2.0 * (double)tid) / (double)rot);
        const double ang = pos * inv;
        rs = (float)sin(ang);
        rc = (float)cos(ang);
    }
    PDL_ENTRY();
    const u16* src;
    u16* dst;
    if (hh < H) {
        src = qg + ((u64)t * H + hh) * 2 * hd;
        dst = q + ((u64)t * H + hh) * hd;
        u16* g = gate + ((u64)t * H + hh) * hd;
#pragma unroll
        for (int j = 0; j < QNR_PER; j++)
            if (tid + QNR_T * j < hd) g[tid + QNR_T * j] = src[hd + tid + QNR_T * j];  // bf16 to bf16: a copy
    } else {
        src = k + ((u64)t * KV + (hh - H)) * hd;
        dst = (u16*)src;
    }
    float v[QNR_PER];
#pragma unroll
    for (int j = 0; j < QNR_PER; j++) v[j] = tid + QNR_T * j < hd ? bf16f(src[tid + QNR_T * j]) : 0.0f;
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < QNR_PER; j++)
        if (tid + QNR_T * j < hd) {
            y[tid + QNR_T * j] = v[j];
            ss += v[j] * v[j];
        }
    ss = block_sum(ss, sh);  // its barriers also order the y[] writes above
    const float r = 1.0f / sqrtf(ss / (float)hd + eps);
#pragma unroll
    for (int j = 0; j < QNR_PER; j++)
        if (tid + QNR_T * j < hd) y[tid + QNR_T * j] = y[tid + QNR_T * j] * r * wv[j];
    __syncthreads();
    if (tid < half) {
        const float a = y[tid], b = y[tid + half];
        y[tid] = a * rc - b * rs;
        y[tid + half] = a * rs + b * rc;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < QNR_PER; j++)
        if (tid + QNR_T * j < hd) dst[tid + QNR_T * j] = bf16_rn(y[tid + QNR_T * j]);
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
          const u16* __restrict__ vc, u16* __restrict__ out, int H, int KV, int hd, int pos0, float scale) { KTRACE(); PDL_ENTRY();
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
          int kvd, int rows, int pos0, const int* __restrict__ posp) { KTRACE(); PDL_ENTRY();
    // Element i .. i+3 of the rows (kvd % 4 == 0: the four stay in one row, and the 8-byte loads
    // and stores at i and at (p0 * kvd + i) bf16 are aligned).
    const u64 i = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (i >= (u64)rows * kvd) return;
    const u64 at = (u64)(posp ? posp[0] : pos0) * kvd + i;
    *(uint2*)(kc + at) = *(const uint2*)(k + i);
    *(uint2*)(vc + at) = *(const uint2*)(v + i);
}

// ---- decode attention (attn_decode_<HD> + attn_decode_combine)
//
// Warp-level flash decoding on tensor cores, with no shared memory in the key loop: every warp of
// every block is an independent online-softmax worker over chunks of DEC_KEYS keys, holding the
// bf16 fragments of its group's (up to) 8 query heads in registers and loading K and V straight
// from the cache into mma fragments (16-byte loads). Dims and keys are summed over, so each may be
// permuted freely as long as both operands of a product use the same permutation; the fragments
// below are laid out so that each lane's share of a K or V row is whole 16-byte pieces.
//
// Lane l, g = l / 4, t = l % 4 (mma.cuh's fragment names). Chunk c covers keys j0 = 8c .. 8c + 7.
// * S^T = K Q^T (m16n8k16; rows = the 8 keys, rows 8..15 zero; cols = the 8 head slots; k = dims):
//   lane (g, t) loads K[key j0 + g][32a + 8t .. + 8) and Q[head slot g][32a + 8t .. + 8) for
//   a < HD / 32. Words 0, 1 of a piece are the A/B registers {k 2t..2t+1}, {k 2t+8..2t+9} of
//   k-step 2a, words 2, 3 those of k-step 2a + 1: each k-step pairs dims 32a + 8t + w of k and q
//   for the same w, a permutation of the dims. Q is the B operand, so no register is spent on
//   the zero rows of a 16-row operand but for the transient A quads of K. Lane (g, t) gets
//   S[key j0 + g][heads 2t, 2t + 1]: the softmax max of a head is over the 8 lanes of one t.
// * P^T: p (f32) at {heads 2t, 2t + 1} of key g, packed as bf16x2, is the row fragment of an
//   8x8 matrix [key][head]; movmatrix.trans turns it into {head g: keys 2t, 2t + 1}, the B
//   register of m16n8k8 with k = keys.
// * O^T += V^T P^T (m16n8k8; rows = dims, cols = head slots, k = keys): lane (g, t) loads
//   V[key j0 + 2t + e][64c + 8g .. + 8) for e < 2, c < HD / 64; word w of the two keys' pieces,
//   byte-permuted into {key 2t, key 2t + 1} pairs, is the A register of dim row g (low halves, dim
//   64c + 8g + 2w) and of dim row g + 8 (high halves, dim + 1) of m-tile i = 4c + w. So lane
//   (g, t) accumulates o[i] = {(head 2t, d), (2t + 1, d), (2t, d + 1), (2t + 1, d + 1)},
//   d = 64c + 8g + 2w: its own two heads, so the rescale needs no shuffle.
// * f32 accuracy, as the CPU's f32 (the tests hold it to F32_TOL): q.k products of bf16 are exact
//   in the f32 accumulators; p is split exactly into three bf16 (p = hi + mid + lo: each
//   remainder is exact in f32 and the last has at most 8 significant bits), so the three P V
//   mma sum exact products too; only the accumulation order differs from the CPU's.
// * Pipelining: the next chunk's K is requested as soon as this chunk's S is computed, its V as
//   soon as this chunk's P V is, so each warp has about one chunk (8 KiB at HD = 256) in flight
//   while it computes, in the registers that held the last one. 8 warps a block and one block
//   per SM (218 registers a thread at HD = 256, no spills): 64 KiB of loads in flight per SM,
//   about twice what the H200's bandwidth-latency product asks for (4.3 TB/s x ~0.8 us / 132
//   SMs = 26 KB), without shared-memory staging, barriers or cp.async in the loop.
// * The newest key (position pos = *posp) is this step's k, v (the inputs), never the cache: the
//   block (KV head, group 0, split 0) copies them into cache row pos, and no block reads that row
//   from the cache in this launch, so there is no race (kv_append stays for prefill).

#define DEC_W 8     // warps per block (ATT_DEC_WARPS in mod.rs)
#define DEC_KEYS 8  // keys per chunk, a warp's step (ATT_DEC_KEYS in mod.rs)

// d += a (16x8 bf16, row: {row g, k 2t..2t+1}, {row g+8, same k}) * b (8x8 bf16, col:
// {k 2t..2t+1, n g}) + d, f32 accumulators.
__device__ __forceinline__ void mma_bf16_1688(float* d, u32 a0, u32 a1, u32 b0) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(b0));
}

// The 8x8 b16 matrix of a warp's fragments (lane l: row l / 4, columns 2 (l % 4), + 1), transposed.
__device__ __forceinline__ u32 movmatrix_trans(u32 x) {
    u32 r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}

__device__ __forceinline__ u32 u4_word(const uint4& u, int w) { return w == 0 ? u.x : w == 1 ? u.y : w == 2 ? u.z : u.w; }

// Blocks of a decode launch (ns splits per head group) that hold keys when n keys are visible:
// chunks spread evenly, at least DEC_W chunks a block (one per warp) so that a short context is
// not cut into more partial states than it has chunks. attn_decode_combine recomputes it.
__device__ __forceinline__ int dec_blocks(int n, int ns) {
    const int chunks = (n + DEC_KEYS - 1) / DEC_KEYS;
    return min(ns, (chunks + DEC_W - 1) / DEC_W);
}

// Block s's share [c0, c1) of the n keys' chunks when nb blocks hold keys (dec_blocks): the one
// formula for the key loop and for attn_decode_early's first chunk, which must be the loop's.
__device__ __forceinline__ void dec_share(int s, int n, int nb, int& c0, int& c1) {
    const int chunks = (n + DEC_KEYS - 1) / DEC_KEYS;
    c0 = (int)((long long)s * chunks / nb);
    c1 = (int)((long long)(s + 1) * chunks / nb);
}

// Whether chunk c's keys are all older than pos: rows the launches of earlier steps wrote (this
// launch writes only row pos), so they may be requested before the PDL wait (the early forms'
// first chunk) or into the L2 ahead of the loop (attn_pf), and never lie past the cache.
// (A macro: as an inline function it changed attn_decode_early_<HD>'s SASS, kept byte-identical
// to the kernel stop 58's tests ran.)
#define DEC_OLD(c, pos) ((c) * DEC_KEYS + DEC_KEYS - 1 < (pos))

template <int HD>
__device__ __forceinline__ void dec_load_k(uint4 (&kr)[HD / 32], const u16* __restrict__ kc, const u16* __restrict__ kin,
                                           u64 kvd, int kvh, int c, int pos, int lane) {
    const int j = c * DEC_KEYS + (lane >> 2);
    const u16* p = (j == pos ? kin : kc + (u64)j * kvd + (u64)kvh * HD) + 8 * (lane & 3);
#pragma unroll
    for (int a = 0; a < HD / 32; a++) kr[a] = j <= pos ? *(const uint4*)(p + 32 * a) : make_uint4(0u, 0u, 0u, 0u);
}

// attn_decode_qk_<HD>: the newest key is in shared memory (kt), normed there. The loads above
// then take kin = cache row pos (global, its value stale or being written by the writer block:
// read, never used), and only the chunk that holds pos, a warp-uniform test, has that key
// replaced from kt. (A
// pointer that may be shared or global made every K load of the loop a generic ld.v4 instead of
// ld.global.nc.v4; a per-piece select between the two loads added ~80 instructions, branches, to
// every chunk of the loop; forcing __ldg here added ~60 and changed the plain kernel's loop too.
// As it is, the key loop is 415 instructions at HD 256 against the plain kernel's 401, with
// ld.global.v4 (not .nc: kin now derives from the cache, which the launch writes): scripts/sass.)
template <int HD>
__device__ __forceinline__ void dec_patch_k(uint4 (&kr)[HD / 32], const u16* kt, int c, int pos, int lane) {
    if (c * DEC_KEYS + (lane >> 2) == pos) {
#pragma unroll
        for (int a = 0; a < HD / 32; a++) kr[a] = *(const uint4*)(kt + 8 * (lane & 3) + 32 * a);
    }
}

template <int HD>
__device__ __forceinline__ void dec_load_v(uint4 (&vr)[2][HD / 64], const u16* __restrict__ vc, const u16* __restrict__ vin,
                                           u64 kvd, int kvh, int c, int pos, int lane) {
#pragma unroll
    for (int e = 0; e < 2; e++) {
        const int j = c * DEC_KEYS + 2 * (lane & 3) + e;
        const u16* p = (j == pos ? vin : vc + (u64)j * kvd + (u64)kvh * HD) + 8 * (lane >> 2);
#pragma unroll
        for (int cc = 0; cc < HD / 64; cc++) vr[e][cc] = j <= pos ? *(const uint4*)(p + 64 * cc) : make_uint4(0u, 0u, 0u, 0u);
    }
}

// Block (x, s) of grid (KV * HG, ns), HG = ceil(G / 8) groups of at most 8 query heads per KV
// head (x = kvh * HG + hg). Of the n = pos + 1 keys' chunks the block takes its even share
// [c0, c1) (dec_blocks; blocks past them return at once, before any barrier), warp w the chunks
// c0 + w, c0 + w + 8, ... . The 8 warps' states are merged through shared memory into one partial
// state per block: pml[x][s][h] = (max, normaliser) for its 8 head slots and part[x][s] the
// unnormalised output in fragment order (element k * 32 + lane holds o[k / 4][k % 4] of lane).
// attn_decode_qk_<HD>'s extra inputs (QK = true): the query|gate projection instead of q, the
// norm weights [HD] f32, the gate output, the RoPE's rotated dims, base and the norm's eps.
struct DecQk {
    const float* qn;
    const float* kn;
    u16* gate;
    int rot;
    double theta;
    float eps;
};

// attn_qk_norm_rope's function for one decode row, inside attn_decode_qk_<HD> (QK = true): rows
// r = warp, warp + 8, ... of the block's gh query heads and its KV head's key (row gh), one warp a
// row, lane l holding dims l + 32j. The arithmetic is attn_qk_norm_rope's, in its order: that
// kernel's 128 threads hold dims i and i + 128 and sum their squares in that order; its
// block_sum is the four warps' warp_sum (S0..S3) then (S0 + S2) + (S1 + S3). Lane l here sums
// the same pairs for "thread" l + 32w (w < 4), warp_sum's each (the same butterfly), and adds
// them in that order, so x, r, the rotation and the bf16 results are the same bits. The RoPE
// pairs go through the warp's f32 row in shared memory (a pair can span lanes). The angles (f64,
// as the CPU) and the norm weights come before the PDL wait: they never depend on the kernel
// before (the position was written by the previous step, before this step's graph started).
template <int HD>
struct DecQkPre {
    static constexpr int NJ = HD / 32;             // dims per lane
    static constexpr int NP = (HD / 2 + 31) / 32;  // RoPE pairs per lane at most
    float qw[NJ], kw[NJ], rs[NP], rc[NP];
};

template <int HD>
__device__ __forceinline__ void dec_qk_pre(const DecQk& f, int pos, int lane, DecQkPre<HD>& pre) {
#pragma unroll
    for (int j = 0; j < DecQkPre<HD>::NJ; j++) {
        pre.qw[j] = f.qn[lane + 32 * j];
        pre.kw[j] = f.kn[lane + 32 * j];
    }
    const int half = f.rot / 2;
#pragma unroll
    for (int p = 0; p < DecQkPre<HD>::NP; p++) {
        const int i = lane + 32 * p;
        pre.rs[p] = 0.0f;
        pre.rc[p] = 1.0f;
        if (i < half) {
            const double inv = pow(f.theta, -(2.0 * (double)i) / (double)f.rot);
            const double ang = (double)pos * inv;
            pre.rs[p] = (float)sin(ang);
            pre.rc[p] = (float)cos(ang);
        }
    }
}

// One row: src (bf16 [HD]) normed by w, rotated, rounded to bf16 into dst; ys: the warp's f32 row.
template <int HD>
__device__ __forceinline__ void dec_qk_row(const u16* __restrict__ src, const float (&w)[HD / 32], const DecQkPre<HD>& pre,
                                           const DecQk& f, float* ys, u16* dst, int lane) {
    constexpr int NJ = HD / 32;
    float v[NJ];
#pragma unroll
    for (int j = 0; j < NJ; j++) v[j] = bf16f(src[lane + 32 * j]);
    float S[4];
#pragma unroll
    for (int w4 = 0; w4 < 4; w4++) {
        float ss = 0.0f;
#pragma unroll
        for (int jj = 0; jj < 2; jj++)
            if (w4 + 4 * jj < NJ) ss += v[w4 + 4 * jj] * v[w4 + 4 * jj];
        S[w4] = w4 < NJ ? warp_sum(ss) : 0.0f;
    }
    const float ss = (S[0] + S[2]) + (S[1] + S[3]);
    const float r = 1.0f / sqrtf(ss / (float)HD + f.eps);
#pragma unroll
    for (int j = 0; j < NJ; j++) ys[lane + 32 * j] = v[j] * r * w[j];
    __syncwarp();
    const int half = f.rot / 2;
#pragma unroll
    for (int p = 0; p < DecQkPre<HD>::NP; p++) {
        const int i = lane + 32 * p;
        if (i < half) {
            const float a = ys[i], b = ys[i + half];
            ys[i] = a * pre.rc[p] - b * pre.rs[p];
            ys[i + half] = a * pre.rs[p] + b * pre.rc[p];
        }
    }
    __syncwarp();
#pragma unroll
    for (int j = 0; j < NJ; j++) dst[lane + 32 * j] = bf16_rn(ys[lane + 32 * j]);
}

// The forms of attn_decode_body: the plain kernel (DEC_PLAIN, the ablation of switch
// `attn_early`), that kernel with each warp's first chunk requested before the PDL wait
// (DEC_EARLY, the ablation of `attn_pf`), and DEC_PF below (the default).
// Stop 57 also measured a cluster form (attn_decode_combine folded into the launch: clusters of
// 8 or 4 merging over DSMEM, the last block of a head group merging the clusters'): slower at
// every length on the H100 (4K 0.966x, 32K 0.961x, 128K 0.961x; alone 17.8 against 12.5 us at
// 4,096 keys: its tail's barriers, ticket and one-block merge cost more than the combine's
// launch), so it was removed (git history: 63f38fc); so was `attn_l2` (the early form plus a
// bulk L2 prefetch of the warp's next two chunks before the wait: 1.000x at 4K, 0.993x at
// 128K; git history: 1461d76).
// DEC_PF (attn_decode_pf_<HD>, switch `attn_pf`: written at stop 58, the default since stop 59
// for its 1.014x at 128K in place, though alone it is 1.7 µs slower there): DEC_EARLY plus, in
// the key loop, the warp's chunk two steps ahead (c + 2·DEC_W) requested into the L2
// (dec_prefetch: no registers),
// so that the register loads of the next chunk hit the L2. Why: stop 58's trace puts the
// attention's read at 2.66 TB/s in place at 128K against 3.09 alone; with one chunk a warp in
// registers (64 KiB an SM) the read sits at the knee of Little's law (132 SMs x ~58 KiB in
// flight / 3.1 TB/s = ~2.5 µs of latency tolerated), so any latency added in place (other
// traffic, page walks) costs bandwidth. The prefetch doubles the DRAM bytes in flight without a
// register or a shared-memory pass (attn_ring's cost, stop 56). The same partial states: bit-equal.
// PS (the bf16 pieces of p in P V, 3 unless an opt-in asks fewer): stop 59's kv_read kv_work rows
// put a chain of 150 dependent FMAs a chunk between the loads at 101.6 µs for 128K keys' 268 MB,
// against 86.1 with none (one chunk a warp in flight: the warp computes instead of waiting on
// a load); P V's three passes are 48 of the chunk's 64 mma.
// VE (opt-in `attn_ve`): the next chunk's V requested with its K (dec_chunk says why).
// LAZY (opt-in `attn_lazy`): the rescale of o (64 FMUL a chunk at HD 256, 70 of the key loop's
// 423 instructions) only in chunks where a lane's factor is not exactly 1.
#define DEC_PLAIN 0
#define DEC_EARLY 1
#define DEC_PF 2

// DEC_PF: chunk c's K and V rows of KV head kvh requested into the L2 (prefetch.global.L2),
// lane l the 128-byte line l % LPR of row l / LPR (LPR = HD / 64 lines a row; 8 · LPR lanes: all
// 32 at HD 256). Called only for chunks DEC_OLD says are older than pos.
template <int HD>
__device__ __forceinline__ void dec_prefetch(const u16* __restrict__ kc, const u16* __restrict__ vc, u64 kvd, int kvh,
                                             int c, int lane) {
    constexpr int LPR = HD / 64;
    if (lane < DEC_KEYS * LPR) {
        const u64 off = (u64)(c * DEC_KEYS + lane / LPR) * kvd + (u64)kvh * HD + 64 * (lane % LPR);
        asm volatile("prefetch.global.L2 [%0];" ::"l"(kc + off));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(vc + off));
    }
}

// One chunk c of a warp's key loop (attn_decode_body): S^T = K Q^T, the online softmax, O^T +=
// V^T P^T, with the next chunk cn = c + DEC_W requested as the registers free up: its K into kr
// once S is computed, its V into vn after P V (vn is vr: one buffer) or, with VE (opt-in
// `attn_ve`), into the other buffer vn together with K, so that V's round trip overlaps P V too.
template <int HD, bool QK, int MODE, int PS, bool LAZY, bool VE>
__device__ __forceinline__ void dec_chunk(int c, int c1, uint4 (&kr)[HD / 32], const uint4 (&vr)[2][HD / 64],
                                          uint4 (&vn)[2][HD / 64], const uint4 (&qf)[HD / 32], float (&o)[HD / 16][4],
                                          float& m0, float& m1, float& l0, float& l1, const u16* __restrict__ kc,
                                          const u16* __restrict__ vc, const u16* kin, const u16* __restrict__ vin,
                                          const u16* kt, u64 kvd, int kvh, int pos, int lane, float scale) {
    constexpr int NA = HD / 32, NT = HD / 16;
    const int g = lane >> 2;
    const int cn = c + DEC_W;
    if constexpr (MODE == DEC_PF) {
        const int cp = c + 2 * DEC_W;
        if (cp < c1 && DEC_OLD(cp, pos)) dec_prefetch<HD>(kc, vc, kvd, kvh, cp, lane);
    }
    // S^T = K Q^T: two accumulator chains (even and odd k-steps) halve the dependent mma latency.
    float s0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int a = 0; a < NA; a++) {
        const u32 ka[4] = {kr[a].x, 0u, kr[a].y, 0u}, kb[4] = {kr[a].z, 0u, kr[a].w, 0u};
        mma_bf16_16816(s0, ka, qf[a].x, qf[a].y);
        mma_bf16_16816(s1, kb, qf[a].z, qf[a].w);
    }
    if (cn < c1) {
        dec_load_k<HD>(kr, kc, kin, kvd, kvh, cn, pos, lane);
        if (QK && cn == pos / DEC_KEYS) dec_patch_k<HD>(kr, kt, cn, pos, lane);
        if constexpr (VE) dec_load_v<HD>(vn, vc, vin, kvd, kvh, cn, pos, lane);
    }
    // Online softmax of heads 2t, 2t + 1 over key j (masked past pos); the max over the chunk's
    // 8 keys is over the 8 lanes of the same t. Key j0 <= pos is in every chunk, so the max is
    // finite after the first.
    const bool live = c * DEC_KEYS + g <= pos;
    const float x0 = live ? (s0[0] + s1[0]) * scale : NEG_INF;
    const float x1 = live ? (s0[1] + s1[1]) * scale : NEG_INF;
    float mx0 = x0, mx1 = x1;
#pragma unroll
    for (int sh = 4; sh < 32; sh <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, sh));
        mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, sh));
    }
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float al0 = expf(m0 - mn0), al1 = expf(m1 - mn1);  // 0 on the first chunk (m = -inf)
    const float p0 = expf(x0 - mn0), p1 = expf(x1 - mn1);
    l0 = l0 * al0 + p0;
    l1 = l1 * al1 + p1;
    m0 = mn0;
    m1 = mn1;
    // p = hi + mid + lo exactly (three bf16x2 of {head 2t, head 2t + 1} at key g), each
    // transposed to the B fragment {head g: keys 2t, 2t + 1} of P^T.
    // PS < 3 (opt-ins attn_p2, attn_p1): only the first PS pieces (the rest of p dropped).
    const u32 ph = pack_bf16x2(p0, p1);
    const float r0 = p0 - bf16_lo(ph), r1 = p1 - bf16_hi(ph);
    const u32 pm = PS >= 2 ? pack_bf16x2(r0, r1) : 0u;
    const u32 pl = PS >= 3 ? pack_bf16x2(r0 - bf16_lo(pm), r1 - bf16_hi(pm)) : 0u;
    const u32 bh = movmatrix_trans(ph), bm = PS >= 2 ? movmatrix_trans(pm) : 0u, bl = PS >= 3 ? movmatrix_trans(pl) : 0u;
    if constexpr (LAZY) {
        // The rescale only when a lane's factor is not exactly 1 (its max moved): o * 1 is o,
        // so skipping it keeps the bits. Warp-uniform (a vote), so it is a branch, not 64
        // predicated multiplies; after the first chunks the max rarely moves.
        if (__any_sync(FULL_MASK, al0 != 1.0f || al1 != 1.0f)) {
#pragma unroll
            for (int i = 0; i < NT; i++) {
                o[i][0] *= al0;
                o[i][1] *= al1;
                o[i][2] *= al0;
                o[i][3] *= al1;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < NT; i++) {
        const u32 vx = u4_word(vr[0][i >> 2], i & 3), vy = u4_word(vr[1][i >> 2], i & 3);
        const u32 lo = __byte_perm(vx, vy, 0x5410), hi = __byte_perm(vx, vy, 0x7632);  // dim rows g, g + 8
        if constexpr (!LAZY) {
            o[i][0] *= al0;
            o[i][1] *= al1;
            o[i][2] *= al0;
            o[i][3] *= al1;
        }
        mma_bf16_1688(o[i], lo, hi, bh);
        if constexpr (PS >= 2) mma_bf16_1688(o[i], lo, hi, bm);
        if constexpr (PS >= 3) mma_bf16_1688(o[i], lo, hi, bl);
    }
    if (!VE && cn < c1) dec_load_v<HD>(vn, vc, vin, kvd, kvh, cn, pos, lane);
}

template <int HD, bool QK, int MODE = DEC_PLAIN, int PS = 3, bool LAZY = false, bool VE = false>
__device__ __forceinline__ void attn_decode_body(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                                                 u16* __restrict__ kc, u16* __restrict__ vc, float* __restrict__ part,
                                                 float* __restrict__ pml, int H, int KV, const int* __restrict__ posp, float scale,
                                                 const DecQk& f) {
    constexpr int NA = HD / 32;  // 16-byte pieces of a K row per lane (two k-steps each)
    constexpr int NC = HD / 64;  // 16-byte pieces of a V row per lane and key
    constexpr int NT = HD / 16;  // m-tiles (16 dims) of the output
    static_assert(!(QK && MODE != DEC_PLAIN), "the early forms take q (no attn_fold)");
    extern __shared__ __align__(16) float dec_o[];  // [DEC_W][NT * 4][32]: the warps' o fragments
    __shared__ float sm[DEC_W][8], sl[DEC_W][8], sf[DEC_W][8];
    const int G = H / KV, HG = (G + 7) / 8;
    const int x = blockIdx.x, kvh = x / HG, hg = x - kvh * HG, s = blockIdx.y, ns = gridDim.y;
    const int gh = min(8, G - 8 * hg);  // query heads in this block's group
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const u64 kvd = (u64)KV * HD;
    const u16* kin = k + (u64)kvh * HD;
    const u16* vin = v + (u64)kvh * HD;
    // QK: this block's normed, rotated query heads and key (attn_qk_norm_rope's outputs), in
    // shared memory: q is read from here, and the newest key through a generic pointer to kt.
    __shared__ __align__(16) u16 qt[QK ? 8 : 1][QK ? HD : 8];
    __shared__ __align__(16) u16 kt[QK ? HD : 8];
    __shared__ float ys[QK ? DEC_W : 1][QK ? HD : 1];
    int pos;
    if constexpr (QK) {
        pos = posp[0];
        DecQkPre<HD> pre;
        dec_qk_pre<HD>(f, pos, lane, pre);
        PDL_ENTRY();
        // Blocks past the keys' share (dec_blocks) skip it all: they return below. The key's row
        // is needed only by the block that writes it to the cache (split 0 of group 0) and by the
        // one whose chunks reach pos (the last with keys); the others leave it out, so that none of
        // their warps has two rows (8 query heads a group in the model).
        const int nbk = dec_blocks(pos + 1, ns);
        const bool needk = (s == 0 && hg == 0) || s == nbk - 1;
        for (int r = warp; s < nbk && r < gh + (needk ? 1 : 0); r += DEC_W) {
            const bool isk = r == gh;
            const u16* src = isk ? kin : q + (u64)(kvh * G + 8 * hg + r) * 2 * HD;
            float w[HD / 32];  // selected value by value: a selected array would live in local memory
#pragma unroll
            for (int j = 0; j < HD / 32; j++) w[j] = isk ? pre.kw[j] : pre.qw[j];
            dec_qk_row<HD>(src, w, pre, f, ys[warp], isk ? kt : qt[r], lane);
            if (!isk && s == 0) {
                // The gate half of the head, for attn_decode_combine (a copy, as attn_qk_norm_rope).
                u16* gd = f.gate + (u64)(kvh * G + 8 * hg + r) * HD;
#pragma unroll
                for (int j = 0; j < HD / 32; j++) gd[lane + 32 * j] = src[HD + lane + 32 * j];
            }
        }
        __syncthreads();
        kin = kc + (u64)pos * kvd + (u64)kvh * HD;  // cache row pos, replaced by dec_patch_k
    } else if constexpr (MODE == DEC_PLAIN) {
        PDL_ENTRY();
        pos = posp[0];
    } else {
        // The early forms: the position is the step's (written before the step's
        // graph began, as attn_decode_combine reads it), so the block knows its share before
        // the wait, and the warp's first chunk, when every key of it is older than pos (rows
        // the launches of earlier steps wrote; this launch writes only row pos), is requested
        // while the kernel before still runs: its DRAM latency leaves the critical path. Every
        // writer of those rows has completed by then: the kernel before (attn_qk_norm_rope,
        // or another attn_decode in the lab) waits for its own predecessor before it lets this
        // launch start. A caller that put a kernel launching before its wait (PDL_LAUNCH
        // first) right before this one would have to keep that true.
        pos = posp[0];
    }
    // The early forms' first chunk (moved into kr, vr below; a separate array so that the plain
    // and attn_fold kernels' code stays as it was).
    constexpr int EA = MODE != DEC_PLAIN ? NA : 1, EC = MODE != DEC_PLAIN ? NC : 1;
    uint4 ekr[EA], evr[2][EC];
    bool early = false;  // the warp's first chunk is in ekr, evr
    if constexpr (MODE != DEC_PLAIN) {
        const int nb0 = dec_blocks(pos + 1, ns);
        if (s < nb0) {
            int e0, e1;
            dec_share(s, pos + 1, nb0, e0, e1);
            const int c = e0 + warp;
            if (c < e1 && DEC_OLD(c, pos)) {
                dec_load_k<HD>(ekr, kc, kin, kvd, kvh, c, pos, lane);
                dec_load_v<HD>(evr, vc, vin, kvd, kvh, c, pos, lane);
                early = true;
            }
        }
        PDL_ENTRY();
    }
    const int n = pos + 1;
    if (s == 0 && hg == 0) {
        // This step's k, v of KV head kvh into cache row pos (one block per KV head writes it).
        u16* kd = kc + (u64)pos * kvd + (u64)kvh * HD;
        u16* vd = vc + (u64)pos * kvd + (u64)kvh * HD;
        const u16* ksrc = QK ? (const u16*)kt : kin;  // QK: the normed key (kin is row pos itself)
        for (int i = tid; i < HD / 4; i += blockDim.x) {
            if (i < HD / 8) ((uint4*)kd)[i] = ((const uint4*)ksrc)[i];
            else ((uint4*)vd)[i - HD / 8] = ((const uint4*)vin)[i - HD / 8];
        }
    }
    const int nb = dec_blocks(n, ns);
    if (s >= nb) return;  // no keys here: the whole block leaves before any barrier
    int c0, c1;
    dec_share(s, n, nb, c0, c1);

    // Q fragments of head slot g (zeros past the group's heads), as the K pieces (see above).
    uint4 qf[NA];
    {
        const u16* qp = (QK ? &qt[g < gh ? g : 0][0] : q + (u64)(kvh * G + 8 * hg + g) * HD) + 8 * t;
#pragma unroll
        for (int a = 0; a < NA; a++) qf[a] = g < gh ? *(const uint4*)(qp + 32 * a) : make_uint4(0u, 0u, 0u, 0u);
    }
    float o[NT][4];
#pragma unroll
    for (int i = 0; i < NT; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    // Heads 2t, 2t + 1: running maxima, and this lane's part (its key g) of their normalisers.
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
    uint4 kr[NA], vr[2][NC];
    if constexpr (MODE != DEC_PLAIN) {
        if (early) {
#pragma unroll
            for (int a = 0; a < NA; a++) kr[a] = ekr[a];
#pragma unroll
            for (int e = 0; e < 2; e++)
#pragma unroll
                for (int cc = 0; cc < NC; cc++) vr[e][cc] = evr[e][cc];
        }
    }
    int c = c0 + warp;
    if (c < c1 && !early) {
        dec_load_k<HD>(kr, kc, kin, kvd, kvh, c, pos, lane);
        if (QK && c == pos / DEC_KEYS) dec_patch_k<HD>(kr, kt, c, pos, lane);
        dec_load_v<HD>(vr, vc, vin, kvd, kvh, c, pos, lane);
    }
    if constexpr (VE) {
        // Two buffers of V, their roles swapped chunk by chunk (unrolled by two: a copy between
        // them would wait on the load it copies).
        uint4 vb[2][NC];
        for (; c < c1; c += 2 * DEC_W) {
            dec_chunk<HD, QK, MODE, PS, LAZY, VE>(c, c1, kr, vr, vb, qf, o, m0, m1, l0, l1, kc, vc, kin, vin, kt, kvd, kvh, pos, lane, scale);
            if (c + DEC_W >= c1) break;
            dec_chunk<HD, QK, MODE, PS, LAZY, VE>(c + DEC_W, c1, kr, vb, vr, qf, o, m0, m1, l0, l1, kc, vc, kin, vin, kt, kvd, kvh, pos, lane, scale);
        }
    } else {
        for (; c < c1; c += DEC_W)
            dec_chunk<HD, QK, MODE, PS, LAZY, VE>(c, c1, kr, vr, vr, qf, o, m0, m1, l0, l1, kc, vc, kin, vin, kt, kvd, kvh, pos, lane, scale);
    }
#pragma unroll
    for (int sh = 4; sh < 32; sh <<= 1) {
        l0 += __shfl_xor_sync(FULL_MASK, l0, sh);
        l1 += __shfl_xor_sync(FULL_MASK, l1, sh);
    }

    // Merge the warps (a warp without chunks has l = 0 and o = 0), in a fixed order.
    float* so = dec_o + warp * (NT * 4 * 32);
#pragma unroll
    for (int i = 0; i < NT; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) so[(i * 4 + e) * 32 + lane] = o[i][e];
    if (g == 0) {
        sm[warp][2 * t] = m0;
        sm[warp][2 * t + 1] = m1;
        sl[warp][2 * t] = l0;
        sl[warp][2 * t + 1] = l1;
    }
    __syncthreads();
    if (tid < 8) {
        float M = NEG_INF, L = 0.0f;
#pragma unroll
        for (int w = 0; w < DEC_W; w++)
            if (sl[w][tid] > 0.0f) M = fmaxf(M, sm[w][tid]);
#pragma unroll
        for (int w = 0; w < DEC_W; w++) {
            const float f = sl[w][tid] > 0.0f ? expf(sm[w][tid] - M) : 0.0f;
            sf[w][tid] = f;
            L = fmaf(sl[w][tid], f, L);
        }
        float* pp = pml + ((u64)x * ns + s) * 16 + 2 * tid;
        pp[0] = M;
        pp[1] = L;
    }
    __syncthreads();
    float* po = part + ((u64)x * ns + s) * (8 * HD);
    for (int e = tid; e < 8 * HD; e += blockDim.x) {
        const int hs = 2 * (e & 3) + ((e >> 5) & 1);  // head slot of element e: 2 (lane % 4) + k % 2
        float acc = 0.0f;
#pragma unroll
        for (int w = 0; w < DEC_W; w++) acc = fmaf(dec_o[w * (NT * 4 * 32) + e], sf[w][hs], acc);
        po[e] = acc;
    }
}

#define ATTN_DECODE(HD)                                                                                              \
    extern "C" __global__ void __launch_bounds__(DEC_W * 32, 1)                                                    \
    attn_decode_##HD(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, u16* __restrict__ kc, \
                     u16* __restrict__ vc, float* __restrict__ part, float* __restrict__ pml, int H, int KV,        \
                     const int* __restrict__ posp, float scale) {                                                   \
        KTRACE();                                                                                                    \
        const DecQk none = {nullptr, nullptr, nullptr, 0, 0.0, 0.0f};                                                \
        attn_decode_body<HD, false>(q, k, v, kc, vc, part, pml, H, KV, posp, scale, none);                            \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(DEC_W * 32, 1)                                                    \
    attn_decode_qk_##HD(const u16* __restrict__ qg, const u16* __restrict__ k, const u16* __restrict__ v,            \
                        u16* __restrict__ kc, u16* __restrict__ vc, float* __restrict__ part, float* __restrict__ pml, \
                        int H, int KV, const int* __restrict__ posp, float scale, DecQk f) {                         \
        KTRACE();                                                                                                    \
        attn_decode_body<HD, true>(qg, k, v, kc, vc, part, pml, H, KV, posp, scale, f);                               \
    }
ATTN_DECODE(64)
ATTN_DECODE(128)
ATTN_DECODE(256)

// attn_decode_<NAME>_<HD>, the early forms (attn_decode_<HD>'s arguments and partial states, bit
// for bit): attn_decode_early_<HD> (switch `attn_early`), its first chunk requested before the
// PDL wait; attn_decode_pf_<HD> (switch `attn_pf`, the default), that kernel with the L2 prefetch
// two chunks ahead in the key loop (DEC_PF above); attn_decode_{lz,ve,lzve}_<HD> (opt-ins
// `attn_lazy`, `attn_ve`), that kernel with the rescale skipped when it would multiply by 1
// (LAZY) and / or the next V requested with its K (VE). And those of PS < 3 (not bit-equal: p in
// P V as fewer bf16 pieces): attn_decode_{p2,p1}[lz][ve]_<HD> (opt-ins `attn_p2`, `attn_p1`).
#define ATTN_DECODE_FORM(NAME, MODE, PS, LAZY, VE, HD)                                                                       \
    extern "C" __global__ void __launch_bounds__(DEC_W * 32, 1)                                                    \
    attn_decode_##NAME##_##HD(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,       \
                              u16* __restrict__ kc, u16* __restrict__ vc, float* __restrict__ part,                  \
                              float* __restrict__ pml, int H, int KV, const int* __restrict__ posp, float scale) {   \
        KTRACE();                                                                                                    \
        const DecQk none = {nullptr, nullptr, nullptr, 0, 0.0, 0.0f};                                                \
        attn_decode_body<HD, false, MODE, PS, LAZY, VE>(q, k, v, kc, vc, part, pml, H, KV, posp, scale, none);        \
    }
ATTN_DECODE_FORM(early, DEC_EARLY, 3, false, false, 64)
ATTN_DECODE_FORM(early, DEC_EARLY, 3, false, false, 128)
ATTN_DECODE_FORM(early, DEC_EARLY, 3, false, false, 256)
ATTN_DECODE_FORM(pf, DEC_PF, 3, false, false, 64)
ATTN_DECODE_FORM(pf, DEC_PF, 3, false, false, 128)
ATTN_DECODE_FORM(pf, DEC_PF, 3, false, false, 256)
ATTN_DECODE_FORM(ve, DEC_PF, 3, false, true, 64)
ATTN_DECODE_FORM(ve, DEC_PF, 3, false, true, 128)
ATTN_DECODE_FORM(ve, DEC_PF, 3, false, true, 256)
ATTN_DECODE_FORM(lz, DEC_PF, 3, true, false, 64)
ATTN_DECODE_FORM(lz, DEC_PF, 3, true, false, 128)
ATTN_DECODE_FORM(lz, DEC_PF, 3, true, false, 256)
ATTN_DECODE_FORM(lzve, DEC_PF, 3, true, true, 64)
ATTN_DECODE_FORM(lzve, DEC_PF, 3, true, true, 128)
ATTN_DECODE_FORM(lzve, DEC_PF, 3, true, true, 256)
ATTN_DECODE_FORM(p2, DEC_PF, 2, false, false, 64)
ATTN_DECODE_FORM(p2, DEC_PF, 2, false, false, 128)
ATTN_DECODE_FORM(p2, DEC_PF, 2, false, false, 256)
ATTN_DECODE_FORM(p2ve, DEC_PF, 2, false, true, 64)
ATTN_DECODE_FORM(p2ve, DEC_PF, 2, false, true, 128)
ATTN_DECODE_FORM(p2ve, DEC_PF, 2, false, true, 256)
ATTN_DECODE_FORM(p2lz, DEC_PF, 2, true, false, 64)
ATTN_DECODE_FORM(p2lz, DEC_PF, 2, true, false, 128)
ATTN_DECODE_FORM(p2lz, DEC_PF, 2, true, false, 256)
ATTN_DECODE_FORM(p2lzve, DEC_PF, 2, true, true, 64)
ATTN_DECODE_FORM(p2lzve, DEC_PF, 2, true, true, 128)
ATTN_DECODE_FORM(p2lzve, DEC_PF, 2, true, true, 256)
ATTN_DECODE_FORM(p1, DEC_PF, 1, false, false, 64)
ATTN_DECODE_FORM(p1, DEC_PF, 1, false, false, 128)
ATTN_DECODE_FORM(p1, DEC_PF, 1, false, false, 256)
ATTN_DECODE_FORM(p1ve, DEC_PF, 1, false, true, 64)
ATTN_DECODE_FORM(p1ve, DEC_PF, 1, false, true, 128)
ATTN_DECODE_FORM(p1ve, DEC_PF, 1, false, true, 256)
ATTN_DECODE_FORM(p1lz, DEC_PF, 1, true, false, 64)
ATTN_DECODE_FORM(p1lz, DEC_PF, 1, true, false, 128)
ATTN_DECODE_FORM(p1lz, DEC_PF, 1, true, false, 256)
ATTN_DECODE_FORM(p1lzve, DEC_PF, 1, true, true, 64)
ATTN_DECODE_FORM(p1lzve, DEC_PF, 1, true, true, 128)
ATTN_DECODE_FORM(p1lzve, DEC_PF, 1, true, true, 256)

#define CMB_PF 16  // partials per warp attn_decode_combine requests at once (8 warps: 128 splits)
#define CMB_ML 4   // partial states per lane whose max and normaliser are requested at once (128)

// Merges the partial states of the blocks that held keys (dec_blocks), normalises and applies
// the gate. Grid (KV * HG, hd / 4), 256 threads: block (x, k) owns fragment row k (32 elements:
// lane l is o[k / 4][k % 4] of lane l, head slot 2 (l % 4) + k % 2); warp w first computes head
// slot w's factors exp(M_s - M) and normaliser over the partials s, then sums partials s = w,
// w + 8, ... of its element; the 8 warps' sums are added in order. Dynamic shared memory: ns * 8
// floats.
// Latency: every load after the wait is requested at once (the partials, the maxima and
// normalisers, the gate), one L2 round trip before the arithmetic; the position is read before
// the wait (the step's, written before the step began: attn_qk_norm_rope reads it there too).
// With the max and normaliser loads in a strided loop and the gate read at the end, the combine
// was 7.3 us in place at 4K (trace, stop 23): four dependent L2 round trips for ~1 MB of L2.
extern "C" __global__ void __launch_bounds__(256)
attn_decode_combine(const float* __restrict__ part, const float* __restrict__ pml, const u16* __restrict__ gate,
                    u16* __restrict__ out, int H, int KV, int hd, int ns, const int* __restrict__ posp) { KTRACE();
    extern __shared__ float cf[];  // [ns][8]
    __shared__ float cl[8], red[8][32];
    const int G = H / KV, HG = (G + 7) / 8;
    const int x = blockIdx.x, kk = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nb = dec_blocks(posp[0] + 1, ns);
    const int hs = 2 * (lane & 3) + (kk & 1);
    const int kvh = x / HG, hg = x - kvh * HG;
    // Element (k, lane) is dim 64c + 8g + 2w' (+ 1 for k % 4 >= 2) of m-tile i = k / 4 = 4c + w'.
    const int i = kk >> 2, d = 64 * (i >> 2) + 8 * (lane >> 2) + 2 * (i & 3) + ((kk >> 1) & 1);
    const u64 at = (u64)(kvh * G + 8 * hg + hs) * hd + d;
    const bool writes = warp == 0 && hs < min(8, G - 8 * hg);
    PDL_ENTRY();
    // The gate (attn_qk_norm_rope's copy, or attn_decode_qk's: after the wait either way).
    const float gv = writes ? bf16f(gate[at]) : 0.0f;
    const float* pe = part + (u64)x * ns * (8 * hd) + kk * 32 + lane;  // this element of partial 0
    // This warp's elements of partials s = warp + 8r; partials past 8 * CMB_PF (more than 128
    // splits) are read after.
    float pv[CMB_PF];
#pragma unroll
    for (int r = 0; r < CMB_PF; r++) {
        const int s = warp + 8 * r;
        pv[r] = s < nb ? pe[(u64)s * (8 * hd)] : 0.0f;
    }
    {
        // Head slot `warp`'s maximum and normaliser of partials s = lane, lane + 32, ...
        const float* ml = pml + (u64)x * ns * 16 + 2 * warp;
        float mv[CMB_ML], lv[CMB_ML];
#pragma unroll
        for (int j = 0; j < CMB_ML; j++) {
            const int s = lane + 32 * j;
            mv[j] = s < nb ? ml[s * 16] : NEG_INF;
            lv[j] = s < nb ? ml[s * 16 + 1] : 0.0f;
        }
        float M = NEG_INF, L = 0.0f;
#pragma unroll
        for (int j = 0; j < CMB_ML; j++)
            if (lv[j] > 0.0f) M = fmaxf(M, mv[j]);
        for (int s = lane + 32 * CMB_ML; s < nb; s += 32)
            if (ml[s * 16 + 1] > 0.0f) M = fmaxf(M, ml[s * 16]);
        M = warp_max(M);
#pragma unroll
        for (int j = 0; j < CMB_ML; j++) {
            const int s = lane + 32 * j;
            const float f = lv[j] > 0.0f ? expf(mv[j] - M) : 0.0f;
            if (s < nb) cf[s * 8 + warp] = f;
            L = fmaf(lv[j], f, L);
        }
        for (int s = lane + 32 * CMB_ML; s < nb; s += 32) {
            const float ls = ml[s * 16 + 1], f = ls > 0.0f ? expf(ml[s * 16] - M) : 0.0f;
            cf[s * 8 + warp] = f;
            L = fmaf(ls, f, L);
        }
        L = warp_sum(L);
        if (lane == 0) cl[warp] = L;
    }
    __syncthreads();
    TRACE_MARK(1);  // factors and normalisers in shared memory
    float acc = 0.0f;
#pragma unroll
    for (int r = 0; r < CMB_PF; r++) {
        const int s = warp + 8 * r;
        if (s < nb) acc = fmaf(pv[r], cf[s * 8 + hs], acc);
    }
    for (int s = warp + 8 * CMB_PF; s < nb; s += 8) acc = fmaf(pe[(u64)s * (8 * hd)], cf[s * 8 + hs], acc);
    red[warp][lane] = acc;
    __syncthreads();
    TRACE_MARK(2);  // the warps' sums in shared memory
    if (writes) {
        float o = 0.0f;
#pragma unroll
        for (int w = 0; w < 8; w++) o += red[w][lane];
        out[at] = bf16_rn(o / cl[hs] * sigmoid_f(gv));
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
                 int rows, int pos0, float scale) { KTRACE(); PDL_ENTRY();                                                    \
        attn_tc_body<HD>(q, gate, kc, vc, out, H, KV, rows, pos0, scale);                                        \
    }
ATTN_TC(64)
ATTN_TC(128)
ATTN_TC(256)
