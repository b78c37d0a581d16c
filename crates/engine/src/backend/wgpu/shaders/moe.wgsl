// moe.wgsl: (to be written). The quantized-weight bindings quant.wgsl reads:
@group(0) @binding(1) var<storage, read> qw: array<u32>;
@group(0) @binding(2) var<storage, read> qs: array<u32>;
@group(0) @binding(3) var<storage, read> qb: array<u32>;
