"""The memory per rank that docs/USAGE.md states ("Memory per rank"), against what the NumPy path
allocates (tracemalloc's peak above the inputs; CuPy holds the same arrays on the GPU). With
Q = B*(S/P)*Hq*D and K = B*(S/P)*Hkv*D elements, e the input's bytes per element and a the
accumulator's (4; 8 for float64), a plain ring (contiguous, zigzag; three ranks or more) holds on
top of its inputs:
    forward:            Q*(a + e) + 4*K*e        (o accumulator and result; two K/V receive buffers)
    backward, q-ring:   Q*(4*a + 4*e) + 2*K*a    (dq, dk, dv accumulators; two (q, do) receive buffers; three dq partials)
    backward, kv-ring:  Q*a + K*(8*a + 4*e)      (accumulators; two (k, v) receive buffers; three (dk, dv) partials)
and the balanced causal schedule at most the other side's buffers too; the NumPy backend adds score
tiles, at most about 10 arrays of B*Hq*128*max(128, D)*a bytes whatever S is."""
import tracemalloc

import numpy as np
import pytest

import burst_hpc
from burst_hpc.dtypes import bfloat16

B, N, HQ, HKV, D = 1, 1024, 2, 1, 128  # per rank; score tiles (128 x 128) stay small next to the shards


def stated(pass_, e, a, q, k):
    return {"forward": q * (a + e) + 4 * k * e,
            "q": q * (4 * a + 4 * e) + 2 * k * a,
            "kv": q * a + k * (8 * a + 4 * e),
            "balanced forward": q * (a + e) + 4 * k * e + q * (2 * e + 3 * a),
            "balanced backward": q * (4 * a + 4 * e) + 2 * k * a + k * (6 * a + 4 * e)}[pass_]


def _peak(fn):
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("dtype,layout,causal", [(np.float32, "contiguous", False), (bfloat16, "zigzag", True),
                                                 (bfloat16, "balanced", True)], ids=["fp32", "bf16", "bf16-balanced"])
def test_memory_per_rank_is_as_documented(comm, dtype, layout, causal):
    if comm.size != 3:  # 1-2 ranks need fewer receive buffers; more ranks the same as 3 (kept short)
        pytest.skip("the stated general case is checked on three ranks")
    rng = np.random.default_rng(comm.rank)
    q, do = (rng.standard_normal((B, N, HQ, D), dtype=np.float32).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((B, N, HKV, D), dtype=np.float32).astype(dtype) for _ in range(2))
    e, a = np.dtype(dtype).itemsize, 4
    elements = {"q": B * N * HQ * D, "k": B * N * HKV * D}
    kw = dict(comm=comm, causal=causal, layout=layout)
    (o, lse), peak = _peak(lambda: burst_hpc.burst_attention(q, k, v, **kw))
    peaks = {"forward": peak}
    for ring in ("q", "kv"):
        peaks[ring] = _peak(lambda: burst_hpc.burst_attention_backward(do, q, k, v, o, lse, backward_ring=ring, **kw))[1]
    peaks = {name: max(comm.allgather(p)) for name, p in peaks.items()}  # the busiest rank
    tiles = 11 * B * HQ * 128 * max(128, D) * a  # the NumPy backend's score tiles, whatever S is
    for name, measured in peaks.items():
        if layout == "balanced":  # an upper bound: which buffers a rank needs depends on P and its place
            bound = stated("balanced forward" if name == "forward" else "balanced backward", e, a, **elements)
            assert measured <= bound + tiles, (name, measured, bound)
        else:
            least = stated(name, e, a, **elements)
            assert least <= measured <= least + tiles, (name, measured / least, (measured - least) / tiles)
