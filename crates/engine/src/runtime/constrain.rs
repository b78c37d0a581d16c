//! Constrained decoding (structured outputs): the tokens a grammar allows, as a bitmask applied to
//! the logits before the pick.
//!
//! The grammar engine is llguidance (the one llama.cpp uses), not outlines-core: llguidance
//! computes each step's mask lazily from a token trie and a lexer built on demand, so a new JSON
//! schema costs about a millisecond to compile, where outlines-core builds a whole index of
//! automaton states × vocabulary per regex before the first token (seconds for a nested schema at
//! a 248K vocabulary); it covers JSON Schema (refs, anyOf, formats, bounds), regexes and Lark
//! grammars, in which a JSON schema can be embedded (`%json`), which is how strict tool calls
//! in Qwen's XML form are written; and it is a plain Rust crate.
//!
//! - [`Grammars`]: one per tokenizer. Bridges the tokenizer to llguidance (each id's bytes;
//!   special tokens are marked so no grammar produces them as text), compiles [`Grammar`]s and
//!   keeps the compiled parsers (cache keyed by the grammar's text: a schema sent again costs a
//!   clone; the lexer's lazily built states are shared between clones, so later requests also get
//!   faster masks).
//! - [`Constraint`]: a compiled grammar for one generation, and where it starts ([`Start`]): at
//!   the first token, or after the reasoning (the `</think>` id, then the tokens the caller
//!   forces after it through the loop's `Forced::after`, such as the template's blank line).
//! - [`ConstraintState`]: one generation's matcher. `mask` gives the allowed tokens of the next
//!   step as u32 words (bit i of word i / 32, LSB first: llguidance's `SimpleVob`), the form the
//!   backend's `mask_logits` takes; `commit` advances it by the chosen token. Once the grammar is
//!   complete only the stop ids are allowed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory, TokenParser};
use serde_json::{json, Value};

use crate::tokenizer::Tokenizer;

/// What a generation must produce.
#[derive(Clone, Debug, PartialEq)]
pub enum Grammar {
    /// Any JSON object (OpenAI's `json_object`).
    JsonObject,
    /// JSON valid against this schema.
    JsonSchema(Value),
    /// Text matching the regex, whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark grammar in llguidance's dialect (JSON schemas embed as `%json { … }`).
    Lark(String),
}

/// JSON is generated compact and in one layout (no free whitespace): a grammar that lets the
/// model pick whitespace lets a weak model pick it forever.
pub fn json_options() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ",", "key_separator": ":"})
}

impl Grammar {
    /// The llguidance grammar.
    pub fn to_llguidance(&self) -> Result<TopLevelGrammar> {
        Ok(match self {
            Grammar::JsonObject => Self::schema_grammar(json!({"type": "object"})),
            Grammar::JsonSchema(s) => {
                if !(s.is_object() || s.is_boolean()) {
                    bail!("a JSON schema must be an object (or a boolean)");
                }
                Self::schema_grammar(s.clone())
            }
            Grammar::Regex(r) => {
                if r.is_empty() {
                    bail!("the regex is empty");
                }
                TopLevelGrammar::from_regex(r)
            }
            Grammar::Choice(c) => {
                if c.is_empty() {
                    bail!("the choice list is empty");
                }
                // Lark string literals take JSON's escapes.
                let alts: Vec<String> = c
                    .iter()
                    .map(|s| serde_json::to_string(s).expect("a string serializes"))
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
            }
            Grammar::Lark(g) => TopLevelGrammar::from_lark_or_grammar_list(g)?,
        })
    }

    fn schema_grammar(mut schema: Value) -> TopLevelGrammar {
        if schema == Value::Bool(true) {
            schema = json!({});
        }
        if let Some(o) = schema.as_object_mut() {
            // The request's own x-guidance options are not taken: the layout is the engine's.
            o.insert("x-guidance".into(), json_options());
        }
        TopLevelGrammar::from_json_schema(schema)
    }

    /// The cache key: the grammar's kind and text.
    fn key(&self) -> String {
        match self {
            Grammar::JsonObject => "json_object".into(),
            Grammar::JsonSchema(s) => format!("json_schema:{s}"),
            Grammar::Regex(r) => format!("regex:{r}"),
            Grammar::Choice(c) => {
                format!("choice:{}", serde_json::to_string(c).unwrap_or_default())
            }
            Grammar::Lark(g) => format!("lark:{g}"),
        }
    }
}

/// The tokenizer as llguidance sees it: every id's bytes in a trie, the text → ids function
/// for the strings a grammar forces.
struct TokenizerBridge {
    trie: TokTrie,
    tok: Arc<Tokenizer>,
}

impl TokenizerEnv for TokenizerBridge {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        // Whole UTF-8 text goes through the real tokenizer (canonical ids); a fragment that is
        // not UTF-8 by itself is split greedily over the trie.
        match std::str::from_utf8(s) {
            Ok(t) => self
                .tok
                .encode(t)
                .unwrap_or_else(|_| self.trie.greedy_tokenize(s)),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// A compiled grammar, ready to start a generation.
#[derive(Clone)]
pub struct Compiled {
    parser: TokenParser,
    /// Whether it came from the cache.
    pub cached: bool,
    /// Seconds spent compiling (or cloning, when cached).
    pub compile_s: f64,
}

/// Compiled grammars cached at most (least recently used out first).
const CACHE_ENTRIES: usize = 64;

/// Grammars for one tokenizer (see the module documentation).
pub struct Grammars {
    factory: ParserFactory,
    vocab: usize,
    /// key → (parser, last use).
    cache: Mutex<(HashMap<String, (TokenParser, u64)>, u64)>,
}

impl Grammars {
    /// `vocab`: the model's vocabulary (the logits' length; ids past the tokenizer's have no
    /// bytes and are never allowed). `stop_ids`: what ends a generation (`<|im_end|>`,
    /// `<|endoftext|>`): allowed where the grammar may end, and alone once it has ended.
    pub fn new(tok: Arc<Tokenizer>, vocab: usize, stop_ids: &[u32]) -> Result<Self> {
        let t0 = Instant::now();
        if vocab < tok.vocab_size() {
            bail!("constrained decoding: the model's vocabulary ({vocab}) is smaller than the tokenizer's ({})", tok.vocab_size());
        }
        let stops: Vec<u32> = stop_ids
            .iter()
            .copied()
            .filter(|&s| (s as usize) < vocab)
            .collect();
        if stops.is_empty() {
            bail!("constrained decoding needs a stop token id (generation_config.json's eos_token_id)");
        }
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| {
                if tok.is_special(id) {
                    // llguidance's mark for a special token: 0xFF then its name. No grammar
                    // produces it as text; the stop ids are allowed as end of sequence.
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend(tok.id_to_token(id).unwrap_or_default().into_bytes());
                    w
                } else {
                    tok.token_bytes(id).unwrap_or_default()
                }
            })
            .collect();
        let info = TokRxInfo::new(vocab as u32, stops[0]);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&stops);
        let env: TokEnv = Arc::new(TokenizerBridge { trie, tok });
        let mut factory =
            ParserFactory::new_simple(&env).context("constrained decoding: llguidance setup")?;
        // Errors come back as values (a 400 for the client), not as log lines.
        factory.quiet();
        let g = Self {
            factory,
            vocab,
            cache: Mutex::new((HashMap::new(), 0)),
        };
        log_setup(t0.elapsed().as_secs_f64(), vocab);
        Ok(g)
    }

    /// The model's vocabulary.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Compiles `g` (or takes it from the cache). Errors name what is wrong with the grammar
    /// (an unsupported JSON Schema keyword, a bad regex): they are the client's.
    pub fn compile(&self, g: &Grammar) -> Result<Compiled> {
        let t0 = Instant::now();
        let key = g.key();
        {
            let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            c.1 += 1;
            let tick = c.1;
            if let Some((p, used)) = c.0.get_mut(&key) {
                *used = tick;
                // A shallow clone: the lexer's lazily built states stay shared.
                let parser = p.clone();
                return Ok(Compiled {
                    parser,
                    cached: true,
                    compile_s: t0.elapsed().as_secs_f64(),
                });
            }
        }
        let top = g.to_llguidance()?;
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| anyhow!("{}", clean_error(&e.to_string())))?;
        // The first mask finds grammars that compile but can match nothing.
        let mut probe = Matcher::new(Ok(parser.clone()));
        probe
            .compute_mask()
            .map_err(|e| anyhow!("{}", clean_error(&e.to_string())))?;
        let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if c.0.len() >= CACHE_ENTRIES {
            if let Some(old) =
                c.0.iter()
                    .min_by_key(|(_, (_, used))| *used)
                    .map(|(k, _)| k.clone())
            {
                c.0.remove(&old);
            }
        }
        let tick = c.1;
        c.0.insert(key, (parser.clone(), tick));
        Ok(Compiled {
            parser,
            cached: false,
            compile_s: t0.elapsed().as_secs_f64(),
        })
    }
}

fn log_setup(s: f64, vocab: usize) {
    if std::env::var_os("LILY_LOG_GRAMMAR").is_some() {
        eprintln!(
            "constrained decoding: token trie of {vocab} ids in {:.0} ms",
            s * 1e3
        );
    }
}

/// llguidance's messages carry a prefix of internal context on some paths; keep the message.
fn clean_error(e: &str) -> String {
    e.trim().trim_start_matches("Error: ").to_string()
}

/// Where a constraint starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// At the first generated token.
    Now,
    /// After this id is generated (the reasoning's `</think>`) and the tokens forced after it
    /// (`Forced::after` on the same trigger: the template's blank line) are out.
    After(u32),
}

/// A compiled grammar for one generation and where it starts.
#[derive(Clone)]
pub struct Constraint {
    pub compiled: Compiled,
    pub start: Start,
}

/// One generation's matcher (see the module documentation).
pub struct ConstraintState {
    matcher: Matcher,
    start: Start,
    phase: Phase,
    words: usize,
    /// Seconds spent computing masks (the part not hidden behind a device step shows in the
    /// decode rate).
    pub mask_s: f64,
    pub masks: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Before the trigger (reasoning).
    Waiting,
    /// Trigger seen: the tokens forced after it are going out.
    Triggered,
    Active,
}

impl ConstraintState {
    pub fn new(c: Constraint, vocab: usize) -> Self {
        let phase = if c.start == Start::Now {
            Phase::Active
        } else {
            Phase::Waiting
        };
        Self {
            matcher: Matcher::new(Ok(c.compiled.parser)),
            start: c.start,
            phase,
            words: vocab.div_ceil(32),
            mask_s: 0.0,
            masks: 0,
        }
    }

    /// Whether the next token (when not forced) is picked under the mask.
    pub fn active(&self) -> bool {
        self.phase == Phase::Active
    }

    /// The allowed tokens of the next step: `words` u32 words, LSB first.
    pub fn mask(&mut self) -> Result<Vec<u32>> {
        let t0 = Instant::now();
        let m = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| anyhow!("constrained decoding: {e}"))?;
        let mut w = m.as_slice().to_vec();
        w.resize(self.words, 0);
        if w.iter().all(|&x| x == 0) {
            bail!("constrained decoding: the grammar allows no token here");
        }
        self.mask_s += t0.elapsed().as_secs_f64();
        self.masks += 1;
        Ok(w)
    }

    /// Advances by the token just emitted; `forcing`: tokens are still queued to be forced next
    /// (after the trigger the grammar waits for them to go out).
    pub fn commit(&mut self, id: u32, forcing: bool) -> Result<()> {
        if self.phase == Phase::Waiting && self.start == Start::After(id) {
            self.phase = Phase::Triggered;
        } else if self.phase == Phase::Active && !self.matcher.is_stopped() {
            // (Once the grammar is complete only a stop id follows, and it ends the generation.)
            self.matcher
                .consume_token(id)
                .map_err(|e| anyhow!("constrained decoding: token {id} rejected: {e}"))?;
        }
        if self.phase == Phase::Triggered && !forcing {
            self.phase = Phase::Active;
        }
        Ok(())
    }
}

/// `logits[i] = -inf` where bit i of `allowed` is clear (ids past the mask included): the CPU
/// twin of the backends' `mask_logits`.
pub fn apply_mask(logits: &mut [f32], allowed: &[u32]) {
    for (i, l) in logits.iter_mut().enumerate() {
        let w = allowed.get(i / 32).copied().unwrap_or(0);
        if (w >> (i % 32)) & 1 == 0 {
            *l = f32::NEG_INFINITY;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_bits_are_lsb_first() {
        let mut l = vec![1.0f32; 70];
        apply_mask(&mut l, &[0b101, 1 << 31]);
        let kept: Vec<usize> = l
            .iter()
            .enumerate()
            .filter(|(_, x)| x.is_finite())
            .map(|(i, _)| i)
            .collect();
        assert_eq!(kept, vec![0, 2, 63]);
    }

    #[test]
    fn choice_literals_are_escaped() {
        let g = Grammar::Choice(vec!["a\"b".into(), "c\\d\n".into()]);
        let top = g.to_llguidance().unwrap();
        let lark = top.grammars[0].lark_grammar.clone().unwrap();
        assert_eq!(lark, r#"start: "a\"b" | "c\\d\n""#);
    }

    #[test]
    fn bad_inputs_are_errors() {
        assert!(Grammar::JsonSchema(json!([1])).to_llguidance().is_err());
        assert!(Grammar::Regex(String::new()).to_llguidance().is_err());
        assert!(Grammar::Choice(vec![]).to_llguidance().is_err());
    }
}
