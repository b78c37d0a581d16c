//! Model output → OpenAI response parts: reasoning, content and tool calls.
//!
//! The engine streams generated text piece by piece (a piece is whatever the detokenizer released:
//! one character, a word, or half of a tag such as `"<thi"` + `"nk>"`). [`OutputParser`] turns that
//! stream into [`Part`]s the server can send as SSE deltas at once: `reasoning_content`, `content`
//! and `tool_calls`. The non-streaming answer is built by [`collect`]ing the same parts, so the two
//! response kinds can never disagree.
//!
//! # The format (Qwen3.6 chat template)
//!
//! ```text
//! <|im_start|>assistant\n<think>\n      ← end of the prompt when thinking is on
//! …reasoning…\n</think>\n\n            ← generated: the model closes the think block
//! …content…\n\n                         ← the answer (optional when calling tools)
//! <tool_call>\n<function=NAME>\n
//! <parameter=KEY>\nVALUE\n</parameter>\n
//! </function>\n</tool_call>             ← zero or more calls, one after another
//! ```
//!
//! With thinking off the prompt already ends in `<think>\n\n</think>\n\n`, so generation starts in
//! content; a model may still open `<think>` itself at the very start of its content.
//! [`prompt_opens_think`] tells the server which case it is in.
//!
//! # Rules (and why)
//!
//! * **Reasoning / content split** mirrors how the template splits an assistant message in the
//!   history: `reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n')`
//!   and `content = content.split('</think>')[-1].lstrip('\n')`. So leading newlines of the reasoning
//!   and of the content after `</think>` are dropped, and trailing newlines of the reasoning are
//!   dropped. Streaming cannot take back what it sent, so newlines at the end of the reasoning are
//!   held until we know whether more reasoning text follows (then they are sent) or `</think>` (then
//!   they are dropped). A reasoning cut off by the length limit also loses its trailing newlines.
//! * `<think>` is a tag only where the template puts it: at the very start of the reasoning (a
//!   repeated opening tag is dropped), or at the very start of the content when no think block was
//!   opened yet (the model chose to think; we switch to reasoning). Anywhere else it is text, and so
//!   is a stray `</think>` in the content.
//! * **Tool calls** are parsed only in the content, never inside the reasoning, and only when the
//!   request allows them (`parse_tools`). Text before the first `<tool_call>` is content; whitespace
//!   right before a call, between calls and after the last one is markup and is dropped (the
//!   template writes `content + '\n\n<tool_call>…'`). Non-blank text after a call is content again.
//! * A parameter value is the text between `<parameter=KEY>` and `</parameter>` minus exactly one
//!   leading and one trailing `'\n'` (the template writes `'>\n' + value + '\n</parameter>'`). Only
//!   `</parameter>` ends a value, so values may contain any other markup (`</think>`, XML, code).
//! * **Arguments** are a compact JSON object, keys in the order generated, values typed by the
//!   tool's JSON schema (see `convert` below). They stream as [`Part::ToolCallArgs`] fragments whose
//!   concatenation is the JSON text: `{` when the call starts, `"key":value` as each parameter
//!   closes, `}` at `</function>`. Parameters whose schema type is exactly `"string"` stream their
//!   escaped characters as they arrive (the key and the opening quote are sent at `<parameter=KEY>`).
//!   Repeated keys are passed through as generated (the JSON stays parseable; the last one wins).
//! * **Never lose text.** Only what could still become a tag we care about is held back (plus the
//!   newlines/whitespace above); everything else is sent at once. Markup that turns out not to be
//!   a call (`<tool_call>` not followed by `<function=NAME>`) is sent as content verbatim. Text that
//!   is not markup inside a started call (between parameters) ends the call and becomes content.
//! * **Cut-off output** ([`OutputParser::finish`]): held-back partial tags in reasoning/content are
//!   sent as the text they are. A call whose [`Part::ToolCallStart`] was sent is closed with `}`:
//!   completed parameters stay; a half-generated value is kept if a string-typed (or untyped)
//!   parameter, or if it already converts to its declared type (e.g. `42` for an integer);
//!   otherwise it is dropped (a truncated `{"a":` must not become a string). A partial structural
//!   tag inside a call (`</para`) is markup and is dropped.

use serde_json::Value;
use std::collections::HashMap;

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const TOOL_CALL_OPEN: &str = "<tool_call>";
const TOOL_CALL_CLOSE: &str = "</tool_call>";
const FUNCTION_OPEN: &str = "<function=";
const FUNCTION_CLOSE: &str = "</function>";
const PARAM_OPEN: &str = "<parameter=";
const PARAM_CLOSE: &str = "</parameter>";

/// Longest function / parameter name we wait for; anything longer is not markup. Bounds how much
/// text `<function=…` can hold back.
const MAX_NAME: usize = 256;

/// One piece of the response, in generation order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Reasoning(String),
    Content(String),
    /// A tool call started: its index (0,1,..), id, function name.
    ToolCallStart {
        index: usize,
        id: String,
        name: String,
    },
    /// More characters of the call's `arguments` JSON string.
    ToolCallArgs {
        index: usize,
        args: String,
    },
}

/// Non-streaming result, built by running the streaming parser (so both agree exactly).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Parsed {
    pub reasoning: Option<String>,
    pub content: Option<String>,
    pub tool_calls: Vec<ToolCall>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as a JSON object text.
    pub arguments: String,
}

/// Merges parts into one answer; empty reasoning or content becomes `None`.
pub fn collect(parts: impl IntoIterator<Item = Part>) -> Parsed {
    let (mut reasoning, mut content) = (String::new(), String::new());
    let mut calls: Vec<(usize, ToolCall)> = Vec::new();
    for part in parts {
        match part {
            Part::Reasoning(s) => reasoning.push_str(&s),
            Part::Content(s) => content.push_str(&s),
            Part::ToolCallStart { index, id, name } => calls.push((
                index,
                ToolCall {
                    id,
                    name,
                    arguments: String::new(),
                },
            )),
            Part::ToolCallArgs { index, args } => {
                if let Some((_, call)) = calls.iter_mut().rev().find(|(i, _)| *i == index) {
                    call.arguments.push_str(&args);
                }
            }
        }
    }
    let non_empty = |s: String| (!s.is_empty()).then_some(s);
    Parsed {
        reasoning: non_empty(reasoning),
        content: non_empty(content),
        tool_calls: calls.into_iter().map(|(_, c)| c).collect(),
    }
}

/// True when the rendered prompt leaves a `<think>` open (last `<think>` after the last
/// `</think>`), i.e. generation starts inside the reasoning.
pub fn prompt_opens_think(prompt: &str) -> bool {
    match (prompt.rfind(THINK_OPEN), prompt.rfind(THINK_CLOSE)) {
        (Some(open), Some(close)) => open > close,
        (Some(_), None) => true,
        (None, _) => false,
    }
}

/// Where the parser is in the output.
enum State {
    /// Inside `<think>`. `at_start`: no reasoning character seen yet (leading newlines are dropped
    /// and a repeated `<think>` is swallowed).
    Reasoning { at_start: bool },
    /// Answer text. `at_start`: nothing but newlines seen yet (they are dropped; `<think>` may open).
    Content { at_start: bool },
    /// After `<tool_call>`, waiting for `<function=NAME>`. Nothing is consumed until it is
    /// complete, so malformed markup can be sent back verbatim; `ws_before` is the content
    /// whitespace held before the tag (dropped if this really is a call).
    CallOpen { ws_before: String },
    /// Inside a started call, between parameters.
    CallBody,
    /// Inside `<parameter=KEY>`.
    Param(Param),
    /// After `</function>`, expecting `</tool_call>`.
    AfterFunction,
    /// After a call: blank text is dropped, `<tool_call>` starts the next call, anything else is
    /// content.
    AfterCall,
}

/// The parameter being generated.
struct Param {
    /// The key, already as a JSON string literal.
    key: String,
    /// Declared JSON schema types; empty when unknown.
    types: Vec<String>,
    /// Type is exactly "string": characters are sent as they arrive.
    streaming: bool,
    /// The first character was seen (and a leading '\n' dropped).
    started: bool,
    /// One '\n' held back: it is dropped if `</parameter>` follows it.
    pending_nl: bool,
    /// The value so far (non-streaming parameters only).
    value: String,
}

/// Parses one generation. Feed it with [`push`](Self::push), end it with [`finish`](Self::finish)
/// (once; the parser is spent afterwards).
pub struct OutputParser {
    state: State,
    /// Text received but not yet consumed (a possible partial tag, a name being generated, ...).
    buf: String,
    /// `finish` was called: no more text will come, held-back text must be resolved.
    eof: bool,
    parse_tools: bool,
    /// Tool name → parameter name → declared types.
    schemas: HashMap<String, HashMap<String, Vec<String>>>,
    seed: u64,
    /// A think block was opened (in the prompt or by the model): `<think>` is text from now on.
    think_seen: bool,
    /// Trailing newlines of the reasoning held back.
    pending_nl: usize,
    /// Trailing whitespace of the content held back (only when tool calls are parsed).
    pending_ws: String,
    /// Tool calls started so far; the current one has index `calls - 1`.
    calls: usize,
    /// Name of the current call's function.
    tool: String,
    /// Parameters of the current call already written into its arguments (for the commas).
    params_done: usize,
    out: Vec<Part>,
}

impl OutputParser {
    /// `in_reasoning`: generation starts inside `<think>` (see [`prompt_opens_think`]).
    /// `tools`: the request's tool list (for argument types), or None. `parse_tools`: false when
    /// tool_choice is "none" or no tools were given; then `<tool_call>` text stays content.
    /// `seed`: tool call ids are a deterministic function of (seed, index), so one seed per request.
    pub fn new(in_reasoning: bool, tools: Option<&Value>, parse_tools: bool, seed: u64) -> Self {
        OutputParser {
            state: if in_reasoning {
                State::Reasoning { at_start: true }
            } else {
                State::Content { at_start: true }
            },
            buf: String::new(),
            eof: false,
            parse_tools,
            schemas: tools.map(tool_schemas).unwrap_or_default(),
            seed,
            think_seen: in_reasoning,
            pending_nl: 0,
            pending_ws: String::new(),
            calls: 0,
            tool: String::new(),
            params_done: 0,
            out: Vec::new(),
        }
    }

    /// Feeds the next piece of generated text; returns the parts it completes.
    pub fn push(&mut self, text: &str) -> Vec<Part> {
        self.buf.push_str(text);
        while self.step() {}
        std::mem::take(&mut self.out)
    }

    /// End of generation: flush everything held back (see the module header for cut-off output).
    pub fn finish(&mut self) -> Vec<Part> {
        self.eof = true;
        while self.step() {}
        // Trailing reasoning newlines are dropped (the template rstrips them); trailing content
        // whitespace was only held in case a call followed.
        self.pending_nl = 0;
        let ws = std::mem::take(&mut self.pending_ws);
        self.emit(Part::Content(ws));
        std::mem::take(&mut self.out)
    }

    /// Number of tool calls started so far.
    pub fn tool_calls_seen(&self) -> usize {
        self.calls
    }

    /// One move of the state machine. Returns false when it needs more text (or, after `finish`,
    /// when everything is consumed).
    fn step(&mut self) -> bool {
        let state = std::mem::replace(&mut self.state, State::AfterCall);
        let (next, progress) = match state {
            State::Reasoning { at_start } => self.step_reasoning(at_start),
            State::Content { at_start } => self.step_content(at_start),
            State::CallOpen { ws_before } => self.step_call_open(ws_before),
            State::CallBody => self.step_call_body(),
            State::Param(p) => self.step_param(p),
            State::AfterFunction => self.step_after_function(),
            State::AfterCall => self.step_after_call(),
        };
        self.state = next;
        progress
    }

    fn step_reasoning(&mut self, mut at_start: bool) -> (State, bool) {
        if at_start {
            self.drop_leading(|c| c == '\n');
            if self.buf.is_empty() {
                return (State::Reasoning { at_start }, false);
            }
            if self.buf.starts_with(THINK_OPEN) {
                self.take(THINK_OPEN.len());
                return (State::Reasoning { at_start }, true);
            }
            if !self.eof && THINK_OPEN.starts_with(self.buf.as_str()) {
                return (State::Reasoning { at_start }, false);
            }
            at_start = false;
        }
        match scan(&self.buf, &[THINK_CLOSE]) {
            Scan::Found(pos, tag) => {
                let text = self.take(pos);
                self.emit_reasoning(&text);
                self.pending_nl = 0;
                self.take(tag.len());
                (State::Content { at_start: true }, true)
            }
            Scan::Partial(safe) => {
                let text = self.take(if self.eof { self.buf.len() } else { safe });
                self.emit_reasoning(&text);
                (State::Reasoning { at_start }, false)
            }
        }
    }

    fn step_content(&mut self, mut at_start: bool) -> (State, bool) {
        if at_start {
            self.drop_leading(|c| c == '\n');
            if self.buf.is_empty() {
                return (State::Content { at_start }, false);
            }
            if !self.think_seen {
                if self.buf.starts_with(THINK_OPEN) {
                    self.take(THINK_OPEN.len());
                    self.think_seen = true;
                    return (State::Reasoning { at_start: true }, true);
                }
                if !self.eof && THINK_OPEN.starts_with(self.buf.as_str()) {
                    return (State::Content { at_start }, false);
                }
            }
            at_start = false;
        }
        if !self.parse_tools {
            let text = std::mem::take(&mut self.buf);
            self.emit_content(&text);
            return (State::Content { at_start }, false);
        }
        match scan(&self.buf, &[TOOL_CALL_OPEN]) {
            Scan::Found(pos, tag) => {
                let text = self.take(pos);
                self.emit_content(&text);
                self.take(tag.len());
                let ws_before = std::mem::take(&mut self.pending_ws);
                (State::CallOpen { ws_before }, true)
            }
            Scan::Partial(safe) => {
                let text = self.take(if self.eof { self.buf.len() } else { safe });
                self.emit_content(&text);
                (State::Content { at_start }, false)
            }
        }
    }

    fn step_call_open(&mut self, ws_before: String) -> (State, bool) {
        let blank = self.buf.len() - self.buf.trim_start().len();
        let rest = &self.buf[blank..];
        let mut name = None;
        if let Some(after) = rest.strip_prefix(FUNCTION_OPEN) {
            match parse_name(after) {
                Name::Done(n, used) => name = Some((n, blank + FUNCTION_OPEN.len() + used)),
                Name::NeedMore if !self.eof => return (State::CallOpen { ws_before }, false),
                _ => {}
            }
        } else if !self.eof && FUNCTION_OPEN.starts_with(rest) {
            return (State::CallOpen { ws_before }, false);
        }
        let Some((name, used)) = name else {
            // Not a call: the tag is text; what followed it is scanned again as content.
            self.emit_content(&format!("{ws_before}{TOOL_CALL_OPEN}"));
            return (State::Content { at_start: false }, true);
        };
        self.take(used);
        let index = self.calls;
        self.calls += 1;
        self.params_done = 0;
        self.emit(Part::ToolCallStart {
            index,
            id: call_id(self.seed, index),
            name: name.clone(),
        });
        self.tool = name;
        self.emit_args("{");
        (State::CallBody, true)
    }

    fn step_call_body(&mut self) -> (State, bool) {
        self.drop_leading(char::is_whitespace);
        if let Some(after) = self.buf.strip_prefix(PARAM_OPEN) {
            match parse_name(after) {
                Name::Done(name, used) => {
                    self.take(PARAM_OPEN.len() + used);
                    return (State::Param(self.open_param(&name)), true);
                }
                Name::NeedMore if !self.eof => return (State::CallBody, false),
                Name::NeedMore => {
                    // Cut inside the tag: markup, dropped.
                    self.buf.clear();
                    self.emit_args("}");
                    return (State::AfterCall, true);
                }
                Name::Invalid => {} // not a parameter: stray text, below
            }
        } else if self.buf.starts_with(FUNCTION_CLOSE) {
            self.take(FUNCTION_CLOSE.len());
            self.emit_args("}");
            return (State::AfterFunction, true);
        } else if self.buf.starts_with(TOOL_CALL_CLOSE) {
            // `</function>` forgotten: the call still ends here.
            self.take(TOOL_CALL_CLOSE.len());
            self.emit_args("}");
            return (State::AfterCall, true);
        } else if [PARAM_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE]
            .iter()
            .any(|t| t.starts_with(self.buf.as_str()))
        {
            if !self.eof {
                return (State::CallBody, false);
            }
            self.buf.clear(); // a partial tag at the cut: markup, dropped
            self.emit_args("}");
            return (State::AfterCall, true);
        }
        // Text that is not markup: the call is over (it keeps what it has) and the text is content.
        self.emit_args("}");
        (State::Content { at_start: false }, true)
    }

    fn open_param(&mut self, name: &str) -> Param {
        let types = self
            .schemas
            .get(&self.tool)
            .and_then(|params| params.get(name))
            .cloned()
            .unwrap_or_default();
        let streaming = types.len() == 1 && types[0] == "string";
        let key = Value::String(name.to_string()).to_string();
        if streaming {
            // The key and the opening quote go out now; the characters follow as they arrive.
            let comma = if self.params_done > 0 { "," } else { "" };
            self.params_done += 1;
            self.emit_args(&format!("{comma}{key}:\""));
        }
        Param {
            key,
            types,
            streaming,
            started: false,
            pending_nl: false,
            value: String::new(),
        }
    }

    fn step_param(&mut self, mut p: Param) -> (State, bool) {
        if !p.started {
            if self.buf.is_empty() && !self.eof {
                return (State::Param(p), false);
            }
            if self.buf.starts_with('\n') {
                self.take(1);
            }
            p.started = true;
        }
        match scan(&self.buf, &[PARAM_CLOSE]) {
            Scan::Found(pos, tag) => {
                let text = self.take(pos);
                self.take(tag.len());
                self.param_text(&mut p, &text, true);
                self.close_param(p, true);
                (State::CallBody, true)
            }
            Scan::Partial(safe) => {
                let text = self.take(safe);
                if !self.eof {
                    self.param_text(&mut p, &text, false);
                    return (State::Param(p), false);
                }
                // Cut inside the value: a partial `</parameter>` is markup, dropped.
                self.buf.clear();
                self.param_text(&mut p, &text, true);
                self.close_param(p, false);
                self.emit_args("}");
                (State::AfterCall, true)
            }
        }
    }

    /// Adds value text; `last`: nothing more follows, so the trailing '\n' is dropped for good.
    fn param_text(&mut self, p: &mut Param, text: &str, last: bool) {
        let mut t = String::with_capacity(text.len() + 1);
        if std::mem::take(&mut p.pending_nl) {
            t.push('\n');
        }
        t.push_str(text);
        if t.ends_with('\n') {
            t.pop();
            p.pending_nl = !last;
        }
        if p.streaming {
            if !t.is_empty() {
                let quoted = Value::String(t).to_string();
                self.emit_args(&quoted[1..quoted.len() - 1]);
            }
        } else {
            p.value.push_str(&t);
        }
    }

    /// Writes the parameter into the arguments; `complete`: `</parameter>` was seen.
    fn close_param(&mut self, p: Param, complete: bool) {
        if p.streaming {
            self.emit_args("\"");
            return;
        }
        let (value, typed) = convert(&p.value, &p.types);
        if complete || typed {
            let comma = if self.params_done > 0 { "," } else { "" };
            self.params_done += 1;
            self.emit_args(&format!("{comma}{}:{value}", p.key));
        }
    }

    fn step_after_function(&mut self) -> (State, bool) {
        self.drop_leading(char::is_whitespace);
        if self.buf.starts_with(TOOL_CALL_CLOSE) {
            self.take(TOOL_CALL_CLOSE.len());
            return (State::AfterCall, true);
        }
        if TOOL_CALL_CLOSE.starts_with(self.buf.as_str()) {
            if !self.eof {
                return (State::AfterFunction, false);
            }
            self.buf.clear(); // partial tag at the cut: markup
            return (State::AfterCall, false);
        }
        // `</tool_call>` forgotten: what follows is content.
        (State::Content { at_start: false }, true)
    }

    fn step_after_call(&mut self) -> (State, bool) {
        self.drop_leading(char::is_whitespace);
        if self.buf.starts_with(TOOL_CALL_OPEN) {
            self.take(TOOL_CALL_OPEN.len());
            return (
                State::CallOpen {
                    ws_before: String::new(),
                },
                true,
            );
        }
        if self.buf.is_empty() || (!self.eof && TOOL_CALL_OPEN.starts_with(self.buf.as_str())) {
            return (State::AfterCall, false);
        }
        (State::Content { at_start: false }, true)
    }

    /// Removes and returns the first `n` bytes of the buffer.
    fn take(&mut self, n: usize) -> String {
        self.buf.drain(..n).collect()
    }

    fn drop_leading(&mut self, f: impl Fn(char) -> bool) {
        let n = self.buf.len() - self.buf.trim_start_matches(f).len();
        self.buf.drain(..n);
    }

    /// Reasoning text, holding its trailing newlines back (see the module header).
    fn emit_reasoning(&mut self, text: &str) {
        let body = text.trim_end_matches('\n');
        if body.is_empty() {
            self.pending_nl += text.len();
            return;
        }
        let mut s = "\n".repeat(self.pending_nl);
        s.push_str(body);
        self.pending_nl = text.len() - body.len();
        self.emit(Part::Reasoning(s));
    }

    /// Content text; with tool parsing on, its trailing whitespace is held back because it is
    /// dropped if a call follows.
    fn emit_content(&mut self, text: &str) {
        if !self.parse_tools {
            self.emit(Part::Content(text.to_string()));
            return;
        }
        let body = text.trim_end();
        if body.is_empty() {
            self.pending_ws.push_str(text);
            return;
        }
        let mut s = std::mem::take(&mut self.pending_ws);
        s.push_str(body);
        self.pending_ws = text[body.len()..].to_string();
        self.emit(Part::Content(s));
    }

    fn emit_args(&mut self, args: &str) {
        let index = self.calls - 1;
        self.emit(Part::ToolCallArgs {
            index,
            args: args.to_string(),
        });
    }

    /// Appends a part, merging it into the previous one of the same kind.
    fn emit(&mut self, part: Part) {
        match (self.out.last_mut(), part) {
            (_, Part::Reasoning(s) | Part::Content(s) | Part::ToolCallArgs { args: s, .. })
                if s.is_empty() => {}
            (Some(Part::Reasoning(a)), Part::Reasoning(b))
            | (Some(Part::Content(a)), Part::Content(b)) => a.push_str(&b),
            (
                Some(Part::ToolCallArgs { index: i, args: a }),
                Part::ToolCallArgs { index: j, args: b },
            ) if *i == j => a.push_str(&b),
            (_, part) => self.out.push(part),
        }
    }
}

enum Scan {
    /// The earliest complete tag: its byte position and which one.
    Found(usize, &'static str),
    /// No complete tag; the text up to this byte offset cannot be part of one (the rest might
    /// still become one and is held back).
    Partial(usize),
}

fn scan(buf: &str, tags: &[&'static str]) -> Scan {
    let found = tags
        .iter()
        .filter_map(|t| buf.find(t).map(|p| (p, *t)))
        .min_by_key(|(p, _)| *p);
    if let Some((pos, tag)) = found {
        return Scan::Found(pos, tag);
    }
    let mut safe = buf.len();
    for tag in tags {
        // The longest suffix of `buf` that is a proper prefix of `tag`.
        for i in buf.len().saturating_sub(tag.len() - 1)..buf.len() {
            if buf.is_char_boundary(i) && tag.starts_with(&buf[i..]) {
                safe = safe.min(i);
                break;
            }
        }
    }
    Scan::Partial(safe)
}

enum Name {
    /// The trimmed name and the bytes used, `>` included.
    Done(String, usize),
    NeedMore,
    Invalid,
}

/// The `NAME>` part of `<function=NAME>` / `<parameter=NAME>`.
fn parse_name(s: &str) -> Name {
    match s.find(['>', '<', '\n']) {
        Some(i) if s.as_bytes()[i] == b'>' && i <= MAX_NAME => {
            let name = s[..i].trim();
            if name.is_empty() {
                Name::Invalid
            } else {
                Name::Done(name.to_string(), i + 1)
            }
        }
        None if s.len() <= MAX_NAME => Name::NeedMore,
        _ => Name::Invalid,
    }
}

/// Tool name → parameter name → declared types, from OpenAI tool objects
/// (`{"type":"function","function":{"name","parameters"}}`) or bare `{"name","parameters"}`.
fn tool_schemas(tools: &Value) -> HashMap<String, HashMap<String, Vec<String>>> {
    let list: Vec<&Value> = match tools {
        Value::Array(a) => a.iter().collect(),
        one => vec![one],
    };
    let mut out = HashMap::new();
    for tool in list {
        let f = tool.get("function").unwrap_or(tool);
        let Some(name) = f.get("name").and_then(Value::as_str) else {
            continue;
        };
        let props = f
            .get("parameters")
            .and_then(|p| p.get("properties"))
            .and_then(Value::as_object);
        let params = props
            .map(|props| {
                props
                    .iter()
                    .map(|(k, s)| (k.clone(), schema_types(s)))
                    .collect()
            })
            .unwrap_or_default();
        out.insert(name.to_string(), params);
    }
    out
}

/// The types a parameter schema allows: `"type"` as a string or a list, else the union over
/// `anyOf`/`oneOf` alternatives. Empty means unknown (an alternative without a type makes the
/// whole union unknown, since it could be anything).
fn schema_types(schema: &Value) -> Vec<String> {
    match schema.get("type") {
        Some(Value::String(t)) => return vec![t.clone()],
        Some(Value::Array(ts)) => {
            return ts
                .iter()
                .filter_map(Value::as_str)
                .map(String::from)
                .collect()
        }
        _ => {}
    }
    let mut types = Vec::new();
    for key in ["anyOf", "oneOf"] {
        for alt in schema
            .get(key)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let alt_types = schema_types(alt);
            if alt_types.is_empty() {
                return Vec::new();
            }
            for t in alt_types {
                if !types.contains(&t) {
                    types.push(t);
                }
            }
        }
    }
    types
}

/// Converts a parameter value to JSON by its declared types; also says whether the result matches
/// one of them (false only for a typed parameter that fell back to a string).
///
/// Non-string types are tried in the declared order on the trimmed text: "integer" (i64/u64),
/// "number" (integer text stays an integer, else a finite f64), "boolean" (true/false, any case),
/// "object"/"array" (JSON of that kind), "null" (`null` or Python's `None`); then "string" takes the
/// text as is. Nothing fitting: the text as a string. Unknown type (absent, unknown parameter or
/// tool): the text stays a string unless it is a JSON object or array — conservative, because a
/// free-form answer like `42` or `true` may well have been meant as text.
fn convert(text: &str, types: &[String]) -> (Value, bool) {
    let t = text.trim();
    let int = || {
        t.parse::<i64>()
            .map(Value::from)
            .ok()
            .or_else(|| t.parse::<u64>().map(Value::from).ok())
    };
    for ty in types {
        let v = match ty.as_str() {
            "integer" => int(),
            "number" => int().or_else(|| {
                t.parse::<f64>()
                    .ok()
                    .and_then(serde_json::Number::from_f64)
                    .map(Value::Number)
            }),
            "boolean" if t.eq_ignore_ascii_case("true") => Some(Value::Bool(true)),
            "boolean" if t.eq_ignore_ascii_case("false") => Some(Value::Bool(false)),
            "object" => serde_json::from_str::<Value>(t)
                .ok()
                .filter(Value::is_object),
            "array" => serde_json::from_str::<Value>(t)
                .ok()
                .filter(Value::is_array),
            "null" if t == "null" || t == "None" => Some(Value::Null),
            _ => None,
        };
        if let Some(v) = v {
            return (v, true);
        }
    }
    if types.is_empty() {
        if let Ok(v @ (Value::Object(_) | Value::Array(_))) = serde_json::from_str::<Value>(t) {
            return (v, true);
        }
        return (Value::String(text.to_string()), true);
    }
    (
        Value::String(text.to_string()),
        types.iter().any(|t| t == "string"),
    )
}

/// `call_` + 24 alphanumeric characters, a deterministic function of (seed, index).
fn call_id(seed: u64, index: usize) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    // splitmix64: mixing the index before combining keeps (seed, index) pairs from colliding in
    // practice, and the stream gives well spread characters.
    fn mix(mut z: u64) -> u64 {
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut state = mix(seed ^ mix((index as u64).wrapping_add(GOLDEN)));
    let mut id = String::from("call_");
    for _ in 0..24 {
        state = state.wrapping_add(GOLDEN);
        id.push(ALPHABET[(mix(state) % ALPHABET.len() as u64) as usize] as char);
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools() -> Value {
        json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "temp": {"type": "number"},
                "metric": {"type": "boolean"},
                "opts": {"type": "object"},
                "tags": {"type": "array"},
                "nothing": {"type": "null"},
                "maybe": {"type": ["integer", "null"]},
                "either": {"anyOf": [{"type": "number"}, {"type": "string"}]},
                "free": {"description": "no type"}
            }}}},
            {"name": "run_code", "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}
        ])
    }

    /// Runs the whole text through one parser in the given pieces.
    fn run_pieces(pieces: &[&str], in_reasoning: bool, parse_tools: bool) -> Vec<Part> {
        let tools = tools();
        let mut p = OutputParser::new(in_reasoning, Some(&tools), parse_tools, 7);
        let mut parts = Vec::new();
        for piece in pieces {
            parts.extend(p.push(piece));
        }
        parts.extend(p.finish());
        parts
    }

    fn parse(text: &str, in_reasoning: bool) -> Parsed {
        collect(run_pieces(&[text], in_reasoning, true))
    }

    fn args(p: &Parsed, i: usize) -> Value {
        serde_json::from_str(&p.tool_calls[i].arguments).unwrap_or_else(|e| {
            panic!(
                "arguments {:?} are not JSON: {e}",
                p.tool_calls[i].arguments
            )
        })
    }

    fn call(name: &str, params: &[(&str, &str)]) -> String {
        let mut s = format!("<tool_call>\n<function={name}>\n");
        for (k, v) in params {
            s.push_str(&format!("<parameter={k}>\n{v}\n</parameter>\n"));
        }
        s + "</function>\n</tool_call>"
    }

    /// Representative outputs: (text, in_reasoning).
    fn samples() -> Vec<(String, bool)> {
        let weather = call("get_weather", &[("city", "Paris"), ("days", "3")]);
        let code = call(
            "run_code",
            &[("code", "if a < b:\n    print(\"</think> é 日本\")\n")],
        );
        vec![
            ("Let me think.\n\nStep 2.\n</think>\n\nThe answer is 4.".into(), true),
            ("\n\nplain answer, no think\n".into(), false),
            ("<think>\nmodel opened it\n</think>\n\nanswer".into(), false),
            (format!("hmm\n</think>\n\nI'll check.\n\n{weather}\n{code}\n"), true),
            (format!("{weather}\n\ntrailing text é"), false),
            ("<tool_call>\nnot a function</tool_call> then <tool_c".into(), false),
            ("cut reasoning\n\n</thi".into(), true),
            ("a\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nLon".into(), true),
            (
                "<tool_call>\n<function=get_weather>\n<parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n\
                 <parameter=days>\n1"
                    .into(),
                false,
            ),
            ("<tool_call><tool_call>\n<function=run_code>\nstray\n</function>".into(), false),
            ("\n<thin \n\n<tool_call>\n<function=get_weather>\n<parameter=temp>\n-1.5\n</parameter>\n</tool_call>".into(), false),
        ]
    }

    #[test]
    fn thinking_on() {
        let p = parse("Let me think.\nMore.\n\n</think>\n\nThe answer is 4.", true);
        assert_eq!(p.reasoning.as_deref(), Some("Let me think.\nMore."));
        assert_eq!(p.content.as_deref(), Some("The answer is 4."));
        assert!(p.tool_calls.is_empty());
    }

    #[test]
    fn thinking_off() {
        let p = parse("Hello there.", false);
        assert_eq!(
            p,
            Parsed {
                reasoning: None,
                content: Some("Hello there.".into()),
                tool_calls: vec![]
            }
        );
        // Empty reasoning (thinking on, closed at once) is None, like the template's split.
        let p = parse("\n</think>\n\nHi", true);
        assert_eq!((p.reasoning, p.content.as_deref()), (None, Some("Hi")));
    }

    #[test]
    fn model_opens_think_at_content_start() {
        let p = parse("\n<think>\nhmm\n</think>\n\nHi", false);
        assert_eq!(
            (p.reasoning.as_deref(), p.content.as_deref()),
            (Some("hmm"), Some("Hi"))
        );
        // Elsewhere `<think>` is text, and so is a stray `</think>` in content.
        let p = parse("a <think> b </think> c", false);
        assert_eq!(
            (p.reasoning, p.content.as_deref()),
            (None, Some("a <think> b </think> c"))
        );
        // A repeated `<think>` at the start of the reasoning is swallowed.
        let p = parse("<think>\nr\n</think>c", true);
        assert_eq!(
            (p.reasoning.as_deref(), p.content.as_deref()),
            (Some("r"), Some("c"))
        );
    }

    #[test]
    fn unterminated_reasoning() {
        let p = parse("thinking about it\n\n", true);
        assert_eq!(
            (p.reasoning.as_deref(), p.content),
            (Some("thinking about it"), None)
        );
        // A partial tag at the cut is text.
        let p = parse("thinking\n</thi", true);
        assert_eq!(p.reasoning.as_deref(), Some("thinking\n</thi"));
        // Tool calls are never parsed inside the reasoning.
        let text = call("get_weather", &[("city", "Paris")]);
        let p = parse(&text, true);
        assert_eq!(
            (p.reasoning.as_deref(), p.tool_calls.len()),
            (Some(text.as_str()), 0)
        );
    }

    #[test]
    fn streams_without_needless_holding() {
        let tools = tools();
        let mut p = OutputParser::new(true, Some(&tools), true, 1);
        assert_eq!(
            p.push("Some reasoning"),
            vec![Part::Reasoning("Some reasoning".into())]
        );
        // Newlines and a possible tag are held...
        assert_eq!(p.push("\n</th"), vec![]);
        // ...and the newline dropped once `</think>` completes.
        assert_eq!(p.push("ink>\n\nAns"), vec![Part::Content("Ans".into())]);
        assert_eq!(p.push("wer. <"), vec![Part::Content("wer.".into())]);
        assert_eq!(p.push("b>"), vec![Part::Content(" <b>".into())]);
        // A string parameter streams its characters before `</parameter>`.
        let parts = p.push("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar");
        let id = call_id(1, 0);
        assert_eq!(
            parts,
            vec![
                Part::ToolCallStart {
                    index: 0,
                    id,
                    name: "get_weather".into()
                },
                Part::ToolCallArgs {
                    index: 0,
                    args: "{\"city\":\"Par".into()
                },
            ]
        );
        let args = |s: &str| {
            vec![Part::ToolCallArgs {
                index: 0,
                args: s.into(),
            }]
        };
        assert_eq!(p.push("is\n"), args("is"));
        // The held '\n' was the value's last: dropped. A non-string value waits for its close.
        assert_eq!(
            p.push("</parameter>\n<parameter=days>\n3\n</par"),
            args("\"")
        );
        assert_eq!(p.push("ameter>\n</function>"), args(",\"days\":3}"));
        assert_eq!(p.push("\n</tool_call>\n"), vec![]);
        assert_eq!(p.finish(), vec![]);
        assert_eq!(p.tool_calls_seen(), 1);
    }

    #[test]
    fn piece_by_piece_equivalence() {
        let mut rng = 0x1234_5678_9abc_def0_u64;
        for (text, in_reasoning) in samples() {
            for parse_tools in [true, false] {
                let whole = run_pieces(&[&text], in_reasoning, parse_tools);
                let expected = collect(whole);
                let chars: Vec<&str> = text
                    .char_indices()
                    .map(|(i, c)| &text[i..i + c.len_utf8()])
                    .collect();
                let one = collect(run_pieces(&chars, in_reasoning, parse_tools));
                assert_eq!(one, expected, "1-char pieces of {text:?}");
                for _ in 0..50 {
                    let mut pieces = Vec::new();
                    let mut start = 0;
                    while start < text.len() {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        let mut end = (start + 1 + (rng % 12) as usize).min(text.len());
                        while !text.is_char_boundary(end) {
                            end += 1;
                        }
                        pieces.push(&text[start..end]);
                        start = end;
                    }
                    let parts = run_pieces(&pieces, in_reasoning, parse_tools);
                    let got = collect(parts);
                    assert_eq!(got, expected, "pieces {pieces:?}");
                    for (i, c) in got.tool_calls.iter().enumerate() {
                        assert!(
                            serde_json::from_str::<Value>(&c.arguments).is_ok(),
                            "call {i}: {}",
                            c.arguments
                        );
                    }
                }
                if !parse_tools {
                    assert!(expected.tool_calls.is_empty());
                }
            }
        }
    }

    #[test]
    fn multiple_calls_and_text_before() {
        let text = format!(
            "r\n</think>\n\nI'll check both.\n\n{}\n{}\n",
            call("get_weather", &[("city", "Paris"), ("days", "3")]),
            call("get_weather", &[("city", "Rome")])
        );
        let p = parse(&text, true);
        assert_eq!(p.reasoning.as_deref(), Some("r"));
        assert_eq!(p.content.as_deref(), Some("I'll check both."));
        assert_eq!(p.tool_calls.len(), 2);
        assert_eq!(p.tool_calls[0].arguments, r#"{"city":"Paris","days":3}"#);
        assert_eq!(p.tool_calls[1].arguments, r#"{"city":"Rome"}"#);
        assert_eq!(p.tool_calls[1].name, "get_weather");
        assert_ne!(p.tool_calls[0].id, p.tool_calls[1].id);
        // Content after the calls is content again.
        let p = parse(
            &format!("{}\n\nDone.", call("run_code", &[("code", "x")])),
            false,
        );
        assert_eq!(
            (p.content.as_deref(), p.tool_calls.len()),
            (Some("Done."), 1)
        );
    }

    #[test]
    fn schema_conversions() {
        let cases: &[(&str, &str, Value)] = &[
            ("city", "  Paris  ", json!("  Paris  ")),
            ("city", "42", json!("42")),
            ("days", " 3 ", json!(3)),
            ("days", "three", json!("three")),
            (
                "days",
                "18446744073709551615",
                json!(18446744073709551615u64),
            ),
            ("temp", "3", json!(3)),
            ("temp", "-2.5", json!(-2.5)),
            ("temp", "1e3", json!(1000.0)),
            ("temp", "NaN", json!("NaN")),
            ("temp", "warm", json!("warm")),
            ("metric", "True", json!(true)),
            ("metric", "false", json!(false)),
            ("metric", "yes", json!("yes")),
            ("opts", "{\"a\": {\"b\": [1]}}", json!({"a": {"b": [1]}})),
            ("opts", "[1]", json!("[1]")),
            ("opts", "{broken", json!("{broken")),
            ("tags", "[\"x\", 2]", json!(["x", 2])),
            ("tags", "x, y", json!("x, y")),
            ("nothing", "None", json!(null)),
            ("nothing", "null", json!(null)),
            ("maybe", "7", json!(7)),
            ("maybe", "null", json!(null)),
            ("maybe", "n/a", json!("n/a")),
            ("either", "1.5", json!(1.5)),
            ("either", "abc", json!("abc")),
            ("free", "42", json!("42")),
            ("free", "true", json!("true")),
            ("free", "{\"k\": 1}", json!({"k": 1})),
            ("free", "[1, 2]", json!([1, 2])),
            ("unknown_param", "hello", json!("hello")),
            ("unknown_param", "[true]", json!([true])),
        ];
        for (key, value, want) in cases {
            let p = parse(&call("get_weather", &[(key, value)]), false);
            assert_eq!(args(&p, 0), json!({ *key: want }), "{key} = {value:?}");
        }
        // Unknown tool: every parameter is untyped.
        let p = parse(&call("other", &[("n", "5"), ("o", "{}")]), false);
        assert_eq!(p.tool_calls[0].arguments, r#"{"n":"5","o":{}}"#);
    }

    #[test]
    fn value_newlines_and_escapes() {
        // Exactly one leading and one trailing newline are markup.
        let v = "\n\tline \"one\"\\\nline two\n";
        let p = parse(&call("run_code", &[("code", v)]), false);
        assert_eq!(args(&p, 0), json!({ "code": v }));
        let p = parse(&call("run_code", &[("code", "")]), false);
        assert_eq!(p.tool_calls[0].arguments, r#"{"code":""}"#);
        // Value written on the tag's line, without newlines.
        let p = parse(
            "<tool_call><function=run_code><parameter=code>x</parameter></function></tool_call>",
            false,
        );
        assert_eq!(p.tool_calls[0].arguments, r#"{"code":"x"}"#);
    }

    #[test]
    fn think_close_inside_param() {
        let text = format!(
            "r</think>\n\n{}",
            call("run_code", &[("code", "x</think>\n<think>y")])
        );
        let p = parse(&text, true);
        assert_eq!(
            (p.reasoning.as_deref(), p.content.as_deref()),
            (Some("r"), None)
        );
        assert_eq!(args(&p, 0), json!({"code": "x</think>\n<think>y"}));
    }

    #[test]
    fn malformed_markup_is_content() {
        for text in [
            "<tool_call>\nhello</tool_call>",
            "Text <tool_call> and <tool_call>\n<function=a\nb>",
            "<tool_call>\n<function=>\n</function></tool_call>",
            "ends with <tool_call>\n<function=get_wea",
            "ends with <tool_call>\n",
            "ends with <tool_c",
        ] {
            let p = parse(text, false);
            assert_eq!(
                (p.content.as_deref(), p.tool_calls.len()),
                (Some(text), 0),
                "{text:?}"
            );
        }
        // A valid call right after a malformed tag still parses.
        let p = parse(
            &format!("<tool_call>{}", call("run_code", &[("code", "c")])),
            false,
        );
        assert_eq!(p.content.as_deref(), Some("<tool_call>"));
        assert_eq!(p.tool_calls[0].arguments, r#"{"code":"c"}"#);
        // Stray text inside a started call ends it; the text is content.
        let p = parse(
            "<tool_call>\n<function=run_code>\noops <parameter=code>\nc\n</parameter>",
            false,
        );
        assert_eq!(p.tool_calls[0].arguments, "{}");
        assert_eq!(
            p.content.as_deref(),
            Some("oops <parameter=code>\nc\n</parameter>")
        );
        // Forgotten `</function>` or `</tool_call>`.
        let p = parse("<tool_call>\n<function=run_code>\n</tool_call>after", false);
        assert_eq!(
            (p.tool_calls[0].arguments.as_str(), p.content.as_deref()),
            ("{}", Some("after"))
        );
        let p = parse(
            "<tool_call>\n<function=run_code>\n</function>\nafter",
            false,
        );
        assert_eq!(
            (p.tool_calls[0].arguments.as_str(), p.content.as_deref()),
            ("{}", Some("after"))
        );
    }

    #[test]
    fn tools_not_parsed_when_disabled() {
        let text = format!("Sure.\n\n{}", call("run_code", &[("code", "x")]));
        let p = collect(run_pieces(&[&text], false, false));
        assert_eq!(
            (p.content.as_deref(), p.tool_calls.len()),
            (Some(text.as_str()), 0)
        );
        // Without tools at all, calls are still parsed when asked to (all untyped).
        let mut parser = OutputParser::new(false, None, true, 0);
        let mut parts = parser.push(&call("f", &[("n", "1")]));
        parts.extend(parser.finish());
        assert_eq!(collect(parts).tool_calls[0].arguments, r#"{"n":"1"}"#);
    }

    #[test]
    fn unterminated_call() {
        let head = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n";
        // A cut string value is kept; a partial closing tag is dropped.
        let p = parse(&format!("{head}<parameter=city>\nLyon\n</para"), false);
        assert_eq!(
            p.tool_calls[0].arguments,
            r#"{"city":"Paris","city":"Lyon"}"#
        );
        // A cut value that already converts is kept, one that does not is dropped.
        let p = parse(&format!("{head}<parameter=days>\n4"), false);
        assert_eq!(args(&p, 0), json!({"city": "Paris", "days": 4}));
        let p = parse(&format!("{head}<parameter=opts>\n{{\"a\":"), false);
        assert_eq!(args(&p, 0), json!({"city": "Paris"}));
        // Cut inside a structural tag.
        let p = parse(&format!("{head}<parameter=da"), false);
        assert_eq!(args(&p, 0), json!({"city": "Paris"}));
        let p = parse(&format!("{head}</func"), false);
        assert_eq!(args(&p, 0), json!({"city": "Paris"}));
        let p = parse("<tool_call>\n<function=run_code>", false);
        assert_eq!(
            (p.tool_calls[0].arguments.as_str(), p.content),
            ("{}", None)
        );
    }

    #[test]
    fn ids_unique() {
        let mut seen = std::collections::HashSet::new();
        for seed in 0..50u64 {
            for index in 0..50 {
                let id = call_id(seed, index);
                assert_eq!(id.len(), 29);
                assert!(
                    id.starts_with("call_") && id[5..].bytes().all(|b| b.is_ascii_alphanumeric())
                );
                assert!(seen.insert(id));
            }
        }
        assert_eq!(call_id(9, 3), call_id(9, 3));
    }

    #[test]
    fn prompt_think_state() {
        assert!(prompt_opens_think("<|im_start|>assistant\n<think>\n"));
        assert!(!prompt_opens_think(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ));
        assert!(!prompt_opens_think("<|im_start|>assistant\n"));
        assert!(prompt_opens_think(
            "<think>\nold\n</think>\n\nx<|im_start|>assistant\n<think>\n"
        ));
    }
}
