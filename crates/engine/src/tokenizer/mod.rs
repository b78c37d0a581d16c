//! Tokenizer: the checkpoint's `tokenizer.json` through the Hugging Face `tokenizers` crate
//! (pure Rust, fancy-regex). Added tokens (`<|im_start|>`, `<think>`, …) match atomically in text.
//! No BOS is added (Qwen adds none).

use std::path::Path;

use anyhow::{anyhow, Context, Result};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let p = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&p).map_err(|e| anyhow!("{}: cannot load tokenizer: {e}", p.display()))?;
        Ok(Self { inner })
    }
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.inner.encode(text, false).map_err(|e| anyhow!("tokenizer: {e}"))?.get_ids().to_vec())
    }
    /// Decodes ids to text, keeping special tokens visible (`<think>`, `<|im_end|>`).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| anyhow!("tokenizer: {e}"))
    }
    pub fn token_id(&self, tok: &str) -> Option<u32> {
        self.inner.token_to_id(tok)
    }
}

/// Stop ids from `generation_config.json` (`eos_token_id`: an id or a list), if present.
pub fn stop_ids(dir: &Path) -> Result<Vec<u32>> {
    let p = dir.join("generation_config.json");
    if !p.exists() {
        return Ok(Vec::new());
    }
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p)?).with_context(|| format!("{}: not valid JSON", p.display()))?;
    Ok(match v.get("eos_token_id") {
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_u64().map(|x| x as u32)).collect(),
        Some(x) => x.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        None => Vec::new(),
    })
}
