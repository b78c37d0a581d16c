//! The server in-process on a `tiny` synthetic checkpoint, over real HTTP: cancellation when a
//! client disconnects, the bounded queue, shutdown with requests in flight, metrics balance, and
//! a fuzz of request bodies through the whole stack. (The OpenAI SDK tests live in
//! tools/api_tests and run from scripts/test.)

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lily::backend::cpu::Cpu;
use lily_server::{ModelRunner, ServeOptions, Server};
use serde_json::{json, Value};

struct Fixture {
    server: Server,
    base: String,
    _dir: tempfile::TempDir,
}

fn start_with(queue: usize, max_context: usize, key: Option<&str>) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let cfg = lily::synth::preset("tiny").unwrap();
    lily::synth::write_checkpoint(&cfg, dir.path(), 7, &|_, _| {}).unwrap();
    let m = lily::runtime::load(Cpu, dir.path()).unwrap();
    let tok = Arc::new(lily::tokenizer::Tokenizer::from_dir(dir.path()).unwrap());
    let mut o = ServeOptions::new(dir.path(), max_context);
    o.port = 0;
    o.queue = queue;
    o.max_body = 1 << 20;
    o.api_key = key.map(str::to_string);
    let server = Server::start(
        o,
        Box::new(ModelRunner::new(m, tok, max_context, 256 << 20, 1024)),
    )
    .unwrap();
    let base = format!("http://{}", server.addr);
    Fixture {
        server,
        base,
        _dir: dir,
    }
}

fn start(queue: usize, max_context: usize) -> Fixture {
    start_with(queue, max_context, None)
}

fn send(base: &str, path: &str, body: &[u8]) -> (u16, String) {
    match ureq::post(&format!("{base}{path}"))
        .set("Content-Type", "application/json")
        .timeout(Duration::from_secs(60))
        .send_bytes(body)
    {
        Ok(r) => (r.status(), r.into_string().unwrap()),
        Err(ureq::Error::Status(c, r)) => (c, r.into_string().unwrap()),
        Err(e) => panic!(
            "body {:?}: transport error {e}",
            String::from_utf8_lossy(body)
        ),
    }
}

fn post(base: &str, body: &Value) -> (u16, String) {
    send(base, "/v1/chat/completions", body.to_string().as_bytes())
}

/// Metric values by name (labels as written).
fn metrics(base: &str) -> HashMap<String, f64> {
    let text = ureq::get(&format!("{base}/metrics"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .map(|(k, v)| (k.to_string(), v.parse().unwrap()))
        .collect()
}

fn outcome(m: &HashMap<String, f64>, o: &str) -> f64 {
    m[&format!("lily_requests_finished_total{{outcome=\"{o}\"}}")]
}

/// Waits until nothing runs or waits, then checks received = Σ finished.
fn wait_settled(base: &str) -> HashMap<String, f64> {
    let t0 = Instant::now();
    loop {
        let m = metrics(base);
        let finished: f64 = ["ok", "cancelled", "error", "rejected"]
            .iter()
            .map(|o| outcome(&m, o))
            .sum();
        if m["lily_queue_depth"] == 0.0
            && m["lily_requests_running"] == 0.0
            && finished == m["lily_requests_received_total"]
        {
            return m;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "metrics never balanced: {m:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn long_stream_body(max_tokens: usize) -> String {
    json!({"messages": [{"role": "user", "content": "go on"}], "max_tokens": max_tokens, "stream": true, "temperature": 0, "chat_template_kwargs": {"enable_thinking": false}}).to_string()
}

/// Opens a streaming request and reads `lines` SSE data lines; returns the open reader.
fn open_stream(base: &str, body: &str, lines: usize) -> Box<dyn BufRead> {
    let r = ureq::post(&format!("{base}/v1/chat/completions"))
        .set("Content-Type", "application/json")
        .send_string(body)
        .unwrap();
    let mut rd: Box<dyn BufRead> = Box::new(BufReader::new(r.into_reader()));
    let mut n = 0;
    let mut line = String::new();
    while n < lines {
        line.clear();
        assert!(rd.read_line(&mut line).unwrap() > 0, "stream ended early");
        if line.starts_with("data: ") {
            n += 1;
        }
    }
    rd
}

#[test]
fn disconnect_cancels_generation() {
    let f = start(4, 8192);
    let rd = open_stream(&f.base, &long_stream_body(6000), 3);
    drop(rd);
    let m = wait_settled(&f.base);
    assert_eq!(outcome(&m, "cancelled"), 1.0, "{m:?}");
    // Stopped long before the 6000 tokens asked for.
    assert!(m["lily_generated_tokens_total"] < 3000.0, "{m:?}");
    // The server still answers.
    let (code, body) = post(
        &f.base,
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    );
    assert_eq!(code, 200, "{body}");
    f.server.shutdown(Duration::from_secs(10)).unwrap();
}

#[test]
fn full_queue_answers_503_with_retry_after() {
    let f = start(1, 8192);
    // One runs, one waits: the queue (capacity 1) is then full.
    let a = open_stream(&f.base, &long_stream_body(6000), 2);
    let t0 = Instant::now();
    let b = std::thread::spawn({
        let base = f.base.clone();
        move || {
            post(
                &base,
                &json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
            )
        }
    });
    while metrics(&f.base)["lily_queue_depth"] < 1.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the second request never queued"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    match ureq::post(&format!("{}/v1/chat/completions", f.base))
        .send_string(&json!({"messages": [{"role": "user", "content": "y"}]}).to_string())
    {
        Err(ureq::Error::Status(503, resp)) => {
            assert_eq!(resp.header("Retry-After"), Some("1"));
            let v: Value = serde_json::from_str(&resp.into_string().unwrap()).unwrap();
            assert_eq!(v["error"]["code"], "server_overloaded");
        }
        other => panic!("expected 503, got {:?}", other.map(|r| r.status())),
    }
    drop(a);
    let (code, _) = b.join().unwrap();
    assert_eq!(code, 200);
    let m = wait_settled(&f.base);
    assert_eq!(outcome(&m, "rejected"), 1.0);
    f.server.shutdown(Duration::from_secs(10)).unwrap();
}

#[test]
fn shutdown_cancels_in_flight_requests_cleanly() {
    let f = start(4, 8192);
    let mut rd = open_stream(&f.base, &long_stream_body(6000), 2);
    let waiting = std::thread::spawn({
        let base = f.base.clone();
        move || {
            post(
                &base,
                &json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}),
            )
        }
    });
    let t0 = Instant::now();
    while metrics(&f.base)["lily_queue_depth"] < 1.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the second request never queued"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let metrics = f.server.metrics.clone();
    let t0 = Instant::now();
    f.server.shutdown(Duration::from_secs(10)).unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "shutdown took {:?}",
        t0.elapsed()
    );
    // The stream ends with an error event, then [DONE].
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut rd, &mut rest);
    assert!(rest.contains("shutting down"), "{rest}");
    assert!(rest.trim_end().ends_with("data: [DONE]"), "{rest}");
    let (code, body) = waiting.join().unwrap();
    assert_eq!(code, 503, "{body}");
    assert_eq!(
        metrics.finished(lily_server::metrics::Outcome::Cancelled),
        2
    );
}

/// Random mutations of valid bodies through the whole stack: every answer is a JSON object with
/// `choices` (`content` for `/v1/messages`, `output` for `/v1/responses`) or `error`, nothing
/// crashes, nothing leaks a queue slot.
#[test]
fn fuzzed_bodies_get_clean_answers() {
    let f = start(8, 256);
    let seeds = [
        json!({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "stop": ["x"]}),
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}], "max_tokens": 2, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}], "tool_choice": "auto"}),
        json!({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}, {"role": "tool", "tool_call_id": "c", "content": "r"}], "max_tokens": 2, "logprobs": true, "top_logprobs": 2}),
        json!({"prompt": "once upon", "max_tokens": 3, "logprobs": 2, "stream": false}),
        // Anthropic's Messages API (`/v1/messages`).
        json!({"system": [{"type": "text", "text": "s"}], "max_tokens": 2, "thinking": {"type": "enabled", "budget_tokens": 9}, "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"a": 1}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]}]}),
        // OpenAI's Responses API (`/v1/responses`).
        json!({"instructions": "s", "max_output_tokens": 2, "reasoning": {"effort": "low"}, "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "q"}]}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "r"}]}),
    ];
    let mut rng = lily::rng::Rng::new(42);
    let n = 300;
    for i in 0..n {
        let seed = &seeds[i % seeds.len()];
        let mut b = seed.to_string().into_bytes();
        for _ in 0..1 + rng.below(4) {
            if b.is_empty() {
                break;
            }
            let at = rng.below(b.len() as u64) as usize;
            match rng.below(4) {
                0 => b[at] = rng.below(256) as u8,
                1 => {
                    b.remove(at);
                }
                2 => b.insert(at, b"{}[]\",:0-e\\\xff"[rng.below(12) as usize]),
                _ => b.truncate(at),
            }
        }
        let (path, answer) = if seed.get("prompt").is_some() {
            ("/v1/completions", "choices")
        } else if seed.get("system").is_some() {
            ("/v1/messages", "content")
        } else if seed.get("input").is_some() {
            ("/v1/responses", "output")
        } else {
            ("/v1/chat/completions", "choices")
        };
        let (code, text) = send(&f.base, path, &b);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| {
            panic!(
                "body {:?}: non-JSON answer {code}: {text}",
                String::from_utf8_lossy(&b)
            )
        });
        match code {
            200 => assert!(v[answer].is_array(), "{text}"),
            400 | 413 => assert!(v["error"]["message"].is_string(), "{text}"),
            _ => panic!(
                "body {:?}: status {code}: {text}",
                String::from_utf8_lossy(&b)
            ),
        }
    }
    let m = wait_settled(&f.base);
    assert_eq!(outcome(&m, "error"), 0.0, "{m:?}");
    assert_eq!(m["lily_requests_received_total"], n as f64);
    f.server.shutdown(Duration::from_secs(10)).unwrap();
}

#[test]
fn auth_and_routes() {
    let f = start_with(4, 512, Some("sekret"));
    let base = &f.base;
    assert_eq!(
        ureq::get(&format!("{base}/health"))
            .call()
            .unwrap()
            .status(),
        200
    );
    match ureq::get(&format!("{base}/v1/models")).call() {
        Err(ureq::Error::Status(401, r)) => {
            assert!(r.into_string().unwrap().contains("invalid_api_key"))
        }
        other => panic!("expected 401, got {:?}", other.map(|r| r.status())),
    }
    match ureq::get(&format!("{base}/v1/models"))
        .set("Authorization", "Bearer sekreT")
        .call()
    {
        Err(ureq::Error::Status(401, _)) => {}
        other => panic!("expected 401, got {:?}", other.map(|r| r.status())),
    }
    let v: Value = serde_json::from_str(
        &ureq::get(&format!("{base}/v1/models"))
            .set("Authorization", "Bearer sekret")
            .call()
            .unwrap()
            .into_string()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(v["data"][0]["object"], "model");
    // Anthropic's clients send `x-api-key`, and get Anthropic's error shape on /v1/messages.
    assert_eq!(
        ureq::get(&format!("{base}/v1/models"))
            .set("x-api-key", "sekret")
            .call()
            .unwrap()
            .status(),
        200
    );
    match ureq::post(&format!("{base}/v1/messages"))
        .set("x-api-key", "nope")
        .send_string("{}")
    {
        Err(ureq::Error::Status(401, r)) => {
            let v: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
            assert_eq!(
                (v["type"].as_str(), v["error"]["type"].as_str()),
                (Some("error"), Some("authentication_error")),
                "{v}"
            );
        }
        other => panic!("expected 401, got {:?}", other.map(|r| r.status())),
    }
    match ureq::get(&format!("{base}/v1/nope"))
        .set("Authorization", "Bearer sekret")
        .call()
    {
        Err(ureq::Error::Status(404, r)) => assert!(r.into_string().unwrap().contains("\"error\"")),
        other => panic!("expected 404, got {:?}", other.map(|r| r.status())),
    }
    match ureq::get(&format!("{base}/v1/chat/completions"))
        .set("Authorization", "Bearer sekret")
        .call()
    {
        Err(ureq::Error::Status(405, _)) => {}
        other => panic!("expected 405, got {:?}", other.map(|r| r.status())),
    }
    f.server.shutdown(Duration::from_secs(10)).unwrap();
}

/// A prompt over the context is a 400 with the counts; a large body is a JSON 413.
#[test]
fn context_and_body_limits() {
    let f = start(4, 64);
    let long = "word ".repeat(400);
    let (code, text) = post(
        &f.base,
        &json!({"messages": [{"role": "user", "content": long}], "max_tokens": 8}),
    );
    assert_eq!(code, 400, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("64 tokens"),
        "{text}"
    );
    let big = format!(
        "{{\"messages\": [{{\"role\": \"user\", \"content\": \"{}\"}}]}}",
        "a".repeat(2 << 20)
    );
    // The server answers 413 as soon as the limit is passed and closes the connection; a client
    // still writing the rest may see that as a reset instead of reading the answer (a race in
    // TCP, not in the server). Either way the request must be counted as rejected below.
    match ureq::post(&format!("{}/v1/chat/completions", f.base))
        .timeout(Duration::from_secs(60))
        .send_bytes(big.as_bytes())
    {
        Err(ureq::Error::Status(413, r)) => {
            assert!(r.into_string().unwrap().contains("request_too_large"))
        }
        Err(ureq::Error::Transport(_)) => {}
        other => panic!("expected 413, got {:?}", other.map(|r| r.status())),
    }
    let m = wait_settled(&f.base);
    assert_eq!(outcome(&m, "rejected"), 2.0);
    f.server.shutdown(Duration::from_secs(10)).unwrap();
}

/// A non-streaming client that gives up also stops its generation.
#[test]
fn non_streaming_disconnect_cancels() {
    let f = start(4, 8192);
    let body = json!({"messages": [{"role": "user", "content": "go"}], "max_tokens": 6000, "temperature": 0}).to_string();
    let r = ureq::post(&format!("{}/v1/chat/completions", f.base))
        .timeout(Duration::from_millis(300))
        .send_string(&body);
    assert!(r.is_err(), "the request should time out on the client");
    let m = wait_settled(&f.base);
    assert_eq!(outcome(&m, "cancelled"), 1.0, "{m:?}");
    assert!(m["lily_generated_tokens_total"] < 5000.0, "{m:?}");
    f.server.shutdown(Duration::from_secs(10)).unwrap();
}
