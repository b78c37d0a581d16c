//! Request parsing: OpenAI request bodies → typed requests, or a 400 naming the field.
//!
//! Bodies are parsed as `serde_json::Value` first and each field is then read by hand, so every
//! wrong type or value gets an error that says which field and what is allowed (serde's derive
//! would give "invalid type at line 1 column 74"). Unknown fields are ignored; `null` counts as
//! absent (some clients send every field). Limits follow OpenAI's where it has one.

use serde_json::{Map, Value};

use lily::runtime::constrain::Grammar;
use lily::runtime::sampler::SamplingOverrides;

use crate::error::{ApiError, ApiResult};

/// Fields shared by both endpoints.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Common {
    pub model: Option<String>,
    pub sampling: SamplingOverrides,
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Log-probabilities with this many alternatives (`Some(0)`: the chosen token only).
    pub logprobs: Option<usize>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct ChatRequest {
    pub common: Common,
    /// Validated messages (roles and content parts checked; `developer` is sent as `system`).
    pub messages: Value,
    /// Tool schemas (`None` when absent or empty).
    pub tools: Option<Value>,
    pub tool_choice: ToolChoice,
    /// Chat template variables: `chat_template_kwargs`, with `reasoning_effort: "none"` turning
    /// thinking off unless the kwargs set it.
    pub template_kwargs: Map<String, Value>,
    pub cache_key: Option<String>,
    /// Structured output (`response_format`, `structured_outputs`, `guided_*`).
    pub structured: Option<Structured>,
}

/// A structured-output request: what the answer must follow and the field that asked for it
/// (named in errors, e.g. when the grammar does not compile).
#[derive(Clone, Debug, PartialEq)]
pub struct Structured {
    pub grammar: Grammar,
    pub param: &'static str,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

#[derive(Clone, Debug, PartialEq)]
pub struct CompletionRequest {
    pub common: Common,
    pub prompt: Prompt,
    pub cache_key: Option<String>,
    pub structured: Option<Structured>,
}

/// Largest `max_tokens` accepted at all; a larger value is refused as absurd. Values that fit
/// here but not in the context just run until the context is full (`finish_reason: length`).
pub const MAX_TOKENS_LIMIT: usize = 1 << 24;
/// Stop sequences at most (OpenAI allows 4; agents sometimes send a few more).
pub const MAX_STOPS: usize = 16;

/// Parses a body: JSON object required.
pub fn body_object(bytes: &[u8]) -> ApiResult<Map<String, Value>> {
    if bytes.is_empty() {
        return Err(ApiError::bad("request body is empty; send a JSON object"));
    }
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(ApiError::bad("request body must be a JSON object")),
        Err(e) => Err(
            ApiError::bad(format!("request body is not valid JSON: {e}")).with_code("invalid_json"),
        ),
    }
}

/// Typed field access with OpenAI-style errors.
struct Fields<'a>(&'a Map<String, Value>);

impl<'a> Fields<'a> {
    fn get(&self, k: &str) -> Option<&'a Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }

    fn f32_in(&self, k: &str, lo: f32, hi: f32) -> ApiResult<Option<f32>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && (lo as f64..=hi as f64).contains(&x) => {
                    Ok(Some(x as f32))
                }
                Some(x) => Err(ApiError::param(
                    k,
                    format!("`{k}` is {x}; it must be between {lo} and {hi}"),
                )),
                None => Err(ApiError::param(
                    k,
                    format!("`{k}` must be a number, got {}", kind(v)),
                )),
            },
        }
    }

    fn int_in(&self, k: &str, lo: i64, hi: i64) -> ApiResult<Option<i64>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => {
                // 3.0 is accepted as 3 (JavaScript clients send floats for integers).
                let i = v.as_i64().or_else(|| {
                    v.as_f64()
                        .filter(|x| x.fract() == 0.0 && x.abs() < 9.0e18)
                        .map(|x| x as i64)
                });
                match i {
                    Some(i) if (lo..=hi).contains(&i) => Ok(Some(i)),
                    Some(i) => Err(ApiError::param(
                        k,
                        format!("`{k}` is {i}; it must be between {lo} and {hi}"),
                    )),
                    None if v.is_number() && v.as_u64().is_some() => Err(ApiError::param(
                        k,
                        format!("`{k}` is {v}; it must be at most {hi}"),
                    )),
                    None => Err(ApiError::param(
                        k,
                        format!("`{k}` must be an integer, got {}", kind(v)),
                    )),
                }
            }
        }
    }

    fn bool(&self, k: &str) -> ApiResult<Option<bool>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(ApiError::param(
                k,
                format!("`{k}` must be true or false, got {}", kind(v)),
            )),
        }
    }

    fn str(&self, k: &str) -> ApiResult<Option<&'a str>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(ApiError::param(
                k,
                format!("`{k}` must be a string, got {}", kind(v)),
            )),
        }
    }

    fn object(&self, k: &str) -> ApiResult<Option<&'a Map<String, Value>>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Object(o)) => Ok(Some(o)),
            Some(v) => Err(ApiError::param(
                k,
                format!("`{k}` must be an object, got {}", kind(v)),
            )),
        }
    }
}

/// "a string", "an array", … for messages (every dialect's errors).
pub(crate) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Fields both endpoints share. `chat` selects the logprobs spelling: chat has
/// `logprobs: bool` + `top_logprobs: 0..=20`, completions `logprobs: 0..=5`.
fn common(o: &Map<String, Value>, chat: bool) -> ApiResult<Common> {
    let f = Fields(o);
    let n = f.int_in("n", 1, 128)?;
    if n.is_some_and(|n| n != 1) {
        return Err(ApiError::param(
            "n",
            "only n=1 is supported (one choice per request)",
        ));
    }
    if f.int_in("best_of", 1, 128)?.is_some_and(|n| n != 1) {
        return Err(ApiError::param("best_of", "only best_of=1 is supported"));
    }
    let max_tokens = match f.int_in("max_completion_tokens", 0, i64::MAX)? {
        Some(x) => Some(("max_completion_tokens", x)),
        None => f
            .int_in("max_tokens", 0, i64::MAX)?
            .map(|x| ("max_tokens", x)),
    };
    let max_tokens = match max_tokens {
        None => None,
        Some((k, x)) if x < 1 => return Err(ApiError::param(k, format!("`{k}` must be at least 1"))),
        Some((k, x)) if x as u64 > MAX_TOKENS_LIMIT as u64 => {
            return Err(ApiError::param(k, format!("`{k}` is {x}; the most this server accepts is {MAX_TOKENS_LIMIT} (generation also stops when the context is full)")))
        }
        Some((_, x)) => Some(x as usize),
    };
    let sampling = SamplingOverrides {
        temperature: f.f32_in("temperature", 0.0, 2.0)?,
        top_p: f.f32_in("top_p", 0.0, 1.0)?,
        top_k: f.int_in("top_k", -1, i32::MAX as i64)?,
        min_p: f.f32_in("min_p", 0.0, 1.0)?,
        presence_penalty: f.f32_in("presence_penalty", -2.0, 2.0)?,
        frequency_penalty: f.f32_in("frequency_penalty", -2.0, 2.0)?,
        repetition_penalty: f.f32_in("repetition_penalty", 0.01, 10.0)?,
        // OpenAI takes any 64-bit integer, negative ones too.
        seed: f.int_in("seed", i64::MIN, i64::MAX)?.map(|s| s as u64),
    };
    if sampling.top_p == Some(0.0) {
        return Err(ApiError::param("top_p", "`top_p` must be greater than 0"));
    }
    let stop = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            if a.len() > MAX_STOPS {
                return Err(ApiError::param(
                    "stop",
                    format!(
                        "at most {MAX_STOPS} stop sequences are allowed, got {}",
                        a.len()
                    ),
                ));
            }
            a.iter()
                .map(|v| {
                    v.as_str().map(str::to_string).ok_or_else(|| {
                        ApiError::param("stop", "`stop` must be a string or an array of strings")
                    })
                })
                .collect::<ApiResult<_>>()?
        }
        Some(v) => {
            return Err(ApiError::param(
                "stop",
                format!(
                    "`stop` must be a string or an array of strings, got {}",
                    kind(v)
                ),
            ))
        }
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::param("stop", "stop sequences must not be empty"));
    }
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.object("stream_options")? {
        Some(so) => Fields(so)
            .bool("include_usage")
            .map_err(|_| {
                ApiError::param(
                    "stream_options",
                    "`stream_options.include_usage` must be true or false",
                )
            })?
            .unwrap_or(false),
        None => false,
    };
    let logprobs = if chat {
        let on = f.bool("logprobs")?.unwrap_or(false);
        let top = f.int_in("top_logprobs", 0, 20)?;
        match (on, top) {
            (false, Some(t)) if t > 0 => {
                return Err(ApiError::param(
                    "top_logprobs",
                    "`top_logprobs` needs `logprobs: true`",
                ))
            }
            (false, _) => None,
            (true, t) => Some(t.unwrap_or(0) as usize),
        }
    } else {
        f.int_in("logprobs", 0, 5)?.map(|n| n as usize)
    };
    Ok(Common {
        model: f.str("model")?.map(str::to_string),
        sampling,
        max_tokens,
        stop,
        stream,
        include_usage,
        logprobs,
    })
}

fn cache_key(o: &Map<String, Value>) -> ApiResult<Option<String>> {
    Ok(Fields(o).str("prompt_cache_key")?.map(str::to_string))
}

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// `POST /v1/chat/completions`.
pub fn chat_request(o: &Map<String, Value>) -> ApiResult<ChatRequest> {
    let common = common(o, true)?;
    let f = Fields(o);
    let messages = match f.get("messages") {
        None => return Err(ApiError::param("messages", "`messages` is required")),
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(ApiError::param("messages", "`messages` must not be empty"))
        }
        Some(Value::Array(a)) => Value::Array(fold_system_messages(
            a.iter()
                .enumerate()
                .map(|(i, m)| message(i, m))
                .collect::<ApiResult<_>>()?,
        )),
        Some(v) => {
            return Err(ApiError::param(
                "messages",
                format!(
                    "`messages` must be an array of message objects, got {}",
                    kind(v)
                ),
            ))
        }
    };
    let tools = match f.get("tools") {
        None => None,
        Some(Value::Array(a)) if a.is_empty() => None,
        Some(Value::Array(a)) => {
            for (i, t) in a.iter().enumerate() {
                tool(i, t)?;
            }
            Some(Value::Array(a.clone()))
        }
        Some(v) => {
            return Err(ApiError::param(
                "tools",
                format!("`tools` must be an array of tool objects, got {}", kind(v)),
            ))
        }
    };
    let tool_choice = match f.get("tool_choice") {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            _ => {
                return Err(ApiError::param(
                    "tool_choice",
                    format!("`tool_choice` {s:?} is not one of none, auto, required"),
                ))
            }
        },
        Some(Value::Object(c)) => {
            let name = c
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .or_else(|| c.get("name").and_then(Value::as_str));
            match name {
                Some(n) => ToolChoice::Named(n.to_string()),
                None => return Err(ApiError::param("tool_choice", "a named `tool_choice` must be {\"type\": \"function\", \"function\": {\"name\": …}}")),
            }
        }
        Some(v) => {
            return Err(ApiError::param(
                "tool_choice",
                format!(
                    "`tool_choice` must be a string or an object, got {}",
                    kind(v)
                ),
            ))
        }
    };
    match (&tool_choice, &tools) {
        (ToolChoice::Required | ToolChoice::Named(_), None) => {
            return Err(ApiError::param(
                "tool_choice",
                "`tool_choice` asks for a tool call but no `tools` were given",
            ))
        }
        (ToolChoice::Named(n), Some(t))
            if !t
                .as_array()
                .is_some_and(|a| a.iter().any(|x| tool_name(x) == Some(n.as_str()))) =>
        {
            return Err(ApiError::param(
                "tool_choice",
                format!("`tool_choice` names the function {n:?}, which is not in `tools`"),
            ))
        }
        _ => {}
    }
    let mut template_kwargs = f
        .object("chat_template_kwargs")?
        .cloned()
        .unwrap_or_default();
    for k in ["enable_thinking", "preserve_thinking"] {
        if let Some(v) = template_kwargs.get(k) {
            if !v.is_boolean() && !v.is_null() {
                return Err(ApiError::param(
                    "chat_template_kwargs",
                    format!("`chat_template_kwargs.{k}` must be true or false"),
                ));
            }
        }
    }
    for k in ["messages", "tools", "documents", "add_generation_prompt"] {
        if template_kwargs.contains_key(k) {
            return Err(ApiError::param(
                "chat_template_kwargs",
                format!("`chat_template_kwargs.{k}` is set by the server and cannot be overridden"),
            ));
        }
    }
    match f.str("reasoning_effort")? {
        None => {}
        Some("none") => {
            template_kwargs
                .entry("enable_thinking")
                .or_insert(Value::Bool(false));
        }
        Some("minimal" | "low" | "medium" | "high" | "xhigh") => {}
        Some(e) => {
            return Err(ApiError::param(
                "reasoning_effort",
                format!("`reasoning_effort` {e:?} is not one of none, minimal, low, medium, high"),
            ))
        }
    }
    let structured = structured(o)?;
    if let (Some(s), ToolChoice::Required | ToolChoice::Named(_)) = (&structured, &tool_choice) {
        return Err(ApiError::param(
            s.param,
            format!("`{}` cannot be combined with a `tool_choice` that asks for a tool call: the answer is either the call or the formatted text", s.param),
        ));
    }
    Ok(ChatRequest {
        common,
        messages,
        tools,
        tool_choice,
        template_kwargs,
        cache_key: cache_key(o)?,
        structured,
    })
}

/// System messages where clients put them → what the chat template can render.
///
/// Clients send several system messages (langchain's `[("system", a), ("system", b), …]`, agents
/// that add instructions), leading or in the middle. The Qwen3.6 template renders one system block
/// at the start and raises on any other system message ("System message must be at the
/// beginning"), so:
/// - the leading ones become that one block, their texts joined with a blank line;
/// - a later one cannot stay a system turn (the template cannot render it, and the model only saw
///   one system prompt, at the top, in training; moving it to the top would also rewrite the start
///   of the prompt and lose the prefix cache of the whole conversation). It is folded into the
///   next message when that is a user message (its text first, then a blank line), which is where
///   the model reads instructions mid-conversation; otherwise (before an assistant or tool
///   message, or at the end) it becomes a user message of its own at its place. Either way the
///   history before it renders exactly as before.
///
/// Runs after `message` (below): roles are checked, `developer` is already `system`, content is a string
/// or null.
pub fn fold_system_messages(msgs: Vec<Value>) -> Vec<Value> {
    let is_system = |m: &Value| m.get("role").and_then(Value::as_str) == Some("system");
    let text = |m: &Value| {
        m.get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    let join = |texts: &[String]| {
        texts
            .iter()
            .filter(|t| !t.trim().is_empty())
            .cloned()
            .collect::<Vec<_>>()
            .join("\n\n")
    };
    let lead = msgs.iter().take_while(|m| is_system(m)).count();
    let mut out = Vec::with_capacity(msgs.len());
    if lead > 0 {
        let mut first = msgs[0].clone();
        if lead > 1 {
            first["content"] =
                Value::from(join(&msgs[..lead].iter().map(text).collect::<Vec<_>>()));
        }
        out.push(first);
    }
    let user = |content: String| serde_json::json!({"role": "user", "content": content});
    let mut pending: Vec<String> = Vec::new();
    for mut m in msgs.into_iter().skip(lead) {
        if is_system(&m) {
            pending.push(text(&m));
            continue;
        }
        if !pending.is_empty() {
            let instructions = join(&std::mem::take(&mut pending));
            if m.get("role").and_then(Value::as_str) == Some("user") {
                let content = text(&m);
                m["content"] = Value::from(if content.is_empty() {
                    instructions
                } else if instructions.is_empty() {
                    content
                } else {
                    format!("{instructions}\n\n{content}")
                });
            } else if !instructions.is_empty() {
                out.push(user(instructions));
            }
        }
        out.push(m);
    }
    let instructions = join(&pending);
    if !instructions.is_empty() {
        out.push(user(instructions));
    }
    out
}

/// One message: role checked, content a string, null or text parts (no images: this build
/// serves the text model).
fn message(i: usize, m: &Value) -> ApiResult<Value> {
    let p = format!("messages[{i}]");
    let Value::Object(o) = m else {
        return Err(ApiError::param(
            &p,
            format!("`{p}` must be an object, got {}", kind(m)),
        ));
    };
    let role = match o.get("role") {
        Some(Value::String(r)) if ROLES.contains(&r.as_str()) => r.as_str(),
        Some(Value::String(r)) => {
            return Err(ApiError::param(
                &p,
                format!("`{p}.role` {r:?} is not one of {}", ROLES.join(", ")),
            ))
        }
        _ => {
            return Err(ApiError::param(
                &p,
                format!("`{p}.role` is required and must be a string"),
            ))
        }
    };
    let mut out = o.clone();
    if role == "developer" {
        // OpenAI's newer name for system instructions; the Qwen template knows `system`.
        out.insert("role".into(), Value::from("system"));
    }
    match o.get("content") {
        None | Some(Value::Null) | Some(Value::String(_)) => {}
        Some(Value::Array(parts)) => {
            for (j, part) in parts.iter().enumerate() {
                let t = part.get("type").and_then(Value::as_str);
                match t {
                    Some("text") | Some("input_text") | Some("output_text") if part.get("text").is_some_and(Value::is_string) => {}
                    // An assistant's refusal part (OpenAI echoes them back in the history): not text
                    // the model wrote in its turn's content, left out.
                    Some("refusal") if role == "assistant" => {}
                    Some("text") | Some("input_text") | Some("output_text") => return Err(ApiError::param(&p, format!("`{p}.content[{j}]` is a text part without a string `text`"))),
                    Some(t @ ("image_url" | "input_image" | "image" | "input_audio" | "video" | "video_url" | "file")) => {
                        return Err(ApiError::param(&p, format!("`{p}.content[{j}]` is a {t:?} part; this server runs the text model only")))
                    }
                    _ => return Err(ApiError::param(&p, format!("`{p}.content[{j}]` must be a content part like {{\"type\": \"text\", \"text\": …}}"))),
                }
            }
            // The template renders a list of text parts by concatenating their `text`.
            let text: String = parts
                .iter()
                .filter(|x| x.get("type").and_then(Value::as_str) != Some("refusal"))
                .filter_map(|x| x.get("text").and_then(Value::as_str))
                .collect();
            out.insert("content".into(), Value::from(text));
        }
        Some(v) => {
            return Err(ApiError::param(
                &p,
                format!(
                    "`{p}.content` must be a string or an array of content parts, got {}",
                    kind(v)
                ),
            ))
        }
    }
    if let Some(calls) = o.get("tool_calls").filter(|v| !v.is_null()) {
        let Value::Array(calls) = calls else {
            return Err(ApiError::param(
                &p,
                format!("`{p}.tool_calls` must be an array"),
            ));
        };
        if role != "assistant" {
            return Err(ApiError::param(
                &p,
                format!("`{p}.tool_calls` is only allowed on assistant messages"),
            ));
        }
        for (j, c) in calls.iter().enumerate() {
            let func = c.get("function").unwrap_or(c);
            let ok_name = func.get("name").is_some_and(Value::is_string);
            let ok_args = func
                .get("arguments")
                .is_none_or(|a| a.is_string() || a.is_object());
            if !ok_name || !ok_args {
                return Err(ApiError::param(&p, format!("`{p}.tool_calls[{j}]` must be {{\"type\": \"function\", \"function\": {{\"name\": string, \"arguments\": JSON string}}}}")));
            }
            if let Some(Value::String(a)) = func.get("arguments") {
                match serde_json::from_str::<Value>(a) {
                    Ok(Value::Object(_)) => {}
                    _ => return Err(ApiError::param(&p, format!("`{p}.tool_calls[{j}].function.arguments` must be a JSON object encoded as a string"))),
                }
            }
        }
    }
    Ok(Value::Object(out))
}

fn tool_name(t: &Value) -> Option<&str> {
    t.get("function")
        .unwrap_or(t)
        .get("name")
        .and_then(Value::as_str)
}

fn tool(i: usize, t: &Value) -> ApiResult<()> {
    let p = format!("tools[{i}]");
    if !t.is_object() {
        return Err(ApiError::param(&p, format!("`{p}` must be an object")));
    }
    match t.get("type").and_then(Value::as_str) {
        None | Some("function") => {}
        Some(x) => {
            return Err(ApiError::param(
                &p,
                format!("`{p}.type` {x:?} is not supported (only \"function\")"),
            ))
        }
    }
    if tool_name(t).is_none() {
        return Err(ApiError::param(&p, format!("`{p}` needs `function.name`")));
    }
    if let Some(strict) = t.get("function").unwrap_or(t).get("strict") {
        if !strict.is_boolean() && !strict.is_null() {
            return Err(ApiError::param(
                &p,
                format!("`{p}.function.strict` must be true or false"),
            ));
        }
    }
    if let Some(params) = t.get("function").unwrap_or(t).get("parameters") {
        if !params.is_object() && !params.is_null() {
            return Err(ApiError::param(
                &p,
                format!("`{p}.function.parameters` must be a JSON schema object"),
            ));
        }
    }
    Ok(())
}

/// `POST /v1/completions`.
pub fn completion_request(o: &Map<String, Value>) -> ApiResult<CompletionRequest> {
    let common = common(o, false)?;
    let f = Fields(o);
    if f.bool("echo")? == Some(true) {
        return Err(ApiError::param("echo", "`echo` is not supported"));
    }
    if f.str("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::param(
            "suffix",
            "`suffix` (fill-in-the-middle) is not supported",
        ));
    }
    let bad = || {
        ApiError::param(
            "prompt",
            "`prompt` must be a string, an array with one string, or an array of token ids",
        )
    };
    let ids = |a: &[Value]| -> ApiResult<Vec<u32>> {
        a.iter()
            .map(|v| {
                v.as_u64()
                    .filter(|&x| x <= u32::MAX as u64)
                    .map(|x| x as u32)
                    .ok_or_else(bad)
            })
            .collect()
    };
    let prompt = match f.get("prompt") {
        None => return Err(ApiError::param("prompt", "`prompt` is required")),
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            Prompt::Text(a[0].as_str().unwrap_or_default().to_string())
        }
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_array() => {
            Prompt::Ids(ids(a[0].as_array().map(Vec::as_slice).unwrap_or_default())?)
        }
        Some(Value::Array(a)) if a.len() > 1 && a.iter().all(|x| x.is_string() || x.is_array()) => {
            return Err(ApiError::param(
                "prompt",
                "only one prompt per request is supported",
            ))
        }
        Some(Value::Array(a)) => Prompt::Ids(ids(a)?),
        Some(_) => return Err(bad()),
    };
    if matches!(&prompt, Prompt::Text(s) if s.is_empty())
        || matches!(&prompt, Prompt::Ids(v) if v.is_empty())
    {
        return Err(ApiError::param("prompt", "`prompt` must not be empty"));
    }
    Ok(CompletionRequest {
        common,
        prompt,
        cache_key: cache_key(o)?,
        structured: structured(o)?,
    })
}

/// The structured-output fields, at most one of them: OpenAI's `response_format` (`text`,
/// `json_object`, `json_schema`), vLLM's `structured_outputs` (`json`, `json_object`, `choice`,
/// `regex`, `grammar`: exactly one) and vLLM's older top-level `guided_json`, `guided_choice`,
/// `guided_regex`, `guided_grammar`. Whether a schema or grammar compiles is checked later, when
/// it is compiled (still before the request is queued).
pub fn structured(o: &Map<String, Value>) -> ApiResult<Option<Structured>> {
    let f = Fields(o);
    let mut found: Vec<Structured> = Vec::new();
    if let Some(rf) = f.object("response_format")? {
        if let Some(g) = response_format(rf)? {
            found.push(Structured {
                grammar: g,
                param: "response_format",
            });
        }
    }
    if let Some(so) = f.object("structured_outputs")? {
        found.push(Structured {
            grammar: structured_outputs(so)?,
            param: "structured_outputs",
        });
    }
    for (k, make) in [
        (
            "guided_json",
            json_grammar as fn(&str, &Value) -> ApiResult<Grammar>,
        ),
        ("guided_choice", choice_grammar),
        ("guided_regex", regex_grammar),
        ("guided_grammar", lark_grammar),
    ] {
        if let Some(v) = f.get(k) {
            found.push(Structured {
                grammar: make(k, v)?,
                param: k,
            });
        }
    }
    if found.len() > 1 {
        let names: Vec<String> = found.iter().map(|s| format!("`{}`", s.param)).collect();
        return Err(ApiError::param(
            found[1].param,
            format!(
                "a request takes one structured-output constraint; it has {}",
                names.join(" and ")
            ),
        ));
    }
    Ok(found.pop())
}

/// OpenAI's `response_format`.
fn response_format(rf: &Map<String, Value>) -> ApiResult<Option<Grammar>> {
    const P: &str = "response_format";
    match rf.get("type") {
        None | Some(Value::Null) => Err(ApiError::param(
            P,
            "`response_format.type` is required: one of text, json_object, json_schema",
        )),
        Some(Value::String(t)) => match t.as_str() {
            "text" => Ok(None),
            "json_object" => Ok(Some(Grammar::JsonObject)),
            "json_schema" => {
                let js = match rf.get("json_schema") {
                    Some(Value::Object(js)) => js,
                    None | Some(Value::Null) => return Err(ApiError::param(P, "`response_format.json_schema` is required when `type` is \"json_schema\": {\"name\": …, \"schema\": {…}}")),
                    Some(v) => return Err(ApiError::param(P, format!("`response_format.json_schema` must be an object, got {}", kind(v)))),
                };
                let jf = Fields(js);
                let bad = |k: &str, what: &str| {
                    ApiError::param(P, format!("`response_format.json_schema.{k}` {what}"))
                };
                match jf.get("name") {
                    Some(Value::String(n)) if !n.is_empty() && n.chars().count() <= 64 => {}
                    Some(Value::String(_)) => {
                        return Err(bad("name", "must be 1 to 64 characters"))
                    }
                    Some(v) => {
                        return Err(bad("name", &format!("must be a string, got {}", kind(v))))
                    }
                    None => return Err(bad("name", "is required")),
                }
                if jf.get("strict").is_some_and(|v| !v.is_boolean()) {
                    return Err(bad("strict", "must be true or false"));
                }
                if jf.get("description").is_some_and(|v| !v.is_string()) {
                    return Err(bad("description", "must be a string"));
                }
                match jf.get("schema") {
                    None => Err(bad("schema", "is required (a JSON Schema object)")),
                    Some(s @ (Value::Object(_) | Value::Bool(_))) => {
                        Ok(Some(Grammar::JsonSchema(s.clone())))
                    }
                    Some(v) => Err(bad(
                        "schema",
                        &format!("must be a JSON Schema object, got {}", kind(v)),
                    )),
                }
            }
            other => Err(ApiError::param(
                P,
                format!(
                    "`response_format.type` {other:?} is not one of text, json_object, json_schema"
                ),
            )),
        },
        Some(v) => Err(ApiError::param(
            P,
            format!("`response_format.type` must be a string, got {}", kind(v)),
        )),
    }
}

/// A flat output format, as the Responses API's `text.format` and Anthropic's
/// `output_config.format` send it: `{"type": "json_schema", "schema": {…}, "name", "strict"}`,
/// `{"type": "json_object"}` (Responses) or `{"type": "text"}`. `path` names the field in errors.
pub(crate) fn flat_format(
    param: &'static str,
    path: &str,
    fmt: &Value,
    json_object: bool,
) -> ApiResult<Option<Structured>> {
    let Value::Object(fo) = fmt else {
        return Err(ApiError::param(
            param,
            format!("`{path}` must be an object, got {}", kind(fmt)),
        ));
    };
    let g = match fo.get("type").and_then(Value::as_str) {
        Some("text") if json_object => return Ok(None),
        Some("json_object") if json_object => Grammar::JsonObject,
        Some("json_schema") => match Fields(fo).get("schema") {
            Some(s @ (Value::Object(_) | Value::Bool(_))) => Grammar::JsonSchema(s.clone()),
            None => {
                return Err(ApiError::param(
                    param,
                    format!("`{path}.schema` is required (a JSON Schema object)"),
                ))
            }
            Some(v) => {
                return Err(ApiError::param(
                    param,
                    format!(
                        "`{path}.schema` must be a JSON Schema object, got {}",
                        kind(v)
                    ),
                ))
            }
        },
        _ if json_object => {
            return Err(ApiError::param(
                param,
                format!("`{path}.type` must be one of text, json_object, json_schema"),
            ))
        }
        _ => {
            return Err(ApiError::param(
                param,
                format!("`{path}.type` must be \"json_schema\""),
            ))
        }
    };
    Ok(Some(Structured { grammar: g, param }))
}

/// Sets a dialect's structured output on its chat request: refused when the request already
/// asks for a tool call (the answer is either the call or the formatted text).
pub(crate) fn set_structured(req: &mut ChatRequest, s: Option<Structured>) -> ApiResult<()> {
    if let Some(s) = &s {
        if matches!(req.tool_choice, ToolChoice::Required | ToolChoice::Named(_)) {
            return Err(ApiError::param(
                s.param,
                format!("`{}` cannot be combined with a `tool_choice` that asks for a tool call: the answer is either the call or the formatted text", s.param),
            ));
        }
        req.structured = Some(s.clone());
    }
    Ok(())
}

/// vLLM's `structured_outputs`: exactly one of `json`, `json_object`, `choice`, `regex`,
/// `grammar` (its options such as `disable_any_whitespace` are ignored: JSON is always compact).
fn structured_outputs(so: &Map<String, Value>) -> ApiResult<Grammar> {
    const P: &str = "structured_outputs";
    const KINDS: [&str; 5] = ["json", "json_object", "choice", "regex", "grammar"];
    if let Some(k) = ["structural_tag"]
        .iter()
        .find(|k| Fields(so).get(k).is_some())
    {
        return Err(ApiError::param(
            P,
            format!("`structured_outputs.{k}` is not supported; use one of json, json_object, choice, regex, grammar"),
        ));
    }
    let set: Vec<&str> = KINDS
        .into_iter()
        .filter(|k| match Fields(so).get(k) {
            None => false,
            Some(Value::Bool(b)) => *b || *k != "json_object",
            Some(_) => true,
        })
        .collect();
    let k = match set.as_slice() {
        [k] => *k,
        [] => return Err(ApiError::param(P, "`structured_outputs` needs one of json, json_object, choice, regex, grammar")),
        many => return Err(ApiError::param(P, format!("`structured_outputs` takes exactly one of json, json_object, choice, regex, grammar; it has {}", many.join(" and ")))),
    };
    let path = format!("structured_outputs.{k}");
    let v = &so[k];
    match k {
        "json" => json_grammar(&path, v),
        "json_object" if v.is_boolean() => Ok(Grammar::JsonObject),
        "json_object" => Err(ApiError::param(
            P,
            "`structured_outputs.json_object` must be true or false",
        )),
        "choice" => choice_grammar(&path, v),
        "regex" => regex_grammar(&path, v),
        _ => lark_grammar(&path, v),
    }
}

fn param_of(path: &str) -> &str {
    path.split('.').next().unwrap_or(path)
}

/// A JSON schema: an object (or a boolean), or the same as JSON text (vLLM takes both).
fn json_grammar(path: &str, v: &Value) -> ApiResult<Grammar> {
    match v {
        Value::Object(_) | Value::Bool(_) => Ok(Grammar::JsonSchema(v.clone())),
        Value::String(s) => match serde_json::from_str::<Value>(s) {
            Ok(s @ (Value::Object(_) | Value::Bool(_))) => Ok(Grammar::JsonSchema(s)),
            _ => Err(ApiError::param(
                param_of(path),
                format!("`{path}` is a string that is not a JSON Schema object"),
            )),
        },
        v => Err(ApiError::param(
            param_of(path),
            format!("`{path}` must be a JSON Schema object, got {}", kind(v)),
        )),
    }
}

fn choice_grammar(path: &str, v: &Value) -> ApiResult<Grammar> {
    let bad = || {
        ApiError::param(
            param_of(path),
            format!("`{path}` must be a non-empty array of strings"),
        )
    };
    let Value::Array(a) = v else {
        return Err(bad());
    };
    if a.is_empty() {
        return Err(bad());
    }
    a.iter()
        .map(|x| x.as_str().map(str::to_string).ok_or_else(bad))
        .collect::<ApiResult<Vec<_>>>()
        .map(Grammar::Choice)
}

fn regex_grammar(path: &str, v: &Value) -> ApiResult<Grammar> {
    match v {
        Value::String(s) if !s.is_empty() => Ok(Grammar::Regex(s.clone())),
        _ => Err(ApiError::param(
            param_of(path),
            format!("`{path}` must be a non-empty string (a regular expression)"),
        )),
    }
}

fn lark_grammar(path: &str, v: &Value) -> ApiResult<Grammar> {
    match v {
        Value::String(s) if !s.trim().is_empty() => Ok(Grammar::Lark(s.clone())),
        _ => Err(ApiError::param(
            param_of(path),
            format!("`{path}` must be a non-empty string (a Lark grammar, llguidance's dialect)"),
        )),
    }
}

/// A dialect's flat tool list (Anthropic's, the Responses API's: name at the top of each tool)
/// → chat-completions tools. `tools` must be an array and every tool needs a string `name`;
/// `each(path, tool)` checks the dialect's own fields and gives the schema (`parameters`) to use.
pub(crate) fn flat_tools(
    tools: &Value,
    mut each: impl FnMut(&str, &Value) -> ApiResult<Option<Value>>,
) -> ApiResult<Vec<Value>> {
    let Value::Array(list) = tools else {
        return Err(ApiError::param(
            "tools",
            format!(
                "`tools` must be an array of tool objects, got {}",
                kind(tools)
            ),
        ));
    };
    let mut fns = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let p = format!("tools[{i}]");
        let parameters = each(&p, t)?;
        let Some(name) = t.get("name").and_then(Value::as_str) else {
            return Err(ApiError::param(
                &p,
                format!("`{p}.name` is required and must be a string"),
            ));
        };
        let mut f = serde_json::json!({"name": name});
        if let Some(d) = t.get("description").filter(|v| !v.is_null()) {
            f["description"] = d.clone();
        }
        if let Some(s) = parameters {
            f["parameters"] = s;
        }
        fns.push(serde_json::json!({"type": "function", "function": f}));
    }
    Ok(fns)
}

/// Field `k` of a request object, a JSON null counting as absent (the dialects' optional fields).
pub(crate) fn get<'a>(o: &'a Map<String, Value>, k: &str) -> Option<&'a Value> {
    o.get(k).filter(|v| !v.is_null())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(v: Value) -> ApiResult<ChatRequest> {
        chat_request(v.as_object().unwrap())
    }

    #[test]
    fn minimal_chat() {
        let r =
            chat(json!({"model": "x", "messages": [{"role": "user", "content": "hi"}]})).unwrap();
        assert_eq!(r.tool_choice, ToolChoice::Auto);
        assert!(!r.common.stream);
        assert_eq!(r.common.max_tokens, None);
    }

    #[test]
    fn fields_are_checked() {
        let base = json!({"messages": [{"role": "user", "content": "hi"}]});
        let with = |k: &str, v: Value| {
            let mut b = base.clone();
            b[k] = v;
            chat(b)
        };
        assert_eq!(
            with("temperature", json!("hot"))
                .unwrap_err()
                .param
                .as_deref(),
            Some("temperature")
        );
        assert!(with("temperature", json!(2.5)).is_err());
        assert!(with("temperature", json!(null)).is_ok());
        assert!(with("max_tokens", json!(-1)).is_err());
        assert!(with("max_tokens", json!(0)).is_err());
        assert!(with("max_tokens", json!(1e30)).is_err());
        assert!(with("max_tokens", json!(1_000_000_000_000u64)).is_err());
        assert_eq!(
            with("max_tokens", json!(16.0)).unwrap().common.max_tokens,
            Some(16)
        );
        assert!(with("n", json!(2)).is_err());
        assert!(with("stop", json!([1])).is_err());
        assert!(with("stop", json!("")).is_err());
        assert_eq!(with("stop", json!("END")).unwrap().common.stop, vec!["END"]);
        assert!(with("top_logprobs", json!(3)).is_err());
        assert!(with("tool_choice", json!("required")).is_err());
        assert!(with("messages", json!("hi")).is_err());
        assert!(with("messages", json!([])).is_err());
        assert!(with("messages", json!([{"role": "wizard", "content": "x"}])).is_err());
        assert!(with(
            "messages",
            json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
        )
        .is_err());
        assert!(with("response_format", json!({"type": "json_schema"})).is_err());
        assert!(with("response_format", json!({"type": "text"}))
            .unwrap()
            .structured
            .is_none());
        assert!(with("seed", json!(-5)).is_ok());
        assert!(with("whatever_unknown", json!({"a": 1})).is_ok());
    }

    #[test]
    fn structured_outputs() {
        let base = json!({"messages": [{"role": "user", "content": "hi"}]});
        let with = |fields: Value| {
            let mut b = base.clone();
            for (k, v) in fields.as_object().unwrap() {
                b[k] = v.clone();
            }
            chat(b)
        };
        let grammar = |fields: Value| {
            with(fields)
                .unwrap()
                .structured
                .map(|s| (s.grammar, s.param))
        };
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            grammar(json!({"response_format": {"type": "json_object"}})),
            Some((Grammar::JsonObject, "response_format"))
        );
        assert_eq!(
            grammar(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true, "description": "d"}}})
            ),
            Some((Grammar::JsonSchema(schema.clone()), "response_format"))
        );
        assert_eq!(grammar(json!({"response_format": {"type": "text"}})), None);
        let err = |fields: Value| {
            let e = with(fields).unwrap_err();
            (e.param.unwrap_or_default(), e.message)
        };
        // OpenAI's required fields and types.
        let (p, m) = err(
            json!({"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}),
        );
        assert_eq!(p, "response_format");
        assert!(m.contains("name"), "{m}");
        assert!(err(
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})
        )
        .1
        .contains("schema"));
        assert!(err(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}})).1.contains("schema"));
        assert!(err(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": "yes"}}})).1.contains("strict"));
        assert!(err(json!({"response_format": {"type": "xml"}}))
            .1
            .contains("xml"));
        assert!(err(json!({"response_format": {}})).1.contains("type"));
        // vLLM's structured_outputs: exactly one kind.
        assert_eq!(
            grammar(json!({"structured_outputs": {"choice": ["a", "b"]}})),
            Some((
                Grammar::Choice(vec!["a".into(), "b".into()]),
                "structured_outputs"
            ))
        );
        assert_eq!(
            grammar(json!({"structured_outputs": {"regex": "[0-9]+"}})),
            Some((Grammar::Regex("[0-9]+".into()), "structured_outputs"))
        );
        assert_eq!(
            grammar(json!({"structured_outputs": {"json": schema.to_string()}})),
            Some((Grammar::JsonSchema(schema.clone()), "structured_outputs"))
        );
        assert_eq!(
            grammar(json!({"structured_outputs": {"grammar": "start: \"x\""}})),
            Some((Grammar::Lark("start: \"x\"".into()), "structured_outputs"))
        );
        assert_eq!(
            grammar(json!({"structured_outputs": {"json_object": true}})),
            Some((Grammar::JsonObject, "structured_outputs"))
        );
        assert!(
            err(json!({"structured_outputs": {"choice": ["a"], "regex": "a"}}))
                .1
                .contains("exactly one")
        );
        assert!(err(json!({"structured_outputs": {}})).1.contains("one of"));
        assert!(err(json!({"structured_outputs": {"choice": []}}))
            .1
            .contains("non-empty"));
        assert!(err(json!({"structured_outputs": {"choice": [1]}}))
            .1
            .contains("strings"));
        assert!(err(json!({"structured_outputs": {"structural_tag": {}}}))
            .1
            .contains("not supported"));
        // The older guided_* fields.
        assert_eq!(
            grammar(json!({"guided_choice": ["x"]})),
            Some((Grammar::Choice(vec!["x".into()]), "guided_choice"))
        );
        assert_eq!(
            grammar(json!({"guided_json": schema})),
            Some((Grammar::JsonSchema(schema.clone()), "guided_json"))
        );
        assert_eq!(
            grammar(json!({"guided_regex": "a+"})),
            Some((Grammar::Regex("a+".into()), "guided_regex"))
        );
        assert!(grammar(json!({"guided_grammar": "start: \"x\""})).is_some());
        assert!(err(json!({"guided_regex": ""})).0 == "guided_regex");
        // Two sources: a 400 naming both.
        let (_, m) = err(json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}));
        assert!(
            m.contains("`response_format`") && m.contains("`guided_regex`"),
            "{m}"
        );
        // A forced tool call and a format cannot both hold.
        let tools = json!([{"type": "function", "function": {"name": "f", "strict": true, "parameters": {"type": "object"}}}]);
        assert!(err(json!({"tools": tools, "tool_choice": "required", "response_format": {"type": "json_object"}})).1.contains("tool_choice"));
        assert!(with(json!({"tools": tools, "response_format": {"type": "json_object"}})).is_ok());
        assert!(with(
            json!({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]})
        )
        .is_err());
        // Completions take the same fields.
        let c = |v: Value| completion_request(v.as_object().unwrap());
        assert_eq!(
            c(json!({"prompt": "x", "guided_choice": ["a"]}))
                .unwrap()
                .structured
                .unwrap()
                .grammar,
            Grammar::Choice(vec!["a".into()])
        );
        assert!(c(json!({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "n"}}})).is_err());
    }

    #[test]
    fn content_parts_and_developer_role() {
        let r = chat(json!({"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})).unwrap();
        assert_eq!(r.messages[0]["role"], "system");
        assert_eq!(r.messages[1]["content"], "ab");
    }

    #[test]
    fn system_messages_anywhere() {
        let roles = |r: &ChatRequest| {
            r.messages
                .as_array()
                .unwrap()
                .iter()
                .map(|m| {
                    format!(
                        "{}:{}",
                        m["role"].as_str().unwrap(),
                        m["content"].as_str().unwrap_or("-")
                    )
                })
                .collect::<Vec<_>>()
        };
        // langchain's [("system", a), ("system", b), ("human", q)]: one system block.
        let r = chat(json!({"messages": [{"role": "system", "content": "a"}, {"role": "developer", "content": [{"type": "text", "text": "b"}]}, {"role": "user", "content": "q"}]})).unwrap();
        assert_eq!(roles(&r), ["system:a\n\nb", "user:q"]);
        // A later one is folded into the next user message...
        let r = chat(json!({"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "r1"},
            {"role": "system", "content": "m1"}, {"role": "system", "content": ""}, {"role": "system", "content": "m2"}, {"role": "user", "content": "q2", "name": "bob"}]})).unwrap();
        assert_eq!(
            roles(&r),
            ["system:a", "user:q1", "assistant:r1", "user:m1\n\nm2\n\nq2"]
        );
        assert_eq!(r.messages[3]["name"], "bob");
        // ...or kept in place as a user message when no user message follows at once.
        let call =
            json!([{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]);
        let r = chat(json!({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": null, "tool_calls": call},
            {"role": "system", "content": "s1"}, {"role": "tool", "tool_call_id": "c", "content": "x"}, {"role": "system", "content": "s2"}]})).unwrap();
        assert_eq!(
            roles(&r),
            ["user:q", "assistant:-", "user:s1", "tool:x", "user:s2"]
        );
        // An empty later system message adds nothing.
        let r = chat(json!({"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": " "}]})).unwrap();
        assert_eq!(roles(&r), ["user:q"]);
        // Fields real OpenAI clients add are accepted.
        let r = chat(
            json!({"messages": [{"role": "user", "content": "q", "name": "x"}], "parallel_tool_calls": false, "user": "u1", "metadata": {"k": "v"},
            "store": false, "service_tier": "auto", "prompt_cache_retention": "24h", "verbosity": "low", "modalities": ["text"]}),
        );
        assert!(r.is_ok());
        // An assistant refusal part in the history is accepted and left out.
        let r = chat(json!({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}, {"type": "text", "text": "ok"}]}, {"role": "user", "content": "q"}]})).unwrap();
        assert_eq!(r.messages[1]["content"], "ok");
    }

    /// The Qwen3.6 template renders what the folding makes of system messages anywhere.
    #[test]
    fn folded_system_messages_render() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../engine/tests/data/templates/model");
        let t = lily::tokenizer::ChatTemplate::from_dir(&dir).unwrap();
        let render = |v: Value| {
            t.render(&chat(v).unwrap().messages, None, true, &Map::new())
                .unwrap()
        };
        let s = render(
            json!({"messages": [{"role": "system", "content": "a"}, {"role": "system", "content": "b"}, {"role": "user", "content": "q"}]}),
        );
        assert!(
            s.starts_with("<|im_start|>system\na\n\nb<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"),
            "{s}"
        );
        let s = render(
            json!({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}, {"role": "system", "content": "m"}, {"role": "user", "content": "q2"}]}),
        );
        assert!(s.contains("<|im_start|>user\nm\n\nq2<|im_end|>"), "{s}");
        let s = render(
            json!({"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "late"}]}),
        );
        assert!(
            s.contains("<|im_start|>user\nq<|im_end|>\n<|im_start|>user\nlate<|im_end|>"),
            "{s}"
        );
    }

    #[test]
    fn thinking_switches() {
        let r = chat(
            json!({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "none"}),
        )
        .unwrap();
        assert_eq!(r.template_kwargs["enable_thinking"], false);
        let r = chat(json!({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": true}})).unwrap();
        assert_eq!(r.template_kwargs["enable_thinking"], true);
        assert!(chat(json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": "yes"}})).is_err());
    }

    #[test]
    fn logprobs_and_tools() {
        let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
        let r = chat(json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 3, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}})).unwrap();
        assert_eq!(r.common.logprobs, Some(3));
        assert_eq!(r.tool_choice, ToolChoice::Named("f".into()));
        assert!(chat(json!({"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": {"type": "function", "function": {"name": "g"}}})).is_err());
        let bad_call = json!([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]);
        assert!(chat(json!({"messages": bad_call})).is_err());
    }

    #[test]
    fn completion_prompts() {
        let c = |v: Value| completion_request(v.as_object().unwrap());
        assert_eq!(
            c(json!({"prompt": "hi"})).unwrap().prompt,
            Prompt::Text("hi".into())
        );
        assert_eq!(
            c(json!({"prompt": ["hi"]})).unwrap().prompt,
            Prompt::Text("hi".into())
        );
        assert_eq!(
            c(json!({"prompt": [1, 2]})).unwrap().prompt,
            Prompt::Ids(vec![1, 2])
        );
        assert_eq!(
            c(json!({"prompt": [[1, 2]]})).unwrap().prompt,
            Prompt::Ids(vec![1, 2])
        );
        assert!(c(json!({"prompt": ["a", "b"]})).is_err());
        assert!(c(json!({"prompt": [-1]})).is_err());
        assert!(c(json!({"prompt": ""})).is_err());
        assert!(c(json!({"prompt": "x", "echo": true})).is_err());
        assert_eq!(
            c(json!({"prompt": "x", "logprobs": 2}))
                .unwrap()
                .common
                .logprobs,
            Some(2)
        );
        assert!(c(json!({"prompt": "x", "logprobs": 9})).is_err());
    }

    #[test]
    fn bodies() {
        assert!(body_object(b"").is_err());
        assert!(body_object(b"[1]").is_err());
        assert!(body_object(b"{\"a\": \xff}").is_err());
        assert_eq!(
            body_object(b"{\"a\": \"\xff\"}")
                .unwrap_err()
                .code
                .as_deref(),
            Some("invalid_json")
        );
        assert!(body_object(b"{}").is_ok());
    }

    fn arb_json() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(|x| serde_json::Number::from_f64(x)
                .map(Value::Number)
                .unwrap_or(Value::Null)),
            "[a-z_]{0,12}".prop_map(Value::from),
            prop_oneof![
                Just("user"),
                Just("assistant"),
                Just("tool"),
                Just("system"),
                Just("text"),
                Just("function"),
                Just("none"),
                Just("required"),
                Just("tool_use"),
                Just("tool_result"),
                Just("thinking"),
                Just("enabled"),
                Just("any"),
                Just("tool"),
                Just("function_call"),
                Just("function_call_output"),
                Just("message"),
                Just("input_text")
            ]
            .prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            let keys = prop_oneof![
                Just("messages"),
                Just("role"),
                Just("content"),
                Just("tools"),
                Just("tool_choice"),
                Just("function"),
                Just("name"),
                Just("arguments"),
                Just("tool_calls"),
                Just("type"),
                Just("text"),
                Just("max_tokens"),
                Just("stop"),
                Just("logprobs"),
                Just("top_logprobs"),
                Just("prompt"),
                Just("temperature"),
                Just("stream_options"),
                Just("chat_template_kwargs"),
                Just("parameters"),
                Just("system"),
                Just("input"),
                Just("tool_use_id"),
                Just("input_schema"),
                Just("thinking"),
                Just("stop_sequences"),
                Just("id"),
                Just("is_error"),
                Just("instructions"),
                Just("call_id"),
                Just("output"),
                Just("previous_response_id"),
                Just("reasoning"),
                Just("effort"),
            ]
            .prop_map(str::to_string);
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::btree_map(keys, inner, 0..5)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
        /// The parsers never panic, on any JSON shaped like a request.
        #[test]
        fn parsers_never_panic(v in arb_json(), raw in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64)) {
            if let Value::Object(o) = &v {
                let _ = chat_request(o);
                let _ = completion_request(o);
                let _ = crate::anthropic::messages_request(o);
                let _ = crate::responses::responses_request(o, &|_| Some(std::sync::Arc::new(vec![serde_json::json!({"role": "user", "content": "x"})])));
            }
            let _ = body_object(&raw);
            let _ = body_object(v.to_string().as_bytes());
        }
    }
}
