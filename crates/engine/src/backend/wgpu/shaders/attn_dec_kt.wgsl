// attn_dec_kt.wgsl: attn_dec_kt, decode attention (cpu/attention.rs `attention`, one row at the
// step's pos) with each 32-lane team an online softmax of its own over chunks of 8 keys, for all
// the query heads of the workgroup's KV head at once (`LILY_WGPU_ATTN_KT=N`, N splits a KV head;
// 0 keeps attn_dec_sg.wgsl's attn_dec_team). Prefixed with common.wgsl, kv_f16.wgsl (KV4, kv4:
// made for the f16 cache only: an f32 cache's K and V words would double the registers) and
// attn_params.wgsl (P, the AD_* constants); made only where the adapter has ordered subgroups.
//
// Why: attn_dec_team gives each query head a team, so the 8 teams of a workgroup walk the same
// keys one after the other: every K/V word is loaded and converted 8 times (L1 hits but for the
// first), and a team's keys are a chain of 8-key blocks, each waiting for its V loads and a
// 25-step shuffle chain. The H100 lab (stop 47) timed it at 0.38 TB/s at 4K and 0.93 at 128K of
// an f16 cache (22 and 289 µs a layer). Here a team owns distinct keys (the CUDA backend's
// attn_decode does the same with warps on tensor cores): each K/V word is loaded and converted
// once, a team has its next chunk's K in flight while it scores this one and its V while it
// adds the last, and a workgroup's 8 teams are 8 independent chains.
//
// Layout: q [heads, hd] (vec4 view); kc, vc [capacity, kv_heads · hd] in KV4 words of 4 f16;
//   step u32 [token, pos]; part: attn_dec_team's records, (m, l, 0, 0, acc[hd/4] vec4s) at
//   part[((kvh · G + h) · splits + s) · (hd/4 + 1)], merged by attention.wgsl's attn_combine4.
// Launch: a workgroup of 256 per (KV head, split): kv_heads · splits. The split's keys: n = pos +
//   1 keys in splits of span = max(ceil(n / splits) rounded up to 8, AD_SPAN) (a recorded step
//   launches the same at any position); a split past the keys writes (m, l) = (−1e30, 0) for its
//   heads and stops. Its chunks of 8 keys go to the teams in turn (team g: chunks g, g + 8, …),
//   every team looping the same count (uniform control flow for the exchanges' barriers): a
//   chunk past the split's keys scores nothing.
// A team (32 lanes, lane t) and a chunk: lane t holds dims of words t and t + 32 (hd ≤ 256) of
//   the chunk's 8 keys and of q (every head, from workgroup memory), and the sums of those dims of
//   its 8 heads' outputs (acc: 16 vec4). The 64 partial scores (8 heads × 8 keys) are summed over
//   the lanes by a reduce-scatter: at lane distance 16 a lane keeps keys 0-3 or 4-7 (the kept
//   half's dots are taken after the sent half's come back, so no more than 32 are live), at 8,
//   4, 2 heads 0-3 or 4-7, then 2 of 4, then 1 of 2, at 1 keys 2 of 4: lane t ends with head
//   h = (t >> 1) & 7's scores of keys 4·bit4(t) + 2·bit0(t) and the next, summed over 32 lanes
//   (62 exchanges). A head's max over its 8 keys: 2 exchanges among its 4 lanes; each lane keeps
//   its head's running max m (the same in the head's 4 lanes) and the sum l of its own keys' p.
//   Then acc ·= corr of each head (8 broadcasts) and acc += p · V key by key (each key's 8 heads'
//   p: 8 broadcasts). f32 arithmetic throughout.
// End: the 8 teams merge in workgroup memory (their (m, l) a head; then 2 heads a round, each
//   team's acc scaled by exp(m_team − M)), one record a head for the split.
// Exchanges: subgroup shuffles where the subgroup holds the team (32 lanes or more: Apple's GPUs,
//   NVIDIA), else through workgroup memory with barriers (lavapipe's 8 lanes), so the CI's tests
//   run this logic too. Order: within F32_TOL of the CPU (the attention tests), not bit-equal
//   to it or to attn_dec_team. Workgroup memory 20.5 KB. Bindings: 1 q, 2 kc, 3 vc, 4 step,
//   5 part.

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> kt_q: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> kt_kc: array<KV4>;
@group(0) @binding(3) var<storage, read> kt_vc: array<KV4>;
@group(0) @binding(4) var<storage, read> kt_step: array<u32>;
@group(0) @binding(5) var<storage, read_write> kt_part: array<vec4<f32>>;

const KT_NEG: f32 = -1.0e30;

// The subgroup width, made uniform for the analysis (workgroupUniformLoad).
var<workgroup> kt_sgw: u32;
// q of the 8 head slots (64 vec4 a head) during the keys; the merge's 2 heads × 8 teams × 64
// vec4 after.
var<workgroup> kt_s: array<vec4<f32>, 1024>;
// Each team's (m, l) of each head slot, for the merge.
var<workgroup> kt_ml: array<vec2<f32>, 64>;
// Exchanges through workgroup memory (partners outside the subgroup).
var<workgroup> kt_x: array<vec4<f32>, 256>;

// Lane li ^ o's v (o < 32: a lane of the same team). Uniform control flow (o and sg uniform).
fn kt_xor(v: vec4<f32>, o: u32, li: u32, sg: u32) -> vec4<f32> {
    if (o < sg) {
        return subgroupShuffleXor(v, o);
    }
    kt_x[li] = v;
    workgroupBarrier();
    let r = kt_x[li ^ o];
    workgroupBarrier();
    return r;
}

fn kt_xor2(v: vec2<f32>, o: u32, li: u32, sg: u32) -> vec2<f32> {
    if (o < sg) {
        return subgroupShuffleXor(v, o);
    }
    return kt_xor(vec4<f32>(v, 0.0, 0.0), o, li, sg).xy;
}

fn kt_xor1(v: f32, o: u32, li: u32, sg: u32) -> f32 {
    if (o < sg) {
        return subgroupShuffleXor(v, o);
    }
    return kt_xor(vec4<f32>(v, 0.0, 0.0, 0.0), o, li, sg).x;
}

// Lane `src` of this lane's team: its v. Uniform control flow (sg uniform).
fn kt_from(v: f32, src: u32, li: u32, sg: u32) -> f32 {
    if (sg >= 32u) {
        return subgroupShuffle(v, li % sg - li % 32u + src);
    }
    kt_x[li] = vec4<f32>(v, 0.0, 0.0, 0.0);
    workgroupBarrier();
    let r = kt_x[li - li % 32u + src].x;
    workgroupBarrier();
    return r;
}

// The chunk's K (`v` false) or V words at rows jb .. jb + 7: key k's words t and t + 32 at 2k and
// 2k + 1 (words past hd/4 zero; rows from j1 on read row j1 − 1, their scores masked by the
// caller). `v` is a literal at each call: the branch folds.
fn kt_load(v: bool, jb: u32, j1: u32, base: u32, kvd4: u32, t: u32, hd4: u32) -> array<KV4, 16> {
    var r: array<KV4, 16>;
    for (var k = 0u; k < 8u; k++) {
        let row = min(jb + k, j1 - 1u) * kvd4 + base;
        for (var i = 0u; i < 2u; i++) {
            let w = t + 32u * i;
            r[2u * k + i] = KV4();
            if (w < hd4) {
                if (v) {
                    r[2u * k + i] = kt_vc[row + w];
                } else {
                    r[2u * k + i] = kt_kc[row + w];
                }
            }
        }
    }
    return r;
}

// Head slot h's partial dots (this lane's 8 dims) with 4 keys' converted words ka (words t) and
// kb (words t + 32).
fn kt_dot4(h: u32, t: u32, ka: array<vec4<f32>, 4>, kb: array<vec4<f32>, 4>) -> vec4<f32> {
    let qa = kt_s[64u * h + t];
    let qb = kt_s[64u * h + t + 32u];
    return vec4<f32>(
        dot(qa, ka[0]) + dot(qb, kb[0]),
        dot(qa, ka[1]) + dot(qb, kb[1]),
        dot(qa, ka[2]) + dot(qb, kb[2]),
        dot(qa, ka[3]) + dot(qb, kb[3])
    );
}

// Head slot h's two words of acc: scaled by c (the online softmax's correction).
fn kt_scale(a: ptr<function, vec4<f32>>, b: ptr<function, vec4<f32>>, c: f32) {
    *a *= c;
    *b *= c;
}

// Head slot h's two words of acc: += its p of a key times the key's V words.
fn kt_pv(a: ptr<function, vec4<f32>>, b: ptr<function, vec4<f32>>, ph: f32, va: vec4<f32>, vb: vec4<f32>) {
    *a += ph * va;
    *b += ph * vb;
}

// Key k of the chunk (its V words va, vb; pk: this lane's p of key k's parity): every head
// slot's p of it (at lane 2h + bit1(k) + 16 · bit2(k)) times va, vb into that slot's words.
fn kt_key(k: u32, va: vec4<f32>, vb: vec4<f32>, pk: f32, li: u32, sg: u32,
          a0: ptr<function, vec4<f32>>, a1: ptr<function, vec4<f32>>, a2: ptr<function, vec4<f32>>,
          a3: ptr<function, vec4<f32>>, a4: ptr<function, vec4<f32>>, a5: ptr<function, vec4<f32>>,
          a6: ptr<function, vec4<f32>>, a7: ptr<function, vec4<f32>>, a8: ptr<function, vec4<f32>>,
          a9: ptr<function, vec4<f32>>, a10: ptr<function, vec4<f32>>, a11: ptr<function, vec4<f32>>,
          a12: ptr<function, vec4<f32>>, a13: ptr<function, vec4<f32>>, a14: ptr<function, vec4<f32>>,
          a15: ptr<function, vec4<f32>>) {
    let src = ((k >> 1u) & 1u) + 16u * (k >> 2u);
    kt_pv(a0, a1, kt_from(pk, src, li, sg), va, vb);
    kt_pv(a2, a3, kt_from(pk, 2u + src, li, sg), va, vb);
    kt_pv(a4, a5, kt_from(pk, 4u + src, li, sg), va, vb);
    kt_pv(a6, a7, kt_from(pk, 6u + src, li, sg), va, vb);
    kt_pv(a8, a9, kt_from(pk, 8u + src, li, sg), va, vb);
    kt_pv(a10, a11, kt_from(pk, 10u + src, li, sg), va, vb);
    kt_pv(a12, a13, kt_from(pk, 12u + src, li, sg), va, vb);
    kt_pv(a14, a15, kt_from(pk, 14u + src, li, sg), va, vb);
}

// The merge: this team's acc words (a, b) of head slot h (the round's e-th), scaled to the
// largest m over the teams, into workgroup memory.
fn kt_put(h: u32, e: u32, g: u32, t: u32, a: vec4<f32>, b: vec4<f32>) {
    var mx = KT_NEG;
    for (var j = 0u; j < 8u; j++) {
        mx = max(mx, kt_ml[8u * j + h].x);
    }
    let w = exp(kt_ml[8u * g + h].x - mx);
    kt_s[(8u * e + g) * 64u + t] = a * w;
    kt_s[(8u * e + g) * 64u + t + 32u] = b * w;
}

// The merge's round of head slots h0, h0 + 1 (after their kt_put): the teams' words added in
// team order, and the records written. Every invocation calls it (barriers).
fn kt_round(h0: u32, li: u32, kvh: u32, G: u32, s: u32, splits: u32, hd4: u32) {
    workgroupBarrier();
    // Thread li < 128: head slot h0 + li / 64, word li % 64.
    let e = li / 64u;
    let h = h0 + e;
    let wd = li % 64u;
    let rec = hd4 + 1u;
    if (li < 128u && h < G) {
        let rb = ((kvh * G + h) * splits + s) * rec;
        if (wd < hd4) {
            var a = vec4<f32>(0.0);
            for (var j = 0u; j < 8u; j++) {
                a += kt_s[(8u * e + j) * 64u + wd];
            }
            kt_part[rb + 1u + wd] = a;
        }
        if (wd == 0u) {
            var mx = KT_NEG;
            for (var j = 0u; j < 8u; j++) {
                mx = max(mx, kt_ml[8u * j + h].x);
            }
            var lt = 0.0;
            for (var j = 0u; j < 8u; j++) {
                let ml = kt_ml[8u * j + h];
                lt += exp(ml.x - mx) * ml.y;
            }
            kt_part[rb] = vec4<f32>(mx, lt, 0.0, 0.0);
        }
    }
    workgroupBarrier();
}

@compute @workgroup_size(256)
fn attn_dec_kt(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_size) sg_size: u32,
) {
    if (li == 0u) {
        kt_sgw = sg_size;
    }
    let sg = workgroupUniformLoad(&kt_sgw);
    let wg = wg_index(wid);
    let splits = ad_splits();
    let kvh = wg / splits;
    let s = wg % splits;
    let G = ad_nh() / ad_nkv();
    let hd4 = ad_hd() / 4u;
    let rec = hd4 + 1u;
    let n = min(kt_step[1] + 1u, ad_cap());
    let span = max(((n + splits - 1u) / splits + 7u) / 8u * 8u, ad_span());
    let j0 = min(s * span, n);
    let j1 = min(j0 + span, n);
    if (j0 >= j1) {
        if (li < G) {
            kt_part[((kvh * G + li) * splits + s) * rec] = vec4<f32>(KT_NEG, 0.0, 0.0, 0.0);
        }
        return;
    }
    let g = li / 32u;
    let t = li % 32u;
    // q of head slot h (zero past G and past hd).
    for (var i = li; i < 512u; i += 256u) {
        let h = i / 64u;
        let w = i % 64u;
        var qv = vec4<f32>(0.0);
        if (h < G && w < hd4) {
            qv = kt_q[(kvh * G + h) * hd4 + w];
        }
        kt_s[i] = qv;
    }
    workgroupBarrier();
    let kvd4 = ad_nkv() * hd4;
    let base = kvh * hd4;
    let chunks = (j1 - j0 + 7u) / 8u;
    let rounds = (chunks + 7u) / 8u;
    // This lane's bits: b4 the key half it keeps at distance 16, b0 the key pair at 1; its head
    // slot after the reduce-scatter.
    let b4 = (t & 16u) != 0u;
    let b3 = (t & 8u) != 0u;
    let b2 = (t & 4u) != 0u;
    let b1 = (t & 2u) != 0u;
    let b0 = (t & 1u) != 0u;
    let hs = (t >> 1u) & 7u;
    let ka0 = 4u * u32(b4) + 2u * u32(b0);
    var m = KT_NEG;
    var l = 0.0;
    // acc as 16 named words (head slot h: a{2h} words t, a{2h+1} words t + 32): every use
    // names its word, so none is indexed at run time (an indexed array goes to local memory:
    // stop 47's first version, 576 bytes a thread).
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    var a4 = vec4<f32>(0.0);
    var a5 = vec4<f32>(0.0);
    var a6 = vec4<f32>(0.0);
    var a7 = vec4<f32>(0.0);
    var a8 = vec4<f32>(0.0);
    var a9 = vec4<f32>(0.0);
    var a10 = vec4<f32>(0.0);
    var a11 = vec4<f32>(0.0);
    var a12 = vec4<f32>(0.0);
    var a13 = vec4<f32>(0.0);
    var a14 = vec4<f32>(0.0);
    var a15 = vec4<f32>(0.0);
    var jb = j0 + 8u * g;
    var kw = kt_load(false, jb, j1, base, kvd4, t, hd4);
    var vw = kt_load(true, jb, j1, base, kvd4, t, hd4);
    for (var r = 0u; r < rounds; r++) {
        // Distance 16: the sent half's dots (keys 4-7 where b4 is clear), then the kept half's.
        var ka: array<vec4<f32>, 4>;
        var kb: array<vec4<f32>, 4>;
        for (var k = 0u; k < 4u; k++) {
            ka[k] = kv4(select(kw[2u * (k + 4u)], kw[2u * k], b4));
            kb[k] = kv4(select(kw[2u * (k + 4u) + 1u], kw[2u * k + 1u], b4));
        }
        var r16: array<vec4<f32>, 8>;
        for (var h = 0u; h < 8u; h++) {
            r16[h] = kt_xor(kt_dot4(h, t, ka, kb), 16u, li, sg);
        }
        for (var k = 0u; k < 4u; k++) {
            ka[k] = kv4(select(kw[2u * k], kw[2u * (k + 4u)], b4));
            kb[k] = kv4(select(kw[2u * k + 1u], kw[2u * (k + 4u) + 1u], b4));
        }
        for (var h = 0u; h < 8u; h++) {
            r16[h] += kt_dot4(h, t, ka, kb);
        }
        // The next chunk's K, while this one's scores are summed.
        let jn = jb + 64u;
        if (r + 1u < rounds) {
            kw = kt_load(false, jn, j1, base, kvd4, t, hd4);
        }
        // Distance 8: head slots 0-3 or 4-7; 4: 2 of those; 2: 1; then keys 2 of 4 at 1.
        var r8: array<vec4<f32>, 4>;
        for (var i = 0u; i < 4u; i++) {
            r8[i] = select(r16[i], r16[i + 4u], b3) + kt_xor(select(r16[i + 4u], r16[i], b3), 8u, li, sg);
        }
        var r4: array<vec4<f32>, 2>;
        for (var i = 0u; i < 2u; i++) {
            r4[i] = select(r8[i], r8[i + 2u], b2) + kt_xor(select(r8[i + 2u], r8[i], b2), 4u, li, sg);
        }
        let r2 = select(r4[0], r4[1], b1) + kt_xor(select(r4[1], r4[0], b1), 2u, li, sg);
        let sc = (select(r2.xy, r2.zw, b0) + kt_xor2(select(r2.zw, r2.xy, b0), 1u, li, sg)) * p.scale;
        // Head slot hs's keys ka0, ka0 + 1 of this chunk; masked past the split's keys.
        let ja = jb + ka0;
        let s0 = select(KT_NEG, sc.x, ja < j1);
        let s1 = select(KT_NEG, sc.y, ja + 1u < j1);
        var bm = max(s0, s1);
        bm = max(bm, kt_xor1(bm, 1u, li, sg));
        bm = max(bm, kt_xor1(bm, 16u, li, sg));
        let mn = max(m, bm);
        let corr = exp(m - mn);
        let p0 = select(0.0, exp(s0 - mn), ja < j1);
        let p1 = select(0.0, exp(s1 - mn), ja + 1u < j1);
        l = l * corr + p0 + p1;
        m = mn;
        // Every head slot's correction (from its lane 2h), then p · V key by key: key k's p of
        // head slot h sits at lane 2h + bit1(k) + 16 · bit2(k), the pair's first or second.
        kt_scale(&a0, &a1, kt_from(corr, 0u, li, sg));
        kt_scale(&a2, &a3, kt_from(corr, 2u, li, sg));
        kt_scale(&a4, &a5, kt_from(corr, 4u, li, sg));
        kt_scale(&a6, &a7, kt_from(corr, 6u, li, sg));
        kt_scale(&a8, &a9, kt_from(corr, 8u, li, sg));
        kt_scale(&a10, &a11, kt_from(corr, 10u, li, sg));
        kt_scale(&a12, &a13, kt_from(corr, 12u, li, sg));
        kt_scale(&a14, &a15, kt_from(corr, 14u, li, sg));
        // Key by key (named, not a loop: a loop the driver left rolled indexed vw at run time,
        // which put it in local memory).
        kt_key(0u, kv4(vw[0]), kv4(vw[1]), p0, li, sg, &a0, &a1, &a2, &a3, &a4, &a5, &a6, &a7, &a8, &a9, &a10, &a11, &a12, &a13, &a14, &a15);
        kt_key(1u, kv4(vw[2]), kv4(vw[3]), p1, li, sg, &a0, &a1, &a2, &a3, &a4, &a5, &a6, &a7, &a8, &a9, &a10, &a11, &a12, &a13, &a14, &a15);
        kt_key(2u, kv4(vw[4]), kv4(vw[5]), p0, li, sg, &a0, &a1, &a2, &a3, &a4, &a5, &a6, &a7, &a8, &a9, &a10, &a11, &a12, &a13, &a14, &a15);
        kt_key(3u, kv4(vw[6]), kv4(vw[7]), p1, li, sg, &a0, &a1, &a2, &a3, &a4, &a5, &a6, &a7, &a8, &a9, &a10, &a11, &a12, &a13, &a14, &a15);
        kt_key(4u, kv4(vw[8]), kv4(vw[9]), p0, li, sg, &a0, &a1, &a2, &a3, &a4, &a5, &a6, &a7, &a8, &a9, &a10, &a11, &a12, &a13, &a14, &a15);
        kt_key(5u, kv4(vw[10]), kv4(vw[11]), p1, li, sg, &a0, &a1, &a2, &a3, &a4, &a5, &a6, &a7, &a8, &a9, &a10, &a11, &a12, &a13, &a14, &a15);
        kt_key(6u, kv4(vw[12]), kv4(vw[13]), p0, li, sg, &a0, &a1, &a2, &a3, &a4, &a5, &a6, &a7, &a8, &a9, &a10, &a11, &a12, &a13, &a14, &a15);
        kt_key(7u, kv4(vw[14]), kv4(vw[15]), p1, li, sg, &a0, &a1, &a2, &a3, &a4, &a5, &a6, &a7, &a8, &a9, &a10, &a11, &a12, &a13, &a14, &a15);
        // The next chunk's V, while its K is scored.
        if (r + 1u < rounds) {
            vw = kt_load(true, jn, j1, base, kvd4, t, hd4);
        }
        jb = jn;
    }
    // The team's l of each head slot: its 4 lanes' sums.
    l += kt_xor1(l, 1u, li, sg);
    l += kt_xor1(l, 16u, li, sg);
    if (t < 16u && !b0) {
        kt_ml[8u * g + hs] = vec2<f32>(m, l);
    }
    // Every team is past its last read of q in kt_s.
    workgroupBarrier();
    kt_put(0u, 0u, g, t, a0, a1);
    kt_put(1u, 1u, g, t, a2, a3);
    kt_round(0u, li, kvh, G, s, splits, hd4);
    kt_put(2u, 0u, g, t, a4, a5);
    kt_put(3u, 1u, g, t, a6, a7);
    kt_round(2u, li, kvh, G, s, splits, hd4);
    kt_put(4u, 0u, g, t, a8, a9);
    kt_put(5u, 1u, g, t, a10, a11);
    kt_round(4u, li, kvh, G, s, splits, hd4);
    kt_put(6u, 0u, g, t, a12, a13);
    kt_put(7u, 1u, g, t, a14, a15);
    kt_round(6u, li, kvh, G, s, splits, hd4);
}
