#!/usr/bin/env python3
# Run: python3 notes/tc_gemv_mapping.py (numpy). Checks gemv.cu tc_gemv_body index math, not the GPU.
# Emulates tc_gemv_body's fragment mapping for one warp, one 16-row tile, one group (64 inputs):
# builds the per-lane A/B registers exactly as the kernel does, then applies the mma.sync m16n8k16
# definition (fragment layouts of mma.cuh) and compares with the direct dot of codes and x.
import numpy as np
rng = np.random.default_rng(1)
q = rng.integers(0, 16, size=(16, 64))          # codes of rows 0..15, group inputs 0..63
x = rng.standard_normal(64).astype(np.float32)
# words: row r, word j (0..7) holds codes of inputs 8j..8j+7, nibble i = input 8j+i
def word(r, j):
    w = 0
    for i in range(8):
        w |= int(q[r, 8 * j + i]) << (4 * i)
    return w
def pair(w, i):  # (lo, hi) = nibble i, nibble i+4
    return ((w >> (4 * i)) & 0xF, (w >> (4 * i + 16)) & 0xF)
D = np.zeros((16, 8))
for st in range(4):
    # virtual A[16][16], B[16][8] assembled from lanes
    A = np.full((16, 16), np.nan); B = np.full((16, 8), np.nan)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        wa = (word(g, 2 * t), word(g, 2 * t + 1)); wb = (word(g + 8, 2 * t), word(g + 8, 2 * t + 1))
        wA = wa[0] if st < 2 else wa[1]; wB = wb[0] if st < 2 else wb[1]
        pp = 2 * (st % 2)
        a = [pair(wA, pp), pair(wB, pp), pair(wA, pp + 1), pair(wB, pp + 1)]
        # mma.cuh: a0 {row g, k 2c..2c+1}, a1 {row g+8, same k}, a2 {row g, k+8}, a3 {row g+8, k+8}
        for (reg, (row, k0)) in zip(a, [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            A[row, k0], A[row, k0 + 1] = reg
        # B: xf[b + pp], xf[b + pp + 4] (b0) and xf[b+pp+1], xf[b+pp+5] (b1); xf = x[16t .. 16t+15]
        b = 8 * (st // 2)
        xf = x[16 * t: 16 * t + 16]
        b0 = (xf[b + pp], xf[b + pp + 4]); b1 = (xf[b + pp + 1], xf[b + pp + 5])
        # B regs {k 2c..2c+1, n g}, {k+8, n g}
        B[2 * t, g], B[2 * t + 1, g] = b0
        B[2 * t + 8, g], B[2 * t + 9, g] = b1
    assert not np.isnan(A).any() and not np.isnan(B).any()
    D += A @ B
ref = q.astype(np.float64) @ x.astype(np.float64)
for n in range(8):
    assert np.allclose(D[:, n], ref, rtol=1e-5, atol=1e-4), (n, D[:, n], ref)
# every lane (g, t): c0 = D[g, 2t], c2 = D[g+8, 2t]
print("tc_gemv mapping: D equals q·x in every column; max err", np.abs(D[:, 0] - ref).max())
