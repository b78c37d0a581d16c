//! Checkpoint loading: safetensors (memory-mapped), MLX quantization, name mapping, load-time fixes.
pub mod tensor;
