//! The decode loop's one-step lookahead on the CPU (common/lookahead.rs): greedy, and sampled by
//! the CPU's own sampler (`Backend::sample_step`, a draw in the step the lookahead enqueues).

mod common;
#[path = "common/lookahead.rs"]
mod lookahead;

use common::{load, prompt_ids, synth};
use lily::runtime::sampler::SamplingParams;
use lily::tokenizer::Tokenizer;

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.9,
        top_k: 20,
        top_p: 0.95,
        min_p: 0.01,
        presence_penalty: 0.5,
        frequency_penalty: 0.3,
        repetition_penalty: 1.2,
        seed: Some(seed),
    }
}

#[test]
fn greedy_is_the_same_with_and_without_the_lookahead() {
    let dir = synth("tiny", 3, &[]);
    let mut m = load(dir.path());
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let prompt = prompt_ids(20, m.cfg.vocab_size);
    lookahead::check_all(&mut m, &tok, &prompt, &SamplingParams::greedy());
}

#[test]
fn device_sampling_is_the_same_with_and_without_the_lookahead() {
    let dir = synth("tiny", 3, &[]);
    let mut m = load(dir.path());
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let prompt = prompt_ids(20, m.cfg.vocab_size);
    for seed in [11, 12] {
        lookahead::check_all(&mut m, &tok, &prompt, &sampled(seed));
    }
}

#[test]
fn a_cached_turn_after_a_stop_id_is_a_fresh_run() {
    let dir = synth("tiny", 3, &[]);
    let mut m = load(dir.path());
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let prompt = prompt_ids(20, m.cfg.vocab_size);
    lookahead::check_cache(&mut m, &tok, &prompt, &SamplingParams::greedy());
    lookahead::check_cache(&mut m, &tok, &prompt, &sampled(5));
}
