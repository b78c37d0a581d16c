//! The CUDA backend's switches: the decode-path optimisations that can be turned off for ablations
//! (`SWITCHES`, `LILY_CUDA_DISABLE`), the variants that are off unless asked for (`OPT_IN`,
//! `LILY_CUDA_ENABLE`), each with what was measured, and the timing probe that leaves kernels out
//! of recorded steps (`set_skip`, `LILY_CUDA_SKIP`).

use std::collections::HashSet;

use anyhow::{anyhow, Result};

use super::{Cuda, Records};

/// The decode-path optimisations that can be switched off, each against an otherwise identical
/// engine (`LILY_CUDA_DISABLE=name,name`, `Cuda::set_disabled`):
/// * `stream_gemv`: the weight-streaming decode GEMVs (decode.rs, gemv.cu); off, the warp-per-row
///   GEMVs of matmul.cu (which also turns the fusions below off: they live in those kernels);
/// * `fuse_norm`: the RMS norm inside the projections' launch; off, its own kernel first;
/// * `fuse_residual`: the residual add in the output projections' epilogue; off, an add kernel;
/// * `fuse_moe`: the routed + shared experts as two streaming launches with the combine and the
///   residual add in the second; off, moe_gate_up, moe_down, moe_combine and an add;
/// * `fuse_route`: the top-k routing in the last block of the router's launch; off, moe_route;
/// * `tc_gemv`: the streaming GEMVs of K = 2048 outside the MoE block (GDN in_proj, attention
///   q|k|v, lm_head) on tensor cores with cp.async staging (gemv.cu's tc_gemv_*); off, the SIMT
///   loop. Measured on the H200 (`lily lab`): in_proj 13.4 -> 11.5 us, q|k|v 12.4 -> 10.6,
///   lm_head 118 -> 102.
/// * `pdl_step`: programmatic dependent launch for the kernels of a recorded decode step (the
///   `pdl` field says what was measured); off, plain stream order.
/// * `gdn_step`: a GDN layer's conv1d_step, gated delta step and gated norm as ONE kernel
///   between in_proj and out_proj (gdn.cu's gdn_step_<K>: 128 blocks in clusters of 8, one per
///   key head; the state requested before the PDL wait): -60 kernels per token, the same bits as
///   the three kernels (cuda_ops). Decode 491 against 464 tok/s at 4K, 448 against 423 at 32K on
///   the H200 (two rounds alternated); off, conv1d_step + gdn_scan + gdn_gated_norm.
/// * `moe_wide`: the decode experts (with `fuse_moe`) as moe.cu's moe_wide_*: the same two
///   launches and function as moe_sw_*, but every block requests all of its weights at once
///   (cp.async into shared memory, one commit group per row group), the shared expert's gate|up
///   and all of down's weights before the PDL wait. Full-model shapes (hidden 2048, width 512);
///   `LILY_CUDA_MOE_WIDE=RPB,DR` sets the rows per block (see decode.rs moe_wide_rows). Lab:
///   11.6 against 13.7 us per layer at 16,8; off, moe_sw_*.
/// * `route_block`: the router's top-k route (in sw_gemv_8's last block, switch `fuse_route`)
///   by the whole block, each expert's slot its count of better experts (route.cuh
///   route_block), rather than one warp's k dependent arg-max rounds (route_warp): the same ids
///   and weights bit for bit (cuda_ops, exact ties included). Decode on the H200 (two rounds
///   alternated): 4K 556.0 / 547.1 against 539.5 / 539.3 tok/s, 128K 389.7 / 390.5 against
///   385.5 / 380.9; off, route_warp.
/// * `down_tma`: moe_wide's down (with `moe_wide`) with each slot's rows fetched by the Tensor
///   Memory Accelerator (moe.cu moe_tma_down: three cp.async.bulk copies a slot, codes, scales
///   and biases row-major, issued by the slot's lane 0 before the PDL wait and counted on an
///   mbarrier) instead of 16-byte cp.async by every lane: the same SwUnit values, so the same
///   bits (cuda_ops moe_step test, which also asserts the kernel ran). Why: down's dots waited on
///   its weights (stop 52's trace: 2.06 µs from x to the dots' end), and the skeleton's chainT
///   (stop 54, H100) puts a bulk-copied chain phase at 3.90 against 4.45 µs at 8.4 MB, 3.35
///   against 3.75 at 6.3 MB. Measured at stop 54 (H100, `lily bench --arms`, alternated): decode
///   at 4K 569.83 against 561.47 tok/s (1.015x, 4 rounds, every round above every default
///   round), at 128K 360.43 against 358.64 (1.005x, 2 rounds). Off-GPU the lab's experts read
///   13.29 against 12.34 µs back to back: the gain is in place, where the copies run ahead of
///   gate|up. Its ablation at stop 56 (H100, the same arms, `LILY_CUDA_DISABLE=down_tma`): 4K
///   568.94 against 561.34 tok/s off (1.013x), 128K 363.42 against 359.31 (1.011x). Off,
///   moe_wide_down (per-lane cp.async).
/// * `attn_early`: the decode attention (attn_decode_<HD>) with each warp's first chunk of keys
///   requested before the PDL wait (attention.cu attn_decode_early_<HD>): the position is the
///   step's, known before the kernel before ends, and every key of that chunk older than it (the
///   launch writes only row pos), so its DRAM latency leaves the critical path. The same partial
///   states, bit for bit (cuda_ops attention_decode_capacities). Why: stop 57's kv_read probe
///   (H100) read the attention's cache at the plain read's rate in every layout, depth and warp
///   count (32,768 keys: 23.3 µs for 67 MB), while attn_decode + combine took 32.5 µs: the gap is
///   fixed cost, not the read. Measured at stop 57 (H100, binaries of 63f38fc, where it was an
///   opt-in): alone (a CUDA graph over L2-cold caches) 6.4 / 11.1 / 31.5 µs against 7.3 / 12.5 /
///   32.5 at 256 / 4,096 / 32,768 keys; decode (`lily bench --arms`, 2 rounds) 571.01 against
///   568.77 tok/s at 4K (1.004x), 506.34 against 505.04 at 32K (1.003x), 361.07 against 362.76
///   at 128K (0.995x). As the default (H100, binaries of 0ec2155, `LILY_CUDA_DISABLE=attn_early`
///   as the arm, 4 rounds at 4K and 32K, 2 at 128K): 571.34 against 568.98 tok/s at 4K (1.004x;
///   three of four rounds above every round off), 506.33 against 504.76 at 32K (1.003x), 363.89
///   against 359.88 at 128K (1.011x); alone 6.4 / 11.0 / 31.4 / 95.4 µs against 7.3 / 12.5 /
///   32.9 / 96.4 at 256 / 4,096 / 32,768 / 131,072 keys. Off, attn_decode_<HD>.
/// * `attn_pf` (stop 58, the default since stop 59): the decode attention as
///   attn_decode_pf_<HD>: attn_early's kernel plus, in the key loop, each warp's chunk two steps
///   ahead requested into the L2 (`prefetch.global.L2`, two a lane a chunk, no registers), so
///   the register loads of the next chunk hit the L2 and the DRAM has about two chunks a warp in
///   flight instead of one. The same partial states (cuda_ops attention_decode_capacities:
///   bit-equal to attn_early's and the plain kernel's at every position). Why: stop 58's trace at
///   128K puts the attention's marginal read at 2.66 TB/s in place against 3.09 alone; with one
///   chunk a warp in registers (~58 KiB an SM in flight) the read tolerates ~2.5 µs of latency at
///   3.1 TB/s and no more. Measured at stop 59 (H100, binaries of 979cb78 where it was an
///   opt-in; `lily bench --arms`, alternated, 64 tokens): 571.13 against 570.96 tok/s at 4K
///   (1.000x, 4 rounds), 506.95 against 505.67 at 32K (1.003x, 4 rounds), 366.16 against 361.12
///   at 128K (1.014x, 2 rounds, both above both default rounds); the full preset's 48 greedy ids
///   equal. Alone (a CUDA graph over L2-cold caches) it is slower: 32.3 / 97.4 µs against 31.5 /
///   95.7 at 32,768 / 131,072 keys: the prefetch pays in place only. Stop 59 also found that the
///   cache's footprint does not slow the read alone (5 caches of 268 MB: 95.2 µs, 1 cache: 95.2).
///   Off, attn_decode_early_<HD>; `attn_early` off turns both off (attn_decode_<HD>).
pub const SWITCHES: &[&str] = &[
    "stream_gemv",
    "fuse_norm",
    "fuse_residual",
    "fuse_moe",
    "fuse_route",
    "tc_gemv",
    "pdl_step",
    "gdn_step",
    "moe_wide",
    "route_block",
    "down_tma",
    "attn_early",
    "attn_pf",
];
/// The switches that do not live in the streaming kernels (`stream_gemv` off leaves them as set).
pub(super) const OUTSIDE_STREAM: &[&str] = &["stream_gemv", "pdl_step", "attn_early", "attn_pf"];

/// Decode-path variants that are off unless asked for (`LILY_CUDA_ENABLE=name`,
/// `Cuda::set_enabled`): correct, but not faster where measured. Removed at stop 55 as clear losers
/// (their code is in git before that stop): `router_cluster` (the router as one cluster, 0.98x at
/// 4K on the H200: the cluster launch cost more than the ticket it removed) and `gemv_wide` (every
/// projection block's weights requested at once, 0.86x: a block that waits for its whole share
/// before its dot has nothing to overlap the wait with). Removed at stop 56 as losers on the H100
/// (H100 80GB HBM3, binaries of b25e4cd; their code is in git before that stop), each `down_tma`'s
/// bulk copies (cp.async.bulk into shared memory, counted on an mbarrier) tried elsewhere; decode
/// from `lily bench --arms` (alternated in one process, 64 tokens, 4 rounds at 4K and 2 at 128K)
/// against the defaults' 568.94 and 363.42 tok/s: `proj_tma` (out_proj and o_proj's one batch a
/// block by bulk copies): lab out_proj / o_proj 3.96 against 3.48 µs (1.23 and 1.08 times their
/// pure read), decode 568.75 at 4K (1.000x), 360.15 at 128K (0.991x); `tc_tma` (tc_gemv's stages
/// filled by bulk copies): lab in_proj 10.51-10.55 against 8.59 µs, q|k|v 8.98-9.00 against 7.70,
/// lm_head 111.1-111.3 against 101.9 (with `LILY_CUDA_TC_S=4` in_proj 11.03, q|k|v 8.73), decode
/// 546.73 (0.961x) and 353.75 (0.973x); `gu_tma` (moe_wide's gate|up rows by bulk copies, one pair
/// of copies a warp; its first form, warp 0's lanes issuing all the copies, 0.970x at 4K at stop
/// 54): decode 558.32 (0.981x) and 358.34 (0.986x). Also removed at stop 56: `attn_ring` (the
/// decode attention with each warp's K and V chunks staged through a 3-stage shared-memory ring
/// by 16-byte cp.async, two chunks in flight a warp where attn_decode_<HD>'s registers hold one;
/// the same bits, cuda_ops): slower at every length on the H100 (binaries of ebd457a, the same
/// arms, 2 rounds): 563.97 against 565.91 tok/s at 4K (0.997x), 497.16 against 501.55 at 32K
/// (0.991x), 351.52 against 357.17 at 128K (0.984x); alone (attn_decode_timings, a CUDA graph
/// over L2-cold caches) 118.5 against 98.2 µs at 131,072 keys (2.27 against 2.73 TB/s), 38.8
/// against 32.9 at 32,768. Why is a guess, not measured: the register form's one chunk a warp
/// already keeps HBM as busy as 8 warps an SM can, and the ring adds a shared-memory write and
/// read of every byte (and 16 LDGSTS a lane a chunk) to each chunk's path. Removed at stop 57:
/// `attn_cluster` / `attn_cluster4` (the decode attention as one launch, attn_decode_combine
/// folded in: clusters of 8 or 4 blocks along the splits merging their states over distributed
/// shared memory, the last block of a head group (a fence, a ticket) merging the clusters' and
/// writing the gated output; -10 kernels a token; splits = the clusters the GPU holds at once,
/// 56 a head group against 66 on the H100; code at 63f38fc): correct (cuda_ops: held to the
/// CPU, recorded steps equal to direct ones, the full preset's greedy ids equal) but slower at
/// every length on the H100 (binaries of 63f38fc, `lily bench --arms`, 2 rounds): 549.48 / 543.83
/// against 568.77 tok/s at 4K (0.966x / 0.956x), 485.31 / 483.28 against 505.04 at 32K (0.961x
/// / 0.957x), 348.50 / 347.53 against 362.76 at 128K (0.961x / 0.958x); alone (a CUDA graph over
/// L2-cold caches) 17.8 / 19.9 against 12.5 µs at 4,096 keys, 38.8 / 40.1 against 32.5 at
/// 32,768. The tail (two cluster barriers, the DSMEM merge, a fence and a ticket, then one block
/// reading the clusters' states element by element) cost more than the combine's launch, and
/// 56 splits stream less than 66.
/// Also removed at stop 57: `attn_l2` (attn_early plus a bulk L2 prefetch,
/// `cp.async.bulk.prefetch.L2`, of each warp's next two chunks' rows before the PDL wait; code at
/// 1461d76): bit-equal, but no gain (H100, binaries of 0ec2155, against the defaults in the arms
/// of `attn_early`): 571.08 against 571.34 tok/s at 4K (1.000x), 507.92 against 506.33 at 32K
/// (1.003x), 361.30 against 363.89 at 128K (0.993x); alone 6.4 / 11.1 / 31.4 / 95.2 µs, as the
/// default's. The lead before the wait is too short to fill much of L2.
/// Removed at stop 58: `l2_pin` (code at 4ea05c2: Backend::upload_mat_hot / upload_vec_hot put
/// the routers, shared-expert gates, norm weights and GDN conv taps and gate parameters in one
/// arena, and every launch carried an L2 access policy window over it, its lines persisting in a
/// set-aside of the arena's size, 31.25 MiB on the H100): the same bits (recorded steps, the
/// full preset's greedy ids), slower at every length (H100, `lily bench --arms`, 4 rounds at 4K
/// and 32K, 2 at 128K): 564.38 against 573.33 tok/s at 4K (0.984x), 499.56 against 507.71 at
/// 32K (0.984x), 353.92 against 362.91 at 128K (0.975x). The set-aside takes 31 of the L2's 50
/// MB from the streaming reads; whatever the router's late blocks gained did not show.
/// * `tc_all`: the tensor-core streaming dot (switch `tc_gemv`) also for the other widths (K 512,
///   1024, 4096: out_proj, o_proj) and the MoE experts (moe.cu's moe_tc_*). Correct (cuda_ops) but
///   measured slower on the H200 than the SIMT kernels there: out_proj 5.3 against 4.4 us, the
///   experts 17.0 against 13.2 (one wave of blocks: the staging has nothing to overlap).
/// * `fuse_gdn`: a GDN layer's decode mixer in three launches (the conv in the projections'
///   epilogue, the scan, the gated norm in out_proj's prologue with the residual add). Correct
///   on the H200 but measured slower there (439 against 457 tok/s at 4K).
/// * `moe_step`: an MoE block's router (norm, router | shared gate GEMV, top-k) folded into
///   moe_wide's gate|up launch (moe.cu's moe_step_gate_up_*, Backend::moe_step_add): -40
///   kernels per token, no launch boundary between the router and the experts' loads. Bit-equal
///   to the composition on the H200 (cuda_ops) but slower there: decode at 4K 505.5 / 503.8
///   against 531.5 / 538.0 tok/s, at 128K 357.9 / 361.1 against 382.6 / 386.8 (two rounds
///   alternated, commit of the unrolled norm). Its probes (LILY_MOE_STEP_PROBE) put the
///   routed blocks' wait for the router blocks' count at 3.1 µs a layer and each block's own
///   route at 3.1: more than the launch boundary it removes.
/// * `attn_fold`: a decode step's attn_qk_norm_rope folded into attn_decode's launch
///   (Backend::attn_decode_qk; attention.cu attn_decode_qk_<HD>): every block norms and rotates
///   its group's 8 query heads and its key itself (the same bits: attn_qk_norm_rope's arithmetic
///   in its order) before its key loop: one launch boundary fewer per attention layer. Bit-equal
///   to the composition on the H200 (cuda_ops, four shapes), but not faster: decode at 4K 550.4 /
///   555.9 against 545.0 / 554.3 tok/s, at 128K 387.3 / 386.3 against 400.0 / 398.2 (two rounds
///   alternated). Every one of the 132 blocks now norms and rotates 9 rows before its first key
///   load, where the separate kernel did it once, in parallel over 18 blocks: at 128K, where
///   each block streams 2 MB of cache, that delay costs more than the boundary saved. And
///   found after the measurement (no device time left to re-run it): with the newest key in
///   shared memory, one pointer that could be shared or global made every K load of the key
///   loop a generic ld.v4. Now the loop loads the cache alone (ld.global.v4; row pos read but
///   unused) and the one chunk holding pos has its key replaced from shared memory after a
///   warp-uniform test (attention.cu dec_patch_k): the key loop is 415 SASS instructions at HD
///   256 against the plain kernel's 401 (`scripts/sass`; the measured version had 404 with 8
///   generic loads). Also since: only the two blocks that use the key (its cache writer, the
///   last split with keys) norm it, so no warp of the others has two rows, and blocks past the
///   keys' share skip the rows. Next: `scripts/h200-run tests,fold`.
/// * `carveout_all`: the largest shared-memory carveout asked for every kernel, not only the
///   tensor-core and streaming ones (device.rs `func`; read when a kernel is first loaded, so set
///   it at creation: `LILY_CUDA_ENABLE`). Why it was tried: stop 23's first trace (`lily bench
///   --trace`) put the boundary from the experts' down (moe_wide_*, no carveout asked) to the
///   next layer's tc_gemv (61 KiB of stages a block, carveout 100) at 2.9 µs where the step's
///   other boundaries were ~0.7, as if an SM had to drain to re-split its L1. Not faster on the
///   H200 (`scripts/h200-run carve`, 4K, alternated): 546.8 / 550.2 against 555.4 tok/s; and the
///   second trace (with marks) put that boundary at 1.3 µs without it.
/// * `late_route`: an MoE block's top-k route moved out of the router's launch (Backend::
///   moe_step_add; decode.rs moe_step): the router | shared gate a plain streaming GEMV (no
///   fence, ticket or route in a last block), and every routed gate|up block (after its PDL wait)
///   and every down block (before its own) routing the logits itself (moe.cu's moe_late_*,
///   route.cuh route_sort for k <= 8): the composition's bits (cuda_ops). Why: the in-place trace
///   puts the router's chain after its dots at 4.1 µs a layer (fence, ticket, logits read back,
///   route), and gate|up reads the ids after its wait anyway. Correct on the H200 (cuda_ops;
///   greedy ids of the full preset equal to the default's, `h200-run optcheck`) but not faster
///   (4K, two rounds alternated): 574.9 / 566.4 against 571.1 / 563.6 tok/s, 128K 400.7 / 399.2
///   against 397.9 / 401.6. In place the router went 10.5 -> 6.5 µs a layer and gate|up 8.3 ->
///   11.0 (its wait -> rows requested 4.0 -> 8.0): the route moved onto gate|up's critical path
///   costs as much latency as the ticket it removes. With route_block in every block instead of
///   route_sort it was 15% slower (491 against 575: route_block's rank loop, every thread against
///   all 256 experts, run by 544 blocks at once). Stop 23's `route_experts` (gate|up only,
///   removed) was the same idea: 528.2 / 532.9 against 552.1 / 557.5 at 4K.
/// * `route_sort`: the router's last block routes with route.cuh's route_sort (k <= 8: per-warp
///   bitonic sorts of 32, then each of the 64 warp-best candidates ranked against the other
///   lists: ~30 compares a thread against route_block's 256) rather than route_block: the same
///   ids and weights (cuda_ops, exact ties included). Less work but a longer dependent chain (15
///   shuffle stages, then the merge): slower in one block on the H200, 552.4 / 552.4 against
///   571.1 / 563.6 tok/s at 4K, 387.9 / 387.6 against 397.9 / 401.6 at 128K (the router's tail
///   4.1 -> 5.1 µs). It stays for `late_route`, where the work, not the latency, decides.
/// * `route_ahead`: an MoE block's router folded into the decode projection before it (out_proj,
///   o_proj; Backend::route_ahead, gemv.cu's AHEAD and route_ahead_<C>): the projection's blocks
///   sum each router row against the rows of h they have just written, and a one-block launch
///   scales the sums by the norm, writes x and routes, where the router was a launch of its own
///   (norm prologue, 0.6 MB of dots, route in its last block: ~10.5 µs a layer in place at 4K,
///   stop 27's trace). The logits differ from the router's in where x is rounded (cuda_ops
///   route_ahead test). Written at stop 36; first run at stop 38 (one call, 4K, 64 tokens):
///   579.19 against 582.97 / 584.20 tok/s without (none, on, none): no gain, within noise or
///   below. Its op test and the lab case `ahead` are still unrun on the H200 (device time):
///   opt-in, `scripts/h200-run aheadtests,aheadlab` first if it is taken up again.
/// * `route_flag`: gate|up's routed blocks take their expert ids from one u64 that the router's
///   last block publishes after the route (route.cuh route_weights, moe.cu's moe_flag_gate_up,
///   decode.rs moe_step), polled by one thread a block, instead of a PDL wait for the router's
///   grid to complete and then an L2 read of the ids: the same bits (cuda_ops moe_step test).
///   Why: in the trace (H100, 4K) gate|up's blocks have their rows requested a median 2.0 µs
///   after their wait (4.8 in the last block), two dependent L2 round trips of which the ids'
///   is one, and the wait itself follows the router's last block's exit. Written at stop 51.
///   Stop 52 (H100, `lily bench --arms`, 4 rounds at 4K, 2 at 128K, alternated): 546.64 against
///   556.18 tok/s at 4K (0.983x), 351.91 against 354.30 at 128K (0.993x); the trace put the
///   publish (a barrier, the ids loaded back from global memory, a sequentially consistent
///   fence) at +1.0 µs of the router's tail. The publish then moved into route_weights (thread
///   0, from shared memory, one release store).
/// * `down_flag` (with `route_flag`; alone it changes nothing): down polls a count of the gate|up
///   blocks done (each counts itself after its act stores: a barrier, then a release add)
///   instead of a PDL wait for gate|up's grid to complete (moe.cu moe_flag_down): the same bits.
///   Why: the same test of the grid-completion wait as route_flag, at the one boundary whose
///   pairing one op holds (gate|up and down are launched by moe_step together). Stop 52 (first
///   form, fence + atomic): with route_flag 551.82 tok/s at 4K (0.992x of the defaults, 1.009x
///   of route_flag alone), 352.80 at 128K (0.996x); in place down's wait -> x fell 1.53 -> 0.36
///   µs but its dots waited on its weights instead (2.06 -> 2.94 µs): down 6.44 -> 6.65 µs.
/// * `attn_p2`, `attn_p1` (stop 59): attn_decode_pf_<HD> with p in P·V as its first two bf16
///   pieces / one bf16 (attn_decode_p2_<HD>, attn_decode_p1_<HD>) instead of three: P·V's mma
///   are 48 of a chunk's 64, and stop 59's kv_read probe slows the 128K read from 86.1 to 101.6
///   µs with 150 dependent FMAs a chunk between the loads. Not bit-equal to the default (p is
///   rounded where it multiplies v, as the prefill's attn_tc): cuda_ops holds them to attn_tc's
///   propagated bound. Not yet measured in place.
/// * `attn_lazy` (stop 59): the decode attention's rescale of its output accumulators (64 FMUL a
///   chunk at HD 256, 70 of the key loop's 423 instructions) skipped in a chunk where no lane's
///   factor moved (a warp vote; o·1 is o): the same partial states (attn_decode_lz_<HD>; with
///   `attn_p2` / `attn_p1`, attn_decode_p2lz_<HD> / attn_decode_p1lz_<HD>). Not yet measured.
/// * `attn_ve` (stop 59): the decode attention with the next chunk's V requested together with
///   its K (right after this chunk's S) into a second register buffer, the two buffers' roles
///   swapping chunk by chunk (the loop unrolled by two), instead of after this chunk's P·V into
///   the one buffer: V's round trip then overlaps the P·V too. Why: in the default's order a
///   chunk takes about one DRAM round trip plus its P·V (V is requested only once P·V frees its
///   registers), so P·V's length adds to every chunk (stop 59's kv_work rows: 150 dependent FMAs
///   a chunk slow the 128K read from 86.1 to 101.6 µs). The same partial states
///   (attn_decode_ve_<HD>; with the others, attn_decode_{p2,p1}{lz}ve_<HD>). SASS (NVRTC 13.0):
///   827 instructions for two chunks (the default 423 for one), no local memory. Not yet
///   measured.
pub const OPT_IN: &[&str] = &[
    "tc_all",
    "fuse_gdn",
    "moe_step",
    "attn_fold",
    "carveout_all",
    "late_route",
    "route_sort",
    "route_ahead",
    "route_flag",
    "down_flag",
    "attn_p2",
    "attn_p1",
    "attn_lazy",
    "attn_ve",
];

impl Cuda {
    /// Switches off exactly the decode-path optimisations named (from [`SWITCHES`]; an unknown
    /// name is an error), the others on. Recorded steps are dropped: they hold the old kernels.
    pub fn set_disabled(&self, names: &[&str]) -> Result<()> {
        let set = Self::known_names(names, SWITCHES, "CUDA switch")?;
        *self.disabled.write().unwrap_or_else(|e| e.into_inner()) = set;
        *self.records.lock().unwrap_or_else(|e| e.into_inner()) = Records::default();
        Ok(())
    }

    /// A timing probe (never for results): recorded decode steps leave out every kernel whose name
    /// starts with one of `prefixes` (none: the full step). Recorded steps are dropped.
    pub fn set_skip(&self, prefixes: &[&str]) {
        *self.skip.write().unwrap_or_else(|e| e.into_inner()) =
            prefixes.iter().map(|p| p.to_string()).collect();
        *self.records.lock().unwrap_or_else(|e| e.into_inner()) = Records::default();
    }

    /// Whether kernel `name` is left out of recorded steps (`set_skip`, `LILY_CUDA_SKIP`).
    pub(super) fn skipped(&self, name: &str) -> bool {
        let s = self.skip.read().unwrap_or_else(|e| e.into_inner());
        !s.is_empty() && s.iter().any(|p| name.starts_with(p.as_str()))
    }

    /// Switches on exactly the opt-in variants named (from [`OPT_IN`]; an unknown name is an
    /// error). Recorded steps are dropped.
    pub fn set_enabled(&self, names: &[&str]) -> Result<()> {
        let set = Self::known_names(names, OPT_IN, "opt-in CUDA variant")?;
        *self.enabled.write().unwrap_or_else(|e| e.into_inner()) = set;
        *self.records.lock().unwrap_or_else(|e| e.into_inner()) = Records::default();
        Ok(())
    }

    /// `names` as a set of the static names in `known`; an unknown one is an error naming `what`.
    fn known_names(
        names: &[&str],
        known: &[&'static str],
        what: &str,
    ) -> Result<HashSet<&'static str>> {
        names
            .iter()
            .map(|n| {
                known
                    .iter()
                    .copied()
                    .find(|k| k == n)
                    .ok_or_else(|| anyhow!("unknown {what} `{n}` (known: {})", known.join(", ")))
            })
            .collect()
    }

    /// Whether opt-in variant `name` (one of [`OPT_IN`]) is on.
    pub(super) fn opted_in(&self, name: &'static str) -> bool {
        self.enabled
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains(name)
    }

    /// The opt-in variants now on.
    pub fn enabled(&self) -> Vec<&'static str> {
        let e = self.enabled.read().unwrap_or_else(|e| e.into_inner());
        OPT_IN.iter().copied().filter(|s| e.contains(s)).collect()
    }

    /// The switches now off.
    pub fn disabled(&self) -> Vec<&'static str> {
        let d = self.disabled.read().unwrap_or_else(|e| e.into_inner());
        SWITCHES.iter().copied().filter(|s| d.contains(s)).collect()
    }

    /// Whether optimisation `name` (one of [`SWITCHES`]) is on; `stream_gemv` off turns off the
    /// switches that live in its kernels (all but [`OUTSIDE_STREAM`]).
    pub(super) fn on(&self, name: &'static str) -> bool {
        let d = self.disabled.read().unwrap_or_else(|e| e.into_inner());
        !d.contains(name) && (OUTSIDE_STREAM.contains(&name) || !d.contains("stream_gemv"))
    }
}
