// moe_mm.wgsl: prefill's grouped expert GEMMs with gemm.wgsl's 8 × 8 register micro-tile
// (cpu/moe.rs `moe_experts_prefill` is the twin), in place of moe.wgsl's moe_gate_up_mm and
// moe_down_mm (4 × 4 a thread) where the stacks allow: 4- or 8-bit codes in groups of a
// multiple of 16, gate|up's width a multiple of 128, down's outputs (hidden) of 256
// (moe.rs `mm8_ok`; LILY_WGPU_MOE_MM=mm8 takes these; the old entries are the default). moe.wgsl's moe_sort makes the
// tiles (≤ TM = 32 rows of one expert; the sort buffer's layout is in moe.wgsl's header) and
// moe_combine sums a token's slots after moe_down_mm8; both are unchanged. The parameter block
// and the bindings are the old entries' (moe.rs launches either with the same buffers).
//
// moe_gate_up_mm8: a workgroup of 128 threads takes a tile's ≤ 32 rows (the slots' x rows,
//   gathered) × 128 outputs of gate and the same 128 of up: act[slot, o] = silu(g) · u.
//   Grid: (tile bound) · width / 128; workgroups past the table's count return at once.
// moe_down_mm8: the same over act for 256 outputs of down: y[slot, o] = down_e[o] · act[slot].
//   Grid: (tile bound) · hidden / 256.
// Both: thread t holds rows 4rg..4rg+3 and 16+4rg..16+4rg+3 of the tile (rg = t % 4) ×
//   columns 4cg..4cg+3 and 128+4cg..128+4cg+3 (cg = t / 4) of the workgroup's 256: gate and
//   up of the same 4 outputs (gate|up, so that the thread applies silu(g) · u itself), or
//   outputs o0 + 4cg.. and o0 + 128 + 4cg.. (down). k in steps of 16: the 256 weight rows'
//   16 codes dequantized once into workgroup memory (thread t: column t and 128 + t, one
//   scale and bias each: gs % 16 = 0) and the 32 x rows staged, both k-major as vec4s
//   (column c of step k at vec4 k·64 + c/4, row r at k·8 + r/4; 16 KB + 2 KB); the next step's
//   codes, scales and x are loaded into registers while the step's products run. Per k, 4 vec4
//   loads for 64 FMAs (moe_gate_up_mm: 2 for 16); a 32-wide subgroup reads 8 consecutive
//   vec4s of weights (no bank conflict) and 4 of x (broadcast). A tile of ≤ 16 rows skips the
//   products of rows 16..31 (the branch is uniform). One FMA chain an output over k, as the
//   old entries (the tests' F32_TOL holds: K ≤ 2560 here).
// Bindings: as moe.wgsl's moe_gate_up_mm (1-6 gate and up, 7 x as vec4s, 8 the sort buffer,
// 9 act) and moe_down_mm (1-3 down, 4 act as vec4s, 5 the sort buffer, 6 y as vec4s).

struct P {
    m: QMat,
    m2: QMat,
    rows: u32,
    k: u32,
    n_exp: u32,
    norm_topk: u32,
    outs: u32,
    cw: u32,
    tiles: u32,
    ablate: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> qw: array<u32>;
@group(0) @binding(2) var<storage, read> qs: array<u32>;
@group(0) @binding(3) var<storage, read> qb: array<u32>;

// Rows of a tile (moe.wgsl TM); k a step.
const M8_TM: u32 = 32u;
const M8_K: u32 = 16u;

// The step's weights [16 k][256 columns] and x [16 k][32 rows], k-major (the header).
var<workgroup> m8_w: array<vec4<f32>, 1024>;
var<workgroup> m8_x: array<vec4<f32>, 128>;
// The tile's slots (rows past its count: 0xffffffff).
var<workgroup> m8_slot: array<u32, 32>;

// One step's staging held in registers: the 16 codes of column t (a) and 128 + t (b) (4-bit:
// .xy; 8-bit: .xyzw), their scales and biases, x's vec4.
struct M8Stage {
    ca: vec4<u32>,
    cb: vec4<u32>,
    sa: f32,
    ba: f32,
    sb: f32,
    bb: f32,
    xv: vec4<f32>,
}

// The 16 codes from input k0 of `row` of the matrix at binding 1.
fn m8_codes_q(m: QMat, row: u32, k0: u32) -> vec4<u32> {
    if (m.bits == 4u) {
        let w0 = row * (m.inp / 8u) + k0 / 8u;
        return vec4<u32>(qw[w0], qw[w0 + 1u], 0u, 0u);
    }
    let w0 = row * (m.inp / 4u) + k0 / 4u;
    return vec4<u32>(qw[w0], qw[w0 + 1u], qw[w0 + 2u], qw[w0 + 3u]);
}

// Dequantizes 16 codes (w = s·code + b) into column `col` of the weight buffer.
fn m8_put_w(c: vec4<u32>, bits: u32, s: f32, b: f32, col: u32) {
    let cv = col / 4u;
    let cl = col % 4u;
    for (var i = 0u; i < 4u; i++) {
        var q: vec4<u32>;
        if (bits == 4u) {
            let w = select(c.y, c.x, i < 2u);
            q = (vec4<u32>(w) >> (vec4<u32>(0u, 4u, 8u, 12u) + vec4<u32>((i % 2u) * 16u))) & vec4<u32>(0xfu);
        } else {
            q = (vec4<u32>(c[i]) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(0xffu);
        }
        let v = fma(vec4<f32>(s), vec4<f32>(q), vec4<f32>(b));
        for (var j = 0u; j < 4u; j++) {
            m8_w[(4u * i + j) * 64u + cv][cl] = v[j];
        }
    }
}

// Stores a staging: the two columns' weights and x's vec4 (row t % 32, inputs 4 (t / 32) ..).
fn m8_store(st: M8Stage, bits_a: u32, bits_b: u32, t: u32) {
    m8_put_w(st.ca, bits_a, st.sa, st.ba, t);
    m8_put_w(st.cb, bits_b, st.sb, st.bb, 128u + t);
    let r = t % 32u;
    let kq = t / 32u;
    for (var j = 0u; j < 4u; j++) {
        m8_x[(4u * kq + j) * 8u + r / 4u][r % 4u] = st.xv[j];
    }
}

// The tile's slots into m8_slot (all threads call it: it ends in a barrier).
fn m8_slots(li: u32, n: u32, s: u32) {
    if (li < M8_TM) {
        m8_slot[li] = select(0xffffffffu, s, li < n);
    }
    workgroupBarrier();
}

// The micro-tile: totals of rows 0-7 (a: columns 0-3, b: 128-131 of the thread's), as one value.
struct M8Acc {
    a0: vec4<f32>, b0: vec4<f32>, a1: vec4<f32>, b1: vec4<f32>,
    a2: vec4<f32>, b2: vec4<f32>, a3: vec4<f32>, b3: vec4<f32>,
    a4: vec4<f32>, b4: vec4<f32>, a5: vec4<f32>, b5: vec4<f32>,
    a6: vec4<f32>, b6: vec4<f32>, a7: vec4<f32>, b7: vec4<f32>,
}

// One step's products over the staged buffers into c (rows 16..31 only when `full`).
fn m8_step(c: M8Acc, rg: u32, cg: u32, full: bool) -> M8Acc {
    var a = c;
    if (full) {
        for (var kk = 0u; kk < M8_K; kk++) {
            let xa = m8_x[kk * 8u + rg];
            let xb = m8_x[kk * 8u + 4u + rg];
            let wa = m8_w[kk * 64u + cg];
            let wb = m8_w[kk * 64u + 32u + cg];
            a.a0 = fma(vec4<f32>(xa.x), wa, a.a0); a.b0 = fma(vec4<f32>(xa.x), wb, a.b0);
            a.a1 = fma(vec4<f32>(xa.y), wa, a.a1); a.b1 = fma(vec4<f32>(xa.y), wb, a.b1);
            a.a2 = fma(vec4<f32>(xa.z), wa, a.a2); a.b2 = fma(vec4<f32>(xa.z), wb, a.b2);
            a.a3 = fma(vec4<f32>(xa.w), wa, a.a3); a.b3 = fma(vec4<f32>(xa.w), wb, a.b3);
            a.a4 = fma(vec4<f32>(xb.x), wa, a.a4); a.b4 = fma(vec4<f32>(xb.x), wb, a.b4);
            a.a5 = fma(vec4<f32>(xb.y), wa, a.a5); a.b5 = fma(vec4<f32>(xb.y), wb, a.b5);
            a.a6 = fma(vec4<f32>(xb.z), wa, a.a6); a.b6 = fma(vec4<f32>(xb.z), wb, a.b6);
            a.a7 = fma(vec4<f32>(xb.w), wa, a.a7); a.b7 = fma(vec4<f32>(xb.w), wb, a.b7);
        }
    } else {
        for (var kk = 0u; kk < M8_K; kk++) {
            let xa = m8_x[kk * 8u + rg];
            let wa = m8_w[kk * 64u + cg];
            let wb = m8_w[kk * 64u + 32u + cg];
            a.a0 = fma(vec4<f32>(xa.x), wa, a.a0); a.b0 = fma(vec4<f32>(xa.x), wb, a.b0);
            a.a1 = fma(vec4<f32>(xa.y), wa, a.a1); a.b1 = fma(vec4<f32>(xa.y), wb, a.b1);
            a.a2 = fma(vec4<f32>(xa.z), wa, a.a2); a.b2 = fma(vec4<f32>(xa.z), wb, a.b2);
            a.a3 = fma(vec4<f32>(xa.w), wa, a.a3); a.b3 = fma(vec4<f32>(xa.w), wb, a.b3);
        }
    }
    return a;
}

// Row i (0..7) of the micro-tile: its tile row and its two column vec4s.
fn m8_row(rg: u32, i: u32) -> u32 {
    return select(16u + 4u * rg + i - 4u, 4u * rg + i, i < 4u);
}

fn m8_get(a: M8Acc, i: u32) -> array<vec4<f32>, 2> {
    switch (i) {
        case 0u: { return array<vec4<f32>, 2>(a.a0, a.b0); }
        case 1u: { return array<vec4<f32>, 2>(a.a1, a.b1); }
        case 2u: { return array<vec4<f32>, 2>(a.a2, a.b2); }
        case 3u: { return array<vec4<f32>, 2>(a.a3, a.b3); }
        case 4u: { return array<vec4<f32>, 2>(a.a4, a.b4); }
        case 5u: { return array<vec4<f32>, 2>(a.a5, a.b5); }
        case 6u: { return array<vec4<f32>, 2>(a.a6, a.b6); }
        default: { return array<vec4<f32>, 2>(a.a7, a.b7); }
    }
}

fn m8_zero() -> M8Acc {
    let z = vec4<f32>(0.0);
    return M8Acc(z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z);
}

// ---- moe_gate_up_mm8

@group(0) @binding(4) var<storage, read> uw: array<u32>;
@group(0) @binding(5) var<storage, read> us: array<u32>;
@group(0) @binding(6) var<storage, read> ub: array<u32>;
@group(0) @binding(7) var<storage, read> g8_x: array<vec4<f32>>;
@group(0) @binding(8) var<storage, read> g8_sort: array<u32>;
@group(0) @binding(9) var<storage, read_write> g8_act: array<f32>;

// q_sb (quant.wgsl) for up's scales and biases.
fn m8_u_sb(i: u32, sb16: u32, is_bias: bool) -> f32 {
    let j = sb_idx(i, sb16);
    var w: u32;
    if (is_bias) { w = ub[j]; } else { w = us[j]; }
    return sb_val(w, i, sb16);
}

fn m8_codes_u(m: QMat, row: u32, k0: u32) -> vec4<u32> {
    if (m.bits == 4u) {
        let w0 = row * (m.inp / 8u) + k0 / 8u;
        return vec4<u32>(uw[w0], uw[w0 + 1u], 0u, 0u);
    }
    let w0 = row * (m.inp / 4u) + k0 / 4u;
    return vec4<u32>(uw[w0], uw[w0 + 1u], uw[w0 + 2u], uw[w0 + 3u]);
}

// Staging of step k0: gate and up row `wrow`, x of token xt (row live: xr < n).
fn g8_load(k0: u32, wrow: u32, xt: u32, live: bool, xq: u32) -> M8Stage {
    var st: M8Stage;
    st.ca = m8_codes_q(p.m, wrow, k0);
    st.cb = m8_codes_u(p.m2, wrow, k0);
    let g = wrow * (p.m.inp / p.m.gs) + k0 / p.m.gs;
    st.sa = q_sb(g, p.m.sb16, false);
    st.ba = q_sb(g, p.m.sb16, true);
    let g2 = wrow * (p.m2.inp / p.m2.gs) + k0 / p.m2.gs;
    st.sb = m8_u_sb(g2, p.m2.sb16, false);
    st.bb = m8_u_sb(g2, p.m2.sb16, true);
    st.xv = vec4<f32>(0.0);
    if (live) {
        st.xv = g8_x[(xt * p.m.inp + k0) / 4u + xq];
    }
    return st;
}

@compute @workgroup_size(128)
fn moe_gate_up_mm8(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let width = p.m.out;
    let hid = p.m.inp;
    let nob = width / 128u;
    let wg = wg_index(wid);
    let tile = wg / nob;
    if (tile >= g8_sort[0]) {
        return;
    }
    let e = g8_sort[1u + 3u * tile];
    let start = g8_sort[2u + 3u * tile];
    let n = g8_sort[3u + 3u * tile];
    let o0 = (wg % nob) * 128u;
    let list = 1u + 3u * p.tiles + start;
    var s0 = 0u;
    if (li < n && li < M8_TM) {
        s0 = g8_sort[list + li];
    }
    m8_slots(li, n, s0);
    let rg = li % 4u;
    let cg = li / 4u;
    let full = n > 16u;
    let wrow = e * width + o0 + li;
    let xr = li % 32u;
    let xq = li / 32u;
    let live = xr < n;
    let xt = select(0u, m8_slot[xr] / p.k, live);
    var acc = m8_zero();
    var st = g8_load(0u, wrow, xt, live, xq);
    for (var k0 = 0u; k0 < hid; k0 += M8_K) {
        m8_store(st, p.m.bits, p.m2.bits, li);
        workgroupBarrier();
        if (k0 + M8_K < hid) {
            st = g8_load(k0 + M8_K, wrow, xt, live, xq);
        }
        acc = m8_step(acc, rg, cg, full);
        workgroupBarrier();
    }
    for (var i = 0u; i < 8u; i++) {
        let r = m8_row(rg, i);
        if (r < n) {
            let v = m8_get(acc, i);
            let base = m8_slot[r] * width + o0 + 4u * cg;
            for (var j = 0u; j < 4u; j++) {
                g8_act[base + j] = silu_f(v[0][j]) * v[1][j];
            }
        }
    }
}

// ---- moe_down_mm8

@group(0) @binding(4) var<storage, read> d8_act: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> d8_sort: array<u32>;
@group(0) @binding(6) var<storage, read_write> d8_y: array<vec4<f32>>;

// Staging of step k0: down rows `wrow` and wrow + 128, act of slot xs (row live: xr < n).
fn d8_load(k0: u32, wrow: u32, xs: u32, live: bool, xq: u32) -> M8Stage {
    var st: M8Stage;
    st.ca = m8_codes_q(p.m, wrow, k0);
    st.cb = m8_codes_q(p.m, wrow + 128u, k0);
    let ng = p.m.inp / p.m.gs;
    let g = wrow * ng + k0 / p.m.gs;
    st.sa = q_sb(g, p.m.sb16, false);
    st.ba = q_sb(g, p.m.sb16, true);
    st.sb = q_sb(g + 128u * ng, p.m.sb16, false);
    st.bb = q_sb(g + 128u * ng, p.m.sb16, true);
    st.xv = vec4<f32>(0.0);
    if (live) {
        st.xv = d8_act[(xs * p.m.inp + k0) / 4u + xq];
    }
    return st;
}

@compute @workgroup_size(128)
fn moe_down_mm8(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let hid = p.m.out;
    let width = p.m.inp;
    let nob = hid / 256u;
    let wg = wg_index(wid);
    let tile = wg / nob;
    if (tile >= d8_sort[0]) {
        return;
    }
    let e = d8_sort[1u + 3u * tile];
    let start = d8_sort[2u + 3u * tile];
    let n = d8_sort[3u + 3u * tile];
    let o0 = (wg % nob) * 256u;
    let list = 1u + 3u * p.tiles + start;
    var s0 = 0u;
    if (li < n && li < M8_TM) {
        s0 = d8_sort[list + li];
    }
    m8_slots(li, n, s0);
    let rg = li % 4u;
    let cg = li / 4u;
    let full = n > 16u;
    let wrow = e * hid + o0 + li;
    let xr = li % 32u;
    let xq = li / 32u;
    let live = xr < n;
    let xs = select(0u, m8_slot[xr], live);
    var acc = m8_zero();
    var st = d8_load(0u, wrow, xs, live, xq);
    for (var k0 = 0u; k0 < width; k0 += M8_K) {
        m8_store(st, p.m.bits, p.m.bits, li);
        workgroupBarrier();
        if (k0 + M8_K < width) {
            st = d8_load(k0 + M8_K, wrow, xs, live, xq);
        }
        acc = m8_step(acc, rg, cg, full);
        workgroupBarrier();
    }
    for (var i = 0u; i < 8u; i++) {
        let r = m8_row(rg, i);
        if (r < n) {
            let v = m8_get(acc, i);
            let base = (m8_slot[r] * hid + o0 + 4u * cg) / 4u;
            d8_y[base] = v[0];
            d8_y[base + 32u] = v[1];
        }
    }
}
