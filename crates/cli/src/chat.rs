//! `lily chat`: an interactive terminal chat, and the text/chat paths of `lily generate`.
//!
//! The conversation is kept as OpenAI-style messages and rendered with the checkpoint's own chat
//! template each turn. Generated text starts inside `<think>` when thinking is on (the generation
//! prompt opens it): reasoning is shown dimmed until `</think>`, then the answer. The assistant
//! turn goes back into the history as `content` + `reasoning_content`, as the template expects.
//! Ctrl-C stops the current generation and keeps the session; Ctrl-C at the prompt (or Ctrl-D,
//! or `/quit`) ends it.

use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Map, Value};

use lily::backend::Backend;
use lily::model::Qwen35;
use lily::runtime::cache::{generate_cached, CacheConfig, PrefixCache};
use lily::runtime::generate::{Forced, GenRequest, Generation};
use lily::runtime::sampler::{SamplingOverrides, SamplingParams};
use lily::runtime::stop::StopRules;
use lily::tokenizer::{ChatTemplate, Tokenizer};

/// Sampling and stop flags shared by `generate` and `chat`; unset values come from the
/// checkpoint's `generation_config.json`.
#[derive(Args, Clone, Debug, Default)]
pub struct SamplingArgs {
    /// Temperature (0 = greedy).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long)]
    pub top_k: Option<i64>,
    /// Nucleus sampling: keep the smallest set with this much probability.
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Drop tokens below this fraction of the most likely one.
    #[arg(long)]
    pub min_p: Option<f32>,
    #[arg(long)]
    pub presence_penalty: Option<f32>,
    #[arg(long)]
    pub frequency_penalty: Option<f32>,
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    /// Seed for reproducible sampling.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop string (repeatable); not included in the output.
    #[arg(long = "stop", value_name = "TEXT")]
    pub stop: Vec<String>,
}

impl SamplingArgs {
    pub fn params(&self, model: &Path) -> Result<SamplingParams> {
        let base = SamplingParams::from_generation_config(model)?;
        base.with_overrides(&SamplingOverrides {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
        })
    }
}

#[derive(Args)]
pub struct ChatArgs {
    /// Checkpoint directory.
    #[arg(long)]
    model: PathBuf,
    /// A system message for the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Start with thinking off (toggle with /think).
    #[arg(long)]
    no_think: bool,
    /// Tokens to generate per turn at most.
    #[arg(long, default_value_t = 2048)]
    max_tokens: usize,
    /// Context length.
    #[arg(long, default_value_t = 32768)]
    max_context: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    common: crate::Common,
}

const DIM: &str = "\x1b[2m";
const RESET: &str = "\x1b[0m";

/// Splits an assistant turn into (reasoning, answer): the text before `</think>` is reasoning
/// when the prompt opened `<think>`.
pub fn split_reasoning(text: &str, thinking: bool) -> (String, String) {
    match text.find("</think>") {
        Some(i) => (
            text[..i].trim().to_string(),
            text[i + "</think>".len()..].trim_start().to_string(),
        ),
        None if thinking => (text.trim().to_string(), String::new()),
        None => (String::new(), text.to_string()),
    }
}

/// Everything a turn needs. Each turn re-renders the whole conversation; the prefix cache
/// resumes from the snapshot before the new turn, so only new tokens are prefilled.
pub struct Session<B: Backend> {
    pub model: Qwen35<B>,
    pub tok: Tokenizer,
    pub template: ChatTemplate,
    pub stop_ids: Vec<u32>,
    cache: PrefixCache<B>,
}

/// Prefix-cache memory of `lily chat` (one conversation: KV + a few snapshots).
const CHAT_CACHE_BYTES: usize = 2 << 30;

impl<B: Backend> Session<B> {
    pub fn open(dir: &Path, b: B) -> Result<Self> {
        let model = crate::load_model(dir, b)?;
        let tok = Tokenizer::from_dir(dir)?;
        let template = ChatTemplate::from_dir(dir)?;
        let mut stop_ids = lily::tokenizer::stop_ids(dir)?;
        for t in ["<|im_end|>", "<|endoftext|>"] {
            if let Some(id) = tok.token_id(t) {
                if !stop_ids.contains(&id) {
                    stop_ids.push(id);
                }
            }
        }
        let cache = PrefixCache::new(CacheConfig {
            budget: CHAT_CACHE_BYTES,
            snapshot_every: 4096,
            turn_start: tok.token_id("<|im_start|>"),
        });
        Ok(Self {
            model,
            tok,
            template,
            stop_ids,
            cache,
        })
    }

    /// Renders `messages`, generates one assistant turn, streaming text to `on_text`.
    pub fn turn(
        &mut self,
        messages: &Value,
        tools: Option<&Value>,
        kwargs: &Map<String, Value>,
        sampling: &SamplingParams,
        stop_strings: &[String],
        max_tokens: usize,
        max_context: usize,
        cancel: &AtomicBool,
        mut on_text: impl FnMut(&str),
    ) -> Result<Generation> {
        let prompt_text = self.template.render(messages, tools, true, kwargs)?;
        let prompt = self.tok.encode(&prompt_text)?;
        if prompt.len() >= max_context {
            bail!(
                "the conversation is {} tokens, more than the context of {max_context}",
                prompt.len()
            );
        }
        let rules = StopRules {
            stop_ids: self.stop_ids.clone(),
            stop_strings: stop_strings.to_vec(),
            max_tokens: Some(max_tokens),
            max_context,
        };
        rules.validate()?;
        let req = GenRequest {
            prompt: &prompt,
            cached: 0,
            sampling,
            stop: rules,
            logprobs: None,
            forced: Forced::default(),
            constraint: None,
            cancel,
        };
        generate_cached(
            &self.model,
            &mut self.cache,
            &self.tok,
            None,
            max_context,
            req,
            &mut |_| {},
            |e| {
                if !e.text.is_empty() {
                    on_text(e.text);
                }
                true
            },
        )
    }
}

fn rate(n: usize, s: f64) -> f64 {
    n as f64 / s.max(1e-9)
}

pub fn run(a: ChatArgs) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Some(b) = crate::pick_cuda(&a.common)? {
        crate::setup_threads(&a.common)?;
        return run_on(b, a);
    }
    #[cfg(feature = "wgpu")]
    if let Some(b) = crate::pick_wgpu(&a.common)? {
        crate::setup_threads(&a.common)?;
        return run_on(b, a);
    }
    let b = crate::setup(&a.common)?;
    run_on(b, a)
}

fn run_on<B: Backend>(b: B, a: ChatArgs) -> Result<()> {
    let mut sess = Session::open(&a.model, b)?;
    let sampling = a.sampling.params(&a.model)?;
    let cancel = Arc::new(AtomicBool::new(false));
    let generating = Arc::new(AtomicBool::new(false));
    {
        let (c, g) = (cancel.clone(), generating.clone());
        ctrlc::set_handler(move || {
            if g.load(Ordering::SeqCst) {
                c.store(true, Ordering::SeqCst);
            } else {
                eprintln!();
                std::process::exit(130);
            }
        })
        .context("cannot install the Ctrl-C handler")?;
    }
    let tty = std::io::stdout().is_terminal();
    let (dim, reset) = if tty { (DIM, RESET) } else { ("", "") };
    let mut thinking = !a.no_think;
    let mut messages: Vec<Value> = Vec::new();
    if let Some(s) = &a.system {
        messages.push(json!({"role": "system", "content": s}));
    }
    eprintln!("lily chat — /think toggles thinking (now {}), /reset clears, /quit exits; Ctrl-C stops a reply", if thinking { "on" } else { "off" });
    let stdin = std::io::stdin();
    let mut line = String::new();
    loop {
        print!("\n> ");
        std::io::stdout().flush()?;
        line.clear();
        if stdin.lock().read_line(&mut line)? == 0 {
            println!();
            return Ok(());
        }
        let input = line.trim_end_matches(['\n', '\r']);
        match input.trim() {
            "" => continue,
            "/quit" | "/exit" => return Ok(()),
            "/think" => {
                thinking = !thinking;
                println!("thinking {}", if thinking { "on" } else { "off" });
                continue;
            }
            "/reset" => {
                messages.retain(|m| m["role"] == "system");
                println!("conversation cleared");
                continue;
            }
            _ => {}
        }
        messages.push(json!({"role": "user", "content": input}));
        let mut kwargs = Map::new();
        kwargs.insert("enable_thinking".into(), Value::Bool(thinking));
        cancel.store(false, Ordering::SeqCst);
        generating.store(true, Ordering::SeqCst);
        // Reasoning (dimmed) until </think>, then the answer. The marker may arrive split over
        // several pieces, so look at everything streamed so far.
        let mut shown = String::new();
        let mut in_reasoning = thinking;
        if in_reasoning {
            print!("{dim}");
        }
        let res = sess.turn(
            &Value::Array(messages.clone()),
            None,
            &kwargs,
            &sampling,
            &a.sampling.stop,
            a.max_tokens,
            a.max_context,
            &cancel,
            |piece| {
                let start = shown.len();
                shown.push_str(piece);
                if in_reasoning {
                    if let Some(i) = shown.find("</think>") {
                        let end = i + "</think>".len();
                        print!("{}", &shown[start.min(i)..i]);
                        print!("{reset}\n");
                        print!("{}", shown[end.max(start)..].trim_start_matches('\n'));
                        in_reasoning = false;
                    } else {
                        print!("{piece}");
                    }
                } else {
                    print!("{piece}");
                }
                let _ = std::io::stdout().flush();
            },
        );
        generating.store(false, Ordering::SeqCst);
        print!("{reset}");
        match res {
            Ok(g) => {
                let (reasoning, answer) = split_reasoning(&g.text, thinking);
                let mut msg = json!({"role": "assistant", "content": answer});
                if !reasoning.is_empty() {
                    msg["reasoning_content"] = Value::String(reasoning);
                }
                messages.push(msg);
                let why = match &g.finish {
                    None => "interrupted".to_string(),
                    Some(f) => format!("{f:?}").to_lowercase(),
                };
                println!(
                    "\n{dim}[{} prompt tok ({} cached), {:.1} tok/s prefill · {} tok, {:.1} tok/s · {why}]{reset}",
                    g.stats.prompt_tokens,
                    g.stats.cached_tokens,
                    rate(g.stats.prompt_tokens - g.stats.cached_tokens, g.stats.prefill_s),
                    g.stats.generated,
                    rate(g.stats.generated, g.stats.decode_s)
                );
            }
            Err(e) => {
                messages.pop();
                println!("\nlily: error: {e:#}");
            }
        }
    }
}
