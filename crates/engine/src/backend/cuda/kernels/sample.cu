// sample.cu: picking the next token on the device.
//
// argmax_partial + argmax_step  the decode loop's greedy pick, fed back on the device: logits
//         [vocab] -> the Step (u32 token, i32 position): token = argmax, position += 1
//         (Cpu::argmax_step). One block reading 1 MB of logits took ~90 us, so the row is split:
//         argmax_partial (grid P, 256 threads) writes each contiguous slice's best (value, index),
//         argmax_step (one block of 1024 threads, P <= 1024) reduces them and writes the step.
//         Ties go to the lower index at both levels, so the pick is the first maximum's.
//
// sample_topk_partial + sample_topk_finish  Backend::sample_step: the sampled pick with exactly
//         the steps of runtime/sampler.rs (`Sampler::sample_split`) for top-k of 1..=SMP_KMAX
//         (greedy included, as k = 1 with the greedy flag), fed back on the device like the arg-max.
//         * sample_topk_partial (grid P = ceil(vocab / SMP_SLICE), SMP_THREADS = 256 threads,
//           SMP_PER = 8 logits a thread: 122 blocks at vocab 248,320, one wave on the H200's 132
//           SMs, so the 1 MB read is spread over the GPU): each block takes a contiguous slice of
//           SMP_SLICE = 2048 logits into registers, applies the penalties (step 1-2, `penalise`,
//           from the u32 counts [vocab]: generated count | SMP_SEEN when the token is in the
//           prompt), packs each as a 64-bit candidate (order key of the logit << 32 | ~id:
//           ordering candidates descending is (logit desc, id asc), the sampler's top-k order;
//           0 = none: NaN, and -inf, whose weight is 0 anyway) and writes its best `kc`
//           candidates, sorted, to cands [P, kc]. No sort of the slice: `block_topk`, a radix
//           select over the candidates' bits (shared-memory histograms of 8 bits a pass, usually
//           1-2 passes) down to <= SEL_CAP candidates, ranked by counting. The global top-k is
//           within the union of the slices' top-k.
//         * sample_topk_finish (one block of FIN_THREADS = 1024, FIN_PER = 8 candidates a thread:
//           P·k <= 8192): the same select keeps the best k of the P·kc candidates, and runs
//           steps 3-8 on them: greedy / non-finite best -> arg-max, no draw; else weights by
//           exp_weight (bit for bit the CPU's: IEEE + * / with no contraction), top-p in (weight
//           desc, id asc) order, min-p, and the draw in id order from the xoshiro256++ state rng
//           [4 u64] (one u64 per draw). The f64 sums run sequentially in the CPU's order (k <= 64
//           values), so with the same seed the device draws the CPU's tokens. Writes step =
//           (token, pos + 1) and counts[token] += 1 (when counts are kept), so a recorded step
//           (CUDA graph) replays with no host input.
//         A full-vocabulary path (top-k off, or k above SMP_KMAX) is not here yet: the backend
//         then declines and the host samples (Cuda::new_sampler).
// sample_count  counts[token] += 1 for a token the sampler did not draw (a forced token).
// mask_logits   constrained decoding (Backend::mask_logits, runtime/constrain.rs apply_mask):
//         logits[i] = -inf where bit i of the allowed words is clear (bit i of word i / 32, LSB
//         first: llguidance's mask), ids past the words disallowed. Grid ceil(vocab / 256), 256
//         threads, one logit each (1 MB read, ~31 KB of words: a few µs before the pick).
// logprobs_finish  (one block of FIN_THREADS) with sample_topk_partial in log-probability mode
//         (lp = 1: raw logits, -inf kept, each block's max and sum of exp in f64): the chosen token's log-probability and
//         the n most likely (id, logprob), as generate.rs's `top_logprobs` on the host.

#define SMP_THREADS 256
#define SMP_PER 8
#define SMP_SLICE (SMP_THREADS * SMP_PER)
#define FIN_THREADS 1024
#define FIN_PER 8
#define SMP_KMAX 64
#define SEL_CAP 256
#define SMP_SEEN 0x80000000u
#define NEG_INF_F64 __longlong_as_double(0xfff0000000000000ll)

// Order key of a float: unsigned order of keys = numeric order of floats (callers drop NaN).
__device__ __forceinline__ u32 f2key(float f) {
    u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key2f(u32 k) { return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k); }
// A candidate (logit, id): larger is better; ties of the logit go to the lower id. Never 0 (the key
// of a non-NaN float is nonzero), so 0 marks "none".
__device__ __forceinline__ u64 cand_of(float l, u32 id) { return ((u64)f2key(l) << 32) | (u64)(~id); }
__device__ __forceinline__ float cand_l(u64 c) { return key2f((u32)(c >> 32)); }
__device__ __forceinline__ u32 cand_id(u64 c) { return ~(u32)c; }

// Steps 1-2 of sampler.rs for one token (Sampler::penalise): c = generated count | SMP_SEEN.
// Explicit _rn intrinsics: never contracted into an FMA, so the result is the CPU's bit for bit.
__device__ __forceinline__ float penalise(float l, u32 c, float rep, float pres, float freq) {
    if (c == 0) return l;
    if (rep != 1.0f) l = l > 0.0f ? __fdiv_rn(l, rep) : __fmul_rn(l, rep);
    u32 n = c & ~SMP_SEEN;
    if (n > 0) l = __fsub_rn(l, __fadd_rn(pres, __fmul_rn(freq, __uint2float_rn(n))));
    return l;
}

// sampler.rs `exp_weight`, operation for operation (range reduction, Cephes polynomial,
// exponent bits), with every + and * rounded on its own as in Rust: the same bits.
__device__ __forceinline__ float exp_weight(float x) {
    const float LN2_HI = 0.693359375f, LN2_LO = -2.1219444e-4f, SHIFT = 12582912.0f;
    float xc = x > -87.0f ? x : -87.0f;
    xc = xc < 0.0f ? xc : 0.0f;
    float s = __fadd_rn(__fmul_rn(xc, 1.44269504088896340736f), SHIFT);
    float kf = __fsub_rn(s, SHIFT);
    float r = __fsub_rn(__fsub_rn(xc, __fmul_rn(kf, LN2_HI)), __fmul_rn(kf, LN2_LO));
    float p = 1.9875691e-4f;
    p = __fadd_rn(__fmul_rn(p, r), 1.3981999e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 8.333452e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 4.1665796e-2f);
    p = __fadd_rn(__fmul_rn(p, r), 1.6666665e-1f);
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    float e = __fadd_rn(__fadd_rn(__fmul_rn(p, __fmul_rn(r, r)), r), 1.0f);
    float two_k = __uint_as_float(((__float_as_uint(s) - 0x4B400000u) + 127u) << 23);
    float w = __fmul_rn(e, two_k);
    return x >= -87.0f ? w : 0.0f;
}

// xoshiro256++ (rng.rs `Rng::next_u64`), state in s[0..4].
__device__ __forceinline__ u64 rotl64(u64 x, int k) { return (x << k) | (x >> (64 - k)); }
__device__ __forceinline__ u64 xoshiro_next(u64* s) {
    u64 r = rotl64(s[0] + s[3], 23) + s[0];
    u64 t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl64(s[3], 45);
    return r;
}

// Shared state of block_topk.
struct SelShared {
    u32 hist[256];
    u64 buf[SEL_CAP];
    u64 prefix, mask;
    int above, eq, kk, cnt, done;
};

// The block's best k (1 <= k <= SMP_KMAX) of the candidates it holds, PER per thread in v (0 =
// none; the others distinct, as their ids are), written to out[0..k) in descending order (0 past
// the valid ones); returns how many are valid. No sort of the whole set: a radix select over the
// candidates' bits, 8 bits a pass from the top (the logit's key first), narrows to the prefix
// holding the k-th best, stopping as soon as the candidates at or above that prefix number at
// most SEL_CAP (logits spread over a few exponents: usually after 1-2 passes; always by the
// last, where the prefix is the k-th best itself); those are ranked by counting (one compare
// per pair). Ends with a barrier.
template <int PER>
__device__ int block_topk(const u64 (&v)[PER], int k, SelShared& sh, u64* out) {
    const int t = threadIdx.x, lane = t & 31;
    if (t == 0) { sh.prefix = 0; sh.mask = 0; sh.above = 0; sh.done = 0; sh.cnt = 0; }
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int b = t; b < 256; b += blockDim.x) sh.hist[b] = 0;
        __syncthreads();
        const u64 prefix = sh.prefix, mask = sh.mask;
#pragma unroll
        for (int i = 0; i < PER; i++)
            if (v[i] && (v[i] & mask) == prefix) atomicAdd(&sh.hist[(u32)(v[i] >> shift) & 255u], 1u);
        __syncthreads();
        if (t < 32) {
            // Lane L holds bins 255 - 8L down to 248 - 8L: lanes in descending bin order.
            int c[8], sum = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) { c[j] = (int)sh.hist[255 - 8 * lane - j]; sum += c[j]; }
            int inc = sum;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                int n = __shfl_up_sync(FULL_MASK, inc, o);
                if (lane >= o) inc += n;
            }
            const int total = __shfl_sync(FULL_MASK, inc, 31);
            int kk, above = sh.above;
            if (shift == 56) {
                // The first pass sees every valid candidate: fewer than k, or few enough to rank
                // them all, and the select is done before it starts.
                kk = min(k, total);
                if (lane == 0) sh.kk = kk;
                if (total <= SEL_CAP) {
                    if (lane == 0) sh.done = 1;
                    kk = 0;
                }
            } else {
                kk = sh.kk;
            }
            if (kk > 0) {
                const int need = kk - above;  // >= 1: the k-th best is among the matching ones
                const u32 hit = __ballot_sync(FULL_MASK, inc >= need);
                if (lane == __ffs(hit) - 1) {
                    int run = inc - sum;
#pragma unroll
                    for (int j = 0; j < 8; j++) {
                        if (run + c[j] >= need) {
                            sh.prefix = prefix | ((u64)(255 - 8 * lane - j) << shift);
                            sh.mask = mask | (255ull << shift);
                            sh.above = above + run;
                            sh.eq = c[j];
                            sh.done = above + run + c[j] <= SEL_CAP;
                            break;
                        }
                        run += c[j];
                    }
                }
            }
        }
        __syncthreads();
        if (sh.done) break;
    }
    // The candidates at or above the prefix: the above ones and the prefix's own (<= SEL_CAP).
    const u64 prefix = sh.prefix, mask = sh.mask;
#pragma unroll
    for (int i = 0; i < PER; i++)
        if (v[i] && (v[i] & mask) >= prefix) sh.buf[atomicAdd(&sh.cnt, 1)] = v[i];
    __syncthreads();
    const int n = sh.cnt, kk = sh.kk;
    for (int j = t; j < n; j += blockDim.x) {
        const u64 x = sh.buf[j];
        int r = 0;
        for (int i = 0; i < n; i++) r += sh.buf[i] > x;
        if (r < kk) out[r] = x;
    }
    for (int j = kk + t; j < k; j += blockDim.x) out[j] = 0;
    __syncthreads();
    return kk;
}

__device__ __forceinline__ double block_sum_f64(double v, double* sh) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// grid P = ceil(vocab / SMP_SLICE), SMP_THREADS threads; kc in 1..=SMP_KMAX. counts: null when
// no penalty is on. lp = 1: log-probability mode (raw logits; -inf is a candidate; part[2b],
// part[2b+1] = the block's max logit and sum of exp(l - max), f64).
extern "C" __global__ void __launch_bounds__(SMP_THREADS)
sample_topk_partial(const float* __restrict__ logits, const u32* __restrict__ counts, u64* __restrict__ cands, double* __restrict__ part,
                    int vocab, int kc, float rep, float pres, float freq, int lp) { KTRACE(); PDL_ENTRY();
    __shared__ SelShared sh;
    __shared__ u64 top[SMP_KMAX];
    __shared__ double shd[32];
    const int base = blockIdx.x * SMP_SLICE;
    float l[SMP_PER];
#pragma unroll
    for (int j = 0; j < SMP_PER; j++) {
        const int i = base + j * SMP_THREADS + threadIdx.x;
        l[j] = i < vocab ? logits[i] : __int_as_float(0x7fffffff);
    }
    u64 v[SMP_PER];
#pragma unroll
    for (int j = 0; j < SMP_PER; j++) {
        const int i = base + j * SMP_THREADS + threadIdx.x;
        float x = l[j];
        if (counts && i < vocab) x = penalise(x, counts[i], rep, pres, freq);
        // NaN (and the slice past the vocabulary) fails both tests; -inf (weight 0, never
        // drawn) is dropped when sampling.
        const bool ok = lp ? (x == x) : (x > NEG_INF);
        v[j] = ok ? cand_of(x, (u32)i) : 0;
    }
    block_topk<SMP_PER>(v, kc, sh, top);
    for (int j = threadIdx.x; j < kc; j += blockDim.x) cands[(u64)blockIdx.x * kc + j] = top[j];
    if (lp) {
        // The slice's max is its first candidate; the sum of exp in f64 as the host's top_logprobs.
        const u64 best = top[0];
        const double m = best ? (double)cand_l(best) : 0.0;
        double e = 0.0;
#pragma unroll
        for (int j = 0; j < SMP_PER; j++)
            if (v[j]) e += exp((double)cand_l(v[j]) - m);
        e = block_sum_f64(e, shd);
        if (threadIdx.x == 0) {
            part[2 * blockIdx.x] = best ? m : NEG_INF_F64;
            part[2 * blockIdx.x + 1] = best ? e : 0.0;
        }
    }
}

// Loads the ncand <= FIN_THREADS·FIN_PER candidates of sample_topk_partial, FIN_PER per thread.
__device__ __forceinline__ void load_cands(u64 (&v)[FIN_PER], const u64* __restrict__ cands, int ncand) {
#pragma unroll
    for (int j = 0; j < FIN_PER; j++) {
        const int i = j * FIN_THREADS + threadIdx.x;
        v[j] = i < ncand ? cands[i] : 0;
    }
}

// One block of FIN_THREADS. ncand = P·k <= FIN_THREADS·FIN_PER; k in 1..=SMP_KMAX; greedy:
// step 3. step = [token, pos]; counts may be null; rng = xoshiro256++ state.
extern "C" __global__ void __launch_bounds__(FIN_THREADS)
sample_topk_finish(const u64* __restrict__ cands, int ncand, int k, u32* __restrict__ step, u32* __restrict__ counts, u64* __restrict__ rng,
                   float temp, float top_p, float min_p, int greedy) { KTRACE(); PDL_ENTRY();
    __shared__ SelShared sh;
    __shared__ u64 s[SMP_KMAX];
    __shared__ float w[SMP_KMAX];
    __shared__ u32 ids[SMP_KMAX];
    __shared__ int ord[SMP_KMAX], keep[SMP_KMAX], byid[SMP_KMAX];
    __shared__ int nkeep;
    u64 v[FIN_PER];
    load_cands(v, cands, ncand);
    // The best k, sorted; kk of them exist.
    const int kk = block_topk<FIN_PER>(v, k, sh, s);
    const u64 best = s[0];
    const float m = best ? cand_l(best) : 0.0f;
    // Step 3 (greedy), no valid logit (the CPU's arg-max of all-NaN / -inf rows: 0), or a best
    // of +inf (the CPU's truncate gives up and takes the arg-max: the first +inf): no draw.
    if (greedy || !best || !(m < __int_as_float(0x7f800000))) {
        if (threadIdx.x == 0) {
            u32 tok = best ? cand_id(best) : 0;
            step[0] = tok;
            step[1] += 1;
            if (counts) counts[tok] += 1;
        }
        return;
    }
    // Step 4 on the k survivors: w = exp_weight((l - m) / T); the best has w = 1.
    const int t = threadIdx.x;
    if (t < kk) {
        w[t] = exp_weight(__fdiv_rn(__fsub_rn(cand_l(s[t]), m), temp));
        ids[t] = cand_id(s[t]);
        keep[t] = 1;
    }
    __syncthreads();
    if (top_p < 1.0f) {
        // Step 6: rank in (weight desc, id asc) order (k values: a rank count per thread).
        if (t < kk) {
            int r = 0;
            for (int i = 0; i < kk; i++) r += (w[i] > w[t]) || (w[i] == w[t] && ids[i] < ids[t]);
            ord[r] = t;
        }
        __syncthreads();
        if (t == 0) {
            // Σ w in the top-k order (the CPU's), then the shortest prefix reaching top_p·Σ.
            double z = 0.0;
            for (int i = 0; i < kk; i++) z += (double)w[i];
            double target = (double)top_p * z, cum = 0.0;
            int n = kk;
            for (int r = 0; r < kk; r++) {
                cum += (double)w[ord[r]];
                if (cum >= target) { n = r + 1; break; }
            }
            for (int r = n; r < kk; r++) keep[ord[r]] = 0;
        }
        __syncthreads();
    }
    // Step 7: min-p (the best, w = 1, always stays).
    if (t < kk && min_p > 0.0f && !(w[t] >= min_p)) keep[t] = 0;
    __syncthreads();
    // Step 8 in id order over the kept tokens.
    if (t < kk && keep[t]) {
        int r = 0;
        for (int i = 0; i < kk; i++) r += keep[i] && ids[i] < ids[t];
        byid[r] = t;
    }
    if (t == 0) {
        int n = 0;
        for (int i = 0; i < kk; i++) n += keep[i];
        nkeep = n;
    }
    __syncthreads();
    if (t == 0) {
        double total = 0.0;
        for (int r = 0; r < nkeep; r++) total += (double)w[byid[r]];
        u64 st[4] = {rng[0], rng[1], rng[2], rng[3]};
        double u = (double)(xoshiro_next(st) >> 11) * (1.0 / 9007199254740992.0);
        rng[0] = st[0]; rng[1] = st[1]; rng[2] = st[2]; rng[3] = st[3];
        double r = u * total, acc = 0.0;
        u32 tok = 0;
        for (int q = 0; q < nkeep; q++) {
            float wq = w[byid[q]];
            if (wq > 0.0f) {
                acc += (double)wq;
                tok = ids[byid[q]];
                if (acc > r) break;
            }
        }
        step[0] = tok;
        step[1] += 1;
        if (counts) counts[tok] += 1;
    }
}

// counts[token] += 1 (one thread): a forced token counts for the penalties as a drawn one.
extern "C" __global__ void sample_count(u32* __restrict__ counts, u32 token) { KTRACE(); PDL_ENTRY();
    counts[token] += 1;
}

extern "C" __global__ void mask_logits(float* __restrict__ logits, const u32* __restrict__ allowed, int vocab, int nwords) { KTRACE(); PDL_ENTRY();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= vocab) return;
    const int w = i >> 5;
    const u32 bits = w < nwords ? allowed[w] : 0u;
    if (!((bits >> (i & 31)) & 1u)) logits[i] = NEG_INF;
}

// One block of FIN_THREADS, after sample_topk_partial with lp = 1 and kc = max(n, 1) over P blocks
// (ncand = P·kc <= FIN_THREADS·FIN_PER).
// out[0] = logit[token] - lse; out[1 + 2j], out[2 + 2j] = (id bits, logprob) of the j-th most
// likely (logit desc, id asc, NaN skipped), j < n. lse = log Σ exp over non-NaN logits.
extern "C" __global__ void __launch_bounds__(FIN_THREADS)
logprobs_finish(const u64* __restrict__ cands, int ncand, int n, const double* __restrict__ part, int nparts, const float* __restrict__ logits,
                u32 token, float* __restrict__ out) { KTRACE(); PDL_ENTRY();
    __shared__ SelShared sh;
    __shared__ u64 s[SMP_KMAX];
    __shared__ double lse_sh;
    u64 v[FIN_PER];
    load_cands(v, cands, ncand);
    block_topk<FIN_PER>(v, n > 0 ? n : 1, sh, s);
    if (threadIdx.x == 0) {
        double m = NEG_INF_F64;
        for (int b = 0; b < nparts; b++) m = part[2 * b] > m ? part[2 * b] : m;
        double z = 0.0;
        for (int b = 0; b < nparts; b++)
            if (part[2 * b + 1] > 0.0) z += part[2 * b + 1] * exp(part[2 * b] - m);
        lse_sh = m + log(z);
        out[0] = (float)((double)logits[token] - lse_sh);
    }
    __syncthreads();
    int j = threadIdx.x;
    if (j < n) {
        u64 c = s[j];
        out[1 + 2 * j] = __uint_as_float(c ? cand_id(c) : 0xffffffffu);
        out[2 + 2 * j] = c ? (float)((double)cand_l(c) - lse_sh) : 0.0f;
    }
}

extern "C" __global__ void __launch_bounds__(256)
argmax_partial(const float* __restrict__ logits, float* __restrict__ pv, int* __restrict__ pi, int vocab) { KTRACE(); PDL_ENTRY();
    __shared__ float shv[32];
    __shared__ int shi[32];
    const int per = (vocab + gridDim.x - 1) / gridDim.x;
    const int a = blockIdx.x * per, b = min(vocab, a + per);
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = a + threadIdx.x; i < b; i += blockDim.x) {
        float v = logits[i];
        if (better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    block_argmax(bv, bi, shv, shi);
    if (threadIdx.x == 0) { pv[blockIdx.x] = bv; pi[blockIdx.x] = bi; }
}

extern "C" __global__ void __launch_bounds__(1024)
argmax_step(const float* __restrict__ pv, const int* __restrict__ pi, u32* __restrict__ step, int nparts) { KTRACE(); PDL_ENTRY();
    __shared__ float shv[32];
    __shared__ int shi[32];
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < nparts; i += blockDim.x)
        if (better(pv[i], pi[i], bv, bi)) { bv = pv[i]; bi = pi[i]; }
    block_argmax(bv, bi, shv, shi);
    if (threadIdx.x == 0) {
        step[0] = (u32)(bi == 0x7fffffff ? 0 : bi);
        step[1] += 1;
    }
}
