#!/usr/bin/env python3
# Run: python3 notes/tc_gemv_mapping.py (numpy). Checks the index math of tc_stream.cuh (tc_load,
# tc_chunk, tc_build_b, tc_dot, tc_finish), not the GPU: for one warp and one 16-row tile of NS
# spans of 128 inputs, it builds each lane's A and B registers as the kernels do, applies the
# mma.sync m16n8k16 definition (fragment layouts of mma.cuh) and checks that column 2i + h of D is
# the dot of group 2i + h (64 inputs) and that tc_finish's per-lane pairs sum to the row dot.
import numpy as np

rng = np.random.default_rng(1)
NS = 2
K = 128 * NS                                     # this warp's slice of K (spans sb = 0 .. NS-1)
q = rng.integers(0, 16, size=(16, K))            # codes of tile rows 0..15
x = rng.standard_normal(K).astype(np.float32)
s = rng.standard_normal((16, K // 64))           # scale and bias per row and group
b = rng.standard_normal((16, K // 64))


def word(r, j):  # u32 word j of row r: nibble i is input 8j + i
    return sum(int(q[r, 8 * j + i]) << (4 * i) for i in range(8))


def pair(w, p):  # tc_pair: (nibble p, nibble p + 4) as the bf16x2 (lo, hi)
    return ((w >> (4 * p)) & 0xF, (w >> (4 * p + 16)) & 0xF)


D = np.zeros((16, 8))
for i in range(NS):
    for st in range(8):
        A = np.zeros((16, 16))
        B = np.zeros((16, 8))
        for lane in range(32):
            g, t = lane // 4, lane % 4
            j = 16 * i + 4 * t + st // 2            # word of the lane's 16-byte chunk in row
            p = 2 * (st % 2)
            for r, rows in ((g, 0), (g + 8, 1)):
                lo0, hi0 = pair(word(r, j), p)      # a0 / a1: k 2t, 2t+1
                lo1, hi1 = pair(word(r, j), p + 1)  # a2 / a3: k 2t+8, 2t+9
                A[r, 2 * t], A[r, 2 * t + 1] = lo0, hi0
                A[r, 2 * t + 8], A[r, 2 * t + 9] = lo1, hi1
            # B: lane (n = g, t) holds column g; x only if g == 2i + t/2 (tc_chunk, tc_build_b).
            if g // 2 == i and g % 2 == t // 2:
                base = 128 * i + 32 * t + 8 * (st // 2) + p
                B[2 * t, g], B[2 * t + 1, g] = x[base], x[base + 4]
                B[2 * t + 8, g], B[2 * t + 9, g] = x[base + 1], x[base + 5]
        D += A @ B
for i in range(NS):
    for h in range(2):
        G = 2 * i + h
        want = q[:, 64 * G:64 * G + 64] @ x[64 * G:64 * G + 64]
        assert np.allclose(D[:, G], want), (i, h)
assert np.allclose(D[:, 2 * NS:], 0)
# tc_finish: lane t < NS scales columns 2t, 2t+1 (groups 2t, 2t+1), then the 4 lanes of a row sum.
xs = x.reshape(-1, 64).sum(1)
row = sum(s[:, 2 * t + h] * D[:, 2 * t + h] + b[:, 2 * t + h] * xs[2 * t + h] for t in range(NS) for h in range(2))
w = s.repeat(64, 1) * q + b.repeat(64, 1)
assert np.allclose(row, w @ x)
print(f"tc_stream mapping OK: NS={NS}, group dots in D's columns, row dots match")
