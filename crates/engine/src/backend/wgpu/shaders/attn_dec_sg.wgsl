// attn_dec_sg.wgsl: attn_dec_team, decode attention (cpu/attention.rs `attention`, one row at the
// step's pos) with a query head a team of 32 lanes and its head's dims across the lanes: the
// alternative to attention.wgsl's attn_dec_gqa (attention.rs `decode_attend`; the default since
// stop 41, `LILY_WGPU_ATTN_DEC=gqa` the other: the H200 figures are in device.rs `attn_team`). Prefixed
// with common.wgsl, the cache's element file (kv_f32.wgsl or kv_f16.wgsl: KV4, kv4) and
// attn_params.wgsl (P, the AD_* constants); made only where the adapter has ordered
// subgroups (`AdapterReport::subgroups`): wgpu rejects subgroup builtins on a device without.
//
// Why: the H200 lab (stop 35) timed attn_dec_gqa at 0.58 TB/s at 4K and 1.93 at 128K of f32 K/V,
// and slower with f16 K/V (half the bytes) at every length: it is bound by its own work, not by
// memory. Each chunk takes 3 workgroup barriers, and each thread reads the 8 heads' q from
// workgroup memory for every key row it scores (256 KB of workgroup-memory reads a chunk of 32
// f32 keys). Here q and the output stay in registers (8 dims of each a lane), a key's row is one
// coalesced load a team (512 B f32, 256 B f16), and the work a key is ~16 FMAs and ~2 shuffles a
// lane. The 8 heads of a KV head are the workgroup's 8 teams, reading the same rows at nearly the
// same time: the first team's loads bring them into L1 for the other 7.
//
// Layout: q [heads, hd] (vec4 view); kc, vc [capacity, kv_heads · hd] in KV4 words of 4
//   elements; step u32 [token, pos]; part: attn_dec_gqa's records, (m, l, 0, 0, acc[hd/4] vec4s)
//   at part[((kvh · G + g) · splits + s) · (hd/4 + 1)], merged by attention.wgsl's attn_combine4.
// Launch: a workgroup of 256 per (KV head, split): kv_heads · splits. Team g = li / 32 is query
//   head kvh · G + g (teams past G compute but write nothing); lane t = li % 32 holds the dims of
//   words t and t + 32 (hd ≤ 256, hd % 4 == 0, G ≤ 8: attention.rs checks). The splits are
//   attn_dec_gqa's: `splits` fixed by the capacity (a recorded step launches the same at any
//   position), each ceil(n / splits) of the n = pos + 1 keys but at least `span`; a split past the
//   keys writes (m, l) = (−1e30, 0) and stops.
// A team's keys go in blocks of TB = 8: the block's K words (2 a lane a key, all 16 loads issued
//   before any use; the next block's issued as soon as this one's are used), the lane's 8 partial
//   dots, its V words issued, then the block's scores by a reduce-scatter over the team (keys 0-3
//   or 4-7 kept at lane distance 16, then 2 of those at 8, 1 at 4: lane t holds key (t >> 2) & 7
//   summed over 8 lanes; then over the 4 lanes that share it at distances 2 and 1: 9 exchanges
//   instead of a butterfly's 40), every lane gathering the 8 scores (8 exchanges); then an online
//   softmax every lane keeps the same (running max m, sum l) and its 8 dims of Σ p·v.
// Exchanges: subgroup shuffles where the subgroup holds the partner (a 32-lane team in a subgroup
//   of ≥ 32: every exchange on the Apple GPUs and NVIDIA), else through workgroup memory (two
//   barriers; lavapipe's 8-lane subgroups at distances 8 and 16 and for the gather), so the team
//   logic runs in the CI's tests too. The two lanes of a pair add the same operands, so the 4
//   copies of a key's score carry the same bits.
// Order: a score is the lane's 8 products (two dot4), then the tree above; the CPU sums a row's
//   products in order. Within F32_TOL of the CPU (the attention tests), not bit-equal to it or to
//   attn_dec_gqa. Workgroup memory 5 KB. Bindings: 1 q, 2 kc, 3 vc, 4 step, 5 part.

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> td_q: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> td_kc: array<KV4>;
@group(0) @binding(3) var<storage, read> td_vc: array<KV4>;
@group(0) @binding(4) var<storage, read> td_step: array<u32>;
@group(0) @binding(5) var<storage, read_write> td_part: array<vec4<f32>>;

// The launch's shape: attn_params.wgsl's ad_*() (pipeline constants with `LILY_WGPU_SPEC` attn).

const NEG_BIG: f32 = -1.0e30;
const TB: u32 = 8u;

// `LILY_WGPU_ATTN_VAHEAD=1` (opt-in until measured): a block's V words issued with its K words,
// a block ahead (both while the block before is scored), instead of after its K dots; so a
// block's V load is not waited for after its scores. 16 KV4 more a lane. The same arithmetic.
override AD_VAHEAD: bool = false;

// The subgroup width, made uniform for the analysis (workgroupUniformLoad).
var<workgroup> td_sgw: u32;
// Exchanges through workgroup memory (partners outside the subgroup).
var<workgroup> td_x: array<vec2<f32>, 256>;
var<workgroup> td_g: array<f32, 256>;

// Lane li ^ o's v (o < 32: a lane of the same team). Uniform control flow (o and sg uniform).
fn td_xor2(v: vec2<f32>, o: u32, li: u32, sg: u32) -> vec2<f32> {
    if (o < sg) {
        return subgroupShuffleXor(v, o);
    }
    td_x[li] = v;
    workgroupBarrier();
    let r = td_x[li ^ o];
    workgroupBarrier();
    return r;
}

fn td_xor1(v: f32, o: u32, li: u32, sg: u32) -> f32 {
    if (o < sg) {
        return subgroupShuffleXor(v, o);
    }
    return td_xor2(vec2<f32>(v, 0.0), o, li, sg).x;
}

// Lanes 0, 4, …, 28 of this lane's team: their x, in every lane.
fn td_gather8(x: f32, li: u32, sg: u32) -> array<f32, 8> {
    var r: array<f32, 8>;
    if (sg >= 32u) {
        // The team's first lane within the subgroup.
        let b = li % sg - li % 32u;
        for (var k = 0u; k < TB; k++) {
            r[k] = subgroupShuffle(x, b + 4u * k);
        }
        return r;
    }
    td_g[li] = x;
    workgroupBarrier();
    for (var k = 0u; k < TB; k++) {
        r[k] = td_g[li - li % 32u + 4u * k];
    }
    workgroupBarrier();
    return r;
}

// The block's 8 scores (before the scale) from each lane's partial dots da (keys 0-3) and db
// (keys 4-7), every lane of the team getting all 8.
fn td_scores(da: vec4<f32>, db: vec4<f32>, li: u32, sg: u32) -> array<f32, 8> {
    let t = li % 32u;
    // Distance 16: lanes t < 16 keep keys 0-3 (their partners send theirs), the others 4-7.
    let h16 = (t & 16u) != 0u;
    let send16 = select(db, da, h16);
    let r16 = vec4<f32>(
        td_xor2(send16.xy, 16u, li, sg),
        td_xor2(send16.zw, 16u, li, sg)
    );
    let w = select(da, db, h16) + r16;
    // Distance 8: 2 of those 4.
    let h8 = (t & 8u) != 0u;
    let u = select(w.xy, w.zw, h8) + td_xor2(select(w.zw, w.xy, h8), 8u, li, sg);
    // Distance 4: 1 of those 2; lane t now holds key (t >> 2) & 7 over 8 lanes.
    let h4 = (t & 4u) != 0u;
    var x = select(u.x, u.y, h4) + td_xor1(select(u.y, u.x, h4), 4u, li, sg);
    // The key's 4 lanes.
    x += td_xor1(x, 2u, li, sg);
    x += td_xor1(x, 1u, li, sg);
    return td_gather8(x, li, sg);
}

// The 8 keys' K (`v` false) or V words w0, w1 of the block at row jb (words past hd/4 zero;
// rows from j1 on read row j1 - 1, their scores masked by the caller). `v` is a literal at each
// call: the branch folds. (WGSL passes no storage pointer, so one function reads either cache.)
fn td_load(v: bool, jb: u32, j1: u32, base: u32, kvd4: u32, w0: u32, w1: u32, hd4: u32) -> array<KV4, 16> {
    var r: array<KV4, 16>;
    for (var k = 0u; k < TB; k++) {
        let row = min(jb + k, j1 - 1u) * kvd4 + base;
        for (var i = 0u; i < 2u; i++) {
            let w = select(w0, w1, i == 1u);
            r[2u * k + i] = KV4();
            if (w < hd4) {
                if (v) {
                    r[2u * k + i] = td_vc[row + w];
                } else {
                    r[2u * k + i] = td_kc[row + w];
                }
            }
        }
    }
    return r;
}

@compute @workgroup_size(256)
fn attn_dec_team(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_size) sg_size: u32,
) {
    if (li == 0u) {
        td_sgw = sg_size;
    }
    let sg = workgroupUniformLoad(&td_sgw);
    let wg = wg_index(wid);
    let splits = ad_splits();
    let kvh = wg / splits;
    let s = wg % splits;
    let G = ad_nh() / ad_nkv();
    let hd4 = ad_hd() / 4u;
    let rec = hd4 + 1u;
    let n = min(td_step[1] + 1u, ad_cap());
    let span = max((n + splits - 1u) / splits, ad_span());
    let j0 = min(s * span, n);
    let j1 = min(j0 + span, n);
    let g = li / 32u;
    let t = li % 32u;
    let rb = ((kvh * G + g) * splits + s) * rec;
    if (j0 >= j1) {
        if (g < G && t == 0u) {
            td_part[rb] = vec4<f32>(NEG_BIG, 0.0, 0.0, 0.0);
        }
        return;
    }
    let kvd4 = ad_nkv() * hd4;
    let base = kvh * hd4;
    let w0 = t;
    let w1 = t + 32u;
    let head = kvh * G + min(g, G - 1u);
    var q0 = vec4<f32>(0.0);
    var q1 = vec4<f32>(0.0);
    if (w0 < hd4) {
        q0 = td_q[head * hd4 + w0];
    }
    if (w1 < hd4) {
        q1 = td_q[head * hd4 + w1];
    }
    var m = NEG_BIG;
    var l = 0.0;
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var kw = td_load(false, j0, j1, base, kvd4, w0, w1, hd4);
    var vn: array<KV4, 16>;
    if (AD_VAHEAD) {
        vn = td_load(true, j0, j1, base, kvd4, w0, w1, hd4);
    }
    for (var jb = j0; jb < j1; jb += TB) {
        var d: array<f32, 8>;
        for (var k = 0u; k < TB; k++) {
            d[k] = dot(q0, kv4(kw[2u * k])) + dot(q1, kv4(kw[2u * k + 1u]));
        }
        var vw: array<KV4, 16>;
        if (AD_VAHEAD) {
            vw = vn;
            if (jb + TB < j1) {
                kw = td_load(false, jb + TB, j1, base, kvd4, w0, w1, hd4);
                vn = td_load(true, jb + TB, j1, base, kvd4, w0, w1, hd4);
            }
        } else {
            vw = td_load(true, jb, j1, base, kvd4, w0, w1, hd4);
            if (jb + TB < j1) {
                kw = td_load(false, jb + TB, j1, base, kvd4, w0, w1, hd4);
            }
        }
        let sc = td_scores(vec4<f32>(d[0], d[1], d[2], d[3]), vec4<f32>(d[4], d[5], d[6], d[7]), li, sg);
        var mb = NEG_BIG;
        for (var k = 0u; k < TB; k++) {
            if (jb + k < j1) {
                mb = max(mb, sc[k] * p.scale);
            }
        }
        let mn = max(m, mb);
        let corr = exp(m - mn);
        var ps = 0.0;
        a0 *= corr;
        a1 *= corr;
        for (var k = 0u; k < TB; k++) {
            let pk = select(0.0, exp(sc[k] * p.scale - mn), jb + k < j1);
            ps += pk;
            a0 += pk * kv4(vw[2u * k]);
            a1 += pk * kv4(vw[2u * k + 1u]);
        }
        l = l * corr + ps;
        m = mn;
    }
    if (g < G) {
        if (t == 0u) {
            td_part[rb] = vec4<f32>(m, l, 0.0, 0.0);
        }
        if (w0 < hd4) {
            td_part[rb + 1u + w0] = a0;
        }
        if (w1 < hd4) {
            td_part[rb + 1u + w1] = a1;
        }
    }
}
