// attention.wgsl: the gated full-attention layer (cpu/attention.rs), f32 arithmetic. Layouts: qg
// [rows, heads, 2·hd] (query | gate per head, q_proj's output); q, gate, out [rows, heads·hd];
// k, v [rows, kv_heads·hd]; the KV cache kc, vc [capacity, kv_heads·hd] in the element type of
// the file prefixed to this one (attention.rs builds it twice): kv_f32.wgsl (f32) or kv_f16.wgsl
// (f16, two a u32 word), read and written only through its KV1 / KV4 words, kv1 / kv4 (widen to
// f32) and kv_word (round into a word of KV_PACK elements); every writer writes whole words. Query
// head h reads KV head h / (heads / kv_heads). A step buffer is u32 [token, pos]. The parameter
// block P and decode's AD_* constants are attn_params.wgsl's, prefixed as well.
//
// qk_norm_rope / qk_norm_rope_step (cpu `attn_qk_norm_rope`): one workgroup of 256 per (row,
//   head) over the heads then the KV heads: rows · (heads + kv_heads) workgroups. rms_norm of the
//   head's hd values (sum of squares by a tree in workgroup memory), times the norm weights, then
//   rotate-half RoPE on dims 0..rot, pairs (i, i + rot/2), at position pos0 + row (the _step
//   entry: the step's pos, one row). q heads read qg's first half into q and copy the second half
//   into gate; KV heads norm and rotate k in place. The angle pos · inv_freq(i) is exact: the host
//   gives each inv_freq(i) / 2π as a 64-bit fixed-point fraction of a turn (from f64, as the CPU
//   computes it), the shader multiplies by pos in integers (mod one turn), reduces to an octant and
//   evaluates sin/cos by polynomials on [-π/4, π/4]: no f64, no reliance on a GPU's sin at large
//   arguments. Bindings: 0 params (PR, with the turn table: 1056 bytes), 1 qg, 2 k, 3 q_norm,
//   4 k_norm, 5 q, 6 gate, (_step: 7 step).
//
// attn_rows (cpu `attention`, rows > 1; the k/v append is a buffer copy on the host side): one
//   workgroup of 256 per (row, head), rows · heads workgroups; row t sees keys 0..=pos0 + t. Keys in
//   chunks of 256: a thread a key's score (q staged in workgroup memory), the chunk's max by a tree,
//   p = exp(s − m) in workgroup memory, then each thread owns dims li and li + 256 of the output
//   and accumulates Σ p·v with an online softmax (running max, rescaled sum). out = acc / l ·
//   sigmoid(gate). Bindings: 0 params (P), 1 q, 2 kc, 3 vc, 4 gate, 5 out.
//
// qk_rope_append_step (cpu `attn_qk_norm_rope` then `attention`'s append, one decode row): the
//   workgroups of qk_norm_rope_step, at the step's pos; a KV head's workgroup then writes its
//   normed, rotated k and its v into row pos of the caches (not past the capacity `cap`), one
//   launch instead of qk_norm_rope_step and kv_append_step (a word a thread). heads + kv_heads
//   workgroups.
//   Bindings: qk_norm_rope_step's 1-7, 8 v, 9 kc, 10 vc.
// kv_append_step (cpu `attention`'s append, decode): kc[pos], vc[pos] = k, v at the step's pos (not
//   written past the capacity), a word a thread: ceil(kv_dim / KV_PACK / 256) workgroups.
//   Bindings: 1 k, 2 v, 3 step, 4 kc, 5 vc. kv_store (prefill's append into an f16 cache) is
//   described where it is defined.
// attn_split (cpu `attention`, one row, at the step's pos): the keys 0..=pos split into `splits`
//   ranges of `span` keys (the host picks them from the capacity: a recorded step works at any
//   position); one workgroup per (head, split), heads · splits workgroups, the loop of attn_rows
//   over its range; writes the partial (m, l, acc[hd]) at part[(h · splits + s) · (hd + 2)] (an
//   empty range: m = −1e30, l = 0). Bindings: 1 q, 2 kc, 3 vc, 4 step, 5 part.
// attn_combine: one workgroup per head merges its splits' partials (weights exp(m_s − M), a
//   thread a split, at most 256 splits), then out = acc / l · sigmoid(gate). Bindings: 1 part,
//   2 gate, 3 out.
//
// The grouped kernels (a KV head's G ≤ 8 query heads together, hd ≤ 256), described where they
// are defined below: attn_tile_gqa / _part (prefill, tiles of query rows × keys; the default),
// attn_dec_gqa (decode; the default), attn_combine4 (their key splits), attn_split_gqa /
// attn_rows_gqa (stop 28's, LILY_WGPU_ATTN_TILE=0).
//
// No subgroup width is assumed (every reduction goes through workgroup memory); workgroup memory:
// 4 KB (attn_rows, attn_split), 1 KB (qk_norm_rope), 25-30 KB (attn_tile_gqa, attn_dec_gqa), at
// most 32 KB anywhere (Apple's and lavapipe's limit). Head dim up to 512 (two dims a thread), rot
// up to 256. "Minus infinity" is −1e30 (finite: Metal's fast math
// assumes no infinities); masked keys get p = 0 by a select.

// qk_norm_rope's parameters: turns[i / 2] holds inv_freq(i) / 2π as 2^-64 turns, (lo, hi) words
// of pair i at components (i % 2) · 2 and + 1 (uniform arrays have a 16-byte stride).
struct PR {
    rows: u32,
    nh: u32,
    nkv: u32,
    hd: u32,
    rot: u32,
    pos0: u32,
    eps: f32,
    // qk_rope_append_step: the KV cache's capacity (rows); 0 otherwise.
    cap: u32,
    turns: array<vec4<u32>, 64>,
}

const NEG_BIG: f32 = -1.0e30;
const CHUNK: u32 = 256u;

fn wg_max(v: f32, li: u32) -> f32 {
    wg_red[li] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (li < s) {
            wg_red[li] = max(wg_red[li], wg_red[li + s]);
        }
        workgroupBarrier();
    }
    let t = wg_red[0];
    workgroupBarrier();
    return t;
}

// ---- qk_norm_rope

@group(0) @binding(0) var<uniform> pr: PR;
@group(0) @binding(1) var<storage, read> nr_qg: array<f32>;
@group(0) @binding(2) var<storage, read_write> nr_k: array<f32>;
@group(0) @binding(3) var<storage, read> nr_qn: array<f32>;
@group(0) @binding(4) var<storage, read> nr_kn: array<f32>;
@group(0) @binding(5) var<storage, read_write> nr_q: array<f32>;
@group(0) @binding(6) var<storage, read_write> nr_gate: array<f32>;
@group(0) @binding(7) var<storage, read> nr_step: array<u32>;

// The full 64-bit product a · b as (lo, hi).
fn mul_wide(a: u32, b: u32) -> vec2<u32> {
    let a0 = a & 0xffffu;
    let a1 = a >> 16u;
    let b0 = b & 0xffffu;
    let b1 = b >> 16u;
    let p00 = a0 * b0;
    let p01 = a0 * b1;
    let p10 = a1 * b0;
    let p11 = a1 * b1;
    let mid = (p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
    let lo = (mid << 16u) | (p00 & 0xffffu);
    let hi = p11 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u);
    return vec2<u32>(lo, hi);
}

// (cos, sin) of pos · f turns, f a 64-bit fraction (lo, hi) of a turn.
fn turn_cos_sin(pos: u32, f: vec2<u32>) -> vec2<f32> {
    let a = mul_wide(pos, f.x);
    // The product's bits 32..95 of 2^-64 turns, mod one turn: top word, then the next.
    let top = a.y + pos * f.y;
    // Nearest quarter turn q, remainder in [-1/8, 1/8) turn.
    let t = top + 0x20000000u;
    let q = t >> 30u;
    let r = i32(t & 0x3fffffffu) - 0x20000000;
    let x = (f32(r) + f32(a.x) * 2.3283064365386963e-10) * 1.4629180792671596e-9; // 2π / 2^32
    let x2 = x * x;
    let s = x + x * x2 * (-1.6666667e-1 + x2 * (8.3333333e-3 + x2 * (-1.9841270e-4
        + x2 * (2.7557319e-6 + x2 * -2.5052108e-8))));
    let c = 1.0 + x2 * (-0.5 + x2 * (4.1666668e-2 + x2 * (-1.3888889e-3 + x2 * (2.4801587e-5
        + x2 * (-2.7557319e-7 + x2 * 2.0876757e-9)))));
    switch q {
        case 0u: { return vec2<f32>(c, s); }
        case 1u: { return vec2<f32>(-s, c); }
        case 2u: { return vec2<f32>(-c, -s); }
        default: { return vec2<f32>(s, -c); }
    }
}

fn nr_load(is_q: bool, i: u32) -> f32 {
    if (is_q) {
        return nr_qg[i];
    }
    return nr_k[i];
}

fn nr_store(is_q: bool, i: u32, v: f32) {
    if (is_q) {
        nr_q[i] = v;
    } else {
        nr_k[i] = v;
    }
}

// Head `wg` (of rows · (heads + kv heads)): norm, RoPE at `pos`, and the gate copy.
fn norm_rope_head(wg: u32, li: u32, pos: u32) {
    let nall = pr.nh + pr.nkv;
    let t = wg / nall;
    let hh = wg % nall;
    let hd = pr.hd;
    let is_q = hh < pr.nh;
    var src: u32;
    var dst: u32;
    if (is_q) {
        src = (t * pr.nh + hh) * 2u * hd;
        dst = (t * pr.nh + hh) * hd;
    } else {
        src = (t * pr.nkv + hh - pr.nh) * hd;
        dst = src;
    }
    var ss = 0.0;
    for (var i = li; i < hd; i += 256u) {
        let v = nr_load(is_q, src + i);
        ss += v * v;
    }
    let r = 1.0 / sqrt(wg_sum(ss, li) / f32(hd) + pr.eps);
    let half = pr.rot / 2u;
    for (var i = li; i < hd; i += 256u) {
        var w: f32;
        if (is_q) {
            w = nr_qn[i];
        } else {
            w = nr_kn[i];
        }
        let a = nr_load(is_q, src + i) * r * w;
        if (i < half) {
            var wb: f32;
            if (is_q) {
                wb = nr_qn[i + half];
            } else {
                wb = nr_kn[i + half];
            }
            let b = nr_load(is_q, src + i + half) * r * wb;
            let tv = pr.turns[i / 2u];
            var f = tv.xy;
            if (i % 2u == 1u) {
                f = tv.zw;
            }
            let cs = turn_cos_sin(pos, f);
            nr_store(is_q, dst + i, a * cs.x - b * cs.y);
            nr_store(is_q, dst + i + half, a * cs.y + b * cs.x);
        } else if (i >= pr.rot) {
            nr_store(is_q, dst + i, a);
        }
        if (is_q) {
            nr_gate[dst + i] = nr_qg[src + hd + i];
        }
    }
}

@compute @workgroup_size(256)
fn qk_norm_rope(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let wg = wg_index(wid);
    norm_rope_head(wg, li, pr.pos0 + wg / (pr.nh + pr.nkv));
}

@compute @workgroup_size(256)
fn qk_norm_rope_step(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    norm_rope_head(wg_index(wid), li, nr_step[1]);
}

@group(0) @binding(8) var<storage, read> nr_v: array<f32>;
@group(0) @binding(9) var<storage, read_write> nr_kc: array<KV1>;
@group(0) @binding(10) var<storage, read_write> nr_vc: array<KV1>;

@compute @workgroup_size(256)
fn qk_rope_append_step(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let wg = wg_index(wid);
    let pos = nr_step[1];
    norm_rope_head(wg, li, pos);
    let hh = wg % (pr.nh + pr.nkv);
    if (hh >= pr.nh) {
        // The head's k as this workgroup's invocations wrote it (each wrote the dims of a
        // rotation pair, not its own index's).
        storageBarrier();
        let kvd = pr.nkv * pr.hd;
        let off = (hh - pr.nh) * pr.hd;
        // A word (KV_PACK elements: hd % KV_PACK == 0, attention.rs) a thread.
        if (pos < pr.cap) {
            let row = (pos * kvd + off) / KV_PACK;
            for (var w = li; w < pr.hd / KV_PACK; w += 256u) {
                let i = off + w * KV_PACK;
                nr_kc[row + w] = kv_word(nr_k[i], nr_k[i + KV_PACK - 1u]);
                nr_vc[row + w] = kv_word(nr_v[i], nr_v[i + KV_PACK - 1u]);
            }
        }
    }
}

// ---- attention over the cache

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> at_q: array<f32>;
@group(0) @binding(2) var<storage, read> at_kc: array<KV1>;
@group(0) @binding(3) var<storage, read> at_vc: array<KV1>;

var<workgroup> qs: array<f32, 512>;
var<workgroup> ps: array<f32, 256>;

// A partial softmax-weighted sum: running max m, sum l, and this thread's dims li, li + 256.
struct Part {
    m: f32,
    l: f32,
    a0: f32,
    a1: f32,
}

// Query at_q[qoff..qoff + hd] over the cache's keys j0..j1 of KV head kvh. Every thread calls it
// (j0, j1 uniform over the workgroup).
fn attend(li: u32, qoff: u32, kvh: u32, j0: u32, j1: u32) -> Part {
    let hd = p.hd;
    let kvd = p.nkv * hd;
    let koff = kvh * hd;
    for (var i = li; i < hd; i += 256u) {
        qs[i] = at_q[qoff + i];
    }
    workgroupBarrier();
    var r = Part(NEG_BIG, 0.0, 0.0, 0.0);
    for (var c0 = j0; c0 < j1; c0 += CHUNK) {
        let n = min(CHUNK, j1 - c0);
        let j = c0 + li;
        var s = NEG_BIG;
        if (li < n) {
            let kb = j * kvd + koff;
            var acc = 0.0;
            for (var i = 0u; i < hd; i++) {
                let e = kb + i;
                acc += qs[i] * kv1(at_kc[e / KV_PACK], e);
            }
            s = acc * p.scale;
        }
        let mn = max(r.m, wg_max(s, li));
        ps[li] = select(0.0, exp(s - mn), li < n);
        let corr = exp(r.m - mn);
        workgroupBarrier();
        var l = 0.0;
        var a0 = 0.0;
        var a1 = 0.0;
        let d0 = li;
        let d1 = li + 256u;
        for (var jj = 0u; jj < n; jj++) {
            let pj = ps[jj];
            let vb = (c0 + jj) * kvd + koff;
            l += pj;
            if (d0 < hd) {
                a0 += pj * kv1(at_vc[(vb + d0) / KV_PACK], vb + d0);
            }
            if (d1 < hd) {
                a1 += pj * kv1(at_vc[(vb + d1) / KV_PACK], vb + d1);
            }
        }
        r.l = r.l * corr + l;
        r.a0 = r.a0 * corr + a0;
        r.a1 = r.a1 * corr + a1;
        r.m = mn;
        workgroupBarrier();
    }
    return r;
}

@group(0) @binding(4) var<storage, read> ar_gate: array<f32>;
@group(0) @binding(5) var<storage, read_write> ar_out: array<f32>;

@compute @workgroup_size(256)
fn attn_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let wg = wg_index(wid);
    let t = wg / p.nh;
    let h = wg % p.nh;
    let kvh = h / (p.nh / p.nkv);
    let off = (t * p.nh + h) * p.hd;
    let r = attend(li, off, kvh, 0u, p.pos0 + t + 1u);
    if (li < p.hd) {
        ar_out[off + li] = r.a0 / r.l * sigmoid_f(ar_gate[off + li]);
    }
    if (li + 256u < p.hd) {
        ar_out[off + li + 256u] = r.a1 / r.l * sigmoid_f(ar_gate[off + li + 256u]);
    }
}

@group(0) @binding(4) var<storage, read> as_step: array<u32>;
@group(0) @binding(5) var<storage, read_write> as_part: array<f32>;

@compute @workgroup_size(256)
fn attn_split(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let wg = wg_index(wid);
    let h = wg / p.splits;
    let s = wg % p.splits;
    let kvh = h / (p.nh / p.nkv);
    // Keys 0..=pos, never past the capacity (the host refuses such a step).
    let n = min(as_step[1] + 1u, p.cap);
    let j0 = min(s * p.span, n);
    let j1 = min(j0 + p.span, n);
    let r = attend(li, h * p.hd, kvh, j0, j1);
    let base = (h * p.splits + s) * (p.hd + 2u);
    if (li == 0u) {
        as_part[base] = r.m;
        as_part[base + 1u] = r.l;
    }
    if (li < p.hd) {
        as_part[base + 2u + li] = r.a0;
    }
    if (li + 256u < p.hd) {
        as_part[base + 2u + li + 256u] = r.a1;
    }
}

@group(0) @binding(1) var<storage, read> ac_part: array<f32>;
@group(0) @binding(2) var<storage, read> ac_gate: array<f32>;
@group(0) @binding(3) var<storage, read_write> ac_out: array<f32>;

var<workgroup> cb_w: array<f32, 256>;

@compute @workgroup_size(256)
fn attn_combine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wg_index(wid);
    let stride = p.hd + 2u;
    let b0 = h * p.splits * stride;
    // Thread s < splits (≤ 256, attention.rs) reads split s's max; the weights exp(m_s − M) and
    // l = Σ w_s·l_s through workgroup memory, so the dims' loop below has no dependent loads.
    var ms = NEG_BIG;
    if (li < p.splits) {
        ms = ac_part[b0 + li * stride];
    }
    let m = wg_max(ms, li);
    var w = 0.0;
    var lw = 0.0;
    if (li < p.splits) {
        w = exp(ms - m);
        lw = w * ac_part[b0 + li * stride + 1u];
    }
    cb_w[li] = w;
    let l = wg_sum(lw, li);
    var a0 = 0.0;
    var a1 = 0.0;
    for (var s0 = 0u; s0 < p.splits; s0 += 8u) {
        for (var e = 0u; e < 8u; e++) {
            let s = s0 + e;
            if (s < p.splits) {
                let b = b0 + s * stride + 2u;
                if (li < p.hd) {
                    a0 += cb_w[s] * ac_part[b + li];
                }
                if (li + 256u < p.hd) {
                    a1 += cb_w[s] * ac_part[b + li + 256u];
                }
            }
        }
    }
    let off = h * p.hd;
    if (li < p.hd) {
        ac_out[off + li] = a0 / l * sigmoid_f(ac_gate[off + li]);
    }
    if (li + 256u < p.hd) {
        ac_out[off + li + 256u] = a1 / l * sigmoid_f(ac_gate[off + li + 256u]);
    }
}

@group(0) @binding(1) var<storage, read> ak_k: array<f32>;
@group(0) @binding(2) var<storage, read> ak_v: array<f32>;
@group(0) @binding(3) var<storage, read> ak_step: array<u32>;
@group(0) @binding(4) var<storage, read_write> ak_kc: array<KV1>;
@group(0) @binding(5) var<storage, read_write> ak_vc: array<KV1>;

@compute @workgroup_size(256)
fn kv_append_step(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    // Thread i: word i of the row (KV_PACK elements).
    let i = wg_index(wid) * 256u + li;
    let kvd = p.nkv * p.hd;
    let pos = ak_step[1];
    if (i < kvd / KV_PACK && pos < p.cap) {
        let e = i * KV_PACK;
        ak_kc[pos * kvd / KV_PACK + i] = kv_word(ak_k[e], ak_k[e + KV_PACK - 1u]);
        ak_vc[pos * kvd / KV_PACK + i] = kv_word(ak_v[e], ak_v[e + KV_PACK - 1u]);
    }
}

// kv_store (cpu: the prefill's append, `attention`'s copy of k, v into the cache): words
// dst[pst.dst + w] = the elements src[pst.src + w · KV_PACK ..] (rounded to the cache's type), w <
// pst.n; a word a thread, ceil(n / 256) workgroups. The f16 cache's prefill append (the f32 one
// is a buffer copy) and `Backend::copy` from an f32 buffer into an f16 cache. Bindings: 0 params
// (PS), 1 src (f32), 2 dst (the cache).

struct PS {
    n: u32,
    src: u32,
    dst: u32,
    pad: u32,
}

@group(0) @binding(0) var<uniform> pst: PS;
@group(0) @binding(1) var<storage, read> ks_src: array<f32>;
@group(0) @binding(2) var<storage, read_write> ks_dst: array<KV1>;

@compute @workgroup_size(256)
fn kv_store(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let w = wg_index(wid) * 256u + li;
    if (w < pst.n) {
        let e = pst.src + w * KV_PACK;
        ks_dst[pst.dst + w] = kv_word(ks_src[e], ks_src[e + KV_PACK - 1u]);
    }
}

// ---- attn_split_gqa: decode attention a workgroup per (KV head, split), its G ≤ 8 query heads
// together, so each key and value row is read once for all of them (attn_split reads them once a
// query head). Keys of the split in chunks of GQ_CHUNK = 32, in three phases a chunk:
//   scores: thread li = key (li / 8) × part (li % 8); the part's vec4s c ≡ part (mod 8) of the
//     key row (8 threads read a row's consecutive 16-byte words), all loaded before any is used
//     (a constant count, so they are in flight together), dotted with every query head (staged
//     in workgroup memory); then thread (head li / 32, key li % 32) sums the key's 8 parts;
//   softmax: the same thread takes its head's chunk max, the new running max and its p = exp(s −
//     m) (one exp a thread); the head's first thread keeps the rescale and, in the next phase,
//     the running sum;
//   values: thread li = key group (li / 64) × vec4 of dims (li % 64) adds p·v over the chunk's
//     keys ≡ its group (mod 4), their rows loaded together; the 4 groups' sums are added through
//     workgroup memory at the end, leaving thread li with dim li of every head.
// The split's range adapts to the step's position: n = pos + 1 keys over `splits` splits (fixed
// by the capacity, so a recorded step launches the same) of ceil(n / splits) keys. Partials as
// attn_split's, for attn_combine. Takes hd ≤ 256, hd % 4 == 0, G ≤ 8 (attention.rs checks).
// Bindings: 1 q, 2 kc (vec4), 3 vc (vec4), 4 step, 5 part. Workgroup memory 18.2 KB.

const GQ_CHUNK: u32 = 32u;
const GQ_MAXG: u32 = 8u;

@group(0) @binding(1) var<storage, read> ag_q: array<f32>;
@group(0) @binding(2) var<storage, read> ag_kc: array<KV4>;
@group(0) @binding(3) var<storage, read> ag_vc: array<KV4>;
@group(0) @binding(4) var<storage, read> ag_step: array<u32>;
@group(0) @binding(5) var<storage, read_write> ag_part: array<f32>;

var<workgroup> gq_q: array<vec4<f32>, 512>;
var<workgroup> gq_red: array<f32, 2048>;
var<workgroup> gq_s: array<f32, 256>;
var<workgroup> gq_p: array<f32, 256>;
var<workgroup> gq_m: array<f32, 8>;
var<workgroup> gq_l: array<f32, 8>;
var<workgroup> gq_corr: array<f32, 8>;

// Attention of the G query heads of KV head kvh (at ag_q[qoff + (kvh·G + g)·hd ..]) over keys
// j0..j1: each head's sum Σ p·v at dim li in the result, its running max and sum left in gq_m,
// gq_l. Every thread calls it (j0, j1 uniform).
fn gqa_attend(li: u32, qoff: u32, kvh: u32, j0: u32, j1: u32) -> array<f32, 8> {
    let hd = p.hd;
    let hd4 = hd / 4u;
    let kvd4 = p.nkv * hd4;
    let G = p.nh / p.nkv;
    // The group's query heads h = kvh·G + g, as vec4s.
    for (var i = li; i < G * hd4; i += 256u) {
        let g = i / hd4;
        let c = i % hd4;
        let qb = qoff + (kvh * G + g) * hd + 4u * c;
        gq_q[i] = vec4<f32>(ag_q[qb], ag_q[qb + 1u], ag_q[qb + 2u], ag_q[qb + 3u]);
    }
    if (li < GQ_MAXG) {
        gq_m[li] = NEG_BIG;
        gq_l[li] = 0.0;
    }
    workgroupBarrier();
    var acc: array<vec4<f32>, 8>;
    for (var g = 0u; g < GQ_MAXG; g++) {
        acc[g] = vec4<f32>(0.0);
    }
    let key = li / 8u;
    let part = li % 8u;
    let sg = li / 32u; // softmax phase: head
    let sk = li % 32u; //   and key
    let vk = li / 64u; // values phase: key group
    let vd = li % 64u; //   and vec4 of dims
    for (var c0 = j0; c0 < j1; c0 += GQ_CHUNK) {
        let cn = min(GQ_CHUNK, j1 - c0);
        // Scores: this thread's part of key c0 + key, for every head. A key row of up to 64
        // vec4s is 8 a part.
        var kr: array<vec4<f32>, 8>;
        let kb = (c0 + key) * kvd4 + kvh * hd4;
        for (var i = 0u; i < 8u; i++) {
            let c = part + 8u * i;
            kr[i] = vec4<f32>(0.0);
            if (key < cn && c < hd4) {
                kr[i] = kv4(ag_kc[kb + c]);
            }
        }
        for (var g = 0u; g < GQ_MAXG; g++) {
            var d = 0.0;
            if (g < G) {
                for (var i = 0u; i < 8u; i++) {
                    let c = part + 8u * i;
                    if (c < hd4) {
                        d += dot(gq_q[g * hd4 + c], kr[i]);
                    }
                }
            }
            gq_red[g * 256u + li] = d;
        }
        workgroupBarrier();
        // Thread (head sg, key sk): the key's score, then its p under the chunk's new max.
        var sc = NEG_BIG;
        if (sk < cn && sg < G) {
            var t = 0.0;
            for (var q = 0u; q < 8u; q++) {
                t += gq_red[sg * 256u + sk * 8u + q];
            }
            sc = t * p.scale;
        }
        gq_s[li] = sc;
        workgroupBarrier();
        var cm = NEG_BIG;
        for (var k = 0u; k < GQ_CHUNK; k++) {
            cm = max(cm, gq_s[sg * GQ_CHUNK + k]);
        }
        let mo = gq_m[sg];
        let mn = max(mo, cm);
        gq_p[li] = select(0.0, exp(sc - mn), sk < cn && sg < G);
        workgroupBarrier();
        if (sk == 0u && sg < G) {
            gq_corr[sg] = exp(mo - mn);
            gq_m[sg] = mn;
        }
        workgroupBarrier();
        // Values: keys vk, vk + 4, … of the chunk, dims 4·vd .. 4·vd + 4 of every head.
        var vr: array<vec4<f32>, 8>;
        for (var i = 0u; i < 8u; i++) {
            let k = vk + 4u * i;
            vr[i] = vec4<f32>(0.0);
            if (k < cn && vd < hd4) {
                vr[i] = kv4(ag_vc[(c0 + k) * kvd4 + kvh * hd4 + vd]);
            }
        }
        for (var g = 0u; g < GQ_MAXG; g++) {
            var a = acc[g] * gq_corr[g];
            for (var i = 0u; i < 8u; i++) {
                a += gq_p[g * GQ_CHUNK + vk + 4u * i] * vr[i];
            }
            acc[g] = a;
        }
        if (sk == 0u && sg < G) {
            var l = 0.0;
            for (var k = 0u; k < GQ_CHUNK; k++) {
                l += gq_p[sg * GQ_CHUNK + k];
            }
            gq_l[sg] = gq_l[sg] * gq_corr[sg] + l;
        }
        workgroupBarrier();
    }
    // The 4 key groups' sums, two heads at a time through gq_red: thread li ends with dim li.
    var out: array<f32, 8>;
    for (var g2 = 0u; g2 < GQ_MAXG; g2 += 2u) {
        for (var e = 0u; e < 2u; e++) {
            let a = acc[g2 + e];
            let b = (e * 4u + vk) * 256u + 4u * vd;
            if (vd < hd4) {
                gq_red[b] = a.x;
                gq_red[b + 1u] = a.y;
                gq_red[b + 2u] = a.z;
                gq_red[b + 3u] = a.w;
            }
        }
        workgroupBarrier();
        for (var e = 0u; e < 2u; e++) {
            var t = 0.0;
            if (li < hd) {
                for (var k = 0u; k < 4u; k++) {
                    t += gq_red[(e * 4u + k) * 256u + li];
                }
            }
            out[g2 + e] = t;
        }
        workgroupBarrier();
    }
    return out;
}

@compute @workgroup_size(256)
fn attn_split_gqa(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let wg = wg_index(wid);
    let kvh = wg / p.splits;
    let s = wg % p.splits;
    let n = min(ag_step[1] + 1u, p.cap);
    let span = (n + p.splits - 1u) / p.splits;
    let j0 = min(s * span, n);
    let j1 = min(j0 + span, n);
    let acc = gqa_attend(li, 0u, kvh, j0, j1);
    let G = p.nh / p.nkv;
    for (var g = 0u; g < G; g++) {
        let h = kvh * G + g;
        let base = (h * p.splits + s) * (p.hd + 2u);
        if (li == 0u) {
            ag_part[base] = gq_m[g];
            ag_part[base + 1u] = gq_l[g];
        }
        if (li < p.hd) {
            ag_part[base + 2u + li] = acc[g];
        }
    }
}

// attn_rows_gqa (prefill, the shapes attn_split_gqa takes): a workgroup per (row t, KV head),
// its G query heads over keys 0..=pos0 + t, then out = acc / l · sigmoid(gate). rows · nkv
// workgroups. Bindings: 1 q, 2 kc, 3 vc, 4 gate, 5 out (attn_rows's).
@compute @workgroup_size(256)
fn attn_rows_gqa(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let wg = wg_index(wid);
    let t = wg / p.nkv;
    let kvh = wg % p.nkv;
    let row = t * p.nh * p.hd;
    let acc = gqa_attend(li, row, kvh, 0u, p.pos0 + t + 1u);
    let G = p.nh / p.nkv;
    if (li < p.hd) {
        for (var g = 0u; g < G; g++) {
            let o = row + (kvh * G + g) * p.hd + li;
            ar_out[o] = acc[g] / gq_l[g] * sigmoid_f(ar_gate[o]);
        }
    }
}

// ---- attn_tile_gqa / attn_tile_gqa_part: prefill attention tiled over query rows and keys
// (flash-attention style; cpu `attention_tiled`). A workgroup per (tile of R = TQ / G query rows,
// KV head, key split): its TQ = 32 query slots (slot q = row q / G, head q % G of the group:
// 4 rows of the model's 8 heads) over the keys of its split, TK = 8 keys at a time. Each K/V row
// is read once per tile and used by all 32 slots (attn_rows_gqa reads it once per row), so the
// quadratic term is K/V traffic / 32 from L2 and the kernel is bound by its FMAs:
//   scores: thread (slot li % 32, dim slice li / 32) keeps its slot's 8 vec4s of q (dims ≡ slice
//     mod 8, in registers for the whole launch) and dots them with the tile's 8 keys (K tile in
//     workgroup memory, the same address across a 32-thread warp: broadcast reads); the 8
//     slices' partials go through workgroup memory;
//   softmax: thread li < 32 (the slot) sums its 8 keys' partials, masks (causal: key ≤ pos0 + t;
//     the split's end), keeps the running max m and sum l (online softmax) and writes p and the
//     rescale exp(m_old − m_new);
//   values: thread (slot group li / 64: 8 slots, vec4 of dims li % 64) rescales its 8
//     accumulators and adds p·v over the tile's keys (V tile in workgroup memory).
// The next tile's K and V are loaded into registers while this one is used, and stored once its
// buffer is free: 3 barriers a tile of 8 keys, 512 FMAs a thread between them. Workgroup memory
// 25.1 KB (K, V tiles 8 KB each, partials 8 KB, p 1 KB); about 100 registers a thread (q 32,
// accumulators 32, the next tile 16), so two workgroups fit an SM. The workgroups of a launch
// run the longest tiles (the last rows) first; those running together read the same K/V tiles,
// so the cache's bytes come from L2. A prefill chunk of 2048 rows is 512 tiles a KV head.
// attn_tile_gqa (one split): out = acc / l · sigmoid(gate). attn_tile_gqa_part (the host splits
// the keys when tiles are few and keys many): partials (m, l, 0, 0, acc[hd]) at
// part[((t · nh + h) · splits + s) · (hd + 4)], merged by attn_combine4 a (row, head) a workgroup.
// Takes G ≤ 8, hd ≤ 256, hd % 4 == 0 (attention.rs checks). Params: splits, span = keys a split
// (a multiple of TK). Bindings: 1 q, 2 kc, 3 vc (vec4 views), then 4 gate, 5 out, or 4 part.

const TQ: u32 = 32u;
const TK: u32 = 8u;
const TS: u32 = 8u; // 256 / TQ: dim slices of the score phase
const TSV: u32 = 8u; // 64 / TS: vec4s of a slice at hd = 256

@group(0) @binding(1) var<storage, read> tk_q: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> tk_kc: array<KV4>;
@group(0) @binding(3) var<storage, read> tk_vc: array<KV4>;
@group(0) @binding(4) var<storage, read> tk_gate: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> tk_out: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> tk_part: array<vec4<f32>>;

var<workgroup> tk_k: array<vec4<f32>, 512>; // [TK][64]
var<workgroup> tk_v: array<vec4<f32>, 512>; // [TK][64]
var<workgroup> tk_red: array<vec4<f32>, 512>; // [TS][TK / 4][TQ]: 4 keys' partials a vec4
var<workgroup> tk_p: array<vec4<f32>, 64>; // [TK][TQ / 4]: p of 4 slots a vec4
var<workgroup> tk_c: array<vec4<f32>, 8>; // [TQ / 4]: rescale, then l at the end

// A tile's shape for workgroup wg: rows t0 .. t0 + rv, KV head, split s, keys j0..j1.
struct Tile {
    g: u32,
    r: u32,
    t0: u32,
    rv: u32,
    kvh: u32,
    s: u32,
    j0: u32,
    j1: u32,
}

fn tile_of(wg: u32) -> Tile {
    let g = p.nh / p.nkv;
    let r = TQ / g;
    let tiles = (p.rows + r - 1u) / r;
    let per = p.nkv * tiles;
    let s = wg / per;
    let kvh = (wg % per) / tiles;
    // Longest first: the last rows see the most keys.
    let t0 = (tiles - 1u - wg % tiles) * r;
    let rv = min(r, p.rows - t0);
    let kend = p.pos0 + t0 + rv;
    let j0 = min(s * p.span, kend);
    let j1 = min(j0 + p.span, kend);
    return Tile(g, r, t0, rv, kvh, s, j0, j1);
}

// Thread li's share of key tile jt's K and V rows (2 words of 4 elements each), zero past j1 (so
// p = 0 there multiplies zeros, never a stale or out-of-range row). Kept in the cache's type
// until stored into workgroup memory (kv4 there), so no conversion waits on the load early.
fn tile_load_k(tl: Tile, li: u32, jt: u32) -> array<KV4, 2> {
    let hd4 = p.hd / 4u;
    let kvd4 = p.nkv * hd4;
    var r: array<KV4, 2>;
    for (var i = 0u; i < 2u; i++) {
        let e = li + 256u * i;
        let j = jt + e / 64u;
        let c = e % 64u;
        r[i] = KV4();
        if (c < hd4 && j < tl.j1) {
            r[i] = tk_kc[j * kvd4 + tl.kvh * hd4 + c];
        }
    }
    return r;
}

fn tile_load_v(tl: Tile, li: u32, jt: u32) -> array<KV4, 2> {
    let hd4 = p.hd / 4u;
    let kvd4 = p.nkv * hd4;
    var r: array<KV4, 2>;
    for (var i = 0u; i < 2u; i++) {
        let e = li + 256u * i;
        let j = jt + e / 64u;
        let c = e % 64u;
        r[i] = KV4();
        if (c < hd4 && j < tl.j1) {
            r[i] = tk_vc[j * kvd4 + tl.kvh * hd4 + c];
        }
    }
    return r;
}

// The tile's attention: thread li (value layout: slots (li / 64)·8 + e, e < 8, dims vec4 li % 64)
// gets its 8 slots' Σ p·v; every slot's final m and l are left in tk_p[q / 4][q % 4] and
// tk_c[q / 4][q % 4]. Every thread calls it (the tile is uniform).
fn tile_attend(tl: Tile, li: u32) -> array<vec4<f32>, 8> {
    let hd4 = p.hd / 4u;
    // Score layout: slot q, slice sl.
    let q = li % TQ;
    let sl = li / TQ;
    let qt = tl.t0 + q / tl.g;
    let qok = q < tl.r * tl.g && qt < p.rows;
    let qlast = p.pos0 + qt; // the slot's last visible key
    var qr: array<vec4<f32>, TSV>;
    let qb = (qt * p.nh + tl.kvh * tl.g + q % tl.g) * hd4;
    for (var i = 0u; i < TSV; i++) {
        let c = sl + TS * i;
        qr[i] = vec4<f32>(0.0);
        if (qok && c < hd4) {
            qr[i] = tk_q[qb + c];
        }
    }
    // Value layout: slot group vg (slots 8·vg ..), dims vec4 vd.
    let vg = li / 64u;
    let vd = li % 64u;
    var acc: array<vec4<f32>, 8>;
    for (var e = 0u; e < 8u; e++) {
        acc[e] = vec4<f32>(0.0);
    }
    // Softmax state (threads li < TQ, slot li).
    var m_run = NEG_BIG;
    var l_run = 0.0;
    let nt = (tl.j1 - tl.j0 + TK - 1u) / TK;
    var kr = tile_load_k(tl, li, tl.j0);
    var vr = tile_load_v(tl, li, tl.j0);
    for (var i = 0u; i < 2u; i++) {
        tk_k[li + 256u * i] = kv4(kr[i]);
        tk_v[li + 256u * i] = kv4(vr[i]);
    }
    kr = tile_load_k(tl, li, tl.j0 + TK);
    vr = tile_load_v(tl, li, tl.j0 + TK);
    workgroupBarrier();
    for (var it = 0u; it < nt; it++) {
        let jt = tl.j0 + it * TK;
        // Scores: this slice's partial dot of the slot with the tile's 8 keys.
        var sp: array<f32, TK>;
        for (var k = 0u; k < TK; k++) {
            var d = 0.0;
            for (var i = 0u; i < TSV; i++) {
                let c = sl + TS * i;
                if (c < hd4) {
                    d += dot(qr[i], tk_k[k * 64u + c]);
                }
            }
            sp[k] = d;
        }
        tk_red[(sl * 2u) * TQ + q] = vec4<f32>(sp[0], sp[1], sp[2], sp[3]);
        tk_red[(sl * 2u + 1u) * TQ + q] = vec4<f32>(sp[4], sp[5], sp[6], sp[7]);
        workgroupBarrier();
        // The K tile is read: the next one goes in while the softmax runs.
        for (var i = 0u; i < 2u; i++) {
            tk_k[li + 256u * i] = kv4(kr[i]);
        }
        kr = tile_load_k(tl, li, jt + 2u * TK);
        if (li < TQ) {
            var s0 = vec4<f32>(0.0);
            var s1 = vec4<f32>(0.0);
            for (var x = 0u; x < TS; x++) {
                s0 += tk_red[(x * 2u) * TQ + li];
                s1 += tk_red[(x * 2u + 1u) * TQ + li];
            }
            let sc = array<f32, 8>(s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w);
            var tm = NEG_BIG;
            for (var k = 0u; k < TK; k++) {
                let j = jt + k;
                if (qok && j < tl.j1 && j <= qlast) {
                    tm = max(tm, sc[k] * p.scale);
                }
            }
            let mn = max(m_run, tm);
            let corr = exp(m_run - mn);
            var ls = 0.0;
            for (var k = 0u; k < TK; k++) {
                let j = jt + k;
                let pk = select(0.0, exp(sc[k] * p.scale - mn), qok && j < tl.j1 && j <= qlast);
                ls += pk;
                tk_p[k * (TQ / 4u) + li / 4u][li % 4u] = pk;
            }
            tk_c[li / 4u][li % 4u] = corr;
            l_run = l_run * corr + ls;
            m_run = mn;
        }
        workgroupBarrier();
        // Values: rescale, then Σ p·v over the tile's keys.
        let c0 = tk_c[vg * 2u];
        let c1 = tk_c[vg * 2u + 1u];
        acc[0] *= c0.x;
        acc[1] *= c0.y;
        acc[2] *= c0.z;
        acc[3] *= c0.w;
        acc[4] *= c1.x;
        acc[5] *= c1.y;
        acc[6] *= c1.z;
        acc[7] *= c1.w;
        for (var k = 0u; k < TK; k++) {
            let pa = tk_p[k * (TQ / 4u) + vg * 2u];
            let pb = tk_p[k * (TQ / 4u) + vg * 2u + 1u];
            let v = tk_v[k * 64u + vd];
            acc[0] += pa.x * v;
            acc[1] += pa.y * v;
            acc[2] += pa.z * v;
            acc[3] += pa.w * v;
            acc[4] += pb.x * v;
            acc[5] += pb.y * v;
            acc[6] += pb.z * v;
            acc[7] += pb.w * v;
        }
        workgroupBarrier();
        // The V tile is read: the next one goes in (seen after the next scores' barrier).
        for (var i = 0u; i < 2u; i++) {
            tk_v[li + 256u * i] = kv4(vr[i]);
        }
        vr = tile_load_v(tl, li, jt + 2u * TK);
    }
    if (li < TQ) {
        tk_p[li / 4u][li % 4u] = m_run;
        tk_c[li / 4u][li % 4u] = l_run;
    }
    workgroupBarrier();
    return acc;
}

fn sigmoid4(x: vec4<f32>) -> vec4<f32> { return 1.0 / (1.0 + exp(-x)); }

@compute @workgroup_size(256)
fn attn_tile_gqa(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let tl = tile_of(wg_index(wid));
    let acc = tile_attend(tl, li);
    let hd4 = p.hd / 4u;
    let vg = li / 64u;
    let vd = li % 64u;
    for (var e = 0u; e < 8u; e++) {
        let q = vg * 8u + e;
        let t = tl.t0 + q / tl.g;
        if (q < tl.r * tl.g && t < p.rows && vd < hd4) {
            let o = (t * p.nh + tl.kvh * tl.g + q % tl.g) * hd4 + vd;
            tk_out[o] = acc[e] / tk_c[q / 4u][q % 4u] * sigmoid4(tk_gate[o]);
        }
    }
}

@compute @workgroup_size(256)
fn attn_tile_gqa_part(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let tl = tile_of(wg_index(wid));
    let acc = tile_attend(tl, li);
    let hd4 = p.hd / 4u;
    let vg = li / 64u;
    let vd = li % 64u;
    for (var e = 0u; e < 8u; e++) {
        let q = vg * 8u + e;
        let t = tl.t0 + q / tl.g;
        if (q < tl.r * tl.g && t < p.rows) {
            // Record (m, l, 0, 0, acc[hd]) of hd / 4 + 1 vec4s.
            let base = ((t * p.nh + tl.kvh * tl.g + q % tl.g) * p.splits + tl.s) * (hd4 + 1u);
            if (vd == 0u) {
                tk_part[base] = vec4<f32>(tk_p[q / 4u][q % 4u], tk_c[q / 4u][q % 4u], 0.0, 0.0);
            }
            if (vd < hd4) {
                tk_part[base + 1u + vd] = acc[e];
            }
        }
    }
}

// ---- attn_dec_gqa: decode attention (cpu `attention`, one row at the step's pos) a workgroup
// per (KV head, split), its G ≤ 8 query heads together, keys in chunks of DK = 32 · KV_PACK (32
// f32 rows, 64 f16 rows: 16 KB of K and 16 KB of V a chunk either way) with every load of a
// chunk issued before any is used: thread li reads 8 K words of 4 elements of key li / 8 (and of
// key li / 8 + 32 for f16; words ≡ li % 8 mod 8, so 8 threads cover 128 (f32) or 64 (f16)
// consecutive bytes of a row) and 8 · KV_PACK V words (keys ≡ li / 64 mod 4, word li % 64): 64
// registers a thread either way, kept in the cache's type and widened (kv4) where used, so no
// conversion waits on a load early. The next chunk's K is requested as soon as this one's is
// used, its V as soon as this one's is. A chunk is 3 barriers: scores (partial dots with the 8
// heads' q, staged in workgroup memory; the partials as scalars at dc_red word (head · 8 + part)
// · RS + key, RS = DK + 4 ≡ 4 mod 32, so that both the writes (4 keys × 8 parts a warp) and the
// reads (32 keys of one head and part) hit 32 distinct banks: the vec4 layout before had each
// reading thread of a warp on one bank, a 32-way conflict, 8 times a chunk), summed by thread
// (head li / 32, keys li % 32 + 32·r); softmax (each thread takes its head's chunk max from
// workgroup memory, its p = exp(s − m), a running max and sum of its own); values (the rescale
// from the heads' new maxes, then p·v). The 4 key groups' sums and the 32 threads' sums of each
// head are added once at the end. Attention's stop-28 kernel (attn_split_gqa) took ~10 barriers
// a chunk and loaded V only after the softmax.
// Splits: `splits` (fixed by the capacity: a recorded step launches the same at any position),
// each over ceil(n / splits) keys but at least `span` (= DK) of the n = pos + 1: the splits past
// the keys write (m, l) = (−1e30, 0) and stop, and attn_combine4 skips them. Partials as
// attn_tile_gqa_part's: (m, l, 0, 0, acc[hd]) at part[((kvh · G + g) · splits + s) · (hd/4 + 1)]
// vec4s. Workgroup memory 26.6 KB f32, 29.7 KB f16 (q 8 KB, partials 16-17 KB, scores and p
// 2-4 KB). Takes G ≤ 8, hd ≤ 256, hd % 4 == 0. Bindings: 1 q, 2 kc, 3 vc (4-element words), 4
// step, 5 part (vec4).

// Decode attention specialised to the launch: attn_params.wgsl's AD_* and ad_*().

const DK: u32 = 32u * KV_PACK;
const DR: u32 = 8u * KV_PACK; // K words, V words a thread a chunk
const RS: u32 = DK + 4u;

@group(0) @binding(1) var<storage, read> dc_qg: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> dc_kc: array<KV4>;
@group(0) @binding(3) var<storage, read> dc_vc: array<KV4>;
@group(0) @binding(4) var<storage, read> dc_step: array<u32>;
@group(0) @binding(5) var<storage, read_write> dc_part: array<vec4<f32>>;

var<workgroup> dc_q: array<vec4<f32>, 512>; // [G][64]
// Score partials as scalars [head][part][RS] (64 · RS words); at the end [kg][4][64] vec4s.
var<workgroup> dc_red: array<vec4<f32>, max(1024u, 16u * RS)>;
var<workgroup> dc_s: array<f32, 8u * DK>; // [head][key] scores; at the end the threads' sums
var<workgroup> dc_p: array<f32, 8u * DK>; // [head][key]
var<workgroup> dc_m: array<f32, 8>;

fn dec_load_k(kr: ptr<function, array<KV4, DR>>, li: u32, kvh: u32, jc: u32, j1: u32) {
    let hd4 = ad_hd() / 4u;
    let kvd4 = ad_nkv() * hd4;
    for (var r = 0u; r < KV_PACK; r++) {
        let j = jc + li / 8u + 32u * r;
        for (var i = 0u; i < 8u; i++) {
            let c = li % 8u + 8u * i;
            (*kr)[8u * r + i] = KV4();
            if (j < j1 && c < hd4) {
                (*kr)[8u * r + i] = dc_kc[j * kvd4 + kvh * hd4 + c];
            }
        }
    }
}

fn dec_load_v(vr: ptr<function, array<KV4, DR>>, li: u32, kvh: u32, jc: u32, j1: u32) {
    let hd4 = ad_hd() / 4u;
    let kvd4 = ad_nkv() * hd4;
    let d = li % 64u;
    for (var i = 0u; i < DR; i++) {
        let j = jc + li / 64u + 4u * i;
        (*vr)[i] = KV4();
        if (j < j1 && d < hd4) {
            (*vr)[i] = dc_vc[j * kvd4 + kvh * hd4 + d];
        }
    }
}

@compute @workgroup_size(256)
fn attn_dec_gqa(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let wg = wg_index(wid);
    let kvh = wg / ad_splits();
    let s = wg % ad_splits();
    let G = ad_nh() / ad_nkv();
    let hd4 = ad_hd() / 4u;
    let rec = hd4 + 1u;
    let n = min(dc_step[1] + 1u, ad_cap());
    let span = max((n + ad_splits() - 1u) / ad_splits(), ad_span());
    let j0 = min(s * span, n);
    let j1 = min(j0 + span, n);
    if (j0 >= j1) {
        if (li < G) {
            dc_part[((kvh * G + li) * ad_splits() + s) * rec] = vec4<f32>(NEG_BIG, 0.0, 0.0, 0.0);
        }
        return;
    }
    var kr: array<KV4, DR>;
    var vr: array<KV4, DR>;
    dec_load_k(&kr, li, kvh, j0, j1);
    dec_load_v(&vr, li, kvh, j0, j1);
    for (var i = li; i < G * 64u; i += 256u) {
        let c = i % 64u;
        dc_q[i] = vec4<f32>(0.0);
        if (c < hd4) {
            dc_q[i] = dc_qg[(kvh * G + i / 64u) * hd4 + c];
        }
    }
    workgroupBarrier();
    let pp = li % 8u; // scores: part of keys li / 8 (+ 32)
    let sg = li / 32u; // softmax: head
    let sk = li % 32u; //   and keys sk (+ 32)
    let kg = li / 64u; // values: key group
    let vd = li % 64u; //   and word of dims
    var acc: array<vec4<f32>, 8>;
    var mv: array<f32, 8>;
    for (var g = 0u; g < 8u; g++) {
        acc[g] = vec4<f32>(0.0);
        mv[g] = NEG_BIG;
    }
    var m_run = NEG_BIG;
    var l_run = 0.0;
    for (var jc = j0; jc < j1; jc += DK) {
        for (var r = 0u; r < KV_PACK; r++) {
            for (var g = 0u; g < 8u; g++) {
                var t = 0.0;
                if (g < G) {
                    for (var i = 0u; i < 8u; i++) {
                        let c = pp + 8u * i;
                        if (c < hd4) {
                            t += dot(dc_q[g * 64u + c], kv4(kr[8u * r + i]));
                        }
                    }
                }
                let w = (g * 8u + pp) * RS + li / 8u + 32u * r;
                dc_red[w / 4u][w % 4u] = t;
            }
        }
        dec_load_k(&kr, li, kvh, jc + DK, j1);
        workgroupBarrier();
        var sc: array<f32, KV_PACK>;
        for (var r = 0u; r < KV_PACK; r++) {
            let k = sk + 32u * r;
            sc[r] = NEG_BIG;
            if (sg < G && jc + k < j1) {
                var t = 0.0;
                for (var x = 0u; x < 8u; x++) {
                    let w = (sg * 8u + x) * RS + k;
                    t += dc_red[w / 4u][w % 4u];
                }
                sc[r] = t * p.scale;
            }
            dc_s[sg * DK + k] = sc[r];
        }
        workgroupBarrier();
        var cm = NEG_BIG;
        for (var k = 0u; k < DK; k++) {
            cm = max(cm, dc_s[sg * DK + k]);
        }
        let mn = max(m_run, cm);
        var psum = 0.0;
        for (var r = 0u; r < KV_PACK; r++) {
            let k = sk + 32u * r;
            let pk = select(0.0, exp(sc[r] - mn), sg < G && jc + k < j1);
            dc_p[sg * DK + k] = pk;
            psum += pk;
        }
        l_run = l_run * exp(m_run - mn) + psum;
        m_run = mn;
        if (sk == 0u && sg < G) {
            dc_m[sg] = mn;
        }
        workgroupBarrier();
        for (var g = 0u; g < 8u; g++) {
            if (g < G) {
                let m2 = dc_m[g];
                var a = acc[g] * exp(mv[g] - m2);
                mv[g] = m2;
                for (var i = 0u; i < DR; i++) {
                    a += dc_p[g * DK + kg + 4u * i] * kv4(vr[i]);
                }
                acc[g] = a;
            }
        }
        dec_load_v(&vr, li, kvh, jc + DK, j1);
    }
    // The 4 key groups' sums, 4 heads a round; each head's l from its 32 threads' sums.
    dc_s[li] = l_run;
    for (var r = 0u; r < 2u; r++) {
        for (var e = 0u; e < 4u; e++) {
            dc_red[(kg * 4u + e) * 64u + vd] = acc[4u * r + e];
        }
        workgroupBarrier();
        let e = li / 64u;
        let g = 4u * r + e;
        if (g < G) {
            let base = ((kvh * G + g) * ad_splits() + s) * rec;
            if (vd < hd4) {
                var t = vec4<f32>(0.0);
                for (var x = 0u; x < 4u; x++) {
                    t += dc_red[(x * 4u + e) * 64u + vd];
                }
                dc_part[base + 1u + vd] = t;
            }
            if (vd == 0u) {
                var l = 0.0;
                for (var k = 0u; k < 32u; k++) {
                    l += dc_s[g * 32u + k];
                }
                dc_part[base] = vec4<f32>(dc_m[g], l, 0.0, 0.0);
            }
        }
        workgroupBarrier();
    }
}

// ---- attn_combine4: merges the key splits of attn_dec_gqa / attn_tile_gqa_part, a workgroup per
// (row, head) f: records (m, l, 0, 0, acc[hd]) at part[(f · splits + s) · (hd/4 + 1)] vec4s.
// One tree finds the largest m and the splits holding keys (m > −1e30: a prefix of them); thread
// (split group li / 64, vec4 of dims li % 64) adds w·acc and w·l over the splits ≡ its group mod
// 4 (w = exp(m_s − M)), their loads issued eight at a time (stop 47: four at a time, ns / 16
// round trips to L2 in a row); the 4 groups are added through
// workgroup memory; out = acc / l · sigmoid(gate). splits ≤ 256, hd ≤ 256, hd % 4 == 0.
// Bindings: 1 part, 2 gate, 3 out (vec4 views).

@group(0) @binding(1) var<storage, read> c4_part: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> c4_gate: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> c4_out: array<vec4<f32>>;

var<workgroup> c4_t: array<vec2<f32>, 256>;
var<workgroup> c4_a: array<vec4<f32>, 256>;
var<workgroup> c4_l: array<f32, 4>;

@compute @workgroup_size(256)
fn attn_combine4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    c4_merge(wg_index(wid), li);
}

// (Row, head) f's records for a merge (attn_combine4, attn_combine4q): the head's vec4s, a
// record's, the first record, the largest m over the splits and the count of splits holding
// keys (m > −1e30: a prefix of them), the last two by a tree in workgroup memory. Every
// invocation calls it (barriers).
struct C4Head {
    hd4: u32,
    rec: u32,
    b0: u32,
    m: f32,
    ns: u32,
}

fn c4_head(f: u32, li: u32) -> C4Head {
    let hd4 = ad_hd() / 4u;
    let rec = hd4 + 1u;
    let b0 = f * ad_splits() * rec;
    var ms = NEG_BIG;
    if (li < ad_splits()) {
        ms = c4_part[b0 + li * rec].x;
    }
    c4_t[li] = vec2<f32>(ms, select(0.0, f32(li + 1u), ms > -1.0e29));
    workgroupBarrier();
    for (var h = 128u; h > 0u; h >>= 1u) {
        if (li < h) {
            c4_t[li] = max(c4_t[li], c4_t[li + h]);
        }
        workgroupBarrier();
    }
    return C4Head(hd4, rec, b0, c4_t[0].x, u32(c4_t[0].y));
}

// A thread's share of the merge: Σ w · acc (its vec4 vd of the dims) and Σ w · l, w = exp(m_s −
// m), over the splits s ≡ grp mod `groups` below ns, in order, their loads issued 8 at a time
// (attn_combine4: 4 groups; attn_combine4q: 16).
struct C4Sum {
    a: vec4<f32>,
    l: f32,
}

fn c4_sum(hh: C4Head, grp: u32, groups: u32, vd: u32) -> C4Sum {
    let b0 = hh.b0;
    let rec = hh.rec;
    let m = hh.m;
    let ns = hh.ns;
    let hd4 = hh.hd4;
    var a = vec4<f32>(0.0);
    var l = 0.0;
    for (var s0 = grp; s0 < ns; s0 += 8u * groups) {
        var ml: array<vec4<f32>, 8>;
        var av: array<vec4<f32>, 8>;
        for (var u = 0u; u < 8u; u++) {
            let s = s0 + groups * u;
            ml[u] = vec4<f32>(NEG_BIG, 0.0, 0.0, 0.0);
            av[u] = vec4<f32>(0.0);
            if (s < ns) {
                ml[u] = c4_part[b0 + s * rec];
                if (vd < hd4) {
                    av[u] = c4_part[b0 + s * rec + 1u + vd];
                }
            }
        }
        for (var u = 0u; u < 8u; u++) {
            let w = exp(ml[u].x - m);
            a += w * av[u];
            l += w * ml[u].y;
        }
    }
    return C4Sum(a, l);
}

// ---- attn_combine4q (`LILY_WGPU_ATTN_CQ`, the default since stop 48: 1.016× at 4K on the
// H100; `0` takes attn_combine4; decode): attn_combine4 over
// ceil(hd / 64) workgroups a (row, head) f, each 16 vec4 of its dims (the quarter qt: dims
// 64 qt ..), so that a thread (split group li / 16 of 16, vec4 li % 16 of the quarter) adds
// ns / 16 splits instead of ns / 4, their loads issued 8 at a time: at 4K (129 splits) 2 round
// trips to L2 in a row instead of 5, on 4× the workgroups (16 → 64 for the model's 16 heads).
// Every workgroup of a head finds the largest m and the splits holding keys as attn_combine4
// (the same tree). The sum over the splits runs in another order than attn_combine4's (16
// groups, not 4): within F32_TOL of it and of the CPU (the attention tests). Bindings as
// attn_combine4; launch: rows · heads · ceil(hd / 64) workgroups.
var<workgroup> c4q_l: array<f32, 16>;

// The quarters (16 vec4) of a head's dims.
fn c4q_quarters() -> u32 {
    return (ad_hd() / 4u + 15u) / 16u;
}

// attn_combine4q's body for (row, head) f, quarter qt: writes its dims of out and returns this
// thread's vec4 of them (thread li < 16 within the head; zeros past). Every invocation calls it
// (barriers).
fn c4q_merge(f: u32, qt: u32, li: u32) -> vec4<f32> {
    let hh = c4_head(f, li);
    let grp = li / 16u;
    let vd = 16u * qt + li % 16u;
    let sum = c4_sum(hh, grp, 16u, vd);
    c4_a[li] = sum.a;
    if (li % 16u == 0u) {
        c4q_l[grp] = sum.l;
    }
    workgroupBarrier();
    var r = vec4<f32>(0.0);
    if (li < 16u && vd < hh.hd4) {
        var t = vec4<f32>(0.0);
        var lt = 0.0;
        for (var g = 0u; g < 16u; g++) {
            t += c4_a[16u * g + li];
            lt += c4q_l[g];
        }
        let o = f * hh.hd4 + vd;
        r = t / lt * sigmoid4(c4_gate[o]);
        c4_out[o] = r;
    }
    return r;
}

@compute @workgroup_size(256)
fn attn_combine4q(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let w = wg_index(wid);
    c4q_merge(w / c4q_quarters(), w % c4q_quarters(), li);
}

// attn_combine4's body for (row, head) f: writes out and returns this thread's vec4 of it
// (thread li < hd / 4; zeros past). Every invocation calls it (barriers).
fn c4_merge(f: u32, li: u32) -> vec4<f32> {
    let hh = c4_head(f, li);
    let sg = li / 64u;
    let vd = li % 64u;
    let sum = c4_sum(hh, sg, 4u, vd);
    c4_a[li] = sum.a;
    if (vd == 0u) {
        c4_l[sg] = sum.l;
    }
    workgroupBarrier();
    var r = vec4<f32>(0.0);
    if (li < hh.hd4) {
        let t = c4_a[li] + c4_a[64u + li] + c4_a[128u + li] + c4_a[192u + li];
        let lt = c4_l[0] + c4_l[1] + c4_l[2] + c4_l[3];
        let o = f * hh.hd4 + li;
        r = t / lt * sigmoid4(c4_gate[o]);
        c4_out[o] = r;
    }
    return r;
}
