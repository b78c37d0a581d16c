// matmul.wgsl: matmul_q, out[t] = x[t] · Wᵀ for a quantized (or dense) matrix (cpu/matmul.rs
// `matmul`: its GEMV and GEMM paths are the twins of gemv_v4 and gemm). x f32 [rows, in] at
// x_off, out f32 [rows, out] at out_off; matrix e of the stack. Layouts: quant.wgsl.
//
// gemv_v4 (rows ≤ 8, 4- or 8-bit codes, a group a whole number of 16-byte code words): the
//   decode path, bound by the weight stream. Codes are read as vec4<u32> (binding 1 seen as
//   qw4), each thread 4 output rows × one 16-byte word of each per step (4 independent 16-byte
//   loads in flight), `lanes` threads (a power of two, 4..256, chosen by the host to make
//   enough workgroups) striding a row, so a workgroup of 256 covers 1024 / lanes rows. x is
//   staged once per workgroup in workgroup memory (4096 elements a pass, 16 KB), pre-scaled
//   into "slot order": code i of a 32-bit word is extracted as (word & (mask << bits·(i % m)))
//   OR'd into the mantissa of 2^23, minus 2^23 (exact; no int-to-float conversion, a
//   reduced-rate instruction on NVIDIA), so it comes out times 2^(bits·(i % m)) and x is
//   pre-multiplied by the inverse power of two (exact). x is staged word-major (vec4 j of word
//   c at j · words + c) so that a warp's reads hit consecutive banks: word after word, a
//   quarter-warp's 8 lanes 128 bytes apart all read the same 4 banks, 8 times over, and the
//   lm_head ran at the workgroup memory's rate (1.0 TB/s). Σ code·x and the word's Σ x (from
//   the scaled x it reads, times the powers of two back: exact) give scale·Σ code·x +
//   bias·Σ x, the CPU GEMV's identity; the 4 rows share every x read. One tree over the lanes
//   in workgroup memory at the end. Workgroup index = block · rows + t (the rows of x of one
//   block run side by side and share the weights through the cache); ceil(out · lanes / 1024)
//   · rows workgroups; 20 KB of workgroup memory.
// gemv_v5 (LILY_WGPU_GEMV=v5; the same launch, parameters, bindings and modes as gemv_v4): x
//   quantized once per workgroup to two int8 levels per 16-byte code word (x ≈ d·(q1 + q2/254),
//   d = max |x| / 127 over the word's 32 (4-bit) or 16 (8-bit) elements: an error ≤ max |x| /
//   64,516, 15 bits), so that a code word's products are 4-way integer dot products
//   (dot4I8Packed: DP4A on NVIDIA, exact i32 sums): a 4-bit u32 of codes splits into its even
//   and odd nibbles by two masks, each against 4 packed x bytes in matching order; 8-bit codes
//   are made signed by flipping their top bit (c − 128), the word's 128·Σq added back. A word
//   row costs ~45 instructions against gemv_v4's ~160 (the lab found gemv_v4 bound by its
//   arithmetic, not its loads). Staging: 4 threads a word (a u32 of codes each), the word's
//   max |x| and Σ x met through workgroup memory. 128 words a pass (4096 4-bit or 2048 8-bit
//   elements): q [4][128] vec4<u32> (q1 even/low, q1 odd, q2 even/low, q2 odd) and per word
//   (d / 254, Σ x, 8-bit correction): 10 KB; with the tree's 4 KB and the exchange's 4 KB, 18 KB.
// gemv (rows = 1, the shapes gemv_v4 does not take: dense, 2-bit, odd groups): scalar, a
//   workgroup of 256 = 8 outputs × 32 threads striding the row's code words; ceil(out / 8)
//   workgroups.
// gemm (every other case; any shape): a 64 (rows) × 64 (outputs) tile a workgroup of 256, each
//   thread a 4 × 4 register micro-tile (rows ty + 16r, outputs tx + 16c: conflict-free vec4
//   reads), k in steps of 32. Each step dequantizes the weight tile once into workgroup memory
//   (8 weights a thread, one scale and bias per 8) and stages the x tile, both [64][32] padded
//   to 36 floats a row (9 KB each); the inner loop reads both as vec4 (8 reads per 64 FMAs).
//   Each step's 32 products are summed apart before joining the total (error ~ in / 32 + 32
//   terms). ceil(out / 64) · ceil(rows / 64) workgroups.
// Bindings: 0 params, 1 qw, 2 qs, 3 qb (quant.wgsl), 4 x, 5 out.

struct P {
    m: QMat,
    rows: u32,
    e: u32,
    x_off: u32,
    out_off: u32,
    // gemv_v4: threads a row (a power of two, 4..256).
    lanes: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> qw: array<u32>;
@group(0) @binding(2) var<storage, read> qs: array<u32>;
@group(0) @binding(3) var<storage, read> qb: array<u32>;
@group(0) @binding(4) var<storage, read> x: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn gemv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let o = wg_index(wid) * 8u + li / 32u;
    let lane = li % 32u;
    var acc = 0.0;
    if (o < p.m.out) {
        if (p.m.bits == 32u) {
            for (var k = lane; k < p.m.inp; k += 32u) {
                acc += q_weight(p.m, p.e, o, k) * x[p.x_off + k];
            }
        } else {
            let per = 32u / p.m.bits;
            let wpr = p.m.inp / per;
            let row = p.e * p.m.out + o;
            let mask = (1u << p.m.bits) - 1u;
            for (var j = lane; j < wpr; j += 32u) {
                let word = qw[row * wpr + j];
                let k0 = j * per;
                // scale·Σ code·x + bias·Σ x over the word's elements: the same products as
                // q_weight's (s·code + b)·x up to the order of the f32 sums.
                var sq = 0.0;
                var sx = 0.0;
                for (var i = 0u; i < per; i++) {
                    let xv = x[p.x_off + k0 + i];
                    sq += f32((word >> (i * p.m.bits)) & mask) * xv;
                    sx += xv;
                }
                let g = row * (p.m.inp / p.m.gs) + k0 / p.m.gs;
                acc += q_sb(g, p.m.sb16, false) * sq + q_sb(g, p.m.sb16, true) * sx;
            }
        }
    }
    red[li] = acc;
    workgroupBarrier();
    for (var s = 16u; s > 0u; s >>= 1u) {
        if (lane < s) {
            red[li] += red[li + s];
        }
        workgroupBarrier();
    }
    if (lane == 0u && o < p.m.out) {
        out[p.out_off + o] = red[li];
    }
}

// x elements gemv_v4 stages a pass.
const GV_CHUNK: u32 = 4096u;
// x of the pass in slot scale (see the header), word-major: vec4 j of code word c of the pass at
// j · words + c, so the lanes of a warp, reading consecutive words' j-th vec4s, read consecutive
// 16 bytes (a word's 8 vec4s side by side put 8 lanes of a quarter-warp on the same 4 banks).
var<workgroup> gv_x: array<vec4<f32>, 1024>;
// The 4 rows' partial sums of every thread, [4][256].
var<workgroup> gv_red: array<f32, 1024>;

// The rms_norm folded in: this workgroup's own sum of squares of its row of h (8 KB at the
// model's width: cheaper than a launch of its own), returning 1 / rms; the first block of the
// row (`first`) writes the normed row back once (the experts read it). Uniform control flow.
fn gv_norm(xrow: u32, inp: u32, li: u32, first: bool) -> f32 {
    var ss = 0.0;
    for (var v = li; v < inp / 4u; v += 256u) {
        let h = vx[xrow + v];
        ss += dot(h, h);
    }
    gv_red[li] = ss;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (li < s) {
            gv_red[li] += gv_red[li + s];
        }
        workgroupBarrier();
    }
    let rn = 1.0 / sqrt(gv_red[0] / f32(inp) + pv.eps);
    if (first) {
        for (var v = li; v < inp / 4u; v += 256u) {
            vxn[xrow + v] = vx[xrow + v] * rn * vaux[v];
        }
    }
    // gv_red is written again only after the caller's next barrier.
    return rn;
}

// The 4 rows' sums a of every thread added over the lanes of its row group (a tree in workgroup
// memory from step `tree` down: lanes / 2, or 0 under the lab's ablation), and lane r of the
// group writes row o0 + r of row t's output of matrix mi as the output mode says.
// (gv_red's last readers, gv_norm's, are behind the pass loop's barriers.)
fn gv_finish(li: u32, lane: u32, tree: u32, o0: u32, t: u32, out: u32, mi: u32, a: vec4<f32>) {
    gv_red[li] = a.x;
    gv_red[256u + li] = a.y;
    gv_red[512u + li] = a.z;
    gv_red[768u + li] = a.w;
    workgroupBarrier();
    for (var s = tree; s > 0u; s >>= 1u) {
        if (lane < s) {
            gv_red[li] += gv_red[li + s];
            gv_red[256u + li] += gv_red[256u + li + s];
            gv_red[512u + li] += gv_red[512u + li + s];
            gv_red[768u + li] += gv_red[768u + li + s];
        }
        workgroupBarrier();
    }
    if (lane < 4u && o0 + lane < out) {
        let i = t * out + o0 + lane;
        let v = gv_red[lane * 256u + li - lane];
        if (pv.omode == 0u) {
            vout(mi, i, v);
        } else if (pv.omode == 1u) {
            vout(mi, i, vget(mi, i) + v);
        } else {
            vout(mi, i, vget(mi, i) + (vr[i] + sigmoid_f(vsg[t]) * v));
        }
    }
}

@compute @workgroup_size(256)
fn gemv_v4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let wg = wg_index(wid);
    let t = wg % pv.rows;
    let slot = gv_slot(wg / pv.rows);
    let mi = slot.x;
    let blk = slot.y;
    let m = pv.ms[mi];
    let lanes = pv.lanes[mi];
    let lane = li % lanes;
    let o0 = (blk * (256u / lanes) + li / lanes) * 4u;
    let bits = m.bits;
    let epv = 128u / bits;
    let v4row = m.inp / epv;
    let gpr = m.inp / m.gs;
    // Rows past the end read the last row (in bounds) and are not written.
    let last = m.out - 1u;
    let r0 = pv.e * m.out + min(o0, last);
    let r1 = pv.e * m.out + min(o0 + 1u, last);
    let r2 = pv.e * m.out + min(o0 + 2u, last);
    let r3 = pv.e * m.out + min(o0 + 3u, last);
    var sc = vec4<f32>(1.0, 1.0 / 256.0, 1.0, 1.0 / 256.0);
    var isc = vec4<f32>(1.0, 256.0, 1.0, 256.0);
    if (bits == 4u) {
        sc = vec4<f32>(1.0, 1.0 / 16.0, 1.0 / 256.0, 1.0 / 4096.0);
        isc = vec4<f32>(1.0, 16.0, 256.0, 4096.0);
    }
    let xrow = t * (m.inp / 4u);
    // rms_norm folded in (gv_norm), then x = h · r · nw when staged.
    var rn = 1.0;
    if (pv.xmode == 1u && (pv.ablate & 4u) == 0u) {
        rn = gv_norm(xrow, m.inp, li, wg < pv.rows);
    }
    var a0 = 0.0;
    var a1 = 0.0;
    var a2 = 0.0;
    var a3 = 0.0;
    for (var k0 = 0u; k0 < m.inp; k0 += GV_CHUNK) {
        let kn = min(GV_CHUNK, m.inp - k0);
        let nv = kn / epv;
        let cb = k0 / epv;
        // The first code words of the pass are loaded before x is staged (their latency
        // overlaps the staging's), the rest one step ahead of their use.
        var c = lane;
        var q0 = vec4<u32>(0u);
        var q1 = vec4<u32>(0u);
        var q2 = vec4<u32>(0u);
        var q3 = vec4<u32>(0u);
        if (c < nv) {
            q0 = vw(mi, r0 * v4row + cb + c);
            q1 = vw(mi, r1 * v4row + cb + c);
            q2 = vw(mi, r2 * v4row + cb + c);
            q3 = vw(mi, r3 * v4row + cb + c);
        }
        // The previous pass's readers are done before x is overwritten.
        if ((pv.ablate & 1u) == 0u) {
            workgroupBarrier();
        }
        // Staged word-major (consecutive invocations write consecutive slots; each reads x
        // 32 bytes or 128 apart, from the cache).
        let npw = epv / 4u;
        let staged = select(kn / 4u, 0u, (pv.ablate & 1u) != 0u);
        for (var u = li; u < staged; u += 256u) {
            let v = (u % nv) * npw + u / nv;
            gv_x[u] = pv_x(xrow, k0 / 4u + v, rn) * sc;
        }
        if ((pv.ablate & 1u) == 0u) {
            workgroupBarrier();
        }
        for (; c < nv; c += lanes) {
            let w0 = q0;
            let w1 = q1;
            let w2 = q2;
            let w3 = q3;
            let cn = c + lanes;
            if (cn < nv) {
                q0 = vw(mi, r0 * v4row + cb + cn);
                q1 = vw(mi, r1 * v4row + cb + cn);
                q2 = vw(mi, r2 * v4row + cb + cn);
                q3 = vw(mi, r3 * v4row + cb + cn);
            }
            var d0 = 0.0;
            var d1 = 0.0;
            var d2 = 0.0;
            var d3 = 0.0;
            var sx = 0.0;
            var g = 0u;
            if ((pv.ablate & 8u) != 0u) {
                // The loads kept, the arithmetic gone (lab ablation).
                d0 = bitcast<f32>(w0.x ^ w0.y ^ w0.z ^ w0.w);
                d1 = bitcast<f32>(w1.x ^ w1.y ^ w1.z ^ w1.w);
                d2 = bitcast<f32>(w2.x ^ w2.y ^ w2.z ^ w2.w);
                d3 = bitcast<f32>(w3.x ^ w3.y ^ w3.z ^ w3.w);
            } else if (bits == 4u) {
                g = (k0 + c * 32u) / m.gs;
                let x0 = gv_x[c];
                let x1 = gv_x[nv + c];
                let x2 = gv_x[2u * nv + c];
                let x3 = gv_x[3u * nv + c];
                let x4_ = gv_x[4u * nv + c];
                let x5 = gv_x[5u * nv + c];
                let x6 = gv_x[6u * nv + c];
                let x7 = gv_x[7u * nv + c];
                // Σ x of the word from the scaled x (a power of two a slot: exact).
                sx = dot(((x0 + x1) + (x2 + x3)) + ((x4_ + x5) + (x6 + x7)), isc);
                d0 = q4_word(w0, x0, x1, x2, x3, x4_, x5, x6, x7);
                d1 = q4_word(w1, x0, x1, x2, x3, x4_, x5, x6, x7);
                d2 = q4_word(w2, x0, x1, x2, x3, x4_, x5, x6, x7);
                d3 = q4_word(w3, x0, x1, x2, x3, x4_, x5, x6, x7);
            } else {
                g = (k0 + c * 16u) / m.gs;
                let x0 = gv_x[c];
                let x1 = gv_x[nv + c];
                let x2 = gv_x[2u * nv + c];
                let x3 = gv_x[3u * nv + c];
                sx = dot((x0 + x1) + (x2 + x3), isc);
                d0 = q8_word(w0, x0, x1, x2, x3);
                d1 = q8_word(w1, x0, x1, x2, x3);
                d2 = q8_word(w2, x0, x1, x2, x3);
                d3 = q8_word(w3, x0, x1, x2, x3);
            }
            a0 += vsb(mi, r0 * gpr + g, m.sb16, false) * d0 + vsb(mi, r0 * gpr + g, m.sb16, true) * sx;
            a1 += vsb(mi, r1 * gpr + g, m.sb16, false) * d1 + vsb(mi, r1 * gpr + g, m.sb16, true) * sx;
            a2 += vsb(mi, r2 * gpr + g, m.sb16, false) * d2 + vsb(mi, r2 * gpr + g, m.sb16, true) * sx;
            a3 += vsb(mi, r3 * gpr + g, m.sb16, false) * d3 + vsb(mi, r3 * gpr + g, m.sb16, true) * sx;
        }
    }
    gv_finish(li, lane, select(lanes / 2u, 0u, (pv.ablate & 2u) != 0u), o0, t, m.out, mi, vec4<f32>(a0, a1, a2, a3));
}

// ---- gemv_v5 (header; q2x.wgsl holds its quantized x): the loads of x and the scales.

// Scale and bias of group i of matrix mi (one load each, no select between them).
fn g5_sb(mi: u32, i: u32, sb16: u32) -> vec2<f32> {
    let j = sb_idx(i, sb16);
    var s: u32;
    var b: u32;
    switch mi {
        case 0u: { s = vs0[j]; b = vb0[j]; }
        case 1u: { s = vs1[j]; b = vb1[j]; }
        case 2u: { s = vs2[j]; b = vb2[j]; }
        default: { s = vs3[j]; b = vb3[j]; }
    }
    return vec2<f32>(sb_val(s, i, sb16), sb_val(b, i, sb16));
}

// gemv_v5's staging, part 1: word u's u32 j of the pass at code word c0 (elements 8 or 4:
// xl, and for 4-bit xh), its max |x| and Σ x shared in g5_m.
fn g5_load(u: u32, j: u32, nv: u32, c0: u32, bits: u32, xrow: u32, rn: f32,
           xl: ptr<function, vec4<f32>>, xh: ptr<function, vec4<f32>>) {
    if (u >= nv) {
        return;
    }
    let epw = 128u / bits;
    let e4 = (c0 + u) * (epw / 4u) + j * (epw / 16u);
    *xl = pv_x(xrow, e4, rn);
    if (bits == 4u) {
        *xh = pv_x(xrow, e4 + 1u, rn);
    }
    g5_share(u, j, *xl, *xh);
}

@compute @workgroup_size(256)
fn gemv_v5(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let wg = wg_index(wid);
    let t = wg % pv.rows;
    let slot = gv_slot(wg / pv.rows);
    let mi = slot.x;
    let blk = slot.y;
    let m = pv.ms[mi];
    let lanes = pv.lanes[mi];
    let lane = li % lanes;
    let o0 = (blk * (256u / lanes) + li / lanes) * 4u;
    let bits = m.bits;
    let epw = 128u / bits;
    let wpr = m.inp / epw;
    let gpr = m.inp / m.gs;
    let last = m.out - 1u;
    let r0 = pv.e * m.out + min(o0, last);
    let r1 = pv.e * m.out + min(o0 + 1u, last);
    let r2 = pv.e * m.out + min(o0 + 2u, last);
    let r3 = pv.e * m.out + min(o0 + 3u, last);
    let xrow = t * (m.inp / 4u);
    // The norm as gemv_v4 takes it: this workgroup's own sum of squares of its row of h.
    var rn = 1.0;
    if (pv.xmode == 1u) {
        rn = gv_norm(xrow, m.inp, li, wg < pv.rows);
    }
    var a0 = 0.0;
    var a1 = 0.0;
    var a2 = 0.0;
    var a3 = 0.0;
    for (var c0 = 0u; c0 < wpr; c0 += G5_W) {
        let nv = min(G5_W, wpr - c0);
        var c = lane;
        var q0 = vec4<u32>(0u);
        var q1 = vec4<u32>(0u);
        var q2 = vec4<u32>(0u);
        var q3 = vec4<u32>(0u);
        if (c < nv) {
            q0 = vw(mi, r0 * wpr + c0 + c);
            q1 = vw(mi, r1 * wpr + c0 + c);
            q2 = vw(mi, r2 * wpr + c0 + c);
            q3 = vw(mi, r3 * wpr + c0 + c);
        }
        // The previous pass's readers are done before the staging is overwritten.
        workgroupBarrier();
        // Staging, part 1: thread (word u, part j) reads its u32's elements (8 or 4) and shares
        // their max |x| and Σ x; 64 words a round, two rounds (G5_W = 128).
        let j = li % 4u;
        let ua = li / 4u;
        let ub = ua + 64u;
        var xla = vec4<f32>(0.0);
        var xha = vec4<f32>(0.0);
        var xlb = vec4<f32>(0.0);
        var xhb = vec4<f32>(0.0);
        g5_load(ua, j, nv, c0, bits, xrow, rn, &xla, &xha);
        g5_load(ub, j, nv, c0, bits, xrow, rn, &xlb, &xhb);
        workgroupBarrier();
        // Part 2: each quantizes against its word's max, packs and writes.
        g5_quant(ua, j, nv, bits, xla, xha);
        g5_quant(ub, j, nv, bits, xlb, xhb);
        workgroupBarrier();
        if (bits == 8u) {
            g5_correct(li, nv);
            workgroupBarrier();
        }
        for (; c < nv; c += lanes) {
            let w0 = q0;
            let w1 = q1;
            let w2 = q2;
            let w3 = q3;
            let cn = c + lanes;
            if (cn < nv) {
                q0 = vw(mi, r0 * wpr + c0 + cn);
                q1 = vw(mi, r1 * wpr + c0 + cn);
                q2 = vw(mi, r2 * wpr + c0 + cn);
                q3 = vw(mi, r3 * wpr + c0 + cn);
            }
            let qa1 = g5_q[c];
            let qb1 = g5_q[128u + c];
            let qa2 = g5_q[256u + c];
            let qb2 = g5_q[384u + c];
            let dd = g5_d[c];
            let corr = bitcast<i32>(dd.z);
            let g = (c0 + c) * epw / m.gs;
            let sb0 = g5_sb(mi, r0 * gpr + g, m.sb16);
            let sb1 = g5_sb(mi, r1 * gpr + g, m.sb16);
            let sb2 = g5_sb(mi, r2 * gpr + g, m.sb16);
            let sb3 = g5_sb(mi, r3 * gpr + g, m.sb16);
            let d0 = f32(g5_dot(w0, bits, qa1, qb1, qa2, qb2) + corr);
            let d1 = f32(g5_dot(w1, bits, qa1, qb1, qa2, qb2) + corr);
            let d2 = f32(g5_dot(w2, bits, qa1, qb1, qa2, qb2) + corr);
            let d3 = f32(g5_dot(w3, bits, qa1, qb1, qa2, qb2) + corr);
            a0 += sb0.x * (dd.x * d0) + sb0.y * dd.y;
            a1 += sb1.x * (dd.x * d1) + sb1.y * dd.y;
            a2 += sb2.x * (dd.x * d2) + sb2.y * dd.y;
            a3 += sb3.x * (dd.x * d3) + sb3.y * dd.y;
        }
    }
    gv_finish(li, lane, lanes / 2u, o0, t, m.out, mi, vec4<f32>(a0, a1, a2, a3));
}

// The gemm tile: 64 rows of x × 64 outputs, k in steps of 32; staged rows padded to 9 vec4s
// (36 floats) so that 8 threads reading rows r..r+7 at the same k hit 8 distinct bank quads.
const GM_T: u32 = 64u;
const GM_K: u32 = 32u;
const GM_S: u32 = 9u;
// Dequantized weights [64 outputs][36] and x [64 rows][36].
var<workgroup> gm_w: array<vec4<f32>, 576>;
var<workgroup> gm_x: array<vec4<f32>, 576>;

// acc + Σ a·b as a chain of FMAs (4 FMAs for 4 products; `dot` + add would cost a fifth op).
fn d4(acc: f32, a: vec4<f32>, b: vec4<f32>) -> f32 {
    return fma(a.w, b.w, fma(a.z, b.z, fma(a.y, b.y, fma(a.x, b.x, acc))));
}

// One row of the micro-tile: acc[c] += x · w_c over 4 k.
fn mac4(acc: vec4<f32>, xv: vec4<f32>, w0: vec4<f32>, w1: vec4<f32>, w2: vec4<f32>, w3: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(d4(acc.x, xv, w0), d4(acc.y, xv, w1), d4(acc.z, xv, w2), d4(acc.w, xv, w3));
}

@compute @workgroup_size(256)
fn gemm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let tiles_o = (p.m.out + GM_T - 1u) / GM_T;
    let wg = wg_index(wid);
    let o0 = (wg % tiles_o) * GM_T;
    let t0 = (wg / tiles_o) * GM_T;
    let tx = li % 16u;
    let ty = li / 16u;
    // Staging: this thread dequantizes weights [kp, kp + 8) of output o0 + so (past the end:
    // the last output, not written).
    let so = li % 64u;
    let piece = li / 64u;
    let orow = p.e * p.m.out + min(o0 + so, p.m.out - 1u);
    let ocl = min(o0 + so, p.m.out - 1u);
    // 8 weights of one group: one scale and bias (uniform).
    let fast = (p.m.bits == 4u || p.m.bits == 8u) && p.m.gs % 8u == 0u;
    var c0 = vec4<f32>(0.0);
    var c1 = vec4<f32>(0.0);
    var c2 = vec4<f32>(0.0);
    var c3 = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < p.m.inp; k0 += GM_K) {
        let kp = k0 + piece * 8u;
        var wa = vec4<f32>(0.0);
        var wb = vec4<f32>(0.0);
        if (fast) {
            // inp is a multiple of the group, so of 8: the 8 are all in or all out.
            if (kp < p.m.inp) {
                let g = orow * (p.m.inp / p.m.gs) + kp / p.m.gs;
                let s = q_sb(g, p.m.sb16, false);
                let b = q_sb(g, p.m.sb16, true);
                if (p.m.bits == 4u) {
                    let w = vec4<u32>(qw[orow * (p.m.inp / 8u) + kp / 8u]);
                    wa = s * vec4<f32>((w >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(0xfu)) + b;
                    wb = s * vec4<f32>((w >> vec4<u32>(16u, 20u, 24u, 28u)) & vec4<u32>(0xfu)) + b;
                } else {
                    let wi = orow * (p.m.inp / 4u) + kp / 4u;
                    let sh = vec4<u32>(0u, 8u, 16u, 24u);
                    wa = s * vec4<f32>((vec4<u32>(qw[wi]) >> sh) & vec4<u32>(0xffu)) + b;
                    wb = s * vec4<f32>((vec4<u32>(qw[wi + 1u]) >> sh) & vec4<u32>(0xffu)) + b;
                }
            }
        } else {
            var v: array<f32, 8>;
            for (var i = 0u; i < 8u; i++) {
                v[i] = 0.0;
                if (kp + i < p.m.inp) {
                    v[i] = q_weight(p.m, p.e, ocl, kp + i);
                }
            }
            wa = vec4<f32>(v[0], v[1], v[2], v[3]);
            wb = vec4<f32>(v[4], v[5], v[6], v[7]);
        }
        gm_w[so * GM_S + piece * 2u] = wa;
        gm_w[so * GM_S + piece * 2u + 1u] = wb;
        // x [64][32]: consecutive threads read consecutive k of a row (coalesced).
        for (var i = 0u; i < 8u; i++) {
            let v = li + i * 256u;
            let r = v / GM_K;
            let k = v % GM_K;
            var xv = 0.0;
            if (t0 + r < p.rows && k0 + k < p.m.inp) {
                xv = x[p.x_off + (t0 + r) * p.m.inp + k0 + k];
            }
            gm_x[r * GM_S + k / 4u][k % 4u] = xv;
        }
        workgroupBarrier();
        // The step's 32 products summed apart, then added to the total: the rounding error
        // grows with in / 32 + 32 terms rather than with in (long rows stay at the CPU's).
        var s0 = vec4<f32>(0.0);
        var s1 = vec4<f32>(0.0);
        var s2 = vec4<f32>(0.0);
        var s3 = vec4<f32>(0.0);
        for (var kq = 0u; kq < GM_K / 4u; kq++) {
            let w0 = gm_w[tx * GM_S + kq];
            let w1 = gm_w[(tx + 16u) * GM_S + kq];
            let w2 = gm_w[(tx + 32u) * GM_S + kq];
            let w3 = gm_w[(tx + 48u) * GM_S + kq];
            s0 = mac4(s0, gm_x[ty * GM_S + kq], w0, w1, w2, w3);
            s1 = mac4(s1, gm_x[(ty + 16u) * GM_S + kq], w0, w1, w2, w3);
            s2 = mac4(s2, gm_x[(ty + 32u) * GM_S + kq], w0, w1, w2, w3);
            s3 = mac4(s3, gm_x[(ty + 48u) * GM_S + kq], w0, w1, w2, w3);
        }
        c0 += s0;
        c1 += s1;
        c2 += s2;
        c3 += s3;
        workgroupBarrier();
    }
    let acc = array<vec4<f32>, 4>(c0, c1, c2, c3);
    for (var r = 0u; r < 4u; r++) {
        let t = t0 + ty + 16u * r;
        if (t < p.rows) {
            for (var c = 0u; c < 4u; c++) {
                let o = o0 + tx + 16u * c;
                if (o < p.m.out) {
                    out[p.out_off + t * p.m.out + o] = acc[r][c];
                }
            }
        }
    }
}
