//! Stop rules: when generation ends, why, and which text the client sees.
//!
//! [`StopRules`] hold stop token ids (from `generation_config.json` through
//! `tokenizer::stop_ids`, plus the request's), stop strings, a token budget and the context
//! length. A [`StopChecker`] follows one generation: it is fed each new token id with its decoded
//! text piece (from the streaming detokenizer, so always whole characters) and answers with the
//! text that may be shown now and, at the end, a [`FinishReason`].
//!
//! - A stop id ends generation; its text is not emitted. Held text is released first.
//! - A stop string ends generation and is not emitted, nor anything after it. It may span any
//!   number of pieces: the checker holds back the longest suffix of the text that is still a
//!   proper prefix of some stop string, and releases it as soon as it cannot be one (or when
//!   generation ends for another reason). Among several stop strings found in the same step the
//!   one starting first wins (the shorter on a tie: it completed first).
//! - Checked in this order after each token: stop id, stop string, `max_tokens` (`Length`),
//!   context (`ContextFull`: prompt + generated tokens reached `max_context`, so the next token
//!   would have no position). The generated count includes a stop token.
//!
//! Matching is on the text as decoded, byte for byte (no Unicode normalisation); holds always
//! end on character boundaries.

use anyhow::{bail, Result};

/// Limits of one generation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StopRules {
    pub stop_ids: Vec<u32>,
    pub stop_strings: Vec<String>,
    /// Generated tokens at most (`None`: until another rule stops it).
    pub max_tokens: Option<usize>,
    /// Context length: prompt + generated tokens at most.
    pub max_context: usize,
}

impl StopRules {
    /// No stop ids or strings, no token budget.
    pub fn new(max_context: usize) -> Self {
        Self {
            max_context,
            ..Default::default()
        }
    }

    /// Empty stop strings are refused (they would match at once).
    pub fn validate(&self) -> Result<()> {
        if self.stop_strings.iter().any(String::is_empty) {
            bail!("stop strings must not be empty");
        }
        Ok(())
    }
}

/// What ended a generation by a stop rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopKind {
    Id(u32),
    String(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop(StopKind),
    /// `max_tokens` reached.
    Length,
    /// The context is full.
    ContextFull,
}

impl FinishReason {
    /// OpenAI's `finish_reason`: `stop`, or `length` for both limits.
    pub fn openai(&self) -> &'static str {
        match self {
            FinishReason::Stop(_) => "stop",
            FinishReason::Length | FinishReason::ContextFull => "length",
        }
    }
}

/// The answer to one token: text to emit now (maybe empty) and, on the last, why it ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Step {
    pub text: String,
    pub finish: Option<FinishReason>,
}

/// Follows one generation. See the module documentation.
#[derive(Clone, Debug)]
pub struct StopChecker {
    rules: StopRules,
    prompt_len: usize,
    generated: usize,
    /// Text received but not yet emitted (a possible start of a stop string).
    held: String,
    finished: Option<FinishReason>,
    /// Set by a rule or by [`Self::finish`].
    done: bool,
}

impl StopChecker {
    /// Empty stop strings are dropped (see [`StopRules::validate`]).
    pub fn new(mut rules: StopRules, prompt_len: usize) -> Self {
        rules.stop_strings.retain(|s| !s.is_empty());
        Self {
            rules,
            prompt_len,
            generated: 0,
            held: String::new(),
            finished: None,
            done: false,
        }
    }

    /// Whether generation must not start at all: `max_tokens` 0 (`Length`) or a prompt that
    /// fills the context (`ContextFull`).
    pub fn check_start(&self) -> Option<FinishReason> {
        if self.rules.max_tokens == Some(0) {
            Some(FinishReason::Length)
        } else if self.prompt_len >= self.rules.max_context {
            Some(FinishReason::ContextFull)
        } else {
            None
        }
    }

    /// Feeds one generated token and its decoded text. After a step with `finish` set (or
    /// after [`Self::finish`]), further calls return empty steps with the same reason.
    pub fn push(&mut self, id: u32, piece: &str) -> Step {
        if self.done {
            return Step {
                text: String::new(),
                finish: self.finished.clone(),
            };
        }
        self.generated += 1;
        if self.rules.stop_ids.contains(&id) {
            return self.end(FinishReason::Stop(StopKind::Id(id)));
        }
        self.held.push_str(piece);
        // A stop string can only end in the new piece: an earlier one would have stopped us.
        let mut best: Option<(usize, usize)> = None; // (start, index)
        for (k, s) in self.rules.stop_strings.iter().enumerate() {
            if let Some(at) = self.held.find(s.as_str()) {
                let better = match best {
                    None => true,
                    Some((b, j)) => {
                        at < b || (at == b && s.len() < self.rules.stop_strings[j].len())
                    }
                };
                if better {
                    best = Some((at, k));
                }
            }
        }
        if let Some((at, k)) = best {
            let text = self.held[..at].to_string();
            self.held.clear();
            let s = self.rules.stop_strings[k].clone();
            self.finished = Some(FinishReason::Stop(StopKind::String(s)));
            self.done = true;
            return Step {
                text,
                finish: self.finished.clone(),
            };
        }
        if self.rules.max_tokens.is_some_and(|m| self.generated >= m) {
            return self.end(FinishReason::Length);
        }
        if self.prompt_len + self.generated >= self.rules.max_context {
            return self.end(FinishReason::ContextFull);
        }
        let keep = self.hold_from();
        let text = self.held[..keep].to_string();
        self.held.drain(..keep);
        Step { text, finish: None }
    }

    /// Whether [`Self::push`] of `id` ends the generation whatever its text: a stop id,
    /// `max_tokens` or the context (only a stop string needs the text). The decode loop asks
    /// before it enqueues the next step, ahead of detokenizing.
    pub fn ends_at(&self, id: u32) -> bool {
        self.next_is_last() || self.rules.stop_ids.contains(&id)
    }

    /// Whether the next [`Self::push`] ends the generation whatever the token: `max_tokens` or
    /// the context. The decode loop asks before it reads the token, to enqueue the step after
    /// it ahead only where that step can be needed.
    pub fn next_is_last(&self) -> bool {
        let n = self.generated + 1;
        self.done
            || self.rules.max_tokens.is_some_and(|m| n >= m)
            || self.prompt_len + n >= self.rules.max_context
    }

    /// Ends the generation for a reason of the caller's (cancelled, error; the finish reason
    /// stays unset): returns the held text. Later pushes return empty steps.
    pub fn finish(&mut self) -> String {
        self.done = true;
        std::mem::take(&mut self.held)
    }

    /// Tokens fed so far (a stop token included).
    pub fn generated(&self) -> usize {
        self.generated
    }

    pub fn finish_reason(&self) -> Option<&FinishReason> {
        self.finished.as_ref()
    }

    /// Text held back as a possible start of a stop string.
    pub fn held(&self) -> &str {
        &self.held
    }

    pub fn rules(&self) -> &StopRules {
        &self.rules
    }

    fn end(&mut self, f: FinishReason) -> Step {
        self.finished = Some(f.clone());
        self.done = true;
        Step {
            text: std::mem::take(&mut self.held),
            finish: Some(f),
        }
    }

    /// Byte offset where the held-back suffix starts: the longest suffix of `held` that is a
    /// proper prefix of a stop string, on a character boundary; `held.len()` if none.
    fn hold_from(&self) -> usize {
        let longest = self
            .rules
            .stop_strings
            .iter()
            .map(String::len)
            .max()
            .unwrap_or(0);
        let h = &self.held;
        for (i, _) in h.char_indices() {
            if h.len() - i >= longest {
                continue;
            }
            let tail = &h[i..];
            if self
                .rules
                .stop_strings
                .iter()
                .any(|s| s.len() > tail.len() && s.starts_with(tail))
            {
                return i;
            }
        }
        h.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(stops: &[&str]) -> StopRules {
        StopRules {
            stop_ids: vec![0],
            stop_strings: stops.iter().map(|s| s.to_string()).collect(),
            max_tokens: None,
            max_context: 1000,
        }
    }

    /// Feeds pieces (ids 10, 11, …); returns the emitted text per step and the finish reason.
    fn run(r: StopRules, pieces: &[&str]) -> (Vec<String>, Option<FinishReason>) {
        let mut c = StopChecker::new(r, 5);
        let mut out = vec![];
        for (i, p) in pieces.iter().enumerate() {
            let s = c.push(10 + i as u32, p);
            out.push(s.text);
            if s.finish.is_some() {
                return (out, s.finish);
            }
        }
        out.push(c.finish());
        (out, None)
    }

    fn stop_str(s: &str) -> Option<FinishReason> {
        Some(FinishReason::Stop(StopKind::String(s.into())))
    }

    #[test]
    fn stop_string_split_over_three_pieces() {
        let (out, f) = run(
            rules(&["<END>"]),
            &["Hello <", "EN", "D> trailing", "never"],
        );
        assert_eq!(out, vec!["Hello ", "", ""]);
        assert_eq!(f, stop_str("<END>"));
        // Text after the stop string in the same piece, and before it, is handled.
        let (out, f) = run(rules(&["stop"]), &["a", "bc st", "o", "pxyz"]);
        assert_eq!(out.concat(), "abc ");
        assert_eq!(f, stop_str("stop"));
    }

    #[test]
    fn partial_match_then_divergence_releases() {
        let (out, f) = run(rules(&["<END>"]), &["x <E", "N", "Y> more", " <"]);
        assert_eq!(out, vec!["x ", "", "<ENY> more", " ", "<"]);
        assert_eq!(f, None);
        // Divergence that itself starts a new partial match keeps only that part.
        let (out, _) = run(rules(&["abc"]), &["ab", "ab", "x"]);
        assert_eq!(out, vec!["", "ab", "abx", ""]);
    }

    #[test]
    fn overlapping_stop_strings() {
        // "abcd" is pending while "bce" completes inside it.
        let (out, f) = run(rules(&["abcd", "bce"]), &["ab", "c", "e!"]);
        assert_eq!(out.concat(), "a");
        assert_eq!(f, stop_str("bce"));
        // Same start: the shorter completed first.
        let (out, f) = run(rules(&["abc", "ab"]), &["xabc"]);
        assert_eq!(out.concat(), "x");
        assert_eq!(f, stop_str("ab"));
        // Earlier start wins over list order.
        let (out, f) = run(rules(&["cd", "abcd"]), &["ab", "cd"]);
        assert_eq!(out.concat(), "");
        assert_eq!(f, stop_str("abcd"));
        // A held prefix of one stop string, then the other completes.
        let (out, f) = run(rules(&["\n\nUser:", "\n\n\n"]), &["ok\n", "\n", "\n"]);
        assert_eq!(out.concat(), "ok");
        assert_eq!(f, stop_str("\n\n\n"));
    }

    #[test]
    fn unicode() {
        let (out, f) = run(rules(&["世界"]), &["你好", "世", "界!"]);
        assert_eq!(out, vec!["你好", "", ""]);
        assert_eq!(f, stop_str("世界"));
        // Held on a character boundary, released whole.
        let (out, f) = run(rules(&["é!", "🙂🙃"]), &["caf", "é", " 🙂", "x"]);
        assert_eq!(out, vec!["caf", "", "é ", "🙂x", ""]);
        assert_eq!(f, None);
    }

    #[test]
    fn stop_id() {
        let mut c = StopChecker::new(rules(&["<END>"]), 5);
        assert_eq!(c.push(10, "hi <EN").text, "hi ");
        let s = c.push(0, "<|im_end|>");
        assert_eq!(
            s,
            Step {
                text: "<EN".into(),
                finish: Some(FinishReason::Stop(StopKind::Id(0)))
            }
        );
        assert_eq!(c.generated(), 2);
        assert_eq!(c.push(11, "more").text, "");
        assert_eq!(c.finish_reason().unwrap().openai(), "stop");
    }

    #[test]
    fn max_tokens() {
        let r = StopRules {
            max_tokens: Some(3),
            ..rules(&["<END>"])
        };
        let mut c = StopChecker::new(r.clone(), 5);
        assert_eq!(c.check_start(), None);
        assert_eq!(c.push(10, "a").finish, None);
        assert_eq!(c.push(11, "b").finish, None);
        // The held "<E" is released at the end.
        assert_eq!(
            c.push(12, "c<E"),
            Step {
                text: "c<E".into(),
                finish: Some(FinishReason::Length)
            }
        );
        // A stop string in the last token still wins.
        let mut c = StopChecker::new(r, 5);
        c.push(10, "a");
        c.push(11, "b");
        assert_eq!(c.push(12, "<END>").finish, stop_str("<END>"));
        let c = StopChecker::new(
            StopRules {
                max_tokens: Some(0),
                ..rules(&[])
            },
            5,
        );
        assert_eq!(c.check_start(), Some(FinishReason::Length));
    }

    #[test]
    fn context_full() {
        let r = StopRules {
            max_context: 7,
            ..rules(&[])
        };
        let mut c = StopChecker::new(r.clone(), 5);
        assert_eq!(
            c.push(10, "a"),
            Step {
                text: "a".into(),
                finish: None
            }
        );
        let s = c.push(11, "b");
        assert_eq!(
            s,
            Step {
                text: "b".into(),
                finish: Some(FinishReason::ContextFull)
            }
        );
        assert_eq!(s.finish.unwrap().openai(), "length");
        assert_eq!(
            StopChecker::new(r, 7).check_start(),
            Some(FinishReason::ContextFull)
        );
        // max_tokens reached at the same step reports Length.
        let r = StopRules {
            max_context: 7,
            max_tokens: Some(2),
            ..rules(&[])
        };
        let mut c = StopChecker::new(r, 5);
        c.push(10, "a");
        assert_eq!(c.push(11, "b").finish, Some(FinishReason::Length));
    }

    #[test]
    fn finish_by_caller_releases_held_text() {
        let mut c = StopChecker::new(rules(&["<END>"]), 5);
        assert_eq!(c.push(10, "a <EN").text, "a ");
        assert_eq!(c.held(), "<EN");
        assert_eq!(c.finish(), "<EN");
        assert_eq!(c.finish_reason(), None);
        assert_eq!(c.push(11, "D>"), Step::default());
    }

    #[test]
    fn validation_and_no_stop_strings() {
        assert!(StopRules {
            stop_strings: vec!["".into()],
            ..rules(&[])
        }
        .validate()
        .is_err());
        assert!(rules(&["x"]).validate().is_ok());
        let (out, f) = run(rules(&[]), &["a", "b"]);
        assert_eq!(out, vec!["a", "b", ""]);
        assert_eq!(f, None);
    }
}
