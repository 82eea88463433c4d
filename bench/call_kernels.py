"""Where one single-GPU forward+backward call's GPU time goes, kernel by kernel (the block contract's one-pair
path: burst_hpc.attention and attention_backward on CuPy arrays): run under ncu, which times each launch of the
profiled call (the call after a warm-up one, between cudaProfilerStart and Stop), then read its CSV:

    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv python3 bench/call_kernels.py \
        --docs > ncu.csv
    python3 bench/call_kernels.py --read ncu.csv

Inputs: bf16, B = 1, --s tokens (default 8192), --heads 64 query heads, --kv-heads 8, D = --d (128); causal, or
(--docs) packed documents of uniform random lengths up to S/4 (seed 0). The read prints each kernel's time and
the share of the call outside the attention kernels (attn_fwd_*, attn_bwd_* other than the sm90 helpers).
--time instead times the whole call with CUDA events (median of 20), for A/B runs of two checkouts (each on
its own PYTHONPATH).
"""
import argparse
import csv
import re
import statistics

import numpy as np

ATTENTION = re.compile(r"^attn_(fwd|bwd)(_sm90)?_(bf16|f16)_")


def documents(s, seed=0):
    """cu_seqlens of documents of uniform random lengths in [1, s // 4] filling s tokens."""
    rng = np.random.default_rng(seed)
    ends = [0]
    while ends[-1] < s:
        ends.append(min(s, ends[-1] + int(rng.integers(1, s // 4 + 1))))
    return np.array(ends)


def run(args):
    import cupy

    import burst_hpc

    bf16 = np.dtype("bfloat16")
    q, do = (cupy.random.standard_normal((1, args.s, args.heads, args.d), dtype=cupy.float32).astype(bf16)
             for _ in range(2))
    k, v = (cupy.random.standard_normal((1, args.s, args.kv_heads, args.d), dtype=cupy.float32).astype(bf16)
            for _ in range(2))
    mask = dict(cu_seqlens=documents(args.s)) if args.docs else dict(causal=True)

    def call():
        o, lse = burst_hpc.attention(q, k, v, **mask)
        return burst_hpc.attention_backward(do, q, k, v, o, lse, **mask)

    call()
    cupy.cuda.Device().synchronize()
    if args.time:
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        samples = []
        for _ in range(20):
            start.record()
            call()
            end.record()
            end.synchronize()
            samples.append(cupy.cuda.get_elapsed_time(start, end))
        what = "documents" if args.docs else "causal"
        print(f"{args.label} fwd+bwd S={args.s} Hq={args.heads} Hkv={args.kv_heads} D={args.d} {what}: "
              f"{statistics.median(samples):.3f} ms")
        return
    cupy.cuda.runtime.profilerStart()
    call()
    cupy.cuda.Device().synchronize()
    cupy.cuda.runtime.profilerStop()


def read(path):
    times = []
    lines = [line for line in open(path) if line.startswith('"')]
    for row in csv.DictReader(lines):
        if row.get("Metric Name") == "gpu__time_duration.sum":
            scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
            value = float(row["Metric Value"].replace(",", "")) * scale[row["Metric Unit"]]
            times.append((re.split(r"[(<]", row["Kernel Name"])[0], value))
    total = sum(t for _, t in times)
    outside = sum(t for name, t in times if not ATTENTION.match(name))
    for name, t in times:
        print(f"{t:10.1f} us  {name}")
    print(f"total {total:.1f} us; outside the attention kernels {outside:.1f} us = {100 * outside / max(total, 1e-9):.1f}%")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--read", help="an ncu CSV to read")
    ap.add_argument("--s", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--docs", action="store_true")
    ap.add_argument("--time", action="store_true", help="time the call (CUDA events) instead of profiling it")
    ap.add_argument("--label", default="", help="--time: the label of the printed line")
    args = ap.parse_args()
    if args.read:
        read(args.read)
    else:
        run(args)


if __name__ == "__main__":
    main()
