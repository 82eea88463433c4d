"""One rank's GPU timeline of a packed-documents call, under mpiexec (one rank per GPU), or every rank's: what
each stream ran and where the compute stream stood idle. The call is queued as bench_documents --timing queued
queues it (an L2 flush and a device barrier first; before them ``--head-start`` ms of a busy GPU, so the host
has issued the call when the GPU reaches it and the trace shows the GPU's own pace, not the profiled host's),
then a torch.profiler (CUPTI) trace of ``--calls`` calls is read per stream: kernels, memsets and copies with
their start (microseconds from the first) and length, and the compute stream's gaps longer than --gap
microseconds. The host's time to issue a call (no profiler) is printed too. Needs torch on the GPU machine
(the library does not).

    mpirun -np 4 python bench/timeline.py --layout chunks --pass fwdbwd [--dist uniform] [--rank 0|all]

On 4 x H200 and 4 x H100 the job printed its timeline and then did not end on its own (every time; not looked
into: the profiler's or NCCL's teardown at exit, most likely): run it under ``timeout``.
"""
import argparse
import json
import os
import tempfile
import time
from collections import defaultdict

import numpy as np
from mpi4py import MPI

import burst_hpc
from burst_hpc.plan import masks
from burst_hpc.plan.layout import make_layout
from burst_hpc.plan.rates import rates_for

import bench_documents
import evidence
import timing


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens-per-rank", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dist", default="uniform")
    ap.add_argument("--layout", default="chunks",
                    help="a layout name, or 'pick': choose_layout's pick for the pass on this GPU's rates (the "
                         "chunks layout placed as bench_documents.py's pick places it, receives weighed)")
    ap.add_argument("--pass", dest="pass_", default="fwdbwd", choices=("fwd", "bwd", "fwdbwd"))
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--rank", default="0", help="whose timeline to print: a rank, or 'all' (in rank order)")
    ap.add_argument("--gap", type=float, default=5.0, help="compute-stream gaps shown, microseconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--head-start", type=float, default=30.0,
                    help="milliseconds the GPU is kept busy before the flush, so the host has issued the call "
                         "before the GPU reaches it (the GPU's own timeline; 0: the host's pace shows, inflated "
                         "by the profiler's own time a launch)")
    args = ap.parse_args(argv)

    import cupy
    from torch.profiler import ProfilerActivity, profile

    from burst_hpc.dtypes import parse_dtype

    comm = MPI.COMM_WORLD
    P, r = comm.size, comm.rank
    burst_hpc.select_device(comm)
    S, H, Hkv, D = args.tokens_per_rank * P, args.heads, args.kv_heads, args.head_dim
    cu = bench_documents.document_set(args.dist, S, args.seed, S // 4)
    if args.layout == "pick":
        rates = rates_for("cuda", cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode())
        placed = burst_hpc.choose_layout(S, P, causal=True, cu_seqlens=cu, heads=H, kv_heads=Hkv, head_dim=D,
                                         dtype=parse_dtype("bf16"), backward=args.pass_ != "fwd", rates=rates)
    else:
        placed = make_layout(args.layout, S, P, masks.make(S, True, None, cu))
    rng = np.random.default_rng([args.seed, 7])
    mine = {name: cupy.asarray(placed.shard(rng.standard_normal((1, S, h, D)).astype(np.float32), r))
            .astype(parse_dtype("bf16")) for name, h in (("q", H), ("k", Hkv), ("v", Hkv), ("do", H))}
    kw = dict(comm=comm, causal=True, cu_seqlens=cu, layout=placed)
    o, lse = burst_hpc.burst_attention(mine["q"], mine["k"], mine["v"], **kw)

    def call():
        if args.pass_ != "bwd":
            out, stats = burst_hpc.burst_attention(mine["q"], mine["k"], mine["v"], **kw)
        else:
            out, stats = o, lse
        if args.pass_ != "fwd":
            burst_hpc.burst_attention_backward(mine["do"], mine["q"], mine["k"], mine["v"], out, stats, **kw)

    _, flush = evidence.device_barrier(comm, cupy)
    for _ in range(3):
        call()
    cupy.cuda.Device().synchronize()
    comm.Barrier()
    host = []
    for _ in range(5):   # the host's time to issue a call, the GPU busy meanwhile, no profiler
        timing.gpu_busy(args.head_start + 5)
        flush()
        t = time.perf_counter()
        call()
        host.append((time.perf_counter() - t) * 1e3)
        cupy.cuda.Device().synchronize()
    comm.Barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.calls):
            if args.head_start:
                timing.gpu_busy(args.head_start)
            flush()
            call()
        cupy.cuda.Device().synchronize()
    if args.rank != "all" and r != int(args.rank):
        comm.Barrier()
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"]
                      if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "dur" in e]
    events.sort(key=lambda e: e["ts"])
    # the call starts after the last barrier's all-reduce
    barriers = [e for e in events if "AllReduce" in e["name"]]
    t0 = barriers[-1]["ts"] + barriers[-1]["dur"] if barriers else events[0]["ts"]
    events = [e for e in events if e["ts"] >= t0 - 1]
    end = max(e["ts"] + e["dur"] for e in events)
    streams = defaultdict(list)
    for e in events:
        streams[e["tid"]].append(e)
    compute = max(streams, key=lambda s: sum(e["dur"] for e in streams[s] if "attn" in e["name"]))
    lines = []
    placement = f" (chunks of {placed.chunk}, receives weighed at {placed.receive})" if placed.chunk else ""
    lines.append(f"rank {r}, {args.layout}{placement}, {args.pass_}, {args.dist}: {args.calls} call(s), {end - t0:.0f} us from "
                 f"the barrier's end to the last work; the host issues a call in {np.median(host):.2f} ms")
    for sid, evs in streams.items():
        busy = sum(e["dur"] for e in evs)
        lines.append(f"\n== stream {sid}{' (compute)' if sid == compute else ''}: {len(evs)} items, busy {busy:.0f} us")
        totals = defaultdict(float)
        for e in evs:
            totals[e["name"][:60]] += e["dur"]
        for name, us in sorted(totals.items(), key=lambda x: -x[1])[:12]:
            lines.append(f"   {us:9.0f} us  {name}")
        if sid != compute:
            lines.extend(f"   at {e['ts'] - t0:9.0f} {e['dur']:8.0f}  {e['name'][:50]}" for e in evs[:30])
    lines.append("\n== compute stream, in order (start us, length us, name; gaps marked)")
    last = t0
    for e in streams[compute]:
        gap = e["ts"] - last
        if gap > args.gap:
            lines.append(f"   -- idle {gap:.0f} us")
        lines.append(f"   {e['ts'] - t0:9.0f} {e['dur']:8.0f}  {e['name'][:70]}")
        last = max(last, e["ts"] + e["dur"])
    if args.rank == "all":
        lines = comm.gather("\n".join(lines), root=0)
        if r == 0:
            print("\n\n".join(lines))
    else:
        print("\n".join(lines))
    comm.Barrier()


if __name__ == "__main__":
    main()
