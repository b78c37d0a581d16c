//! The model: the forward pass (`qwen35`) and per-sequence state (`state`).
pub mod qwen35;
pub mod state;

pub use qwen35::{DeviceSampler, Logits, Next, Pick, Qwen35};
pub use state::SeqState;
