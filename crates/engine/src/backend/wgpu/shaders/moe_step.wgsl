// moe_step.wgsl: the decode entries with the shared expert as slot k, moe_gate_up_s (which may
// route the token itself) and moe_down_s. moe.wgsl's header documents them; moe.rs
// `moe_decode_shared` launches them. Appended to moe.wgsl in one module (moe.rs SHADER): they
// use its parameter block and bindings 1-7, its staging (stg, red, red2, rtop), exp_acc,
// order_key, dq1 and q2x.wgsl's staging of x in two int8 levels.

// ---- moe_gate_up_s

@group(0) @binding(8) var<storage, read_write> gs_ids: array<u32>;
@group(0) @binding(10) var<storage, read> shg_w4: array<vec4<u32>>;
@group(0) @binding(11) var<storage, read> shg_s: array<u32>;
@group(0) @binding(12) var<storage, read> shg_b: array<u32>;
@group(0) @binding(13) var<storage, read> shu_w4: array<vec4<u32>>;
@group(0) @binding(14) var<storage, read> shu_s: array<u32>;
@group(0) @binding(15) var<storage, read> shu_b: array<u32>;
@group(0) @binding(16) var<storage, read> gs_logits: array<f32>;
@group(0) @binding(17) var<storage, read_write> gs_w: array<f32>;

// The route's order keys, one an expert (INT_MIN past the experts: never ahead of one). A flat
// array written a key a thread and read four keys a step, as moe_route's.
var<workgroup> rkey_s: array<i32, 256>;

// Code vec4 i of gate (the shared expert's when sh: a branch uniform over the workgroup).
fn gs_gate_w(sh: bool, i: u32) -> vec4<u32> {
    if (sh) {
        return shg_w4[i];
    }
    return qw4[i];
}

fn gs_up_w(sh: bool, i: u32) -> vec4<u32> {
    if (sh) {
        return shu_w4[i];
    }
    return uw4[i];
}

// Group i's scale (bias when is_bias) of gate, the shared expert's when sh.
fn gs_gate_sb(sh: bool, i: u32, sb16: u32, is_bias: bool) -> f32 {
    let j = sb_idx(i, sb16);
    var w: u32;
    if (sh) {
        if (is_bias) { w = shg_b[j]; } else { w = shg_s[j]; }
    } else {
        if (is_bias) { w = qb[j]; } else { w = qs[j]; }
    }
    return sb_val(w, i, sb16);
}

fn gs_up_sb(sh: bool, i: u32, sb16: u32, is_bias: bool) -> f32 {
    let j = sb_idx(i, sb16);
    var w: u32;
    if (sh) {
        if (is_bias) { w = shu_b[j]; } else { w = shu_s[j]; }
    } else {
        if (is_bias) { w = ub[j]; } else { w = us[j]; }
    }
    return sb_val(w, i, sb16);
}

// moe_q_load's loads without its g5_share: the elements of word u's u32 q of x's row t at code
// word c0 (4-bit: xl, xh; 8-bit: xl), nothing past nv words.
fn gs_xload(t: u32, hid: u32, c0: u32, u: u32, q: u32, nv: u32, bits: u32,
            xl: ptr<function, vec4<f32>>, xh: ptr<function, vec4<f32>>) {
    if (u >= nv) {
        return;
    }
    let epw = 128u / bits;
    let v = (t * hid) / 4u + (c0 + u) * (epw / 4u) + q * (epw / 16u);
    *xl = x4[v];
    if (bits == 4u) {
        *xh = x4[v + 1u];
    }
}

// Token t's route by moe_route's maths for E ≤ 256 experts, a thread each: the max and the sum
// by the same trees over red, the same exp_acc, p = e / sum, the same order keys and ranks, so
// the same ids and (thread 0 of the workgroup that writes them) the same weights bit for bit.
// Leaves the ids in rtop[0..k) and p in red2. Every invocation calls it (barriers).
fn gs_route(t: u32, li: u32, write: bool) {
    let ne = p.n_exp;
    var m = bitcast<f32>(0xff800000u);
    var l = 0.0;
    if (li < ne) {
        l = gs_logits[t * ne + li];
        m = max(m, l);
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
    if (li < ne) {
        part += exp_acc(l - m);
    }
    red[li] = part;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (li < s) {
            red[li] += red[li + s];
        }
        workgroupBarrier();
    }
    let sum = red[0];
    var key = bitcast<i32>(0x80000000u);
    if (li < ne) {
        let v = part / sum;
        red2[li] = v;
        key = order_key(v);
    }
    rkey_s[li] = key;
    workgroupBarrier();
    // Rank = the experts ahead (a larger key, or an equal one of a lower id), four keys a
    // step, every thread the same broadcast reads.
    if (li < ne) {
        var rank = 0u;
        let ne4 = (ne + 3u) & ~3u;
        for (var j = 0u; j < ne4; j += 4u) {
            let k4 = vec4<i32>(rkey_s[j], rkey_s[j + 1u], rkey_s[j + 2u], rkey_s[j + 3u]);
            let j4 = vec4<u32>(j, j + 1u, j + 2u, j + 3u);
            let ahead = (k4 > vec4<i32>(key)) | ((k4 == vec4<i32>(key)) & (j4 < vec4<u32>(li)));
            rank += dot(select(vec4<u32>(0u), vec4<u32>(1u), ahead), vec4<u32>(1u));
        }
        if (rank < p.k) {
            rtop[rank] = li;
        }
    }
    workgroupBarrier();
    if (write && li == 0u) {
        var s = 1.0;
        if (p.norm_topk != 0u) {
            s = 0.0;
            for (var j = 0u; j < p.k; j++) {
                s += red2[rtop[j]];
            }
        }
        for (var j = 0u; j < p.k; j++) {
            gs_ids[t * p.k + j] = rtop[j];
            gs_w[t * p.k + j] = red2[rtop[j]] / s;
        }
    }
}

@compute @workgroup_size(256)
fn moe_gate_up_s(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let width = p.m.out;
    let hid = p.m.inp;
    let blocks = (width + 7u) / 8u;
    let wg = wg_index(wid);
    let k1 = p.k + 1u;
    let slot = wg / blocks;
    if (slot >= p.rows * k1) {
        return;
    }
    let t = slot / k1;
    let js = slot % k1;
    // Slot k is the shared expert (uniform over the workgroup, as every branch on sh below).
    let sh = js == p.k;
    let o = (wg % blocks) * 8u + li / 32u;
    let lane = li % 32u;
    let bits = p.m.bits;
    let epw = 128u / bits;
    let wpr = hid / epw;
    let q = li % 4u;
    let ua = li / 4u;
    let ub = ua + 64u;
    // x's first pass is loaded before the route, its latency under the route's barriers.
    var xla = vec4<f32>(0.0);
    var xha = vec4<f32>(0.0);
    var xlb = vec4<f32>(0.0);
    var xhb = vec4<f32>(0.0);
    let nv0 = min(G5_W, wpr);
    gs_xload(t, hid, 0u, ua, q, nv0, bits, &xla, &xha);
    gs_xload(t, hid, 0u, ub, q, nv0, bits, &xlb, &xhb);
    var e = 0u;
    if (!sh) {
        if (p.tiles != 0u) {
            // Every routed slot's workgroup routes the token; the first of slot 0 writes it.
            gs_route(t, li, js == 0u && wg % blocks == 0u);
            e = min(rtop[js], p.n_exp - 1u);
        } else {
            e = min(gs_ids[t * p.k + js], p.n_exp - 1u);
        }
    }
    let row = e * width + min(o, width - 1u);
    let gg = row * (hid / p.m.gs);
    let gu = row * (hid / p.m2.gs);
    var ga = 0.0;
    var uacc = 0.0;
    for (var c0 = 0u; c0 < wpr; c0 += G5_W) {
        let nv = min(G5_W, wpr - c0);
        // The first code words are loaded before x is staged.
        var c = lane;
        var a = vec4<u32>(0u);
        var b = vec4<u32>(0u);
        if (c < nv) {
            a = gs_gate_w(sh, row * wpr + c0 + c);
            b = gs_up_w(sh, row * wpr + c0 + c);
        }
        workgroupBarrier();
        if (c0 > 0u) {
            gs_xload(t, hid, c0, ua, q, nv, bits, &xla, &xha);
            gs_xload(t, hid, c0, ub, q, nv, bits, &xlb, &xhb);
        }
        if (ua < nv) {
            g5_share(ua, q, xla, xha);
        }
        if (ub < nv) {
            g5_share(ub, q, xlb, xhb);
        }
        workgroupBarrier();
        g5_quant(ua, q, nv, bits, xla, xha);
        g5_quant(ub, q, nv, bits, xlb, xhb);
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
                a = gs_gate_w(sh, row * wpr + c0 + cn);
                b = gs_up_w(sh, row * wpr + c0 + cn);
            }
            let qa1 = g5_q[c];
            let qb1 = g5_q[128u + c];
            let qa2 = g5_q[256u + c];
            let qb2 = g5_q[384u + c];
            let dd = g5_d[c];
            let corr = bitcast<i32>(dd.z);
            let ig = f32(g5_dot(wa, bits, qa1, qb1, qa2, qb2) + corr);
            let iu = f32(g5_dot(wb, bits, qa1, qb1, qa2, qb2) + corr);
            let kk = (c0 + c) * epw;
            ga += gs_gate_sb(sh, gg + kk / p.m.gs, p.m.sb16, false) * (dd.x * ig)
                + gs_gate_sb(sh, gg + kk / p.m.gs, p.m.sb16, true) * dd.y;
            uacc += gs_up_sb(sh, gu + kk / p.m2.gs, p.m2.sb16, false) * (dd.x * iu)
                + gs_up_sb(sh, gu + kk / p.m2.gs, p.m2.sb16, true) * dd.y;
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

// ---- moe_down_s

@group(0) @binding(7) var<storage, read_write> ds_h: array<f32>;
@group(0) @binding(8) var<storage, read> shd_w4: array<vec4<u32>>;
@group(0) @binding(9) var<storage, read> shd_s: array<u32>;
@group(0) @binding(10) var<storage, read> shd_b: array<u32>;
@group(0) @binding(11) var<storage, read> ds_logit: array<f32>;

// dn_load of down, the shared expert's down when sh (a branch per (output, slot) pair).
fn ds_load(sh: bool, base: u32, vi: u32, v1: u32) -> vec4<u32> {
    if (vi >= v1) {
        return vec4<u32>(0u);
    }
    if (sh) {
        return shd_w4[base + vi];
    }
    return qw4[base + vi];
}

// dn_word with the shared expert's scales and biases when sh.
fn ds_word(sh: bool, a: vec4<u32>, vi: u32, v0: u32, v1: u32, xb: u32, nwp: u32, gr: u32) -> f32 {
    if (vi >= v1) {
        return 0.0;
    }
    let d = dq1(a, xb, vi - v0, nwp, p.m.bits);
    let g = gr + vi * (128u / p.m.bits) / p.m.gs;
    let j = sb_idx(g, p.m.sb16);
    var ws: u32;
    var wb: u32;
    if (sh) {
        ws = shd_s[j];
        wb = shd_b[j];
    } else {
        ws = qs[j];
        wb = qb[j];
    }
    return sb_val(ws, g, p.m.sb16) * d.x + sb_val(wb, g, p.m.sb16) * d.y;
}

@compute @workgroup_size(256)
fn moe_down_s(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let hid = p.m.out;
    let width = p.m.inp;
    let k = p.k;
    let k1 = k + 1u;
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
    let j = pair % k1;
    let o = ob + pair / k1;
    let live = pair < outs * k1 && o < hid;
    let sh = j == k;
    var e = 0u;
    if (!sh) {
        e = min(dn_ids[t * k + j], p.n_exp - 1u);
    }
    let bits = p.m.bits;
    let epv = 128u / bits;
    let nvr = width / epv;
    let row = e * hid + min(o, hid - 1u);
    let gr = row * (width / p.m.gs);
    let cw4 = select(p.cw / 4u, p.cw / 4u + DOWN_PAD, k1 * (p.cw / 4u + DOWN_PAD) <= STG_LEN);
    let vpw = 32u / bits;
    let base = row * nvr;
    var acc = 0.0;
    for (var c0 = 0u; c0 < width; c0 += p.cw) {
        let n4 = (min(c0 + p.cw, width) - c0) / 4u;
        let nwp = n4 / vpw;
        let v0 = c0 / epv;
        let v1 = v0 + 4u * n4 / epv;
        // The chunk's first four code vec4s before its act rows are staged (moe_down_v).
        var a0 = vec4<u32>(0u);
        var a1 = vec4<u32>(0u);
        var a2 = vec4<u32>(0u);
        var a3 = vec4<u32>(0u);
        if (live) {
            a0 = ds_load(sh, base, v0 + lane, v1);
            a1 = ds_load(sh, base, v0 + lane + 4u, v1);
            a2 = ds_load(sh, base, v0 + lane + 8u, v1);
            a3 = ds_load(sh, base, v0 + lane + 12u, v1);
        }
        for (var i = li; i < k1 * n4; i += 256u) {
            let jj = i / n4;
            let qq = i % n4;
            stg[jj * cw4 + qq] = act4[((t * k1 + jj) * width + c0) / 4u + (qq % nwp) * vpw + qq / nwp];
        }
        workgroupBarrier();
        if (live) {
            for (var v = v0 + lane; v < v1; v += 16u) {
                let w0 = a0;
                let w1 = a1;
                let w2 = a2;
                let w3 = a3;
                if (v + 16u < v1) {
                    a0 = ds_load(sh, base, v + 16u, v1);
                    a1 = ds_load(sh, base, v + 20u, v1);
                    a2 = ds_load(sh, base, v + 24u, v1);
                    a3 = ds_load(sh, base, v + 28u, v1);
                }
                acc += ds_word(sh, w0, v, v0, v1, j * cw4, nwp, gr);
                acc += ds_word(sh, w1, v + 4u, v0, v1, j * cw4, nwp, gr);
                acc += ds_word(sh, w2, v + 8u, v0, v1, j * cw4, nwp, gr);
                acc += ds_word(sh, w3, v + 12u, v0, v1, j * cw4, nwp, gr);
            }
        }
        workgroupBarrier();
    }
    red[li] = acc;
    workgroupBarrier();
    if (li < outs && ob + li < hid) {
        // The CPU's composition in its order: the routed slots weighted and summed in slot
        // order (moe_experts_decode), then + sigmoid(s) · the shared expert's down
        // (add_sigmoid_gated), then the residual add.
        var total = 0.0;
        for (var jj = 0u; jj < k; jj++) {
            let b = (li * k1 + jj) * 4u;
            total += dn_w[t * k + jj] * ((red[b] + red[b + 1u]) + (red[b + 2u] + red[b + 3u]));
        }
        let b = (li * k1 + k) * 4u;
        let sd = (red[b] + red[b + 1u]) + (red[b + 2u] + red[b + 3u]);
        total += sigmoid_f(ds_logit[t]) * sd;
        let i = t * hid + ob + li;
        ds_h[i] = ds_h[i] + total;
    }
}
