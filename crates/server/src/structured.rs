//! Strict tool calls: a Lark grammar (llguidance's dialect) for Qwen's XML tool call, so the
//! call's arguments are typed and valid against the function's schema.
//!
//! The grammar writes the call exactly as the chat template renders one (and as output.rs parses
//! it back):
//!
//! ```text
//! <tool_call>\n<function=NAME>\n
//! <parameter=P>\nVALUE\n</parameter>\n      ← per parameter, in the schema's property order
//! </function>\n</tool_call>
//! ```
//!
//! - A parameter whose schema is a string (`"type": "string"`, or an `enum`/`const` of strings)
//!   is raw text in this format, not JSON: one regex terminal covers the whole parameter,
//!   `<parameter=P>\n` + value + `\n</parameter>\n` (one terminal, so the lexer never has to
//!   guess where a value that may hold newlines ends). The value is an enum's literals, the
//!   schema's `pattern`, or text without `<` (so it cannot hold `</parameter>`) of at most
//!   `maxLength` characters (`minLength` too, when given).
//! - Any other parameter is JSON, through `%json { subschema }` (the root's `$defs` /
//!   `definitions` copied in, so `$ref`s resolve), generated compact.
//! - Required parameters always appear, optional ones may; with `additionalProperties` the
//!   call still only names declared parameters.
//! - Several strict tools (under `tool_choice: required`): one call to any of them.
//!
//! Only for `tool_choice` required or named: with `auto` the model may answer in text, and a
//! grammar cannot leave that choice free without constraining the text too, so strict tools
//! under `auto` are not constrained.

use serde_json::{json, Map, Value};

// JSON inside the grammar takes the engine's layout (compact, no free whitespace).
use lily::runtime::constrain::json_options;

use crate::api::ToolChoice;

fn function(t: &Value) -> &Value {
    t.get("function").unwrap_or(t)
}

fn is_strict(t: &Value) -> bool {
    function(t).get("strict").and_then(Value::as_bool) == Some(true)
}

/// The Lark grammar that forces a strict call, when `tool_choice` asks for a call and the tools
/// it allows are all strict (`None` otherwise: today's forced call start). `Err` names what
/// cannot be expressed.
pub fn strict_call_grammar(
    tools: Option<&Value>,
    choice: &ToolChoice,
) -> Option<Result<String, String>> {
    let list = tools?.as_array()?;
    let chosen: Vec<&Value> = match choice {
        ToolChoice::Required => list.iter().collect(),
        ToolChoice::Named(n) => list
            .iter()
            .filter(|t| function(t).get("name").and_then(Value::as_str) == Some(n.as_str()))
            .take(1)
            .collect(),
        _ => return None,
    };
    if chosen.is_empty() || !chosen.iter().all(|t| is_strict(t)) {
        return None;
    }
    Some(build(&chosen))
}

fn build(tools: &[&Value]) -> Result<String, String> {
    let mut rules = Vec::new();
    let mut alts = Vec::new();
    for (i, t) in tools.iter().enumerate() {
        let f = function(t);
        let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
        if name.is_empty() || name.contains(['>', '<', '\n']) {
            return Err(format!(
                "strict tool {name:?}: a name with '<', '>' or a newline cannot be called in this format"
            ));
        }
        let schema = f.get("parameters").cloned().unwrap_or(json!({}));
        let mut body = vec![lit(&format!("<tool_call>\n<function={name}>\n"))];
        body.extend(params(name, &schema, i, &mut rules)?);
        body.push(lit("</function>\n</tool_call>"));
        alts.push(format!("call{i}"));
        rules.push(format!("call{i}: {}", body.join(" ")));
    }
    let mut g = format!("start: {}\n", alts.join(" | "));
    for r in rules {
        g.push_str(&r);
        g.push('\n');
    }
    Ok(g)
}

/// A Lark string literal (JSON's escapes).
fn lit(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

/// The parameter items of one call, in the schema's order.
fn params(
    tool: &str,
    schema: &Value,
    ti: usize,
    rules: &mut Vec<String>,
) -> Result<Vec<String>, String> {
    let empty = Map::new();
    let props = schema
        .get("properties")
        .and_then(Value::as_object)
        .unwrap_or(&empty);
    let required: Vec<&str> = schema
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if let Some(r) = required.iter().find(|r| !props.contains_key(**r)) {
        return Err(format!(
            "strict tool {tool:?}: required parameter {r:?} is not in `properties`"
        ));
    }
    let mut defs = Map::new();
    for k in ["$defs", "definitions"] {
        if let Some(d) = schema.get(k) {
            defs.insert(k.to_string(), d.clone());
        }
    }
    let mut items = Vec::new();
    for (pi, (p, sub)) in props.iter().enumerate() {
        if p.is_empty() || p.contains(['>', '<', '\n']) {
            return Err(format!(
                "strict tool {tool:?}: a parameter name with '<', '>' or a newline cannot be written in this format"
            ));
        }
        let sub = resolve(sub, schema);
        let rule = format!("p{ti}_{pi}");
        let def = match string_value(sub)? {
            Some(value) => {
                // One terminal for the whole parameter (see the module documentation).
                let open = regex_escape(&format!("<parameter={p}>\n"));
                let close = regex_escape("\n</parameter>\n");
                format!("{}: /{open}(?:{value}){close}/", rule.to_uppercase())
            }
            None => {
                let mut s = match sub {
                    Value::Bool(true) => json!({}),
                    s => s.clone(),
                };
                if let Some(o) = s.as_object_mut() {
                    for (k, v) in &defs {
                        o.entry(k.clone()).or_insert(v.clone());
                    }
                    o.insert("x-guidance".into(), json_options());
                } else {
                    return Err(format!(
                        "strict tool {tool:?}: the schema of parameter {p:?} must be an object"
                    ));
                }
                format!(
                    "{rule}: {} %json {} {}",
                    lit(&format!("<parameter={p}>\n")),
                    s,
                    lit("\n</parameter>\n")
                )
            }
        };
        let name = if def.starts_with(&rule.to_uppercase()) {
            rule.to_uppercase()
        } else {
            rule
        };
        rules.push(def);
        if required.contains(&p.as_str()) {
            items.push(name);
        } else {
            items.push(format!("{name}?"));
        }
    }
    Ok(items)
}

/// A local `$ref` (`#/$defs/X`) as its target, for deciding whether the parameter is a string.
fn resolve<'a>(sub: &'a Value, root: &'a Value) -> &'a Value {
    let mut cur = sub;
    for _ in 0..8 {
        let Some(r) = cur.get("$ref").and_then(Value::as_str) else {
            break;
        };
        match r.strip_prefix('#').and_then(|p| root.pointer(p)) {
            Some(t) => cur = t,
            None => break,
        }
    }
    cur
}

/// The value regex of a string parameter (`None`: not a plain string, so JSON).
fn string_value(s: &Value) -> Result<Option<String>, String> {
    let strings = |a: &Value| -> Option<Vec<String>> {
        a.as_array()?
            .iter()
            .map(|x| x.as_str().map(str::to_string))
            .collect()
    };
    if let Some(c) = s.get("const") {
        return Ok(c.as_str().map(regex_escape));
    }
    if let Some(e) = s.get("enum") {
        return Ok(strings(e).filter(|v| !v.is_empty()).map(|v| {
            v.iter()
                .map(|x| regex_escape(x))
                .collect::<Vec<_>>()
                .join("|")
        }));
    }
    if s.get("type").and_then(Value::as_str) != Some("string") {
        return Ok(None);
    }
    if let Some(p) = s.get("pattern").and_then(Value::as_str) {
        // JSON Schema patterns are unanchored searches; inside a parameter the value is the
        // whole match, so anchors are dropped.
        let p = p.strip_prefix('^').unwrap_or(p);
        let p = p.strip_suffix('$').unwrap_or(p);
        return Ok(Some(p.replace('/', "\\/")));
    }
    let min = s.get("minLength").and_then(Value::as_u64).unwrap_or(0);
    let max = s.get("maxLength").and_then(Value::as_u64);
    if max.is_some_and(|m| m < min) {
        return Err(format!(
            "maxLength {} is below minLength {min}",
            max.unwrap_or(0)
        ));
    }
    Ok(Some(match max {
        Some(m) => format!("[^<]{{{min},{m}}}"),
        None if min > 0 => format!("[^<]{{{min},}}"),
        None => "[^<]*".into(),
    }))
}

/// `s` as a regex matching itself, safe inside Lark's `/…/`.
fn regex_escape(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        match c {
            '\\' | '.' | '+' | '*' | '?' | '(' | ')' | '|' | '[' | ']' | '{' | '}' | '^' | '$'
            | '#' | '&' | '-' | '~' | '/' => {
                out.push('\\');
                out.push(c);
            }
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Value {
        json!([
            {"type": "function", "function": {"name": "get_weather", "strict": true, "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                               "unit": {"enum": ["c", "f"]}},
                "required": ["city", "days"], "additionalProperties": false}}},
            {"type": "function", "function": {"name": "loose", "parameters": {"type": "object"}}}
        ])
    }

    #[test]
    fn only_required_or_named_strict_tools() {
        let t = tools();
        assert!(strict_call_grammar(Some(&t), &ToolChoice::Auto).is_none());
        // Required with a non-strict tool among them: not constrained.
        assert!(strict_call_grammar(Some(&t), &ToolChoice::Required).is_none());
        assert!(strict_call_grammar(Some(&t), &ToolChoice::Named("loose".into())).is_none());
        let g = strict_call_grammar(Some(&t), &ToolChoice::Named("get_weather".into()))
            .unwrap()
            .unwrap();
        assert!(g.starts_with("start: call0\n"), "{g}");
        assert!(g.contains(r#"call0: "<tool_call>\n<function=get_weather>\n" P0_0 p0_1 P0_2? "</function>\n</tool_call>""#), "{g}");
        assert!(
            g.contains(r"P0_0: /<parameter=city>\n(?:[^<]{0,20})\n<\/parameter>\n/"),
            "{g}"
        );
        assert!(
            g.contains(r"P0_2: /<parameter=unit>\n(?:c|f)\n<\/parameter>\n/"),
            "{g}"
        );
        assert!(g.contains(r#"p0_1: "<parameter=days>\n" %json {"#), "{g}");
    }

    #[test]
    fn bad_names_are_errors() {
        let t = json!([{"function": {"name": "f", "strict": true, "parameters": {"type": "object", "properties": {"a<b": {"type": "integer"}}}}}]);
        assert!(strict_call_grammar(Some(&t), &ToolChoice::Required)
            .unwrap()
            .is_err());
        let t = json!([{"function": {"name": "f", "strict": true, "parameters": {"type": "object", "properties": {}, "required": ["x"]}}}]);
        assert!(strict_call_grammar(Some(&t), &ToolChoice::Required)
            .unwrap()
            .is_err());
    }
}
