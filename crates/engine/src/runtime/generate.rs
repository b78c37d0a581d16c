//! The generation loop with text: prefill, then sample → stream-decode → stop rules → feed back,
//! one token at a time. Used by `lily generate`, `lily chat` and (later) the server.
//!
//! The sampled token is fed back to the model only when generation goes on, so after a stop the
//! state holds exactly prompt + emitted tokens (minus the stop token): ready for the next turn.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::Result;

use super::sampler::{Sampler, SamplingParams};
use super::stop::{FinishReason, StopChecker, StopRules};
use super::GenStats;
use crate::backend::Backend;
use crate::model::{Logits, Qwen35, SeqState};
use crate::tokenizer::Tokenizer;

/// The result of one generation.
#[derive(Clone, Debug)]
pub struct Generation {
    pub ids: Vec<u32>,
    pub text: String,
    /// `None` when cancelled.
    pub finish: Option<FinishReason>,
    pub stats: GenStats,
}

/// Generates after `prompt` (fed from the state's current position). `on_text` receives text as
/// soon as it is final (whole characters, stop strings held back and never emitted). Setting
/// `cancel` stops within one token.
#[allow(clippy::too_many_arguments)]
pub fn generate<B: Backend>(
    m: &Qwen35<B>,
    st: &mut SeqState<B>,
    tok: &Tokenizer,
    prompt: &[u32],
    sampling: &SamplingParams,
    stop: StopRules,
    cancel: &AtomicBool,
    mut on_text: impl FnMut(&str),
) -> Result<Generation> {
    let mut stats = GenStats { prompt_tokens: prompt.len(), ..Default::default() };
    let mut checker = StopChecker::new(stop, st.pos + prompt.len());
    let mut sampler = Sampler::new(sampling.clone(), m.cfg.vocab_size)?;
    let mut dec = tok.stream_decoder();
    let mut out = Generation { ids: Vec::new(), text: String::new(), finish: None, stats: GenStats::default() };
    let t0 = Instant::now();
    let mut logits = m.forward(st, prompt, Logits::Last, None)?;
    stats.prefill_s = t0.elapsed().as_secs_f64();
    if let Some(f) = checker.check_start() {
        out.finish = Some(f);
        out.stats = stats;
        return Ok(out);
    }
    let t1 = Instant::now();
    let mut emit = |s: &str, out: &mut Generation| {
        if !s.is_empty() {
            on_text(s);
            out.text.push_str(s);
        }
    };
    loop {
        if cancel.load(Ordering::Relaxed) {
            let rest = checker.finish();
            emit(&rest, &mut out);
            break;
        }
        let id = sampler.sample_split(&mut logits, prompt, &out.ids);
        out.ids.push(id);
        let piece = dec.push(id).unwrap_or_default();
        let step = checker.push(id, &piece);
        emit(&step.text, &mut out);
        if let Some(f) = step.finish {
            // A stop id's text is not shown; a length stop flushes what the decoder still holds.
            if !matches!(f, FinishReason::Stop(_)) {
                if let Some(rest) = dec.finish() {
                    emit(&rest, &mut out);
                }
            }
            out.finish = Some(f);
            break;
        }
        logits = m.forward(st, &[id], Logits::Last, None)?;
    }
    stats.decode_s = t1.elapsed().as_secs_f64();
    stats.generated = out.ids.len();
    out.stats = stats;
    Ok(out)
}
