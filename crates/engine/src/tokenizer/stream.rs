//! Streaming detokenizer: turns generated ids into text as they arrive.
//!
//! Why: byte-level BPE tokens hold raw bytes, so one token may end in the middle of a multi-byte
//! UTF-8 character (an emoji is often split over 2–4 tokens). Decoding each token alone would
//! print replacement characters; re-decoding the whole history each step costs O(n²). For the
//! byte-level decoder (Qwen's) we map each token to its bytes and keep only the incomplete tail of
//! a character (≤ 3 bytes) pending; text is emitted as soon as it is valid UTF-8. Invalid bytes
//! become U+FFFD exactly where `String::from_utf8_lossy` would put them, so the concatenation of
//! all pushes plus `finish()` equals `Tokenizer::decode` of all ids. Special and added tokens
//! (`<think>`, `</think>`, `<tool_call>`, `<|im_end|>`) are emitted as their text, never dropped.
//! Other decoders fall back to a small re-decoded window (prefix/read offsets, as in TGI).

use super::Tokenizer;

/// Incremental decoder of one generated sequence; see the module docs.
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    mode: Mode,
}

enum Mode {
    /// Byte-level BPE: bytes of an incomplete UTF-8 character waiting for the next token.
    Bytes { pending: Vec<u8> },
    /// Generic decoders: ids from `prefix`; `read` marks the ids whose text was emitted.
    Window {
        ids: Vec<u32>,
        prefix: usize,
        read: usize,
    },
}

impl<'a> StreamDecoder<'a> {
    pub fn new(tok: &'a Tokenizer) -> Self {
        let mode = if tok.is_byte_level() {
            Mode::Bytes {
                pending: Vec::new(),
            }
        } else {
            Mode::Window {
                ids: Vec::new(),
                prefix: 0,
                read: 0,
            }
        };
        Self { tok, mode }
    }

    /// Adds one token; returns the text that became complete (None while a character is split, or
    /// for ids without a token).
    pub fn push(&mut self, id: u32) -> Option<String> {
        match &mut self.mode {
            Mode::Bytes { pending } => {
                let bytes = self.tok.token_bytes(id)?;
                pending.extend_from_slice(&bytes);
                let out = drain_utf8(pending, false);
                (!out.is_empty()).then_some(out)
            }
            Mode::Window { ids, prefix, read } => {
                ids.push(id);
                let before = self.tok.decode(&ids[*prefix..*read]).ok()?;
                let now = self.tok.decode(&ids[*prefix..]).ok()?;
                if now.len() > before.len()
                    && !now.ends_with('\u{FFFD}')
                    && now.is_char_boundary(before.len())
                {
                    let out = now[before.len()..].to_string();
                    // Keep the last emitted ids as context for the next step; drop the rest.
                    let keep_from = *read;
                    ids.drain(..keep_from);
                    *prefix = 0;
                    *read = ids.len();
                    Some(out)
                } else {
                    None
                }
            }
        }
    }

    /// Ends the sequence: flushes what is still held back (an incomplete character becomes
    /// U+FFFD, as a full decode writes it).
    pub fn finish(&mut self) -> Option<String> {
        let out = match &mut self.mode {
            Mode::Bytes { pending } => drain_utf8(pending, true),
            Mode::Window { ids, prefix, read } => {
                let before = self.tok.decode(&ids[*prefix..*read]).unwrap_or_default();
                let now = self.tok.decode(&ids[*prefix..]).unwrap_or_default();
                ids.clear();
                *prefix = 0;
                *read = 0;
                if now.len() > before.len() && now.is_char_boundary(before.len()) {
                    now[before.len()..].to_string()
                } else {
                    String::new()
                }
            }
        };
        (!out.is_empty()).then_some(out)
    }

    /// True while bytes or ids are held back waiting for the rest of a character.
    pub fn has_pending(&self) -> bool {
        match &self.mode {
            Mode::Bytes { pending } => !pending.is_empty(),
            Mode::Window { ids, read, .. } => ids.len() > *read,
        }
    }
}

/// Moves the longest decodable prefix of `buf` out as text, replacing invalid sequences with
/// U+FFFD like `from_utf8_lossy`; an incomplete trailing character stays in `buf` unless `flush`.
fn drain_utf8(buf: &mut Vec<u8>, flush: bool) -> String {
    let mut out = String::new();
    let mut start = 0;
    while start < buf.len() {
        match std::str::from_utf8(&buf[start..]) {
            Ok(s) => {
                out.push_str(s);
                start = buf.len();
            }
            Err(e) => {
                let valid = e.valid_up_to();
                out.push_str(
                    std::str::from_utf8(&buf[start..start + valid]).expect("valid prefix"),
                );
                match e.error_len() {
                    Some(n) => {
                        out.push('\u{FFFD}');
                        start += valid + n;
                    }
                    None if flush => {
                        out.push('\u{FFFD}');
                        start = buf.len();
                    }
                    None => {
                        start += valid;
                        break;
                    }
                }
            }
        }
    }
    buf.drain(..start);
    out
}

#[cfg(test)]
mod tests {
    use super::drain_utf8;

    #[test]
    fn lossy_streaming_equals_lossy_whole() {
        let cases: [&[u8]; 5] = [
            "héllo 😀 世界".as_bytes(),
            b"\xe4\xbd\xa0\xe5\xa5",
            b"a\xff\xfeb\xe4\xbdc",
            b"\xf0\x9f\x98",
            b"\xed\xa0\x80x",
        ];
        for bytes in cases {
            let whole = String::from_utf8_lossy(bytes).to_string();
            let mut buf = Vec::new();
            let mut got = String::new();
            for b in bytes {
                buf.push(*b);
                got.push_str(&drain_utf8(&mut buf, false));
            }
            got.push_str(&drain_utf8(&mut buf, true));
            assert_eq!(got, whole, "{bytes:?}");
        }
    }
}
