"""Where a call spends its host time.

The library call (default), under mpiexec: a ``burst_attention`` call (causal; --mask documents, the
default: packed documents up to S/4; the balanced layout unless --layout says otherwise) made many times
with the same shapes and mask, as a training loop makes it, timed phase by phase on the host: the plan
(callplan: checks, the layout decision, the schedule, the agreement across ranks), the forward pass and,
with --backward, the backward call's plan and pass. Three ways: ``uncached`` plans every call anew
(callplan.plan_arrays, what every call did before the plan cache), ``cached`` as the library does
(callplan.plan_call: the first call plans, the others reuse its plan), ``api`` the public calls
themselves (burst_hpc.burst_attention and burst_attention_backward, whole: their plan is in "forward"
and "backward"). Medians over --calls calls, each started between barriers, of the slowest rank; then
cProfile's costliest host functions of each way and the Python function calls of a step (rank 0).

    mpiexec -n 2 python3 bench/call_overhead.py --backend numpy --host-only
    mpiexec -n 2 python3 bench/call_overhead.py --backend numpy --tokens-per-rank 256 --head-dim 8 \
        --backward --layout chunks --ways api   # tiny arrays: a cached call's host time
    mpiexec -n 2 python3 bench/call_overhead.py --backend cuda [--heads 1] [--head-dim 128] [--backward]

--host-only replaces the backend's block calls (forward_block, backward_block) by no-ops: the host
work of the call alone (NumPy's kernels are otherwise far slower than a GPU's). On the GPU each call
ends with a device synchronisation, in the step's "wall" time, and CUDA events around each block call
give the GPU time of the step's kernels; the host phases are the host's own time (kernels queue
asynchronously).
--json prints one JSON line per way (rank 0): mpi_tests/test_call_overhead.py runs this on the CPU.

The block call (--block): one forward_block on one GPU, host microseconds per call (Python and
launches, nothing waited for), the GPU time of one call launched alone against the same call queued
back to back, and cProfile's costliest host functions.

    python3 bench/call_overhead.py --block [--d 128] [--s 4096] [--heads 32] [--causal] [--calls 200]

Nsight Systems is not on the GPU machines here, so the host side is read with cProfile and host
clocks, the device side with CUDA events.
"""
import argparse
import contextlib
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from burst_hpc.plan import callplan  # noqa: E402
from burst_hpc.plan import masks  # noqa: E402
from burst_hpc.plan.layout import as_layout  # noqa: E402
from burst_hpc.collective import one_fails_all  # noqa: E402
from burst_hpc.device import array_device  # noqa: E402
from burst_hpc.plan.workload import documents  # noqa: E402

WAYS = ("uncached", "cached", "api")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block", action="store_true", help="time one forward_block on one GPU instead")
    ap.add_argument("--backend", choices=("numpy", "cuda"), default="cuda")
    ap.add_argument("--host-only", action="store_true", help="no-op block calls: the host work alone")
    ap.add_argument("--tokens-per-rank", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=None, help="default: 1 (--block: 32)")
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layout", default="balanced", help="a layout, or 'default' (the library's pick)")
    ap.add_argument("--mask", choices=("documents", "causal"), default="documents", help="causal: no documents")
    ap.add_argument("--longest", type=float, default=0.25, help="the longest document, a share of S")
    ap.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {', '.join(WAYS)}")
    ap.add_argument("--backward", action="store_true", help="also the backward call of each step")
    ap.add_argument("--calls", type=int, default=None, help="default: 50 (--block: 200)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", type=int, default=12, help="cProfile lines per way (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    # --block's own
    ap.add_argument("--family", default=None)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--s", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args(argv)
    if not set(args.ways.split(",")) <= set(WAYS):
        ap.error(f"--ways: each of {', '.join(WAYS)}")
    args.heads = args.heads or (32 if args.block else 1)
    args.calls = args.calls or (200 if args.block else 50)
    if args.block:
        return block_call(args)
    return library_call(args)


def library_call(args):
    from mpi4py import MPI

    import burst_hpc

    comm = MPI.COMM_WORLD
    P, r = comm.size, comm.rank
    cuda = args.backend == "cuda"
    if cuda:
        import cupy

        burst_hpc.select_device(comm)
        xp, dtype = cupy, np.dtype("bfloat16")
    else:
        xp, dtype = np, np.dtype(np.float32)
    S, H, Hkv, D = args.tokens_per_rank * P, args.heads, args.kv_heads or args.heads, args.head_dim
    cu = None if args.mask == "causal" else documents(np.random.default_rng(args.seed), S, "capped",
                                                      longest=max(1, int(S * args.longest)))
    layout = None if args.layout == "default" else args.layout
    options = dict(cu_seqlens=cu, window=None, scheme="auto", ranks_per_node=None)
    rng = np.random.default_rng([args.seed, 7])
    full = {name: rng.standard_normal((1, S, h, D)).astype(np.float32)
            for name, h in (("q", H), ("k", Hkv), ("v", Hkv), ("do", H))}
    if layout is None:   # shard as the library's pick for this call (the plan on these shapes says which)
        local = [xp.asarray(x[:, :S // P]).astype(dtype) for x in (full["q"], full["k"], full["v"])]
        shard = callplan.plan_arrays(comm, local[0], callplan.checked_call(P, *local, True, None, None, "auto",
                                                                           **options)).layout
    else:
        shard = layout
    mask = dict(causal=True, cu_seqlens=cu, window=None)   # the chunks layout places tokens by it
    placed = as_layout(shard, S, P, **mask)   # what checked_call takes (the api way passes the name itself)
    call_layout = None if layout is None else placed
    q, k, v, do = (xp.asarray(burst_hpc.shard(full[name], r, P, shard, **mask)).astype(dtype)
                   for name in ("q", "k", "v", "do"))

    def sync():
        if cuda:
            cupy.cuda.get_current_stream().synchronize()

    def api_call(times):
        """One training step's public calls, each timed whole on the host."""
        t0 = time.perf_counter()
        o, lse = burst_hpc.burst_attention(q, k, v, causal=True, layout=layout, **options)
        t1 = time.perf_counter()
        times["forward"].append(t1 - t0)
        if args.backward:
            burst_hpc.burst_attention_backward(do, q, k, v, o, lse, causal=True, layout=layout, **options)
            times["backward"].append(time.perf_counter() - t1)
        sync()
        times["wall"].append(time.perf_counter() - t0)

    def one_call(plan_of, times):
        """One training step's calls, each phase timed on the host (``plan_of``: plan_arrays or plan_call;
        None: the public calls, ``api_call``)."""
        if plan_of is None:
            return api_call(times)
        t0 = time.perf_counter()
        plan = plan_of(comm, q, callplan.checked_call(P, q, k, v, True, None, call_layout, "auto", **options))
        t1 = time.perf_counter()
        with array_device(q), one_fails_all(comm, "call_overhead"):
            o, lse = plan.passes.forward(q, k, v)
        t2 = time.perf_counter()
        times["plan"].append(t1 - t0)
        times["forward"].append(t2 - t1)
        if args.backward:
            back = plan_of(comm, q, callplan.checked_call(P, q, k, v, True, None, call_layout, "auto",
                                                          backward=callplan.Backward(do, o, lse), **options))
            t3 = time.perf_counter()
            with array_device(q), one_fails_all(comm, "call_overhead"):
                back.passes.backward(back.ring, do, q, k, v, o, lse)
            t4 = time.perf_counter()
            times["backward plan"].append(t3 - t2)
            times["backward"].append(t4 - t3)
        sync()
        times["wall"].append(time.perf_counter() - t0)

    rows = []
    with no_kernels(args.host_only, cuda):
        for way in args.ways.split(","):
            cache = callplan.PLANS if way == "api" else callplan.PlanCache()
            cache.clear()
            plan_of = {"uncached": callplan.plan_arrays, "api": None}.get(
                way, lambda *a, **kw: callplan.plan_call(*a, cache=cache, **kw))
            times = {name: [] for name in ("plan", "forward", "backward plan", "backward", "wall")}
            for _ in range(args.warmup):
                one_call(plan_of, {name: [] for name in times})
            for _ in range(args.calls):
                comm.Barrier()
                one_call(plan_of, times)
            gpu = kernel_ms(lambda: one_call(plan_of, {n: [] for n in times})) if cuda and not args.host_only else None
            profile, calls = profiled(args.profile, lambda: [one_call(plan_of, {n: [] for n in times})
                                                             for _ in range(10)], ("tottime", "cumulative"))
            medians = {name: statistics.median(t) * 1e3 for name, t in times.items() if t}
            slowest = {name: max(comm.allgather(ms)) for name, ms in medians.items()}
            host = sum(ms for name, ms in slowest.items() if name != "wall")
            rows.append(dict(way=way, ranks=P, backend=args.backend, host_only=args.host_only,
                             layout=shard if isinstance(shard, str) else shard.kind,
                             tokens_per_rank=args.tokens_per_rank, heads=H, kv_heads=Hkv, head_dim=D,
                             documents=0 if cu is None else len(cu) - 1, backward=args.backward, calls=args.calls,
                             host_ms=host, gpu_ms=gpu, hits=cache.hits, misses=cache.misses,
                             python_calls=None if calls is None else calls / 10,
                             **{name.replace(" ", "_") + "_ms": ms for name, ms in slowest.items()}))
            if r == 0 and profile and not args.json:
                print(f"== {way}: cProfile of 10 calls, rank 0 ==\n{profile}")
    if r == 0:
        for row in rows:
            if args.json:
                print(json.dumps(row))
                continue
            phases = ", ".join(f"{name} {row[name.replace(' ', '_') + '_ms']:.3f} ms" for name in
                               ("plan", "forward", "backward plan", "backward") if name.replace(" ", "_") + "_ms" in row)
            gpu = "" if row["gpu_ms"] is None else f"; kernels {row['gpu_ms']:.3f} ms of GPU time"
            python = "" if row["python_calls"] is None else f"; {row['python_calls']:.0f} Python calls per step"
            print(f"call_overhead: P={P} {args.backend}{' host-only' if args.host_only else ''} {args.mask} "
                  f"layout={args.layout}->{shard} "
                  f"{args.tokens_per_rank} tokens/rank H={H}/{Hkv} D={D} {row['documents']} documents, "
                  f"{row['way']}: host {row['host_ms']:.3f} ms per step ({phases}); wall {row['wall_ms']:.3f} ms"
                  f"{gpu}{python} (median of {args.calls}, slowest rank; plan cache {row['hits']} hits, "
                  f"{row['misses']} misses)")
    return rows


@contextlib.contextmanager
def no_kernels(on, cuda):
    """The backend's block calls as no-ops while inside (``on``), so a call's host work is timed alone."""
    if not on:
        yield
        return
    if cuda:
        from burst_hpc.backends.cuda import CudaBackend as Backend
    else:
        from burst_hpc.backends.numpy_backend import NumpyBackend as Backend
    kept = Backend.forward_block, Backend.backward_block
    Backend.forward_block = Backend.backward_block = lambda self, *a, **kw: None
    try:
        yield
    finally:
        Backend.forward_block, Backend.backward_block = kept


def kernel_ms(fn, samples=5):
    """Median over ``samples`` runs of ``fn`` of the GPU time of its block calls (the CUDA backend's
    forward_block and backward_block, each between two CUDA events), in milliseconds."""
    import cupy

    from burst_hpc.backends.cuda import CudaBackend

    kept = CudaBackend.forward_block, CudaBackend.backward_block
    events = []

    def timed(method):
        def call(self, *a, **kw):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            method(self, *a, **kw)
            end.record()
            events.append((start, end))
        return call

    CudaBackend.forward_block, CudaBackend.backward_block = (timed(m) for m in kept)
    totals = []
    try:
        for _ in range(samples):
            events.clear()
            fn()
            cupy.cuda.Device().synchronize()
            totals.append(sum(cupy.cuda.get_elapsed_time(a, b) for a, b in events))
    finally:
        CudaBackend.forward_block, CudaBackend.backward_block = kept
    return statistics.median(totals)


def profiled(lines, fn, orders=("tottime",)):
    """(text, calls): cProfile's ``lines`` costliest functions while ``fn`` runs, by each of ``orders``
    (own time, cumulative time), and the Python function calls it made ('' and None for 0 lines)."""
    if not lines:
        return "", None
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    text = io.StringIO()
    for order in orders:
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(lines)
    return text.getvalue(), sum(stat[1] for stat in pstats.Stats(prof).stats.values())


def block_call(args):
    import cupy

    from burst_hpc.backends.cuda import CudaBackend, default_family

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from timing import cupy_sample

    be = CudaBackend.instance(family=args.family or default_family())
    shape = (1, args.s, args.heads, args.d)
    q, k, v = (cupy.random.standard_normal(shape, dtype=cupy.float32).astype(np.dtype("bfloat16")) for _ in range(3))
    o = cupy.zeros(shape, cupy.float32)
    lse = cupy.full((1, args.heads, args.s), -cupy.inf, cupy.float32)

    def call():
        be.forward_block(q, k, v, o, lse, scale=args.d ** -0.5, masked=args.causal, mask=masks.make(q.shape[1], True))

    for _ in range(5):
        call()
    cupy.cuda.Device().synchronize()

    # host time per call while the GPU works through the queue
    t0 = time.perf_counter()
    for _ in range(args.calls):
        call()
    host_us = (time.perf_counter() - t0) / args.calls * 1e6
    cupy.cuda.Device().synchronize()

    alone = statistics.median(cupy_sample(call, 1) for _ in range(20))
    queued = statistics.median(cupy_sample(call, 20) for _ in range(5))

    profile, _ = profiled(12, lambda: [call() for _ in range(args.calls)])
    cupy.cuda.Device().synchronize()
    flops = 4 * args.s * args.s * args.heads * args.d / (2 if args.causal else 1)
    print(profile)
    print(f"call_overhead: d={args.d} s={args.s} causal={args.causal}: host {host_us:.1f} us/call; GPU one call "
          f"alone {alone * 1e3:.1f} us ({flops / alone / 1e9:.0f} TFLOP/s), queued {queued * 1e3:.1f} us "
          f"({flops / queued / 1e9:.0f} TFLOP/s)")


if __name__ == "__main__":
    main()
