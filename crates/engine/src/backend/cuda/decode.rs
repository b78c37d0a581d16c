//! The weight-streaming decode path of the CUDA backend: the host side of kernels/stream.cuh,
//! gemv.cu (`sw_gemv_*`) and moe.cu's `moe_sw_*`.
//!
//! A decode step reads every active weight once (1.67 GB on the full model), so its GEMVs should
//! run at the memory system's speed. These kernels keep a lane's slice of x in registers, load
//! 16 bytes of codes per chunk with several chunks in flight, dequantise without int→float
//! conversions, and run as one wave of resident blocks walking batches of rows (stream.cuh says
//! why each). They also carry the small ops of a step that used to be launches of their own:
//! the RMS norm before a layer's projections (each block normalises h itself), the residual add
//! after its output projection (the epilogue adds into h), and the MoE combine with the shared
//! expert's gate and the residual add (in the experts' down launch).
//!
//! Each piece has a switch (`SWITCHES` in mod.rs): `stream_gemv`, `fuse_norm`,
//! `fuse_residual`, `fuse_moe`. A matrix the kernels cannot take (another format, a width the
//! geometry does not divide: the `tiny` preset's 128) runs the warp-per-row kernels of matmul.cu.

use std::collections::HashMap;
use std::sync::Mutex;

use cudarc::driver::sys;

use super::{
    grid1, Arg, Buf, Cuda, Dims, Fmt, Mat, MoeWeights, QMat, Route, RouteAhead, RouterScratch,
    SharedExpert,
};

/// `struct SwArgs` of gemv.cu (same layout).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct SwArgs {
    m: [QMat; 4],
    out: [u64; 4],
    obf: [i32; 4],
    bstart: [i32; 5],
    n: i32,
    x: u64,
    nw: u64,
    xn: u64,
    rids: u64,
    rwts: u64,
    counter: u64,
    eps: f32,
    re: i32,
    rk: i32,
    ntopk: i32,
    cw: u64,
    cst: u64,
    zp: u64,
    ck: i32,
    dv: i32,
    rblock: i32,
    rflag: i32,
    fr: QMat,
    fs: QMat,
    fnw: u64,
    facc: u64,
    fe: i32,
    fpad: i32,
}

impl SwArgs {
    /// No matrices, no prologue inputs, no route, no fold: the fields each launch then sets.
    fn empty() -> Self {
        SwArgs {
            m: [QMat::none(); 4],
            out: [0; 4],
            obf: [0; 4],
            bstart: [0; 5],
            n: 0,
            x: 0,
            nw: 0,
            xn: 0,
            rids: 0,
            rwts: 0,
            counter: 0,
            eps: 0.0,
            re: 0,
            rk: 0,
            ntopk: 0,
            cw: 0,
            cst: 0,
            zp: 0,
            ck: 0,
            dv: 0,
            rblock: 0,
            rflag: 0,
            fr: QMat::none(),
            fs: QMat::none(),
            fnw: 0,
            facc: 0,
            fe: 0,
            fpad: 0,
        }
    }
}

/// `struct RaArgs` of gemv.cu (same layout): route_ahead's arguments.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct RaArgs {
    h: u64,
    nw: u64,
    acc: u64,
    xn: u64,
    logits: u64,
    s: u64,
    ids: u64,
    wts: u64,
    eps: f32,
    e: i32,
    k: i32,
    ntopk: i32,
    rblock: i32,
    sbf: i32,
}

/// Bytes of sw_gemv_route's scratch, which every launch leaves at zero: the router's ticket (u32
/// at 0); with route_flag the published route (u64 at 8: route.cuh route_weights writes it,
/// moe_flag_gate_up polls it, moe_wide_down / moe_flag_down zero it); with down_flag the gate|up
/// blocks done and the down blocks past their poll (two u32 at 16: moe.cu moe_wait_done). One
/// size for every caller: a larger request would reallocate it under a recorded launch.
const ROUTE_SCRATCH: usize = 24;

/// `struct SwMoe` of moe.cu (same layout).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct SwMoe {
    g: QMat,
    u: QMat,
    d: QMat,
    sg: QMat,
    su: QMat,
    sd: QMat,
    x: u64,
    ids: u64,
    wts: u64,
    slogit: u64,
    act: u64,
    h: u64,
    k: i32,
    re: i32,
    counter: u64,
    logits: u64,
    ntopk: i32,
    rblock: i32,
    done: u64,
    dn: i32,
    dpad: i32,
}

/// `struct SwStep` of moe.cu (same layout): moe_step_gate_up's arguments.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct SwStep {
    m: SwMoe,
    r: QMat,
    rs: QMat,
    nw: u64,
    xn: u64,
    logits: u64,
    s: u64,
    eps: f32,
    e: i32,
    ntopk: i32,
    sobf: i32,
    probe: i32,
    pad: i32,
}

/// Rows per batch at most (SW_MAXRB in gemv.cu), and slots of the down kernel (SWD_MAXSLOTS in
/// moe.cu; the experts' batch sizes are fixed by their instantiations there).
const SW_MAXRB: usize = 128;
const SWD_MAXSLOTS: usize = 10;

/// The x of a streaming GEMV.
#[derive(Clone, Copy)]
pub(super) enum SwX<'a> {
    /// A bf16 activation.
    Act(&'a Buf),
    /// `bf16(rms_norm(h) · w)` computed by every block (h and w f32), written to `xn` by block 0.
    Norm {
        h: &'a Buf,
        w: &'a Buf,
        eps: f32,
        xn: Option<&'a Buf>,
    },
    /// The GDN output's gated norm, `bf16(rms_norm(y_head) · w · silu(z))` per value head of `dv`
    /// (y f32 at `y`, the scan's scratch; z bf16; w f32 [dv]): out_proj's input, never stored.
    Gated {
        y: u64,
        z: &'a Buf,
        w: &'a Buf,
        eps: f32,
        dv: usize,
    },
}

/// The GDN conv of output 0 (`sw_gemv` obf 3): taps [C, K] f32 and the state [K-1, C] f32.
pub(super) struct SwConv<'a> {
    pub w: &'a Buf,
    pub state: &'a Buf,
    pub k: usize,
}

/// Blocks of each kernel one SM holds at once (from the occupancy calculator), by name.
#[derive(Default)]
pub(super) struct Occupancy(Mutex<HashMap<String, u32>>);

impl Cuda {
    /// Bits of a format the streaming kernels take (bf16 scales and biases), else None.
    fn sw_bits(fmt: Fmt) -> Option<usize> {
        match fmt {
            Fmt::Q4Bf16 => Some(4),
            Fmt::Q8Bf16 => Some(8),
            _ => None,
        }
    }

    /// Chunks per lane per batch (two batches in flight): `default` (4 for the GEMVs, 2 for the
    /// experts, whose pairs of gate and up chunks spill at 4); `LILY_CUDA_SW_U` (2, 4 or 8) for
    /// measuring. Capped so a batch fits the reduction buffer.
    fn sw_u(rw: usize, maxrb: usize, allowed: &[usize], default: usize) -> usize {
        let want = std::env::var("LILY_CUDA_SW_U")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|u| allowed.contains(u))
            .unwrap_or(default);
        let mut u = want.min(*allowed.iter().max().unwrap_or(&4));
        while u > allowed[0] && rw * u > maxrb {
            u /= 2;
        }
        u
    }

    /// Whether the streaming GEMV takes these matrices as one launch: one stack each, one format
    /// it reads, one width K with C = K/256 dividing 32 (the 8 warp slices of 32-input chunks).
    pub(super) fn sw_fits(&self, ws: &[&Mat]) -> bool {
        let Some(w0) = ws.first() else { return false };
        let k = w0.inp;
        self.on("stream_gemv")
            && (1..=4).contains(&ws.len())
            && Self::sw_bits(w0.fmt).is_some()
            && k >= 256
            && k % 256 == 0
            && 16 % (k / 256) == 0
            && w0.gs % 32 == 0
            && ws
                .iter()
                .all(|w| w.fmt == w0.fmt && w.n == 1 && w.inp == k && w.gs == w0.gs && w.out > 0)
    }

    /// Blocks of kernel `name` the whole GPU holds at once with `threads` threads (one wave).
    fn resident_blocks(&self, name: &str, threads: u32, smem: u32) -> u32 {
        let key = format!("{name}/{threads}/{smem}");
        if let Some(&n) = self
            .occupancy
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
        {
            return n;
        }
        let per_sm = self
            .func(name)
            .and_then(|f| {
                if smem > 32 * 1024 {
                    // The opt-in `launch` makes, made first so the calculator counts with it.
                    f.set_attribute(
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        smem as i32,
                    )
                    .ok()?;
                }
                f.occupancy_max_active_blocks_per_multiprocessor(threads, smem as usize, None)
                    .ok()
            })
            .unwrap_or(1)
            .max(1);
        let n = per_sm * self.sm_count;
        self.occupancy
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, n);
        n
    }

    /// `outs[i] (type obf[i]: 0 f32, 1 bf16, 2 f32 +=) = x · ws[i]ᵀ` for one row of x, one launch
    /// (callers check `sw_fits` and the buffers).
    pub(super) fn sw_gemv(&self, x: SwX<'_>, ws: &[&Mat], outs: &[(u64, i32)]) {
        self.sw_gemv_route(x, ws, outs, None, None, None)
    }

    /// Rows per batch of the SIMT streaming GEMV (sw_gemv_<B>_<C>_<U>_*) over matrices of width
    /// `k` and `bits`: RW = 32 / C rows a load, U loads.
    fn sw_rb(k: usize, bits: usize) -> usize {
        let rw = 32 / (k / 256);
        let u = if bits == 8 {
            2
        } else {
            Self::sw_u(rw, SW_MAXRB, &[2, 4], 4)
        };
        rw * u
    }

    /// Whether the decode projection `out` (added into h) can fold the MoE router `next` into its
    /// launch (gemv.cu's AHEAD, Backend::route_ahead): opt-in `route_ahead` (and the streaming
    /// GEMV with its residual add) on, `out` a one-stack streaming GEMV (the fold always takes the
    /// SIMT loop, whatever `tc_all` says: `sw_gemv_route`), an 8-bit
    /// router | shared gate of K = out's rows whose group size the batch's rows divide, E < 512,
    /// and a hidden size route_ahead_<C> takes (256·C, C | 16).
    pub(super) fn ahead_fits(&self, out: &Mat, next: &RouteAhead<'_, Cuda>) -> bool {
        let (r, sg) = (next.router, next.shared_gate);
        let hid = out.out;
        let Some(bits) = Self::sw_bits(out.fmt) else {
            return false;
        };
        // sw_fits first: it holds K = 256·C that sw_rb divides by (tiny's K < 256 panicked
        // here, opted in or not, from stop 36 until cuda_ops next ran on the H200 at stop 41).
        if !(self.opted_in("route_ahead") && self.on("fuse_residual") && self.sw_fits(&[out])) {
            return false;
        }
        let rb = Self::sw_rb(out.inp, bits);
        rb.is_multiple_of(4)
            && (rb <= 16 || rb.is_multiple_of(16))
            && [r, sg].iter().all(|m| {
                Self::sw_bits(m.fmt) == Some(8)
                    && m.n == 1
                    && m.inp == hid
                    && m.gs.is_multiple_of(rb)
            })
            && sg.out == 1
            && (1..512).contains(&r.out)
            && hid.is_multiple_of(256)
            && 16 % (hid / 256) == 0
            && next.norm.len >= hid
    }

    /// `h += x · wᵀ` (one row) with the MoE router `next` folded into the launch (callers check
    /// `ahead_fits` and the buffers).
    pub(super) fn ahead_gemv(&self, x: SwX<'_>, w: &Mat, h: &Buf, next: &RouteAhead<'_, Cuda>) {
        self.sw_gemv_route(x, &[w], &[(h.mem.ptr, 2)], None, None, Some(next));
    }

    /// The MoE block's router after a projection that folded it (gemv.cu's route_ahead_<C>): the
    /// logits, the shared gate's logit, x = rms_norm(h) · norm into `r.xn` and the route, from
    /// the projection's sums (which it leaves at zero). Callers check the operands.
    pub(super) fn route_ahead_launch(
        &self,
        h: &Buf,
        norm: &Buf,
        eps: f32,
        e: usize,
        d: &Dims,
        r: &mut RouterScratch<'_, Cuda>,
    ) {
        let Some(acc) = self.ahead_acc(e) else {
            return;
        };
        let hid = d.hidden;
        let k = d.top_k;
        let p = RaArgs {
            h: h.mem.ptr,
            nw: norm.mem.ptr,
            acc,
            xn: r.xn.mem.ptr,
            logits: r.logits.mem.ptr,
            s: r.s.mem.ptr,
            ids: r.route.ids.ptr,
            wts: r.route.weights.ptr,
            eps,
            e: e as i32,
            k: k as i32,
            ntopk: d.norm_topk as i32,
            rblock: self.route_kind(e, k),
            sbf: r.s.bf16(),
        };
        r.route.k = k;
        let name = format!("route_ahead_{}", hid / 256);
        self.launch(&name, (1, 1, 1), 256, 0, &[Arg::R(Box::new(p))]);
    }

    /// The fold's fixed-point sums, `[E + 1]` i64 (zeroed when allocated; route_ahead leaves them
    /// at zero after reading).
    fn ahead_acc(&self, e: usize) -> Option<u64> {
        let mut sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        self.scratch(&mut sc, "route_ahead", 8 * (e + 1))
    }

    /// How a whole block routes E experts to the top k (gemv.cu's ROUTE, `rblock`, route.cuh
    /// route_by): 1 route_block (switch `route_block`, E <= 256), 2 route_sort (opt-in, k <= 8
    /// too), 0 route_warp.
    fn route_kind(&self, e: usize, k: usize) -> i32 {
        match (self.on("route_block") && e <= 256, k <= 8) {
            (false, _) => 0,
            (true, true) if self.opted_in("route_sort") => 2,
            (true, _) => 1,
        }
    }

    /// `sw_gemv`, routing the token in the last block (`route`: the route to write, top-k, whether
    /// to renormalise, whether to publish the ids for moe_flag_gate_up: route.cuh route_weights,
    /// E <= 256 and k <= 8; ROUTE_SCRATCH) from output 0, which must then be f32 router logits.
    /// With `conv` (obf 3 on output 0), output 0 goes through the GDN conv step in the epilogue.
    pub(super) fn sw_gemv_route(
        &self,
        x: SwX<'_>,
        ws: &[&Mat],
        outs: &[(u64, i32)],
        route: Option<(&Route, usize, bool, bool)>,
        conv: Option<SwConv<'_>>,
        ahead: Option<&RouteAhead<'_, Cuda>>,
    ) {
        let k = ws[0].inp;
        let bits = Self::sw_bits(ws[0].fmt).expect("sw_fits");
        let rw = 32 / (k / 256);
        // 8-bit (the router): U = 2 only (gemv.cu's instantiations).
        let u = Self::sw_rb(k, bits) / rw;
        let pro = match x {
            SwX::Act(_) => 0,
            SwX::Norm { .. } => 1,
            SwX::Gated { .. } => 2,
        };
        // The tensor-core form (gemv.cu's tc_gemv_<NS>_<NW>_<U>_<PRO>): 4-bit, group size 64, K of
        // 512 to 4096 cut into NW warps of NS spans of 128; batches of U tiles of 16 rows.
        let tc_geom = match k {
            512 => Some((1, 4)),
            1024 => Some((2, 4)),
            2048 => Some((2, 8)),
            4096 => Some((2, 16)),
            _ => None,
        };
        // On by default for K = 2048 only (measured faster there; `tc_all` for the rest). The
        // fold (AHEAD) lives in the SIMT loop only.
        let tc = match tc_geom {
            Some((_, nw)) => {
                route.is_none()
                    && ahead.is_none()
                    && bits == 4
                    && ws.iter().all(|w| w.gs == 64)
                    && (pro == 0 || (pro == 1 && nw == 8))
                    && self.on("tc_gemv")
                    && (k == 2048 || self.opted_in("tc_all"))
            }
            None => false,
        };
        // K = 4096 (16 warps), 1024 and 512: one tile per batch (gemv.cu's instantiations).
        let (tc_u, tc_s) = match tc_geom {
            // 4 stages for the lm_head (102 against 104 us at 3), 3 for the layers' projections
            // (in_proj 11.5 against 12.2, q|k|v 10.6 against 10.8).
            Some((2, 8)) => {
                let rows: usize = ws.iter().map(|w| w.out).sum();
                (tc_u(1), tc_s(if rows >= 65_536 { 4 } else { 3 }))
            }
            Some((2, 16)) => (1, tc_s(4)),
            _ => (1, 4),
        };
        let rb = if tc { 16 * tc_u } else { rw * u };
        let mut p = SwArgs {
            n: ws.len() as i32,
            ..SwArgs::empty()
        };
        for (i, (w, o)) in ws.iter().zip(outs).enumerate() {
            p.m[i] = w.q();
            p.out[i] = o.0;
            p.obf[i] = o.1;
            p.bstart[i + 1] = p.bstart[i] + w.out.div_ceil(rb) as i32;
        }
        for i in ws.len() + 1..5 {
            p.bstart[i] = p.bstart[ws.len()];
        }
        match x {
            SwX::Act(b) => {
                p.x = b.mem.ptr;
            }
            SwX::Norm { h, w, eps, xn } => {
                p.x = h.mem.ptr;
                p.nw = w.mem.ptr;
                p.eps = eps;
                p.xn = xn.map_or(0, |b| b.mem.ptr);
            }
            SwX::Gated { y, z, w, eps, dv } => {
                p.x = y;
                p.zp = z.mem.ptr;
                p.nw = w.mem.ptr;
                p.eps = eps;
                p.dv = dv as i32;
            }
        }
        if let Some(c) = conv {
            p.cw = c.w.mem.ptr;
            p.cst = c.state.mem.ptr;
            p.ck = c.k as i32;
        }
        if let Some((r, k, norm, publish)) = route {
            let Some(counter) = self.route_scratch() else {
                return;
            };
            p.rflag = publish as i32;
            p.rids = r.ids.ptr;
            p.rwts = r.weights.ptr;
            p.counter = counter;
            p.re = ws[0].out as i32;
            p.rk = k as i32;
            p.ntopk = norm as i32;
            // The whole last block routes (route.cuh, 256 threads, E <= 256): route_block, or
            // route_sort (opt-in) for k <= 8.
            p.rblock = self.route_kind(ws[0].out, k);
        }
        if let Some(n) = ahead {
            let Some(acc) = self.ahead_acc(n.router.out) else {
                return;
            };
            p.fr = n.router.q();
            p.fs = n.shared_gate.q();
            p.fnw = n.norm.mem.ptr;
            p.facc = acc;
            p.fe = n.router.out as i32;
        }
        let (name, threads, smem) = match (tc, tc_geom) {
            (true, Some((ns, nw))) => (
                format!("tc_gemv_{ns}_{nw}_{tc_u}_{tc_s}_{pro}"),
                32 * nw as u32,
                (tc_s * nw * tc_u * tc_slot(ns)) as u32,
            ),
            // The router folded in (AHEAD): kernels of their own, PRO 0 and 2.
            _ if ahead.is_some() => (
                format!("sw_gemv_ahead_{bits}_{}_{u}_{pro}", k / 256),
                256,
                0,
            ),
            _ => (format!("sw_gemv_{bits}_{}_{u}_{pro}", k / 256), 256, 0),
        };
        let batches = p.bstart[ws.len()] as u32;
        let grid = batches.min(self.resident_blocks(&name, threads, smem));
        self.launch(&name, (grid, 1, 1), threads, smem, &[Arg::S(Box::new(p))]);
    }

    /// The bits of the experts' format when the two streaming MoE launches take them (the routed
    /// and the shared experts in one format the kernels read, shapes fitting their geometry, `k`
    /// slots within the down kernel's), else None.
    fn moe_sw_bits(
        &self,
        gate: &Mat,
        up: &Mat,
        down: &Mat,
        sh: [&Mat; 3],
        k: usize,
    ) -> Option<usize> {
        let (hid, w) = (gate.inp, gate.out);
        let fmt = gate.fmt;
        let bits = Self::sw_bits(fmt)?;
        let [sg, su, sd] = sh;
        let same = [up.fmt, down.fmt, sg.fmt, su.fmt, sd.fmt]
            .iter()
            .all(|&f| f == fmt);
        let shapes = sg.out == w
            && su.out == w
            && sd.inp == w
            && sg.inp == hid
            && sd.out == hid
            && down.inp == w
            && down.out == hid;
        let geometry = hid.is_multiple_of(256)
            && 16 % (hid / 256) == 0
            && w.is_multiple_of(64)
            && w <= 1024
            && 32 % (w / 32) == 0
            && gate.gs.is_multiple_of(32)
            && [up.gs, sg.gs, su.gs].iter().all(|&g| g == gate.gs)
            && down.gs.is_multiple_of(32)
            && sd.gs == down.gs;
        (self.on("fuse_moe") && same && shapes && geometry && k < SWD_MAXSLOTS && k > 0)
            .then_some(bits)
    }

    /// The experts' launch arguments (act in scratch), or None where the scratch failed (recorded).
    #[allow(clippy::too_many_arguments)]
    fn moe_sw_args(
        &self,
        x: &Buf,
        route: &Route,
        k: usize,
        gate: &Mat,
        up: &Mat,
        down: &Mat,
        sh: [&Mat; 3],
        slogit: &Buf,
        h: &Buf,
        counter: bool,
    ) -> Option<SwMoe> {
        let mut sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let act = self.scratch(&mut sc, "moe_sw_act", 2 * (k + 1) * gate.out)?;
        // Zeroed when allocated; moe_wide_down leaves it at zero after every moe_step launch.
        let counter = if counter {
            // 8 bytes: moe_wide_down zeroes a u64 (a published route, or this count).
            self.scratch(&mut sc, "moe_step_counter", 8)?
        } else {
            0
        };
        Some(SwMoe {
            g: gate.q(),
            u: up.q(),
            d: down.q(),
            sg: sh[0].q(),
            su: sh[1].q(),
            sd: sh[2].q(),
            x: x.mem.ptr,
            ids: route.ids.ptr,
            wts: route.weights.ptr,
            slogit: slogit.mem.ptr,
            act,
            h: h.mem.ptr,
            k: k as i32,
            re: 0,
            counter,
            logits: 0,
            ntopk: 0,
            rblock: 0,
            done: 0,
            dn: 0,
            dpad: 0,
        })
    }

    /// `h += moe(x)` for one token as two streaming launches, when the experts and the shared
    /// expert share a format the kernels read and the shapes fit their geometry; `false`: not
    /// run (the caller composes the unfused ops).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_sw(
        &self,
        x: &Buf,
        route: &Route,
        gate: &Mat,
        up: &Mat,
        down: &Mat,
        sh: &SharedExpert<'_, Cuda>,
        h: &mut Buf,
    ) -> bool {
        let (hid, w, k) = (gate.inp, gate.out, route.k);
        let shm = [sh.gate, sh.up, sh.down];
        let Some(bits) = self.moe_sw_bits(gate, up, down, shm, k) else {
            return false;
        };
        let Some(p) = self.moe_sw_args(x, route, k, gate, up, down, shm, sh.logit, h, false) else {
            return true;
        };
        // On tensor cores (moe.cu's moe_tc_*): 4-bit, group size 64, hidden cut as tc_gemv's K,
        // the width W = 128·NS with NS ≤ 4.
        let gs64 = [gate.gs, up.gs, down.gs, sh.gate.gs, sh.up.gs, sh.down.gs]
            .iter()
            .all(|&g| g == 64);
        let tc_hid = match hid {
            1024 => Some((2, 4)),
            2048 => Some((2, 8)),
            4096 => Some((2, 16)),
            _ => None,
        };
        if let (true, 4, true, Some((ns, nw)), true) = (
            self.on("tc_gemv") && self.opted_in("tc_all"),
            bits,
            gs64,
            tc_hid,
            matches!(w, 128 | 256 | 512),
        ) {
            let st = if nw == 8 {
                tc_s(4)
            } else if nw == 4 {
                4
            } else {
                2
            };
            let name = format!("moe_tc_gate_up_{ns}_{nw}_{st}");
            let threads = 32 * nw as u32;
            let smem = (st * nw * 2 * tc_slot(ns)) as u32;
            let batches = ((k + 1) * w.div_ceil(16)) as u32;
            let grid = batches.min(self.resident_blocks(&name, threads, smem));
            self.launch(&name, (grid, 1, 1), threads, smem, &[Arg::E(Box::new(p))]);
            let name = format!("moe_tc_down_{}", w / 128);
            let threads = 32 * (k + 1) as u32;
            let grid = (hid.div_ceil(16) as u32).min(self.resident_blocks(&name, threads, 0));
            self.launch(&name, (grid, 1, 1), threads, 0, &[Arg::E(Box::new(p))]);
            return true;
        }
        if self.on("moe_wide") && self.moe_wide(&p, bits, hid, w, k, [gate.gs, down.gs]) {
            return true;
        }
        // gate|up: the gemv geometry over hidden, RW rows per load.
        let rw = 32 / (hid / 256);
        let u = 2; // the one instantiated (moe.cu): 4 spills
        let name = format!("moe_sw_gate_up_{bits}_{}_{u}", hid / 256);
        let batches = ((k + 1) * w.div_ceil(rw * u)) as u32;
        let grid = batches.min(self.resident_blocks(&name, 256, 0));
        self.launch(&name, (grid, 1, 1), 256, 0, &[Arg::E(Box::new(p))]);
        // down: warp per slot over the whole row of W inputs, RW = 32 / (W/32) rows per load.
        let rw = 32 / (w / 32);
        let u = 2; // the one instantiated (moe.cu)
        let name = format!("moe_sw_down_{bits}_{}_{u}", w / 32);
        let threads = 32 * (k + 1) as u32;
        let batches = grid1(hid, rw * u);
        let grid = batches.min(self.resident_blocks(&name, threads, 0));
        self.launch(&name, (grid, 1, 1), threads, 0, &[Arg::E(Box::new(p))]);
        true
    }
}

impl Cuda {
    /// moe_wide's rows per block (gate|up, down) when its kernels take these experts, else None:
    /// instantiated for hidden 2048 and width 512 (the full model). `gs`: the group sizes of
    /// gate|up and of down (the rest checked equal by moe_sw_bits).
    fn moe_wide_fits(
        &self,
        p: &SwMoe,
        hid: usize,
        w: usize,
        k: usize,
        gs: [usize; 2],
    ) -> Option<(usize, usize)> {
        let (rpb, dr) = moe_wide_rows();
        // A lane's scale word holds its group at the group's parity: groups per row even.
        // The scale and bias words are copied 4 bytes at a time from the matrices' own buffers.
        let aligned = [p.g, p.u, p.d, p.sg, p.su, p.sd]
            .iter()
            .all(|m| m.s % 4 == 0 && m.b % 4 == 0);
        let fits = aligned
            && hid == 2048
            && w == 512
            && (hid / gs[0]).is_multiple_of(2)
            && (w / gs[1]).is_multiple_of(2)
            && w.is_multiple_of(rpb)
            && hid.is_multiple_of(dr)
            && k < SWD_MAXSLOTS;
        fits.then_some((rpb, dr))
    }

    /// The wide form of `moe_sw` (moe.cu's moe_wide_*, switch `moe_wide`): every block requests
    /// all its weights at once through cp.async into shared memory, the shared expert's gate|up
    /// and all of down's weights before the PDL wait. `false`: the shapes do not fit (the caller
    /// runs moe_sw).
    fn moe_wide(
        &self,
        p: &SwMoe,
        bits: usize,
        hid: usize,
        w: usize,
        k: usize,
        gs: [usize; 2],
    ) -> bool {
        let Some((rpb, dr)) = self.moe_wide_fits(p, hid, w, k, gs) else {
            return false;
        };
        let (name, grid, smem) = moe_wide_gate_up_launch("moe_wide", bits, hid, w, k, rpb);
        self.launch(&name, (grid, 1, 1), 256, smem, &[Arg::E(Box::new(*p))]);
        self.moe_wide_down("moe_wide", p, bits, hid, w, k, dr);
        true
    }

    /// moe_wide's down launch (`kind` moe_wide, moe_late or moe_flag): H / DR blocks, warp j slot
    /// j; G = DR / RW row groups of RW = 32 / (W / 32) rows; shared memory G·T·(16·NP + 8) with T
    /// = 32·(k + 1) threads. moe_wide's becomes moe_tma_down (switch `down_tma`, on by default)
    /// where down_tma_slot takes the experts: (k + 1) slots of its bytes.
    #[allow(clippy::too_many_arguments)]
    fn moe_wide_down(
        &self,
        kind: &str,
        p: &SwMoe,
        bits: usize,
        hid: usize,
        w: usize,
        k: usize,
        dr: usize,
    ) {
        let c = w / 32;
        let threads = 32 * (k + 1);
        let g = dr / (32 / c);
        let mut smem = (g * threads * (16 * (bits / 4) + 8)) as u32;
        let mut kind = kind;
        if kind == "moe_wide" && self.on("down_tma") {
            if let Some(slot) = down_tma_slot(p, bits, w, dr) {
                kind = "moe_tma";
                smem = ((k + 1) * slot) as u32;
            }
        }
        self.launch(
            &format!("{kind}_down_{bits}_{c}_{dr}"),
            ((hid / dr) as u32, 1, 1),
            threads as u32,
            smem,
            &[Arg::E(Box::new(*p))],
        );
    }

    /// The experts' bits when an MoE block's router and experts take the one-token forms that
    /// route on the device (moe_step): moe_wide's experts, the router | shared
    /// gate one streaming GEMV over K = hidden with the norm prologue, at most 256 experts
    /// (route_block), top-k of 1 to 32. None: not taken.
    fn moe_step_experts(&self, mw: &MoeWeights<'_, Cuda>, d: &Dims) -> Option<usize> {
        let (e, k, hid) = (d.n_experts, d.top_k, d.hidden);
        let (rt, rs) = (mw.router, mw.shared_gate);
        let shm = [mw.shared_gate_proj, mw.shared_up_proj, mw.shared_down_proj];
        let fits = self.on("moe_wide")
            && self.on("fuse_norm")
            && self.sw_fits(&[rt, rs])
            && rt.inp == hid
            && rt.out == e
            && e <= 256
            && (1..=32).contains(&k)
            && k <= e;
        fits.then(|| self.moe_sw_bits(mw.gate, mw.up, mw.down, shm, k))
            .flatten()
    }

    /// sw_gemv_route's scratch (ROUTE_SCRATCH), zeroed when allocated. None: the scratch failed
    /// (recorded).
    fn route_scratch(&self) -> Option<u64> {
        let mut sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        self.scratch(&mut sc, "route_counter", ROUTE_SCRATCH)
    }

    /// The operands of moe_step_add checked (a failure is recorded: the op is then skipped).
    pub(super) fn moe_step_operands_ok(
        &self,
        h: &Buf,
        norm: &Buf,
        mw: &MoeWeights<'_, Cuda>,
        d: &Dims,
        r: &RouterScratch<'_, Cuda>,
    ) -> bool {
        let op = "moe_step_add";
        let (e, k, hid) = (d.n_experts, d.top_k, d.hidden);
        self.experts_ok(mw.gate, mw.up, mw.down, d, op)
            && self.buf_ok(h, hid, "h", op)
            && self.buf_ok(norm, hid, "norm", op)
            && self.act_ok(r.xn, hid, "xn", op)
            && self.buf_ok(r.logits, e, "logits", op)
            && self.out_ok(r.s, mw.shared_gate.out, "s", op)
            && self.ensure(k <= r.route.cap, || {
                format!("{op}: route holds {} entries, {k} needed", r.route.cap)
            })
    }

    /// The MoE block of one token (Backend::moe_step_add) in moe_wide's launches with the route
    /// moved or handed over differently, by one of three opt-ins:
    /// * `moe_step`: the router folded into the experts' gate|up launch (moe.cu's
    ///   moe_step_gate_up_*), then moe_wide's down. Takes an 8-bit router and shared gate of K =
    ///   hidden; the whole gate|up grid must be resident at once (its routed blocks wait for its
    ///   router blocks).
    /// * `late_route`: the router | shared gate as a plain streaming GEMV with the norm prologue
    ///   (sw_gemv_8: the logits, the shared gate's logit and x; no ticket, no route in a last
    ///   block), then moe_wide's two launches in which every routed gate|up block (after its PDL
    ///   wait) and every down block (before its own) routes the logits itself (moe.cu's
    ///   moe_late_*, route.cuh route_sort). Why: the router's last block (fence, ticket, the
    ///   logits read back, the route) is a chain of ~4 µs a layer after its dots (`lily bench
    ///   --trace`). Measured neutral on the H200: the route on gate|up's critical path costs as
    ///   much (switches.rs `late_route`).
    ///
    /// * `route_flag`: the router as moe_router launches it (sw_gemv_8, the route in its last
    ///   block), which also publishes the ids as one u64 (route.cuh route_weights; k <= 8);
    ///   moe_wide's gate|up polls that word instead of a PDL wait and a read of the ids
    ///   (moe.cu's moe_flag_gate_up), and moe_wide's down zeroes it after its wait. Why: gate|up's
    ///   routed blocks can request their expert's rows only after the router's grid completes
    ///   and then one L2 round trip for the ids (~2 µs a layer from the wait to the rows
    ///   requested, the trace's median); here the ids arrive with the poll. What down reads is
    ///   still ordered: its ids (before its own PDL wait, ld.global.cg) and the weights (after
    ///   it) were written before the router's release, which every gate|up block acquired
    ///   before letting down launch; the router's grid may still be exiting, but it writes
    ///   nothing after the word.
    ///
    ///   With `down_flag` too, down polls a count of gate|up blocks done instead of its PDL
    ///   wait (moe.cu moe_flag_down, moe_wait_done): gate|up's grid completion off the chain as
    ///   well. Down's block 0 zeroes the route word before its launch lets the next kernel
    ///   start, as moe_wide_down does.
    ///
    /// All give the composition's bits, take at most 256 experts and whatever moe_wide takes.
    /// `false`: not taken (the caller composes moe_router and moe_decode_add).
    pub(super) fn moe_step(
        &self,
        h: &mut Buf,
        norm: &Buf,
        eps: f32,
        mw: &MoeWeights<'_, Cuda>,
        d: &Dims,
        r: &mut RouterScratch<'_, Cuda>,
    ) -> bool {
        let fold = self.opted_in("moe_step");
        let late = !fold && self.opted_in("late_route");
        let flag = !fold && !late && self.opted_in("route_flag");
        if !(fold || late || flag) {
            return false;
        }
        let (e, k, hid) = (d.n_experts, d.top_k, d.hidden);
        let (rt, rs) = (mw.router, mw.shared_gate);
        let shm = [mw.shared_gate_proj, mw.shared_up_proj, mw.shared_down_proj];
        let router = if fold {
            Self::sw_bits(rt.fmt) == Some(8) && rs.out == 1 && r.s.bf16() == 0
        } else if flag {
            // Eight ids of 8 bits in the published word (moe_step_experts: E <= 256); the
            // publishing tail is compiled into the 8-bit sw_gemv only, and into the whole-block
            // routes (route_block, route_sort), not route_warp.
            k <= 8 && Self::sw_bits(rt.fmt) == Some(8) && self.route_kind(e, k) != 0
        } else {
            self.on("route_block")
        };
        let taken =
            router && self.on("fuse_route") && !(self.on("tc_gemv") && self.opted_in("tc_all"));
        let Some(bits) = taken.then(|| self.moe_step_experts(mw, d)).flatten() else {
            return false;
        };
        if !self.moe_step_operands_ok(h, norm, mw, d, r) {
            return true;
        }
        let w = mw.gate.out;
        let Some(mut p) =
            self.moe_sw_args(r.xn, r.route, k, mw.gate, mw.up, mw.down, shm, r.s, h, fold)
        else {
            return true;
        };
        let Some((rpb, dr)) = self.moe_wide_fits(&p, hid, w, k, [mw.gate.gs, mw.down.gs]) else {
            return false;
        };
        if fold {
            let (name, grid, smem) = moe_wide_gate_up_launch("moe_step", bits, hid, w, k, rpb);
            // The router's blocks are the first ceil((E + 1) / RW) of the grid; all must be
            // resident.
            let nrj = (e + 1).div_ceil(32 / (hid / 256)) as u32;
            if nrj > grid || self.resident_blocks(&name, 256, smem) < grid {
                return false;
            }
            let st = SwStep {
                m: p,
                r: rt.q(),
                rs: rs.q(),
                nw: norm.mem.ptr,
                xn: r.xn.mem.ptr,
                logits: r.logits.mem.ptr,
                s: r.s.mem.ptr,
                eps,
                e: e as i32,
                ntopk: d.norm_topk as i32,
                sobf: r.s.bf16(),
                probe: moe_step_probe(),
                pad: 0,
            };
            self.launch(&name, (grid, 1, 1), 256, smem, &[Arg::T(Box::new(st))]);
        } else {
            // The router as moe_router launches it (sw_gemv, the norm prologue). route_flag: it
            // also routes in its last block and publishes the ids (ROUTE_SCRATCH's layout);
            // late_route: its logits only, every routed gate|up block routing them.
            let base = if flag {
                let Some(b) = self.route_scratch() else {
                    return true;
                };
                b
            } else {
                0
            };
            let x = SwX::Norm {
                h,
                w: norm,
                eps,
                xn: Some(r.xn),
            };
            let outs = [(r.logits.mem.ptr, 0), (r.s.mem.ptr, r.s.bf16())];
            let route = flag.then_some((&*r.route, k, d.norm_topk, true));
            self.sw_gemv_route(x, &[rt, rs], &outs, route, None, None);
            let kind = if flag {
                p.counter = base + 8;
                "moe_flag"
            } else {
                p.re = e as i32;
                p.logits = r.logits.mem.ptr;
                p.ntopk = d.norm_topk as i32;
                // Every routed block routes (route.cuh route_by): route_sort for k <= 8.
                p.rblock = 2;
                "moe_late"
            };
            let (name, grid, smem) = moe_wide_gate_up_launch(kind, bits, hid, w, k, rpb);
            if flag && self.opted_in("down_flag") {
                p.done = base + 16;
                p.dn = grid as i32;
            }
            self.launch(&name, (grid, 1, 1), 256, smem, &[Arg::E(Box::new(p))]);
        }
        r.route.k = k;
        let down = if late {
            "moe_late"
        } else if p.done != 0 {
            "moe_flag"
        } else {
            "moe_wide"
        };
        self.moe_wide_down(down, &p, bits, hid, w, k, dr);
        true
    }
}

/// Timing probes of moe_step_gate_up (`LILY_MOE_STEP_PROBE`, bits: 1 no wait for the router's
/// count, 2 no route, 4 no norm, 8 no fence). Each leaves a phase out, so the step's time without
/// it is that phase's cost in place; the results are wrong. 0 (the default): none.
fn moe_step_probe() -> i32 {
    static P: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *P.get_or_init(|| {
        std::env::var("LILY_MOE_STEP_PROBE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    })
}

/// Name, grid and dynamic shared memory of moe_wide's gate|up launch (`kind` moe_wide or
/// moe_step): (k + 1)·W / RPB blocks of 256 threads, the shared expert's first; G = RPB / RW row
/// groups of RW = 32 / (hid / 256) rows; shared memory G·(2·NP·256·16 + 2·2·256·4).
fn moe_wide_gate_up_launch(
    kind: &str,
    bits: usize,
    hid: usize,
    w: usize,
    k: usize,
    rpb: usize,
) -> (String, u32, u32) {
    let c = hid / 256;
    let g = rpb / (32 / c);
    let smem = (g * (2 * (bits / 4) * 256 * 16 + 2 * 2 * 256 * 4)) as u32;
    (
        format!("{kind}_gate_up_{bits}_{c}_{rpb}"),
        ((k + 1) * w / rpb) as u32,
        smem,
    )
}

/// Bytes of shared memory a slot of moe_tma_down takes (switch `down_tma`: its DR rows), or None
/// (moe_wide's own down runs). Called after moe_wide_fits, whose shapes (W = 512, H = 2048,
/// groups a row even, DR >= 4) make every copy's size and every expert's and block's offset a
/// multiple of 16 bytes: tma_layout's checks are what is left.
fn down_tma_slot(p: &SwMoe, bits: usize, w: usize, dr: usize) -> Option<usize> {
    tma_layout(&[p.d, p.sd], w, bits).map(|row| dr * row)
}

/// The bytes a row of these matrices (K = `k` inputs) takes in shared memory as wide.cuh's
/// tma_rows copies it (codes, then its groups' bf16 scales and biases), or None where the bulk
/// copies cannot take them: every buffer must start 16-byte aligned, and all must have the
/// first's groups (one row layout).
fn tma_layout(ms: &[QMat], k: usize, bits: usize) -> Option<usize> {
    let gs = ms[0].gs;
    let ok = ms
        .iter()
        .all(|q| q.w % 16 == 0 && q.s % 16 == 0 && q.b % 16 == 0 && q.gs == gs);
    ok.then(|| k * bits / 8 + 4 * (k / gs as usize))
}

/// Rows per block of moe_wide's gate|up and down kernels (`LILY_CUDA_MOE_WIDE=RPB,DR`: RPB 8, 16
/// or 32, DR 4, 8, 16 or 32). Default 16,8: 288 gate|up blocks, 2-3 per SM, and 256 down blocks;
/// the H200 lab (experts, µs per layer): 16,16 13.6; 8,16 14.0; 32,16 15.6; 16,8 11.6; 16,32
/// 15.6 (moe_sw: 13.7).
fn moe_wide_rows() -> (usize, usize) {
    static RD: std::sync::OnceLock<(usize, usize)> = std::sync::OnceLock::new();
    *RD.get_or_init(|| {
        let v = std::env::var("LILY_CUDA_MOE_WIDE").unwrap_or_default();
        let mut it = v.split(',').map(|s| {
            s.trim()
                .parse::<usize>()
                .ok()
                .filter(|n| [4, 8, 16, 32].contains(n))
        });
        let rpb = it.next().flatten().filter(|&n| n >= 8).unwrap_or(16);
        (rpb, it.next().flatten().unwrap_or(8))
    })
}

/// Bytes of one warp's shared-memory slot for a 16-row tile of NS spans (tc_stream.cuh's TcSlot).
fn tc_slot(ns: usize) -> usize {
    (2 * ns + 1) * 512
}

/// A tensor-core kernel parameter from the environment (the lab compares them), read once by
/// the caller's OnceLock: `var` if it names one of `allowed`, else `default`.
fn env_choice(
    cell: &std::sync::OnceLock<Option<usize>>,
    var: &str,
    allowed: &[usize],
    default: usize,
) -> usize {
    cell.get_or_init(|| std::env::var(var).ok().and_then(|s| s.parse().ok()))
        .filter(|x| allowed.contains(x))
        .unwrap_or(default)
}

/// Tiles of 16 rows per batch of the tensor-core GEMVs (`LILY_CUDA_TC_U`: 1 or 2).
fn tc_u(default: usize) -> usize {
    static U: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    env_choice(&U, "LILY_CUDA_TC_U", &[1, 2], default)
}

/// cp.async stages of the tensor-core kernels (`LILY_CUDA_TC_S`: 3 or 4).
fn tc_s(default: usize) -> usize {
    static S: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    env_choice(&S, "LILY_CUDA_TC_S", &[3, 4], default)
}
