"""Documents and sliding windows through the ring, under mpiexec on GPUs (one rank per GPU).

packed: S tokens packed from N documents of random lengths, causal. Times the packed run (each
layout) against the dense causal run of the same tokens and against the ideal: the documents' own
causal work (visible query-key pairs) at the dense run's TFLOP/s. Also prints each layout's ring
steps and per-rank work imbalance (busiest rank over mean).

window: a causal sliding window at a given number of tokens per GPU against full causal.

    mpirun -np 8 python bench/bench_masks.py packed --tokens 262144 --documents 64
    mpirun -np 8 python bench/bench_masks.py window --tokens-per-rank 32768 --window 4096
"""
import argparse
import datetime
import json
import sys

import cupy
import numpy as np

import burst_hpc
import evidence
from bench_ring import gpu_job, timed
from burst_hpc.plan import masks
from burst_hpc.plan.layout import make_layout


def pair_flops(visible_pairs, heads, dim, backward):
    """FLOPs of a run over this many visible (query, key) pairs (FlashAttention's count)."""
    return 4.0 * visible_pairs * heads * dim * (3.5 if backward else 1.0)


def visible_pairs(mask):
    """The visible (query, key) pairs of ``mask`` (a masks.Mask), counted exactly."""
    lo, hi = mask.intervals
    return float((hi - lo).sum())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", choices=("packed", "window"))
    ap.add_argument("--tokens", type=int, default=262144, help="packed: total tokens")
    ap.add_argument("--documents", type=int, default=64, help="packed: documents of random lengths")
    evidence.problem_arguments(ap)   # --tokens-per-rank: the window case's tokens per GPU
    ap.add_argument("--window", type=int, default=4096, help="window: keys before each query")
    ap.add_argument("--layouts", default="contiguous,zigzag")
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--passes", default="fwd,fwdbwd")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="append a markdown table here (rank 0)")
    args = ap.parse_args()

    comm, dtype, kv_heads = gpu_job(args)
    P, r = comm.size, comm.rank
    S = args.tokens if args.case == "packed" else args.tokens_per_rank * P
    n = S // P
    rng = cupy.random.default_rng()

    def rand(h):
        return rng.standard_normal((1, n, h, args.head_dim), dtype=cupy.float32).astype(dtype)

    q, k, v, do = rand(args.heads), rand(kv_heads), rand(kv_heads), rand(args.heads)
    if args.case == "packed":
        cu = masks.random_documents(np.random.default_rng(args.seed), S, args.documents)
        runs = [("dense causal", None, None, "zigzag")]
        runs += [(f"packed, {layout}", cu, None, layout) for layout in args.layouts.split(",")]
    else:
        cu = None
        runs = [("full causal", None, None, "zigzag"), (f"window {args.window}", None, (args.window, 0), "contiguous")]

    rows = []
    for label, docs, window, layout in runs:
        mask = masks.make(S, True, window, docs)
        kw = dict(comm=comm, causal=True, layout=layout, transport=args.transport, cu_seqlens=docs, window=window)
        o, lse = burst_hpc.burst_attention(q, k, v, **kw)
        row = {"run": label, "layout": layout, "P": P, "tokens": S,
               "steps": masks.ring_steps(mask, make_layout(layout, S, P)), "pairs": visible_pairs(mask)}
        if mask.kind == "intervals":
            work = masks.rank_work(mask, make_layout(layout, S, P))
            row["imbalance"] = max(work) / (sum(work) / P)
        for pass_ in args.passes.split(","):
            backward = pass_ == "fwdbwd"

            def run():
                oo, ll = burst_hpc.burst_attention(q, k, v, **kw)
                if backward:
                    burst_hpc.burst_attention_backward(do, q, k, v, o, lse, **kw)

            row[pass_] = timed(comm, run, args.iters, args.warmup)
            row[f"{pass_}_tflops_per_gpu"] = pair_flops(row["pairs"], args.heads, args.head_dim, backward) / P / row[pass_] / 1e12
        rows.append(row)
        if r == 0:
            print(json.dumps(row), flush=True)
    if r != 0:
        return
    base = rows[0]
    dev = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    what = (f"{S} tokens packed from {args.documents} random-length documents (seed {args.seed}; longest "
            f"{int(np.diff(cu).max())})" if cu is not None else f"{n} tokens per GPU, causal window {args.window}")
    lines = [f"\n### Masks, {P} x {dev}, {datetime.date.today()}: {what}, {args.dtype}, H={args.heads}, "
             f"Hkv={kv_heads}, D={args.head_dim}\n", f"`mpirun -np {P} python {' '.join(sys.argv)}`\n",
             "| run | layout | ring steps | busiest rank / mean | pass | time (s) | TFLOP/s/GPU (visible pairs) | "
             "speed-up vs dense causal | time / ideal |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for pass_ in args.passes.split(","):
            # ideal: this run's visible pairs at the dense causal run's rate
            ideal = base[pass_] * row["pairs"] / base["pairs"]
            imbalance = f"{row['imbalance']:.2f}" if "imbalance" in row else "-"
            lines.append(f"| {row['run']} | {row['layout']} | {row['steps']} of {P} | {imbalance} | {pass_} | "
                         f"{row[pass_]:.3f} | {row[f'{pass_}_tflops_per_gpu']:.0f} | "
                         f"{base[pass_] / row[pass_]:.2f}x | {row[pass_] / ideal:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
