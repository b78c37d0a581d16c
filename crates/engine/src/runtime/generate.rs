//! The generation loop with text: prefill, then sample → stream-decode → stop rules → feed back,
//! one token at a time. Used by `lily generate`, `lily chat` and the server.
//!
//! Tokens are picked on the backend where it can (`Backend::sample_step`, or the arg-max for
//! plain greedy): a step reads back only the token id (and the log-probabilities when asked).
//! Otherwise the step's logits come to the host for [`Sampler`]. The next step is enqueued before
//! the current token's text is worked out (detokenizing, stop strings, the caller's streaming),
//! so on a device that host work overlaps the step.
//!
//! **Lookahead.** Where the next step needs nothing from the host — the pick is on the backend,
//! no forced token, grammar or log-probabilities, and the budget and the context leave room for
//! a token after this one — it is enqueued even before this token is read
//! ([`Qwen35::picked_ahead`]: the read is begun, the step that feeds this token from the backend
//! enqueued, then the host waits for the read alone), so the device never idles while the host
//! reads a token and submits the next step. `LILY_LOOKAHEAD=0` (`Qwen35::lookahead`) turns it
//! off. The tokens, text and finish are the same either way; what the state holds after the
//! last token differs:
//! - a token that ends the generation by the budget or the context is never fed;
//! - a stop id is fed when the lookahead was on for it (the step after it was enqueued before it
//!   was known), never otherwise;
//! - after a stop string or a cancellation the last token may be fed.
//!
//! So after a stop the state holds prompt + emitted tokens, with or without the last one, and
//! never a token past them; `st.pos` always says which (`cache::release` keeps exactly the
//! tokens the state holds, the prompt and the emitted ids cut at `st.pos`).
//!
//! [`generate_ex`] is the full loop: besides sampling it can
//! - start from a state that already holds a prefix of the prompt (`cached`, for prefix reuse);
//! - report OpenAI log-probabilities of each token (of the model's raw distribution, before
//!   penalties and temperature, as OpenAI and vLLM report them);
//! - force tokens instead of sampling them: a list to emit now, and a list to emit right after a
//!   trigger id is generated (`tool_choice: required` forces the start of a tool call once the
//!   model closes `</think>`; the server's test-script mode forces a whole reply). Forced tokens
//!   go through the model, the stop rules and the detokenizer like sampled ones;
//! - constrain the output to a grammar (`constraint`: a JSON schema, a regex, …; see
//!   `constrain.rs`). A constrained token is picked in two parts: the step computes the logits
//!   (`Pick::Later`), and while it runs the host computes the grammar's mask for it; the mask
//!   then goes to the backend (`mask_logits`, 31 KB of bits at the full vocabulary) and the pick
//!   (arg-max or the sampler) runs there on the masked logits. Forced tokens advance the grammar
//!   too. Log-probabilities of a constrained token are of the masked distribution.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{bail, Result};

use super::constrain::{apply_mask, Constraint, ConstraintState};
use super::sampler::{top_logprobs, Sampler, SamplingParams};
use super::stop::{FinishReason, StopChecker, StopRules};
use super::GenStats;
use crate::backend::Backend;
use crate::model::{Logits, Pick, Qwen35, SeqState};
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
    /// Constrained decoding: the output follows this grammar (from where its `start` says).
    pub constraint: Option<Constraint>,
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
    let req = GenRequest {
        prompt,
        cached: 0,
        sampling,
        stop,
        logprobs: None,
        forced: Forced::default(),
        constraint: None,
        cancel,
    };
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
        bail!(
            "generate: the state holds {} tokens but the request says {} are cached",
            st.pos,
            req.cached
        );
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
    let GenRequest {
        prompt,
        cached,
        sampling,
        stop,
        logprobs,
        forced,
        constraint,
        cancel,
    } = req;
    if prompt.is_empty() {
        bail!("generate: empty prompt");
    }
    if cached >= prompt.len() {
        // At least one prompt token must be fed to get the logits of the first new token.
        bail!(
            "generate: {cached} cached tokens leave nothing of the {}-token prompt to feed",
            prompt.len()
        );
    }
    let base = st.pos - cached;
    let mut stats = GenStats {
        prompt_tokens: prompt.len(),
        cached_tokens: cached,
        ..Default::default()
    };
    let mut checker = StopChecker::new(stop, base + prompt.len());
    // The host sampler resolves the seed (an unseeded request draws one) and samples wherever
    // the backend does not.
    let mut sampler = Sampler::new(sampling.clone(), m.cfg.vocab_size)?;
    let mut dec = tok.stream_decoder();
    let mut out = Generation {
        ids: Vec::new(),
        text: String::new(),
        finish: None,
        stats: GenStats::default(),
    };
    if let Some(f) = checker.check_start() {
        out.finish = Some(f);
        out.stats = stats;
        return Ok(out);
    }
    let mut queue: VecDeque<u32> = forced.now.into();
    let mut after = forced.after;
    let mut grammar = constraint.map(|c| ConstraintState::new(c, m.cfg.vocab_size));
    // Where each token is picked: on the backend (plain greedy: its arg-max; otherwise its own
    // sampler, when it has one for these parameters), reading back only the token id and, when
    // asked, the log-probabilities; or on the host from the step's logits (1 MB per token).
    let mut dev = if sampling.is_plain_greedy() {
        None
    } else {
        m.device_sampler(sampling, sampler.seed(), prompt)?
    };
    let on_backend = sampling.is_plain_greedy() || dev.is_some();
    // Whether this generation may enqueue a step before reading the token it feeds (the module
    // documentation): log-probabilities read the step's logits, which the next step overwrites,
    // and a grammar's mask for the next token needs this one on the host.
    let lookahead = m.lookahead && on_backend && grammar.is_none() && logprobs.is_none();
    // Under an active grammar the first pick waits for its mask (in the loop).
    let masked_first = grammar.as_ref().is_some_and(|g| g.active());
    // The prefill records the step after it ahead where that step's pick is the arg-max (no
    // device sampler, no grammar's mask); a device sampler's step is recorded ahead below.
    st.greedy_next = dev.is_none() && !masked_first;
    let t0 = Instant::now();
    // Picking the first token on the device, the prefill's logits stay there (1 MB not read
    // back) and nothing waits for the device until the loop reads that token.
    let device_first = on_backend && queue.is_empty();
    let want = if device_first {
        Logits::Device
    } else {
        Logits::Last
    };
    let first = m.forward(st, &prompt[cached..], want, None)?;
    if let (Some(d), true, false) = (dev.as_mut(), queue.is_empty(), masked_first) {
        m.sample_last(st, d)?;
        // The host records the sampled step after it while the device runs the prefill.
        m.prerecord_next(st, Pick::Sample(d))?;
    }
    // The host path's logits of the current step (the prefill's first).
    let mut host_logits = (!on_backend).then_some(first);
    // With `device_first` nothing waited for the prefill yet: its time (and the decode's
    // start) are taken when the first token is read.
    stats.prefill_s = t0.elapsed().as_secs_f64();
    let mut t1 = Instant::now();
    let mut text = String::new();
    loop {
        if cancel.load(Ordering::Relaxed) {
            let rest = checker.finish();
            if !rest.is_empty() {
                out.text.push_str(&rest);
                on_token(TokenEvent {
                    id: None,
                    text: &rest,
                    logprob: None,
                });
            }
            break;
        }
        if !on_backend && host_logits.is_none() {
            host_logits = Some(m.step_logits()?);
        }
        // This step's token: forced, picked on the backend (the step holds it), or sampled on
        // the host. Log-probabilities are of the raw logits (the host sampler penalises its row
        // in place, so they are taken first).
        let forced_id = queue.pop_front();
        // Under a grammar, the mask of this step (computed while the step runs on a device),
        // applied before the pick: on the backend, or to the host's logits.
        if let (None, Some(g)) = (forced_id, grammar.as_mut().filter(|g| g.active())) {
            let mask = g.mask()?;
            match host_logits.as_mut() {
                Some(l) => apply_mask(l, &mask),
                None => m.pick_masked(st, &mask, dev.as_mut())?,
            }
        }
        // The step after this token enqueued before it is read: only where its input and pick
        // need nothing from the host (a forced token queued by a trigger replaces the pick: no
        // draw of the device sampler may be spent on it) and the budget and the context have
        // room for a token after this one (a stop id it turns out to be is then fed for nothing).
        let ahead = lookahead
            && forced_id.is_none()
            && (after.is_none() || dev.is_none())
            && !checker.next_is_last()
            && st.pos < st.max_context
            && !cancel.load(Ordering::Relaxed);
        let (id, on_step, logprob) = match (forced_id, host_logits.as_mut()) {
            (Some(id), None) => {
                if let Some(d) = dev.as_mut() {
                    m.note(d, id);
                }
                (id, false, logprobs.map(|k| m.logprobs(id, k)).transpose()?)
            }
            (None, None) if ahead => (m.picked_ahead(st, Pick::from(dev.as_mut()))?, true, None),
            (None, None) => {
                let id = m.picked(st)?;
                (id, true, logprobs.map(|k| m.logprobs(id, k)).transpose()?)
            }
            (f, Some(l)) => {
                let raw = logprobs.map(|k| (top_logprobs(l, k), l.clone()));
                let id = f.unwrap_or_else(|| sampler.sample_split(l, prompt, &out.ids));
                let lp = raw.map(|((top, lse), raw)| {
                    (
                        raw.get(id as usize)
                            .map_or(f32::NEG_INFINITY, |&x| (x as f64 - lse) as f32),
                        top,
                    )
                });
                (id, false, lp)
            }
        };
        host_logits = None;
        if let Some((trigger, _)) = &after {
            if *trigger == id {
                queue.extend(after.take().map(|a| a.1).unwrap_or_default());
            }
        }
        if let Some(g) = grammar.as_mut() {
            g.commit(id, !queue.is_empty())?;
        }
        out.ids.push(id);
        if stats.first_token_s == 0.0 {
            stats.first_token_s = t0.elapsed().as_secs_f64();
            if device_first {
                stats.prefill_s = stats.first_token_s;
                t1 = Instant::now();
            }
        }
        // Without the lookahead, the next step is enqueued before this token's text is worked
        // out (detokenizing, stop strings, the caller's streaming), which then overlaps it on a
        // device — unless the token ends the generation whatever its text (a stop id, the token
        // budget, the context). A stop string found in the text leaves that one step done: the
        // state then also holds this token (its position says so; `cache::release` keeps exactly
        // the tokens the state holds). The token after a forced one is picked by arg-max and
        // never used (the forced token replaces it), so the sampler draws only for tokens it
        // chooses, as the host sampler does.
        if !ahead && !checker.ends_at(id) && !cancel.load(Ordering::Relaxed) {
            // The next token's pick: forced (the step's arg-max is not used), under the grammar
            // (after its mask: not in the step), or the sampler's / the arg-max in the step.
            let pick = match (
                queue.is_empty(),
                grammar.as_ref().is_some_and(|g| g.active()),
                dev.as_mut(),
            ) {
                (false, _, _) => Pick::Argmax,
                (true, true, _) => Pick::Later,
                (true, false, Some(d)) => Pick::Sample(d),
                (true, false, None) => Pick::Argmax,
            };
            m.decode_step_ex(st, (!on_step).then_some(id), pick)?;
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
        let logprob = logprob.map(|(logprob, top)| TokenLogprob { logprob, top });
        let go_on = on_token(TokenEvent {
            id: Some(id),
            text: &text,
            logprob,
        });
        if let Some(f) = step.finish {
            out.finish = Some(f);
            break;
        }
        if !go_on {
            cancel.store(true, Ordering::Relaxed);
            continue;
        }
    }
    stats.decode_s = t1.elapsed().as_secs_f64();
    if device_first && out.ids.is_empty() {
        // No token was read: the prefill's time is the whole call's.
        stats.prefill_s = t0.elapsed().as_secs_f64();
    }
    if let Some(g) = &grammar {
        stats.mask_s = g.mask_s;
        stats.masks = g.masks;
    }
    stats.generated = out.ids.len();
    out.stats = stats;
    Ok(out)
}
