// common.wgsl: helpers every shader file of the wgpu backend is prefixed with (device.rs
// concatenates them): bf16 unpacking and the flat workgroup index of a dispatch whose x count
// was folded into y (Ctx::dispatch: at most 65,535 workgroups a dimension).
// Subgroups are not assumed (lavapipe's are 8 lanes wide, Apple's and NVIDIA's 32): reductions
// go through workgroup memory, except in the files that use subgroup operations (matmul_sg.wgsl),
// made only on adapters that have them (wgpu's SUBGROUP feature: naga 30 takes no `enable`) and
// each with a fallback.

// A matrix's shape and format (quant.wgsl): outputs, inputs, bits a code (32: dense f32), group
// size, whether scales and biases are bf16 pairs.
struct QMat {
    out: u32,
    inp: u32,
    bits: u32,
    gs: u32,
    sb16: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

fn bf16_lo(w: u32) -> f32 { return bitcast<f32>(w << 16u); }
fn bf16_hi(w: u32) -> f32 { return bitcast<f32>(w & 0xffff0000u); }

// A quantized matrix's scale or bias of group i: the word holding it (bf16 pairs when sb16, else
// f32 words), then its value from that word. Every reader of scales shares the two.
fn sb_idx(i: u32, sb16: u32) -> u32 {
    return select(i, i >> 1u, sb16 != 0u);
}

fn sb_val(w: u32, i: u32, sb16: u32) -> f32 {
    if (sb16 == 0u) {
        return bitcast<f32>(w);
    }
    return select(bf16_lo(w), bf16_hi(w), (i & 1u) == 1u);
}

// Workgroup index of a dispatch of n workgroups folded as (65535, ceil(n / 65535)).
fn wg_index(wid: vec3<u32>) -> u32 { return wid.y * 65535u + wid.x; }

// The sum of every invocation's v over a workgroup of 256 (all call it: uniform control flow),
// by a tree in workgroup memory.
var<workgroup> wg_red: array<f32, 256>;

fn wg_sum(v: f32, li: u32) -> f32 {
    wg_red[li] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (li < s) {
            wg_red[li] += wg_red[li + s];
        }
        workgroupBarrier();
    }
    let t = wg_red[0];
    workgroupBarrier();
    return t;
}

fn sigmoid_f(x: f32) -> f32 { return 1.0 / (1.0 + exp(-x)); }
fn silu_f(x: f32) -> f32 { return x * sigmoid_f(x); }
