//! Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) as a thin
//! translation onto the chat path: the body becomes an OpenAI chat request (then parsed, checked,
//! rendered, tokenized and queued exactly like `/v1/chat/completions`: same template, prefix
//! cache, generation loop and output parser), and the parser's parts are shaped into Anthropic's
//! content blocks and stream events.
//!
//! Request → chat request:
//! - `system` (a string or text blocks) → leading system messages (merged into one block).
//! - `messages[].content` (a string or blocks): `text` → the message text (blocks joined with a
//!   blank line); `thinking` (assistant) → `reasoning_content`; `tool_use` (assistant) →
//!   `tool_calls`; `tool_result` (user) → a `tool` message at its place (`is_error` prefixes
//!   "Error: "); `redacted_thinking` is left out; images and documents are refused (text model).
//! - `tools[]` (`name`, `description`, `input_schema`) → function tools; server tools are refused.
//! - `tool_choice` auto / any / tool / none → auto / required / named / none.
//! - `thinking.type` enabled / adaptive / between_tools → Qwen thinking on; disabled or absent →
//!   off (Anthropic's default is no thinking).
//! - `max_tokens`, `stop_sequences`, `temperature`, `top_p`, `top_k`, `stream` as they are;
//!   `metadata`, `service_tier`, `output_config.effort` and other fields are ignored;
//!   `output_config.format` (`{"type": "json_schema", "schema"}`) constrains the answer.
//!
//! Response: content blocks `thinking` (reasoning; `signature` is empty: nothing to verify here),
//! `text`, `tool_use` (`input` is the parsed arguments); `stop_reason` end_turn / max_tokens /
//! stop_sequence (with `stop_sequence`) / tool_use; `usage` with `input_tokens` (not cached),
//! `cache_read_input_tokens` (reused from the prefix cache), `cache_creation_input_tokens` 0 and
//! `output_tokens`. Streaming sends `message_start`, then per block `content_block_start`,
//! `content_block_delta`s (`thinking_delta`, `text_delta`, `input_json_delta`),
//! `content_block_stop`, then `message_delta` (stop reason, final usage) and `message_stop`; an
//! error after the stream began is an `error` event. Errors are Anthropic's
//! `{"type": "error", "error": {"type", "message"}}`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::response::sse::{Event as Sse, KeepAlive};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use lily::runtime::generate::Generation;
use lily::runtime::stop::{FinishReason, StopKind};

use crate::api::{self, get, kind, ChatRequest, ToolChoice};
use crate::error::{ApiError, ApiResult};
use crate::metrics::Outcome;
use crate::output::{self, Part};
use crate::routes::{self, CancelOnDrop, Kind, Shaper};
use crate::worker::Event;
use crate::App;

pub(crate) fn is_anthropic_path(path: &str) -> bool {
    path.starts_with("/v1/messages")
}

/// Text blocks (or a string) → one string; `what` names the field in errors.
fn blocks_text(v: &Value, what: &str) -> ApiResult<String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut texts = Vec::new();
            for (j, b) in blocks.iter().enumerate() {
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => texts.push(b.get("text").and_then(Value::as_str).ok_or_else(|| ApiError::param(what, format!("`{what}[{j}]` is a text block without a string `text`")))?),
                    Some(t @ ("image" | "document" | "search_result")) => return Err(ApiError::param(what, format!("`{what}[{j}]` is a {t:?} block; this server runs the text model only"))),
                    _ => return Err(ApiError::param(what, format!("`{what}[{j}]` must be a text block like {{\"type\": \"text\", \"text\": …}}"))),
                }
            }
            // Separate blocks are separate paragraphs.
            Ok(texts.join("\n\n"))
        }
        v => Err(ApiError::param(
            what,
            format!(
                "`{what}` must be a string or an array of text blocks, got {}",
                kind(v)
            ),
        )),
    }
}

/// The Anthropic body as the body of an OpenAI chat request (see the module docs).
pub fn chat_body(o: &Map<String, Value>) -> ApiResult<Map<String, Value>> {
    let mut out = Map::new();
    for k in [
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stream",
    ] {
        if let Some(v) = get(o, k) {
            out.insert(k.into(), v.clone());
        }
    }
    match get(o, "stop_sequences") {
        None => {}
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => {
            if a.iter().any(|s| s.as_str().is_some_and(str::is_empty)) {
                return Err(ApiError::param(
                    "stop_sequences",
                    "stop sequences must not be empty",
                ));
            }
            if a.len() > api::MAX_STOPS {
                return Err(ApiError::param(
                    "stop_sequences",
                    format!(
                        "at most {} stop sequences are allowed, got {}",
                        api::MAX_STOPS,
                        a.len()
                    ),
                ));
            }
            out.insert("stop".into(), Value::Array(a.clone()));
        }
        Some(_) => {
            return Err(ApiError::param(
                "stop_sequences",
                "`stop_sequences` must be an array of strings",
            ))
        }
    }
    let mut msgs: Vec<Value> = Vec::new();
    if let Some(system) = get(o, "system") {
        msgs.push(json!({"role": "system", "content": blocks_text(system, "system")?}));
    }
    match get(o, "messages") {
        None => return Err(ApiError::param("messages", "`messages` is required")),
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(ApiError::param("messages", "`messages` must not be empty"))
        }
        Some(Value::Array(a)) => {
            for (i, m) in a.iter().enumerate() {
                message(i, m, &mut msgs)?;
            }
        }
        Some(v) => {
            return Err(ApiError::param(
                "messages",
                format!(
                    "`messages` must be an array of message objects, got {}",
                    kind(v)
                ),
            ))
        }
    }
    out.insert("messages".into(), Value::Array(msgs));
    if let Some(tools) = get(o, "tools") {
        let fns = api::flat_tools(tools, |p, t| {
            match t.get("type").and_then(Value::as_str) {
                None | Some("custom") => {}
                Some(x) => return Err(ApiError::param(p, format!("`{p}.type` {x:?} is a server tool, which this server does not run; give client tools with `name` and `input_schema`"))),
            }
            let schema = t
                .get("input_schema")
                .filter(|v| !v.is_null())
                .cloned()
                .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
            if !schema.is_object() {
                return Err(ApiError::param(
                    p,
                    format!("`{p}.input_schema` must be a JSON schema object"),
                ));
            }
            Ok(Some(schema))
        })?;
        out.insert("tools".into(), Value::Array(fns));
    }
    if let Some(tc) = get(o, "tool_choice") {
        let choice = match tc.get("type").and_then(Value::as_str) {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => match tc.get("name").and_then(Value::as_str) {
                Some(n) => json!({"type": "function", "function": {"name": n}}),
                None => {
                    return Err(ApiError::param(
                        "tool_choice",
                        "`tool_choice` of type \"tool\" needs a `name`",
                    ))
                }
            },
            _ => {
                return Err(ApiError::param(
                    "tool_choice",
                    "`tool_choice.type` must be one of auto, any, tool, none",
                ))
            }
        };
        // Anthropic accepts `auto` / `none` without tools; the chat path does too.
        out.insert("tool_choice".into(), choice);
    }
    let thinking = match get(o, "thinking") {
        None => false,
        Some(t) => match t.get("type").and_then(Value::as_str) {
            Some("enabled" | "adaptive" | "between_tools") => true,
            Some("disabled") => false,
            _ => {
                return Err(ApiError::param(
                    "thinking",
                    "`thinking.type` must be one of enabled, adaptive, disabled",
                ))
            }
        },
    };
    out.insert(
        "chat_template_kwargs".into(),
        json!({"enable_thinking": thinking}),
    );
    Ok(out)
}

/// One Anthropic message → chat messages (a user message with tool results gives `tool`
/// messages at their places).
fn message(i: usize, m: &Value, out: &mut Vec<Value>) -> ApiResult<()> {
    let p = format!("messages[{i}]");
    let Value::Object(o) = m else {
        return Err(ApiError::param(
            &p,
            format!("`{p}` must be an object, got {}", kind(m)),
        ));
    };
    let role = match o.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant")) => r,
        Some(r) => return Err(ApiError::param(&p, format!("`{p}.role` {r:?} is not one of user, assistant (the system prompt goes in `system`)"))),
        None => return Err(ApiError::param(&p, format!("`{p}.role` is required and must be a string"))),
    };
    let blocks = match get(o, "content") {
        None => return Err(ApiError::param(&p, format!("`{p}.content` is required"))),
        Some(Value::String(s)) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Some(Value::Array(b)) => b,
        Some(v) => {
            return Err(ApiError::param(
                &p,
                format!(
                    "`{p}.content` must be a string or an array of content blocks, got {}",
                    kind(v)
                ),
            ))
        }
    };
    let mut texts: Vec<String> = Vec::new();
    let mut thinking: Vec<String> = Vec::new();
    let mut calls: Vec<Value> = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let bp = format!("{p}.content[{j}]");
        let str_field = |k: &str| {
            b.get(k)
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::param(&p, format!("`{bp}` needs a string `{k}`")))
        };
        match (role, b.get("type").and_then(Value::as_str)) {
            (_, Some("text")) => texts.push(str_field("text")?.to_string()),
            ("assistant", Some("thinking")) => thinking.push(str_field("thinking")?.to_string()),
            ("assistant", Some("redacted_thinking")) => {}
            ("assistant", Some("tool_use")) => {
                let input = b
                    .get("input")
                    .filter(|v| !v.is_null())
                    .cloned()
                    .unwrap_or_else(|| json!({}));
                if !input.is_object() {
                    return Err(ApiError::param(
                        &p,
                        format!("`{bp}.input` must be an object"),
                    ));
                }
                calls.push(json!({"id": str_field("id")?, "type": "function", "function": {"name": str_field("name")?, "arguments": input}}));
            }
            ("user", Some("tool_result")) => {
                if !texts.is_empty() {
                    out.push(
                        json!({"role": "user", "content": std::mem::take(&mut texts).join("\n\n")}),
                    );
                }
                let mut content = match b.get("content").filter(|v| !v.is_null()) {
                    None => String::new(),
                    Some(c) => blocks_text(c, &format!("{bp}.content"))?,
                };
                if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                    content = format!("Error: {content}");
                }
                out.push(json!({"role": "tool", "tool_call_id": str_field("tool_use_id")?, "content": content}));
            }
            (_, Some(t @ ("image" | "document" | "search_result"))) => {
                return Err(ApiError::param(
                    &p,
                    format!("`{bp}` is a {t:?} block; this server runs the text model only"),
                ))
            }
            (_, Some(t)) => {
                return Err(ApiError::param(
                    &p,
                    format!("`{bp}` is a {t:?} block, which a {role} message cannot hold here"),
                ))
            }
            (_, None) => {
                return Err(ApiError::param(
                    &p,
                    format!("`{bp}` must be a content block with a `type`"),
                ))
            }
        }
    }
    if role == "assistant" {
        let mut msg = json!({"role": "assistant", "content": texts.join("\n\n")});
        if !thinking.is_empty() {
            msg["reasoning_content"] = json!(thinking.join("\n\n"));
        }
        if !calls.is_empty() {
            msg["tool_calls"] = Value::Array(calls);
        }
        out.push(msg);
    } else if !texts.is_empty()
        || !blocks
            .iter()
            .any(|b| b.get("type").and_then(Value::as_str) == Some("tool_result"))
    {
        out.push(json!({"role": "user", "content": texts.join("\n\n")}));
    }
    Ok(())
}

/// Anthropic body → the chat request the chat path runs.
pub fn messages_request(o: &Map<String, Value>) -> ApiResult<ChatRequest> {
    let mut req = api::chat_request(&chat_body(o)?)?;
    // Structured outputs: `output_config.format` = {"type": "json_schema", "schema": {…}}.
    let format = match get(o, "output_config") {
        None => None,
        Some(Value::Object(c)) => get(c, "format"),
        Some(v) => {
            return Err(ApiError::param(
                "output_config",
                format!("`output_config` must be an object, got {}", kind(v)),
            ))
        }
    };
    if let Some(f) = format {
        let s = api::flat_format("output_config", "output_config.format", f, false)?;
        api::set_structured(&mut req, s)?;
    }
    Ok(req)
}

fn reject(app: &App, e: ApiError) -> Response {
    app.metrics.finish(Outcome::Rejected);
    e.anthropic_response()
}

/// `POST /v1/messages`.
pub(crate) async fn messages(State(app): State<Arc<App>>, body: Body) -> Response {
    app.metrics
        .received
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let r = async {
        let bytes = routes::read_body(&app, body).await?;
        let req = messages_request(&api::body_object(&bytes)?)?;
        let a = app.clone();
        let (req, prep) =
            routes::blocking(move || routes::prepare_chat(&a, &req).map(|p| (req, p))).await?;
        let parse_tools = req.tools.is_some() && req.tool_choice != ToolChoice::None;
        let kind = Kind::Chat {
            tools: req.tools.clone(),
            parse_tools,
        };
        let (rx, guard, sh) =
            routes::submit(&app, &req.common, req.cache_key.clone(), prep, &kind)?;
        let m = Msg::new(&app, sh);
        Ok::<_, ApiError>(if req.common.stream {
            stream(app.clone(), rx, guard, m)
        } else {
            collect(app.clone(), rx, guard, m).await
        })
    }
    .await;
    r.unwrap_or_else(|e| reject(&app, e))
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as `/v1/messages` would render it.
pub(crate) async fn count_tokens(State(app): State<Arc<App>>, body: Body) -> Response {
    let r = async {
        let bytes = routes::read_body(&app, body).await?;
        let req = messages_request(&api::body_object(&bytes)?)?;
        let a = app.clone();
        let n = routes::blocking(move || routes::count_chat_tokens(&a, &req)).await?;
        Ok::<_, ApiError>(Json(json!({"input_tokens": n})).into_response())
    }
    .await;
    r.unwrap_or_else(|e| e.anthropic_response())
}

/// Which content block is open while streaming.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    None,
    Thinking,
    Text,
    Tool,
}

/// Shapes one request's parts into an Anthropic message.
struct Msg {
    sh: Shaper,
    id: String,
    model: String,
    open: Open,
    /// Index of the next block.
    blocks: usize,
    parts: Vec<Part>,
    started: bool,
}

impl Msg {
    fn new(app: &Arc<App>, sh: Shaper) -> Self {
        Self {
            sh,
            id: format!("msg_{}", app.new_id()),
            model: app.model_name.clone(),
            open: Open::None,
            blocks: 0,
            parts: Vec::new(),
            started: false,
        }
    }

    fn stop(&self, g: &Generation) -> (&'static str, Value) {
        match &g.finish {
            Some(FinishReason::Stop(StopKind::String(s))) => ("stop_sequence", json!(s)),
            Some(FinishReason::Stop(_)) | None if self.sh.called_tools() => {
                ("tool_use", Value::Null)
            }
            Some(FinishReason::Stop(_)) | None => ("end_turn", Value::Null),
            Some(FinishReason::Length | FinishReason::ContextFull) => ("max_tokens", Value::Null),
        }
    }

    fn usage(&self, output: usize) -> Value {
        json!({
            "input_tokens": self.sh.prompt_len - self.sh.cached.min(self.sh.prompt_len),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": self.sh.cached,
            "output_tokens": output,
        })
    }

    /// The whole message, from the collected parts.
    fn message(&mut self, g: &Generation) -> Value {
        let p = output::collect(std::mem::take(&mut self.parts));
        let mut content = Vec::new();
        if let Some(r) = p.reasoning {
            content.push(json!({"type": "thinking", "thinking": r, "signature": ""}));
        }
        if let Some(c) = p.content {
            content.push(json!({"type": "text", "text": c}));
        }
        for c in p.tool_calls {
            let input: Value = serde_json::from_str(&c.arguments).unwrap_or_else(|_| json!({}));
            content.push(json!({"type": "tool_use", "id": c.id, "name": c.name, "input": input}));
        }
        let (reason, seq) = self.stop(g);
        json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
            "stop_reason": reason, "stop_sequence": seq, "usage": self.usage(g.ids.len()),
        })
    }

    fn start_event(&mut self) -> Vec<(&'static str, Value)> {
        self.started = true;
        let msg = json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": null, "stop_sequence": null, "usage": self.usage(0),
        });
        vec![(
            "message_start",
            json!({"type": "message_start", "message": msg}),
        )]
    }

    fn close(&mut self, ev: &mut Vec<(&'static str, Value)>) {
        if self.open != Open::None {
            ev.push((
                "content_block_stop",
                json!({"type": "content_block_stop", "index": self.blocks - 1}),
            ));
            self.open = Open::None;
        }
    }

    fn begin(&mut self, open: Open, block: Value, ev: &mut Vec<(&'static str, Value)>) {
        self.close(ev);
        ev.push((
            "content_block_start",
            json!({"type": "content_block_start", "index": self.blocks, "content_block": block}),
        ));
        self.blocks += 1;
        self.open = open;
    }

    /// Stream events for parts.
    fn events(&mut self, parts: Vec<Part>) -> Vec<(&'static str, Value)> {
        let mut ev = Vec::new();
        for p in parts {
            let delta = match p {
                Part::Reasoning(s) => {
                    if self.open != Open::Thinking {
                        self.begin(
                            Open::Thinking,
                            json!({"type": "thinking", "thinking": "", "signature": ""}),
                            &mut ev,
                        );
                    }
                    json!({"type": "thinking_delta", "thinking": s})
                }
                Part::Content(s) => {
                    if self.open != Open::Text {
                        self.begin(Open::Text, json!({"type": "text", "text": ""}), &mut ev);
                    }
                    json!({"type": "text_delta", "text": s})
                }
                Part::ToolCallStart { id, name, .. } => {
                    self.begin(
                        Open::Tool,
                        json!({"type": "tool_use", "id": id, "name": name, "input": {}}),
                        &mut ev,
                    );
                    continue;
                }
                // The parser sends a call's arguments right after its start, before anything else.
                Part::ToolCallArgs { .. } if self.open != Open::Tool => continue,
                Part::ToolCallArgs { args, .. } => {
                    json!({"type": "input_json_delta", "partial_json": args})
                }
            };
            ev.push((
                "content_block_delta",
                json!({"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}),
            ));
        }
        ev
    }

    fn end_events(&mut self, g: &Generation) -> Vec<(&'static str, Value)> {
        let tail = self.sh.final_parts();
        let mut ev = self.events(tail);
        self.close(&mut ev);
        let (reason, seq) = self.stop(g);
        ev.push(("message_delta", json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": self.usage(g.ids.len())})));
        ev.push(("message_stop", json!({"type": "message_stop"})));
        ev
    }
}

async fn collect(
    app: Arc<App>,
    mut rx: UnboundedReceiver<Event>,
    guard: CancelOnDrop,
    mut m: Msg,
) -> Response {
    let _guard = guard;
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Started { cached } => m.sh.cached = cached,
            Event::Token { id, text, logprob } => {
                let parts = m.sh.token(id, &text, logprob);
                m.parts.extend(parts);
            }
            Event::Done(g) => {
                if let Some(e) = routes::ended_early(&app, &g) {
                    return e.anthropic_response();
                }
                let tail = m.sh.final_parts();
                m.parts.extend(tail);
                return Json(m.message(&g)).into_response();
            }
            Event::Failed(msg) => return ApiError::internal(msg).anthropic_response(),
        }
    }
    ApiError::internal("the model thread stopped before answering").anthropic_response()
}

fn sse((name, v): (&'static str, Value)) -> Result<Sse, Infallible> {
    Ok(Sse::default().event(name).data(v.to_string()))
}

fn error_event(e: ApiError) -> Vec<Result<Sse, Infallible>> {
    vec![sse(("error", e.anthropic_body()))]
}

struct StreamState {
    app: Arc<App>,
    rx: UnboundedReceiver<Event>,
    m: Msg,
    _guard: CancelOnDrop,
    done: bool,
}

impl StreamState {
    async fn next(&mut self) -> Option<Vec<Result<Sse, Infallible>>> {
        if self.done {
            return None;
        }
        let Some(ev) = self.rx.recv().await else {
            self.done = true;
            return Some(error_event(ApiError::internal(
                "the model thread stopped before answering",
            )));
        };
        let m = &mut self.m;
        let out = match ev {
            Event::Started { cached } => {
                m.sh.cached = cached;
                m.start_event()
            }
            Event::Token { id, text, logprob } => {
                let parts = m.sh.token(id, &text, logprob);
                m.events(parts)
            }
            Event::Done(g) => {
                self.done = true;
                if let Some(e) = routes::ended_early(&self.app, &g) {
                    return Some(error_event(e));
                }
                let mut ev = if m.started {
                    Vec::new()
                } else {
                    m.start_event()
                };
                ev.extend(m.end_events(&g));
                ev
            }
            Event::Failed(msg) => {
                self.done = true;
                return Some(error_event(ApiError::internal(msg)));
            }
        };
        Some(out.into_iter().map(sse).collect())
    }
}

fn stream(app: Arc<App>, rx: UnboundedReceiver<Event>, guard: CancelOnDrop, m: Msg) -> Response {
    let st = StreamState {
        app,
        rx,
        m,
        _guard: guard,
        done: false,
    };
    let body = stream::unfold(st, |mut st| async move {
        st.next().await.map(|evs| (stream::iter(evs), st))
    })
    .flatten();
    let body: std::pin::Pin<Box<dyn Stream<Item = Result<Sse, Infallible>> + Send>> =
        Box::pin(body);
    axum::response::Sse::new(body)
        .keep_alive(
            KeepAlive::new()
                .interval(Duration::from_secs(5))
                .text("keep-alive"),
        )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Value) -> ApiResult<Map<String, Value>> {
        chat_body(v.as_object().unwrap())
    }

    #[test]
    fn translates_a_tool_conversation() {
        let b = body(json!({
            "model": "m", "max_tokens": 100, "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}}],
            "stop_sequences": ["END"], "top_k": 5, "metadata": {"user_id": "u"}, "thinking": {"type": "enabled", "budget_tokens": 1024},
            "tools": [{"name": "get_weather", "description": "w", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
            "tool_choice": {"type": "any"},
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "x"}, {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]}, {"type": "text", "text": "thanks"}]},
            ]
        }))
        .unwrap();
        assert_eq!(b["stop"], json!(["END"]));
        assert_eq!(b["top_k"], 5);
        assert_eq!(b["tool_choice"], "required");
        assert_eq!(b["chat_template_kwargs"]["enable_thinking"], true);
        assert_eq!(
            b["tools"][0]["function"]["parameters"]["properties"]["city"]["type"],
            "string"
        );
        let m = b["messages"].as_array().unwrap();
        assert_eq!(m[0], json!({"role": "system", "content": "a\n\nb"}));
        assert_eq!(m[2]["reasoning_content"], "hmm");
        assert_eq!(
            m[2]["tool_calls"][0]["function"]["arguments"],
            json!({"city": "Paris"})
        );
        assert_eq!(
            m[3],
            json!({"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"})
        );
        assert_eq!(m[4], json!({"role": "user", "content": "thanks"}));
        let r = api::chat_request(&b).unwrap();
        assert_eq!(r.tool_choice, ToolChoice::Required);
        assert_eq!(r.common.stop, vec!["END"]);
    }

    #[test]
    fn choices_and_refusals() {
        let base = json!({"max_tokens": 10, "messages": [{"role": "user", "content": "x"}]});
        let with = |k: &str, v: Value| {
            let mut b = base.clone();
            b[k] = v;
            messages_request(b.as_object().unwrap())
        };
        assert_eq!(
            with("thinking", json!(null)).unwrap().template_kwargs["enable_thinking"],
            false
        );
        assert_eq!(
            with("thinking", json!({"type": "disabled"}))
                .unwrap()
                .template_kwargs["enable_thinking"],
            false
        );
        assert!(with("thinking", json!({"type": "sometimes"})).is_err());
        assert_eq!(
            with("tool_choice", json!({"type": "none"}))
                .unwrap()
                .tool_choice,
            ToolChoice::None
        );
        assert!(with("tool_choice", json!({"type": "tool"})).is_err());
        assert!(with(
            "tools",
            json!([{"type": "web_search_20250305", "name": "web_search"}])
        )
        .is_err());
        assert!(with("stop_sequences", json!("END")).is_err());
        assert!(with("messages", json!([{"role": "system", "content": "x"}])).is_err());
        assert!(with(
            "messages",
            json!([{"role": "user", "content": [{"type": "image", "source": {}}]}])
        )
        .is_err());
        assert!(with("messages", json!([{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}])).is_err());
        assert!(with("messages", json!([])).is_err());
        assert!(with("temperature", json!("hot")).is_err());
        assert!(with(
            "output_config",
            json!({"format": {"type": "json_schema", "schema": {}}})
        )
        .is_ok());
        assert!(with("output_config", json!({"format": {"type": "json_schema"}})).is_err());
        assert!(with("output_config", json!({"format": {"type": "xml"}})).is_err());
        assert!(with("output_config", json!({"effort": "low"})).is_ok());
        // A tool result marked as an error says so.
        let b = body(json!({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "boom", "is_error": true}]}]})).unwrap();
        assert_eq!(
            b["messages"][2],
            json!({"role": "tool", "tool_call_id": "t", "content": "Error: boom"})
        );
        assert_eq!(b["messages"].as_array().unwrap().len(), 3);
    }

    #[test]
    fn error_shapes() {
        let e = ApiError::param("x", "bad x");
        assert_eq!(
            e.anthropic_body(),
            json!({"type": "error", "error": {"type": "invalid_request_error", "message": "bad x"}})
        );
        assert_eq!(
            ApiError::unauthorized().anthropic_type(),
            "authentication_error"
        );
        assert_eq!(
            ApiError::unavailable("busy", 1).anthropic_type(),
            "overloaded_error"
        );
        assert_eq!(ApiError::internal("x").anthropic_type(), "api_error");
    }
}
