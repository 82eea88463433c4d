"""Exact attention over sequences split across MPI ranks (BurstAttention + DistFlashAttn).

On one device (NumPy or CuPy arrays in, the same kind out; no MPI):

- ``attention(q, k, v, causal=False, scale=None, cu_seqlens=None, window=None)`` -> ``(o, lse)``
- ``attention_backward(do, q, k, v, o, lse, ...)`` -> ``(dq, dk, dv)``
- ``attention_reference`` and ``attention_backward_reference``: the float64 oracle

Across MPI ranks, one call per rank under ``mpiexec``, on this rank's shard of the sequence:

- ``burst_attention(q, k, v, comm=None, causal=False, layout=None, scheme="auto", transport="auto", ...)``
  -> this rank's ``(o, lse)``; ``burst_attention_backward(do, q, k, v, o, lse, ...)`` -> ``(dq, dk, dv)``
- ``Decomposition(comm, seqlen=..., heads=..., head_dim=..., dtype=..., ...)``: the sequence's
  decomposition over the ranks, decided once from shapes and agreed by every rank (its layout,
  scheme, transport and backward ring); ``d.shard(x)``, then ``d.attention(q, k, v)`` and
  ``d.attention_backward(...)``
- ``Layout`` (made by ``make_layout``): which global tokens each rank holds; ``shard``, ``unshard``,
  ``layout_indices``: between a global sequence and the ranks' shards
- ``choose_layout``: the Layout the cost model predicts fastest; ``schedule_work``: the visible work
  each rank computes at each ring step
- ``select_device``: one GPU per rank, by node-local rank

Errors: :class:`BurstError` (a ``ValueError``) and its kinds (``ShapeError``, ``DTypeError``,
``LayoutError``, ``MaskError``, ``TransportError``, ``RankMismatchError``, ``BackendError``,
``FileError``, ``MpiError``, ``TopologyError``): bad input gives the same one on every rank.

The layers below, as subpackages: ``plan`` (what runs where, decided from shapes), ``engine`` (the ring
that runs a plan on arrays), ``transport``, ``backends`` (the block kernels), ``io`` (HDF5, each rank
its own tokens) and ``job`` (the command line's jobs); ``burst-hpc`` is the command (``cli``).
"""
__version__ = "0.1.0"

from .api import attention, attention_backward
from .device import select_device
from .distributed import burst_attention, burst_attention_backward
from .errors import (BackendError, BurstError, DTypeError, FileError, LayoutError, MaskError, MpiError,
                     RankMismatchError, ShapeError, TopologyError, TransportError, UsageError)
from .plan.costmodel import choose_layout
from .plan.decomposition import Decomposition
from .plan.layout import Layout, layout_indices, make_layout, shard, unshard
from .plan.workload import schedule_work
from .reference import attention_backward_reference, attention_reference

__all__ = ["select_device", "attention", "attention_backward", "burst_attention", "burst_attention_backward", "Decomposition", "Layout",
           "make_layout", "layout_indices",
           "choose_layout", "shard", "unshard", "schedule_work", "attention_reference", "attention_backward_reference",
           "BurstError", "ShapeError", "DTypeError", "LayoutError", "MaskError", "TransportError", "RankMismatchError",
           "BackendError", "FileError", "MpiError", "TopologyError", "UsageError", "__version__"]
