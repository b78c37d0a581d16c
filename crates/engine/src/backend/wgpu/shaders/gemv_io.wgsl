// gemv_io.wgsl: what the two GEMV kernels for decode share (matmul.wgsl's gemv_v4 and
// matmul_sg.wgsl's gemv_rw): their parameter block, their 21 bindings (up to 4 matrices reading
// the same x, x, 4 outputs, and the inputs of the x and output modes), and the exact code-to-float
// dot products of the 2^23 trick. Prefixed (after common.wgsl) to both files by matmul.rs.

// The 2^23 + v trick: v < 2^23 OR'd into 2^23's mantissa is the float 2^23 + v exactly.
const MAGIC: u32 = 0x4b000000u;
const MAGIC_F: f32 = 8388608.0;

// Σ code·x' over a 4-bit word's 8 codes: codes 0-3 from the low half, 4-7 from the high half,
// each scaled by 16^(i % 4), against x' (xa: elements 0-3, xb: 4-7, pre-scaled by 16^-(i % 4)).
fn q4_dot(w: u32, xa: vec4<f32>, xb: vec4<f32>) -> f32 {
    let m = vec4<u32>(0xfu, 0xf0u, 0xf00u, 0xf000u);
    let lo = bitcast<vec4<f32>>((vec4<u32>(w) & m) | vec4<u32>(MAGIC)) - vec4<f32>(MAGIC_F);
    let hi = bitcast<vec4<f32>>((vec4<u32>(w >> 16u) & m) | vec4<u32>(MAGIC)) - vec4<f32>(MAGIC_F);
    return dot(lo, xa) + dot(hi, xb);
}

// Σ code·x' over an 8-bit word's 4 codes (scaled by 256^(i % 2); x' by 256^-(i % 2)).
fn q8_dot(w: u32, xa: vec4<f32>) -> f32 {
    let m = vec4<u32>(0xffu, 0xff00u, 0xffu, 0xff00u);
    let v = bitcast<vec4<f32>>((vec4<u32>(w, w, w >> 16u, w >> 16u) & m) | vec4<u32>(MAGIC))
        - vec4<f32>(MAGIC_F);
    return dot(v, xa);
}

// Σ code·x' over one 16-byte word of 4-bit codes (32 codes), x' its 8 vec4s in slot scale.
fn q4_word(w: vec4<u32>, x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>, x3: vec4<f32>,
           x4: vec4<f32>, x5: vec4<f32>, x6: vec4<f32>, x7: vec4<f32>) -> f32 {
    return (q4_dot(w.x, x0, x1) + q4_dot(w.y, x2, x3)) + (q4_dot(w.z, x4, x5) + q4_dot(w.w, x6, x7));
}

// The same over a word of 8-bit codes (16 codes, 4 vec4s of x').
fn q8_word(w: vec4<u32>, x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>, x3: vec4<f32>) -> f32 {
    return (q8_dot(w.x, x0) + q8_dot(w.y, x1)) + (q8_dot(w.z, x2) + q8_dot(w.w, x3));
}

// ---- gemv_v4's own parameters and bindings: up to 4 matrices reading the same x (matmul_q_many;
// matmul_q is one), each a range of workgroups, and the rms_norm folded in (rms_norm_matmul).
struct PV {
    ms: array<QMat, 4>,
    // n matrices, rows of x, stack index e (every matrix), how x is read (xmode: 0 as it is;
    // 1 x = rms_norm(h) · aux; 2 x = silu(x) · aux, the shared expert's swiglu).
    n: u32,
    rows: u32,
    e: u32,
    xmode: u32,
    // Threads a row of each matrix.
    lanes: vec4<u32>,
    // First block (of 1024 / lanes rows) of each matrix; total blocks in .w of `end`.
    start: vec4<u32>,
    end: vec4<u32>,
    eps: f32,
    // How the outputs are written (omode: 0 stored; 1 added to the output (a residual add);
    // 2 out += r + sigmoid(s[t]) · acc: the shared expert's gate, the routed experts' sum r and
    // the residual add of the MoE block; 3, gemv_q6 only: matrix 0's outputs through the GDN
    // layer's conv, its weights [C, 4] at aux and its state [3, C] at xn: matmul_sg.wgsl
    // conv_out).
    omode: u32,
    // `lily lab` only (0 otherwise): parts of gemv_v4 skipped to time the rest (results wrong):
    // 1 the x staging and its barriers, 2 the final tree, 4 the norm's pre-pass, 8 the dots,
    // 16 the scale and bias loads (1.0 each).
    ablate: u32,
    pad2: u32,
}

@group(0) @binding(0) var<uniform> pv: PV;
@group(0) @binding(1) var<storage, read> vw0: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> vs0: array<u32>;
@group(0) @binding(3) var<storage, read> vb0: array<u32>;
@group(0) @binding(4) var<storage, read> vw1: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read> vs1: array<u32>;
@group(0) @binding(6) var<storage, read> vb1: array<u32>;
@group(0) @binding(7) var<storage, read> vw2: array<vec4<u32>>;
@group(0) @binding(8) var<storage, read> vs2: array<u32>;
@group(0) @binding(9) var<storage, read> vb2: array<u32>;
@group(0) @binding(10) var<storage, read> vw3: array<vec4<u32>>;
@group(0) @binding(11) var<storage, read> vs3: array<u32>;
@group(0) @binding(12) var<storage, read> vb3: array<u32>;
@group(0) @binding(13) var<storage, read> vx: array<vec4<f32>>;
@group(0) @binding(14) var<storage, read_write> vo0: array<f32>;
@group(0) @binding(15) var<storage, read_write> vo1: array<f32>;
@group(0) @binding(16) var<storage, read_write> vo2: array<f32>;
@group(0) @binding(17) var<storage, read_write> vo3: array<f32>;
// xmode 1: the norm's weights and the normed x written back; xmode 2: the up projection (aux).
// omode 2: the routed experts' sum r and the shared expert's gate logit s; omode 3 (gemv_q6,
// whose x has no mode): the conv's weights at aux, its state at xn. Dummies otherwise.
@group(0) @binding(18) var<storage, read> vaux: array<vec4<f32>>;
@group(0) @binding(19) var<storage, read_write> vxn: array<vec4<f32>>;
@group(0) @binding(20) var<storage, read> vr: array<f32>;
@group(0) @binding(21) var<storage, read> vsg: array<f32>;

// The matrix slot of workgroup block blk (uniform over the workgroup) and the
// block's index within that matrix's blocks (every GEMV of the parameter block).
fn gv_slot(blk: u32) -> vec2<u32> {
    var mi = 0u;
    for (var k = 1u; k < pv.n; k++) {
        if (blk >= pv.start[k]) {
            mi = k;
        }
    }
    return vec2<u32>(mi, blk - pv.start[mi]);
}

// Code words i of matrix mi (a branch uniform over the workgroup: a workgroup is one matrix's).
fn vw(mi: u32, i: u32) -> vec4<u32> {
    switch mi {
        case 0u: { return vw0[i]; }
        case 1u: { return vw1[i]; }
        case 2u: { return vw2[i]; }
        default: { return vw3[i]; }
    }
}

// Scale or bias i of matrix mi (bf16 pairs when sb16, else f32 words), as quant.wgsl's q_sb.
fn vsb(mi: u32, i: u32, sb16: u32, is_bias: bool) -> f32 {
    if ((pv.ablate & 16u) != 0u) {
        return 1.0;
    }
    let j = sb_idx(i, sb16);
    var w: u32;
    switch mi {
        case 0u: { w = select(vs0[j], vb0[j], is_bias); }
        case 1u: { w = select(vs1[j], vb1[j], is_bias); }
        case 2u: { w = select(vs2[j], vb2[j], is_bias); }
        default: { w = select(vs3[j], vb3[j], is_bias); }
    }
    return sb_val(w, i, sb16);
}

fn vget(mi: u32, i: u32) -> f32 {
    switch mi {
        case 0u: { return vo0[i]; }
        case 1u: { return vo1[i]; }
        case 2u: { return vo2[i]; }
        default: { return vo3[i]; }
    }
}

fn vout(mi: u32, i: u32, v: f32) {
    switch mi {
        case 0u: { vo0[i] = v; }
        case 1u: { vo1[i] = v; }
        case 2u: { vo2[i] = v; }
        default: { vo3[i] = v; }
    }
}

// x's vec4 v of row xrow as the mode reads it (xmode 1: times rn, the norm's 1 / rms, and the
// norm's weights; 2: silu(x) · u), for gemv_v4, gemv_v5 and gemv_rw.
fn pv_x(xrow: u32, v: u32, rn: f32) -> vec4<f32> {
    var xv = vx[xrow + v];
    if (pv.xmode == 1u) {
        xv = xv * rn * vaux[v];
    } else if (pv.xmode == 2u) {
        let a = vaux[xrow + v];
        xv = vec4<f32>(silu_f(xv.x) * a.x, silu_f(xv.y) * a.y, silu_f(xv.z) * a.z, silu_f(xv.w) * a.w);
    }
    return xv;
}
