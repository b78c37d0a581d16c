// moe.wgsl: the MoE block (cpu/moe.rs), all f32. Three entries; moe.rs launches them.
//
// moe_route (cpu moe_route): per token row t, p = softmax(logits[t]) (max subtracted, the sum
//   taken in expert order by one thread, as the CPU's loop), the k largest p in the order of
//   f32::total_cmp, lower expert id first on ties (the CPU's stable sort), weights p / Σ_top p
//   (summed in slot order) when norm_topk, else p. exp is exp_acc below (≤ 2 ulp), not the
//   builtin, whose precision Vulkan and Metal leave loose (3 + 2|x| ulp), so the weights stay
//   within 1e-6 of the CPU's. Rank of expert i = the number of experts ahead of it; the ones of
//   rank < k are the route. One workgroup of 256 a row; rows workgroups. E ≤ 2048, k ≤ 64.
//   Bindings: 1 logits f32 [rows, E], 2 ids u32 [rows, k] (written), 3 weights f32 [rows, k]
//   (written).
// moe_gate_up (cpu expert_mlp's gate, up and swiglu): for each slot s = t·k + j and expert
//   e = ids[s] (clamped below n_exp), act[s, o] = silu(gate_e[o] · x[t]) · (up_e[o] · x[t]).
//   A workgroup of 256 = 8 outputs × 32 lanes striding the matrices' words (consecutive lanes,
//   consecutive words), x[t] staged in workgroup memory in chunks of 2048, the two dot products
//   summed by a tree in workgroup memory; rows · k · ceil(width / 8) workgroups.
//   Bindings: 1-3 gate (qw, qs, qb: quant.wgsl, params m), 4-6 up (uw, us, ub, params m2),
//   7 x f32 [rows, hidden], 8 ids u32 [rows, k], 9 act f32 [rows, k, width] (written).
// moe_down (cpu expert_mlp's down and the slot sum): out[t, o] = Σ_j w[t, j] · (down_e[o] ·
//   act[t·k + j]), summed in slot order j = 0..k from 0 (as both CPU paths). A workgroup of
//   256 = 32 outputs × 8 lanes, each slot's act row staged in workgroup memory, the dot product
//   by a tree; rows · ceil(hidden / 32) workgroups.
//   Bindings: 1-3 down (qw, qs, qb, params m), 4 act, 5 ids, 6 weights, 7 out f32 [rows, hidden].
// moe_gate_up_grouped, moe_down_grouped, moe_combine (prefill blocks of ≥ 4 rows, moe.rs
//   GROUPED_FROM): the same outputs grouped by expert, a workgroup per (expert, 8 or 32 rows)
//   walking the block's slots and computing those routed to it (n_exp · ceil(width / 8) and
//   n_exp · ceil(hidden / 32) workgroups); down writes each slot's y [rows·k, hidden], and
//   moe_combine sums every token's slots in order (ceil(rows · hidden / 256) workgroups).
// Weights are dequantized as quant.wgsl's q_weight (w = s·code + b), a word at a time: moe.rs
// checks that in % (32 / bits) == 0 and gs % (32 / bits) == 0, so a word never straddles a group.
// Each entry uses its own names for bindings 4.. (and moe_route for 1-3): a pipeline's layout
// holds only what its entry uses.

struct P {
    m: QMat,
    m2: QMat,
    rows: u32,
    k: u32,
    n_exp: u32,
    norm_topk: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> qw: array<u32>;
@group(0) @binding(2) var<storage, read> qs: array<u32>;
@group(0) @binding(3) var<storage, read> qb: array<u32>;

const CH: u32 = 2048u;
var<workgroup> xs: array<f32, 2048>;
var<workgroup> red: array<f32, 256>;
var<workgroup> red2: array<f32, 256>;
var<workgroup> rtop: array<u32, 64>;

// ---- moe_route

@group(0) @binding(1) var<storage, read> rt_logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> rt_ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> rt_w: array<f32>;

// e^x to about 1 ulp: x = n·ln2 + r (Cody-Waite, |r| ≤ ln2 / 2), e^r by its Taylor polynomial of
// degree 7 (truncation below 6e-9 relative), times 2^n.
fn exp_acc(x: f32) -> f32 {
    if (x < -103.0) { return 0.0; }
    if (x > 88.72) { return bitcast<f32>(0x7f800000u); }
    let n = round(x * 1.442695041);
    let r = (x - n * 0.693145751953125) - n * 1.428606765330187e-6;
    var q = 1.0 / 5040.0;
    q = q * r + 1.0 / 720.0;
    q = q * r + 1.0 / 120.0;
    q = q * r + 1.0 / 24.0;
    q = q * r + 1.0 / 6.0;
    q = q * r + 0.5;
    q = q * r + 1.0;
    q = q * r + 1.0;
    // 2^n in two steps: n down to -150 (subnormal results) stays representable.
    let h = i32(n) / 2;
    return ldexp(ldexp(q, h), i32(n) - h);
}

// f32::total_cmp's order as an i32 comparison.
fn order_key(v: f32) -> i32 {
    let b = bitcast<i32>(v);
    return select(b, b ^ 0x7fffffff, b < 0);
}

@compute @workgroup_size(256)
fn moe_route(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wg_index(wid);
    if (t >= p.rows) {
        return;
    }
    let ne = p.n_exp;
    let base = t * ne;
    var m = bitcast<f32>(0xff800000u);
    for (var i = li; i < ne; i += 256u) {
        m = max(m, rt_logits[base + i]);
    }
    red[li] = m;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (li < s) {
            red[li] = max(red[li], red[li + s]);
        }
        workgroupBarrier();
    }
    m = red[0];
    for (var i = li; i < ne; i += 256u) {
        xs[i] = exp_acc(rt_logits[base + i] - m);
    }
    workgroupBarrier();
    if (li == 0u) {
        var sum = 0.0;
        for (var i = 0u; i < ne; i++) {
            sum += xs[i];
        }
        red[0] = sum;
    }
    workgroupBarrier();
    let sum = red[0];
    for (var i = li; i < ne; i += 256u) {
        xs[i] = xs[i] / sum;
    }
    workgroupBarrier();
    for (var i = li; i < ne; i += 256u) {
        let ki = order_key(xs[i]);
        var rank = 0u;
        for (var j = 0u; j < ne && rank < p.k; j++) {
            let kj = order_key(xs[j]);
            if (kj > ki || (kj == ki && j < i)) {
                rank++;
            }
        }
        if (rank < p.k) {
            rtop[rank] = i;
        }
    }
    workgroupBarrier();
    if (li == 0u) {
        var s = 1.0;
        if (p.norm_topk != 0u) {
            s = 0.0;
            for (var j = 0u; j < p.k; j++) {
                s += xs[rtop[j]];
            }
        }
        for (var j = 0u; j < p.k; j++) {
            rt_ids[t * p.k + j] = rtop[j];
            rt_w[t * p.k + j] = xs[rtop[j]] / s;
        }
    }
}

// ---- the experts

// Σ over k in [k0, k1) of w(row, k) · xs[k − k0] for the matrix at bindings 1-3, this lane's
// share (words lane, lane + lanes, …).
fn dot_q(m: QMat, row: u32, k0: u32, k1: u32, lane: u32, lanes: u32) -> f32 {
    var acc = 0.0;
    if (m.bits == 32u) {
        for (var k = k0 + lane; k < k1; k += lanes) {
            acc += bitcast<f32>(qw[row * m.inp + k]) * xs[k - k0];
        }
        return acc;
    }
    let per = 32u / m.bits;
    let mask = (1u << m.bits) - 1u;
    let wpr = m.inp / per;
    let gpr = m.inp / m.gs;
    for (var wi = k0 / per + lane; wi < k1 / per; wi += lanes) {
        let word = qw[row * wpr + wi];
        let k = wi * per;
        let g = row * gpr + k / m.gs;
        let s = q_sb(g, m.sb16, false);
        let b = q_sb(g, m.sb16, true);
        for (var i = 0u; i < per; i++) {
            let code = (word >> (i * m.bits)) & mask;
            acc += (s * f32(code) + b) * xs[k - k0 + i];
        }
    }
    return acc;
}

@group(0) @binding(4) var<storage, read> uw: array<u32>;
@group(0) @binding(5) var<storage, read> us: array<u32>;
@group(0) @binding(6) var<storage, read> ub: array<u32>;
@group(0) @binding(7) var<storage, read> gu_x: array<f32>;
@group(0) @binding(8) var<storage, read> gu_ids: array<u32>;
@group(0) @binding(9) var<storage, read_write> gu_act: array<f32>;

fn u_sb(i: u32, sb16: u32, is_bias: bool) -> f32 {
    if (sb16 != 0u) {
        var w: u32;
        if (is_bias) { w = ub[i >> 1u]; } else { w = us[i >> 1u]; }
        if ((i & 1u) == 1u) { return bf16_hi(w); }
        return bf16_lo(w);
    }
    if (is_bias) { return bitcast<f32>(ub[i]); }
    return bitcast<f32>(us[i]);
}

// dot_q for the matrix at bindings 4-6 (up).
fn dot_u(m: QMat, row: u32, k0: u32, k1: u32, lane: u32, lanes: u32) -> f32 {
    var acc = 0.0;
    if (m.bits == 32u) {
        for (var k = k0 + lane; k < k1; k += lanes) {
            acc += bitcast<f32>(uw[row * m.inp + k]) * xs[k - k0];
        }
        return acc;
    }
    let per = 32u / m.bits;
    let mask = (1u << m.bits) - 1u;
    let wpr = m.inp / per;
    let gpr = m.inp / m.gs;
    for (var wi = k0 / per + lane; wi < k1 / per; wi += lanes) {
        let word = uw[row * wpr + wi];
        let k = wi * per;
        let g = row * gpr + k / m.gs;
        let s = u_sb(g, m.sb16, false);
        let b = u_sb(g, m.sb16, true);
        for (var i = 0u; i < per; i++) {
            let code = (word >> (i * m.bits)) & mask;
            acc += (s * f32(code) + b) * xs[k - k0 + i];
        }
    }
    return acc;
}

// act[slot, o] for output o of this invocation's group of 32 lanes (every invocation of the
// workgroup calls it: it stages x[slot / k] and has barriers).
fn gate_up_slot(slot: u32, o: u32, lane: u32, li: u32) {
    let width = p.m.out;
    let hid = p.m.inp;
    let t = slot / p.k;
    let e = min(gu_ids[slot], p.n_exp - 1u);
    var ga = 0.0;
    var ua = 0.0;
    for (var k0 = 0u; k0 < hid; k0 += CH) {
        let k1 = min(k0 + CH, hid);
        for (var i = li; i < k1 - k0; i += 256u) {
            xs[i] = gu_x[t * hid + k0 + i];
        }
        workgroupBarrier();
        if (o < width) {
            ga += dot_q(p.m, e * width + o, k0, k1, lane, 32u);
            ua += dot_u(p.m2, e * width + o, k0, k1, lane, 32u);
        }
        workgroupBarrier();
    }
    red[li] = ga;
    red2[li] = ua;
    workgroupBarrier();
    for (var s = 16u; s > 0u; s >>= 1u) {
        if (lane < s) {
            red[li] += red[li + s];
            red2[li] += red2[li + s];
        }
        workgroupBarrier();
    }
    if (lane == 0u && o < width) {
        gu_act[slot * width + o] = silu_f(red[li]) * red2[li];
    }
    workgroupBarrier();
}

@compute @workgroup_size(256)
fn moe_gate_up(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let blocks = (p.m.out + 7u) / 8u;
    let wg = wg_index(wid);
    let slot = wg / blocks;
    if (slot >= p.rows * p.k) {
        return;
    }
    gate_up_slot(slot, (wg % blocks) * 8u + li / 32u, li % 32u, li);
}

// The same outputs for a prefill block grouped by expert: a workgroup per (expert, 8 rows of
// gate and up) walks the block's slots and computes those routed to its expert, so each
// expert's rows are read from memory once a block (then from cache) instead of once a slot.
@compute @workgroup_size(256)
fn moe_gate_up_grouped(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let blocks = (p.m.out + 7u) / 8u;
    let wg = wg_index(wid);
    let e = wg / blocks;
    if (e >= p.n_exp) {
        return;
    }
    let o = (wg % blocks) * 8u + li / 32u;
    for (var slot = 0u; slot < p.rows * p.k; slot++) {
        if (min(gu_ids[slot], p.n_exp - 1u) == e) {
            gate_up_slot(slot, o, li % 32u, li);
        }
    }
}

@group(0) @binding(4) var<storage, read> dn_act: array<f32>;
@group(0) @binding(5) var<storage, read> dn_ids: array<u32>;
@group(0) @binding(6) var<storage, read> dn_w: array<f32>;
@group(0) @binding(7) var<storage, read_write> dn_out: array<f32>;

// down_e[o] · act[slot] for output o of this invocation's group of 8 lanes, valid in lane 0
// (every invocation calls it: it stages the slot's act row and has barriers).
fn down_slot(slot: u32, o: u32, lane: u32, li: u32) -> f32 {
    let hid = p.m.out;
    let width = p.m.inp;
    let e = min(dn_ids[slot], p.n_exp - 1u);
    var acc = 0.0;
    for (var k0 = 0u; k0 < width; k0 += CH) {
        let k1 = min(k0 + CH, width);
        for (var i = li; i < k1 - k0; i += 256u) {
            xs[i] = dn_act[slot * width + k0 + i];
        }
        workgroupBarrier();
        if (o < hid) {
            acc += dot_q(p.m, e * hid + o, k0, k1, lane, 8u);
        }
        workgroupBarrier();
    }
    red[li] = acc;
    workgroupBarrier();
    for (var s = 4u; s > 0u; s >>= 1u) {
        if (lane < s) {
            red[li] += red[li + s];
        }
        workgroupBarrier();
    }
    let y = red[li];
    workgroupBarrier();
    return y;
}

@compute @workgroup_size(256)
fn moe_down(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let hid = p.m.out;
    let blocks = (hid + 31u) / 32u;
    let wg = wg_index(wid);
    let t = wg / blocks;
    if (t >= p.rows) {
        return;
    }
    let o = (wg % blocks) * 32u + li / 8u;
    let lane = li % 8u;
    var total = 0.0;
    for (var j = 0u; j < p.k; j++) {
        let slot = t * p.k + j;
        let y = down_slot(slot, o, lane, li);
        if (lane == 0u) {
            total += dn_w[slot] * y;
        }
    }
    if (lane == 0u && o < hid) {
        dn_out[t * hid + o] = total;
    }
}

// Grouped by expert (prefill): y[slot, o] = down_e[o] · act[slot] for the slots routed to the
// workgroup's expert, a workgroup per (expert, 32 outputs); moe_combine then sums each token's
// slots in order. The same y bits as moe_down's (the same lanes and tree).
@group(0) @binding(6) var<storage, read_write> dg_y: array<f32>;

@compute @workgroup_size(256)
fn moe_down_grouped(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let hid = p.m.out;
    let blocks = (hid + 31u) / 32u;
    let wg = wg_index(wid);
    let e = wg / blocks;
    if (e >= p.n_exp) {
        return;
    }
    let o = (wg % blocks) * 32u + li / 8u;
    let lane = li % 8u;
    for (var slot = 0u; slot < p.rows * p.k; slot++) {
        if (min(dn_ids[slot], p.n_exp - 1u) == e) {
            let y = down_slot(slot, o, lane, li);
            if (lane == 0u && o < hid) {
                dg_y[slot * hid + o] = y;
            }
        }
    }
}

// out[t, o] = Σ_j w[t, j] · y[t·k + j, o], j = 0..k in order from 0 (moe_down's sum).
// Bindings: 1 y, 2 weights, 3 out; ceil(rows · hidden / 256) workgroups.
@group(0) @binding(1) var<storage, read> cb_y: array<f32>;
@group(0) @binding(2) var<storage, read> cb_w: array<f32>;
@group(0) @binding(3) var<storage, read_write> cb_out: array<f32>;

@compute @workgroup_size(256)
fn moe_combine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let hid = p.m.out;
    let i = wg_index(wid) * 256u + li;
    if (i >= p.rows * hid) {
        return;
    }
    let t = i / hid;
    let o = i % hid;
    var total = 0.0;
    for (var j = 0u; j < p.k; j++) {
        total += cb_w[t * p.k + j] * cb_y[(t * p.k + j) * hid + o];
    }
    cb_out[i] = total;
}
