//! lily: an inference engine for one model family, Qwen3.6-35B-A3B (qwen3_5_moe), loaded from MLX
//! affine-quantized checkpoints. This crate is the library: no HTTP, no async runtime.
//!
//! Read `model/qwen35.rs` first: it is the forward pass, a list of named ops against
//! `backend::Backend`. `backend/cpu` is the reference implementation of every op.

pub mod backend;
pub mod config;
pub mod loader;
pub mod model;
pub mod npy;
pub mod rng;
pub mod runtime;
pub mod synth;
pub mod tokenizer;

pub use config::Config;
