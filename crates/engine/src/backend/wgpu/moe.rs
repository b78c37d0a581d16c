//! The MoE block: routing (softmax, top-k) and the routed experts (shaders/moe.wgsl;
//! cpu/moe.rs is the twin).
//!
//! `moe_experts` (prefill and decode alike) is two launches: `moe_gate_up` writes each slot's
//! activation `silu(gate_e(x_t)) · up_e(x_t)` into a scratch `[rows, k, width]` allocated per
//! call, then `moe_down` runs each token's k down projections and sums them, weighted, in slot
//! order into `out` (the CPU's order). Tokens are not grouped by expert: each slot streams its
//! expert's weights.

use anyhow::{bail, Result};

use super::device::{Ctx, Shader};
use super::{WBuf, WMat, WRoute, Wgpu};
use crate::backend::Dims;

pub const SHADER: Shader = Shader {
    name: "moe",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/quant.wgsl"),
        include_str!("shaders/moe.wgsl")
    ),
};

/// The most experts `moe_route` takes (its probabilities sit in workgroup memory).
const MAX_EXPERTS: usize = 2048;
/// The most experts a token chooses (`moe_route`'s workgroup array of the chosen ids).
const MAX_TOP_K: usize = 64;
/// Outputs a workgroup of `moe_gate_up` / `moe_down` computes.
const GATE_UP_OUTS: usize = 8;
const DOWN_OUTS: usize = 32;
/// Rows from which a block's experts run grouped by expert (moe_gate_up_grouped,
/// moe_down_grouped, moe_combine): each expert's rows read once a block, not once a slot. Below
/// it (decode, short blocks) a slot a workgroup reads only the experts chosen.
const GROUPED_FROM: usize = 4;

/// moe.wgsl's parameter block: two matrices, then rows, k, experts, norm_topk.
fn params(m: [u32; 8], m2: [u32; 8], rows: usize, k: usize, n_exp: usize, norm: bool) -> Vec<u32> {
    let mut p = Vec::with_capacity(20);
    p.extend(m);
    p.extend(m2);
    p.extend([rows as u32, k as u32, n_exp as u32, norm as u32]);
    p
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
        &params([0; 8], [0; 8], rows, k, e, d.norm_topk),
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
    let p_up = params(gate.qmat(), up.qmat(), rows, k, n, false);
    let p_down = params(down.qmat(), [0; 8], rows, k, n, false);
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
            &[
                &down.w,
                &down.s,
                &down.b,
                &act,
                &route.ids,
                &route.weights,
                &out.buf,
            ],
            g2,
        );
    } else {
        // Grouped by expert: each expert's rows are read once a block; the slots' down outputs
        // go to `y` and are summed in slot order by moe_combine.
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
            &[&down.w, &down.s, &down.b, &act, &route.ids, &y],
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
    Ok(())
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
