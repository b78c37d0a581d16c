//! Constrained decoding (runtime/constrain.rs): the tokenizer bridge and grammars on a synthetic
//! checkpoint's real byte-level BPE, and the generation loop under a grammar on the CPU backend.
//!
//! Random weights make noise, so any structure in the output comes from the constraint: a test
//! fails if the mask lets a wrong token through, if the bridge gives a token the wrong bytes, or
//! if the loop picks outside the mask.

mod common;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use common::{load, prompt_ids, synth};
use lily::runtime::constrain::{Constraint, ConstraintState, Grammar, Grammars, Start};
use lily::runtime::generate::{generate_ex, Forced, GenRequest};
use lily::runtime::sampler::SamplingParams;
use lily::runtime::stop::{FinishReason, StopKind, StopRules};
use lily::tokenizer::{stop_ids, Tokenizer};
use serde_json::{json, Value};

fn setup(preset: &str) -> (tempfile::TempDir, Arc<Tokenizer>, Grammars, Vec<u32>, usize) {
    let dir = synth(preset, 5, &[]);
    let tok = Arc::new(Tokenizer::from_dir(dir.path()).unwrap());
    let stops = stop_ids(dir.path()).unwrap();
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap())
            .unwrap();
    let vocab = cfg["text_config"]["vocab_size"]
        .as_u64()
        .or(cfg["vocab_size"].as_u64())
        .unwrap() as usize;
    let g = Grammars::new(tok.clone(), vocab, &stops).unwrap();
    (dir, tok, g, stops, vocab)
}

/// Walks the grammar with random allowed tokens (a stop id, once allowed, is taken with
/// probability 1/4): returns the text and whether it ended on a stop id.
fn walk(
    g: &Grammars,
    tok: &Tokenizer,
    stops: &[u32],
    grammar: &Grammar,
    seed: u64,
    max: usize,
) -> (String, bool) {
    let c = Constraint {
        compiled: g.compile(grammar).unwrap(),
        start: Start::Now,
    };
    let mut st = ConstraintState::new(c, g.vocab());
    let mut rng = lily::rng::Rng::new(seed);
    let mut ids = Vec::new();
    for _ in 0..max {
        let mask = st.mask().unwrap();
        let allowed: Vec<u32> = (0..g.vocab() as u32)
            .filter(|&i| (mask[i as usize / 32] >> (i % 32)) & 1 == 1)
            .collect();
        assert!(!allowed.is_empty());
        let stop = allowed.iter().find(|a| stops.contains(a));
        let id = match stop {
            Some(&s) if allowed.iter().all(|a| stops.contains(a)) || rng.uniform() < 0.25 => s,
            _ => {
                let others: Vec<u32> = allowed
                    .iter()
                    .copied()
                    .filter(|a| !stops.contains(a))
                    .collect();
                others[(rng.uniform() * others.len() as f32) as usize % others.len()]
            }
        };
        if stops.contains(&id) {
            return (tok.decode(&ids).unwrap(), true);
        }
        st.commit(id, false).unwrap();
        ids.push(id);
    }
    (tok.decode(&ids).unwrap(), false)
}

#[test]
fn random_walks_under_a_schema_produce_valid_json() {
    let (_d, tok, g, stops, _) = setup("tiny");
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "kind": {"enum": ["a", "b", "c d"]},
            "n": {"type": "integer", "minimum": -5, "maximum": 300},
            "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
            "inner": {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["x"], "additionalProperties": false}
        },
        "required": ["name", "kind", "n", "inner"],
        "additionalProperties": false
    });
    for seed in 0..12 {
        let (text, ended) = walk(
            &g,
            &tok,
            &stops,
            &Grammar::JsonSchema(schema.clone()),
            seed,
            400,
        );
        assert!(ended, "seed {seed}: no end within 400 tokens: {text:?}");
        let v: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("seed {seed}: not JSON ({e}): {text:?}"));
        assert!(
            v["name"].as_str().is_some_and(|s| s.chars().count() <= 12),
            "{text}"
        );
        assert!(
            ["a", "b", "c d"].contains(&v["kind"].as_str().unwrap()),
            "{text}"
        );
        let n = v["n"].as_i64().unwrap();
        assert!((-5..=300).contains(&n), "{text}");
        if let Some(t) = v.get("tags") {
            assert!(
                t.as_array().unwrap().len() <= 3
                    && t.as_array().unwrap().iter().all(Value::is_boolean),
                "{text}"
            );
        }
        let x = v["inner"]["x"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&x), "{text}");
        assert_eq!(
            v.as_object()
                .unwrap()
                .keys()
                .filter(|k| !["name", "kind", "n", "tags", "inner"].contains(&k.as_str()))
                .count(),
            0
        );
    }
}

#[test]
fn regex_choice_and_lark() {
    let (_d, tok, g, stops, _) = setup("tiny");
    for seed in 0..6 {
        let (t, ended) = walk(
            &g,
            &tok,
            &stops,
            &Grammar::Regex(r"[a-c]{2,4}-[0-9]{3}".into()),
            seed,
            50,
        );
        assert!(
            ended && t.len() >= 6 && t.len() <= 8 && t.contains('-'),
            "{t:?}"
        );
        let (t, ended) = walk(
            &g,
            &tok,
            &stops,
            &Grammar::Choice(vec!["yes".into(), "no way".into(), "maybe \"so\"".into()]),
            seed,
            50,
        );
        assert!(
            ended && ["yes", "no way", "maybe \"so\""].contains(&t.as_str()),
            "{t:?}"
        );
        let (t, ended) = walk(
            &g,
            &tok,
            &stops,
            &Grammar::Lark("start: \"<\" WORD \">\"\nWORD: /[xyz]{1,3}/".into()),
            seed,
            50,
        );
        assert!(
            ended && t.starts_with('<') && t.ends_with('>') && t.len() <= 5,
            "{t:?}"
        );
    }
    // Any object: JSON's grammar allows numbers such as 4E+6767, which serde_json refuses as out
    // of range (Python reads them as inf); anything else must parse as an object.
    for seed in 0..4 {
        let (t, ended) = walk(&g, &tok, &stops, &Grammar::JsonObject, seed, 2000);
        if let (true, Err(e)) = (
            ended,
            serde_json::from_str::<serde_json::Map<String, Value>>(&t),
        ) {
            assert!(e.to_string().contains("out of range"), "{e}: {t:?}");
        }
        assert!(t.starts_with('{'), "{t:?}");
    }
}

#[test]
fn bad_grammars_are_errors_and_compiles_are_cached() {
    let (_d, _tok, g, _, _) = setup("tiny");
    for bad in [
        Grammar::Regex("(unclosed".into()),
        Grammar::Lark("start: nothing_defined".into()),
        Grammar::JsonSchema(json!({"type": "no-such-type"})),
    ] {
        let e = g
            .compile(&bad)
            .err()
            .unwrap_or_else(|| panic!("{bad:?} compiled"));
        assert!(!format!("{e:#}").is_empty());
    }
    let s = Grammar::JsonSchema(json!({"type": "object", "properties": {"a": {"type": "string"}}}));
    let first = g.compile(&s).unwrap();
    let again = g.compile(&s).unwrap();
    assert!(!first.cached && again.cached);
}

fn run(
    m: &lily::model::Qwen35<lily::backend::cpu::Cpu>,
    tok: &Tokenizer,
    stops: &[u32],
    sampling: &SamplingParams,
    c: Option<Constraint>,
    after: Option<(u32, Vec<u32>)>,
    max_tokens: usize,
) -> lily::runtime::generate::Generation {
    let prompt = prompt_ids(12, m.cfg.vocab_size);
    let mut st = m.new_state(1024).unwrap();
    let cancel = AtomicBool::new(false);
    let stop = StopRules {
        stop_ids: stops.to_vec(),
        max_tokens: Some(max_tokens),
        max_context: 1024,
        ..Default::default()
    };
    let req = GenRequest {
        prompt: &prompt,
        cached: 0,
        sampling,
        stop,
        logprobs: None,
        forced: Forced {
            now: Vec::new(),
            after,
        },
        constraint: c,
        cancel: &cancel,
    };
    generate_ex(m, &mut st, tok, req, |_| true).unwrap()
}

/// The loop picks under the mask, greedy and sampled, and ends on a stop id once the grammar is
/// complete; a grammar that starts after a trigger leaves the tokens before it free.
#[test]
fn generation_follows_the_grammar() {
    let (dir, tok, g, stops, _) = setup("tiny");
    let m = load(dir.path());
    let schema = json!({"type": "object", "properties": {"k": {"enum": ["on", "off"]}, "v": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["k", "v"], "additionalProperties": false});
    let greedy = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
    let sampled = SamplingParams {
        temperature: 1.0,
        top_k: 20,
        top_p: 0.95,
        seed: Some(3),
        ..Default::default()
    };
    for p in [&greedy, &sampled] {
        let c = Constraint {
            compiled: g.compile(&Grammar::JsonSchema(schema.clone())).unwrap(),
            start: Start::Now,
        };
        let out = run(&m, &tok, &stops, p, Some(c), None, 64);
        assert!(
            matches!(out.finish, Some(FinishReason::Stop(StopKind::Id(_)))),
            "{:?}: {:?}",
            out.finish,
            out.text
        );
        let v: Value =
            serde_json::from_str(&out.text).unwrap_or_else(|e| panic!("{e}: {:?}", out.text));
        assert!(
            ["on", "off"].contains(&v["k"].as_str().unwrap()) && v["v"].as_u64().unwrap() < 100,
            "{}",
            out.text
        );
        assert_eq!(out.stats.masks, out.ids.len(), "one mask per picked token");
    }
    // Unconstrained, the same model makes no JSON.
    let free = run(&m, &tok, &stops, &greedy, None, None, 16);
    assert!(
        serde_json::from_str::<Value>(&free.text).is_err(),
        "{:?}",
        free.text
    );
    // Starting after a trigger: the free tokens first (their greedy picks), then the lead, then
    // the grammar.
    let trigger = free.ids[3];
    let lead = tok.encode("\n\n").unwrap();
    let c = Constraint {
        compiled: g.compile(&Grammar::Choice(vec!["ok".into()])).unwrap(),
        start: Start::After(trigger),
    };
    // The lead goes out through the loop's own forcing after the trigger.
    let out = run(
        &m,
        &tok,
        &stops,
        &greedy,
        Some(c),
        Some((trigger, lead.clone())),
        64,
    );
    let first = free.ids.iter().position(|&t| t == trigger).unwrap();
    assert_eq!(out.ids[..=first], free.ids[..=first]);
    assert_eq!(out.ids[first + 1..first + 1 + lead.len()], lead[..]);
    assert!(out.text.ends_with("\n\nok"), "{:?}", out.text);
    // Cut by max_tokens: a length finish, the text a prefix of the grammar's language.
    let c = Constraint {
        compiled: g.compile(&Grammar::Regex("a{40}".into())).unwrap(),
        start: Start::Now,
    };
    let out = run(&m, &tok, &stops, &greedy, Some(c), None, 5);
    assert_eq!(out.finish, Some(FinishReason::Length));
    assert!(
        !out.text.is_empty() && out.text.chars().all(|c| c == 'a'),
        "{:?}",
        out.text
    );
}
