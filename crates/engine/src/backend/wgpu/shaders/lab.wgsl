// lab.wgsl: the reference kernels of `lily lab --backend wgpu` (backend/wgpu/lab.rs); no model op
// and no CPU twin: they measure the adapter.
//
// lab_touch: one workgroup of 64: dst[i] += 1. Back to back on one buffer, each dispatch waits for
//   the last through it (wgpu puts a barrier between writes): the cost of a dependent dispatch
//   with next to no work, the floor under every op of a decode step. Bindings: 1 src (unused),
//   2 dst (rw).
// lab_read: a pure streaming read of n 16-byte words: each invocation loads 4 words 256 apart
//   (all 4 issued before they are used), xor-folds them, and writes only if the fold equals a
//   word the parameters make impossible (so the loads stay). ceil(n / 1024) workgroups of 256:
//   what reading the bytes of a kernel costs, with the same launch around it.

struct LP {
    n: u32,
    never: u32,
    pad0: u32,
    pad1: u32,
}

@group(0) @binding(0) var<uniform> lp: LP;
@group(0) @binding(1) var<storage, read> lsrc: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> ldst: array<u32>;

@compute @workgroup_size(64)
fn lab_touch(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    // lp.n = 1; src is bound but read only when pad1 says (never): every dispatch binds both.
    var v = lp.n;
    if (lp.pad1 == 1u) {
        v += lsrc[0].x;
    }
    ldst[li] += v;
}

@compute @workgroup_size(256)
fn lab_read(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let base = wg_index(wid) * 1024u + li;
    var a = vec4<u32>(0u);
    var b = vec4<u32>(0u);
    var c = vec4<u32>(0u);
    var d = vec4<u32>(0u);
    if (base + 768u < lp.n) {
        a = lsrc[base];
        b = lsrc[base + 256u];
        c = lsrc[base + 512u];
        d = lsrc[base + 768u];
    } else {
        for (var k = 0u; k < 4u; k++) {
            if (base + 256u * k < lp.n) {
                a ^= lsrc[base + 256u * k];
            }
        }
    }
    let f = (a ^ b) ^ (c ^ d);
    if ((f.x ^ f.y ^ f.z ^ f.w) == lp.never && lp.pad0 == 1u) {
        ldst[li] = f.x;
    }
}
