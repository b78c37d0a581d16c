// rope.wgsl: RoPE's angle, exact in integers (attention.wgsl's qk_norm_rope and
// attn_dec_rope.wgsl's folded norm and rotation use it; prefixed to both). The host gives each
// inv_freq(i) / 2π as a 64-bit fixed-point fraction of a turn (attention.rs `rope_params`, from
// f64 as the CPU computes it); pos · inv_freq is then exact mod one turn here, reduced to an
// octant, and sin / cos are polynomials on [-π/4, π/4]: no f64, no reliance on a GPU's sin at
// large arguments.

// The full 64-bit product a · b as (lo, hi).
fn mul_wide(a: u32, b: u32) -> vec2<u32> {
    let a0 = a & 0xffffu;
    let a1 = a >> 16u;
    let b0 = b & 0xffffu;
    let b1 = b >> 16u;
    let p00 = a0 * b0;
    let p01 = a0 * b1;
    let p10 = a1 * b0;
    let p11 = a1 * b1;
    let mid = (p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
    let lo = (mid << 16u) | (p00 & 0xffffu);
    let hi = p11 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u);
    return vec2<u32>(lo, hi);
}

// (cos, sin) of pos · f turns, f a 64-bit fraction (lo, hi) of a turn.
fn turn_cos_sin(pos: u32, f: vec2<u32>) -> vec2<f32> {
    let a = mul_wide(pos, f.x);
    // The product's bits 32..95 of 2^-64 turns, mod one turn: top word, then the next.
    let top = a.y + pos * f.y;
    // Nearest quarter turn q, remainder in [-1/8, 1/8) turn.
    let t = top + 0x20000000u;
    let q = t >> 30u;
    let r = i32(t & 0x3fffffffu) - 0x20000000;
    let x = (f32(r) + f32(a.x) * 2.3283064365386963e-10) * 1.4629180792671596e-9; // 2π / 2^32
    let x2 = x * x;
    let s = x + x * x2 * (-1.6666667e-1 + x2 * (8.3333333e-3 + x2 * (-1.9841270e-4
        + x2 * (2.7557319e-6 + x2 * -2.5052108e-8))));
    let c = 1.0 + x2 * (-0.5 + x2 * (4.1666668e-2 + x2 * (-1.3888889e-3 + x2 * (2.4801587e-5
        + x2 * (-2.7557319e-7 + x2 * 2.0876757e-9)))));
    switch q {
        case 0u: { return vec2<f32>(c, s); }
        case 1u: { return vec2<f32>(-s, c); }
        case 2u: { return vec2<f32>(-c, -s); }
        default: { return vec2<f32>(s, -c); }
    }
}
