//! Tokenizer (Hugging Face `tokenizers`, pure Rust) loaded from the checkpoint's tokenizer.json.
