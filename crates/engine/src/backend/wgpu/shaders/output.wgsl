// output.wgsl: the token's way in and out (cpu/mod.rs embed, argmax_step, mask_logits).
// embed:          out[t, i] = dequant(table)[ids[t], i] (quant.wgsl's q_weight: scale·code +
//                 bias, the CPU's `row_f32`); one workgroup of 256 a token striding the hidden
//                 size. ids u32 [rows] (for embed_step, the step buffer: its word 0 is the token).
//                 Bindings: 1 qw, 2 qs, 3 qb, 4 ids, 5 out [rows, hidden] f32.
// argmax_partial: the arg-max of each block of 4,096 logits (first index on ties; NaN never
//                 wins, as runtime::argmax): one workgroup of 256 a block. Bindings: 1 logits,
//                 2 part_v f32 [blocks], 3 part_i u32 [blocks].
// argmax_final:   one workgroup reduces the partials the same way and writes the step: token =
//                 the arg-max (0 when nothing beat -inf), pos += 1. Bindings: 1 part_v, 2 part_i,
//                 3 step u32 [token, pos].
// mask_logits:    logits[i] = -inf where bit i of the mask (word i / 32, LSB first) is clear, for
//                 i < vocab; ids past the mask's words are disallowed (runtime::constrain::
//                 apply_mask). Bindings: 1 logits, 2 mask u32 [words].

struct P {
    m: QMat,
    n: u32,
    words: u32,
    pad0: u32,
    pad1: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> qw: array<u32>;
@group(0) @binding(2) var<storage, read> qs: array<u32>;
@group(0) @binding(3) var<storage, read> qb: array<u32>;
@group(0) @binding(4) var<storage, read> em_ids: array<u32>;
@group(0) @binding(5) var<storage, read_write> em_out: array<f32>;

@compute @workgroup_size(256)
fn embed(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wg_index(wid);
    let id = min(em_ids[t], p.m.out - 1u);  // the host checks ids; the step's token is the model's own
    for (var i = li; i < p.m.inp; i += 256u) {
        em_out[t * p.m.inp + i] = q_weight(p.m, 0u, id, i);
    }
}

const AM_BLOCK: u32 = 4096u;
const NONE: u32 = 0xffffffffu;

var<workgroup> rv: array<f32, 256>;
var<workgroup> ri: array<u32, 256>;

// (v, i) beats (bv, bi): larger, or equal with the lower index (NaN never beats anything).
fn beats(v: f32, i: u32, bv: f32, bi: u32) -> bool {
    return v > bv || (v == bv && i < bi);
}

// The workgroup's best (value, index) of each invocation's (v, i), left in rv[0], ri[0].
fn wg_argmax(v: f32, i: u32, li: u32) {
    rv[li] = v;
    ri[li] = i;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (li < s && beats(rv[li + s], ri[li + s], rv[li], ri[li])) {
            rv[li] = rv[li + s];
            ri[li] = ri[li + s];
        }
        workgroupBarrier();
    }
}

@group(0) @binding(1) var<storage, read> am_logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> am_part_v: array<f32>;
@group(0) @binding(3) var<storage, read_write> am_part_i: array<u32>;

@compute @workgroup_size(256)
fn argmax_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let b = wg_index(wid);
    let end = min(p.n, (b + 1u) * AM_BLOCK);
    var bv = -bitcast<f32>(0x7f800000u);
    var bi = NONE;
    for (var i = b * AM_BLOCK + li; i < end; i += 256u) {
        let v = am_logits[i];
        if (beats(v, i, bv, bi)) {
            bv = v;
            bi = i;
        }
    }
    wg_argmax(bv, bi, li);
    if (li == 0u) {
        am_part_v[b] = rv[0];
        am_part_i[b] = ri[0];
    }
}

@group(0) @binding(1) var<storage, read> af_part_v: array<f32>;
@group(0) @binding(2) var<storage, read> af_part_i: array<u32>;
@group(0) @binding(3) var<storage, read_write> af_step: array<u32>;

@compute @workgroup_size(256)
fn argmax_final(@builtin(local_invocation_index) li: u32) {
    var bv = -bitcast<f32>(0x7f800000u);
    var bi = NONE;
    for (var b = li; b < p.words; b += 256u) {
        let v = af_part_v[b];
        let i = af_part_i[b];
        if (i != NONE && beats(v, i, bv, bi)) {
            bv = v;
            bi = i;
        }
    }
    wg_argmax(bv, bi, li);
    if (li == 0u) {
        af_step[0] = select(ri[0], 0u, ri[0] == NONE);
        af_step[1] = af_step[1] + 1u;
    }
}

@group(0) @binding(1) var<storage, read_write> ml_logits: array<f32>;
@group(0) @binding(2) var<storage, read> ml_mask: array<u32>;

@compute @workgroup_size(256)
fn mask_logits(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = wg_index(wid) * 256u + li;
    if (i < p.n) {
        var w = 0u;
        if (i / 32u < p.words) {
            w = ml_mask[i / 32u];
        }
        if (((w >> (i % 32u)) & 1u) == 0u) {
            ml_logits[i] = -bitcast<f32>(0x7f800000u);
        }
    }
}
