// softfloat.wgsl: IEEE arithmetic in integers, for the device sampler (sample.wgsl), so that its
// weights, sums and draw are runtime/sampler.rs's bit for bit on any adapter.
//
// Why integers: WGSL lets a compiler contract a * b + c into one fused rounding (NVIDIA's Vulkan
// driver does; SPIR-V's NoContraction is not something naga emits), allows division 2.5 ulps off,
// and has no f64 at all on Metal. sampler.rs computes its weights with separate f32 roundings
// (`exp_weight`: Rust never fuses) and sums them in f64. Integer operations are exact everywhere,
// so these functions give the CPU's bits on lavapipe, NVIDIA and Apple alike. They run on at
// most 64 values a token (the top-k survivors) and on the few logits a penalty touches, so their
// cost is noise beside the 1 MB of logits the pick reads.
//
// f32 (values as their u32 bits): add32, sub32, mul32, div32, round to nearest even, subnormal
//   results rounded as IEEE does (w = e · 2^k can be one); a non-finite input takes the hardware's
//   result (inf and NaN arithmetic is exact anyway).
// f64 (vec2<u32>(high word, low word) of the bits), only what the sampler needs: non-negative
//   finite values, add64 and mul64 (round to nearest even), ge64 / gt64 (the bits of
//   non-negative doubles order like the doubles), f64_of_f32 (exact), f64_of_u53 (N · 2^-53).
// Tested bit for bit against Rust's f32 / f64 arithmetic (wgpu_ops `softfloat_matches_ieee`,
// through sample.wgsl's `softfloat_check` entry).

// ---- f32 ----

// x's sign, exponent and significand with three extra low bits (guard, round, sticky):
// |x| = m · 2^e, m in [2^26, 2^27) (0 for a zero). Finite x only.
struct U32f {
    s: u32,
    e: i32,
    m: u32,
}

fn sf_unpack32(x: u32) -> U32f {
    let be = (x >> 23u) & 0xffu;
    let f = x & 0x7fffffu;
    if (be == 0u) {
        if (f == 0u) {
            return U32f(x & 0x80000000u, 0, 0u);
        }
        // Subnormal: f · 2^-149, normalised so its leading bit is bit 26.
        let sh = countLeadingZeros(f) - 5u;
        return U32f(x & 0x80000000u, -149 - i32(sh), f << sh);
    }
    return U32f(x & 0x80000000u, i32(be) - 153, (f | 0x800000u) << 3u);
}

// m · 2^e (m in [2^26, 2^27), or 0) with sign s, rounded to nearest even: overflow gives inf, an
// exponent below the normal range a subnormal (the significand shifted with its sticky bit).
// The biased exponent goes in as (be - 1) << 23 plus the significand, whose leading bit carries
// the 1 back, so a rounding that overflows the significand steps the exponent (to inf at the top).
fn sf_pack32(s: u32, e: i32, m_in: u32) -> u32 {
    if (m_in == 0u) {
        return s;
    }
    var m = m_in;
    var be = e + 153;
    if (be >= 255) {
        return s | 0x7f800000u;
    }
    if (be <= 0) {
        let sh = u32(1 - be);
        if (sh >= 27u) {
            m = 1u;
        } else {
            m = (m >> sh) | select(0u, 1u, (m & ((1u << sh) - 1u)) != 0u);
        }
        be = 1;
    }
    var bits = (u32(be - 1) << 23u) + (m >> 3u);
    let rest = m & 7u;
    if (rest > 4u || (rest == 4u && (bits & 1u) == 1u)) {
        bits += 1u;
    }
    return s | bits;
}

fn sf_finite32(x: u32) -> bool {
    return (x & 0x7f800000u) != 0x7f800000u;
}

// A right shift of m by d with the bits shifted out ORed into bit 0 (sticky).
fn sf_shr_sticky(m: u32, d: u32) -> u32 {
    if (d == 0u) {
        return m;
    }
    if (d >= 31u) {
        return select(0u, 1u, m != 0u);
    }
    return (m >> d) | select(0u, 1u, (m & ((1u << d) - 1u)) != 0u);
}

fn add32(a: u32, b: u32) -> u32 {
    if (!sf_finite32(a) || !sf_finite32(b)) {
        return bitcast<u32>(bitcast<f32>(a) + bitcast<f32>(b));
    }
    var x = sf_unpack32(a);
    var y = sf_unpack32(b);
    if (x.m == 0u && y.m == 0u) {
        return a & b & 0x80000000u;  // -0 only from -0 + -0
    }
    if (x.m == 0u) {
        return b;
    }
    if (y.m == 0u) {
        return a;
    }
    if (x.e < y.e || (x.e == y.e && x.m < y.m)) {
        let t = x;
        x = y;
        y = t;
    }
    // |x| >= |y|: y aligned to x's exponent (its lost bits kept as sticky).
    let ym = sf_shr_sticky(y.m, u32(x.e - y.e));
    var e = x.e;
    var m: u32;
    if (x.s == y.s) {
        m = x.m + ym;
        if (m >= 0x8000000u) {
            m = (m >> 1u) | (m & 1u);
            e += 1;
        }
    } else {
        m = x.m - ym;
        if (m == 0u) {
            return 0u;  // an exact cancellation is +0 when rounding to nearest
        }
        let sh = countLeadingZeros(m) - 5u;
        m <<= sh;
        e -= i32(sh);
    }
    return sf_pack32(x.s, e, m);
}

fn sub32(a: u32, b: u32) -> u32 {
    return add32(a, b ^ 0x80000000u);
}

fn mul32(a: u32, b: u32) -> u32 {
    if (!sf_finite32(a) || !sf_finite32(b)) {
        return bitcast<u32>(bitcast<f32>(a) * bitcast<f32>(b));
    }
    let x = sf_unpack32(a);
    let y = sf_unpack32(b);
    let s = x.s ^ y.s;
    if (x.m == 0u || y.m == 0u) {
        return s;
    }
    // The 24-bit significands' 48-bit product, from 12-bit halves: p = hi · 2^24 + lo.
    let xa = x.m >> 3u;
    let ya = y.m >> 3u;
    let x1 = xa >> 12u;
    let x0 = xa & 0xfffu;
    let y1 = ya >> 12u;
    let y0 = ya & 0xfffu;
    let mid = x1 * y0 + x0 * y1;
    var lo = x0 * y0 + ((mid & 0xfffu) << 12u);
    let hi = x1 * y1 + (mid >> 12u) + (lo >> 24u);
    lo &= 0xffffffu;
    // p in [2^46, 2^48): its leading bit moved to bit 26, the rest sticky.
    var sh = 20u;
    if (hi >= 0x800000u) {
        sh = 21u;
    }
    let m = (hi << (24u - sh)) | (lo >> sh) | select(0u, 1u, (lo & ((1u << sh) - 1u)) != 0u);
    return sf_pack32(s, x.e + y.e + 6 + i32(sh), m);
}

fn div32(a: u32, b: u32) -> u32 {
    if (!sf_finite32(a) || !sf_finite32(b) || (b & 0x7fffffffu) == 0u) {
        return bitcast<u32>(bitcast<f32>(a) / bitcast<f32>(b));
    }
    let x = sf_unpack32(a);
    let y = sf_unpack32(b);
    let s = x.s ^ y.s;
    if (x.m == 0u) {
        return s;
    }
    // Long division of the 24-bit significands, 27 quotient bits (leading bit 26) and the
    // remainder as sticky.
    let d = y.m >> 3u;
    var r = x.m >> 3u;
    var adj = 0;
    if (r < d) {
        r <<= 1u;
        adj = 1;
    }
    var q = 0u;
    for (var i = 0u; i < 27u; i++) {
        q <<= 1u;
        if (r >= d) {
            q |= 1u;
            r -= d;
        }
        r <<= 1u;
    }
    q |= select(0u, 1u, r != 0u);
    return sf_pack32(s, x.e - y.e - 26 - adj, q);
}

// ---- f64 (non-negative, finite) ----

// A 64-bit shift right with the bits shifted out ORed into bit 0.
fn sf_shr64_sticky(v: vec2<u32>, d: u32) -> vec2<u32> {
    if (d == 0u) {
        return v;
    }
    if (d >= 64u) {
        return vec2<u32>(0u, select(0u, 1u, (v.x | v.y) != 0u));
    }
    var hi: u32;
    var lo: u32;
    var lost: bool;
    if (d >= 32u) {
        let k = d - 32u;
        hi = 0u;
        lo = select(v.x >> k, v.x, k == 0u);
        lost = v.y != 0u || (k != 0u && (v.x & ((1u << k) - 1u)) != 0u);
    } else {
        hi = v.x >> d;
        lo = (v.y >> d) | (v.x << (32u - d));
        lost = (v.y & ((1u << d) - 1u)) != 0u;
    }
    return vec2<u32>(hi, lo | select(0u, 1u, lost));
}

// The significand with three extra low bits: m56 = (1.f) · 2^55 as (high, low) words.
fn sf_sig56(x: vec2<u32>) -> vec2<u32> {
    let h = (x.x & 0xfffffu) | 0x100000u;
    return vec2<u32>((h << 3u) | (x.y >> 29u), x.y << 3u);
}

// The double m56 · 2^(be - 1078) (m56's leading bit at bit 55), rounded to nearest even.
fn sf_pack64(be: u32, m: vec2<u32>) -> vec2<u32> {
    let rest = m.y & 7u;
    var hi = ((be - 1u) << 20u) + (m.x >> 3u);
    var lo = (m.y >> 3u) | (m.x << 29u);
    if (rest > 4u || (rest == 4u && (lo & 1u) == 1u)) {
        lo += 1u;
        if (lo == 0u) {
            hi += 1u;
        }
    }
    return vec2<u32>(hi, lo);
}

fn add64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    if ((a.x | a.y) == 0u) {
        return b;
    }
    if ((b.x | b.y) == 0u) {
        return a;
    }
    var x = a;
    var y = b;
    if (gt64(y, x)) {
        x = b;
        y = a;
    }
    var be = x.x >> 20u;
    let xm = sf_sig56(x);
    let ym = sf_shr64_sticky(sf_sig56(y), be - (y.x >> 20u));
    var lo = xm.y + ym.y;
    var hi = xm.x + ym.x + select(0u, 1u, lo < xm.y);
    if (hi >= 0x1000000u) {
        // A carry into bit 56: one place right, the lost bit sticky.
        lo = (lo >> 1u) | (hi << 31u) | (lo & 1u);
        hi >>= 1u;
        be += 1u;
    }
    return sf_pack64(be, vec2<u32>(hi, lo));
}

fn mul64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    if ((a.x | a.y) == 0u || (b.x | b.y) == 0u) {
        return vec2<u32>(0u, 0u);
    }
    // The 53-bit significands as four 16-bit limbs each; the 106-bit product in 16-bit columns.
    let ah = (a.x & 0xfffffu) | 0x100000u;
    let bh = (b.x & 0xfffffu) | 0x100000u;
    let al = array<u32, 4>(a.y & 0xffffu, a.y >> 16u, ah & 0xffffu, ah >> 16u);
    let bl = array<u32, 4>(b.y & 0xffffu, b.y >> 16u, bh & 0xffffu, bh >> 16u);
    var c: array<u32, 8>;
    for (var i = 0u; i < 4u; i++) {
        for (var j = 0u; j < 4u; j++) {
            let p = al[i] * bl[j];
            c[i + j] += p & 0xffffu;
            c[i + j + 1u] += p >> 16u;
        }
    }
    for (var k = 0u; k < 7u; k++) {
        c[k + 1u] += c[k] >> 16u;
        c[k] &= 0xffffu;
    }
    let w0 = c[0] | (c[1] << 16u);
    let w1 = c[2] | (c[3] << 16u);
    let w2 = c[4] | (c[5] << 16u);
    let w3 = c[6] | (c[7] << 16u);
    // p in [2^104, 2^106): shifted right by t + 32 so its leading bit lands on bit 55.
    var t = 17u;
    if ((w3 & 0x200u) != 0u) {
        t = 18u;
    }
    let lost = w0 != 0u || (w1 & ((1u << t) - 1u)) != 0u;
    let lo = (w1 >> t) | (w2 << (32u - t)) | select(0u, 1u, lost);
    let hi = (w2 >> t) | (w3 << (32u - t));
    // p · 2^(ea + eb - 2150) = m56 · 2^(32 + t + ea + eb - 2150), so be = 32 + t + ea + eb - 1072.
    let be = (a.x >> 20u) + (b.x >> 20u) + t + 32u - 1072u;
    return sf_pack64(be, vec2<u32>(hi, lo));
}

fn gt64(a: vec2<u32>, b: vec2<u32>) -> bool {
    return a.x > b.x || (a.x == b.x && a.y > b.y);
}

fn ge64(a: vec2<u32>, b: vec2<u32>) -> bool {
    return a.x > b.x || (a.x == b.x && a.y >= b.y);
}

// A non-negative f32 (its bits) as the same double.
fn f64_of_f32(x: u32) -> vec2<u32> {
    let f = x & 0x7fffffu;
    var be = (x >> 23u) & 0xffu;
    if (be == 0u) {
        if (f == 0u) {
            return vec2<u32>(0u, 0u);
        }
        // Subnormal: its leading bit becomes the implicit one.
        let lead = 31u - countLeadingZeros(f);
        let g = (f << (23u - lead)) & 0x7fffffu;
        return vec2<u32>(((lead + 874u) << 20u) | (g >> 3u), g << 29u);
    }
    return vec2<u32>(((be + 896u) << 20u) | (f >> 3u), f << 29u);
}

// N · 2^-53 for a 53-bit integer N = (high 21 bits, low 32 bits): rng.rs `next_f64`, exact.
fn f64_of_u53(n: vec2<u32>) -> vec2<u32> {
    if ((n.x | n.y) == 0u) {
        return vec2<u32>(0u, 0u);
    }
    var lead: u32;
    if (n.x != 0u) {
        lead = 63u - countLeadingZeros(n.x);
    } else {
        lead = 31u - countLeadingZeros(n.y);
    }
    // Shift left so the leading bit is bit 52 (bit 20 of the high word).
    let sh = 52u - lead;
    var hi: u32;
    var lo: u32;
    if (sh >= 32u) {
        hi = n.y << (sh - 32u);
        lo = 0u;
    } else if (sh == 0u) {
        hi = n.x;
        lo = n.y;
    } else {
        hi = (n.x << sh) | (n.y >> (32u - sh));
        lo = n.y << sh;
    }
    return vec2<u32>(((lead + 970u) << 20u) | (hi & 0xfffffu), lo);
}
