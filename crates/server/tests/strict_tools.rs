//! Strict tool calls (structured.rs): the Lark grammar of Qwen's XML call compiles with the
//! engine's llguidance bridge on a synthetic checkpoint's real tokenizer, every random walk
//! through it is a call, and output.rs parses each back into typed arguments that fit the schema.

use std::sync::Arc;

use lily::runtime::constrain::{Constraint, ConstraintState, Grammar, Grammars, Start};
use lily::tokenizer::{stop_ids, Tokenizer};
use lily_server::api::ToolChoice;
use lily_server::output::{collect, OutputParser};
use lily_server::structured::strict_call_grammar;
use serde_json::{json, Value};

fn walk(g: &Grammars, tok: &Tokenizer, stops: &[u32], grammar: &Grammar, seed: u64) -> String {
    let c = Constraint {
        compiled: g.compile(grammar).unwrap_or_else(|e| panic!("{e:#}")),
        start: Start::Now,
    };
    let mut st = ConstraintState::new(c, g.vocab());
    let mut rng = lily::rng::Rng::new(seed);
    let mut ids = Vec::new();
    for _ in 0..600 {
        let mask = st.mask().unwrap();
        let allowed: Vec<u32> = (0..g.vocab() as u32)
            .filter(|&i| (mask[i as usize / 32] >> (i % 32)) & 1 == 1)
            .collect();
        if let Some(&s) = allowed.iter().find(|a| stops.contains(a)) {
            if allowed.iter().all(|a| stops.contains(a)) || rng.uniform() < 0.25 {
                let _ = s;
                return tok.decode(&ids).unwrap();
            }
        }
        let others: Vec<u32> = allowed
            .iter()
            .copied()
            .filter(|a| !stops.contains(a))
            .collect();
        let id = others[(rng.uniform() * others.len() as f32) as usize % others.len()];
        st.commit(id, false).unwrap();
        ids.push(id);
    }
    panic!("no end within 600 tokens: {:?}", tok.decode(&ids).unwrap());
}

#[test]
fn strict_calls_parse_back_typed_and_valid() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = lily::synth::preset("tiny").unwrap();
    lily::synth::write_checkpoint(&cfg, dir.path(), 7, &|_, _| {}).unwrap();
    let tok = Arc::new(Tokenizer::from_dir(dir.path()).unwrap());
    let stops = stop_ids(dir.path()).unwrap();
    let g = Grammars::new(tok.clone(), cfg.vocab_size, &stops).unwrap();
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "strict": true, "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"enum": ["c", "f"]},
                "when": {"$ref": "#/$defs/slot"},
                "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}
            },
            "$defs": {"slot": {"type": "object", "properties": {"h": {"type": "integer", "minimum": 0, "maximum": 23}}, "required": ["h"], "additionalProperties": false}},
            "required": ["city", "days", "when"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "ping", "strict": true, "parameters": {"type": "object", "properties": {}}}}
    ]);
    for choice in [
        ToolChoice::Required,
        ToolChoice::Named("get_weather".into()),
    ] {
        let lark = strict_call_grammar(Some(&tools), &choice).unwrap().unwrap();
        let mut names = Vec::new();
        for seed in 0..10 {
            let text = walk(&g, &tok, &stops, &Grammar::Lark(lark.clone()), seed);
            let mut p = OutputParser::new(false, Some(&tools), true, 1);
            let mut parts = p.push(&text);
            parts.extend(p.finish());
            let parsed = collect(parts);
            assert_eq!(parsed.tool_calls.len(), 1, "{text:?} → {parsed:?}");
            assert_eq!(parsed.content, None, "{text:?}");
            let call = &parsed.tool_calls[0];
            let args: Value = serde_json::from_str(&call.arguments).unwrap();
            names.push(call.name.clone());
            if call.name == "ping" {
                assert_eq!(args, json!({}));
                continue;
            }
            assert_eq!(call.name, "get_weather");
            let city = args["city"].as_str().unwrap_or_else(|| panic!("{text:?}"));
            assert!(city.chars().count() <= 12, "{text:?}");
            let days = args["days"].as_i64().unwrap_or_else(|| panic!("{text:?}"));
            assert!((1..=7).contains(&days), "{text:?}");
            assert!(
                (0..=23).contains(&args["when"]["h"].as_i64().unwrap()),
                "{text:?}"
            );
            if let Some(u) = args.get("unit") {
                assert!(u == "c" || u == "f", "{text:?}");
            }
            if let Some(t) = args.get("tags") {
                let t = t.as_array().unwrap();
                assert!(t.len() <= 3 && t.iter().all(Value::is_boolean), "{text:?}");
            }
            for k in args.as_object().unwrap().keys() {
                assert!(["city", "days", "unit", "when", "tags"].contains(&k.as_str()));
            }
        }
        if choice == ToolChoice::Required {
            assert!(
                names.iter().any(|n| n == "ping") && names.iter().any(|n| n == "get_weather"),
                "{names:?}"
            );
        } else {
            assert!(names.iter().all(|n| n == "get_weather"));
        }
    }
}
