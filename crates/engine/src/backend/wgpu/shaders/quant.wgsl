// quant.wgsl: a quantized (MLX affine) or dense matrix read element by element, for the shader
// files that read weights (prefixed after common.wgsl; the file declares the bindings qw, qs,
// qb). Layout (MODEL.md): codes u32 [n, out, in·bits/32], element 8j+i of a 4-bit row is bits
// [4i, 4i+4) of word j (8-bit: byte i of word 4j+i); scales and biases [n, out, in/gs] as bf16
// pairs in u32 words (sb16 = 1, the checkpoints' type) or f32 words; w = scale·code + bias, as
// cpu/matmul.rs. bits = 32: a dense f32 matrix in qw (no scales). The matrix's shape is a `QMat`
// (common.wgsl).

fn q_sb(i: u32, sb16: u32, is_bias: bool) -> f32 {
    let j = sb_idx(i, sb16);
    var w: u32;
    if (is_bias) { w = qb[j]; } else { w = qs[j]; }
    return sb_val(w, i, sb16);
}

// Weight (o, k) of matrix e of the stack.
fn q_weight(m: QMat, e: u32, o: u32, k: u32) -> f32 {
    if (m.bits == 32u) {
        return bitcast<f32>(qw[(e * m.out + o) * m.inp + k]);
    }
    let per = 32u / m.bits;
    let row = e * m.out + o;
    let word = qw[row * (m.inp / per) + k / per];
    let code = (word >> ((k % per) * m.bits)) & ((1u << m.bits) - 1u);
    let g = row * (m.inp / m.gs) + k / m.gs;
    return q_sb(g, m.sb16, false) * f32(code) + q_sb(g, m.sb16, true);
}
