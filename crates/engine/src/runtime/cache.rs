//! Prefix cache: sessions that remember.
//!
//! An agent sends the whole conversation every call; only the new tokens should be prefilled.
//! Each cache entry is a [`SeqState`] with the token ids it holds and [`GdnSnapshot`]s of the
//! Gated DeltaNet state at chosen positions. For a new prompt:
//!
//! 1. **Find** the entry and position to resume from: the largest `p` that is at most the common
//!    prefix of the entry's ids and the prompt (and leaves at least one prompt token to feed,
//!    since the first new token needs logits) where the GDN state is known — a snapshot, or the
//!    entry's current position. Attention KV is valid at any `p` (rows past it are overwritten).
//! 2. **Take** it: in place (the entry leaves the cache and is cut back to `p`) when it belongs to
//!    the same conversation — same `prompt_cache_key`, or both without a key and `p` reaches the
//!    entry's last turn boundary (the new prompt continues its history) — else **fork** a copy at
//!    `p`, so one conversation never destroys another's entry.
//! 3. **Prefill** the rest in segments, snapshotting before every `<|im_start|>` (end of the
//!    system/tools block, each turn, just before the new assistant header), every
//!    `snapshot_every` tokens, and one token before the end of the prompt ([`prefill_plan`]).
//! 4. **Return** the state after generation (its position is prompt + the emitted tokens it was
//!    fed: all of them, or all but the last; generate.rs says when): the entry lists exactly
//!    those tokens, and its current position is the end of the generation. Entries are evicted least recently used first
//!    while the bytes held (KV at its capacity + recurrent state + snapshots, counted exactly)
//!    exceed the budget.
//!
//! Why snapshots before `<|im_start|>`: the Qwen3.6 template drops earlier reasoning from the
//! history unless `preserve_thinking` is set, so the next prompt equals this one up to the final
//! `<|im_start|>assistant\n`, then differs (the reasoning is gone). The snapshot before that
//! header is exactly where the next turn resumes; only the header, the answer without its
//! reasoning and the new user message are prefilled.

use anyhow::Result;

use crate::backend::{Backend, Dims};
use crate::model::state::GdnSnapshot;
use crate::model::{Logits, Qwen35, SeqState};
use crate::runtime::generate::{generate_ex, GenRequest, Generation, TokenEvent};
use crate::tokenizer::Tokenizer;

/// Cache settings.
#[derive(Clone, Debug)]
pub struct CacheConfig {
    /// Bytes the cache may hold (0: off, every request starts fresh).
    pub budget: usize,
    /// Snapshot every this many prompt tokens in long prefills.
    pub snapshot_every: usize,
    /// Turn-start token (`<|im_start|>`): snapshots go right before it.
    pub turn_start: Option<u32>,
}

/// Counters for `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub bytes: usize,
    pub entries: usize,
    pub snapshots: usize,
}

struct Entry<B: Backend> {
    key: Option<String>,
    /// Token ids the state holds (`ids.len() == state.pos`).
    ids: Vec<u32>,
    state: SeqState<B>,
    /// Ascending by position, all `< state.pos`.
    snaps: Vec<GdnSnapshot<B>>,
    /// Position of the last turn start of the last prompt (see the module docs).
    boundary: usize,
    last_used: u64,
}

/// A state taken from the cache for one request.
pub struct Lease<B: Backend> {
    pub state: SeqState<B>,
    /// Prompt tokens reused from the cache (the prefill starts after them).
    pub cached: usize,
    key: Option<String>,
    snaps: Vec<GdnSnapshot<B>>,
}

impl<B: Backend> Lease<B> {
    /// Takes a snapshot of the current position (prefill boundaries).
    pub fn snapshot(&mut self, m: &Qwen35<B>) -> Result<()> {
        if self.snaps.last().is_none_or(|s| s.pos < self.state.pos) && self.state.pos > 0 {
            self.snaps.push(self.state.snapshot(&m.backend, &m.dims)?);
        }
        Ok(())
    }

    pub fn snapshots(&self) -> impl Iterator<Item = usize> + '_ {
        self.snaps.iter().map(|s| s.pos)
    }
}

pub struct PrefixCache<B: Backend> {
    pub cfg: CacheConfig,
    entries: Vec<Entry<B>>,
    stats: CacheStats,
    clock: u64,
}

/// Common prefix length.
fn lcp(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl<B: Backend> Entry<B> {
    /// The best resume position for `prompt` (0: nothing usable).
    fn resume_point(&self, prompt: &[u32]) -> usize {
        let limit = lcp(&self.ids, prompt).min(prompt.len().saturating_sub(1));
        if self.state.pos <= limit {
            return self.state.pos;
        }
        self.snaps
            .iter()
            .rev()
            .map(|s| s.pos)
            .find(|&p| p <= limit)
            .unwrap_or(0)
    }

    fn nbytes(&self, d: &Dims) -> usize {
        self.state.nbytes(d) + self.snaps.iter().map(GdnSnapshot::nbytes).sum::<usize>()
    }
}

impl<B: Backend> PrefixCache<B> {
    pub fn new(cfg: CacheConfig) -> Self {
        Self {
            cfg,
            entries: Vec::new(),
            stats: CacheStats::default(),
            clock: 0,
        }
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// A state for `prompt`, resumed from the cache where possible (see the module docs).
    pub fn acquire(
        &mut self,
        m: &Qwen35<B>,
        prompt: &[u32],
        key: Option<&str>,
        max_context: usize,
    ) -> Result<Lease<B>> {
        let key = key.map(str::to_string);
        let best = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.resume_point(prompt), e.key == key, i))
            .filter(|&(p, _, _)| p > 0)
            .max_by_key(|&(p, same, _)| (p, same));
        let Some((p, _, i)) = best else {
            self.stats.misses += 1;
            return Ok(Lease {
                state: m.new_state(max_context)?,
                cached: 0,
                key,
                snaps: Vec::new(),
            });
        };
        self.stats.hits += 1;
        let e = &self.entries[i];
        let same_conversation = match (&e.key, &key) {
            (Some(a), Some(b)) => a == b,
            (None, None) => p >= e.boundary,
            _ => false,
        };
        let lease = if same_conversation {
            let mut e = self.entries.swap_remove(i);
            if p < e.state.pos {
                let at = e
                    .snaps
                    .iter()
                    .position(|s| s.pos == p)
                    .expect("resume point is a snapshot");
                e.state.restore(&m.backend, &m.dims, &e.snaps[at])?;
                e.snaps.truncate(at + 1);
            }
            // The state's max context is the server's, whatever it was when cached.
            e.state.max_context = max_context;
            Lease {
                state: e.state,
                cached: p,
                key,
                snaps: e.snaps,
            }
        } else {
            let mut st = if p == e.state.pos {
                let snap = e.state.snapshot(&m.backend, &m.dims)?;
                e.state.fork(&m.backend, &m.cfg, &snap)?
            } else {
                let snap = e
                    .snaps
                    .iter()
                    .find(|s| s.pos == p)
                    .expect("resume point is a snapshot");
                e.state.fork(&m.backend, &m.cfg, snap)?
            };
            st.max_context = max_context;
            self.entries[i].last_used = self.tick();
            Lease {
                state: st,
                cached: p,
                key,
                snaps: Vec::new(),
            }
        };
        self.refresh_bytes(&m.dims);
        Ok(lease)
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Puts a used state back: `ids` are the tokens it holds (prompt + fed generated tokens),
    /// `prompt` the request's prompt (for the turn boundary).
    pub fn release(&mut self, m: &Qwen35<B>, lease: Lease<B>, ids: Vec<u32>, prompt: &[u32]) {
        if self.cfg.budget == 0 || lease.state.pos == 0 || ids.len() != lease.state.pos {
            self.refresh_bytes(&m.dims);
            return;
        }
        let boundary = self
            .cfg
            .turn_start
            .and_then(|t| prompt.iter().rposition(|&x| x == t))
            .unwrap_or(0);
        let last_used = self.tick();
        let mut snaps = lease.snaps;
        snaps.retain(|s| s.pos < lease.state.pos);
        prune(&mut snaps, self.cfg.snapshot_every);
        // A keyed request replaces the older entry of its key (it was taken or forked from).
        if let Some(k) = &lease.key {
            self.entries.retain(|e| e.key.as_ref() != Some(k));
        }
        self.entries.push(Entry {
            key: lease.key,
            ids,
            state: lease.state,
            snaps,
            boundary,
            last_used,
        });
        self.evict(&m.dims);
    }

    /// LRU eviction down to the budget; the newest entry goes last, shedding its oldest
    /// snapshots before it goes entirely.
    fn evict(&mut self, d: &Dims) {
        loop {
            let total: usize = self.entries.iter().map(|e| e.nbytes(d)).sum();
            if total <= self.cfg.budget || self.entries.is_empty() {
                break;
            }
            if self.entries.len() > 1 {
                let (i, _) = self
                    .entries
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, e)| e.last_used)
                    .expect("non-empty");
                self.entries.swap_remove(i);
                self.stats.evictions += 1;
            } else if !self.entries[0].snaps.is_empty() {
                self.entries[0].snaps.remove(0);
            } else {
                self.entries.clear();
                self.stats.evictions += 1;
            }
        }
        self.refresh_bytes(d);
    }

    fn refresh_bytes(&mut self, d: &Dims) {
        self.stats.bytes = self.entries.iter().map(|e| e.nbytes(d)).sum();
        self.stats.entries = self.entries.len();
        self.stats.snapshots = self.entries.iter().map(|e| e.snaps.len()).sum();
    }
}

/// Snapshots an entry keeps: the first (the end of the system/tools block, shared by every
/// conversation with that prompt), the periodic ones (for edits deep in a long prompt), and the
/// last [`KEEP_RECENT`] (the next turn resumes before the last assistant header, or at the end).
/// Older turn boundaries are rarely a resume point and cost a full GDN state each (63 MiB on
/// the real model).
const KEEP_RECENT: usize = 3;

fn prune<B: Backend>(snaps: &mut Vec<GdnSnapshot<B>>, every: usize) {
    let n = snaps.len();
    let mut i = 0;
    snaps.retain(|s| {
        let keep = i == 0 || i + KEEP_RECENT >= n || (every > 0 && s.pos.is_multiple_of(every));
        i += 1;
        keep
    });
}

/// Positions (token counts) in `(cached, prompt.len() - 1]` where the prefill stops to take a
/// snapshot, ascending: before each turn start, every `every` tokens, and one before the end.
pub fn prefill_plan(
    prompt: &[u32],
    cached: usize,
    turn_start: Option<u32>,
    every: usize,
) -> Vec<usize> {
    let end = prompt.len().saturating_sub(1);
    let mut at: Vec<usize> = Vec::new();
    if let Some(t) = turn_start {
        at.extend((cached + 1..=end).filter(|&p| prompt[p] == t));
    }
    if let Some(first) = cached.checked_div(every) {
        at.extend((first + 1..).map(|k| k * every).take_while(|&p| p <= end));
    }
    if end > cached {
        at.push(end);
    }
    at.sort_unstable();
    at.dedup();
    at
}

/// Prefills `prompt[state.pos .. last planned stop]` with a snapshot at every planned stop;
/// afterwards `lease.state.pos` is where the generation loop takes over (it feeds the rest).
pub fn prefill_with_snapshots<B: Backend>(
    m: &Qwen35<B>,
    lease: &mut Lease<B>,
    prompt: &[u32],
    cfg: &CacheConfig,
) -> Result<()> {
    if cfg.budget == 0 {
        return Ok(());
    }
    for stop in prefill_plan(prompt, lease.state.pos, cfg.turn_start, cfg.snapshot_every) {
        let from = lease.state.pos;
        m.forward(&mut lease.state, &prompt[from..stop], Logits::None, None)?;
        lease.snapshot(m)?;
    }
    Ok(())
}

/// One generation through the cache: resume from the best cached state, prefill the rest with
/// snapshots, generate, put the state back. `req.cached` is ignored (the cache decides);
/// `started` gets the number of prompt tokens reused; the stats count the snapshot prefill as
/// prefill time.
#[allow(clippy::too_many_arguments)]
pub fn generate_cached<B: Backend>(
    m: &Qwen35<B>,
    cache: &mut PrefixCache<B>,
    tok: &Tokenizer,
    key: Option<&str>,
    max_context: usize,
    mut req: GenRequest<'_>,
    started: &mut dyn FnMut(usize),
    on_token: impl FnMut(TokenEvent<'_>) -> bool,
) -> Result<Generation> {
    let t0 = std::time::Instant::now();
    let prompt = req.prompt;
    let mut lease = cache.acquire(m, prompt, key, max_context)?;
    started(lease.cached);
    // Prefill up to the last snapshot point; the generation loop feeds the rest.
    prefill_with_snapshots(m, &mut lease, prompt, &cache.cfg)?;
    let before = t0.elapsed().as_secs_f64();
    req.cached = lease.state.pos;
    let mut g = generate_ex(m, &mut lease.state, tok, req, on_token)?;
    g.stats.cached_tokens = lease.cached;
    g.stats.prefill_s += before;
    g.stats.first_token_s += before;
    let held: Vec<u32> = prompt
        .iter()
        .chain(&g.ids)
        .copied()
        .take(lease.state.pos)
        .collect();
    cache.release(m, lease, held, prompt);
    Ok(g)
}

#[cfg(test)]
mod tests {
    use super::prefill_plan;

    #[test]
    fn plan_stops_before_turns_every_n_and_before_the_end() {
        // 9 = turn start.
        let p = [9, 1, 2, 9, 3, 4, 5, 9, 6, 7];
        assert_eq!(prefill_plan(&p, 0, Some(9), 0), vec![3, 7, 9]);
        assert_eq!(prefill_plan(&p, 3, Some(9), 4), vec![4, 7, 8, 9]);
        assert_eq!(prefill_plan(&p, 9, Some(9), 4), Vec::<usize>::new());
        assert_eq!(prefill_plan(&[5], 0, Some(9), 4), Vec::<usize>::new());
    }
}
