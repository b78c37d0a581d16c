//! wgpu attention ops against the CPU (a module of wgpu_ops.rs; its header states the tolerances).
//!
//! All at F32_TOL per head row: the GPU runs the CPU's arithmetic in f32 with another summation
//! order (online softmax over chunks of 256 keys, split ranges merged for decode) and its own
//! `exp`; the RoPE angles are exact on both sides (f64 on the CPU, 64-bit fixed-point turns on the
//! GPU), sin/cos within an f32 ulp or two. The gate copy and the KV cache appends are EXACT.
//!
//! Both KV cache types where the adapter has SHADER_F16 (`kv_kinds`; `Wgpu::set_kv_f16`): with
//! an f16 cache the CPU is given the K/V rows rounded to f16 (`f16r`, round to nearest even as
//! the GPU's pack2x16float on Vulkan and Metal), so the GPU, which rounds them as it stores
//! them, and the CPU hold the same cache bit for bit and the outputs keep F32_TOL: the test
//! sees every index and mask as in f32. What f16 costs against the f32 CPU is measured by
//! `attention_f16_kv_against_f32` (F16_KV_TOL) and the end-to-end tests (E2E_TOL).

use super::ops::kv_new;
use super::*;
use lily::backend::cpu::CpuStep;
use lily::backend::{AttnStep, Dims, KvCache, OProj};

/// What an f16 KV cache costs against the f32 CPU, per output row (max |gpu − cpu| / max |cpu|).
/// Each K/V element is rounded once to 11 significant bits, relative error ≤ u = 2^-11 (4.9e-4),
/// u/2 on average. V: an output is a p-weighted mean of the rows' values, so its error is the
/// same mean of their roundings: ≤ u of the rows' values, ~u/√3 of them on average relative to
/// the output's own scale when the roundings are independent. K: a score moves by ≤ u ·
/// scale · Σ|q_i k_i| (≈ 12u for this test's needles, whose scores are ~12; ~u for its random
/// keys), each p by that relative amount, the output by that times the spread of the values it
/// averages. Measured on lavapipe (decode, 16/2 heads of 256): see the test's output. 4u leaves
/// room for the worst row of a few hundred while a wrong index or mask moves a row by O(1).
const F16_KV_TOL: f32 = 2e-3;

/// The KV cache types the adapter takes (f32, and f16 where it has SHADER_F16).
fn kv_kinds(g: &Wgpu) -> Vec<bool> {
    if g.report().f16 {
        vec![false, true]
    } else {
        vec![false]
    }
}

/// x rounded to f16 (11 significant bits, nearest even; subnormals to 2^-24), as f32. Values
/// here are far inside f16's range.
fn f16r(x: f32) -> f32 {
    if x.abs() < 6.103_515_6e-5 {
        let q = 2f32.powi(-24);
        return (x / q).round_ties_even() * q;
    }
    let (bits, lsb) = (x.to_bits(), 1u32 << 13);
    let rem = bits & (lsb - 1);
    let mut b = bits & !(lsb - 1);
    if rem > lsb / 2 || (rem == lsb / 2 && b & lsb != 0) {
        b += lsb;
    }
    f32::from_bits(b)
}

/// The values as an f16 cache holds them (`f16`), else as they are.
fn kv_round(v: &[f32], f16: bool) -> Vec<f32> {
    if f16 {
        v.iter().map(|&x| f16r(x)).collect()
    } else {
        v.to_vec()
    }
}

/// The model's shape and the smaller ones the kernels must also take: 32 heads (16 a KV head),
/// head 128 (4 heads a KV head), head 64 (one KV head).
fn shapes() -> Vec<Dims> {
    let qd = qwen_dims();
    vec![
        qd,
        Dims { n_heads: 32, ..qd },
        Dims {
            n_heads: 4,
            head_dim: 128,
            rotary_dim: 32,
            ..qd
        },
        Dims {
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 64,
            rotary_dim: 16,
            ..qd
        },
    ]
}

#[test]
fn attention_qk_norm_rope() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(4);
    let mut gstep = g.new_step().unwrap();
    for d in shapes() {
        let (hq, hd, kvd) = (d.n_heads, d.head_dim, d.n_kv_heads * d.head_dim);
        let qn: Vec<f32> = (0..hd).map(|_| 1.0 + 0.1 * rng.f()).collect();
        let kn: Vec<f32> = (0..hd).map(|_| 1.0 + 0.1 * rng.f()).collect();
        let (gqn, gkn) = (g.upload_vec(&qn).unwrap(), g.upload_vec(&kn).unwrap());
        // Large positions too (angles exact on both sides); the step form reads its position
        // from the step (the host value beside it is wrong on purpose: the step's must win).
        for (rows, pos0, use_step) in [
            (5, 0, false),
            (3, 100_000, false),
            (40, 262_000, false),
            (1, 77_777, true),
            (1, 3, true),
        ] {
            let qg = rng.vec(rows * hq * 2 * hd, 1.0);
            let k = rng.vec(rows * kvd, 1.0);
            let (mut cq, mut cgate, mut ck) = (
                vec![0f32; rows * hq * hd],
                vec![0f32; rows * hq * hd],
                k.clone(),
            );
            Cpu.attn_qk_norm_rope(
                &qg, &mut ck, &qn, &kn, &d, rows, pos0, None, &mut cq, &mut cgate,
            );
            let (mut gq, mut ggate, mut gk) = (
                g.zeros(rows * hq * hd).unwrap(),
                g.zeros(rows * hq * hd).unwrap(),
                g.upload(&k).unwrap(),
            );
            g.set_step(&mut gstep, 0, pos0);
            let (host_pos, step) = if use_step {
                (0, Some(&gstep))
            } else {
                (pos0, None)
            };
            g.attn_qk_norm_rope(
                &g.upload(&qg).unwrap(),
                &mut gk,
                &gqn,
                &gkn,
                &d,
                rows,
                host_pos,
                step,
                &mut gq,
                &mut ggate,
            );
            let what = format!(
                "attn_qk_norm_rope {hq}/{} heads of {hd} rows {rows} pos {pos0}",
                d.n_kv_heads
            );
            check(
                &format!("{what} (q)"),
                rel_rows(&h(&g, &gq, rows * hq * hd), &cq, hd),
                F32_TOL,
            );
            check(
                &format!("{what} (k)"),
                rel_rows(&h(&g, &gk, rows * kvd), &ck, hd),
                F32_TOL,
            );
            check(
                &format!("{what} (gate)"),
                rel_rows(&h(&g, &ggate, rows * hq * hd), &cgate, hd),
                EXACT,
            );
        }
    }
}

/// Two prefill chunks, decode steps, a long chunk (500 rows: many chunks of 256 keys), decode
/// steps, another chunk, a decode: the cache carries over between the ops and must equal the
/// CPU's bit for bit after.
#[test]
fn attention_prefill_then_decode() {
    let Some(g) = gpu() else { return };
    for f16 in kv_kinds(&g) {
        g.set_kv_f16(f16);
        prefill_then_decode(&g, f16);
    }
}

fn prefill_then_decode(g: &Wgpu, f16: bool) {
    let d = qwen_dims();
    let mut rng = Rng(5);
    let (hq, hd, kvd) = (d.n_heads, d.head_dim, d.n_kv_heads * d.head_dim);
    let cap = 20_000;
    let mut ckv = kv_new(&Cpu, cap, kvd);
    let mut gkv = kv_new(g, cap, kvd);
    let mut gstep = g.new_step().unwrap();
    let mut pos = 0;
    for (step, rows) in [64usize, 37, 1, 1, 1, 500, 1, 1, 256, 1]
        .into_iter()
        .enumerate()
    {
        let q = rng.vec(rows * hq * hd, 1.0);
        let k = rng.vec(rows * kvd, 1.0);
        let v = rng.vec(rows * kvd, 1.0);
        let gate = rng.vec(rows * hq * hd, 2.0);
        let mut c = vec![0f32; rows * hq * hd];
        let (gq, gk, gv, gg) = (
            g.upload(&q).unwrap(),
            g.upload(&k).unwrap(),
            g.upload(&v).unwrap(),
            g.upload(&gate).unwrap(),
        );
        let (k, v) = (kv_round(&k, f16), kv_round(&v, f16));
        let mut go = g.zeros(rows * hq * hd).unwrap();
        let what = if rows == 1 {
            Cpu.attn_decode(
                &q,
                &k,
                &v,
                &gate,
                &mut ckv,
                &d,
                pos,
                &CpuStep { token: 0, pos },
                &mut c,
            );
            g.set_step(&mut gstep, 0, pos);
            g.attn_decode(&gq, &gk, &gv, &gg, &mut gkv, &d, pos, &gstep, &mut go);
            format!("attn_decode (f16 KV {f16}) step {step} at pos {pos}")
        } else {
            Cpu.attn_prefill(&q, &k, &v, &gate, &mut ckv, &d, rows, pos, &mut c);
            g.attn_prefill(&gq, &gk, &gv, &gg, &mut gkv, &d, rows, pos, &mut go);
            format!("attn_prefill (f16 KV {f16}) {rows} rows at pos {pos}")
        };
        check(&what, rel_rows(&h(g, &go, rows * hq * hd), &c, hd), F32_TOL);
        pos += rows;
    }
    check(
        &format!("attention KV cache (f16 {f16}) after prefill + decode (K)"),
        rel_rows(&h(g, &gkv.k, cap * kvd), &ckv.k, kvd),
        EXACT,
    );
    check(
        &format!("attention KV cache (f16 {f16}) after prefill + decode (V)"),
        rel_rows(&h(g, &gkv.v, cap * kvd), &ckv.v, kvd),
        EXACT,
    );
}

/// Both caches filled with the same random rows (so a row read past the causal limit, or a row
/// not appended, shows), and the same values on the GPU, in the cache type `kv_zeros` makes
/// now (f16: the rows rounded on both sides).
fn filled_caches(
    g: &Wgpu,
    rng: &mut Rng,
    cap: usize,
    kvd: usize,
) -> (KvCache<Vec<f32>>, KvCache<<Wgpu as Backend>::Buf>) {
    let f16 = g.kv_f16();
    let c = KvCache {
        k: kv_round(&rng.vec(cap * kvd, 1.0), f16),
        v: kv_round(&rng.vec(cap * kvd, 1.0), f16),
        capacity: cap,
    };
    let mut gk = kv_new(g, cap, kvd);
    g.copy(&g.upload(&c.k).unwrap(), 0, &mut gk.k, 0, cap * kvd);
    g.copy(&g.upload(&c.v).unwrap(), 0, &mut gk.v, 0, cap * kvd);
    (c, gk)
}

/// Prefill chunks deep in a filled cache (a prompt's later chunks: keys in many chunks of 256,
/// up to the last row of the cache), in every head shape. Sizes kept small: lavapipe on a CI
/// machine's few cores runs a few GFLOP/s at best.
#[test]
fn attention_prefill_shapes() {
    let Some(g) = gpu() else { return };
    for f16 in kv_kinds(&g) {
        g.set_kv_f16(f16);
        prefill_shapes(&g, f16);
    }
}

fn prefill_shapes(g: &Wgpu, f16: bool) {
    let mut rng = Rng(6);
    for (d, (cap, chunks)) in shapes().into_iter().zip([
        (6000, vec![(40usize, 5000usize), (3, 5997)]),
        (1024, vec![(100, 0), (150, 100)]),
        (1024, vec![(257, 0), (2, 257), (511, 259)]),
        (1024, vec![(255, 0), (512, 255), (257, 767)]),
    ]) {
        let (hq, hd, kvd) = (d.n_heads, d.head_dim, d.n_kv_heads * d.head_dim);
        let (mut ckv, mut gkv) = filled_caches(g, &mut rng, cap, kvd);
        for (rows, pos0) in chunks {
            let q = rng.vec(rows * hq * hd, 1.0);
            let k = rng.vec(rows * kvd, 1.0);
            let v = rng.vec(rows * kvd, 1.0);
            let gate = rng.vec(rows * hq * hd, 2.0);
            let mut c = vec![0f32; rows * hq * hd];
            let (ck, cv) = (kv_round(&k, f16), kv_round(&v, f16));
            Cpu.attn_prefill(&q, &ck, &cv, &gate, &mut ckv, &d, rows, pos0, &mut c);
            let mut go = g.zeros(rows * hq * hd).unwrap();
            g.attn_prefill(
                &g.upload(&q).unwrap(),
                &g.upload(&k).unwrap(),
                &g.upload(&v).unwrap(),
                &g.upload(&gate).unwrap(),
                &mut gkv,
                &d,
                rows,
                pos0,
                &mut go,
            );
            check(
                &format!(
                    "attn_prefill (f16 KV {f16}) {hq}/{} heads of {hd}, {rows} rows at pos {pos0}",
                    d.n_kv_heads
                ),
                rel_rows(&h(g, &go, rows * hq * hd), &c, hd),
                F32_TOL,
            );
        }
        let kv_err = rel_rows(&h(g, &gkv.k, cap * kvd), &ckv.k, kvd).max(rel_rows(
            &h(g, &gkv.v, cap * kvd),
            &ckv.v,
            kvd,
        ));
        check(
            &format!(
                "attn_prefill (f16 KV {f16}) {hq}/{} heads of {hd}: KV cache",
                d.n_kv_heads
            ),
            kv_err,
            EXACT,
        );
    }
}

/// The tiled prefill (attn_tile_gqa: tiles of 32 (row, head) slots, 4 rows of the model's 8
/// heads; keys 8 at a time; keys split over workgroups when tiles are few and keys many) over a
/// prompt of several chunks in a filled cache: chunk lengths not multiples of the tile (130, 7, 1,
/// 333: a last tile of 2, 3, 1, 1 rows), pos0 > 0, and chunks deep in the cache (45 rows at 4000,
/// 3 at 5997: several key splits, attn_tile_gqa_part + attn_combine4; 130 and 333 rows: one
/// split). Needles: chunk row t's key (its KV head) is 0.75 × the query of row t − 1 (head slot
/// (t − 1) % G), a score of about 12: if row t − 1 saw the key one past its own (the causal edge
/// inside a tile or across tiles), its output would move by O(1). Held to F32_TOL against f64 and
/// against the CPU plus the CPU's own error (as the decode test: the CPU's sums over thousands of
/// keys drift by √n·ε). Every head shape the grouped kernels take (group 8, 2, 2).
#[test]
fn attention_prefill_tiled_chunks() {
    let Some(g) = gpu() else { return };
    for f16 in kv_kinds(&g) {
        g.set_kv_f16(f16);
        prefill_tiled_chunks(&g, f16);
    }
}

fn prefill_tiled_chunks(g: &Wgpu, f16: bool) {
    let sh = shapes();
    let mut rng = Rng(12);
    for (d, cap, chunks) in [
        (
            sh[0],
            6000,
            vec![
                (130usize, 0usize),
                (7, 130),
                (1, 137),
                (333, 138),
                (45, 4000),
                (3, 5997),
            ],
        ),
        (sh[2], 2000, vec![(37, 0), (19, 1500)]),
        (sh[3], 2000, vec![(21, 3), (5, 1995)]),
    ] {
        let (hq, kvh, hd) = (d.n_heads, d.n_kv_heads, d.head_dim);
        let (kvd, group) = (kvh * hd, hq / kvh);
        let (mut ckv, mut gkv) = filled_caches(g, &mut rng, cap, kvd);
        for (rows, pos0) in chunks {
            let q = rng.vec(rows * hq * hd, 1.0);
            let mut k = rng.vec(rows * kvd, 1.0);
            let v = rng.vec(rows * kvd, 1.0);
            let gate = rng.vec(rows * hq * hd, 2.0);
            for t in 1..rows {
                let head = (t - 1) % hq;
                let kh = head / group;
                for i in 0..hd {
                    k[t * kvd + kh * hd + i] = 0.75 * q[((t - 1) * hq + head) * hd + i];
                }
            }
            let mut c = vec![0f32; rows * hq * hd];
            let (ck, cv) = (kv_round(&k, f16), kv_round(&v, f16));
            Cpu.attn_prefill(&q, &ck, &cv, &gate, &mut ckv, &d, rows, pos0, &mut c);
            let mut go = g.zeros(rows * hq * hd).unwrap();
            g.attn_prefill(
                &g.upload(&q).unwrap(),
                &g.upload(&k).unwrap(),
                &g.upload(&v).unwrap(),
                &g.upload(&gate).unwrap(),
                &mut gkv,
                &d,
                rows,
                pos0,
                &mut go,
            );
            let gout = h(g, &go, rows * hq * hd);
            let r: Vec<f32> = (0..rows)
                .flat_map(|t| {
                    let o = t * hq * hd;
                    reference_decode(
                        &q[o..o + hq * hd],
                        &gate[o..o + hq * hd],
                        &ckv,
                        &d,
                        pos0 + t,
                    )
                })
                .collect();
            let what =
                format!("attn_prefill (tiled, f16 KV {f16}) {hq}/{kvh} heads of {hd}, {rows} rows at pos {pos0}");
            let cpu_err = rel_rows(&c, &r, hd);
            println!("{what:<66} CPU vs f64 {cpu_err:.2e}");
            check(&format!("{what} vs f64"), rel_rows(&gout, &r, hd), F32_TOL);
            check(&what, rel_rows(&gout, &c, hd), F32_TOL + cpu_err);
        }
        let kv_err = rel_rows(&h(g, &gkv.k, cap * kvd), &ckv.k, kvd).max(rel_rows(
            &h(g, &gkv.v, cap * kvd),
            &ckv.v,
            kvd,
        ));
        check(
            &format!("attn_prefill (tiled, f16 KV {f16}) {hq}/{kvh} heads of {hd}: KV cache"),
            kv_err,
            EXACT,
        );
    }
}

/// Decode against the CPU over capacities whose split counts differ (attn_dec_gqa: ceil(cap /
/// 64) splits, at most 256, each over ceil((pos + 1) / splits) keys but at least one chunk of 32:
/// 1 split at 64, 16 at 1024, 256 at 20000 and 50000; attn_split, the 32-heads shape: at most 32
/// splits of whole 256-key chunks) and
/// positions at the start (0: one key, the step's own), at the edges of chunks and splits, and at
/// the last row. Caches filled with random rows beforehand (a row read past the position shows);
/// needles, key rows that match one query head (a score about 12: much of its attention), sit at
/// chunk and split edges and in the step's own k, so a key skipped, misplaced or counted twice
/// moves that head's output by O(1). After the steps the caches equal the CPU's bit for bit.
///
/// Both decode kernels where the adapter has ordered subgroups (`dec_kernels`): attn_dec_gqa and
/// attn_dec_team (`Wgpu::set_attn_team`), the latter also with V a block ahead
/// (`Wgpu::set_attn_vahead`) and with its splits merged by attn_combine4q (a quarter of a head
/// a workgroup; `Wgpu::set_attn_cq`), each held to the same bounds.
#[test]
fn attention_decode_capacities() {
    let Some(g) = gpu() else { return };
    let cq0 = g.attn_cq();
    for team in dec_kernels(&g) {
        g.set_attn_team(team);
        // (V a block ahead, attn_combine4q.)
        let variants: &[(bool, bool)] = if team {
            &[(false, false), (true, false), (false, true)]
        } else {
            &[(false, false)]
        };
        for &(vahead, cq) in variants {
            g.set_attn_vahead(vahead);
            g.set_attn_cq(cq);
            for f16 in kv_kinds(&g) {
                g.set_kv_f16(f16);
                let built = g.pipelines_built();
                decode_capacities(&g, f16);
                if cq {
                    assert!(
                        g.pipelines_built() > built,
                        "attn_combine4q built no pipeline of its own: it did not run"
                    );
                }
            }
        }
    }
    g.set_attn_cq(cq0);
    g.set_attn_vahead(false);
    g.set_attn_team(false);
}

/// The decode attention kernels the adapter takes: attn_dec_gqa (`false`), and attn_dec_team
/// (`true`) where it has ordered subgroups.
fn dec_kernels(g: &Wgpu) -> Vec<bool> {
    if g.report().subgroups {
        vec![false, true]
    } else {
        vec![false]
    }
}

fn decode_capacities(g: &Wgpu, f16: bool) {
    let kernel = match (g.attn_team(), g.attn_cq()) {
        (true, true) => "attn_dec_team + attn_combine4q",
        (true, false) => "attn_dec_team",
        (false, _) => "attn_dec_gqa",
    };
    let qd = qwen_dims();
    let sh = shapes();
    let cases: Vec<(Dims, usize, Vec<usize>)> = vec![
        (qd, 64, vec![0, 1, 7, 8, 63]),
        (qd, 1024, vec![0, 255, 256, 257, 520, 1023]),
        (qd, 20_000, vec![0, 767, 768, 5000, 19_999]),
        // 256 splits (the most) of 122 and 196 keys: several chunks of 32 a split, the last
        // one partial. (K and V caches 102 MB each: lavapipe binds 128 MiB at most.)
        (qd, 50_000, vec![31_000, 49_999]),
        (sh[1], 1024, vec![0, 9, 700]),
        (sh[2], 1024, vec![0, 100, 1000]),
        (sh[3], 1024, vec![0, 64, 1023]),
    ];
    let mut rng = Rng(11);
    let mut gstep = g.new_step().unwrap();
    for (d, cap, positions) in cases {
        let (hq, kvh, hd) = (d.n_heads, d.n_kv_heads, d.head_dim);
        let (kvd, group) = (kvh * hd, hq / kvh);
        let (mut ckv, mut gkv) = filled_caches(g, &mut rng, cap, kvd);
        for pos in positions {
            let q = rng.vec(hq * hd, 1.0);
            let mut k = rng.vec(kvd, 1.0);
            let v = rng.vec(kvd, 1.0);
            let gate = rng.vec(hq * hd, 2.0);
            // Needle i: KV head i % kvh, its head slot (i / kvh) % group, at key spots[i].
            let spots = [
                0,
                255,
                256,
                767,
                768,
                pos / 3,
                pos / 2,
                pos.saturating_sub(256),
                pos.saturating_sub(1),
                pos,
            ];
            for (i, &j) in spots.iter().enumerate().filter(|(_, &j)| j <= pos) {
                let (kh, head) = (i % kvh, (i % kvh) * group + (i / kvh) % group);
                let row: Vec<f32> = q[head * hd..][..hd].iter().map(|&x| 0.75 * x).collect();
                let row = kv_round(&row, f16);
                if j == pos {
                    k[kh * hd..][..hd].copy_from_slice(&row);
                } else {
                    ckv.k[j * kvd + kh * hd..][..hd].copy_from_slice(&row);
                    g.copy(
                        &g.upload(&row).unwrap(),
                        0,
                        &mut gkv.k,
                        j * kvd + kh * hd,
                        hd,
                    );
                }
            }
            let mut c = vec![0f32; hq * hd];
            Cpu.attn_decode(
                &q,
                &kv_round(&k, f16),
                &kv_round(&v, f16),
                &gate,
                &mut ckv,
                &d,
                pos,
                &CpuStep { token: 0, pos },
                &mut c,
            );
            g.set_step(&mut gstep, 0, pos);
            let go = &decode_both(g, &q, &k, &v, &gate, &mut gkv, &d, pos, &gstep);
            // The CPU op sums its keys one after the other in f32: for a head with no needle
            // (diffuse attention, output ~ 1/√n of its terms) its own error relative to the row
            // grows like √n·ε (≈ 1e-5 at 20000 keys). So the GPU is held to F32_TOL against an
            // f64 reference, and to F32_TOL plus the CPU's own measured error against the CPU.
            let r = reference_decode(&q, &gate, &ckv, &d, pos);
            let gout = h(g, go, hq * hd);
            let what = format!(
                "{kernel} (f16 KV {f16}) {hq}/{kvh} heads of {hd}, capacity {cap}, pos {pos}"
            );
            let cpu_err = rel_rows(&c, &r, hd);
            println!("{:<58} CPU vs f64 {cpu_err:.2e}", what);
            check(&format!("{what} vs f64"), rel_rows(&gout, &r, hd), F32_TOL);
            check(&what, rel_rows(&gout, &c, hd), F32_TOL + cpu_err);
        }
        let kv_err = rel_rows(&h(g, &gkv.k, cap * kvd), &ckv.k, kvd).max(rel_rows(
            &h(g, &gkv.v, cap * kvd),
            &ckv.v,
            kvd,
        ));
        check(
            &format!("{kernel} (f16 KV {f16}) {hq}/{kvh} heads of {hd}, capacity {cap}: KV cache"),
            kv_err,
            EXACT,
        );
    }
}

/// One decode row's gated attention in f64 over the cache's rows 0..=pos (which hold the step's
/// k, v), rounded to f32 at the end.
fn reference_decode(
    q: &[f32],
    gate: &[f32],
    kv: &KvCache<Vec<f32>>,
    d: &Dims,
    pos: usize,
) -> Vec<f32> {
    let (hq, hd) = (d.n_heads, d.head_dim);
    let (kvd, group) = (d.n_kv_heads * hd, hq / d.n_kv_heads);
    let scale = 1.0 / (hd as f64).sqrt();
    let mut out = vec![0f32; hq * hd];
    for h in 0..hq {
        let (qv, kh) = (&q[h * hd..][..hd], h / group);
        let s: Vec<f64> = (0..=pos)
            .map(|j| {
                let k = &kv.k[j * kvd + kh * hd..][..hd];
                qv.iter()
                    .zip(k)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum::<f64>()
                    * scale
            })
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let p: Vec<f64> = s.iter().map(|&x| (x - m).exp()).collect();
        let l: f64 = p.iter().sum();
        let mut o = vec![0f64; hd];
        for (j, &pj) in p.iter().enumerate() {
            for (a, &v) in o.iter_mut().zip(&kv.v[j * kvd + kh * hd..][..hd]) {
                *a += pj * v as f64;
            }
        }
        for (i, a) in o.iter().enumerate() {
            let gv = gate[h * hd + i] as f64;
            out[h * hd + i] = (a / l / (1.0 + (-gv).exp())) as f32;
        }
    }
    out
}

/// A decode or prefill past the cache's capacity, and short buffers, are errors returned by the
/// next sync, not crashes; the backend works after.
#[test]
fn attention_bad_shapes_are_errors() {
    let Some(g) = gpu() else { return };
    let d = qwen_dims();
    let (hq, hd, kvd) = (d.n_heads, d.head_dim, d.n_kv_heads * d.head_dim);
    let cap = 16;
    let mut kv = kv_new(&g, cap, kvd);
    let (q, k, v, gate) = (
        g.zeros(hq * hd).unwrap(),
        g.zeros(kvd).unwrap(),
        g.zeros(kvd).unwrap(),
        g.zeros(hq * hd).unwrap(),
    );
    let mut out = g.zeros(hq * hd).unwrap();
    let mut step = g.new_step().unwrap();
    g.set_step(&mut step, 0, cap);
    g.attn_decode(&q, &k, &v, &gate, &mut kv, &d, cap, &step, &mut out);
    let e = g.sync().expect_err("a decode at the capacity");
    assert!(e.to_string().contains("attn_decode"), "{e}");
    println!("decode past the capacity: {e}");
    // The backend goes on working: a valid step, then a prefill past the end.
    g.set_step(&mut step, 0, cap - 1);
    g.attn_decode(&q, &k, &v, &gate, &mut kv, &d, cap - 1, &step, &mut out);
    g.sync().expect("a valid decode after the error");
    g.attn_prefill(&q, &k, &v, &gate, &mut kv, &d, 1, cap, &mut out);
    let e = g.sync().expect_err("a prefill past the capacity");
    assert!(e.to_string().contains("attn_prefill"), "{e}");
    // Buffers too small for the rows asked.
    g.attn_prefill(&q, &k, &v, &gate, &mut kv, &d, 4, 0, &mut out);
    let e = g
        .sync()
        .expect_err("a prefill of 4 rows from 1-row buffers");
    assert!(e.to_string().contains("attn_prefill"), "{e}");
    let (mut q2, mut gate2, mut k2) = (
        g.zeros(hq * hd).unwrap(),
        g.zeros(hq * hd).unwrap(),
        g.zeros(kvd).unwrap(),
    );
    let qn = g.zeros(hd).unwrap();
    g.attn_qk_norm_rope(&q, &mut k2, &qn, &qn, &d, 1, 0, None, &mut q2, &mut gate2);
    let e = g.sync().expect_err("qg of one row holds half of it");
    assert!(e.to_string().contains("attn_qk_norm_rope"), "{e}");
}

/// One decode step from q_proj's output (`attn_decode_qk`: qk_rope_append_step, then the
/// attention) at every shape, against the CPU's composition (attn_qk_norm_rope, attn_decode):
/// a short prefill, then steps, each with fresh q|gate, k and v. The output at F32_TOL per head;
/// the caches after: V EXACT (copies), K at F32_TOL (normed and rotated on each side).
#[test]
fn attention_decode_qk_appends_in_the_rope_launch() {
    let Some(g) = gpu() else { return };
    for f16 in kv_kinds(&g) {
        g.set_kv_f16(f16);
        decode_qk_appends(&g, f16);
    }
}

fn decode_qk_appends(g: &Wgpu, f16: bool) {
    let mut rng = Rng(6);
    for d in shapes() {
        let (hq, hd, kvd) = (d.n_heads, d.head_dim, d.n_kv_heads * d.head_dim);
        let cap = 700;
        let mut ckv = kv_new(&Cpu, cap, kvd);
        let mut gkv = kv_new(g, cap, kvd);
        let qn: Vec<f32> = (0..hd).map(|_| 1.0 + 0.1 * rng.f()).collect();
        let kn: Vec<f32> = (0..hd).map(|_| 1.0 + 0.1 * rng.f()).collect();
        let (gqn, gkn) = (g.upload_vec(&qn).unwrap(), g.upload_vec(&kn).unwrap());
        // A prefill of 300 rows (already normed keys: only the cache matters).
        let (k, v) = (rng.vec(300 * kvd, 1.0), rng.vec(300 * kvd, 1.0));
        let (q, gate) = (rng.vec(300 * hq * hd, 1.0), rng.vec(300 * hq * hd, 1.0));
        let mut c = vec![0f32; 300 * hq * hd];
        let (ck, cv) = (kv_round(&k, f16), kv_round(&v, f16));
        Cpu.attn_prefill(&q, &ck, &cv, &gate, &mut ckv, &d, 300, 0, &mut c);
        let mut go = g.zeros(300 * hq * hd).unwrap();
        let up = |x: &[f32]| g.upload(x).unwrap();
        g.attn_prefill(
            &up(&q),
            &up(&k),
            &up(&v),
            &up(&gate),
            &mut gkv,
            &d,
            300,
            0,
            &mut go,
        );
        let mut gstep = g.new_step().unwrap();
        for pos in 300..305 {
            let qg = rng.vec(hq * 2 * hd, 1.0);
            let k = rng.vec(kvd, 1.0);
            let v = rng.vec(kvd, 1.0);
            let (mut cq, mut cg, mut co) = (
                vec![0f32; hq * hd],
                vec![0f32; hq * hd],
                vec![0f32; hq * hd],
            );
            let cstep = CpuStep { token: 0, pos };
            Cpu.attn_decode_qk(AttnStep {
                qg: &qg,
                k: &mut k.clone(),
                v: &v,
                q_norm: &qn,
                k_norm: &kn,
                kv: &mut ckv,
                d: &d,
                pos,
                step: &cstep,
                q: &mut cq,
                gate: &mut cg,
                out: &mut co,
            });
            let mut gk = up(&k);
            let (mut gq, mut gg, mut gout) = (
                g.zeros(hq * hd).unwrap(),
                g.zeros(hq * hd).unwrap(),
                g.zeros(hq * hd).unwrap(),
            );
            g.set_step(&mut gstep, 0, pos);
            g.attn_decode_qk(AttnStep {
                qg: &up(&qg),
                k: &mut gk,
                v: &up(&v),
                q_norm: &gqn,
                k_norm: &gkn,
                kv: &mut gkv,
                d: &d,
                pos,
                step: &gstep,
                q: &mut gq,
                gate: &mut gg,
                out: &mut gout,
            });
            // An f16 cache rounds this step's k and v, the CPU's (f32) does not.
            let what = format!("attn_decode_qk (f16 KV {f16}) {hq} heads of {hd} at pos {pos}");
            let tol = if f16 { F16_KV_TOL } else { F32_TOL };
            check(&what, rel_rows(&h(g, &gout, hq * hd), &co, hd), tol);
        }
        // f16: the GPU's k (within F32_TOL of the CPU's) rounded may land an f16 ulp (2^-10 of
        // the element at most) from the CPU's rounded; v is rounded from the same values.
        let n = 305 * kvd;
        let ktol = if f16 { 1.0 / 1024.0 } else { F32_TOL };
        check(
            &format!("attn_decode_qk (f16 KV {f16}) {hq} heads of {hd}: the K cache"),
            rel_rows(&h(g, &gkv.k, n), &kv_round(&ckv.k[..n], f16), kvd),
            ktol,
        );
        check(
            &format!("attn_decode_qk (f16 KV {f16}) {hq} heads of {hd}: the V cache"),
            rel_rows(&h(g, &gkv.v, n), &kv_round(&ckv.v[..n], f16), kvd),
            EXACT,
        );
    }
}

/// Opt-in `LILY_WGPU_XQ_AHEAD` (`attn_decode_qk_add`; `Wgpu::set_xq_ahead`): attn_combine4_x
/// stages o_proj's x as it writes the attention's output (xq.wgsl's xq_put on the values it
/// writes, the words q2x_stage would stage from them), and o_proj's gemv_q6 reads it: against
/// the same op with it off (attn_decode_qk, q2x_stage, gemv_q6), on two caches filled alike, at
/// the model's shape (16 / 2 heads of 256, o_proj 4-bit [2048, 4096]) after a prefill of 300,
/// three steps. The output and h after o_proj: bit-equal (the same values staged by the same
/// function). Launches: one fewer. Then staged by attn_combine4q_x (`Wgpu::set_attn_cq`: a
/// quarter of a head a workgroup, the splits summed in another order): the output within
/// F32_TOL, h within Q2X_TOL (o_proj's x staged from those values), the same launches.
#[test]
fn attention_decode_add_stages_o_proj() {
    let Some(g) = gpu() else { return };
    let d = shapes()
        .into_iter()
        .find(|d| d.head_dim == 256 && d.n_heads == 16)
        .unwrap();
    let (hq, hd, kvd, hid) = (d.n_heads, d.head_dim, d.n_kv_heads * d.head_dim, 2048);
    let mut rng = Rng(61);
    let wo = g
        .upload_mat(&ops::rand_quant(&mut rng, 1, hid, hq * hd, 4, 64, false))
        .unwrap();
    let qn: Vec<f32> = (0..hd).map(|_| 1.0 + 0.1 * rng.f()).collect();
    let gqn = g.upload_vec(&qn).unwrap();
    let up = |x: &[f32]| g.upload(x).unwrap();
    let (k, v) = (rng.vec(300 * kvd, 1.0), rng.vec(300 * kvd, 1.0));
    let (q, gate) = (rng.vec(300 * hq * hd, 1.0), rng.vec(300 * hq * hd, 1.0));
    let mut caches: Vec<_> = (0..2).map(|_| kv_new(&g, 400, kvd)).collect();
    for kv in caches.iter_mut() {
        let mut go = g.zeros(300 * hq * hd).unwrap();
        g.attn_prefill(
            &up(&q),
            &up(&k),
            &up(&v),
            &up(&gate),
            kv,
            &d,
            300,
            0,
            &mut go,
        );
    }
    let cq0 = g.attn_cq();
    let mut gstep = g.new_step().unwrap();
    for pos in 300..303 {
        let (qg, k, v, h0) = (
            rng.vec(hq * 2 * hd, 1.0),
            rng.vec(kvd, 1.0),
            rng.vec(kvd, 1.0),
            rng.vec(hid, 1.0),
        );
        g.set_step(&mut gstep, 0, pos);
        let mut got = Vec::new();
        // The third: staged by attn_combine4q_x (a quarter of a head a workgroup), on the
        // second cache again (its row pos rewritten with the same k, v).
        for (run, (staged, cq)) in [(false, false), (true, false), (true, true)]
            .into_iter()
            .enumerate()
        {
            let kv = &mut caches[run.min(1)];
            g.set_xq_ahead(staged);
            g.set_attn_cq(cq);
            let (mut gq, mut gg, mut gout) = (
                g.zeros(hq * hd).unwrap(),
                g.zeros(hq * hd).unwrap(),
                g.zeros(hq * hd).unwrap(),
            );
            let (mut gr, mut gh) = (g.zeros(hid).unwrap(), up(&h0));
            g.sync().unwrap();
            let n0 = g.dispatches();
            let o = OProj {
                w: &wo,
                r: &mut gr,
                h: &mut gh,
                next: None,
            };
            let (mut gk, gv) = (up(&k), up(&v));
            let a = AttnStep {
                qg: &up(&qg),
                k: &mut gk,
                v: &gv,
                q_norm: &gqn,
                k_norm: &gqn,
                kv,
                d: &d,
                pos,
                step: &gstep,
                q: &mut gq,
                gate: &mut gg,
                out: &mut gout,
            };
            g.attn_decode_qk_add(a, o);
            let n = g.dispatches() - n0;
            got.push((h(&g, &gout, hq * hd), h(&g, &gh, hid), n));
        }
        g.set_xq_ahead(false);
        g.set_attn_cq(cq0);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let what = format!("attn_decode_qk_add at pos {pos}");
        // attn_combine4q_x sums the splits in another order: F32_TOL on the output; o_proj's
        // x is staged from those values, Q2X_TOL on h.
        check(
            &format!("{what}, attn_combine4q_x: the attention's output"),
            rel_rows(&got[2].0, &got[0].0, hd),
            F32_TOL,
        );
        check(
            &format!("{what}, attn_combine4q_x: h after o_proj"),
            rel_rows(&got[2].1, &got[0].1, hid),
            Q2X_TOL,
        );
        assert_eq!(got[2].2, got[1].2, "{what}, attn_combine4q_x: launches");
        assert_eq!(
            bits(&got[1].0),
            bits(&got[0].0),
            "{what}: the attention's output"
        );
        assert_eq!(bits(&got[1].1), bits(&got[0].1), "{what}: h after o_proj");
        assert_eq!(got[1].2 + 1, got[0].2, "{what}: launches");
    }
}

/// What an f16 KV cache costs (F16_KV_TOL's reasoning): decode at the model's shape over a
/// random cache with needles (scores ~12) against the CPU on the unrounded f32 rows, and the
/// same launch on an f32 cache at F32_TOL as the control. Positions across several splits.
#[test]
fn attention_f16_kv_against_f32() {
    let Some(g) = gpu() else { return };
    if !g.report().f16 {
        eprintln!("skipping: the adapter has no SHADER_F16 (the KV cache is f32)");
        return;
    }
    let d = qwen_dims();
    let (hq, kvh, hd) = (d.n_heads, d.n_kv_heads, d.head_dim);
    let (kvd, group) = (kvh * hd, hq / kvh);
    let cap = 4096;
    let mut rng = Rng(21);
    let ck = rng.vec(cap * kvd, 1.0);
    let cv = rng.vec(cap * kvd, 1.0);
    let mut gstep = g.new_step().unwrap();
    let mut worst = [0f32; 2];
    for pos in [100usize, 1000, 4095] {
        let q = rng.vec(hq * hd, 1.0);
        let gate = rng.vec(hq * hd, 2.0);
        let mut c = KvCache {
            k: ck.clone(),
            v: cv.clone(),
            capacity: cap,
        };
        // A needle for each query head, at spread keys before pos.
        for head in 0..hq {
            let (kh, j) = (head / group, (head * 7919) % pos);
            for i in 0..hd {
                c.k[j * kvd + kh * hd + i] = 0.75 * q[head * hd + i];
            }
        }
        let (k, v) = (
            c.k[pos * kvd..][..kvd].to_vec(),
            c.v[pos * kvd..][..kvd].to_vec(),
        );
        let mut co = vec![0f32; hq * hd];
        Cpu.attn_decode(
            &q,
            &k,
            &v,
            &gate,
            &mut c,
            &d,
            pos,
            &CpuStep { token: 0, pos },
            &mut co,
        );
        for (i, f16) in [false, true].into_iter().enumerate() {
            g.set_kv_f16(f16);
            let mut gkv = kv_new(&g, cap, kvd);
            g.copy(&g.upload(&c.k).unwrap(), 0, &mut gkv.k, 0, cap * kvd);
            g.copy(&g.upload(&c.v).unwrap(), 0, &mut gkv.v, 0, cap * kvd);
            g.set_step(&mut gstep, 0, pos);
            let go = &decode_both(&g, &q, &k, &v, &gate, &mut gkv, &d, pos, &gstep);
            let e = rel_rows(&h(&g, go, hq * hd), &co, hd);
            worst[i] = worst[i].max(e);
            println!("attn_decode f16 KV {f16} vs the f32 CPU at pos {pos}: {e:.2e}");
        }
    }
    g.set_kv_f16(true);
    check("attn_decode, f32 KV vs the f32 CPU", worst[0], F32_TOL);
    check("attn_decode, f16 KV vs the f32 CPU", worst[1], F16_KV_TOL);
}

/// `attn_decode` of one row without and with the specialised kernels (`LILY_WGPU_SPEC` attn:
/// the same arithmetic, so the same bits, asserted); the second run appends the same row again.
/// Returns the first run's output.
#[allow(clippy::too_many_arguments)]
fn decode_both(
    g: &Wgpu,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    gate: &[f32],
    gkv: &mut lily::backend::KvCache<<Wgpu as Backend>::Buf>,
    d: &Dims,
    pos: usize,
    step: &<Wgpu as Backend>::Step,
) -> <Wgpu as Backend>::Buf {
    let n = d.n_heads * d.head_dim;
    let mut outs = Vec::new();
    for spec in ["", "attn"] {
        g.set_spec(spec).unwrap();
        let mut go = g.zeros(n).unwrap();
        g.attn_decode(
            &g.upload(q).unwrap(),
            &g.upload(k).unwrap(),
            &g.upload(v).unwrap(),
            &g.upload(gate).unwrap(),
            gkv,
            d,
            pos,
            step,
            &mut go,
        );
        outs.push(go);
    }
    g.set_spec("").unwrap();
    assert!(
        h(g, &outs[1], n) == h(g, &outs[0], n),
        "attn_decode specialised differs ({}/{} heads of {}, capacity {}, pos {pos})",
        d.n_heads,
        d.n_kv_heads,
        d.head_dim,
        gkv.capacity
    );
    outs.swap_remove(0)
}
