//! Endpoints and response shapes (OpenAI's, field for field).
//!
//! `POST /v1/chat/completions` and `POST /v1/completions` share one path: parse → prepare
//! (template, tokens, context check, forced tokens) on the blocking pool → queue → either collect
//! the worker's events into one JSON response, or turn each into SSE chunks. Streaming sends the
//! role first, then deltas (`reasoning_content` + `reasoning`, `content`, `tool_calls`), a chunk
//! with `finish_reason`, a usage chunk when asked, and `[DONE]`; an error after the stream began
//! is an `{"error": …}` event. Comment lines keep the connection alive during long prefills.
//!
//! `/v1/responses` (responses.rs) and `/v1/messages` (anthropic.rs) reuse this path: their
//! bodies become a [`ChatRequest`], then [`prepare_chat`] and [`submit`] as here, and they shape
//! the same worker events and output-parser parts in their own dialect.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as Sse, KeepAlive};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use lily::runtime::constrain::{Constraint, Grammar, Start};
use lily::runtime::generate::{Forced, Generation, TokenLogprob};
use lily::runtime::stop::{FinishReason, StopRules};
use lily::tokenizer::TemplateError;

use crate::api::{self, ChatRequest, Common, CompletionRequest, Prompt, ToolChoice};
use crate::error::{ApiError, ApiResult};
use crate::metrics::Outcome;
use crate::output::{self, OutputParser, Part};
use crate::worker::{Event, Job};
use crate::App;

type AppState = State<Arc<App>>;

pub(crate) fn router(app: Arc<App>) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(crate::responses::create))
        .route("/v1/messages", post(crate::anthropic::messages))
        .route(
            "/v1/messages/count_tokens",
            post(crate::anthropic::count_tokens),
        )
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(app.clone(), auth));
    Router::new()
        .route("/health", get(health))
        .merge(api)
        .fallback(|| async { ApiError::not_found("no such route; see /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/models, /health, /metrics") })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .with_state(app)
}

/// The API key on every route but `/health` (when a key is set): `Authorization: Bearer KEY`
/// (OpenAI's clients) or `x-api-key: KEY` (Anthropic's).
async fn auth(State(app): AppState, req: Request, next: Next) -> Response {
    if let Some(key) = &app.api_key {
        let h = req.headers();
        let bearer = h
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let x_key = h
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::trim);
        // Constant-time comparison: the key must not leak through timing.
        let same = |g: &str| {
            g.len() == key.len()
                && g.bytes()
                    .zip(key.bytes())
                    .fold(0u8, |a, (x, y)| a | (x ^ y))
                    == 0
        };
        if !(bearer.is_some_and(same) || x_key.is_some_and(same)) {
            let e = ApiError::unauthorized();
            return if crate::anthropic::is_anthropic_path(req.uri().path()) {
                e.anthropic_response()
            } else {
                e.into_response()
            };
        }
    }
    next.run(req).await
}

async fn health(State(app): AppState) -> Response {
    let code = if app.shutdown.load(Ordering::Relaxed) {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    (code, Json(crate::health(&app))).into_response()
}

async fn metrics(State(app): AppState) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        app.metrics.render(),
    )
        .into_response()
}

fn model_card(app: &App) -> Value {
    json!({"id": app.model_name, "object": "model", "created": app.created, "owned_by": "lily", "max_model_len": app.max_context})
}

async fn models(State(app): AppState) -> Response {
    Json(json!({"object": "list", "data": [model_card(&app)]})).into_response()
}

async fn model(
    State(app): AppState,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    if id == app.model_name {
        Json(model_card(&app)).into_response()
    } else {
        ApiError::not_found(format!(
            "the model {id:?} does not exist; this server serves {:?}",
            app.model_name
        ))
        .into_response()
    }
}

/// Reads the body within the size limit (a JSON 413 rather than axum's plain-text one).
pub(crate) async fn read_body(app: &App, body: Body) -> ApiResult<Bytes> {
    axum::body::to_bytes(body, app.max_body).await.map_err(|e| {
        let too_big = std::error::Error::source(&e)
            .is_some_and(|s| s.to_string().contains("length limit"))
            || e.to_string().contains("length limit");
        if too_big {
            ApiError::too_large(app.max_body)
        } else {
            ApiError::bad(format!("cannot read the request body: {e}"))
        }
    })
}

/// A request ready to queue.
pub(crate) struct Prepared {
    ids: Vec<u32>,
    /// The prompt left a `<think>` open: generation starts in the reasoning.
    opens_think: bool,
    forced: Forced,
    /// Structured output: the grammar the answer must follow.
    constraint: Option<Constraint>,
}

/// Which endpoint, with what it needs for the response.
pub(crate) enum Kind {
    Chat {
        tools: Option<Value>,
        parse_tools: bool,
    },
    Text,
}

async fn chat(State(app): AppState, body: Body) -> Response {
    handle(app, body, api::chat_request, |app, req: &ChatRequest| {
        let p = prepare_chat(app, req)?;
        let parse_tools = req.tools.is_some() && req.tool_choice != ToolChoice::None;
        Ok((
            req.common.clone(),
            req.cache_key.clone(),
            p,
            Kind::Chat {
                tools: req.tools.clone(),
                parse_tools,
            },
        ))
    })
    .await
}

async fn completions(State(app): AppState, body: Body) -> Response {
    handle(
        app,
        body,
        api::completion_request,
        |app, req: &CompletionRequest| {
            Ok((
                req.common.clone(),
                req.cache_key.clone(),
                prepare_completion(app, req)?,
                Kind::Text,
            ))
        },
    )
    .await
}

/// The shared path of both endpoints: count, read, parse, prepare off the async threads, run.
async fn handle<R: Send + 'static>(
    app: Arc<App>,
    body: Body,
    parse: impl FnOnce(&Map<String, Value>) -> ApiResult<R>,
    prepare: impl FnOnce(&App, &R) -> ApiResult<(Common, Option<String>, Prepared, Kind)>
        + Send
        + 'static,
) -> Response {
    app.metrics.received.fetch_add(1, Ordering::SeqCst);
    let r = async {
        let bytes = read_body(&app, body).await?;
        let req = parse(&api::body_object(&bytes)?)?;
        let a = app.clone();
        let (common, key, prep, kind) = blocking(move || prepare(&a, &req)).await?;
        Ok::<_, ApiError>(run(app.clone(), common, key, prep, kind).await)
    }
    .await;
    r.unwrap_or_else(|e| reject(&app, e))
}

pub(crate) fn reject(app: &App, e: ApiError) -> Response {
    app.metrics.finish(Outcome::Rejected);
    e.into_response()
}

/// Runs CPU work (template, tokenizer) off the async threads.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> ApiResult<T> + Send + 'static,
) -> ApiResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("request preparation failed: {e}")))?
}

/// The chat request's prompt: rendered text and its tokens.
fn render_chat(app: &App, req: &ChatRequest) -> ApiResult<(String, Vec<u32>)> {
    // `tool_choice: none` leaves the tools out of the prompt, so the model is not told about them.
    let tools = if req.tool_choice == ToolChoice::None {
        None
    } else {
        req.tools.as_ref()
    };
    let text = app
        .template
        .render(&req.messages, tools, true, &req.template_kwargs)
        .map_err(template_error)?;
    check_bytes(app, text.len())?;
    let ids = app
        .tok
        .encode(&text)
        .map_err(|e| ApiError::bad(format!("{e:#}")))?;
    Ok((text, ids))
}

/// Prompt tokens of a chat request, as it would run (Anthropic's `count_tokens`).
pub(crate) fn count_chat_tokens(app: &App, req: &ChatRequest) -> ApiResult<usize> {
    Ok(render_chat(app, req)?.1.len())
}

pub(crate) fn prepare_chat(app: &App, req: &ChatRequest) -> ApiResult<Prepared> {
    let (text, ids) = render_chat(app, req)?;
    check_context(app, ids.len(), &req.common)?;
    let opens_think = output::prompt_opens_think(&text);
    let mut forced = Forced::default();
    let mut constraint = match &req.structured {
        Some(s) => Some(compile(app, &s.grammar, s.param, opens_think)?),
        None => None,
    };
    let script = app.script.iter().find(|(r, _)| text.contains(&r.when));
    if let Some((_, reply)) = script {
        forced.now = reply.clone();
    }
    if script.is_some_and(|(r, _)| !r.open) {
        // A whole scripted reply (test mode): nothing else is forced or constrained (the
        // grammar would reject the forced tokens).
        constraint = None;
    } else if let Some(g) =
        crate::structured::strict_call_grammar(req.tools.as_ref(), &req.tool_choice)
    {
        // Strict tools: the grammar writes the whole call (its start included), typed by the
        // function's schema.
        let g = g.map_err(|e| ApiError::param("tools", e))?;
        constraint = Some(compile(app, &Grammar::Lark(g), "tools", opens_think)?);
    } else {
        // A required call is forced by writing the start of one where the answer begins: right
        // away, or after the model closes its reasoning.
        let start = match &req.tool_choice {
            ToolChoice::Required => Some("<tool_call>\n<function=".to_string()),
            ToolChoice::Named(n) => Some(format!("<tool_call>\n<function={n}>\n")),
            _ => None,
        };
        if let Some(s) = start {
            match (opens_think, app.think_close) {
                (true, Some(close)) => {
                    forced.after = Some((
                        close,
                        app.tok
                            .encode(&format!("\n\n{s}"))
                            .map_err(|e| ApiError::internal(format!("{e:#}")))?,
                    ))
                }
                _ => {
                    forced.now = app
                        .tok
                        .encode(&s)
                        .map_err(|e| ApiError::internal(format!("{e:#}")))?
                }
            }
        }
    }
    // A constraint that starts after the reasoning: the blank line the template puts after
    // `</think>` is forced first, as a required call's start is.
    if let (
        Some(Constraint {
            start: Start::After(close),
            ..
        }),
        None,
    ) = (&constraint, &forced.after)
    {
        forced.after = Some((*close, app.think_lead.clone()));
    }
    Ok(Prepared {
        ids,
        opens_think,
        forced,
        constraint,
    })
}

/// A structured-output grammar compiled for one request (a 400 naming the problem when it does
/// not compile), in the handler so a bad schema never reaches the queue. With the prompt in a
/// think block the constraint starts after `</think>` and the blank line the template puts there:
/// the reasoning stays free.
fn compile(app: &App, g: &Grammar, param: &str, opens_think: bool) -> ApiResult<Constraint> {
    let grammars = app
        .grammars
        .wait()
        .as_ref()
        .map_err(|e| ApiError::param(param, e.clone()))?;
    let compiled = grammars.compile(g).map_err(|e| {
        ApiError::param(
            param,
            format!("`{param}` cannot be used for constrained decoding: {e:#}"),
        )
        .with_code("invalid_grammar")
    })?;
    app.metrics
        .record_compile(compiled.compile_s, compiled.cached);
    let start = match (opens_think, app.think_close) {
        (true, Some(trigger)) => Start::After(trigger),
        _ => Start::Now,
    };
    Ok(Constraint { compiled, start })
}

/// A failed render as a 400. A [`TemplateError`]'s text already says "chat template"; the
/// other errors (the renderer's own checks) get the prefix once.
fn template_error(e: anyhow::Error) -> ApiError {
    let msg = match e.downcast_ref::<TemplateError>() {
        Some(te) => te.to_string(),
        None => format!("chat template: {e:#}"),
    };
    ApiError::bad(msg)
        .with_code("invalid_messages")
        .param_name("messages")
}

fn prepare_completion(app: &App, req: &CompletionRequest) -> ApiResult<Prepared> {
    let (ids, text) = match &req.prompt {
        Prompt::Text(t) => {
            check_bytes(app, t.len())?;
            (
                app.tok
                    .encode(t)
                    .map_err(|e| ApiError::bad(format!("{e:#}")))?,
                t.clone(),
            )
        }
        Prompt::Ids(ids) => {
            let vocab = app.tok.vocab_size();
            if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
                return Err(ApiError::param(
                    "prompt",
                    format!("token id {bad} is out of range (the vocabulary has {vocab})"),
                ));
            }
            (ids.clone(), String::new())
        }
    };
    if ids.is_empty() {
        return Err(ApiError::param("prompt", "the prompt encodes to no tokens"));
    }
    check_context(app, ids.len(), &req.common)?;
    let mut forced = Forced::default();
    if let Some((_, reply)) = app
        .script
        .iter()
        .find(|(r, _)| !text.is_empty() && text.contains(&r.when))
    {
        forced.now = reply.clone();
    }
    let constraint = match &req.structured {
        // A scripted reply (test mode) is not constrained; the grammar is still checked.
        Some(s) => {
            Some(compile(app, &s.grammar, s.param, false)?).filter(|_| forced.now.is_empty())
        }
        None => None,
    };
    Ok(Prepared {
        ids,
        opens_think: false,
        forced,
        constraint,
    })
}

fn context_error(app: &App, detail: String) -> ApiError {
    ApiError::bad(format!(
        "This model's maximum context length is {} tokens. However, your request has {detail}; the prompt must be shorter than the context. Please reduce the length of the messages.",
        app.max_context
    ))
    .with_code("context_length_exceeded")
    .param_name("messages")
}

/// A prompt of more bytes than the context could hold even in the longest tokens is refused
/// without tokenizing it.
fn check_bytes(app: &App, bytes: usize) -> ApiResult<()> {
    if bytes > app.max_context.saturating_mul(app.max_token_bytes) {
        return Err(context_error(app, format!("more than {} prompt tokens (the prompt is {bytes} bytes; no token is longer than {} bytes)", app.max_context, app.max_token_bytes)));
    }
    Ok(())
}

/// A prompt must leave room for at least one generated token.
fn check_context(app: &App, prompt: usize, c: &Common) -> ApiResult<()> {
    if prompt >= app.max_context {
        let asked = c
            .max_tokens
            .map(|m| format!(" ({prompt} in the messages, {m} in the completion)"))
            .unwrap_or_default();
        return Err(context_error(app, format!("{prompt} prompt tokens{asked}")));
    }
    Ok(())
}

/// Sets the job's cancel flag when dropped: the client went away (its handler future or SSE
/// stream was dropped) before the job ended.
pub(crate) struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Queues the job and answers: JSON or SSE.
async fn run(
    app: Arc<App>,
    common: Common,
    cache_key: Option<String>,
    prep: Prepared,
    kind: Kind,
) -> Response {
    let (rx, guard, shaper) = match submit(&app, &common, cache_key, prep, &kind) {
        Ok(x) => x,
        Err(e) => return reject(&app, e),
    };
    if common.stream {
        stream_response(app, rx, guard, shaper)
    } else {
        collect_response(app, rx, guard, shaper).await
    }
}

/// Queues the job: the one way into the model for every endpoint (each dialect then shapes the
/// same events). Errors are not yet counted: the caller rejects them in its own dialect.
pub(crate) fn submit(
    app: &Arc<App>,
    common: &Common,
    cache_key: Option<String>,
    prep: Prepared,
    kind: &Kind,
) -> ApiResult<(UnboundedReceiver<Event>, CancelOnDrop, Shaper)> {
    if app.shutdown.load(Ordering::Relaxed) {
        return Err(ApiError::unavailable("the server is shutting down", 5));
    }
    let sampling = app
        .defaults
        .with_overrides(&common.sampling)
        .map_err(|e| ApiError::bad(format!("{e:#}")))?;
    let stop = StopRules {
        stop_ids: app.stop_ids.clone(),
        stop_strings: common.stop.clone(),
        max_tokens: common.max_tokens,
        max_context: app.max_context,
    };
    let (tx, rx) = unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let prompt_len = prep.ids.len();
    let job = Job {
        prompt: prep.ids,
        sampling,
        stop,
        logprobs: common.logprobs,
        forced: prep.forced,
        constraint: prep.constraint,
        cache_key,
        cancel: cancel.clone(),
        events: tx,
        enqueued: Instant::now(),
    };
    if app.queue.push(job).is_err() {
        let msg = if app.shutdown.load(Ordering::Relaxed) {
            "the server is shutting down"
        } else {
            "the server is busy: the request queue is full; retry shortly"
        };
        return Err(ApiError::unavailable(msg, 1));
    }
    let guard = CancelOnDrop(cancel);
    let shaper = Shaper::new(app, common, kind, prep.opens_think, prompt_len);
    Ok((rx, guard, shaper))
}

/// Turns worker events into OpenAI objects for one request.
pub(crate) struct Shaper {
    app: Arc<App>,
    id: String,
    chat: bool,
    parser: Option<OutputParser>,
    include_usage: bool,
    logprobs: bool,
    /// Log-probability entries not yet sent (tokens whose text is still held back).
    pending_lp: Vec<Value>,
    /// Completions' legacy logprobs: tokens, token_logprobs, top_logprobs, text_offset.
    legacy_lp: Option<[Vec<Value>; 4]>,
    text_len: usize,
    pub(crate) prompt_len: usize,
    pub(crate) cached: usize,
    /// Generated tokens before `</think>` when the prompt opened a think block.
    pub(crate) reasoning_tokens: usize,
    in_think: bool,
    parts: Vec<Part>,
}

impl Shaper {
    fn new(
        app: &Arc<App>,
        common: &Common,
        kind: &Kind,
        opens_think: bool,
        prompt_len: usize,
    ) -> Self {
        let id = app.new_id();
        let (chat, parser) = match kind {
            Kind::Chat { tools, parse_tools } => {
                let seed = lily::rng::name_id(&id);
                (
                    true,
                    Some(OutputParser::new(
                        opens_think,
                        tools.as_ref(),
                        *parse_tools,
                        seed,
                    )),
                )
            }
            Kind::Text => (false, None),
        };
        Self {
            app: app.clone(),
            id: if chat {
                format!("chatcmpl-{id}")
            } else {
                format!("cmpl-{id}")
            },
            chat,
            parser,
            include_usage: common.include_usage,
            logprobs: common.logprobs.is_some(),
            pending_lp: Vec::new(),
            legacy_lp: (!chat && common.logprobs.is_some()).then(Default::default),
            text_len: 0,
            prompt_len,
            cached: 0,
            reasoning_tokens: 0,
            in_think: opens_think,
            parts: Vec::new(),
        }
    }

    fn object(&self, stream: bool) -> &'static str {
        match (self.chat, stream) {
            (true, true) => "chat.completion.chunk",
            (true, false) => "chat.completion",
            (false, _) => "text_completion",
        }
    }

    /// One token: its text as parts (chat) or text (completions); log-probs are recorded.
    pub(crate) fn token(
        &mut self,
        id: Option<u32>,
        text: &str,
        lp: Option<TokenLogprob>,
    ) -> Vec<Part> {
        if let Some(id) = id {
            if self.in_think {
                if Some(id) == self.app.think_close {
                    self.in_think = false;
                } else {
                    self.reasoning_tokens += 1;
                }
            }
            if let Some(lp) = lp.filter(|_| self.logprobs) {
                self.record_lp(id, &lp);
            }
        }
        let parts = match &mut self.parser {
            Some(p) => p.push(text),
            None if text.is_empty() => Vec::new(),
            None => vec![Part::Content(text.to_string())],
        };
        self.text_len += text.len();
        parts
    }

    fn token_entry(&self, id: u32, lp: f32) -> Value {
        let tok = &self.app.tok;
        let text = tok.decode(&[id]).unwrap_or_default();
        let bytes = tok
            .token_bytes(id)
            .unwrap_or_else(|| text.as_bytes().to_vec());
        json!({"token": text, "logprob": lp, "bytes": bytes})
    }

    fn record_lp(&mut self, id: u32, lp: &TokenLogprob) {
        if let Some(l) = &mut self.legacy_lp {
            let text = self.app.tok.decode(&[id]).unwrap_or_default();
            let top: Map<String, Value> = lp
                .top
                .iter()
                .map(|&(t, p)| (self.app.tok.decode(&[t]).unwrap_or_default(), json!(p)))
                .collect();
            l[0].push(json!(text));
            l[1].push(json!(lp.logprob));
            l[2].push(Value::Object(top));
            l[3].push(json!(self.text_len));
            return;
        }
        let mut e = self.token_entry(id, lp.logprob);
        e["top_logprobs"] = Value::Array(
            lp.top
                .iter()
                .map(|&(t, p)| self.token_entry(t, p))
                .collect(),
        );
        self.pending_lp.push(e);
    }

    fn take_logprobs(&mut self) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        if let Some(l) = &mut self.legacy_lp {
            let [a, b, c, d] = std::mem::take(l);
            return json!({"tokens": a, "token_logprobs": b, "top_logprobs": c, "text_offset": d});
        }
        json!({"content": std::mem::take(&mut self.pending_lp), "refusal": null})
    }

    /// Whether the output parser found a tool call.
    pub(crate) fn called_tools(&self) -> bool {
        self.parser
            .as_ref()
            .is_some_and(|p| p.tool_calls_seen() > 0)
    }

    fn finish_reason(&self, g: &Generation) -> &'static str {
        match &g.finish {
            Some(FinishReason::Stop(_))
                if self
                    .parser
                    .as_ref()
                    .is_some_and(|p| p.tool_calls_seen() > 0) =>
            {
                "tool_calls"
            }
            Some(f) => f.openai(),
            None => "stop",
        }
    }

    fn usage(&self, g: &Generation) -> Value {
        let n = g.ids.len();
        let mut u = json!({
            "prompt_tokens": self.prompt_len,
            "completion_tokens": n,
            "total_tokens": self.prompt_len + n,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        });
        if self.chat {
            u["completion_tokens_details"] = json!({"reasoning_tokens": self.reasoning_tokens});
        }
        u
    }

    fn chunk(&self, choice: Value) -> Value {
        let mut c = json!({"id": self.id, "object": self.object(true), "created": now(), "model": self.app.model_name, "system_fingerprint": fingerprint(), "choices": [choice]});
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }

    /// Stream chunks for parts (chat: one delta per part; completions: the text).
    fn part_chunks(&mut self, parts: Vec<Part>) -> Vec<Value> {
        let mut out = Vec::new();
        for p in parts {
            let lp = self.take_logprobs();
            let choice = if self.chat {
                let delta = match p {
                    Part::Reasoning(s) => json!({"reasoning_content": s, "reasoning": s}),
                    Part::Content(s) => json!({"content": s}),
                    Part::ToolCallStart { index, id, name } => {
                        json!({"tool_calls": [{"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]})
                    }
                    Part::ToolCallArgs { index, args } => {
                        json!({"tool_calls": [{"index": index, "function": {"arguments": args}}]})
                    }
                };
                json!({"index": 0, "delta": delta, "logprobs": lp, "finish_reason": null})
            } else {
                let Part::Content(s) = p else { continue };
                json!({"index": 0, "text": s, "logprobs": lp, "finish_reason": null})
            };
            out.push(self.chunk(choice));
        }
        out
    }

    /// The non-streaming response.
    fn response(&mut self, g: &Generation) -> Value {
        let finish = self.finish_reason(g);
        let lp = self.take_logprobs();
        let choice = if self.chat {
            let p = output::collect(std::mem::take(&mut self.parts));
            let mut msg = json!({"role": "assistant", "content": p.content, "refusal": null});
            if let Some(r) = &p.reasoning {
                msg["reasoning_content"] = json!(r);
                msg["reasoning"] = json!(r);
            }
            if !p.tool_calls.is_empty() {
                msg["tool_calls"] = p.tool_calls.iter().map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})).collect();
            }
            json!({"index": 0, "message": msg, "logprobs": lp, "finish_reason": finish})
        } else {
            let text: String = std::mem::take(&mut self.parts)
                .into_iter()
                .filter_map(|p| {
                    if let Part::Content(s) = p {
                        Some(s)
                    } else {
                        None
                    }
                })
                .collect();
            json!({"index": 0, "text": text, "logprobs": lp, "finish_reason": finish})
        };
        json!({"id": self.id, "object": self.object(false), "created": now(), "model": self.app.model_name, "system_fingerprint": fingerprint(), "choices": [choice], "usage": self.usage(g)})
    }

    pub(crate) fn final_parts(&mut self) -> Vec<Part> {
        self.parser.as_mut().map(|p| p.finish()).unwrap_or_default()
    }
}

pub(crate) fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn fingerprint() -> String {
    format!("lily-{}", env!("CARGO_PKG_VERSION"))
}

/// Why a job ended without a generation result the client can use.
pub(crate) fn ended_early(app: &App, g: &Generation) -> Option<ApiError> {
    g.finish.is_none().then(|| {
        if app.shutdown.load(Ordering::Relaxed) {
            ApiError::unavailable("the server is shutting down; the request was cancelled", 5)
        } else {
            ApiError::internal("the request was cancelled")
        }
    })
}

async fn collect_response(
    app: Arc<App>,
    mut rx: UnboundedReceiver<Event>,
    guard: CancelOnDrop,
    mut sh: Shaper,
) -> Response {
    let _guard = guard;
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Started { cached } => sh.cached = cached,
            Event::Token { id, text, logprob } => {
                let parts = sh.token(id, &text, logprob);
                sh.parts.extend(parts);
            }
            Event::Done(g) => {
                if let Some(e) = ended_early(&app, &g) {
                    return e.into_response();
                }
                let tail = sh.final_parts();
                sh.parts.extend(tail);
                return Json(sh.response(&g)).into_response();
            }
            Event::Failed(msg) => return ApiError::internal(msg).into_response(),
        }
    }
    ApiError::internal("the model thread stopped before answering").into_response()
}

/// Per-stream state for the SSE body.
struct StreamState {
    app: Arc<App>,
    rx: UnboundedReceiver<Event>,
    sh: Shaper,
    _guard: CancelOnDrop,
    done: bool,
}

fn data(v: &Value) -> Result<Sse, Infallible> {
    Ok(Sse::default().data(v.to_string()))
}

impl StreamState {
    /// The next batch of SSE events, or `None` at the end.
    async fn next(&mut self) -> Option<Vec<Result<Sse, Infallible>>> {
        if self.done {
            return None;
        }
        let ev = match self.rx.recv().await {
            Some(ev) => ev,
            None => {
                self.done = true;
                return Some(vec![data(
                    &ApiError::internal("the model thread stopped before answering").body(),
                )]);
            }
        };
        let sh = &mut self.sh;
        let out: Vec<Value> = match ev {
            Event::Started { cached } => {
                sh.cached = cached;
                Vec::new()
            }
            Event::Token { id, text, logprob } => {
                let parts = sh.token(id, &text, logprob);
                sh.part_chunks(parts)
            }
            Event::Done(g) => {
                self.done = true;
                if let Some(e) = ended_early(&self.app, &g) {
                    return Some(vec![data(&e.body()), Ok(Sse::default().data("[DONE]"))]);
                }
                let tail = sh.final_parts();
                let mut v = sh.part_chunks(tail);
                let lp = sh.take_logprobs();
                let finish = sh.finish_reason(&g);
                let choice = if sh.chat {
                    json!({"index": 0, "delta": {}, "logprobs": lp, "finish_reason": finish})
                } else {
                    json!({"index": 0, "text": "", "logprobs": lp, "finish_reason": finish})
                };
                v.push(sh.chunk(choice));
                if sh.include_usage {
                    let mut u = sh.chunk(Value::Null);
                    u["choices"] = json!([]);
                    u["usage"] = sh.usage(&g);
                    v.push(u);
                }
                let mut evs: Vec<_> = v.iter().map(data).collect();
                evs.push(Ok(Sse::default().data("[DONE]")));
                return Some(evs);
            }
            Event::Failed(msg) => {
                self.done = true;
                return Some(vec![
                    data(&ApiError::internal(msg).body()),
                    Ok(Sse::default().data("[DONE]")),
                ]);
            }
        };
        Some(out.iter().map(data).collect())
    }
}

fn stream_response(
    app: Arc<App>,
    rx: UnboundedReceiver<Event>,
    guard: CancelOnDrop,
    sh: Shaper,
) -> Response {
    // The role comes first, before the job even leaves the queue (the first byte is fast).
    let first = if sh.chat {
        let c = sh.chunk(json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}));
        vec![data(&c)]
    } else {
        Vec::new()
    };
    let st = StreamState {
        app,
        rx,
        sh,
        _guard: guard,
        done: false,
    };
    let rest = stream::unfold(st, |mut st| async move {
        st.next().await.map(|evs| (stream::iter(evs), st))
    })
    .flatten();
    let body: std::pin::Pin<Box<dyn Stream<Item = Result<Sse, Infallible>> + Send>> =
        Box::pin(stream::iter(first).chain(rest));
    axum::response::Sse::new(body)
        .keep_alive(
            KeepAlive::new()
                .interval(Duration::from_secs(5))
                .text("keep-alive"),
        )
        .into_response()
}
