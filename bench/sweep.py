"""The single-GPU sweep the cost model's kernel prices are fitted on (bench/data/sweep-*.json, rates.py): one call over
S tokens of causal documents (equal lengths; two sets each of uniform lengths up to S/4 and of MagiAttention's
lengths), its GPU time queued behind a busy kernel, forward and backward; bf16, Hq = 64, Hkv = 8, D = 128. On a GPU:

    PYTHONPATH=$PWD python3 bench/sweep.py bench/data/sweep-DATE.json

then `python3 bench/predict_sweep.py` (after pointing its DATA there) prices the calls, and
burst_hpc.plan.calibrate.fit_tiles over them gives the prices."""
import json
import statistics
import subprocess
import sys

import cupy
import numpy as np
from bench_packed import bf16_inputs, document_sets
from timing import cupy_gpu_sample

import burst_hpc


def main(path):
    cases = [(8192, f"L={L}", np.arange(0, 8193, L)) for L in (8192, 4096, 2048, 1024, 512, 256, 128)]
    cases += [(32768, f"L={L}", np.arange(0, 32769, L)) for L in (32768, 8192, 2048, 512)]
    for S in (8192, 32768):
        for dist in ("uniform", "magi"):
            cases += [(S, f"{dist} set{i}", np.asarray(cu)) for i, cu in enumerate(document_sets(dist, S, 2))]
    rows = []
    inputs = {S: bf16_inputs(S) for S in (8192, 32768)}
    for S, case, cu in cases:
        q, k, v, do = inputs[S]
        o, lse = burst_hpc.attention(q, k, v, causal=True, cu_seqlens=cu)
        fns = {"fwd": lambda: burst_hpc.attention(q, k, v, causal=True, cu_seqlens=cu),
               "bwd": lambda: burst_hpc.attention_backward(do, q, k, v, o, lse, causal=True, cu_seqlens=cu)}
        row = {"S": S, "case": case, "cu": [int(x) for x in cu]}
        for p, fn in fns.items():
            for _ in range(2):
                fn()
            row[f"{p}_us"] = 1e3 * statistics.median(cupy_gpu_sample(fn, calls=3, busy_ms=20.0) for _ in range(5))
        rows.append(row)
        print(S, case, round(row["fwd_us"]), round(row["bwd_us"]), flush=True)
    tree = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "?"
    with open(path, "w") as f:
        json.dump({"source": f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, tree {tree}",
                   "heads": 64, "kv_heads": 8, "head_dim": 128, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
