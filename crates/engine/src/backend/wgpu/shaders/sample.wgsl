// sample.wgsl: the sampled pick of a decode step on the device (Backend::sample_step; the CPU twin
// is runtime/sampler.rs `Sampler::sample_split`, CUDA's is sample.cu). Prefixed with
// common.wgsl and softfloat.wgsl.
//
// sample_topk_partial  grid P = ceil(vocab / SMP_SLICE) workgroups of 256 (61 at vocab 248,320):
//     each takes a contiguous slice of 4,096 logits, 16 an invocation (i = base + 256 j + lane:
//     coalesced), applies the penalties (steps 1-2, `penalise`, from the u32 counts [vocab]:
//     generated count | SMP_SEEN for a prompt token; only where the count word is not 0, in
//     softfloat so the bits are the CPU's), packs each logit as a 64-bit candidate
//     (key(logit) << 32 | ~id: descending candidates are (logit desc, id asc), the sampler's
//     top-k order; 0 = none: NaN and -inf, whose weight is 0) and writes its best k, sorted
//     descending, to cands [P, k] (u32 pairs: key, ~id).
//     Bindings: 1 logits f32 [vocab], 2 counts u32 [vocab] (a dummy word when no penalty is on:
//     P.flags bit 1 says), 3 cands u32 [2 P k].
// sample_topk_finish   one workgroup of 256: the same select keeps the best k of the P·k
//     candidates (at most SMP_T · SMP_PER = 4,096), then steps 3-8 on them: greedy, no finite
//     best or a best of +inf -> the arg-max and no draw; else the weights exp_weight((l - m) / T)
//     (softfloat: sampler.rs's roundings), top-p in (weight desc, id asc) order with its f64 sums
//     in the CPU's order, min-p, and the draw in id order from the xoshiro256++ state (one u64 a
//     draw, softfloat f64 for u · Σ w and the running sum). Writes step = (token, pos + 1) and,
//     with penalties, counts[token] += 1: a replayed step needs nothing from the host.
//     Bindings: 1 cands, 2 step u32 [token, pos], 3 counts, 4 rng u32 [8] (4 u64, low word first).
// sample_count   counts[P.token] += 1 (a forced token counts as drawn). Bindings: 1 counts.
// logprobs_finish  (one workgroup, after sample_topk_partial in log-probability mode: P.flags
//     bit 2, raw logits, -inf kept, each slice's max and Σ exp(l - max) at binding 4) the
//     chosen token's log-probability and the n most likely (id, logprob), as
//     runtime::sampler::token_logprobs on the host (lse in f32 here: within 1e-5 of its f64).
//     Bindings: 1 cands, 2 the slices' (max, Σ exp), 3 logits, 4 out f32 [1 + 2 n].
// softfloat_check  the softfloat functions on test inputs (wgpu_ops `softfloat_matches_ieee`):
//     one invocation a row of 4 words in, 16 out. Bindings: 1 input u32 [4 n], 2 output u32 [16 n].
//
// The select (`block_topk`): a radix select over the candidates' 64 bits, 8 a pass from the top,
// narrows to the prefix holding the k-th best and stops once the candidates at or above it are at
// most SEL_CAP (usually after 1-2 passes; always by the last, where the prefix is the k-th best
// itself); those are ranked by counting. A pass: a 256-bin histogram (workgroup atomics), its
// inclusive scan from the top bin down (Hillis-Steele in workgroup memory: no subgroup width is
// assumed), and the one invocation whose bin holds the k-th best moves the prefix.

struct P {
    vocab: u32,
    k: u32,
    ncand: u32,
    // bit 0: greedy; bit 1: penalty counts are kept.
    flags: u32,
    rep: u32,
    pres: u32,
    freq: u32,
    temp: u32,
    top_p: u32,
    min_p: u32,
    token: u32,
    // softfloat_check's rows; logprobs_finish's slices.
    n: u32,
    // logprobs_finish: the alternatives asked (n ≤ 20).
    alts: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

@group(0) @binding(0) var<uniform> p: P;

const SMP_T: u32 = 256u;
const SMP_PER: u32 = 16u;
const SMP_SLICE: u32 = 4096u;
const SEL_CAP: u32 = 256u;
const SMP_KMAX: u32 = 64u;
const SMP_SEEN: u32 = 0x80000000u;
const F32_INF: u32 = 0x7f800000u;

var<workgroup> sel_hist: array<atomic<u32>, 256>;
var<workgroup> sel_scan: array<u32, 256>;
var<workgroup> sel_buf: array<vec2<u32>, 256>;
var<workgroup> sel_top: array<vec2<u32>, 64>;
var<workgroup> sel_cnt: atomic<u32>;
// prefix (2 words), mask (2), above, done.
var<workgroup> sel_st: array<u32, 6>;
var<workgroup> sel_done: u32;

// Order key of a float's bits: unsigned order of keys = numeric order (callers drop NaN).
fn f2key(b: u32) -> u32 {
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

fn key2f(k: u32) -> u32 {
    return select(~k, k & 0x7fffffffu, (k & 0x80000000u) != 0u);
}

// 8 bits of a candidate, pass 0 the top ones.
fn sel_digit(v: vec2<u32>, ps: u32) -> u32 {
    if (ps < 4u) {
        return (v.x >> (24u - 8u * ps)) & 255u;
    }
    return (v.y >> (24u - 8u * (ps - 4u))) & 255u;
}

// The workgroup's best k (1 <= k <= SMP_KMAX) of the SMP_PER candidates each invocation holds in
// v (0 = none; the others distinct, as their ids are), left in sel_top[0..k) in descending order
// (0 past the valid ones); returns how many are valid. Ends with a barrier.
fn block_topk(v: ptr<function, array<vec2<u32>, 16>>, k: u32, t: u32) -> u32 {
    if (t == 0u) {
        sel_st = array<u32, 6>(0u, 0u, 0u, 0u, 0u, 0u);
        sel_done = 0u;
        atomicStore(&sel_cnt, 0u);
    }
    var kk = 0u;
    for (var ps = 0u; ps < 8u; ps++) {
        atomicStore(&sel_hist[t], 0u);
        workgroupBarrier();
        // Read before the scan's barriers: the invocation that moves them writes after those.
        let prefix = vec2<u32>(sel_st[0], sel_st[1]);
        let mask = vec2<u32>(sel_st[2], sel_st[3]);
        let above = sel_st[4];
        for (var i = 0u; i < SMP_PER; i++) {
            let c = (*v)[i];
            if (c.x != 0u && all((c & mask) == prefix)) {
                atomicAdd(&sel_hist[sel_digit(c, ps)], 1u);
            }
        }
        workgroupBarrier();
        // Invocation t holds bin 255 - t: the scan runs from the top bin down.
        let cnt = atomicLoad(&sel_hist[255u - t]);
        sel_scan[t] = cnt;
        workgroupBarrier();
        for (var o = 1u; o < 256u; o <<= 1u) {
            var add = 0u;
            if (t >= o) {
                add = sel_scan[t - o];
            }
            workgroupBarrier();
            sel_scan[t] += add;
            workgroupBarrier();
        }
        let inc = sel_scan[t];
        var search = true;
        if (ps == 0u) {
            // The first pass sees every valid candidate: fewer than k, or few enough to rank
            // them all, and the select is done before it starts.
            let total = sel_scan[255];
            kk = min(k, total);
            if (total <= SEL_CAP) {
                search = false;
                if (t == 0u) {
                    sel_done = 1u;
                }
            }
        }
        // need >= 1: the k-th best is among the candidates matching the prefix.
        let need = kk - above;
        if (search && cnt > 0u && inc >= need && inc - cnt < need) {
            let sh = 24u - 8u * (ps % 4u);
            let d = (255u - t) << sh;
            let dm = 255u << sh;
            if (ps < 4u) {
                sel_st[0] = prefix.x | d;
                sel_st[2] = mask.x | dm;
            } else {
                sel_st[1] = prefix.y | d;
                sel_st[3] = mask.y | dm;
            }
            sel_st[4] = above + inc - cnt;
            if (above + inc <= SEL_CAP) {
                sel_done = 1u;
            }
        }
        if (workgroupUniformLoad(&sel_done) != 0u) {
            break;
        }
    }
    // The candidates at or above the prefix: the ones above it and the prefix's own.
    let prefix = vec2<u32>(sel_st[0], sel_st[1]);
    let mask = vec2<u32>(sel_st[2], sel_st[3]);
    for (var i = 0u; i < SMP_PER; i++) {
        let c = (*v)[i];
        if (c.x != 0u && ge64(c & mask, prefix)) {
            // At most SEL_CAP by the passes' end (the last one's prefix is the k-th best
            // itself); the bound keeps the writes in the array whatever happens.
            let at = atomicAdd(&sel_cnt, 1u);
            if (at < SEL_CAP) {
                sel_buf[at] = c;
            }
        }
    }
    workgroupBarrier();
    let n = min(atomicLoad(&sel_cnt), SEL_CAP);
    for (var j = t; j < n; j += SMP_T) {
        let x = sel_buf[j];
        var r = 0u;
        for (var i = 0u; i < n; i++) {
            r += select(0u, 1u, gt64(sel_buf[i], x));
        }
        if (r < kk) {
            sel_top[r] = x;
        }
    }
    for (var j = kk + t; j < k; j += SMP_T) {
        sel_top[j] = vec2<u32>(0u, 0u);
    }
    workgroupBarrier();
    return kk;
}

// Steps 1-2 of sampler.rs for one logit (Sampler::penalise): c = generated count | SMP_SEEN.
fn penalise(l: u32, c: u32) -> u32 {
    var x = l;
    if (bitcast<f32>(p.rep) != 1.0) {
        x = select(mul32(x, p.rep), div32(x, p.rep), bitcast<f32>(x) > 0.0);
    }
    let n = c & ~SMP_SEEN;
    if (n > 0u) {
        x = sub32(x, add32(p.pres, mul32(p.freq, bitcast<u32>(f32(n)))));
    }
    return x;
}

@group(0) @binding(1) var<storage, read> tp_logits: array<f32>;
@group(0) @binding(2) var<storage, read> tp_counts: array<u32>;
@group(0) @binding(3) var<storage, read_write> tp_cands: array<u32>;
// Log-probability mode (P.flags bit 2): the slice's max logit and Σ exp(l - max) (a spare in
// sampling mode).
@group(0) @binding(4) var<storage, read_write> tp_part: array<f32>;


@compute @workgroup_size(256)
fn sample_topk_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let b = wg_index(wid);
    let base = b * SMP_SLICE;
    var v: array<vec2<u32>, 16>;
    for (var j = 0u; j < SMP_PER; j++) {
        let i = base + j * SMP_T + t;
        if (i < p.vocab) {
            var x = bitcast<u32>(tp_logits[i]);
            if ((p.flags & 2u) != 0u) {
                let c = tp_counts[i];
                if (c != 0u) {
                    x = penalise(x, c);
                }
            }
            // NaN fails both tests; sampling drops -inf (weight 0, never drawn), the
            // log-probabilities keep it (a token the mask excluded is still reported).
            let xf = bitcast<f32>(x);
            let lp = (p.flags & 4u) != 0u;
            if ((lp && xf == xf) || xf > -bitcast<f32>(F32_INF)) {
                v[j] = vec2<u32>(f2key(x), ~i);
            }
        }
    }
    block_topk(&v, p.k, t);
    for (var j = t; j < p.k; j += SMP_T) {
        let c = sel_top[j];
        tp_cands[2u * (b * p.k + j)] = c.x;
        tp_cands[2u * (b * p.k + j) + 1u] = c.y;
    }
    if ((p.flags & 4u) != 0u) {
        // The slice's max is its best candidate; Σ exp(l - max) over its valid logits, each
        // invocation's 16 in order, then common.wgsl's tree over the workgroup (wg_sum).
        let best = workgroupUniformLoad(&sel_top[0]);
        let m = bitcast<f32>(key2f(best.x));
        var e = 0.0;
        for (var j = 0u; j < SMP_PER; j++) {
            if (v[j].x != 0u && best.x != 0u) {
                e += exp(bitcast<f32>(key2f(v[j].x)) - m);
            }
        }
        let z = wg_sum(e, t);
        if (t == 0u) {
            tp_part[2u * b] = select(-bitcast<f32>(F32_INF), m, best.x != 0u);
            tp_part[2u * b + 1u] = select(0.0, z, best.x != 0u);
        }
    }
}

// Binding 1: the candidates, tf_cands (below), as sample_topk_finish reads them.
@group(0) @binding(2) var<storage, read> lf_part: array<f32>;
@group(0) @binding(3) var<storage, read> lf_logits: array<f32>;
@group(0) @binding(4) var<storage, read_write> lf_out: array<f32>;

var<workgroup> lf_lse: f32;

// After sample_topk_partial in log-probability mode (P.k = max(alts, 1) candidates from each
// of P.n slices, P.ncand in all): out[0] = logit[P.token] - lse; out[1 + 2j], out[2 + 2j] = the
// (id bits, logprob) of the j-th most likely (logit desc, id asc, NaN skipped) for j < P.alts;
// lse = max + log Σ_slices Σ exp(l - max) over the non-NaN logits, in f32
// (runtime::sampler::token_logprobs sums in f64: the tests hold the two within 1e-5).
@compute @workgroup_size(256)
fn logprobs_finish(@builtin(local_invocation_index) t: u32) {
    var v = fin_cands(t);
    block_topk(&v, p.k, t);
    if (t == 0u) {
        var m = -bitcast<f32>(F32_INF);
        for (var b = 0u; b < p.n; b++) {
            m = max(m, lf_part[2u * b]);
        }
        var z = 0.0;
        for (var b = 0u; b < p.n; b++) {
            if (lf_part[2u * b + 1u] > 0.0) {
                z += lf_part[2u * b + 1u] * exp(lf_part[2u * b] - m);
            }
        }
        lf_lse = m + log(z);
        lf_out[0] = lf_logits[p.token] - lf_lse;
    }
    workgroupBarrier();
    if (t < p.alts) {
        let c = sel_top[t];
        lf_out[1u + 2u * t] = bitcast<f32>(select(0xffffffffu, ~c.y, c.x != 0u));
        lf_out[2u + 2u * t] = select(0.0, bitcast<f32>(key2f(c.x)) - lf_lse, c.x != 0u);
    }
}

// The exp of sampler.rs `exp_weight`, rounding for rounding (its comments say why each step).
fn exp_weight(x: u32) -> u32 {
    let xf = bitcast<f32>(x);
    var xc = select(0xc2ae0000u, x, xf > -87.0);
    xc = select(0u, xc, bitcast<f32>(xc) < 0.0);
    let s = add32(mul32(xc, 0x3fb8aa3bu), 0x4b400000u);
    let kf = sub32(s, 0x4b400000u);
    let r = sub32(sub32(xc, mul32(kf, 0x3f318000u)), mul32(kf, 0xb95e8083u));
    var q = 0x39506967u;
    q = add32(mul32(q, r), 0x3ab743ceu);
    q = add32(mul32(q, r), 0x3c088908u);
    q = add32(mul32(q, r), 0x3d2aa9c1u);
    q = add32(mul32(q, r), 0x3e2aaaaau);
    q = add32(mul32(q, r), 0x3f000000u);
    let e = add32(add32(mul32(q, mul32(r, r)), r), 0x3f800000u);
    let two_k = ((s - 0x4b400000u) + 127u) << 23u;
    return select(0u, mul32(e, two_k), xf >= -87.0);
}

// xoshiro256++ (rng.rs `Rng::next_u64`) on u64 words as vec2(low, high).
fn u64_add(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let lo = a.x + b.x;
    return vec2<u32>(lo, a.y + b.y + select(0u, 1u, lo < a.x));
}

fn u64_rotl(a: vec2<u32>, k: u32) -> vec2<u32> {
    // 0 < k < 32 here after folding a rotation of 32 or more into a swap.
    var x = a;
    var r = k;
    if (r >= 32u) {
        x = a.yx;
        r -= 32u;
    }
    if (r == 0u) {
        return x;
    }
    return vec2<u32>((x.x << r) | (x.y >> (32u - r)), (x.y << r) | (x.x >> (32u - r)));
}

@group(0) @binding(1) var<storage, read> tf_cands: array<u32>;
@group(0) @binding(2) var<storage, read_write> tf_step: array<u32>;
@group(0) @binding(3) var<storage, read_write> tf_counts: array<u32>;
@group(0) @binding(4) var<storage, read_write> tf_rng: array<u32>;

var<workgroup> fw: array<u32, 64>;
var<workgroup> fid: array<u32, 64>;
var<workgroup> fkeep: array<u32, 64>;
var<workgroup> ford: array<u32, 64>;
var<workgroup> fbyid: array<u32, 64>;

// The step's token: pos += 1, and the token counted for the penalties.
fn finish_with(tok: u32) {
    tf_step[0] = tok;
    tf_step[1] = tf_step[1] + 1u;
    if ((p.flags & 2u) != 0u) {
        tf_counts[tok] = tf_counts[tok] + 1u;
    }
}

// Invocation t's SMP_PER of the first pass's P.ncand candidates (0 past them): the finishing
// workgroups' input (sample_topk_finish, logprobs_finish).
fn fin_cands(t: u32) -> array<vec2<u32>, 16> {
    var v: array<vec2<u32>, 16>;
    for (var j = 0u; j < SMP_PER; j++) {
        let i = j * SMP_T + t;
        if (i < p.ncand) {
            v[j] = vec2<u32>(tf_cands[2u * i], tf_cands[2u * i + 1u]);
        }
    }
    return v;
}

@compute @workgroup_size(256)
fn sample_topk_finish(@builtin(local_invocation_index) t: u32) {
    var v = fin_cands(t);
    let kk = block_topk(&v, p.k, t);
    let best = workgroupUniformLoad(&sel_top[0]);
    let m = key2f(best.x);
    // Step 3 (greedy), no valid logit (the CPU's arg-max of an all-NaN / -inf row: 0), or a best
    // of +inf (the CPU's truncate gives up and takes the arg-max: the first +inf): no draw.
    if ((p.flags & 1u) != 0u || best.x == 0u || m == F32_INF) {
        if (t == 0u) {
            finish_with(select(~best.y, 0u, best.x == 0u));
        }
        return;
    }
    // Step 4 on the kk survivors: w = exp_weight((l - m) / T); the best has w = 1.
    if (t < kk) {
        let c = sel_top[t];
        fw[t] = exp_weight(div32(sub32(key2f(c.x), m), p.temp));
        fid[t] = ~c.y;
        fkeep[t] = 1u;
    }
    workgroupBarrier();
    if (bitcast<f32>(p.top_p) < 1.0) {
        // Step 6: the rank in (weight desc, id asc) order (kk values: a count an invocation).
        if (t < kk) {
            var r = 0u;
            for (var i = 0u; i < kk; i++) {
                let wi = bitcast<f32>(fw[i]);
                let wt = bitcast<f32>(fw[t]);
                r += select(0u, 1u, wi > wt || (wi == wt && fid[i] < fid[t]));
            }
            ford[r] = t;
        }
        workgroupBarrier();
        if (t == 0u) {
            // Σ w in the top-k order (the CPU's), then the shortest prefix reaching top_p · Σ.
            var z = vec2<u32>(0u, 0u);
            for (var i = 0u; i < kk; i++) {
                z = add64(z, f64_of_f32(fw[i]));
            }
            let goal = mul64(f64_of_f32(p.top_p), z);
            var cum = vec2<u32>(0u, 0u);
            var n = kk;
            for (var r = 0u; r < kk; r++) {
                cum = add64(cum, f64_of_f32(fw[ford[r]]));
                if (ge64(cum, goal)) {
                    n = r + 1u;
                    break;
                }
            }
            for (var r = n; r < kk; r++) {
                fkeep[ford[r]] = 0u;
            }
        }
        workgroupBarrier();
    }
    // Step 7: min-p (the best, w = 1, always stays).
    let min_p = bitcast<f32>(p.min_p);
    if (t < kk && min_p > 0.0 && !(bitcast<f32>(fw[t]) >= min_p)) {
        fkeep[t] = 0u;
    }
    workgroupBarrier();
    // Step 8 in id order over the kept tokens.
    if (t < kk && fkeep[t] != 0u) {
        var r = 0u;
        for (var i = 0u; i < kk; i++) {
            r += select(0u, 1u, fkeep[i] != 0u && fid[i] < fid[t]);
        }
        fbyid[r] = t;
    }
    workgroupBarrier();
    if (t == 0u) {
        var nkeep = 0u;
        for (var i = 0u; i < kk; i++) {
            nkeep += fkeep[i];
        }
        var total = vec2<u32>(0u, 0u);
        for (var r = 0u; r < nkeep; r++) {
            total = add64(total, f64_of_f32(fw[fbyid[r]]));
        }
        // rng.rs next_u64, then next_f64: (x >> 11) · 2^-53.
        var s0 = vec2<u32>(tf_rng[0], tf_rng[1]);
        var s1 = vec2<u32>(tf_rng[2], tf_rng[3]);
        var s2 = vec2<u32>(tf_rng[4], tf_rng[5]);
        var s3 = vec2<u32>(tf_rng[6], tf_rng[7]);
        let x = u64_add(u64_rotl(u64_add(s0, s3), 23u), s0);
        let sh = vec2<u32>(s1.x << 17u, (s1.y << 17u) | (s1.x >> 15u));
        s2 ^= s0;
        s3 ^= s1;
        s1 ^= s2;
        s0 ^= s3;
        s2 ^= sh;
        s3 = u64_rotl(s3, 45u);
        tf_rng[0] = s0.x;
        tf_rng[1] = s0.y;
        tf_rng[2] = s1.x;
        tf_rng[3] = s1.y;
        tf_rng[4] = s2.x;
        tf_rng[5] = s2.y;
        tf_rng[6] = s3.x;
        tf_rng[7] = s3.y;
        let u = f64_of_u53(vec2<u32>(x.y >> 11u, (x.x >> 11u) | (x.y << 21u)));
        let r = mul64(u, total);
        var acc = vec2<u32>(0u, 0u);
        var tok = 0u;
        for (var q = 0u; q < nkeep; q++) {
            let wq = fw[fbyid[q]];
            if (bitcast<f32>(wq) > 0.0) {
                acc = add64(acc, f64_of_f32(wq));
                tok = fid[fbyid[q]];
                if (gt64(acc, r)) {
                    break;
                }
            }
        }
        finish_with(tok);
    }
}

@group(0) @binding(1) var<storage, read_write> sc_counts: array<u32>;

@compute @workgroup_size(1)
fn sample_count() {
    sc_counts[p.token] = sc_counts[p.token] + 1u;
}

@group(0) @binding(1) var<storage, read> sf_in: array<u32>;
@group(0) @binding(2) var<storage, read_write> sf_out: array<u32>;

// Row i: in = (a, b, c, d) f32 bits; out (16 words) = a + b, a - b, a · b, a / b, exp_weight(a)
// in f32, then in f64 (2 words each, high first; c, d >= 0): s = c + d, m = c · d, s + m, s · m
// (operands with all 53 bits), and f64_of_u53 of N = (c & 0x1fffff) · 2^32 + d.
@compute @workgroup_size(64)
fn softfloat_check(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= p.n) {
        return;
    }
    let a = sf_in[4u * i];
    let b = sf_in[4u * i + 1u];
    let c = f64_of_f32(sf_in[4u * i + 2u]);
    let d = f64_of_f32(sf_in[4u * i + 3u]);
    let o = 16u * i;
    sf_out[o] = add32(a, b);
    sf_out[o + 1u] = sub32(a, b);
    sf_out[o + 2u] = mul32(a, b);
    sf_out[o + 3u] = div32(a, b);
    sf_out[o + 4u] = exp_weight(a);
    let s = add64(c, d);
    let m = mul64(c, d);
    let sm = add64(s, m);
    let pm = mul64(s, m);
    let u = f64_of_u53(vec2<u32>(sf_in[4u * i + 2u] & 0x1fffffu, sf_in[4u * i + 3u]));
    sf_out[o + 5u] = s.x;
    sf_out[o + 6u] = s.y;
    sf_out[o + 7u] = m.x;
    sf_out[o + 8u] = m.y;
    sf_out[o + 9u] = sm.x;
    sf_out[o + 10u] = sm.y;
    sf_out[o + 11u] = pm.x;
    sf_out[o + 12u] = pm.y;
    sf_out[o + 13u] = u.x;
    sf_out[o + 14u] = u.y;
}
