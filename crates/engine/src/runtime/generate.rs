//! The generation loop with text: prefill, then sample → stream-decode → stop rules → feed back,
//! one token at a time. Used by `lily generate`, `lily chat` and the server.
//!
//! The sampled token is fed back to the model only when generation goes on, so after a stop the
//! state holds exactly prompt + emitted tokens (minus the stop token): ready for the next turn.
//!
//! [`generate_ex`] is the full loop: besides sampling it can
//! - start from a state that already holds a prefix of the prompt (`cached`, for prefix reuse);
//! - report OpenAI log-probabilities of each token (of the model's raw distribution, before
//!   penalties and temperature, as OpenAI and vLLM report them);
//! - force tokens instead of sampling them: a list to emit now, and a list to emit right after a
//!   trigger id is generated (`tool_choice: required` forces the start of a tool call once the
//!   model closes `</think>`; the server's test-script mode forces a whole reply). Forced tokens
//!   go through the model, the stop rules and the detokenizer like sampled ones.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{bail, Result};

use super::sampler::{Sampler, SamplingParams};
use super::stop::{FinishReason, StopChecker, StopRules};
use super::GenStats;
use crate::backend::Backend;
use crate::model::{Logits, Next, Qwen35, SeqState};
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

/// Tokens emitted instead of sampled.
#[derive(Clone, Debug, Default)]
pub struct Forced {
    /// Emitted first, one per step.
    pub now: Vec<u32>,
    /// When the first id is generated (sampled or forced), the list is queued next.
    pub after: Option<(u32, Vec<u32>)>,
}

/// The log-probability of one generated token and the most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub logprob: f32,
    /// `(id, logprob)`, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// One generation request for [`generate_ex`].
pub struct GenRequest<'a> {
    /// The whole prompt. The state must already hold its first `cached` tokens.
    pub prompt: &'a [u32],
    pub cached: usize,
    pub sampling: &'a SamplingParams,
    pub stop: StopRules,
    /// Report log-probabilities with this many alternatives (0..=20); `None`: off.
    pub logprobs: Option<usize>,
    pub forced: Forced,
    /// Setting it stops generation within one token.
    pub cancel: &'a AtomicBool,
}

/// What the loop reports per generated token.
pub struct TokenEvent<'a> {
    /// `None` for the text flushed at cancellation.
    pub id: Option<u32>,
    /// Text that became final with this token (may be empty: partial characters and possible
    /// stop strings are held back).
    pub text: &'a str,
    pub logprob: Option<TokenLogprob>,
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
    // The prompt is fed after what the state holds (an earlier turn); penalties see only it.
    let req = GenRequest { prompt, cached: 0, sampling, stop, logprobs: None, forced: Forced::default(), cancel };
    generate_from(m, st, tok, req, |e| {
        if !e.text.is_empty() {
            on_text(e.text)
        }
        true
    })
}

/// The full loop (see the module documentation): the state must hold exactly the first
/// `req.cached` prompt tokens. `on_token` returns false to cancel.
pub fn generate_ex<B: Backend>(
    m: &Qwen35<B>,
    st: &mut SeqState<B>,
    tok: &Tokenizer,
    req: GenRequest<'_>,
    on_token: impl FnMut(TokenEvent<'_>) -> bool,
) -> Result<Generation> {
    if st.pos != req.cached {
        bail!("generate: the state holds {} tokens but the request says {} are cached", st.pos, req.cached);
    }
    generate_from(m, st, tok, req, on_token)
}

/// The loop; positions in the state before the cached part of the prompt (`st.pos - cached`)
/// belong to earlier turns and count toward the context.
fn generate_from<B: Backend>(
    m: &Qwen35<B>,
    st: &mut SeqState<B>,
    tok: &Tokenizer,
    req: GenRequest<'_>,
    mut on_token: impl FnMut(TokenEvent<'_>) -> bool,
) -> Result<Generation> {
    let GenRequest { prompt, cached, sampling, stop, logprobs, forced, cancel } = req;
    if prompt.is_empty() {
        bail!("generate: empty prompt");
    }
    if cached >= prompt.len() {
        // At least one prompt token must be fed to get the logits of the first new token.
        bail!("generate: {cached} cached tokens leave nothing of the {}-token prompt to feed", prompt.len());
    }
    let base = st.pos - cached;
    let mut stats = GenStats { prompt_tokens: prompt.len(), cached_tokens: cached, ..Default::default() };
    let mut checker = StopChecker::new(stop, base + prompt.len());
    let mut sampler = Sampler::new(sampling.clone(), m.cfg.vocab_size)?;
    let mut dec = tok.stream_decoder();
    let mut out = Generation { ids: Vec::new(), text: String::new(), finish: None, stats: GenStats::default() };
    if let Some(f) = checker.check_start() {
        out.finish = Some(f);
        out.stats = stats;
        return Ok(out);
    }
    let mut queue: VecDeque<u32> = forced.now.into();
    let mut after = forced.after;
    let t0 = Instant::now();
    // Plain greedy without log-probabilities: each step's pick is made on the backend and fed
    // back there (`Next::Token`); otherwise the logits come to the host for the sampler.
    let device_greedy = sampling.is_plain_greedy() && logprobs.is_none();
    let mut next = Next::Logits(m.forward(st, &prompt[cached..], Logits::Last, None)?);
    stats.prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut text = String::new();
    loop {
        if cancel.load(Ordering::Relaxed) {
            let rest = checker.finish();
            if !rest.is_empty() {
                out.text.push_str(&rest);
                on_token(TokenEvent { id: None, text: &rest, logprob: None });
            }
            break;
        }
        // Log-probabilities come from the raw logits; the sampler changes its row in place.
        let lp = match (&next, logprobs) {
            (Next::Logits(l), Some(k)) => Some((top_logprobs(l, k), l.clone())),
            _ => None,
        };
        let mut picked_on_backend = false;
        let id = match (queue.pop_front(), &mut next) {
            (Some(id), _) => id,
            (None, Next::Token(t)) => {
                picked_on_backend = true;
                *t
            }
            (None, Next::Logits(l)) => sampler.sample_split(l, prompt, &out.ids),
        };
        if let Some((trigger, _)) = &after {
            if *trigger == id {
                queue.extend(after.take().map(|a| a.1).unwrap_or_default());
            }
        }
        out.ids.push(id);
        if stats.first_token_s == 0.0 {
            stats.first_token_s = t0.elapsed().as_secs_f64();
        }
        let piece = dec.push(id).unwrap_or_default();
        let step = checker.push(id, &piece);
        text.clear();
        text.push_str(&step.text);
        if let Some(f) = &step.finish {
            // A stop id's text is not shown; a length stop flushes what the decoder still holds.
            if !matches!(f, FinishReason::Stop(_)) {
                if let Some(rest) = dec.finish() {
                    text.push_str(&rest);
                }
            }
        }
        out.text.push_str(&text);
        let logprob = lp.map(|((top, lse), raw)| TokenLogprob { logprob: raw.get(id as usize).map_or(f32::NEG_INFINITY, |&x| (x as f64 - lse) as f32), top });
        let go_on = on_token(TokenEvent { id: Some(id), text: &text, logprob });
        if let Some(f) = step.finish {
            out.finish = Some(f);
            break;
        }
        if !go_on {
            cancel.store(true, Ordering::Relaxed);
            continue;
        }
        next = m.decode(st, (!picked_on_backend).then_some(id), device_greedy)?;
    }
    stats.decode_s = t1.elapsed().as_secs_f64();
    stats.generated = out.ids.len();
    out.stats = stats;
    Ok(out)
}

/// The `k` most likely ids with their log-probabilities, and log Σ exp(logits) (f64).
fn top_logprobs(logits: &[f32], k: usize) -> (Vec<(u32, f32)>, f64) {
    let max = logits.iter().copied().filter(|x| !x.is_nan()).fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().filter(|x| !x.is_nan()).map(|&x| (x as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    // Partial selection: keep the k best in a small sorted list (k ≤ 20).
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        for (i, &x) in logits.iter().enumerate() {
            if x.is_nan() || (top.len() == k && x <= top[k - 1].1) {
                continue;
            }
            let at = top.partition_point(|&(_, y)| y >= x);
            top.insert(at, (i as u32, x));
            top.truncate(k);
        }
    }
    (top.into_iter().map(|(i, x)| (i, (x as f64 - lse) as f32)).collect(), lse)
}

#[cfg(test)]
mod tests {
    use super::top_logprobs;

    #[test]
    fn top_logprobs_are_sorted_log_softmax() {
        let l = [1.0f32, 3.0, 2.0, 3.0, f32::NAN, -1.0];
        let (top, lse) = top_logprobs(&l, 3);
        let z: f64 = [1.0f64, 3.0, 2.0, 3.0, -1.0].iter().map(|x| x.exp()).sum();
        assert!((lse - z.ln()).abs() < 1e-9);
        // Ties keep id order; NaN is skipped.
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3, 2]);
        assert!((top[0].1 as f64 - (3.0 - z.ln())).abs() < 1e-6);
        assert!(top.windows(2).all(|w| w[0].1 >= w[1].1));
        assert!(top_logprobs(&l, 0).0.is_empty());
    }
}
