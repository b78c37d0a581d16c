//! Norms and small elementwise ops (shaders/norm.wgsl; cpu/norm.rs is the twin).

use super::device::{Ctx, Shader};
use super::{fits, WBuf};

pub const SHADER: Shader = Shader {
    name: "norm",
    src: concat!(
        include_str!("shaders/common.wgsl"),
        include_str!("shaders/norm.wgsl")
    ),
};

/// The parameter block of norm.wgsl: n, dim, eps.
fn params(n: usize, dim: usize, eps: f32) -> [u32; 4] {
    [n as u32, dim as u32, eps.to_bits(), 0]
}

pub fn rms_norm(ctx: &Ctx, x: &WBuf, w: &WBuf, rows: usize, dim: usize, eps: f32, out: &mut WBuf) {
    let n = rows * dim;
    if !fits(
        ctx,
        "rms_norm",
        &[("x", x, n), ("out", out, n), ("the weights", w, dim)],
    ) {
        return;
    }
    ctx.dispatch(
        &SHADER,
        "rms_norm",
        &params(rows, dim, eps),
        &[&x.buf, &w.buf, &out.buf],
        rows as u32,
    );
}

#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm(
    ctx: &Ctx,
    h: &mut WBuf,
    r: &WBuf,
    w: &WBuf,
    rows: usize,
    dim: usize,
    eps: f32,
    out: &mut WBuf,
) {
    let n = rows * dim;
    let bufs = [
        ("h", &*h, n),
        ("r", r, n),
        ("out", &*out, n),
        ("the weights", w, dim),
    ];
    if !fits(ctx, "add_rms_norm", &bufs) {
        return;
    }
    ctx.dispatch(
        &SHADER,
        "add_rms_norm",
        &params(rows, dim, eps),
        &[&h.buf, &r.buf, &w.buf, &out.buf],
        rows as u32,
    );
}

pub fn add(ctx: &Ctx, h: &mut WBuf, r: &WBuf, len: usize) {
    if !fits(ctx, "add", &[("h", h, len), ("r", r, len)]) {
        return;
    }
    ctx.dispatch(
        &SHADER,
        "add",
        &params(len, 0, 0.0),
        &[&h.buf, &r.buf],
        len.div_ceil(256) as u32,
    );
}

pub fn swiglu(ctx: &Ctx, g: &WBuf, u: &WBuf, len: usize, out: &mut WBuf) {
    if !fits(
        ctx,
        "swiglu",
        &[("g", g, len), ("u", u, len), ("out", out, len)],
    ) {
        return;
    }
    ctx.dispatch(
        &SHADER,
        "swiglu",
        &params(len, 0, 0.0),
        &[&g.buf, &u.buf, &out.buf],
        len.div_ceil(256) as u32,
    );
}

pub fn add_sigmoid_gated(
    ctx: &Ctx,
    y: &mut WBuf,
    shared: &WBuf,
    s: &WBuf,
    rows: usize,
    dim: usize,
) {
    let n = rows * dim;
    if !fits(
        ctx,
        "add_sigmoid_gated",
        &[("y", y, n), ("shared", shared, n), ("s", s, rows)],
    ) {
        return;
    }
    ctx.dispatch(
        &SHADER,
        "add_sigmoid_gated",
        &params(n, dim, 0.0),
        &[&y.buf, &shared.buf, &s.buf],
        n.div_ceil(256) as u32,
    );
}
