//! `lily bench --schema builtin|FILE`: what constrained decoding costs (issue #15).
//!
//! At each `--decode` context, through the generation loop (`generate_ex`, as `lily serve` runs
//! it): `--decode-tokens` tokens without a constraint and under the JSON schema, greedy and with
//! the checkpoint's default sampling, the order alternated per round (free first in odd rounds,
//! the schema first in even ones); the median of `--rounds`. Reported per row: decode tokens/s,
//! time to first token (prefill + the first pick, the first mask included), and the host time
//! spent computing masks per token (hidden behind the device step when it is shorter than it).
//! Before the rows: the grammar engine's setup (token trie of the vocabulary) and the schema's
//! compile time, cold and from the cache.
//!
//! The built-in schema (about 1 KB: an agent's plan of file edits) has `minItems` high enough
//! that no generation can complete it within the measured tokens, so every row decodes exactly
//! `--decode-tokens` tokens whatever the (random) weights pick.

use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use lily::backend::Backend;
use lily::model::Qwen35;
use lily::runtime::constrain::{Constraint, Grammar, Grammars, Start};
use lily::runtime::generate::{generate_ex, Forced, GenRequest};
use lily::runtime::sampler::SamplingParams;
use lily::runtime::stop::StopRules;
use lily::tokenizer::{stop_ids, Tokenizer};

use crate::bench::{median, prompt_ids};

/// The built-in schema: an agent's plan (nested objects, enums, bounded numbers and strings).
pub fn builtin_schema() -> Value {
    json!({
        "title": "EditPlan",
        "type": "object",
        "properties": {
            "summary": {"type": "string", "maxLength": 200, "description": "What the plan does, in one or two sentences."},
            "risk": {"enum": ["low", "medium", "high"]},
            "steps": {
                "type": "array",
                "minItems": 64,
                "maxItems": 256,
                "items": {
                    "type": "object",
                    "properties": {
                        "action": {"enum": ["read", "edit", "create", "delete", "run", "search"]},
                        "path": {"type": "string", "maxLength": 120, "description": "File path relative to the repository root."},
                        "line": {"type": "integer", "minimum": 1, "maximum": 1000000},
                        "replacement": {"type": ["string", "null"], "maxLength": 400},
                        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                        "depends_on": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 8}
                    },
                    "required": ["action", "path", "confidence"],
                    "additionalProperties": false
                }
            },
            "tests": {"type": "array", "items": {"type": "string", "maxLength": 200}, "maxItems": 16}
        },
        "required": ["steps", "summary", "risk"],
        "additionalProperties": false
    })
}

/// One measured generation: (decode tok/s, time to first token s, mask ms per token, tokens).
fn one<B: Backend>(
    m: &Qwen35<B>,
    tok: &Tokenizer,
    prompt: &[u32],
    max_len: usize,
    sampling: &SamplingParams,
    c: Option<Constraint>,
    n: usize,
) -> Result<(f64, f64, f64, usize)> {
    let mut st = m.new_state(max_len)?;
    let cancel = AtomicBool::new(false);
    // No stop ids: the free rows run the full count too.
    let stop = StopRules {
        max_tokens: Some(n),
        max_context: max_len,
        ..Default::default()
    };
    let req = GenRequest {
        prompt,
        cached: 0,
        sampling,
        stop,
        logprobs: None,
        forced: Forced::default(),
        constraint: c,
        cancel: &cancel,
    };
    let g = generate_ex(m, &mut st, tok, req, |_| true)?;
    let s = &g.stats;
    let decoded = s.generated.saturating_sub(1).max(1);
    let mask_ms = if s.masks > 0 {
        1e3 * s.mask_s / s.masks as f64
    } else {
        0.0
    };
    Ok((
        decoded as f64 / s.decode_s,
        s.first_token_s,
        mask_ms,
        s.generated,
    ))
}

pub fn rows<B: Backend>(
    m: &Qwen35<B>,
    dir: &Path,
    schema_arg: &str,
    contexts: &[usize],
    n: usize,
    rounds: usize,
) -> Result<Vec<Value>> {
    if n < 2 {
        bail!("--schema needs --decode-tokens of at least 2");
    }
    let schema = if schema_arg == "builtin" {
        builtin_schema()
    } else {
        let t = std::fs::read_to_string(schema_arg)
            .with_context(|| format!("--schema {schema_arg}"))?;
        serde_json::from_str(&t).with_context(|| format!("--schema {schema_arg}: not JSON"))?
    };
    let schema_bytes = schema.to_string().len();
    let tok = Arc::new(Tokenizer::from_dir(dir)?);
    let stops = stop_ids(dir)?;
    let t0 = Instant::now();
    let grammars = Grammars::new(tok.clone(), m.cfg.vocab_size, &stops)?;
    let setup_s = t0.elapsed().as_secs_f64();
    let grammar = Grammar::JsonSchema(schema);
    let cold = grammars.compile(&grammar)?;
    let cached = grammars.compile(&grammar)?;
    println!(
        "schema: {schema_bytes} bytes | grammar engine setup {:.1} ms (once per model) | compile cold {:.2} ms, cached {:.3} ms",
        setup_s * 1e3,
        cold.compile_s * 1e3,
        cached.compile_s * 1e3
    );
    let sampled = SamplingParams::from_generation_config(dir).unwrap_or_default();
    let greedy = SamplingParams::greedy();
    println!(
        "{:<14} {:>8} {:>9} {:>9} {:>9} {:>10} {:>10} {:>9}",
        "decode", "context", "free t/s", "schema", "ratio", "ttft free", "ttft sch", "mask ms"
    );
    let mut out = Vec::new();
    for &ctx in contexts {
        let prompt = prompt_ids(ctx, m.cfg.vocab_size);
        let max_len = ctx + n + 1;
        for (label, p) in [("greedy", &greedy), ("sampled", &sampled)] {
            let (mut free, mut cons) = (Vec::new(), Vec::new());
            let gen = |with: bool| -> Result<(f64, f64, f64, usize)> {
                let c = with
                    .then(|| {
                        grammars.compile(&grammar).map(|compiled| Constraint {
                            compiled,
                            start: Start::Now,
                        })
                    })
                    .transpose()?;
                one(m, &tok, &prompt, max_len, p, c, n)
            };
            // A warm-up of each (records the steps, fills the lexer's cache), then alternated.
            gen(false)?;
            gen(true)?;
            for r in 0..rounds {
                if r % 2 == 0 {
                    free.push(gen(false)?);
                    cons.push(gen(true)?);
                } else {
                    cons.push(gen(true)?);
                    free.push(gen(false)?);
                }
            }
            let pick = |v: &[(f64, f64, f64, usize)], f: fn(&(f64, f64, f64, usize)) -> f64| {
                median(v.iter().map(f).collect())
            };
            let (ft, ct) = (pick(&free, |x| x.0), pick(&cons, |x| x.0));
            let (ff, cf) = (pick(&free, |x| x.1), pick(&cons, |x| x.1));
            let mask = pick(&cons, |x| x.2);
            let toks = cons.iter().map(|x| x.3).min().unwrap_or(0);
            println!(
                "{:<14} {:>8} {:>9.1} {:>9.1} {:>8.3} {:>9.1}ms {:>9.1}ms {:>9.3}",
                format!("decode {label}"),
                ctx,
                ft,
                ct,
                ct / ft,
                ff * 1e3,
                cf * 1e3,
                mask
            );
            if toks < n {
                println!("  (the schema ended a generation after {toks} of {n} tokens)");
            }
            out.push(json!({"phase": "decode_schema", "sampling": label, "context": ctx, "tokens": n,
                "free_tok_s": ft, "schema_tok_s": ct, "ratio": ct / ft, "ttft_free_s": ff, "ttft_schema_s": cf,
                "mask_ms_per_token": mask, "schema_bytes": schema_bytes, "compile_cold_s": cold.compile_s,
                "compile_cached_s": cached.compile_s, "grammar_setup_s": setup_s}));
        }
    }
    Ok(out)
}
