// gdn.wgsl: the Gated DeltaNet layer's two ops (cpu/gdn.rs), all f32. Prefill and decode share the
// entries (rows = 1 for a step). C = conv channels = q (Hk·Dk) | k (Hk·Dk) | v (Hv·Dv).
//
// conv1d (cpu/gdn.rs `conv1d`): causal depthwise conv, kernel K, no bias, then SiLU:
//   out[t, ch] = silu(Σ_tap w[ch, tap] · in[t + tap, ch]), in = state (K-1 rows) ++ x (rows rows);
//   then state = the last K-1 rows of in. x, out [rows, C]; w [C, K]; state [K-1, C].
//   An invocation owns one channel over a block of `rb` (≥ K-1) rows; only the block at row 0
//   reads the old state (row t reads state rows t..K-2), so that invocation alone rewrites its
//   channel of the state, after its outputs, shifting in place in increasing j (it reads row
//   rows + j ≥ j). Workgroups of 256 channels: ceil(C / 256) · ceil(rows / rb).
//   Bindings: 1 x, 2 w, 3 state (rw), 4 out (rw).
//
// gdn_recur (cpu/gdn.rs `gated_delta`, the recurrence): per token t and value head h (key head
//   kh = h / (Hv / Hk)): q = l2norm(q_kh) / sqrt(Dk), k = l2norm(k_kh), β = sigmoid(b[t, h]),
//   g = exp(-exp(a_log[h]) · softplus(a[t, h] + dt_bias[h])); for each value row r of the head's
//   state S [Dv, Dk]: s ← g·s; δ = (v_r − s·k)·β; s ← s + δ·k; y_r = s·q. y goes to out (before
//   its norm). qkv [rows, C]; b, a [rows, Hv]; a_log, dt_bias [Hv]; state [Hv, Dv, Dk];
//   out [rows, Hv·Dv].
//   A workgroup of 256 owns 32 value rows of one head (ceil(Dv / 32) slices a head, Hv · slices
//   workgroups): 8 invocations a row, invocation `part` holding the row's elements
//   c = 8j + part (j < 16, so Dk ≤ 128) in private memory across all the tokens; the state is read
//   once and written back once. Per token the workgroup loads q and k of its key head into
//   workgroup memory (l2 norms by a tree there), and the 8 partial dot products of a row are summed
//   in workgroup memory in part order: the CPU's 8-lane sums (lane = c mod 8) in its order.
//   Bindings: 1 qkv, 2 b, 3 a, 4 a_log, 5 dt_bias, 6 state (rw), 7 out (rw).
//   The fallback: where the adapter has subgroups, gdn_sg.wgsl's kernels run instead (gdn.rs).
//   A decode step takes gdn_step.wgsl's kernels (gdn.rs; LILY_WGPU_GDN_STEP=0: this one).
//
// gdn_prep (the per-token work of the recurrence that does not depend on the state, done once
//   for all tokens in parallel before gdn_sg.wgsl's scan, so that its sequential loop is only the
//   state's arithmetic): q = l2norm(q) / sqrt(Dk), k = l2norm(k) of every key head, β and g of
//   every value head. A workgroup of 256 a token; 8 invocations a vector (q or k of a key head),
//   each summing the squares of elements c = 8j + part, the 8 sums added in part order (the
//   CPU sums all Dk in one chain: the norms differ from it by rounding only).
//   pre (f32): [rows, Hk, Dk / 2] of (k[2i], k[2i+1], q[2i], q[2i+1]) (one 16-byte load a column
//   pair in the scan), then at 2 · rows · Hk · Dk: [rows, Hv] of (β, g, -, -). Dk even.
//   Bindings: 1 qkv, 2 b, 3 a, 4 a_log, 5 dt_bias, 6 pre (rw). rows workgroups.
//
// gdn_norm (cpu/gdn.rs `gated_delta`, the gated norm): out[t, h] = rms_norm(y[t, h]) · norm ·
//   silu(z[t, h]) per value head, y read from and written to out in place. A workgroup of 256 a
//   (token, head), the sum of squares by a tree in workgroup memory; rows · Hv workgroups.
//   Bindings: 1 z, 2 norm, 3 out (rw).

struct P {
    rows: u32,
    c: u32,
    kern: u32,
    hist: u32,
    hk: u32,
    hv: u32,
    dk: u32,
    dv: u32,
    eps: f32,
    qscale: f32,
    rb: u32,
    pad: u32,
}

@group(0) @binding(0) var<uniform> p: P;

// ---- conv1d

@group(0) @binding(1) var<storage, read> cv_x: array<f32>;
@group(0) @binding(2) var<storage, read> cv_w: array<f32>;
@group(0) @binding(3) var<storage, read_write> cv_state: array<f32>;
@group(0) @binding(4) var<storage, read_write> cv_out: array<f32>;

// Row j of state ++ x, channel ch.
fn conv_in(j: u32, ch: u32) -> f32 {
    if (j < p.hist) {
        return cv_state[j * p.c + ch];
    }
    return cv_x[(j - p.hist) * p.c + ch];
}

@compute @workgroup_size(256)
fn conv1d(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let cblocks = (p.c + 255u) / 256u;
    let wg = wg_index(wid);
    let ch = (wg % cblocks) * 256u + li;
    let t0 = (wg / cblocks) * p.rb;
    if (ch >= p.c) {
        return;
    }
    let t1 = min(t0 + p.rb, p.rows);
    for (var t = t0; t < t1; t++) {
        var acc = 0.0;
        for (var tap = 0u; tap < p.kern; tap++) {
            acc += cv_w[ch * p.kern + tap] * conv_in(t + tap, ch);
        }
        cv_out[t * p.c + ch] = silu_f(acc);
    }
    if (t0 == 0u) {
        for (var j = 0u; j < p.hist; j++) {
            cv_state[j * p.c + ch] = conv_in(p.rows + j, ch);
        }
    }
}

// ---- gdn_recur

const PARTS: u32 = 8u; // invocations a state row
const ROWS: u32 = 32u; // state rows a workgroup (256 / PARTS)
const MAXE: u32 = 16u; // elements an invocation holds: Dk ≤ PARTS · MAXE = 128

@group(0) @binding(1) var<storage, read> gd_qkv: array<f32>;
@group(0) @binding(2) var<storage, read> gd_b: array<f32>;
@group(0) @binding(3) var<storage, read> gd_a: array<f32>;
@group(0) @binding(4) var<storage, read> gd_alog: array<f32>;
@group(0) @binding(5) var<storage, read> gd_dtb: array<f32>;
@group(0) @binding(6) var<storage, read_write> gd_state: array<f32>;
@group(0) @binding(7) var<storage, read_write> gd_out: array<f32>;

var<workgroup> ssq: array<f32, 256>; // squares of q (0..128) and k (128..256), then their sums
var<workgroup> qk: array<f32, 256>; // normed, scaled q at 0, normed k at 128
var<workgroup> pk: array<f32, 256>; // partial s·k, PARTS a row
var<workgroup> py: array<f32, 256>; // partial s·q

// log(1 + e^x) as the CPU's `x.exp().ln_1p()`: log1p by Goldberg's correction, so that a small
// e^x keeps its relative precision.
fn softplus_g(x: f32) -> f32 {
    if (x > 20.0) {
        return x;
    }
    let u = exp(x);
    let w = 1.0 + u;
    if (w == 1.0) {
        return u;
    }
    return log(w) * (u / (w - 1.0));
}

@compute @workgroup_size(256)
fn gdn_recur(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let slices = (p.dv + ROWS - 1u) / ROWS;
    let wg = wg_index(wid);
    let h = wg / slices;
    let r = (wg % slices) * ROWS + li / PARTS;
    let part = li % PARTS;
    let g0 = li - part; // the row's first invocation
    let kh = h / (p.hv / p.hk);
    let live = r < p.dv;
    let base = (h * p.dv + r) * p.dk;
    var s: array<f32, 16>;
    for (var j = 0u; j < MAXE; j++) {
        let c = j * PARTS + part;
        var v = 0.0;
        if (live && c < p.dk) {
            v = gd_state[base + c];
        }
        s[j] = v;
    }
    let decay_rate = exp(gd_alog[h]);
    let dtb = gd_dtb[h];
    let hl = li & 127u; // element of q (li < 128) or k
    let is_k = li >= 128u;
    let src = select(0u, p.hk * p.dk, is_k) + kh * p.dk + hl;
    let vsrc = 2u * p.hk * p.dk + h * p.dv + r;
    for (var t = 0u; t < p.rows; t++) {
        let row = t * p.c;
        // q and k of the key head, l2-normed (q scaled by 1/sqrt(Dk)).
        var x = 0.0;
        if (hl < p.dk) {
            x = gd_qkv[row + src];
        }
        ssq[li] = x * x;
        workgroupBarrier();
        for (var m = 64u; m > 0u; m >>= 1u) {
            if (hl < m) {
                ssq[li] += ssq[li + m];
            }
            workgroupBarrier();
        }
        let scale = select(p.qscale, 1.0, is_k);
        qk[li] = x * (scale / sqrt(ssq[li & 128u] + 1e-6));
        workgroupBarrier();
        let beta = sigmoid_f(gd_b[t * p.hv + h]);
        let g = exp(-decay_rate * softplus_g(gd_a[t * p.hv + h] + dtb));
        // s ← g·s; s·k
        var acc = 0.0;
        for (var j = 0u; j < MAXE; j++) {
            let c = j * PARTS + part;
            if (c < p.dk) {
                s[j] *= g;
                acc += s[j] * qk[128u + c];
            }
        }
        pk[li] = acc;
        workgroupBarrier();
        var kv = 0.0;
        for (var i = 0u; i < PARTS; i++) {
            kv += pk[g0 + i];
        }
        var vr = 0.0;
        if (live) {
            vr = gd_qkv[row + vsrc];
        }
        let delta = (vr - kv) * beta;
        // s ← s + δ·k; y = s·q
        acc = 0.0;
        for (var j = 0u; j < MAXE; j++) {
            let c = j * PARTS + part;
            if (c < p.dk) {
                s[j] += delta * qk[128u + c];
                acc += s[j] * qk[c];
            }
        }
        py[li] = acc;
        workgroupBarrier();
        if (live && part == 0u) {
            var y = 0.0;
            for (var i = 0u; i < PARTS; i++) {
                y += py[g0 + i];
            }
            gd_out[t * p.hv * p.dv + h * p.dv + r] = y;
        }
    }
    for (var j = 0u; j < MAXE; j++) {
        let c = j * PARTS + part;
        if (live && c < p.dk) {
            gd_state[base + c] = s[j];
        }
    }
}

// ---- gdn_prep

// β = sigmoid(b), g = exp(-exp(a_log) · softplus(a + dt_bias)) of token t, value head h: the
// CPU's expressions (gdn_recur computes the same inline, exp(a_log) hoisted).
fn gd_gates(t: u32, h: u32) -> vec2<f32> {
    let beta = sigmoid_f(gd_b[t * p.hv + h]);
    let g = exp(-exp(gd_alog[h]) * softplus_g(gd_a[t * p.hv + h] + gd_dtb[h]));
    return vec2<f32>(beta, g);
}

@group(0) @binding(6) var<storage, read_write> gp_pre: array<f32>;

@compute @workgroup_size(256)
fn gdn_prep(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wg_index(wid);
    let part = li % PARTS;
    let g0 = li - part;
    let nvec = 2u * p.hk; // q of key head i at vector i, k at Hk + i: qkv offset i · Dk
    for (var it = 0u; it < (nvec + 31u) / 32u; it++) {
        let vi = it * 32u + li / PARTS;
        let live = vi < nvec;
        let src = t * p.c + vi * p.dk;
        var acc = 0.0;
        for (var j = 0u; j < MAXE; j++) {
            let c = j * PARTS + part;
            if (live && c < p.dk) {
                let x = gd_qkv[src + c];
                acc += x * x;
            }
        }
        ssq[li] = acc;
        workgroupBarrier();
        var ss = 0.0;
        for (var i = 0u; i < PARTS; i++) {
            ss += ssq[g0 + i];
        }
        workgroupBarrier(); // the next vectors overwrite ssq
        let is_k = vi >= p.hk;
        let kh = select(vi, vi - p.hk, is_k);
        let r = select(p.qscale, 1.0, is_k) / sqrt(ss + 1e-6);
        // (k, k', q, q') of column pair c / 2: see the layout in the header.
        let dst = 2u * ((t * p.hk + kh) * p.dk) + select(2u, 0u, is_k);
        for (var j = 0u; j < MAXE; j++) {
            let c = j * PARTS + part;
            if (live && c < p.dk) {
                gp_pre[dst + 2u * (c & ~1u) + (c & 1u)] = gd_qkv[src + c] * r;
            }
        }
    }
    let gates = 2u * p.rows * p.hk * p.dk + 4u * t * p.hv;
    for (var h = li; h < p.hv; h += 256u) {
        let bg = gd_gates(t, h);
        gp_pre[gates + 4u * h] = bg.x;
        gp_pre[gates + 4u * h + 1u] = bg.y;
    }
}

// ---- gdn_norm

@group(0) @binding(1) var<storage, read> gn_z: array<f32>;
@group(0) @binding(2) var<storage, read> gn_w: array<f32>;
@group(0) @binding(3) var<storage, read_write> gn_out: array<f32>;

// The workgroup's sum of v (every invocation calls it; uniform control flow).
fn gn_sum(v: f32, li: u32) -> f32 {
    ssq[li] = v;
    workgroupBarrier();
    for (var m = 128u; m > 0u; m >>= 1u) {
        if (li < m) {
            ssq[li] += ssq[li + m];
        }
        workgroupBarrier();
    }
    let t = ssq[0];
    workgroupBarrier();
    return t;
}

@compute @workgroup_size(256)
fn gdn_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let base = wg_index(wid) * p.dv; // (t · Hv + h) · Dv
    var ss = 0.0;
    for (var i = li; i < p.dv; i += 256u) {
        let v = gn_out[base + i];
        ss += v * v;
    }
    let r = 1.0 / sqrt(gn_sum(ss, li) / f32(p.dv) + p.eps);
    for (var i = li; i < p.dv; i += 256u) {
        gn_out[base + i] = gn_out[base + i] * r * gn_w[i] * silu_f(gn_z[base + i]);
    }
}
