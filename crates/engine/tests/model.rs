//! The CPU model against itself: decode equals prefill, chunked prefill equals one shot, bad
//! input is an error. No oracle needed.

mod common;

use common::{load, prompt_ids, synth};
use lily::model::Logits;

/// Largest |a-b| relative to the largest |b|.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let m = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
    a.iter().zip(b).fold(0f32, |e, (x, y)| e.max((x - y).abs())) / m
}

// Decode (GEMV, single-token ops) and prefill (GEMM, block ops) sum in different orders, so they
// agree to f32 rounding, not bit for bit: 1e-5 of the logit scale is ~100× the f32 epsilon and
// far below any meaningful difference (a real bug, e.g. a wrong position or a stale state, moves
// logits by O(1e-1)).
const PATH_TOL: f32 = 1e-5;

#[test]
fn prefill_then_decode_equals_longer_prefill() {
    let dir = synth("small", 1, &[]);
    let m = load(dir.path());
    let ids = prompt_ids(41, m.cfg.vocab_size);
    // Reference: one prefill of all 41 tokens.
    let mut st = m.new_state(64).unwrap();
    let full = m.forward(&mut st, &ids, Logits::All, None).unwrap();
    // Prefill 37, then decode 4 one at a time: the KV cache and the conv/recurrent state carry over.
    let mut st2 = m.new_state(64).unwrap();
    m.forward(&mut st2, &ids[..37], Logits::None, None).unwrap();
    let v = m.cfg.vocab_size;
    for t in 37..41 {
        let l = m
            .forward(&mut st2, &ids[t..t + 1], Logits::Last, None)
            .unwrap();
        let e = rel_err(&l, &full[t * v..(t + 1) * v]);
        assert!(
            e < PATH_TOL,
            "position {t}: decode vs prefill rel err {e:e}"
        );
    }
    assert_eq!(st2.pos, 41);
}

/// A prompt that fills the KV cache's capacity (256 positions, a new state's) leaves room for
/// the token its logits pick: the first decode step does not grow the cache (which on a GPU
/// copies it and records the decode step anew for the new buffers), and its logits are those
/// of a longer prefill. At the context limit nothing past it is reserved.
#[test]
fn prefill_leaves_room_for_the_next_token() {
    let dir = synth("tiny", 4, &[]);
    let m = load(dir.path());
    let d = m.dims;
    let ids = prompt_ids(257, m.cfg.vocab_size);
    let mut st = m.new_state(1024).unwrap();
    m.forward(&mut st, &ids[..256], Logits::Last, None).unwrap();
    let after_prefill = st.nbytes(&d);
    let l = m
        .forward(&mut st, &ids[256..257], Logits::Last, None)
        .unwrap();
    assert_eq!(
        st.nbytes(&d),
        after_prefill,
        "the first decode step grew the KV cache"
    );
    let mut one = m.new_state(1024).unwrap();
    let full = m.forward(&mut one, &ids, Logits::Last, None).unwrap();
    let e = rel_err(&l, &full);
    assert!(e < PATH_TOL, "decode after the prefill: rel err {e:e}");
    // A prompt of the whole context reserves the context, no more.
    let mut at = m.new_state(256).unwrap();
    let fresh = at.nbytes(&d);
    m.forward(&mut at, &ids[..256], Logits::Last, None).unwrap();
    assert_eq!(at.nbytes(&d), fresh, "reserved past the context");
}

#[test]
fn chunked_prefill_equals_one_shot() {
    let dir = synth("small", 2, &[]);
    let mut m = load(dir.path());
    let ids = prompt_ids(100, m.cfg.vocab_size);
    m.chunk = 256;
    let mut st = m.new_state(128).unwrap();
    let one = m.forward(&mut st, &ids, Logits::All, None).unwrap();
    for chunk in [1, 7, 32] {
        m.chunk = chunk;
        let mut st = m.new_state(128).unwrap();
        let parts = m.forward(&mut st, &ids, Logits::All, None).unwrap();
        let e = rel_err(&parts, &one);
        assert!(e < PATH_TOL, "chunk {chunk}: rel err {e:e}");
    }
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let dir = synth("tiny", 0, &[]);
    let m = load(dir.path());
    let mut st = m.new_state(8).unwrap();
    let e = m
        .forward(&mut st, &[m.cfg.vocab_size as u32], Logits::Last, None)
        .unwrap_err();
    assert!(format!("{e:#}").contains("out of range"), "{e:#}");
    let e = m.forward(&mut st, &[1; 9], Logits::Last, None).unwrap_err();
    assert!(
        format!("{e:#}").contains("context length exceeded"),
        "{e:#}"
    );
    assert!(m.forward(&mut st, &[], Logits::Last, None).is_err());
    // The state is untouched by rejected calls and still usable.
    assert_eq!(st.pos, 0);
    m.forward(&mut st, &[1, 2, 3], Logits::Last, None).unwrap();
    assert_eq!(st.pos, 3);
}
