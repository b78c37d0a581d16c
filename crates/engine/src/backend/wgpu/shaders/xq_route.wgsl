// xq_route.wgsl: q2x_stage_ahead, the MoE block's router after a projection that folded it
// (Backend::route_ahead; matmul_sg.wgsl's gemv_q6 omode 4 has the why and the sums' format).
// Appended to xq.wgsl in matmul.rs's XQ_SHADER only. One workgroup, one row (a decode step):
// q2x_stage's staging of x = rms_norm(h) · w (xmode 1, the normed row written to xn), then, with
// the norm's 1 / rms, the logits = rn · the sums (the router's E rows; row E the shared gate's
// logit, to qs[0]), and the sums left at zero for the next projection. The twin of the pair
// (gemv_q6 omode 4 + this) is Backend::moe_router's x, logits and shared logit; the route stays
// in the experts' gate|up launch (moe_step_add's logits). The logits differ from the router's in
// where x is rounded (q2x's two int8 levels there; none here): tests/wgpu/moe_step.rs states it.

@group(0) @binding(6) var<storage, read_write> qacc: array<atomic<u32>>;
@group(0) @binding(7) var<storage, read_write> qlog: array<f32>;
@group(0) @binding(8) var<storage, read_write> qs: array<f32>;

@compute @workgroup_size(256)
fn q2x_stage_ahead(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32,
                   @builtin(subgroup_size) sg_size: u32, @builtin(subgroup_invocation_id) lane: u32) {
    let rn = xq_stage(wid, li, sg_size, lane);
    for (var e = li; e <= xp.ne; e += 256u) {
        // matmul_sg.wgsl fold_add's words: positive (i, m, l), negative (i, m, l). Each triple's
        // l and m carried up in integers first, then the difference of the two taken part by
        // part, so each part is exact in f32 and the value is rounded once.
        var p: array<u32, 6>;
        for (var j = 0u; j < 6u; j++) {
            p[j] = atomicLoad(&qacc[6u * e + j]);
            atomicStore(&qacc[6u * e + j], 0u);
        }
        let pm = p[1] + (p[2] >> 16u);
        let nm = p[4] + (p[5] >> 16u);
        let di = bitcast<i32>((p[0] + (pm >> 16u)) - (p[3] + (nm >> 16u)));
        let dm = i32(pm & 0xffffu) - i32(nm & 0xffffu);
        let dl = i32(p[2] & 0xffffu) - i32(p[5] & 0xffffu);
        let v = (f32(di) + f32(dm) * (1.0 / 65536.0) + f32(dl) * (1.0 / 4294967296.0)) * rn;
        if (e < xp.ne) {
            qlog[e] = v;
        } else {
            qs[0] = v;
        }
    }
}
