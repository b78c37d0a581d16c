//! The CPU backend: the reference every other backend is checked against.
