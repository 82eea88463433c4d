"""The simplest alternative to the balanced schedule, for bench_ring.py: contiguous shards
turned into zigzag ones by an all-to-all (layout.relayout), the zigzag ring, and the results
turned back into contiguous shards. A training step keeps the zigzag q, k, v, o, lse of the
forward pass for the backward pass, so that one moves only dO there and dQ, dK, dV back.
NumPy or CuPy, whatever the plan's backend; checked against the oracle in mpi_tests/test_ring.py.
"""
from burst_hpc.distributed import _backward, _forward
from burst_hpc.layout import relayout


def to_zigzag(transport, *arrays, axis=1):
    return [relayout(x, "contiguous", "zigzag", transport, axis=axis) for x in arrays]


def to_contiguous(transport, *arrays, axis=1):
    return [relayout(x, "zigzag", "contiguous", transport, axis=axis) for x in arrays]


def forward(plan, transport, q, k, v, skip_compute=False):
    """``plan``: a zigzag _Plan; q, k, v: contiguous shards. Returns the contiguous (o, lse) and
    what the backward pass reuses."""
    zq, zk, zv = to_zigzag(transport, q, k, v)
    zo, zlse = _forward(plan, zq, zk, zv, skip_compute=skip_compute, transport=transport)
    (o,), (lse,) = to_contiguous(transport, zo), to_contiguous(transport, zlse, axis=2)
    return o, lse, (zq, zk, zv, zo, zlse)


def backward(plan, ring, transport, do, saved, skip_compute=False):
    """Contiguous (dq, dk, dv) from the contiguous ``do`` and ``saved`` from ``forward``."""
    zq, zk, zv, zo, zlse = saved
    (zdo,) = to_zigzag(transport, do)
    grads = _backward(plan, ring, zdo, zq, zk, zv, zo, zlse, skip_compute=skip_compute, transport=transport)
    return to_contiguous(transport, *grads)
