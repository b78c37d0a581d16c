//! The MoE block: routing (softmax, top-k) and the routed experts (shaders/moe.wgsl;
//! cpu/moe.rs is the twin).
//!
//! `moe_experts` picks one of four paths by the block's rows and the stacks' layout:
//! - rows < `GEMM_FROM` (decode, short blocks): `moe_gate_up_v` writes each slot's activation
//!   `silu(gate_e(x_t)) · up_e(x_t)` into the scratch `moe.act` `[rows, k, width]`, then
//!   `moe_down_v` runs each token's k down projections and sums them, weighted, in slot order
//!   into `out` (the CPU's order). Each slot streams its expert's rows with 16-byte loads.
//! - rows ≥ `GEMM_FROM`: a grouped GEMM. `moe_sort` lists each expert's slots and a table of
//!   tiles of ≤ 32 of them (scratch `moe.sort`, on the device: no read-back), `moe_gate_up_mm`
//!   and `moe_down_mm` run each tile against its expert's weights (read once a tile, dequantized
//!   once into workgroup memory), `moe_down_mm` writes each slot's `y` (`moe.y`) and
//!   `moe_combine` sums a token's slots in order. The grid is sized by a bound on the tiles
//!   (slots / 32 + experts); workgroups past the table's count return at once.
//! - Layouts the fast entries do not take (dense stacks, rows that are not whole vec4s of
//!   codes, groups that split a vec4, odd widths) run the first versions: a slot a workgroup
//!   reading words one by one (`moe_gate_up`, `moe_down`), or for blocks of ≥ `GROUPED_FROM`
//!   rows grouped by expert (`moe_gate_up_grouped`, `moe_down_grouped`, `moe_combine`).
//!
//! Beside it, `moe_decode_shared` runs one decode token's block with its shared expert (the
//! wgpu moe_decode_add and moe_step_add, where `shared_slot_ok`): moe_gate_up_s with the shared
//! expert as slot k (routing the token itself from the logits for moe_step_add), then
//! moe_down_s summing the slots, the shared one gated, into h: 2 launches where the first path
//! and the shared expert's two GEMVs take 4 (5 with moe_route).

use anyhow::{bail, Result};

use super::device::{Ctx, Shader};
use super::{WBuf, WMat, WRoute, Wgpu};
use crate::backend::{Dims, SharedExpert};

pub const SHADER: Shader = Shader {
    name: "moe",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/quant.wgsl"),
        include_str!("shaders/q2x.wgsl"),
        include_str!("shaders/moe.wgsl"),
        include_str!("shaders/moe_step.wgsl")
    ),
};

/// moe_xq.wgsl: moe_gate_up_x and moe_down_x (`moe_decode_shared` with `LILY_WGPU_MOE_XQ`),
/// with moe.wgsl and moe_step.wgsl (the parameter block, bindings, helpers) and q2x_sg.wgsl:
/// a module of its own, made only on adapters with subgroups.
pub const XQ_SHADER: Shader = Shader {
    name: "moe_xq",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/quant.wgsl"),
        include_str!("shaders/q2x.wgsl"),
        include_str!("shaders/q2x_sg.wgsl"),
        include_str!("shaders/moe.wgsl"),
        include_str!("shaders/moe_step.wgsl"),
        include_str!("shaders/moe_xq.wgsl")
    ),
};

/// moe_mm.wgsl: the grouped GEMMs with an 8 × 8 micro-tile a thread (`mm8_ok`).
pub const MM8_SHADER: Shader = Shader {
    name: "moe_mm",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/quant.wgsl"),
        include_str!("shaders/moe_mm.wgsl")
    ),
};

/// The most experts `moe_route` takes (its probabilities sit in workgroup memory).
const MAX_EXPERTS: usize = 2048;
/// The most experts a token chooses (`moe_route`'s workgroup array of the chosen ids).
const MAX_TOP_K: usize = 64;
/// Outputs a workgroup of `moe_gate_up` / `moe_down` computes.
const GATE_UP_OUTS: usize = 8;
const DOWN_OUTS: usize = 32;
/// Fallback layouts only: rows from which a block's experts run grouped by expert
/// (moe_gate_up_grouped, moe_down_grouped, moe_combine).
const GROUPED_FROM: usize = 4;
/// Rows from which a block runs as a grouped GEMM (moe_sort, moe_gate_up_mm, moe_down_mm,
/// moe_combine). Below it a slot a workgroup wins: a GEMM tile of an expert chosen once or
/// twice in the block still dequantizes the whole weight tile and runs 8 rows of arithmetic
/// (a warp's), while the slot kernels stream only the bytes; at 64 rows ~220 of 256 experts are
/// chosen, ~2.3 rows each, where the two cost about the same.
const GEMM_FROM: usize = 64;
/// Rows of a GEMM tile (moe.wgsl TM).
const TM: usize = 32;
/// The most experts moe_sort lists (its counters sit in workgroup memory).
const MAX_SORT_EXPERTS: usize = 1024;
/// Floats of act rows moe_down_v stages at a time (moe.wgsl stg: 16 KB of its 17, the rest
/// its slots' padding).
const DOWN_STAGE: usize = 4096;

/// Floats of act rows moe_down_s stages at a time: k + 1 = 9 rows of width 512 whole
/// (moe.wgsl STG_LEN = 9 · (128 + DOWN_PAD) vec4s).
const DOWN_STAGE_S: usize = 4608;
/// Storage buffers moe_gate_up_s binds (moe.wgsl's header).
const S_BUFFERS: u32 = 17;
/// Workgroup memory moe_gate_up_s (q2x's 16 KB, red, red2, rkey_s, rtop: 19.3 KB) and
/// moe_down_s (stg, red: 19.6 KB) use at most.
const S_WG_BYTES: u32 = 20 * 1024;
/// Storage buffers moe_gate_up_x binds (moe_gate_up_s's and the staged act).
const X_BUFFERS: u32 = 18;
/// Outputs of a slot a moe_gate_up_x workgroup computes (one 4-bit word of act).
const X_OUTS: usize = 32;

/// The most experts moe_gate_up_s routes (a thread an expert).
pub(super) const S_MAX_EXPERTS: usize = 256;

/// moe.wgsl's parameter block: two matrices, then rows, k, experts, norm_topk, outs, cw, tiles.
#[allow(clippy::too_many_arguments)]
fn params(
    m: [u32; 8],
    m2: [u32; 8],
    rows: usize,
    k: usize,
    n_exp: usize,
    norm: bool,
    outs: usize,
    cw: usize,
    tiles: usize,
) -> Vec<u32> {
    let mut p = Vec::with_capacity(24);
    p.extend(m);
    p.extend(m2);
    p.extend([rows as u32, k as u32, n_exp as u32, norm as u32]);
    p.extend([outs as u32, cw as u32, tiles as u32, 0]);
    p
}

/// Whether moe_gate_up_v / moe_down_v read these stacks: 2, 4 or 8 bits (gate and up alike),
/// rows and groups whole vec4s of codes.
fn vec_ok(gate: &WMat, up: &WMat, down: &WMat) -> bool {
    gate.bits == up.bits
        && [gate, up, down].iter().all(|m| {
            let epv = match m.bits {
                2 | 4 | 8 => 128 / m.bits as usize,
                _ => return false,
            };
            m.inp.is_multiple_of(epv) && m.gs.is_multiple_of(epv)
        })
}

/// Whether moe_gate_up_mm / moe_down_mm read these stacks: 2, 4 or 8 bits, groups of a multiple
/// of 16 (a thread's 16 staged codes share a scale), inputs a multiple of TK = 32, whole output
/// tiles (64 of width, 128 of hidden).
fn mm_ok(gate: &WMat, up: &WMat, down: &WMat) -> bool {
    [gate, up, down]
        .iter()
        .all(|m| matches!(m.bits, 2 | 4 | 8) && m.gs.is_multiple_of(16) && m.inp.is_multiple_of(32))
        && gate.out.is_multiple_of(64)
        && down.out.is_multiple_of(128)
        && gate.n <= MAX_SORT_EXPERTS
}

/// Whether moe_gate_up_mm8 / moe_down_mm8 read these stacks (besides `mm_ok`): with
/// `LILY_WGPU_MOE_MM=mm8`, 4- or 8-bit codes, whole output blocks (128 of width, 256 of hidden).
fn mm8_ok(ctx: &Ctx, gate: &WMat, up: &WMat, down: &WMat) -> bool {
    ctx.sw.moe_mm8.load(std::sync::atomic::Ordering::Relaxed)
        && [gate, up, down].iter().all(|m| matches!(m.bits, 4 | 8))
        && gate.out.is_multiple_of(128)
        && down.out.is_multiple_of(256)
}

pub fn moe_route(ctx: &Ctx, logits: &WBuf, d: &Dims, rows: usize, route: &mut WRoute) {
    let (e, k) = (d.n_experts, d.top_k);
    if e == 0 || e > MAX_EXPERTS || k == 0 || k > e || k > MAX_TOP_K {
        ctx.fail(format!(
            "moe_route: top-{k} of {e} experts (the wgpu kernel takes 1 ≤ k ≤ {MAX_TOP_K}, k ≤ experts ≤ {MAX_EXPERTS})"
        ));
        return;
    }
    if route.k != k || route.rows < rows || logits.len < rows * e {
        ctx.fail(format!(
            "moe_route: {rows} rows of {e} logits, top-{k}: the logits hold {}, the route {} rows of {}",
            logits.len, route.rows, route.k
        ));
        return;
    }
    let groups = match u32::try_from(rows) {
        Ok(g) => g,
        Err(_) => {
            ctx.fail(format!(
                "moe_route: {rows} rows are too many for one launch"
            ));
            return;
        }
    };
    ctx.dispatch(
        &SHADER,
        "moe_route",
        &params([0; 8], [0; 8], rows, k, e, d.norm_topk, 0, 0, 0),
        &[&logits.buf, &route.ids, &route.weights],
        groups,
    );
}

/// Why the wgpu experts kernels cannot read `m` (a word of codes must not straddle a group).
fn unreadable(m: &WMat) -> Option<String> {
    if m.bits == 32 {
        return None;
    }
    let per = 32 / m.bits as usize;
    (!m.inp.is_multiple_of(per) || !m.gs.is_multiple_of(per)).then(|| {
        format!(
            "{}-bit codes in groups of {} over {} inputs",
            m.bits, m.gs, m.inp
        )
    })
}

#[allow(clippy::too_many_arguments)]
pub fn moe_experts(
    ctx: &Ctx,
    x: &WBuf,
    route: &WRoute,
    gate: &WMat,
    up: &WMat,
    down: &WMat,
    d: &Dims,
    rows: usize,
    out: &mut WBuf,
) {
    if let Err(e) = experts(ctx, x, route, gate, up, down, d, rows, out) {
        ctx.fail(format!("moe_experts: {e:#}"));
    }
}

#[allow(clippy::too_many_arguments)]
fn experts(
    ctx: &Ctx,
    x: &WBuf,
    route: &WRoute,
    gate: &WMat,
    up: &WMat,
    down: &WMat,
    d: &Dims,
    rows: usize,
    out: &mut WBuf,
) -> Result<()> {
    let (hid, width, n, k) = (gate.inp, gate.out, gate.n, route.k);
    if n == 0
        || up.n != n
        || down.n != n
        || up.out != width
        || up.inp != hid
        || down.out != hid
        || down.inp != width
        || hid != d.hidden
        || n != d.n_experts
    {
        bail!(
            "expert stacks gate {}×[{width}, {hid}], up {}×[{}, {}], down {}×[{}, {}] do not \
             make {} experts of hidden size {}",
            n,
            up.n,
            up.out,
            up.inp,
            down.n,
            down.out,
            down.inp,
            d.n_experts,
            d.hidden
        );
    }
    for (what, m) in [("gate", gate), ("up", up), ("down", down)] {
        if let Some(why) = unreadable(m) {
            bail!("{what}: {why}: not a layout the wgpu kernels read");
        }
    }
    if route.rows < rows || x.len < rows * hid || out.len < rows * hid {
        bail!(
            "{rows} rows of {hid}: the route has {} rows, x {} elements, out {}",
            route.rows,
            x.len,
            out.len
        );
    }
    if rows == 0 || k == 0 {
        // No token, or no expert chosen: the sum is empty.
        if rows > 0 {
            let zeros = ctx.buffer(4 * (rows * hid) as u64)?;
            ctx.copy(&zeros, 0, &out.buf, 0, 4 * (rows * hid) as u64);
        }
        return Ok(());
    }
    let gate_up = [
        &gate.w, &gate.s, &gate.b, &up.w, &up.s, &up.b, &x.buf, &route.ids,
    ];
    let launch = |n: usize| {
        u32::try_from(n)
            .map_err(|_| anyhow::anyhow!("{rows} rows: too many workgroups for one launch"))
    };
    let act = ctx.scratch("moe.act", 4 * (rows * k * width) as u64)?;
    let dq = [&down.w, &down.s, &down.b];
    if rows >= GEMM_FROM && mm_ok(gate, up, down) {
        let slots = rows * k;
        let tiles = slots.div_ceil(TM) + n.min(slots);
        let sort = ctx.scratch("moe.sort", 4 * (1 + 3 * tiles + slots) as u64)?;
        let y = ctx.scratch("moe.y", 4 * (slots * hid) as u64)?;
        let p_up = params(gate.qmat(), up.qmat(), rows, k, n, false, 0, 0, tiles);
        let p_down = params(down.qmat(), [0; 8], rows, k, n, false, 0, 0, tiles);
        // moe_mm.wgsl's 8 × 8 entries where they take the stacks: 128 outputs of gate|up and
        // 256 of down a workgroup (the old: 64 and 128).
        let mm8 = mm8_ok(ctx, gate, up, down);
        let (sh_mm, up_mm, down_mm, wo, ho) = if mm8 {
            (&MM8_SHADER, "moe_gate_up_mm8", "moe_down_mm8", 128, 256)
        } else {
            (&SHADER, "moe_gate_up_mm", "moe_down_mm", 64, 128)
        };
        let g1 = launch(tiles * (width / wo))?;
        let g2 = launch(tiles * (hid / ho))?;
        let g3 = launch((rows * hid).div_ceil(256))?;
        ctx.dispatch(&SHADER, "moe_sort", &p_up, &[&route.ids, &sort], 1);
        ctx.dispatch(
            sh_mm,
            up_mm,
            &p_up,
            &[&gate_up[..7], &[&sort, &act]].concat(),
            g1,
        );
        ctx.dispatch(
            sh_mm,
            down_mm,
            &p_down,
            &[&dq[..], &[&act], &[&sort, &y]].concat(),
            g2,
        );
        ctx.dispatch(
            &SHADER,
            "moe_combine",
            &p_down,
            &[&y, &route.weights, &out.buf],
            g3,
        );
    } else if rows < GEMM_FROM && vec_ok(gate, up, down) {
        // A slot a workgroup for gate and up; down: `outs` outputs of a token for all its
        // slots, 4 lanes a (output, slot) pair, the k act rows staged `cw` columns at a time.
        let outs = (64 / k).max(1);
        let cw = width.min(DOWN_STAGE / k / 64 * 64);
        let mut p_up = params(gate.qmat(), up.qmat(), rows, k, n, false, 0, 0, 0);
        let mut p_down = params(down.qmat(), [0; 8], rows, k, n, false, outs, cw, 0);
        // The parameter block's last word: `lily lab`'s ablation bits (moe.wgsl `ablate`), else 0.
        let ablate = ctx.sw.ablate.load(std::sync::atomic::Ordering::Relaxed);
        for p in [&mut p_up, &mut p_down] {
            if let Some(w) = p.last_mut() {
                *w = ablate;
            }
        }
        let g1 = launch(rows * k * width.div_ceil(GATE_UP_OUTS))?;
        let g2 = launch(rows * hid.div_ceil(outs))?;
        // gate|up by integer dot products against x in two int8 levels (moe_gate_up_q) for 4-
        // and 8-bit codes, unless LILY_WGPU_MOE_Q=0.
        let q =
            matches!(gate.bits, 4 | 8) && ctx.sw.moe_q.load(std::sync::atomic::Ordering::Relaxed);
        ctx.dispatch(
            &SHADER,
            if q { "moe_gate_up_q" } else { "moe_gate_up_v" },
            &p_up,
            &[&gate_up[..], &[&act]].concat(),
            g1,
        );
        ctx.dispatch(
            &SHADER,
            "moe_down_v",
            &p_down,
            &[&dq[..], &[&act], &[&route.ids, &route.weights, &out.buf]].concat(),
            g2,
        );
    } else {
        let p_up = params(gate.qmat(), up.qmat(), rows, k, n, false, 0, 0, 0);
        let p_down = params(down.qmat(), [0; 8], rows, k, n, false, 0, 0, 0);
        if rows < GROUPED_FROM {
            // A slot a workgroup: each reads its expert's rows itself.
            let g1 = launch(rows * k * width.div_ceil(GATE_UP_OUTS))?;
            let g2 = launch(rows * hid.div_ceil(DOWN_OUTS))?;
            ctx.dispatch(
                &SHADER,
                "moe_gate_up",
                &p_up,
                &[&gate_up[..], &[&act]].concat(),
                g1,
            );
            ctx.dispatch(
                &SHADER,
                "moe_down",
                &p_down,
                &[&dq[..], &[&act], &[&route.ids, &route.weights, &out.buf]].concat(),
                g2,
            );
        } else {
            // Grouped by expert: each expert's rows are read once a block; the slots' down
            // outputs go to `y` and are summed in slot order by moe_combine.
            let g1 = launch(n * width.div_ceil(GATE_UP_OUTS))?;
            let g2 = launch(n * hid.div_ceil(DOWN_OUTS))?;
            let g3 = launch((rows * hid).div_ceil(256))?;
            let y = ctx.scratch("moe.y", 4 * (rows * k * hid) as u64)?;
            ctx.dispatch(
                &SHADER,
                "moe_gate_up_grouped",
                &p_up,
                &[&gate_up[..], &[&act]].concat(),
                g1,
            );
            ctx.dispatch(
                &SHADER,
                "moe_down_grouped",
                &p_down,
                &[&dq[..], &[&act], &[&route.ids, &y]].concat(),
                g2,
            );
            ctx.dispatch(
                &SHADER,
                "moe_combine",
                &p_down,
                &[&y, &route.weights, &out.buf],
                g3,
            );
        }
    }
    Ok(())
}

/// Whether moe_gate_up_s / moe_down_s take one token's MoE block: `LILY_WGPU_MOE_FUSE` (and the
/// fused epilogues and moe_gate_up_q it builds on) on; stacks moe_gate_up_q and moe_down_v read
/// (4- or 8-bit, vec_ok) of `d`'s experts and hidden size; a shared expert of one matrix each
/// in exactly the stacks' layout (equal QMat: shape, bits, group size, scale type), so that one
/// parameter block describes both; 1 ≤ k, k + 1 ≤ 64 (moe_down_s's pairs); buffers that hold
/// what the launches touch; an adapter with the storage buffers and workgroup memory they use.
/// Otherwise the caller runs today's sequence (which reports what is wrong, if anything).
#[allow(clippy::too_many_arguments)]
pub fn shared_slot_ok(
    ctx: &Ctx,
    x: &WBuf,
    route: &WRoute,
    gate: &WMat,
    up: &WMat,
    down: &WMat,
    sh: &SharedExpert<'_, Wgpu>,
    d: &Dims,
    h: &WBuf,
) -> bool {
    let hid = gate.inp;
    slot_weights_ok(ctx, gate, up, down, [sh.gate, sh.up, sh.down], d)
        && route.k == d.top_k
        && route.rows >= 1
        && x.len >= hid
        && h.len >= hid
        && sh.logit.len >= 1
}

/// `shared_slot_ok`'s conditions on the switches, the adapter and the weights (the shared
/// expert's gate, up and down in `sh`), without the buffers.
pub fn slot_weights_ok(
    ctx: &Ctx,
    gate: &WMat,
    up: &WMat,
    down: &WMat,
    sh: [&WMat; 3],
    d: &Dims,
) -> bool {
    use std::sync::atomic::Ordering::Relaxed;
    let (hid, width, n, k) = (gate.inp, gate.out, gate.n, d.top_k);
    ctx.sw.moe_fuse.load(Relaxed)
        && ctx.sw.fuse_epilogue
        && ctx.sw.moe_q.load(Relaxed)
        && ctx.report.storage_buffers >= S_BUFFERS
        && ctx.report.workgroup_storage >= S_WG_BYTES
        && matches!(gate.bits, 4 | 8)
        && vec_ok(gate, up, down)
        && n >= 1
        && n == d.n_experts
        && hid == d.hidden
        && [up.n, down.n] == [n, n]
        && [up.out, up.inp, down.out, down.inp] == [width, hid, hid, width]
        && sh.iter().all(|m| m.n == 1)
        && sh[0].qmat() == gate.qmat()
        && sh[1].qmat() == up.qmat()
        && sh[2].qmat() == down.qmat()
        && (1..64).contains(&k)
}

/// Whether moe_gate_up_s can also route the token (`moe_step_add`): at most 256 experts (a
/// thread each), k ≤ E, the logits all there.
pub fn route_fold_ok(d: &Dims, logits: &WBuf) -> bool {
    d.n_experts <= S_MAX_EXPERTS && d.top_k <= d.n_experts && logits.len >= d.n_experts
}

/// Which of moe_xq.wgsl's kernels take the block `moe_decode_shared` runs (`shared_slot_ok`
/// holds): `(gate_up, down)`. `LILY_WGPU_MOE_XQ` (2: both, 1: gate|up), an adapter with ordered
/// subgroups of one width (as gemv_q6, whose staging of x they read; at most 64 subgroups, the
/// route's per-subgroup maxima), the storage buffers moe_gate_up_x binds, hidden and width
/// whole 4-bit words (x's staging; a workgroup's 32 outputs one word of act), and for down its
/// outputs' slots in moe.wgsl's xs (outputs a workgroup · (k + 1) ≤ 2048).
pub fn xq_takes(ctx: &Ctx, hid: usize, width: usize, k: usize) -> (bool, bool) {
    use std::sync::atomic::Ordering::Relaxed;
    let mode = ctx.sw.moe_xq.load(Relaxed);
    let r = &ctx.report;
    let gate = mode >= 1
        && r.subgroups
        && r.subgroup_min == r.subgroup_max
        && r.subgroup_min >= 4
        && r.storage_buffers >= X_BUFFERS
        && hid.is_multiple_of(32)
        && width.is_multiple_of(X_OUTS);
    let (dt, ds) = down_shape(ctx, width, 4);
    let down = gate && mode >= 2 && 256 / (dt * ds) * (k + 1) <= 2048;
    (gate, down)
}

/// moe_gate_up_y's or moe_down_y's pipeline constants (moe_xq.wgsl's MY_*, `LILY_WGPU_SPEC=moe`)
/// from the launch's parameter block `p` (`params`' layout: m, m2, rows, k, n_exp, norm_topk,
/// outs, cw, tiles) and the adapter's one subgroup width (`xq_takes` requires one).
fn y_spec(ctx: &Ctx, p: &[u32]) -> Vec<(&'static str, u32)> {
    vec![
        ("MY_ON", 1),
        ("MY_OUT", p[0]),
        ("MY_INP", p[1]),
        ("MY_GS", p[3]),
        ("MY_SB16", p[4]),
        // down's launch has no second matrix (zeros): 1, so that no constant divides by 0.
        ("MY_GS2", p[8 + 3].max(1)),
        ("MY_SB162", p[8 + 4]),
        ("MY_ROWS", p[16]),
        ("MY_K", p[17]),
        ("MY_NEXP", p[18]),
        ("MY_NORM", p[19]),
        ("MY_OUTS", p[20]),
        ("MY_TILES", p[22]),
        ("MY_SG", ctx.report.subgroup_min),
    ]
}

/// The most routed slots moe_down_y takes (moe_xq.wgsl DY_K: its straight-line loads).
const DOWN_Y_K: usize = 8;

/// moe_down_y's lanes a team (one a code word of a row of down) where it takes the block after
/// moe_gate_up_x or _y (whose epilogue stages act): `LILY_WGPU_MOE_XQ` 3 or 4, 4-bit down
/// (the shared expert's the same, `shared_slot_ok`) whose rows are 1 to 256 code words, a power
/// of two, and at most DOWN_Y_K routed slots.
fn down_y_lanes(ctx: &Ctx, width: usize, bits: u32, k: usize) -> Option<usize> {
    let words = width / 32;
    (ctx.sw.moe_xq.load(std::sync::atomic::Ordering::Relaxed) >= 3
        && bits == 4
        && width.is_multiple_of(32)
        && words.is_power_of_two()
        && words <= 256
        && (1..=DOWN_Y_K).contains(&k))
    .then_some(words)
}

/// The most vec4s of moe_down_y2q's act staging in workgroup memory (moe_xq.wgsl MY_DQ: 16 KB).
const DQ_MAX: usize = 1024;

/// Whether down stages act (`Switches::moe_act`, `LILY_WGPU_MOE_ACT=down16`: moe_down_y2q, gate|up
/// on half the outputs a workgroup), given that the y pair with their constants takes the
/// block: where the k + 1 rows' 4-bit staging (5 vec4s a 32 act values) fits moe_down_y2q's
/// workgroup memory; else gate|up's epilogue stages it.
fn act_takes(ctx: &Ctx, width: usize, k: usize) -> bool {
    ctx.sw.moe_act.load(std::sync::atomic::Ordering::Relaxed)
        && width.is_multiple_of(32)
        && (k + 1) * 5 * (width / 32) <= DQ_MAX
}

/// moe_gate_up_y's lanes a team where it takes the block: `LILY_WGPU_MOE_XQ` 4, 4-bit gate and
/// up in groups of a multiple of 64 inputs (a lane's two code words share one), hidden 512,
/// 1,024 or 2,048 (hidden / 64 = 8, 16 or 32 lanes: two words a lane).
fn gate_y_lanes(ctx: &Ctx, hid: usize, gate: &WMat, up: &WMat) -> Option<usize> {
    let lanes = hid / 64;
    (ctx.sw.moe_xq.load(std::sync::atomic::Ordering::Relaxed) >= 4
        && gate.bits == 4
        && up.bits == 4
        && gate.gs.is_multiple_of(64)
        && up.gs.is_multiple_of(64)
        && matches!(hid, 512 | 1024 | 2048))
    .then_some(lanes)
}

/// Whether moe_decode_shared's gate|up reads x staged ahead (`rn`: matmul_sg.wgsl omode 5's
/// staging, the 1 / rms applied by moe_gate_up_y's MY_RN): the y kernel with its pipeline
/// constants (`LILY_WGPU_SPEC` moe), hidden a multiple of 128 (the partial sums in vec4s).
pub fn rn_takes(ctx: &Ctx, d: &Dims, gate: &WMat, up: &WMat) -> bool {
    let hid = gate.inp;
    xq_takes(ctx, hid, gate.out, d.top_k).0
        && gate_y_lanes(ctx, hid, gate, up).is_some()
        && ctx.sw.moe_spec.load(std::sync::atomic::Ordering::Relaxed)
        && hid.is_multiple_of(128)
}

/// Whether moe_decode_shared's down can stage the next op's x (moe_xq.wgsl moe_down_ys, with
/// `next`): one token through moe_gate_up_y and moe_down_y with their pipeline constants,
/// down's team of 8 or 16 lanes (32 outputs a workgroup in one or two a team), hidden a
/// multiple of 128.
pub fn stage_next_takes(ctx: &Ctx, d: &Dims, gate: &WMat, up: &WMat, down: &WMat) -> bool {
    let hid = gate.inp;
    xq_takes(ctx, hid, gate.out, d.top_k).0
        && gate_y_lanes(ctx, hid, gate, up).is_some()
        && matches!(
            down_y_lanes(ctx, gate.out, down.bits, d.top_k),
            Some(8 | 16)
        )
        && down.out == hid
        && ctx.sw.moe_spec.load(std::sync::atomic::Ordering::Relaxed)
        && hid.is_multiple_of(128)
}

/// moe_down_x's lanes a team and teams an output (`Switches::moe_xq_shape`), the lanes at most
/// the code words of a row of down (`bits` of `width` inputs), at least 1.
fn down_shape(ctx: &Ctx, width: usize, bits: u32) -> (usize, usize) {
    let shape = ctx
        .sw
        .moe_xq_shape
        .load(std::sync::atomic::Ordering::Relaxed) as usize;
    let words = (width / (128 / bits as usize)).max(1);
    let mut t = (shape >> 8) & 0xff;
    while t > 1 && t > words {
        t /= 2;
    }
    (t.max(1), (shape >> 16).max(1))
}

/// `lily lab`'s ablation bits (`Switches::ablate`) for moe_decode_shared's y kernels: its
/// gate|up launch alone, or its down launch alone (the lab's `gate-only` / `down-only` rows:
/// each launch's own time; the block's sums are then wrong).
pub(super) const LAB_GATE_ONLY: u32 = 0x100;
pub(super) const LAB_DOWN_ONLY: u32 = 0x200;

/// How the projection before the MoE block left x (moe_decode_shared's `rn`): staged without
/// its norm's 1 / rms (`eps`: the norm's), and with `fold` the router's partial dots after it
/// (`matmul::OutMode::AddStageFold`), so gate|up takes the logits from them.
#[derive(Clone, Copy)]
pub struct StagedAhead {
    pub eps: f32,
    pub fold: bool,
}

/// One token's MoE block added into `h` in two launches (the caller checked `shared_slot_ok`):
/// moe_gate_up_s, the shared expert as slot k, then moe_down_s, which sums the routed slots,
/// adds the gated shared slot and adds the total into h. With `logits`, moe_gate_up_s routes the
/// token from them and writes `route` (moe_step_add); else it reads `route` (moe_decode_add).
/// Where `xq_takes`, moe_xq.wgsl's moe_gate_up_x (x as staged in `xq`, the router's launch's
/// staging of this x; without it a q2x_stage of x first) and moe_down_x instead.
#[allow(clippy::too_many_arguments)]
pub fn moe_decode_shared(
    ctx: &Ctx,
    x: &WBuf,
    route: &WRoute,
    gate: &WMat,
    up: &WMat,
    down: &WMat,
    sh: &SharedExpert<'_, Wgpu>,
    d: &Dims,
    h: &mut WBuf,
    logits: Option<&WBuf>,
    xq: Option<&::wgpu::Buffer>,
    rn: Option<StagedAhead>,
    next: Option<&WBuf>,
) {
    let (hid, width, n, k) = (gate.inp, gate.out, gate.n, d.top_k);
    // The next op's x staged by down (`next`: its norm's weights) needs moe_down_ys.
    if next.is_some() && !stage_next_takes(ctx, d, gate, up, down) {
        return ctx.fail("moe_decode_shared: staging the next x needs moe_down_ys".to_string());
    }
    // x staged ahead (`rn`) is read by moe_gate_up_y with MY_RN alone; with the router folded
    // (`fold`), its route also writes the logits and the shared gate's logit.
    if rn.is_some() && !(xq.is_some() && rn_takes(ctx, d, gate, up)) {
        return ctx
            .fail("moe_decode_shared: x staged ahead needs moe_gate_up_y's constants".to_string());
    }
    let fold = rn.is_some_and(|r| r.fold);
    if fold && (sh.logit.len < 1 || logits.is_none()) {
        return ctx.fail("moe_decode_shared: the folded router writes the logits".to_string());
    }
    let k1 = k + 1;
    let act_f = match ctx.scratch("moe.act", 4 * (k1 * width) as u64) {
        Ok(a) => a,
        Err(e) => return ctx.fail(format!("moe_decode_shared: {e:#}")),
    };
    // moe_down_s: 64 / (k + 1) outputs of the token for all its slots (7 at k = 8), the k + 1
    // act rows staged whole where they fit.
    let outs = 64 / k1;
    let cw = width.min(DOWN_STAGE_S / k1 / 64 * 64);
    let route_in = logits.is_some() as usize;
    let (lg, wts) = match logits {
        Some(l) => (&l.buf, &route.weights),
        None => (&ctx.spare[0], &ctx.spare[1]),
    };
    let (sg, su, sd) = (sh.gate, sh.up, sh.down);
    let (x_gate, x_down) = xq_takes(ctx, hid, width, k);
    if x_gate {
        let staged = match xq {
            Some(b) => Ok(b.clone()),
            None => super::matmul::q2x_stage(ctx, x, hid, 1, "moe.xq"),
        };
        let aq = ctx.scratch("moe.aq", (16 * k1 * super::matmul::xq_row(width)) as u64);
        let (staged, aq) = match (staged, aq) {
            (Ok(s), Ok(a)) => (s, a),
            (Err(e), _) | (_, Err(e)) => return ctx.fail(format!("moe_decode_shared: {e:#}")),
        };
        // moe_gate_up_y where it takes the block (its team: hidden / 64 lanes), else
        // moe_gate_up_x in the shape's team.
        let gy = gate_y_lanes(ctx, hid, gate, up);
        let (entry, lanes) = match gy {
            Some(lanes) => ("moe_gate_up_y", lanes),
            None => {
                let shape =
                    ctx.sw
                        .moe_xq_shape
                        .load(std::sync::atomic::Ordering::Relaxed) as usize;
                ("moe_gate_up_x", shape & 0xff)
            }
        };
        // cw: x staged ahead, the norm's eps (moe_xq.wgsl MY_RN).
        let p_up = params(
            gate.qmat(),
            up.qmat(),
            1,
            k,
            n,
            d.norm_topk,
            lanes,
            rn.map_or(0, |r| r.eps.to_bits() as usize),
            route_in,
        );
        // gemv_q6s's idea for the y kernels (opt-in): the launch's values as constants.
        let spec = ctx.sw.moe_spec.load(std::sync::atomic::Ordering::Relaxed);
        // moe_down_y where it takes the block (moe_down_y2, two outputs a team, where it has
        // its constants and `LILY_WGPU_MOE_DOWN` is y2, the default), else moe_down_x (same
        // bindings); else moe_down_s below.
        let y2 = spec && ctx.sw.moe_down.load(std::sync::atomic::Ordering::Relaxed) == 1;
        let down_x = match down_y_lanes(ctx, width, down.bits, k) {
            Some(lanes) if y2 => Some(("moe_down_y2", lanes, 512 / lanes)),
            Some(lanes) => Some(("moe_down_y", lanes, 256 / lanes)),
            None if x_down => {
                let (dt, ds) = down_shape(ctx, width, down.bits);
                Some(("moe_down_x", dt | ds << 16, 256 / (dt * ds)))
            }
            None => None,
        };
        // Down stages act (`act_takes`): moe_down_y2q after moe_gate_up_y with MY_NOQ; with
        // `next`, moe_down_ys with MY_AQW (dy_pair stages act as moe_down_y2q does).
        let act = gy.is_some()
            && down_x.is_some_and(|(e, ..)| e == "moe_down_y2")
            && act_takes(ctx, width, k);
        let down_x =
            down_x.map(|(e, lanes, opw)| (if act { "moe_down_y2q" } else { e }, lanes, opw));
        // `lily lab`'s ablation bits for moe_gate_up_y (MY_ABL; 0 in a step).
        let lab = ctx.sw.ablate.load(std::sync::atomic::Ordering::Relaxed);
        let mut consts = match gy {
            Some(_) if spec => y_spec(ctx, &p_up),
            _ => Vec::new(),
        };
        if rn.is_some() {
            consts.push(("MY_RN", 1));
        }
        if act {
            consts.push(("MY_NOQ", 1));
        }
        if !consts.is_empty() && lab & 0xff != 0 {
            consts.push(("MY_ABL", lab & 0xff));
        }
        // A 4-bit down reads act's 4-bit staging alone (`LILY_WGPU_MOE_A8=1`: both, as before).
        let a8 = ctx.sw.moe_a8.load(std::sync::atomic::Ordering::Relaxed);
        if !consts.is_empty() && down.bits == 4 && !a8 {
            consts.push(("MY_A8", 0));
        }
        // moe_gate_up_y's outputs a workgroup: 256 / lanes teams of R = lanes / 8 outputs (32),
        // or with MY_NOQ of R = lanes / 16, at least 1 (moe_xq.wgsl).
        let gate_opw = match gy {
            Some(lanes) if act => 256 / lanes * (lanes / 16).max(1),
            _ => X_OUTS,
        };
        if fold {
            if consts.is_empty() {
                return ctx.fail(
                    "moe_decode_shared: the folded router needs moe_gate_up_y's constants"
                        .to_string(),
                );
            }
            consts.push(("MY_FOLD", 1));
        }
        // Bindings 19 and 20: the logits and the shared gate's logit the folded route writes
        // (spares otherwise); the logits are then not read at 16.
        let (lg, l_out, s_out) = match (fold, logits) {
            (true, Some(l)) => (&ctx.spare[2], &l.buf, &sh.logit.buf),
            _ => (lg, &ctx.spare[3], &ctx.spare[4]),
        };
        if lab & LAB_DOWN_ONLY == 0 {
            ctx.dispatch_spec(
                &XQ_SHADER,
                entry,
                &consts,
                &p_up,
                &[
                    &gate.w, &gate.s, &gate.b, &up.w, &up.s, &up.b, &staged, &route.ids, &act_f,
                    &sg.w, &sg.s, &sg.b, &su.w, &su.s, &su.b, lg, wts, &aq, l_out, s_out,
                ],
                (k1 * width / gate_opw) as u32,
            );
        }
        if lab & LAB_GATE_ONLY != 0 {
            return;
        }
        if let Some((entry, outs, opw)) = down_x {
            let p_down = params(down.qmat(), [0; 8], 1, k, n, d.norm_topk, outs, 0, 0);
            let mut consts = if spec && entry != "moe_down_x" {
                y_spec(ctx, &p_down)
            } else {
                Vec::new()
            };
            // moe_down_y2q stages act itself from the f32 values (binding 4), MY_DQ vec4s.
            if act {
                consts.push(("MY_AQW", 1));
                consts.push(("MY_DQ", (k1 * 5 * (width / 32)) as u32));
            }
            let mut bufs = vec![
                &down.w,
                &down.s,
                &down.b,
                if act { &act_f } else { &aq },
                &route.ids,
                &route.weights,
                &h.buf,
                &sd.w,
                &sd.s,
                &sd.b,
                &sh.logit.buf,
            ];
            let Some(nw) = next else {
                ctx.dispatch_spec(
                    &XQ_SHADER,
                    entry,
                    &consts,
                    &p_down,
                    &bufs,
                    hid.div_ceil(opw) as u32,
                );
                return;
            };
            // moe_down_ys: the next op's x staged at binding 18 from the norm's weights at 12
            // (13-17 spares: moe_xq.wgsl's header of the entry).
            let staging = match super::matmul::stage_ahead_scratch(ctx, hid) {
                Ok(b) => b,
                Err(e) => return ctx.fail(format!("moe_decode_shared: {e:#}")),
            };
            let sp = &ctx.spare;
            bufs.extend([&nw.buf, &sp[0], &sp[1], &sp[2], &sp[3], &sp[4], &staging]);
            ctx.dispatch_spec(
                &XQ_SHADER,
                "moe_down_ys",
                &consts,
                &p_down,
                &bufs,
                (hid / 32) as u32,
            );
            return;
        }
    } else {
        let p_up = params(gate.qmat(), up.qmat(), 1, k, n, d.norm_topk, 0, 0, route_in);
        ctx.dispatch(
            &SHADER,
            "moe_gate_up_s",
            &p_up,
            &[
                &gate.w, &gate.s, &gate.b, &up.w, &up.s, &up.b, &x.buf, &route.ids, &act_f, &sg.w,
                &sg.s, &sg.b, &su.w, &su.s, &su.b, lg, wts,
            ],
            (k1 * width.div_ceil(GATE_UP_OUTS)) as u32,
        );
    }
    let p_down = params(down.qmat(), [0; 8], 1, k, n, d.norm_topk, outs, cw, 0);
    ctx.dispatch(
        &SHADER,
        "moe_down_s",
        &p_down,
        &[
            &down.w,
            &down.s,
            &down.b,
            &act_f,
            &route.ids,
            &route.weights,
            &h.buf,
            &sd.w,
            &sd.s,
            &sd.b,
            &sh.logit.buf,
        ],
        hid.div_ceil(outs) as u32,
    );
}

impl Wgpu {
    /// A route's ids and weights, `rows · k` of each (tests, debugging).
    pub fn route_to_host(&self, r: &WRoute, rows: usize) -> Result<(Vec<u32>, Vec<f32>)> {
        if rows > r.rows {
            bail!(
                "route_to_host: {rows} rows asked of a route of {} rows",
                r.rows
            );
        }
        let n = 4 * (rows * r.k) as u64;
        let words = |b: &::wgpu::Buffer| -> Result<Vec<u32>> {
            Ok(self
                .ctx
                .read(b, n)?
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect())
        };
        let ids = words(&r.ids)?;
        let w = words(&r.weights)?;
        Ok((ids, w.into_iter().map(f32::from_bits).collect()))
    }
}
