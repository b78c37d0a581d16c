//! wgpu output ops against the CPU (a module of wgpu_ops.rs; its header states the tolerances):
//! the embedding lookup, the greedy pick into the step, the constrained-decoding mask.

use super::*;
use lily::backend::cpu::CpuStep;

#[test]
fn embed_dequantizes_rows_like_the_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(21);
    let d = qwen_dims();
    let table = rand_quant(&mut rng, 1, 1000, d.hidden, 4, 64, false);
    let gt = g.upload_mat(&table).unwrap();
    let ids = [0u32, 999, 17, 17, 512];
    let mut c = vec![0.0; ids.len() * d.hidden];
    Cpu.embed(&table, &ids, &mut c);
    let mut o = g.zeros(ids.len() * d.hidden).unwrap();
    g.embed(&gt, &ids, &mut o);
    // scale·code + bias: one product and one add, which a GPU may contract into an FMA (one
    // rounding instead of two): within an f32 ulp of the value, far below F32_TOL.
    check(
        "embed (5 ids)",
        rel_rows(&h(&g, &o, c.len()), &c, d.hidden),
        1e-6,
    );
    // embed_step reads the token from the step on the device.
    let mut st = g.new_step().unwrap();
    g.set_step(&mut st, 999, 40);
    let mut o1 = g.zeros(d.hidden).unwrap();
    g.embed_step(&gt, &st, &mut o1);
    check(
        "embed_step (token 999)",
        rel_rows(&h(&g, &o1, d.hidden), &c[d.hidden..2 * d.hidden], d.hidden),
        1e-6,
    );
    // An id past the vocabulary is an error.
    g.embed(&gt, &[1000], &mut o1);
    assert!(g.sync().is_err(), "an id past the table must be an error");
}

#[test]
fn argmax_first_on_ties_and_steps_the_position() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(22);
    let vocab = 248_320;
    let mut st = g.new_step().unwrap();
    for case in 0..4 {
        let mut l = rng.vec(vocab, 3.0);
        match case {
            1 => {
                // a tie across two partial blocks: the lower index wins
                l[5_000] = 100.0;
                l[200_000] = 100.0;
            }
            2 => {
                // NaN never wins; -inf everywhere else but one
                l.iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
                l[7] = f32::NAN;
                l[123_456] = -1e30;
            }
            3 => l[vocab - 1] = 1e9,
            _ => {}
        }
        let mut cs = CpuStep {
            token: 0,
            pos: 10 + case,
        };
        Cpu.argmax_step(&l, vocab, &mut cs);
        g.set_step(&mut st, 0, 10 + case);
        g.argmax_step(&g.upload(&l).unwrap(), vocab, &mut st);
        let tok = g.step_token(&st).unwrap();
        g.sync().unwrap();
        println!("argmax case {case}: cpu {} wgpu {tok}", cs.token);
        assert_eq!(tok, cs.token, "case {case}");
    }
}

/// A token read begun (`step_token_begin`) sees the step as the work before it left it, not as
/// work enqueued after it (the next step's pick) leaves it; several may be in flight.
#[test]
fn a_token_read_sees_the_step_when_it_began() {
    let Some(g) = gpu() else { return };
    let vocab = 1000;
    let mut st = g.new_step().unwrap();
    let peak = |i: usize| {
        let mut l = vec![0.0f32; vocab];
        l[i] = 1.0;
        g.upload(&l).unwrap()
    };
    let (a, b, c) = (peak(17), peak(400), peak(999));
    g.set_step(&mut st, 5, 3);
    g.argmax_step(&a, vocab, &mut st);
    let r1 = g.step_token_begin(&st).unwrap();
    g.argmax_step(&b, vocab, &mut st);
    let r2 = g.step_token_begin(&st).unwrap();
    g.argmax_step(&c, vocab, &mut st);
    assert_eq!(g.step_token_finish(r1).unwrap(), 17);
    let r3 = g.step_token_begin(&st).unwrap();
    assert_eq!(g.step_token_finish(r2).unwrap(), 400);
    assert_eq!(g.step_token_finish(r3).unwrap(), 999);
    // The buffers go back to the pool and are reused.
    for i in 0..5 {
        g.set_step(&mut st, 100 + i, 0);
        let r = g.step_token_begin(&st).unwrap();
        assert_eq!(g.step_token_finish(r).unwrap(), 100 + i);
    }
    assert_eq!(g.step_token(&st).unwrap(), 104);
}

#[test]
fn mask_logits_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(23);
    let vocab = 70_000;
    let l = rng.vec(vocab, 1.0);
    // a mask shorter than the vocabulary: ids past its words are disallowed
    let allowed: Vec<u32> = (0..1500).map(|_| rng.u64() as u32).collect();
    let mut c = l.clone();
    Cpu.mask_logits(&mut c, vocab, &allowed);
    let mut gl = g.upload(&l).unwrap();
    g.mask_logits(&mut gl, vocab, &allowed);
    let back = h(&g, &gl, vocab);
    let same = back
        .iter()
        .zip(&c)
        .all(|(a, b)| a == b || (a.is_infinite() && b.is_infinite() && a.signum() == b.signum()));
    println!(
        "mask_logits: {} of {vocab} allowed",
        c.iter().filter(|v| v.is_finite()).count()
    );
    assert!(same, "mask_logits differs from the CPU");
}

/// The device sampler on masked logits (common/sampling.rs says what it holds).
#[test]
fn sample_step_on_masked_logits() {
    let Some(g) = gpu() else { return };
    sampling::sample_step_on_masked_logits(&g, |l| g.upload(l).unwrap());
}
