"""burst_attention: exact attention over a sequence sharded across the ranks of an MPI communicator.

Each rank passes its own shard (in ``layout``) of q, k, v. The forward pass sends K/V around
the ring and merges partial results (GAO); the backward pass reuses (o, lse) from the forward
pass and sends either the query side (q-ring) or K/V (kv-ring) around, whichever moves fewer
bytes. With the balanced layout and a causal mask the schedule deals chunk pairs to ranks
instead (schedule.balanced_tasks): the near pairs go where the chosen side travels, the far
ones to the other owner, which returns its partial (o, lse), dq or dk, dv.
"""
import contextlib
import logging
import os

import numpy as np

from . import masks
from .backends import get_backend
from .dtypes import accum_dtype, dtype_name
from .errors import BurstError, ShapeError
from .layout import check_layout, check_split, default_layout
from .merge import merge_into
from .ring import Side, run
from .schedule import visit_pairs
from .schemes import check_scheme, make as make_scheme, ulysses_heads
from .topology import topology
from . import ulysses
from .collective import agree, one_fails_all, world
from .device import gpus_shared
from .transport import choose_transport, make_transport
from .transport.emulated import EmulatedNetwork, Nic, setting as emulated_network
from .validate import check_like, check_qkv, check_same_kind, resolve_scale

log = logging.getLogger("burst_hpc")
BACKWARD_RINGS = ("auto", "q", "kv")


class _Plan:
    """What every rank agreed on before the first exchange."""

    def __init__(self, comm, q, k, v, causal, scale, layout, transport, backward=None, cu_seqlens=None, window=None,
                 scheme="auto", ranks_per_node=None):
        """``backward``: (do, o, lse, backward_ring) for the backward pass, checked too."""
        self.comm, self.rank, self.size = comm, comm.rank, comm.size
        error, signature, offsets = None, None, None
        on_device = type(q).__module__.startswith("cupy")
        shared = gpus_shared(comm, q.device if on_device else None)  # collective: before any check can fail
        self.topo, topo_error = None, None
        # collective too (one allgather); the flat ring needs it only to emulate or count the network
        if scheme != "ring" or ranks_per_node is not None or os.environ.get("BURST_HPC_EMULATE_NETWORK"):
            try:
                self.topo = topology(comm, ranks_per_node)
            except BurstError as e:
                topo_error = e
        try:
            check_scheme(scheme)
            if topo_error is not None:
                raise topo_error
            arrays = {"q": q, "k": k, "v": v}
            if backward is not None:
                arrays.update(zip(("do", "o", "lse"), backward[:3]))
            check_same_kind(**arrays)
            b, sq, sk, hq, hkv, d = check_qkv(q, k, v)
            if sq != sk:
                raise ShapeError(f"q and k shards must hold the same tokens; got {sq} and {sk} per rank")
            self.mask = masks.make(sq * self.size, causal, window, cu_seqlens)
            if layout is None and self.mask is not None:
                layout = masks.default_layout(self.mask, self.size)
            self.layout = check_layout(default_layout(causal) if layout is None else layout)
            self.seqlen = check_split(sq * self.size, self.size, self.layout) * self.size
            self.ring = None
            if backward is not None:
                do, o, lse, ring = backward
                check_like("do", do, q.shape, q.dtype)
                check_like("o", o, q.shape, q.dtype)
                check_like("lse", lse, (b, hq, sq), np.float32)
                self.ring = choose_backward_ring(ring, hq, hkv, d, q.dtype.itemsize,
                                                 *(masks.ring_steps(self.mask, self.size, self.layout, queries_travel)
                                                   for queries_travel in (True, False)), self.size)
            self.scale = resolve_scale(scale, d)
            self.causal = bool(causal)
            self.backend = get_backend(q)
            self.transport_name = choose_transport(transport, self.backend.name == "cuda", shared)
            self.heads, self.kv_heads, self.head_dim = hq, hkv, d
            self.scheme_name = resolve_scheme(scheme, self.topo, self.layout, self.causal, self.mask, q.shape, hkv,
                                              q.dtype.itemsize, backward is not None, self.backend.name)
            self.scheme = make_scheme(self.scheme_name, comm, self.topo, self.seqlen, self.layout, self.causal,
                                      self.mask)
            if self.scheme_name == "ulysses_ring":
                self.ranges = ulysses_heads(hq, hkv, self.topo.per_node)
            self.network = emulated_network()
            signature = {"scheme": self.scheme_name, "emulated network": self.network,
                         "q shape": q.shape, "k shape": k.shape, "dtype": dtype_name(q.dtype),
                         "causal": self.causal, "layout": self.layout, "scale": self.scale,
                         "transport": self.transport_name, "backward ring": self.ring,
                         "window": None if self.mask is None else self.mask.window}
            offsets = None if self.mask is None else self.mask.cu_seqlens
        except Exception as e:  # shared with every rank below, so no rank is left waiting
            error = e if isinstance(e, BurstError) else BurstError(f"{type(e).__name__}: {e}")
        agree(comm, error, signature, {"cu_seqlens": offsets})
        self.xp = self.backend.xp
        self.acc = accum_dtype(q.dtype)

    def pieces(self, position):
        """The tokens of the shard at ``position`` of the scheme's ring."""
        return self.scheme.pieces(position)

    def steps(self, near, returns):
        """This rank's schedule; ``near``: the side a plain ring sends around (and the balanced
        schedule to its near chunk pairs); ``returns``: the sides whose visits return partials."""
        return self.scheme.steps(near, returns)

    def transport(self):
        """The transport of the scheme's ring."""
        return self.transports()[0]

    def transports(self):
        """(near, far): the scheme's ring transport, and the one for transfers that complete steps
        after they are posted (the double ring's network lane): over a duplicate communicator, so
        they never queue behind (NCCL) or share staging buffers with (staged) the inner ring's.
        With BURST_HPC_EMULATE_NETWORK both are held to one emulated NIC between nodes."""
        near = make_transport(self.transport_name, self.scheme.comm, self.xp)
        far = near if self.scheme.far_comm is None else make_transport(self.transport_name, self.scheme.far_comm,
                                                                       self.xp)
        if self.network is None:
            return near, far
        nic = Nic(*self.network)
        held = EmulatedNetwork(near, self.scheme.remote, nic)
        return held, held if far is near else EmulatedNetwork(far, self.scheme.remote, nic)


def _device_of(x):
    """CuPy arrays: their device as a context; NumPy arrays: nothing to enter."""
    return x.device if type(x).__module__.startswith("cupy") else contextlib.nullcontext()


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
    plan = _Plan(comm, q, k, v, causal, scale, layout, transport, cu_seqlens=cu_seqlens, window=window, scheme=scheme,
                 ranks_per_node=ranks_per_node)
    with _device_of(q), one_fails_all(comm, "burst_attention"):
        if plan.scheme_name == "ulysses_ring":
            return _ulysses_forward(plan, q, k, v, on_step=on_step)
        return _forward(plan, q, k, v, on_step=on_step)


def _ulysses_forward(plan, q, k, v, **mode):
    """All-to-all over heads inside the node, the ring over the rails, all-to-all back."""
    node, local = ulysses.node_transport(plan), plan.topo.local
    qn, kn, vn = ulysses.to_node(node, plan.ranges, local, [(q, 0, 1, 2), (k, 1, 1, 2), (v, 1, 1, 2)])
    o_n, lse_n = _forward(plan, qn, kn, vn, **mode)
    o, lse = plan.xp.zeros(q.shape, o_n.dtype), plan.xp.zeros((q.shape[0], plan.heads, q.shape[1]), lse_n.dtype)
    ulysses.from_node(node, plan.ranges, local, [(o_n, o, 0, 1, 2), (lse_n, lse, 0, 2, 1)])
    return o, lse


def _forward(plan, q, k, v, skip_compute=False, transport=None, far=None, on_step=None):
    xp, be = plan.xp, plan.backend
    o = xp.zeros(q.shape, plan.acc)
    lse = xp.full((q.shape[0], q.shape[2], q.shape[1]), -xp.inf, plan.acc)
    sides = {"kv": Side(_contiguous(xp, k, v), []),
             "q": Side(_contiguous(xp, q), [o, lse], (0, -xp.inf), lambda into, part: merge_into(*into, *part))}

    def pair(p, q_side, kv, q_out, _k_out):
        be.forward_block(q_side[0][:, p.q], kv[0][:, p.k], kv[1][:, p.k], q_out[0][:, p.q], q_out[1][:, :, p.q],
                         scale=plan.scale, causal=p.causal, q_start=p.q_start, k_start=p.k_start, mask=plan.mask)

    run(*_lanes(plan, transport, far), plan.steps("kv", ("q",)), sides, _visits(plan, sides, pair),
        skip_compute=skip_compute, on_step=on_step)
    return o.astype(q.dtype), lse.astype(xp.float32)


def _lanes(plan, transport, far):
    """(near, far) transports: the plan's, or the caller's (``far`` defaults to ``transport``)."""
    if transport is None:
        return plan.transports()
    return transport, transport if far is None else far


def _contiguous(xp, *arrays):
    return [xp.ascontiguousarray(a) for a in arrays]


def _add(into, part):
    for a, b in zip(into, part):
        a += b


def _visits(plan, sides, pair):
    """The engine's compute: a kv visit meets this rank's query side with the visiting keys
    (the partial holds key-side results), a q visit meets the visiting query side with this
    rank's keys (the partial holds query-side results). ``pair(p, q_side, kv, q_out, k_out)``
    runs one block pair."""
    mine = plan.pieces(plan.scheme.position)

    def compute(visit, data, partial):
        theirs = plan.pieces(visit.shard)
        if visit.side == "kv":
            args = (sides["q"].travelling, data, sides["q"].results, partial)
            q_pieces, k_pieces = mine, theirs
        else:
            args = (data, sides["kv"].travelling, partial, sides["kv"].results)
            q_pieces, k_pieces = theirs, mine
        for p in visit_pairs(q_pieces, k_pieces, plan.causal, visit.half, plan.mask):
            pair(p, *args)

    return compute


def backward_ring_bytes(heads, kv_heads, head_dim, itemsize):
    """Bytes per token moved each step by the (q-ring, kv-ring) backward (DESIGN.md)."""
    q_ring = heads * head_dim * (2 * itemsize + 4) + 8 * heads
    kv_ring = kv_heads * head_dim * (2 * itemsize + 2 * 4)
    return q_ring, kv_ring


def choose_backward_ring(name, heads, kv_heads, head_dim, itemsize, q_steps=1, kv_steps=1, size=1):
    """The backward ring: ``name``, or for 'auto' the one moving fewer bytes over its steps (with
    documents or a window a ring may stop early: ``q_steps``/``kv_steps`` of ``size``)."""
    if name not in BACKWARD_RINGS:
        raise BurstError(f"unknown backward_ring {name!r}; use one of {', '.join(BACKWARD_RINGS)}")
    if name != "auto":
        return name
    q_bytes, kv_bytes = backward_ring_bytes(heads, kv_heads, head_dim, itemsize)
    if (q_steps, kv_steps) != (size, size):  # a shortened ring sends its carried accumulator home in one hop
        q_bytes, kv_bytes = q_bytes * q_steps, kv_bytes * kv_steps
    choice = "q" if q_bytes < kv_bytes else "kv"
    log.info("backward ring auto -> %s-ring (%d vs %d bytes per token per step)", choice,
             min(q_bytes, kv_bytes), max(q_bytes, kv_bytes))
    return choice


def burst_attention_backward(do, q, k, v, o, lse, comm=None, causal=False, scale=None, layout=None,
                             transport="auto", backward_ring="auto", cu_seqlens=None, window=None, scheme="auto",
                             ranks_per_node=None, on_step=None):
    """This rank's (dq, dk, dv) for the loss sum(do * o), reusing (o, lse) from burst_attention
    (called with the same causal, layout, cu_seqlens, window, scheme and ranks_per_node).
    ``on_step`` as burst_attention's."""
    comm = world() if comm is None else comm
    plan = _Plan(comm, q, k, v, causal, scale, layout, transport, backward=(do, o, lse, backward_ring),
                 cu_seqlens=cu_seqlens, window=window, scheme=scheme, ranks_per_node=ranks_per_node)
    with _device_of(q), one_fails_all(comm, "burst_attention_backward"):
        if plan.scheme_name == "ulysses_ring":
            return _ulysses_backward(plan, plan.ring, do, q, k, v, o, lse, on_step=on_step)
        return _backward(plan, plan.ring, do, q, k, v, o, lse, on_step=on_step)


def _ulysses_backward(plan, ring, do, q, k, v, o, lse, **mode):
    """delta here, then as the forward: all-to-all in, the ring over the rails, all-to-all back
    (the gradients of a K/V head shared by several ranks summed in float32)."""
    node, local, xp = ulysses.node_transport(plan), plan.topo.local, plan.xp
    delta = plan.backend.delta(do, o)
    arrays = [(q, 0, 1, 2), (k, 1, 1, 2), (v, 1, 1, 2), (do, 0, 1, 2), (lse, 0, 2, 1), (delta, 0, 2, 1)]
    qn, kn, vn, don, lsen, deltan = ulysses.to_node(node, plan.ranges, local, arrays)
    grads = _backward(plan, ring, don, qn, kn, vn, None, lsen, delta=deltan, cast=False, **mode)
    dq, dk, dv = (xp.zeros(x.shape, plan.acc) for x in (q, k, v))
    ulysses.from_node(node, plan.ranges, local, [(grads[0], dq, 0, 1, 2), (grads[1], dk, 1, 1, 2),
                                                 (grads[2], dv, 1, 1, 2)])
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _backward(plan, ring, do, q, k, v, o, lse, skip_compute=False, transport=None, far=None, delta=None, cast=True,
              on_step=None):
    xp, be, acc = plan.xp, plan.backend, plan.acc
    delta = be.delta(do, o) if delta is None else delta
    dq, dk, dv = xp.zeros(q.shape, acc), xp.zeros(k.shape, acc), xp.zeros(v.shape, acc)
    sides = {"kv": Side(_contiguous(xp, k, v), [dk, dv], (0, 0), _add),
             "q": Side(_contiguous(xp, q, do, lse.astype(xp.float32, copy=False), delta), [dq], (0,), _add)}

    def pair(p, q_side, kv, q_out, k_out):
        q_, do_, lse_, delta_ = q_side
        be.backward_block(q_[:, p.q], kv[0][:, p.k], kv[1][:, p.k], do_[:, p.q], lse_[:, :, p.q], delta_[:, :, p.q],
                          q_out[0][:, p.q], k_out[0][:, p.k], k_out[1][:, p.k], scale=plan.scale,
                          causal=p.causal, q_start=p.q_start, k_start=p.k_start, mask=plan.mask)

    run(*_lanes(plan, transport, far), plan.steps(ring, ("kv", "q")), sides, _visits(plan, sides, pair),
        skip_compute=skip_compute, on_step=on_step)
    if not cast:
        return dq, dk, dv
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def resolve_scheme(name, topo, layout, causal, mask, q_shape, kv_heads, itemsize, backward, backend="numpy"):
    """The concrete scheme: ``name``, or for 'auto' 'ring' on one node and otherwise the cost model's
    fastest of the schemes that fit the layout and heads (costmodel.pick)."""
    if name != "auto":
        return name
    if topo is None or topo.nodes == 1:
        return "ring"
    from . import costmodel

    choice = costmodel.pick_for_call(topo, layout, causal, mask, q_shape, kv_heads, itemsize, backward, backend)
    log.info("scheme auto -> %s (%d nodes x %d ranks)", choice, topo.nodes, topo.per_node)
    return choice


__all__ = ["burst_attention", "burst_attention_backward", "choose_backward_ring", "backward_ring_bytes"]
