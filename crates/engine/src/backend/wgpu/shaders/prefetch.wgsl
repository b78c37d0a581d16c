// prefetch.wgsl: prefetch_w, a decode step's next weights read into the L2 cache while the
// kernel before them runs (device.rs `Ctx::prefetch_hint`, placed by `end_record`). No model
// op and no CPU twin: it changes no value (the test `prefetch_keeps_the_step` holds a replayed
// step with it bit-equal to one without), only where the weights are when their GEMV reads them.
//
// Why: Vulkan has no programmatic dependent launch, so a GEMV's first weight loads start only
// after the barrier on its input, and the small GEMVs (router 0.56 MB, out_proj 4.7 MB) are
// mostly that latency (stop 35: a GEMV launch costs ~4 µs less in place when its weights are in
// L2). A dispatch that reads only never-written weights and writes only a sink of its own needs
// no barrier after the kernel before it, so the GPU runs the two together; the GEMV's barrier
// then waits for both.
//
// Bindings: 1-12 up to twelve weight buffers (read; a launch's unused ones are spare buffers),
// 13 its own sink (written only if the xor of the loads equals a word the parameters make
// impossible, so the loads stay). Parameters: the first workgroup of buffer i (start[i]) and the
// 16-byte words of buffer i (n16[i]). Launch: 256 invocations, each 4 words 256 apart issued
// before they are used (lab_read's pattern), 1,024 words a workgroup; buffer i takes
// ceil(n16[i] / 1024) workgroups from start[i].

struct PP {
    start: array<vec4<u32>, 3>,
    n16: array<vec4<u32>, 3>,
    bufs: u32,
    never: u32,
    pad0: u32,
    pad1: u32,
}

@group(0) @binding(0) var<uniform> pp: PP;
@group(0) @binding(1) var<storage, read> pw0: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> pw1: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> pw2: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> pw3: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read> pw4: array<vec4<u32>>;
@group(0) @binding(6) var<storage, read> pw5: array<vec4<u32>>;
@group(0) @binding(7) var<storage, read> pw6: array<vec4<u32>>;
@group(0) @binding(8) var<storage, read> pw7: array<vec4<u32>>;
@group(0) @binding(9) var<storage, read> pw8: array<vec4<u32>>;
@group(0) @binding(10) var<storage, read> pw9: array<vec4<u32>>;
@group(0) @binding(11) var<storage, read> pw10: array<vec4<u32>>;
@group(0) @binding(12) var<storage, read> pw11: array<vec4<u32>>;
@group(0) @binding(13) var<storage, read_write> psink: array<u32>;

// Word j of buffer b (b < 12).
fn pf_word(b: u32, j: u32) -> vec4<u32> {
    switch b {
        case 0u: { return pw0[j]; }
        case 1u: { return pw1[j]; }
        case 2u: { return pw2[j]; }
        case 3u: { return pw3[j]; }
        case 4u: { return pw4[j]; }
        case 5u: { return pw5[j]; }
        case 6u: { return pw6[j]; }
        case 7u: { return pw7[j]; }
        case 8u: { return pw8[j]; }
        case 9u: { return pw9[j]; }
        case 10u: { return pw10[j]; }
        default: { return pw11[j]; }
    }
}

@compute @workgroup_size(256)
fn prefetch_w(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let wg = wg_index(wid);
    // The buffer this workgroup reads: the last whose first workgroup is at or before it.
    var b = 0u;
    for (var i = 1u; i < pp.bufs; i++) {
        if (pp.start[i / 4u][i % 4u] <= wg) {
            b = i;
        }
    }
    let n = pp.n16[b / 4u][b % 4u];
    let base = (wg - pp.start[b / 4u][b % 4u]) * 1024u + li;
    var f = vec4<u32>(0u);
    if (base + 768u < n) {
        let a0 = pf_word(b, base);
        let a1 = pf_word(b, base + 256u);
        let a2 = pf_word(b, base + 512u);
        let a3 = pf_word(b, base + 768u);
        f = (a0 ^ a1) ^ (a2 ^ a3);
    } else {
        for (var k = 0u; k < 4u; k++) {
            if (base + 256u * k < n) {
                f ^= pf_word(b, base + 256u * k);
            }
        }
    }
    if ((f.x ^ f.y ^ f.z ^ f.w) == pp.never && pp.pad0 == 1u) {
        psink[li] = f.x;
    }
}
