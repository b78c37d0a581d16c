//! OpenAI's Responses API (`POST /v1/responses`) as a thin translation onto the chat path: the
//! body becomes a chat request (parsed, rendered, tokenized and queued exactly like
//! `/v1/chat/completions`: same template, prefix cache, generation loop and output parser), and
//! the parser's parts become output items and typed stream events.
//!
//! Request → chat request:
//! - `instructions` → the system message; `input` a string (one user message) or items:
//!   messages (`role` user / assistant / system / developer; a string or `input_text` /
//!   `output_text` parts), `function_call` (an assistant tool call; consecutive ones join one
//!   assistant message), `function_call_output` (a `tool` message), `reasoning` (the next
//!   assistant message's reasoning). Other item types are refused.
//! - `previous_response_id`: the stored conversation of that response (its input and output;
//!   not its `instructions`, as OpenAI does) goes before `input`. Responses are stored unless
//!   `store: false`, in a bounded in-memory store of the most recent ones ([`Store`]); the
//!   prompt then starts with the same tokens as the earlier one, so the prefix cache reuses it.
//! - function `tools` (`name`, `description`, `parameters`) and `tool_choice`; other tool types
//!   are refused. `max_output_tokens` → `max_tokens`; `temperature`, `top_p`, `prompt_cache_key`
//!   as they are; `reasoning.effort` none / minimal → thinking off, others on (absent: the
//!   model's default, on); `text.format` json_schema / json_object constrains the answer
//!   (structured outputs). `parallel_tool_calls`, `metadata`, `user`, `truncation`, `include`, … are ignored.
//!
//! Output items, in generation order: `reasoning` (`content: [reasoning_text]`, empty
//! `summary`), `message` (`output_text`), `function_call` (`call_id`, `name`, `arguments`).
//! `usage` has `input_tokens_details.cached_tokens` and `output_tokens_details.reasoning_tokens`.
//! A generation cut by `max_output_tokens` is `status: "incomplete"` with
//! `incomplete_details.reason: "max_output_tokens"`. Streaming sends `response.created`,
//! `response.in_progress`, then per item `response.output_item.added`, its content events
//! (`response.content_part.added`, `response.output_text.delta` / `response.reasoning_text.delta`
//! / `response.function_call_arguments.delta`, the matching `.done` events,
//! `response.content_part.done`), `response.output_item.done`, and last `response.completed` (or
//! `response.incomplete`); every event carries a `sequence_number`. An error after the stream
//! began is an `error` event.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
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
use lily::runtime::stop::FinishReason;

use crate::api::{self, get, kind, ChatRequest, ToolChoice};
use crate::error::{ApiError, ApiResult};
use crate::output::Part;
use crate::routes::{self, CancelOnDrop, Kind, Shaper};
use crate::worker::Event;
use crate::App;

/// Responses kept for `previous_response_id`, most recent last.
pub const STORE_CAPACITY: usize = 512;

/// The bounded in-memory store: response id → its conversation as chat messages (input and
/// output, without the instructions). The oldest is dropped when full.
#[derive(Default)]
pub struct Store {
    inner: Mutex<Stored>,
}

/// The conversations by id, and the ids oldest first.
type Stored = (HashMap<String, Arc<Vec<Value>>>, VecDeque<String>);

impl Store {
    pub fn get(&self, id: &str) -> Option<Arc<Vec<Value>>> {
        self.inner.lock().ok()?.0.get(id).cloned()
    }

    pub fn put(&self, id: String, conversation: Vec<Value>) {
        let Ok(mut g) = self.inner.lock() else { return };
        let (map, order) = &mut *g;
        while order.len() >= STORE_CAPACITY {
            if let Some(old) = order.pop_front() {
                map.remove(&old);
            }
        }
        order.push_back(id.clone());
        map.insert(id, Arc::new(conversation));
    }
}

/// What the response echoes and what storing it needs, besides the chat request.
pub struct Meta {
    /// The conversation before the output (stored history + this input), for the store.
    pub history: Vec<Value>,
    pub store: bool,
    /// Request fields the response object repeats.
    pub echo: Map<String, Value>,
}

/// The Responses body as the body of a chat request, with what the response needs.
/// `previous` looks up a stored conversation.
pub fn chat_body(
    o: &Map<String, Value>,
    previous: &dyn Fn(&str) -> Option<Arc<Vec<Value>>>,
) -> ApiResult<(Map<String, Value>, Meta)> {
    let mut out = Map::new();
    for k in [
        "model",
        "temperature",
        "top_p",
        "stream",
        "prompt_cache_key",
    ] {
        if let Some(v) = get(o, k) {
            out.insert(k.into(), v.clone());
        }
    }
    if let Some(v) = get(o, "max_output_tokens") {
        out.insert("max_tokens".into(), v.clone());
    }
    if get(o, "conversation").is_some() {
        return Err(ApiError::param(
            "conversation",
            "`conversation` objects are not supported; chain responses with `previous_response_id`",
        ));
    }
    let mut history: Vec<Value> = Vec::new();
    let prev_id = match get(o, "previous_response_id") {
        None => None,
        Some(Value::String(id)) => {
            let conv = previous(id).ok_or_else(|| {
                ApiError::param("previous_response_id", format!("Previous response with id '{id}' not found (responses are kept in memory: the {STORE_CAPACITY} most recent with `store` on)"))
                    .with_code("previous_response_not_found")
            })?;
            history.extend(conv.iter().cloned());
            Some(id.clone())
        }
        Some(v) => {
            return Err(ApiError::param(
                "previous_response_id",
                format!("`previous_response_id` must be a string, got {}", kind(v)),
            ))
        }
    };
    match get(o, "input") {
        None => return Err(ApiError::param("input", "`input` is required")),
        Some(Value::String(s)) => history.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => input_items(items, &mut history)?,
        Some(v) => {
            return Err(ApiError::param(
                "input",
                format!(
                    "`input` must be a string or an array of items, got {}",
                    kind(v)
                ),
            ))
        }
    }
    let mut msgs = Vec::new();
    let instructions = match get(o, "instructions") {
        None => None,
        Some(Value::String(s)) => {
            msgs.push(json!({"role": "system", "content": s}));
            Some(s.clone())
        }
        Some(v) => {
            return Err(ApiError::param(
                "instructions",
                format!("`instructions` must be a string, got {}", kind(v)),
            ))
        }
    };
    msgs.extend(history.iter().cloned());
    if msgs.is_empty() {
        return Err(ApiError::param("input", "`input` must not be empty"));
    }
    out.insert("messages".into(), Value::Array(msgs));
    let mut tools_echo = Vec::new();
    if let Some(tools) = get(o, "tools") {
        let fns = api::flat_tools(tools, |p, t| {
            match t.get("type").and_then(Value::as_str) {
                Some("function") => {}
                Some(x) => {
                    return Err(ApiError::param(
                        p,
                        format!("`{p}.type` {x:?} is not supported (only \"function\" tools)"),
                    ))
                }
                None => {
                    return Err(ApiError::param(
                        p,
                        format!("`{p}.type` is required (\"function\")"),
                    ))
                }
            }
            tools_echo.push(t.clone());
            Ok(t.get("parameters").filter(|v| !v.is_null()).cloned())
        })?;
        out.insert("tools".into(), Value::Array(fns));
    }
    if let Some(tc) = get(o, "tool_choice") {
        // Strings and `{"type": "function", "name": …}` read the same as in chat.
        out.insert("tool_choice".into(), tc.clone());
    }
    let effort = match get(o, "reasoning") {
        None => None,
        Some(Value::Object(r)) => match get(r, "effort") {
            None => None,
            Some(Value::String(e))
                if ["none", "minimal", "low", "medium", "high", "xhigh"].contains(&e.as_str()) =>
            {
                Some(e.clone())
            }
            Some(_) => {
                return Err(ApiError::param(
                    "reasoning",
                    "`reasoning.effort` must be one of none, minimal, low, medium, high, xhigh",
                ))
            }
        },
        Some(v) => {
            return Err(ApiError::param(
                "reasoning",
                format!("`reasoning` must be an object, got {}", kind(v)),
            ))
        }
    };
    if let Some(e) = &effort {
        out.insert(
            "chat_template_kwargs".into(),
            json!({"enable_thinking": !matches!(e.as_str(), "none" | "minimal")}),
        );
    }
    let store = match get(o, "store") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(ApiError::param(
                "store",
                format!("`store` must be true or false, got {}", kind(v)),
            ))
        }
    };
    let mut echo = Map::new();
    echo.insert("instructions".into(), json!(instructions));
    echo.insert("tools".into(), Value::Array(tools_echo));
    echo.insert(
        "tool_choice".into(),
        get(o, "tool_choice")
            .cloned()
            .unwrap_or_else(|| json!("auto")),
    );
    echo.insert(
        "parallel_tool_calls".into(),
        json!(get(o, "parallel_tool_calls")
            .and_then(Value::as_bool)
            .unwrap_or(true)),
    );
    echo.insert(
        "temperature".into(),
        get(o, "temperature").cloned().unwrap_or(Value::Null),
    );
    echo.insert(
        "top_p".into(),
        get(o, "top_p").cloned().unwrap_or(Value::Null),
    );
    echo.insert(
        "max_output_tokens".into(),
        get(o, "max_output_tokens").cloned().unwrap_or(Value::Null),
    );
    echo.insert("previous_response_id".into(), json!(prev_id));
    echo.insert(
        "reasoning".into(),
        json!({"effort": effort, "summary": null}),
    );
    echo.insert("store".into(), json!(store));
    echo.insert("text".into(), json!({"format": {"type": "text"}}));
    echo.insert("truncation".into(), json!("disabled"));
    echo.insert(
        "metadata".into(),
        get(o, "metadata").cloned().unwrap_or_else(|| json!({})),
    );
    echo.insert(
        "user".into(),
        get(o, "user").cloned().unwrap_or(Value::Null),
    );
    Ok((
        out,
        Meta {
            history,
            store,
            echo,
        },
    ))
}

/// Input items → chat messages, appended to `out`.
fn input_items(items: &[Value], out: &mut Vec<Value>) -> ApiResult<()> {
    // Reasoning waiting for the assistant message (or tool call) that follows it.
    let mut reasoning: Option<String> = None;
    // Whether the last message in `out` is an assistant message this input built, which a
    // following `function_call` joins.
    let mut open_assistant = false;
    for (i, it) in items.iter().enumerate() {
        let p = format!("input[{i}]");
        let Value::Object(o) = it else {
            return Err(ApiError::param(
                &p,
                format!("`{p}` must be an object, got {}", kind(it)),
            ));
        };
        let str_field = |k: &str| {
            o.get(k).and_then(Value::as_str).ok_or_else(|| {
                ApiError::param(&p, format!("`{p}.{k}` is required and must be a string"))
            })
        };
        let ty = o.get("type").and_then(Value::as_str).unwrap_or("message");
        match ty {
            "message" => {
                let mut m = Map::new();
                let role = str_field("role")?;
                m.insert("role".into(), json!(role));
                m.insert("content".into(), o.get("content").cloned().unwrap_or(Value::Null));
                if role == "assistant" {
                    if let Some(r) = reasoning.take() {
                        m.insert("reasoning_content".into(), json!(r));
                    }
                }
                out.push(Value::Object(m));
                open_assistant = role == "assistant";
            }
            "function_call" => {
                let args = match o.get("arguments") {
                    Some(Value::String(s)) => s.clone(),
                    _ => return Err(ApiError::param(&p, format!("`{p}.arguments` is required and must be a JSON string"))),
                };
                let call = json!({"id": str_field("call_id")?, "type": "function", "function": {"name": str_field("name")?, "arguments": args}});
                let joins = open_assistant && out.last().is_some_and(|m| m["role"] == "assistant");
                if joins {
                    let last = out.last_mut().expect("checked");
                    match last.get_mut("tool_calls").and_then(Value::as_array_mut) {
                        Some(calls) => calls.push(call),
                        None => last["tool_calls"] = json!([call]),
                    }
                } else {
                    let mut m = json!({"role": "assistant", "content": null, "tool_calls": [call]});
                    if let Some(r) = reasoning.take() {
                        m["reasoning_content"] = json!(r);
                    }
                    out.push(m);
                    open_assistant = true;
                }
            }
            "function_call_output" => {
                let output = match o.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => parts.iter().filter_map(|x| x.get("text").and_then(Value::as_str)).collect::<Vec<_>>().join(""),
                    _ => return Err(ApiError::param(&p, format!("`{p}.output` is required and must be a string"))),
                };
                out.push(json!({"role": "tool", "tool_call_id": str_field("call_id")?, "content": output}));
                open_assistant = false;
            }
            "reasoning" => {
                let texts = |k: &str| -> Vec<String> {
                    o.get(k).and_then(Value::as_array).map(|a| a.iter().filter_map(|x| x.get("text").and_then(Value::as_str).map(str::to_string)).collect()).unwrap_or_default()
                };
                let mut t = texts("content");
                if t.is_empty() {
                    t = texts("summary");
                }
                // Only `encrypted_content` (Codex sends it back): nothing this model can read.
                reasoning = Some(t.join("\n\n")).filter(|r| !r.is_empty());
                open_assistant = false;
            }
            t => return Err(ApiError::param(&p, format!("`{p}.type` {t:?} is not supported (message, function_call, function_call_output, reasoning)"))),
        }
    }
    Ok(())
}

/// Which item is open while building the output.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    None,
    Reasoning,
    Message,
    Call,
}

/// Builds the output items from the parser's parts, and the stream events that describe them.
struct Output {
    app: Arc<App>,
    id: String,
    created: u64,
    echo: Map<String, Value>,
    sh: Shaper,
    items: Vec<Value>,
    open: Open,
    /// Text of the open item (its content or arguments).
    text: String,
    seq: u64,
    events: Vec<Value>,
    streaming: bool,
}

impl Output {
    fn new(app: &Arc<App>, sh: Shaper, echo: Map<String, Value>, streaming: bool) -> Self {
        Self {
            app: app.clone(),
            id: format!("resp_{}", app.new_id()),
            created: routes::now(),
            echo,
            sh,
            items: Vec::new(),
            open: Open::None,
            text: String::new(),
            seq: 0,
            events: Vec::new(),
            streaming,
        }
    }

    fn emit(&mut self, mut ev: Value) {
        if self.streaming {
            ev["sequence_number"] = json!(self.seq);
            self.seq += 1;
            self.events.push(ev);
        }
    }

    fn index(&self) -> usize {
        self.items.len() - 1
    }

    fn item_id(&self) -> Value {
        self.items
            .last()
            .map(|i| i["id"].clone())
            .unwrap_or(Value::Null)
    }

    fn begin(&mut self, open: Open, item: Value) {
        self.close("completed");
        self.items.push(item.clone());
        self.open = open;
        self.text.clear();
        let (oi, id) = (self.index(), self.item_id());
        self.emit(json!({"type": "response.output_item.added", "output_index": oi, "item": item}));
        match open {
            Open::Message => self.emit(json!({"type": "response.content_part.added", "item_id": id, "output_index": oi, "content_index": 0, "part": text_part("")})),
            Open::Reasoning => self.emit(json!({"type": "response.content_part.added", "item_id": id, "output_index": oi, "content_index": 0, "part": {"type": "reasoning_text", "text": ""}})),
            _ => {}
        }
    }

    fn close(&mut self, status: &str) {
        if self.open == Open::None {
            return;
        }
        let (oi, id) = (self.index(), self.item_id());
        let text = std::mem::take(&mut self.text);
        let open = std::mem::replace(&mut self.open, Open::None);
        let item = self.items.last_mut().expect("an open item");
        item["status"] = json!(status);
        match open {
            Open::Message => {
                item["content"] = json!([text_part(&text)]);
                let item = item.clone();
                self.emit(json!({"type": "response.output_text.done", "item_id": id, "output_index": oi, "content_index": 0, "text": text, "logprobs": []}));
                self.emit(json!({"type": "response.content_part.done", "item_id": id, "output_index": oi, "content_index": 0, "part": text_part(&text)}));
                self.emit(
                    json!({"type": "response.output_item.done", "output_index": oi, "item": item}),
                );
            }
            Open::Reasoning => {
                let part = json!({"type": "reasoning_text", "text": text});
                item["content"] = json!([part]);
                let item = item.clone();
                self.emit(json!({"type": "response.reasoning_text.done", "item_id": id, "output_index": oi, "content_index": 0, "text": text}));
                self.emit(json!({"type": "response.content_part.done", "item_id": id, "output_index": oi, "content_index": 0, "part": part}));
                self.emit(
                    json!({"type": "response.output_item.done", "output_index": oi, "item": item}),
                );
            }
            Open::Call => {
                item["arguments"] = json!(text);
                let item = item.clone();
                self.emit(json!({"type": "response.function_call_arguments.done", "item_id": id, "output_index": oi, "name": item["name"], "arguments": text}));
                self.emit(
                    json!({"type": "response.output_item.done", "output_index": oi, "item": item}),
                );
            }
            Open::None => {}
        }
    }

    fn parts(&mut self, parts: Vec<Part>) {
        for p in parts {
            match p {
                Part::Reasoning(s) => {
                    if self.open != Open::Reasoning {
                        let id = format!("rs_{}", self.app.new_id());
                        self.begin(Open::Reasoning, json!({"id": id, "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}));
                    }
                    self.text.push_str(&s);
                    let (oi, id) = (self.index(), self.item_id());
                    self.emit(json!({"type": "response.reasoning_text.delta", "item_id": id, "output_index": oi, "content_index": 0, "delta": s}));
                }
                Part::Content(s) => {
                    if self.open != Open::Message {
                        let id = format!("msg_{}", self.app.new_id());
                        self.begin(Open::Message, json!({"id": id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}));
                    }
                    self.text.push_str(&s);
                    let (oi, id) = (self.index(), self.item_id());
                    self.emit(json!({"type": "response.output_text.delta", "item_id": id, "output_index": oi, "content_index": 0, "delta": s, "logprobs": []}));
                }
                Part::ToolCallStart { id, name, .. } => {
                    let item_id = format!("fc_{}", self.app.new_id());
                    self.begin(Open::Call, json!({"id": item_id, "type": "function_call", "call_id": id, "name": name, "arguments": "", "status": "in_progress"}));
                }
                // The parser sends a call's arguments right after its start, before anything else.
                Part::ToolCallArgs { .. } if self.open != Open::Call => {}
                Part::ToolCallArgs { args, .. } => {
                    self.text.push_str(&args);
                    let (oi, id) = (self.index(), self.item_id());
                    self.emit(json!({"type": "response.function_call_arguments.delta", "item_id": id, "output_index": oi, "delta": args}));
                }
            }
        }
    }

    /// The response object; `g` is the finished generation (`None`: still in progress).
    fn response(&self, g: Option<&Generation>) -> Value {
        let mut r = json!({
            "id": self.id, "object": "response", "created_at": self.created, "model": self.app.model_name,
            "status": "in_progress", "error": null, "incomplete_details": null, "output": [], "usage": null,
        });
        if let Some(g) = g {
            let cut = matches!(
                g.finish,
                Some(FinishReason::Length | FinishReason::ContextFull)
            );
            r["status"] = json!(if cut { "incomplete" } else { "completed" });
            if cut {
                r["incomplete_details"] = json!({"reason": "max_output_tokens"});
            }
            r["output"] = Value::Array(self.items.clone());
            let (p, n) = (self.sh.prompt_len, g.ids.len());
            r["usage"] = json!({
                "input_tokens": p, "input_tokens_details": {"cached_tokens": self.sh.cached, "cache_write_tokens": 0},
                "output_tokens": n, "output_tokens_details": {"reasoning_tokens": self.sh.reasoning_tokens}, "total_tokens": p + n,
            });
        }
        for (k, v) in &self.echo {
            r[k] = v.clone();
        }
        r
    }

    /// Ends the output; returns the final response object.
    fn finish(&mut self, g: &Generation) -> Value {
        let tail = self.sh.final_parts();
        self.parts(tail);
        let cut = matches!(
            g.finish,
            Some(FinishReason::Length | FinishReason::ContextFull)
        );
        self.close(if cut { "incomplete" } else { "completed" });
        let r = self.response(Some(g));
        let ty = if cut {
            "response.incomplete"
        } else {
            "response.completed"
        };
        self.emit(json!({"type": ty, "response": r}));
        r
    }

    /// The output as one assistant chat message (for the store).
    fn as_chat(&self) -> Option<Value> {
        let (mut content, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
        for it in &self.items {
            match it["type"].as_str() {
                Some("reasoning") => reasoning.push_str(it["content"][0]["text"].as_str().unwrap_or_default()),
                Some("message") => content.push_str(it["content"][0]["text"].as_str().unwrap_or_default()),
                Some("function_call") => calls.push(json!({"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}})),
                _ => {}
            }
        }
        if self.items.is_empty() {
            return None;
        }
        let mut m = json!({"role": "assistant", "content": content});
        if !reasoning.is_empty() {
            m["reasoning_content"] = json!(reasoning);
        }
        // Arguments of a call cut short may not be JSON: such a call is not stored.
        calls.retain(|c| {
            c["function"]["arguments"]
                .as_str()
                .is_some_and(|a| serde_json::from_str::<Map<String, Value>>(a).is_ok())
        });
        if !calls.is_empty() {
            m["tool_calls"] = Value::Array(calls);
        }
        Some(m)
    }
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

/// The chat request and its Responses metadata.
pub fn responses_request(
    o: &Map<String, Value>,
    previous: &dyn Fn(&str) -> Option<Arc<Vec<Value>>>,
) -> ApiResult<(ChatRequest, Meta)> {
    let (body, meta) = chat_body(o, previous)?;
    let mut req = api::chat_request(&body)?;
    // Structured outputs: `text.format` = {"type": "json_schema", "name", "schema", "strict"}
    // or {"type": "json_object"}.
    if let Some(fmt) = get(o, "text")
        .and_then(|t| t.get("format"))
        .filter(|f| !f.is_null())
    {
        let s = api::flat_format("text", "text.format", fmt, true)?;
        api::set_structured(&mut req, s)?;
    }
    Ok((req, meta))
}

/// `POST /v1/responses`.
pub(crate) async fn create(State(app): State<Arc<App>>, body: Body) -> Response {
    app.metrics
        .received
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let r = async {
        let bytes = routes::read_body(&app, body).await?;
        let (req, meta) =
            responses_request(&api::body_object(&bytes)?, &|id| app.responses.get(id))?;
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
        let out = Output::new(&app, sh, meta.echo.clone(), req.common.stream);
        let keep = meta.store.then_some(meta.history);
        Ok::<_, ApiError>(if req.common.stream {
            stream(app.clone(), rx, guard, out, keep)
        } else {
            collect(app.clone(), rx, guard, out, keep).await
        })
    }
    .await;
    r.unwrap_or_else(|e| routes::reject(&app, e))
}

fn remember(app: &App, out: &Output, keep: Option<Vec<Value>>) {
    if let Some(mut history) = keep {
        history.extend(out.as_chat());
        app.responses.put(out.id.clone(), history);
    }
}

async fn collect(
    app: Arc<App>,
    mut rx: UnboundedReceiver<Event>,
    guard: CancelOnDrop,
    mut out: Output,
    keep: Option<Vec<Value>>,
) -> Response {
    let _guard = guard;
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Started { cached } => out.sh.cached = cached,
            Event::Token { id, text, logprob } => {
                let parts = out.sh.token(id, &text, logprob);
                out.parts(parts);
            }
            Event::Done(g) => {
                if let Some(e) = routes::ended_early(&app, &g) {
                    return e.into_response();
                }
                let r = out.finish(&g);
                remember(&app, &out, keep);
                return Json(r).into_response();
            }
            Event::Failed(msg) => return ApiError::internal(msg).into_response(),
        }
    }
    ApiError::internal("the model thread stopped before answering").into_response()
}

fn sse(v: Value) -> Result<Sse, Infallible> {
    let name = v["type"].as_str().unwrap_or("message").to_string();
    Ok(Sse::default().event(name).data(v.to_string()))
}

struct StreamState {
    app: Arc<App>,
    rx: UnboundedReceiver<Event>,
    out: Output,
    keep: Option<Vec<Value>>,
    _guard: CancelOnDrop,
    done: bool,
}

impl StreamState {
    fn error(&mut self, e: ApiError) -> Vec<Result<Sse, Infallible>> {
        let ev = json!({"type": "error", "code": e.code, "message": e.message, "param": e.param, "sequence_number": self.out.seq});
        vec![sse(ev)]
    }

    async fn next(&mut self) -> Option<Vec<Result<Sse, Infallible>>> {
        if self.done {
            return None;
        }
        let Some(ev) = self.rx.recv().await else {
            self.done = true;
            return Some(self.error(ApiError::internal(
                "the model thread stopped before answering",
            )));
        };
        match ev {
            Event::Started { cached } => self.out.sh.cached = cached,
            Event::Token { id, text, logprob } => {
                let parts = self.out.sh.token(id, &text, logprob);
                self.out.parts(parts);
            }
            Event::Done(g) => {
                self.done = true;
                if let Some(e) = routes::ended_early(&self.app, &g) {
                    return Some(self.error(e));
                }
                self.out.finish(&g);
                remember(&self.app, &self.out, self.keep.take());
            }
            Event::Failed(msg) => {
                self.done = true;
                return Some(self.error(ApiError::internal(msg)));
            }
        }
        Some(
            std::mem::take(&mut self.out.events)
                .into_iter()
                .map(sse)
                .collect(),
        )
    }
}

fn stream(
    app: Arc<App>,
    rx: UnboundedReceiver<Event>,
    guard: CancelOnDrop,
    mut out: Output,
    keep: Option<Vec<Value>>,
) -> Response {
    // `response.created` and `response.in_progress` go first, before the job leaves the queue.
    let r = out.response(None);
    out.emit(json!({"type": "response.created", "response": r}));
    out.emit(json!({"type": "response.in_progress", "response": r}));
    let first: Vec<_> = std::mem::take(&mut out.events)
        .into_iter()
        .map(sse)
        .collect();
    let st = StreamState {
        app,
        rx,
        out,
        keep,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn none(_: &str) -> Option<Arc<Vec<Value>>> {
        None
    }

    fn body(v: Value) -> ApiResult<(Map<String, Value>, Meta)> {
        chat_body(v.as_object().unwrap(), &none)
    }

    #[test]
    fn translates_items() {
        let (b, meta) = body(json!({
            "model": "m", "instructions": "be brief", "max_output_tokens": 50, "reasoning": {"effort": "none"}, "store": false,
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": true}],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
                {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{\"city\":\"Rome\"}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "function_call_output", "call_id": "c2", "output": "rain"},
            ]
        }))
        .unwrap();
        assert!(!meta.store);
        assert_eq!(b["max_tokens"], 50);
        assert_eq!(b["chat_template_kwargs"]["enable_thinking"], false);
        let m = b["messages"].as_array().unwrap();
        assert_eq!(m[0], json!({"role": "system", "content": "be brief"}));
        assert_eq!(m[2]["reasoning_content"], "hmm");
        assert_eq!(m[2]["tool_calls"].as_array().unwrap().len(), 2);
        assert_eq!(
            m[3],
            json!({"role": "tool", "tool_call_id": "c1", "content": "sunny"})
        );
        assert_eq!(meta.history.len(), 4, "the history has no instructions");
        let r = api::chat_request(&b).unwrap();
        assert_eq!(r.tool_choice, ToolChoice::Named("get_weather".into()));
    }

    #[test]
    fn previous_response_and_refusals() {
        let prev = |id: &str| {
            (id == "resp_a").then(|| {
                Arc::new(vec![
                    json!({"role": "user", "content": "q1"}),
                    json!({"role": "assistant", "content": "a1"}),
                ])
            })
        };
        let (b, meta) = chat_body(
            json!({"previous_response_id": "resp_a", "input": "q2"})
                .as_object()
                .unwrap(),
            &prev,
        )
        .unwrap();
        assert_eq!(b["messages"].as_array().unwrap().len(), 3);
        assert_eq!(meta.history.len(), 3);
        assert!(meta.store);
        let e = chat_body(
            json!({"previous_response_id": "resp_b", "input": "q2"})
                .as_object()
                .unwrap(),
            &prev,
        )
        .err()
        .unwrap();
        assert_eq!(e.code.as_deref(), Some("previous_response_not_found"));
        assert!(body(json!({"input": "x", "tools": [{"type": "web_search"}]})).is_err());
        let req = |v: Value| responses_request(v.as_object().unwrap(), &prev);
        assert!(req(json!({"input": "x", "text": {"format": {"type": "json_schema"}}})).is_err());
        assert!(req(json!({"input": "x", "text": {"format": {"type": "yaml"}}})).is_err());
        let (r, _) = req(json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": true}}})).unwrap();
        assert_eq!(r.structured.unwrap().param, "text");
        let (r, _) = req(json!({"input": "x", "text": {"format": {"type": "text"}}})).unwrap();
        assert!(r.structured.is_none());
        assert!(body(json!({"input": "x", "reasoning": {"effort": "huge"}})).is_err());
        assert!(body(json!({"input": [{"type": "item_reference", "id": "x"}]})).is_err());
        // A reasoning item with encrypted content only adds no reasoning.
        let (b, _) = body(json!({"input": [{"role": "user", "content": "q"}, {"type": "reasoning", "summary": [], "encrypted_content": "xyz"}, {"role": "assistant", "content": [{"type": "output_text", "text": "a"}]}, {"role": "user", "content": "q2"}]})).unwrap();
        assert!(b["messages"][1].get("reasoning_content").is_none());
        assert!(api::chat_request(&b).is_ok());
        assert!(body(json!({"input": []})).is_err());
        assert!(body(json!({})).is_err());
        let (b, _) = body(json!({"input": "x", "reasoning": {"effort": "high"}})).unwrap();
        assert_eq!(b["chat_template_kwargs"]["enable_thinking"], true);
    }

    #[test]
    fn store_is_bounded() {
        let s = Store::default();
        for i in 0..STORE_CAPACITY + 3 {
            s.put(format!("r{i}"), vec![json!(i)]);
        }
        assert!(s.get("r0").is_none() && s.get("r2").is_none());
        assert_eq!(s.get("r3").unwrap()[0], json!(3));
        assert!(s.get(&format!("r{}", STORE_CAPACITY + 2)).is_some());
    }
}
