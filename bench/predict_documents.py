"""The cost model's predictions against the packed-documents runs of docs/BENCHMARKS.md ("2 and 4 x H100 after
the backward's CTA order", 2026-11-26, chunks rows): bench_documents.py's prediction path (costmodel.pick, then
costmodel.pass_prediction per pass) on the same document sets, H100's built-in rates, no GPU needed.

    python bench/predict_documents.py

Prints, per row and pass, measured and predicted TFLOP/s per GPU and predicted / measured - 1. The forward
figures were measured before the forward became ~7% faster on documents (c7074cf): the measured forward of
these rows would now be ~7% higher.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from burst_hpc.plan import costmodel, masks  # noqa: E402
from burst_hpc.plan.accounting import visible_pairs  # noqa: E402
from burst_hpc.plan.layout import make_layout  # noqa: E402
from burst_hpc.plan.rates import GPU_RATES  # noqa: E402

import bench_documents  # noqa: E402

# (GPUs, tokens a GPU, documents): measured TFLOP/s per GPU fwd, bwd, fwdbwd (docs/BENCHMARKS.md, H100 80GB HBM3)
MEASURED = {(2, 8192, "uniform"): (373, 249, 277), (2, 8192, "magi"): (409, 266, 296),
            (2, 32768, "uniform"): (545, 443, 459), (4, 8192, "uniform"): (428, 312, 340),
            (4, 8192, "magi"): (333, 223, 247), (4, 32768, "uniform"): (552, 468, 456)}
DIRECTIONS = {"fwd": (False,), "bwd": (True,), "fwdbwd": (False, True)}
FORWARD_SINCE = 1.07   # the forward's gain on documents since these runs (c7074cf), as the lead measured it


def predicted_tflops(P, tokens, dist, rates, heads=64, kv_heads=8, head_dim=128):
    """{pass: predicted TFLOP/s per GPU} of the chunks layout, as bench_documents.measure predicts it."""
    S = P * tokens
    cu = bench_documents.document_set(dist, S, 0, S // 4)
    mask = masks.make(S, True, None, cu)
    problem = costmodel.Problem(1, S, heads, kv_heads, head_dim, 2, mask)
    cluster = costmodel.Cluster(1, P)
    placed = make_layout("chunks", S, P, mask)
    scheme = costmodel.pick(problem, cluster, rates, placed)
    flops = 4.0 * visible_pairs(mask) * heads * head_dim
    out = {}
    for pass_, directions in DIRECTIONS.items():
        seconds = sum(costmodel.pass_prediction(scheme, problem, cluster, rates, placed, b).time for b in directions)
        out[pass_] = flops * bench_documents.PASS_FLOPS[pass_] / P / seconds / 1e12
    return out


def main():
    rates = GPU_RATES["H100"]
    print("| GPUs | tokens/GPU | documents | pass | measured | predicted | predicted / measured - 1 | "
          "against the forward ~7% faster |")
    print("|---|---|---|---|---|---|---|---|")
    worst = now = 0.0
    for (P, tokens, dist), measured in MEASURED.items():
        got = predicted_tflops(P, tokens, dist, rates)
        for pass_, value in zip(DIRECTIONS, measured):
            error = got[pass_] / value - 1
            faster = got[pass_] / (value * FORWARD_SINCE) - 1 if pass_ == "fwd" else error
            worst, now = max(worst, abs(error)), max(now, abs(faster))
            print(f"| {P} | {tokens // 1024}k | {dist} | {pass_} | {value} | {got[pass_]:.0f} | {error:+.1%} | "
                  f"{faster:+.1%} |")
    print(f"worst: {worst:.1%} (against the forward ~7% faster: {now:.1%})")


if __name__ == "__main__":
    main()
