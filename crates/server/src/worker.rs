//! The model thread: one generation at a time (batch 1), in FIFO order from a bounded queue.
//!
//! Handlers render and tokenize on their own threads and hand the worker a [`Job`]; the worker
//! streams [`Event`]s back on the job's channel. A job is cancelled by its flag (the handler's
//! guard sets it when the client goes away), by a closed event channel, or by shutdown; the loop
//! checks after every token, so a cancelled generation stops within one token.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use tokio::sync::mpsc::UnboundedSender;

use lily::backend::Backend;
use lily::model::Qwen35;
use lily::runtime::cache::{generate_cached, CacheConfig, CacheStats, PrefixCache};
use lily::runtime::constrain::Constraint;
use lily::runtime::generate::{Forced, GenRequest, Generation, TokenEvent, TokenLogprob};
use lily::runtime::sampler::SamplingParams;
use lily::runtime::stop::StopRules;
use lily::tokenizer::Tokenizer;

use crate::metrics::{Metrics, Outcome};

/// One generation request, ready to run.
pub struct Job {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub stop: StopRules,
    pub logprobs: Option<usize>,
    pub forced: Forced,
    /// Structured output (constrained decoding).
    pub constraint: Option<Constraint>,
    /// `prompt_cache_key` of the request (for the prefix cache).
    pub cache_key: Option<String>,
    pub cancel: Arc<AtomicBool>,
    pub events: UnboundedSender<Event>,
    pub enqueued: Instant,
}

/// What the worker reports about a job.
#[derive(Debug)]
pub enum Event {
    /// The job left the queue; `cached` prompt tokens were reused.
    Started {
        cached: usize,
    },
    Token {
        id: Option<u32>,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// The end; `finish` is `None` when cancelled.
    Done(Box<Generation>),
    Failed(String),
}

/// Runs generations on a model; the worker owns it. Object-safe so the server is not generic
/// over the backend.
pub trait Runner: Send {
    /// Runs one job; `started` gets the number of prompt tokens reused before the prefill.
    fn run(
        &mut self,
        job: &Job,
        started: &mut dyn FnMut(usize),
        on_token: &mut dyn FnMut(TokenEvent<'_>) -> bool,
    ) -> Result<Generation>;
    fn cache_stats(&self) -> CacheStats;
    /// Backend name for `/health`.
    fn describe(&self) -> String;
    /// Bytes per KV-cache element on the backend (`Backend::kv_elem_bytes`): memory accounting.
    fn kv_elem_bytes(&self) -> usize;
}

/// The real model on any backend, with its prefix cache.
pub struct ModelRunner<B: Backend> {
    model: Qwen35<B>,
    tok: Arc<Tokenizer>,
    max_context: usize,
    cache: PrefixCache<B>,
}

impl<B: Backend> ModelRunner<B> {
    /// `cache_bytes` 0 turns the prefix cache off; `snapshot_every` 0 takes no periodic
    /// snapshots.
    pub fn new(
        model: Qwen35<B>,
        tok: Arc<Tokenizer>,
        max_context: usize,
        cache_bytes: usize,
        snapshot_every: usize,
    ) -> Self {
        let cfg = CacheConfig {
            budget: cache_bytes,
            snapshot_every,
            turn_start: tok.token_id("<|im_start|>"),
        };
        Self {
            model,
            tok,
            max_context,
            cache: PrefixCache::new(cfg),
        }
    }
}

impl<B: Backend + 'static> Runner for ModelRunner<B> {
    fn run(
        &mut self,
        job: &Job,
        started: &mut dyn FnMut(usize),
        on_token: &mut dyn FnMut(TokenEvent<'_>) -> bool,
    ) -> Result<Generation> {
        let req = GenRequest {
            prompt: &job.prompt,
            cached: 0,
            sampling: &job.sampling,
            stop: job.stop.clone(),
            logprobs: job.logprobs,
            forced: job.forced.clone(),
            constraint: job.constraint.clone(),
            cancel: &job.cancel,
        };
        generate_cached(
            &self.model,
            &mut self.cache,
            &self.tok,
            job.cache_key.as_deref(),
            self.max_context,
            req,
            started,
            on_token,
        )
    }

    fn cache_stats(&self) -> CacheStats {
        self.cache.stats()
    }

    fn describe(&self) -> String {
        self.model.backend.name()
    }
    fn kv_elem_bytes(&self) -> usize {
        self.model.backend.kv_elem_bytes()
    }
}

/// The sending side of the queue, shared by handlers.
#[derive(Clone)]
pub struct Queue {
    tx: SyncSender<Job>,
    metrics: Arc<Metrics>,
}

impl Queue {
    /// Queues a job, or gives it back when the queue is full or the worker has stopped.
    #[allow(clippy::result_large_err)]
    pub fn push(&self, job: Job) -> Result<(), Job> {
        self.metrics.queue_depth.fetch_add(1, Ordering::SeqCst);
        match self.tx.try_send(job) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(j)) | Err(TrySendError::Disconnected(j)) => {
                self.metrics.queue_depth.fetch_sub(1, Ordering::SeqCst);
                Err(j)
            }
        }
    }
}

/// Starts the model thread. It ends when every [`Queue`] is dropped and the queue is drained.
pub fn spawn(
    runner: Box<dyn Runner>,
    capacity: usize,
    metrics: Arc<Metrics>,
    shutdown: Arc<AtomicBool>,
) -> (Queue, std::thread::JoinHandle<()>) {
    let (tx, rx) = std::sync::mpsc::sync_channel(capacity);
    let m = metrics.clone();
    let h = std::thread::Builder::new()
        .name("lily-model".into())
        .spawn(move || work(runner, rx, m, shutdown))
        .expect("cannot start the model thread");
    (Queue { tx, metrics }, h)
}

fn work(
    mut runner: Box<dyn Runner>,
    rx: Receiver<Job>,
    metrics: Arc<Metrics>,
    shutdown: Arc<AtomicBool>,
) {
    while let Ok(job) = rx.recv() {
        metrics.queue_depth.fetch_sub(1, Ordering::SeqCst);
        metrics.running.fetch_add(1, Ordering::SeqCst);
        let outcome = run_one(&mut *runner, &job, &metrics, &shutdown);
        metrics.finish(outcome);
        metrics.running.fetch_sub(1, Ordering::SeqCst);
    }
}

fn run_one(
    runner: &mut dyn Runner,
    job: &Job,
    metrics: &Metrics,
    shutdown: &AtomicBool,
) -> Outcome {
    if job.cancel.load(Ordering::Relaxed)
        || job.events.is_closed()
        || shutdown.load(Ordering::Relaxed)
    {
        job.cancel.store(true, Ordering::Relaxed);
        let _ = job.events.send(Event::Done(Box::new(cancelled(job))));
        return Outcome::Cancelled;
    }
    let mut first: Option<f64> = None;
    let mut on_token = |e: TokenEvent<'_>| -> bool {
        if first.is_none() && e.id.is_some() {
            first = Some(job.enqueued.elapsed().as_secs_f64());
        }
        let sent = job
            .events
            .send(Event::Token {
                id: e.id,
                text: e.text.to_string(),
                logprob: e.logprob,
            })
            .is_ok();
        sent && !shutdown.load(Ordering::Relaxed)
    };
    let mut started = |cached: usize| {
        let _ = job.events.send(Event::Started { cached });
    };
    // A panic in the engine must not take the server down: it becomes this request's error.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        runner.run(job, &mut started, &mut on_token)
    }));
    let c = runner.cache_stats();
    metrics.cache_hits.store(c.hits, Ordering::Relaxed);
    metrics.cache_misses.store(c.misses, Ordering::Relaxed);
    metrics
        .cache_evictions
        .store(c.evictions, Ordering::Relaxed);
    metrics.cache_bytes.store(c.bytes as u64, Ordering::Relaxed);
    metrics
        .cache_entries
        .store(c.entries as u64, Ordering::Relaxed);
    metrics
        .cache_snapshots
        .store(c.snapshots as u64, Ordering::Relaxed);
    match r {
        Ok(Ok(g)) => {
            let s = &g.stats;
            metrics
                .prompt_tokens
                .fetch_add(s.prompt_tokens as u64, Ordering::Relaxed);
            metrics
                .cached_tokens
                .fetch_add(s.cached_tokens as u64, Ordering::Relaxed);
            metrics
                .generated_tokens
                .fetch_add(s.generated as u64, Ordering::Relaxed);
            if let Some(ttft) = first {
                metrics.record_generation(
                    ttft,
                    s.prompt_tokens - s.cached_tokens,
                    s.prefill_s,
                    s.generated.saturating_sub(1),
                    s.decode_s,
                );
            }
            let outcome = if g.finish.is_some() {
                Outcome::Ok
            } else {
                Outcome::Cancelled
            };
            let _ = job.events.send(Event::Done(Box::new(g)));
            outcome
        }
        Ok(Err(e)) => {
            let _ = job.events.send(Event::Failed(format!("{e:#}")));
            Outcome::Error
        }
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            let _ = job.events.send(Event::Failed(format!(
                "internal error in the engine: {msg}"
            )));
            Outcome::Error
        }
    }
}

fn cancelled(job: &Job) -> Generation {
    let stats = lily::runtime::GenStats {
        prompt_tokens: job.prompt.len(),
        ..Default::default()
    };
    Generation {
        ids: Vec::new(),
        text: String::new(),
        finish: None,
        stats,
    }
}
