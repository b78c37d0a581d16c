//! `lily synth`: seeded random checkpoints in the exact MLX format (being written).
