// q2x.wgsl: x quantized to two int8 levels per 16-byte code word, and the word's integer dot
// products (matmul.wgsl gemv_v5 and moe.wgsl moe_gate_up_q include it; their headers say how
// they stage). A word of 32 4-bit or 16 8-bit codes meets its x as x ≈ d·(q1 + q2/254),
// d = max |x| / 127 over the word (each element within max |x| / 64,516: 15 bits); a u32 of
// codes costs 2 masks and 4 dot4I8Packed (DP4A where the adapter has integer dot products) and
// the word's sums are exact in i32. Staging: 4 threads a word, each a u32 of codes' elements
// (8 or 4): g5_share (max |x| and Σ x to g5_m), a barrier, g5_quant (packed q1 and q2 to g5_q,
// (d / 254, Σ x) to g5_d, the 8-bit correction's parts to g5_c), a barrier, and for 8-bit codes
// g5_correct and a barrier. Workgroup memory: 8 + 2 + 4 + 2 KB.

// Code words a pass.
const G5_W: u32 = 128u;
// [4][G5_W]: the word's packed q1 (even nibbles' x, or a 8-bit word's), q1 (odd), q2, q2 (odd).
var<workgroup> g5_q: array<vec4<u32>, 512>;
// Per word: d / 254, Σ x, and (8-bit) the correction 128 · (254 · Σ q1 + Σ q2) as bits.
var<workgroup> g5_d: array<vec4<f32>, 128>;
// The staging threads' (max |x|, Σ x) of their u32, and their part of the 8-bit correction,
// [word][4].
var<workgroup> g5_m: array<vec2<f32>, 512>;
var<workgroup> g5_c: array<i32, 512>;

// Staging, part 1: the max |x| and Σ x of word u's u32 j (xl: elements 0-3, xh: 4-7 or 0).
fn g5_share(u: u32, j: u32, xl: vec4<f32>, xh: vec4<f32>) {
    let am = max(abs(xl), abs(xh));
    g5_m[u * 4u + j] = vec2<f32>(max(max(am.x, am.y), max(am.z, am.w)), dot(xl + xh, vec4<f32>(1.0)));
}

// 4 signed values in [-127, 127] as packed bytes (x, y, z, w from the low byte up).
fn g5_pack(q: vec4<f32>) -> u32 {
    let b = vec4<u32>(vec4<i32>(q)) & vec4<u32>(0xffu);
    return b.x | (b.y << 8u) | (b.z << 16u) | (b.w << 24u);
}

// Part 2: the u32's x quantized against the word's max |x| (two levels), packed in the codes'
// order into g5_q; its part of the 8-bit correction into g5_m; the word's first thread writes
// (d / 254, Σ x) to g5_d.
fn g5_quant(u: u32, j: u32, nv: u32, bits: u32, xl0: vec4<f32>, xh0: vec4<f32>) {
    if (u >= nv) {
        return;
    }
    let mm0 = g5_m[u * 4u];
    let mm1 = g5_m[u * 4u + 1u];
    let mm2 = g5_m[u * 4u + 2u];
    let mm3 = g5_m[u * 4u + 3u];
    let amax = max(max(mm0.x, mm1.x), max(mm2.x, mm3.x));
    let inv = select(0.0, 127.0 / amax, amax > 0.0);
    let xl = xl0 * inv;
    let xh = xh0 * inv;
    let l1 = round(xl);
    let h1 = round(xh);
    let l2 = round((xl - l1) * 254.0);
    let h2 = round((xh - h1) * 254.0);
    if (bits == 4u) {
        // Nibble i of the u32 is element i: the even ones (0 2 4 6) meet the low nibbles'
        // bytes, the odd ones the high nibbles'.
        g5_q[u][j] = g5_pack(vec4<f32>(l1.x, l1.z, h1.x, h1.z));
        g5_q[128u + u][j] = g5_pack(vec4<f32>(l1.y, l1.w, h1.y, h1.w));
        g5_q[256u + u][j] = g5_pack(vec4<f32>(l2.x, l2.z, h2.x, h2.z));
        g5_q[384u + u][j] = g5_pack(vec4<f32>(l2.y, l2.w, h2.y, h2.w));
    } else {
        g5_q[u][j] = g5_pack(l1);
        g5_q[256u + u][j] = g5_pack(l2);
    }
    // Read by the 8-bit correction after the next barrier (part 1's values are read above).
    let corr = (i32(dot(l1, vec4<f32>(1.0))) * 254 + i32(dot(l2, vec4<f32>(1.0)))) * 128;
    g5_c[u * 4u + j] = corr;
    if (j == 0u) {
        g5_d[u] = vec4<f32>(amax / (127.0 * 254.0), (mm0.y + mm1.y) + (mm2.y + mm3.y), 0.0, 0.0);
    }
}

// Staging, part 3 (8-bit codes, after a barrier): each word's correction 128 · (254 · Σ q1 + Σ q2)
// into g5_d[u].z (as bits), for the codes read as signed (c − 128).
fn g5_correct(li: u32, nv: u32) {
    for (var u = li; u < nv; u += 256u) {
        let cs = (g5_c[u * 4u] + g5_c[u * 4u + 1u]) + (g5_c[u * 4u + 2u] + g5_c[u * 4u + 3u]);
        g5_d[u].z = bitcast<f32>(cs);
    }
}

// Σ code·(254·q1 + q2) over a code word, x of the word as staged (qa1 qb1 qa2 qb2), as an
// exact integer (4-bit: |.| < 2^24; 8-bit: before the correction).
fn g5_dot(w: vec4<u32>, bits: u32, qa1: vec4<u32>, qb1: vec4<u32>, qa2: vec4<u32>, qb2: vec4<u32>) -> i32 {
    var i1 = 0;
    var i2 = 0;
    if (bits == 4u) {
        let m = vec4<u32>(0x0f0f0f0fu);
        let lo = w & m;
        let hi = (w >> vec4<u32>(4u)) & m;
        i1 = (dot4I8Packed(lo.x, qa1.x) + dot4I8Packed(hi.x, qb1.x))
            + (dot4I8Packed(lo.y, qa1.y) + dot4I8Packed(hi.y, qb1.y))
            + (dot4I8Packed(lo.z, qa1.z) + dot4I8Packed(hi.z, qb1.z))
            + (dot4I8Packed(lo.w, qa1.w) + dot4I8Packed(hi.w, qb1.w));
        i2 = (dot4I8Packed(lo.x, qa2.x) + dot4I8Packed(hi.x, qb2.x))
            + (dot4I8Packed(lo.y, qa2.y) + dot4I8Packed(hi.y, qb2.y))
            + (dot4I8Packed(lo.z, qa2.z) + dot4I8Packed(hi.z, qb2.z))
            + (dot4I8Packed(lo.w, qa2.w) + dot4I8Packed(hi.w, qb2.w));
    } else {
        let f = w ^ vec4<u32>(0x80808080u);
        i1 = (dot4I8Packed(f.x, qa1.x) + dot4I8Packed(f.y, qa1.y))
            + (dot4I8Packed(f.z, qa1.z) + dot4I8Packed(f.w, qa1.w));
        i2 = (dot4I8Packed(f.x, qa2.x) + dot4I8Packed(f.y, qa2.y))
            + (dot4I8Packed(f.z, qa2.z) + dot4I8Packed(f.w, qa2.w));
    }
    return i1 * 254 + i2;
}

