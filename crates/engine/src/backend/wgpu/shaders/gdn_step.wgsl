// gdn_step.wgsl: one decode token's gated delta rule (cpu/gdn.rs `gated_delta` with rows = 1;
// gdn.wgsl's header has the maths), the state streamed once with every load issued up front.
// Two entries share `gs_step`:
// - gdn_step_y (gdn.rs `gated_delta_ex`, LILY_WGPU_GDN_STEP=y and the rows = 1 op): writes y
//   (before its norm) as gdn_recur does; gdn_norm or out_proj's q2x_stage (xq.wgsl xmode 3)
//   follows. Workgroups of 256 own 32 value rows of one head: Hv · ceil(Dv / 32) of them (128
//   at the model's shape, 16 KB of state in and out each).
// - gdn_step_x (gdn_step_x.wgsl, the subgroup module only; `gated_delta_x`, the default of a
//   decode step's GDN mixer): a workgroup owns a whole value head (Dv ≤ 128 rows, 4 a thread;
//   Hv = 32 workgroups, 64 KB in and out each), so that it can finish the head: the gated norm
//   and out_proj's x staged in q2x_stage's layouts (launch 4 of the old mixer gone).
//
// Layout: state [Hv, Dv, Dk] f32 read as vec4s (Dk a multiple of 4, ≤ 128); qkv [C] (q | k | v),
//   read as vec4s for q and k; b, a [Hv]; a_log, dt_bias [Hv].
// Threads: 8 a state row (`part` = li % 8), thread `part` holding the columns 4·part + 32m ..
//   4·part + 32m + 3 (m < 4) of each of its rows: one 16-byte load a row and m, 8 threads
//   covering 128 contiguous bytes of a row (whole lines). Rows of thread li: r0 + li / 8 + 32 i, i < nr (nr = 1 for gdn_step_y, 4
//   for gdn_step_x). Each row group of 8 threads holds all of q and k, so the l2 norms, s·k and
//   s·q are sums over the 8 threads of the group (`gs_rows`: shuffles 4, 2, 1 where the adapter
//   has ordered subgroups of ≥ 8 lanes, else workgroup memory; gdn.rs puts one or the other
//   before this file), the nr rows' sums side by side in a vec4. Every thread of a group ends with
//   the same bits (the butterfly adds the same two values on both lanes of each level), so δ needs
//   no broadcast and the 8 copies of a row stay one.
// Order: the CPU sums s·k and s·q in 8 SIMD lanes (lane = column mod 8) and q·q, k·k in one
//   chain; here a thread's 16 columns in 4 vec4 chains, then the group's tree. The results differ
//   from the CPU's by rounding only (F32_TOL in the op tests, as gdn_recur).
// The dependent chain: every load (the state, q, k, v, b, a, a_log, dt_bias) issued before any
//   use, so one memory latency; then 3 row sums (norms; s·k; s·q), each 3 shuffle levels; then
//   the stores. gdn_recur (its predecessor) synced its workgroup ~12 times and loaded v, b and a
//   after barriers, paying the latency again each time.
//
// Why a head a workgroup for gdn_step_x, not 4 workgroups of 32 rows and a combine: the gated
//   norm needs the head's Σ y² before any x of the head can be staged (a 4-bit word's scale is
//   the max over 32 of its x). WGSL has no clusters (CUDA's gdn_step shares the partial sums
//   through distributed shared memory) and no device-scope fence, so a split needs either a
//   launch for the combine (the launch we remove) or a "last workgroup of the head" counter whose
//   cross-workgroup visibility WGSL does not promise (Metal's threadgroup barriers are not device
//   fences). The price of the head a workgroup: 32 workgroups, one an SM, each streaming 64 KB in
//   and 64 KB out. All 64 KB of a workgroup's loads are issued at once (16 vec4s a thread, 256
//   threads), so an SM has its whole share in flight after the first latency (~0.8 µs on the
//   H200); what it then costs is the SM's own load bandwidth (~64 B a clock to L1: 64 KB in
//   ~0.55 µs at 1.9 GHz, the same again for the stores) against ~0.1-0.3 µs for a 16 KB
//   workgroup on 128 SMs: ~1 µs more memory time than the split, against the split's extra
//   launch (≥ 1.9 µs in a pass on the H200, and q2x_stage's own ~5.7 µs in place) or its counter
//   round trip (an atomic to L2 and a reload of y: ~1 µs of latency on the last workgroup). The
//   lab's `gdn_step` case times both shapes (gdn_step_y + q2x_stage against gdn_step_x).
//
// Bindings: 1 qkv (vec4), 2 b, 3 a, 4 y (gdn_step_y) or the staged x (gdn_step_x: xq.wgsl's qq),
//   5 a_log, 6 dt_bias, 7 state (rw, vec4), 8 z (vec4; gdn_step_x), 9 the norm's weights [Dv]
//   (vec4; gdn_step_x).

struct GS {
    hk: u32,
    hv: u32,
    dk: u32,
    dv: u32,
    // Workgroups a value head (gdn_step_y: ceil(Dv / 32); gdn_step_x: 1).
    slices: u32,
    // gdn_step_x: out_proj's x row (Hv · Dv) in 4-bit and 8-bit words (xq.wgsl's w4, w8).
    w4: u32,
    w8: u32,
    pad0: u32,
    eps: f32,
    qscale: f32,
    pad1: u32,
    pad2: u32,
}

@group(0) @binding(0) var<uniform> gs: GS;
@group(0) @binding(1) var<storage, read> gs_qkv: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> gs_b: array<f32>;
@group(0) @binding(3) var<storage, read> gs_a: array<f32>;
@group(0) @binding(4) var<storage, read_write> gs_y: array<f32>;
@group(0) @binding(5) var<storage, read> gs_alog: array<f32>;
@group(0) @binding(6) var<storage, read> gs_dtb: array<f32>;
@group(0) @binding(7) var<storage, read_write> gs_state: array<vec4<f32>>;

// The step specialised to the model (`LILY_WGPU_SPEC` gdn, the default since stop 38;
// gdn.rs `step_dispatch` sets them): with GC_ON the accessors give the head counts and sizes as
// pipeline constants (the bounds checks on rows and columns, the head's key head and the
// state's offsets fold); without (`LILY_WGPU_SPEC=none`) they read the parameter block.
override GC_ON: bool = false;
override GC_HK: u32 = 16u;
override GC_HV: u32 = 32u;
override GC_DK: u32 = 128u;
override GC_DV: u32 = 128u;
override GC_SLICES: u32 = 1u;
override GC_W4: u32 = 128u;
override GC_W8: u32 = 256u;

fn gc_hk() -> u32 { return select(gs.hk, GC_HK, GC_ON); }
fn gc_hv() -> u32 { return select(gs.hv, GC_HV, GC_ON); }
fn gc_dk() -> u32 { return select(gs.dk, GC_DK, GC_ON); }
fn gc_dv() -> u32 { return select(gs.dv, GC_DV, GC_ON); }
fn gc_slices() -> u32 { return select(gs.slices, GC_SLICES, GC_ON); }
fn gc_w4() -> u32 { return select(gs.w4, GC_W4, GC_ON); }
fn gc_w8() -> u32 { return select(gs.w8, GC_W8, GC_ON); }

// The most rows a thread holds (gdn_step_x: 4, a head of 128 over 32 row groups).
const GS_NR: u32 = 4u;

// One token's step of workgroup wg's rows (nr a thread; every invocation calls it: the row sums
// may be barriers): the state read, updated and written back; returns the thread's rows' y (row
// i in component i, the same on the 8 threads of a row; 0 past Dv).
fn gs_step(wg: u32, li: u32, nr: u32) -> vec4<f32> {
    let part = li % 8u;
    let h = wg / gc_slices();
    let r0 = (wg % gc_slices()) * 32u * nr + li / 8u;
    let kh = h / (gc_hv() / gc_hk());
    let dk4 = gc_dk() / 4u;
    // Every load first: none depends on another, so they share one latency.
    var s: array<vec4<f32>, 16>; // [4 i + m]: row i, columns 4·part + 32m
    for (var i = 0u; i < GS_NR; i++) {
        let r = r0 + 32u * i;
        for (var m = 0u; m < 4u; m++) {
            let c4 = part + 8u * m;
            var x = vec4<f32>(0.0);
            if (i < nr && r < gc_dv() && c4 < dk4) {
                x = gs_state[(h * gc_dv() + r) * dk4 + c4];
            }
            s[4u * i + m] = x;
        }
    }
    var q: array<vec4<f32>, 4>;
    var k: array<vec4<f32>, 4>;
    for (var m = 0u; m < 4u; m++) {
        let c4 = part + 8u * m;
        var xq = vec4<f32>(0.0);
        var xk = vec4<f32>(0.0);
        if (c4 < dk4) {
            xq = gs_qkv[kh * dk4 + c4];
            xk = gs_qkv[(gc_hk() + kh) * dk4 + c4];
        }
        q[m] = xq;
        k[m] = xk;
    }
    var v = vec4<f32>(0.0);
    for (var i = 0u; i < GS_NR; i++) {
        let r = r0 + 32u * i;
        if (i < nr && r < gc_dv()) {
            let at = 2u * gc_hk() * gc_dk() + h * gc_dv() + r;
            v[i] = gs_qkv[at / 4u][at % 4u];
        }
    }
    let braw = gs_b[h];
    let araw = gs_a[h];
    let decay_rate = exp(gs_alog[h]);
    let dtb = gs_dtb[h];
    // q and k l2-normed (q scaled by 1/sqrt(Dk)): the group's sums of squares.
    var sq = vec2<f32>(0.0);
    for (var m = 0u; m < 4u; m++) {
        sq += vec2<f32>(dot(q[m], q[m]), dot(k[m], k[m]));
    }
    let ssum = gs_rows(vec4<f32>(sq, 0.0, 0.0), li);
    let rq = gs.qscale / sqrt(ssum.x + 1e-6);
    let rk = 1.0 / sqrt(ssum.y + 1e-6);
    for (var m = 0u; m < 4u; m++) {
        q[m] *= rq;
        k[m] *= rk;
    }
    // The gates (gdn.wgsl gd_gates' expressions).
    let beta = sigmoid_f(braw);
    let g = exp(-decay_rate * softplus_g(araw + dtb));
    // s ← g·s; s·k
    var kv = vec4<f32>(0.0);
    for (var i = 0u; i < GS_NR; i++) {
        var acc = vec4<f32>(0.0);
        for (var m = 0u; m < 4u; m++) {
            s[4u * i + m] *= g;
            acc += s[4u * i + m] * k[m];
        }
        kv[i] = (acc.x + acc.y) + (acc.z + acc.w);
    }
    kv = gs_rows(kv, li);
    let delta = (v - kv) * beta;
    // s ← s + δ·k; y = s·q
    var y = vec4<f32>(0.0);
    for (var i = 0u; i < GS_NR; i++) {
        var acc = vec4<f32>(0.0);
        for (var m = 0u; m < 4u; m++) {
            s[4u * i + m] += delta[i] * k[m];
            acc += s[4u * i + m] * q[m];
        }
        y[i] = (acc.x + acc.y) + (acc.z + acc.w);
    }
    for (var i = 0u; i < GS_NR; i++) {
        let r = r0 + 32u * i;
        for (var m = 0u; m < 4u; m++) {
            let c4 = part + 8u * m;
            if (i < nr && r < gc_dv() && c4 < dk4) {
                gs_state[(h * gc_dv() + r) * dk4 + c4] = s[4u * i + m];
            }
        }
    }
    return gs_rows(y, li);
}

@compute @workgroup_size(256)
fn gdn_step_y(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let wg = wg_index(wid);
    let y = gs_step(wg, li, 1u);
    let r = (wg % gc_slices()) * 32u + li / 8u;
    if (li % 8u == 0u && r < gc_dv()) {
        gs_y[(wg / gc_slices()) * gc_dv() + r] = y.x;
    }
}
