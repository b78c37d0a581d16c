//! The OpenAI-compatible HTTP API of lily (axum + tokio).
//!
//! ```text
//! client ──HTTP──▶ handler (tokio): parse + validate → render template → tokenize → check context
//!                     │ Job (bounded FIFO queue; full → 503 + Retry-After)
//!                     ▼
//!                  model thread (worker.rs): one generation at a time, events back per token
//!                     │ Event::{Started, Token, Done, Failed}
//!                     ▼
//!                  handler: output parser (reasoning / content / tool calls) → JSON or SSE chunks
//! ```
//!
//! - `routes.rs`: the endpoints and response shapes; `api.rs`: request parsing; `output.rs`:
//!   reasoning and tool-call parsing; `metrics.rs`: `/metrics`; `error.rs`: OpenAI (and
//!   Anthropic) errors. `responses.rs` (OpenAI's Responses API) and `anthropic.rs` (Anthropic's
//!   Messages API) translate their bodies into chat requests and shape the same worker events
//!   their own way: one request path, one generation loop, one output parser.
//! - The model runs on its own OS thread so tokio's threads never block on compute; handlers
//!   render and tokenize on the blocking pool.
//! - A client that goes away drops its handler future or SSE stream; a guard in both sets the
//!   job's cancel flag, which the generation loop checks after every token.
//! - Shutdown (SIGINT/SIGTERM, or [`Server::shutdown`]): stop accepting, cancel the running and
//!   queued generations (their clients get a 503 / an error event), drain, stop the model thread.

pub mod anthropic;
pub mod api;
pub mod error;
pub mod metrics;
pub mod output;
pub mod responses;
mod routes;
pub mod structured;
pub mod worker;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use lily::runtime::sampler::SamplingParams;
use lily::tokenizer::{ChatTemplate, Tokenizer};

pub use worker::{ModelRunner, Runner};

use metrics::Metrics;
use worker::Queue;

/// How to serve.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub host: String,
    /// 0 picks a free port.
    pub port: u16,
    pub api_key: Option<String>,
    /// The checkpoint directory (tokenizer, template, generation config).
    pub model_dir: PathBuf,
    /// Name reported by `/v1/models` and in responses (default: the directory's name).
    pub model_name: Option<String>,
    pub max_context: usize,
    /// Requests waiting at most (beyond the running one).
    pub queue: usize,
    /// Largest request body in bytes.
    pub max_body: usize,
    /// Test mode: teacher-forced replies chosen by prompt substring (see [`ScriptRule`]).
    pub test_script: Option<PathBuf>,
}

impl ServeOptions {
    pub fn new(model_dir: &Path, max_context: usize) -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8000,
            api_key: None,
            model_dir: model_dir.to_path_buf(),
            model_name: None,
            max_context,
            queue: 32,
            max_body: 32 << 20,
            test_script: None,
        }
    }
}

/// A test-script rule: when the rendered prompt contains `when`, the reply is `reply` (forced
/// token by token through the model, then end of turn) instead of sampled text. For
/// deterministic API tests with random-weight checkpoints; every other path runs for real.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct ScriptRule {
    pub when: String,
    pub reply: String,
    /// Force the reply, then let the model go on (no end of turn): e.g. a reasoning that ends in
    /// `</think>`, after which a structured-output constraint takes over.
    #[serde(default)]
    pub open: bool,
}

/// What every handler shares.
pub(crate) struct App {
    tok: Arc<Tokenizer>,
    template: ChatTemplate,
    defaults: SamplingParams,
    stop_ids: Vec<u32>,
    /// `</think>`: where a forced tool-call start goes when the prompt opened a think block.
    think_close: Option<u32>,
    /// Structured outputs: the grammar compiler for this tokenizer, or why it could not be set
    /// up (then structured-output requests get that error; everything else still runs). Built
    /// on a thread of its own (a token trie of the whole vocabulary: 1.4-2 s at 248K ids) so
    /// the server listens at once; a structured request that comes first waits for it.
    grammars: Arc<OnceLock<std::result::Result<lily::runtime::constrain::Grammars, String>>>,
    /// What the template puts between `</think>` and the answer ("\n\n"): forced before a
    /// constraint that starts after the reasoning.
    think_lead: Vec<u32>,
    max_context: usize,
    /// The longest token in bytes: a prompt longer than `max_context` × this cannot fit, and is
    /// refused before tokenizing (tokenizing megabytes would tie up a core for seconds).
    max_token_bytes: usize,
    model_name: String,
    api_key: Option<String>,
    max_body: usize,
    queue: Queue,
    metrics: Arc<Metrics>,
    shutdown: Arc<AtomicBool>,
    script: Vec<(ScriptRule, Vec<u32>)>,
    backend: String,
    created: u64,
    next_id: AtomicU64,
    /// Recent responses of `/v1/responses`, for `previous_response_id`.
    responses: responses::Store,
}

impl App {
    /// A fresh id suffix: 24 characters of base-62, unique per server run.
    fn new_id(&self) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut x = lily::rng::hash(&[self.created, n, std::process::id() as u64]);
        let mut y = lily::rng::mix64(x ^ 0x9e37_79b9_7f4a_7c15);
        const A: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
        (0..24)
            .map(|i| {
                let w = if i < 12 { &mut x } else { &mut y };
                let c = A[(*w % 62) as usize] as char;
                *w /= 62;
                c
            })
            .collect()
    }
}

/// A running server.
pub struct Server {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<()>>>,
    pub metrics: Arc<Metrics>,
}

impl Server {
    /// Loads the text side of the checkpoint, starts the model thread and binds. Returns once
    /// the server accepts connections.
    pub fn start(opts: ServeOptions, runner: Box<dyn Runner>) -> Result<Server> {
        let dir = &opts.model_dir;
        let tok = Arc::new(Tokenizer::from_dir(dir)?);
        let template = ChatTemplate::from_dir(dir)?;
        let defaults = SamplingParams::from_generation_config(dir)?;
        let end_of_turn = tok
            .token_id("<|im_end|>")
            .context("the tokenizer has no <|im_end|> token; is this a Qwen3.6 checkpoint?")?;
        let mut stop_ids = lily::tokenizer::stop_ids(dir)?;
        if stop_ids.is_empty() {
            stop_ids = [Some(end_of_turn), tok.token_id("<|endoftext|>")]
                .into_iter()
                .flatten()
                .collect();
        }
        if opts.max_context < 2 {
            bail!("--max-context must be at least 2");
        }
        if opts.queue == 0 {
            bail!("--queue must be at least 1");
        }
        let script = match &opts.test_script {
            None => Vec::new(),
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("{}: cannot read the test script", p.display()))?;
                let rules: Vec<ScriptRule> = serde_json::from_str(&text).with_context(|| {
                    format!(
                        "{}: expected a JSON list of {{\"when\", \"reply\"}}",
                        p.display()
                    )
                })?;
                rules
                    .into_iter()
                    .map(|r| {
                        let mut ids = tok.encode(&r.reply)?;
                        if !r.open {
                            ids.push(end_of_turn);
                        }
                        Ok((r, ids))
                    })
                    .collect::<Result<_>>()?
            }
        };
        let model_name = opts.model_name.clone().unwrap_or_else(|| {
            dir.canonicalize()
                .ok()
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| "lily".into())
        });
        let metrics = Arc::new(Metrics::default());
        let shutdown = Arc::new(AtomicBool::new(false));
        let backend = runner.describe();
        let (queue, worker) = worker::spawn(runner, opts.queue, metrics.clone(), shutdown.clone());
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let max_token_bytes = (0..tok.vocab_size() as u32)
            .filter_map(|i| tok.token_bytes(i).map(|b| b.len()))
            .max()
            .unwrap_or(1)
            .max(1);
        let grammars = Arc::new(OnceLock::new());
        {
            let (cell, tok, dir, stops) = (
                grammars.clone(),
                tok.clone(),
                dir.to_path_buf(),
                stop_ids.clone(),
            );
            std::thread::Builder::new()
                .name("lily-grammars".into())
                .spawn(move || {
                    // A panic inside the grammar engine must still fill the cell: requests wait on it.
                    let build = std::panic::AssertUnwindSafe(|| {
                        lily::config::Config::from_dir(&dir)
                            .map(|c| c.vocab_size)
                            .and_then(|vocab| {
                                lily::runtime::constrain::Grammars::new(tok, vocab, &stops)
                            })
                            .map_err(|e| format!("{e:#}"))
                    });
                    let g = std::panic::catch_unwind(build)
                        .unwrap_or_else(|_| {
                            Err("the grammar engine panicked while loading the vocabulary".into())
                        })
                        .map_err(|e| {
                            format!("structured outputs are unavailable on this server: {e}")
                        });
                    if let Err(e) = &g {
                        eprintln!("lily: {e}");
                    }
                    let _ = cell.set(g);
                })?;
        }
        let think_lead = tok.encode("\n\n")?;
        let app = Arc::new(App {
            max_token_bytes,
            grammars,
            think_lead,
            think_close: tok.token_id("</think>"),
            tok,
            template,
            defaults,
            stop_ids,
            max_context: opts.max_context,
            model_name,
            api_key: opts.api_key.clone().filter(|k| !k.is_empty()),
            max_body: opts.max_body,
            queue,
            metrics: metrics.clone(),
            shutdown: shutdown.clone(),
            script,
            backend,
            created,
            next_id: AtomicU64::new(0),
            responses: responses::Store::default(),
        });

        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("lily-http")
            .build()?;
        let listener = rt
            .block_on(tokio::net::TcpListener::bind((
                opts.host.as_str(),
                opts.port,
            )))
            .with_context(|| format!("cannot listen on {}:{}", opts.host, opts.port))?;
        let addr = listener.local_addr()?;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let router = routes::router(app.clone());
        let thread = std::thread::Builder::new()
            .name("lily-server".into())
            .spawn(move || -> Result<()> {
                rt.block_on(async move {
                    let app2 = app.clone();
                    let stopping = async move {
                        let _ = stop_rx.await;
                        // Cancel everything in flight so the graceful drain ends quickly.
                        app2.shutdown.store(true, Ordering::SeqCst);
                    };
                    axum::serve(listener, router)
                        .with_graceful_shutdown(stopping)
                        .await
                        .context("server failed")?;
                    Ok::<(), anyhow::Error>(())
                })?;
                // The last handle to the queue goes with the app; the model thread then drains and ends.
                drop(rt);
                worker
                    .join()
                    .map_err(|_| anyhow::anyhow!("the model thread panicked"))?;
                Ok(())
            })?;
        Ok(Server {
            addr,
            stop: Some(stop_tx),
            thread: Some(thread),
            metrics,
        })
    }

    /// Stops accepting, cancels what runs, waits for the drain (at most `grace`).
    pub fn shutdown(mut self, grace: Duration) -> Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let t0 = std::time::Instant::now();
        if let Some(t) = self.thread.take() {
            while !t.is_finished() {
                if t0.elapsed() > grace {
                    bail!("the server did not stop within {grace:?}");
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            t.join()
                .map_err(|_| anyhow::anyhow!("the server thread panicked"))??;
        }
        Ok(())
    }

    /// Whether the server thread has ended (on its own only after a fatal error).
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }
}

/// Runs a server until SIGINT or SIGTERM, then shuts down gracefully.
pub fn serve(opts: ServeOptions, runner: Box<dyn Runner>) -> Result<()> {
    let server = Server::start(opts, runner)?;
    eprintln!("lily: listening on http://{}", server.addr);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            tokio::select! {
                _ = ctrl_c => {},
                _ = term.recv() => {},
            }
        }
        #[cfg(not(unix))]
        ctrl_c.await?;
        Ok::<(), anyhow::Error>(())
    })?;
    eprintln!("lily: shutting down (cancelling running requests)");
    server.shutdown(Duration::from_secs(30))?;
    eprintln!("lily: stopped");
    Ok(())
}

/// `/health` body.
pub(crate) fn health(app: &App) -> Value {
    serde_json::json!({
        "status": if app.shutdown.load(Ordering::Relaxed) { "stopping" } else { "ok" },
        "model": app.model_name,
        "backend": app.backend,
        "max_context": app.max_context,
        "queue_depth": app.metrics.queue_depth.load(Ordering::Relaxed),
        "running": app.metrics.running.load(Ordering::Relaxed),
    })
}
