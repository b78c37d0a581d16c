//! The in-place trace of recorded decode steps (`lily bench --trace`): where a step's time goes,
//! kernel by kernel, inside the replayed graph.
//!
//! Why: a decode step is a chain of ~264 kernels, each waiting (programmatic dependent launch)
//! for the full completion of the one before. The lab times a kernel back to back with itself,
//! Nsight Compute times each alone, `--in-place` times a step without a family; none says how a
//! kernel's time in place splits between its own work and the boundary to the next kernel, or
//! whether its blocks were resident (their weights requested) before the previous kernel ended.
//!
//! What the device gives (cuda/kernels/common.cuh, `KTRACE`): one [`BlockRec`] per block of every
//! kernel run while tracing, three global-timer stamps (start, PDL wait returned, end) and the
//! grid size; what the host gives: the launches in the order they ran ([`Launch`]). This module
//! attributes the records to the launches and sums them per kernel name. It needs no GPU (tested
//! here on made-up records).
//!
//! Attribution: a kernel's waits all return after the previous kernel has completed, and all its
//! blocks have passed their wait before it completes, so the records sorted by wait fall into
//! the launches in order, each taking as many records as its grid has blocks (checked: every
//! record of a launch must carry that launch's grid size, else the trace is reported as out of
//! order rather than misattributed).
//!
//! Per launch, with `first_wait` the earliest wait of its blocks:
//! * `in_place` = the next launch's `first_wait` − this one's: its share of the chain;
//! * `body` = its last block's end − `first_wait`: its own work after the wait;
//! * `gap` = `in_place` − `body`: completion, memory flush and the next kernel's wait returning;
//! * `lead` = `first_wait` − its earliest start: how long before its wait it was already running
//!   (0 for a kernel whose blocks could not be resident before the previous one finished);
//! * `spread` = its latest wait − `first_wait`: blocks that started late (not resident at the wait);
//! * `early`: the share of its blocks that started before the previous launch's last block ended;
//! * where the kernel marks two phases of its body (TRACE_MARK), the block that ended last (the
//!   one the next kernel waited for): its wait to mark 1, mark 1 to mark 2, mark 2 to its end;
//!   and over all its blocks, each one's own wait to mark 1, median and 90th percentile: whether
//!   the first phase is slow in every block or only in the last one.

use std::collections::BTreeMap;

use anyhow::{bail, Result};

/// One block of one kernel, as the device recorded it (global timer, ns).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct BlockRec {
    pub start: u64,
    /// When its PDL wait returned (its start if it has none).
    pub wait: u64,
    /// When it passed the kernel's TRACE_MARK(1) and TRACE_MARK(2) (0: unmarked).
    pub mark1: u64,
    pub mark2: u64,
    pub end: u64,
    /// Blocks in its grid.
    pub blocks: u32,
    pub smid: u32,
}

/// One kernel launch as the host issued it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    pub name: String,
    pub blocks: u32,
}

/// What a traced stretch of steps gives: the block records and the launches they belong to.
pub type Traced = (Vec<BlockRec>, Vec<Launch>);

/// One launch's timeline (ns).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub first_start: u64,
    pub first_wait: u64,
    pub last_wait: u64,
    pub last_end: u64,
    /// The block that ended last (the one the next kernel waited for): its wait and marks.
    pub crit: BlockRec,
    /// Blocks that started before the previous launch's last block ended (resident early).
    pub early: u32,
    /// Over the blocks that passed mark 1: their own wait to mark 1 (ns), median and 90th
    /// percentile (nearest rank); none if no block marked it.
    pub to_mark1_q: Option<(u64, u64)>,
}

/// The records grouped by launch, in launch order (module header: attribution).
pub fn attribute(recs: &[BlockRec], launches: &[Launch]) -> Result<Vec<Span>> {
    let want: u64 = launches.iter().map(|l| l.blocks as u64).sum();
    if recs.len() as u64 != want {
        bail!(
            "trace: {} block records for {} launches of {want} blocks (a kernel without KTRACE, \
             or launches the host did not log)",
            recs.len(),
            launches.len()
        );
    }
    let mut r = recs.to_vec();
    r.sort_by_key(|b| (b.wait, b.start));
    let mut out = Vec::with_capacity(launches.len());
    let mut at = 0usize;
    for (i, l) in launches.iter().enumerate() {
        let blk = &r[at..at + l.blocks as usize];
        at += l.blocks as usize;
        if let Some(b) = blk.iter().find(|b| b.blocks != l.blocks) {
            bail!(
                "trace: launch {i} ({}, {} blocks) took a record of a {}-block grid: the records \
                 do not fall into launch order",
                l.name,
                l.blocks,
                b.blocks
            );
        }
        if blk.is_empty() {
            bail!("trace: launch {i} ({}) has an empty grid", l.name);
        }
        let prev_end = out.last().map(|p: &Span| p.last_end);
        let crit = *blk.iter().max_by_key(|b| b.end).expect("not empty");
        let mut m1: Vec<u64> = blk
            .iter()
            .filter(|b| b.mark1 > 0 && b.mark1 >= b.wait)
            .map(|b| b.mark1 - b.wait)
            .collect();
        m1.sort_unstable();
        let rank = |q: f64| m1[((q * m1.len() as f64).ceil() as usize).clamp(1, m1.len()) - 1];
        out.push(Span {
            first_start: blk.iter().map(|b| b.start).min().unwrap_or(0),
            first_wait: blk[0].wait,
            last_wait: blk[blk.len() - 1].wait,
            last_end: crit.end,
            crit,
            early: prev_end.map_or(0, |e| blk.iter().filter(|b| b.start < e).count() as u32),
            to_mark1_q: (!m1.is_empty()).then(|| (rank(0.5), rank(0.9))),
        });
    }
    Ok(out)
}

/// Per kernel name: calls and summed times (ns) over the traced steps.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KernelSum {
    pub name: String,
    pub calls: usize,
    pub blocks: u64,
    pub in_place: f64,
    pub body: f64,
    pub gap: f64,
    pub lead: f64,
    pub spread: f64,
    /// Blocks resident before the previous launch ended (summed over calls).
    pub early: u64,
    /// The last block's phases, summed over the calls that mark them: its wait to mark 1, mark 1
    /// to mark 2, mark 2 to its end.
    pub marked: usize,
    pub to_mark1: f64,
    pub mark1_2: f64,
    pub mark2_end: f64,
    /// Every block's own wait to mark 1, median and 90th percentile per call, summed over the
    /// `q_calls` calls that mark it.
    pub q_calls: usize,
    pub mark1_p50: f64,
    pub mark1_p90: f64,
}

/// A trace summed per kernel name.
#[derive(Clone, Debug, PartialEq)]
pub struct Table {
    /// Steps traced (the per-step figures divide by it).
    pub steps: usize,
    /// From the first launch's wait to the last launch's end (ns).
    pub span_ns: f64,
    /// Sorted by time in place, largest first.
    pub kernels: Vec<KernelSum>,
    /// The smallest nonzero difference between two stamps: the timer's resolution as seen.
    pub tick_ns: u64,
}

/// Sums `spans` (from [`attribute`]) per kernel name over `steps` traced steps. The last launch's
/// time in place is its body (nothing follows it).
pub fn summarize(launches: &[Launch], spans: &[Span], recs: &[BlockRec], steps: usize) -> Table {
    let mut by: BTreeMap<&str, KernelSum> = BTreeMap::new();
    for (i, (l, s)) in launches.iter().zip(spans).enumerate() {
        let body = s.last_end.saturating_sub(s.first_wait) as f64;
        let in_place = match spans.get(i + 1) {
            Some(n) => n.first_wait.saturating_sub(s.first_wait) as f64,
            None => body,
        };
        let k = by.entry(&l.name).or_insert_with(|| KernelSum {
            name: l.name.clone(),
            ..Default::default()
        });
        k.calls += 1;
        k.blocks += l.blocks as u64;
        k.in_place += in_place;
        k.body += body;
        k.gap += in_place - body;
        k.lead += s.first_wait.saturating_sub(s.first_start) as f64;
        k.spread += s.last_wait.saturating_sub(s.first_wait) as f64;
        k.early += s.early as u64;
        let c = &s.crit;
        if c.mark1 >= c.wait && c.mark2 >= c.mark1 && c.end >= c.mark2 && c.mark1 > 0 && c.mark2 > 0
        {
            k.marked += 1;
            k.to_mark1 += (c.mark1 - c.wait) as f64;
            k.mark1_2 += (c.mark2 - c.mark1) as f64;
            k.mark2_end += (c.end - c.mark2) as f64;
        }
        if let Some((p50, p90)) = s.to_mark1_q {
            k.q_calls += 1;
            k.mark1_p50 += p50 as f64;
            k.mark1_p90 += p90 as f64;
        }
    }
    let mut kernels: Vec<KernelSum> = by.into_values().collect();
    kernels.sort_by(|a, b| b.in_place.total_cmp(&a.in_place));
    let span_ns = match (spans.first(), spans.last()) {
        (Some(a), Some(b)) => b.last_end.saturating_sub(a.first_wait) as f64,
        _ => 0.0,
    };
    let mut stamps: Vec<u64> = recs.iter().flat_map(|r| [r.start, r.wait, r.end]).collect();
    stamps.sort_unstable();
    let tick_ns = stamps
        .windows(2)
        .map(|w| w[1] - w[0])
        .filter(|&d| d > 0)
        .min()
        .unwrap_or(0);
    Table {
        steps: steps.max(1),
        span_ns,
        kernels,
        tick_ns,
    }
}

impl Table {
    /// A text table: per kernel name, calls and µs per step, and the split of one call.
    pub fn text(&self) -> String {
        let st = self.steps as f64;
        let total: f64 = self.kernels.iter().map(|k| k.in_place).sum();
        let mut s = format!(
            "trace: {} steps, {:.1} µs a step from the first wait to the last end (timer tick {} ns)\n",
            self.steps,
            self.span_ns / st / 1e3,
            self.tick_ns
        );
        s += &format!(
            "{:<32} {:>6} {:>7} {:>10} {:>6} | {:>8} {:>8} {:>8} {:>8} {:>8} {:>6} | {:>7} {:>7} {:>7} | {:>6} {:>6}\n",
            "kernel",
            "calls",
            "blocks",
            "µs/step",
            "share",
            "in place",
            "body",
            "gap",
            "lead",
            "spread",
            "early",
            "→mark1",
            "→mark2",
            "→end",
            "m1 p50",
            "m1 p90"
        );
        for k in &self.kernels {
            let c = k.calls as f64;
            let mut marks = if k.marked > 0 {
                let m = k.marked as f64 * 1e3;
                format!(
                    " | {:>7.2} {:>7.2} {:>7.2}",
                    k.to_mark1 / m,
                    k.mark1_2 / m,
                    k.mark2_end / m
                )
            } else {
                String::new()
            };
            if k.marked > 0 && k.q_calls > 0 {
                let q = k.q_calls as f64 * 1e3;
                marks += &format!(" | {:>6.2} {:>6.2}", k.mark1_p50 / q, k.mark1_p90 / q);
            }
            s += &format!(
                "{:<32} {:>6.1} {:>7.0} {:>10.1} {:>5.1}% | {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>5.0}%{marks}\n",
                k.name,
                c / st,
                k.blocks as f64 / c,
                k.in_place / st / 1e3,
                100.0 * k.in_place / total.max(1.0),
                k.in_place / c / 1e3,
                k.body / c / 1e3,
                k.gap / c / 1e3,
                k.lead / c / 1e3,
                k.spread / c / 1e3,
                100.0 * k.early as f64 / k.blocks.max(1) as f64
            );
        }
        let calls: usize = self.kernels.iter().map(|k| k.calls).sum();
        let (body, gap): (f64, f64) = self
            .kernels
            .iter()
            .fold((0.0, 0.0), |(b, g), k| (b + k.body, g + k.gap));
        s += &format!(
            "{:<32} {:>6.1} {:>7} {:>10.1} {:>6} | per step: body {:.1} µs, gaps {:.1} µs\n",
            "all",
            calls as f64 / st,
            "",
            total / st / 1e3,
            "",
            body / st / 1e3,
            gap / st / 1e3
        );
        s
    }

    /// The table as JSON rows (µs per call and per step).
    pub fn json(&self) -> serde_json::Value {
        let st = self.steps as f64;
        let rows: Vec<serde_json::Value> = self
            .kernels
            .iter()
            .map(|k| {
                let c = k.calls as f64;
                serde_json::json!({
                    "kernel": k.name, "calls_per_step": c / st, "blocks": k.blocks as f64 / c,
                    "us_per_step": k.in_place / st / 1e3, "in_place_us": k.in_place / c / 1e3,
                    "body_us": k.body / c / 1e3, "gap_us": k.gap / c / 1e3,
                    "lead_us": k.lead / c / 1e3, "spread_us": k.spread / c / 1e3,
                    "early_fraction": k.early as f64 / k.blocks.max(1) as f64,
                    "last_block_us": if k.marked > 0 {
                        let m = k.marked as f64 * 1e3;
                        serde_json::json!({"wait_to_mark1": k.to_mark1 / m,
                            "mark1_to_mark2": k.mark1_2 / m, "mark2_to_end": k.mark2_end / m})
                    } else { serde_json::Value::Null },
                    "all_blocks_wait_to_mark1_us": if k.q_calls > 0 {
                        let q = k.q_calls as f64 * 1e3;
                        serde_json::json!({"p50": k.mark1_p50 / q, "p90": k.mark1_p90 / q})
                    } else { serde_json::Value::Null },
                })
            })
            .collect();
        serde_json::json!({"steps": self.steps, "span_us_per_step": self.span_ns / st / 1e3,
            "tick_ns": self.tick_ns, "kernels": rows})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(start: u64, wait: u64, end: u64, blocks: u32) -> BlockRec {
        BlockRec {
            start,
            wait,
            end,
            blocks,
            ..Default::default()
        }
    }
    fn launch(name: &str, blocks: u32) -> Launch {
        Launch {
            name: name.into(),
            blocks,
        }
    }

    /// Two kernels of 2 and 3 blocks, the second launched early (PDL: its blocks start before
    /// the first ends) and its records shuffled: grouped by wait, each launch gets its own.
    #[test]
    fn attributes_by_wait_and_sums_per_name() {
        let launches = vec![launch("a", 2), launch("b", 3), launch("a", 2)];
        let recs = vec![
            rec(40, 120, 150, 3),
            rec(0, 10, 100, 2),
            rec(45, 110, 160, 3),
            rec(5, 12, 90, 2),
            rec(60, 111, 140, 3),
            rec(150, 170, 200, 2),
            rec(155, 175, 190, 2),
        ];
        let spans = attribute(&recs, &launches).unwrap();
        let times = |s: &Span| {
            (
                s.first_start,
                s.first_wait,
                s.last_wait,
                s.last_end,
                s.early,
            )
        };
        assert_eq!(
            spans.iter().map(times).collect::<Vec<_>>(),
            // b's three blocks all started before a's last end (100); a's second launch's none
            // before b's (160) but 155.
            vec![
                (0, 10, 12, 100, 0),
                (40, 110, 120, 160, 3),
                (150, 170, 175, 200, 2)
            ]
        );
        assert_eq!(spans[1].crit, recs[2], "b's last block to end");
        let t = summarize(&launches, &spans, &recs, 1);
        assert_eq!(t.span_ns, 190.0);
        assert_eq!(t.tick_ns, 1);
        let b = t.kernels.iter().find(|k| k.name == "b").unwrap();
        // b: in place 170 - 110, body 160 - 110, lead 110 - 40, spread 120 - 110.
        assert_eq!(
            (b.in_place, b.body, b.gap, b.lead, b.spread),
            (60.0, 50.0, 10.0, 70.0, 10.0)
        );
        let a = t.kernels.iter().find(|k| k.name == "a").unwrap();
        // a: (110 - 10) + the last launch's body (200 - 170).
        assert_eq!((a.calls, a.in_place, a.body), (2, 130.0, 90.0 + 30.0));
        assert_eq!(t.kernels[0].name, "a", "sorted by time in place");
        assert_eq!((b.early, b.marked), (3, 0), "unmarked: no phases");
        assert!(t.text().contains("in place"));
        assert_eq!(t.json()["kernels"][0]["kernel"], "a");
    }

    /// The phases of the block that ended last, where the kernel marks them.
    #[test]
    fn marks_split_the_last_block() {
        let launches = vec![launch("k", 2)];
        let mut a = rec(0, 10, 50, 2);
        let mut b = rec(0, 12, 70, 2);
        (a.mark1, a.mark2) = (20, 40);
        (b.mark1, b.mark2) = (30, 60);
        let spans = attribute(&[a, b], &launches).unwrap();
        let t = summarize(&launches, &spans, &[a, b], 1);
        let k = &t.kernels[0];
        // b ended last: 12 -> 30 -> 60 -> 70.
        assert_eq!(
            (k.marked, k.to_mark1, k.mark1_2, k.mark2_end),
            (1, 18.0, 30.0, 10.0)
        );
        // Every block's own wait to mark 1: a 10, b 18 (nearest rank: p50 10, p90 18).
        assert_eq!((k.q_calls, k.mark1_p50, k.mark1_p90), (1, 10.0, 18.0));
        assert!(t.text().contains("→mark1") && t.text().contains("m1 p90"));
        assert_eq!(
            t.json()["kernels"][0]["all_blocks_wait_to_mark1_us"]["p90"],
            0.018
        );
    }

    /// Records that do not match the launches are an error, not a wrong table.
    #[test]
    fn refuses_a_trace_that_does_not_fit() {
        let launches = vec![launch("a", 2), launch("b", 1)];
        let too_few = vec![rec(0, 1, 2, 2), rec(0, 1, 2, 2)];
        assert!(attribute(&too_few, &launches).is_err());
        // b's block waited before a's second: a takes a 1-block record.
        let crossed = vec![rec(0, 1, 5, 2), rec(0, 3, 9, 2), rec(0, 2, 6, 1)];
        let e = attribute(&crossed, &launches).unwrap_err().to_string();
        assert!(e.contains("launch order"), "{e}");
    }
}
