// gdn_sg.wgsl: the gated delta rule's recurrence with subgroup shuffles (cpu/gdn.rs
// `gated_delta`, the recurrence; gdn.wgsl's header has the math and the layouts). Appended to
// common.wgsl and gdn.wgsl in a module of its own (gdn.rs `SHADER_SG`), so it shares their
// parameter block `P`, bindings 1-5 and 7 and `softplus_g`; built only where the adapter has
// SUBGROUP with subgroups of at least SG_PARTS lanes (gdn_recur is the fallback).
//
// Why: gdn_recur syncs its workgroup of 256 about a dozen times a token (q and k norms by a tree,
//   the row sums in workgroup memory) and fills only Hv · Dv / 32 workgroups; each token waits for
//   its loads. Here a row's invocations are SG_PARTS = 4 lanes of one subgroup: no workgroup
//   memory, no barrier, every workgroup independent (Hv · Dv / 16 workgroups of 64).
//
// gdn_scan_sg (prefill: inputs from gdn_prep) and gdn_step_sg (decode, and blocks too short to
//   pay for gdn_prep's launch: q/k norms and the gates inline, from qkv, b and a). Both run the
//   same loop; a workgroup of 64 owns SG_ROWS = 16 value rows of one head (ceil(Dv / 16) slices,
//   Hv · slices workgroups). Lane `part` of a row (0..3, an aligned group of 4 subgroup lanes)
//   holds the column pairs i = 4j + part (j < 16: Dk ≤ 128, Dk even), columns 8j + 2·part + {0, 1}
//   as a vec2: exactly the CPU's SIMD lanes 2·part and 2·part + 1 (lane = column mod 8), each
//   summed in increasing j as the CPU does. The 8 lane sums are gathered by 4 shuffles and added
//   in the CPU's lane order, so s·k and s·q are the CPU's sums term for term (when Dk is a
//   multiple of 8; the CPU adds a tail after its lanes otherwise): what differs from the CPU is
//   q and k (their norms' sums in another order: an ulp or so), the exps, and FMA contraction
//   where the driver fuses, as in gdn_recur (the op tests' F32_TOL holds with 4x to spare).
//   Every lane of a row ends with the same sums, so δ needs no broadcast.
//   Per token, the state's dependency chain is: s ← g·s (independent), 16 chained FMAs per lane
//   (two chains a vec2) for s·k, 4 shuffles and 7 adds, δ = (v − s·k)·β, then s ← s + δ·k, which
//   the next token's first FMA needs. y = s·q (16 more FMAs, 4 shuffles, 7 adds) is off the
//   chain: the next token can start before it is written. The next token's inputs (k and q as
//   16 vec4 loads, v, β and g) are loaded before the current token's arithmetic: they do not
//   depend on the state, so their latency hides behind one token's work.
//   Why 4 lanes a row: keeping the CPU's order, s·k is a chain of 16 FMAs (one CPU lane's terms)
//   whatever the lane count. 4 lanes a row make 512 warps of 32 for Hv · Dv = 4096 rows, about
//   one a scheduler on the H200 (132 SMs × 4), each ~185 issue slots a token (128 FP32 ops,
//   16 loads, 16 shuffles, 14 adds) against a chain of ~130 cycles; 8 lanes a row would run two
//   warps a scheduler with twice the shuffles and scalar loads (~250 slots a token), 2 lanes
//   a row leave half the schedulers idle. Registers: ~180 a lane (the state's 32, this and the
//   next token's q and k, 64 each).
//   Bindings: 1 qkv, 2 b, 3 a, 4 a_log, 5 dt_bias, 6 state (rw, as vec2), 7 out (rw),
//   8 pre (gdn_prep's output, as vec4; a spare buffer for gdn_step_sg).

const SG_PARTS: u32 = 4u; // lanes a state row
const SG_ROWS: u32 = 16u; // state rows a workgroup (64 / SG_PARTS)
const SG_PAIRS: u32 = 16u; // column pairs a lane holds: Dk ≤ 2 · SG_PARTS · SG_PAIRS = 128

@group(0) @binding(6) var<storage, read_write> sg_state: array<vec2<f32>>;
@group(0) @binding(8) var<storage, read> sg_pre: array<vec4<f32>>;

// One token's inputs for one lane: kq[j] = (k, k', q, q') of column pair 4j + part (normed, q
// scaled, zero past Dk); v of the lane's row; bg = (β, g), or the raw (b, a) in the fused form.
struct SgTok {
    kq: array<vec4<f32>, 16>,
    v: f32,
    bg: vec2<f32>,
}

// The CPU's lane-ordered sum of a row's 8 SIMD lanes: lane 2i + e is component e of the row's
// lane i's pair `x` (the subgroup lanes g0..g0+3).
fn sg_row_sum(x: vec2<f32>, g0: u32) -> f32 {
    let a0 = subgroupShuffle(x, g0);
    let a1 = subgroupShuffle(x, g0 + 1u);
    let a2 = subgroupShuffle(x, g0 + 2u);
    let a3 = subgroupShuffle(x, g0 + 3u);
    return ((((((a0.x + a0.y) + a1.x) + a1.y) + a2.x) + a2.y) + a3.x) + a3.y;
}

// Token t's inputs. `fused`: raw q and k from qkv and raw (b, a); else gdn_prep's output.
fn sg_load(t: u32, h: u32, kh: u32, r: u32, part: u32, live: bool, fused: bool) -> SgTok {
    var tok: SgTok;
    let npairs = p.dk / 2u;
    if (fused) {
        let qsrc = t * p.c + kh * p.dk;
        let ksrc = qsrc + p.hk * p.dk;
        for (var j = 0u; j < SG_PAIRS; j++) {
            let i = j * SG_PARTS + part;
            var x = vec4<f32>(0.0);
            if (i < npairs) {
                let c = 2u * i;
                x = vec4<f32>(gd_qkv[ksrc + c], gd_qkv[ksrc + c + 1u], gd_qkv[qsrc + c], gd_qkv[qsrc + c + 1u]);
            }
            tok.kq[j] = x;
        }
        tok.bg = vec2<f32>(gd_b[t * p.hv + h], gd_a[t * p.hv + h]);
    } else {
        let src = (t * p.hk + kh) * npairs;
        for (var j = 0u; j < SG_PAIRS; j++) {
            let i = j * SG_PARTS + part;
            var x = vec4<f32>(0.0);
            if (i < npairs) {
                x = sg_pre[src + i];
            }
            tok.kq[j] = x;
        }
        tok.bg = sg_pre[p.rows * p.hk * npairs + t * p.hv + h].xy;
    }
    tok.v = 0.0;
    if (live) {
        tok.v = gd_qkv[t * p.c + 2u * p.hk * p.dk + h * p.dv + r];
    }
    return tok;
}

fn sg_scan(wg: u32, sg_id: u32, sg_size: u32, lane: u32, fused: bool) {
    // The row from the subgroup's numbering (not the local index): a row's 4 lanes are an
    // aligned group of its subgroup whatever the subgroup width (≥ 4) and its mapping.
    let part = lane % SG_PARTS;
    let g0 = lane - part;
    let slices = (p.dv + SG_ROWS - 1u) / SG_ROWS;
    let h = wg / slices;
    let r = (wg % slices) * SG_ROWS + (sg_id * sg_size + lane) / SG_PARTS;
    let kh = h / (p.hv / p.hk);
    let live = r < p.dv;
    let npairs = p.dk / 2u;
    let base = (h * p.dv + r) * npairs;
    var s: array<vec2<f32>, 16>;
    for (var j = 0u; j < SG_PAIRS; j++) {
        let i = j * SG_PARTS + part;
        var x = vec2<f32>(0.0);
        if (live && i < npairs) {
            x = sg_state[base + i];
        }
        s[j] = x;
    }
    let decay_rate = exp(gd_alog[h]);
    let dtb = gd_dtb[h];
    var nxt = sg_load(0u, h, kh, r, part, live, fused);
    for (var t = 0u; t < p.rows; t++) {
        var cur = nxt;
        // The next token's loads, issued before this token's arithmetic (a repeat of the last
        // token at the end, so that the loop has no branch).
        nxt = sg_load(min(t + 1u, p.rows - 1u), h, kh, r, part, live, fused);
        var beta = cur.bg.x;
        var g = cur.bg.y;
        if (fused) {
            // l2 norms of q and k over the row's 4 lanes (each lane holds every 4th pair).
            var ss = vec2<f32>(0.0); // (k, q)
            for (var j = 0u; j < SG_PAIRS; j++) {
                let x = cur.kq[j];
                ss += vec2<f32>(dot(x.xy, x.xy), dot(x.zw, x.zw));
            }
            ss += subgroupShuffleXor(ss, 1u);
            ss += subgroupShuffleXor(ss, 2u);
            let rk = 1.0 / sqrt(ss.x + 1e-6);
            let rq = p.qscale / sqrt(ss.y + 1e-6);
            for (var j = 0u; j < SG_PAIRS; j++) {
                cur.kq[j] *= vec4<f32>(rk, rk, rq, rq);
            }
            beta = sigmoid_f(cur.bg.x);
            g = exp(-decay_rate * softplus_g(cur.bg.y + dtb));
        }
        // s ← g·s; s·k
        var acc = vec2<f32>(0.0);
        for (var j = 0u; j < SG_PAIRS; j++) {
            s[j] *= g;
            acc += s[j] * cur.kq[j].xy;
        }
        let delta = (cur.v - sg_row_sum(acc, g0)) * beta;
        // s ← s + δ·k; y = s·q
        acc = vec2<f32>(0.0);
        for (var j = 0u; j < SG_PAIRS; j++) {
            s[j] += delta * cur.kq[j].xy;
            acc += s[j] * cur.kq[j].zw;
        }
        let y = sg_row_sum(acc, g0);
        if (live && part == 0u) {
            gd_out[t * p.hv * p.dv + h * p.dv + r] = y;
        }
    }
    for (var j = 0u; j < SG_PAIRS; j++) {
        let i = j * SG_PARTS + part;
        if (live && i < npairs) {
            sg_state[base + i] = s[j];
        }
    }
}

@compute @workgroup_size(64)
fn gdn_scan_sg(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(subgroup_id) sg_id: u32,
    @builtin(subgroup_size) sg_size: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    sg_scan(wg_index(wid), sg_id, sg_size, lane, false);
}

@compute @workgroup_size(64)
fn gdn_step_sg(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(subgroup_id) sg_id: u32,
    @builtin(subgroup_size) sg_size: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    sg_scan(wg_index(wid), sg_id, sg_size, lane, true);
}
