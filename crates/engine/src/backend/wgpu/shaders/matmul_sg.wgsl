// matmul_sg.wgsl: the decode GEMVs for adapters with subgroup operations: gemv_rw and gemv_xs
// (x in f32, `LILY_WGPU_GEMV=rw1|rw2|rw4|xs`) and gemv_q6 (x staged once a launch by xq.wgsl's
// q2x_stage; the default, its header at the `q6entry` part); cpu/matmul.rs `matmul`'s GEMV is
// the twin of all three. What follows up to the template paragraph is gemv_rw's.
// Same parameter block, bindings and modes as gemv_v4 (gemv_io.wgsl): up to 4 matrices reading
// the same x, x read as it is / rms-normed / silu(g)·u, outputs stored / added / the MoE block's
// gated residual; 4- or 8-bit codes, each 16-byte code word in one scale group.
//
// Why another GEMV: gemv_v4 stages x in 24 KB of workgroup memory behind a barrier and reduces
// by a 6-step tree of barriers, and selects its matrix's buffers by a `switch` at every load, so
// its loads cannot be hoisted past one another. gemv_rw has no workgroup memory on its main
// path: a team of T lanes (a power of two ≤ 256, T ≤ the row's code words) owns R rows (R = 1,
// 2 or 4: the entry point's number); lane l reads code words l, l + T, … of each of its rows as
// vec4<u32> (the R rows' words issued together), reads its x straight from memory (8 KB: L1
// after the first team), converts codes by gemv_io's 2^23 trick against x pre-scaled in
// registers, and the team sums by subgroup shuffles (subgroupShuffleXor over offsets < T: a team
// is an aligned block of lanes, the subgroups of a workgroup being its invocations in order,
// which `Ctx::new` checks on the adapter before it lets this kernel run). Where a subgroup is
// narrower than a team (lavapipe: 8 lanes), the subgroup totals meet in workgroup memory.
//
// The source is a template (matmul.rs `sg_shader`): the part after the `matrix` marker line is
// repeated for each matrix slot M = 0..3 (its own code and scale buffers, so no load is behind
// a switch), the parts after the `rows` and `entry` markers for each R in 1, 2, 4 (loops over
// R rows unrolled by the driver's compiler with a constant bound); `xs` for each slot and NW
// with `xsentry` for each NW; `q6` for each slot, then `q6entry` once. q2x.wgsl (g5_dot) comes
// before the head.
//
// Launch: 256 invocations = 256 / T teams, (256 / T) · R rows a workgroup; matrix i gets
// ceil(out_i · T_i / (256 · R)) blocks, and workgroup index = block · rows + t as in gemv_v4.
// The norm mode: every team takes the row's sum of squares itself (8 KB), so no barrier
// separates it from the weights; the first workgroup of each row writes xn.

// team_sum, rw_red and rw_sg: q2x_sg.wgsl (shared with the MoE block's xq kernels).

// gemv_xs: the matrix slot of this workgroup (uniform), for the epilogue.
var<private> xs_mi: u32;

// Writes row o of row t's output of matrix xs_mi as the output mode says.
fn xs_out(o: u32, t: u32, out: u32, a: f32) {
    sg_out(xs_mi, t, t * out + o, a);
}

// Writes output i (of row t of x) of matrix mi as the output mode says (gemv_rw, gemv_xs,
// gemv_q6).
fn sg_out(mi: u32, t: u32, i: u32, a: f32) {
    sg_out_m(mi, t, i, a, pv.omode);
}

// sg_out with the output mode given (gemv_q6s: a pipeline constant, so the other modes leave
// the code).
fn sg_out_m(mi: u32, t: u32, i: u32, a: f32, omode: u32) {
    if (omode == 0u) {
        vout(mi, i, a);
    } else if (omode == 1u) {
        vout(mi, i, vget(mi, i) + a);
    } else if (omode == 2u) {
        vout(mi, i, vget(mi, i) + (vr[i] + sigmoid_f(vsg[t]) * a));
    } else if (mi == 0u) {
        conv_out(i, a);
    } else {
        vout(mi, i, a);
    }
}

// omode 3 (gemv_q6, one row of x): a is channel ch's new conv input. out = silu(Σ_tap w[ch, tap]
// · in[tap]), in = the 3 state rows then a, summed in tap order as gdn.wgsl's conv1d; the state
// [3, C] (at vxn, C = matrix 0's rows) shifted by one row with a last. The channel is this
// lane's alone: no other invocation reads or writes its state.
fn conv_out(ch: u32, a: f32) {
    let c = pv.ms[0].out;
    let w = vaux[ch];
    let s0 = vxn[ch / 4u][ch % 4u];
    let s1 = vxn[(c + ch) / 4u][(c + ch) % 4u];
    let s2 = vxn[(2u * c + ch) / 4u][(2u * c + ch) % 4u];
    var acc = 0.0;
    acc += w.x * s0;
    acc += w.y * s1;
    acc += w.z * s2;
    acc += w.w * a;
    vout(0u, ch, silu_f(acc));
    vxn[ch / 4u][ch % 4u] = s1;
    vxn[(c + ch) / 4u][(c + ch) % 4u] = s2;
    vxn[(2u * c + ch) / 4u][(2u * c + ch) % 4u] = a;
}

//@@ matrix
// Scale (or bias) i of matrix {M}, as quant.wgsl's q_sb.
fn rw_sb{M}(i: u32, sb16: u32, is_bias: bool) -> f32 {
    let j = sb_idx(i, sb16);
    return sb_val(select(vs{M}[j], vb{M}[j], is_bias), i, sb16);
}

//@@ rows
// This lane's share of R = {R} rows o0.. of matrix {M} (rows past the end read the last row).
fn rw_dot{M}_{R}(m: QMat, o0: u32, lane: u32, T: u32, xrow: u32, rn: f32) -> vec4<f32> {
    var ri: array<u32, 4>;
    for (var r = 0u; r < {R}u; r++) {
        ri[r] = pv.e * m.out + min(o0 + r, m.out - 1u);
    }
    let gpr = m.inp / m.gs;
    var acc = vec4<f32>(0.0);
    if (m.bits == 4u) {
        let wpr = m.inp / 32u;
        let sc = vec4<f32>(1.0, 1.0 / 16.0, 1.0 / 256.0, 1.0 / 4096.0);
        for (var c = lane; c < wpr; c += T) {
            var q: array<vec4<u32>, 4>;
            var s: array<f32, 4>;
            var b: array<f32, 4>;
            let g = (c * 32u) / m.gs;
            for (var r = 0u; r < {R}u; r++) {
                q[r] = vw{M}[ri[r] * wpr + c];
                s[r] = rw_sb{M}(ri[r] * gpr + g, m.sb16, false);
                b[r] = rw_sb{M}(ri[r] * gpr + g, m.sb16, true);
            }
            let x0 = pv_x(xrow, 8u * c, rn);
            let x1 = pv_x(xrow, 8u * c + 1u, rn);
            let x2 = pv_x(xrow, 8u * c + 2u, rn);
            let x3 = pv_x(xrow, 8u * c + 3u, rn);
            let x4 = pv_x(xrow, 8u * c + 4u, rn);
            let x5 = pv_x(xrow, 8u * c + 5u, rn);
            let x6 = pv_x(xrow, 8u * c + 6u, rn);
            let x7 = pv_x(xrow, 8u * c + 7u, rn);
            let sx = dot(((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)), vec4<f32>(1.0));
            let a0 = x0 * sc;
            let a1 = x1 * sc;
            let a2 = x2 * sc;
            let a3 = x3 * sc;
            let a4 = x4 * sc;
            let a5 = x5 * sc;
            let a6 = x6 * sc;
            let a7 = x7 * sc;
            for (var r = 0u; r < {R}u; r++) {
                let w = q[r];
                let d = q4_word(w, a0, a1, a2, a3, a4, a5, a6, a7);
                acc[r] += s[r] * d + b[r] * sx;
            }
        }
    } else {
        let wpr = m.inp / 16u;
        let sc = vec4<f32>(1.0, 1.0 / 256.0, 1.0, 1.0 / 256.0);
        for (var c = lane; c < wpr; c += T) {
            var q: array<vec4<u32>, 4>;
            var s: array<f32, 4>;
            var b: array<f32, 4>;
            let g = (c * 16u) / m.gs;
            for (var r = 0u; r < {R}u; r++) {
                q[r] = vw{M}[ri[r] * wpr + c];
                s[r] = rw_sb{M}(ri[r] * gpr + g, m.sb16, false);
                b[r] = rw_sb{M}(ri[r] * gpr + g, m.sb16, true);
            }
            let x0 = pv_x(xrow, 4u * c, rn);
            let x1 = pv_x(xrow, 4u * c + 1u, rn);
            let x2 = pv_x(xrow, 4u * c + 2u, rn);
            let x3 = pv_x(xrow, 4u * c + 3u, rn);
            let sx = dot((x0 + x1) + (x2 + x3), vec4<f32>(1.0));
            let a0 = x0 * sc;
            let a1 = x1 * sc;
            let a2 = x2 * sc;
            let a3 = x3 * sc;
            for (var r = 0u; r < {R}u; r++) {
                let w = q[r];
                let d = q8_word(w, a0, a1, a2, a3);
                acc[r] += s[r] * d + b[r] * sx;
            }
        }
    }
    return acc;
}

//@@ entry
@compute @workgroup_size(256)
fn gemv_rw{R}(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_size) sg_size: u32,
    @builtin(subgroup_invocation_id) lane_sg: u32,
) {
    if (li == 0u) {
        rw_sg = sg_size;
    }
    let sg = workgroupUniformLoad(&rw_sg);
    let wg = wg_index(wid);
    let t = wg % pv.rows;
    let slot = gv_slot(wg / pv.rows);
    let mi = slot.x;
    let blk = slot.y;
    let m = pv.ms[mi];
    let T = pv.lanes[mi];
    let lane = li % T;
    let o0 = (blk * (256u / T) + li / T) * {R}u;
    let xrow = t * (m.inp / 4u);
    var rn = 1.0;
    if (pv.xmode == 1u) {
        var ss = 0.0;
        for (var v = lane; v < m.inp / 4u; v += T) {
            let h = vx[xrow + v];
            ss += dot(h, h);
        }
        rn = 1.0 / sqrt(team_sum(vec4<f32>(ss, 0.0, 0.0, 0.0), li, lane_sg, T, sg).x / f32(m.inp) + pv.eps);
        if (wg < pv.rows) {
            for (var v = li; v < m.inp / 4u; v += 256u) {
                vxn[xrow + v] = vx[xrow + v] * rn * vaux[v];
            }
        }
    }
    var acc: vec4<f32>;
    switch mi {
        case 0u: { acc = rw_dot0_{R}(m, o0, lane, T, xrow, rn); }
        case 1u: { acc = rw_dot1_{R}(m, o0, lane, T, xrow, rn); }
        case 2u: { acc = rw_dot2_{R}(m, o0, lane, T, xrow, rn); }
        default: { acc = rw_dot3_{R}(m, o0, lane, T, xrow, rn); }
    }
    acc = team_sum(acc, li, lane_sg, T, sg);
    // Lane r of a team writes its row r.
    if (lane < {R}u && o0 + lane < m.out) {
        sg_out(mi, t, t * m.out + o0 + lane, acc[lane]);
    }
}

//@@ xs
// gemv_xs's rows of matrix {M} with NW = {NW} code words a lane: the subgroup (team) `sgi` of
// `nsg` takes rows o0 + sgi, o0 + sgi + nsg, … below o1, U = 2 at a time (their code words issued
// together); lane l's columns are words l, l + W, …, l + (NW - 1)·W of every row, whose x it
// holds in registers (xa, pre-scaled) with each word's Σ x (sxw). Returns nothing: writes each
// row's total (subgroupAdd) through the epilogue by lane 0.
fn xs_rows{M}_{NW}(m: QMat, t: u32, o0: u32, o1: u32, sgi: u32, nsg: u32, lane: u32, W: u32,
                   xa: ptr<function, array<vec4<f32>, 8 * {NW}>>, sxw: ptr<function, array<f32, {NW}>>) {
    let gpr = m.inp / m.gs;
    let epw = 128u / m.bits;
    let wpr = m.inp / epw;
    for (var o = o0 + sgi; o < o1; o += 2u * nsg) {
        let ob = min(o + nsg, o1 - 1u);
        let ra = pv.e * m.out + o;
        let rb = pv.e * m.out + ob;
        var qa: array<vec4<u32>, {NW}>;
        var qb: array<vec4<u32>, {NW}>;
        var sa: array<f32, {NW}>;
        var ba: array<f32, {NW}>;
        var sb: array<f32, {NW}>;
        var bb: array<f32, {NW}>;
        for (var j = 0u; j < {NW}u; j++) {
            let c = min(lane + j * W, wpr - 1u);
            qa[j] = vw{M}[ra * wpr + c];
            qb[j] = vw{M}[rb * wpr + c];
            let g = (c * epw) / m.gs;
            sa[j] = rw_sb{M}(ra * gpr + g, m.sb16, false);
            ba[j] = rw_sb{M}(ra * gpr + g, m.sb16, true);
            sb[j] = rw_sb{M}(rb * gpr + g, m.sb16, false);
            bb[j] = rw_sb{M}(rb * gpr + g, m.sb16, true);
        }
        var pa = 0.0;
        var pb = 0.0;
        for (var j = 0u; j < {NW}u; j++) {
            // Lanes past the row's words hold x = 0 (and Σ x = 0): their products vanish.
            var da: f32;
            var db: f32;
            if (m.bits == 4u) {
                let x0 = (*xa)[8u * j];
                let x1 = (*xa)[8u * j + 1u];
                let x2 = (*xa)[8u * j + 2u];
                let x3 = (*xa)[8u * j + 3u];
                let x4 = (*xa)[8u * j + 4u];
                let x5 = (*xa)[8u * j + 5u];
                let x6 = (*xa)[8u * j + 6u];
                let x7 = (*xa)[8u * j + 7u];
                da = q4_word(qa[j], x0, x1, x2, x3, x4, x5, x6, x7);
                db = q4_word(qb[j], x0, x1, x2, x3, x4, x5, x6, x7);
            } else {
                let x0 = (*xa)[8u * j];
                let x1 = (*xa)[8u * j + 1u];
                let x2 = (*xa)[8u * j + 2u];
                let x3 = (*xa)[8u * j + 3u];
                da = q8_word(qa[j], x0, x1, x2, x3);
                db = q8_word(qb[j], x0, x1, x2, x3);
            }
            pa += sa[j] * da + ba[j] * (*sxw)[j];
            pb += sb[j] * db + bb[j] * (*sxw)[j];
        }
        let ta = subgroupAdd(pa);
        let tb = subgroupAdd(pb);
        if (lane == 0u) {
            xs_out(o, t, m.out, ta);
            if (o + nsg < o1) {
                xs_out(o + nsg, t, m.out, tb);
            }
        }
    }
}

//@@ xsentry
// gemv_xs with NW = {NW} code words a lane (matmul.rs picks NW = the row's words / the
// subgroup width, rounded up to 1, 2, 4 or 8).
@compute @workgroup_size(256)
fn gemv_xs{NW}(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_size) sg_size: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    if (li == 0u) {
        rw_sg = sg_size;
    }
    let W = workgroupUniformLoad(&rw_sg);
    let wg = wg_index(wid);
    let t = wg % pv.rows;
    let slot = gv_slot(wg / pv.rows);
    let mi = slot.x;
    let blk = slot.y;
    let m = pv.ms[mi];
    // Rows a workgroup: pv.lanes (a multiple of 2 · nsg, chosen by the host).
    let rpw = pv.lanes[mi];
    let o0 = blk * rpw;
    let o1 = min(o0 + rpw, m.out);
    let nsg = 256u / W;
    let sgi = li / W;
    xs_mi = mi;
    let epw = 128u / m.bits;
    let wpr = m.inp / epw;
    let xrow = t * (m.inp / 4u);
    // This lane's x: its words' elements, as read (h for the norm mode), Σ of squares alongside.
    var xa: array<vec4<f32>, 8 * {NW}>;
    var sxw: array<f32, {NW}>;
    var ss = 0.0;
    let nv = epw / 4u;
    for (var j = 0u; j < {NW}u; j++) {
        let c = lane + j * W;
        for (var i = 0u; i < 8u; i++) {
            var v = vec4<f32>(0.0);
            if (c < wpr && i < nv) {
                v = vx[xrow + c * nv + i];
            }
            xa[8u * j + i] = v;
            ss += dot(v, v);
        }
    }
    var rn = 1.0;
    if (pv.xmode == 1u) {
        rn = 1.0 / sqrt(subgroupAdd(ss) / f32(m.inp) + pv.eps);
    }
    var sc = vec4<f32>(1.0, 1.0 / 256.0, 1.0, 1.0 / 256.0);
    if (m.bits == 4u) {
        sc = vec4<f32>(1.0, 1.0 / 16.0, 1.0 / 256.0, 1.0 / 4096.0);
    }
    for (var j = 0u; j < {NW}u; j++) {
        let c = lane + j * W;
        var s4 = vec4<f32>(0.0);
        for (var i = 0u; i < 8u; i++) {
            var v = xa[8u * j + i];
            if (c < wpr && i < nv) {
                if (pv.xmode == 1u) {
                    v = v * rn * vaux[c * nv + i];
                    // The normed row goes back out once (the experts read it), by the first
                    // workgroup's first subgroup.
                    if (wg < pv.rows && sgi == 0u) {
                        vxn[xrow + c * nv + i] = v;
                    }
                } else if (pv.xmode == 2u) {
                    let u = vaux[xrow + c * nv + i];
                    v = vec4<f32>(silu_f(v.x) * u.x, silu_f(v.y) * u.y, silu_f(v.z) * u.z, silu_f(v.w) * u.w);
                }
            }
            s4 += v;
            xa[8u * j + i] = v * sc;
        }
        sxw[j] = (s4.x + s4.y) + (s4.z + s4.w);
    }
    switch mi {
        case 0u: { xs_rows0_{NW}(m, t, o0, o1, sgi, nsg, lane, W, &xa, &sxw); }
        case 1u: { xs_rows1_{NW}(m, t, o0, o1, sgi, nsg, lane, W, &xa, &sxw); }
        case 2u: { xs_rows2_{NW}(m, t, o0, o1, sgi, nsg, lane, W, &xa, &sxw); }
        default: { xs_rows3_{NW}(m, t, o0, o1, sgi, nsg, lane, W, &xa, &sxw); }
    }
}

//@@ q6
// gemv_q6 (the entry's header says how it launches): this lane's share of rows o0 .. o0 + R - 1
// of matrix {M} (R = 1, 2 or 4, uniform; rows past the end read the last row), against x as
// q2x_stage staged it at xb (xq.wgsl's layouts, read through vx as bits). Every load of a step
// is issued before its products: R rows' code words (16 bytes each), their scales and biases,
// and x's word (80 bytes 4-bit, 48 bytes 8-bit), shared by the R rows. `rnh` (0: none): x staged
// by gdn_step_x.wgsl's gdn_step_xs without its heads' 1 / rms (heads of rnh elements); each
// word's d and Σ x scaled by its head's (q6_hscale).
fn q6_dot{M}(m: QMat, o0: u32, R: u32, lane: u32, T: u32, xb: u32, rnh: u32) -> vec4<f32> {
    let last = m.out - 1u;
    let r0 = pv.e * m.out + min(o0, last);
    let r1 = pv.e * m.out + min(o0 + 1u, last);
    let r2 = pv.e * m.out + min(o0 + 2u, last);
    let r3 = pv.e * m.out + min(o0 + 3u, last);
    let gpr = m.inp / m.gs;
    let epw = 128u / m.bits;
    let wpr = m.inp / epw;
    let w4 = m.inp / 32u;
    var acc = vec4<f32>(0.0);
    for (var c = lane; c < wpr; c += T) {
        let g = (c * epw) / m.gs;
        var q0 = vw{M}[r0 * wpr + c];
        var q1 = vec4<u32>(0u);
        var q2 = vec4<u32>(0u);
        var q3 = vec4<u32>(0u);
        var s = vec4<f32>(rw_sb{M}(r0 * gpr + g, m.sb16, false), 0.0, 0.0, 0.0);
        var b = vec4<f32>(rw_sb{M}(r0 * gpr + g, m.sb16, true), 0.0, 0.0, 0.0);
        if (R > 1u) {
            q1 = vw{M}[r1 * wpr + c];
            s.y = rw_sb{M}(r1 * gpr + g, m.sb16, false);
            b.y = rw_sb{M}(r1 * gpr + g, m.sb16, true);
        }
        if (R > 2u) {
            q2 = vw{M}[r2 * wpr + c];
            q3 = vw{M}[r3 * wpr + c];
            s.z = rw_sb{M}(r2 * gpr + g, m.sb16, false);
            s.w = rw_sb{M}(r3 * gpr + g, m.sb16, false);
            b.z = rw_sb{M}(r2 * gpr + g, m.sb16, true);
            b.w = rw_sb{M}(r3 * gpr + g, m.sb16, true);
        }
        var xa1: vec4<u32>;
        var xb1 = vec4<u32>(0u);
        var xa2: vec4<u32>;
        var xb2 = vec4<u32>(0u);
        var xm: vec4<u32>;
        if (m.bits == 4u) {
            xa1 = bitcast<vec4<u32>>(vx[xb + c]);
            xb1 = bitcast<vec4<u32>>(vx[xb + w4 + c]);
            xa2 = bitcast<vec4<u32>>(vx[xb + 2u * w4 + c]);
            xb2 = bitcast<vec4<u32>>(vx[xb + 3u * w4 + c]);
            xm = bitcast<vec4<u32>>(vx[xb + 4u * w4 + c]);
        } else {
            let x8 = xb + 5u * w4;
            xa1 = bitcast<vec4<u32>>(vx[x8 + c]);
            xa2 = bitcast<vec4<u32>>(vx[x8 + wpr + c]);
            xm = bitcast<vec4<u32>>(vx[x8 + 2u * wpr + c]);
        }
        let hs = q6_hscale(xb, c * epw, rnh, m.inp);
        let dd = bitcast<f32>(xm.x) * hs;
        let sx = bitcast<f32>(xm.y) * hs;
        // 0 for 4-bit words (q2x_stage writes it so).
        let corr = bitcast<i32>(xm.z);
        var d = vec4<f32>(f32(g5_dot(q0, m.bits, xa1, xb1, xa2, xb2) + corr), 0.0, 0.0, 0.0);
        if (R > 1u) {
            d.y = f32(g5_dot(q1, m.bits, xa1, xb1, xa2, xb2) + corr);
        }
        if (R > 2u) {
            d.z = f32(g5_dot(q2, m.bits, xa1, xb1, xa2, xb2) + corr);
            d.w = f32(g5_dot(q3, m.bits, xa1, xb1, xa2, xb2) + corr);
        }
        acc += s * (dd * d) + b * sx;
    }
    return acc;
}

// gemv_q6s (`LILY_WGPU_SPEC=q6`): slot {M}'s matrix and team shape as pipeline constants
// (matmul.rs `q6_spec` sets them for each launch), so that the divisions by them, the bit
// width's and R's branches and the team's sum fold away. The defaults (out_proj's shape on a
// 32-lane subgroup) only serve `lily lab --pipeline-stats`.
override Q6_OUT{M}: u32 = 2048u;
override Q6_INP{M}: u32 = 4096u;
override Q6_BITS{M}: u32 = 4u;
override Q6_GS{M}: u32 = 64u;
override Q6_SB16{M}: u32 = 1u;
override Q6_T{M}: u32 = 128u;
override Q6_R{M}: u32 = 4u;

// gemv_q6s's workgroups of slot {M}: gemv_q6's body with the constants above.
fn q6s_run{M}(blk: u32, t: u32, li: u32, lane_sg: u32) {
    let m = QMat(Q6_OUT{M}, Q6_INP{M}, Q6_BITS{M}, Q6_GS{M}, Q6_SB16{M}, 0u, 0u, 0u);
    let T = Q6_T{M};
    let R = Q6_R{M};
    let lane = li % T;
    let o0 = (blk * (256u / T) + li / T) * R;
    let xb = q6_xb(t, m.inp);
    // x staged without its norm's 1 / rms (Q6_RNG): the row's scales the sum, a head's each word.
    let row = Q6_RNG == Q6_INP{M};
    let acc = q6_dot{M}(m, o0, R, lane, T, xb, select(Q6_RNG, 0u, row)) * q6_rn(xb, m.inp, row);
    q6_tail({M}u, m, blk, t, li, lane_sg, Q6_SG, T, R, o0, Q6_OMODE, acc);
}

// gemv_q6w (the header at its entry): step c's loads of this team's rows rr of matrix {M} (R
// of them; the last row again past R), q6_dot's loads but x's.
fn q6w_load{M}(m: QMat, rr: vec4<u32>, R: u32, c: u32) -> Q6L {
    let gpr = m.inp / m.gs;
    let wpr = m.inp / (128u / m.bits);
    let g = (c * (128u / m.bits)) / m.gs;
    var l: Q6L;
    l.q0 = vw{M}[rr.x * wpr + c];
    l.s = vec4<f32>(rw_sb{M}(rr.x * gpr + g, m.sb16, false), 0.0, 0.0, 0.0);
    l.b = vec4<f32>(rw_sb{M}(rr.x * gpr + g, m.sb16, true), 0.0, 0.0, 0.0);
    if (R > 1u) {
        l.q1 = vw{M}[rr.y * wpr + c];
        l.s.y = rw_sb{M}(rr.y * gpr + g, m.sb16, false);
        l.b.y = rw_sb{M}(rr.y * gpr + g, m.sb16, true);
    }
    if (R > 2u) {
        l.q2 = vw{M}[rr.z * wpr + c];
        l.q3 = vw{M}[rr.w * wpr + c];
        l.s.z = rw_sb{M}(rr.z * gpr + g, m.sb16, false);
        l.s.w = rw_sb{M}(rr.w * gpr + g, m.sb16, false);
        l.b.z = rw_sb{M}(rr.z * gpr + g, m.sb16, true);
        l.b.w = rw_sb{M}(rr.w * gpr + g, m.sb16, true);
    }
    return l;
}

// gemv_q6w's workgroups of slot {M} (gemv_q6s's constants): the first step's loads, then x
// staged in the workgroup behind them, then the steps.
fn q6w_run{M}(blk: u32, t: u32, li: u32, lane_sg: u32, first: bool) {
    let m = QMat(Q6_OUT{M}, Q6_INP{M}, Q6_BITS{M}, Q6_GS{M}, Q6_SB16{M}, 0u, 0u, 0u);
    let T = Q6_T{M};
    let R = Q6_R{M};
    let lane = li % T;
    let o0 = (blk * (256u / T) + li / T) * R;
    // The constants, not m's fields, past m's first use (naga 30's override pass rejects some
    // uses of a constant-composed struct's fields: ExpressionAlreadyInScope).
    let last = Q6_OUT{M} - 1u;
    let rr = vec4<u32>(pv.e * Q6_OUT{M}) + min(vec4<u32>(o0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(last));
    let wpr = Q6_INP{M} / (128u / Q6_BITS{M});
    // lane < wpr: a team has at most a row's words (q6_shape).
    let l0 = q6w_load{M}(m, rr, R, lane);
    let rn = q6w_stage(t, li, lane_sg, Q6_INP{M}, first);
    var acc = q6w_mul(l0, Q6_BITS{M}, R, lane, Q6_INP{M});
    for (var c = lane + T; c < wpr; c += T) {
        acc += q6w_mul(q6w_load{M}(m, rr, R, c), Q6_BITS{M}, R, c, Q6_INP{M});
    }
    q6_tail({M}u, m, blk, t, li, lane_sg, Q6_SG, T, R, o0, Q6_OMODE, acc * rn);
}

// gemv_rt (the header at its entry): this thread's share of row o of matrix {M} (8-bit codes,
// stack index pv.e), its elements 8i .. 8i + 7 against xl, xh in f32: s · Σ q·x + b · Σ x (the
// 8 elements lie in one group: Q6_GS a multiple of 8).
fn rt_dot{M}(o: u32, i: u32, xl: vec4<f32>, xh: vec4<f32>) -> f32 {
    let row = pv.e * Q6_OUT{M} + o;
    let q = vw{M}[row * (Q6_INP{M} / 16u) + i / 2u];
    let odd = i % 2u == 1u;
    let sh = vec4<u32>(0u, 8u, 16u, 24u);
    let cl = vec4<f32>((vec4<u32>(select(q.x, q.z, odd)) >> sh) & vec4<u32>(0xffu));
    let ch = vec4<f32>((vec4<u32>(select(q.y, q.w, odd)) >> sh) & vec4<u32>(0xffu));
    let g = row * (Q6_INP{M} / Q6_GS{M}) + (8u * i) / Q6_GS{M};
    let sc = rw_sb{M}(g, Q6_SB16{M}, false);
    let bi = rw_sb{M}(g, Q6_SB16{M}, true);
    return sc * (dot(cl, xl) + dot(ch, xh)) + bi * dot(xl + xh, vec4<f32>(1.0));
}

//@@ q6entry
// omode 4 (Backend::route_ahead, opt-in LILY_WGPU_ROUTE_AHEAD=1; one row of x): omode 1's
// residual add, and the MoE router that follows folded in (the CUDA backend's gemv.cu AHEAD has
// the why): the workgroup's rows of the new h, times the MoE norm's weights (at aux), go to
// q6_fx, and invocation e sums router row e (matrix slot 1, 8-bit, [E, rows]; e = E: the shared
// gate, slot 2) over those columns, adding the sum into vacc[6e .. 6e + 6] as fixed point
// (fold_add: integer adds, so the total does not depend on the order the workgroups arrive in). xq.wgsl's q2x_stage (xp.ahead) turns the sums into the
// logits and zeroes them. Needs 256 R / T rows a workgroup, a multiple of 4 up to 256.
@group(0) @binding(22) var<storage, read_write> vacc: array<atomic<u32>>;
var<workgroup> q6_fx: array<f32, 256>;

// Code word j (u32) of the 8-bit matrix in slot 1 (router) or 2 (shared gate).
fn fold_word(slot: u32, j: u32) -> u32 {
    if (slot == 1u) {
        return vw1[j / 4u][j % 4u];
    }
    return vw2[j / 4u][j % 4u];
}

fn fold_sb(slot: u32, i: u32, sb16: u32, is_bias: bool) -> f32 {
    if (slot == 1u) {
        return rw_sb1(i, sb16, is_bias);
    }
    return rw_sb2(i, sb16, is_bias);
}

// v (|v| < 2^31) added into row e's sums as fixed point: |v| = i + m·2^-16 + l·2^-32 (i its
// integer part, m and l 16-bit, l truncated below 2^-32), each part added into its own u32 of
// the positive (vacc[6e ..]) or the negative (vacc[6e + 3 ..]) triple. No part can overflow for
// fewer than 65,537 workgroups, so no carry is taken and no atomic waits for its old value:
// three adds that return nothing, in any order, give the same words.
fn fold_add(e: u32, v: f32) {
    let a = abs(v);
    let ip = floor(a);
    let f = (a - ip) * 65536.0;
    let m = floor(f);
    let l = u32((f - m) * 65536.0);
    let base = 6u * e + select(0u, 3u, v < 0.0);
    if (ip > 0.0) {
        atomicAdd(&vacc[base], u32(ip));
    }
    if (m > 0.0) {
        atomicAdd(&vacc[base + 1u], u32(m));
    }
    if (l > 0u) {
        atomicAdd(&vacc[base + 2u], l);
    }
}

// Router row e (e = E: the shared gate) over columns col0 .. col0 + rb: the workgroup's rows of
// h in q6_fx, times the norm's weights at aux where `nw` (omode 6: q6_fx holds h itself, which
// the staging needs; omode 4 holds h · w already).
fn fold_dot(e: u32, col0: u32, rb: u32, nw: bool) -> f32 {
    let ne = pv.ms[1].out;
    var slot = 1u;
    var row = e;
    if (e == ne) {
        slot = 2u;
        row = 0u;
    }
    let m = pv.ms[slot];
    let gpr = m.inp / m.gs;
    let base = (row * m.inp + col0) / 4u;
    var sum = 0.0;
    for (var j = 0u; j < rb / 4u; j++) {
        let w = fold_word(slot, base + j);
        let c = col0 + 4u * j;
        let g = row * gpr + c / m.gs;
        var x = vec4<f32>(q6_fx[c - col0], q6_fx[c - col0 + 1u], q6_fx[c - col0 + 2u], q6_fx[c - col0 + 3u]);
        if (nw) {
            x *= vaux[c / 4u];
        }
        let q = vec4<f32>(f32(w & 0xffu), f32((w >> 8u) & 0xffu), f32((w >> 16u) & 0xffu), f32(w >> 24u));
        sum += fold_sb(slot, g, m.sb16, false) * dot(q, x) + fold_sb(slot, g, m.sb16, true) * dot(x, vec4<f32>(1.0));
    }
    return sum;
}

// Invocation li's router rows (li, li + 256, …, up to E = the shared gate) over columns col0 ..
// col0 + rb (the workgroup's rows of h, in q6_fx), added into vacc.
fn q6_fold(li: u32, col0: u32, rb: u32) {
    let ne = pv.ms[1].out;
    for (var e = li; e <= ne; e += 256u) {
        let sum = fold_dot(e, col0, rb, false);
        if (sum != 0.0) {
            fold_add(e, sum);
        }
    }
}

// omode 6 (`LILY_WGPU_XQ_AHEAD=fold`; one row of x): omode 5's staging, and the router folded in
// as in omode 4 but without atomics: workgroup blk (32 rows of h) writes its dot of every router
// row e (e = E: the shared gate) with its 32 columns of h · w, unscaled by the 1 / rms, at word
// (e · n / 32 + blk) after the partial sums of squares (a row's values contiguous: its reader
// takes them as n / 128 vec4s). moe_xq.wgsl's moe_gate_up_y (MY_FOLD) adds the n / 32
// workgroups' values of each row in workgroup order and scales the sum by the 1 / rms it takes
// from the sums of squares: the logits, with no router launch at all.
fn q6_fold_part(li: u32, blk: u32, n: u32) {
    let ne = pv.ms[1].out;
    let base = 4u * q6_xb(1u, n) + n / 32u + blk;
    for (var e = li; e <= ne; e += 256u) {
        atomicStore(&vacc[base + e * (n / 32u)], bitcast<u32>(fold_dot(e, blk * 32u, 32u, true)));
    }
}

// omode 5 (Backend::route_ahead with `LILY_WGPU_XQ_AHEAD=1`; one row of x): omode 1's residual
// add, then the MoE block's x staged from the new h, so that no q2x_stage runs before the router
// and the experts. x = rms_norm(h) · w = r · (h · w), r = 1 / rms(h) one number for the row, and
// q2x's words are linear in x (scaling x scales a word's d and Σ x and leaves its codes, up to
// the rounding of the division), so a workgroup stages its 32 rows of h · w (w the MoE norm's
// weights, at aux) as one 4-bit word (two 8-bit) without r, in xq.wgsl's layouts (xq_put's
// indices; q2x_words' maths), and writes its rows' Σ h² (in row order) after the staged row:
// the readers (gemv_q6s with Q6_RNG, moe_xq.wgsl's moe_gate_up_y with MY_RN) take r from those
// partial sums (q6_rn) and scale their dot products by it. Words and sums go to binding 22 as
// u32s (atomicStore: the words are bit patterns, not floats). Needs 32 rows a workgroup
// (matmul.rs `stage_ahead_shape`) and out a multiple of 128.
fn q6_stage_ahead(li: u32, blk: u32, n: u32) {
    let q4 = li % 4u;
    let col = blk * 32u + 8u * q4;
    let xl = vec4<f32>(q6_fx[8u * q4], q6_fx[8u * q4 + 1u], q6_fx[8u * q4 + 2u], q6_fx[8u * q4 + 3u]);
    let xh = vec4<f32>(q6_fx[8u * q4 + 4u], q6_fx[8u * q4 + 5u], q6_fx[8u * q4 + 6u], q6_fx[8u * q4 + 7u]);
    // Every invocation quantizes (q2x_words' shuffles); the first 4 hold the word.
    let q = q2x_words(xl * vaux[col / 4u], xh * vaux[col / 4u + 1u]);
    if (li < 4u) {
        let w4 = n / 32u;
        let w8 = n / 16u;
        let b8 = 5u * w4;
        let u = blk;
        q6_put(u, q4, q.w4.x);
        q6_put(w4 + u, q4, q.w4.y);
        q6_put(2u * w4 + u, q4, q.w4.z);
        q6_put(3u * w4 + u, q4, q.w4.w);
        if (q4 == 0u) {
            q6_put4(4u * w4 + u, q.m4);
        }
        let v = 2u * u + q4 / 2u;
        let pp = 2u * (q4 % 2u);
        q6_put(b8 + v, pp, q.w8.x);
        q6_put(b8 + v, pp + 1u, q.w8.y);
        q6_put(b8 + w8 + v, pp, q.w8.z);
        q6_put(b8 + w8 + v, pp + 1u, q.w8.w);
        if (pp == 0u) {
            q6_put4(b8 + 2u * w8 + v, q.m8);
        }
    }
    if (li == 0u) {
        var ss = 0.0;
        for (var i = 0u; i < 32u; i++) {
            ss += q6_fx[i] * q6_fx[i];
        }
        atomicStore(&vacc[4u * q6_xb(1u, n) + blk], bitcast<u32>(ss));
    }
}

// u32 `c` of vec4 `v` of the staged row at binding 22 (omode 5).
fn q6_put(v: u32, c: u32, a: u32) {
    atomicStore(&vacc[4u * v + c], a);
}

fn q6_put4(v: u32, a: vec4<u32>) {
    q6_put(v, 0u, a.x);
    q6_put(v, 1u, a.y);
    q6_put(v, 2u, a.z);
    q6_put(v, 3u, a.w);
}

// The row's 1 / rms for a reader of x staged without it (`on`: gemv_q6s with Q6_RNG = the row;
// else 1): the partial sums of squares after the staged row at xb (n / 32 of them), added in
// order, in vec4s (q6_hscale's sum for a head, in its order).
fn q6_rn(xb: u32, n: u32, on: bool) -> f32 {
    if (!on) {
        return 1.0;
    }
    var s = 0.0;
    let base = xb + q6_xb(1u, n);
    for (var j = 0u; j < n / 128u; j++) {
        let p = vx[base + j];
        s += p.x;
        s += p.y;
        s += p.z;
        s += p.w;
    }
    return 1.0 / sqrt(s / f32(n) + pv.eps);
}

// A word's scale for x staged without its norm's 1 / rms in groups smaller than the row
// (gdn_step_xs's heads: `rnh` > 0 elements, a multiple of 32, each with rnh / 32 partial sums of
// squares, in order, after the staged row): the 1 / rms of the group holding element e (the
// gated norm's r, gdn_step_x's arithmetic); 1 when rnh is 0.
fn q6_hscale(xb: u32, e: u32, rnh: u32, n: u32) -> f32 {
    if (rnh == 0u) {
        return 1.0;
    }
    let np = rnh / 32u;
    let base = 4u * (xb + q6_xb(1u, n)) + (e / rnh) * np;
    var ss = 0.0;
    for (var j = 0u; j < np; j++) {
        ss += vx[(base + j) / 4u][(base + j) % 4u];
    }
    return 1.0 / sqrt(ss / f32(rnh) + pv.eps);
}

// gemv_q6: the decode GEMV against x staged once a launch by q2x_stage (xq.wgsl), so that a
// workgroup has no staging and no barrier but its sum's: gemv_v5's integer dot products without
// its per-workgroup chain (x loaded and quantized behind 3 barriers, a 6-step tree of barriers
// at the end, 95 registers: two workgroups an SM on the H200). A team of T lanes owns R rows
// (both per matrix, chosen by matmul.rs `q6_shape`: T from the subgroup up to the row's code
// words, R from 4 down, until the matrix has enough workgroups): lane l reads code words l,
// l + T, … of each, and x's words from the staged buffer (L1/L2: 5.5 bytes an element, every
// team reads the same); the team sums by shuffles (team_sum: through workgroup memory, one
// barrier pair, only where T exceeds the subgroup). Same parameter block and bindings as gemv_v4
// with vx = the staged x, xmode 0 (q2x_stage applied the mode), lanes = T | R << 16; outputs as
// gemv_io's omode says. Launch: 256 invocations = 256 / T teams, 256 R / T rows a workgroup;
// matrix i ceil(out_i · T_i / (256 R_i)) blocks, workgroup index = block · rows + t (as gemv_v4).
@compute @workgroup_size(256)
fn gemv_q6(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_size) sg_size: u32,
    @builtin(subgroup_invocation_id) lane_sg: u32,
) {
    if (li == 0u) {
        rw_sg = sg_size;
    }
    let sg = workgroupUniformLoad(&rw_sg);
    let wg = wg_index(wid);
    let t = wg % pv.rows;
    let slot = gv_slot(wg / pv.rows);
    let mi = slot.x;
    let blk = slot.y;
    let m = pv.ms[mi];
    let T = pv.lanes[mi] & 0xffffu;
    let R = pv.lanes[mi] >> 16u;
    let lane = li % T;
    let o0 = (blk * (256u / T) + li / T) * R;
    let xb = q6_xb(t, m.inp);
    // The layout is derived from the bindings a kernel uses, and gemv_io's launch binds the
    // norm's and the glu's buffers too: this keeps them in it (xmode is 0 here).
    if (pv.xmode == 7u) {
        vxn[0] = vaux[0];
    }
    var acc: vec4<f32>;
    switch mi {
        case 0u: { acc = q6_dot0(m, o0, R, lane, T, xb, 0u); }
        case 1u: { acc = q6_dot1(m, o0, R, lane, T, xb, 0u); }
        case 2u: { acc = q6_dot2(m, o0, R, lane, T, xb, 0u); }
        default: { acc = q6_dot3(m, o0, R, lane, T, xb, 0u); }
    }
    q6_tail(mi, m, blk, t, li, lane_sg, sg, T, R, o0, pv.omode, acc);
}

// Row t's staged x (xq.wgsl: 5 · inp / 32 + 3 · inp / 16 vec4s a row).
fn q6_xb(t: u32, inp: u32) -> u32 {
    return t * (5u * (inp / 32u) + 3u * (inp / 16u));
}

// gemv_q6's (and gemv_q6s's) end: the team's sum, then the output mode's epilogue. Uniform
// control flow (team_sum's and the fold's barriers).
fn q6_tail(mi: u32, m: QMat, blk: u32, t: u32, li: u32, lane_sg: u32, sg: u32, T: u32, R: u32,
           o0: u32, omode: u32, part: vec4<f32>) {
    let lane = li % T;
    let acc = team_sum(part, li, lane_sg, T, sg);
    if (omode == 4u) {
        // The residual add, then the router folded in (the header above q6_fold).
        if (lane < R) {
            let o = o0 + lane;
            var fx = 0.0;
            if (o < m.out) {
                let hn = vget(0u, o) + acc[lane];
                vout(0u, o, hn);
                fx = hn * vaux[o / 4u][o % 4u];
            }
            q6_fx[(li / T) * R + lane] = fx;
        }
        workgroupBarrier();
        let rb = 256u / T * R;
        q6_fold(li, blk * rb, rb);
        return;
    }
    if (omode == 5u || omode == 6u) {
        // The residual add, then the MoE block's x staged ahead (the header above
        // q6_stage_ahead), and in omode 6 the router's partial dots (q6_fold_part).
        if (lane < R) {
            let o = o0 + lane;
            let hn = vget(0u, o) + acc[lane];
            vout(0u, o, hn);
            q6_fx[(li / T) * R + lane] = hn;
        }
        workgroupBarrier();
        q6_stage_ahead(li, blk, m.out);
        if (omode == 6u) {
            q6_fold_part(li, blk, m.out);
        }
        return;
    }
    // Lane r of a team writes its row r.
    if (lane < R && o0 + lane < m.out) {
        sg_out_m(mi, t, t * m.out + o0 + lane, acc[lane], omode);
    }
}

// gemv_q6s: gemv_q6 specialised to one launch (`LILY_WGPU_SPEC` q6, the default since stop
// 38): the launch's matrix count, x rows, output mode, subgroup width and the slots' first
// blocks are pipeline constants here, each slot's shape beside its q6s_run. Same parameters,
// bindings, launch and arithmetic as gemv_q6 (the outputs are bit-equal: the op tests compare
// them); what goes is the runtime integer divisions on the way to the first load, the
// workgroup's subgroup-width broadcast (a barrier), the block's slot search and the branches on
// values the launch fixes. One pipeline per launch shape (a decode step has about ten).
override Q6_NM: u32 = 1u;
// x's rows; 0: read pv.rows (a launch of several rows).
override Q6_ROWS: u32 = 1u;
override Q6_OMODE: u32 = 1u;
override Q6_SG: u32 = 32u;
override Q6_S1: u32 = 0u;
override Q6_S2: u32 = 0u;
override Q6_S3: u32 = 0u;
// x staged without its norm's 1 / rms (omode 5, moe_xq.wgsl moe_down_ys, gdn_step_xs; one row
// of x): the size of the norm's groups, the row (one 1 / rms, q6_rn, on the sum) or less
// (gdn_step_xs's heads: each word's, q6_hscale); 0: x staged whole.
override Q6_RNG: u32 = 0u;

@compute @workgroup_size(256)
fn gemv_q6s(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_invocation_id) lane_sg: u32,
) {
    let a = q6s_at(wid);
    let t = a.x;
    let s = a.yz;
    switch s.x {
        case 0u: { q6s_run0(s.y, t, li, lane_sg); }
        case 1u: { q6s_run1(s.y, t, li, lane_sg); }
        case 2u: { q6s_run2(s.y, t, li, lane_sg); }
        default: { q6s_run3(s.y, t, li, lane_sg); }
    }
}

// A gemv_q6s / gemv_q6w workgroup's row of x, matrix slot and block within that matrix's
// (uniform); it also keeps gemv_q6's bindings, all of them, in the entry's (the derived layout
// must be the same).
fn q6s_at(wid: vec3<u32>) -> vec3<u32> {
    let wg = wg_index(wid);
    let rows = select(pv.rows, Q6_ROWS, Q6_ROWS != 0u);
    if (pv.xmode == 7u) {
        vxn[0] = vaux[0];
    }
    return vec3<u32>(wg % rows, q6s_slot(wg / rows));
}

// Block b's matrix slot and its block within that matrix's (gemv_q6s, gemv_q6w; uniform).
fn q6s_slot(b: u32) -> vec2<u32> {
    if (Q6_NM > 3u && b >= Q6_S3) {
        return vec2<u32>(3u, b - Q6_S3);
    } else if (Q6_NM > 2u && b >= Q6_S2) {
        return vec2<u32>(2u, b - Q6_S2);
    } else if (Q6_NM > 1u && b >= Q6_S1) {
        return vec2<u32>(1u, b - Q6_S1);
    }
    return vec2<u32>(0u, b);
}

// gemv_q6w (`LILY_WGPU_Q6W`, opt-in until measured): gemv_q6s with x quantized in each
// workgroup instead of by a q2x_stage launch before it (91 launches of ~4.8 µs a 4K decode
// step on the H100, stop 42's trace). Each workgroup issues its first step's code words,
// scales and biases, then stages the whole row of x into workgroup memory (q6_wx) in the
// layouts its matrices read (xq.wgsl's: Q6W_L4 the 4-bit one at 0, Q6W_L8 the 8-bit one after
// it), so x's load, quantization and the one barrier run while those loads are in flight;
// the steps then read x from workgroup memory, not L1/L2. x = h (Q6W_XMODE 0) or h · w
// (1: the rms norm's weights at binding 20, vr) quantized without the norm's 1 / rms, which
// does not change a word's codes (a word's d is its max |x| / 127): the dots are scaled by it
// at the end, summed from each 32-element word's sum of squares in order (q6_rn's sum of
// StagedRn's partials); the first workgroup writes the normed row (Q6W_XN). With Q6W_EXPORT the launch's first workgroup also writes the staging
// to binding 22 in stage_ahead_scratch's layout (both word layouts, then the words' sums of
// squares), for the MoE block's gate|up (moe_xq.wgsl MY_RN). Rows of x ≤ 4,096 elements, one
// row (Q6_ROWS 1); gemv_q6s's output modes but the shared expert's gated residual (2: binding
// 20) and the folds (4-6: binding 22). The CPU twin: cpu/matmul.rs `matmul` after `rms_norm`,
// as gemv_q6's (Q2X_TOL).
override Q6W_XMODE: u32 = 1u;
override Q6W_L4: bool = true;
override Q6W_L8: bool = false;
override Q6W_EXPORT: bool = false;
// xmode 1: the first workgroup writes the normed row to binding 19 (vxn; not with the conv
// epilogue, whose state is there).
override Q6W_XN: bool = false;
// x's words (5 · 4,096 / 32 vec4s for a 4-bit row of 4,096; 3 · 2,048 / 16 + 5 · 2,048 / 32
// for both layouts of 2,048) and each 32 elements' sum of squares.
var<workgroup> q6_wx: array<vec4<u32>, 768>;
var<workgroup> q6_wss: array<vec4<f32>, 32>;

// Word at x's u32 index `at` of the exported staging (binding 22).
fn q6w_put(at: u32, v: u32) {
    atomicStore(&vacc[at], v);
}

// Thread i's words of x (w, from q2x_words on its elements 8i .. 8i + 7) and its 4-bit word's
// sum of squares s4 into the exported staging (binding 22, stage_ahead_scratch's layout: both
// word layouts, then the words' sums of squares).
fn q6w_export(i: u32, w: Q2xW, s4: f32, inp: u32) {
    let w4 = inp / 32u;
    let w8 = inp / 16u;
    let e8 = 5u * w4;
    let u = i / 4u;
    let j = i % 4u;
    let v = 2u * u + j / 2u;
    let p = 2u * (j % 2u);
    q6w_put(4u * u + j, w.w4.x);
    q6w_put(4u * (w4 + u) + j, w.w4.y);
    q6w_put(4u * (2u * w4 + u) + j, w.w4.z);
    q6w_put(4u * (3u * w4 + u) + j, w.w4.w);
    q6w_put(4u * (e8 + v) + p, w.w8.x);
    q6w_put(4u * (e8 + v) + p + 1u, w.w8.y);
    q6w_put(4u * (e8 + w8 + v) + p, w.w8.z);
    q6w_put(4u * (e8 + w8 + v) + p + 1u, w.w8.w);
    for (var k = 0u; k < 4u; k++) {
        if (j == 0u) {
            q6w_put(4u * (4u * w4 + u) + k, w.m4[k]);
        }
        if (p == 0u) {
            q6w_put(4u * (e8 + 2u * w8 + v) + k, w.m8[k]);
        }
    }
    if (j == 0u) {
        q6w_put(4u * (e8 + 3u * w8) + u, bitcast<u32>(s4));
    }
}

// Row t of x staged into q6_wx as the header says (every invocation calls it: the shuffles and
// the barrier), with the first workgroup's export (`first`); returns the norm's 1 / rms
// (Q6W_XMODE 1, else 1). Thread i takes elements 8i .. 8i + 7 as q2x_stage does (xq_put's
// places), a word's four threads consecutive lanes.
fn q6w_stage(t: u32, li: u32, lane_sg: u32, inp: u32, first: bool) -> f32 {
    let w4 = inp / 32u;
    let w8 = inp / 16u;
    let b8 = select(0u, 5u * w4, Q6W_L4);
    let xrow = t * (inp / 4u);
    for (var i0 = 0u; i0 < inp / 8u; i0 += 256u) {
        let i = i0 + li;
        let on = i < inp / 8u;
        var xl = vec4<f32>(0.0);
        var xh = vec4<f32>(0.0);
        var ss = 0.0;
        if (on) {
            xl = vx[xrow + 2u * i];
            xh = vx[xrow + 2u * i + 1u];
            if (Q6W_XMODE == 1u) {
                ss = dot(xl, xl) + dot(xh, xh);
                let e = 8u * i;
                xl = xl * vec4<f32>(vr[e], vr[e + 1u], vr[e + 2u], vr[e + 3u]);
                xh = xh * vec4<f32>(vr[e + 4u], vr[e + 5u], vr[e + 6u], vr[e + 7u]);
            }
        }
        let w = q2x_words(xl, xh);
        // The 4-bit word's sum of squares over its four threads.
        let s2 = ss + subgroupShuffleXor(ss, 1u);
        let s4 = s2 + subgroupShuffleXor(s2, 2u);
        if (on) {
            let u = i / 4u;
            let j = i % 4u;
            let v = 2u * u + j / 2u;
            let p = 2u * (j % 2u);
            if (Q6W_L4) {
                q6_wx[u][j] = w.w4.x;
                q6_wx[w4 + u][j] = w.w4.y;
                q6_wx[2u * w4 + u][j] = w.w4.z;
                q6_wx[3u * w4 + u][j] = w.w4.w;
                if (j == 0u) {
                    q6_wx[4u * w4 + u] = w.m4;
                }
            }
            if (Q6W_L8) {
                q6_wx[b8 + v][p] = w.w8.x;
                q6_wx[b8 + v][p + 1u] = w.w8.y;
                q6_wx[b8 + w8 + v][p] = w.w8.z;
                q6_wx[b8 + w8 + v][p + 1u] = w.w8.w;
                if (p == 0u) {
                    q6_wx[b8 + 2u * w8 + v] = w.m8;
                }
            }
            if (j == 0u) {
                q6_wss[u / 4u][u % 4u] = s4;
            }
            if (Q6W_EXPORT && first) {
                q6w_export(i, w, s4, inp);
            }
        }
    }
    workgroupBarrier();
    if (Q6W_XMODE != 1u) {
        return 1.0;
    }
    // Every word's, in order (q6_rn's order where inp is a multiple of 128; rows of 32k + 64
    // elements too, which a vec4 loop would cut short).
    var s = 0.0;
    for (var j = 0u; j < inp / 32u; j++) {
        s += q6_wss[j / 4u][j % 4u];
    }
    let rn = 1.0 / sqrt(s / f32(inp) + pv.eps);
    if (Q6W_XN && first) {
        for (var v = li; v < inp / 4u; v += 256u) {
            let e = 4u * v;
            vxn[xrow + v] = vx[xrow + v] * rn * vec4<f32>(vr[e], vr[e + 1u], vr[e + 2u], vr[e + 3u]);
        }
    }
    return rn;
}

// A step's code words (l, from q6w_load) against x's word c in q6_wx: q6_dot's products.
fn q6w_mul(l: Q6L, bits: u32, R: u32, c: u32, inp: u32) -> vec4<f32> {
    let w4 = inp / 32u;
    var xa1: vec4<u32>;
    var xb1 = vec4<u32>(0u);
    var xa2: vec4<u32>;
    var xb2 = vec4<u32>(0u);
    var xm: vec4<u32>;
    if (bits == 4u) {
        xa1 = q6_wx[c];
        xb1 = q6_wx[w4 + c];
        xa2 = q6_wx[2u * w4 + c];
        xb2 = q6_wx[3u * w4 + c];
        xm = q6_wx[4u * w4 + c];
    } else {
        let x8 = select(0u, 5u * w4, Q6W_L4);
        let w8 = inp / 16u;
        xa1 = q6_wx[x8 + c];
        xa2 = q6_wx[x8 + w8 + c];
        xm = q6_wx[x8 + 2u * w8 + c];
    }
    let dd = bitcast<f32>(xm.x);
    let sx = bitcast<f32>(xm.y);
    let corr = bitcast<i32>(xm.z);
    var d = vec4<f32>(f32(g5_dot(l.q0, bits, xa1, xb1, xa2, xb2) + corr), 0.0, 0.0, 0.0);
    if (R > 1u) {
        d.y = f32(g5_dot(l.q1, bits, xa1, xb1, xa2, xb2) + corr);
    }
    if (R > 2u) {
        d.z = f32(g5_dot(l.q2, bits, xa1, xb1, xa2, xb2) + corr);
        d.w = f32(g5_dot(l.q3, bits, xa1, xb1, xa2, xb2) + corr);
    }
    return l.s * (dd * d) + l.b * sx;
}

// A step's loads of a team's rows (q6w_load).
struct Q6L {
    q0: vec4<u32>,
    q1: vec4<u32>,
    q2: vec4<u32>,
    q3: vec4<u32>,
    s: vec4<f32>,
    b: vec4<f32>,
}

@compute @workgroup_size(256)
fn gemv_q6w(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_invocation_id) lane_sg: u32,
) {
    let a = q6s_at(wid);
    let t = a.x;
    let s = a.yz;
    let first = wg_index(wid) == 0u;
    switch s.x {
        case 0u: { q6w_run0(s.y, t, li, lane_sg, first); }
        case 1u: { q6w_run1(s.y, t, li, lane_sg, first); }
        case 2u: { q6w_run2(s.y, t, li, lane_sg, first); }
        default: { q6w_run3(s.y, t, li, lane_sg, first); }
    }
}

// gemv_rt (`LILY_WGPU_ROUTER`, the default since stop 48: 1.018× at 4K on the H100 with one
// row a workgroup, RT_R 1; `q6w` the ablation; matmul.rs `rt_rows`): the MoE
// router's launch (gemv_q6w's launch shapes with 8-bit matrices only, x = rms_norm(h) · w, one
// row, outputs stored) with x read in f32 and not staged. Why: gemv_q6w stages and quantizes
// the whole row of x in every workgroup (x and the norm's weights from L2, q2x_words, a
// barrier, the 1 / rms summed from 64 word sums in order) before its first dot, and the
// router's rows are 2 KB each: 4.6 µs for 0.56 MB in the lab on the H100, 1.6× its pure read
// (CUDA's router with its top-k: 3.7). Here a workgroup owns RT_R rows of the launch's matrices (slot
// after slot, ceil(out / RT_R) workgroups each) and thread i elements 8i .. 8i + 7 of x, as
// q6w_stage's threads: h and the norm's weights loaded once, x = h · w, the thread's partial
// dot of each row (8 codes: s · Σ q·x + b · Σ x) and its Σ h², summed over the workgroup by
// subgroupAdd then the subgroups' partials in workgroup memory (one barrier; subgroups in order,
// any width), scaled by the 1 / rms. What gemv_q6w's first workgroup alone wrote is spread over
// the first RT_EXPORT_WGS workgroups (fewer where the launch has fewer): with Q6W_EXPORT each
// quantizes x (q2x_words of the same x, q6w_export: the same bits) and writes its contiguous
// share of the threads' words; the others never quantize. With Q6W_XN thread i's xn vec4s are
// written by workgroup i mod the launch's (no extra work). The logits
// differ from gemv_q6w's (x not quantized: closer to the CPU's f32 matmul, F32_TOL-scale
// against f64 in moe_step's q6w_router test) and from q6_rn's 1 / rms by the order of Σ h².
// Measured (H100, stop 48): the lab's router 4.57 µs with RT_R 2 against gemv_q6w's 4.59;
// in a step one row a workgroup (257 workgroups at the full preset) is what pays, 1.018× at
// 4K, against 1.003× with two. Launch: Σ ceil(out / RT_R) workgroups of 256.
override RT_R: u32 = 1u;
// The workgroups that export gate|up's staging, a share each (a few: the staging's work is
// done once, not in each of the launch's 257 workgroups, nor all in the first).
const RT_EXPORT_WGS: u32 = 8u;
var<workgroup> rt_red: array<vec4<f32>, 64>;

// Matrix slot m's rows.
fn rt_out(m: u32) -> u32 {
    switch m {
        case 0u: { return Q6_OUT0; }
        case 1u: { return Q6_OUT1; }
        case 2u: { return Q6_OUT2; }
        default: { return Q6_OUT3; }
    }
}

// Matrix slot m's workgroups in gemv_rt.
fn rt_blocks(m: u32) -> u32 {
    return select(0u, (rt_out(m) + RT_R - 1u) / RT_R, m < Q6_NM);
}

@compute @workgroup_size(256)
fn gemv_rt(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_invocation_id) lane_sg: u32,
    @builtin(subgroup_size) sgs: u32,
) {
    // q6s_at keeps gemv_q6w's bindings in this entry's layout (the same bind group).
    let keep = q6s_at(wid);
    let wg = wg_index(wid);
    let nwg = rt_blocks(0u) + rt_blocks(1u) + rt_blocks(2u) + rt_blocks(3u);
    var mi = 0u;
    var b = wg;
    for (var k = 0u; k < 3u; k++) {
        if (mi == k && b >= rt_blocks(k) && k + 1u < Q6_NM) {
            b -= rt_blocks(k);
            mi = k + 1u;
        }
    }
    let outs = rt_out(mi);
    let inp = Q6_INP0;
    // The exporting workgroups (uniform) and each one's share of x's threads.
    let ne = min(RT_EXPORT_WGS, nwg);
    let share = (inp / 8u + ne - 1u) / ne;
    // Rows in .x, .y, .z (RT_R ≤ 3), Σ h² in .w.
    var acc = vec4<f32>(0.0);
    for (var i0 = 0u; i0 < inp / 8u; i0 += 256u) {
        let i = i0 + li;
        let on = i < inp / 8u;
        var hl = vec4<f32>(0.0);
        var hh = vec4<f32>(0.0);
        var xl = vec4<f32>(0.0);
        var xh = vec4<f32>(0.0);
        if (on) {
            hl = vx[2u * i];
            hh = vx[2u * i + 1u];
            let e = 8u * i;
            xl = hl * vec4<f32>(vr[e], vr[e + 1u], vr[e + 2u], vr[e + 3u]);
            xh = hh * vec4<f32>(vr[e + 4u], vr[e + 5u], vr[e + 6u], vr[e + 7u]);
        }
        let ss = dot(hl, hl) + dot(hh, hh);
        acc.w += ss;
        if (on) {
            for (var r = 0u; r < RT_R; r++) {
                let o = b * RT_R + r;
                if (o < outs) {
                    var d = 0.0;
                    switch mi {
                        case 0u: { d = rt_dot0(o, i, xl, xh); }
                        case 1u: { d = rt_dot1(o, i, xl, xh); }
                        case 2u: { d = rt_dot2(o, i, xl, xh); }
                        default: { d = rt_dot3(o, i, xl, xh); }
                    }
                    acc[r] += d;
                }
            }
        }
        if (Q6W_EXPORT && wg < ne) {
            let w = q2x_words(xl, xh);
            let s2 = ss + subgroupShuffleXor(ss, 1u);
            let s4 = s2 + subgroupShuffleXor(s2, 2u);
            if (on && i / share == wg) {
                q6w_export(i, w, s4, inp);
            }
        }
    }
    let part = subgroupAdd(acc);
    if (lane_sg == 0u) {
        rt_red[li / sgs] = part;
    }
    workgroupBarrier();
    var t = vec4<f32>(0.0);
    for (var k = 0u; k < 256u / sgs; k++) {
        t += rt_red[k];
    }
    let rn = 1.0 / sqrt(t.w / f32(inp) + pv.eps);
    if (li < RT_R && b * RT_R + li < outs) {
        sg_out_m(mi, keep.x, b * RT_R + li, t[li] * rn, Q6_OMODE);
    }
    if (Q6W_XN) {
        for (var i = li; i < inp / 8u; i += 256u) {
            if (i % nwg == wg) {
                for (var v = 2u * i; v < 2u * i + 2u; v++) {
                    let e = 4u * v;
                    vxn[v] = vx[v] * rn * vec4<f32>(vr[e], vr[e + 1u], vr[e + 2u], vr[e + 3u]);
                }
            }
        }
    }
}
