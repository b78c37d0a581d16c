// moe_xq.wgsl: the decode MoE block with x and act staged once a launch (moe.rs `XQ_SHADER`,
// `moe_decode_shared` with `LILY_WGPU_MOE_XQ`, the default where the adapter has ordered
// subgroups of one width): moe_gate_up_x and moe_down_x, the twins of moe_step.wgsl's
// moe_gate_up_s and moe_down_s (same maths, same CPU functions: expert_mlp, add_shared_expert,
// moe_route, moe_decode_compose), without their workgroup staging. Appended to moe.wgsl,
// moe_step.wgsl and q2x_sg.wgsl in one module (its parameter block, bindings, exp_acc,
// order_key; team_sum, q2x_words), made only on adapters with subgroups.
//
// The defaults are their y twins (at the end of the file, `LILY_WGPU_MOE_XQ`): moe_gate_up_y and
// moe_down_y, the same maths with every weight load of a lane issued at once (H200 lab, one
// token's gate|up and down with the shared expert: 20.1 µs against 32.9); for one token with
// their pipeline constants, moe_down_y2 (two outputs a team, half the workgroups: 4K decode on
// the H100 1.034×, stop 42; `LILY_WGPU_MOE_DOWN=y` for moe_down_y), and since stop 46 act staged
// by down: moe_gate_up_y on 16 outputs a workgroup writing act in f32 alone (MY_NOQ),
// moe_down_y2q staging it into workgroup memory (MY_AQW; `LILY_WGPU_MOE_ACT=gate` for gate|up's
// staging: its 144 workgroups of 64 KB on 132 SMs, then a barrier and the quantizing).
//
// moe_gate_up_x: act[s, o] = silu(gate_e[o] · x) · (up_e[o] · x) for the k + 1 slots of token t
//   (slot k the shared expert), x read as q2x_stage staged it (xq.wgsl's layouts: the router's
//   launch staged the normed x, or moe.rs stages x itself), integer dot products as gemv_q6's
//   q6_dot: a team of T = p.outs lanes (8, 16 or 32) owns R = T / 8 outputs (gate and up rows
//   of each), lane l reads code words l, l + T, … of its 2R rows and x's words from the staged
//   buffer (L1/L2), the team sums by shuffles (team_sum). A workgroup: 256 / T teams = 32
//   consecutive outputs of one slot (64 KB of 4-bit codes at hidden 2048), no barrier before
//   its weights but the route's. With p.tiles = 1 a routed slot's workgroup routes the token
//   itself (gx_route: moe_route's ids and weights to the bit, 5 barriers instead of
//   gs_route's 18 and a rank loop over the few candidates instead of all 256 experts); the
//   shared slot's workgroups skip it. Epilogue: act in f32 (for moe_down_s) and, as the 32
//   outputs make one 4-bit word of act (two 8-bit), quantized in q2x_stage's layouts to aq,
//   row t · (k + 1) + j (moe_down_x's x), by the workgroup's first 4 threads after a barrier.
//   (k + 1) · width / 32 workgroups a token. Bindings: 1-6 the stacks' gate and up, 7 the
//   staged x (vec4<u32>, row t at t · xq_row(hidden)), 8 ids (read; written with p.tiles = 1),
//   9 act f32, 10-15 the shared gate and up, 16 logits, 17 weights (p.tiles = 1), 18 aq
//   (written). Needs width % 32 == 0, hidden % 32 == 0 (moe.rs xq_ok).
// moe_down_x: h[t, o] += Σ_{j<k} w[t, j] · (down_{ids[j]}[o] · act_j) in slot order, then
//   + sigmoid(s[t]) · (shared down[o] · act_k): moe_down_s's sum in its order, the dots by
//   integer products against aq. A team of T lanes (p.outs & 0xffff) takes one output and a
//   range of the routed slots (S = p.outs >> 16 ranges of ceil(k / S), the last range also
//   the shared slot), four slots' words in flight at once; lane 0 of the team puts each
//   slot's dot in workgroup memory (xs), and after the workgroup's one barrier a thread an
//   output sums them in slot order. 256 / (T · S) outputs a workgroup, ceil(hidden / that)
//   workgroups a token. Bindings: 1-3 down, 4 aq, 5 ids, 6 weights, 7 h (read and written),
//   8-10 the shared down, 11 s (the shared gate's logit). Needs outputs · (k + 1) ≤ 2048.

// The y kernels' launch as pipeline constants (`LILY_WGPU_SPEC` moe, the default since
// stop 38; moe.rs `y_spec` sets them for each of the two pipelines): with MY_ON the accessors
// below give the constants, so that the divisions by the widths and group sizes, the route's
// loops over the subgroups (its per-lane array then indexed by constants alone), the slot
// arithmetic and the branches on the launch fold, and the subgroup width needs no broadcast
// (a barrier). Without (every other pipeline of this module, and these by default) they read
// the parameter block as before. The x kernels share gx_route, gx_expert and dx_sb, never with
// MY_ON. The defaults: gate|up's launch at the full preset's shapes (`lily lab
// --pipeline-stats` compiles them with MY_ON off).
override MY_ON: bool = false;
override MY_OUT: u32 = 512u;
override MY_INP: u32 = 2048u;
override MY_GS: u32 = 64u;
override MY_SB16: u32 = 1u;
override MY_GS2: u32 = 64u;
override MY_SB162: u32 = 1u;
override MY_ROWS: u32 = 1u;
override MY_K: u32 = 8u;
override MY_NEXP: u32 = 256u;
override MY_NORM: u32 = 1u;
override MY_OUTS: u32 = 32u;
override MY_TILES: u32 = 1u;
override MY_SG: u32 = 32u;
// x staged ahead by the projection before the block (matmul_sg.wgsl's omode 5: without the
// norm's 1 / rms, the partial sums of squares after the row): gate|up's dots scaled by gx_rn's
// (the norm's eps as f32 bits in p.cw, which gate|up does not read otherwise). Only with MY_ON.
override MY_RN: bool = false;
// The router folded into the projection before the block too (matmul_sg.wgsl omode 6,
// `LILY_WGPU_XQ_AHEAD=fold`; with MY_RN): no router launch ran, so the route takes each
// logit from the projection's partial dots (gx_fold_logit) and the route's writer also writes
// the logits (binding 19) and the shared gate's logit (20, for down). Only with MY_ON, one row.
override MY_FOLD: bool = false;
// `LILY_WGPU_MOE_ACT=down16`, the default (moe.rs `act_takes`; only with MY_ON): act staged by
// down, not by gate|up. MY_NOQ: gate|up writes act in f32 alone (no barrier, no quantizing in
// its epilogue), on half the outputs a workgroup where a team has two or more (a team's R =
// T / 16: 16 outputs a workgroup at hidden 2048, 288 workgroups of 32 KB, not 144 of 64 KB).
// MY_AQW: moe_down_y2q stages act from those f32 values into workgroup memory (dq_stage) while
// its weights are in flight, and its dots read act there.
override MY_NOQ: bool = false;
override MY_AQW: bool = false;
// gate|up's epilogue stages act's 8-bit layout too (for an 8-bit down); false (moe.rs, with
// MY_ON, where down is 4-bit) leaves it out: its quantizing and its stores.
override MY_A8: bool = true;
// `lily lab` only (moe.rs sets it from the lab's ablation bits; 0 in a step, so the step's
// kernels carry no test of it): moe_gate_up_y without 8 its dot products, 32 its act staging.
override MY_ABL: u32 = 0u;

fn my_out() -> u32 { return select(p.m.out, MY_OUT, MY_ON); }
fn my_inp() -> u32 { return select(p.m.inp, MY_INP, MY_ON); }
fn my_gs() -> u32 { return select(p.m.gs, MY_GS, MY_ON); }
fn my_sb16() -> u32 { return select(p.m.sb16, MY_SB16, MY_ON); }
fn my_gs2() -> u32 { return select(p.m2.gs, MY_GS2, MY_ON); }
fn my_sb162() -> u32 { return select(p.m2.sb16, MY_SB162, MY_ON); }
fn my_rows() -> u32 { return select(p.rows, MY_ROWS, MY_ON); }
fn my_k() -> u32 { return select(p.k, MY_K, MY_ON); }
fn my_nexp() -> u32 { return select(p.n_exp, MY_NEXP, MY_ON); }
fn my_norm() -> u32 { return select(p.norm_topk, MY_NORM, MY_ON); }
fn my_outs() -> u32 { return select(p.outs, MY_OUTS, MY_ON); }
fn my_tiles() -> u32 { return select(p.tiles, MY_TILES, MY_ON); }

// The subgroup width, uniform over the workgroup (every invocation calls it).
fn my_sg(li: u32, sg_size: u32) -> u32 {
    if (MY_ON) {
        return MY_SG;
    }
    if (li == 0u) {
        rw_sg = sg_size;
    }
    return workgroupUniformLoad(&rw_sg);
}

@group(0) @binding(7) var<storage, read> gx_x: array<vec4<u32>>;
@group(0) @binding(18) var<storage, read_write> gx_aq: array<vec4<u32>>;
// MY_FOLD: the logits and the shared gate's logit, written by the route's writer (spares
// otherwise; the logits at 16 are then not bound: a spare).
@group(0) @binding(19) var<storage, read_write> gy_l: array<f32>;
@group(0) @binding(20) var<storage, read_write> gy_s: array<f32>;
// MY_FOLD: the row's 1 / rms (gx_rn), for gx_fold_logit.
var<private> gx_rnv: f32;
@group(0) @binding(4) var<storage, read> dx_aq: array<vec4<u32>>;

// Each subgroup's largest logit and largest key (the route), and the route's candidates:
// their count and (key, id).
var<workgroup> gx_smax: array<f32, 64>;
var<workgroup> gx_kmax: array<i32, 64>;
var<workgroup> gx_n: atomic<u32>;
var<workgroup> gx_cand: array<vec2<i32>, 256>;

// A code word's x as staged (xq.wgsl): 4-bit q1 even, q1 odd, q2 even, q2 odd, (d / 254, Σ x,
// correction); 8-bit words leave b1 and b2 zero.
struct GxW {
    a1: vec4<u32>,
    b1: vec4<u32>,
    a2: vec4<u32>,
    b2: vec4<u32>,
    m: vec4<u32>,
}

// Word c of the row staged at xb (inp elements) of gate|up's x.
fn gx_xword(xb: u32, c: u32, inp: u32, bits: u32) -> GxW {
    var r: GxW;
    let w4 = inp / 32u;
    if (bits == 4u) {
        r.a1 = gx_x[xb + c];
        r.b1 = gx_x[xb + w4 + c];
        r.a2 = gx_x[xb + 2u * w4 + c];
        r.b2 = gx_x[xb + 3u * w4 + c];
        r.m = gx_x[xb + 4u * w4 + c];
    } else {
        let x8 = xb + 5u * w4;
        let w8 = inp / 16u;
        r.a1 = gx_x[x8 + c];
        r.a2 = gx_x[x8 + w8 + c];
        r.m = gx_x[x8 + 2u * w8 + c];
    }
    return r;
}

// The row's 1 / rms for x staged ahead (MY_RN): matmul_sg.wgsl q6_rn's sum, in its order, of
// the inp / 32 partial sums of squares after the row staged at xb.
fn gx_rn(xb: u32, inp: u32) -> f32 {
    let s = gx_vsum(xb + 5u * (inp / 32u) + 3u * (inp / 16u), inp / 128u);
    return 1.0 / sqrt(s / f32(inp) + bitcast<f32>(p.cw));
}

// The n vec4s of f32 bits at gx_x[base ..] added in order, a component at a time (gx_rn's
// partial sums of squares, gx_fold_logit's router dots).
fn gx_vsum(base: u32, n: u32) -> f32 {
    var s = 0.0;
    for (var j = 0u; j < n; j++) {
        let p = bitcast<vec4<f32>>(gx_x[base + j]);
        s += p.x;
        s += p.y;
        s += p.z;
        s += p.w;
    }
    return s;
}

// MY_FOLD: router row e's logit (e = E: the shared gate's), the n / 32 workgroups' partial dots
// after the staged row and its sums of squares (matmul_sg.wgsl q6_fold_part: row e's values
// contiguous, n / 128 vec4s), added in workgroup order, times the 1 / rms (gx_rnv). One row of
// x: the staging at 0.
fn gx_fold_logit(e: u32) -> f32 {
    let hid = my_inp();
    let base = 5u * (hid / 32u) + 3u * (hid / 16u) + hid / 128u + e * (hid / 128u);
    return gx_vsum(base, hid / 128u) * gx_rnv;
}

// The same of down's act (aq as moe_gate_up_x staged it).
fn dx_xword(xb: u32, c: u32, inp: u32, bits: u32) -> GxW {
    var r: GxW;
    let w4 = inp / 32u;
    if (bits == 4u) {
        r.a1 = dx_aq[xb + c];
        r.b1 = dx_aq[xb + w4 + c];
        r.a2 = dx_aq[xb + 2u * w4 + c];
        r.b2 = dx_aq[xb + 3u * w4 + c];
        r.m = dx_aq[xb + 4u * w4 + c];
    } else {
        let x8 = xb + 5u * w4;
        let w8 = inp / 16u;
        r.a1 = dx_aq[x8 + c];
        r.a2 = dx_aq[x8 + w8 + c];
        r.m = dx_aq[x8 + 2u * w8 + c];
    }
    return r;
}

// A code word's dot against its staged x: Σ code · x ≈ s · dd · (integer) + b · Σ x (q6_dot).
fn gx_dot(w: vec4<u32>, bits: u32, x: GxW, s: f32, b: f32) -> f32 {
    let dd = bitcast<f32>(x.m.x);
    let sx = bitcast<f32>(x.m.y);
    // 0 for 4-bit words (q2x_stage writes it so).
    let corr = bitcast<i32>(x.m.z);
    return s * (dd * f32(g5_dot(w, bits, x.a1, x.b1, x.a2, x.b2) + corr)) + b * sx;
}

// Node i (< 32) of moe_route's sum tree (red[i] += red[i + s] for s = 128, 64, 32), from the 8
// values it sums, in the tree's order.
fn gx_node32(i: u32) -> f32 {
    return ((red[i] + red[i + 128u]) + (red[i + 64u] + red[i + 192u]))
        + ((red[i + 32u] + red[i + 160u]) + (red[i + 96u] + red[i + 224u]));
}

// gs_route's result (the ids in rtop[0..k), p in red2; the weights written when `write`) by
// fewer barriers, every value the same bits as moe_route's:
// - the max is order-free: each subgroup's subgroupMax, then the subgroups' maxima;
// - the sum is moe_route's tree: its node at level w = min(sg, 32) from the level-32 nodes in
//   the tree's order, then the levels below w by shuffles (lane i adds lane i ^ o's node: the
//   tree's red[i] + red[i + o], the same operands);
// - the rank only among candidates: each subgroup's largest key is a distinct expert, so with
//   at least k subgroups the k-th largest key is ≥ the least of those maxima; an expert below it
//   is neither in the top k nor ahead of one that is, so a candidate's rank among the
//   candidates is its rank among all (the same keys and ties by id as moe_route).
// Every invocation calls it (barriers; sg and lsg as team_sum's).
fn gx_route(t: u32, li: u32, sg: u32, lsg: u32, write: bool) {
    let ne = my_nexp();
    let nsg = 256u / sg;
    // Bindings 19 and 20 are every gate|up pipeline's (one derived layout whatever MY_FOLD):
    // a use the launch never runs (the route's k is at most the expert count).
    if (p.k > 0xfffffu) {
        gy_l[0] = gy_s[0];
    }
    var l = bitcast<f32>(0xff800000u);
    if (li < ne) {
        if (MY_FOLD) {
            l = gx_fold_logit(li);
            if (write) {
                gy_l[t * ne + li] = l;
            }
        } else {
            l = gs_logits[t * ne + li];
        }
    }
    let sm = subgroupMax(l);
    if (lsg == 0u) {
        gx_smax[li / sg] = sm;
    }
    if (li == 0u) {
        atomicStore(&gx_n, 0u);
    }
    workgroupBarrier();
    var m = gx_smax[0];
    for (var i = 1u; i < nsg; i++) {
        m = max(m, gx_smax[i]);
    }
    var part = 0.0;
    if (li < ne) {
        part += exp_acc(l - m);
    }
    red[li] = part;
    workgroupBarrier();
    let w = min(sg, 32u);
    let i = lsg % w;
    // Level w's node i: the level-32 nodes i, i + w, … halved in the tree's order.
    var a = array<f32, 8>(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    let n = 32u / w;
    for (var q = 0u; q < n; q++) {
        a[q] = gx_node32(i + q * w);
    }
    for (var hh = n / 2u; hh > 0u; hh >>= 1u) {
        for (var q = 0u; q < hh; q++) {
            a[q] = a[q] + a[q + hh];
        }
    }
    var s = a[0];
    for (var o = w / 2u; o > 0u; o >>= 1u) {
        s = s + subgroupShuffleXor(s, o);
    }
    let sum = subgroupShuffle(s, 0u);
    var key = bitcast<i32>(0x80000000u);
    if (li < ne) {
        let v = part / sum;
        red2[li] = v;
        key = order_key(v);
    }
    let km = subgroupMax(key);
    if (lsg == 0u) {
        gx_kmax[li / sg] = km;
    }
    workgroupBarrier();
    var th = bitcast<i32>(0x80000000u);
    if (nsg >= my_k()) {
        th = gx_kmax[0];
        for (var j = 1u; j < nsg; j++) {
            th = min(th, gx_kmax[j]);
        }
    }
    let cand = li < ne && key >= th;
    if (cand) {
        gx_cand[atomicAdd(&gx_n, 1u)] = vec2<i32>(key, i32(li));
    }
    workgroupBarrier();
    let nc = atomicLoad(&gx_n);
    if (cand) {
        // Rank = the candidates ahead (a larger key, or an equal one of a lower id).
        var rank = 0u;
        for (var j = 0u; j < nc; j++) {
            let c = gx_cand[j];
            rank += select(0u, 1u, c.x > key || (c.x == key && u32(c.y) < li));
        }
        if (rank < my_k()) {
            rtop[rank] = li;
        }
    }
    workgroupBarrier();
    if (write && li == 0u) {
        if (MY_FOLD) {
            gy_s[t] = gx_fold_logit(ne);
        }
        var ws = 1.0;
        if (my_norm() != 0u) {
            ws = 0.0;
            for (var j = 0u; j < my_k(); j++) {
                ws += red2[rtop[j]];
            }
        }
        for (var j = 0u; j < my_k(); j++) {
            gs_ids[t * my_k() + j] = rtop[j];
            gs_w[t * my_k() + j] = red2[rtop[j]] / ws;
        }
    }
}

// A gate|up workgroup's place (moe_gate_up_x, moe_gate_up_y; uniform: the workgroup index
// alone): its slot of the (k + 1) · rows, token t, slot js of it (slot k the shared expert: sh,
// uniform over the workgroup as every branch on it), the first of its `opw` outputs (32, or 16
// with MY_NOQ at hidden 2048), and whether it is the slot's first workgroup.
struct GxAt {
    slot: u32,
    t: u32,
    js: u32,
    sh: bool,
    ob: u32,
    first: bool,
}

fn gx_at(wg: u32, opw: u32) -> GxAt {
    let blocks = my_out() / opw;
    let k1 = my_k() + 1u;
    let slot = wg / blocks;
    return GxAt(slot, slot / k1, slot % k1, slot % k1 == my_k(), (wg % blocks) * opw, wg % blocks == 0u);
}

// The expert of slot js of token t (0 for the shared slot, sh, uniform over the workgroup):
// with p.tiles = 1 every routed slot's workgroup routes the token (gx_route; the first
// workgroup of slot 0, `first` and js = 0, writes the route), else read from gs_ids. Every
// invocation calls it (the route's barriers).
fn gx_expert(t: u32, js: u32, sh: bool, li: u32, sg: u32, lane_sg: u32, first: bool) -> u32 {
    var e = 0u;
    if (!sh) {
        if (my_tiles() != 0u) {
            gx_route(t, li, sg, lane_sg, js == 0u && first);
            e = min(rtop[js], my_nexp() - 1u);
        } else {
            e = min(gs_ids[t * my_k() + js], my_nexp() - 1u);
        }
    }
    return e;
}

@compute @workgroup_size(256)
fn moe_gate_up_x(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_size) sg_size: u32,
    @builtin(subgroup_invocation_id) lane_sg: u32,
) {
    let width = p.m.out;
    let hid = p.m.inp;
    let a = gx_at(wg_index(wid), 32u);
    if (a.slot >= p.rows * (p.k + 1u)) {
        return;
    }
    if (li == 0u) {
        rw_sg = sg_size;
    }
    let sg = workgroupUniformLoad(&rw_sg);
    let slot = a.slot;
    let t = a.t;
    let js = a.js;
    let sh = a.sh;
    let ob = a.ob;
    let T = p.outs;
    let R = T / 8u;
    let lane = li % T;
    let o0 = ob + (li / T) * R;
    let bits = p.m.bits;
    let epw = 128u / bits;
    let wpr = hid / epw;
    let xb = t * (5u * (hid / 32u) + 3u * (hid / 16u));
    // x's first words go out before the route (they do not depend on the expert).
    let x0 = gx_xword(xb, min(lane, wpr - 1u), hid, bits);
    let e = gx_expert(t, js, sh, li, sg, lane_sg, a.first);
    // The team's rows (past R: the last, not summed).
    let r0 = e * width + o0;
    let r1 = e * width + o0 + min(1u, R - 1u);
    let r2 = e * width + o0 + min(2u, R - 1u);
    let r3 = e * width + o0 + min(3u, R - 1u);
    let gpg = hid / p.m.gs;
    let gpu = hid / p.m2.gs;
    var ag = vec4<f32>(0.0);
    var au = vec4<f32>(0.0);
    var xw = x0;
    for (var c = lane; c < wpr; c += T) {
        // Every load of a step before its products: the 2R rows' words, their scales and
        // biases; the next step's x after them.
        let g0 = gs_gate_w(sh, r0 * wpr + c);
        let u0 = gs_up_w(sh, r0 * wpr + c);
        var g1 = vec4<u32>(0u);
        var u1 = vec4<u32>(0u);
        var g2 = vec4<u32>(0u);
        var u2 = vec4<u32>(0u);
        var g3 = vec4<u32>(0u);
        var u3 = vec4<u32>(0u);
        if (R > 1u) {
            g1 = gs_gate_w(sh, r1 * wpr + c);
            u1 = gs_up_w(sh, r1 * wpr + c);
        }
        if (R > 2u) {
            g2 = gs_gate_w(sh, r2 * wpr + c);
            u2 = gs_up_w(sh, r2 * wpr + c);
            g3 = gs_gate_w(sh, r3 * wpr + c);
            u3 = gs_up_w(sh, r3 * wpr + c);
        }
        let kg = (c * epw) / p.m.gs;
        let ku = (c * epw) / p.m2.gs;
        let x = xw;
        if (c + T < wpr) {
            xw = gx_xword(xb, c + T, hid, bits);
        }
        ag.x += gx_dot(g0, bits, x, gs_gate_sb(sh, r0 * gpg + kg, p.m.sb16, false), gs_gate_sb(sh, r0 * gpg + kg, p.m.sb16, true));
        au.x += gx_dot(u0, bits, x, gs_up_sb(sh, r0 * gpu + ku, p.m2.sb16, false), gs_up_sb(sh, r0 * gpu + ku, p.m2.sb16, true));
        if (R > 1u) {
            ag.y += gx_dot(g1, bits, x, gs_gate_sb(sh, r1 * gpg + kg, p.m.sb16, false), gs_gate_sb(sh, r1 * gpg + kg, p.m.sb16, true));
            au.y += gx_dot(u1, bits, x, gs_up_sb(sh, r1 * gpu + ku, p.m2.sb16, false), gs_up_sb(sh, r1 * gpu + ku, p.m2.sb16, true));
        }
        if (R > 2u) {
            ag.z += gx_dot(g2, bits, x, gs_gate_sb(sh, r2 * gpg + kg, p.m.sb16, false), gs_gate_sb(sh, r2 * gpg + kg, p.m.sb16, true));
            au.z += gx_dot(u2, bits, x, gs_up_sb(sh, r2 * gpu + ku, p.m2.sb16, false), gs_up_sb(sh, r2 * gpu + ku, p.m2.sb16, true));
            ag.w += gx_dot(g3, bits, x, gs_gate_sb(sh, r3 * gpg + kg, p.m.sb16, false), gs_gate_sb(sh, r3 * gpg + kg, p.m.sb16, true));
            au.w += gx_dot(u3, bits, x, gs_up_sb(sh, r3 * gpu + ku, p.m2.sb16, false), gs_up_sb(sh, r3 * gpu + ku, p.m2.sb16, true));
        }
    }
    gx_finish(ag, au, li, lane_sg, T, T / 8u, sg, slot, width, o0, ob);
}

// moe_gate_up_y: moe_gate_up_x's maths and epilogue (`LILY_WGPU_MOE_XQ` 4) with a lane's
// loads issued at once: a team of T = p.outs = hidden / 64 lanes (8, 16 or 32) owns R = T / 8
// outputs, lane l code words 2l and 2l + 1 of its 2R gate and up rows (4-bit, groups a multiple
// of 64 inputs: the two words share a scale and a bias), so after the route a lane has 4R words
// and 4R scalars in flight (16 and 16 at hidden 2048) where moe_gate_up_x walks its words T
// apart in a loop; x's two words go out before the route. Same launch, bindings and route.

// A row's two words (2l, 2l + 1) against x's, with their group's scale s and bias b.
// (`lily lab` ablation 8, MY_ABL: the words only xor-ed, the dots skipped, to time the rest.)
fn gy_dot(wa: vec4<u32>, wb: vec4<u32>, xa: GxW, xc: GxW, s: f32, b: f32) -> f32 {
    if ((MY_ABL & 8u) != 0u) {
        let v = wa ^ wb;
        return f32(v.x ^ v.y ^ v.z ^ v.w) * s + b;
    }
    return gx_dot(wa, 4u, xa, s, b) + gx_dot(wb, 4u, xc, s, b);
}

@compute @workgroup_size(256)
fn moe_gate_up_y(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_size) sg_size: u32,
    @builtin(subgroup_invocation_id) lane_sg: u32,
) {
    let width = my_out();
    let hid = my_inp();
    let T = my_outs();
    let R = select(T / 8u, max(T / 16u, 1u), MY_NOQ);
    let a = gx_at(wg_index(wid), (256u / T) * R);
    if (a.slot >= my_rows() * (my_k() + 1u)) {
        return;
    }
    let sg = my_sg(li, sg_size);
    let slot = a.slot;
    let t = a.t;
    let js = a.js;
    let sh = a.sh;
    let ob = a.ob;
    let lane = li % T;
    let o0 = ob + (li / T) * R;
    let wpr = hid / 32u;
    let c = 2u * lane;
    let xb = t * (5u * (hid / 32u) + 3u * (hid / 16u));
    let xa = gx_xword(xb, c, hid, 4u);
    let xc = gx_xword(xb, c + 1u, hid, 4u);
    var rn = 1.0;
    if (MY_RN) {
        rn = gx_rn(xb, hid);
    }
    gx_rnv = rn;
    let e = gx_expert(t, js, sh, li, sg, lane_sg, a.first);
    // The team's rows (past R: the last again, not kept).
    let r0 = e * width + o0;
    let r1 = e * width + o0 + min(1u, R - 1u);
    let r2 = e * width + o0 + min(2u, R - 1u);
    let r3 = e * width + o0 + min(3u, R - 1u);
    let gg = (c * 32u) / my_gs();
    let gu = (c * 32u) / my_gs2();
    let gpg = hid / my_gs();
    let gpu = hid / my_gs2();
    let g0a = gs_gate_w(sh, r0 * wpr + c);
    let g0b = gs_gate_w(sh, r0 * wpr + c + 1u);
    let u0a = gs_up_w(sh, r0 * wpr + c);
    let u0b = gs_up_w(sh, r0 * wpr + c + 1u);
    // Row 1 only where a team has two outputs, rows 2 and 3 where it has four (MY_NOQ's half:
    // no loads for the rest).
    var g1a = vec4<u32>(0u);
    var g1b = vec4<u32>(0u);
    var u1a = vec4<u32>(0u);
    var u1b = vec4<u32>(0u);
    if (R > 1u) {
        g1a = gs_gate_w(sh, r1 * wpr + c);
        g1b = gs_gate_w(sh, r1 * wpr + c + 1u);
        u1a = gs_up_w(sh, r1 * wpr + c);
        u1b = gs_up_w(sh, r1 * wpr + c + 1u);
    }
    var g2a = vec4<u32>(0u);
    var g2b = vec4<u32>(0u);
    var u2a = vec4<u32>(0u);
    var u2b = vec4<u32>(0u);
    var g3a = vec4<u32>(0u);
    var g3b = vec4<u32>(0u);
    var u3a = vec4<u32>(0u);
    var u3b = vec4<u32>(0u);
    if (R > 2u) {
        g2a = gs_gate_w(sh, r2 * wpr + c);
        g2b = gs_gate_w(sh, r2 * wpr + c + 1u);
        u2a = gs_up_w(sh, r2 * wpr + c);
        u2b = gs_up_w(sh, r2 * wpr + c + 1u);
        g3a = gs_gate_w(sh, r3 * wpr + c);
        g3b = gs_gate_w(sh, r3 * wpr + c + 1u);
        u3a = gs_up_w(sh, r3 * wpr + c);
        u3b = gs_up_w(sh, r3 * wpr + c + 1u);
    }
    let sb = my_sb16();
    let sb2 = my_sb162();
    let sg0 = gs_gate_sb(sh, r0 * gpg + gg, sb, false);
    let bg0 = gs_gate_sb(sh, r0 * gpg + gg, sb, true);
    let su0 = gs_up_sb(sh, r0 * gpu + gu, sb2, false);
    let bu0 = gs_up_sb(sh, r0 * gpu + gu, sb2, true);
    var sg1 = 0.0;
    var bg1 = 0.0;
    var su1 = 0.0;
    var bu1 = 0.0;
    if (R > 1u) {
        sg1 = gs_gate_sb(sh, r1 * gpg + gg, sb, false);
        bg1 = gs_gate_sb(sh, r1 * gpg + gg, sb, true);
        su1 = gs_up_sb(sh, r1 * gpu + gu, sb2, false);
        bu1 = gs_up_sb(sh, r1 * gpu + gu, sb2, true);
    }
    var sg2 = 0.0;
    var bg2 = 0.0;
    var su2 = 0.0;
    var bu2 = 0.0;
    var sg3 = 0.0;
    var bg3 = 0.0;
    var su3 = 0.0;
    var bu3 = 0.0;
    if (R > 2u) {
        sg2 = gs_gate_sb(sh, r2 * gpg + gg, sb, false);
        bg2 = gs_gate_sb(sh, r2 * gpg + gg, sb, true);
        su2 = gs_up_sb(sh, r2 * gpu + gu, sb2, false);
        bu2 = gs_up_sb(sh, r2 * gpu + gu, sb2, true);
        sg3 = gs_gate_sb(sh, r3 * gpg + gg, sb, false);
        bg3 = gs_gate_sb(sh, r3 * gpg + gg, sb, true);
        su3 = gs_up_sb(sh, r3 * gpu + gu, sb2, false);
        bu3 = gs_up_sb(sh, r3 * gpu + gu, sb2, true);
    }
    let ag = vec4<f32>(
        gy_dot(g0a, g0b, xa, xc, sg0, bg0),
        gy_dot(g1a, g1b, xa, xc, sg1, bg1),
        gy_dot(g2a, g2b, xa, xc, sg2, bg2),
        gy_dot(g3a, g3b, xa, xc, sg3, bg3),
    );
    let au = vec4<f32>(
        gy_dot(u0a, u0b, xa, xc, su0, bu0),
        gy_dot(u1a, u1b, xa, xc, su1, bu1),
        gy_dot(u2a, u2b, xa, xc, su2, bu2),
        gy_dot(u3a, u3b, xa, xc, su3, bu3),
    );
    gx_finish(ag * rn, au * rn, li, lane_sg, T, R, sg, slot, width, o0, ob);
}

// gate|up's epilogue (moe_gate_up_x, moe_gate_up_y): the team's sums, act = silu(gate) · up of
// its R outputs o0.. in f32, and the workgroup's 32 outputs (ob..) quantized as one word of aq
// (not with MY_NOQ: down stages act). Every invocation calls it (barriers).
fn gx_finish(ag0: vec4<f32>, au0: vec4<f32>, li: u32, lane_sg: u32, T: u32, R: u32, sg: u32, slot: u32, width: u32, o0: u32, ob: u32) {
    let ag = team_sum(ag0, li, lane_sg, T, sg);
    let au = team_sum(au0, li, lane_sg, T, sg);
    let lane = li % T;
    // Lane r < R of a team: output o0 + r.
    if (lane < R) {
        let a = silu_f(ag[lane]) * au[lane];
        gu_act[slot * width + o0 + lane] = a;
        red[o0 - ob + lane] = a;
    }
    // (`lily lab` ablation 32, MY_ABL: act in f32 only, not staged for down, to time the rest.)
    if (MY_NOQ || (MY_ABL & 32u) != 0u) {
        return;
    }
    workgroupBarrier();
    // The block's 32 act values as one 4-bit word (two 8-bit) of row `slot` of aq: thread i of
    // each 4 takes elements 8i .. 8i + 7 (every thread computes, for the shuffles).
    let q4 = li % 4u;
    let xl = vec4<f32>(red[8u * q4], red[8u * q4 + 1u], red[8u * q4 + 2u], red[8u * q4 + 3u]);
    let xh = vec4<f32>(red[8u * q4 + 4u], red[8u * q4 + 5u], red[8u * q4 + 6u], red[8u * q4 + 7u]);
    let q = q2x_words(xl, xh);
    if (li < 4u) {
        gx_put(q, q4, slot, ob / 32u, width);
    }
}

// Thread q4 (< 4)'s share of 4-bit word u (two 8-bit words) of row `row` of gx_aq, a staged
// row of n elements in xq.wgsl's layouts (xq_put's indices), from q2x_words' result.
fn gx_put(q: Q2xW, q4: u32, row: u32, u: u32, n: u32) {
    let w4 = n / 32u;
    let w8 = n / 16u;
    let b4 = row * (5u * w4 + 3u * w8);
    let b8 = b4 + 5u * w4;
    gx_aq[b4 + u][q4] = q.w4.x;
    gx_aq[b4 + w4 + u][q4] = q.w4.y;
    gx_aq[b4 + 2u * w4 + u][q4] = q.w4.z;
    gx_aq[b4 + 3u * w4 + u][q4] = q.w4.w;
    if (q4 == 0u) {
        gx_aq[b4 + 4u * w4 + u] = q.m4;
    }
    if (!MY_A8) {
        return;
    }
    let v = 2u * u + q4 / 2u;
    let pp = 2u * (q4 % 2u);
    gx_aq[b8 + v][pp] = q.w8.x;
    gx_aq[b8 + v][pp + 1u] = q.w8.y;
    gx_aq[b8 + w8 + v][pp] = q.w8.z;
    gx_aq[b8 + w8 + v][pp + 1u] = q.w8.w;
    if (pp == 0u) {
        gx_aq[b8 + 2u * w8 + v] = q.m8;
    }
}

// Word i of down's codes, the shared expert's when sh; scale (bias when is_bias) of group g.
fn dx_w(sh: bool, i: u32) -> vec4<u32> {
    if (sh) {
        return shd_w4[i];
    }
    return qw4[i];
}

fn dx_sb(sh: bool, g: u32, is_bias: bool) -> f32 {
    let j = sb_idx(g, my_sb16());
    var w: u32;
    if (sh) {
        if (is_bias) { w = shd_b[j]; } else { w = shd_s[j]; }
    } else {
        if (is_bias) { w = qb[j]; } else { w = qs[j]; }
    }
    return sb_val(w, g, my_sb16());
}

// Row `row`'s dot with act row `ar` over this lane's words c = lane, lane + T, … (down, the
// shared expert's when sh).
fn dx_row(sh: bool, row: u32, ar: u32, lane: u32, T: u32) -> f32 {
    let width = p.m.inp;
    let bits = p.m.bits;
    let epw = 128u / bits;
    let wpr = width / epw;
    let gpr = width / p.m.gs;
    let xb = ar * (5u * (width / 32u) + 3u * (width / 16u));
    var acc = 0.0;
    for (var c = lane; c < wpr; c += T) {
        let w = dx_w(sh, row * wpr + c);
        let g = row * gpr + (c * epw) / p.m.gs;
        acc += gx_dot(w, bits, dx_xword(xb, c, width, bits), dx_sb(sh, g, false), dx_sb(sh, g, true));
    }
    return acc;
}

@compute @workgroup_size(256)
fn moe_down_x(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_size) sg_size: u32,
    @builtin(subgroup_invocation_id) lane_sg: u32,
) {
    let hid = p.m.out;
    let k = p.k;
    let k1 = k + 1u;
    let T = p.outs & 0xffffu;
    let S = p.outs >> 16u;
    let opw = 256u / (T * S);
    let blocks = (hid + opw - 1u) / opw;
    let wg = wg_index(wid);
    let t = wg / blocks;
    if (t >= p.rows) {
        return;
    }
    if (li == 0u) {
        rw_sg = sg_size;
    }
    let sg = workgroupUniformLoad(&rw_sg);
    let ob = (wg % blocks) * opw;
    let team = li / T;
    let lane = li % T;
    let ol = team / S;
    let part = team % S;
    let o = min(ob + ol, hid - 1u);
    // This team's routed slots [j0, j1); the last range's team also takes the shared slot.
    let per = (k + S - 1u) / S;
    let j0 = part * per;
    let j1 = min(j0 + per, k);
    let last = part == S - 1u;
    // The shared slot's words first: they need no id.
    var shd = 0.0;
    if (last) {
        shd = dx_row(true, o, t * k1 + k, lane, T);
    }
    // Four slots at a time (their loads together; slots past the range read the range's last
    // and are not kept). The bound is uniform: every lane reaches team_sum.
    for (var jc = 0u; jc < per; jc += 4u) {
        var d = vec4<f32>(0.0);
        for (var i = 0u; i < 4u; i++) {
            let j = min(j0 + jc + i, max(j1, 1u) - 1u);
            let e = min(dn_ids[t * k + j], p.n_exp - 1u);
            d[i] = dx_row(false, e * hid + o, t * k1 + j, lane, T);
        }
        d = team_sum(d, li, lane_sg, T, sg);
        if (lane == 0u) {
            for (var i = 0u; i < 4u; i++) {
                let j = j0 + jc + i;
                if (jc + i < per && j < j1) {
                    xs[ol * k1 + j] = d[i];
                }
            }
        }
    }
    let sd = team_sum(vec4<f32>(shd, 0.0, 0.0, 0.0), li, lane_sg, T, sg);
    if (lane == 0u && last) {
        xs[ol * k1 + k] = sd.x;
    }
    workgroupBarrier();
    if (li < opw && ob + li < hid) {
        // The CPU's composition in its order: the routed slots weighted and summed in slot
        // order (moe_experts_decode), then + sigmoid(s) · the shared expert's down
        // (add_sigmoid_gated), then the residual add (moe_down_s's).
        var total = 0.0;
        for (var j = 0u; j < k; j++) {
            total += dn_w[t * k + j] * xs[li * k1 + j];
        }
        total += sigmoid_f(ds_logit[t]) * xs[li * k1 + k];
        let i = t * hid + ob + li;
        ds_h[i] = ds_h[i] + total;
    }
}

// moe_down_y: moe_down_x's sum (the same h[t, o] += Σ_{j<k} w[t, j] · (down_{ids[j]}[o] · act_j)
// + sigmoid(s[t]) · (shared down[o] · act_k), the same integer dots against aq) with every load
// of a lane issued at once: `LILY_WGPU_MOE_XQ` 3, 4-bit down, k ≤ 8 (DY_K). moe_down_x's teams
// walk their slots four at a time, each behind its expert id (an L2 round trip, then DRAM), so
// a lane has ~64 bytes in flight; here lane c of a team of T = p.outs lanes (T = the row's code
// words: 16 at width 512) takes code word c of one output for all k + 1 slots: the k ids, then
// the k + 1 rows' words, scales and biases (9 × 24 bytes) go out together, x's words as each
// slot's dot needs them (L1: the workgroup's 256 / T outputs read the same act). Each lane sums
// its words' weighted dots over the slots, the team sums by shuffles (team_sum) and its lane 0
// adds the total into h: no workgroup memory, no barrier. The sum's order differs from moe_down_x's
// (a lane's slots first, then the team's lanes): within the MoE tests' bound, not bit-equal.
// 256 / T outputs a workgroup, ceil(hid / that) workgroups a token. Bindings: moe_down_x's.
const DY_K: u32 = 8u;

// A slot's code word, scale and bias for this lane.
struct DyW {
    w: vec4<u32>,
    s: f32,
    b: f32,
}

// Slot j's (j < k; past k: slot k - 1's, not summed) word c of output o of token t.
fn dy_load(t: u32, j: u32, o: u32, c: u32) -> DyW {
    let hid = my_out();
    let wpr = my_inp() / 32u;
    let gpr = my_inp() / my_gs();
    let jj = min(j, my_k() - 1u);
    let e = min(dn_ids[t * my_k() + jj], my_nexp() - 1u);
    let row = e * hid + o;
    let g = row * gpr + (c * 32u) / my_gs();
    return DyW(qw4[row * wpr + c], dx_sb(false, g, false), dx_sb(false, g, true));
}

// The shared expert's word c of output o.
fn dy_load_sh(o: u32, c: u32) -> DyW {
    let wpr = my_inp() / 32u;
    let g = o * (my_inp() / my_gs()) + (c * 32u) / my_gs();
    return DyW(shd_w4[o * wpr + c], dx_sb(true, g, false), dx_sb(true, g, true));
}

// Word c's dot against act row `ar`, times `wt` (0 past the routed slots: the term dropped).
fn dy_dot(v: DyW, ar: u32, c: u32, wt: f32, keep: bool) -> f32 {
    let width = my_inp();
    var x: GxW;
    if (MY_AQW) {
        x = dq_xword(ar, c);
    } else {
        let xb = ar * (5u * (width / 32u) + 3u * (width / 16u));
        x = dx_xword(xb, c, width, 4u);
    }
    let d = gx_dot(v.w, 4u, x, v.s, v.b);
    return select(0.0, wt * d, keep);
}

// MY_AQW (moe_down_y2q): act's 4-bit staging in workgroup memory, row r at r · 5 · (width / 32)
// vec4s (xq.wgsl's 4-bit layout of a row: q1 even, q1 odd, q2 even, q2 odd, then the words'
// (d / 254, Σ x)). Its length is a pipeline constant, MY_DQ: (k + 1) · 5 · width / 32 for
// moe_down_y2q (720 at the full preset; moe.rs `act_takes` bounds it by DQ_MAX, 1,024), 1 for
// every other pipeline of the module, whose dy_dot names the array but never reads it: so no
// other down carries 16 KB of workgroup memory it does not touch (Apple's limit is 32 KB).
override MY_DQ: u32 = 1u;
var<workgroup> dq_aq: array<vec4<u32>, MY_DQ>;

fn dq_xword(ar: u32, c: u32) -> GxW {
    let w4 = my_inp() / 32u;
    let b = ar * 5u * w4;
    return GxW(dq_aq[b + c], dq_aq[b + w4 + c], dq_aq[b + 2u * w4 + c], dq_aq[b + 3u * w4 + c], dq_aq[b + 4u * w4 + c]);
}

// dq_aq from act in f32 (binding 4, dx_aq's bits: (k + 1) rows of `width`, as gate|up wrote
// them), after down's weight loads are issued (dy_pair): 8 elements a thread a round (chunk
// ch = base + li: element 8 · ch.., the word's 4 chunks on 4 consecutive lanes, q2x_words'
// shuffles), the same words gx_finish would have staged, then a barrier. Every invocation
// calls it (uniform loop; lanes past the rows pass zeros). The H100 lab (stop 46, down alone):
// act staged by gate|up 6.0 µs, this loop 6.9; every round's loads before any quantizing 7.2,
// and before the weights' loads 10.9 (their registers held across them).
fn dq_stage(li: u32) {
    let width = my_inp();
    let w4 = width / 32u;
    let per = width / 8u;
    let chunks = (my_k() + 1u) * per;
    for (var base = 0u; base < chunks; base += 256u) {
        let ch = base + li;
        var xl = vec4<f32>(0.0);
        var xh = vec4<f32>(0.0);
        if (ch < chunks) {
            xl = bitcast<vec4<f32>>(dx_aq[2u * ch]);
            xh = bitcast<vec4<f32>>(dx_aq[2u * ch + 1u]);
        }
        let q = q2x_words(xl, xh);
        if (ch < chunks) {
            let b = (ch / per) * 5u * w4;
            let u = (ch % per) / 4u;
            let q4 = ch % 4u;
            dq_aq[b + u][q4] = q.w4.x;
            dq_aq[b + w4 + u][q4] = q.w4.y;
            dq_aq[b + 2u * w4 + u][q4] = q.w4.z;
            dq_aq[b + 3u * w4 + u][q4] = q.w4.w;
            if (q4 == 0u) {
                dq_aq[b + 4u * w4 + u] = q.m4;
            }
        }
    }
    workgroupBarrier();
}

// A lane's loads for one output o of token t: the k routed slots' words (past k: slot k - 1's,
// not summed) and the shared expert's.
struct DyL {
    l0: DyW,
    l1: DyW,
    l2: DyW,
    l3: DyW,
    l4: DyW,
    l5: DyW,
    l6: DyW,
    l7: DyW,
    ls: DyW,
}

fn dy_loads(t: u32, o: u32, c: u32) -> DyL {
    return DyL(
        dy_load(t, 0u, o, c),
        dy_load(t, 1u, o, c),
        dy_load(t, 2u, o, c),
        dy_load(t, 3u, o, c),
        dy_load(t, 4u, o, c),
        dy_load(t, 5u, o, c),
        dy_load(t, 6u, o, c),
        dy_load(t, 7u, o, c),
        dy_load_sh(o, c),
    );
}

// A lane's weighted sum over the slots of its loads (the routed slots in order, then the
// gated shared slot).
fn dy_sum(l: DyL, t: u32, c: u32) -> f32 {
    let k = my_k();
    let wb = t * k;
    let jl = k - 1u;
    let r0 = t * (k + 1u);
    var acc = dy_dot(l.l0, r0, c, dn_w[wb], true);
    acc += dy_dot(l.l1, r0 + min(1u, jl), c, dn_w[wb + min(1u, jl)], 1u < k);
    acc += dy_dot(l.l2, r0 + min(2u, jl), c, dn_w[wb + min(2u, jl)], 2u < k);
    acc += dy_dot(l.l3, r0 + min(3u, jl), c, dn_w[wb + min(3u, jl)], 3u < k);
    acc += dy_dot(l.l4, r0 + min(4u, jl), c, dn_w[wb + min(4u, jl)], 4u < k);
    acc += dy_dot(l.l5, r0 + min(5u, jl), c, dn_w[wb + min(5u, jl)], 5u < k);
    acc += dy_dot(l.l6, r0 + min(6u, jl), c, dn_w[wb + min(6u, jl)], 6u < k);
    acc += dy_dot(l.l7, r0 + min(7u, jl), c, dn_w[wb + min(7u, jl)], 7u < k);
    acc += dy_dot(l.ls, r0 + k, c, sigmoid_f(ds_logit[t]), true);
    return acc;
}

@compute @workgroup_size(256)
fn moe_down_y(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_size) sg_size: u32,
    @builtin(subgroup_invocation_id) lane_sg: u32,
) {
    let hid = my_out();
    let k = my_k();
    let k1 = k + 1u;
    let T = my_outs();
    let opw = 256u / T;
    let blocks = (hid + opw - 1u) / opw;
    let wg = wg_index(wid);
    let t = wg / blocks;
    if (t >= my_rows()) {
        return;
    }
    let sg = my_sg(li, sg_size);
    let c = li % T;
    let ou = (wg % blocks) * opw + li / T;
    let o = min(ou, hid - 1u);
    // Every weight load first (straight-line: no array for the compiler to spill).
    let l = dy_loads(t, o, c);
    let tot = team_sum(vec4<f32>(dy_sum(l, t, c), 0.0, 0.0, 0.0), li, lane_sg, T, sg).x;
    if (c == 0u && ou < hid) {
        let i = t * hid + o;
        ds_h[i] = ds_h[i] + tot;
    }
}

// Token 0's outputs o0 and (with `two`) o1 summed by a team of T lanes (moe_down_y2,
// moe_down_ys): both outputs' loads issued before either's products, each sum moe_down_y's.
fn dy_pair(o0: u32, o1: u32, c: u32, two: bool, li: u32, lane_sg: u32, T: u32, sg: u32) -> vec2<f32> {
    let la = dy_loads(0u, o0, c);
    let lb = dy_loads(0u, select(o0, o1, two), c);
    // moe_down_y2q: act staged here, while the loads above are in flight.
    if (MY_AQW) {
        dq_stage(li);
    }
    let sa = dy_sum(la, 0u, c);
    let sb = select(0.0, dy_sum(lb, 0u, c), two);
    return team_sum(vec4<f32>(sa, sb, 0.0, 0.0), li, lane_sg, T, sg).xy;
}

// moe_down_y2 (`LILY_WGPU_MOE_DOWN` y2, the default since stop 42; one token, moe_down_y's
// pipeline constants): moe_down_y's sums with two outputs a team as moe_down_ys takes them
// (outputs ob + i and ob + teams + i, their loads issued together, act's words the same for
// both: a lane reads 45 of them for 18 code words, where moe_down_y reads 45 for 9), 512 / T
// outputs a workgroup (32 at T = 16: 64 workgroups at hidden 2048, against 128). 4K decode on
// the H100: 1.034× over moe_down_y. Each team's rows of h are read before its weights (no
// gain measured alone, none lost). Each output's sum is moe_down_y's, in its order.
// Bindings: moe_down_y's.
@compute @workgroup_size(256)
fn moe_down_y2(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_size) sg_size: u32,
    @builtin(subgroup_invocation_id) lane_sg: u32,
) {
    dy2_run(wg_index(wid), li, sg_size, lane_sg);
}

// moe_down_y2q (`LILY_WGPU_MOE_ACT=down16`, the default, with MY_AQW; one token, moe_down_y's
// constants): moe_down_y2 reading act in f32 at binding 4 (gate|up with MY_NOQ
// staged nothing) and staging it itself into workgroup memory (dq_stage) after its weights'
// loads are issued; each output's sum moe_down_y2's, bit for bit (the same act words).
// Bindings: moe_down_y's, 4 act (f32).
@compute @workgroup_size(256)
fn moe_down_y2q(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_size) sg_size: u32,
    @builtin(subgroup_invocation_id) lane_sg: u32,
) {
    dy2_run(wg_index(wid), li, sg_size, lane_sg);
}

// moe_down_y2's body (moe_down_y2q's too) for workgroup wg: its teams of T lanes take outputs
// ob + i and ob + teams + i.
fn dy2_run(wg: u32, li: u32, sg_size: u32, lane_sg: u32) {
    let hid = my_out();
    let T = my_outs();
    let teams = 256u / T;
    let sg = my_sg(li, sg_size);
    let c = li % T;
    let ob = wg * 2u * teams;
    let u0 = ob + li / T;
    let u1 = u0 + teams;
    let o0 = min(u0, hid - 1u);
    let o1 = min(u1, hid - 1u);
    let h0 = ds_h[o0];
    let h1 = ds_h[o1];
    let tot = dy_pair(o0, o1, c, true, li, lane_sg, T, sg);
    if (c == 0u) {
        if (u0 < hid) {
            ds_h[o0] = h0 + tot.x;
        }
        if (u1 < hid) {
            ds_h[o1] = h1 + tot.y;
        }
    }
}

// moe_down_ys (the MoE block of a decode step with the next op's x staged ahead: Backend::
// norm_ahead, `LILY_WGPU_XQ_AHEAD` down, the default since stop 49, next or 1): moe_down_y's
// sums for one token (the same lanes, loads and order), 32 outputs a workgroup (a team of T =
// 16 lanes takes outputs ob + i and ob + 16 + i, their loads issued together; T = 8: one),
// then, after the residual add, the next op's x = rms_norm(h) · w (w at binding 12) staged
// without the 1 / rms as matmul_sg.wgsl's omode 5 stages it (its header has the why): the
// workgroup's 32 rows of h · w as one 4-bit word (two 8-bit) of row 0 at binding 18, and their
// Σ h² (in row order) after the row. With MY_AQW (`LILY_WGPU_MOE_ACT=down16`, the default)
// act comes in f32 at binding 4 and dy_pair stages it as moe_down_y2q does. Bindings:
// moe_down_y's, 12 the next norm's weights, 18 the staging. hid / 32 workgroups.
@group(0) @binding(12) var<storage, read> dy_nw: array<vec4<f32>>;

@compute @workgroup_size(256)
fn moe_down_ys(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_size) sg_size: u32,
    @builtin(subgroup_invocation_id) lane_sg: u32,
) {
    let hid = my_out();
    let T = my_outs();
    let teams = 256u / T;
    let sg = my_sg(li, sg_size);
    let c = li % T;
    let ob = wg_index(wid) * 32u;
    let o0 = ob + li / T;
    let o1 = o0 + teams;
    let two = teams < 32u;
    let tot = dy_pair(o0, o1, c, two, li, lane_sg, T, sg);
    if (c == 0u) {
        let h0 = ds_h[o0] + tot.x;
        ds_h[o0] = h0;
        red[o0 - ob] = h0;
        if (two) {
            let h1 = ds_h[o1] + tot.y;
            ds_h[o1] = h1;
            red[o1 - ob] = h1;
        }
    }
    workgroupBarrier();
    let q4 = li % 4u;
    let col = ob / 4u + 2u * q4;
    let xl = vec4<f32>(red[8u * q4], red[8u * q4 + 1u], red[8u * q4 + 2u], red[8u * q4 + 3u]);
    let xh = vec4<f32>(red[8u * q4 + 4u], red[8u * q4 + 5u], red[8u * q4 + 6u], red[8u * q4 + 7u]);
    let q = q2x_words(xl * dy_nw[col], xh * dy_nw[col + 1u]);
    if (li < 4u) {
        gx_put(q, q4, 0u, ob / 32u, hid);
    }
    // The bind group gives bindings 13-17 (spares): the derived layout must hold them.
    if (p.ablate == 0xfeedu) {
        gs_w[0] = gs_logits[0] + f32(shu_w4[0].x + shu_s[0] + shu_b[0]);
    }
    if (li == 0u) {
        var ss = 0.0;
        for (var i = 0u; i < 32u; i++) {
            ss += red[i] * red[i];
        }
        let at = 5u * (hid / 32u) + 3u * (hid / 16u) + ob / 128u;
        gx_aq[at][(ob / 32u) % 4u] = bitcast<u32>(ss);
    }
}
