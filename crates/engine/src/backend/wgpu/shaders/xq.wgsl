// xq.wgsl: q2x_stage, the decode GEMV's x quantized once a launch instead of once a workgroup
// (matmul.rs `gemv_many` runs it before gemv_q6 of matmul_sg.wgsl; the twin of the quantization
// is q2x.wgsl's g5_share / g5_quant, which gemv_v5 runs in every workgroup; the CPU twin of
// the pair is cpu/matmul.rs `matmul`, the error stated by the tests' Q2X_TOL).
//
// What: row t of x, read as gemv_io's modes read it (xmode 0 as it is; 1 rms_norm(h) · w, the
// normed row also written to xn; 2 silu(x) · u), quantized per code word to two int8 levels,
// x ≈ d·(q1 + q2/254) with d = max |x| / 127 over the word, in both of the GEMV's layouts:
// - 4-bit words (32 elements): at row base b, five arrays of w4 = inp / 32 vec4s: [b] q1 of the
//   even nibbles, [b + w4] q1 of the odd nibbles, [b + 2 w4] q2 even, [b + 3 w4] q2 odd (u32 j
//   of a vec4 = the word's u32 j of codes, bytes in the nibbles' order), [b + 4 w4] the word's
//   (d / 254, Σ x, 0, 0) as f32 bits;
// - 8-bit words (16 elements) at b8 = b + 5 w4, three arrays of w8 = inp / 16: q1, q2 (bytes in
//   element order) and (d / 254, Σ x, 128 · (254 · Σ q1 + Σ q2) as i32 bits, 0): the codes are
//   read as signed (c − 128), the correction adds the difference back.
// Row t's base is t · (5 w4 + 3 w8) (`xq_row` in matmul.rs; 5.5 bytes an element).
// xmode 3 (the GDN layer's gated norm folded into out_proj, gdn.wgsl gdn_norm's twin): x = y ·
// r_h · w · silu(z) per head h of `hd` elements (r_h = 1 / rms of the head's y), y at binding 1,
// z at 2, w [hd] at 5; each vec4's sum of squares in workgroup memory, a head's summed in order
// by one invocation (rows of ≤ 4,096 elements, heads of a multiple of 4 and ≤ 256 of them).
//
// Launch: a workgroup of 256 a row of x (rows ≤ 8). Each thread takes 8 elements (u32 j of
// 4-bit word u = i / 4, j = i % 4; also the two u32s 2(j % 2), 2(j % 2) + 1 of 8-bit word
// 2u + j / 2); a word's max and Σ meet by subgroup shuffles among its 4 (or 2) threads, which
// are consecutive lanes of one subgroup (Ctx checks that invocations fill subgroups in order,
// and at least 4 lanes). The norm's sum of squares: subgroupAdd, then workgroup memory. Rows of
// ≤ 2,048 elements (every decode GEMV of the model) are loaded once, before that barrier, and
// kept in registers; longer rows are read again after it.

struct XP {
    inp: u32,
    rows: u32,
    xmode: u32,
    eps: f32,
    // xmode 3: the head size (x's heads of `hd` elements each normed on its own).
    hd: u32,
    // q2x_stage_ahead (xq_route.wgsl): the router's rows E, whose sums become the logits.
    ne: u32,
    pad1: u32,
    pad2: u32,
}

@group(0) @binding(0) var<uniform> xp: XP;
@group(0) @binding(1) var<storage, read> qx: array<vec4<f32>>;
// xmode 1: the norm's weights; xmode 2: u. Read only in those modes.
@group(0) @binding(2) var<storage, read> qaux: array<vec4<f32>>;
// xmode 1: the normed row, written back (the experts read it).
@group(0) @binding(3) var<storage, read_write> qxn: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> qq: array<vec4<u32>>;
// xmode 3: the gated norm's weights [hd] (a dummy otherwise).
@group(0) @binding(5) var<storage, read> qgw: array<vec4<f32>>;

// q2x_stage specialised to its launch (`LILY_WGPU_SPEC` xq, the default since stop 38;
// matmul.rs sets them): with SQ_ON the accessors give the row length, the x mode and the head
// size as pipeline constants (the mode's branches, the one-pass choice and the loops' bounds
// fold) and the subgroup width needs no broadcast (a barrier); without (the default, and every
// other module that includes this file) they read the parameter block.
override SQ_ON: bool = false;
override SQ_INP: u32 = 2048u;
override SQ_XMODE: u32 = 1u;
override SQ_HD: u32 = 128u;
override SQ_SG: u32 = 32u;

fn sq_inp() -> u32 { return select(xp.inp, SQ_INP, SQ_ON); }
fn sq_xmode() -> u32 { return select(xp.xmode, SQ_XMODE, SQ_ON); }
fn sq_hd() -> u32 { return select(xp.hd, SQ_HD, SQ_ON); }

var<workgroup> xq_part: array<f32, 64>;
var<workgroup> xq_sg: u32;
// xmode 3: each vec4's sum of squares (up to 4,096 elements a row), then each head's 1 / rms.
var<workgroup> xq_hss: array<f32, 1024>;
var<workgroup> xq_hrn: array<f32, 256>;

// A vec4 of x as the mode reads it, from the raw vec4 h and its aux a (mode 1: the norm's
// weights, rn its 1 / rms; mode 2: u).
fn xq_mode(h: vec4<f32>, a: vec4<f32>, rn: f32) -> vec4<f32> {
    if (sq_xmode() == 1u) {
        return h * rn * a;
    } else if (sq_xmode() == 2u) {
        return vec4<f32>(silu_f(h.x) * a.x, silu_f(h.y) * a.y, silu_f(h.z) * a.z, silu_f(h.w) * a.w);
    }
    return h;
}

// x's vec4 v of row t as the mode reads it (rows of more than 2,048 elements).
fn xq_x(xrow: u32, v: u32, rn: f32) -> vec4<f32> {
    var a = vec4<f32>(0.0);
    if (sq_xmode() == 1u) {
        a = qaux[v];
    } else if (sq_xmode() == 2u) {
        a = qaux[xrow + v];
    } else if (sq_xmode() == 3u) {
        // gdn.wgsl gdn_norm's y · r · w · silu(z), in its order.
        let z = qaux[xrow + v];
        let y = qx[xrow + v] * xq_hrn[v / (sq_hd() / 4u)] * qgw[v % (sq_hd() / 4u)];
        return vec4<f32>(y.x * silu_f(z.x), y.y * silu_f(z.y), y.z * silu_f(z.z), y.w * silu_f(z.w));
    }
    return xq_mode(qx[xrow + v], a, rn);
}

// xmode 3: each head's 1 / rms of row xrow into xq_hrn (every invocation calls it: barriers).
// A vec4's sum of squares each, then one invocation a head adds its vec4s' in order.
fn xq_head_norms(xrow: u32, li: u32) {
    let n4 = sq_inp() / 4u;
    let h4 = sq_hd() / 4u;
    for (var v = li; v < n4; v += 256u) {
        let y = qx[xrow + v];
        xq_hss[v] = dot(y, y);
    }
    workgroupBarrier();
    for (var h = li; h < n4 / h4; h += 256u) {
        var ss = 0.0;
        for (var j = 0u; j < h4; j++) {
            ss += xq_hss[h * h4 + j];
        }
        xq_hrn[h] = 1.0 / sqrt(ss / f32(sq_hd()) + xp.eps);
    }
    workgroupBarrier();
}

// Thread i's 8 elements of a row of x (elements 8i .. 8i + 3 in xl, 8i + 4 .. 8i + 7 in xh)
// quantized (q2x_sg.wgsl q2x_words) and written in both of gemv_q6's layouts at the row's
// bases b4 (4-bit words, w4 of them) and b8 (8-bit words, w8). Every lane of those words calls
// it (q2x_words' shuffles); `on` says whether this thread's i is in the row (a thread past it
// brings zeros and writes nothing). q2x_stage and gdn_step_x.wgsl (the GDN layer's gated norm
// staging out_proj's x) share it.
fn xq_put(i: u32, on: bool, xl: vec4<f32>, xh: vec4<f32>, b4: u32, w4: u32, b8: u32, w8: u32) {
    let w = q2x_words(xl, xh);
    if (on) {
        let u = i / 4u;
        let j = i % 4u;
        qq[b4 + u][j] = w.w4.x;
        qq[b4 + w4 + u][j] = w.w4.y;
        qq[b4 + 2u * w4 + u][j] = w.w4.z;
        qq[b4 + 3u * w4 + u][j] = w.w4.w;
        if (j == 0u) {
            qq[b4 + 4u * w4 + u] = w.m4;
        }
        let v = 2u * u + j / 2u;
        let p = 2u * (j % 2u);
        qq[b8 + v][p] = w.w8.x;
        qq[b8 + v][p + 1u] = w.w8.y;
        qq[b8 + w8 + v][p] = w.w8.z;
        qq[b8 + w8 + v][p + 1u] = w.w8.w;
        if (p == 0u) {
            qq[b8 + 2u * w8 + v] = w.m8;
        }
    }
}

@compute @workgroup_size(256)
fn q2x_stage(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32,
             @builtin(subgroup_size) sg_size: u32, @builtin(subgroup_invocation_id) lane: u32) {
    xq_stage(wid, li, sg_size, lane);
}

// q2x_stage's body (also xq_route.wgsl's q2x_stage_ahead's): stages row wid's x and returns the
// norm's 1 / rms (xmode 1; else 1).
fn xq_stage(wid: vec3<u32>, li: u32, sg_size: u32, lane: u32) -> f32 {
    var sg = SQ_SG;
    if (!SQ_ON) {
        if (li == 0u) {
            xq_sg = sg_size;
        }
        sg = workgroupUniformLoad(&xq_sg);
    }
    let t = wg_index(wid);
    let inp = sq_inp();
    let xrow = t * (inp / 4u);
    let w4 = inp / 32u;
    let w8 = inp / 16u;
    // A row of ≤ 2,048 elements is one pass of the workgroup: each thread loads its 8 elements
    // (and in the norm's mode their weights) once, before the norm's barrier, and keeps them in
    // registers: the loads' latency is paid once, not again after the barrier.
    // (Mode 3 reads x through xq_x, after its head norms.)
    let one_pass = 4u * w4 <= 256u && sq_xmode() != 3u;
    if (sq_xmode() == 3u) {
        xq_head_norms(xrow, li);
    }
    let i1 = li;
    let on1 = one_pass && i1 < 4u * w4;
    var hl = vec4<f32>(0.0);
    var hh = vec4<f32>(0.0);
    var wl = vec4<f32>(0.0);
    var wh = vec4<f32>(0.0);
    if (on1) {
        hl = qx[xrow + 2u * i1];
        hh = qx[xrow + 2u * i1 + 1u];
        if (sq_xmode() != 0u) {
            // Mode 1: the norm's weights (a vector); mode 2: u (a row like x).
            let ab = select(xrow, 0u, sq_xmode() == 1u);
            wl = qaux[ab + 2u * i1];
            wh = qaux[ab + 2u * i1 + 1u];
        }
    }
    var rn = 1.0;
    if (sq_xmode() == 1u) {
        var ss = dot(hl, hl) + dot(hh, hh);
        if (!one_pass) {
            for (var v = li; v < inp / 4u; v += 256u) {
                let h = qx[xrow + v];
                ss += dot(h, h);
            }
        }
        let s = subgroupAdd(ss);
        if (lane == 0u) {
            xq_part[li / sg] = s;
        }
        workgroupBarrier();
        var tot = 0.0;
        for (var i = 0u; i < 256u / sg; i++) {
            tot += xq_part[i];
        }
        rn = 1.0 / sqrt(tot / f32(inp) + xp.eps);
    }
    let b4 = t * (5u * w4 + 3u * w8);
    let b8 = b4 + 5u * w4;
    // The bound is uniform: every lane reaches the shuffles; lanes past the row take zeros.
    for (var i0 = 0u; i0 < 4u * w4; i0 += 256u) {
        let i = i0 + li;
        let on = i < 4u * w4;
        var xl = vec4<f32>(0.0);
        var xh = vec4<f32>(0.0);
        if (on && one_pass) {
            xl = xq_mode(hl, wl, rn);
            xh = xq_mode(hh, wh, rn);
            if (sq_xmode() == 1u) {
                qxn[xrow + 2u * i] = xl;
                qxn[xrow + 2u * i + 1u] = xh;
            }
        } else if (on) {
            xl = xq_x(xrow, 2u * i, rn);
            xh = xq_x(xrow, 2u * i + 1u, rn);
            if (sq_xmode() == 1u) {
                qxn[xrow + 2u * i] = xl;
                qxn[xrow + 2u * i + 1u] = xh;
            }
        }
        xq_put(i, on, xl, xh, b4, w4, b8, w8);
    }
    return rn;
}
