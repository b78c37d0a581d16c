// gemm.wgsl: gemm_big, prefill's dense matmul out[t] = x[t] · W_eᵀ for 4- or 8-bit codes in
// groups of a multiple of 16 (every matrix of the model), the rows of x past matmul.wgsl's
// 64-row tile (matmul.rs `matmul_q` picks; cpu/matmul.rs `matmul` is the twin: the same
// products, summed in another order). x f32 [rows, in] at x_off, out f32 [rows, out] at
// out_off (both offsets multiples of 4: x is read as vec4), matrix e of the stack. Layouts:
// quant.wgsl (MLX affine: w = scale·code + bias). matmul.rs makes two modules of this file,
// prefixed by `const GB_APART: bool` (see "Summation" below): "gemm" (true, the default) and
// "gemm_chain" (false, LILY_WGPU_GEMM=chain).
//
// Tile: a 128 (rows) × 128 (outputs) block a workgroup of 256 threads, each thread an 8 × 8
//   register micro-tile: rows 4ty..4ty+3 and 64+4ty..64+4ty+3, outputs 4tx..4tx+3 and
//   64+4tx..64+4tx+3 of the block (tx = li % 16, ty = li / 16). k in steps of 16.
// Workgroup memory: the step's x and dequantized weights transposed, k-major: gb_x[k][128 rows]
//   and gb_w[k][128 outputs] as vec4s (row r of step k at vec4 k·32 + r/4, lane r % 4), two
//   buffers of each (double-buffered): 2 × 2 × 16 × 128 × 4 = 32,768 bytes, exactly the 32 KiB
//   every adapter offers (Apple's limit); no padding, none needed (below).
// Inner loop, per k: 4 vec4 loads (x rows 0-3 and 4-7 of the micro-tile, weights 0-3 and 4-7)
//   for 64 FMAs (16 vec4 FMAs, the x lane broadcast): one workgroup-memory load per 16 FMAs,
//   against matmul.wgsl gemm's one per 8. A 32-wide subgroup (whatever the width: nothing
//   depends on it) spans 2 values of ty and 16 of tx: its weight loads are 16 consecutive vec4s
//   (256 bytes, no bank conflict), its x loads 2 addresses (broadcast).
// Staging, per step, thread li takes row / output r = li % 128 and half h = li / 128:
//   x: the vec4s kq = h and h + 2 of row t0 + r (k 4kq..4kq+3; a row past the end reads 0),
//   stored as 8 scalars gb_x[4kq + j][r]; weights: the 8 codes k 8h..8h+7 of output o0 + r
//   (4-bit: one u32; 8-bit: two; an output past the end reads the last output, never
//   written), one scale and bias (a step lies in one group: gs % 16 = 0), dequantized once
//   and stored as 8 scalars gb_w[8h + i][r]. A subgroup's stores are 32 consecutive floats
//   (conflict-free) and cost 16 stores a thread a step against 1,024 FMAs.
//   Double buffering with a register prefetch: step s+1's x, codes, scale and bias are loaded
//   into registers before step s's products (their latency hidden behind them), stored into the
//   other buffer after; one barrier a step. Both buffers' roles swap each step.
// Summation (GB_APART = true): each step's 16 products of an output are summed apart (from 0),
//   then added to the total, as matmul.wgsl's gemm does: the rounding error grows with
//   in / 16 + 16 terms rather than in (the CPU's scalar GEMM sums each group apart; wgpu_ops
//   `gemm_big_matches_the_cpu` measures ~1e-6 of a row's largest output at 4096 inputs, as
//   the old gemm). It costs a second set of 64 accumulators (128 registers of them against
//   64). GB_APART = false (module "gemm_chain") runs one FMA chain an output over all of k:
//   an error growing with in terms, ~2^-24·√in relative on random data (measured 3.8e-6 at
//   4096 inputs, 2.6e-6 at 2048: within the tests' F32_TOL 1e-5 by 2.6×), for 64
//   registers fewer (more workgroups an SM); which is faster is the H200's to say
//   (`lily lab --backend wgpu --cases gemm`).
// Launch: ceil(out / 128) · ceil(rows / 128) workgroups (index = row block · ceil(out / 128) +
//   output block), 256 threads each.
// Bindings: 0 params, 1 qw, 2 qs, 3 qb (quant.wgsl), 4 x (as vec4), 5 out.

struct P {
    m: QMat,
    rows: u32,
    e: u32,
    x_off: u32,
    out_off: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
    pad3: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> qw: array<u32>;
@group(0) @binding(2) var<storage, read> qs: array<u32>;
@group(0) @binding(3) var<storage, read> qb: array<u32>;
@group(0) @binding(4) var<storage, read> x4: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

// Rows and outputs a block; k a step; vec4s a buffer (16 k × 32 vec4s).
const GB_T: u32 = 128u;
const GB_K: u32 = 16u;
const GB_BUF: u32 = 512u;

var<workgroup> gb_x: array<vec4<f32>, 1024>;
var<workgroup> gb_w: array<vec4<f32>, 1024>;

// One step's staging, loaded ahead into registers: x's two vec4s, the codes (4-bit: w.x only),
// the scale and bias.
struct GbStage {
    x0: vec4<f32>,
    x1: vec4<f32>,
    w: vec2<u32>,
    s: f32,
    b: f32,
}

// Loads the staging of the step at k0 for row / output r, half h (the header's "Staging").
fn gb_load(k0: u32, t0: u32, orow: u32, r: u32, h: u32) -> GbStage {
    var st: GbStage;
    st.x0 = vec4<f32>(0.0);
    st.x1 = vec4<f32>(0.0);
    if (t0 + r < p.rows) {
        let xi = p.x_off / 4u + (t0 + r) * (p.m.inp / 4u) + k0 / 4u + h;
        st.x0 = x4[xi];
        st.x1 = x4[xi + 2u];
    }
    if (p.m.bits == 4u) {
        st.w = vec2<u32>(qw[orow * (p.m.inp / 8u) + k0 / 8u + h], 0u);
    } else {
        let wi = orow * (p.m.inp / 4u) + k0 / 4u + 2u * h;
        st.w = vec2<u32>(qw[wi], qw[wi + 1u]);
    }
    let g = orow * (p.m.inp / p.m.gs) + k0 / p.m.gs;
    st.s = q_sb(g, p.m.sb16, false);
    st.b = q_sb(g, p.m.sb16, true);
    return st;
}

// Dequantizes and stores a staging into the buffer at cb (vec4 index of its start).
fn gb_store(st: GbStage, cb: u32, r: u32, h: u32) {
    let rv = r / 4u;
    let rl = r % 4u;
    for (var j = 0u; j < 4u; j++) {
        gb_x[cb + (4u * h + j) * 32u + rv][rl] = st.x0[j];
        gb_x[cb + (4u * h + 8u + j) * 32u + rv][rl] = st.x1[j];
    }
    var lo: vec4<u32>;
    var hi: vec4<u32>;
    if (p.m.bits == 4u) {
        lo = (vec4<u32>(st.w.x) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(0xfu);
        hi = (vec4<u32>(st.w.x) >> vec4<u32>(16u, 20u, 24u, 28u)) & vec4<u32>(0xfu);
    } else {
        let sh = vec4<u32>(0u, 8u, 16u, 24u);
        lo = (vec4<u32>(st.w.x) >> sh) & vec4<u32>(0xffu);
        hi = (vec4<u32>(st.w.y) >> sh) & vec4<u32>(0xffu);
    }
    let wa = fma(vec4<f32>(st.s), vec4<f32>(lo), vec4<f32>(st.b));
    let wb = fma(vec4<f32>(st.s), vec4<f32>(hi), vec4<f32>(st.b));
    for (var i = 0u; i < 4u; i++) {
        gb_w[cb + (8u * h + i) * 32u + rv][rl] = wa[i];
        gb_w[cb + (8u * h + 4u + i) * 32u + rv][rl] = wb[i];
    }
}

// Writes one row of the micro-tile: outputs oa..oa+3 from a, oa+64..oa+67 from b.
fn gb_put(t: u32, oa: u32, a: vec4<f32>, b: vec4<f32>) {
    if (t >= p.rows) {
        return;
    }
    let base = p.out_off + t * p.m.out;
    for (var j = 0u; j < 4u; j++) {
        if (oa + j < p.m.out) {
            out[base + oa + j] = a[j];
        }
        if (oa + 64u + j < p.m.out) {
            out[base + oa + 64u + j] = b[j];
        }
    }
}

@compute @workgroup_size(256)
fn gemm_big(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let tiles_o = (p.m.out + GB_T - 1u) / GB_T;
    let wg = wg_index(wid);
    let o0 = (wg % tiles_o) * GB_T;
    let t0 = (wg / tiles_o) * GB_T;
    let tx = li % 16u;
    let ty = li / 16u;
    let r = li % GB_T;
    let h = li / GB_T;
    let orow = p.e * p.m.out + min(o0 + r, p.m.out - 1u);
    let steps = p.m.inp / GB_K;
    // The micro-tile's totals (c) and, with GB_APART, the step's sums (s): row i of the
    // micro-tile, outputs 0-3 (a) and 4-7 (b).
    var c0a = vec4<f32>(0.0); var c0b = vec4<f32>(0.0);
    var c1a = vec4<f32>(0.0); var c1b = vec4<f32>(0.0);
    var c2a = vec4<f32>(0.0); var c2b = vec4<f32>(0.0);
    var c3a = vec4<f32>(0.0); var c3b = vec4<f32>(0.0);
    var c4a = vec4<f32>(0.0); var c4b = vec4<f32>(0.0);
    var c5a = vec4<f32>(0.0); var c5b = vec4<f32>(0.0);
    var c6a = vec4<f32>(0.0); var c6b = vec4<f32>(0.0);
    var c7a = vec4<f32>(0.0); var c7b = vec4<f32>(0.0);
    var s0a = vec4<f32>(0.0); var s0b = vec4<f32>(0.0);
    var s1a = vec4<f32>(0.0); var s1b = vec4<f32>(0.0);
    var s2a = vec4<f32>(0.0); var s2b = vec4<f32>(0.0);
    var s3a = vec4<f32>(0.0); var s3b = vec4<f32>(0.0);
    var s4a = vec4<f32>(0.0); var s4b = vec4<f32>(0.0);
    var s5a = vec4<f32>(0.0); var s5b = vec4<f32>(0.0);
    var s6a = vec4<f32>(0.0); var s6b = vec4<f32>(0.0);
    var s7a = vec4<f32>(0.0); var s7b = vec4<f32>(0.0);
    if (steps > 0u) {
        gb_store(gb_load(0u, t0, orow, r, h), 0u, r, h);
    }
    workgroupBarrier();
    for (var st = 0u; st < steps; st++) {
        let cb = (st % 2u) * GB_BUF;
        let more = st + 1u < steps;
        var next: GbStage;
        if (more) {
            next = gb_load((st + 1u) * GB_K, t0, orow, r, h);
        }
        for (var kk = 0u; kk < GB_K; kk++) {
            let xa = gb_x[cb + kk * 32u + ty];
            let xb = gb_x[cb + kk * 32u + 16u + ty];
            let wa = gb_w[cb + kk * 32u + tx];
            let wb = gb_w[cb + kk * 32u + 16u + tx];
            s0a = fma(vec4<f32>(xa.x), wa, s0a); s0b = fma(vec4<f32>(xa.x), wb, s0b);
            s1a = fma(vec4<f32>(xa.y), wa, s1a); s1b = fma(vec4<f32>(xa.y), wb, s1b);
            s2a = fma(vec4<f32>(xa.z), wa, s2a); s2b = fma(vec4<f32>(xa.z), wb, s2b);
            s3a = fma(vec4<f32>(xa.w), wa, s3a); s3b = fma(vec4<f32>(xa.w), wb, s3b);
            s4a = fma(vec4<f32>(xb.x), wa, s4a); s4b = fma(vec4<f32>(xb.x), wb, s4b);
            s5a = fma(vec4<f32>(xb.y), wa, s5a); s5b = fma(vec4<f32>(xb.y), wb, s5b);
            s6a = fma(vec4<f32>(xb.z), wa, s6a); s6b = fma(vec4<f32>(xb.z), wb, s6b);
            s7a = fma(vec4<f32>(xb.w), wa, s7a); s7b = fma(vec4<f32>(xb.w), wb, s7b);
        }
        if (GB_APART) {
            c0a += s0a; c0b += s0b; c1a += s1a; c1b += s1b;
            c2a += s2a; c2b += s2b; c3a += s3a; c3b += s3b;
            c4a += s4a; c4b += s4b; c5a += s5a; c5b += s5b;
            c6a += s6a; c6b += s6b; c7a += s7a; c7b += s7b;
            s0a = vec4<f32>(0.0); s0b = vec4<f32>(0.0); s1a = vec4<f32>(0.0); s1b = vec4<f32>(0.0);
            s2a = vec4<f32>(0.0); s2b = vec4<f32>(0.0); s3a = vec4<f32>(0.0); s3b = vec4<f32>(0.0);
            s4a = vec4<f32>(0.0); s4b = vec4<f32>(0.0); s5a = vec4<f32>(0.0); s5b = vec4<f32>(0.0);
            s6a = vec4<f32>(0.0); s6b = vec4<f32>(0.0); s7a = vec4<f32>(0.0); s7b = vec4<f32>(0.0);
        }
        if (more) {
            gb_store(next, GB_BUF - cb, r, h);
        }
        workgroupBarrier();
    }
    if (!GB_APART) {
        c0a = s0a; c0b = s0b; c1a = s1a; c1b = s1b;
        c2a = s2a; c2b = s2b; c3a = s3a; c3b = s3b;
        c4a = s4a; c4b = s4b; c5a = s5a; c5b = s5b;
        c6a = s6a; c6b = s6b; c7a = s7a; c7b = s7b;
    }
    let ta = t0 + 4u * ty;
    let tb = ta + 64u;
    let oa = o0 + 4u * tx;
    gb_put(ta, oa, c0a, c0b);
    gb_put(ta + 1u, oa, c1a, c1b);
    gb_put(ta + 2u, oa, c2a, c2b);
    gb_put(ta + 3u, oa, c3a, c3b);
    gb_put(tb, oa, c4a, c4b);
    gb_put(tb + 1u, oa, c5a, c5b);
    gb_put(tb + 2u, oa, c6a, c6b);
    gb_put(tb + 3u, oa, c7a, c7b);
}
