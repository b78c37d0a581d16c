//! `lily`: the command-line front end.
//!
//! The subcommands and flags below are a contract other tools script against (the foundation
//! issue lists them); keep them stable.

mod bench;
mod bench_schema;
mod chat;
mod lab;
mod render;
mod serve;
mod session_bench;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};

use lily::backend::cpu::Cpu;
use lily::backend::Backend;
use lily::model::{Logits, Pick};

#[derive(Parser)]
#[command(
    name = "lily",
    version,
    about = "lily: a fast inference engine for Qwen3.6-35B-A3B (MLX 4-bit checkpoints)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum BackendKind {
    /// The fastest available backend (says which it picked).
    Auto,
    /// The CPU reference backend (threads + SIMD).
    Cpu,
    /// NVIDIA GPUs (needs a build with `--features cuda`).
    Cuda,
    /// Any GPU through wgpu: Metal on a Mac, Vulkan elsewhere (needs `--features wgpu`). Asked
    /// for by name it also takes a software adapter (lavapipe); `auto` never does.
    Wgpu,
}

/// Flags every subcommand takes.
#[derive(Args, Clone, Debug)]
pub struct Common {
    /// Backend to run on.
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendKind,
    /// Worker threads for the CPU backend (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Write a seeded random checkpoint in the exact MLX format.
    Synth(SynthArgs),
    /// Generate tokens from a prompt (ids or text).
    Generate(GenerateArgs),
    /// Teacher-forced logits of a prompt; compare with a reference.
    Eval(EvalArgs),
    /// Prefill and decode throughput (the DESIGN.md benchmark contract).
    Bench(bench::BenchArgs),
    /// Interactive chat in the terminal (streams; reasoning shown dimmed).
    Chat(chat::ChatArgs),
    /// Print the chat-template prompt of a conversation exactly (or its token ids).
    Render(render::RenderArgs),
    /// The OpenAI-compatible HTTP server.
    Serve(serve::ServeArgs),
    /// Quickstart: a small synthetic model, the server, one streamed chat completion over HTTP.
    Demo(serve::DemoArgs),
    /// Time to first token per turn of a growing agent session, prefix cache on vs off.
    BenchSession(session_bench::SessionBenchArgs),
    /// Kernel lab (CUDA, or wgpu with --backend wgpu): each weight-reading decode op alone,
    /// cache-cold, against a pure read.
    Lab(lab::LabArgs),
}

#[derive(Args)]
struct SynthArgs {
    /// Preset: tiny | small | cpu-bench | qwen3.6-35b-a3b.
    #[arg(long)]
    preset: String,
    /// Output directory (created; must be empty or absent).
    #[arg(long)]
    out: PathBuf,
    /// Seed of the random weights (same seed, same bytes).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Override a config field, e.g. `--set num_hidden_layers=4` (repeatable).
    #[arg(long = "set", value_name = "FIELD=VALUE")]
    sets: Vec<String>,
    #[command(flatten)]
    common: Common,
}

#[derive(Args)]
struct GenerateArgs {
    /// Checkpoint directory.
    #[arg(long)]
    model: PathBuf,
    /// Prompt as comma-separated token ids.
    #[arg(long, conflicts_with_all = ["prompt", "chat"])]
    prompt_ids: Option<String>,
    /// Prompt as text (tokenized with the checkpoint's tokenizer; no chat template applied).
    #[arg(long, conflicts_with = "chat")]
    prompt: Option<String>,
    /// A conversation (JSON file with an OpenAI-style `messages` array, optional `tools`),
    /// rendered with the checkpoint's chat template and a generation prompt.
    #[arg(long)]
    chat: Option<PathBuf>,
    /// With --chat: template variables as JSON, e.g. '{"enable_thinking": false}'.
    #[arg(long)]
    template_kwargs: Option<String>,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: chat::SamplingArgs,
    /// Print generated token ids (comma-separated, one line) instead of text.
    #[arg(long)]
    ids: bool,
    /// Do not stop at the checkpoint's end-of-sequence ids.
    #[arg(long)]
    ignore_eos: bool,
    /// Context length (prompt + generated) to allow.
    #[arg(long, default_value_t = 32768)]
    max_context: usize,
    #[command(flatten)]
    common: Common,
}

#[derive(Args)]
struct EvalArgs {
    /// Checkpoint directory.
    #[arg(long)]
    model: PathBuf,
    /// Prompt as comma-separated token ids.
    #[arg(long)]
    prompt_ids: String,
    /// Write the teacher-forced logits [T, vocab] as float32 .npy.
    #[arg(long)]
    logits_out: Option<PathBuf>,
    /// Reference logits [T, vocab] (.npy) to compare with: prints max abs error, top-1 agreement
    /// and both perplexities against the next-token targets.
    #[arg(long)]
    reference: Option<PathBuf>,
    /// Prefill block size (tokens per forward call).
    #[arg(long)]
    chunk: Option<usize>,
    #[command(flatten)]
    common: Common,
}

/// Sets the CPU thread count (also used by a GPU backend's host side).
fn setup_threads(c: &Common) -> Result<()> {
    if let Some(n) = c.threads {
        if n == 0 {
            bail!("--threads must be at least 1");
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("cannot start the thread pool")?;
    }
    Ok(())
}

/// The CUDA backend when it is asked for (`cuda`) or available (`auto`); `None` = use the CPU.
#[cfg(feature = "cuda")]
pub fn pick_cuda(c: &Common) -> Result<Option<lily::backend::cuda::Cuda>> {
    match c.backend {
        BackendKind::Cuda => Ok(Some(lily::backend::cuda::Cuda::new()?)),
        BackendKind::Auto => match lily::backend::cuda::Cuda::new() {
            Ok(b) => {
                eprintln!("lily: backend auto → {}", lily::backend::Backend::name(&b));
                Ok(Some(b))
            }
            Err(e) => {
                eprintln!("lily: backend auto: no CUDA device ({e:#})");
                Ok(None)
            }
        },
        BackendKind::Cpu | BackendKind::Wgpu => Ok(None),
    }
}

/// The wgpu backend when it is asked for (`wgpu`: any adapter, software ones included) or a
/// hardware GPU adapter exists (`auto`, after CUDA); `None` = use the CPU. Says which adapter.
#[cfg(feature = "wgpu")]
pub fn pick_wgpu(c: &Common) -> Result<Option<lily::backend::wgpu::Wgpu>> {
    let b = match c.backend {
        BackendKind::Wgpu => lily::backend::wgpu::Wgpu::new(true)?,
        BackendKind::Auto => match lily::backend::wgpu::Wgpu::new(false) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("lily: backend auto: no wgpu GPU adapter ({e:#})");
                return Ok(None);
            }
        },
        BackendKind::Cpu | BackendKind::Cuda => return Ok(None),
    };
    let r = b.report();
    if !r.robust {
        eprintln!("lily: wgpu device without robust buffer access (LILY_WGPU_ROBUST=0)");
    }
    eprintln!(
        "lily: backend {} → {} (subgroups {}-{}, f16 {}, {} KiB workgroup memory, largest binding {} MiB, coop16 {} [{}])",
        if c.backend == BackendKind::Auto { "auto" } else { "wgpu" },
        lily::backend::Backend::name(&b),
        r.subgroup_min,
        r.subgroup_max,
        r.f16,
        r.workgroup_storage / 1024,
        r.max_binding >> 20,
        r.coop16,
        r.coop
    );
    Ok(Some(b))
}

/// Sets up threads and resolves the CPU backend (GPU dispatch happens before, see `pick_cuda`).
pub fn setup(c: &Common) -> Result<Cpu> {
    setup_threads(c)?;
    match c.backend {
        BackendKind::Cpu => Ok(Cpu),
        BackendKind::Auto => {
            eprintln!("lily: backend auto → cpu ({} threads)", rayon::current_num_threads());
            Ok(Cpu)
        }
        BackendKind::Cuda if cfg!(feature = "cuda") => bail!("--backend cuda: this command runs no model on a device (it works the same with --backend cpu)"),
        BackendKind::Cuda => bail!("--backend cuda: this build has no CUDA backend (build with `--features cuda`)"),
        BackendKind::Wgpu if cfg!(feature = "wgpu") => bail!("--backend wgpu: this command runs no model on a device (it works the same with --backend cpu)"),
        BackendKind::Wgpu => bail!("--backend wgpu: this build has no wgpu backend (build with `--features wgpu`)"),
    }
}

pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    let ids: Vec<u32> = s
        .split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| {
            x.parse::<u32>()
                .with_context(|| format!("--prompt-ids: `{x}` is not a token id"))
        })
        .collect::<Result<_>>()?;
    if ids.is_empty() {
        bail!("--prompt-ids: no token ids given");
    }
    Ok(ids)
}

/// Loads a checkpoint with a progress line on stderr.
pub fn load_model<B: Backend>(dir: &Path, b: B) -> Result<lily::model::Qwen35<B>> {
    let t0 = std::time::Instant::now();
    // Drawn only on a terminal (indicatif hides it otherwise).
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "loading {msg} [{bar:40}] layer {pos}/{len} {elapsed}",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    bar.set_message(b.name());
    let m = lily::runtime::load_with_progress(b, dir, &|done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    });
    bar.finish_and_clear();
    let m = m?;
    eprintln!(
        "lily: loaded {} ({} layers, {} experts, vocab {}) in {:.2}s",
        dir.display(),
        m.cfg.num_hidden_layers,
        m.cfg.num_experts,
        m.cfg.vocab_size,
        t0.elapsed().as_secs_f64()
    );
    Ok(m)
}

fn synth(a: SynthArgs) -> Result<()> {
    setup(&a.common)?;
    let mut cfg = lily::synth::preset(&a.preset)?;
    for s in &a.sets {
        lily::synth::apply_set(&mut cfg, s)?;
    }
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    bar.set_message(format!("synth {}", a.preset));
    let progress = |done: u64, total: u64| {
        bar.set_length(total);
        bar.set_position(done);
    };
    let rep = lily::synth::write_checkpoint(&cfg, &a.out, a.seed, &progress)?;
    bar.finish_and_clear();
    eprintln!(
        "lily: wrote {} ({} tensors, {:.1} MB in {} files) in {:.1}s",
        a.out.display(),
        rep.tensors,
        rep.bytes_written as f64 / 1e6,
        rep.files.len(),
        rep.seconds
    );
    Ok(())
}

fn generate(a: GenerateArgs) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Some(b) = pick_cuda(&a.common)? {
        setup_threads(&a.common)?;
        return generate_on(b, a);
    }
    #[cfg(feature = "wgpu")]
    if let Some(b) = pick_wgpu(&a.common)? {
        setup_threads(&a.common)?;
        return generate_on(b, a);
    }
    let b = setup(&a.common)?;
    generate_on(b, a)
}

fn generate_on<B: Backend>(b: B, a: GenerateArgs) -> Result<()> {
    let m = load_model(&a.model, b)?;
    let sampling = a.sampling.params(&a.model)?;
    let has_tok = a.model.join("tokenizer.json").exists();
    let tok = if has_tok {
        Some(lily::tokenizer::Tokenizer::from_dir(&a.model)?)
    } else {
        None
    };
    let need_tok = || {
        tok.as_ref()
            .context("this checkpoint has no tokenizer.json (use --prompt-ids and --ids)")
    };
    let prompt = match (&a.prompt_ids, &a.prompt, &a.chat) {
        (Some(s), _, _) => parse_ids(s)?,
        (None, Some(text), _) => need_tok()?.encode(text)?,
        (None, None, Some(file)) => {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("{}: cannot read", file.display()))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{}: not valid JSON", file.display()))?;
            let (messages, tools) = match &v {
                serde_json::Value::Array(_) => (v.clone(), None),
                _ => (
                    v.get("messages")
                        .cloned()
                        .with_context(|| format!("{}: no `messages` array", file.display()))?,
                    v.get("tools").cloned(),
                ),
            };
            let kwargs = match &a.template_kwargs {
                Some(k) => serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(k)
                    .context("--template-kwargs: not a JSON object")?,
                None => Default::default(),
            };
            let tmpl = lily::tokenizer::ChatTemplate::from_dir(&a.model)?;
            need_tok()?.encode(&tmpl.render(&messages, tools.as_ref(), true, &kwargs)?)?
        }
        (None, None, None) => {
            bail!("give a prompt: --prompt-ids 1,2,3, --prompt TEXT or --chat FILE.json")
        }
    };
    if prompt.len() >= a.max_context {
        bail!(
            "prompt of {} tokens does not fit the context of {} (--max-context)",
            prompt.len(),
            a.max_context
        );
    }
    let stop_ids = if a.ignore_eos {
        Vec::new()
    } else {
        lily::tokenizer::stop_ids(&a.model)?
    };
    let mut st = m.new_state(a.max_context)?;
    let stats;
    if let (Some(tok), false) = (tok.as_ref(), a.ids) {
        // Text out: stream as it comes.
        let rules = lily::runtime::stop::StopRules {
            stop_ids,
            stop_strings: a.sampling.stop.clone(),
            max_tokens: Some(a.max_tokens),
            max_context: a.max_context,
        };
        rules.validate()?;
        let cancel = std::sync::atomic::AtomicBool::new(false);
        let mut stdout = std::io::stdout();
        let g = lily::runtime::generate::generate(
            &m,
            &mut st,
            tok,
            &prompt,
            &sampling,
            rules,
            &cancel,
            |t| {
                use std::io::Write;
                let _ = write!(stdout, "{t}");
                let _ = stdout.flush();
            },
        )?;
        println!();
        stats = g.stats;
    } else {
        if !a.ids {
            bail!("this checkpoint has no tokenizer.json: add --ids to print token ids");
        }
        // Picks on the backend where it can (plain greedy: its arg-max; else its sampler for
        // these parameters), reading back only the ids; otherwise on the host from the logits.
        let mut sampler = lily::runtime::sampler::Sampler::new(sampling.clone(), m.cfg.vocab_size)?;
        let plain = sampling.is_plain_greedy();
        let mut dev = if plain {
            None
        } else {
            m.device_sampler(&sampling, sampler.seed(), &prompt)?
        };
        let on_backend = plain || dev.is_some();
        let t0 = std::time::Instant::now();
        let mut logits = m.forward(&mut st, &prompt, Logits::Last, None)?;
        if let Some(d) = dev.as_mut() {
            m.sample_last(&mut st, d)?;
        }
        let mut s = lily::runtime::GenStats {
            prompt_tokens: prompt.len(),
            prefill_s: t0.elapsed().as_secs_f64(),
            ..Default::default()
        };
        let t1 = std::time::Instant::now();
        let mut out: Vec<u32> = Vec::new();
        while out.len() < a.max_tokens && st.pos < a.max_context {
            // The lookahead (`Qwen35::picked_ahead`): where a token can follow this one (the
            // budget allows it; the loop's condition leaves room to feed it), the step feeding
            // it is enqueued before it is read; a stop id is then fed for nothing, as in the
            // serving loop.
            let ahead = on_backend && m.lookahead && out.len() + 1 < a.max_tokens;
            let id = if ahead {
                m.picked_ahead(&mut st, Pick::from(dev.as_mut()))?
            } else if on_backend {
                m.picked(&st)?
            } else {
                sampler.sample_split(&mut logits, &prompt, &out)
            };
            out.push(id);
            if stop_ids.contains(&id) || out.len() == a.max_tokens {
                break;
            }
            if ahead {
                continue; // fed already
            }
            if st.pos >= a.max_context {
                break;
            }
            if on_backend {
                m.decode_step(&mut st, None, dev.as_mut())?;
            } else {
                logits = m.forward(&mut st, &[id], Logits::Last, None)?;
            }
        }
        s.decode_s = t1.elapsed().as_secs_f64();
        s.generated = out.len();
        println!(
            "{}",
            out.iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .join(",")
        );
        stats = s;
    }
    eprintln!(
        "lily: prompt {} tok in {:.3}s ({:.1} tok/s), generated {} tok in {:.3}s ({:.1} tok/s)",
        stats.prompt_tokens,
        stats.prefill_s,
        stats.prompt_tokens as f64 / stats.prefill_s.max(1e-9),
        stats.generated,
        stats.decode_s,
        stats.generated as f64 / stats.decode_s.max(1e-9)
    );
    Ok(())
}

/// Log-softmax probability of `target` in a row of logits (f64 for a stable perplexity).
fn log_prob(row: &[f64], target: usize) -> f64 {
    let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
    row[target] - lse
}

fn top1(row: &[f64]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

fn eval(a: EvalArgs) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Some(b) = pick_cuda(&a.common)? {
        setup_threads(&a.common)?;
        return eval_on(b, a);
    }
    #[cfg(feature = "wgpu")]
    if let Some(b) = pick_wgpu(&a.common)? {
        setup_threads(&a.common)?;
        return eval_on(b, a);
    }
    let b = setup(&a.common)?;
    eval_on(b, a)
}

fn eval_on<B: Backend>(b: B, a: EvalArgs) -> Result<()> {
    let mut m = load_model(&a.model, b)?;
    if let Some(c) = a.chunk {
        m.chunk = c.max(1);
    }
    let ids = parse_ids(&a.prompt_ids)?;
    let v = m.cfg.vocab_size;
    let mut st = m.new_state(ids.len())?;
    let t0 = std::time::Instant::now();
    let logits = m.forward(&mut st, &ids, Logits::All, None)?;
    eprintln!(
        "lily: {} positions in {:.3}s",
        ids.len(),
        t0.elapsed().as_secs_f64()
    );
    if let Some(p) = &a.logits_out {
        lily::npy::write_f32(p, &[ids.len(), v], &logits)?;
    }
    if let Some(r) = &a.reference {
        let refa = lily::npy::read(r)?;
        if refa.shape != [ids.len(), v] {
            bail!(
                "{}: reference shape {:?} differs from [{}, {v}]",
                r.display(),
                refa.shape,
                ids.len()
            );
        }
        let ours: Vec<f64> = logits.iter().map(|&x| x as f64).collect();
        let (mut max_abs, mut ref_absmax, mut agree) = (0.0f64, 0.0f64, 0usize);
        let (mut nll_ours, mut nll_ref) = (0.0f64, 0.0f64);
        for t in 0..ids.len() {
            let (ro, rr) = (&ours[t * v..(t + 1) * v], &refa.data[t * v..(t + 1) * v]);
            for (x, y) in ro.iter().zip(rr) {
                max_abs = max_abs.max((x - y).abs());
                ref_absmax = ref_absmax.max(y.abs());
            }
            agree += (top1(ro) == top1(rr)) as usize;
            if t + 1 < ids.len() {
                nll_ours -= log_prob(ro, ids[t + 1] as usize);
                nll_ref -= log_prob(rr, ids[t + 1] as usize);
            }
        }
        let n = (ids.len() - 1).max(1) as f64;
        println!(
            "{}",
            serde_json::json!({
                "positions": ids.len(),
                "max_abs_err": max_abs,
                "max_rel_err": max_abs / ref_absmax.max(1e-30),
                "top1_agreement": agree as f64 / ids.len() as f64,
                "perplexity": (nll_ours / n).exp(),
                "reference_perplexity": (nll_ref / n).exp(),
            })
        );
    }
    Ok(())
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Synth(a) => synth(a),
        Cmd::Generate(a) => generate(a),
        Cmd::Eval(a) => eval(a),
        Cmd::Bench(a) => bench::run(a),
        Cmd::Chat(a) => chat::run(a),
        Cmd::Render(a) => render::run(a),
        Cmd::Serve(a) => serve::serve(a),
        Cmd::Demo(a) => serve::demo(a),
        Cmd::BenchSession(a) => session_bench::run(a),
        Cmd::Lab(a) => lab::run(a),
    };
    if let Err(e) = r {
        eprintln!("lily: error: {e:#}");
        std::process::exit(1);
    }
}
