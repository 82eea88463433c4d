"""A quick first look at the sm90 kernels on a GPU machine: one small forward per tile shape and one backward per
head dim, checked loosely against the float64 oracle; run it under `timeout` before longer checks, so a kernel
that hangs costs seconds, not a whole test run.

    timeout 90 python3 bench/smoke_sm90.py
"""
import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from burst_hpc import reference  # noqa: E402
from burst_hpc.backends.cuda import CudaBackend  # noqa: E402
from burst_hpc.plan import masks  # noqa: E402


def main():
    be = CudaBackend.instance(family="sm90")
    rng = np.random.default_rng()
    bad = 0
    for d in be.native_widths("fwd"):
        for rows in be.kernels.tile_heights(d):
            for causal in (False, True):
                be.kernels.forced_tile_height = rows
                b, s, hq, hkv = 1, 300, 4, 2
                q, k, v, do = (rng.standard_normal((b, s, h, d)).astype(np.float32) for h in (hq, hkv, hkv, hq))
                dev = [cupy.asarray(x).astype(np.dtype("bfloat16")) for x in (q, k, v, do)]
                o = cupy.zeros((b, s, hq, d), np.float32)
                lse = cupy.full((b, hq, s), -np.inf, np.float32)
                be.forward_block(*dev[:3], o, lse, scale=d ** -0.5, masked=causal, mask=masks.make(s, True))
                grads = [cupy.zeros(x.shape, np.float32) for x in (q, k, v)]
                be.backward_block(*dev, lse, be.delta(dev[3], o), *grads, scale=d ** -0.5, masked=causal,
                                  mask=masks.make(s, True))
                cupy.cuda.Device().synchronize()
                host = [cupy.asnumpy(x.astype(np.float32)).astype(np.float64) for x in dev]
                want = [reference.attention_reference(*host[:3], causal=causal)[0],
                        *reference.attention_backward_reference(host[3], *host[:3], causal=causal)]
                errs = [float(np.abs(cupy.asnumpy(g) - w).max() / max(np.abs(w).max(), 1e-6))
                        for g, w in zip((o, *grads), want)]
                ok = all(np.isfinite(e) and e < 3e-2 for e in errs)
                bad += not ok
                print(f"D={d} BM={rows} causal={causal}: rel err o/dq/dk/dv " + " ".join(f"{e:.1e}" for e in errs)
                      + ("" if ok else "  FAIL"), flush=True)
    be.kernels.forced_tile_height = None
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
