//! The kernel lab (`lily lab`): each weight-reading op of a decode step timed alone, beside a pure
//! streaming read of the same bytes, with the decode optimisations on and off.
//!
//! A decode step is a byte budget (DESIGN.md): each op that reads weights should move them at the
//! speed a plain read of the same bytes reaches. `lily bench --profile` times ops inside a whole
//! step, with a sync around each; here each op runs alone, so its kernels can be judged and
//! compared with the ones they replace:
//! * Every call is L2-cold (unless `LILY_LAB_HOT=1`: two copies, L2-hot; with `LILY_LAB_FLUSH=1`
//!   the whole L2 is flushed before every call, code and inputs too; with `=2` only the page-table
//!   caches, by one read a 2 MB page: `Cuda::time_graph`). A case holds enough distinct copies of its weights that the bytes read
//!   between two reads of one copy are at least [`L2_FACTOR`] × the L2 (and [`MIN_CYCLE`]): an
//!   H200 has 50 MB of L2, a layer's in_proj is 14 MB. The copies are made on the device
//!   ([`Cuda::random_mat`], `lab_fill_mat` in kernels/lab.cu), not uploaded (one lm_head is 286 MB).
//!   The routed experts are one stack; each call reads 8 experts that the calls just before it did
//!   not (routes made with `moe_route` before recording, walking a random permutation of the
//!   experts 8 at a time): a real step reads one layer's experts 39 layers apart, cold too.
//! * Calls run back to back in one CUDA graph (`time_recorded`), as in a recorded decode step:
//!   no host launch cost, the same gaps between kernels. The graph's calls are a whole number of
//!   cycles through the copies (the count asked for is rounded up), so that the next launch starts
//!   on the copy read longest ago. The median over [`REPS`] launches, per call.
//! * The pure read (`time_pure_read`, `lab_read`) reads the same number of bytes from the same
//!   number of distinct buffers in the same kind of graph: the bandwidth an op of that size could
//!   reach (small ops are latency-bound, and so is their read). `ratio` = op time / read time.
//! * Each op is called through the `Backend` trait, so the kernels measured are whichever the
//!   backend picks; each case runs twice, with every switch of [`super::SWITCHES`] on and off
//!   (the order alternated from case to case), the read measured beside each.

use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{sys, CudaGraph};

use super::{Arg, Cuda, Fmt, Mat, Mem, SWITCHES};
use crate::backend::{Backend, Dims, MoeScratch, RouteAhead, RouterScratch, SharedExpert};
use crate::rng::Rng;
use crate::Config;

/// Graph launches timed per figure (after one untimed launch); the median is kept.
pub const REPS: usize = 7;
/// The bytes a case reads between two reads of one copy: at least this many times the L2 ...
const L2_FACTOR: usize = 4;
/// ... and at least this many bytes.
const MIN_CYCLE: usize = 200_000_000;
/// The lm_head (286 MB a call, far above the L2 on its own) runs this fraction of the calls asked.
const LM_HEAD_CALL_DIV: usize = 8;
/// Most calls in one graph.
pub const MAX_CALLS: usize = 16_384;
/// Device memory left free beyond a case's buffers.
const HEADROOM: usize = 512 << 20;

/// A lab case: one weight-reading op of a decode step (`--cases` takes the short names).
pub struct Case {
    pub short: &'static str,
    pub name: &'static str,
}

pub const CASES: &[Case] = &[
    Case {
        short: "in_proj",
        name: "gdn in_proj (qkv|z|b|a)",
    },
    Case {
        short: "qkv",
        name: "attn q|k|v",
    },
    Case {
        short: "out_proj",
        name: "gdn out_proj (+ residual)",
    },
    Case {
        short: "o_proj",
        name: "attn o_proj (+ residual)",
    },
    Case {
        short: "router",
        name: "router | shared gate (8-bit)",
    },
    Case {
        short: "route",
        name: "moe_route",
    },
    Case {
        short: "ahead",
        name: "out_proj + router folded (route_ahead)",
    },
    Case {
        short: "experts",
        name: "experts (8 routed + shared)",
    },
    Case {
        short: "lm_head",
        name: "lm_head",
    },
];

/// One measured row: a case under one setting of the switches.
#[derive(Clone, Debug)]
pub struct LabRow {
    pub short: &'static str,
    pub name: &'static str,
    /// `on` (every decode optimisation on, except those LILY_CUDA_DISABLE named) or `off` (every
    /// switch of SWITCHES off).
    pub opts: &'static str,
    /// Weight bytes one call reads (0: an op that reads none).
    pub bytes: usize,
    /// Distinct copies of the weights cycled through.
    pub copies: usize,
    /// Calls per recorded graph.
    pub calls: usize,
    /// Seconds per call (median).
    pub op_s: f64,
    /// Seconds per call of the pure read of `bytes` (none when `bytes` is 0).
    pub read_s: Option<f64>,
    /// Kernel launches per call (kernel nodes of the graph / calls).
    pub kernels_per_call: f64,
    /// Other graph nodes per call (memsets, copies).
    pub other_nodes_per_call: f64,
}

impl LabRow {
    /// Bytes per second of the op (none for an op that reads no weights).
    pub fn op_bw(&self) -> Option<f64> {
        (self.bytes > 0).then(|| self.bytes as f64 / self.op_s)
    }
    pub fn read_bw(&self) -> Option<f64> {
        self.read_s.map(|t| self.bytes as f64 / t)
    }
    /// Op time / pure-read time.
    pub fn ratio(&self) -> Option<f64> {
        self.read_s.map(|t| self.op_s / t)
    }
}

/// What a lab run measured.
#[derive(Clone, Debug)]
pub struct LabReport {
    pub device: String,
    pub l2_bytes: usize,
    /// Bytes read at least between two reads of one copy.
    pub cycle_bytes: usize,
    pub rows: Vec<LabRow>,
}

/// A recorded graph's timing: seconds per call and its node counts.
#[derive(Clone, Copy, Debug)]
pub struct GraphTiming {
    pub seconds: f64,
    pub kernels: usize,
    pub nodes: usize,
}

impl Cuda {
    /// A stack of `n` random matrices `[out, inp]` in exactly the format `mat_fmt` makes of an
    /// MLX bf16-scale checkpoint (Fmt::Q4Bf16 / Q8Bf16), filled on the device (`lab_fill_mat`):
    /// codes uniform, scales in [0.01, 0.02), biases centring the codes on zero.
    pub fn random_mat(
        &self,
        n: usize,
        out: usize,
        inp: usize,
        bits: u32,
        gs: usize,
        seed: u32,
    ) -> Result<Mat> {
        let fmt = match bits {
            4 => Fmt::Q4Bf16,
            8 => Fmt::Q8Bf16,
            _ => bail!("random_mat: {bits}-bit weights (4 and 8 are supported)"),
        };
        if n == 0 || out == 0 || inp == 0 {
            bail!("random_mat: an empty stack {n}×{out}×{inp}");
        }
        if !inp.is_multiple_of(32) || gs == 0 || !gs.is_multiple_of(32) || !inp.is_multiple_of(gs) {
            bail!("random_mat: group size {gs} with input width {inp} (both multiples of 32, the group dividing the width)");
        }
        let nw = n * out * inp * bits as usize / 32;
        let ng = n * out * inp / gs;
        self.lab_room(4 * nw + 4 * ng, "a random weight stack")?;
        let (w, s, b) = (
            self.alloc(4 * nw)?,
            self.alloc(2 * ng)?,
            self.alloc(2 * ng)?,
        );
        let zero = (1u32 << (bits - 1)) as f32;
        self.lab_fill(&w, nw, Some((&s, &b, ng)), seed, zero)?;
        Ok(Mat {
            n,
            out,
            inp,
            fmt,
            gs,
            w,
            s: Some(s),
            b: Some(b),
        })
    }

    /// Records `ops(0) .. ops(calls-1)` into one CUDA graph and returns the median seconds per
    /// call over REPS launches. The ops run once each directly first (a warm-up that makes every
    /// scratch buffer they need: `alloc` refuses to allocate while recording), then the graph is
    /// launched once untimed.
    pub fn time_recorded(
        &self,
        calls: usize,
        ops: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<f64> {
        Ok(self.time_graph(calls, ops)?.seconds)
    }

    /// `time_recorded` with the graph's node counts (kernel launches per call). With
    /// `LILY_LAB_FLUSH=1` every call is preceded by a streaming read of twice the L2 (`lab_read`
    /// over a buffer of its own), and the figures are those of the graph with the reads minus
    /// those of the reads alone: the op with nothing of its own in L2 (its code and inputs
    /// neither), as in a decode step, where 1.67 GB of weights a token pass through the L2.
    /// With `LILY_LAB_FLUSH=2` the flush is one 16-byte read every 2 MB over up to 32 GiB
    /// (`lab_touch`): the GPU's page-table caches replaced, the L2 nearly untouched (a line a
    /// page). Stop 25's full flush cost in_proj, out_proj, the router and the experts 6-15 µs a
    /// call; this says how much of that is the TLB.
    pub fn time_graph(
        &self,
        calls: usize,
        ops: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<GraphTiming> {
        let mode = std::env::var("LILY_LAB_FLUSH").unwrap_or_default();
        if !matches!(mode.as_str(), "1" | "2") {
            if !matches!(mode.as_str(), "" | "0") {
                bail!("LILY_LAB_FLUSH={mode}: 0 (none), 1 (the whole L2) or 2 (the page-table caches)");
            }
            return self.time_graph_plain(calls, ops);
        }
        let blocks = 4 * self.lab_sms()?;
        let sink = self.alloc(4 * blocks as usize)?;
        // The flush kernel, its buffer (kept alive while the graphs are recorded) and arguments.
        let (name, _buf, args) = if mode == "1" {
            let l2 = self
                .ctx
                .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?
                .max(1 << 20) as usize;
            let words = 2 * l2 / 16;
            self.lab_room(16 * words, "the L2 flush's buffer")?;
            let buf = self.alloc(16 * words)?;
            self.lab_fill(&buf, 4 * words, None, 0xf105, 0.0)?;
            let args = [buf.ptr, words as u64, sink.ptr].map(Arg::P);
            ("lab_read", buf, Vec::from(args))
        } else {
            const PAGE: usize = 2 << 20;
            let (free, _) = self.mem_info()?;
            let bytes = (32usize << 30).min(free.saturating_sub(HEADROOM) / 2) / PAGE * PAGE;
            if bytes < 1024 * PAGE {
                bail!(
                    "kernel lab (LILY_LAB_FLUSH=2): {} MiB free, too few pages to replace the TLB",
                    free >> 20
                );
            }
            let buf = self.alloc(bytes)?;
            let args = [buf.ptr, (bytes / PAGE) as u64, (PAGE / 16) as u64, sink.ptr].map(Arg::P);
            ("lab_touch", buf, Vec::from(args))
        };
        let flush = || self.launch(name, (blocks, 1, 1), 256, 0, &args);
        let with = self.time_graph_plain(calls, &mut |i| {
            flush();
            ops(i)
        })?;
        let alone = self.time_graph_plain(calls, &mut |_| {
            flush();
            Ok(())
        })?;
        let t = with.seconds - alone.seconds;
        if !(t.is_finite() && t > 0.0) {
            bail!(
                "kernel lab (LILY_LAB_FLUSH): the op measured {t} s per call beside the flush ({} s with it, {} s alone)",
                with.seconds,
                alone.seconds
            );
        }
        Ok(GraphTiming {
            seconds: t,
            kernels: with.kernels - alone.kernels,
            nodes: with.nodes - alone.nodes,
        })
    }

    fn time_graph_plain(
        &self,
        calls: usize,
        ops: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<GraphTiming> {
        if calls == 0 || calls > MAX_CALLS {
            bail!("kernel lab: {calls} calls per graph (1 to {MAX_CALLS})");
        }
        self.check()
            .context("kernel lab: the backend is in a failed state")?;
        for i in 0..calls {
            ops(i)?;
        }
        self.check()
            .context("kernel lab: running the ops directly (warm-up)")?;
        let mut all = || -> Result<()> {
            for i in 0..calls {
                ops(i)?;
            }
            Ok(())
        };
        let graph = self
            .capture(&mut all)
            .context("kernel lab: recording the calls")?;
        let (nodes, kernels) = graph_nodes(&graph)?;
        let launch = |g: &CudaGraph| {
            g.launch()
                .map_err(|e| anyhow!("kernel lab: launching the recorded calls: {e}"))
        };
        launch(&graph)?;
        self.check()
            .context("kernel lab: the first launch of the recorded calls")?;
        let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut ts = Vec::with_capacity(REPS);
        for _ in 0..REPS {
            let t0 = self.stream.record_event(timing)?;
            launch(&graph)?;
            let t1 = self.stream.record_event(timing)?;
            // Waits for the work: an asynchronous fault surfaces here.
            ts.push(
                t0.elapsed_ms(&t1)
                    .context("kernel lab: timing (a device error?)")? as f64
                    / 1e3,
            );
        }
        self.check().context("kernel lab: the timed launches")?;
        ts.sort_by(f64::total_cmp);
        let t = ts[REPS / 2] / calls as f64;
        if !(t.is_finite() && t > 0.0) {
            bail!("kernel lab: a measured time of {t} s per call");
        }
        Ok(GraphTiming {
            seconds: t,
            kernels,
            nodes,
        })
    }

    /// Median seconds per call of a pure streaming read of `bytes` bytes (`lab_read`), each call
    /// reading the next of `copies` distinct buffers, `calls` calls recorded in one graph.
    pub fn time_pure_read(&self, bytes: usize, copies: usize, calls: usize) -> Result<f64> {
        if bytes == 0 || copies == 0 {
            bail!("kernel lab: a pure read of {bytes} bytes from {copies} buffers");
        }
        let words = bytes.div_ceil(16);
        // Each copy starts 256-byte aligned, as an allocation does.
        let stride = (16 * words).next_multiple_of(256);
        self.lab_room(stride * copies, "the pure read's buffers")?;
        let buf = self.alloc(stride * copies)?;
        // Random contents, like the weights (the memory system does not see zeros differently
        // today, but a read of zeros would prove nothing should it start to).
        self.lab_fill(&buf, stride * copies / 4, None, 0x5eed, 0.0)?;
        let blocks = (4 * self.lab_sms()? as usize)
            .min(words.div_ceil(256))
            .max(1);
        let sink = self.alloc(4 * blocks)?;
        let n = words as u64;
        self.time_recorded(calls, &mut |i| {
            let src = buf.ptr + ((i % copies) * stride) as u64;
            self.launch(
                "lab_read",
                (blocks as u32, 1, 1),
                256,
                0,
                &[Arg::P(src), Arg::P(n), Arg::P(sink.ptr)],
            );
            Ok(())
        })
    }

    /// Runs the lab cases named (`CASES` short names; all when empty) at the shapes of `cfg`,
    /// each with the decode optimisations on and off. `row` sees each row as it is measured.
    /// The switches are restored afterwards.
    pub fn run_lab(
        &self,
        cfg: &Config,
        cases: &[&str],
        calls: usize,
        row: &mut dyn FnMut(&LabRow),
    ) -> Result<LabReport> {
        for c in cases {
            if !CASES.iter().any(|k| k.short == *c) {
                bail!(
                    "unknown lab case `{c}` (known: {})",
                    CASES.iter().map(|k| k.short).collect::<Vec<_>>().join(", ")
                );
            }
        }
        if calls == 0 || calls > MAX_CALLS {
            bail!("--calls {calls}: 1 to {MAX_CALLS}");
        }
        let l2 = self
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?
            .max(0) as usize;
        // LILY_LAB_HOT=1: two copies only (a layer's weights fit the L2 twice): the op with its
        // weights already in L2, the bound on what prefetching them into L2 could give.
        let cycle = if std::env::var("LILY_LAB_HOT").is_ok_and(|v| v == "1") {
            1
        } else {
            (L2_FACTOR * l2).max(MIN_CYCLE)
        };
        let before = self.disabled();
        let mut rows = Vec::new();
        let r = (|| -> Result<()> {
            for (k, case) in CASES
                .iter()
                .enumerate()
                .filter(|(_, c)| cases.is_empty() || cases.contains(&c.short))
            {
                let lab = Lab {
                    cuda: self,
                    cfg,
                    d: Dims::from_config(cfg),
                    case,
                    cycle,
                    calls,
                    flip: k % 2 == 1,
                    seed: 1 + 1000 * k as u32,
                    on: &before,
                };
                for r in lab
                    .run()
                    .with_context(|| format!("kernel lab, case `{}`", case.short))?
                {
                    row(&r);
                    rows.push(r);
                }
            }
            Ok(())
        })();
        let restored = self.set_disabled(&before);
        r?;
        restored?;
        Ok(LabReport {
            device: self.device.clone(),
            l2_bytes: l2,
            cycle_bytes: cycle,
            rows,
        })
    }

    /// Fills `w` (`nw` u32 words) with random codes and, with `sb`, `ng` bf16 scales and biases.
    fn lab_fill(
        &self,
        w: &Mem,
        nw: usize,
        sb: Option<(&Mem, &Mem, usize)>,
        seed: u32,
        zero: f32,
    ) -> Result<()> {
        let (s, b, ng) = sb.map_or((0, 0, 0), |(s, b, ng)| (s.ptr, b.ptr, ng));
        let blocks = 4 * self.lab_sms()?;
        self.launch(
            "lab_fill_mat",
            (blocks, 1, 1),
            256,
            0,
            &[
                Arg::P(w.ptr),
                Arg::P(nw as u64),
                Arg::P(s),
                Arg::P(b),
                Arg::P(ng as u64),
                Arg::I(seed as i32),
                Arg::F(zero),
            ],
        );
        if self.failed() {
            self.check()?;
        }
        Ok(())
    }

    fn lab_sms(&self) -> Result<u32> {
        Ok(self
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            .max(1) as u32)
    }

    /// An error unless `bytes` more fit in the device's free memory (with HEADROOM).
    fn lab_room(&self, bytes: usize, what: &str) -> Result<()> {
        let (free, _) = self.mem_info()?;
        if bytes + HEADROOM > free {
            bail!(
                "kernel lab: {what} needs {} MiB of device memory, {} MiB are free",
                (bytes + HEADROOM) >> 20,
                free >> 20
            );
        }
        Ok(())
    }
}

/// Nodes of a graph and how many of them are kernels.
fn graph_nodes(g: &CudaGraph) -> Result<(usize, usize)> {
    let mut n = 0usize;
    // SAFETY: the graph is live (owned by `g`, not destroyed here); a null array asks for the count.
    unsafe { sys::cuGraphGetNodes(g.cu_graph(), std::ptr::null_mut(), &mut n) }
        .result()
        .context("cuGraphGetNodes")?;
    let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); n];
    // SAFETY: `nodes` holds `n` entries, the most the driver writes.
    unsafe { sys::cuGraphGetNodes(g.cu_graph(), nodes.as_mut_ptr(), &mut n) }
        .result()
        .context("cuGraphGetNodes")?;
    let mut kernels = 0;
    for &node in &nodes[..n.min(nodes.len())] {
        let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: `node` is a node of the live graph; `t` is written by the call.
        unsafe { sys::cuGraphNodeGetType(node, &mut t) }
            .result()
            .context("cuGraphNodeGetType")?;
        kernels += (t == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL) as usize;
    }
    Ok((n, kernels))
}

/// Random f32 values uniform in [lo, hi).
fn rand_vec(rng: &mut Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| lo + (hi - lo) * rng.uniform()).collect()
}

/// One case being run.
struct Lab<'a> {
    cuda: &'a Cuda,
    cfg: &'a Config,
    d: Dims,
    case: &'static Case,
    cycle: usize,
    /// Calls asked for (rounded up to whole cycles through the copies).
    calls: usize,
    /// Off before on (alternated from case to case).
    flip: bool,
    /// Seed of the case's first matrix (the next ones count up).
    seed: u32,
    /// The switches off in the `on` row: those the environment turned off (`LILY_CUDA_DISABLE`),
    /// so one switch can be compared against the rest on.
    on: &'a [&'static str],
}

impl Lab<'_> {
    /// Distinct copies of `bytes` of weights so that a cycle through them reads at least `cycle`.
    fn copies(&self, bytes: usize) -> usize {
        self.cycle.div_ceil(bytes.max(1)).max(2)
    }

    /// `calls` rounded up to a whole number of cycles through `copies`.
    fn calls_for(&self, calls: usize, copies: usize) -> usize {
        calls.max(1).div_ceil(copies) * copies
    }

    fn next_seed(&mut self) -> u32 {
        self.seed = self.seed.wrapping_add(1);
        self.seed
    }

    /// A copy of each matrix of `shapes` (`(out, inp, bits)`): one set of a case's weights.
    fn mats(&mut self, shapes: &[(usize, usize, u32)], gs: usize) -> Result<Vec<Mat>> {
        shapes
            .iter()
            .map(|&(o, i, b)| self.cuda.random_mat(1, o, i, b, gs, self.next_seed()))
            .collect()
    }

    fn run(mut self) -> Result<Vec<LabRow>> {
        let (cfg, d, g) = (self.cfg, self.d, self.cuda);
        let q = cfg
            .quantization
            .default
            .context("the config is not quantized (the lab measures the quantized formats)")?;
        let gate_q = cfg
            .quantization
            .spec_for("model.layers.0.mlp.gate")
            .context("the router is not quantized")?;
        let sgate_q = cfg
            .quantization
            .spec_for("model.layers.0.mlp.shared_expert_gate")
            .context("the shared-expert gate is not quantized")?;
        let (hd, gs, bits) = (d.hidden, q.group_size, q.bits);
        let mut rng = Rng::new(self.seed as u64);
        match self.case.short {
            "in_proj" => {
                let (qkv, z, hv) = (cfg.gdn_qkv_dim(), cfg.gdn_v_dim(), d.gdn_v_heads);
                self.norm_matmul(
                    &[
                        (qkv, hd, bits),
                        (z, hd, bits),
                        (hv, hd, bits),
                        (hv, hd, bits),
                    ],
                    &[false; 4],
                    gs,
                    self.calls,
                    &mut rng,
                )
            }
            "qkv" => {
                let qd = cfg.attn_q_dim() * if cfg.attn_output_gate { 2 } else { 1 };
                let kv = cfg.attn_kv_dim();
                self.norm_matmul(
                    &[(qd, hd, bits), (kv, hd, bits), (kv, hd, bits)],
                    &[false; 3],
                    gs,
                    self.calls,
                    &mut rng,
                )
            }
            "router" => {
                if gate_q.group_size != sgate_q.group_size {
                    bail!(
                        "router group size {} and shared-gate group size {} differ",
                        gate_q.group_size,
                        sgate_q.group_size
                    );
                }
                // Both outputs f32: the router logits and the shared expert's gate logit.
                self.norm_matmul(
                    &[(d.n_experts, hd, gate_q.bits), (1, hd, sgate_q.bits)],
                    &[true, true],
                    gate_q.group_size,
                    self.calls,
                    &mut rng,
                )
            }
            "lm_head" => {
                let calls = (self.calls / LM_HEAD_CALL_DIV).max(1);
                self.norm_matmul(&[(cfg.vocab_size, hd, bits)], &[true], gs, calls, &mut rng)
            }
            "out_proj" => self.matmul_add(cfg.gdn_v_dim(), bits, gs, &mut rng),
            "ahead" => {
                let rq = (gate_q.bits, gate_q.group_size);
                self.out_proj_ahead(cfg.gdn_v_dim(), bits, gs, rq, &mut rng)
            }
            "o_proj" => self.matmul_add(cfg.attn_q_dim(), bits, gs, &mut rng),
            "route" => {
                let logits = g.upload_vec(&rand_vec(&mut rng, d.n_experts, -2.0, 2.0))?;
                let mut route = g.new_route(1, d.top_k)?;
                self.variants(0, 1, self.calls, &mut |_| {
                    g.moe_route(&logits, &d, 1, &mut route);
                    Ok(())
                })
            }
            "experts" => self.experts(bits, gs, &mut rng),
            other => bail!("no lab case `{other}`"),
        }
    }

    /// `rms_norm_matmul(h, w, …, xn, ws, outs)` over copies of the matrices `shapes`; outputs f32
    /// where `f32_out` says (logits), activations otherwise.
    fn norm_matmul(
        &mut self,
        shapes: &[(usize, usize, u32)],
        f32_out: &[bool],
        gs: usize,
        calls: usize,
        rng: &mut Rng,
    ) -> Result<Vec<LabRow>> {
        let (g, d) = (self.cuda, self.d);
        let one = self.mats(shapes, gs)?;
        let bytes: usize = one.iter().map(Mat::nbytes).sum();
        let copies = self.copies(bytes);
        let mut sets = vec![one];
        for _ in 1..copies {
            sets.push(self.mats(shapes, gs)?);
        }
        let h = g.upload_vec(&rand_vec(rng, d.hidden, -1.0, 1.0))?;
        let w = g.upload_vec(&rand_vec(rng, d.hidden, 0.9, 1.1))?;
        let mut xn = g.act_zeros(d.hidden)?;
        let mut outs: Vec<_> = shapes
            .iter()
            .zip(f32_out)
            .map(|(&(o, _, _), &f)| if f { g.zeros(o) } else { g.act_zeros(o) })
            .collect::<Result<_>>()?;
        let calls = self.calls_for(calls, copies);
        self.variants(bytes, copies, calls, &mut |i| {
            let ws: Vec<&Mat> = sets[i % copies].iter().collect();
            let mut os: Vec<&mut _> = outs.iter_mut().collect();
            g.rms_norm_matmul(&h, &w, 1, d.hidden, d.eps, &mut xn, &ws, &mut os);
            Ok(())
        })
    }

    /// GDN out_proj with the MoE router folded into it (opt-in `route_ahead`: matmul_q_add_ahead,
    /// then route_ahead_<C>'s launch), or where it is off, out_proj then the router's own launch
    /// (matmul_q_add, moe_router): compare `ahead` with and without LILY_CUDA_ENABLE=route_ahead.
    /// The router | shared gate take `rq` (bits, group size).
    fn out_proj_ahead(
        &mut self,
        inp: usize,
        bits: u32,
        gs: usize,
        rq: (u32, usize),
        rng: &mut Rng,
    ) -> Result<Vec<LabRow>> {
        let (g, d) = (self.cuda, self.d);
        let hd = d.hidden;
        let set = |lab: &mut Self| -> Result<Vec<Mat>> {
            let mut m = lab.mats(&[(hd, inp, bits)], gs)?;
            m.extend(lab.mats(&[(d.n_experts, hd, rq.0), (1, hd, rq.0)], rq.1)?);
            Ok(m)
        };
        let mut sets = vec![set(self)?];
        let bytes: usize = sets[0].iter().map(Mat::nbytes).sum();
        let copies = self.copies(bytes);
        for _ in 1..copies {
            sets.push(set(self)?);
        }
        let y = g.upload_act(&rand_vec(rng, inp, -1.0, 1.0))?;
        let w = g.upload_vec(&rand_vec(rng, hd, 0.9, 1.1))?;
        let mut r = g.act_zeros(hd)?;
        let mut h = g.upload_vec(&rand_vec(rng, hd, -1.0, 1.0))?;
        let (mut xn, mut lg, mut s) = (g.act_zeros(hd)?, g.zeros(d.n_experts)?, g.zeros(1)?);
        let mut route = g.new_route(1, d.top_k)?;
        let calls = self.calls_for(self.calls, copies);
        self.variants(bytes, copies, calls, &mut |i| {
            let m = &sets[i % copies];
            let next = RouteAhead {
                router: &m[1],
                shared_gate: &m[2],
                norm: &w,
            };
            if g.route_ahead(&m[0], &next) {
                g.matmul_q_add_ahead(&y, &m[0], &mut r, &mut h, &next);
                let mut rs = RouterScratch {
                    xn: &mut xn,
                    logits: &mut lg,
                    s: &mut s,
                    route: &mut route,
                    ahead: true,
                };
                g.route_ahead_launch(&h, &w, d.eps, d.n_experts, &d, &mut rs);
            } else {
                g.matmul_q_add(&y, &m[0], 1, &mut r, &mut h);
                g.moe_router(
                    &h, &w, 1, d.eps, &mut xn, &m[1], &m[2], &d, &mut lg, &mut s, &mut route,
                );
            }
            Ok(())
        })
    }

    /// `matmul_q_add(y, W [hidden, inp], 1, r, h)`: an output projection added into the residual.
    fn matmul_add(
        &mut self,
        inp: usize,
        bits: u32,
        gs: usize,
        rng: &mut Rng,
    ) -> Result<Vec<LabRow>> {
        let (g, d) = (self.cuda, self.d);
        let shape = [(d.hidden, inp, bits)];
        let mut ws = self.mats(&shape, gs)?;
        let bytes = ws[0].nbytes();
        let copies = self.copies(bytes);
        for _ in 1..copies {
            ws.extend(self.mats(&shape, gs)?);
        }
        let y = g.upload_act(&rand_vec(rng, inp, -1.0, 1.0))?;
        let mut r = g.act_zeros(d.hidden)?;
        let mut h = g.upload_vec(&rand_vec(rng, d.hidden, -1.0, 1.0))?;
        let calls = self.calls_for(self.calls, copies);
        self.variants(bytes, copies, calls, &mut |i| {
            g.matmul_q_add(&y, &ws[i % copies], 1, &mut r, &mut h);
            Ok(())
        })
    }

    /// `moe_decode_add` over one routed stack and `copies` shared experts, call `i` with route
    /// `i % copies`. Route `c` picks experts `perm[(c·k + j) mod E]` of a random permutation, so
    /// successive calls never share an expert: its logits are random, the chosen ones above the
    /// rest (their weights vary as a real router's do).
    fn experts(&mut self, bits: u32, gs: usize, rng: &mut Rng) -> Result<Vec<LabRow>> {
        let (g, d, cfg) = (self.cuda, self.d, self.cfg);
        let (e, k, hd) = (d.n_experts, d.top_k, d.hidden);
        let (wi, ws) = (
            cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size,
        );
        let gate = g.random_mat(e, wi, hd, bits, gs, self.next_seed())?;
        let up = g.random_mat(e, wi, hd, bits, gs, self.next_seed())?;
        let down = g.random_mat(e, hd, wi, bits, gs, self.next_seed())?;
        let shape = [(ws, hd, bits), (ws, hd, bits), (hd, ws, bits)];
        let first = self.mats(&shape, gs)?;
        let per_expert = (gate.nbytes() + up.nbytes() + down.nbytes()) / e;
        let bytes = k * per_expert + first.iter().map(Mat::nbytes).sum::<usize>();
        let copies = self.copies(bytes);
        let mut shared = vec![first];
        for _ in 1..copies {
            shared.push(self.mats(&shape, gs)?);
        }
        // A random permutation of the experts (Fisher–Yates).
        let mut perm: Vec<usize> = (0..e).collect();
        for i in (1..e).rev() {
            perm.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        let (mut routes, mut logits) = (Vec::with_capacity(copies), Vec::with_capacity(copies));
        for c in 0..copies {
            let mut l = rand_vec(rng, e, -1.0, 0.0);
            for j in 0..k {
                l[perm[(c * k + j) % e]] = 1.0 + rng.uniform();
            }
            let (l, mut r) = (g.upload_vec(&l)?, g.new_route(1, k)?);
            g.moe_route(&l, &d, 1, &mut r);
            routes.push(r);
            logits.push(l);
        }
        // The logits are kept until the routes are made.
        g.check().context("routing the calls")?;
        drop(logits);
        let x = g.upload_act(&rand_vec(rng, hd, -1.0, 1.0))?;
        let logit = g.upload_vec(&[0.5])?;
        let mut h = g.upload_vec(&rand_vec(rng, hd, -1.0, 1.0))?;
        let (mut out, mut tg, mut tu, mut ta, mut td) = (
            g.act_zeros(hd)?,
            g.act_zeros(ws)?,
            g.act_zeros(ws)?,
            g.act_zeros(ws)?,
            g.act_zeros(hd)?,
        );
        let calls = self.calls_for(self.calls, copies);
        self.variants(bytes, copies, calls, &mut |i| {
            let s = &shared[i % copies];
            let sh = SharedExpert {
                gate: &s[0],
                up: &s[1],
                down: &s[2],
                logit: &logit,
            };
            let tmp = MoeScratch {
                out: &mut out,
                g: &mut tg,
                u: &mut tu,
                act: &mut ta,
                down: &mut td,
            };
            g.moe_decode_add(
                &x,
                &routes[i % copies],
                &gate,
                &up,
                &down,
                &sh,
                &d,
                tmp,
                &mut h,
            );
            Ok(())
        })
    }

    /// Times `ops` and the pure read of `bytes` (from `copies` buffers) with the switches on and
    /// off, in the case's order; returns the `on` row first.
    fn variants(
        &self,
        bytes: usize,
        copies: usize,
        calls: usize,
        ops: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<Vec<LabRow>> {
        let g = self.cuda;
        let order: [(&'static str, &[&str]); 2] = if self.flip {
            [("off", SWITCHES), ("on", self.on)]
        } else {
            [("on", self.on), ("off", SWITCHES)]
        };
        let mut rows = Vec::new();
        for (opts, off) in order {
            g.set_disabled(off)?;
            let t = g
                .time_graph(calls, ops)
                .with_context(|| format!("optimisations {opts}"))?;
            let read_s = if bytes > 0 {
                Some(
                    g.time_pure_read(bytes, copies, calls)
                        .context("the pure read")?,
                )
            } else {
                None
            };
            rows.push(LabRow {
                short: self.case.short,
                name: self.case.name,
                opts,
                bytes,
                copies,
                calls,
                op_s: t.seconds,
                read_s,
                kernels_per_call: t.kernels as f64 / calls as f64,
                other_nodes_per_call: (t.nodes - t.kernels) as f64 / calls as f64,
            });
        }
        rows.sort_by_key(|r| r.opts != "on");
        Ok(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loader::tensor::bf16_to_f32;

    /// The first GPU, or `None` (skipped) without one; LILY_REQUIRE_CUDA makes that a failure.
    fn gpu() -> Option<Cuda> {
        match Cuda::new() {
            Ok(c) => Some(c),
            Err(e) => {
                assert!(
                    std::env::var("LILY_REQUIRE_CUDA").is_err(),
                    "no usable GPU: {e:#}"
                );
                eprintln!("SKIPPED: no usable GPU: {e:#}");
                None
            }
        }
    }

    /// A random matrix is in the format the kernels read: `matmul_q` of it equals the product with
    /// its codes, scales and biases read back and dequantised on the host.
    #[test]
    fn random_mat_is_what_the_kernels_read() {
        let Some(g) = gpu() else { return };
        let (out, inp, gs) = (64, 256, 64);
        for bits in [4u32, 8] {
            let m = g.random_mat(1, out, inp, bits, gs, 3).unwrap();
            assert_eq!(
                m.nbytes(),
                out * inp * bits as usize / 8 + 2 * 2 * out * inp / gs
            );
            let w: Vec<u32> = g.read(m.w.ptr, out * inp * bits as usize / 32).unwrap();
            let s: Vec<f32> = g
                .read::<u16>(m.s.as_ref().unwrap().ptr, out * inp / gs)
                .unwrap()
                .into_iter()
                .map(bf16_to_f32)
                .collect();
            let b: Vec<f32> = g
                .read::<u16>(m.b.as_ref().unwrap().ptr, out * inp / gs)
                .unwrap()
                .into_iter()
                .map(bf16_to_f32)
                .collect();
            let zero = (1u32 << (bits - 1)) as f32;
            for (s, b) in s.iter().zip(&b) {
                assert!((0.01..0.02).contains(s), "scale {s}");
                assert_eq!(*b, -zero * s);
            }
            let mut rng = Rng::new(5);
            let x = rand_vec(&mut rng, inp, -1.0, 1.0);
            let xb = g.upload_act(&x).unwrap();
            let xr = g.to_host(&xb, inp).unwrap(); // x as the kernel sees it (bf16)
            let mut y = g.zeros(out).unwrap();
            g.matmul_q(&xb, &m, 1, &mut y);
            let y = g.to_host(&y, out).unwrap();
            let per = 32 / bits as usize;
            for o in 0..out {
                let want: f32 = (0..inp)
                    .map(|k| {
                        let code = (w[(o * inp + k) / per] >> ((k % per) * bits as usize))
                            & ((1 << bits) - 1);
                        let gi = (o * inp + k) / gs;
                        (s[gi] * code as f32 + b[gi]) * xr[k]
                    })
                    .sum();
                assert!(
                    (y[o] - want).abs() <= 1e-3 * (1.0 + want.abs()),
                    "{bits}-bit row {o}: {} vs {want}",
                    y[o]
                );
            }
        }
    }

    #[test]
    fn pure_read_and_recorded_ops_are_timed() {
        let Some(g) = gpu() else { return };
        let t = g.time_pure_read(8 << 20, 2, 4).unwrap();
        // 8 MiB in (0.5 µs, 10 ms): any GPU.
        assert!(t > 5e-7 && t < 1e-2, "pure read of 8 MiB: {t} s");
        let m = g.random_mat(1, 512, 2048, 4, 64, 1).unwrap();
        let x = g.act_zeros(2048).unwrap();
        let mut y = g.act_zeros(512).unwrap();
        let r = g.time_graph(3, &mut |_| {
            g.matmul_q(&x, &m, 1, &mut y);
            Ok(())
        });
        let r = r.unwrap();
        assert!(r.seconds > 0.0 && r.kernels >= 3, "{r:?}");
        g.check().unwrap();
    }
}
