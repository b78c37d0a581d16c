//! OpenAI-compatible HTTP API (axum). Empty until the server issue lands; the crate exists so the
//! workspace layout of DESIGN.md holds from the start.
