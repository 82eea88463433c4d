"""Where a short forward_block call spends its time (the host side of a ring step on a short shard): host
microseconds per call (Python and launches, nothing waited for), the GPU time of one call launched alone
against the same call queued back to back, and the host functions that cost most (cProfile).

    python3 bench/call_overhead.py [--d 128] [--s 4096] [--heads 32] [--causal] [--calls 200]

Nsight Systems is not on the GPU machines here, so the host side is read with cProfile and host clocks,
the device side with CUDA events.
"""
import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from burst_hpc.backends.cuda import CudaBackend, default_family  # noqa: E402
from timing import cupy_sample  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default=None)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--s", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    be = CudaBackend.instance(family=args.family or default_family())
    shape = (1, args.s, args.heads, args.d)
    q, k, v = (cupy.random.standard_normal(shape, dtype=cupy.float32).astype(np.dtype("bfloat16")) for _ in range(3))
    o = cupy.zeros(shape, cupy.float32)
    lse = cupy.full((1, args.heads, args.s), -cupy.inf, cupy.float32)

    def call():
        be.forward_block(q, k, v, o, lse, scale=args.d ** -0.5, causal=args.causal)

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

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        call()
    prof.disable()
    cupy.cuda.Device().synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
    flops = 4 * args.s * args.s * args.heads * args.d / (2 if args.causal else 1)
    print(text.getvalue())
    print(f"call_overhead: d={args.d} s={args.s} causal={args.causal}: host {host_us:.1f} us/call; GPU one call "
          f"alone {alone * 1e3:.1f} us ({flops / alone / 1e9:.0f} TFLOP/s), queued {queued * 1e3:.1f} us "
          f"({flops / queued / 1e9:.0f} TFLOP/s)")


if __name__ == "__main__":
    main()
