"""The simplest alternative to the balanced schedule, for bench_ring.py: contiguous shards
turned into zigzag ones by an all-to-all (layout.relayout), the zigzag ring, and the results
turned back into contiguous shards. A training step keeps the zigzag q, k, v, o, lse of the
forward pass for the backward pass, so that one moves only dO there and dQ, dK, dV back.

``exchange`` is an open transport (transport.make_transport, or benchmark.NoExchange to time
the rest);
``zigzag_forward(q, k, v)`` and ``zigzag_backward(do, q, k, v, o, lse)`` run the ring on zigzag
shards. Checked against the oracle in mpi_tests/test_ring.py (CPU) and test_ring_gpu.py.
"""
from burst_hpc.plan.layout import make_layout, relayout


def placed(x, axis, exchange, *kinds):
    """The Layouts of ``kinds`` for the sequence whose shard on this rank is ``x``."""
    return [make_layout(kind, x.shape[axis] * exchange.size, exchange.size) for kind in kinds]


def to_zigzag(exchange, *arrays, axis=1):
    return [relayout(x, *placed(x, axis, exchange, "contiguous", "zigzag"), exchange, axis=axis) for x in arrays]


def to_contiguous(exchange, *arrays, axis=1):
    return [relayout(x, *placed(x, axis, exchange, "zigzag", "contiguous"), exchange, axis=axis) for x in arrays]


def forward(exchange, zigzag_forward, q, k, v):
    """Contiguous (o, lse) from contiguous q, k, v, and what ``backward`` reuses."""
    zq, zk, zv = to_zigzag(exchange, q, k, v)
    zo, zlse = zigzag_forward(zq, zk, zv)
    (o,), (lse,) = to_contiguous(exchange, zo), to_contiguous(exchange, zlse, axis=2)
    return o, lse, (zq, zk, zv, zo, zlse)


def backward(exchange, zigzag_backward, do, saved):
    """Contiguous (dq, dk, dv) from the contiguous ``do`` and ``saved`` from ``forward``."""
    (zdo,) = to_zigzag(exchange, do)
    return to_contiguous(exchange, *zigzag_backward(zdo, *saved))
