//! A decode token's MoE block fused (a module of wgpu_ops.rs): `moe_decode_add` with the shared
//! expert as slot k of the routed experts' two launches (moe_gate_up_s, moe_down_s), and
//! `moe_step_add` with the route folded into moe_gate_up_s (two launches after the router's),
//! at the model's shapes (hidden 2048, 256 experts, top-8, width 512, 4-bit experts and shared
//! expert in groups of 64, an 8-bit router and shared gate), against the CPU and against the
//! unfused sequence on the same device (`Wgpu::set_moe_fuse`, `LILY_WGPU_MOE_FUSE`).
//!
//! What must be exact: the router's launch is the same either way, so x, the logits and the
//! shared gate's logit are the same bits; the route moe_gate_up_s writes is moe_route's maths
//! (same trees, exp_acc, keys, ranks), so its ids and weights are the same bits as moe_route's
//! on the device, and its ids equal the CPU's moe_route of those logits (weights within 1e-6,
//! as moe_route_matches_the_cpu), ties included (lower id first).
//!
//! The MoE output (h after minus h before; h is small, 0.05, so that taking it back out of the
//! f32 sum costs ~1e-8 of an O(1) output) against the CPU's moe_decode_add on the device's x,
//! route and shared logit: `MOE_TOL` per row relative to its largest |value|. Every gate|up
//! (the 8 routed slots and, fused, the shared one) reads x in two int8 levels per 16-byte code
//! word (q2x.wgsl: each element within max |x| / 64,516 of itself), the downs read act in f32;
//! the fused and the unfused sequences measure alike on lavapipe: 3-7e-5 through moe_step_add
//! (x normed), 6e-5 to 1.1e-4 through moe_decode_add on x of unit scale (the larger figure the
//! unfused one's). MOE_TOL = 5e-4 keeps over 4× above that, below Q2X_TOL (whose 1e-3 is for
//! one-output matrices), fails x at one int8 level (~4e-3) by 8×, and a wrong slot, weight or
//! gate or a missing shared expert moves the output by O(1e-1).
//!
//! Each case runs with every kernel set of the fused block (`XQ_MODES`): moe_xq.wgsl's
//! moe_gate_up_x (x as q2x_stage staged it: the same two int8 levels) and moe_down_x (act in
//! two int8 levels too, quantized in gate|up's epilogue: each element within max |act| / 64,516
//! of its 32-element word), in several team shapes, its gate|up with moe_down_s, and
//! moe_step.wgsl's; mode 4 (the default) and 3 run moe_xq.wgsl's y twins (moe_gate_up_y,
//! moe_down_y: the same integer dots, a lane's loads at once; down sums a lane's slots before
//! the team's lanes, so its order differs from moe_down_x's). The same bound holds for all: on lavapipe the xq sets measure 2.5e-5 to
//! 1.4e-4 at the model's shapes and up to 1.65e-4 on the top-1 stack of width 128, against
//! 3e-5 to 1.2e-4 for moe_step.wgsl's; the route moe_gate_up_x writes (gx_route: fewer
//! barriers, candidates only) is asserted bit-equal to moe_route's like gs_route's.

use super::*;
use lily::backend::cpu::moe::Route as CpuRoute;
use lily::backend::{Dims, MoeScratch, MoeWeights, RouteAhead, RouterScratch, SharedExpert};
use lily::loader::tensor::{HostLinear, LinearKind};
use ops::{check_fold_logits, moe_weights, rand_moe, tensor_u32, MoeTmp};

const MOE_TOL: f32 = 5e-4;

/// Whether the adapter offers what moe_gate_up_s / moe_down_s bind and stage (moe.rs S_BUFFERS,
/// S_WG_BYTES): else every op here runs the unfused sequence, which the checks still hold.
fn fusable(g: &Wgpu) -> bool {
    let r = g.report();
    r.storage_buffers >= 17 && r.workgroup_storage >= 20 * 1024
}

/// The fused block's kernel sets the tests run (`LILY_WGPU_MOE_XQ`, `LILY_WGPU_MOE_XQ_SHAPE`).
const XQ_MODES: [(u32, &str); 7] = [
    (4, "32,16,2"),
    (3, "32,16,2"),
    (2, "32,16,2"),
    (2, "8,8,1"),
    (2, "16,4,4"),
    (1, "32,16,2"),
    (0, "32,16,2"),
];

fn set_xq(g: &Wgpu, mode: u32, shape: &str) {
    g.set_moe_xq(mode);
    assert!(g.set_moe_xq_shape(shape), "moe_xq shape {shape}");
    eprintln!("moe_xq mode {mode} shape {shape}");
}

/// `m` with row r a copy of row `src(r)` (codes, scales and biases: whole u32 words a row).
fn copy_rows(m: &HostLinear, src: impl Fn(usize) -> usize) -> HostLinear {
    let LinearKind::Quant {
        bits,
        group_size,
        w,
        scales,
        biases,
    } = &m.kind
    else {
        panic!("copy_rows: a quantized matrix");
    };
    let words = |t: &lily::loader::tensor::HostTensor| -> Vec<u32> {
        t.bytes()
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let dup = |v: Vec<u32>| -> Vec<u32> {
        let per = v.len() / m.out;
        (0..m.out)
            .flat_map(|r| v[src(r) * per..][..per].to_vec())
            .collect()
    };
    let t = |old: &lily::loader::tensor::HostTensor, v: Vec<u32>| {
        let n = old.bytes().len();
        tensor_u32(&old.name, old.shape.clone(), old.dtype, v, n)
    };
    HostLinear {
        name: format!("{} (rows copied)", m.name),
        n: m.n,
        out: m.out,
        inp: m.inp,
        kind: LinearKind::Quant {
            bits: *bits,
            group_size: *group_size,
            w: t(w, dup(words(w))),
            scales: t(scales, dup(words(scales))),
            biases: t(biases, dup(words(biases))),
        },
    }
}

/// The CPU's moe_decode_add of one token into a zero h: the MoE output.
#[allow(clippy::ptr_arg)]
fn cpu_moe(x: &Vec<f32>, route: &CpuRoute, m: [&HostLinear; 6], logit: f32, d: &Dims) -> Vec<f32> {
    let (hid, width) = (m[0].inp, m[0].out);
    let mut h = vec![0f32; hid];
    let cl = vec![logit];
    let (mut c0, mut c1, mut c2, mut c3, mut c4) = (
        vec![0f32; hid],
        vec![0f32; width],
        vec![0f32; width],
        vec![0f32; width],
        vec![0f32; hid],
    );
    Cpu.moe_decode_add(
        x,
        route,
        m[0],
        m[1],
        m[2],
        &SharedExpert {
            gate: m[3],
            up: m[4],
            down: m[5],
            logit: &cl,
        },
        d,
        MoeScratch {
            out: &mut c0,
            g: &mut c1,
            u: &mut c2,
            act: &mut c3,
            down: &mut c4,
        },
        &mut h,
    );
    h
}

type WB = <Wgpu as Backend>::Buf;
type WM = <Wgpu as Backend>::Mat;

/// What one moe_step_add left: h, x, the logits, the shared logit, the route, its launches.
struct StepOut {
    h: Vec<f32>,
    x: Vec<f32>,
    logits: Vec<f32>,
    s: f32,
    ids: Vec<u32>,
    w: Vec<f32>,
    launches: u64,
}

/// One token through the device's moe_step_add, fused or not.
#[allow(clippy::too_many_arguments)]
fn gpu_step(
    g: &Wgpu,
    fuse: bool,
    hv: &[f32],
    norm: &WB,
    w: &MoeWeights<'_, Wgpu>,
    d: &Dims,
    width: usize,
    ahead: bool,
) -> StepOut {
    let (hid, e) = (d.hidden, d.n_experts);
    g.set_moe_fuse(fuse);
    let mut gh = g.upload(hv).unwrap();
    let (mut xn, mut lg, mut sl) = (
        g.zeros(hid).unwrap(),
        g.zeros(e).unwrap(),
        g.zeros(1).unwrap(),
    );
    let mut route = g.new_route(1, d.top_k).unwrap();
    let mut tmp = MoeTmp::new(g, hid, width);
    g.sync().unwrap();
    let n0 = g.dispatches();
    g.moe_step_add(
        &mut gh,
        norm,
        d.eps,
        w,
        d,
        RouterScratch {
            xn: &mut xn,
            logits: &mut lg,
            s: &mut sl,
            route: &mut route,
            ahead,
        },
        tmp.tmp(),
    );
    let launches = g.dispatches() - n0;
    g.set_moe_fuse(true);
    let (ids, wts) = g.route_to_host(&route, 1).unwrap();
    StepOut {
        h: h(g, &gh, hid),
        x: h(g, &xn, hid),
        logits: h(g, &lg, e),
        s: h(g, &sl, 1)[0],
        ids,
        w: wts,
        launches,
    }
}

/// One token through the device's moe_decode_add (x, route and shared logit given), fused or
/// not: the MoE output (h from zero) and its launches.
#[allow(clippy::too_many_arguments)]
fn gpu_decode(
    g: &Wgpu,
    fuse: bool,
    x: &[f32],
    route: &<Wgpu as Backend>::Route,
    gm: [&WM; 6],
    logit: f32,
    d: &Dims,
) -> (Vec<f32>, u64) {
    let (hid, width) = (d.hidden, g.mat_shape(gm[0]).0);
    g.set_moe_fuse(fuse);
    let gx = g.upload(x).unwrap();
    let gl = g.upload(&[logit]).unwrap();
    let mut gh = g.zeros(hid).unwrap();
    let mut tmp = MoeTmp::new(g, hid, width);
    g.sync().unwrap();
    let n0 = g.dispatches();
    g.moe_decode_add(
        &gx,
        route,
        gm[0],
        gm[1],
        gm[2],
        &SharedExpert {
            gate: gm[3],
            up: gm[4],
            down: gm[5],
            logit: &gl,
        },
        d,
        tmp.tmp(),
        &mut gh,
    );
    let launches = g.dispatches() - n0;
    g.set_moe_fuse(true);
    (h(g, &gh, hid), launches)
}

/// moe_step_add fused and not with the router given: bit-equal router outputs and route, the
/// route equal to the CPU's of the device's logits, each MoE output against the CPU's;
/// `takes`: whether the fused kernels take this shared expert (the route in moe_gate_up_s and
/// the shared slot: the router's GEMV and two launches) or not (the unfused launches: the
/// router's GEMV, moe_route, the routed experts' two, the shared expert's two GEMVs; a GEMV is
/// one launch, or two where gemv_q6 takes it: `Wgpu::gemv_launches`). Returns the fused run.
#[allow(clippy::too_many_arguments)]
fn step_case(
    g: &Wgpu,
    rng: &mut Rng,
    router: &HostLinear,
    m: [&HostLinear; 6],
    gm: [&WM; 6],
    d: &Dims,
    takes: bool,
    what: &str,
) -> StepOut {
    let (hid, width) = (d.hidden, m[0].out);
    let nw: Vec<f32> = (0..hid).map(|_| 1.0 + 0.1 * rng.f()).collect();
    let sgate = rand_quant(rng, 1, 1, hid, 8, 64, false);
    let (grt, gsg, gnw) = (
        g.upload_mat(router).unwrap(),
        g.upload_mat(&sgate).unwrap(),
        g.upload_vec(&nw).unwrap(),
    );
    let w = moe_weights(&grt, &gsg, gm);
    let hv = rng.vec(hid, 0.05);
    let comp = gpu_step(g, false, &hv, &gnw, &w, d, width, false);
    let fused = gpu_step(g, true, &hv, &gnw, &w, d, width, false);
    println!(
        "moe_step_add {what}: {} launches fused, {} unfused; route {:?}",
        fused.launches, comp.launches, fused.ids
    );
    let r = g.gemv_launches(&[&grt, &gsg]);
    let unfused = 3 + r + g.gemv_launches(&[gm[3], gm[4]]) + g.gemv_launches(&[gm[5]]);
    assert_eq!(
        comp.launches, unfused,
        "{what}: the unfused sequence's launches"
    );
    // moe_gate_up_x reads the router's staging of x, or stages x itself (one launch more)
    // where the router's GEMV ran without one.
    let xq = g.moe_xq_takes(hid, width, d.top_k).0;
    let expect = if takes && fusable(g) {
        2 + r + (xq && r == 1) as u64
    } else {
        unfused
    };
    assert_eq!(
        fused.launches, expect,
        "{what}: the fused sequence's launches"
    );
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&fused.x), bits(&comp.x), "{what}: x differs");
    assert_eq!(
        bits(&fused.logits),
        bits(&comp.logits),
        "{what}: the logits differ"
    );
    assert_eq!(fused.s.to_bits(), comp.s.to_bits(), "{what}: s differs");
    assert_eq!(
        fused.ids, comp.ids,
        "{what}: route ids differ from moe_route's"
    );
    assert_eq!(
        bits(&fused.w),
        bits(&comp.w),
        "{what}: route weights differ from moe_route's"
    );
    // Against the CPU, on the device's x, logits and shared logit.
    let mut cl = vec![0f32; d.n_experts];
    Cpu.matmul_q(&fused.x, router, 1, &mut cl);
    check(
        &format!("moe_step_add {what} (router logits)"),
        rel_rows(&fused.logits, &cl, d.n_experts),
        Q2X_TOL,
    );
    let mut cr = CpuRoute::default();
    Cpu.moe_route(&fused.logits, d, 1, &mut cr);
    assert_eq!(fused.ids, cr.ids, "{what}: route ids differ from the CPU's");
    let werr = fused
        .w
        .iter()
        .zip(&cr.weights)
        .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
    check(
        &format!("moe_step_add {what} (route weights, abs)"),
        werr,
        1e-6,
    );
    let want = cpu_moe(&fused.x, &cr, m, fused.s, d);
    for (run, got) in [("fused", &fused), ("unfused", &comp)] {
        let out: Vec<f32> = got.h.iter().zip(&hv).map(|(a, b)| a - b).collect();
        check(
            &format!("moe_step_add {what} {run} (MoE output)"),
            rel_rows(&out, &want, hid),
            MOE_TOL,
        );
    }
    fused
}

/// moe_decode_add fused and not on one route against the CPU; `takes`: whether the fused
/// kernels take the shared expert (2 launches: the shared slot) or not (the routed experts' two
/// launches and the shared expert's two GEMVs).
#[allow(clippy::too_many_arguments)]
fn decode_case(
    g: &Wgpu,
    rng: &mut Rng,
    m: [&HostLinear; 6],
    gm: [&WM; 6],
    d: &Dims,
    takes: bool,
    what: &str,
) {
    let e = d.n_experts;
    let mut logits = rng.vec(e, 3.0);
    logits[3 % e] += 8.0;
    let mut cr = CpuRoute::default();
    Cpu.moe_route(&logits, d, 1, &mut cr);
    let mut gr = g.new_route(1, d.top_k).unwrap();
    g.moe_route(&g.upload(&logits).unwrap(), d, 1, &mut gr);
    let (ids, _) = g.route_to_host(&gr, 1).unwrap();
    assert_eq!(ids, cr.ids, "{what}: moe_route's ids differ from the CPU's");
    let x = rng.vec(d.hidden, 1.0);
    for logit in [-1.5f32, 0.7] {
        let want = cpu_moe(&x, &cr, m, logit, d);
        for fuse in [true, false] {
            let (got, launches) = gpu_decode(g, fuse, &x, &gr, gm, logit, d);
            let unfused = 2 + g.gemv_launches(&[gm[3], gm[4]]) + g.gemv_launches(&[gm[5]]);
            // moe_gate_up_x stages x first (q2x_stage: moe_decode_add has no router).
            let xq = g.moe_xq_takes(d.hidden, g.mat_shape(gm[0]).0, d.top_k).0;
            let expect = if fuse && takes && fusable(g) {
                2 + xq as u64
            } else {
                unfused
            };
            assert_eq!(launches, expect, "{what}: launches (fuse {fuse})");
            check(
                &format!(
                    "moe_decode_add {what} s {logit} {}",
                    if fuse { "fused" } else { "unfused" }
                ),
                rel_rows(&got, &want, d.hidden),
                MOE_TOL,
            );
        }
    }
}

fn upload6(g: &Wgpu, m: [&HostLinear; 6]) -> Vec<WM> {
    m.iter().map(|w| g.upload_mat(w).unwrap()).collect()
}

/// The model's shapes: moe_step_add on random routers (3 tokens), on routers whose rows come
/// in triples of equal ones (ties at the top-8's edge: two whole triples and the lower two of
/// a third must be chosen), and on one whose rows are all equal (experts 0..7, weights 1/8);
/// moe_decode_add with the shared slot; and shared experts in layouts the fused kernels do not
/// take (8-bit, groups of 32, f32 scales), which must fall back to the unfused launches and
/// still match.
#[test]
fn moe_block_fused_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let r = g.report();
    eprintln!(
        "storage buffers a stage {}, workgroup memory {} B: fused kernels {}",
        r.storage_buffers,
        r.workgroup_storage,
        if fusable(&g) { "taken" } else { "not taken" }
    );
    let d = qwen_dims();
    let mut rng = Rng(81);
    let (e, hid, width) = (d.n_experts, d.hidden, 512);
    let m = [
        rand_quant(&mut rng, e, width, hid, 4, 64, false),
        rand_quant(&mut rng, e, width, hid, 4, 64, false),
        rand_quant(&mut rng, e, hid, width, 4, 64, false),
        rand_quant(&mut rng, 1, width, hid, 4, 64, false),
        rand_quant(&mut rng, 1, width, hid, 4, 64, false),
        rand_quant(&mut rng, 1, hid, width, 4, 64, false),
    ];
    let mr = [&m[0], &m[1], &m[2], &m[3], &m[4], &m[5]];
    let gmv = upload6(&g, mr);
    let gm = [&gmv[0], &gmv[1], &gmv[2], &gmv[3], &gmv[4], &gmv[5]];

    // Every kernel set of the fused block: moe_xq.wgsl's (moe_gate_up_x, moe_down_x) in the
    // default shape and in others (teams of 8 lanes, one a down output: shuffles alone on 8-lane
    // subgroups; 16-lane teams, 4 of down: team_sum through workgroup memory here), its gate|up
    // with moe_down_s, and moe_step.wgsl's (LILY_WGPU_MOE_XQ=0).
    for (mode, shape) in XQ_MODES {
        set_xq(&g, mode, shape);
        // moe_step_add on random routers.
        for token in 0..3 {
            let router = rand_quant(&mut rng, 1, e, hid, 8, 64, false);
            step_case(
                &g,
                &mut rng,
                &router,
                mr,
                gm,
                &d,
                true,
                &format!("token {token}"),
            );
        }
        // Ties: rows in triples, the logits of a triple the same bits (the same dot products).
        let base = rand_quant(&mut rng, 1, e, hid, 8, 64, false);
        let triples = copy_rows(&base, |r| r - r % 3);
        let out = step_case(&g, &mut rng, &triples, mr, gm, &d, true, "ties in triples");
        for &i in &out.ids {
            let first = (i - i % 3) as usize;
            assert_eq!(
                out.logits[i as usize].to_bits(),
                out.logits[first].to_bits(),
                "the triple of expert {i} has unequal logits: no ties tested"
            );
        }
        // 8 is no multiple of 3 (and 255 is alone): the top-8's edge splits a triple, whose lower
        // ids must be the ones taken.
        let split = out.ids.iter().any(|&i| {
            let first = i - i % 3;
            (first..(first + 3).min(e as u32)).any(|j| !out.ids.contains(&j))
        });
        assert!(split, "no tie at the top-8's edge: {:?}", out.ids);
        // Every logit equal: the route is experts 0..k, each weighing 1/k.
        let same = copy_rows(&base, |_| 0);
        let out = step_case(&g, &mut rng, &same, mr, gm, &d, true, "all logits equal");
        assert_eq!(out.ids, (0..d.top_k as u32).collect::<Vec<_>>());
        assert!(out.w.iter().all(|&w| w == 1.0 / d.top_k as f32));

        // moe_decode_add with the shared slot (2 launches; 4 unfused).
        decode_case(&g, &mut rng, mr, gm, &d, true, "4-bit");
    }
    set_xq(&g, 2, "32,16,2");

    // Shared experts the fused kernels do not take: the unfused launches, the same results.
    let others = [
        ("shared 8-bit", 8u32, 64usize, false),
        ("shared 4-bit g32", 4, 32, false),
        ("shared f32 scales", 4, 64, true),
    ];
    for (what, bits, gs, f32s) in others {
        let sh = [
            rand_quant(&mut rng, 1, width, hid, bits, gs, f32s),
            rand_quant(&mut rng, 1, width, hid, bits, gs, f32s),
            rand_quant(&mut rng, 1, hid, width, bits, gs, f32s),
        ];
        let ms = [&m[0], &m[1], &m[2], &sh[0], &sh[1], &sh[2]];
        let gsh: Vec<WM> = sh.iter().map(|w| g.upload_mat(w).unwrap()).collect();
        let gms = [gm[0], gm[1], gm[2], &gsh[0], &gsh[1], &gsh[2]];
        decode_case(&g, &mut rng, ms, gms, &d, false, what);
        // moe_step_add falls back to moe_router + moe_decode_add's unfused launches (6).
        let router = rand_quant(&mut rng, 1, e, hid, 8, 64, false);
        step_case(&g, &mut rng, &router, ms, gms, &d, false, what);
    }
}

/// Other stacks: 8-bit experts and shared expert (x's int8 correction of moe_gate_up_q), 32
/// experts of hidden 1024 and width 256, top-4 without renormalisation (moe_down_s's 12
/// outputs × 5 slots a workgroup), 16 experts top-1; moe_step_add and moe_decode_add.
#[test]
fn moe_block_fused_other_shapes() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(82);
    let cases = [
        (8u32, 32usize, 1024usize, 256usize, 4usize, false),
        (4, 16, 512, 128, 1, true),
    ];
    for (bits, e, hid, width, k, norm) in cases {
        let d = moe_dims(e, hid, k, norm);
        let m = [
            rand_quant(&mut rng, e, width, hid, bits, 64, false),
            rand_quant(&mut rng, e, width, hid, bits, 64, false),
            rand_quant(&mut rng, e, hid, width, bits, 64, false),
            rand_quant(&mut rng, 1, width, hid, bits, 64, false),
            rand_quant(&mut rng, 1, width, hid, bits, 64, false),
            rand_quant(&mut rng, 1, hid, width, bits, 64, false),
        ];
        let mr = [&m[0], &m[1], &m[2], &m[3], &m[4], &m[5]];
        let gmv = upload6(&g, mr);
        let gm = [&gmv[0], &gmv[1], &gmv[2], &gmv[3], &gmv[4], &gmv[5]];
        for (mode, shape) in XQ_MODES {
            set_xq(&g, mode, shape);
            let what = format!("{bits}-bit {e}×[{width}, {hid}] top-{k} xq {mode} {shape}");
            let router = rand_quant(&mut rng, 1, e, hid, 8, 64, false);
            step_case(&g, &mut rng, &router, mr, gm, &d, true, &what);
            decode_case(&g, &mut rng, mr, gm, &d, true, &what);
        }
        set_xq(&g, 2, "32,16,2");
    }
}

/// The projection and the MoE block after it of the ahead tests (route_ahead, xq_ahead), at the
/// model's shapes: out_proj 4-bit [2048, 4096], an 8-bit router and shared gate, the experts
/// (width 512) and the MoE norm's weights, on the host and on the device.
struct AheadCase {
    d: Dims,
    router: HostLinear,
    sgate: HostLinear,
    m: [HostLinear; 6],
    nw: Vec<f32>,
    gwo: WM,
    grt: WM,
    gsg: WM,
    gm: Vec<WM>,
    gnw: WB,
}

impl AheadCase {
    fn new(g: &Wgpu, rng: &mut Rng) -> Self {
        let d = qwen_dims();
        let (e, hid) = (d.n_experts, d.hidden);
        let wo = rand_quant(rng, 1, hid, 4096, 4, 64, false);
        let router = rand_quant(rng, 1, e, hid, 8, 64, false);
        let sgate = rand_quant(rng, 1, 1, hid, 8, 64, false);
        let m = rand_moe(rng, e, 512, hid, 4);
        let gm = upload6(g, [&m[0], &m[1], &m[2], &m[3], &m[4], &m[5]]);
        let nw: Vec<f32> = (0..hid).map(|_| 1.0 + 0.1 * rng.f()).collect();
        AheadCase {
            gwo: g.upload_mat(&wo).unwrap(),
            grt: g.upload_mat(&router).unwrap(),
            gsg: g.upload_mat(&sgate).unwrap(),
            gnw: g.upload_vec(&nw).unwrap(),
            d,
            router,
            sgate,
            m,
            nw,
            gm,
        }
    }

    fn next(&self) -> RouteAhead<'_, Wgpu> {
        RouteAhead {
            router: &self.grt,
            shared_gate: &self.gsg,
            norm: &self.gnw,
        }
    }

    /// One token: h (`hv`) plus the projection of `gx`, prepared for the MoE block or not
    /// (`ahead`), then moe_step_add on a copy of h after the projection (what the projection
    /// prepared waits in the device's scratch): h after the projection and the block's outputs.
    fn run(&self, g: &Wgpu, hv: &[f32], gx: &WB, ahead: bool) -> (Vec<f32>, StepOut) {
        let hid = self.d.hidden;
        let mut gh = g.upload(hv).unwrap();
        let mut r = g.zeros(hid).unwrap();
        if ahead {
            g.matmul_q_add_ahead(gx, &self.gwo, &mut r, &mut gh, &self.next());
        } else {
            g.matmul_q_add(gx, &self.gwo, 1, &mut r, &mut gh);
        }
        let hmid = h(g, &gh, hid);
        let gm = &self.gm;
        let w = moe_weights(
            &self.grt,
            &self.gsg,
            [&gm[0], &gm[1], &gm[2], &gm[3], &gm[4], &gm[5]],
        );
        let step = gpu_step(g, true, &hmid, &self.gnw, &w, &self.d, 512, ahead);
        (hmid, step)
    }

    /// The block's route against the CPU's moe_route of its logits (ids equal, weights to
    /// 1e-6), and its MoE output (h after it minus `hmid`, h before) within MOE_TOL of the
    /// CPU's on x `cx`, that route and its shared logit.
    fn check_block(&self, on: &StepOut, hmid: &[f32], cx: &Vec<f32>, what: &str) {
        let (d, m) = (&self.d, &self.m);
        let mut cr = CpuRoute::default();
        Cpu.moe_route(&on.logits, d, 1, &mut cr);
        assert_eq!(on.ids, cr.ids, "{what}: route ids differ from the CPU's");
        let werr =
            on.w.iter()
                .zip(&cr.weights)
                .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        check(&format!("{what} (route weights, abs)"), werr, 1e-6);
        let want = cpu_moe(cx, &cr, [&m[0], &m[1], &m[2], &m[3], &m[4], &m[5]], on.s, d);
        let out: Vec<f32> = on.h.iter().zip(hmid).map(|(a, b)| a - b).collect();
        check(
            &format!("{what} (MoE output)"),
            rel_rows(&out, &want, d.hidden),
            MOE_TOL,
        );
    }
}

/// Opt-in `LILY_WGPU_ROUTE_AHEAD` (Backend::route_ahead; `Wgpu::set_route_ahead`): the MoE
/// router folded into the decode projection before it (matmul_q_add_ahead: gemv_q6 omode 4;
/// then moe_step_add with RouterScratch::ahead: xq_route.wgsl q2x_stage_ahead in place of
/// q2x_stage + the router's gemv_q6), against the same device's two ops without the fold, at the
/// model's shapes (out_proj 4-bit [2048, 4096]). Three tokens in a row on one device, so sums
/// left over from one token would show in the next.
/// * h after the projection and x: bit-equal (the same add; q2x_stage's norm, the same code).
/// * The logits and the shared gate's logit against the fold's maths in f64 (x̃ = h·rr·w, A_e =
///   Σ_k |R_ek·x̃_k|): within F32_TOL·A_e + 1e-6 (f32 sums; the 2^-32 fixed point and its
///   conversion back, ~3e-8 before the scale, hence the floor). The router reads x in q2x's two
///   int8 levels (each element within max |x| / 64,516 of its word): the two differ by far
///   less than A_e / 256, which is checked.
/// * The route equals the CPU's moe_route of the fold's logits (weights to 1e-6), and the MoE
///   output is within MOE_TOL of the CPU's on the fold's x, route and shared logit.
#[test]
fn route_ahead_matches_the_router() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(91);
    let c = AheadCase::new(&g, &mut rng);
    let (d, hid, inner) = (&c.d, c.d.hidden, 4096);
    let (router, sgate, nw, gwo) = (&c.router, &c.sgate, &c.nw, &c.gwo);
    let next = c.next();
    g.set_xq_ahead(false);
    g.set_route_ahead(true);
    if !g.route_ahead(gwo, &next) {
        g.set_route_ahead(false);
        println!("route_ahead: this adapter does not fold (no gemv_q6): skipped");
        return;
    }
    for token in 0..3 {
        let hv = rng.vec(hid, 0.05);
        let xv = rng.vec(inner, 0.05);
        let gx = g.upload(&xv).unwrap();
        let (off_h, off) = c.run(&g, &hv, &gx, false);
        let (on_h, on) = c.run(&g, &hv, &gx, true);
        let what = format!("route_ahead, token {token}");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&on_h), bits(&off_h), "{what}: h after the projection");
        assert_eq!(bits(&on.x), bits(&off.x), "{what}: x");
        check_fold_logits(
            &what,
            &on_h,
            nw,
            d.eps,
            router,
            sgate,
            (&on.logits, on.s),
            (&off.logits, off.s),
            F32_TOL,
        );
        c.check_block(&on, &on_h, &on.x, &what);
    }
    g.set_route_ahead(false);
}

/// Opt-in `LILY_WGPU_XQ_AHEAD` (Backend::route_ahead; `Wgpu::set_xq_ahead`): the MoE block's x
/// staged by the decode projection before it (matmul_q_add_ahead: gemv_q6s omode 5 stages h · w
/// without the norm's 1 / rms, with its workgroups' partial sums of squares), read by the
/// router's gemv_q6s (Q6_RNG) and moe_gate_up_y (MY_RN), which apply the 1 / rms; against the
/// same device's ops without it, at the model's shapes, three tokens in a row on one device.
/// * h after the projection within F32_TOL of without: the same products, summed in another
///   order (omode 5 takes 32 rows a workgroup, so its teams are narrower).
/// * The logits and the shared gate's logit against the exact maths in f64 (x̃ = h·rr·w, A_e =
///   Σ_k |R_ek·x̃_k|) within A_e / 4096 + 1e-6 (`logit_err_q2x`), and the router's without it
///   too: x is read in q2x's two int8 levels either way, scaled by rr before or after
///   quantizing, so the two differ in rounding only (lavapipe: 0.7-1.5e-2 of the bound both).
/// * The route equals the CPU's moe_route of the staged path's logits (weights to 1e-6), and
///   the MoE output is within MOE_TOL of the CPU's on the CPU's rms_norm(h)·w (the staged path
///   writes no xn), its route and its shared logit.
/// * Launches: one fewer than without (no q2x_stage before the router).
///
/// With `LILY_WGPU_XQ_AHEAD=fold` (`Wgpu::set_xq_fold`) the projection also writes its
/// workgroups' dots of every router row (gemv_q6s omode 6) and moe_gate_up_y (MY_FOLD) adds
/// them into the logits: the same checks (the logits now from x in f32, well inside the q2x
/// bound), and two launches fewer than without (no q2x_stage, no router).
#[test]
fn xq_ahead_matches_the_block() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(93);
    let c = AheadCase::new(&g, &mut rng);
    let (d, hid, inner) = (&c.d, c.d.hidden, 4096);
    let (router, sgate, nw, gwo) = (&c.router, &c.sgate, &c.nw, &c.gwo);
    let next = c.next();
    g.set_xq_ahead(true);
    if !g.route_ahead(gwo, &next) {
        g.set_xq_ahead(false);
        println!("xq_ahead: this adapter does not stage ahead (no gemv_q6s): skipped");
        return;
    }
    for (fold, token) in [false, true]
        .into_iter()
        .flat_map(|f| (0..3).map(move |t| (f, t)))
    {
        g.set_xq_fold(fold);
        let hv = rng.vec(hid, 0.05);
        let xv = rng.vec(inner, 0.05);
        let gx = g.upload(&xv).unwrap();
        let (off_h, off) = c.run(&g, &hv, &gx, false);
        let (on_h, on) = c.run(&g, &hv, &gx, true);
        let what = format!("xq_ahead{}, token {token}", if fold { " fold" } else { "" });
        // The projection's sums: the same products in another order (32 rows a workgroup).
        let proj = |v: &[f32]| v.iter().zip(&hv).map(|(a, b)| a - b).collect::<Vec<_>>();
        check(
            &format!("{what} (the projection, against without)"),
            rel_rows(&proj(&on_h), &proj(&off_h), hid),
            F32_TOL,
        );
        let fewer = if fold { 2 } else { 1 };
        assert_eq!(on.launches + fewer, off.launches, "{what}: launches");
        for (name, got) in [("staged ahead", &on), ("the router's", &off)] {
            let worst = logit_err_q2x(&on_h, nw, d.eps, router, sgate, (&got.logits, got.s));
            // The fold's logits come from x in f32 (lavapipe: ~1e-4 of the q2x bound): a
            // hundredth of it still fails a fold that read x quantized or summed a row short.
            let tol = if fold && name == "staged ahead" {
                1e-2
            } else {
                1.0
            };
            check(
                &format!("{what} ({name} logits against f64, / bound)"),
                worst as f32,
                tol,
            );
        }
        // The staged path writes no xn: the CPU's x is rms_norm(h)·w.
        let mut cx = vec![0f32; hid];
        Cpu.rms_norm(&on_h, nw, 1, hid, d.eps, &mut cx);
        c.check_block(&on, &on_h, &cx, &what);
    }
    g.set_xq_fold(false);
    g.set_xq_ahead(false);
}

/// `LILY_WGPU_Q6W=2` (`Wgpu::set_q6w`): the router's launch by gemv_q6w, which stages
/// rms_norm(h) · w in each workgroup without the 1 / rms and exports the first workgroup's
/// staging to gate|up (moe_gate_up_y with MY_RN, as after a projection that staged x ahead),
/// against the same device's block without it, at the model's shapes, three tokens in a row.
/// * Launches: one fewer (no q2x_stage before the router); with `1` (the projections alone)
///   the same as without.
/// * The logits and the shared gate's logit against the exact maths in f64 within
///   `logit_err_q2x`'s bound, for both paths.
/// * The route equals the CPU's moe_route of its logits, and the MoE output is within MOE_TOL
///   of the CPU's on rms_norm(h)·w (gemv_q6w writes no xn).
///
/// Then with the launch by gemv_rt (`LILY_WGPU_ROUTER`, `Wgpu::set_router_rows`: x in f32,
/// not staged; 1, 2 and 3 rows a workgroup): the same launches as gemv_q6w's, the logits
/// within a hundredth of that bound (x in f32: a router that read x quantized, or a row short,
/// fails it), and the block's checks (gate|up reads its exported staging; another x exported
/// by gemv_q6w just before, so every word must be written again).
#[test]
fn q6w_router_matches_the_block() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(94);
    let c = AheadCase::new(&g, &mut rng);
    let d = &c.d;
    let gm = &c.gm;
    let w = moe_weights(
        &c.grt,
        &c.gsg,
        [&gm[0], &gm[1], &gm[2], &gm[3], &gm[4], &gm[5]],
    );
    // gemv_q6w's launch first, whatever the environment says (`LILY_WGPU_ROUTER`).
    g.set_router_rows(0);
    for token in 0..3 {
        let hv = rng.vec(d.hidden, 0.05);
        let mut runs = Vec::new();
        for level in [0, 1, 2] {
            g.set_q6w(level);
            runs.push(gpu_step(&g, true, &hv, &c.gnw, &w, d, 512, false));
        }
        g.set_q6w(0);
        let what = format!("q6w router, token {token}");
        let (off, on) = (&runs[0], &runs[2]);
        println!(
            "{what}: launches {} / {} / {} (Q6W 0 / 1 / 2)",
            off.launches, runs[1].launches, on.launches
        );
        assert_eq!(
            runs[1].launches, off.launches,
            "{what}: launches with Q6W=1"
        );
        let takes = g.moe_xq_takes(d.hidden, 512, d.top_k).0 && fusable(&g);
        if takes && g.gemv_launches(&[&c.grt, &c.gsg]) == 2 {
            assert_eq!(on.launches + 1, off.launches, "{what}: launches");
        }
        for (name, got) in [("gemv_q6w", on), ("q2x_stage + gemv_q6s", off)] {
            let worst = logit_err_q2x(&hv, &c.nw, d.eps, &c.router, &c.sgate, (&got.logits, got.s));
            check(
                &format!("{what} ({name} logits against f64, / bound)"),
                worst as f32,
                1.0,
            );
        }
        let mut cx = vec![0f32; d.hidden];
        Cpu.rms_norm(&hv, &c.nw, 1, d.hidden, d.eps, &mut cx);
        c.check_block(on, &hv, &cx, &what);
        if !g.report().subgroups {
            continue;
        }
        // Another token's x exported first, so that a word gemv_rt leaves unwritten shows.
        let hother: Vec<f32> = hv.iter().rev().map(|x| -0.5 * x).collect();
        for rows in 1..=3 {
            g.set_q6w(2);
            gpu_step(&g, true, &hother, &c.gnw, &w, d, 512, false);
            g.set_router_rows(rows);
            let built = g.pipelines_built();
            let rt = gpu_step(&g, true, &hv, &c.gnw, &w, d, 512, false);
            let ran = g.pipelines_built() > built || token > 0;
            g.set_router_rows(0);
            g.set_q6w(0);
            let what = format!("{what}, gemv_rt with {rows} rows a workgroup");
            assert!(ran, "{what}: built no pipeline of its own");
            assert_eq!(rt.launches, on.launches, "{what}: launches");
            let worst = logit_err_q2x(&hv, &c.nw, d.eps, &c.router, &c.sgate, (&rt.logits, rt.s));
            check(
                &format!("{what} (logits against f64, / bound)"),
                worst as f32,
                1e-2,
            );
            c.check_block(&rt, &hv, &cx, &what);
        }
    }
}

/// The worst |logit − exact| / (A_e / 4096 + 1e-6) over the router's rows and the shared gate's
/// (x̃ = h·rr·w in f64, A_e = Σ_k |R_ek·x̃_k|): a bound a router reading x in q2x's two int8
/// levels keeps (each element within max |x| / 64,516 of its word: A_e / 4096 allows a word's
/// max 16× its mean); a 1/rms off by 1% breaks it.
fn logit_err_q2x(
    hm: &[f32],
    nw: &[f32],
    eps: f32,
    router: &HostLinear,
    sgate: &HostLinear,
    got: (&[f32], f32),
) -> f64 {
    let rows = (0..router.out)
        .map(|i| (router, i, got.0[i]))
        .chain(std::iter::once((sgate, 0, got.1)));
    norm_rows_err_q2x(hm, nw, eps, rows)
}

/// `logit_err_q2x`'s figure over any rows (matrix, row, the device's value) of a projection of
/// x = rms_norm(h) · nw.
fn norm_rows_err_q2x<'a>(
    hm: &[f32],
    nw: &[f32],
    eps: f32,
    rows: impl Iterator<Item = (&'a HostLinear, usize, f32)>,
) -> f64 {
    let xt = ops::normed_f64(hm, nw, eps);
    let mut row = vec![0f32; hm.len()];
    let mut worst = 0f64;
    for (mat, i, g) in rows {
        let (exact, a) = ops::row_exact(mat, i, &xt, &mut row);
        worst = worst.max((g as f64 - exact).abs() / (a / 4096.0 + 1e-6));
    }
    worst
}

/// Opt-in `LILY_WGPU_XQ_AHEAD` (Backend::norm_ahead): the MoE block's down (moe_xq.wgsl
/// moe_down_ys) stages the next op's x = rms_norm(h) · w without the 1 / rms (its partial sums
/// of squares after the row), and `rms_norm_matmul_ahead` reads it (gemv_q6s with Q6_RNG, no
/// q2x_stage), against moe_step_add without it then `rms_norm_matmul`, at the model's shapes
/// (the next projections 4-bit [1024, 2048] and 8-bit [64, 2048] in one launch), three tokens
/// in a row on one device.
/// * The MoE output within F32_TOL of without (moe_down_ys sums as moe_down_y does; NVIDIA's
///   compiler may contract differently, as moe_y_specialised_equals_the_y_kernels found).
/// * The projections against the exact maths in f64 within A_e / 4096 + 1e-6 (`logit_err_q2x`'s
///   bound for a reader of q2x's two int8 levels), for both paths.
/// * Launches: one fewer (no q2x_stage before the projections).
#[test]
fn norm_ahead_matches_the_norm() {
    let Some(g) = gpu() else { return };
    let d = qwen_dims();
    let (e, hid, width) = (d.n_experts, d.hidden, 512);
    let mut rng = Rng(95);
    let router = rand_quant(&mut rng, 1, e, hid, 8, 64, false);
    let sgate = rand_quant(&mut rng, 1, 1, hid, 8, 64, false);
    let m = rand_moe(&mut rng, e, width, hid, 4);
    let gm = upload6(&g, [&m[0], &m[1], &m[2], &m[3], &m[4], &m[5]]);
    let (grt, gsg) = (
        g.upload_mat(&router).unwrap(),
        g.upload_mat(&sgate).unwrap(),
    );
    let nw: Vec<f32> = (0..hid).map(|_| 1.0 + 0.1 * rng.f()).collect();
    let next: Vec<f32> = (0..hid).map(|_| 1.0 + 0.1 * rng.f()).collect();
    let (gnw, gnext) = (g.upload_vec(&nw).unwrap(), g.upload_vec(&next).unwrap());
    let pa = rand_quant(&mut rng, 1, 1024, hid, 4, 64, false);
    let pb = rand_quant(&mut rng, 1, 64, hid, 8, 64, false);
    let (gpa, gpb) = (g.upload_mat(&pa).unwrap(), g.upload_mat(&pb).unwrap());
    let mut w = moe_weights(&grt, &gsg, [&gm[0], &gm[1], &gm[2], &gm[3], &gm[4], &gm[5]]);
    g.set_xq_ahead(true);
    if !g.norm_ahead(&w, &gnext, &d) {
        g.set_xq_ahead(false);
        println!("norm_ahead: this adapter does not stage the next x (no moe_down_ys): skipped");
        return;
    }
    for token in 0..3 {
        let hv = rng.vec(hid, 0.05);
        let what = format!("norm_ahead, token {token}");
        let mut run = |ahead: bool| -> (StepOut, Vec<f32>, Vec<f32>, u64) {
            w.next_norm = ahead.then_some(&gnext);
            let step = gpu_step(&g, true, &hv, &gnw, &w, &d, width, false);
            let gh = g.upload(&step.h).unwrap();
            let (mut xn, mut oa, mut ob) = (
                g.zeros(hid).unwrap(),
                g.zeros(pa.out).unwrap(),
                g.zeros(pb.out).unwrap(),
            );
            g.sync().unwrap();
            let n0 = g.dispatches();
            let (ws, mut outs) = ([&gpa, &gpb], [&mut oa, &mut ob]);
            if ahead {
                g.rms_norm_matmul_ahead(&gh, &gnext, hid, d.eps, &mut xn, &ws, &mut outs);
            } else {
                g.rms_norm_matmul(&gh, &gnext, 1, hid, d.eps, &mut xn, &ws, &mut outs);
            }
            let launches = g.dispatches() - n0;
            (step, h(&g, &oa, pa.out), h(&g, &ob, pb.out), launches)
        };
        let (off, off_a, off_b, off_n) = run(false);
        let (on, on_a, on_b, on_n) = run(true);
        let moe = |v: &[f32]| v.iter().zip(&hv).map(|(a, b)| a - b).collect::<Vec<_>>();
        check(
            &format!("{what} (MoE output, against without)"),
            rel_rows(&moe(&on.h), &moe(&off.h), hid),
            F32_TOL,
        );
        assert_eq!(on_n + 1, off_n, "{what}: launches");
        for (name, a, b) in [("staged ahead", &on_a, &on_b), ("normed", &off_a, &off_b)] {
            let rows = (0..pa.out)
                .map(|i| (&pa, i, a[i]))
                .chain((0..pb.out).map(|i| (&pb, i, b[i])));
            let worst = norm_rows_err_q2x(&on.h, &next, d.eps, rows);
            check(
                &format!("{what} ({name}: against f64, / bound)"),
                worst as f32,
                1.0,
            );
        }
    }
    g.set_xq_ahead(false);
}

/// The y-kernel tests' stacks (experts, hidden, width, top-k, renormalised): the model's, and
/// two other 4-bit shapes (hidden 512, 16 experts, top-1; hidden 1024, 32 experts, top-4).
const Y_SHAPES: [(usize, usize, usize, usize, bool); 3] = [
    (256, 2048, 512, 8, true),
    (16, 512, 128, 1, true),
    (32, 1024, 256, 4, false),
];

/// One of `Y_SHAPES` on the device: its dims, the 4-bit experts and shared expert (upload6's
/// order), the 8-bit router and shared gate, the norm's weights, and the case's name.
struct YCase {
    d: Dims,
    width: usize,
    gm: Vec<WM>,
    router: WM,
    sgate: WM,
    gnw: WB,
    what: String,
}

/// The model's dims with another MoE block: e experts of hidden `hid`, top-k, the top-k's
/// weights renormalised or not.
fn moe_dims(e: usize, hid: usize, k: usize, norm: bool) -> Dims {
    Dims {
        hidden: hid,
        n_experts: e,
        top_k: k,
        norm_topk: norm,
        ..qwen_dims()
    }
}

fn y_case(g: &Wgpu, rng: &mut Rng, shape: (usize, usize, usize, usize, bool)) -> YCase {
    let (e, hid, width, k, norm) = shape;
    let d = moe_dims(e, hid, k, norm);
    let m = rand_moe(rng, e, width, hid, 4);
    let gm = upload6(g, [&m[0], &m[1], &m[2], &m[3], &m[4], &m[5]]);
    let router = g
        .upload_mat(&rand_quant(rng, 1, e, hid, 8, 64, false))
        .unwrap();
    let sgate = g
        .upload_mat(&rand_quant(rng, 1, 1, hid, 8, 64, false))
        .unwrap();
    let gnw = g
        .upload_vec(&(0..hid).map(|_| 1.0 + 0.1 * rng.f()).collect::<Vec<_>>())
        .unwrap();
    YCase {
        d,
        width,
        gm,
        router,
        sgate,
        gnw,
        what: format!("{e}×[{width}, {hid}] top-{k}"),
    }
}

/// A route of one token from random logits (moe_route on the device), for moe_decode_add.
fn random_route(g: &Wgpu, rng: &mut Rng, d: &Dims) -> <Wgpu as Backend>::Route {
    let logits = g.upload(&rng.vec(d.n_experts, 2.0)).unwrap();
    let mut r = g.new_route(1, d.top_k).unwrap();
    g.moe_route(&logits, d, 1, &mut r);
    r
}

/// `LILY_WGPU_MOE_ACT=down16` (the default; `Wgpu::set_moe_act`): act staged by moe_down_y2q in
/// workgroup memory from gate|up's f32 values (gate|up without its barrier and quantizing, on
/// half the outputs a workgroup where a team has two or more: 16 at hidden 2048 and 1024, 32
/// at 512 as before), against act staged by gate|up (`gate`), the y pair specialised with
/// moe_down_y2, at the model's shapes and two other 4-bit stacks. The staging is the same
/// function of the same f32 values and down's sums the same, so the route must be the same and
/// h within F32_TOL (each pipeline is compiled apart, so its a·b + c pairs may contract
/// differently: said whether bit-equal). A staged row, word or layout off moves h by O(1)
/// (checked: the act rows' base without the factor 5 fails it). down16 must build pipelines of
/// its own (it did not fall back to gate's).

#[test]
fn moe_act_staged_by_down_equals_gate_ups() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(85);
    set_xq(&g, 4, "32,16,2");
    g.set_spec("moe").unwrap();
    g.set_moe_down("y2").unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for shape in Y_SHAPES {
        let c = y_case(&g, &mut rng, shape);
        let (d, gm, gnw, what) = (c.d, &c.gm, &c.gnw, &c.what);
        let (hid, width) = (d.hidden, c.width);
        let w = moe_weights(
            &c.router,
            &c.sgate,
            [&gm[0], &gm[1], &gm[2], &gm[3], &gm[4], &gm[5]],
        );
        // down16 first: gate's run leaves act's f32 rows in the shared scratch, which would
        // hide a gate|up workgroup down16 did not launch (checked: it did).
        let hv = rng.vec(hid, 0.05);
        g.set_moe_act("down16").unwrap();
        let built = g.pipelines_built();
        let o = gpu_step(&g, true, &hv, gnw, &w, &d, width, false);
        assert!(
            g.pipelines_built() > built,
            "{what}: MOE_ACT=down16 built no pipeline of its own"
        );
        g.set_moe_act("gate").unwrap();
        let a = gpu_step(&g, true, &hv, gnw, &w, &d, width, false);
        assert_eq!(o.ids, a.ids, "{what}: ids with MOE_ACT=down16");
        assert_eq!(bits(&o.w), bits(&a.w), "{what}: weights with down16");
        check(
            &format!("{what}: h with MOE_ACT=down16"),
            rel_rows(&o.h, &a.h, hid),
            F32_TOL,
        );
        eprintln!(
            "{what}: h with MOE_ACT=down16 bit-equal to gate's: {}",
            bits(&o.h) == bits(&a.h)
        );
        // The route given (moe_decode_add: gate|up reads the ids).
        let xv = rng.vec(hid, 1.0);
        let route = random_route(&g, &mut rng, &d);
        let gmr = [&gm[0], &gm[1], &gm[2], &gm[3], &gm[4], &gm[5]];
        g.set_moe_act("down16").unwrap();
        let o = gpu_decode(&g, true, &xv, &route, gmr, 0.4, &d).0;
        g.set_moe_act("gate").unwrap();
        let a = gpu_decode(&g, true, &xv, &route, gmr, 0.4, &d).0;
        check(
            &format!("{what}: moe_decode_add with MOE_ACT=down16"),
            rel_rows(&o, &a, hid),
            F32_TOL,
        );
    }
    g.set_spec("").unwrap();
    g.set_moe_down("y").unwrap();
}

/// The y kernels' settings the test runs: (specialised, `LILY_WGPU_MOE_DOWN`); the first is
/// the reference, the second moe_down_y with its constants.
const DOWNS: [(bool, &str); 3] = [(false, "y"), (true, "y"), (true, "y2")];

/// `LILY_WGPU_SPEC` moe (`Wgpu::set_spec`): moe_gate_up_y and moe_down_y specialised to their
/// launch by pipeline constants (moe_xq.wgsl MY_*), against the same kernels reading the
/// parameter block, on one device, at the model's shapes and on two other 4-bit stacks (hidden
/// 512, 16 experts, top-1, renormalised; hidden 1024, 32 experts, top-4, not). x, the logits
/// and the route through moe_step_add (the route in gate|up) must be the same bits. h and the
/// MoE output through moe_decode_add (the route given) within F32_TOL: the arithmetic is the
/// same, but with the trip counts constant NVIDIA's compiler unrolls moe_down_y's sums and
/// contracts other a·b + c pairs into FMAs (the H200, stop 38: h a few ulps off; lavapipe
/// bit-equal). A constant in the wrong place (a group size, k, the width) moves the outputs by
/// O(1). moe_down_y2 (`LILY_WGPU_MOE_DOWN` y2, the default) likewise against the unspecialised
/// kernels (with `LILY_WGPU_MOE_ACT`'s default: act staged by moe_down_y2q).
#[test]
fn moe_y_specialised_equals_the_y_kernels() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(84);
    set_xq(&g, 4, "32,16,2");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for shape in Y_SHAPES {
        let c = y_case(&g, &mut rng, shape);
        let (d, gm, gnw, what) = (c.d, &c.gm, &c.gnw, &c.what);
        let (hid, width) = (d.hidden, c.width);
        let w = moe_weights(
            &c.router,
            &c.sgate,
            [&gm[0], &gm[1], &gm[2], &gm[3], &gm[4], &gm[5]],
        );
        for token in 0..2 {
            let hv = rng.vec(hid, 0.05);
            let mut out = Vec::new();
            for (spec, down) in DOWNS {
                g.set_spec(if spec { "moe" } else { "" }).unwrap();
                g.set_moe_down(down).unwrap();
                out.push(gpu_step(&g, true, &hv, gnw, &w, &d, width, false));
            }
            g.set_spec("").unwrap();
            g.set_moe_down("y").unwrap();
            let (a, b) = (&out[0], &out[1]);
            assert_eq!(bits(&b.x), bits(&a.x), "{what} token {token}: x");
            assert_eq!(
                bits(&b.logits),
                bits(&a.logits),
                "{what} token {token}: logits"
            );
            assert_eq!(b.ids, a.ids, "{what} token {token}: ids");
            assert_eq!(bits(&b.w), bits(&a.w), "{what} token {token}: weights");
            check(
                &format!("{what} token {token}: h specialised"),
                rel_rows(&b.h, &a.h, hid),
                F32_TOL,
            );
            // moe_down_y2: moe_down_y's sums in its order, so h within F32_TOL of the
            // kernels without constants, and said whether bit-equal to moe_down_y's with them.
            for (o, (_, down)) in out.iter().zip(DOWNS).skip(2) {
                check(
                    &format!("{what} token {token}: h by moe_down_y2 {down}"),
                    rel_rows(&o.h, &a.h, hid),
                    F32_TOL,
                );
                assert_eq!(o.ids, a.ids, "{what} token {token}: ids with {down}");
                eprintln!(
                    "{what} token {token}: moe_down_y2 {down} bit-equal to moe_down_y: {}",
                    bits(&o.h) == bits(&b.h)
                );
            }
            // The route given: moe_decode_add (gate|up reads the ids).
            let xv = rng.vec(hid, 1.0);
            let route = random_route(&g, &mut rng, &d);
            let gmr = [&gm[0], &gm[1], &gm[2], &gm[3], &gm[4], &gm[5]];
            let mut dec = Vec::new();
            for (spec, down) in DOWNS {
                g.set_spec(if spec { "moe" } else { "" }).unwrap();
                g.set_moe_down(down).unwrap();
                dec.push(gpu_decode(&g, true, &xv, &route, gmr, 0.4, &d).0);
            }
            g.set_spec("").unwrap();
            g.set_moe_down("y").unwrap();
            for (o, (_, down)) in dec.iter().zip(DOWNS).skip(1) {
                check(
                    &format!("{what} token {token}: moe_decode_add specialised, down {down}"),
                    rel_rows(o, &dec[0], hid),
                    F32_TOL,
                );
            }
        }
    }
}
