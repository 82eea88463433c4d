"""The cost model's predictions against the packed-documents runs on the current kernels (docs/BENCHMARKS.md,
"Where the 4-GPU calls of MagiAttention's lengths wait": the 4 x H200 table row, and the 2 x H200 rows of the tree
before its tried change; chunks layout): bench_documents.py's prediction
path (the chunks placed with the model's chunk by costmodel.cluster_layouts, costmodel.pick, then
costmodel.pass_prediction per pass) on the same document sets, H200's built-in rates, no GPU needed.

    python bench/predict_documents.py

Prints, per row and pass, measured and predicted TFLOP/s per GPU and predicted / measured - 1.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from burst_hpc.plan import costmodel, masks  # noqa: E402
from burst_hpc.plan.accounting import visible_pairs  # noqa: E402
from burst_hpc.plan.rates import GPU_RATES  # noqa: E402

import bench_documents  # noqa: E402

# (GPUs, tokens a GPU, documents): measured TFLOP/s per GPU fwd, bwd, fwdbwd (docs/BENCHMARKS.md, NVIDIA H200, the
# kernels of c81e218, the middle of each measured range)
MEASURED = {(4, 8192, "uniform"): (496, 411, 434.5), (4, 8192, "magi"): (428, 340, 364),
            (2, 8192, "uniform"): (478.5, 370, 396), (2, 8192, "magi"): (504, 385, 415)}
DIRECTIONS = {"fwd": (False,), "bwd": (True,), "fwdbwd": (False, True)}


def predicted_tflops(P, tokens, dist, rates, heads=64, kv_heads=8, head_dim=128):
    """{pass: predicted TFLOP/s per GPU} of the chunks layout, as bench_documents.measure predicts it."""
    S = P * tokens
    cu = bench_documents.document_set(dist, S, 0, S // 4)
    mask = masks.make(S, True, None, cu)
    problem = costmodel.Problem(1, S, heads, kv_heads, head_dim, 2, mask)
    cluster = costmodel.Cluster(1, P)
    placed = costmodel.cluster_layouts(problem, cluster, rates, ("chunks",))["chunks"]
    scheme = costmodel.pick(problem, cluster, rates, placed)
    flops = 4.0 * visible_pairs(mask) * heads * head_dim
    out = {}
    for pass_, directions in DIRECTIONS.items():
        seconds = sum(costmodel.pass_prediction(scheme, problem, cluster, rates, placed, b).time for b in directions)
        out[pass_] = flops * bench_documents.PASS_FLOPS[pass_] / P / seconds / 1e12
    return out


def main():
    rates = GPU_RATES["H200"]
    print("| GPUs | tokens/GPU | documents | pass | measured | predicted | predicted / measured - 1 |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for (P, tokens, dist), measured in MEASURED.items():
        got = predicted_tflops(P, tokens, dist, rates)
        for pass_, value in zip(DIRECTIONS, measured):
            error = got[pass_] / value - 1
            worst = max(worst, abs(error))
            print(f"| {P} | {tokens // 1024}k | {dist} | {pass_} | {value:g} | {got[pass_]:.0f} | {error:+.1%} |")
    print(f"worst: {worst:.1%}")


if __name__ == "__main__":
    main()
