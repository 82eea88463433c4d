"""Packed documents at MagiAttention's benchmark setting, under mpiexec (one rank per GPU): bf16,
D = 128, Hq = 64, Hkv = 8, 8k tokens per GPU, causal, documents of random lengths up to S/4
(drawn from --seed). For each layout (every one: contiguous, zigzag, balanced, chunks), with the
scheme ``scheme='auto'`` runs it with (the chunks layout: gather), it times the forward and
forward+backward passes and reports TFLOP/s per GPU over the visible pairs at the slowest rank's
pace (FlashAttention's count: 4 Hq D per visible pair forward, 3.5x that forward+backward), next
to the schedule's own account (workload.account: critical path / mean work) and the cost model's
prediction (costmodel.pass_prediction, this GPU's built-in rates); the layout the default picks
(costmodel.choose_layout) is marked. Launch it at 1, 2, 4 and 8 GPUs for the table in docs/RING.md.

    mpirun -np 8 python bench/bench_documents.py --out docs/results.md
    mpiexec -n 2 python bench/bench_documents.py --cpu --tokens-per-rank 64 --heads 4 --kv-heads 2 --head-dim 8

--cpu runs the NumPy path in float32 (the driver checked in CI, mpi_tests/test_bench_documents.py);
--check also compares every layout's output with the first's, gathered on rank 0.
"""
import argparse
import datetime
import json
import sys

import numpy as np
from mpi4py import MPI

import burst_hpc
from burst_hpc.plan import costmodel, masks
from burst_hpc.plan.accounting import visible_pairs
from burst_hpc.plan.layout import LAYOUTS, make_layout
from burst_hpc.plan.workload import account, documents

import evidence
from evidence import timed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    evidence.problem_arguments(ap, tokens_per_rank=8192)
    ap.set_defaults(heads=64, kv_heads=8, head_dim=128)
    ap.add_argument("--longest", type=float, default=0.25, help="the longest document, a share of S (default 1/4)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--passes", default="fwd,fwdbwd")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", action="store_true", help="the NumPy path in float32 (no GPU)")
    ap.add_argument("--check", action="store_true", help="compare every layout's output with the first's")
    ap.add_argument("--out", default=None, help="append JSON rows and a Markdown table here (rank 0)")
    args = ap.parse_args(argv)

    comm = MPI.COMM_WORLD
    P, r = comm.size, comm.rank
    if args.cpu:
        xp, dtype, device = np, np.float32, "CPU"
    else:
        import cupy

        from burst_hpc.dtypes import parse_dtype

        burst_hpc.select_device(comm)
        xp, dtype = cupy, parse_dtype(args.dtype)
        device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    S, H, Hkv, D = args.tokens_per_rank * P, args.heads, args.kv_heads or args.heads, args.head_dim
    cu = documents(np.random.default_rng(args.seed), S, "capped", longest=max(1, int(S * args.longest)))
    mask = masks.make(S, True, None, cu)
    pairs = visible_pairs(S, True, mask)
    rng = np.random.default_rng([args.seed, 7])
    full = {name: rng.standard_normal((1, S, h, D)).astype(np.float32) for name, h in
            (("q", H), ("k", Hkv), ("v", Hkv), ("do", H))}
    rates = costmodel.rates_for("numpy" if args.cpu else "cuda", device)
    problem = costmodel.Problem(1, S, H, Hkv, D, np.dtype(dtype).itemsize, True)
    cluster = costmodel.Cluster(max(1, P // 8), min(P, 8))   # 8 GPUs a node
    picked = costmodel.choose_layout(S, P, causal=True, cu_seqlens=cu, heads=H, kv_heads=Hkv, head_dim=D, dtype=dtype,
                                     backend="numpy" if args.cpu else "cuda", rates=rates,
                                     ranks_per_node=cluster.per_node).kind
    rows, first = [], None
    for layout in args.layouts.split(","):
        placed = make_layout(layout, S, P, mask)   # the chunks layout places tokens by the mask
        mine = {name: xp.asarray(placed.shard(x, r)).astype(dtype) for name, x in full.items()}
        scheme = costmodel.pick(problem, cluster, rates, placed, mask)   # what scheme='auto' runs
        kw = dict(comm=comm, causal=True, cu_seqlens=cu, layout=placed, scheme=scheme)
        work = account(placed, True, mask, scheme, "forward", cluster.per_node if cluster.nodes > 1 else None).work
        row = {"layout": layout, "scheme": scheme, "pick": layout == picked, "P": P, "tokens": S,
               "documents": len(cu) - 1, "longest": int(np.diff(cu).max()), "device": device,
               "critical_over_mean": float(work.max(axis=1).sum() * P / work.sum()), "steps": int(work.shape[0])}
        o, lse = burst_hpc.burst_attention(mine["q"], mine["k"], mine["v"], **kw)
        for pass_ in args.passes.split(","):
            backward = pass_ == "fwdbwd"

            def run():
                out, stats = burst_hpc.burst_attention(mine["q"], mine["k"], mine["v"], **kw)
                if backward:
                    burst_hpc.burst_attention_backward(mine["do"], mine["q"], mine["k"], mine["v"], out, stats, **kw)

            seconds = timed(comm, run, args.iters, args.warmup, xp)
            row[pass_] = seconds
            row[f"{pass_}_tflops_per_gpu"] = 4.0 * pairs * H * D * (3.5 if backward else 1.0) / P / seconds / 1e12
            pred = [costmodel.pass_prediction(scheme, problem, cluster, rates, placed, mask, b)
                    for b in ((False, True) if backward else (False,))]
            time_ = sum(p.time for p in pred)
            row[f"{pass_}_predicted_tflops_per_gpu"] = 4.0 * pairs * H * D * (3.5 if backward else 1.0) / P / time_ / 1e12
            row[f"{pass_}_predicted_exposed"] = sum(p.time - p.compute for p in pred) / time_
        if args.check:
            gathered = comm.gather(o.get() if hasattr(o, "get") else o)
            if r == 0:
                whole = placed.unshard(gathered).astype(np.float64)
                first = whole if first is None else first
                row["max_diff_vs_first"] = float(np.abs(whole - first).max())
        rows.append(row)
        if r == 0:
            print(json.dumps(row), flush=True)
    if r == 0:
        text = table(rows, args, device)
        print(text, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write("".join(json.dumps(row) + "\n" for row in rows) + text)
    return rows


def table(rows, args, device):
    first = rows[0]
    lines = [f"\n### Packed documents, {first['P']} x {device}, {datetime.date.today()}: {first['tokens']} tokens, "
             f"{first['documents']} documents up to {first['longest']} (seed {args.seed}), H={args.heads}, "
             f"Hkv={args.kv_heads or args.heads}, D={args.head_dim}\n",
             f"`mpirun -np {first['P']} python bench/bench_documents.py {' '.join(sys.argv[1:])}`\n",
             "| layout | scheme | critical path / mean | steps | pass | time (s) | TFLOP/s per GPU | predicted | "
             "predicted exposed |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for pass_ in args.passes.split(","):
            name = f"**{row['layout']}** (pick)" if row["pick"] else row["layout"]
            lines.append(f"| {name} | {row['scheme']} | {row['critical_over_mean']:.2f} | {row['steps']} | {pass_} | "
                         f"{row[pass_]:.4f} | {row[pass_ + '_tflops_per_gpu']:.3g} | "
                         f"{row[pass_ + '_predicted_tflops_per_gpu']:.3g} | {row[pass_ + '_predicted_exposed']:.1%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
