//! Chat template: renders a conversation to the prompt text with the checkpoint's own Jinja
//! template (`chat_template.jinja`, or the `chat_template` field of `tokenizer_config.json`), using
//! minijinja set up the way transformers sets up jinja2 in `apply_chat_template`.
//!
//! Why: the prompt must be byte-identical to what the model was trained on (and to what other
//! engines send), so that outputs match and cached prefixes line up across turns. The reference is
//! transformers 5.x (`utils/chat_template_utils.py`): an `ImmutableSandboxedEnvironment` with
//! `trim_blocks`, `lstrip_blocks` and loop controls; `raise_exception`, `strftime_now`, `namespace`,
//! `dict` globals; a `tojson` filter that is plain `json.dumps(ensure_ascii=False)` (no HTML
//! escaping, Python separators and float repr); the special-token names (`eos_token`, …) plus the
//! caller's kwargs as variables. Python string methods (`.startswith`, `.split`, `.strip`, …) come
//! from minijinja-contrib's pycompat, with `strip`/`split`/`trim` redone on Python's whitespace
//! set; printed values follow Python's `str()` (`None`, `True`, `1e-05`).
//!
//! Before rendering, messages get the same normalization as transformers (keys whose value is null
//! are dropped; `reasoning_content`/`thinking`/`reasoning` are aliased), plus one OpenAI-API step
//! that transformers leaves to the serving layer: tool-call `arguments` given as a JSON string are
//! parsed into an object (the Qwen template iterates them with `|items`). The Python reference
//! renderer `tools/template_ref/render.py` applies the same steps and then calls transformers' own
//! `render_jinja_template`; `tests/template.rs` checks the two agree byte for byte.

use std::fmt;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Rest, Value, ValueKind, ValueOrKwargs};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, State};
use serde_json::{Map, Value as Json};

use super::pyfmt::{self, JsonOpts};

/// A failed render: either the template called `raise_exception(message)` (`raised`), or the
/// template engine failed (a type error, an undefined attribute, a syntax error in the template).
#[derive(Clone, Debug)]
pub struct TemplateError {
    pub message: String,
    pub raised: bool,
}

impl fmt::Display for TemplateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.raised {
            write!(f, "chat template: {}", self.message)
        } else {
            write!(f, "chat template error: {}", self.message)
        }
    }
}

impl std::error::Error for TemplateError {}

/// Source of a `raise_exception` error, to tell it apart from engine errors.
#[derive(Debug)]
struct Raised(String);

impl fmt::Display for Raised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

fn template_error(e: &Error) -> TemplateError {
    let mut src: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = src {
        if let Some(r) = s.downcast_ref::<Raised>() {
            return TemplateError {
                message: r.0.clone(),
                raised: true,
            };
        }
        src = s.source();
    }
    TemplateError {
        message: e.to_string(),
        raised: false,
    }
}

/// A compiled chat template plus the special-token variables transformers passes to it.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Template names in `env` (`"default"` for a single template; HF names for a named set).
    names: Vec<String>,
    /// `special_tokens_map` of transformers: `eos_token`, `pad_token`, … and the
    /// `extra_special_tokens` names (`image_token`, …), in that order.
    special_tokens: Vec<(String, String)>,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("names", &self.names)
            .field("special_tokens", &self.special_tokens)
            .finish()
    }
}

impl ChatTemplate {
    /// Loads the template of a checkpoint directory: `chat_template.jinja` if present (as
    /// transformers does), else the `chat_template` field of `tokenizer_config.json` (a string,
    /// or a list of `{name, template}`). Special-token variables come from `tokenizer_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: Option<Json> = if cfg_path.exists() {
            let text = std::fs::read_to_string(&cfg_path)
                .with_context(|| format!("{}: cannot read", cfg_path.display()))?;
            Some(
                serde_json::from_str(&text)
                    .with_context(|| format!("{}: not valid JSON", cfg_path.display()))?,
            )
        } else {
            None
        };
        let jinja = dir.join("chat_template.jinja");
        let templates: Vec<(String, String)> = if jinja.exists() {
            vec![(
                "default".into(),
                std::fs::read_to_string(&jinja)
                    .with_context(|| format!("{}: cannot read", jinja.display()))?,
            )]
        } else {
            match cfg.as_ref().and_then(|c| c.get("chat_template")) {
                Some(Json::String(s)) => vec![("default".into(), s.clone())],
                Some(Json::Array(list)) => list
                    .iter()
                    .map(|t| match (t.get("name").and_then(Json::as_str), t.get("template").and_then(Json::as_str)) {
                        (Some(n), Some(s)) => Ok((n.to_string(), s.to_string())),
                        _ => Err(anyhow!("{}: chat_template list entries need `name` and `template`", cfg_path.display())),
                    })
                    .collect::<Result<_>>()?,
                _ => bail!("{}: no chat template (neither chat_template.jinja nor a `chat_template` in tokenizer_config.json)", dir.display()),
            }
        };
        let specials = cfg.as_ref().map(special_tokens_map).unwrap_or_default();
        Self::from_named(templates, specials)
            .with_context(|| format!("{}: chat template", dir.display()))
    }

    /// A single template from source, with no special-token variables.
    pub fn from_source(source: &str) -> Result<Self> {
        Self::from_named(vec![("default".into(), source.to_string())], Vec::new())
    }

    /// Named templates (`default`, `tool_use`, …) and the special-token variables.
    pub fn from_named(
        templates: Vec<(String, String)>,
        special_tokens: Vec<(String, String)>,
    ) -> Result<Self> {
        if templates.is_empty() {
            bail!("no chat template given");
        }
        let mut env = environment()?;
        let mut names = Vec::new();
        for (name, src) in templates {
            env.add_template_owned(name.clone(), src)
                .map_err(|e| anyhow!("template `{name}` does not compile: {e:#}"))?;
            names.push(name);
        }
        Ok(Self {
            env,
            names,
            special_tokens,
        })
    }

    /// The special-token variables (`eos_token`, …) the template sees.
    pub fn special_tokens(&self) -> &[(String, String)] {
        &self.special_tokens
    }

    /// transformers' `get_chat_template`: a single template, or from a named set `tool_use` when
    /// tools are given, else `default`.
    fn pick(&self, has_tools: bool) -> Result<&str> {
        if self.names.len() == 1 {
            return Ok(&self.names[0]);
        }
        if has_tools && self.names.iter().any(|n| n == "tool_use") {
            return Ok("tool_use");
        }
        if self.names.iter().any(|n| n == "default") {
            return Ok("default");
        }
        bail!(
            "the checkpoint has several chat templates ({}) and none is named `default`",
            self.names.join(", ")
        )
    }

    /// Renders a conversation: `messages` is the OpenAI-style array of message objects, `tools` an
    /// optional array of tool schemas, `kwargs` extra template variables (`enable_thinking`,
    /// `preserve_thinking`, …). Errors (bad input, `raise_exception`, engine failures) come back
    /// as `Err` with a [`TemplateError`] inside when the template itself failed.
    pub fn render(
        &self,
        messages: &Json,
        tools: Option<&Json>,
        add_generation_prompt: bool,
        kwargs: &Map<String, Json>,
    ) -> Result<String> {
        let msgs = normalize_messages(messages)?;
        if msgs.is_empty() {
            // transformers refuses before the template runs.
            bail!("cannot apply the chat template to an empty conversation (give at least one message)");
        }
        let tools = match tools {
            None | Some(Json::Null) => None,
            Some(Json::Array(list)) => {
                for (i, t) in list.iter().enumerate() {
                    if !t.is_object() {
                        bail!("tool {i} is not a JSON object (tools are JSON schemas)");
                    }
                }
                Some(list)
            }
            Some(_) => bail!("tools must be a JSON array of tool schemas"),
        };
        for k in ["messages", "tools", "documents", "add_generation_prompt"] {
            if kwargs.contains_key(k) {
                bail!("template kwarg `{k}` is reserved (it is set by the renderer)");
            }
        }
        let mut ctx: Vec<(String, Value)> = Vec::new();
        for (k, v) in &self.special_tokens {
            if !kwargs.contains_key(k) {
                ctx.push((k.clone(), Value::from(v.as_str())));
            }
        }
        for (k, v) in kwargs {
            ctx.push((k.clone(), to_value(v)));
        }
        ctx.push((
            "messages".into(),
            Value::from(msgs.iter().map(to_value).collect::<Vec<_>>()),
        ));
        ctx.push((
            "tools".into(),
            tools
                .map(|t| Value::from(t.iter().map(to_value).collect::<Vec<_>>()))
                .unwrap_or(Value::from(())),
        ));
        ctx.push(("documents".into(), Value::from(())));
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        ));
        let name = self.pick(tools.is_some())?;
        let tmpl = self
            .env
            .get_template(name)
            .map_err(|e| anyhow::Error::new(template_error(&e)))?;
        tmpl.render(Value::from_pairs(ctx))
            .map_err(|e| anyhow::Error::new(template_error(&e)))
    }
}

/// transformers' `special_tokens_map` from a `tokenizer_config.json`: the named special tokens
/// that are set (`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`, `cls_token`,
/// `mask_token`; a string or an `AddedToken` object), then the `extra_special_tokens` names.
pub fn special_tokens_map(cfg: &Json) -> Vec<(String, String)> {
    let content = |v: &Json| match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_string),
        _ => None,
    };
    let mut out: Vec<(String, String)> = Vec::new();
    for k in [
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
    ] {
        if let Some(s) = cfg.get(k).and_then(content) {
            out.push((k.to_string(), s));
        }
    }
    if let Some(Json::Object(extra)) = cfg.get("extra_special_tokens") {
        for (k, v) in extra {
            if let Some(s) = content(v) {
                if let Some(slot) = out.iter_mut().find(|(n, _)| n == k) {
                    slot.1 = s;
                } else {
                    out.push((k.clone(), s));
                }
            }
        }
    }
    out
}

/// The message preprocessing done before rendering (see the module docs): each message must be
/// an object; null-valued keys are dropped; string tool-call arguments are parsed as JSON objects;
/// reasoning is aliased as transformers' `_alias_reasoning_fields` does.
pub fn normalize_messages(messages: &Json) -> Result<Vec<Json>> {
    let list = messages
        .as_array()
        .ok_or_else(|| anyhow!("messages must be a JSON array of message objects"))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let obj = m
            .as_object()
            .ok_or_else(|| anyhow!("message {i} is not a JSON object"))?;
        let mut msg: Map<String, Json> = obj
            .iter()
            .filter(|(_, v)| !v.is_null())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        if let Some(Json::Array(calls)) = msg.get_mut("tool_calls") {
            for (j, call) in calls.iter_mut().enumerate() {
                let target = match call {
                    Json::Object(c) if c.get("function").is_some_and(Json::is_object) => {
                        c.get_mut("function")
                    }
                    c => Some(c),
                };
                if let Some(Json::Object(f)) = target {
                    if let Some(Json::String(s)) = f.get("arguments") {
                        let parsed: Json = serde_json::from_str(s)
                            .map_err(|e| anyhow!("message {i}: tool call {j}: `arguments` is a string but not valid JSON ({e})"))?;
                        if !parsed.is_object() {
                            bail!("message {i}: tool call {j}: `arguments` must be a JSON object");
                        }
                        f.insert("arguments".into(), parsed);
                    }
                }
            }
        }
        let reasoning = ["reasoning_content", "thinking", "reasoning"]
            .iter()
            .find_map(|k| msg.get(*k))
            .cloned();
        if let Some(r) = reasoning {
            let mut aliased = Map::new();
            aliased.insert("thinking".into(), r.clone());
            for (k, v) in msg {
                aliased.insert(k, v);
            }
            aliased.insert("reasoning_content".into(), r);
            msg = aliased;
        }
        out.push(Json::Object(msg));
    }
    Ok(out)
}

/// JSON to a template value (object key order kept; ints stay ints, floats stay floats).
pub fn to_value(v: &Json) -> Value {
    match v {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(a) => Value::from(a.iter().map(to_value).collect::<Vec<_>>()),
        Json::Object(o) => Value::from_pairs(
            o.iter()
                .map(|(k, v)| (Value::from(k.as_str()), to_value(v))),
        ),
    }
}

/// The jinja2 environment of transformers, rebuilt in minijinja.
fn environment() -> Result<Environment<'static>> {
    let mut env = Environment::new();
    env.set_syntax(
        SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| anyhow!("{e}"))?,
    );
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_undefined_behavior(minijinja::UndefinedBehavior::Lenient);
    env.set_recursion_limit(500);
    env.set_unknown_method_callback(py_methods);
    env.set_formatter(|out, _state, value| {
        match value.as_str() {
            Some(s) if value.kind() == ValueKind::String => out.write_str(s),
            _ => out.write_str(&pyfmt::py_str(value)),
        }
        .map_err(|_| Error::new(ErrorKind::WriteFailure, "cannot write template output"))
    });
    env.add_function("raise_exception", |msg: Value| -> Result<Value, Error> {
        let text = pyfmt::py_str(&msg);
        Err(Error::new(ErrorKind::InvalidOperation, text.clone()).with_source(Raised(text)))
    });
    env.add_function("strftime_now", |fmt: String| -> Result<Value, Error> {
        Ok(Value::from(strftime_utc(&fmt)))
    });
    env.add_filter("tojson", tojson);
    env.add_filter("string", |v: Value| -> Value {
        if v.kind() == ValueKind::String {
            v
        } else {
            Value::from(pyfmt::py_str(&v))
        }
    });
    env.add_filter("trim", |v: Value, chars: Option<String>| -> Value {
        let s = pyfmt::py_str(&v);
        Value::from(pyfmt::py_strip(&s, chars.as_deref(), true, true))
    });
    Ok(env)
}

/// Python string methods: `strip`/`lstrip`/`rstrip`/`split` with Python's whitespace set, the rest
/// from minijinja-contrib's pycompat.
fn py_methods(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let (ValueKind::String, Some(s)) = (value.kind(), value.as_str()) {
        let arg = |i: usize| -> Result<Option<String>, Error> {
            match args.get(i) {
                None => Ok(None),
                Some(a) if a.is_none() => Ok(None),
                Some(a) => a.as_str().map(|s| Some(s.to_string())).ok_or_else(|| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        format!("{method}: argument must be a string or None"),
                    )
                }),
            }
        };
        match method {
            "strip" | "lstrip" | "rstrip" => {
                if args.len() > 1 {
                    return Err(Error::new(
                        ErrorKind::TooManyArguments,
                        format!("{method} takes at most 1 argument"),
                    ));
                }
                let chars = arg(0)?;
                let (l, r) = match method {
                    "strip" => (true, true),
                    "lstrip" => (true, false),
                    _ => (false, true),
                };
                return Ok(Value::from(pyfmt::py_strip(s, chars.as_deref(), l, r)));
            }
            "split" => {
                if args.len() > 2 {
                    return Err(Error::new(
                        ErrorKind::TooManyArguments,
                        "split takes at most 2 arguments",
                    ));
                }
                let sep = arg(0)?;
                let max = match args.get(1) {
                    None => -1,
                    Some(v) => v.as_i64().ok_or_else(|| {
                        Error::new(
                            ErrorKind::InvalidOperation,
                            "split: maxsplit must be an integer",
                        )
                    })?,
                };
                return Ok(Value::from(
                    pyfmt::py_split(s, sep.as_deref(), max)?
                        .into_iter()
                        .map(Value::from)
                        .collect::<Vec<_>>(),
                ));
            }
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(value: &Value, args: Rest<ValueOrKwargs>) -> Result<Value, Error> {
    let mut pos: Vec<Value> = args.into_values();
    let kw = match pos.last() {
        Some(v) if v.is_kwargs() => Kwargs::try_from(pos.pop().expect("checked"))
            .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?,
        _ => Kwargs::from_iter(std::iter::empty::<(String, Value)>()),
    };
    if pos.len() > 4 {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments",
        ));
    }
    let mut pos = pos.into_iter();
    let (ensure_ascii, indent, separators, sort_keys) =
        (pos.next(), pos.next(), pos.next(), pos.next());
    let pick = |pos: Option<Value>, name: &str| -> Result<Option<Value>, Error> {
        match pos {
            Some(v) => Ok(Some(v)),
            None => kw.get::<Option<Value>>(name),
        }
    };
    let ensure_ascii = pick(ensure_ascii, "ensure_ascii")?.is_some_and(|v| v.is_true());
    let sort_keys = pick(sort_keys, "sort_keys")?.is_some_and(|v| v.is_true());
    let indent = match pick(indent, "indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => {
            Some(v.as_str().unwrap_or_default().to_string())
        }
        Some(v) if v.kind() == ValueKind::Bool => {
            Some(if v.is_true() { " " } else { "" }.to_string())
        }
        Some(v) => {
            let n = v.as_i64().ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an int or a string",
                )
            })?;
            Some(" ".repeat(n.max(0) as usize))
        }
    };
    let (item_sep, key_sep) = match pick(separators, "separators")? {
        Some(v) if !v.is_none() => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => (
                    a.as_str().unwrap_or_default().to_string(),
                    b.as_str().unwrap_or_default().to_string(),
                ),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ))
                }
            }
        }
        _ => (
            if indent.is_some() { "," } else { ", " }.to_string(),
            ": ".to_string(),
        ),
    };
    kw.assert_all_used()?;
    let opts = JsonOpts {
        ensure_ascii,
        indent,
        item_sep,
        key_sep,
        sort_keys,
    };
    Ok(Value::from(pyfmt::py_json_dumps(value, &opts)?))
}

/// `datetime.now().strftime(fmt)` for the common directives, in UTC (no time-zone database here).
fn strftime_utc(fmt: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (h, mi, s) = (sod / 3600, sod % 3600 / 60, sod % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let d = doy_mar - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let wd = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday (Monday = 0)
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let mut out = String::new();
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('I') => out.push_str(&format!("{:02}", if h % 12 == 0 { 12 } else { h % 12 })),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{mi:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('b') | Some('h') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('A') => out.push_str(DAYS[wd]),
            Some('a') => out.push_str(&DAYS[wd][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raise_exception_is_a_clear_error() {
        let t = ChatTemplate::from_source("{{ raise_exception('boom') }}").unwrap();
        let e = t
            .render(
                &serde_json::json!([{"role": "user", "content": "x"}]),
                None,
                false,
                &Map::new(),
            )
            .unwrap_err();
        let te = e.downcast_ref::<TemplateError>().expect("a TemplateError");
        assert!(te.raised);
        assert_eq!(te.message, "boom");
    }

    #[test]
    fn python_semantics() {
        let t = ChatTemplate::from_source(
            "{{ x|tojson }}|{{ x.a|tojson(indent=2) }}|{{ ' a '.strip() }}|{{ none }}|{{ true }}|{{ 1e-5 }}|{{ 'a,b'.split(',')|length }}",
        )
        .unwrap();
        let mut kw = Map::new();
        kw.insert("x".into(), serde_json::json!({"z": "<é>", "a": [1, 2.0]}));
        let s = t
            .render(
                &serde_json::json!([{"role": "user", "content": "x"}]),
                None,
                false,
                &kw,
            )
            .unwrap();
        assert_eq!(
            s,
            "{\"z\": \"<é>\", \"a\": [1, 2.0]}|[\n  1,\n  2.0\n]|a|None|True|1e-05|2"
        );
    }

    #[test]
    fn strftime_has_fields() {
        let s = strftime_utc("%Y-%m-%d %H:%M:%S %a %b %j %%");
        assert_eq!(s.len(), "2026-11-29 10:00:00 Sun Nov 333 %".len(), "{s}");
    }
}
