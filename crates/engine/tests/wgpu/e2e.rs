//! The whole model on wgpu against the CPU (a module of wgpu_ops.rs): the `tiny` and `small`
//! presets teacher-forced over 192 positions (logits per position), decode after a prefill, and
//! greedy continuations, as cuda_ops' end_to_end.

use super::*;

/// Logits against the CPU's, max over positions of max |wgpu − cpu| / max |cpu|. Both sides are
/// f32 (activations, states) on the same weights, the wgpu KV cache f16 by default (where the
/// adapter has SHADER_F16 and ordered subgroups: `Wgpu::kv_f16`; lavapipe has both) and f32 in
/// `tiny_preset_end_to_end_f32_kv` (LILY_WGPU_KV_F16=0; on
/// lavapipe prefill logits 1.25e-4 / 6.5e-5 on tiny / small with f16 against 1.2e-6 / 9.1e-7
/// with f32, decode ~9e-5 either way), so summation order
/// differs, compounded over the layers; MLX-LM's own bf16-vs-f32 gap on `small` is 1e-2 (#6's
/// yardstick) and the CUDA backend's f32 paths measured 5-7e-4 with a bf16 KV cache. A tenth of
/// MLX-LM's gap leaves room for lavapipe's and a GPU's reduction orders while a wrong op (an
/// index, a gate, a position) moves logits by O(1).
const E2E_TOL: f32 = 1e-3;

fn end_to_end(preset: &str) {
    end_to_end_at(preset, &[], None);
}

/// `f16`: the KV cache's type asked for (f16 is made only where the adapter has SHADER_F16),
/// `None` the default's.
fn end_to_end_kv(preset: &str, f16: Option<bool>) {
    end_to_end_at(preset, &[], f16);
}

/// `preset` with config fields overridden (`sets`, `lily synth --set`'s syntax), held to the
/// bounds above.
fn end_to_end_at(preset: &str, sets: &[&str], f16: Option<bool>) {
    let Some(g) = gpu() else { return };
    if let Some(f16) = f16 {
        g.set_kv_f16(f16);
    }
    // The decode step as it runs by default (gpu() turns gemv_q6w off for the op tests).
    g.set_q6w(2);
    e2e_checks(g, preset, sets);
}

/// `preset` (with `sets`) on the device `g` as it is set, held to the bounds above.
fn e2e_checks(g: Wgpu, preset: &str, sets: &[&str]) {
    let what = format!("{preset} {}", sets.join(" "));
    eprintln!("e2e {what}: the KV cache in f16: {}", g.kv_f16());
    let r = ops::end_to_end_set(g, preset, sets, "wgpu");
    // f32 on both sides: the greedy tokens may part only at a near-tie of the CPU's logits.
    if let Some((gap, scale)) = r.parted {
        assert!(
            gap <= 2.0 * E2E_TOL * scale,
            "e2e {what}: greedy parted at token {} without a near-tie",
            r.same
        );
    }
    assert!(
        r.agree + r.dagree >= (r.n + 8) * 99 / 100,
        "e2e {what}: top-1 agreement {} of {}",
        r.agree + r.dagree,
        r.n + 8
    );
    check(&format!("e2e {what}: decode logits"), r.derr, E2E_TOL);
    check(
        &format!("e2e {what}: logits (prefill, per position; f32)"),
        r.err,
        E2E_TOL,
    );
}

#[test]
fn tiny_preset_end_to_end() {
    end_to_end("tiny");
}

/// `tiny` with the KV cache in f32 (`LILY_WGPU_KV_F16=0`, and every adapter without
/// SHADER_F16), within the same bound.
#[test]
fn tiny_preset_end_to_end_f32_kv() {
    end_to_end_kv("tiny", Some(false));
}

#[test]
fn small_preset_end_to_end() {
    end_to_end("small");
}

/// `tiny` and `small` without gemv_q6w (`LILY_WGPU_Q6W=0`: q2x_stage before every decode
/// GEMV, as until stop 43), within the same bounds; the tests above run its default, 2 (every
/// projection it takes and the MoE router's launch, whose export small's MoE block reads).
#[test]
fn q6w_off_end_to_end() {
    for preset in ["tiny", "small"] {
        let Some(g) = gpu() else { return };
        g.set_q6w(0);
        e2e_checks(g, preset, &[]);
    }
}

/// `tiny` at shapes no preset has (`ops::ODD_SHAPES`), each a path the kernels take or refuse
/// by shape. A kernel that takes a shape must get the CPU's logits; one that cannot must fall
/// back, not fail or fault: wgpu runs all of them.
#[test]
fn odd_shapes_end_to_end() {
    for set in ops::ODD_SHAPES {
        end_to_end_at("tiny", &[set], None);
    }
}

/// The decode loop's lookahead on wgpu (common/lookahead.rs): each token's read begun before
/// the step that feeds it is enqueued, finished after. Greedy, and drawn by the device sampler
/// (a draw in the step enqueued before the token it feeds is read).
#[test]
fn lookahead_generates_what_the_loop_without_it_does() {
    let Some(g) = gpu() else { return };
    let dir = common::synth("tiny", 3, &[]);
    let mut m = lily::runtime::load(g, dir.path()).unwrap();
    let tok = lily::tokenizer::Tokenizer::from_dir(dir.path()).unwrap();
    let prompt = common::prompt_ids(20, m.cfg.vocab_size);
    let greedy = lily::runtime::sampler::SamplingParams::greedy();
    lookahead::check_all(&mut m, &tok, &prompt, &greedy);
    let sampled = lily::runtime::sampler::SamplingParams {
        temperature: 0.8,
        top_k: 20,
        seed: Some(4),
        ..greedy.clone()
    };
    lookahead::check_all(&mut m, &tok, &prompt, &sampled);
    lookahead::check_cache(&mut m, &tok, &prompt, &greedy);
}

/// A new state's first decode step is recorded as it runs (`LILY_WGPU_RECORD_FIRST`'s default)
/// where the prefill did not record it ahead (`SeqState::greedy_next` cleared): it launches op
/// by op, the second and third steps replay it (no launch op by op). A second state with the
/// same prompt, whose prefill records the step ahead (`Backend::prerecord`, the default),
/// launches nothing op by op in its first three steps (the record made ahead ran none either),
/// and picks the same tokens. (That replayed steps pick the CPU's tokens: the end-to-end tests
/// above, 48 greedy steps.) The model's warm-up at load (`Backend::warm_up`, on a state of 256
/// positions) built the decode step's pipelines: the first state's first step, recorded as it
/// runs on a state of the same capacity, builds none (attention's depend on the capacity).
#[test]
fn first_decode_step_is_recorded() {
    let Some(g) = gpu() else { return };
    if std::env::var("LILY_WGPU_RECORD_FIRST").as_deref() == Ok("0")
        || std::env::var("LILY_WGPU_REPLAY").as_deref() == Ok("0")
    {
        eprintln!("first_decode_step_is_recorded: skipped (the environment turns it off)");
        return;
    }
    let m = tiny_model(g);
    let b = &m.backend;
    let mut launches = Vec::new();
    let mut toks = Vec::new();
    for greedy_next in [false, true] {
        let d0 = b.dispatches();
        let (mut st, first) = after_prompt_on(&m, greedy_next, 256);
        let prefill = b.dispatches() - d0;
        let mut l = Vec::new();
        let mut t = Vec::new();
        let mut feed = Some(first);
        for i in 0..3 {
            let (d0, p0) = (b.dispatches(), b.pipelines_built());
            t.push(greedy_step(&m, &mut st, feed.take()));
            l.push(b.dispatches() - d0);
            if i == 0 && std::env::var("LILY_WGPU_WARM_UP").as_deref() != Ok("0") {
                assert_eq!(
                    b.pipelines_built(),
                    p0,
                    "a first decode step built pipelines the warm-up had not"
                );
            }
        }
        launches.push((prefill, l));
        toks.push(t);
    }
    eprintln!("launches op by op (prefill, first three steps): {launches:?}");
    let (l0, l1) = (&launches[0].1, &launches[1].1);
    assert!(l0[0] > 0, "the first step ran no launch: {launches:?}");
    assert_eq!(
        l0[1..],
        [0, 0],
        "the second and third steps should replay the first's record: {launches:?}"
    );
    if std::env::var("LILY_WGPU_PRERECORD").as_deref() != Ok("0") {
        assert_eq!(
            l1[..],
            [0, 0, 0],
            "the steps after a prefill that recorded ahead should replay: {launches:?}"
        );
        assert_eq!(
            launches[0].0, launches[1].0,
            "a record made ahead ran launches: {launches:?}"
        );
    }
    assert_eq!(
        toks[0], toks[1],
        "a step recorded ahead picked other tokens"
    );
}

/// A generation that draws on the device: its prefill leaves the logits there
/// (`Logits::Device`), the first token is drawn (`sample_last`), and the sampled step after it
/// is recorded ahead (`Qwen35::prerecord_next`): its steps then launch nothing op by op, where
/// a state without the record ahead launches its first step's kernels; both draw the same
/// tokens (the same seed).
#[test]
fn sampled_step_is_recorded_ahead() {
    let Some(g) = gpu() else { return };
    if std::env::var("LILY_WGPU_REPLAY").as_deref() == Ok("0")
        || std::env::var("LILY_WGPU_PRERECORD").as_deref() == Ok("0")
    {
        eprintln!("sampled_step_is_recorded_ahead: skipped (the environment turns it off)");
        return;
    }
    use lily::model::{Logits, Pick};
    let m = tiny_model(g);
    let b = &m.backend;
    let prompt = common::prompt_ids(12, m.cfg.vocab_size);
    let params = lily::runtime::sampler::SamplingParams {
        temperature: 0.8,
        top_k: 20,
        seed: Some(4),
        ..lily::runtime::sampler::SamplingParams::greedy()
    };
    let mut launches = Vec::new();
    let mut toks = Vec::new();
    for ahead in [false, true] {
        let mut st = m.new_state(256).unwrap();
        st.greedy_next = false;
        let mut d = m
            .device_sampler(&params, 4, &prompt)
            .unwrap()
            .expect("a device sampler on wgpu");
        let got = m.forward(&mut st, &prompt, Logits::Device, None).unwrap();
        assert!(got.is_empty(), "Logits::Device read logits back");
        m.sample_last(&mut st, &mut d).unwrap();
        if ahead {
            m.prerecord_next(&mut st, Pick::Sample(&mut d)).unwrap();
        }
        let mut t = vec![m.picked(&st).unwrap()];
        let d0 = b.dispatches();
        for _ in 0..3 {
            m.decode_step(&mut st, None, Some(&mut d)).unwrap();
            t.push(m.picked(&st).unwrap());
        }
        launches.push(b.dispatches() - d0);
        toks.push(t);
    }
    eprintln!("sampled steps' launches op by op: {launches:?}; tokens {toks:?}");
    assert!(launches[0] > 0, "no step ran op by op: {launches:?}");
    assert_eq!(
        launches[1], 0,
        "the steps recorded ahead ran op by op: {launches:?}"
    );
    assert_eq!(
        toks[0], toks[1],
        "a sampled step recorded ahead drew other tokens"
    );
}

/// `LILY_WGPU_BG_CACHE` (`Wgpu::set_bg_cache`): a state's record (made ahead by its prefill)
/// makes fewer bind groups with the cache than without (only those of its own buffers: the KV
/// caches, the conv and recurrent state), and picks the same tokens over three replayed steps.
/// State 0 runs without the cache; state 1 with it, after the cache was emptied (state 0's
/// record used none of it: BG_KEEP_RECORDS); states 2-4 then find the weights' groups. The
/// cache does not keep the groups of states gone by: each state is dropped before the next, and
/// the groups kept stop growing after state 2, where without the purge each would add its own.
#[test]
fn recorded_steps_share_bind_groups() {
    let Some(g) = gpu() else { return };
    if std::env::var("LILY_WGPU_REPLAY").as_deref() == Ok("0") {
        return;
    }
    let was = g.set_bg_cache(true);
    let m = tiny_model(g);
    let b = &m.backend;
    let mut made = Vec::new();
    let mut kept = Vec::new();
    let mut toks = Vec::new();
    let mut first = None;
    for state in 0..5 {
        b.set_bg_cache(state > 0);
        // The prefill (its bind groups op by op: the same count every state), the record (made
        // ahead, or at the first step with LILY_WGPU_PRERECORD=0) and three steps.
        let b0 = b.bind_groups_made();
        let (mut st, f) = after_prompt(&m);
        assert_eq!(*first.get_or_insert(f), f);
        let t: Vec<u32> = (0..3)
            .map(|i| greedy_step(&m, &mut st, (i == 0).then_some(f)))
            .collect();
        made.push(b.bind_groups_made() - b0);
        kept.push(b.bind_groups_cached());
        toks.push(t);
    }
    b.set_bg_cache(was);
    eprintln!("bind groups made: {made:?}; kept: {kept:?}");
    for t in &toks[1..] {
        assert_eq!(
            &toks[0], t,
            "a state recorded from cached bind groups picked other tokens"
        );
    }
    assert!(
        made[2] < made[0],
        "bind groups made by a state with the cache and one without: {made:?}"
    );
    assert!(
        kept[4] <= kept[2],
        "bind groups kept after each of five states: {kept:?} (a dropped state's stay)"
    );
}

/// The in-place trace of replayed decode steps (`lily bench --trace` on wgpu; device.rs
/// `Tracer`): every traced step names the same launches in the same order, each record starts
/// where the one before ended (one chain of stamps a step), and a skipped entry point
/// (`--in-place`) is left out of the step and of its trace; stamped at pass boundaries instead
/// (`Wgpu::set_trace_passes`, Metal's way) it names the same launches.
#[test]
fn trace_stamps_every_launch_of_a_replayed_step() {
    let Some(g) = gpu() else { return };
    let (m, mut st, first) = tiny_after_prompt(g);
    // Run, record, then replay: the trace sees replayed steps only.
    let mut step = |feed: Option<u32>| greedy_step(&m, &mut st, feed);
    step(Some(first));
    for _ in 0..3 {
        step(None);
    }
    let b = &m.backend;
    if let Err(e) = b.trace_begin() {
        eprintln!("trace skipped: {e:#}");
        return;
    }
    const STEPS: usize = 3;
    for _ in 0..STEPS {
        step(None);
    }
    let (recs, launches) = b.trace_end().unwrap();
    assert!(!launches.is_empty(), "no launch traced");
    assert_eq!(recs.len(), launches.len());
    assert_eq!(launches.len() % STEPS, 0, "steps of different lengths");
    let per = launches.len() / STEPS;
    for s in 1..STEPS {
        assert_eq!(
            launches[..per],
            launches[s * per..(s + 1) * per],
            "step {s} launched other kernels"
        );
    }
    for (i, r) in recs.iter().enumerate() {
        assert!(r.end >= r.start, "launch {i} ends before it starts");
        if i % per > 0 {
            assert_eq!(
                r.start,
                recs[i - 1].end,
                "launch {i}'s stamps are not chained"
            );
        }
    }
    let spans = lily::backend::trace::attribute(&recs, &launches).unwrap();
    let table = lily::backend::trace::summarize(&launches, &spans, &recs, STEPS);
    assert_eq!(
        table.kernels.iter().map(|k| k.calls).sum::<usize>(),
        per * STEPS
    );
    let skipped = "moe_down";
    assert!(launches.iter().any(|l| l.name.starts_with(skipped)));
    b.set_skip(&[skipped]);
    b.trace_begin().unwrap();
    step(None);
    step(None);
    let (_, without) = b.trace_end().unwrap();
    b.set_skip(&[]);
    assert!(!without.is_empty());
    assert!(
        without.iter().all(|l| !l.name.starts_with(skipped)),
        "a skipped kernel ran"
    );
    assert_eq!(
        without.len() / 2,
        per - launches[..per]
            .iter()
            .filter(|l| l.name.starts_with(skipped))
            .count()
    );
    // `+prefix` encodes the family's launches twice (one more of each, in place).
    let n = launches[..per]
        .iter()
        .filter(|l| l.name.starts_with(skipped))
        .count();
    b.set_skip(&["+moe_down"]);
    b.trace_begin().unwrap();
    step(None);
    let (_, twice) = b.trace_end().unwrap();
    b.set_skip(&[]);
    assert_eq!(twice.len(), per + n);
    assert_eq!(
        twice.iter().filter(|l| l.name.starts_with(skipped)).count(),
        2 * n
    );
    // Stamps at pass boundaries (what an adapter without TIMESTAMP_QUERY_INSIDE_PASSES, Apple's
    // through Metal, gets): the same launches in the same order, chained, each a pass of its own.
    b.set_trace_passes(true);
    b.trace_begin().unwrap();
    step(None);
    step(None);
    let (precs, passes) = b.trace_end().unwrap();
    b.set_trace_passes(false);
    assert_eq!(passes.len(), 2 * per);
    assert_eq!(
        passes[..per],
        launches[..per],
        "pass-boundary stamps named other launches"
    );
    for (i, r) in precs.iter().enumerate() {
        assert!(
            r.end >= r.start,
            "pass-stamped launch {i} ends before it starts"
        );
        if i % per > 0 {
            assert_eq!(
                r.start,
                precs[i - 1].end,
                "pass-stamped launch {i} not chained"
            );
        }
    }
}

/// `Wgpu::set_switches` (`lily bench --arms`): an arm's switches take effect in the next decode
/// step (its recorded step dropped and made again: `LILY_WGPU_XQ_AHEAD=1` leaves out every
/// q2x_stage but layer 0's, so the step launches fewer kernels), the empty arm brings the
/// defaults back (the same launches as before), and an unknown name or a switch read only when
/// the device opens is refused without changing anything.
#[test]
fn switches_change_between_steps() {
    let Some(g) = gpu() else { return };
    let (m, mut st, first) = tiny_after_prompt(g);
    let mut step = |feed: Option<u32>| greedy_step(&m, &mut st, feed);
    step(Some(first));
    let b = &m.backend;
    // Launches of the next decode step run op by op (a step's first run under these switches,
    // or its recording after `set_switches` made the old record stale).
    let launches = |step: &mut dyn FnMut(Option<u32>) -> u32| {
        let d0 = b.dispatches();
        step(None);
        b.dispatches() - d0
    };
    let arm = |s: &[(&str, &str)]| -> Vec<(String, String)> {
        s.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    // The environment's defaults first (whatever the run sets), then XQ_AHEAD off and on.
    b.set_switches(&[]).unwrap();
    let defaults = launches(&mut step);
    assert!(
        defaults > 0,
        "the first step after set_switches ran no launch op by op"
    );
    // Without gemv_q6w (its default takes the q2x_stage launches XQ_AHEAD takes out).
    b.set_switches(&arm(&[("LILY_WGPU_Q6W", "0"), ("LILY_WGPU_XQ_AHEAD", "0")]))
        .unwrap();
    let base = launches(&mut step);
    b.set_switches(&arm(&[("LILY_WGPU_Q6W", "0"), ("LILY_WGPU_XQ_AHEAD", "1")]))
        .unwrap();
    let xq = launches(&mut step);
    assert!(xq < base, "XQ_AHEAD=1: {xq} launches, with it off {base}");
    for bad in [("LILY_WGPU_NOPE", "1"), ("LILY_WGPU_REPLAY", "0")] {
        let e = b.set_switches(&arm(&[bad])).unwrap_err();
        eprintln!("{}={}: {e:#}", bad.0, bad.1);
    }
    // Refused arms changed nothing: still XQ_AHEAD's launches (recorded: a replay runs none).
    assert_eq!(
        launches(&mut step),
        0,
        "a refused arm dropped the recorded step"
    );
    b.set_switches(&[]).unwrap();
    assert_eq!(
        launches(&mut step),
        defaults,
        "the empty arm is the defaults"
    );
    // The KV cache's type left to choose (LILY_WGPU_KV_F16 unset): f16 only for attn_dec_team,
    // the one decode kernel that reads it faster than f32 (stop 41); attn_dec_gqa gets f32.
    if std::env::var_os("LILY_WGPU_KV_F16").is_none() {
        b.set_switches(&arm(&[("LILY_WGPU_ATTN_DEC", "gqa")]))
            .unwrap();
        assert!(!b.kv_f16(), "an f16 cache chosen for attn_dec_gqa");
        b.set_switches(&[]).unwrap();
        let r = b.report();
        let tile = std::env::var("LILY_WGPU_ATTN_TILE").as_deref() != Ok("0");
        let team = std::env::var("LILY_WGPU_ATTN_DEC").as_deref() != Ok("gqa");
        assert_eq!(
            b.kv_f16(),
            r.f16 && r.subgroups && tile && team,
            "the default cache type (f16 {}, subgroups {})",
            r.f16,
            r.subgroups
        );
    }
}

/// `tiny` on the device after a 12-token prompt (a state of 64 positions): the model, the state
/// and the prompt's greedy next token.
fn tiny_after_prompt(g: Wgpu) -> (lily::model::Qwen35<Wgpu>, lily::model::SeqState<Wgpu>, u32) {
    let m = tiny_model(g);
    let (st, first) = after_prompt(&m);
    (m, st, first)
}

/// The `tiny` preset on `g` (a synthetic checkpoint).
fn tiny_model(g: Wgpu) -> lily::model::Qwen35<Wgpu> {
    let dir = common::synth("tiny", 3, &[]);
    lily::runtime::load(g, dir.path()).unwrap()
}

/// A new state of `m` after tiny_after_prompt's prompt, and the token its logits pick.
fn after_prompt(m: &lily::model::Qwen35<Wgpu>) -> (lily::model::SeqState<Wgpu>, u32) {
    after_prompt_on(m, true, 64)
}

/// `after_prompt` with the state's `greedy_next` (whether the prefill records the next step
/// ahead) and context as given.
fn after_prompt_on(
    m: &lily::model::Qwen35<Wgpu>,
    greedy_next: bool,
    context: usize,
) -> (lily::model::SeqState<Wgpu>, u32) {
    let prompt = common::prompt_ids(12, m.cfg.vocab_size);
    let mut st = m.new_state(context).unwrap();
    st.greedy_next = greedy_next;
    let logits = m
        .forward(&mut st, &prompt, lily::model::Logits::Last, None)
        .unwrap();
    (st, lily::runtime::argmax(&logits))
}

/// One greedy decode step (fed `feed`, else the step's own pick): the token it picks.
fn greedy_step(
    m: &lily::model::Qwen35<Wgpu>,
    st: &mut lily::model::SeqState<Wgpu>,
    feed: Option<u32>,
) -> u32 {
    match m.decode(st, feed, true).unwrap() {
        lily::model::Next::Token(t) => t,
        lily::model::Next::Logits(_) => panic!("greedy decode gave logits"),
    }
}
