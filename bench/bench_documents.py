"""Packed documents at MagiAttention's benchmark setting, under mpiexec (one rank per GPU): bf16,
D = 128, Hq = 64, Hkv = 8, 8k tokens per GPU, causal, two document distributions: lengths uniform up
to S/4 (drawn from --seed) and MagiAttention's real-world lengths (bench_packed.magi_packs). For each
layout it times the forward, the backward alone and forward+backward and reports TFLOP/s per GPU over
the visible pairs at the slowest rank's pace (4 Hq D per visible pair forward, 2.5x that backward,
3.5x forward+backward: FlashAttention's count and MagiAttention's agree), each layout (contiguous,
zigzag, balanced, chunks) with the scheme ``scheme='auto'`` runs it with (chunks: gather), next to the
schedule's own account (workload.account: critical path / mean work) and the cost model's prediction
(costmodel.pass_prediction: this GPU's rates with the fixed costs `burst-hpc compile` measured,
else the built-in ones; --ranks-per-node a node), marking the default
layout and choose_layout's pick for each pass. Launch it at 1, 2, 4 and 8 GPUs for the table in
docs/BENCHMARKS.md, "Packed documents across GPUs".

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
from burst_hpc.plan.rates import rates_for
from burst_hpc.plan.accounting import visible_pairs
from burst_hpc.plan.layout import LAYOUTS, default_kind
from burst_hpc.plan.workload import account, documents

import bench_packed
import evidence
from evidence import issued, queued, timed


PASSES = ("fwd", "bwd", "fwdbwd")
# FLOPs of each pass over the visible pairs, in units of the forward's 4 Hq D per pair: FlashAttention's count and
# MagiAttention's (calculate_attn_flops: backward 2.5x forward) agree, so one figure serves both conventions
MAGI_MIN_TOKENS = 4096
PASS_FLOPS = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
TIMINGS = ("queued", "alone")
TIMING_TEXT = {"queued": "Timed as MagiAttention times (an L2 flush and a device barrier queued before each call, "
                         "CUDA events, mean of the slowest rank's)",
               "alone": "Each call timed alone between device synchronisations and barriers (the host's time per "
                        "call included; median)"}


def document_set(dist, seqlen, seed, longest):
    """cu_seqlens of one pack: 'uniform' lengths in 1..longest tokens (seed), or 'magi': MagiAttention's
    real-world lengths chunked at S/4 as their benchmark samples them (bench_packed.magi_packs, their seed)."""
    if dist == "uniform":
        return documents(np.random.default_rng(seed), seqlen, "capped", longest=max(1, longest))
    if dist == "magi":
        if seqlen < MAGI_MIN_TOKENS:   # their 24G-token table cut into S/4 pieces must fit in memory
            raise SystemExit(f"--dists magi needs at least {MAGI_MIN_TOKENS} tokens in all; got {seqlen}")
        return bench_packed.magi_packs(bench_packed.read_length_table(), seqlen, 1)[0]
    raise SystemExit(f"--dists: unknown distribution {dist!r}; use uniform or magi")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    evidence.problem_arguments(ap, tokens_per_rank=8192)
    ap.set_defaults(heads=64, kv_heads=8, head_dim=128)
    ap.add_argument("--longest", type=float, default=0.25, help="uniform: the longest document, a share of S")
    ap.add_argument("--dists", default="uniform,magi", help="document length distributions: uniform, magi")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--transport", default="auto", help="the calls' transport (auto, nccl, mpi, staged)")
    ap.add_argument("--passes", default=",".join(PASSES), help="fwd, bwd (backward alone), fwdbwd")
    ap.add_argument("--ranks-per-node", type=int, default=8, help="for the cost model's prediction (default 8)")
    ap.add_argument("--timing", choices=TIMINGS, default="queued",
                    help="queued: MagiAttention's protocol (evidence.queued: an L2 flush and a device barrier before "
                         "each call, CUDA events, no host synchronisation in the loop); alone: each call between "
                         "device synchronisations and barriers, the host's time per call included (evidence.timed)")
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
    S = args.tokens_per_rank * P
    passes = args.passes.split(",")
    rows = []
    for dist in args.dists.split(","):
        cu = document_set(dist, S, args.seed, int(S * args.longest))
        rows += measure(comm, args, dist, cu, passes, xp, dtype, device)
    if r == 0:
        text = table(rows, args, device, passes)
        print(text, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write("".join(json.dumps(row) + "\n" for row in rows) + text)
    return rows


def measure(comm, args, dist, cu, passes, xp, dtype, device):
    """A row per layout over one document set: each pass timed, the schedule's account, the cost model's
    prediction, and which layout the library picks (the default for causal calls and choose_layout's pick)."""
    P, r = comm.size, comm.rank
    S, H, Hkv, D = args.tokens_per_rank * P, args.heads, args.kv_heads or args.heads, args.head_dim
    mask = masks.make(S, True, None, cu)
    flops = 4.0 * visible_pairs(mask) * H * D
    rng = np.random.default_rng([args.seed, 7])
    full = {name: rng.standard_normal((1, S, h, D)).astype(np.float32) for name, h in
            (("q", H), ("k", Hkv), ("v", Hkv), ("do", H))}
    rates = rates_for("numpy" if args.cpu else "cuda", device)
    problem = costmodel.Problem(1, S, H, Hkv, D, np.dtype(dtype).itemsize, mask)
    per_node = min(P, args.ranks_per_node)
    cluster = costmodel.Cluster(max(1, P // per_node), per_node)
    picked = {}
    for pass_ in passes:
        choice = burst_hpc.choose_layout(S, P, causal=True, cu_seqlens=cu, heads=H, kv_heads=Hkv, head_dim=D,
                                         dtype=np.dtype(dtype), backend="numpy" if args.cpu else "cuda",
                                         ranks_per_node=per_node if P > per_node else None,
                                         backward=pass_ != "fwd", rates=rates)
        picked[pass_] = getattr(choice, "kind", choice)
    rows, first = [], None
    # each layout as choose_layout prices it (the chunks: placed by the mask and the nodes, the model's chunk)
    layouts = costmodel.cluster_layouts(problem, cluster, rates, tuple(args.layouts.split(",")))
    for layout in args.layouts.split(","):
        placed = layouts[layout]
        if isinstance(placed, str):
            raise burst_hpc.LayoutError(placed)
        mine = {name: xp.asarray(placed.shard(x, r)).astype(dtype) for name, x in full.items()}
        scheme = costmodel.pick(problem, cluster, rates, placed)   # what scheme='auto' runs
        kw = dict(comm=comm, causal=True, cu_seqlens=cu, layout=placed, scheme=scheme, transport=args.transport)
        acc = account(placed, mask, scheme, "forward", cluster.per_node if cluster.nodes > 1 else None)
        work = acc.work
        row = {"dist": dist, "layout": layout, "scheme": scheme, "P": P, "tokens": S, "documents": len(cu) - 1,
               "longest": int(np.diff(cu).max()), "device": device, "steps": int(work.shape[0]),
               "critical_over_mean": float(acc.critical * P / work.sum()),
               "timing": args.timing, "transport": args.transport,
               "default": layout == default_kind(True), "picked": [p for p in passes if picked[p] == layout]}
        o, lse = burst_hpc.burst_attention(mine["q"], mine["k"], mine["v"], **kw)
        for pass_ in passes:
            def run(pass_=pass_):
                if pass_ == "bwd":
                    burst_hpc.burst_attention_backward(mine["do"], mine["q"], mine["k"], mine["v"], o, lse, **kw)
                    return
                out, stats = burst_hpc.burst_attention(mine["q"], mine["k"], mine["v"], **kw)
                if pass_ == "fwdbwd":
                    burst_hpc.burst_attention_backward(mine["do"], mine["q"], mine["k"], mine["v"], out, stats, **kw)

            seconds = (queued if args.timing == "queued" else timed)(comm, run, args.iters, args.warmup, xp)
            row[f"{pass_}_host_ms"] = issued(comm, run, max(1, min(args.iters, 5)), xp) * 1e3
            directions = {"fwd": (False,), "bwd": (True,), "fwdbwd": (False, True)}[pass_]
            pred = [costmodel.pass_prediction(scheme, problem, cluster, rates, placed, b) for b in directions]
            predicted = sum(p.time for p in pred)
            row[pass_] = seconds
            row[f"{pass_}_tflops_per_gpu"] = flops * PASS_FLOPS[pass_] / P / seconds / 1e12
            row[f"{pass_}_predicted_tflops_per_gpu"] = flops * PASS_FLOPS[pass_] / P / predicted / 1e12
            row[f"{pass_}_predicted_exposed"] = sum(max(0.0, p.waited) for p in pred) / predicted
        if args.check:
            gathered = comm.gather(o.get() if hasattr(o, "get") else o)
            if r == 0:
                whole = placed.unshard(gathered).astype(np.float64)
                first = whole if first is None else first
                row["max_diff_vs_first"] = float(np.abs(whole - first).max())
        rows.append(row)
        if r == 0:
            print(json.dumps(row), flush=True)
    return rows


def table(rows, args, device, passes):
    first = rows[0]
    lines = [f"\n### Packed documents, {first['P']} x {device}, {datetime.date.today()}: {first['tokens']} tokens, "
             f"H={args.heads}, Hkv={args.kv_heads or args.heads}, D={args.head_dim}, causal\n",
             f"`mpirun -np {first['P']} python bench/bench_documents.py {' '.join(sys.argv[1:])}`\n",
             f"{TIMING_TEXT[args.timing]}; TFLOP/s per GPU at the slowest rank's pace over the visible pairs (backward alone 2.5x, forward+backward "
             "3.5x the forward's count: FlashAttention's and MagiAttention's conventions agree); (prediction) the cost "
             "model's; **bold**: the fastest layout measured; d: the default layout (layout=None), c: "
             "choose_layout's pick for that pass; host ms: the slowest rank's median time to issue a call of each "
             "pass, the GPU kept busy meanwhile (above the GPU's own time, a loop without a barrier waits for it)\n",
             "| documents | layout | scheme | critical path / mean | steps | " + " | ".join(passes) + " | host ms |",
             "|---|---|---|---|---|" + "---|" * len(passes) + "---|"]
    for dist in dict.fromkeys(row["dist"] for row in rows):
        group = [row for row in rows if row["dist"] == dist]
        best = {p: max(row[p + "_tflops_per_gpu"] for row in group) for p in passes}
        for row in group:
            cells = []
            for p in passes:
                rate = row[p + "_tflops_per_gpu"]
                text = f"**{rate:.3g}**" if rate == best[p] else f"{rate:.3g}"
                marks = ("d" if row["default"] else "") + ("c" if p in row["picked"] else "")
                cells.append(f"{text} ({row[p + '_predicted_tflops_per_gpu']:.3g}){' ' + marks if marks else ''}")
            lines.append(f"| {dist} ({row['documents']}, longest {row['longest']}) | {row['layout']} | "
                         f"{row['scheme']} | {row['critical_over_mean']:.2f} | {row['steps']} | " + " | ".join(cells)
                         + " | " + " / ".join(f"{row[p + '_host_ms']:.2f}" for p in passes) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
