// attn_combine_x.wgsl: attn_combine4_x, attn_combine4 with o_proj's x staged in its epilogue
// (attention.rs `ATTN_X_SHADER`: appended to attention.wgsl, q2x.wgsl, q2x_sg.wgsl and xq.wgsl
// in a module made only on adapters with ordered subgroups of ≥ 4 lanes). The CPU twin: cpu's
// attn_decode then matmul_q's x, the staging's error Q2X_TOL's.
//
// `LILY_WGPU_XQ_AHEAD` 1 or next (Backend::attn_decode_qk_add): c4_merge writes the head's output as
// attn_combine4 does, then the workgroup stages it as q2x_stage would stage that row of o
// (xq.wgsl xq_put, the same words bit for bit): thread i < hd / 8 takes elements 8i .. 8i + 7
// of the head (one 4-bit word every 4 threads), so o_proj's gemv_q6 reads it and no q2x_stage
// runs before it. Head size a multiple of 32 up to 256. Bindings: attn_combine4's (1 part,
// 2 gate, 3 out), 4 the staged x (xq.wgsl's qq; `AD_NH · hd` inputs in its layouts).

@compute @workgroup_size(256)
fn attn_combine4_x(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let f = wg_index(wid);
    let o = c4_merge(f, li);
    workgroupBarrier();
    c4_a[li] = o;
    workgroupBarrier();
    let hd = ad_hd();
    let n = ad_nh() * hd;
    let on = li < hd / 8u;
    let xl = c4_a[2u * (li % 64u)];
    let xh = c4_a[2u * (li % 64u) + 1u];
    // Every thread reaches the shuffles (those past the head's bring copies, write nothing).
    xq_put(f * (hd / 8u) + li, on, xl, xh, 0u, n / 32u, 5u * (n / 32u), n / 16u);
}

// attn_combine4q_x (`LILY_WGPU_ATTN_CQ`, the default, with the staging): attn_combine4q's quarter of the
// head, then its words staged as attn_combine4_x stages the whole head's: thread i < 8 takes
// elements 8i .. 8i + 7 of the quarter (a quarter is 64 dims, whole 32-element words; a head's
// last one 32 where hd % 64 is 32).
@compute @workgroup_size(256)
fn attn_combine4q_x(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let w = wg_index(wid);
    let f = w / c4q_quarters();
    let qt = w % c4q_quarters();
    let o = c4q_merge(f, qt, li);
    workgroupBarrier();
    c4_a[li] = o;
    workgroupBarrier();
    let hd = ad_hd();
    let n = ad_nh() * hd;
    let nv = min(16u, hd / 4u - 16u * qt);
    let on = li < nv / 2u;
    let xl = c4_a[2u * (li % 8u)];
    let xh = c4_a[2u * (li % 8u) + 1u];
    // Every thread reaches the shuffles (those past the quarter's bring copies, write nothing).
    xq_put(f * (hd / 8u) + 8u * qt + li, on, xl, xh, 0u, n / 32u, 5u * (n / 32u), n / 16u);
}
