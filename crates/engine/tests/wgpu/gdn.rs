//! wgpu gdn ops against the CPU (a module of wgpu_ops.rs; its header states the tolerances).

#[allow(unused_imports)]
use super::*;
