//! `lily serve` (the OpenAI-compatible server) and `lily demo` (the README quickstart: a small
//! synthetic checkpoint, the real server, one streamed chat completion through real HTTP).

use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};

use lily::backend::Backend;
use lily_server::{ModelRunner, Runner, ServeOptions, Server};

use crate::Common;

#[derive(Args)]
pub struct ServeArgs {
    /// Checkpoint directory.
    #[arg(long)]
    model: PathBuf,
    /// Address to bind (127.0.0.1: this machine only; 0.0.0.0: every interface).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Context length in tokens (default: the model's `max_position_embeddings`).
    #[arg(long)]
    max_context: Option<usize>,
    /// Require `Authorization: Bearer KEY` on every route but /health (also read from LILY_API_KEY).
    #[arg(long, env = "LILY_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Name reported in /v1/models and responses (default: the checkpoint directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Requests that may wait for the model; more get 503 + Retry-After.
    #[arg(long, default_value_t = 32)]
    queue: usize,
    /// Memory for the prefix cache (KV + recurrent-state snapshots of earlier requests), e.g.
    /// `4GiB`, `512MiB`, `0` (off). Default: 16 GiB on CUDA; on the CPU a quarter of RAM, at most 4 GiB.
    #[arg(long, value_parser = parse_size)]
    cache_mem: Option<usize>,
    /// Snapshot the recurrent state every this many tokens of a long prefill (0: only at turn
    /// boundaries and the end of the prompt).
    #[arg(long, default_value_t = 4096)]
    snapshot_every: usize,
    /// Largest request body in MiB.
    #[arg(long, default_value_t = 32)]
    max_body_mib: usize,
    /// Test mode: JSON list of {"when": substring, "reply": text}; a prompt containing `when`
    /// gets `reply` forced through the model instead of sampled text (for API tests with random
    /// weights).
    #[arg(long, hide = true)]
    test_script: Option<PathBuf>,
    #[command(flatten)]
    common: Common,
}

/// `4GiB`, `512M`, `1.5G`, `123456` (bytes) → bytes.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let x: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size like 4GiB or 512MiB"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" | "kib" => 1024.0,
        "m" | "mb" | "mib" => 1024.0 * 1024.0,
        "g" | "gb" | "gib" => 1024.0 * 1024.0 * 1024.0,
        u => return Err(format!("unknown size unit {u:?} (use KiB, MiB or GiB)")),
    };
    Ok((x * mult) as usize)
}

/// Cache settings for [`runner`].
#[derive(Clone, Copy)]
pub struct CacheArgs {
    pub bytes: Option<usize>,
    pub snapshot_every: usize,
}

/// The machine's memory in bytes (`/proc/meminfo`; `sysctl hw.memsize` on a Mac), if known.
fn machine_memory() -> Option<usize> {
    #[cfg(target_os = "macos")]
    {
        let out = std::process::Command::new("sysctl")
            .args(["-n", "hw.memsize"])
            .output()
            .ok()?;
        return String::from_utf8_lossy(&out.stdout).trim().parse().ok();
    }
    #[allow(unreachable_code)]
    std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<usize>().ok())
            .map(|kib| kib * 1024)
    })
}

/// A quarter of the machine's memory, at most 4 GiB (CPU default of `--cache-mem`).
fn cpu_cache_default() -> usize {
    (machine_memory().unwrap_or(8 << 30) / 4).min(4 << 30)
}

/// The wgpu backend's prefix-cache default, said on stderr: half of what the GPU's memory leaves
/// once the checkpoint and one sequence at the full context are in it, at most 4 GiB and at
/// least 256 MiB (`wgpu_cache_bytes`). The GPU's memory: a discrete adapter's own (Vulkan's
/// DEVICE_LOCAL heap); else, the GPU sharing the machine's memory (a Mac, an integrated GPU),
/// three quarters of the machine's (macOS lets the GPU have about that much), or the adapter's
/// heap where smaller. A 36 GiB Mac with the 19.4 GB checkpoint and a 32K context (1.4 GB of
/// f32 K/V and GDN state) keeps ~3.3 GiB for the cache.
#[cfg(feature = "wgpu")]
fn wgpu_cache_default(
    b: &lily::backend::wgpu::Wgpu,
    model: &Path,
    max_context: Option<usize>,
) -> usize {
    let r = b.report();
    let machine = machine_memory().map(|m| m as u64);
    let shared = machine.map(|m| m / 4 * 3);
    let (gpu, whose) = match (r.memory, r.device_type.as_str(), shared) {
        (Some(m), "DiscreteGpu", _) => (m, "the adapter's own"),
        (Some(m), _, Some(s)) if m < s => (m, "the adapter's heap"),
        (_, _, Some(s)) => (s, "3/4 of the machine's, shared"),
        (Some(m), _, None) => (m, "the adapter's heap"),
        (None, _, None) => (8u64 << 30, "assumed: the memory is unknown"),
    };
    // The checkpoint's files (its index's shards, or every *.safetensors) and one sequence at
    // the served context as the model's state holds it (model/state.rs).
    let weights: u64 = lily::loader::safetensors::checkpoint_files(model)
        .map(|fs| {
            fs.iter()
                .filter_map(|f| f.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0);
    let (ctx, state) = match lily::config::Config::from_dir(model) {
        Ok(c) => {
            use lily::model::state::{gdn_layer_bytes, kv_layer_bytes};
            let ctx = max_context.unwrap_or(c.max_position_embeddings);
            let d = lily::backend::Dims::from_config(&c);
            let attn = c.num_attention_layers();
            let kv = kv_layer_bytes(&d, ctx, b.kv_elem_bytes());
            let gdn = gdn_layer_bytes(&d);
            (ctx, (attn * kv + (c.num_hidden_layers - attn) * gdn) as u64)
        }
        Err(_) => (max_context.unwrap_or(0), 0),
    };
    let bytes = wgpu_cache_bytes(gpu, weights, state);
    let gib = |x: u64| x as f64 / (1u64 << 30) as f64;
    eprintln!(
        "lily: prefix cache {:.1} GiB on {}: of {:.1} GiB of GPU memory ({whose}), less the checkpoint's {:.1} GiB, one {ctx}-token sequence's {:.1} GiB and 1 GiB kept back, half, within 0.25-4 GiB (--cache-mem sets it)",
        gib(bytes),
        r.name,
        gib(gpu),
        gib(weights),
        gib(state),
    );
    if gpu < weights + state + (1 << 30) {
        eprintln!(
            "lily: warning: the checkpoint and a {ctx}-token context ({:.1} GiB) may not fit in {:.1} GiB of GPU memory (--max-context lowers the context)",
            gib(weights + state),
            gib(gpu)
        );
    }
    bytes as usize
}

/// The prefix cache's default bytes on a GPU of `gpu` bytes holding `weights` and one
/// sequence's `state`: half of the rest after 1 GiB kept back (scratch, activations, the
/// system's share), within 256 MiB .. 4 GiB.
#[cfg(any(test, feature = "wgpu"))]
fn wgpu_cache_bytes(gpu: u64, weights: u64, state: u64) -> u64 {
    let free = gpu.saturating_sub(weights + state + (1 << 30));
    (free / 2).clamp(256 << 20, 4 << 30)
}

/// Loads the model on the chosen backend and returns it as a server runner.
pub fn runner(
    model: &Path,
    common: &Common,
    max_context: Option<usize>,
    cache: CacheArgs,
) -> Result<(Box<dyn Runner>, usize)> {
    #[cfg(feature = "cuda")]
    if let Some(b) = crate::pick_cuda(common)? {
        crate::setup_threads(common)?;
        return runner_on(
            b,
            model,
            max_context,
            cache.bytes.unwrap_or(16 << 30),
            cache.snapshot_every,
        );
    }
    #[cfg(feature = "wgpu")]
    if let Some(b) = crate::pick_wgpu(common)? {
        crate::setup_threads(common)?;
        let bytes = cache
            .bytes
            .unwrap_or_else(|| wgpu_cache_default(&b, model, max_context));
        return runner_on(b, model, max_context, bytes, cache.snapshot_every);
    }
    let b = crate::setup(common)?;
    runner_on(
        b,
        model,
        max_context,
        cache.bytes.unwrap_or_else(cpu_cache_default),
        cache.snapshot_every,
    )
}

fn runner_on<B: Backend + 'static>(
    b: B,
    model: &Path,
    max_context: Option<usize>,
    cache_bytes: usize,
    every: usize,
) -> Result<(Box<dyn Runner>, usize)> {
    let m = crate::load_model(model, b)?;
    let limit = m.cfg.max_position_embeddings;
    let ctx = max_context.unwrap_or(limit);
    if ctx > limit {
        bail!("--max-context {ctx} is larger than the model's max_position_embeddings ({limit})");
    }
    let tok = Arc::new(lily::tokenizer::Tokenizer::from_dir(model)?);
    eprintln!(
        "lily: prefix cache {:.1} GiB, snapshot every {every} tokens",
        cache_bytes as f64 / (1u64 << 30) as f64
    );
    Ok((
        Box::new(ModelRunner::new(m, tok, ctx, cache_bytes, every)),
        ctx,
    ))
}

pub fn serve(a: ServeArgs) -> Result<()> {
    if !a.model.join("tokenizer.json").exists() {
        bail!(
            "{}: no tokenizer.json; the server needs the checkpoint's tokenizer and chat template",
            a.model.display()
        );
    }
    let (runner, ctx) = runner(
        &a.model,
        &a.common,
        a.max_context,
        CacheArgs {
            bytes: a.cache_mem,
            snapshot_every: a.snapshot_every,
        },
    )?;
    let mut o = ServeOptions::new(&a.model, ctx);
    o.host = a.host;
    o.port = a.port;
    o.api_key = a.api_key;
    o.model_name = a.served_model_name;
    o.queue = a.queue;
    o.max_body = a.max_body_mib.max(1) << 20;
    o.test_script = a.test_script;
    lily_server::serve(o, runner)
}

#[derive(Args)]
pub struct DemoArgs {
    /// Checkpoint directory (default: synthesize the `small` preset into models/demo-small).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The user message.
    #[arg(long, default_value = "Write a haiku about a lily in the rain.")]
    prompt: String,
    #[arg(long, default_value_t = 96)]
    max_tokens: usize,
    /// Think before answering (the reasoning is shown dimmed).
    #[arg(long)]
    think: bool,
    #[command(flatten)]
    common: Common,
}

pub fn demo(a: DemoArgs) -> Result<()> {
    let dir = match &a.model {
        Some(d) => d.clone(),
        None => {
            let d = PathBuf::from("models/demo-small");
            if !d.join("config.json").exists() || !d.join("tokenizer.json").exists() {
                eprintln!("lily demo: synthesizing the `small` preset into {} (random weights, a few seconds)", d.display());
                let cfg = lily::synth::preset("small")?;
                lily::synth::write_checkpoint(&cfg, &d, 0, &|_, _| {})?;
            }
            d
        }
    };
    eprintln!("lily demo: random weights produce noise text; the point is that every path of the real model and the real HTTP API runs.");
    let (runner, ctx) = runner(
        &dir,
        &a.common,
        Some(4096),
        CacheArgs {
            bytes: None,
            snapshot_every: 4096,
        },
    )?;
    let mut o = ServeOptions::new(&dir, ctx);
    o.port = 0;
    let server = Server::start(o, runner)?;
    let url = format!("http://{}/v1/chat/completions", server.addr);
    eprintln!(
        "lily demo: server on http://{} — POST {url} (stream)\n",
        server.addr
    );
    let r = stream_chat(&url, &a);
    server.shutdown(Duration::from_secs(10))?;
    r
}

/// Reads an SSE chat stream: calls `on_chunk` with each chunk object until `[DONE]`; an error
/// event becomes an error. Returns the usage object of the last chunk that had one.
pub fn read_sse(
    resp: ureq::Response,
    mut on_chunk: impl FnMut(&Value) -> Result<()>,
) -> Result<Value> {
    let mut usage = Value::Null;
    for line in BufReader::new(resp.into_reader()).lines() {
        let line = line?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data)?;
        if let Some(e) = v.get("error") {
            bail!("the server reported an error: {e}");
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
        on_chunk(&v)?;
    }
    Ok(usage)
}

/// One streamed chat completion through the HTTP API, printed as it arrives.
fn stream_chat(url: &str, a: &DemoArgs) -> Result<()> {
    let body = json!({
        "model": "demo",
        "messages": [{"role": "user", "content": a.prompt}],
        "max_tokens": a.max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
        "chat_template_kwargs": {"enable_thinking": a.think},
    });
    let t0 = Instant::now();
    let resp = ureq::post(url)
        .set("Content-Type", "application/json")
        .send_string(&body.to_string())
        .context("the demo request failed")?;
    let dim = std::io::stdout().is_terminal();
    let mut out = std::io::stdout().lock();
    let mut ttft = None;
    let mut finish = String::new();
    println!("user: {}\nassistant:", a.prompt);
    let usage = read_sse(resp, |v| {
        let Some(c) = v["choices"].get(0) else {
            return Ok(());
        };
        if let Some(f) = c["finish_reason"].as_str() {
            finish = f.to_string();
        }
        let d = &c["delta"];
        for (key, dimmed) in [("reasoning_content", true), ("content", false)] {
            if let Some(s) = d[key].as_str().filter(|s| !s.is_empty()) {
                ttft.get_or_insert_with(|| t0.elapsed());
                if dimmed && dim {
                    write!(out, "\x1b[2m{s}\x1b[0m")?;
                } else {
                    write!(out, "{s}")?;
                }
                out.flush()?;
            }
        }
        Ok(())
    })?;
    let total = t0.elapsed();
    let n = usage["completion_tokens"].as_u64().unwrap_or(0);
    let p = usage["prompt_tokens"].as_u64().unwrap_or(0);
    let ttft = ttft.unwrap_or(total);
    let decode_s = (total - ttft).as_secs_f64();
    println!("\n");
    eprintln!(
        "lily demo: {p} prompt tokens, {n} generated (finish: {finish}); time to first token {:.0} ms, {:.1} tok/s after it, {:.2} s in all",
        ttft.as_secs_f64() * 1e3,
        if decode_s > 0.0 { n.saturating_sub(1) as f64 / decode_s } else { 0.0 },
        total.as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::wgpu_cache_bytes;

    const GIB: u64 = 1 << 30;

    /// The wgpu prefix-cache default (issue #14: a 36 GB Mac must run the 19.4 GB checkpoint
    /// with a 32K context): what is left after the weights, one sequence and 1 GiB, halved,
    /// within 256 MiB .. 4 GiB.
    #[test]
    fn wgpu_cache_default_leaves_room_for_the_model_and_its_context() {
        let (weights, state_32k) = (19_400_000_000u64, 1_408_000_000u64);
        // A 36 GiB Mac: the GPU may use 3/4 of it (27 GiB).
        let mac36 = wgpu_cache_bytes(36 * GIB / 4 * 3, weights, state_32k);
        assert!(mac36 > 3 * GIB && mac36 < 4 * GIB, "{mac36}");
        assert!(weights + state_32k + mac36 + GIB <= 36 * GIB / 4 * 3);
        // A 24 GiB Mac cannot hold the checkpoint: the floor, not an overflow.
        assert_eq!(wgpu_cache_bytes(18 * GIB, weights, state_32k), 256 << 20);
        // An 80 GB discrete GPU: the 4 GiB cap.
        assert_eq!(wgpu_cache_bytes(80 * GIB, weights, state_32k), 4 * GIB);
    }
}
