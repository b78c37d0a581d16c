//! Runtime: generation loop over a model and its per-sequence state.
