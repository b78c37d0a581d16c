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
// lab_chain_init: dst[j · s] = ((j + 1) · s) mod n for j < n / s (n = lp.n words, s = lp.pad0
//   words): a chain through the first n words at a stride of s. 64 a workgroup, ceil(n / s / 64)
//   workgroups. Bindings: 1 src (unused), 2 dst = the chain (rw).
// lab_chase: one invocation follows the chain lp.pad0 loads from word 0 (each load's address
//   the last load's value: the latency of one load, address translation included, at the chain's
//   stride and footprint) and writes where it ended to dst[0]. One workgroup of 1. Bindings: 1
//   src = the chain (as vec4s), 2 dst.

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

// lab_touch22: lab_touch with the 22 storage bindings of a decode GEMV's bind group (bindings
//   3-22 read only when pad1 says: never), to see whether a dispatch's cost grows with the
//   descriptors it binds.
@group(0) @binding(3) var<storage, read> lb3: array<u32>;
@group(0) @binding(4) var<storage, read> lb4: array<u32>;
@group(0) @binding(5) var<storage, read> lb5: array<u32>;
@group(0) @binding(6) var<storage, read> lb6: array<u32>;
@group(0) @binding(7) var<storage, read> lb7: array<u32>;
@group(0) @binding(8) var<storage, read> lb8: array<u32>;
@group(0) @binding(9) var<storage, read> lb9: array<u32>;
@group(0) @binding(10) var<storage, read> lb10: array<u32>;
@group(0) @binding(11) var<storage, read> lb11: array<u32>;
@group(0) @binding(12) var<storage, read> lb12: array<u32>;
@group(0) @binding(13) var<storage, read> lb13: array<u32>;
@group(0) @binding(14) var<storage, read> lb14: array<u32>;
@group(0) @binding(15) var<storage, read> lb15: array<u32>;
@group(0) @binding(16) var<storage, read> lb16: array<u32>;
@group(0) @binding(17) var<storage, read> lb17: array<u32>;
@group(0) @binding(18) var<storage, read> lb18: array<u32>;
@group(0) @binding(19) var<storage, read> lb19: array<u32>;
@group(0) @binding(20) var<storage, read> lb20: array<u32>;
@group(0) @binding(21) var<storage, read> lb21: array<u32>;
@group(0) @binding(22) var<storage, read> lb22: array<u32>;

@compute @workgroup_size(64)
fn lab_touch22(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    var v = lp.n;
    if (lp.pad1 == 1u) {
        v += lsrc[0].x + lb3[0] + lb4[0] + lb5[0] + lb6[0] + lb7[0] + lb8[0] + lb9[0] + lb10[0] + lb11[0] + lb12[0] + lb13[0] + lb14[0] + lb15[0] + lb16[0] + lb17[0] + lb18[0] + lb19[0] + lb20[0] + lb21[0] + lb22[0];
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

@compute @workgroup_size(64)
fn lab_chain_init(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let j = wg_index(wid) * 64u + li;
    let st = lp.pad0;
    if (j < lp.n / st) {
        ldst[j * st] = ((j + 1u) * st) % lp.n;
    }
    if (lp.pad1 == 1u) {
        ldst[0] += lsrc[0].x;
    }
}

@compute @workgroup_size(1)
fn lab_chase() {
    var i = 0u;
    for (var k = 0u; k < lp.pad0; k++) {
        i = lsrc[i / 4u][i % 4u];
    }
    ldst[0] = i;
}
