// gemm_coop.wgsl: gemm_coop, prefill's dense matmul out[t] = x[t] · W_eᵀ on cooperative matrices
// (tensor cores: wgpu's EXPERIMENTAL_COOPERATIVE_MATRIX, Vulkan's VK_KHR_cooperative_matrix) for
// 4- or 8-bit codes in groups of a multiple of 8, inputs a multiple of 32 (every matrix of the
// model), past GEMM_BIG_MIN_ROWS rows of x with `LILY_WGPU_GEMM=coop` on adapters that offer
// 16×16×16 f16 × f16 + f32 (matmul.rs `coop_shader`; AdapterReport::coop16). cpu/matmul.rs
// `matmul` is the twin: the same products, of operands rounded to f16 (below), summed in another
// order. x f32 [rows, in] at x_off, out f32 [rows, out] at out_off (both multiples of 4: x is
// read as vec4, whole tiles are stored by coopStoreT, whose rows must be 16-byte aligned), matrix
// e of the stack. Layouts: quant.wgsl (MLX affine: w = scale·code + bias). matmul.rs makes two
// modules of this file, each prefixed with `enable f16; enable wgpu_cooperative_matrix;`,
// common.wgsl, quant.wgsl and the staging element (below): "gemm_coop" (`GcT` = vec4<f16>, the
// default: 8-byte stores, 4 a step an invocation; `LILY_WGPU_GEMM=coop`) and "gemm_coop1"
// (`GcT` = f16: 24 2-byte stores; `LILY_WGPU_GEMM=coop1`). Vulkan's cooperative loads take
// either (GLSL_KHR_cooperative_matrix, issue 3: the pointed-to type may differ from the
// matrix's component type, the stride counts pointed-to elements); the scalar one is the
// fallback should a driver mishandle vector elements. The prefix defines `GcT`, `GC_V` (halves
// an element: 4 or 1) and `gc_put_x4` / `gc_put_w4` (4 halves stored from half index `at`, a
// multiple of 4).
//
// Precision: x and w reach the matrix units as f16 (11 significant bits): x rounded from f32,
//   w computed in f32 (fma(scale, code, bias), as gemm_big) then rounded; the products are
//   exact in f32 and accumulated in f32 (coop_mat16x16<f32, C>). Each product is off by up to
//   ~2^-10 of itself, of random sign: a row's outputs by ~1e-3 of the row's largest (wgpu_ops
//   `gemm_coop_matches_the_cpu` holds them to COOP_TOL), against ~1e-6 for the f32 GEMMs.
//   Range: |x| > 65504 (f16's largest) is clamped to ±65504 before the rounding, so such an
//   input gives a finite but wrong product (the CPU's differs there), never ±inf and the NaN
//   that inf − inf makes in the sum; a NaN in x may come out clamped too (WGSL's clamp of a NaN
//   is the GPU's choice). Model weights (|w| ≪ 65504) are safe; |w| below 2^-14 loses bits as
//   an f16 subnormal (absolute error ≤ 2^-25).
// Tile: a 64 (rows) × 128 (outputs) block a workgroup of 256 invocations; k in steps of 32.
//   The workgroup's subgroups (32 wide on NVIDIA and Apple; `subgroup_id` says which is which,
//   nothing assumes an order of the invocations in them) each take a 32 × 32 warp tile of the
//   block, 2 × 2 accumulators of 16 × 16: subgroup s (s mod 8 where the subgroups are narrower
//   than 32 and thus more than 8: those after the 8th repeat the 8th's work, and store the same
//   values) takes rows 32·(s mod 2) .. +32 and outputs 32·(s / 2) .. +32. The host takes this
//   kernel only where subgroups are at most 32 wide (8 or more subgroups a workgroup).
// Workgroup memory (f16 rows of 32 k padded to GC_LD = 40 halves, 80 bytes: every row start is
//   16-byte aligned as coopLoad needs, and the 8 rows a matrix load reads at once fall in 8
//   distinct 16-byte columns of the 128-byte bank window, so they do not conflict): x [64][40]
//   and w [128][40], two buffers of each (double-buffered: 2 × 192 × 80 = 30,720 bytes), and
//   gc_e (2 × 256 f32, 2,048 bytes) for ragged tiles' stores: 32,768 bytes in all, the 32 KiB
//   Apple's GPUs and lavapipe offer (common.wgsl's wg_red is not used here, so not counted).
// Matrices a step: for kk = 0, 16: A = x rows [16 × 16] at k kk, row-major (coopLoadT, stride
//   GC_LD); B = w as k × outputs, which is the staged w [outputs][k] read column-major
//   (coopLoad, stride GC_LD): B(k, n) = w[n][k]. C += A · B for the 4 accumulators. Pointers
//   and strides are in `GcT` elements: every half offset divided by GC_V (all multiples of 4).
// Staging, per step, invocation li: x's vec4s v = li and li + 256 (row v / 8 of the block, k
//   4·(v % 8) .. +3; a row past the end reads 0), clamped, rounded to f16 and stored as 4
//   halves; the weights' 8-k chunks c = li and li + 256 (output c / 4 of the block, k 8·(c % 4)
//   .. +7; 4-bit: one code word, 8-bit: two; an output past the end reads the last output, never
//   written), each its own scale and bias (a chunk lies in one group: gs % 8 = 0), dequantized
//   in f32, rounded and stored as 8 halves. Double buffering with a register prefetch, one
//   barrier a step, as gemm.wgsl: step s+1's loads are issued before step s's products and
//   stored into the other buffer after them.
// Store: a whole tile (64 rows and 128 outputs in range, out a multiple of 4) by coopStoreT from
//   each subgroup's accumulators straight into out (row-major, stride out). A ragged tile (the
//   last row block, the last output block) goes through gc_e one accumulator at a time: 32
//   rounds (8 warp tiles × 4), in each of which subgroup s stores its accumulator into gc_e[0..256]
//   (the others into gc_e[256..512], unread: cooperative ops must stay in uniform control flow,
//   so every subgroup stores and the address picks), then every invocation copies one element
//   to out if its row and output are in range. Two barriers a round; only ragged tiles pay them.
// Launch: ceil(out / 128) · ceil(rows / 64) workgroups (index = row block · ceil(out / 128) +
//   output block), 256 invocations each.
// Memory model: naga declares the Vulkan memory model in a module with cooperative matrices,
//   but writes its workgroup loads and stores without NonPrivatePointer and its barriers
//   without MakeAvailable / MakeVisible (wgpu issue #8805): by the letter of that model the
//   staging is not made visible to the other subgroups. Drivers keep workgroup memory coherent
//   across a workgroup barrier (the hardware's shared memory), which the kernel relies on; the
//   op test is what shows it on a given driver.
// naga 30: the indices and stride of a coopStore are `let`s (its SPIR-V writer does not emit
//   expressions written inside coopStore's arguments and panics), and every branch around a
//   cooperative op or barrier depends on uniform values only (its validator checks it; a local
//   variable or a call's result counts as non-uniform).
// Bindings: 0 params, 1 qw, 2 qs, 3 qb (quant.wgsl), 4 x (as vec4), 5 out (gemm.wgsl's).

struct P {
    m: QMat,
    rows: u32,
    e: u32,
    x_off: u32,
    out_off: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
    pad3: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> qw: array<u32>;
@group(0) @binding(2) var<storage, read> qs: array<u32>;
@group(0) @binding(3) var<storage, read> qb: array<u32>;
@group(0) @binding(4) var<storage, read> x4: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

// Rows and outputs a block; k a step; halves a staged row; halves a buffer of x and of w.
const GC_M: u32 = 64u;
const GC_N: u32 = 128u;
const GC_K: u32 = 32u;
const GC_LD: u32 = 40u;
const GC_XB: u32 = 2560u;
const GC_WB: u32 = 5120u;
// f16's largest finite value.
const GC_F16_MAX: f32 = 65504.0;

var<workgroup> gc_x: array<GcT, 5120u / GC_V>;
var<workgroup> gc_w: array<GcT, 10240u / GC_V>;
var<workgroup> gc_e: array<f32, 512>;

// One step's staging, loaded ahead into registers: x's two vec4s, the codes of the two chunks
// (4-bit: .x only), their scales and biases.
struct GcStage {
    x0: vec4<f32>,
    x1: vec4<f32>,
    w0: vec2<u32>,
    w1: vec2<u32>,
    s0: f32,
    b0: f32,
    s1: f32,
    b1: f32,
}

// x's vec4 of block row r at step k0 (0 past the last row).
fn gc_x4(k0: u32, t0: u32, r: u32, kq: u32) -> vec4<f32> {
    if (t0 + r >= p.rows) {
        return vec4<f32>(0.0);
    }
    return x4[p.x_off / 4u + (t0 + r) * (p.m.inp / 4u) + k0 / 4u + kq];
}

// The code words of the 8-k chunk ch of stack row `row` at step k0.
fn gc_codes(k0: u32, row: u32, ch: u32) -> vec2<u32> {
    if (p.m.bits == 4u) {
        return vec2<u32>(qw[row * (p.m.inp / 8u) + k0 / 8u + ch], 0u);
    }
    let wi = row * (p.m.inp / 4u) + k0 / 4u + 2u * ch;
    return vec2<u32>(qw[wi], qw[wi + 1u]);
}

// Loads the staging of the step at k0 for invocation li (the header's "Staging").
fn gc_load(k0: u32, t0: u32, o0: u32, li: u32) -> GcStage {
    var st: GcStage;
    let kq = li % 8u;
    st.x0 = gc_x4(k0, t0, li / 8u, kq);
    st.x1 = gc_x4(k0, t0, 32u + li / 8u, kq);
    let ch = li % 4u;
    let base = p.e * p.m.out;
    let row0 = base + min(o0 + li / 4u, p.m.out - 1u);
    let row1 = base + min(o0 + 64u + li / 4u, p.m.out - 1u);
    st.w0 = gc_codes(k0, row0, ch);
    st.w1 = gc_codes(k0, row1, ch);
    let groups = p.m.inp / p.m.gs;
    let gk = (k0 + 8u * ch) / p.m.gs;
    st.s0 = q_sb(row0 * groups + gk, p.m.sb16, false);
    st.b0 = q_sb(row0 * groups + gk, p.m.sb16, true);
    st.s1 = q_sb(row1 * groups + gk, p.m.sb16, false);
    st.b1 = q_sb(row1 * groups + gk, p.m.sb16, true);
    return st;
}

// Stores x's vec4 as 4 halves from half index `at`.
fn gc_put_x(at: u32, v: vec4<f32>) {
    gc_put_x4(at, vec4<f16>(clamp(v, vec4<f32>(-GC_F16_MAX), vec4<f32>(GC_F16_MAX))));
}

// Dequantizes a chunk's 8 codes (scale s, bias b) and stores them as 8 halves from half index
// `at`.
fn gc_put_w(at: u32, w: vec2<u32>, s: f32, b: f32) {
    var lo: vec4<u32>;
    var hi: vec4<u32>;
    if (p.m.bits == 4u) {
        lo = (vec4<u32>(w.x) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(0xfu);
        hi = (vec4<u32>(w.x) >> vec4<u32>(16u, 20u, 24u, 28u)) & vec4<u32>(0xfu);
    } else {
        let sh = vec4<u32>(0u, 8u, 16u, 24u);
        lo = (vec4<u32>(w.x) >> sh) & vec4<u32>(0xffu);
        hi = (vec4<u32>(w.y) >> sh) & vec4<u32>(0xffu);
    }
    gc_put_w4(at, vec4<f16>(fma(vec4<f32>(s), vec4<f32>(lo), vec4<f32>(b))));
    gc_put_w4(at + 4u, vec4<f16>(fma(vec4<f32>(s), vec4<f32>(hi), vec4<f32>(b))));
}

// Stores a staging into the buffers at xb and wb (half index of their starts).
fn gc_store(st: GcStage, xb: u32, wb: u32, li: u32) {
    let xk = 4u * (li % 8u);
    gc_put_x(xb + (li / 8u) * GC_LD + xk, st.x0);
    gc_put_x(xb + (32u + li / 8u) * GC_LD + xk, st.x1);
    let wk = 8u * (li % 4u);
    gc_put_w(wb + (li / 4u) * GC_LD + wk, st.w0, st.s0, st.b0);
    gc_put_w(wb + (64u + li / 4u) * GC_LD + wk, st.w1, st.s1, st.b1);
}

@compute @workgroup_size(256)
fn gemm_coop(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sid: u32,
) {
    // Every value a branch around a cooperative op or a barrier depends on is uniform (naga
    // checks it): the block's place comes from the workgroup id and the parameters (wg_index
    // written out: a call's result does not count as uniform).
    let tiles_o = (p.m.out + GC_N - 1u) / GC_N;
    let wg = wid.y * 65535u + wid.x;
    let o0 = (wg % tiles_o) * GC_N;
    let t0 = (wg / tiles_o) * GC_M;
    // The subgroup's warp tile: its first row of x and its first output, as half offsets into
    // a buffer.
    let wt = sid % 8u;
    let xa = (wt % 2u) * 32u * GC_LD;
    let wa = (wt / 2u) * 32u * GC_LD;
    // Accumulators: rows 0-15 / 16-31 (first digit) × outputs 0-15 / 16-31 of the warp tile.
    var c00 = coop_mat16x16<f32, C>();
    var c01 = coop_mat16x16<f32, C>();
    var c10 = coop_mat16x16<f32, C>();
    var c11 = coop_mat16x16<f32, C>();
    let steps = p.m.inp / GC_K;
    gc_store(gc_load(0u, t0, o0, li), 0u, 0u, li);
    workgroupBarrier();
    for (var st = 0u; st < steps; st++) {
        let xb = (st % 2u) * GC_XB;
        let wb = (st % 2u) * GC_WB;
        let more = st + 1u < steps;
        var next: GcStage;
        if (more) {
            next = gc_load((st + 1u) * GC_K, t0, o0, li);
        }
        for (var kk = 0u; kk < GC_K; kk += 16u) {
            let ia0 = (xb + xa + kk) / GC_V;
            let ia1 = (xb + xa + 16u * GC_LD + kk) / GC_V;
            let ib0 = (wb + wa + kk) / GC_V;
            let ib1 = (wb + wa + 16u * GC_LD + kk) / GC_V;
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&gc_x[ia0], GC_LD / GC_V);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&gc_x[ia1], GC_LD / GC_V);
            let b0 = coopLoad<coop_mat16x16<f16, B>>(&gc_w[ib0], GC_LD / GC_V);
            let b1 = coopLoad<coop_mat16x16<f16, B>>(&gc_w[ib1], GC_LD / GC_V);
            c00 = coopMultiplyAdd(a0, b0, c00);
            c01 = coopMultiplyAdd(a0, b1, c01);
            c10 = coopMultiplyAdd(a1, b0, c10);
            c11 = coopMultiplyAdd(a1, b1, c11);
        }
        if (more) {
            gc_store(next, GC_XB - xb, GC_WB - wb, li);
        }
        workgroupBarrier();
    }
    let whole = t0 + GC_M <= p.rows && o0 + GC_N <= p.m.out && p.m.out % 4u == 0u
        && p.out_off % 4u == 0u;
    if (whole) {
        // Indices and stride as `let`s: naga 30's SPIR-V writer does not emit the expressions
        // written inside a coopStore's arguments (an index or a field load there panics it:
        // "Expression [n] is not cached!"), only those bound before.
        let ld = p.m.out;
        let i00 = p.out_off + (t0 + (wt % 2u) * 32u) * ld + o0 + (wt / 2u) * 32u;
        let i01 = i00 + 16u;
        let i10 = i00 + 16u * ld;
        let i11 = i10 + 16u;
        coopStoreT(c00, &out[i00], ld);
        coopStoreT(c01, &out[i01], ld);
        coopStoreT(c10, &out[i10], ld);
        coopStoreT(c11, &out[i11], ld);
    } else {
        for (var s = 0u; s < 8u; s++) {
            for (var q = 0u; q < 4u; q++) {
                var cq = c00;
                if (q == 1u) {
                    cq = c01;
                } else if (q == 2u) {
                    cq = c10;
                } else if (q == 3u) {
                    cq = c11;
                }
                let at = select(256u, 0u, sid == s);
                coopStoreT(cq, &gc_e[at], 16u);
                workgroupBarrier();
                let r = t0 + (s % 2u) * 32u + (q / 2u) * 16u + li / 16u;
                let o = o0 + (s / 2u) * 32u + (q % 2u) * 16u + li % 16u;
                if (r < p.rows && o < p.m.out) {
                    out[p.out_off + r * p.m.out + o] = gc_e[li];
                }
                workgroupBarrier();
            }
        }
    }
}
