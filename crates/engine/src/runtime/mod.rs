//! Runtime: loading a model onto a backend and the generation loop.

pub mod cache;
pub mod constrain;
pub mod generate;
pub mod sampler;
pub mod stop;

use std::path::Path;

use anyhow::Result;

use crate::backend::Backend;
use crate::loader::Checkpoint;
use crate::model::{Logits, Next, Qwen35, SeqState};

/// Loads a checkpoint directory onto a backend.
pub fn load<B: Backend>(backend: B, dir: &Path) -> Result<Qwen35<B>> {
    load_with_progress(backend, dir, &|_, _| {})
}

/// As [`load`], reporting `(layers placed, layers)` as the weights go to the backend.
pub fn load_with_progress<B: Backend>(
    backend: B,
    dir: &Path,
    progress: &dyn Fn(usize, usize),
) -> Result<Qwen35<B>> {
    let ck = Checkpoint::open(dir)?;
    let m = Qwen35::new_with_progress(backend, ck.config, &ck.weights, progress)?;
    m.warm_up()?;
    Ok(m)
}

/// Index of the largest value (the first on ties, NaN ignored): the sampler's greedy pick.
pub use sampler::argmax;

/// Timings of one generation.
#[derive(Clone, Debug, Default)]
pub struct GenStats {
    pub prompt_tokens: usize,
    /// Prompt tokens that were already in the state (not prefilled again).
    pub cached_tokens: usize,
    pub generated: usize,
    pub prefill_s: f64,
    /// From the start of prefill to the first generated token.
    pub first_token_s: f64,
    pub decode_s: f64,
    /// Constrained decoding: seconds spent computing grammar masks on the host, and how many.
    pub mask_s: f64,
    pub masks: usize,
}

/// Greedy generation: prefill `prompt`, then up to `max_tokens` tokens, stopping after any id in
/// `stop`. `on_token` sees each new id as it is produced.
pub fn generate_greedy<B: Backend>(
    m: &Qwen35<B>,
    st: &mut SeqState<B>,
    prompt: &[u32],
    max_tokens: usize,
    stop: &[u32],
    mut on_token: impl FnMut(u32),
) -> Result<(Vec<u32>, GenStats)> {
    let mut stats = GenStats {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };
    let t0 = std::time::Instant::now();
    let logits = m.forward(st, prompt, Logits::Last, None)?;
    stats.prefill_s = t0.elapsed().as_secs_f64();
    let mut out = Vec::new();
    if max_tokens == 0 {
        return Ok((out, stats));
    }
    // The prefill left its greedy pick in the state's step, equal to `argmax(logits)`: every
    // later token is picked and fed back on the backend.
    let mut next = argmax(&logits);
    let t1 = std::time::Instant::now();
    loop {
        out.push(next);
        on_token(next);
        if out.len() >= max_tokens || stop.contains(&next) || st.pos >= st.max_context {
            break;
        }
        next = match m.decode(st, None, true)? {
            Next::Token(t) => t,
            Next::Logits(l) => argmax(&l),
        };
    }
    stats.decode_s = t1.elapsed().as_secs_f64();
    stats.generated = out.len();
    Ok((out, stats))
}
