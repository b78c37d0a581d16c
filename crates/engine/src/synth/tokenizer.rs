//! Tokenizer files of a synthetic checkpoint: a working byte-level BPE in the Hugging Face
//! `tokenizer.json` format (Qwen's pre-tokenizer regex, NFC, byte-level decoder) with the Qwen
//! added tokens matched atomically, plus `tokenizer_config.json`, `generation_config.json` and
//! `chat_template.jinja`.
//!
//! Id layout:
//! - full vocabulary (`vocab_size ≥ 248077`): ids 0..255 are the 256 byte symbols (GPT-2 order),
//!   then one id per merge of Qwen3.6's `merges.txt` in order, then `<|synth_unused_N|>` fillers up
//!   to 248043; the added tokens sit at their real ids 248044…248076; ids above are padding rows
//!   with no token (as in the published model).
//! - smaller vocabularies: bytes, then the first merges that fit, and the 33 added tokens at the
//!   top ids `vocab_size − 33 … vocab_size − 1`: `<|endoftext|>` is `vocab_size − 33`,
//!   `<|im_end|>` `vocab_size − 31` and so on, in the real order. `tokenizer_config.json`,
//!   `generation_config.json` and `config.json` carry these ids.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

pub const MERGES: &str = include_str!("fixtures/merges.txt");
pub const TOKENIZER_CONFIG: &str = include_str!("fixtures/tokenizer_config.json");
pub const CHAT_TEMPLATE: &str = include_str!("fixtures/chat_template.jinja");

/// The real id of the first added token (`<|endoftext|>`).
pub const REAL_ADDED_BASE: usize = 248_044;
/// The Qwen pre-tokenizer regex (Qwen3.5/3.6: letters with marks, single digits).
pub const PRETOKENIZE_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// One added token of the fixture: content and whether it is "special".
#[derive(Clone, Debug)]
pub struct Added {
    pub id: usize,
    pub content: String,
    pub special: bool,
}

/// The vocabulary of a synthetic checkpoint.
pub struct Vocab {
    /// Token strings (byte-level symbols) by id, for ids below `added_base`.
    pub tokens: Vec<String>,
    /// Number of real (byte / merge) tokens; ids `[n_text, added_base)` are fillers.
    pub n_text: usize,
    /// Merges used, in priority order.
    pub merges: Vec<(String, String)>,
    pub added: Vec<Added>,
    pub vocab_size: usize,
}

/// GPT-2's byte → printable-char map, in id order (printable bytes first).
fn byte_symbols() -> Vec<char> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    cs.into_iter()
        .map(|c| char::from_u32(c).expect("valid char"))
        .collect()
}

fn fixture_added() -> Result<Vec<(usize, String, bool)>> {
    let v: Value =
        serde_json::from_str(TOKENIZER_CONFIG).context("fixture tokenizer_config.json")?;
    let dec = v["added_tokens_decoder"]
        .as_object()
        .context("fixture: no added_tokens_decoder")?;
    let mut out: Vec<(usize, String, bool)> = dec
        .iter()
        .map(|(k, t)| {
            (
                k.parse().unwrap_or(0),
                t["content"].as_str().unwrap_or("").to_string(),
                t["special"].as_bool().unwrap_or(false),
            )
        })
        .collect();
    out.sort();
    Ok(out)
}

/// Number of added tokens (33 for Qwen3.6).
pub fn n_added() -> usize {
    fixture_added().map(|a| a.len()).unwrap_or(33)
}

impl Vocab {
    pub fn build(vocab_size: usize) -> Result<Self> {
        let fixture = fixture_added()?;
        let n_add = fixture.len();
        let full = vocab_size >= REAL_ADDED_BASE + n_add;
        let added_base = if full {
            REAL_ADDED_BASE
        } else {
            vocab_size.saturating_sub(n_add)
        };
        if added_base < 256 + 32 {
            bail!("vocab_size {vocab_size} is too small: the synthetic tokenizer needs 256 byte tokens, some merges and {n_add} added tokens (at least {})", 256 + 32 + n_add);
        }
        let mut tokens: Vec<String> = byte_symbols().into_iter().map(String::from).collect();
        let mut ids: HashMap<String, usize> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i))
            .collect();
        let mut merges = Vec::new();
        for line in MERGES.lines() {
            if tokens.len() >= added_base {
                break;
            }
            let Some((a, b)) = line.split_once(' ') else {
                continue;
            };
            if !ids.contains_key(a) || !ids.contains_key(b) {
                continue;
            }
            let m = format!("{a}{b}");
            if !ids.contains_key(&m) {
                ids.insert(m.clone(), tokens.len());
                tokens.push(m);
            }
            merges.push((a.to_string(), b.to_string()));
        }
        let n_text = tokens.len();
        while tokens.len() < added_base {
            tokens.push(format!("<|synth_unused_{}|>", tokens.len() - n_text));
        }
        let added = fixture
            .into_iter()
            .map(|(real, content, special)| Added {
                id: real - REAL_ADDED_BASE + added_base,
                content,
                special,
            })
            .collect();
        Ok(Self {
            tokens,
            n_text,
            merges,
            added,
            vocab_size,
        })
    }

    pub fn id_of(&self, content: &str) -> Option<usize> {
        self.added
            .iter()
            .find(|a| a.content == content)
            .map(|a| a.id)
    }
    pub fn endoftext(&self) -> usize {
        self.id_of("<|endoftext|>")
            .expect("fixture has <|endoftext|>")
    }
    pub fn im_end(&self) -> usize {
        self.id_of("<|im_end|>").expect("fixture has <|im_end|>")
    }

    /// `tokenizer.json` text (Hugging Face tokenizers format).
    pub fn tokenizer_json(&self) -> String {
        let q = |s: &str| serde_json::to_string(s).expect("string serializes");
        let mut out = String::with_capacity(16 << 20);
        out.push_str("{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n  \"added_tokens\": [");
        for (i, a) in self.added.iter().enumerate() {
            out.push_str(if i == 0 { "\n    " } else { ",\n    " });
            out.push_str(
                &json!({"id": a.id, "content": a.content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": a.special})
                    .to_string(),
            );
        }
        out.push_str("\n  ],\n");
        let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
        let pre = json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PRETOKENIZE_REGEX}, "behavior": "Isolated", "invert": false},
            byte_level
        ]});
        out.push_str(&format!("  \"normalizer\": {{\"type\": \"NFC\"}},\n  \"pre_tokenizer\": {pre},\n  \"post_processor\": {byte_level},\n  \"decoder\": {byte_level},\n"));
        out.push_str("  \"model\": {\n    \"type\": \"BPE\",\n    \"dropout\": null,\n    \"unk_token\": null,\n    \"continuing_subword_prefix\": \"\",\n    \"end_of_word_suffix\": \"\",\n    \"fuse_unk\": false,\n    \"byte_fallback\": false,\n    \"ignore_merges\": false,\n    \"vocab\": {");
        for (i, t) in self.tokens.iter().enumerate() {
            out.push_str(if i == 0 { "\n      " } else { ",\n      " });
            out.push_str(&q(t));
            out.push_str(&format!(": {i}"));
        }
        out.push_str("\n    },\n    \"merges\": [");
        for (i, (a, b)) in self.merges.iter().enumerate() {
            out.push_str(if i == 0 { "\n      [" } else { ",\n      [" });
            out.push_str(&q(a));
            out.push_str(", ");
            out.push_str(&q(b));
            out.push(']');
        }
        out.push_str("\n    ]\n  }\n}\n");
        out
    }

    /// `tokenizer_config.json`: the fixture with the added-token ids of this vocabulary.
    pub fn tokenizer_config(&self) -> Result<Value> {
        let mut v: Value =
            serde_json::from_str(TOKENIZER_CONFIG).context("fixture tokenizer_config.json")?;
        let dec = v["added_tokens_decoder"]
            .as_object()
            .context("fixture: no added_tokens_decoder")?
            .clone();
        let mut new = serde_json::Map::new();
        for (_, t) in dec {
            let content = t["content"].as_str().unwrap_or("");
            let id = self.id_of(content).context("fixture added token")?;
            new.insert(id.to_string(), t.clone());
        }
        v["added_tokens_decoder"] = Value::Object(new);
        Ok(v)
    }

    pub fn generation_config(&self) -> Value {
        let (eot, end) = (self.endoftext(), self.im_end());
        json!({
            "bos_token_id": eot,
            "pad_token_id": eot,
            "do_sample": true,
            "eos_token_id": [end, eot],
            "temperature": 1.0,
            "top_k": 20,
            "top_p": 0.95
        })
    }

    /// Writes `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`,
    /// `chat_template.jinja`; returns the files written.
    pub fn write(&self, dir: &Path) -> Result<Vec<std::path::PathBuf>> {
        let mut files = vec![];
        let mut put = |name: &str, text: String| -> Result<()> {
            let p = dir.join(name);
            std::fs::write(&p, text).with_context(|| format!("{}: cannot write", p.display()))?;
            files.push(p);
            Ok(())
        };
        put("tokenizer.json", self.tokenizer_json())?;
        put(
            "tokenizer_config.json",
            serde_json::to_string_pretty(&self.tokenizer_config()?)? + "\n",
        )?;
        put(
            "generation_config.json",
            serde_json::to_string_pretty(&self.generation_config())? + "\n",
        )?;
        put("chat_template.jinja", CHAT_TEMPLATE.to_string())?;
        Ok(files)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(vocab_size: usize) {
        let v = Vocab::build(vocab_size).unwrap();
        assert_eq!(v.added.len(), 33);
        assert!(v.added.iter().all(|a| a.id < vocab_size));
        let dir = tempfile::tempdir().unwrap();
        v.write(dir.path()).unwrap();
        let tok = tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
        let text = "<|im_start|>user\nHello, world! Ça va? 12345 naïve\t tabs  and   spaces<|im_end|>\n<|im_start|>assistant\n<think>\nhmm</think>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call><|endoftext|>";
        let enc = tok.encode(text, false).unwrap();
        let ids = enc.get_ids();
        for (s, id) in [
            ("<|im_start|>", v.id_of("<|im_start|>")),
            ("<think>", v.id_of("<think>")),
            ("</tool_call>", v.id_of("</tool_call>")),
        ] {
            assert!(
                ids.contains(&(id.unwrap() as u32)),
                "{s} not matched atomically: {ids:?}"
            );
        }
        assert!(ids.iter().all(|&i| (i as usize) < vocab_size));
        assert_eq!(tok.decode(ids, false).unwrap(), text);
        // Merges are used: far fewer tokens than bytes.
        let plain = tok
            .encode("the quick brown fox jumps over the lazy dog", false)
            .unwrap();
        assert!(plain.get_ids().len() < 30, "{:?}", plain.get_ids());
        assert_eq!(tok.get_vocab_size(true), v.tokens.len() + 33);
    }

    #[test]
    fn small_vocab_tokenizer_round_trips() {
        roundtrip(4160);
        roundtrip(1088);
        let v = Vocab::build(4160).unwrap();
        assert_eq!(v.endoftext(), 4160 - 33);
        assert_eq!(v.im_end(), 4160 - 31);
        assert_eq!(v.n_text, 4160 - 33);
    }

    #[test]
    fn full_vocab_uses_real_ids() {
        let v = Vocab::build(248_320).unwrap();
        assert_eq!(v.endoftext(), 248_044);
        assert_eq!(v.im_end(), 248_046);
        assert_eq!(v.id_of("<think>"), Some(248_068));
        assert_eq!(v.id_of("</tool_call>"), Some(248_059));
        assert_eq!(v.tokens.len(), 248_044);
        assert!(v.n_text > 247_000);
        roundtrip(248_320);
    }

    #[test]
    fn too_small_vocab_is_an_error() {
        let e = Vocab::build(300).err().unwrap().to_string();
        assert!(e.contains("too small"), "{e}");
    }
}
