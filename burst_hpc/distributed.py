"""burst_attention: exact attention over a sequence sharded across the ranks of an MPI communicator.

Each rank passes its own shard (in ``layout``) of q, k, v. The forward pass sends K/V around
the ring and merges partial results (GAO); the backward pass reuses (o, lse) from the forward
pass and sends either the query side (q-ring) or K/V (kv-ring) around, whichever moves fewer
bytes. With the balanced layout and a causal mask the schedule deals chunk pairs to ranks
instead (schedule.balanced_tasks): the near pairs go where the chosen side travels, the far
ones to the other owner, which returns its partial (o, lse), dq or dk, dv.

Each call is its plan (callplan.CallPlan: checked and agreed by every rank) and its passes
(passes.py), run so that an error on some ranks ends every rank (collective.one_fails_all).
"""
from .callplan import CallPlan
from .collective import one_fails_all, world
from .device import array_device


def burst_attention(q, k, v, comm=None, causal=False, scale=None, layout=None, transport="auto", cu_seqlens=None,
                    window=None, scheme="auto", ranks_per_node=None, on_step=None):
    """This rank's (o, lse) of attention over the whole sharded sequence.

    q (B, S/P, Hq, D), k and v (B, S/P, Hkv, D): this rank's shards in ``layout`` ('contiguous',
    'zigzag' or 'balanced'; default zigzag when causal; with documents or a window
    masks.default_layout). 'balanced' shards are contiguous ones (natural token order) with causal
    work balanced by the schedule. Returns o like q and lse float32 (B, Hq, S/P).
    ``cu_seqlens``: global document offsets [0, ..., S] of a packed sequence, the same on every
    rank; ``window``: (left, right) sliding window, -1 unbounded (flash-attn's meaning).
    NaN or Inf inputs are not refused: they propagate like torch's (see burst_hpc.attention).
    ``scheme``: how shards cross nodes ('ring', 'double_ring', 'ulysses_ring' or 'auto': the cost
    model's pick, 'ring' on one node); ``ranks_per_node`` (or BURST_HPC_RANKS_PER_NODE) overrides
    the node detection, so one host can act as several nodes (burst_hpc.topology).
    ``on_step(done, total)``: called on this rank after each of its ring steps (progress reports)."""
    comm = world() if comm is None else comm
    plan = CallPlan(comm, q, k, v, causal, scale, layout, transport, cu_seqlens=cu_seqlens, window=window,
                    scheme=scheme, ranks_per_node=ranks_per_node)
    with array_device(q), one_fails_all(comm, "burst_attention"):
        return plan.passes.forward(q, k, v, on_step=on_step)


def burst_attention_backward(do, q, k, v, o, lse, comm=None, causal=False, scale=None, layout=None,
                             transport="auto", backward_ring="auto", cu_seqlens=None, window=None, scheme="auto",
                             ranks_per_node=None, on_step=None):
    """This rank's (dq, dk, dv) for the loss sum(do * o), reusing (o, lse) from burst_attention
    (called with the same causal, layout, cu_seqlens, window, scheme and ranks_per_node).
    ``on_step`` as burst_attention's."""
    comm = world() if comm is None else comm
    plan = CallPlan(comm, q, k, v, causal, scale, layout, transport, backward=(do, o, lse, backward_ring),
                    cu_seqlens=cu_seqlens, window=window, scheme=scheme, ranks_per_node=ranks_per_node)
    with array_device(q), one_fails_all(comm, "burst_attention_backward"):
        return plan.passes.backward(plan.ring, do, q, k, v, o, lse, on_step=on_step)


__all__ = ["burst_attention", "burst_attention_backward"]
