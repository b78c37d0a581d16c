//! Text in, text out: the tokenizer, the streaming detokenizer and the chat template.
//!
//! - [`Tokenizer`]: the checkpoint's `tokenizer.json` through the Hugging Face `tokenizers` crate
//!   (pure Rust, fancy-regex). Added tokens (`<|im_start|>`, `<think>`, `<tool_call>`, …) match
//!   atomically in text, special or not; which are special follows `tokenizer_config.json`'s
//!   `added_tokens_decoder` (as transformers does). No BOS is added (Qwen adds none).
//! - [`StreamDecoder`] (`stream.rs`): ids → text as they are generated, never splitting a UTF-8
//!   character and never dropping the `<think>`/`<tool_call>` markers.
//! - [`ChatTemplate`] (`template.rs`): conversation → prompt, byte-exact with transformers'
//!   `apply_chat_template` (`pyfmt.rs` holds the Python formatting rules it needs).

mod pyfmt;
mod stream;
mod template;

use std::collections::HashSet;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};

pub use stream::StreamDecoder;
pub use template::{normalize_messages, special_tokens_map, ChatTemplate, TemplateError};

/// One added token (matched atomically in text).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AddedToken {
    pub id: u32,
    pub content: String,
    /// "special" per `tokenizer_config.json` (`<|im_end|>` is, `<think>` is not).
    pub special: bool,
}

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    added: Vec<AddedToken>,
    special: HashSet<u32>,
    /// The decoder is plain byte-level BPE (Qwen's): enables the byte-exact streaming path.
    byte_level: bool,
}

impl Tokenizer {
    /// Loads `tokenizer.json` of a checkpoint directory, and `tokenizer_config.json` if present.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let cfg = dir.join("tokenizer_config.json");
        Self::from_files(
            &dir.join("tokenizer.json"),
            cfg.exists().then_some(cfg.as_path()),
        )
    }

    /// Loads a `tokenizer.json`; `config` (a `tokenizer_config.json`) marks the special tokens
    /// and may declare added tokens the tokenizer file lacks (their ids must then line up).
    pub fn from_files(tokenizer_json: &Path, config: Option<&Path>) -> Result<Self> {
        let p = tokenizer_json;
        let mut inner = tokenizers::Tokenizer::from_file(p)
            .map_err(|e| anyhow!("{}: cannot load tokenizer: {e}", p.display()))?;
        // Prompts are never truncated or padded behind the caller's back.
        inner
            .with_truncation(None)
            .map_err(|e| anyhow!("tokenizer: {e}"))?;
        inner.with_padding(None);
        let mut added: Vec<AddedToken> = inner
            .get_added_tokens_decoder()
            .into_iter()
            .map(|(id, t)| AddedToken {
                id,
                content: t.content,
                special: t.special,
            })
            .collect();
        if let Some(cp) = config {
            let text = std::fs::read_to_string(cp)
                .with_context(|| format!("{}: cannot read", cp.display()))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{}: not valid JSON", cp.display()))?;
            if let Some(dec) = v.get("added_tokens_decoder").and_then(|d| d.as_object()) {
                for (k, t) in dec {
                    let id: u32 = k.parse().with_context(|| {
                        format!(
                            "{}: added_tokens_decoder key {k:?} is not an id",
                            cp.display()
                        )
                    })?;
                    let content = t.get("content").and_then(|c| c.as_str()).with_context(|| {
                        format!("{}: added token {id} has no content", cp.display())
                    })?;
                    let special = t.get("special").and_then(|s| s.as_bool()).unwrap_or(false);
                    match inner.token_to_id(content) {
                        Some(x) if x == id => {}
                        Some(x) => bail!("{}: added token {content:?} is id {id} but tokenizer.json has it at {x}", cp.display()),
                        None => {
                            let tok = tokenizers::AddedToken::from(content.to_string(), special);
                            if special {
                                inner.add_special_tokens(&[tok]);
                            } else {
                                inner.add_tokens(&[tok]);
                            }
                            if inner.token_to_id(content) != Some(id) {
                                bail!("{}: added token {content:?} should be id {id}, but tokenizer.json's vocabulary puts it elsewhere", cp.display());
                            }
                        }
                    }
                    added.retain(|a| a.id != id);
                    added.push(AddedToken {
                        id,
                        content: content.to_string(),
                        special,
                    });
                }
            }
        }
        added.sort_by_key(|a| a.id);
        let special = added.iter().filter(|a| a.special).map(|a| a.id).collect();
        let byte_level = matches!(
            inner.get_decoder(),
            Some(tokenizers::DecoderWrapper::ByteLevel(_))
        );
        Ok(Self {
            inner,
            added,
            special,
            byte_level,
        })
    }

    /// Text to ids: added tokens match atomically, nothing is prepended or appended.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode_fast(text, false)
            .map_err(|e| anyhow!("tokenizer: {e}"))?
            .get_ids()
            .to_vec())
    }

    /// Decodes ids to text, keeping special tokens visible (`<think>`, `<|im_end|>`).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| anyhow!("tokenizer: {e}"))
    }

    /// A streaming decoder for one generated sequence.
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder::new(self)
    }

    pub fn token_id(&self, tok: &str) -> Option<u32> {
        self.inner.token_to_id(tok)
    }

    /// The token string of an id (byte-level symbols for BPE tokens, e.g. `Ġthe`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of ids with a token, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Added tokens in id order.
    pub fn added_tokens(&self) -> &[AddedToken] {
        &self.added
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special.contains(&id)
    }

    pub(crate) fn is_byte_level(&self) -> bool {
        self.byte_level
    }

    /// The raw bytes one token decodes to under the byte-level decoder (the rule of
    /// `tokenizers`' `ByteLevel::decode_chain`: every char maps back to a byte, else the token's
    /// own UTF-8). None for ids without a token.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let s = self.inner.id_to_token(id)?;
        let mapped: Option<Vec<u8>> = s.chars().map(byte_of_char).collect();
        Some(mapped.unwrap_or_else(|| s.into_bytes()))
    }
}

/// GPT-2's printable-char → byte map (inverse of `bytes_to_unicode`).
fn byte_of_char(c: char) -> Option<u8> {
    static TABLE: std::sync::OnceLock<[i16; 324]> = std::sync::OnceLock::new();
    let t = TABLE.get_or_init(|| {
        let mut t = [-1i16; 324];
        let mut n = 0;
        for b in 0..=255u16 {
            let printable = (b'!' as u16..=b'~' as u16).contains(&b)
                || (0xA1..=0xAC).contains(&b)
                || (0xAE..=0xFF).contains(&b);
            if printable {
                t[b as usize] = b as i16;
            } else {
                t[256 + n] = b as i16;
                n += 1;
            }
        }
        t
    });
    let i = c as usize;
    (i < t.len() && t[i] >= 0).then(|| t[i] as u8)
}

/// Stop ids from `generation_config.json` (`eos_token_id`: an id or a list), if present.
pub fn stop_ids(dir: &Path) -> Result<Vec<u32>> {
    let p = dir.join("generation_config.json");
    if !p.exists() {
        return Ok(Vec::new());
    }
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p)?)
        .with_context(|| format!("{}: not valid JSON", p.display()))?;
    Ok(match v.get("eos_token_id") {
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().map(|x| x as u32))
            .collect(),
        Some(x) => x.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        None => Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::byte_of_char;

    #[test]
    fn gpt2_byte_map() {
        assert_eq!(byte_of_char('Ġ'), Some(b' '));
        assert_eq!(byte_of_char('Ċ'), Some(b'\n'));
        assert_eq!(byte_of_char('a'), Some(b'a'));
        assert_eq!(byte_of_char('é'), Some(0xE9));
        assert_eq!(byte_of_char(' '), None);
        assert_eq!(byte_of_char('中'), None);
        let all: std::collections::HashSet<u8> = (0..324u32)
            .filter_map(|c| byte_of_char(char::from_u32(c).unwrap()))
            .collect();
        assert_eq!(all.len(), 256);
    }
}
