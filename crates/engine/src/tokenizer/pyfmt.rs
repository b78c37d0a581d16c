//! Python formatting semantics for the chat-template engine: `json.dumps` (the `tojson` filter the
//! way transformers defines it), `str()`/`repr()` of values, float `repr`, and Python's notion of
//! whitespace for `strip`/`split`/`trim`.
//!
//! Why: chat templates are written for Python jinja2, and a prompt must match the one transformers
//! renders byte for byte. minijinja's own `tojson` escapes HTML characters and formats floats the
//! Rust way, and its `trim`/`strip` use Rust's whitespace set; these helpers replace them.

use std::fmt::Write;

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// Python's `str.isspace` characters: Rust's `char::is_whitespace` plus U+001C..U+001F.
pub fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// `str.strip(chars)` / `lstrip` / `rstrip`: `chars = None` strips Python whitespace.
pub fn py_strip<'a>(s: &'a str, chars: Option<&str>, left: bool, right: bool) -> &'a str {
    let pred = |c: char| match chars {
        Some(set) => set.contains(c),
        None => is_py_space(c),
    };
    let mut out = s;
    if left {
        out = out.trim_start_matches(pred);
    }
    if right {
        out = out.trim_end_matches(pred);
    }
    out
}

/// `str.split(sep=None, maxsplit=-1)` with Python semantics.
pub fn py_split(s: &str, sep: Option<&str>, maxsplit: i64) -> Result<Vec<String>, Error> {
    let max = if maxsplit < 0 {
        usize::MAX
    } else {
        maxsplit as usize
    };
    match sep {
        Some("") => Err(Error::new(ErrorKind::InvalidOperation, "empty separator")),
        Some(sep) => {
            let mut out = Vec::new();
            let mut rest = s;
            while out.len() < max {
                match rest.find(sep) {
                    Some(i) => {
                        out.push(rest[..i].to_string());
                        rest = &rest[i + sep.len()..];
                    }
                    None => break,
                }
            }
            out.push(rest.to_string());
            Ok(out)
        }
        None => {
            // Runs of whitespace separate; leading/trailing whitespace yields no empty strings.
            let mut out = Vec::new();
            let mut rest = s.trim_start_matches(is_py_space);
            while !rest.is_empty() {
                if out.len() == max {
                    out.push(rest.to_string());
                    break;
                }
                let end = rest.find(is_py_space).unwrap_or(rest.len());
                out.push(rest[..end].to_string());
                rest = rest[end..].trim_start_matches(is_py_space);
            }
            Ok(out)
        }
    }
}

/// `repr(float)` of Python 3 (shortest round-trip digits; exponent form below 1e-4 and from 1e16).
pub fn py_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if x == 0.0 {
        return if x.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "-1.2345e-7".
    let e = format!("{x:e}");
    let (mant, exp) = e.split_once('e').expect("LowerExp has an exponent");
    let exp: i32 = exp.parse().expect("LowerExp exponent is an integer");
    let (neg, mant) = match mant.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mant),
    };
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    let mut out = String::new();
    if neg {
        out.push('-');
    }
    if !(-4..16).contains(&exp) {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    } else if exp >= 0 {
        let int_len = exp as usize + 1;
        if digits.len() <= int_len {
            out.push_str(&digits);
            out.extend(std::iter::repeat_n('0', int_len - digits.len()));
            out.push_str(".0");
        } else {
            out.push_str(&digits[..int_len]);
            out.push('.');
            out.push_str(&digits[int_len..]);
        }
    } else {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', (-exp - 1) as usize));
        out.push_str(&digits);
    }
    out
}

fn number_str(v: &Value) -> String {
    if v.is_integer() {
        // Display of integers (i64/u64/i128/u128) is plain decimal, as in Python.
        v.to_string()
    } else {
        py_float_repr(f64::try_from(v.clone()).unwrap_or(f64::NAN))
    }
}

/// Python `str(value)` of a template value (what jinja2 prints for `{{ value }}`).
pub fn py_str(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => v.as_str().unwrap_or_default().to_string(),
        _ => py_repr(v),
    }
}

/// Python `repr(value)` (strings quoted; lists, tuples and dicts as Python prints them).
pub fn py_repr(v: &Value) -> String {
    let mut out = String::new();
    repr_into(&mut out, v);
    out
}

fn repr_into(out: &mut String, v: &Value) {
    match v.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push_str(&number_str(v)),
        ValueKind::String => repr_str(out, v.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let tuple = v.is_tuple();
            out.push(if tuple { '(' } else { '[' });
            let mut n = 0;
            if let Ok(it) = v.try_iter() {
                for (i, item) in it.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    repr_into(out, &item);
                    n += 1;
                }
            }
            if tuple && n == 1 {
                out.push(',');
            }
            out.push(if tuple { ')' } else { ']' });
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(it) = v.try_iter() {
                for (i, k) in it.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    repr_into(out, &k);
                    out.push_str(": ");
                    repr_into(out, &v.get_item(&k).unwrap_or_default());
                }
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{v}");
        }
    }
}

/// Characters Python's `str.isprintable` rejects, approximately: controls, separators other than
/// the ASCII space, and the common format characters (no full Unicode tables here).
fn py_unprintable(c: char) -> bool {
    let u = c as u32;
    u < 0x20
        || (0x7f..=0xa0).contains(&u)
        || u == 0xad
        || (c != ' ' && c.is_whitespace())
        || matches!(u, 0x061c | 0x180e | 0x200b..=0x200f | 0x202a..=0x202e | 0x2060..=0x206f | 0xfeff | 0xfff9..=0xfffb)
        || (0xe000..=0xf8ff).contains(&u)
        || u >= 0xf0000
}

fn repr_str(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if py_unprintable(c) => {
                let u = c as u32;
                let _ = if u <= 0xff {
                    write!(out, "\\x{u:02x}")
                } else if u <= 0xffff {
                    write!(out, "\\u{u:04x}")
                } else {
                    write!(out, "\\U{u:08x}")
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Options of Python's `json.dumps` that transformers' `tojson` filter exposes.
#[derive(Clone, Debug)]
pub struct JsonOpts {
    pub ensure_ascii: bool,
    /// `None`: single line. `Some(s)`: newline + `s` per level (an int indent is `s = " " * n`).
    pub indent: Option<String>,
    pub item_sep: String,
    pub key_sep: String,
    pub sort_keys: bool,
}

impl Default for JsonOpts {
    /// transformers' defaults: `ensure_ascii=False, indent=None, separators=None, sort_keys=False`.
    fn default() -> Self {
        Self {
            ensure_ascii: false,
            indent: None,
            item_sep: ", ".into(),
            key_sep: ": ".into(),
            sort_keys: false,
        }
    }
}

/// `json.dumps(value, ...)` exactly as Python writes it.
pub fn py_json_dumps(v: &Value, o: &JsonOpts) -> Result<String, Error> {
    let mut out = String::new();
    json_into(&mut out, v, o, 0)?;
    Ok(out)
}

fn not_serializable(v: &Value) -> Error {
    let what = match v.kind() {
        ValueKind::Undefined => "Undefined".to_string(),
        k => k.to_string(),
    };
    Error::new(
        ErrorKind::InvalidOperation,
        format!("tojson: object of type {what} is not JSON serializable"),
    )
}

fn json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) >= 0x7f => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{:04x}", unit);
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn json_float(out: &mut String, x: f64) {
    if x.is_nan() {
        out.push_str("NaN");
    } else if x.is_infinite() {
        out.push_str(if x > 0.0 { "Infinity" } else { "-Infinity" });
    } else {
        out.push_str(&py_float_repr(x));
    }
}

fn json_key(k: &Value) -> Result<String, Error> {
    Ok(match k.kind() {
        ValueKind::String => k.as_str().unwrap_or_default().to_string(),
        ValueKind::Bool => (if k.is_true() { "true" } else { "false" }).to_string(),
        ValueKind::None => "null".to_string(),
        ValueKind::Number if k.is_integer() => k.to_string(),
        ValueKind::Number => {
            let mut s = String::new();
            json_float(&mut s, f64::try_from(k.clone()).unwrap_or(f64::NAN));
            s
        }
        other => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: keys must be str, int, float, bool or None, not {other}"),
            ))
        }
    })
}

fn newline_indent(out: &mut String, o: &JsonOpts, level: usize) {
    if let Some(ind) = &o.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn json_into(out: &mut String, v: &Value, o: &JsonOpts, level: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
        ValueKind::Number => json_float(out, f64::try_from(v.clone()).unwrap_or(f64::NAN)),
        ValueKind::String => json_str(out, v.as_str().unwrap_or_default(), o.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline_indent(out, o, level + 1);
                json_into(out, item, o, level + 1)?;
            }
            newline_indent(out, o, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut items: Vec<(Value, Value)> = Vec::new();
            for k in v.try_iter()? {
                let val = v.get_item(&k)?;
                items.push((k, val));
            }
            if items.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if o.sort_keys {
                if items.iter().any(|(k, _)| k.kind() != ValueKind::String) {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: sort_keys needs string keys",
                    ));
                }
                items.sort_by(|a, b| a.0.as_str().cmp(&b.0.as_str()));
            }
            out.push('{');
            for (i, (k, val)) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline_indent(out, o, level + 1);
                json_str(out, &json_key(k)?, o.ensure_ascii);
                out.push_str(&o.key_sep);
                json_into(out, val, o, level + 1)?;
            }
            newline_indent(out, o, level);
            out.push('}');
        }
        _ => return Err(not_serializable(v)),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456789012345680.0, "1.2345678901234568e+17"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (-2.5, "-2.5"),
            (-0.0, "-0.0"),
            (3.25, "3.25"),
            (0.30000000000000004, "0.30000000000000004"),
            (1e300, "1e+300"),
            (5e-324, "5e-324"),
            (100.0, "100.0"),
            (1234.5678, "1234.5678"),
        ];
        for (x, want) in cases {
            assert_eq!(py_float_repr(x), want, "{x}");
        }
    }

    #[test]
    fn json_dumps_matches_python() {
        let v = Value::from_pairs([
            ("a", Value::from(1)),
            (
                "b",
                Value::from(vec![Value::from(1.0), Value::from(()), Value::from(true)]),
            ),
            ("c", Value::from("é<>&\"\\\n\u{1}\u{7f}😀")),
            ("d", Value::from_pairs::<_, &str, Value>([])),
        ]);
        let o = JsonOpts::default();
        assert_eq!(py_json_dumps(&v, &o).unwrap(), "{\"a\": 1, \"b\": [1.0, null, true], \"c\": \"é<>&\\\"\\\\\\n\\u0001\u{7f}😀\", \"d\": {}}");
        let o = JsonOpts {
            ensure_ascii: true,
            indent: Some("  ".into()),
            item_sep: ",".into(),
            ..JsonOpts::default()
        };
        assert_eq!(
            py_json_dumps(&v, &o).unwrap(),
            "{\n  \"a\": 1,\n  \"b\": [\n    1.0,\n    null,\n    true\n  ],\n  \"c\": \"\\u00e9<>&\\\"\\\\\\n\\u0001\\u007f\\ud83d\\ude00\",\n  \"d\": {}\n}"
        );
    }

    #[test]
    fn split_and_strip_match_python() {
        assert_eq!(py_split("  a b\t\nc  ", None, -1).unwrap(), ["a", "b", "c"]);
        assert_eq!(py_split("a b c", None, 1).unwrap(), ["a", "b c"]);
        assert_eq!(py_split("", Some(","), -1).unwrap(), [""]);
        assert_eq!(py_split("a,,b", Some(","), -1).unwrap(), ["a", "", "b"]);
        assert_eq!(py_split("a,b,c", Some(","), 1).unwrap(), ["a", "b,c"]);
        assert_eq!(py_strip("\u{1c} x \n", None, true, true), "x");
        assert_eq!(py_strip("\n\nx\n", Some("\n"), false, true), "\n\nx");
    }

    #[test]
    fn repr_matches_python() {
        let v = Value::from(vec![
            Value::from("it's"),
            Value::from(1),
            Value::from(()),
            Value::from(false),
            Value::from(2.5),
        ]);
        assert_eq!(py_str(&v), "[\"it's\", 1, None, False, 2.5]");
        assert_eq!(py_repr(&Value::from("a\nb'\"")), "'a\\nb\\'\"'");
    }
}
