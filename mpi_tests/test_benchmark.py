"""The benchmark timing hook (burst_hpc.benchmark.RingBenchmark) on the CPU path: its "full" mode is
burst_attention exactly, "comm" computes nothing, "compute" runs the kernels without moving data."""
import numpy as np
import pytest

import burst_hpc
from burst_hpc.benchmark import RingBenchmark
from burst_hpc.errors import BurstError


def test_modes(comm):
    P, r = comm.size, comm.rank
    rng = np.random.default_rng(comm.bcast(int(np.random.SeedSequence().entropy % 2**63)))
    b, hq, hkv, d, seqlen = 1, 4, 2, 16, 2 * P * 9
    q, do = (rng.standard_normal((b, seqlen, hq, d)) for _ in range(2))
    k, v = (rng.standard_normal((b, seqlen, hkv, d)) for _ in range(2))
    mine = [burst_hpc.shard(x, r, P, "zigzag") for x in (q, k, v, do)]
    kw = dict(comm=comm, causal=True, layout=burst_hpc.make_layout("zigzag", seqlen, P))

    ring = RingBenchmark(*mine[:3], backward_ring="kv", **kw)
    assert ring.transport_name == "host" and ring.layout.kind == "zigzag" and ring.backward_ring == "kv"
    o, lse = ring.forward()
    o_ref, lse_ref = burst_hpc.burst_attention(*mine[:3], **kw)
    assert np.array_equal(o, o_ref) and np.array_equal(lse, lse_ref)
    grads = ring.backward(mine[3], o, lse)
    grads_ref = burst_hpc.burst_attention_backward(mine[3], *mine[:3], o, lse, backward_ring="kv", **kw)
    assert all(np.array_equal(g, g_ref) for g, g_ref in zip(grads, grads_ref))

    o_comm, lse_comm = ring.forward("comm")
    assert not o_comm.any() and np.isneginf(lse_comm).all()
    assert not any(g.any() for g in ring.backward(mine[3], o, lse, "comm"))

    o_compute, lse_compute = ring.forward("compute")
    assert np.isfinite(o_compute).all() and o_compute.shape == o.shape
    if P == 1:  # nothing travels on one rank: the modes agree
        assert np.array_equal(o_compute, o)
    assert all(np.isfinite(g).all() for g in ring.backward(mine[3], o, lse, "compute"))

    with pytest.raises(BurstError, match="unknown benchmark mode"):
        ring.forward("fast")
