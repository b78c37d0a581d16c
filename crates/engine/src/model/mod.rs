//! The model: the forward pass (`qwen35`) and per-sequence state (`state`).
