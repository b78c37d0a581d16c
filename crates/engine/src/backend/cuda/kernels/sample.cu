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
//         * sample_topk_partial (grid P = ceil(vocab / SMP_SLICE), SMP_THREADS threads): each
//           block takes a contiguous slice of SMP_SLICE logits, applies the penalties (step 1-2,
//           `penalise`, from the u32 counts [vocab]: generated count | SMP_SEEN when the token is
//           in the prompt), packs each as a 64-bit candidate (order key of the logit << 32 |
//           ~id: ordering candidates descending is (logit desc, id asc), the sampler's top-k
//           order; 0 = none: NaN, and -inf, whose weight is 0 anyway), sorts the slice in shared
//           memory (bitonic) and writes its best `kc` candidates to cands [P, kc]. The global
//           top-k is within the union of the slices' top-k.
//         * sample_topk_finish (one block of SMP_THREADS): sorts the P·kc candidates, keeps the
//           best k, and runs steps 3-8 on them: greedy / non-finite best -> arg-max, no draw;
//           else weights by exp_weight (bit for bit the CPU's: IEEE + * / with no contraction),
//           top-p in (weight desc, id asc) order, min-p, and the draw in id order from the
//           xoshiro256++ state rng [4 u64] (one u64 per draw). The f64 sums run sequentially in
//           the CPU's order (k <= 64 values), so with the same seed the device draws the CPU's
//           tokens. Writes step = (token, pos + 1) and counts[token] += 1 (when counts are kept),
//           so a recorded step (CUDA graph) replays with no host input.
//         A full-vocabulary path (top-k off, or k above SMP_KMAX) is not here yet: the backend
//         then declines and the host samples (Cuda::new_sampler).
// sample_count  counts[token] += 1 for a token the sampler did not draw (a forced token).
// logprobs_finish  with sample_topk_partial in log-probability mode (lp = 1: raw logits, -inf
//         kept, each block's max and sum of exp in f64): the chosen token's log-probability and
//         the n most likely (id, logprob), as generate.rs's `top_logprobs` on the host.

#define SMP_THREADS 1024
#define SMP_SLICE 4096
#define SMP_KMAX 64
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

// Sorts s[0..n) descending (n a power of two) with the whole block; ends with a barrier.
__device__ void bitonic_desc(u64* s, int n) {
    for (int k = 2; k <= n; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            __syncthreads();
            for (int t = threadIdx.x; t < n / 2; t += blockDim.x) {
                int i = ((t & ~(j - 1)) << 1) | (t & (j - 1));
                u64 a = s[i], b = s[i + j];
                // Blocks with bit k clear sort descending, the others ascending: the merge of
                // the next level then sees bitonic runs; the last level (k = n) is all descending.
                bool desc = (i & k) == 0;
                if ((a < b) == desc) { s[i] = b; s[i + j] = a; }
            }
        }
    }
    __syncthreads();
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

// grid P = ceil(vocab / SMP_SLICE), SMP_THREADS threads. counts: null when no penalty is on.
// lp = 1: log-probability mode (raw logits; -inf is a candidate; part[2b], part[2b+1] = the
// block's max logit and sum of exp(l - max), f64).
extern "C" __global__ void __launch_bounds__(SMP_THREADS)
sample_topk_partial(const float* __restrict__ logits, const u32* __restrict__ counts, u64* __restrict__ cands, double* __restrict__ part,
                    int vocab, int kc, float rep, float pres, float freq, int lp) { PDL_ENTRY();
    __shared__ u64 sk[SMP_SLICE];
    __shared__ double shd[32];
    const int base = blockIdx.x * SMP_SLICE;
    for (int j = threadIdx.x; j < SMP_SLICE; j += blockDim.x) {
        int i = base + j;
        u64 c = 0;
        if (i < vocab) {
            float l = logits[i];
            if (counts) l = penalise(l, counts[i], rep, pres, freq);
            // NaN fails both tests; -inf (weight 0, never drawn) is dropped when sampling.
            bool ok = lp ? (l == l) : (l > NEG_INF);
            if (ok) c = cand_of(l, (u32)i);
        }
        sk[j] = c;
    }
    bitonic_desc(sk, SMP_SLICE);
    for (int j = threadIdx.x; j < kc; j += blockDim.x) cands[(u64)blockIdx.x * kc + j] = j < SMP_SLICE ? sk[j] : 0;
    if (lp) {
        // The slice's max is its first candidate; the sum of exp in f64 as the host's top_logprobs.
        double m = sk[0] ? (double)cand_l(sk[0]) : 0.0;
        double e = 0.0;
        for (int j = threadIdx.x; j < SMP_SLICE; j += blockDim.x)
            if (sk[j]) e += exp((double)cand_l(sk[j]) - m);
        e = block_sum_f64(e, shd);
        if (threadIdx.x == 0) {
            part[2 * blockIdx.x] = sk[0] ? m : NEG_INF_F64;
            part[2 * blockIdx.x + 1] = sk[0] ? e : 0.0;
        }
    }
}

// Loads n candidates into s and sorts them descending (padding to a power of two with 0).
__device__ int load_sorted(u64* s, const u64* __restrict__ cands, int n) {
    int n2 = 1;
    while (n2 < n) n2 <<= 1;
    for (int j = threadIdx.x; j < n2; j += blockDim.x) s[j] = j < n ? cands[j] : 0;
    bitonic_desc(s, n2);
    return n2;
}

// One block of SMP_THREADS. ncand = P·kc <= SMP_THREADS·4; k in 1..=SMP_KMAX; greedy: step 3.
// step = [token, pos]; counts may be null; rng = xoshiro256++ state.
extern "C" __global__ void __launch_bounds__(SMP_THREADS)
sample_topk_finish(const u64* __restrict__ cands, int ncand, int k, u32* __restrict__ step, u32* __restrict__ counts, u64* __restrict__ rng,
                   float temp, float top_p, float min_p, int greedy) { PDL_ENTRY();
    __shared__ u64 s[SMP_THREADS * 4];
    __shared__ float w[SMP_KMAX];
    __shared__ u32 ids[SMP_KMAX];
    __shared__ int ord[SMP_KMAX], keep[SMP_KMAX], byid[SMP_KMAX];
    __shared__ int nkeep;
    load_sorted(s, cands, ncand);
    // Candidates of the top k that exist (sorted: the valid ones come first).
    int kk = 0;
    while (kk < k && s[kk]) kk++;
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
extern "C" __global__ void sample_count(u32* __restrict__ counts, u32 token) { PDL_ENTRY();
    counts[token] += 1;
}

// One block of SMP_THREADS, after sample_topk_partial with lp = 1 and kc >= n over P blocks.
// out[0] = logit[token] - lse; out[1 + 2j], out[2 + 2j] = (id bits, logprob) of the j-th most
// likely (logit desc, id asc, NaN skipped), j < n. lse = log Σ exp over non-NaN logits.
extern "C" __global__ void __launch_bounds__(SMP_THREADS)
logprobs_finish(const u64* __restrict__ cands, int ncand, int n, const double* __restrict__ part, int nparts, const float* __restrict__ logits,
                u32 token, float* __restrict__ out) { PDL_ENTRY();
    __shared__ u64 s[SMP_THREADS * 4];
    __shared__ double lse_sh;
    load_sorted(s, cands, ncand);
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
argmax_partial(const float* __restrict__ logits, float* __restrict__ pv, int* __restrict__ pi, int vocab) { PDL_ENTRY();
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
argmax_step(const float* __restrict__ pv, const int* __restrict__ pi, u32* __restrict__ step, int nparts) { PDL_ENTRY();
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
