//! Backends: the op vocabulary the forward pass is written against.
pub mod cpu;
