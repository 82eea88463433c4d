"""The first call of each pass against the second, on the GPU, and the kernel cache's compile log: run it
twice on one fresh CUPY_CACHE_DIR, the first run finds the cache empty (cold), the second full (warm).

    d=$(mktemp -d); export CUPY_CACHE_DIR=$d
    python3 bench/first_call.py --label cold --json cold.json
    python3 bench/first_call.py --label warm --json warm.json --against cold.json
    mpirun -np 8 -x CUPY_CACHE_DIR python3 -m mpi4py bench/first_call.py --label "8 ranks" --check-once

Each rank holds S / P tokens (ranks share the GPUs: local rank mod GPU count). Prints, on rank 0, the
seconds of the first and second forward and backward calls (burst_attention, burst_attention_backward,
timed to the slowest rank), the builds compiled during this run (from the cache's compile log) and how
many times each build was ever compiled in this cache directory. --check-once exits 1 when a build was
compiled more than once; --against prints the first calls' seconds minus another run's.
"""
import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from burst_hpc import burst_attention, burst_attention_backward, config  # noqa: E402
from burst_hpc.backends.cuda.compile import compiles  # noqa: E402
from burst_hpc.device import select_device  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--no-causal", action="store_true")
    ap.add_argument("--label", default="")
    ap.add_argument("--json", help="write rank 0's numbers here")
    ap.add_argument("--against", help="a --json file of another run (the warm one's against the cold one)")
    ap.add_argument("--check-once", action="store_true", help="exit 1 if a build was compiled more than once")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    select_device(comm)
    causal = not args.no_causal
    directory = config.kernel_cache_dir()
    before = len(compiles(directory)) if comm.rank == 0 else 0
    rng = cupy.random.default_rng(comm.rank)
    shape = (1, args.seqlen // comm.size, args.heads, args.head_dim)
    kv = (1, args.seqlen // comm.size, args.kv_heads, args.head_dim)
    q, do = (rng.standard_normal(shape, dtype=cupy.float32).astype(np.dtype(args.dtype)) for _ in range(2))
    k, v = (rng.standard_normal(kv, dtype=cupy.float32).astype(np.dtype(args.dtype)) for _ in range(2))
    cupy.cuda.runtime.deviceSynchronize()

    def timed(call):
        comm.Barrier()
        t0 = time.perf_counter()
        out = call()
        cupy.cuda.runtime.deviceSynchronize()
        return out, comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    seconds = {}
    for n in ("first", "second"):
        (o, lse), seconds[f"{n} forward"] = timed(lambda: burst_attention(q, k, v, comm=comm, causal=causal))
    for n in ("first", "second"):
        _, seconds[f"{n} backward"] = timed(lambda: burst_attention_backward(do, q, k, v, o, lse, comm=comm,
                                                                            causal=causal))
    comm.Barrier()
    if comm.rank != 0:
        return comm.bcast(None)
    log = compiles(directory)
    counts = Counter(build for build, *_ in log)
    result = {"label": args.label, "ranks": comm.size, "cache": directory, "seconds": seconds,
              "compiled this run": [f"{b} {s:.2f}s" for b, s, *_ in log[before:]],
              "most compiles of one build": max(counts.values(), default=0),
              "builds in cache": len(counts)}
    print(f"first_call {args.label}: {comm.size} rank(s), S={args.seqlen}, H={args.heads}/{args.kv_heads}, "
          f"D={args.head_dim}, {args.dtype}, causal={causal}, cache {directory}")
    print("  " + ", ".join(f"{k} {v:.3f} s" for k, v in seconds.items()))
    print(f"  compiled this run: {len(log) - before} build(s), {sum(s for _, s, *_ in log[before:]):.1f} s of "
          f"compiling: {', '.join(result['compiled this run']) or 'none'}")
    print(f"  builds in this cache: {len(counts)}, most compiles of one build: {result['most compiles of one build']}")
    if args.against:
        other = json.loads(Path(args.against).read_text())
        for key in ("first forward", "first backward"):
            print(f"  {key}: {other['label']} {other['seconds'][key]:.3f} s, {args.label} {seconds[key]:.3f} s, "
                  f"difference {other['seconds'][key] - seconds[key]:+.3f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    once = result["most compiles of one build"] <= 1
    if args.check_once:
        print(f"  each build compiled once: {'yes' if once else 'NO'}")
    return comm.bcast(0 if once or not args.check_once else 1)


if __name__ == "__main__":
    sys.exit(main())
