"""One forward_block and one backward_block call (after a warm-up call of each) on random bf16 inputs:
the target for profilers (ncu, nsys), which then see exactly one launch per kernel after warm-up.

    python3 bench/one_call.py [--family sm90] [--d 128] [--s 16384] [--heads 32] [--causal]
    ncu --kernel-name regex:attn_bwd_sm90 --launch-skip 1 --launch-count 1 python3 bench/one_call.py ...
"""
import argparse
import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from burst_hpc.backends.cuda import CudaBackend, default_family  # noqa: E402
from burst_hpc.plan import masks  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default=None)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--s", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    be = CudaBackend.instance(family=args.family or default_family())
    shape = (1, args.s, args.heads, args.d)
    q, k, v, do = (cupy.random.standard_normal(shape, dtype=cupy.float32).astype(np.dtype("bfloat16"))
                   for _ in range(4))
    scale = args.d ** -0.5
    for _ in range(2):  # the first of each is the warm-up (compilation, tensor maps)
        o = cupy.zeros(shape, cupy.float32)
        lse = cupy.full((1, args.heads, args.s), -cupy.inf, cupy.float32)
        be.forward_block(q, k, v, o, lse, scale=scale, masked=args.causal, mask=masks.make(q.shape[1], True))
        dq, dk, dv = (cupy.zeros(shape, cupy.float32) for _ in range(3))
        be.backward_block(q, k, v, do, lse, be.delta(do, o), dq, dk, dv, scale=scale, masked=args.causal,
                          mask=masks.make(q.shape[1], True))
    cupy.cuda.runtime.deviceSynchronize()
    print(f"one_call: family {be.family} d={args.d} s={args.s} causal={args.causal} finite:",
          bool(cupy.isfinite(o).all() and cupy.isfinite(dq).all()))


if __name__ == "__main__":
    main()
