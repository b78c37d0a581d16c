//! `/metrics` in the Prometheus text format.
//!
//! Every generation request is counted once in `lily_requests_received_total` and, when it ends,
//! once in `lily_requests_finished_total{outcome}`: `rejected` (turned away before running:
//! invalid, too long, queue full), `ok`, `cancelled` (client gone or shutdown) or `error`. So at
//! any moment `received = Σ finished + queue_depth + running` (up to the instant a handler takes
//! between counting a request and queueing it).

use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    Cancelled,
    Error,
    Rejected,
}

const OUTCOMES: [(Outcome, &str); 4] = [
    (Outcome::Ok, "ok"),
    (Outcome::Cancelled, "cancelled"),
    (Outcome::Error, "error"),
    (Outcome::Rejected, "rejected"),
];

#[derive(Default)]
pub struct Metrics {
    pub received: AtomicU64,
    finished: [AtomicU64; 4],
    pub queue_depth: AtomicI64,
    pub running: AtomicI64,
    pub prompt_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    pub cache_evictions: AtomicU64,
    pub cache_bytes: AtomicU64,
    pub cache_entries: AtomicU64,
    pub cache_snapshots: AtomicU64,
    timing: Mutex<Timing>,
}

#[derive(Default)]
struct Timing {
    ttft_sum: f64,
    ttft_count: u64,
    prefill_s: f64,
    prefill_tokens: u64,
    decode_s: f64,
    decode_tokens: u64,
    last_prefill_tps: f64,
    last_decode_tps: f64,
    /// Grammar compilations (structured outputs): [cold, cached] seconds and counts.
    compile_s: [f64; 2],
    compiles: [u64; 2],
}

impl Metrics {
    pub fn finish(&self, o: Outcome) {
        self.finished[o as usize].fetch_add(1, Relaxed);
    }

    pub fn finished(&self, o: Outcome) -> u64 {
        self.finished[o as usize].load(Relaxed)
    }

    /// One generation's timings: `prefilled` tokens in `prefill_s`, then `decoded` tokens
    /// after the first in `decode_s` (the first token comes from the prefill's logits).
    pub fn record_generation(
        &self,
        ttft_s: f64,
        prefilled: usize,
        prefill_s: f64,
        decoded: usize,
        decode_s: f64,
    ) {
        let mut t = self.timing.lock().unwrap_or_else(|e| e.into_inner());
        t.ttft_sum += ttft_s;
        t.ttft_count += 1;
        if prefilled > 0 && prefill_s > 0.0 {
            t.prefill_s += prefill_s;
            t.prefill_tokens += prefilled as u64;
            t.last_prefill_tps = prefilled as f64 / prefill_s;
        }
        if decoded > 0 && decode_s > 0.0 {
            t.decode_s += decode_s;
            t.decode_tokens += decoded as u64;
            t.last_decode_tps = decoded as f64 / decode_s;
        }
    }

    /// One structured-output grammar compiled (`cached`: taken from the compiler's cache).
    pub fn record_compile(&self, seconds: f64, cached: bool) {
        let mut t = self.timing.lock().unwrap_or_else(|e| e.into_inner());
        t.compile_s[cached as usize] += seconds;
        t.compiles[cached as usize] += 1;
    }

    pub fn render(&self) -> String {
        let mut s = String::new();
        let mut counter = |name: &str, help: &str, v: u64| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        counter(
            "lily_requests_received_total",
            "Generation requests received.",
            self.received.load(Relaxed),
        );
        counter(
            "lily_prompt_tokens_total",
            "Prompt tokens of requests that ran.",
            self.prompt_tokens.load(Relaxed),
        );
        counter(
            "lily_cached_prompt_tokens_total",
            "Prompt tokens served from the prefix cache.",
            self.cached_tokens.load(Relaxed),
        );
        counter(
            "lily_generated_tokens_total",
            "Tokens generated.",
            self.generated_tokens.load(Relaxed),
        );
        counter(
            "lily_prefix_cache_hits_total",
            "Requests that reused cached state.",
            self.cache_hits.load(Relaxed),
        );
        counter(
            "lily_prefix_cache_misses_total",
            "Requests that found no cached state.",
            self.cache_misses.load(Relaxed),
        );
        counter(
            "lily_prefix_cache_evictions_total",
            "Cache entries evicted.",
            self.cache_evictions.load(Relaxed),
        );
        let _ = writeln!(s, "# HELP lily_requests_finished_total Generation requests finished, by outcome.\n# TYPE lily_requests_finished_total counter");
        for (o, name) in OUTCOMES {
            let _ = writeln!(
                s,
                "lily_requests_finished_total{{outcome=\"{name}\"}} {}",
                self.finished(o)
            );
        }
        let mut gauge = |name: &str, help: &str, v: String| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        gauge(
            "lily_queue_depth",
            "Requests waiting for the model.",
            self.queue_depth.load(Relaxed).to_string(),
        );
        gauge(
            "lily_requests_running",
            "Requests on the model now (0 or 1).",
            self.running.load(Relaxed).to_string(),
        );
        gauge(
            "lily_prefix_cache_bytes",
            "Bytes held by the prefix cache (KV at capacity + recurrent states + snapshots).",
            self.cache_bytes.load(Relaxed).to_string(),
        );
        gauge(
            "lily_prefix_cache_entries",
            "Sessions held by the prefix cache.",
            self.cache_entries.load(Relaxed).to_string(),
        );
        gauge(
            "lily_prefix_cache_snapshots",
            "Recurrent-state snapshots held.",
            self.cache_snapshots.load(Relaxed).to_string(),
        );
        let t = self.timing.lock().unwrap_or_else(|e| e.into_inner());
        gauge(
            "lily_prefill_tokens_per_second",
            "Prefill speed of the last request.",
            format!("{:.3}", t.last_prefill_tps),
        );
        gauge(
            "lily_decode_tokens_per_second",
            "Decode speed of the last request.",
            format!("{:.3}", t.last_decode_tps),
        );
        let avg = |tok: u64, secs: f64| if secs > 0.0 { tok as f64 / secs } else { 0.0 };
        gauge(
            "lily_prefill_tokens_per_second_avg",
            "Prefill tokens / prefill seconds since start.",
            format!("{:.3}", avg(t.prefill_tokens, t.prefill_s)),
        );
        gauge(
            "lily_decode_tokens_per_second_avg",
            "Decode tokens / decode seconds since start.",
            format!("{:.3}", avg(t.decode_tokens, t.decode_s)),
        );
        let _ = writeln!(
            s,
            "# HELP lily_time_to_first_token_seconds From queueing a request to its first token.\n# TYPE lily_time_to_first_token_seconds summary\nlily_time_to_first_token_seconds_sum {:.6}\nlily_time_to_first_token_seconds_count {}",
            t.ttft_sum, t.ttft_count
        );
        let _ = writeln!(
            s,
            "# HELP lily_grammar_compile_seconds Structured-output grammar compilation, cold or from the cache.\n# TYPE lily_grammar_compile_seconds summary"
        );
        for (i, cache) in ["cold", "cached"].into_iter().enumerate() {
            let _ = writeln!(
                s,
                "lily_grammar_compile_seconds_sum{{cache=\"{cache}\"}} {:.6}\nlily_grammar_compile_seconds_count{{cache=\"{cache}\"}} {}",
                t.compile_s[i], t.compiles[i]
            );
        }
        s
    }
}
