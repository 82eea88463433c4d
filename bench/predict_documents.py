"""The cost model's predictions against the packed-documents runs on the current kernels and placement
(docs/BENCHMARKS.md, "The placement weighs the keys each rank receives": the 4 x H100 and 2 x H200 rows of the
chunks layout; "4 x H200 meets the 8k targets": the 4 x H200 rows): bench_documents.py's prediction path (the chunks placed with the model's chunk and receive weight
by costmodel.cluster_layouts, costmodel.pick, then costmodel.pass_prediction per pass) on the same document sets,
the built-in rates of the GPU each row ran on, no GPU needed.

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

# (GPUs, tokens a GPU, documents, GPU): measured TFLOP/s per GPU fwd, bwd, fwdbwd (docs/BENCHMARKS.md, 2026-11-28,
# the kernels of c81e218, the middle of each measured range; 4 x H200: the twentieth session's, the median of four)
MEASURED = {(4, 8192, "uniform", "H100"): (544, 403.5, 438.5), (4, 8192, "magi", "H100"): (435, 326.5, 355.5),
            (2, 8192, "uniform", "H200"): (488, 384, 409), (2, 8192, "magi", "H200"): (498, 412, 433.5),
            (4, 8192, "uniform", "H200"): (548, 391.5, 425), (4, 8192, "magi", "H200"): (465, 365.5, 390)}
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
    print("| GPUs | tokens/GPU | documents | pass | measured | predicted | predicted / measured - 1 |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for (P, tokens, dist, gpu), measured in MEASURED.items():
        got = predicted_tflops(P, tokens, dist, GPU_RATES[gpu])
        for pass_, value in zip(DIRECTIONS, measured):
            error = got[pass_] / value - 1
            worst = max(worst, abs(error))
            print(f"| {P} x {gpu} | {tokens // 1024}k | {dist} | {pass_} | {value:g} | {got[pass_]:.0f} | "
                  f"{error:+.1%} |")
    print(f"worst: {worst:.1%}")


if __name__ == "__main__":
    main()
