// moe.wgsl: the MoE block (cpu/moe.rs), all f32. moe.rs launches the entries below.
//
// moe_route (cpu moe_route): per token row t, p = softmax(logits[t]) (max subtracted, the sum
//   by a tree), the k largest p in the order of
//   f32::total_cmp, lower expert id first on ties (the CPU's stable sort), weights p / Σ_top p
//   (summed in slot order) when norm_topk, else p. exp is exp_acc below (≤ 2 ulp), not the
//   builtin, whose precision Vulkan and Metal leave loose (3 + 2|x| ulp), so the weights stay
//   within 1e-6 of the CPU's. Rank of expert i = the number of experts ahead of it; the ones of
//   rank < k are the route. One workgroup of 256 a row; rows workgroups. E ≤ 2048, k ≤ 64.
//   Bindings: 1 logits f32 [rows, E], 2 ids u32 [rows, k] (written), 3 weights f32 [rows, k]
//   (written).
//
// Decode and short blocks (rows < moe.rs GEMM_FROM), a slot at a time (cpu moe_experts_decode):
// moe_gate_up_v (cpu expert_mlp's gate, up and swiglu): for each slot s = t·k + j and expert
//   e = ids[s] (clamped below n_exp), act[s, o] = silu(gate_e[o] · x[t]) · (up_e[o] · x[t]).
//   A workgroup of 256 = 8 outputs × 32 lanes; each lane reads 16-byte words of codes (a
//   vec4<u32>: 32 4-bit codes, all in one scale group), two of gate and two of up in flight,
//   x[t] staged in workgroup memory in chunks of 2048 as vec4s (word-major, see stg). A vec4 of codes adds
//   s·Σ code·x + b·Σ x (MLX's factoring; Σ x shared by gate and up), codes turned into floats
//   by the 2^23 trick (no int-to-float conversion). One tree a output over 32 lanes.
//   rows · k · width / 8 workgroups. Bindings: 1-3 gate (qw as vec4s, qs, qb: quant.wgsl,
//   params m), 4-6 up (uw as vec4s, us, ub, params m2), 7 x f32 [rows, hidden] as vec4s,
//   8 ids u32 [rows, k], 9 act f32 [rows·k, width] (written).
// moe_down_v (cpu expert_mlp's down and the slot sum): out[t, o] = Σ_j w[t, j] · (down_e[o] ·
//   act[t·k + j]), j = 0..k in slot order. A workgroup of 256 computes `outs` = 64 / k outputs
//   (at least 1) of one token for all k slots: 4 lanes a (output, slot) pair, each lane the
//   vec4s lane, lane + 4, … of the row (four in flight; a chunk's first four loaded before its
//   act is staged, the next four before these are used), the token's k act rows staged
//   together in chunks of `cw` columns (k · cw ≤ 4096 floats; word-major, see stg); the 4
//   lanes' partials summed, then the slots weighted and summed in order j = 0..k by one thread
//   an output.
//   rows · ceil(hidden / outs) workgroups. Bindings: 1-3 down (qw as vec4s, qs, qb, params m),
//   4 act as vec4s, 5 ids, 6 weights, 7 out f32 [rows, hidden].
//   Both need in % (4 · 32 / bits) == 0 and gs % (4 · 32 / bits) == 0 (a vec4 of codes inside a
//   row and a group), bits 2, 4 or 8, and gate and up of one width in bits (moe.rs vec_ok).
// moe_gate_up_q: moe_gate_up_v's launch, bindings and outputs with x in two int8 levels and
//   integer dot products (4- and 8-bit codes; its own comment below says how).
//
// Decode with the shared expert as slot k (moe_step.wgsl; moe.rs moe_decode_shared, the wgpu
// moe_decode_add and moe_step_add): the MoE block of one token in two launches, two (three with
// moe_route) fewer than the routed experts' two and the shared expert's two GEMVs. They take
// the shared expert only in the stacks' layout (moe.rs shared_slot_ok: its three matrices'
// QMat equal to the stacks', 4- or 8-bit), so one parameter block describes both.
// moe_gate_up_s (cpu expert_mlp's gate, up and swiglu, and the shared expert's in
//   add_shared_expert): moe_gate_up_q for k + 1 slots a token, slot s = t·(k+1) + j; slot k
//   reads the shared expert's gate_proj and up_proj (bindings 10-15) instead of expert ids[j]'s
//   rows. act [rows·(k+1), width]. With p.tiles = 1 (moe_step_add) every workgroup of a routed
//   slot first routes the token itself from its f32 logits (cpu moe_route; moe_route's maths
//   for E ≤ 256, a thread an expert: the max and the sum by the same trees, exp_acc, the keys
//   and ranks, so the same ids and weights bit for bit) and takes its slot's expert; the first
//   workgroup of slot 0 writes the route's ids and weights for moe_down_s (written before the
//   launch ends, read by the next). The route costs each routed workgroup two 8-step trees and
//   a 64-step rank loop before its first weight load; x's first loads go out before it, the
//   shared slot's workgroups skip it. rows · (k+1) · width / 8 workgroups.
//   Bindings: 1-6 the stacks' gate and up (as moe_gate_up_v), 7 x, 8 ids u32 [rows, k] (read;
//   written with p.tiles = 1), 9 act (written), 10-12 shared gate_proj (codes as vec4s, scales,
//   biases), 13-15 shared up_proj, 16 logits f32 [rows, E] and 17 weights f32 [rows, k]
//   (written) with p.tiles = 1 (spare buffers otherwise). 17 storage buffers (moe.rs checks the
//   adapter's); workgroup memory 19.3 KB.
// moe_down_s (cpu moe_decode_compose: moe_experts_decode's slot sum, add_sigmoid_gated, add):
//   moe_down_v over the k + 1 slots (outs = 64 / (k + 1) outputs a workgroup, 4 lanes a (output,
//   slot) pair, the k + 1 act rows staged together: cw = 512 at k = 8, the whole row; the first
//   code loads before the staging), slot k from the shared expert's down_proj (bindings 8-10);
//   then one thread an output: total = Σ_{j<k} w[t, j] · dot_j in slot order, total +=
//   sigmoid(s[t]) · dot_k, h[t, o] += total: the CPU's operations in its order.
//   rows · ceil(hidden / outs) workgroups. Bindings: 1-3 down, 4 act as vec4s, 5 ids, 6 weights,
//   7 h f32 [rows, hidden] (read and written), 8-10 shared down_proj, 11 s f32 [rows] (the
//   shared gate's logit).
//
// Prefill blocks (rows ≥ GEMM_FROM), a grouped GEMM (cpu moe_experts_prefill):
// moe_sort: one workgroup of 256 lists each expert's slots: counts by workgroup atomics, a scan
//   to offsets, a scatter (the order inside an expert's list is free: a slot's result does not
//   depend on its place in a tile), and a table of tiles of ≤ TM = 32 rows of one expert.
//   Writes the sort buffer u32: [0] the number of tiles, [1 + 3i ..] tile i = (expert, start in
//   the list, rows), the list (slots) from 1 + 3 · tiles. n_exp ≤ 1024.
//   Bindings: 1 ids, 2 the sort buffer (written).
// moe_gate_up_mm: per (tile, 64 outputs) a workgroup of 256 computes gate and up for the tile's
//   ≤ 32 rows (the slots' x rows gathered): per step of TK = 32 inputs the 128 weight rows
//   (64 gate, 64 up) are dequantized once into workgroup memory (w = s·code + b, 16 codes a
//   thread) and the 32 x rows staged transposed; each thread holds a 4 rows × (2 gate + 2 up)
//   tile of accumulators (vec4 over rows). A warp (32 invocations) covers 8 rows, so the warps
//   of rows past the tile's count skip the arithmetic. Writes act[slot, o] = silu(g) · u.
//   (ceil(rows·k / 32) + min(n_exp, rows·k)) · width / 64 workgroups, those past the table's
//   count return at once. Bindings: 1-6 gate and up (qw, qs, qb, uw, us, ub), 7 x as vec4s,
//   8 the sort buffer, 9 act.
// moe_down_mm: the same over act for down: per (tile, 128 outputs) y[slot, o] = down_e[o] ·
//   act[slot], 4 rows × 4 outputs a thread. Bindings: 1-3 down, 4 act as vec4s, 5 the sort
//   buffer, 6 y f32 [rows·k, hidden] (as vec4s).
//   Both need bits 2, 4 or 8, gs % 16 == 0, hidden % 128 == 0, width % 64 == 0 (moe.rs mm_ok).
// moe_combine: out[t, o] = Σ_j w[t, j] · y[t·k + j, o], j = 0..k in order (the CPU's slot sum).
//   ceil(rows · hidden / 256) workgroups. Bindings: 1 y, 2 weights, 3 out.
//
// Fallbacks for layouts the entries above do not take (dense stacks, rows not a whole number of
// vec4s, odd widths): moe_gate_up and moe_down (the same maths a scalar word a lane: 8 outputs
// × 32 lanes and 32 outputs × 8 lanes), moe_gate_up_grouped and moe_down_grouped (prefill: a
// workgroup per (expert, 8 or 32 rows) walking the block's slots, then moe_combine). They need
// in % (32 / bits) == 0 and gs % (32 / bits) == 0 (a word never straddles a group).
// Each entry uses its own names for bindings 4.. (and moe_route for 1-3): a pipeline's layout
// holds only what its entry uses.

struct P {
    m: QMat,
    m2: QMat,
    rows: u32,
    k: u32,
    n_exp: u32,
    norm_topk: u32,
    // moe_down_v, moe_down_s: outputs a workgroup and the act columns staged at a time;
    // moe_sort and the _mm entries: the bound on tiles (the size of the tile table in the sort
    // buffer); moe_gate_up_s: 1 = route the token in the launch (else read ids).
    outs: u32,
    cw: u32,
    tiles: u32,
    // `lily lab` only (0 otherwise), moe_gate_up_v and moe_down_v: parts skipped to time the rest
    // (results wrong): 1 the staging and its barriers, 2 the final sums, 8 the dot products,
    // 16 the scale and bias loads (1.0 each). (moe_xq.wgsl's y kernels take theirs as the
    // pipeline constant MY_ABL.)
    ablate: u32,
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
// moe_route: each expert's order key (order_key of its p), read by every thread's rank loop.
var<workgroup> rkey: array<i32, 2048>;

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
    workgroupBarrier();
    var part = 0.0;
    for (var i = li; i < ne; i += 256u) {
        let e = exp_acc(rt_logits[base + i] - m);
        xs[i] = e;
        part += e;
    }
    // The sum by a tree (the CPU's is a loop in expert order: an ulp or two apart, well inside
    // the weights' 1e-6); one thread's serial loop over 256 experts was most of the kernel.
    red[li] = part;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (li < s) {
            red[li] += red[li + s];
        }
        workgroupBarrier();
    }
    let sum = red[0];
    for (var i = li; i < ne; i += 256u) {
        let v = xs[i] / sum;
        xs[i] = v;
        rkey[i] = order_key(v);
    }
    workgroupBarrier();
    // Every thread walks all the keys (no early exit: the same j for the whole workgroup, one
    // broadcast read a step, no loop-carried condition), four at a time.
    let ne4 = ne & ~3u;
    for (var i = li; i < ne; i += 256u) {
        let ki = rkey[i];
        var rank = 0u;
        for (var j = 0u; j < ne4; j += 4u) {
            let k4 = vec4<i32>(rkey[j], rkey[j + 1u], rkey[j + 2u], rkey[j + 3u]);
            let j4 = vec4<u32>(j, j + 1u, j + 2u, j + 3u);
            let ahead = (k4 > vec4<i32>(ki)) | ((k4 == vec4<i32>(ki)) & (j4 < vec4<u32>(i)));
            rank += dot(select(vec4<u32>(0u), vec4<u32>(1u), ahead), vec4<u32>(1u));
        }
        for (var j = ne4; j < ne; j++) {
            let kj = rkey[j];
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

// q_sb for the decode kernels: 1.0 under `lily lab`'s ablation bit 16 (no scale/bias loads).
fn m_sb(i: u32, sb16: u32, is_bias: bool) -> f32 {
    if ((p.ablate & 16u) != 0u) {
        return 1.0;
    }
    return q_sb(i, sb16, is_bias);
}

fn u_sb(i: u32, sb16: u32, is_bias: bool) -> f32 {
    if ((p.ablate & 16u) != 0u) {
        return 1.0;
    }
    let j = sb_idx(i, sb16);
    var w: u32;
    if (is_bias) { w = ub[j]; } else { w = us[j]; }
    return sb_val(w, i, sb16);
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

// ---- the vectorized decode entries and the grouped GEMM (header)

@group(0) @binding(1) var<storage, read> qw4: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> uw4: array<vec4<u32>>;
@group(0) @binding(7) var<storage, read> x4: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> act4: array<vec4<f32>>;

// Staging shared by the entries below (18.6 KB): x or act chunks (_v, _s), dequantized weights
// (_mm). The _v entries stage word-major: vec4 i of code word w of a chunk of `nwp` words at
// i · nwp + w, so the lanes reading consecutive words read consecutive 16 bytes (a word's vec4s
// side by side put a quarter-warp's 8 lanes on the same 4 banks); moe_down_v's slots lie
// DOWN_PAD vec4s further apart than their chunks, so two slots' lanes fall on other banks too.
// STG_LEN = 9 · (128 + DOWN_PAD): moe_down_s's 9 act rows of width 512 staged whole, padded.
const STG_LEN: u32 = 1188u;
var<workgroup> stg: array<vec4<f32>, STG_LEN>;
const DOWN_PAD: u32 = 4u;

// The codes of w at the bit offsets sh as floats: code | 0x4b000000 is the f32 2^23 + code
// (code < 2^23), and subtracting 2^23 is exact; this avoids int-to-float conversions, which run
// at a quarter of the FMA rate on NVIDIA.
fn codes4(w: u32, sh: vec4<u32>, mask: u32) -> vec4<f32> {
    let c = (vec4<u32>(w) >> sh) & vec4<u32>(mask);
    return bitcast<vec4<f32>>(c | vec4<u32>(0x4b000000u)) - vec4<f32>(8388608.0);
}

fn hsum(v: vec4<f32>) -> f32 {
    return (v.x + v.y) + (v.z + v.w);
}

// (Σ code·x over the vec4 of codes a, the same for b, Σ x) with x from word w of the chunk of
// nwp words staged word-major at stg[xb ..]: the 4 · 32 / bits inputs of one vec4 of codes (one
// scale group; moe.rs checks it).
fn dq2(a: vec4<u32>, b: vec4<u32>, xb: u32, w: u32, nwp: u32, bits: u32) -> vec3<f32> {
    var ca = vec4<f32>(0.0);
    var cb = vec4<f32>(0.0);
    var sx = vec4<f32>(0.0);
    if (bits == 4u) {
        for (var j = 0u; j < 4u; j++) {
            let x0 = stg[xb + 2u * j * nwp + w];
            let x1 = stg[xb + (2u * j + 1u) * nwp + w];
            ca = fma(codes4(a[j], vec4<u32>(0u, 4u, 8u, 12u), 15u), x0, ca);
            cb = fma(codes4(b[j], vec4<u32>(0u, 4u, 8u, 12u), 15u), x0, cb);
            ca = fma(codes4(a[j], vec4<u32>(16u, 20u, 24u, 28u), 15u), x1, ca);
            cb = fma(codes4(b[j], vec4<u32>(16u, 20u, 24u, 28u), 15u), x1, cb);
            sx += x0 + x1;
        }
    } else {
        let q = 8u / bits;
        let mask = (1u << bits) - 1u;
        let sh0 = vec4<u32>(0u, bits, 2u * bits, 3u * bits);
        for (var j = 0u; j < 4u; j++) {
            for (var i = 0u; i < q; i++) {
                let xv = stg[xb + (j * q + i) * nwp + w];
                let sh = sh0 + vec4<u32>(4u * bits * i);
                ca = fma(codes4(a[j], sh, mask), xv, ca);
                cb = fma(codes4(b[j], sh, mask), xv, cb);
                sx += xv;
            }
        }
    }
    return vec3<f32>(hsum(ca), hsum(cb), hsum(sx));
}

// dq2 for one vec4 of codes: (Σ code·x, Σ x).
fn dq1(a: vec4<u32>, xb: u32, w: u32, nwp: u32, bits: u32) -> vec2<f32> {
    var ca = vec4<f32>(0.0);
    var sx = vec4<f32>(0.0);
    if (bits == 4u) {
        for (var j = 0u; j < 4u; j++) {
            let x0 = stg[xb + 2u * j * nwp + w];
            let x1 = stg[xb + (2u * j + 1u) * nwp + w];
            ca = fma(codes4(a[j], vec4<u32>(0u, 4u, 8u, 12u), 15u), x0, ca);
            ca = fma(codes4(a[j], vec4<u32>(16u, 20u, 24u, 28u), 15u), x1, ca);
            sx += x0 + x1;
        }
    } else {
        let q = 8u / bits;
        let mask = (1u << bits) - 1u;
        let sh0 = vec4<u32>(0u, bits, 2u * bits, 3u * bits);
        for (var j = 0u; j < 4u; j++) {
            for (var i = 0u; i < q; i++) {
                let xv = stg[xb + (j * q + i) * nwp + w];
                ca = fma(codes4(a[j], sh0 + vec4<u32>(4u * bits * i), mask), xv, ca);
                sx += xv;
            }
        }
    }
    return vec2<f32>(hsum(ca), hsum(sx));
}

@compute @workgroup_size(256)
fn moe_gate_up_v(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let width = p.m.out;
    let hid = p.m.inp;
    let blocks = (width + 7u) / 8u;
    let wg = wg_index(wid);
    let slot = wg / blocks;
    if (slot >= p.rows * p.k) {
        return;
    }
    let o = (wg % blocks) * 8u + li / 32u;
    let lane = li % 32u;
    let t = slot / p.k;
    let e = min(gu_ids[slot], p.n_exp - 1u);
    let bits = p.m.bits;
    let epv = 128u / bits;
    let nvr = hid / epv;
    let row = e * width + min(o, width - 1u);
    let gg = row * (hid / p.m.gs);
    let gu = row * (hid / p.m2.gs);
    var ga = 0.0;
    var ua = 0.0;
    for (var k0 = 0u; k0 < hid; k0 += CH) {
        let n4 = (min(k0 + CH, hid) - k0) / 4u;
        let vpw = 32u / bits;
        let nwp = n4 / vpw;
        let staged = select(n4, 0u, (p.ablate & 1u) != 0u);
        for (var i = li; i < staged; i += 256u) {
            stg[i] = x4[(t * hid + k0) / 4u + (i % nwp) * vpw + i / nwp];
        }
        if ((p.ablate & 1u) == 0u) {
            workgroupBarrier();
        }
        let v0 = k0 / epv;
        let v1 = v0 + 4u * n4 / epv;
        // Two vec4s of each matrix in flight: v and v + 32.
        for (var v = v0 + lane; v < v1; v += 64u) {
            let v2 = v + 32u;
            let a0 = qw4[row * nvr + v];
            let b0 = uw4[row * nvr + v];
            var a1 = vec4<u32>(0u);
            var b1 = vec4<u32>(0u);
            if (v2 < v1) {
                a1 = qw4[row * nvr + v2];
                b1 = uw4[row * nvr + v2];
            }
            var d0 = vec3<f32>(bitcast<f32>(a0.x ^ b0.y), 0.0, 0.0);
            if ((p.ablate & 8u) == 0u) {
                d0 = dq2(a0, b0, 0u, v - v0, nwp, bits);
            }
            let g0 = v * epv;
            ga += m_sb(gg + g0 / p.m.gs, p.m.sb16, false) * d0.x
                + m_sb(gg + g0 / p.m.gs, p.m.sb16, true) * d0.z;
            ua += u_sb(gu + g0 / p.m2.gs, p.m2.sb16, false) * d0.y
                + u_sb(gu + g0 / p.m2.gs, p.m2.sb16, true) * d0.z;
            if (v2 < v1) {
                var d1 = vec3<f32>(bitcast<f32>(a1.x ^ b1.y), 0.0, 0.0);
                if ((p.ablate & 8u) == 0u) {
                    d1 = dq2(a1, b1, 0u, v2 - v0, nwp, bits);
                }
                let g1 = v2 * epv;
                ga += m_sb(gg + g1 / p.m.gs, p.m.sb16, false) * d1.x
                    + m_sb(gg + g1 / p.m.gs, p.m.sb16, true) * d1.z;
                ua += u_sb(gu + g1 / p.m2.gs, p.m2.sb16, false) * d1.y
                    + u_sb(gu + g1 / p.m2.gs, p.m2.sb16, true) * d1.z;
            }
        }
        if ((p.ablate & 1u) == 0u) {
            workgroupBarrier();
        }
    }
    red[li] = ga;
    red2[li] = ua;
    workgroupBarrier();
    for (var s = select(16u, 0u, (p.ablate & 2u) != 0u); s > 0u; s >>= 1u) {
        if (lane < s) {
            red[li] += red[li + s];
            red2[li] += red2[li + s];
        }
        workgroupBarrier();
    }
    if (lane == 0u && o < width) {
        gu_act[slot * width + o] = silu_f(red[li]) * red2[li];
    }
}

// moe_down_v: code vec4 vi of the row at base (zero past v1).
fn dn_load(base: u32, vi: u32, v1: u32) -> vec4<u32> {
    if (vi < v1) {
        return qw4[base + vi];
    }
    return vec4<u32>(0u);
}

// moe_down_v: scale·Σ code·x + bias·Σ x of code vec4 a (vec4 vi of the row; 0 past v1), x from
// the slot's staged chunk at stg[xb ..] (word vi − v0 of nwp), groups from gr.
fn dn_word(a: vec4<u32>, vi: u32, v0: u32, v1: u32, xb: u32, nwp: u32, gr: u32) -> f32 {
    if (vi >= v1) {
        return 0.0;
    }
    var d = vec2<f32>(bitcast<f32>(a.x ^ a.w), 0.0);
    if ((p.ablate & 8u) == 0u) {
        d = dq1(a, xb, vi - v0, nwp, p.m.bits);
    }
    let g = gr + vi * (128u / p.m.bits) / p.m.gs;
    return m_sb(g, p.m.sb16, false) * d.x + m_sb(g, p.m.sb16, true) * d.y;
}

@compute @workgroup_size(256)
fn moe_down_v(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let hid = p.m.out;
    let width = p.m.inp;
    let k = p.k;
    let outs = p.outs;
    let blocks = (hid + outs - 1u) / outs;
    let wg = wg_index(wid);
    let t = wg / blocks;
    if (t >= p.rows) {
        return;
    }
    let ob = (wg % blocks) * outs;
    let pair = li / 4u;
    let lane = li % 4u;
    let j = pair % k;
    let o = ob + pair / k;
    let live = pair < outs * k && o < hid;
    let e = min(dn_ids[t * k + j], p.n_exp - 1u);
    let bits = p.m.bits;
    let epv = 128u / bits;
    let nvr = width / epv;
    let row = e * hid + min(o, hid - 1u);
    let gr = row * (width / p.m.gs);
    // A slot's staged chunk: cw / 4 vec4s, DOWN_PAD more where the slots still fit.
    let cw4 = select(p.cw / 4u, p.cw / 4u + DOWN_PAD, k * (p.cw / 4u + DOWN_PAD) <= STG_LEN);
    let vpw = 32u / bits;
    let base = row * nvr;
    var acc = 0.0;
    for (var c0 = 0u; c0 < width; c0 += p.cw) {
        let n4 = (min(c0 + p.cw, width) - c0) / 4u;
        let nwp = n4 / vpw;
        let v0 = c0 / epv;
        let v1 = v0 + 4u * n4 / epv;
        // Four vec4s in flight: v, v + 4, v + 8, v + 12 (a row of 512 4-bit codes is 16),
        // held in four values: as an array they went to local memory (64 bytes a thread,
        // the driver's statistics on the H200). The chunk's first four are loaded before its
        // act rows are staged, so that their DRAM latency passes under the staging and its
        // barrier instead of after it (the codes do not depend on act).
        var a0 = vec4<u32>(0u);
        var a1 = vec4<u32>(0u);
        var a2 = vec4<u32>(0u);
        var a3 = vec4<u32>(0u);
        if (live) {
            a0 = dn_load(base, v0 + lane, v1);
            a1 = dn_load(base, v0 + lane + 4u, v1);
            a2 = dn_load(base, v0 + lane + 8u, v1);
            a3 = dn_load(base, v0 + lane + 12u, v1);
        }
        let staged = select(k * n4, 0u, (p.ablate & 1u) != 0u);
        for (var i = li; i < staged; i += 256u) {
            let jj = i / n4;
            let q = i % n4;
            stg[jj * cw4 + q] = act4[((t * k + jj) * width + c0) / 4u + (q % nwp) * vpw + q / nwp];
        }
        if ((p.ablate & 1u) == 0u) {
            workgroupBarrier();
        }
        if (live) {
            for (var v = v0 + lane; v < v1; v += 16u) {
                let w0 = a0;
                let w1 = a1;
                let w2 = a2;
                let w3 = a3;
                // The next four (rows past 16 vec4s: wider experts, 2-bit codes) before these
                // are used; the sums keep their order.
                if (v + 16u < v1) {
                    a0 = dn_load(base, v + 16u, v1);
                    a1 = dn_load(base, v + 20u, v1);
                    a2 = dn_load(base, v + 24u, v1);
                    a3 = dn_load(base, v + 28u, v1);
                }
                acc += dn_word(w0, v, v0, v1, j * cw4, nwp, gr);
                acc += dn_word(w1, v + 4u, v0, v1, j * cw4, nwp, gr);
                acc += dn_word(w2, v + 8u, v0, v1, j * cw4, nwp, gr);
                acc += dn_word(w3, v + 12u, v0, v1, j * cw4, nwp, gr);
            }
        }
        if ((p.ablate & 1u) == 0u) {
            workgroupBarrier();
        }
    }
    red[li] = acc;
    workgroupBarrier();
    if (li < outs && ob + li < hid) {
        var total = 0.0;
        for (var jj = 0u; jj < k; jj++) {
            let b = (li * k + jj) * 4u;
            total += dn_w[t * k + jj] * ((red[b] + red[b + 1u]) + (red[b + 2u] + red[b + 3u]));
        }
        dn_out[t * hid + ob + li] = total;
    }
}

// ---- moe_gate_up_q: moe_gate_up_v's launch and outputs, x in two int8 levels (q2x.wgsl) and
// the gate and up code words by integer dot products (4- and 8-bit codes; moe.rs picks it).
// Each workgroup (a slot's 8 outputs, 32 lanes a row) quantizes the token's x itself, 128 code
// words a pass.

// The elements of word u's u32 j of x's row t at code word c0 (4-bit: xl, xh; 8-bit: xl).
fn moe_q_load(t: u32, hid: u32, c0: u32, u: u32, j: u32, nv: u32, bits: u32,
              xl: ptr<function, vec4<f32>>, xh: ptr<function, vec4<f32>>) {
    if (u >= nv) {
        return;
    }
    let epw = 128u / bits;
    let v = (t * hid) / 4u + (c0 + u) * (epw / 4u) + j * (epw / 16u);
    *xl = x4[v];
    if (bits == 4u) {
        *xh = x4[v + 1u];
    }
    g5_share(u, j, *xl, *xh);
}

@compute @workgroup_size(256)
fn moe_gate_up_q(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let width = p.m.out;
    let hid = p.m.inp;
    let blocks = (width + 7u) / 8u;
    let wg = wg_index(wid);
    let slot = wg / blocks;
    if (slot >= p.rows * p.k) {
        return;
    }
    let o = (wg % blocks) * 8u + li / 32u;
    let lane = li % 32u;
    let t = slot / p.k;
    let e = min(gu_ids[slot], p.n_exp - 1u);
    let bits = p.m.bits;
    let epw = 128u / bits;
    let wpr = hid / epw;
    let row = e * width + min(o, width - 1u);
    let gg = row * (hid / p.m.gs);
    let gu = row * (hid / p.m2.gs);
    let j = li % 4u;
    let ua = li / 4u;
    let ub = ua + 64u;
    var ga = 0.0;
    var uacc = 0.0;
    for (var c0 = 0u; c0 < wpr; c0 += G5_W) {
        let nv = min(G5_W, wpr - c0);
        // The first code words are loaded before x is staged.
        var c = lane;
        var a = vec4<u32>(0u);
        var b = vec4<u32>(0u);
        if (c < nv) {
            a = qw4[row * wpr + c0 + c];
            b = uw4[row * wpr + c0 + c];
        }
        workgroupBarrier();
        var xla = vec4<f32>(0.0);
        var xha = vec4<f32>(0.0);
        var xlb = vec4<f32>(0.0);
        var xhb = vec4<f32>(0.0);
        moe_q_load(t, hid, c0, ua, j, nv, bits, &xla, &xha);
        moe_q_load(t, hid, c0, ub, j, nv, bits, &xlb, &xhb);
        workgroupBarrier();
        g5_quant(ua, j, nv, bits, xla, xha);
        g5_quant(ub, j, nv, bits, xlb, xhb);
        workgroupBarrier();
        if (bits == 8u) {
            g5_correct(li, nv);
            workgroupBarrier();
        }
        for (; c < nv; c += 32u) {
            let wa = a;
            let wb = b;
            let cn = c + 32u;
            if (cn < nv) {
                a = qw4[row * wpr + c0 + cn];
                b = uw4[row * wpr + c0 + cn];
            }
            let qa1 = g5_q[c];
            let qb1 = g5_q[128u + c];
            let qa2 = g5_q[256u + c];
            let qb2 = g5_q[384u + c];
            let dd = g5_d[c];
            let corr = bitcast<i32>(dd.z);
            let ig = f32(g5_dot(wa, bits, qa1, qb1, qa2, qb2) + corr);
            let iu = f32(g5_dot(wb, bits, qa1, qb1, qa2, qb2) + corr);
            let k = (c0 + c) * epw;
            ga += q_sb(gg + k / p.m.gs, p.m.sb16, false) * (dd.x * ig)
                + q_sb(gg + k / p.m.gs, p.m.sb16, true) * dd.y;
            uacc += u_sb(gu + k / p.m2.gs, p.m2.sb16, false) * (dd.x * iu)
                + u_sb(gu + k / p.m2.gs, p.m2.sb16, true) * dd.y;
        }
    }
    red[li] = ga;
    red2[li] = uacc;
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
}

// ---- the grouped GEMM (prefill)

const TM: u32 = 32u;
const TK: u32 = 32u;

var<workgroup> so_cnt: array<atomic<u32>, 1024>;
var<workgroup> so_cur: array<atomic<u32>, 1024>;
var<workgroup> so_off: array<u32, 1024>;
var<workgroup> so_toff: array<u32, 1024>;
var<workgroup> so_scan: array<vec2<u32>, 256>;

@group(0) @binding(1) var<storage, read> so_ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> so_out: array<u32>;

@compute @workgroup_size(256)
fn moe_sort(@builtin(local_invocation_index) li: u32) {
    let ne = p.n_exp;
    let ns = p.rows * p.k;
    for (var e = li; e < ne; e += 256u) {
        atomicStore(&so_cnt[e], 0u);
        atomicStore(&so_cur[e], 0u);
    }
    workgroupBarrier();
    for (var s = li; s < ns; s += 256u) {
        atomicAdd(&so_cnt[min(so_ids[s], ne - 1u)], 1u);
    }
    workgroupBarrier();
    // Each thread's run of experts: its slots and tiles, then a scan over the runs.
    let per = (ne + 255u) / 256u;
    let e0 = min(li * per, ne);
    let e1 = min(e0 + per, ne);
    var run = vec2<u32>(0u);
    for (var e = e0; e < e1; e++) {
        let c = atomicLoad(&so_cnt[e]);
        run += vec2<u32>(c, (c + TM - 1u) / TM);
    }
    so_scan[li] = run;
    workgroupBarrier();
    for (var d = 1u; d < 256u; d <<= 1u) {
        var v = so_scan[li];
        if (li >= d) {
            v += so_scan[li - d];
        }
        workgroupBarrier();
        so_scan[li] = v;
        workgroupBarrier();
    }
    var at = so_scan[li] - run;
    for (var e = e0; e < e1; e++) {
        let c = atomicLoad(&so_cnt[e]);
        so_off[e] = at.x;
        so_toff[e] = at.y;
        at += vec2<u32>(c, (c + TM - 1u) / TM);
    }
    let total = so_scan[255];
    workgroupBarrier();
    let l0 = 1u + 3u * p.tiles;
    for (var s = li; s < ns; s += 256u) {
        let e = min(so_ids[s], ne - 1u);
        let i = atomicAdd(&so_cur[e], 1u);
        so_out[l0 + so_off[e] + i] = s;
    }
    for (var e = li; e < ne; e += 256u) {
        let c = atomicLoad(&so_cnt[e]);
        for (var i = 0u; i * TM < c; i++) {
            let b = 1u + 3u * (so_toff[e] + i);
            so_out[b] = e;
            so_out[b + 1u] = so_off[e] + i * TM;
            so_out[b + 2u] = min(TM, c - i * TM);
        }
    }
    if (li == 0u) {
        so_out[0] = total.y;
    }
}

// The tile's x (or act) rows, transposed: mx[kk · 8 + g] = inputs k0 + kk of rows 4g .. 4g + 3.
var<workgroup> mx: array<vec4<f32>, 256>;
// The tile's slots (rows past its count: 0xffffffff).
var<workgroup> mslot: array<u32, 32>;

// Stages 16 weights of `row` from input k (a multiple of 16 inside one group) of the matrix at
// bindings 1-3, dequantized, into stg[dst + 32 i][comp], i = 0..16.
fn stage_q(m: QMat, row: u32, k: u32, dst: u32, comp: u32) {
    let g = row * (m.inp / m.gs) + k / m.gs;
    let s = q_sb(g, m.sb16, false);
    let b = q_sb(g, m.sb16, true);
    let per = 32u / m.bits;
    let w0 = row * (m.inp / per) + k / per;
    if (m.bits == 4u) {
        let wa = qw[w0];
        let wb = qw[w0 + 1u];
        for (var i = 0u; i < 8u; i++) {
            let ca = (wa >> (4u * i)) & 15u;
            let cb = (wb >> (4u * i)) & 15u;
            stg[dst + 32u * i][comp] = s * (bitcast<f32>(ca | 0x4b000000u) - 8388608.0) + b;
            stg[dst + 32u * (i + 8u)][comp] = s * (bitcast<f32>(cb | 0x4b000000u) - 8388608.0) + b;
        }
        return;
    }
    let mask = (1u << m.bits) - 1u;
    for (var i = 0u; i < 16u; i++) {
        let c = (qw[w0 + i / per] >> ((i % per) * m.bits)) & mask;
        stg[dst + 32u * i][comp] = s * (bitcast<f32>(c | 0x4b000000u) - 8388608.0) + b;
    }
}

// stage_q for the matrix at bindings 4-6 (up).
fn stage_u(m: QMat, row: u32, k: u32, dst: u32, comp: u32) {
    let g = row * (m.inp / m.gs) + k / m.gs;
    let s = u_sb(g, m.sb16, false);
    let b = u_sb(g, m.sb16, true);
    let per = 32u / m.bits;
    let w0 = row * (m.inp / per) + k / per;
    if (m.bits == 4u) {
        let wa = uw[w0];
        let wb = uw[w0 + 1u];
        for (var i = 0u; i < 8u; i++) {
            let ca = (wa >> (4u * i)) & 15u;
            let cb = (wb >> (4u * i)) & 15u;
            stg[dst + 32u * i][comp] = s * (bitcast<f32>(ca | 0x4b000000u) - 8388608.0) + b;
            stg[dst + 32u * (i + 8u)][comp] = s * (bitcast<f32>(cb | 0x4b000000u) - 8388608.0) + b;
        }
        return;
    }
    let mask = (1u << m.bits) - 1u;
    for (var i = 0u; i < 16u; i++) {
        let c = (uw[w0 + i / per] >> ((i % per) * m.bits)) & mask;
        stg[dst + 32u * i][comp] = s * (bitcast<f32>(c | 0x4b000000u) - 8388608.0) + b;
    }
}

// Stages the tile's inputs k0 + 4q .. k0 + 4q + 3 of row r (v: those values, zeros past the
// tile's count) into mx.
fn stage_x(r: u32, q: u32, v: vec4<f32>) {
    let d = 4u * q * 8u + r / 4u;
    let c = r % 4u;
    mx[d][c] = v.x;
    mx[d + 8u][c] = v.y;
    mx[d + 16u][c] = v.z;
    mx[d + 24u][c] = v.w;
}

@group(0) @binding(8) var<storage, read> mg_sort: array<u32>;

@compute @workgroup_size(256)
fn moe_gate_up_mm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let width = p.m.out;
    let hid = p.m.inp;
    let nob = width / 64u;
    let wg = wg_index(wid);
    let tile = wg / nob;
    if (tile >= mg_sort[0]) {
        return;
    }
    let e = mg_sort[1u + 3u * tile];
    let start = mg_sort[2u + 3u * tile];
    let n = mg_sort[3u + 3u * tile];
    let o0 = (wg % nob) * 64u;
    if (li < TM) {
        var s = 0xffffffffu;
        if (li < n) {
            s = mg_sort[1u + 3u * p.tiles + start + li];
        }
        mslot[li] = s;
    }
    workgroupBarrier();
    // Arithmetic roles: warp w = li / 32 holds rows 8 (w % 4) .. + 8 (two row groups of 4 across
    // its lanes) and 16 column groups (outputs 2c, 2c + 1 of gate and of up).
    let w = li / 32u;
    let lane = li % 32u;
    let rg = (w % 4u) * 2u + lane % 2u;
    let tc = (w / 4u) * 16u + lane / 2u;
    let live = (w % 4u) * 8u < n;
    // Staging roles: weight row sr of the 128 (gate 0..63, up 64..127), inputs 16 half ..;
    // x row xr, inputs 4 xq ...
    let sr = li / 2u;
    let half = li % 2u;
    let so = sr % 64u;
    let wrow = e * width + o0 + so;
    let dst = half * 16u * 32u + so / 2u;
    let comp = (sr / 64u) * 2u + so % 2u;
    let xr = li % 32u;
    let xq = li / 32u;
    let xslot = mslot[xr];
    let xt = select(0u, xslot / p.k, xr < n);
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < hid; k0 += TK) {
        if (sr < 64u) {
            stage_q(p.m, wrow, k0 + 16u * half, dst, comp);
        } else {
            stage_u(p.m2, wrow, k0 + 16u * half, dst, comp);
        }
        var xv = vec4<f32>(0.0);
        if (xr < n) {
            xv = x4[(xt * hid + k0) / 4u + xq];
        }
        stage_x(xr, xq, xv);
        workgroupBarrier();
        if (live) {
            for (var kk = 0u; kk < TK; kk++) {
                let xk = mx[kk * 8u + rg];
                let wk = stg[kk * 32u + tc];
                a0 = fma(xk, vec4<f32>(wk.x), a0);
                a1 = fma(xk, vec4<f32>(wk.y), a1);
                a2 = fma(xk, vec4<f32>(wk.z), a2);
                a3 = fma(xk, vec4<f32>(wk.w), a3);
            }
        }
        workgroupBarrier();
    }
    for (var r = 0u; r < 4u; r++) {
        if (rg * 4u + r < n) {
            let base = mslot[rg * 4u + r] * width + o0 + 2u * tc;
            gu_act[base] = silu_f(a0[r]) * a2[r];
            gu_act[base + 1u] = silu_f(a1[r]) * a3[r];
        }
    }
}

@group(0) @binding(5) var<storage, read> md_sort: array<u32>;
@group(0) @binding(6) var<storage, read_write> md_y: array<vec4<f32>>;

@compute @workgroup_size(256)
fn moe_down_mm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let hid = p.m.out;
    let width = p.m.inp;
    let nob = hid / 128u;
    let wg = wg_index(wid);
    let tile = wg / nob;
    if (tile >= md_sort[0]) {
        return;
    }
    let e = md_sort[1u + 3u * tile];
    let start = md_sort[2u + 3u * tile];
    let n = md_sort[3u + 3u * tile];
    let o0 = (wg % nob) * 128u;
    if (li < TM) {
        var s = 0xffffffffu;
        if (li < n) {
            s = md_sort[1u + 3u * p.tiles + start + li];
        }
        mslot[li] = s;
    }
    workgroupBarrier();
    // As moe_gate_up_mm, with column group c = outputs 4c .. 4c + 3 of down.
    let w = li / 32u;
    let lane = li % 32u;
    let rg = (w % 4u) * 2u + lane % 2u;
    let tc = (w / 4u) * 16u + lane / 2u;
    let live = (w % 4u) * 8u < n;
    let sr = li / 2u;
    let half = li % 2u;
    let wrow = e * hid + o0 + sr;
    let dst = half * 16u * 32u + sr / 4u;
    let comp = sr % 4u;
    let xr = li % 32u;
    let xq = li / 32u;
    let xs_ = select(0u, mslot[xr], xr < n);
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < width; k0 += TK) {
        stage_q(p.m, wrow, k0 + 16u * half, dst, comp);
        var xv = vec4<f32>(0.0);
        if (xr < n) {
            xv = act4[(xs_ * width + k0) / 4u + xq];
        }
        stage_x(xr, xq, xv);
        workgroupBarrier();
        if (live) {
            for (var kk = 0u; kk < TK; kk++) {
                let xk = mx[kk * 8u + rg];
                let wk = stg[kk * 32u + tc];
                a0 = fma(xk, vec4<f32>(wk.x), a0);
                a1 = fma(xk, vec4<f32>(wk.y), a1);
                a2 = fma(xk, vec4<f32>(wk.z), a2);
                a3 = fma(xk, vec4<f32>(wk.w), a3);
            }
        }
        workgroupBarrier();
    }
    for (var r = 0u; r < 4u; r++) {
        if (rg * 4u + r < n) {
            md_y[(mslot[rg * 4u + r] * hid + o0 + 4u * tc) / 4u] = vec4<f32>(a0[r], a1[r], a2[r], a3[r]);
        }
    }
}
