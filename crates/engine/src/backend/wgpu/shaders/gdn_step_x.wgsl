// gdn_step_x.wgsl: a decode token's gated delta rule, its gated norm and out_proj's x staged for
// gemv_q6, in one launch (gdn.rs `gated_delta_x`; the CPU twin: cpu/gdn.rs `gated_delta` then
// cpu/matmul.rs's x of out_proj, the staging's error Q2X_TOL's). Appended to common.wgsl,
// q2x.wgsl, xq.wgsl, gdn.wgsl and gdn_step.wgsl (with its shuffle row sums) in the subgroup
// module: it shares gs_step and xq.wgsl's `xq_put` (so its staged words are q2x_stage's, bit for
// bit given the same x), and needs ordered subgroups of ≥ 8 lanes.
//
// A workgroup of 256 a value head h (Hv workgroups; gdn_step.wgsl's header says why a head
// and not a split): gs_step with 4 rows a thread (Dv ≤ 128), the head's y to workgroup memory,
// then the gated norm as gdn.wgsl gdn_norm / xq.wgsl xmode 3 compute it, in xmode 3's order:
// r = 1 / sqrt(Σ y² / Dv + eps) with the head's vec4 sums of squares added in order, x = y · r ·
// w · silu(z). Threads 0 .. Dv / 8 - 1 then stage elements 8li .. 8li + 7 of the head as
// q2x_stage's thread 16h + li would (Dv a multiple of 32: a head holds whole 4-bit words), into
// row 0 of the staged x (base 0; 8-bit words at 5 · w4). z and w are loaded at the start, beside
// the state: they do not depend on it.
// Bindings: gdn_step.wgsl's, binding 4 being xq.wgsl's qq; 8 z (vec4), 9 the norm's weights (vec4).

@group(0) @binding(8) var<storage, read> gs_z: array<vec4<f32>>;
@group(0) @binding(9) var<storage, read> gs_nw: array<vec4<f32>>;

var<workgroup> gs_ys: array<f32, 128>; // the head's y
var<workgroup> gs_ss: array<f32, 32>; // its vec4s' sums of squares

@compute @workgroup_size(256)
fn gdn_step_x(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wg_index(wid);
    let dv4 = gc_dv() / 4u;
    // The staging threads' z and norm weights, before the recurrence's loads are used.
    let st = li < gc_dv() / 8u;
    var zl = vec4<f32>(0.0);
    var zh = vec4<f32>(0.0);
    var wl = vec4<f32>(0.0);
    var wh = vec4<f32>(0.0);
    if (st) {
        zl = gs_z[h * dv4 + 2u * li];
        zh = gs_z[h * dv4 + 2u * li + 1u];
        wl = gs_nw[2u * li];
        wh = gs_nw[2u * li + 1u];
    }
    let y = gs_step(h, li, GS_NR);
    if (li % 8u == 0u) {
        for (var i = 0u; i < GS_NR; i++) {
            let r = li / 8u + 32u * i;
            if (r < gc_dv()) {
                gs_ys[r] = y[i];
            }
        }
    }
    workgroupBarrier();
    var yl = vec4<f32>(0.0);
    var yh = vec4<f32>(0.0);
    if (st) {
        yl = vec4<f32>(gs_ys[8u * li], gs_ys[8u * li + 1u], gs_ys[8u * li + 2u], gs_ys[8u * li + 3u]);
        yh = vec4<f32>(gs_ys[8u * li + 4u], gs_ys[8u * li + 5u], gs_ys[8u * li + 6u], gs_ys[8u * li + 7u]);
        gs_ss[2u * li] = dot(yl, yl);
        gs_ss[2u * li + 1u] = dot(yh, yh);
    }
    workgroupBarrier();
    var ss = 0.0;
    for (var j = 0u; j < dv4; j++) {
        ss += gs_ss[j];
    }
    let rn = 1.0 / sqrt(ss / f32(gc_dv()) + gs.eps);
    // xq.wgsl xq_x's mode 3: (y · r · w) · silu(z), element by element.
    let xl4 = yl * rn * wl;
    let xh4 = yh * rn * wh;
    let xl = vec4<f32>(xl4.x * silu_f(zl.x), xl4.y * silu_f(zl.y), xl4.z * silu_f(zl.z), xl4.w * silu_f(zl.w));
    let xh = vec4<f32>(xh4.x * silu_f(zh.x), xh4.y * silu_f(zh.y), xh4.z * silu_f(zh.z), xh4.w * silu_f(zh.w));
    // Every thread reaches the shuffles (those past the head's 16 bring zeros, write nothing):
    // the 4 threads of a word are lanes li ^ 1, li ^ 2 of one subgroup.
    xq_put(h * (gc_dv() / 8u) + li, st, xl, xh, 0u, gc_w4(), 5u * gc_w4(), gc_w8());
}

// gdn_step_xs (`LILY_WGPU_GDN_STEP=xs`, the default since stop 41; gdn.rs `gated_delta_x` with `split`):
// gdn_step_y's split (a workgroup owns 32 value rows of a head: Hv · Dv / 32 workgroups, 16 KB
// of state each instead of gdn_step_x's 64 on 32 workgroups) with gdn_step_x's epilogue, its
// gated norm deferred. The head's 1 / rms needs Σ y² over the head's rows, which Dv / 32
// workgroups hold (4 at Dv = 128), so each stages its 32 rows of x' = (y · w) · silu(z) as one
// 4-bit word (two 8-bit) without it (q2x's words are linear in x: matmul_sg.wgsl omode 5's
// header has the why) and writes its Σ y² (rows in order) after the staged row, at u32 wg;
// out_proj's gemv_q6s (Q6_RNG = Dv) takes each head's 1 / rms from its Dv / 32 sums and scales
// that head's words. Dv a multiple of 32 up to 128.
@compute @workgroup_size(256)
fn gdn_step_xs(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let wg = wg_index(wid);
    let h = wg / gc_slices();
    let r0 = (wg % gc_slices()) * 32u;
    // The staging threads' z and norm weights (8 rows each), before the recurrence's loads are
    // used.
    let st = li < 4u;
    var zl = vec4<f32>(0.0);
    var zh = vec4<f32>(0.0);
    var wl = vec4<f32>(0.0);
    var wh = vec4<f32>(0.0);
    if (st) {
        let e = (h * gc_dv() + r0) / 4u + 2u * li;
        zl = gs_z[e];
        zh = gs_z[e + 1u];
        wl = gs_nw[r0 / 4u + 2u * li];
        wh = gs_nw[r0 / 4u + 2u * li + 1u];
    }
    let y = gs_step(wg, li, 1u);
    if (li % 8u == 0u) {
        gs_ys[li / 8u] = y.x;
    }
    workgroupBarrier();
    let q4 = li % 4u;
    let yl = vec4<f32>(gs_ys[8u * q4], gs_ys[8u * q4 + 1u], gs_ys[8u * q4 + 2u], gs_ys[8u * q4 + 3u]);
    let yh = vec4<f32>(gs_ys[8u * q4 + 4u], gs_ys[8u * q4 + 5u], gs_ys[8u * q4 + 6u], gs_ys[8u * q4 + 7u]);
    let xl4 = yl * wl;
    let xh4 = yh * wh;
    let xl = vec4<f32>(xl4.x * silu_f(zl.x), xl4.y * silu_f(zl.y), xl4.z * silu_f(zl.z), xl4.w * silu_f(zl.w));
    let xh = vec4<f32>(xh4.x * silu_f(zh.x), xh4.y * silu_f(zh.y), xh4.z * silu_f(zh.z), xh4.w * silu_f(zh.w));
    // Every thread reaches the shuffles; the first 4 hold the workgroup's word.
    xq_put((h * gc_dv() + r0) / 8u + li, st, xl, xh, 0u, gc_w4(), 5u * gc_w4(), gc_w8());
    if (li == 0u) {
        var ss = 0.0;
        for (var i = 0u; i < 32u; i++) {
            ss += gs_ys[i] * gs_ys[i];
        }
        qq[5u * gc_w4() + 3u * gc_w8() + wg / 4u][wg % 4u] = bitcast<u32>(ss);
    }
}
