//! Prefix cache correctness through the real HTTP API (`small` preset, greedy):
//! a scripted 8-turn agent session with tools and thinking — reasoning dropped from the history,
//! and preserved — gives the same tokens with the cache on, off, and under a budget so small
//! that entries are evicted all the time; two interleaved conversations never see each other's
//! state; `cached_tokens` reports the reuse.
//!
//! Tolerance: the cached path prefills in different segments than the uncached one (GEMM tiles
//! vs GEMV, chunk edges), so logits agree to float rounding, not bit for bit. Greedy tokens are
//! compared exactly; the `small` preset's peaked lm_head keeps near-ties (gap < 1e-3) rare, and
//! logprobs of every emitted token must agree within 1e-3.

use std::sync::Arc;
use std::time::Duration;

use lily::backend::cpu::Cpu;
use lily_server::{ModelRunner, ServeOptions, Server};
use serde_json::{json, Value};

const SCRIPT: &str = r#"[
  {"when": "look up the weather", "reply": "<think>\nI should call the tool.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"},
  {"when": "read the file", "reply": "<think>\nA file read is needed.\n</think>\n\n<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/main.rs\n</parameter>\n</function>\n</tool_call>"}
]"#;

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
    ])
}

struct Srv {
    server: Server,
    base: String,
}

fn start(dir: &std::path::Path, script: &std::path::Path, cache_bytes: usize) -> Srv {
    let m = lily::runtime::load(Cpu, dir).unwrap();
    let tok = Arc::new(lily::tokenizer::Tokenizer::from_dir(dir).unwrap());
    let mut o = ServeOptions::new(dir, 8192);
    o.port = 0;
    o.test_script = Some(script.to_path_buf());
    // Small periodic snapshots so the test also exercises them.
    let server = Server::start(
        o,
        Box::new(ModelRunner::new(m, tok, 8192, cache_bytes, 256)),
    )
    .unwrap();
    let base = format!("http://{}", server.addr);
    Srv { server, base }
}

fn chat(base: &str, body: &Value) -> Value {
    let r = ureq::post(&format!("{base}/v1/chat/completions"))
        .timeout(Duration::from_secs(300))
        .send_string(&body.to_string());
    match r {
        Ok(r) => serde_json::from_str(&r.into_string().unwrap()).unwrap(),
        Err(ureq::Error::Status(c, r)) => panic!("status {c}: {}", r.into_string().unwrap()),
        Err(e) => panic!("{e}"),
    }
}

/// One turn's result: what the client sees, the token logprobs, and the reuse.
struct Turn {
    reply: Value,
    logprobs: Vec<f64>,
    cached: u64,
    prompt_tokens: u64,
}

/// An agent session: 8 user turns; turns 2 and 5 trigger a scripted tool call, whose result
/// goes back in; the others are the model's own greedy text (thinking on for odd turns).
fn session(base: &str, preserve: bool, key: Option<&str>, topic: &str) -> Vec<Turn> {
    let mut messages = vec![
        json!({"role": "system", "content": format!("You are a careful coding agent working on {topic}.")}),
    ];
    let mut out = Vec::new();
    for turn in 0..8 {
        let ask = match turn {
            2 => format!("Please look up the weather for the {topic} offsite."),
            5 => "Now read the file with the entry point.".to_string(),
            _ => format!("Turn {turn} about {topic}: what next?"),
        };
        messages.push(json!({"role": "user", "content": ask}));
        loop {
            let mut body = json!({
                "messages": messages, "tools": tools(), "max_tokens": 12, "temperature": 0,
                "logprobs": true, "top_logprobs": 1,
                "chat_template_kwargs": {"enable_thinking": turn % 2 == 1, "preserve_thinking": preserve},
            });
            if let Some(k) = key {
                body["prompt_cache_key"] = json!(k);
            }
            let r = chat(base, &body);
            let msg = r["choices"][0]["message"].clone();
            let lps = r["choices"][0]["logprobs"]["content"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["logprob"].as_f64().unwrap())
                .collect();
            out.push(Turn {
                reply: json!([
                    msg["content"],
                    msg["reasoning_content"],
                    msg["tool_calls"]
                        .as_array()
                        .map(|c| c.iter().map(|x| x["function"].clone()).collect::<Vec<_>>())
                ]),
                logprobs: lps,
                cached: r["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap(),
                prompt_tokens: r["usage"]["prompt_tokens"].as_u64().unwrap(),
            });
            let mut hist =
                json!({"role": "assistant", "content": msg["content"].as_str().unwrap_or("")});
            if let Some(rc) = msg.get("reasoning_content").filter(|v| v.is_string()) {
                hist["reasoning_content"] = rc.clone();
            }
            let calls = msg["tool_calls"].as_array().cloned().unwrap_or_default();
            if !calls.is_empty() {
                hist["tool_calls"] = Value::Array(calls.clone());
            }
            messages.push(hist);
            if calls.is_empty() {
                break;
            }
            for c in calls {
                messages.push(json!({"role": "tool", "tool_call_id": c["id"], "content": format!("result of {}", c["function"]["name"])}));
            }
        }
    }
    out
}

fn same(a: &[Turn], b: &[Turn], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: turn counts differ");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.reply, y.reply, "{what}: request {i} differs");
        assert_eq!(
            x.prompt_tokens, y.prompt_tokens,
            "{what}: request {i} prompt length differs"
        );
        for (p, q) in x.logprobs.iter().zip(&y.logprobs) {
            assert!(
                (p - q).abs() < 1e-3,
                "{what}: request {i}: logprob {p} vs {q}"
            );
        }
    }
}

#[test]
fn cache_on_off_and_evicting_give_identical_sessions() {
    let dir = tempfile::tempdir().unwrap();
    lily::synth::write_checkpoint(
        &lily::synth::preset("small").unwrap(),
        dir.path(),
        11,
        &|_, _| {},
    )
    .unwrap();
    let script = dir.path().join("script.json");
    std::fs::write(&script, SCRIPT).unwrap();

    let off = start(dir.path(), &script, 0);
    let on = start(dir.path(), &script, 512 << 20);
    // About one entry's KV without its snapshots: constant eviction and snapshot shedding.
    let tiny = start(dir.path(), &script, 2 << 20);

    for preserve in [false, true] {
        let what = if preserve {
            "preserve_thinking"
        } else {
            "thinking dropped"
        };
        let reference = session(&off.base, preserve, None, "lily");
        assert!(reference.iter().all(|t| t.cached == 0));
        let cached = session(&on.base, preserve, None, "lily");
        same(&reference, &cached, what);
        // Every request after the first reuses most of its prompt: at least everything before
        // the previous request's final assistant header.
        for (i, t) in cached.iter().enumerate().skip(1) {
            let prev = cached[i - 1].prompt_tokens;
            assert!(
                t.cached + 8 >= prev.min(t.prompt_tokens) / 2,
                "{what}: request {i} reused only {} of {} (previous prompt {prev})",
                t.cached,
                t.prompt_tokens
            );
            assert!(t.cached < t.prompt_tokens);
        }
        let total_cached: u64 = cached.iter().map(|t| t.cached).sum();
        let total: u64 = cached.iter().map(|t| t.prompt_tokens).sum();
        eprintln!("{what}: {total_cached} of {total} prompt tokens reused");
        assert!(
            total_cached * 10 >= total * 6,
            "{what}: only {total_cached}/{total} reused"
        );
        let evicting = session(&tiny.base, preserve, None, "lily");
        same(&reference, &evicting, &format!("{what}, tiny budget"));
    }

    // Two conversations interleaved, keyed and not: identical to running each alone without
    // the cache; neither reuses more than the other could share (the system prompt differs).
    let ref_a = session(&off.base, false, None, "alpha");
    let ref_b = session(&off.base, false, None, "beta");
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| session(&on.base, false, Some("conv-a"), "alpha"));
        let b = s.spawn(|| session(&on.base, false, None, "beta"));
        (a.join().unwrap(), b.join().unwrap())
    });
    same(&ref_a, &a, "interleaved A");
    same(&ref_b, &b, "interleaved B");

    let m = ureq::get(&format!("{}/metrics", on.base))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    assert!(m.contains("lily_prefix_cache_hits_total"), "{m}");
    let bytes: f64 = m
        .lines()
        .find(|l| l.starts_with("lily_prefix_cache_bytes "))
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    assert!(bytes > 0.0 && bytes <= (512u64 << 20) as f64);
    let tm = ureq::get(&format!("{}/metrics", tiny.base))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    let ev: f64 = tm
        .lines()
        .find(|l| l.starts_with("lily_prefix_cache_evictions_total "))
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    assert!(ev > 0.0, "the tiny budget never evicted: {tm}");
    for s in [off, on, tiny] {
        s.server.shutdown(Duration::from_secs(10)).unwrap();
    }
}
