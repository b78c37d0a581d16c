//! Sampler: turns one row of logits into the next token id.
//!
//! Parameters ([`SamplingParams`]) default from the checkpoint's `generation_config.json` and are
//! overridden per request ([`SamplingOverrides`]). A [`Sampler`] belongs to one sequence: it owns
//! the seeded generator, so the same seed and the same logits give the same tokens on every run
//! and platform.
//!
//! # Order of the steps (the order of Hugging Face transformers' processors and warpers, which
//! vLLM and llama.cpp differ from only where the result does not change)
//!
//! 1. **Repetition penalty** `r` (CTRL / transformers / vLLM): for each distinct token already
//!    seen, `l > 0 ? l / r : l * r`.
//! 2. **Presence and frequency penalties** (OpenAI / vLLM): `l -= presence·[c > 0] +
//!    frequency·c`, `c` = the token's count. With [`Sampler::sample`] every penalty counts `history`;
//!    [`Sampler::sample_split`] follows vLLM exactly (the repetition penalty sees prompt and
//!    output, presence and frequency only the output).
//! 3. **Greedy** when `temperature < 1e-5` (vLLM's threshold) or `top_k == 1`: the arg-max, the
//!    first (lowest id) on ties, NaN ignored; no random number is drawn.
//! 4. **Temperature** `T`: weights `w = exp((l - m) / T)` with `m` the largest logit kept; `w` of
//!    the best token is exactly 1. `exp` is [`exp_weight`], a portable polynomial (0 for NaN and
//!    -inf logits). Steps 5–7 never need the normaliser of all logits.
//! 5. **Top-k** (`top_k` = 0 or ≥ vocab: off): keep the `k` largest logits, order (logit desc, id
//!    asc) so ties are deterministic. A bounded heap, one pass, O(V + k log k) in practice; the
//!    weights of step 4 are then computed for these k only.
//! 6. **Softmax + top-p** (`top_p` = 1: off): with `Z` = Σ w over the tokens kept so far, keep
//!    the shortest prefix of the (weight desc, id asc) order whose Σ w ≥ top_p · Z, at least
//!    one. Without top-k this would need a sort of the whole vocabulary; instead a histogram of
//!    the weights in 1/8-octave bins (from the float bits) finds the bin where the cumulative
//!    mass crosses top_p · Z. Better bins are kept whole; only the tokens of that one bin are
//!    sorted, to find the last token `(w_c, c)` of the nucleus, and the kept set becomes the mask
//!    `w > w_c || (w == w_c && id ≤ c)` over the dense weights. A few passes over V plus
//!    O(B log B) for the B tokens of one bin (B ≈ V only when nearly all weights are within
//!    1/8 octave of each other, i.e. an almost uniform distribution).
//! 7. **Min-p** (`min_p` = 0: off): drop tokens with `p < min_p · p_max`, i.e. `w < min_p`
//!    (renormalising after top-p does not change `p / p_max`).
//! 8. **Draw**: `u` uniform in [0, 1) from the generator (53 bits), `r = u · Σ w` over the kept
//!    set; the token is the lowest id `j` in the kept set with Σ_{i ≤ j} w_i > r (ids ascending,
//!    sums in f64). This definition is order-free, so a device can compute it with a prefix sum.
//!
//! Generator: xoshiro256++ seeded through SplitMix64 (both public domain, Vigna); one `u64` per
//! sampled token (none for greedy). Without a seed, the seed comes from the OS-keyed hasher and
//! the clock, and [`Sampler::seed`] reports it so a run can be repeated. All arithmetic is IEEE
//! f32 / f64 `+ * /` in a fixed order (no libm), so results match across platforms.

use crate::rng::Rng;
use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Temperatures below this sample greedily (as vLLM).
pub const GREEDY_TEMPERATURE: f32 = 1e-5;
/// Histogram for top-p without top-k: bins of 1/8 octave of the weight; the last one holds all
/// weights below 2^-128 (in practice only zeros).
const BINS: usize = 1024;

/// What the sampler does. Neutral values switch a step off: `top_k` 0, `top_p` 1, `min_p` 0,
/// penalties 0 / 0 / 1.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 (or below 1e-5) = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: f32,
    /// `None`: a fresh seed per sampler (see [`Sampler::seed`]).
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    /// Greedy, every other step off.
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            seed: None,
        }
    }
}

/// Per-request values; `None` keeps the default. `top_k` takes -1 or 0 for "off" (vLLM, OpenAI
/// clients). Deserialises from a JSON object with any of these keys.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingOverrides {
    pub temperature: Option<f32>,
    pub top_k: Option<i64>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
}

impl SamplingParams {
    /// Greedy (the same as `default()`).
    pub fn greedy() -> Self {
        Self::default()
    }

    /// True when [`Sampler::sample`] takes the arg-max and draws no random number.
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_TEMPERATURE || self.top_k == 1
    }

    /// Greedy with every penalty off: the pick is the arg-max of the raw logits, which a backend
    /// can make itself (`Qwen35::decode` with `greedy`), never sending the logits to the host.
    pub fn is_plain_greedy(&self) -> bool {
        self.is_greedy()
            && self.repetition_penalty == 1.0
            && self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
    }

    /// Defaults from `DIR/generation_config.json`: `temperature`, `top_k`, `top_p`, `min_p`,
    /// `repetition_penalty`, `presence_penalty`, `frequency_penalty` where present; a missing
    /// field is neutral (temperature 1). `do_sample: false` means greedy (as transformers); a
    /// missing `do_sample` does not (vLLM reads the fields regardless). No file: greedy.
    /// Qwen3.6 ships temperature 1.0, top_k 20, top_p 0.95.
    pub fn from_generation_config(dir: &Path) -> Result<Self> {
        let p = dir.join("generation_config.json");
        if !p.exists() {
            return Ok(Self::default());
        }
        let text =
            std::fs::read_to_string(&p).with_context(|| format!("{}: cannot read", p.display()))?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: not valid JSON", p.display()))?;
        Self::from_generation_config_json(&v).with_context(|| format!("{}", p.display()))
    }

    /// [`Self::from_generation_config`] on parsed JSON.
    pub fn from_generation_config_json(v: &Value) -> Result<Self> {
        let num = |k: &str| -> Result<Option<f32>> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_f64()
                    .map(|x| Some(x as f32))
                    .ok_or_else(|| anyhow!("{k} must be a number, got {x}")),
            }
        };
        let mut p = Self {
            temperature: 1.0,
            ..Self::default()
        };
        if let Some(t) = num("temperature")? {
            p.temperature = t;
        }
        if let Some(k) = num("top_k")? {
            if k.fract() != 0.0 {
                bail!("top_k must be an integer, got {k}");
            }
            p.top_k = if k <= 0.0 { 0 } else { k as usize };
        }
        if let Some(x) = num("top_p")? {
            p.top_p = x;
        }
        if let Some(x) = num("min_p")? {
            p.min_p = x;
        }
        if let Some(x) = num("repetition_penalty")? {
            p.repetition_penalty = x;
        }
        if let Some(x) = num("presence_penalty")? {
            p.presence_penalty = x;
        }
        if let Some(x) = num("frequency_penalty")? {
            p.frequency_penalty = x;
        }
        if v.get("do_sample").and_then(Value::as_bool) == Some(false) {
            p.temperature = 0.0;
        }
        p.validate()?;
        Ok(p)
    }

    /// These parameters with the request's values on top, validated.
    pub fn with_overrides(&self, o: &SamplingOverrides) -> Result<Self> {
        let mut p = self.clone();
        if let Some(x) = o.temperature {
            p.temperature = x;
        }
        if let Some(k) = o.top_k {
            p.top_k = match k {
                -1 | 0 => 0,
                k if k > 0 => k as usize,
                k => bail!("top_k must be -1 or 0 (off) or a positive integer, got {k}"),
            };
        }
        if let Some(x) = o.top_p {
            p.top_p = x;
        }
        if let Some(x) = o.min_p {
            p.min_p = x;
        }
        if let Some(x) = o.presence_penalty {
            p.presence_penalty = x;
        }
        if let Some(x) = o.frequency_penalty {
            p.frequency_penalty = x;
        }
        if let Some(x) = o.repetition_penalty {
            p.repetition_penalty = x;
        }
        if o.seed.is_some() {
            p.seed = o.seed;
        }
        p.validate()?;
        Ok(p)
    }

    /// Checks every field; the message names the field and the accepted range (fit for an HTTP
    /// 400).
    pub fn validate(&self) -> Result<()> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            bail!("temperature must be a finite number >= 0, got {t}");
        }
        let p = self.top_p;
        if !(p > 0.0 && p <= 1.0) {
            bail!("top_p must be in (0, 1], got {p}");
        }
        let m = self.min_p;
        if !(0.0..=1.0).contains(&m) {
            bail!("min_p must be in [0, 1], got {m}");
        }
        let r = self.repetition_penalty;
        if !(r.is_finite() && r > 0.0) {
            bail!("repetition_penalty must be a finite number > 0, got {r}");
        }
        for (name, x) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&x) {
                bail!("{name} must be in [-2, 2], got {x}");
            }
        }
        Ok(())
    }
}

/// A seed from the OS-keyed `RandomState`, the clock and a process counter.
fn entropy_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering as AO};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    h.write_u128(nanos);
    h.write_u64(COUNTER.fetch_add(1, AO::Relaxed));
    h.finish()
}

/// A top-k candidate; `Ord` puts the worse candidate greater (lower logit, then higher id), so
/// a `BinaryHeap` keeps the worst of the k on top.
#[derive(Clone, Copy, Debug)]
struct Cand {
    l: f32,
    id: u32,
}
impl PartialEq for Cand {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Cand {}
impl PartialOrd for Cand {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Cand {
    fn cmp(&self, o: &Self) -> Ordering {
        o.l.total_cmp(&self.l).then(self.id.cmp(&o.id))
    }
}

/// `exp(x)` for weights (`x ≤ 0`), the same on every platform: IEEE f32 `+`, `*` (Rust never
/// fuses them) and exponent bits, so a device kernel can reproduce it exactly (without FMA
/// contraction) and the compiler can vectorise it (libm's `expf` does neither). Range reduction `x = k·ln 2 + r`, k
/// rounded to nearest by adding 1.5·2^23, |r| ≤ ½ ln 2 with ln 2 split in two (Cody–Waite),
/// then the Cephes `expf` polynomial; relative error < 1e-7 (tested). `x < -87` (so -inf and
/// NaN too) gives 0; `x > 0` is taken as 0.
#[inline]
pub fn exp_weight(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const SHIFT: f32 = 12_582_912.0; // 1.5 · 2^23
    let xc = if x > -87.0 { x } else { -87.0 };
    let xc = if xc < 0.0 { xc } else { 0.0 };
    let s = xc * std::f32::consts::LOG2_E + SHIFT; // bits: 0x4B40_0000 + k
    let kf = s - SHIFT;
    let r = (xc - kf * LN2_HI) - kf * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * (r * r) + r + 1.0;
    // k in [-126, 0]: 2^k is a normal number.
    let two_k = f32::from_bits(s.to_bits().wrapping_sub(0x4B40_0000).wrapping_add(127) << 23);
    let w = e * two_k;
    if x >= -87.0 {
        w
    } else {
        0.0
    }
}

/// Index of the largest logit, the first on ties, NaN ignored (0 if all are NaN).
pub fn argmax(logits: &[f32]) -> u32 {
    let (mut best, mut bv) = (0, f32::NEG_INFINITY);
    for (i, &x) in logits.iter().enumerate() {
        if x > bv {
            (best, bv) = (i, x);
        }
    }
    best as u32
}

/// The tokens left after truncation: every id with its weight `w_i` in `dense` (zeros
/// dropped), or the ids in `kept` (ascending) with their weights.
enum Kept {
    /// With Σ w, summed in id order.
    Dense(f64),
    Sparse,
}

/// Samples tokens for one sequence. See the module documentation for the steps.
pub struct Sampler {
    params: SamplingParams,
    vocab: usize,
    seed: u64,
    rng: Rng,
    /// Penalty counts per id; all zero between calls (only touched entries are reset).
    counts: Vec<u32>,
    /// Weights of the whole vocabulary (no top-k).
    dense: Vec<f32>,
    /// Kept (id, weight).
    kept: Vec<(u32, f32)>,
}

/// A penalty count's flag for a token of the prompt (the low bits count generated ones).
pub const SEEN: u32 = 1 << 31;

/// What a device sampler (cuda/sample.rs, wgpu/sample.rs) keeps of [`SamplingParams`]: the
/// parameters its kernels take, and the geometry of its two passes (a first pass of blocks of
/// `slice` logits each keeping its best `k`, then one block selecting from all of those).
#[derive(Clone, Debug)]
pub struct DevicePlan {
    pub vocab: usize,
    /// Candidates kept per slice and in the end: `top_k`, or 1 when greedy.
    pub k: usize,
    pub slice: usize,
    pub greedy: bool,
    /// Whether any penalty is on (the kernels then keep counts).
    pub penalties: bool,
    pub temperature: f32,
    pub top_p: f32,
    pub min_p: f32,
    pub rep: f32,
    pub pres: f32,
    pub freq: f32,
}

impl DevicePlan {
    /// The plan for `p` over `vocab` logits, or `None` where the kernels do not cover `p`: top-k
    /// off or above `kmax` (the full-vocabulary path is the host's), or more first-pass
    /// candidates than the finishing block holds (`cands`). Greedy is top-k 1.
    pub fn new(
        p: &SamplingParams,
        vocab: usize,
        kmax: usize,
        slice: usize,
        cands: usize,
    ) -> Result<Option<Self>> {
        p.validate()?;
        if vocab == 0 {
            bail!("new_sampler: empty vocabulary");
        }
        let greedy = p.is_greedy();
        let k = if greedy { 1 } else { p.top_k };
        if k == 0 || k > kmax || (!greedy && k >= vocab) || vocab.div_ceil(slice) * k > cands {
            return Ok(None);
        }
        Ok(Some(Self {
            vocab,
            k,
            slice,
            greedy,
            penalties: p.repetition_penalty != 1.0
                || p.presence_penalty != 0.0
                || p.frequency_penalty != 0.0,
            temperature: p.temperature,
            top_p: p.top_p,
            min_p: p.min_p,
            rep: p.repetition_penalty,
            pres: p.presence_penalty,
            freq: p.frequency_penalty,
        }))
    }

    /// First-pass blocks.
    pub fn blocks(&self) -> usize {
        self.vocab.div_ceil(self.slice)
    }

    /// The penalty counts a sampler starts from ([`SEEN`] on each prompt token), when a
    /// penalty is on.
    pub fn counts(&self, prompt: &[u32]) -> Option<Vec<u32>> {
        self.penalties.then(|| {
            let mut c = vec![0u32; self.vocab];
            for &t in prompt {
                if (t as usize) < self.vocab {
                    c[t as usize] |= SEEN;
                }
            }
            c
        })
    }
}

impl Sampler {
    /// A sampler for logits of length `vocab`; validates `params`.
    pub fn new(params: SamplingParams, vocab: usize) -> Result<Self> {
        params.validate()?;
        let seed = params.seed.unwrap_or_else(entropy_seed);
        Ok(Self {
            params,
            vocab,
            seed,
            rng: Rng::splitmix(seed),
            counts: Vec::new(),
            dense: Vec::new(),
            kept: Vec::new(),
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The seed in use (the drawn one when the parameters had none).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The next token. `logits` (length `vocab`) get the penalties applied in place; every
    /// penalty counts the tokens of `history` (pass the generated tokens for OpenAI semantics,
    /// or use [`Self::sample_split`]). Ids ≥ vocab in the history are ignored.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        self.sample_split(logits, &[], history)
    }

    /// As [`Self::sample`], with vLLM's split: the repetition penalty sees `prompt` and
    /// `generated`, presence and frequency penalties only `generated`.
    pub fn sample_split(&mut self, logits: &mut [f32], prompt: &[u32], generated: &[u32]) -> u32 {
        self.penalise(logits, prompt, generated);
        if self.params.is_greedy() {
            return argmax(logits);
        }
        match self.truncate(logits) {
            None => argmax(logits),
            Some(k) => self.draw(k),
        }
    }

    /// The distribution [`Self::sample`] draws from: (id, probability) in id order; one entry
    /// of probability 1 when greedy. Applies the penalties to `logits` as `sample` does; draws
    /// nothing.
    pub fn distribution(&mut self, logits: &mut [f32], history: &[u32]) -> Vec<(u32, f64)> {
        self.penalise(logits, &[], history);
        let k = if self.params.is_greedy() {
            None
        } else {
            self.truncate(logits)
        };
        let pairs: Vec<(u32, f32)> = match k {
            None => return vec![(argmax(logits), 1.0)],
            Some(Kept::Dense(_)) => self
                .dense
                .iter()
                .enumerate()
                .filter(|(_, &w)| w > 0.0)
                .map(|(i, &w)| (i as u32, w))
                .collect(),
            Some(Kept::Sparse) => self
                .kept
                .iter()
                .copied()
                .filter(|&(_, w)| w > 0.0)
                .collect(),
        };
        let total: f64 = pairs.iter().map(|&(_, w)| w as f64).sum();
        pairs
            .into_iter()
            .map(|(i, w)| (i, w as f64 / total))
            .collect()
    }

    /// Steps 1–2. O(len(prompt) + len(generated)); a vocab-sized count table is allocated on
    /// first use and left zeroed.
    fn penalise(&mut self, logits: &mut [f32], prompt: &[u32], generated: &[u32]) {
        assert_eq!(
            logits.len(),
            self.vocab,
            "sampler: {} logits for a vocabulary of {}",
            logits.len(),
            self.vocab
        );
        let p = &self.params;
        let (rep, pres, freq) = (
            p.repetition_penalty,
            p.presence_penalty,
            p.frequency_penalty,
        );
        if rep == 1.0 && pres == 0.0 && freq == 0.0 {
            return;
        }
        let rep_prompt = rep != 1.0 && !prompt.is_empty();
        if generated.is_empty() && !rep_prompt {
            return;
        }
        if self.counts.len() != self.vocab {
            self.counts = vec![0; self.vocab];
        }
        let v = self.vocab;
        for &t in generated {
            if (t as usize) < v {
                self.counts[t as usize] += 1;
            }
        }
        if rep_prompt {
            for &t in prompt {
                if (t as usize) < v {
                    self.counts[t as usize] |= SEEN;
                }
            }
        }
        let prompt = if rep_prompt { prompt } else { &[] };
        for &t in generated.iter().chain(prompt) {
            let t = t as usize;
            if t >= v || self.counts[t] == 0 {
                continue;
            }
            let c = (self.counts[t] & !SEEN) as f32;
            self.counts[t] = 0;
            let l = &mut logits[t];
            if rep != 1.0 {
                *l = if *l > 0.0 { *l / rep } else { *l * rep };
            }
            if c > 0.0 {
                *l -= pres + freq * c;
            }
        }
    }

    /// Steps 4–7. `None` when no finite best logit exists (the caller takes the arg-max).
    fn truncate(&mut self, logits: &[f32]) -> Option<Kept> {
        let p = self.params.clone();
        let t = p.temperature;
        let v = logits.len();
        let top_k = if p.top_k >= v { 0 } else { p.top_k };
        self.kept.clear();
        if top_k > 0 {
            // Step 5: bounded heap holding the k best, worst on top.
            let mut heap = BinaryHeap::with_capacity(top_k);
            let mut worst = f32::NEG_INFINITY; // logit of the heap's top once full
            for (i, &l) in logits.iter().enumerate() {
                // Quick reject (also drops NaN); equal logits lose to the lower id already in.
                if l.partial_cmp(&worst) != Some(Ordering::Greater)
                    && (heap.len() == top_k || l.is_nan())
                {
                    continue;
                }
                let c = Cand { l, id: i as u32 };
                if heap.len() < top_k {
                    heap.push(c);
                } else {
                    *heap.peek_mut().unwrap() = c;
                }
                if heap.len() == top_k {
                    worst = heap.peek().unwrap().l;
                }
            }
            let top = heap.into_sorted_vec(); // best first
            let m = top.first()?.l;
            if !m.is_finite() {
                return None;
            }
            // Step 4 on the k survivors.
            self.kept
                .extend(top.iter().map(|c| (c.id, exp_weight((c.l - m) / t))));
            // Step 6.
            if p.top_p < 1.0 {
                self.kept.sort_unstable_by(by_weight);
                let target = p.top_p as f64 * self.kept.iter().map(|&(_, w)| w as f64).sum::<f64>();
                let mut cum = 0.0;
                let n = self.kept.iter().position(|&(_, w)| {
                    cum += w as f64;
                    cum >= target
                });
                self.kept.truncate(n.map_or(self.kept.len(), |n| n + 1));
            }
            // Step 7 (the best token has w = 1 and always stays).
            if p.min_p > 0.0 {
                self.kept.retain(|&(_, w)| w >= p.min_p);
            }
            self.kept.sort_unstable_by_key(|&(i, _)| i);
            return Some(Kept::Sparse);
        }

        // No top-k: weights of the whole vocabulary (step 4).
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max); // NaN ignored
        if !m.is_finite() {
            return None;
        }
        self.dense.resize(v, 0.0);
        for (w, &l) in self.dense.iter_mut().zip(logits) {
            *w = exp_weight((l - m) / t);
        }
        let mut z = sum(&self.dense);
        if p.top_p < 1.0 {
            // Step 6 through a histogram of the weights: positive floats order like their bits,
            // so `(bits(1) - bits(w)) >> 20` is a bin of 1/8 octave, larger weights first. Find
            // the bin where the cumulative mass crosses top_p · Z; better bins are kept whole
            // and only that bin's tokens are sorted, to find the last token of the nucleus.
            let bin = |w: f32| {
                ((1.0f32.to_bits().saturating_sub(w.to_bits()) >> 20) as usize).min(BINS - 1)
            };
            let mut hist = vec![0.0f64; BINS];
            for &w in &self.dense {
                hist[bin(w)] += w as f64;
            }
            let target = p.top_p as f64 * z;
            let (mut cum, mut cut_bin) = (0.0, BINS - 1);
            for (b, &h) in hist.iter().enumerate() {
                if cum + h >= target {
                    cut_bin = b;
                    break;
                }
                cum += h;
            }
            self.kept.extend(
                self.dense
                    .iter()
                    .enumerate()
                    .filter(|&(_, &w)| w > 0.0 && bin(w) == cut_bin)
                    .map(|(i, &w)| (i as u32, w)),
            );
            self.kept.sort_unstable_by(by_weight);
            // (Empty only if rounding kept the total short of the target: keep all.)
            if let Some(&(mut ic, mut wc)) = self.kept.last() {
                for &(i, w) in &self.kept {
                    cum += w as f64;
                    (ic, wc) = (i, w);
                    if cum >= target {
                        break;
                    }
                }
                // Keep the tokens up to and including (wc, ic) in (weight desc, id asc) order.
                for (i, w) in self.dense.iter_mut().enumerate() {
                    let keep = (*w > wc) | ((*w == wc) & (i as u32 <= ic)); // branch-free
                    *w = if keep { *w } else { 0.0 };
                }
                z = sum(&self.dense);
            }
            self.kept.clear();
        }
        // Step 7.
        if p.min_p > 0.0 {
            for w in &mut self.dense {
                *w = if *w >= p.min_p { *w } else { 0.0 };
            }
            z = sum(&self.dense);
        }
        Some(Kept::Dense(z))
    }

    /// Step 8.
    fn draw(&mut self, k: Kept) -> u32 {
        let u = self.rng.next_f64();
        let pick = |it: &mut dyn Iterator<Item = (u32, f32)>, total: f64| {
            let r = u * total;
            let mut acc = 0.0f64;
            let mut last = 0;
            for (i, w) in it {
                if w > 0.0 {
                    acc += w as f64;
                    last = i;
                    if acc > r {
                        return i;
                    }
                }
            }
            last
        };
        match k {
            Kept::Dense(total) => pick(
                &mut self.dense.iter().enumerate().map(|(i, &w)| (i as u32, w)),
                total,
            ),
            Kept::Sparse => {
                let total: f64 = self.kept.iter().map(|&(_, w)| w as f64).sum();
                pick(&mut self.kept.iter().copied(), total)
            }
        }
    }
}

/// The `k` most likely ids with their log-probabilities, and log Σ exp(logits) (f64).
pub fn top_logprobs(logits: &[f32], k: usize) -> (Vec<(u32, f32)>, f64) {
    let max = logits
        .iter()
        .copied()
        .filter(|x| !x.is_nan())
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits
        .iter()
        .filter(|x| !x.is_nan())
        .map(|&x| (x as f64 - max).exp())
        .sum();
    let lse = max + sum.ln();
    // Partial selection: keep the k best in a small sorted list (k ≤ 20).
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        for (i, &x) in logits.iter().enumerate() {
            if x.is_nan() || (top.len() == k && x <= top[k - 1].1) {
                continue;
            }
            let at = top.partition_point(|&(_, y)| y >= x);
            top.insert(at, (i as u32, x));
            top.truncate(k);
        }
    }
    (
        top.into_iter()
            .map(|(i, x)| (i, (x as f64 - lse) as f32))
            .collect(),
        lse,
    )
}

/// `token`'s log-probability under the raw `logits` and the `n` most likely `(id, logprob)`
/// ([`top_logprobs`]): what a response reports per token (`Backend::logprobs`).
pub fn token_logprobs(logits: &[f32], token: u32, n: usize) -> (f32, Vec<(u32, f32)>) {
    let (top, lse) = top_logprobs(logits, n);
    (
        logits
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |&x| (x as f64 - lse) as f32),
        top,
    )
}

/// Σ w in f64, in index order (the order the draw walks).
fn sum(w: &[f32]) -> f64 {
    w.iter().map(|&x| x as f64).sum()
}

/// Top-p order: weight descending, then id ascending.
fn by_weight(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampling(t: f32) -> SamplingParams {
        SamplingParams {
            temperature: t,
            ..Default::default()
        }
    }

    fn softmax(l: &[f32], t: f32) -> Vec<f64> {
        let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let e: Vec<f64> = l
            .iter()
            .map(|&x| ((x as f64 - m) / t as f64).exp())
            .collect();
        let z: f64 = e.iter().sum();
        e.iter().map(|x| x / z).collect()
    }

    /// Pseudo-random logits in [-scale, scale].
    fn logits(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut r = Rng::splitmix(seed);
        (0..n)
            .map(|_| (r.next_f64() as f32 * 2.0 - 1.0) * scale)
            .collect()
    }

    fn sample_once(p: SamplingParams, l: &[f32], hist: &[u32]) -> u32 {
        let mut s = Sampler::new(p, l.len()).unwrap();
        s.sample(&mut l.to_vec(), hist)
    }

    #[test]
    fn top_logprobs_are_sorted_log_softmax() {
        let l = [1.0f32, 3.0, 2.0, 3.0, f32::NAN, -1.0];
        let (top, lse) = top_logprobs(&l, 3);
        let z: f64 = [1.0f64, 3.0, 2.0, 3.0, -1.0].iter().map(|x| x.exp()).sum();
        assert!((lse - z.ln()).abs() < 1e-9);
        // Ties keep id order; NaN is skipped.
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3, 2]);
        assert!((top[0].1 as f64 - (3.0 - z.ln())).abs() < 1e-6);
        assert!(top.windows(2).all(|w| w[0].1 >= w[1].1));
        assert!(top_logprobs(&l, 0).0.is_empty());
    }

    #[test]
    fn exp_weight_accuracy() {
        let mut worst = 0.0f64;
        for i in 0..=2_000_000 {
            let x = -87.0 * i as f32 / 2_000_000.0;
            let (got, want) = (exp_weight(x) as f64, (x as f64).exp());
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 2e-7, "max relative error {worst}");
        assert_eq!(exp_weight(0.0), 1.0);
        assert_eq!(exp_weight(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_weight(f32::NAN), 0.0);
        assert_eq!(exp_weight(-100.0), 0.0);
    }

    #[test]
    fn greedy_is_argmax_first_on_ties() {
        let l = [0.1, 3.0, -1.0, 3.0, 2.9];
        assert_eq!(sample_once(SamplingParams::default(), &l, &[]), 1);
        assert_eq!(sample_once(sampling(1e-6), &l, &[]), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0, 2.0, f32::NAN]), 2);
        let big = logits(1000, 7, 5.0);
        let want = argmax(&big);
        let mut s = Sampler::new(SamplingParams::greedy(), 1000).unwrap();
        for _ in 0..5 {
            assert_eq!(s.sample(&mut big.clone(), &[]), want);
        }
    }

    #[test]
    fn seed_reproducible_and_seeds_differ() {
        let l = logits(500, 1, 2.0);
        let run = |seed| {
            let p = SamplingParams {
                temperature: 1.0,
                top_k: 50,
                top_p: 0.9,
                seed: Some(seed),
                ..Default::default()
            };
            let mut s = Sampler::new(p, l.len()).unwrap();
            (0..64)
                .map(|_| s.sample(&mut l.clone(), &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
        // The stream is fixed across platforms: the first draw for seed 0 is pinned.
        let mut r = Rng::splitmix(0);
        assert_eq!(r.next_u64(), 0x53175d61490b23df);
        // Unseeded samplers get distinct, reported seeds.
        let a = Sampler::new(sampling(1.0), 4).unwrap();
        let b = Sampler::new(sampling(1.0), 4).unwrap();
        assert_ne!(a.seed(), b.seed());
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        for seed in 0..20 {
            let l = logits(300, seed, 3.0);
            let want = argmax(&l);
            let k1 = SamplingParams {
                temperature: 5.0,
                top_k: 1,
                seed: Some(seed),
                ..Default::default()
            };
            assert_eq!(sample_once(k1, &l, &[]), want);
            let p0 = SamplingParams {
                temperature: 5.0,
                top_p: 1e-6,
                seed: Some(seed),
                ..Default::default()
            };
            assert_eq!(sample_once(p0.clone(), &l, &[]), want);
            let p0k = SamplingParams { top_k: 40, ..p0 };
            assert_eq!(sample_once(p0k, &l, &[]), want);
        }
    }

    #[test]
    fn top_k_keeps_k_best() {
        let l = [1.0, 5.0, 3.0, 4.0, 2.0, 4.0];
        let mut s = Sampler::new(
            SamplingParams {
                temperature: 1.0,
                top_k: 3,
                ..Default::default()
            },
            6,
        )
        .unwrap();
        let d = s.distribution(&mut l.to_vec(), &[]);
        // 5, 4, 4: the tie at 4 keeps both (ids 3 and 5); the third best is id 3 or 5 by id order.
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3, 5]);
        let want = softmax(&[5.0, 4.0, 4.0], 1.0);
        for (x, w) in d.iter().zip(want) {
            assert!((x.1 - w).abs() < 1e-6);
        }
        let mut s = Sampler::new(
            SamplingParams {
                temperature: 1.0,
                top_k: 2,
                ..Default::default()
            },
            6,
        )
        .unwrap();
        let d = s.distribution(&mut l.to_vec(), &[]);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3]);
    }

    #[test]
    fn top_p_nucleus() {
        // Probabilities 0.5, 0.25, 0.125, 0.125 (logits = ln p).
        // A fifth token of weight 0 lets top_k 4 take the heap path (top_k < vocab).
        let l: Vec<f32> = [0.5f32, 0.25, 0.125, 0.125, 0.0]
            .iter()
            .map(|p| p.ln())
            .collect();
        for (top_p, n) in [
            (0.49, 1),
            (0.51, 2),
            (0.74, 2),
            (0.8, 3),
            (0.9, 4),
            (1.0, 4),
        ] {
            for top_k in [0, 4] {
                let p = SamplingParams {
                    temperature: 1.0,
                    top_p,
                    top_k,
                    ..Default::default()
                };
                let d = Sampler::new(p, 5)
                    .unwrap()
                    .distribution(&mut l.clone(), &[]);
                assert_eq!(d.len(), n, "top_p {top_p} top_k {top_k}");
            }
        }
    }

    #[test]
    fn top_p_ties_keep_lowest_ids() {
        // Ten equal logits (one bin) plus a masked token: top_p 0.5 keeps ids 0..5 on both paths.
        let mut l = vec![0.25f32; 11];
        l[10] = f32::NEG_INFINITY;
        for top_k in [0, 10] {
            let p = SamplingParams {
                temperature: 0.8,
                top_p: 0.5,
                top_k,
                ..Default::default()
            };
            let d = Sampler::new(p, 11)
                .unwrap()
                .distribution(&mut l.clone(), &[]);
            assert_eq!(
                d.iter().map(|x| x.0).collect::<Vec<_>>(),
                vec![0, 1, 2, 3, 4],
                "top_k {top_k}"
            );
            assert!(d.iter().all(|x| (x.1 - 0.2).abs() < 1e-9));
        }
    }

    #[test]
    fn min_p_drops_below_fraction_of_max() {
        // p ∝ 1, 0.5, 0.2, 0.05: min_p 0.25 keeps the first two.
        let l: Vec<f32> = [1.0f32, 0.5, 0.2, 0.05].iter().map(|p| p.ln()).collect();
        for (top_k, top_p) in [(0, 1.0), (0, 0.99), (3, 1.0)] {
            let p = SamplingParams {
                temperature: 1.0,
                min_p: 0.25,
                top_k,
                top_p,
                ..Default::default()
            };
            let d = Sampler::new(p, 4)
                .unwrap()
                .distribution(&mut l.clone(), &[]);
            assert_eq!(
                d.iter().map(|x| x.0).collect::<Vec<_>>(),
                vec![0, 1],
                "top_k {top_k} top_p {top_p}"
            );
            assert!((d[0].1 - 2.0 / 3.0).abs() < 1e-6);
        }
        // min_p 1 is greedy.
        let p = SamplingParams {
            temperature: 1.0,
            min_p: 1.0,
            ..Default::default()
        };
        assert_eq!(
            Sampler::new(p, 4)
                .unwrap()
                .distribution(&mut l.clone(), &[]),
            vec![(0, 1.0)]
        );
    }

    /// The truncation against a brute-force reference (full sort, the documented definition)
    /// on random logits, for every path (heap / histogram, with and without min-p).
    #[test]
    fn truncation_matches_reference() {
        for seed in 0..40u64 {
            let n = 2000;
            let l = logits(n, seed, 1.0 + seed as f32);
            for &(t, top_k, top_p, min_p) in &[
                (1.0, 0, 0.9, 0.0),
                (0.7, 0, 0.5, 0.0),
                (1.3, 50, 0.95, 0.0),
                (1.0, 0, 0.95, 0.05),
                (2.0, 500, 0.8, 0.01),
                (0.5, 0, 1.0, 0.1),
            ] {
                let p = SamplingParams {
                    temperature: t,
                    top_k,
                    top_p,
                    min_p,
                    ..Default::default()
                };
                let got: Vec<u32> = Sampler::new(p, n)
                    .unwrap()
                    .distribution(&mut l.clone(), &[])
                    .iter()
                    .map(|x| x.0)
                    .collect();
                let mut order: Vec<u32> = (0..n as u32).collect();
                order.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]).then(a.cmp(&b)));
                if top_k > 0 {
                    order.truncate(top_k);
                }
                let probs = softmax(&order.iter().map(|&i| l[i as usize]).collect::<Vec<_>>(), t);
                let mut cum = 0.0;
                let mut keep = vec![];
                for (&i, &q) in order.iter().zip(&probs) {
                    if q >= min_p as f64 * probs[0] * (1.0 - 1e-6) {
                        keep.push(i);
                    }
                    cum += q;
                    if cum >= top_p as f64 - 1e-9 {
                        break;
                    }
                }
                keep.sort();
                assert_eq!(
                    got, keep,
                    "seed {seed} t {t} top_k {top_k} top_p {top_p} min_p {min_p}"
                );
            }
        }
    }

    #[test]
    fn repetition_penalty() {
        // Token 0 (positive) is divided, token 2 (negative) multiplied.
        let mut l = vec![2.0, 1.5, -1.0, -1.5];
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        let mut s = Sampler::new(p, 4).unwrap();
        assert_eq!(s.sample(&mut l, &[0, 2, 0]), 1);
        assert_eq!(l, vec![1.0, 1.5, -2.0, -1.5]);
        // The split form applies it to prompt tokens too.
        let mut l = vec![2.0, 1.5, -1.0, -1.5];
        assert_eq!(s.sample_split(&mut l, &[0], &[2]), 1);
        assert_eq!(l, vec![1.0, 1.5, -2.0, -1.5]);
        // Counts are reset between calls: no history, no penalty.
        let mut l = vec![2.0, 1.5, -1.0, -1.5];
        assert_eq!(s.sample(&mut l, &[]), 0);
        assert_eq!(l, vec![2.0, 1.5, -1.0, -1.5]);
    }

    #[test]
    fn presence_and_frequency_penalties() {
        let base = vec![3.0, 2.5, 2.1, 0.0];
        let hist = [0, 0, 0, 1];
        let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-5);
        // Presence: -1 once for each seen token.
        let mut l = base.clone();
        let mut s = Sampler::new(
            SamplingParams {
                presence_penalty: 1.0,
                ..Default::default()
            },
            4,
        )
        .unwrap();
        assert_eq!(s.sample(&mut l, &hist), 2);
        assert!(close(&l, &[2.0, 1.5, 2.1, 0.0]), "{l:?}");
        // Frequency: -0.3 per occurrence (presence 0.3 would keep token 0 first).
        let mut l = base.clone();
        let mut s = Sampler::new(
            SamplingParams {
                frequency_penalty: 0.3,
                ..Default::default()
            },
            4,
        )
        .unwrap();
        assert_eq!(s.sample(&mut l, &hist), 1);
        assert!(close(&l, &[2.1, 2.2, 2.1, 0.0]), "{l:?}");
        // Negative presence encourages repetition.
        let mut l = vec![1.0, 0.5, 0.2, 0.8];
        let mut s = Sampler::new(
            SamplingParams {
                presence_penalty: -1.0,
                ..Default::default()
            },
            4,
        )
        .unwrap();
        assert_eq!(s.sample(&mut l, &[3]), 3);
        // vLLM split: presence/frequency ignore the prompt.
        let mut l = base.clone();
        let mut s = Sampler::new(
            SamplingParams {
                presence_penalty: 1.0,
                ..Default::default()
            },
            4,
        )
        .unwrap();
        assert_eq!(s.sample_split(&mut l, &[0, 1], &[]), 0);
        assert_eq!(l, base);
        // Out-of-range ids are ignored.
        let mut l = base.clone();
        s.sample(&mut l, &[99]);
        assert_eq!(l, base);
    }

    /// 20,000 draws at temperature 1 over 8 tokens against the softmax. The standard error of
    /// each frequency is ≤ sqrt(0.25 / 20000) ≈ 0.0035, so 0.015 is > 4 sigma; chi-square with 7
    /// degrees of freedom has its 0.1 % critical value at 24.3. The seed is fixed, so the test
    /// is deterministic; the bounds say a correct sampler passes for almost any seed.
    #[test]
    fn frequencies_match_softmax() {
        let l = [1.0f32, 0.0, -1.0, 2.0, 0.5, -0.5, 1.5, -2.0];
        let n = 20_000;
        let want = softmax(&l, 1.0);
        // Plain, and through the top-p histogram path with a top_p that keeps every token
        // (the smallest probability is 0.0087 > 1 - 0.999).
        for top_p in [1.0, 0.999] {
            let mut s = Sampler::new(
                SamplingParams {
                    temperature: 1.0,
                    top_p,
                    seed: Some(123),
                    ..Default::default()
                },
                8,
            )
            .unwrap();
            let mut count = [0usize; 8];
            for _ in 0..n {
                count[s.sample(&mut l.to_vec(), &[]) as usize] += 1;
            }
            let mut chi2 = 0.0;
            for i in 0..8 {
                let f = count[i] as f64 / n as f64;
                assert!(
                    (f - want[i]).abs() <= 0.015,
                    "token {i}: {f} vs {}",
                    want[i]
                );
                let e = want[i] * n as f64;
                chi2 += (count[i] as f64 - e).powi(2) / e;
            }
            assert!(chi2 < 24.3, "chi2 {chi2}");
        }
        // Temperature 2 with top-k 4: the renormalised softmax of the 4 best at T=2.
        let mut s = Sampler::new(
            SamplingParams {
                temperature: 2.0,
                top_k: 4,
                seed: Some(9),
                ..Default::default()
            },
            8,
        )
        .unwrap();
        let best = [3usize, 6, 0, 4];
        let want = softmax(&best.map(|i| l[i]), 2.0);
        let mut count = [0usize; 8];
        for _ in 0..n {
            count[s.sample(&mut l.to_vec(), &[]) as usize] += 1;
        }
        for (j, &i) in best.iter().enumerate() {
            assert!((count[i] as f64 / n as f64 - want[j]).abs() <= 0.015);
        }
        assert_eq!(
            count.iter().sum::<usize>(),
            best.iter().map(|&i| count[i]).sum::<usize>()
        );
    }

    #[test]
    fn validation() {
        let ok = SamplingParams::default();
        assert!(ok.validate().is_ok());
        let bad = [
            (
                SamplingParams {
                    temperature: -0.1,
                    ..ok.clone()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..ok.clone()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::INFINITY,
                    ..ok.clone()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..ok.clone()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_p: 1.01,
                    ..ok.clone()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    min_p: -0.1,
                    ..ok.clone()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    min_p: f32::NAN,
                    ..ok.clone()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..ok.clone()
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    presence_penalty: 2.5,
                    ..ok.clone()
                },
                "presence_penalty",
            ),
            (
                SamplingParams {
                    frequency_penalty: f32::NAN,
                    ..ok.clone()
                },
                "frequency_penalty",
            ),
        ];
        for (p, field) in bad {
            let e = p.validate().unwrap_err().to_string();
            assert!(e.starts_with(field), "{e}");
            assert!(Sampler::new(p, 4).is_err());
        }
    }

    #[test]
    fn generation_config_and_overrides() {
        let dir = tempfile::tempdir().unwrap();
        // No file: greedy.
        assert_eq!(
            SamplingParams::from_generation_config(dir.path()).unwrap(),
            SamplingParams::default()
        );
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"bos_token_id": 1, "do_sample": true, "eos_token_id": [2, 3], "temperature": 1.0, "top_k": 20, "top_p": 0.95}"#,
        )
        .unwrap();
        let g = SamplingParams::from_generation_config(dir.path()).unwrap();
        let want = SamplingParams {
            temperature: 1.0,
            top_k: 20,
            top_p: 0.95,
            ..Default::default()
        };
        assert_eq!(g, want);
        // Missing fields are neutral; do_sample false is greedy; bad values are errors.
        let j = |s: &str| {
            SamplingParams::from_generation_config_json(&serde_json::from_str(s).unwrap())
        };
        assert_eq!(
            j("{}").unwrap(),
            SamplingParams {
                temperature: 1.0,
                ..Default::default()
            }
        );
        assert!(j(r#"{"do_sample": false, "temperature": 0.7}"#)
            .unwrap()
            .is_greedy());
        assert_eq!(
            j(r#"{"top_k": -1, "min_p": 0.05, "repetition_penalty": 1.1}"#)
                .unwrap()
                .top_k,
            0
        );
        assert!(j(r#"{"top_p": 0}"#)
            .unwrap_err()
            .to_string()
            .contains("top_p"));
        assert!(j(r#"{"temperature": "hot"}"#)
            .unwrap_err()
            .to_string()
            .contains("temperature"));
        // Overrides from a request body.
        let o: SamplingOverrides = serde_json::from_str(
            r#"{"temperature": 0.6, "top_k": -1, "seed": 7, "presence_penalty": 1.5}"#,
        )
        .unwrap();
        let m = g.with_overrides(&o).unwrap();
        assert_eq!(
            m,
            SamplingParams {
                temperature: 0.6,
                top_k: 0,
                top_p: 0.95,
                presence_penalty: 1.5,
                seed: Some(7),
                ..Default::default()
            }
        );
        assert_eq!(g.with_overrides(&SamplingOverrides::default()).unwrap(), g);
        let o = SamplingOverrides {
            top_k: Some(-2),
            ..Default::default()
        };
        assert!(g
            .with_overrides(&o)
            .unwrap_err()
            .to_string()
            .contains("top_k"));
        let o = SamplingOverrides {
            top_p: Some(2.0),
            ..Default::default()
        };
        assert!(g
            .with_overrides(&o)
            .unwrap_err()
            .to_string()
            .contains("top_p"));
    }

    #[test]
    fn degenerate_logits() {
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            seed: Some(1),
            ..Default::default()
        };
        let mut s = Sampler::new(p, 4).unwrap();
        assert_eq!(s.sample(&mut [f32::NEG_INFINITY; 4], &[]), 0);
        assert_eq!(s.sample(&mut [f32::NAN; 4], &[]), 0);
        assert_eq!(
            s.sample(&mut [0.0, f32::INFINITY, 1.0, f32::INFINITY], &[]),
            1
        );
        // Masked (-inf) and NaN tokens are never drawn.
        for _ in 0..200 {
            let t = s.sample(&mut [f32::NEG_INFINITY, 0.0, f32::NAN, 0.0], &[]);
            assert!(t == 1 || t == 3);
        }
    }

    /// Speed on the real vocabulary size (248,320). Prints µs per sample per configuration.
    #[test]
    fn speed_full_vocab() {
        let v = 248_320;
        let l = logits(v, 3, 8.0);
        let hist: Vec<u32> = (0..2000u32).map(|i| (i * 7919) % v as u32).collect();
        let configs = [
            ("greedy", SamplingParams::default()),
            (
                "T=1",
                SamplingParams {
                    temperature: 1.0,
                    ..Default::default()
                },
            ),
            (
                "qwen T=1 k=20 p=.95",
                SamplingParams {
                    temperature: 1.0,
                    top_k: 20,
                    top_p: 0.95,
                    ..Default::default()
                },
            ),
            (
                "T=1 p=.95",
                SamplingParams {
                    temperature: 1.0,
                    top_p: 0.95,
                    ..Default::default()
                },
            ),
            (
                "T=1 p=.95 min_p=.05",
                SamplingParams {
                    temperature: 1.0,
                    top_p: 0.95,
                    min_p: 0.05,
                    ..Default::default()
                },
            ),
            (
                "k=20 + penalties (2000 hist)",
                SamplingParams {
                    temperature: 1.0,
                    top_k: 20,
                    presence_penalty: 1.5,
                    repetition_penalty: 1.1,
                    ..Default::default()
                },
            ),
        ];
        for (name, p) in configs {
            let mut s = Sampler::new(SamplingParams { seed: Some(5), ..p }, v).unwrap();
            // Best of 20 (the machine may be shared), logits copy excluded.
            let mut buf = l.clone();
            let mut best = f64::MAX;
            for _ in 0..20 {
                buf.copy_from_slice(&l);
                let t0 = std::time::Instant::now();
                std::hint::black_box(s.sample(&mut buf, &hist));
                best = best.min(t0.elapsed().as_secs_f64());
            }
            eprintln!(
                "sampler 248320 vocab, {name}: {:.0} µs/sample (best of 20)",
                best * 1e6
            );
        }
    }
}
