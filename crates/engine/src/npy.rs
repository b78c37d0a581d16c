//! Minimal `.npy` (NumPy format 1.0) reading and writing for float32/int arrays: logits dumps
//! and oracle outputs. Little-endian, C order only.
