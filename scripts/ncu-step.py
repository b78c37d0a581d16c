#!/usr/bin/env python3
"""One decode step's kernels from an Nsight Compute CSV (scripts/h200-run's `ncu` step).

ncu --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum over `lily generate` with
LILY_CUDA_GRAPH=0: every kernel timed alone. The last decode step is the span after the
second-to-last pick of a token (`argmax_step`, greedy, or `sample_topk_finish`, sampling on the
device: the checkpoint's default) up to the last one. Prints per kernel name: calls, total µs, µs per
call, MB read per call, TB/s; then the step's kernel count, the sum of times and bytes.
"""
import csv
import sys
from collections import OrderedDict

UNIT = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6, "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6, "B": 1e-6,
        "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3, "Tbyte": 1e6,
        "KB": 1e-3, "MB": 1.0, "GB": 1e3}


def main(path):
    kernels = OrderedDict()  # id -> [name, us, mb]
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    for row in csv.DictReader(lines):
        kid = row["ID"]
        k = kernels.setdefault(kid, [row["Kernel Name"].split("(")[0], 0.0, 0.0])
        val = float(row["Metric Value"].replace(",", "") or 0)
        scale = UNIT.get(row["Metric Unit"], 1.0)
        if row["Metric Name"].startswith("gpu__time_duration"):
            k[1] = val * scale
        elif row["Metric Name"].startswith("dram__bytes_read"):
            k[2] = val * scale
    ks = list(kernels.values())
    ends = [i for i, k in enumerate(ks) if k[0] in ("argmax_step", "sample_topk_finish")]
    if len(ends) < 2:
        sys.exit(f"ncu-step: {len(ends)} token picks in {len(ks)} kernels: no whole decode step")
    step = ks[ends[-2] + 1 : ends[-1] + 1]
    agg = OrderedDict()
    for name, us, mb in step:
        a = agg.setdefault(name, [0, 0.0, 0.0])
        a[0] += 1
        a[1] += us
        a[2] += mb
    print(f"{'kernel':<34} {'calls':>5} {'us total':>9} {'us/call':>8} {'MB/call':>8} {'TB/s':>6}")
    for name, (n, us, mb) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print(f"{name[:34]:<34} {n:>5} {us:>9.1f} {us / n:>8.2f} {mb / n:>8.3f} {mb / us if us else 0:>6.2f}")
    tus = sum(k[1] for k in step)
    tmb = sum(k[2] for k in step)
    print(f"step: {len(step)} kernels, {tus:.1f} us summed in isolation, {tmb:.1f} MB read ({tmb / tus:.2f} TB/s)")


if __name__ == "__main__":
    main(sys.argv[1])
