// attn_dec_rope.wgsl: attn_dec_team with the q/k norms, RoPE and the cache append folded in
// (`LILY_WGPU_ATTN_ROPE=1`; attention.rs DEC_ROPE_SHADER / _H, prefixed to attn_dec_sg.wgsl
// after rope.wgsl). The same names as attn_dec_io.wgsl. Matches cpu `attn_qk_norm_rope` (one row,
// at the step's pos) then `attention`'s append and row, as qk_rope_append_step + attn_dec_team
// do in two launches: this saves the first (one launch a layer, ten a token at the full preset).
//
// Why: qk_rope_append_step is a launch of 18 workgroups whose work is ~20 KB; on the H100's
// Vulkan driver a dependent launch costs ~2.3 µs however small (stop 44's lab floor), and the
// traced step charged it ~4.7 µs a layer.
//
// What each workgroup does (a KV head's split, attn_dec_team's launch):
// - td_head_q: team g norms and rotates its query head's q from qg in registers: lane t holds
//   words t and t + 32 (attn_dec_team's layout), the sum of squares over the team by exchanges
//   (td_xor1), the normed values through workgroup memory (td_r, a head's hd a team) for the
//   rotation's partner dims, the angle by rope.wgsl. Split 0's teams also copy their head's gate
//   (qg's second half) to `gate` for the combine.
// - td_append (only the split holding pos, a uniform choice): every team norms and rotates the KV
//   head's k the same way (the exchanges need all of them); team 0 writes the row pos of the K
//   cache, team 1 v's into the V cache (rounded by kv4_word as kv_append_step rounds), then
//   storageBarrier before the split's first K load reads the row back.
// The other splits never read row pos (each split's keys are its own range), so they need no
// ordering against the append.
// Order of sums: the sum of squares by a 5-exchange tree, not qk_norm_rope's workgroup tree:
// within F32_TOL of the CPU (the attention tests), not bit-equal to the two launches.
// Layouts: qg [heads, 2·hd] (q | gate a head), k, v [kv_heads · hd], q_norm, k_norm [hd], gate
//   [heads, hd], all in vec4 views (hd % 4 == 0).
// Parameters: attn_params.wgsl's P, then rot, eps and RoPE's turn table (attention.wgsl PR's
//   layout: pair i at turns[i / 2], components 2 (i % 2) and + 1).
// Bindings: 0 PT, 1 qg, 2 kc, 3 vc (read_write), 4 step, 5 part, 6 k, 7 v, 8 q_norm, 9 k_norm,
//   10 gate. Workgroup memory: td_r 8 KB.

struct PT {
    rows: u32,
    nh: u32,
    nkv: u32,
    hd: u32,
    pos0: u32,
    cap: u32,
    splits: u32,
    span: u32,
    scale: f32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
    rot: u32,
    eps: f32,
    pad3: u32,
    pad4: u32,
    turns: array<vec4<u32>, 64>,
}

@group(0) @binding(0) var<uniform> p: PT;
@group(0) @binding(1) var<storage, read> td_qg: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> td_kc: array<KV4>;
@group(0) @binding(3) var<storage, read_write> td_vc: array<KV4>;
@group(0) @binding(4) var<storage, read> td_step: array<u32>;
@group(0) @binding(5) var<storage, read_write> td_part: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read> td_k: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read> td_v: array<vec4<f32>>;
@group(0) @binding(8) var<storage, read> td_qn: array<vec4<f32>>;
@group(0) @binding(9) var<storage, read> td_kn: array<vec4<f32>>;
@group(0) @binding(10) var<storage, read_write> td_gate: array<vec4<f32>>;

// A team's normed row (hd ≤ 256: 64 vec4), read for the rotation's partners.
var<workgroup> td_r: array<vec4<f32>, 512>;

// Rotated element e of a row whose normed values are in td_r at `base` (a team's), `a` its own.
// attention.wgsl norm_rope_head's arithmetic: pair (i, i + rot/2), a · cos − b · sin at i,
// a · sin + b · cos at i + rot/2.
fn td_rot1(a: f32, e: u32, base: u32, pos: u32) -> f32 {
    if (e >= p.rot) {
        return a;
    }
    let half = p.rot / 2u;
    let i = e % half;
    let tv = p.turns[i / 2u];
    let cs = turn_cos_sin(pos, select(tv.xy, tv.zw, i % 2u == 1u));
    let pa = td_r[base + i / 4u][i % 4u];
    let pb = td_r[base + (i + half) / 4u][(i + half) % 4u];
    return select(pa * cs.y + pb * cs.x, pa * cs.x - pb * cs.y, e < half);
}

fn td_rot4(a: vec4<f32>, w: u32, base: u32, pos: u32) -> vec4<f32> {
    let e = 4u * w;
    return vec4<f32>(
        td_rot1(a.x, e, base, pos),
        td_rot1(a.y, e + 1u, base, pos),
        td_rot1(a.z, e + 2u, base, pos),
        td_rot1(a.w, e + 3u, base, pos)
    );
}

// Lane li % 32's words t, t + 32 of a head's row x (x0, x1; zero past hd / 4), rms-normed over
// the team, times the norm's weights (n0, n1), rotated at pos. Every invocation calls it (the
// exchanges and barriers).
fn td_norm_rope(x0: vec4<f32>, x1: vec4<f32>, n0: vec4<f32>, n1: vec4<f32>, li: u32, sg: u32, pos: u32) -> array<vec4<f32>, 2> {
    var ss = dot(x0, x0) + dot(x1, x1);
    ss += td_xor1(ss, 16u, li, sg);
    ss += td_xor1(ss, 8u, li, sg);
    ss += td_xor1(ss, 4u, li, sg);
    ss += td_xor1(ss, 2u, li, sg);
    ss += td_xor1(ss, 1u, li, sg);
    let r = 1.0 / sqrt(ss / f32(ad_hd()) + p.eps);
    let a0 = x0 * r * n0;
    let a1 = x1 * r * n1;
    let t = li % 32u;
    let base = (li / 32u) * 64u;
    td_r[base + t] = a0;
    td_r[base + t + 32u] = a1;
    workgroupBarrier();
    let o = array<vec4<f32>, 2>(td_rot4(a0, t, base, pos), td_rot4(a1, t + 32u, base, pos));
    // td_r is read again by the next call.
    workgroupBarrier();
    return o;
}

// Words t, t + 32 of a row at `src` (vec4s) of qg (`q`) or k, and of its norm's weights.
fn td_row(q: bool, src: u32, t: u32) -> array<vec4<f32>, 4> {
    let hd4 = ad_hd() / 4u;
    var r = array<vec4<f32>, 4>(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
    for (var i = 0u; i < 2u; i++) {
        let w = t + 32u * i;
        if (w < hd4) {
            if (q) {
                r[i] = td_qg[src + w];
                r[2u + i] = td_qn[w];
            } else {
                r[i] = td_k[src + w];
                r[2u + i] = td_kn[w];
            }
        }
    }
    return r;
}

// The split holding pos (`holds`, uniform): k normed, rotated and v into row pos of the caches.
fn td_append(kvh: u32, holds: bool, li: u32, sg: u32, pos: u32) {
    if (!holds || pos >= ad_cap()) {
        return;
    }
    let hd4 = ad_hd() / 4u;
    let t = li % 32u;
    let g = li / 32u;
    let src = kvh * hd4;
    let x = td_row(false, src, t);
    let kr = td_norm_rope(x[0], x[1], x[2], x[3], li, sg, pos);
    let row = pos * ad_nkv() * hd4 + src;
    if (g == 0u) {
        if (t < hd4) {
            td_kc[row + t] = kv4_word(kr[0]);
        }
        if (t + 32u < hd4) {
            td_kc[row + t + 32u] = kv4_word(kr[1]);
        }
    }
    if (g == 1u) {
        if (t < hd4) {
            td_vc[row + t] = kv4_word(td_v[src + t]);
        }
        if (t + 32u < hd4) {
            td_vc[row + t + 32u] = kv4_word(td_v[src + t + 32u]);
        }
    }
    storageBarrier();
}

// Query head `head`'s words t, t + 32, normed and rotated; `first` (split 0, a team of a head):
// the head's gate copied as well.
fn td_head_q(head: u32, first: bool, li: u32, sg: u32, pos: u32) -> array<vec4<f32>, 2> {
    let hd4 = ad_hd() / 4u;
    let t = li % 32u;
    let src = head * 2u * hd4;
    let x = td_row(true, src, t);
    if (first) {
        if (t < hd4) {
            td_gate[head * hd4 + t] = td_qg[src + hd4 + t];
        }
        if (t + 32u < hd4) {
            td_gate[head * hd4 + t + 32u] = td_qg[src + hd4 + t + 32u];
        }
    }
    return td_norm_rope(x[0], x[1], x[2], x[3], li, sg, pos);
}
