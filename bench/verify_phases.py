"""Where --verify's time goes on one device, at the README's job shape (Hq 32, Hkv 8, D 128, bf16, causal,
forward and backward; issue 25: at most 10% of the passes at S >= 128k): the costs the check calibrates,
its blocks, the predicted and the measured seconds, and each block's calls timed apart (synchronized, so
these timings add a wait per call that the check itself does not have). Random inputs and outputs: the
check fails, only its cost is measured. The check runs twice; the second is the measurement.
    python3 bench/verify_phases.py [SEQLEN] [--passes SECONDS] [--cpu]
(--passes: the passes' seconds the job's budget is a share of; default 0.89, an H100's at S = 131072.)
"""
import argparse
import time
from types import SimpleNamespace

import numpy as np
from mpi4py import MPI

from burst_hpc import verify
from burst_hpc.dtypes import bfloat16


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("seqlen", type=int, nargs="?", default=131072)
    parser.add_argument("--passes", type=float, default=0.89)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    if args.cpu:
        xp = np
    else:
        import cupy as xp
    s, hq, hk, d = args.seqlen, 32, 8, 128
    spec = SimpleNamespace(batch=1, seqlen=s, heads=hq, kv_heads=hk, head_dim=d, dtype=np.dtype(bfloat16),
                           cu_seqlens=None)
    normal = np.random.default_rng(0).standard_normal if xp is np else xp.random.standard_normal
    bits = lambda h: (normal((1, s, h, d), np.float32).view(xp.uint32) >> 16).astype(xp.uint16)
    inputs = {"q": bits(hq), "k": bits(hk), "v": bits(hk), "do": bits(hq)}
    outputs = {"o": bits(hq), "lse": xp.full((1, hq, s), 5.0, np.float32), "dq": bits(hq), "dk": bits(hk),
               "dv": bits(hk)}

    calls, costs, plans = [], [], []
    cost_model, plan = verify.cost_model, verify.plan

    def sync():
        if xp is not np:
            xp.cuda.Device().synchronize()

    def timed(name, method):
        def call(self, *a, **kw):
            sync()
            begin = time.perf_counter()
            method(self, *a, **kw)
            sync()
            calls.append((name, len(a[0]), time.perf_counter() - begin))
        return call

    verify.cost_model = lambda *a, **kw: costs.append(cost_model(*a, **kw)) or costs[-1]
    verify.plan = lambda *a, **kw: plans.append(plan(*a, **kw)) or plans[-1]
    verify.Samples.add_keys = timed("add_keys", verify.Samples.add_keys)
    verify.Samples.add_queries = timed("add_queries", verify.Samples.add_queries)
    budget = verify.BUDGET["numpy" if xp is np else "cuda"] * args.passes
    for attempt in ("first", "second"):
        calls.clear()
        plans.clear()
        report = verify.verify_resident(inputs, outputs, np.arange(s), spec, MPI.COMM_SELF, True, d ** -0.5,
                                        budget_s=budget, announce=print)
        cost = costs[-1]
        blocks = plans[-1]
        print(f"{attempt}: {report['mode']}, {report['seconds']:.3f}s measured, {report['predicted_s']:.3f}s "
              f"predicted, budget {budget:.3f}s ({100 * report['seconds'] / args.passes:.1f}% of {args.passes}s "
              f"passes); cost fixed {cost.fixed * 1e3:.2f} ms/block, {cost.per_token * 1e9:.1f} ns/token, "
              f"{cost.per_pair * 1e9:.3f} ns/pair; {len(blocks)} block(s) of {blocks[0][1] - blocks[0][0]} tokens")
    print("  the calls of the second check, the calibration's first (warm-up, few samples small and large "
          "block, more samples):")
    for name, tokens, seconds in calls:
        print(f"  {name} {tokens} tokens: {seconds * 1e3:.2f} ms")
    print(f"  calls {sum(t for _, _, t in calls):.3f}s of the check's {report['seconds']:.3f}s")


if __name__ == "__main__":
    main()
