// norm.wgsl: the norms and small elementwise ops (cpu/norm.rs), all f32.
// rms_norm:      out[t] = x[t] · rsqrt(mean(x[t]²) + eps) · w; one workgroup of 256 a row, the
//                sum of squares by a tree in workgroup memory. Bindings: 1 x, 2 w, 3 out.
// add_rms_norm:  h[t] += r[t], then rms_norm of h[t] into out. Bindings: 1 h, 2 r, 3 w, 4 out.
// add:           h[i] += r[i]. Bindings: 1 h, 2 r. ceil(len / 256) workgroups.
// swiglu:        out[i] = silu(g[i]) · u[i]. Bindings: 1 g, 2 u, 3 out.
// add_sigmoid_gated: y[t, i] += sigmoid(s[t]) · shared[t, i]. Bindings: 1 y, 2 shared, 3 s.
// Each entry has its own binding names: an entry point's layout holds only what it uses.

struct P {
    n: u32,
    dim: u32,
    eps: f32,
    pad: u32,
}

@group(0) @binding(0) var<uniform> p: P;

@group(0) @binding(1) var<storage, read> rn_x: array<f32>;
@group(0) @binding(2) var<storage, read> rn_w: array<f32>;
@group(0) @binding(3) var<storage, read_write> rn_out: array<f32>;

@compute @workgroup_size(256)
fn rms_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let base = wg_index(wid) * p.dim;
    var ss = 0.0;
    for (var i = li; i < p.dim; i += 256u) {
        let v = rn_x[base + i];
        ss += v * v;
    }
    let r = 1.0 / sqrt(wg_sum(ss, li) / f32(p.dim) + p.eps);
    for (var i = li; i < p.dim; i += 256u) {
        rn_out[base + i] = rn_x[base + i] * r * rn_w[i];
    }
}

@group(0) @binding(1) var<storage, read_write> arn_h: array<f32>;
@group(0) @binding(2) var<storage, read> arn_r: array<f32>;
@group(0) @binding(3) var<storage, read> arn_w: array<f32>;
@group(0) @binding(4) var<storage, read_write> arn_out: array<f32>;

@compute @workgroup_size(256)
fn add_rms_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let base = wg_index(wid) * p.dim;
    var ss = 0.0;
    for (var i = li; i < p.dim; i += 256u) {
        let v = arn_h[base + i] + arn_r[base + i];
        arn_h[base + i] = v;
        ss += v * v;
    }
    let r = 1.0 / sqrt(wg_sum(ss, li) / f32(p.dim) + p.eps);
    for (var i = li; i < p.dim; i += 256u) {
        arn_out[base + i] = arn_h[base + i] * r * arn_w[i];
    }
}

@group(0) @binding(1) var<storage, read_write> add_h: array<f32>;
@group(0) @binding(2) var<storage, read> add_r: array<f32>;

@compute @workgroup_size(256)
fn add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = wg_index(wid) * 256u + li;
    if (i < p.n) {
        add_h[i] += add_r[i];
    }
}

@group(0) @binding(1) var<storage, read> sw_g: array<f32>;
@group(0) @binding(2) var<storage, read> sw_u: array<f32>;
@group(0) @binding(3) var<storage, read_write> sw_out: array<f32>;

@compute @workgroup_size(256)
fn swiglu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = wg_index(wid) * 256u + li;
    if (i < p.n) {
        sw_out[i] = silu_f(sw_g[i]) * sw_u[i];
    }
}

@group(0) @binding(1) var<storage, read_write> asg_y: array<f32>;
@group(0) @binding(2) var<storage, read> asg_sh: array<f32>;
@group(0) @binding(3) var<storage, read> asg_s: array<f32>;

@compute @workgroup_size(256)
fn add_sigmoid_gated(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = wg_index(wid) * 256u + li;
    if (i < p.n) {
        asg_y[i] += sigmoid_f(asg_s[i / p.dim]) * asg_sh[i];
    }
}
