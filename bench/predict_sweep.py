"""The cost model's kernel prices against the single-GPU sweep they were fitted on (bench/data/sweep-2026-11-27.json:
one H100, the sm90 kernels on one call over causal documents at S = 8k and 32k, Hq = 64, Hkv = 8, D = 128): each
call's predicted GPU time (pricing.call_seconds with H100's built-in rates: its tiles, the forward's packing a K/V
group's query heads, and the backward's pre-pass and dQ conversion; no launch or step costs, which the sweep's
per-call GPU time does not hold) beside the measured one. No GPU needed.

    python bench/predict_sweep.py
"""
import json
import pathlib

import numpy as np

from burst_hpc.plan import masks
from burst_hpc.plan.pricing import call_seconds
from burst_hpc.plan.rates import GPU_RATES
from burst_hpc.plan.tiles import packed_heads

DATA = pathlib.Path(__file__).resolve().parent / "data" / "sweep-2026-11-27.json"


def predictions(rates=GPU_RATES["H100"], path=DATA):
    """[(S, case, pass, measured us, predicted us)] over the sweep's calls, forward and backward."""
    sweep = json.loads(pathlib.Path(path).read_text())
    out = []
    for row in sweep["rows"]:
        mask = masks.make(row["S"], True, None, np.array(row["cu"]))
        pack = packed_heads(sweep["heads"] // sweep["kv_heads"])
        for pass_, backward in (("fwd", False), ("bwd", True)):
            predicted = call_seconds(rates, mask, 1, sweep["heads"], sweep["head_dim"], backward, pack) * 1e6
            out.append((row["S"], row["case"], pass_, row[f"{pass_}_us"], predicted))
    return out


def main():
    print("| S | documents | pass | measured (us) | predicted (us) | predicted / measured - 1 |")
    print("|---|---|---|---|---|---|")
    rows = predictions()
    for S, case, pass_, measured, predicted in rows:
        error = predicted / measured - 1
        print(f"| {S // 1024}k | {case} | {pass_} | {measured:.0f} | {predicted:.0f} | {error:+.1%} |")
    worst = max(rows, key=lambda r: abs(r[4] / r[3] - 1))
    print(f"worst: {worst[4] / worst[3] - 1:+.1%} ({worst[0] // 1024}k {worst[1]} {worst[2]})")


if __name__ == "__main__":
    main()
