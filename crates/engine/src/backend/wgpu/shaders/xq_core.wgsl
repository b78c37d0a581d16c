// xq_core.wgsl: the quantization of x into q2x_stage's two layouts, shared by q2x_stage
// (xq.wgsl: x staged once a launch into a buffer) and gemv_q7 (matmul_sg.wgsl: x staged by
// every workgroup into its own memory). xq.wgsl's header documents the layouts and the maths;
// the CPU twin is cpu/matmul.rs `matmul`, the error the tests' Q2X_TOL. Uses subgroup shuffles:
// only in modules made where the adapter has subgroups (in order, at least 4 lanes).

// The two levels of y = x / d (|y| ≤ 127): q1 = round(y), q2 = round((y − q1) · 254).
fn xq_levels(y: vec4<f32>) -> array<vec4<f32>, 2> {
    let q1 = round(y);
    return array<vec4<f32>, 2>(q1, round((y - q1) * 254.0));
}

// A vec4 of x as mode `mode` reads it, from the raw vec4 h and its aux a (mode 1: the norm's
// weights, rn its 1 / rms; mode 2: u; else h as it is).
fn xq_apply(mode: u32, h: vec4<f32>, a: vec4<f32>, rn: f32) -> vec4<f32> {
    if (mode == 1u) {
        return h * rn * a;
    } else if (mode == 2u) {
        return vec4<f32>(silu_f(h.x) * a.x, silu_f(h.y) * a.y, silu_f(h.z) * a.z, silu_f(h.w) * a.w);
    }
    return h;
}

// One thread's share of a staged row: thread i holds elements 8i .. 8i + 7 (xl, xh).
struct XqW {
    // 4-bit word u = i / 4, its u32 j = i % 4 in each of the four code arrays: q1 of the even
    // nibbles, q1 of the odd, q2 even, q2 odd.
    q4: vec4<u32>,
    // The 4-bit word's (d / 254, Σ x) as bits (the same in its four threads).
    m4: vec2<u32>,
    // 8-bit word 2u + j / 2, its u32s 2(j % 2) and 2(j % 2) + 1: q1 lo, q1 hi, q2 lo, q2 hi.
    q8: vec4<u32>,
    // The 8-bit word's (d / 254, Σ x, 128 · (254 · Σ q1 + Σ q2)) as bits (both its threads).
    m8: vec3<u32>,
}

// Thread i's 8 elements quantized against their 8-bit word's max (lanes i, i ^ 1) and their
// 4-bit word's (lanes i ^ 1, i ^ 2: the word's four threads, consecutive lanes of a subgroup).
// Every invocation of the subgroup calls it (shuffles); threads past the row pass zeros.
fn xq_words(xl: vec4<f32>, xh: vec4<f32>) -> XqW {
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
    let lo8 = xq_levels(xl * inv8);
    let hi8 = xq_levels(xh * inv8);
    let one = vec4<f32>(1.0);
    let c = (i32(dot(lo8[0] + hi8[0], one)) * 254 + i32(dot(lo8[1] + hi8[1], one))) * 128;
    let cw = c + subgroupShuffleXor(c, 1u);
    // 4-bit: against the 32 elements' max.
    let inv4 = select(0.0, 127.0 / a32, a32 > 0.0);
    let lo = xq_levels(xl * inv4);
    let hi = xq_levels(xh * inv4);
    var w: XqW;
    // Nibble k of a u32 of codes is element k: the even ones meet the low nibbles' bytes, the
    // odd ones the high nibbles'.
    w.q4 = vec4<u32>(
        g5_pack(vec4<f32>(lo[0].x, lo[0].z, hi[0].x, hi[0].z)),
        g5_pack(vec4<f32>(lo[0].y, lo[0].w, hi[0].y, hi[0].w)),
        g5_pack(vec4<f32>(lo[1].x, lo[1].z, hi[1].x, hi[1].z)),
        g5_pack(vec4<f32>(lo[1].y, lo[1].w, hi[1].y, hi[1].w)),
    );
    w.m4 = vec2<u32>(bitcast<u32>(a32 / (127.0 * 254.0)), bitcast<u32>(s32));
    w.q8 = vec4<u32>(g5_pack(lo8[0]), g5_pack(hi8[0]), g5_pack(lo8[1]), g5_pack(hi8[1]));
    w.m8 = vec3<u32>(bitcast<u32>(a16 / (127.0 * 254.0)), bitcast<u32>(s16), bitcast<u32>(cw));
    return w;
}
