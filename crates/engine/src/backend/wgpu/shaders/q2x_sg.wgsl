// q2x_sg.wgsl: the subgroup helpers of the files that use subgroup operations (matmul.rs
// sg_shader, XQ_SHADER, moe.rs XQ_SHADER; only made on adapters with ordered subgroups of one
// width, `Ctx::new`'s SG_PROBE, at least 4 lanes): a team's sum by shuffles (team_sum, gemv_q6
// and the MoE block's xq kernels) and q2x's quantization of 8 elements a thread in both of its
// word layouts (q2x_words: q2x_stage of x, moe_gate_up_x of act; xq.wgsl's header has the
// layouts, q2x.wgsl the maths).

// Subgroup totals of a team wider than its subgroup: 4 rows each, at most 256 / 4 subgroups.
var<workgroup> rw_red: array<vec4<f32>, 64>;
// The subgroup width, made uniform for the analysis (workgroupUniformLoad).
var<workgroup> rw_sg: u32;

// The sum of v over this invocation's team of T lanes, every lane of the team getting it.
// Called in uniform control flow (sg and T uniform).
fn team_sum(v: vec4<f32>, li: u32, lane_sg: u32, T: u32, sg: u32) -> vec4<f32> {
    var s = v;
    let w = min(T, sg);
    for (var o = 1u; o < w; o <<= 1u) {
        s += subgroupShuffleXor(s, o);
    }
    if (sg >= T) {
        return s;
    }
    workgroupBarrier();
    if (lane_sg == 0u) {
        rw_red[li / sg] = s;
    }
    workgroupBarrier();
    let per = T / sg;
    let first = (li / T) * per;
    var t = vec4<f32>(0.0);
    for (var i = 0u; i < per; i++) {
        t += rw_red[first + i];
    }
    return t;
}

// One thread's share of a row staged as xq.wgsl's q2x_stage stages it: thread i holds elements
// 8i .. 8i + 7 (xl, xh) = u32 j = i % 4 of 4-bit word i / 4, and the u32s 2(j % 2), 2(j % 2) + 1
// of 8-bit word 2(i / 4) + j / 2. A word's threads are consecutive lanes of one subgroup (the
// shuffles: every lane calls it, in uniform control flow; lanes past the row pass zeros).
struct Q2xW {
    // 4-bit: u32 j of the word's q1 (even nibbles), q1 (odd), q2 (even), q2 (odd).
    w4: vec4<u32>,
    // 4-bit: the word's (d / 254, Σ x, 0, 0) as bits (written by its u32 0's thread).
    m4: vec4<u32>,
    // 8-bit: this thread's two u32s of q1, then its two of q2.
    w8: vec4<u32>,
    // 8-bit: the word's (d / 254, Σ x, 128 · (254 · Σ q1 + Σ q2), 0) as bits (its even thread's).
    m8: vec4<u32>,
}

// The two levels of y = x / d (|y| ≤ 127): q1 = round(y), q2 = round((y − q1) · 254).
fn q2x_levels(y: vec4<f32>) -> array<vec4<f32>, 2> {
    let q1 = round(y);
    return array<vec4<f32>, 2>(q1, round((y - q1) * 254.0));
}

fn q2x_words(xl: vec4<f32>, xh: vec4<f32>) -> Q2xW {
    let am = max(abs(xl), abs(xh));
    let a8 = max(max(am.x, am.y), max(am.z, am.w));
    let s8 = dot(xl + xh, vec4<f32>(1.0));
    // The 8-bit word's pair of threads (lanes i, i ^ 1), then the 4-bit word's four.
    let a16 = max(a8, subgroupShuffleXor(a8, 1u));
    let s16 = s8 + subgroupShuffleXor(s8, 1u);
    let a32 = max(a16, subgroupShuffleXor(a16, 2u));
    let s32 = s16 + subgroupShuffleXor(s16, 2u);
    // 8-bit: against the 16 elements' max; the word's correction summed over its pair.
    let inv8 = select(0.0, 127.0 / a16, a16 > 0.0);
    let lo8 = q2x_levels(xl * inv8);
    let hi8 = q2x_levels(xh * inv8);
    let one = vec4<f32>(1.0);
    let c = (i32(dot(lo8[0] + hi8[0], one)) * 254 + i32(dot(lo8[1] + hi8[1], one))) * 128;
    let cw = c + subgroupShuffleXor(c, 1u);
    // 4-bit: against the 32 elements' max.
    let inv4 = select(0.0, 127.0 / a32, a32 > 0.0);
    let lo = q2x_levels(xl * inv4);
    let hi = q2x_levels(xh * inv4);
    var r: Q2xW;
    // Nibble k of a u32 of codes is element k: the even ones meet the low nibbles' bytes, the
    // odd ones the high nibbles'.
    r.w4 = vec4<u32>(
        g5_pack(vec4<f32>(lo[0].x, lo[0].z, hi[0].x, hi[0].z)),
        g5_pack(vec4<f32>(lo[0].y, lo[0].w, hi[0].y, hi[0].w)),
        g5_pack(vec4<f32>(lo[1].x, lo[1].z, hi[1].x, hi[1].z)),
        g5_pack(vec4<f32>(lo[1].y, lo[1].w, hi[1].y, hi[1].w)),
    );
    r.m4 = vec4<u32>(bitcast<u32>(a32 / (127.0 * 254.0)), bitcast<u32>(s32), 0u, 0u);
    r.w8 = vec4<u32>(g5_pack(lo8[0]), g5_pack(hi8[0]), g5_pack(lo8[1]), g5_pack(hi8[1]));
    r.m8 = vec4<u32>(bitcast<u32>(a16 / (127.0 * 254.0)), bitcast<u32>(s16), bitcast<u32>(cw), 0u);
    return r;
}
