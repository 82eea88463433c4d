"""Host time of one block call, or of the library's calls, without a GPU: the CuPy stand-in of
tests/record_launches.py (arrays in NumPy, launches recorded, not run, kernels compiled to PTX by nvcc) drives
CudaBackend as each tree's code does it.

At short lengths the host's time per call is part of what the benchmarks read: a sample of bench_kernels.py or
forward_ab.py is 5 calls between two CUDA events, the first recorded on an idle GPU, so the first call's host
time is in it (about 300 us per call is the GPU's at 4k causal, D = 128). A launch that read the kernel header
from disk made the 4k causal forward 7% slower (docs/KERNELS.md, "The kernel contract").

    python3 bench/host_time.py TREE [TREE ...] [--seq 4096] [--families sm90,sm80] [--reps 7]
    python3 bench/host_time.py TREE [TREE ...] --library [--seq 8192]

TREE: a source tree (this checkout: .; another: a checkout, or `git archive REF | tar -x -C DIR`). Prints
`tree family call microseconds` (causal, bf16, B = 1, H = 32, D = 128; the best of --reps repeats of 100 calls),
each tree in its own process, the trees interleaved twice. --library: the public calls instead, as a training
loop repeats them (`attention`, `attention_backward`, and `burst_attention` and its backward on one rank with the
chunks layout; causal documents of uniform lengths up to S/4, seed 0; bf16, Hq = 64, Hkv = 8, D = 128): `tree
sm90 call microseconds`. The stand-in counts none of CuPy's own time (a launch's arguments, allocations): on a
GPU host a call costs about twice to three times what it reads here (docs/BENCHMARKS.md, "The host's time per
call").
"""
import argparse
import os
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parents[1]


def one_tree(tree, seq, families, reps):
    sys.path.insert(0, str(HERE / "tests"))
    sys.path.insert(0, str(tree))
    import record_launches

    cupy = record_launches.install([])
    from burst_hpc.backends.cuda import CudaBackend

    bf16, heads, d = np.dtype("bfloat16"), 32, 128
    q, k, v, do = (cupy.asarray(np.zeros((1, seq, heads, d), bf16)) for _ in range(4))
    o, dq, dk, dv = (cupy.zeros((1, seq, heads, d), np.float32) for _ in range(4))
    lse, delta = cupy.full((1, heads, seq), -np.inf, np.float32), cupy.zeros((1, heads, seq), np.float32)
    where = dict(scale=d ** -0.5, causal=True)
    for family in families:
        be = CudaBackend.instance(family)
        calls = {"forward_block": lambda: be.forward_block(q, k, v, o, lse, **where),
                 "backward_block": lambda: be.backward_block(q, k, v, do, lse, delta, dq, dk, dv, **where)}
        for name, call in calls.items():
            call()  # compiles and loads its kernels
            best = min(timeit.repeat(call, number=100, repeat=reps)) / 100
            print(f"{tree} {family} {name} {best * 1e6:.1f}", flush=True)


def library_calls(tree, seq, reps):
    """The public calls' host time on the stand-in, with what they need of CuPy beyond the block calls' (device
    properties, streams, events, an array's device)."""
    import contextlib
    import types

    sys.path.insert(0, str(HERE / "tests"))
    sys.path.insert(0, str(tree))
    import record_launches

    cupy = record_launches.install([])
    record_launches.ndarray.__module__ = "cupy._core"   # what the library tells CuPy arrays by
    record_launches.ndarray.device = property(lambda self: contextlib.nullcontext())
    event = types.SimpleNamespace(synchronize=lambda: None, record=lambda *a: None)
    stream = types.SimpleNamespace(ptr=0, synchronize=lambda: None, record=lambda *a: event,
                                   wait_event=lambda e: None, __enter__=lambda *a: stream)
    cupy.cuda.runtime.getDeviceProperties = lambda i: {"name": b"stand-in", "totalGlobalMem": 80 << 30,
                                                       "multiProcessorCount": 132}
    cupy.cuda.runtime.runtimeGetVersion = cupy.cuda.runtime.driverGetVersion = lambda: 13000
    cupy.cuda.Device.pci_bus_id = "0000:00:00.0"
    cupy.cuda.get_current_stream = lambda: stream
    cupy.cuda.Event = lambda *a, **k: event
    cupy.cuda.Stream = lambda *a, **k: stream
    cupy.cuda.alloc_pinned_memory = bytearray
    from mpi4py import MPI

    import burst_hpc
    from burst_hpc.plan.workload import documents

    bf16, heads, kv_heads, d = np.dtype("bfloat16"), 64, 8, 128
    cu = documents(np.random.default_rng(0), seq, "capped", longest=seq // 4)
    q, do = (cupy.asarray(np.zeros((1, seq, heads, d), bf16)) for _ in range(2))
    k, v = (cupy.asarray(np.zeros((1, seq, kv_heads, d), bf16)) for _ in range(2))
    kw = dict(causal=True, cu_seqlens=cu)
    ranked = dict(kw, comm=MPI.COMM_SELF, layout="chunks")
    o, lse = burst_hpc.attention(q, k, v, **kw)
    calls = {"attention": lambda: burst_hpc.attention(q, k, v, **kw),
             "attention_backward": lambda: burst_hpc.attention_backward(do, q, k, v, o, lse, **kw),
             "burst_attention": lambda: burst_hpc.burst_attention(q, k, v, **ranked),
             "burst_attention_backward": lambda: burst_hpc.burst_attention_backward(do, q, k, v, o, lse, **ranked)}
    for name, call in calls.items():
        call()   # compiles its kernels, plans
        best = min(timeit.repeat(call, number=100, repeat=reps)) / 100
        print(f"{tree} sm90 {name} {best * 1e6:.1f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="*", default=["."])
    ap.add_argument("--seq", type=int, default=None, help="tokens (default 4096; --library: 8192)")
    ap.add_argument("--families", default="sm90,sm80")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--library", action="store_true", help="the public calls (8k documents) instead of block calls")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child process of one tree
    args = ap.parse_args()
    args.seq = args.seq or (8192 if args.library else 4096)
    if args.one and args.library:
        return library_calls(Path(args.trees[0]).resolve(), args.seq, args.reps)
    if args.one:
        return one_tree(Path(args.trees[0]).resolve(), args.seq, args.families.split(","), args.reps)
    with tempfile.TemporaryDirectory() as cache:  # the stand-in's kernel cache, of this run only
        env = dict(os.environ, CUPY_CACHE_DIR=cache)
        env.pop("BURST_HPC_CUDA_DIR", None)
        for _ in range(2):
            for tree in args.trees:
                subprocess.run([sys.executable, __file__, tree, "--one", "--seq", str(args.seq), "--families",
                                args.families, "--reps", str(args.reps)] + (["--library"] if args.library else []),
                               env=env, check=True)


if __name__ == "__main__":
    sys.exit(main())
