//! `lily bench-session`: time to first token per turn of a growing agent session, prefix cache
//! on vs off, through the real HTTP API (two in-process servers on the same checkpoint, the
//! order alternated per turn). Both servers get the same history (the cache-off server's
//! replies), so the prompts are identical token for token.
//!
//! The session: a system prompt with two tools, then `turns` user messages that each add a slice
//! of file-like text so the last prompt reaches about `--context` tokens; thinking is on, so the
//! template drops each earlier turn's reasoning from the history (the hard case for reuse).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};

use lily_server::{ServeOptions, Server};

use crate::serve::{parse_size, read_sse, runner, CacheArgs};
use crate::Common;

#[derive(Args)]
pub struct SessionBenchArgs {
    /// Checkpoint directory.
    #[arg(long)]
    model: PathBuf,
    #[arg(long, default_value_t = 8)]
    turns: usize,
    /// Approximate prompt tokens at the last turn.
    #[arg(long, default_value_t = 16384)]
    context: usize,
    /// Tokens generated per turn.
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Prefix-cache memory of the cache-on server.
    #[arg(long, value_parser = parse_size, default_value = "4GiB")]
    cache_mem: usize,
    #[arg(long, default_value_t = 4096)]
    snapshot_every: usize,
    /// Write the results as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    common: Common,
}

const WORDS: &[&str] = &[
    "fn",
    "let",
    "mut",
    "self",
    "return",
    "match",
    "Some",
    "None",
    "Ok",
    "Err",
    "state",
    "cache",
    "token",
    "layer",
    "kernel",
    "buffer",
    "prefill",
    "decode",
    "expert",
    "router",
    "snapshot",
    "session",
    "request",
    "stream",
    "value",
    "index",
    "offset",
    "length",
    "error",
    "result",
    "config",
    "model",
    "weight",
    "scale",
    "bias",
    "group",
    "norm",
    "gate",
    "attention",
    "delta",
    "recurrent",
    "conv",
    "head",
];

/// Deterministic file-like text of about `tokens` tokens (≈ 1.3 tokens per word here).
fn filler(turn: usize, tokens: usize) -> String {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ turn as u64;
    let mut s = format!("File src/part{turn}.rs:\n");
    for i in 0..(tokens * 10 / 13) {
        x = lily::rng::mix64(x);
        s.push_str(WORDS[(x % WORDS.len() as u64) as usize]);
        s.push(if i % 12 == 11 { '\n' } else { ' ' });
    }
    s
}

struct Measure {
    ttft_s: f64,
    total_s: f64,
    prompt_tokens: u64,
    cached: u64,
    message: Value,
}

/// One streamed request; time to the first generated token as the client sees it.
fn request(base: &str, messages: &[Value], tools: &Value, max_tokens: usize) -> Result<Measure> {
    let body = json!({"messages": messages, "tools": tools, "max_tokens": max_tokens, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}});
    let t0 = Instant::now();
    let r = ureq::post(&format!("{base}/v1/chat/completions"))
        .timeout(Duration::from_secs(3600))
        .send_string(&body.to_string())
        .context("request failed")?;
    let mut ttft = None;
    let (mut content, mut reasoning) = (String::new(), String::new());
    let usage = read_sse(r, |v| {
        let delta = &v["choices"][0]["delta"];
        for (k, buf) in [
            ("content", &mut content),
            ("reasoning_content", &mut reasoning),
        ] {
            if let Some(s) = delta[k].as_str().filter(|s| !s.is_empty()) {
                ttft.get_or_insert_with(|| t0.elapsed().as_secs_f64());
                buf.push_str(s);
            }
        }
        if delta["tool_calls"].is_array() {
            ttft.get_or_insert_with(|| t0.elapsed().as_secs_f64());
        }
        Ok(())
    })?;
    let total_s = t0.elapsed().as_secs_f64();
    let mut message = json!({"role": "assistant", "content": content});
    if !reasoning.is_empty() {
        message["reasoning_content"] = json!(reasoning);
    }
    Ok(Measure {
        ttft_s: ttft.unwrap_or(total_s),
        total_s,
        prompt_tokens: usage["prompt_tokens"].as_u64().unwrap_or(0),
        cached: usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
        message,
    })
}

fn metric(base: &str, name: &str) -> f64 {
    let text = ureq::get(&format!("{base}/metrics"))
        .call()
        .ok()
        .and_then(|r| r.into_string().ok())
        .unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

pub fn run(a: SessionBenchArgs) -> Result<()> {
    let ctx = (a.context + a.context / 2 + 4096).max(8192);
    let start = |bytes: usize| -> Result<(Server, usize)> {
        let (r, ctx) = runner(
            &a.model,
            &a.common,
            Some(ctx),
            CacheArgs {
                bytes: Some(bytes),
                snapshot_every: a.snapshot_every,
            },
        )?;
        let kv_elem = r.kv_elem_bytes();
        let mut o = ServeOptions::new(&a.model, ctx);
        o.port = 0;
        Ok((Server::start(o, r)?, kv_elem))
    };
    let (off, _) = start(0)?;
    let (on, kv_elem) = start(a.cache_mem)?;
    let (b_off, b_on) = (
        format!("http://{}", off.addr),
        format!("http://{}", on.addr),
    );
    let tools = json!([
        {"type": "function", "function": {"name": "read_file", "description": "Read a file of the project", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
        {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite", "parameters": {"type": "object", "properties": {"filter": {"type": "string"}}}}}
    ]);
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent. Read files, run tests, and explain changes briefly."}),
    ];
    let per_turn = a.context / a.turns.max(1);
    let mut rows = Vec::new();
    println!(
        "{:>4} {:>8} {:>8} {:>11} {:>11} {:>8}",
        "turn", "prompt", "cached", "ttft off", "ttft on", "speedup"
    );
    let (mut sum_off, mut sum_on) = (0.0, 0.0);
    for turn in 0..a.turns {
        messages.push(json!({"role": "user", "content": format!("{}\nWhat does this part do?", filler(turn, per_turn.saturating_sub(a.max_tokens + 16)))}));
        // Alternate which server goes first, so neither always runs on a warmer machine.
        let (m_off, m_on) = if turn % 2 == 0 {
            let x = request(&b_off, &messages, &tools, a.max_tokens)?;
            (x, request(&b_on, &messages, &tools, a.max_tokens)?)
        } else {
            let y = request(&b_on, &messages, &tools, a.max_tokens)?;
            (request(&b_off, &messages, &tools, a.max_tokens)?, y)
        };
        if m_off.prompt_tokens != m_on.prompt_tokens {
            bail!(
                "turn {turn}: the two servers saw different prompts ({} vs {} tokens)",
                m_off.prompt_tokens,
                m_on.prompt_tokens
            );
        }
        sum_off += m_off.total_s;
        sum_on += m_on.total_s;
        println!(
            "{:>4} {:>8} {:>8} {:>9.1}ms {:>9.1}ms {:>7.1}×",
            turn + 1,
            m_on.prompt_tokens,
            m_on.cached,
            m_off.ttft_s * 1e3,
            m_on.ttft_s * 1e3,
            m_off.ttft_s / m_on.ttft_s.max(1e-9)
        );
        rows.push(json!({"turn": turn + 1, "prompt_tokens": m_on.prompt_tokens, "cached_tokens": m_on.cached, "ttft_off_s": m_off.ttft_s, "ttft_on_s": m_on.ttft_s, "total_off_s": m_off.total_s, "total_on_s": m_on.total_s}));
        messages.push(m_off.message);
    }
    let bytes = metric(&b_on, "lily_prefix_cache_bytes");
    let snaps = metric(&b_on, "lily_prefix_cache_snapshots");
    let entries = metric(&b_on, "lily_prefix_cache_entries");
    let ck = lily::loader::Checkpoint::open(&a.model)?;
    let c = &ck.config;
    let d = lily::backend::Dims::from_config(c);
    let n_attn = c.layer_is_attention.iter().filter(|&&x| x).count();
    let n_gdn = c.layer_is_attention.len() - n_attn;
    let snap_bytes = n_gdn
        * ((d.conv_kernel - 1) * d.conv_channels() + d.gdn_v_heads * d.gdn_v_dim * d.gdn_k_dim)
        * 4;
    let kv_per_token = n_attn * 2 * d.n_kv_heads * d.head_dim * kv_elem;
    println!(
        "\nsession time: cache off {sum_off:.2}s, on {sum_on:.2}s (ratio {:.2}×)\ncache: {entries} entries, {snaps} snapshots, {:.1} MiB held; theory: snapshot {:.2} MiB, KV {:.1} KiB/token ({kv_elem}-byte elements)",
        sum_off / sum_on.max(1e-9),
        bytes / 1048576.0,
        snap_bytes as f64 / 1048576.0,
        kv_per_token as f64 / 1024.0,
    );
    if let Some(p) = &a.json {
        let v = json!({"rows": rows, "session_s_off": sum_off, "session_s_on": sum_on, "cache_bytes": bytes, "cache_entries": entries, "cache_snapshots": snaps,
            "theory": {"snapshot_bytes": snap_bytes, "kv_bytes_per_token": kv_per_token}});
        std::fs::write(p, serde_json::to_string_pretty(&v)?)?;
    }
    off.shutdown(Duration::from_secs(30))?;
    on.shutdown(Duration::from_secs(30))?;
    Ok(())
}
