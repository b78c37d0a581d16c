// matmul.wgsl: matmul_q, out[t] = x[t] · Wᵀ for a quantized (or dense) matrix (cpu/matmul.rs
// `matmul`). x f32 [rows, in] at x_off, out f32 [rows, out] at out_off; matrix e of the stack.
// gemv (rows = 1): a workgroup of 256 = 8 outputs × 32 threads striding the row's code words
//   (consecutive threads read consecutive words: 32 / bits elements each, one scale and bias
//   a word), summed by a tree in workgroup memory; ceil(out / 8) workgroups.
// gemm (rows > 1): a 16 × 16 tile of (row, output) a workgroup, k in chunks of 64 with the
//   chunk's dequantized weights and x staged in workgroup memory (8 KB); ceil(out / 16) ·
//   ceil(rows / 16) workgroups.
// Bindings: 0 params, 1 qw, 2 qs, 3 qb (quant.wgsl), 4 x, 5 out.

struct P {
    m: QMat,
    rows: u32,
    e: u32,
    x_off: u32,
    out_off: u32,
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

var<workgroup> tw: array<f32, 1024>;
var<workgroup> tx: array<f32, 1024>;

@compute @workgroup_size(256)
fn gemm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let tiles_o = (p.m.out + 15u) / 16u;
    let wg = wg_index(wid);
    let o0 = (wg % tiles_o) * 16u;
    let t0 = (wg / tiles_o) * 16u;
    let lo = li % 16u;
    let lt = li / 16u;
    var acc = 0.0;
    for (var k0 = 0u; k0 < p.m.inp; k0 += 64u) {
        for (var i = li; i < 1024u; i += 256u) {
            let r = i / 64u;
            let k = k0 + i % 64u;
            var wv = 0.0;
            if (o0 + r < p.m.out && k < p.m.inp) {
                wv = q_weight(p.m, p.e, o0 + r, k);
            }
            tw[i] = wv;
            var xv = 0.0;
            if (t0 + r < p.rows && k < p.m.inp) {
                xv = x[p.x_off + (t0 + r) * p.m.inp + k];
            }
            tx[i] = xv;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < 64u; kk++) {
            acc += tw[lo * 64u + kk] * tx[lt * 64u + kk];
        }
        workgroupBarrier();
    }
    if (o0 + lo < p.m.out && t0 + lt < p.rows) {
        out[p.out_off + (t0 + lt) * p.m.out + o0 + lo] = acc;
    }
}
