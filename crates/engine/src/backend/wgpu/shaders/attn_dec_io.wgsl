// attn_dec_io.wgsl: attn_dec_team's bindings and hooks where q comes normed and rotated
// (attention.rs DEC_SG_SHADER / _H: prefixed to attn_dec_sg.wgsl). attn_dec_rope.wgsl is the
// other choice, with the same names. Bindings: 0 P, 1 q [heads, hd] (vec4 view), 2 kc, 3 vc
// (read), 4 step, 5 part.

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> td_q: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> td_kc: array<KV4>;
@group(0) @binding(3) var<storage, read> td_vc: array<KV4>;
@group(0) @binding(4) var<storage, read> td_step: array<u32>;
@group(0) @binding(5) var<storage, read_write> td_part: array<vec4<f32>>;

// The row at pos is already in the cache (kv_append_step or qk_rope_append_step).
fn td_append(kvh: u32, holds: bool, li: u32, sg: u32, pos: u32) {}

// Lane li % 32's words t and t + 32 of query head `head` (zero past hd / 4).
fn td_head_q(head: u32, first: bool, li: u32, sg: u32, pos: u32) -> array<vec4<f32>, 2> {
    let hd4 = ad_hd() / 4u;
    let t = li % 32u;
    var q = array<vec4<f32>, 2>(vec4<f32>(0.0), vec4<f32>(0.0));
    if (t < hd4) {
        q[0] = td_q[head * hd4 + t];
    }
    if (t + 32u < hd4) {
        q[1] = td_q[head * hd4 + t + 32u];
    }
    return q;
}
