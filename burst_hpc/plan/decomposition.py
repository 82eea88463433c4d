"""A sequence's decomposition over the ranks of a communicator, decided once from shapes (no arrays).

mpi4py-fft's ``PFFT(comm, shape)`` is the model: the decomposition is built collectively from the
global shape, the dtype, the mask, the communicator and the options, and arrays are cut by it
afterwards (:meth:`Decomposition.shard`). Every argument is checked on every rank and agreed in one
collective (collective.agree), which also gathers what each rank's machine says (its GPU, whether
its MPI is CUDA-aware, whether NCCL loads, its GPU model): every decision after it (layout,
topology, scheme, transport, backward ring) is then made from values every rank holds alike, so
the ranks never need to agree again. Ranks that pass different arguments get one
RankMismatchError naming the first that differs; bad arguments the same error on every rank.

The decomposition owns the layout (layout.Layout), the topology, the scheme, the transport, the
backward ring, the schedules (cached by the scheme and schedule.py) and its open transports; the
passes run on it once it is bound to the arrays' backend (callplan.CallPlan).
"""
import hashlib
from dataclasses import dataclass

import numpy as np

from .. import config
from . import masks
from ..backends import get_backend
from ..collective import agree, check_comm, describe, kept, one_fails_all, world
from .decisions import (check_backward_ring, choose_backward_ring, gather_backward_ring, machine_facts, settled_scheme,
                        settled_transport)
from ..device import array_device
from ..dtypes import accum_dtype, dtype_name, parse_dtype
from ..engine import passes
from ..engine.packed import PackedPasses
from ..errors import BackendError, BurstError, ShapeError, TransportError
from .layout import Layout, as_layout, check_kind, default_kind
from .schemes import check_scheme, make as make_scheme
from .topology import ranks_per_node_setting, topology
from ..transport import TRANSPORTS, make_transport
from ..transport.emulated import EmulatedNetwork, Nic
from ..validate import check_like, check_same_kind, resolve_scale

BACKENDS = ("numpy", "cuda")


@dataclass(frozen=True)
class Request:
    """A decomposition's arguments, checked on this rank (``Request.checked``); ``mask`` the
    masks.Mask of causal, documents and window, made here once for the whole call."""
    size: int
    seqlen: int
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: np.dtype
    scale: float
    mask: object
    layout: object          # None (the default kind), 'auto' (the predicted fastest), a kind or a Layout
    scheme: str
    transport: str
    backward_ring: str
    ranks_per_node: object  # the setting (ranks_per_node or BURST_HPC_RANKS_PER_NODE), None: detect
    backend: str
    backward: bool          # whether the backward pass is priced ('auto' choices) and prepared
    network: object         # BURST_HPC_EMULATE_NETWORK's (bytes/s, seconds), or None

    @classmethod
    def checked(cls, size, *, seqlen, heads, head_dim, dtype, kv_heads=None, batch=1, causal=False, scale=None,
                cu_seqlens=None, window=None, layout=None, scheme="auto", transport="auto", backward_ring="auto",
                ranks_per_node=None, backend="numpy", backward=True):
        """The Request of these arguments over ``size`` ranks; BurstError on the first that is bad."""
        kv_heads = heads if kv_heads is None else kv_heads
        for name, value in (("seqlen", seqlen), ("batch", batch), ("heads", heads), ("kv_heads", kv_heads),
                            ("head_dim", head_dim)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ShapeError(f"{name} must be a positive integer; got {value!r}")
        if heads % kv_heads:
            raise ShapeError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
        if seqlen % size:
            raise ShapeError(f"sequence length {seqlen} does not split over {size} ranks (every rank holds S/P tokens)")
        if isinstance(layout, Layout):
            as_layout(layout, seqlen, size)
        elif layout is not None and not (isinstance(layout, str) and layout == "auto"):
            check_kind(layout)
        check_scheme(scheme)
        if transport not in TRANSPORTS:
            raise TransportError(f"unknown transport {transport!r}; use one of {', '.join(TRANSPORTS)}")
        check_backward_ring(backward_ring)
        if backend not in BACKENDS:
            raise BurstError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
        mask = masks.make(int(seqlen), causal, window, cu_seqlens)
        return cls(size, int(seqlen), int(batch), int(heads), int(kv_heads), int(head_dim), np.dtype(parse_dtype(dtype)),
                   resolve_scale(scale, head_dim), mask, layout, scheme, transport, backward_ring,
                   ranks_per_node_setting(ranks_per_node), backend, bool(backward), config.emulated_network())

    def signature(self):
        """What every rank must pass alike, by name (document offsets apart: agree compares them by digest);
        a Layout as itself (equal by its pieces, named by its kind and sizes where ranks disagree)."""
        mask = {name: value for name, value in self.mask.arguments.items() if name != "cu_seqlens"}
        return {"seqlen": self.seqlen, "batch": self.batch, "heads": self.heads, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "dtype": dtype_name(self.dtype), **mask, "scale": self.scale,
                "layout": self.layout, "scheme": self.scheme, "transport": self.transport,
                "backward_ring": self.backward_ring, "ranks_per_node": self.ranks_per_node,
                "emulated network": self.network, "backend": self.backend, "backward": self.backward}

    def agreement(self, call=None):
        """(signature, arrays): what every rank must pass alike, as collective.agree compares it: the
        arguments by name (``call``'s entries, more of a library call's own, first) and the document
        offsets (compared by digest)."""
        return dict(call or {}, **self.signature()), {"cu_seqlens": self.mask.cu_seqlens}

    def key(self, comm, call=None):
        """The DecompositionKey of this request over ``comm`` (``call`` as :meth:`agreement` takes it): the
        agreed signature, the mask's key (the document offsets by content), a Layout's key (its pieces: what
        the digest is made of, the Layout's repr naming only its kind and sizes) and the ranks."""
        signature, _ = self.agreement(call)
        layout = self.layout.key if isinstance(self.layout, Layout) else None
        return DecompositionKey((self.size, tuple(signature.items()), self.mask.key, layout),
                                (id(comm), config.plan_settings()))


@dataclass(frozen=True)
class DecompositionKey:
    """What identifies a Decomposition, hashable (the plan cache keeps decompositions by it,
    callplan.PlanCache). ``shared``: what its ranks agreed on (the request's signature, values as
    checked: scale resolved, dtype by name, layout as said; the mask's key: document offsets by
    content), the same on every rank whose arguments agree whatever their Python types (1 or True,
    int32 or int64 offsets); ``local``: this rank's communicator (its id:
    the decomposition holds it alive, so the id is not reused while the key is) and BURST_HPC_*
    settings (config.plan_settings)."""
    shared: tuple
    local: tuple

    def digest(self):
        """16 bytes from ``shared``, the same on every rank that agrees: what the ranks compare."""
        return hashlib.blake2b(repr(self.shared).encode(), digest_size=16).digest()


def open_transport(name, comm, xp):
    """The open transport of kind ``name`` over ``comm`` for arrays of module ``xp``: one for each
    (communicator, kind, array module, device), kept on the communicator (collective.kept) and shared by
    every decomposition over it, so the plans a cache keeps do not each hold streams and pinned buffers.
    A GPU transport's streams and NCCL communicator belong to the device current when it opened, so a
    call on another device opens its own."""
    state = kept(comm)
    device = xp.cuda.Device().id if hasattr(xp, "cuda") else None
    key = ("transport", name, xp.__name__, device)
    if key not in state:
        state[key] = make_transport(name, comm, xp)
    return state[key]


class Decomposition:
    """A sequence's decomposition over the ranks of ``comm``: which tokens each rank holds and how
    the shards travel, decided once from shapes and agreed by every rank (collective).

    Parameters
    ----------
    comm : mpi4py communicator, optional
        The ranks (default MPI.COMM_WORLD).
    seqlen : int
        Tokens in the whole sequence (S); every rank holds S/P.
    heads, head_dim : int
        Hq and D.
    dtype : str or numpy dtype
        Element type of q, k, v ('bfloat16', 'float16', 'float32', 'float64').
    kv_heads : int, optional
        Hkv (default ``heads``); Hq a multiple of it (GQA/MQA).
    batch : int
        B.
    causal, cu_seqlens, window, scale :
        The mask and the score scale, as burst_attention takes them.
    layout : Layout, {'contiguous', 'zigzag', 'balanced', 'auto'}, optional
        Which tokens each rank holds: None zigzag when causal, contiguous otherwise; 'auto' the one the
        cost model predicts fastest for this call (costmodel.choose_layout: safe here, since the data is
        cut by this decomposition).
    scheme, transport, backward_ring, ranks_per_node :
        As burst_attention and burst_attention_backward take them.
    backend : {'numpy', 'cuda'}
        Where the arrays live (NumPy on the CPU, CuPy on this rank's GPU): the transports follow it.
    backward : bool
        Whether the backward pass runs too ('auto' choices price it).

    Attributes
    ----------
    layout : Layout
    rank, size, local : int
        This rank, the ranks, and the tokens each holds.
    mask : masks.Mask
    scheme : the scheme object (schemes.py), ``scheme.name`` its name
    topo : topology.Topology or None (the flat ring on one node, not emulated)
    transport_name : str
    ring : {'q', 'kv'}
        The backward ring.

    Raises
    ------
    BurstError
        Bad arguments, with the same message on every rank; RankMismatchError when ranks pass different
        ones.

    Examples
    --------
    ::

        d = burst_hpc.Decomposition(comm, seqlen=S, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16",
                                    causal=True, cu_seqlens=cu, layout="auto")
        q, k, v = (d.shard(x) for x in (q_all, k_all, v_all))
        o, lse = d.attention(q, k, v)
        dq, dk, dv = d.attention_backward(do, q, k, v, o, lse)
    """

    def __init__(self, comm=None, *, seqlen, heads, head_dim, dtype, kv_heads=None, batch=1, causal=False,
                 scale=None, cu_seqlens=None, window=None, layout=None, scheme="auto", transport="auto",
                 backward_ring="auto", ranks_per_node=None, backend="numpy", backward=True):
        comm = world() if comm is None else check_comm(comm)
        error, request = None, None
        try:
            request = Request.checked(comm.size, seqlen=seqlen, heads=heads, head_dim=head_dim, dtype=dtype,
                                      kv_heads=kv_heads, batch=batch, causal=causal, scale=scale,
                                      cu_seqlens=cu_seqlens, window=window, layout=layout, scheme=scheme,
                                      transport=transport, backward_ring=backward_ring,
                                      ranks_per_node=ranks_per_node, backend=backend, backward=backward)
        except Exception as e:  # noqa: BLE001  agreed below, so no rank is left waiting
            error = as_burst_error(e)
        self.settle(comm, request, error)

    @classmethod
    def agreed(cls, comm, request, error=None, call=None):
        """Collective: the Decomposition of ``request`` (None where this rank's checks failed with
        ``error``), with ``call`` ({name: value}: more that every rank must pass alike) in the agreement."""
        decomposition = cls.__new__(cls)
        decomposition.settle(comm, request, error, call)
        return decomposition

    def settle(self, comm, request, error=None, call=None):
        """Collective: agree on ``request`` (one allgather, with each rank's machine), then decide."""
        facts, signature, arrays = None, None, {"cu_seqlens": None}
        if request is not None:
            try:
                facts = machine_facts(request)
                signature, arrays = request.agreement(call)
            except Exception as e:  # noqa: BLE001
                error = as_burst_error(e)
        everyone = agree(comm, error, signature, arrays, facts=facts)
        self.comm, self.rank, self.size, self.request, self.call = comm, comm.rank, comm.size, request, call
        try:
            self.decide(request, everyone)
        except BurstError as e:   # decided from agreed values and every rank's facts: the same on every rank
            e.agreed = True
            raise
        self.plans = {}   # binding(q, directions) -> its CallPlan (bound)

    @property
    def key(self):
        """What identifies this decomposition (DecompositionKey: what its ranks agreed on, its
        communicator and the settings)."""
        return self.request.key(self.comm, self.call)

    def decide(self, request, everyone):
        """The layout, topology, transport, scheme and backward ring, from the agreed ``request`` and
        ``everyone``'s machine facts (the topology is a collective: every rank agreed on needing it)."""
        r = request
        self.seqlen, self.local, self.batch, self.dtype = r.seqlen, r.seqlen // self.size, r.batch, r.dtype
        self.heads, self.kv_heads, self.head_dim = r.heads, r.kv_heads, r.head_dim
        self.scale, self.mask, self.network = r.scale, r.mask, r.network
        auto = isinstance(r.layout, str) and r.layout == "auto"   # one rank: every layout holds the same
        self.topo = None
        if r.scheme != "ring" or r.ranks_per_node is not None or r.network or auto and self.size > 1:
            self.topo = topology(self.comm, r.ranks_per_node)   # collective: one allgather
        self.transport_name = settled_transport(r, everyone)
        if auto and self.size > 1:
            self.layout = self.fastest_layout(everyone[0])
        else:
            self.layout = as_layout(default_kind(r.mask.causal) if r.layout is None or auto else r.layout, r.seqlen,
                                    self.size, r.mask)   # chunks: placed by it
        name = settled_scheme(r, self.topo, self.layout, everyone)
        if name == "gather":   # its backward moves keys and values; a forward alone never asks which
            self.ring = gather_backward_ring(r.backward_ring if r.backward else "auto")
        else:
            self.ring = choose_backward_ring(r.backward_ring, r.heads, r.kv_heads, r.head_dim, r.dtype.itemsize,
                                             *(masks.ring_steps(r.mask, self.layout, queries_travel)
                                               for queries_travel in (True, False)), self.size)
        self.scheme = make_scheme(name, self.comm, self.topo, self.layout, r.mask)

    def fastest_layout(self, facts):
        """The Layout the cost model predicts fastest (costmodel.choose_layout), priced with the rates of
        the machine whose ``facts`` are given (rank 0's: its GPU model and the fixed costs measured there)."""
        from .costmodel import Problem, fastest_layout
        from .rates import rates_for

        r, topo = self.request, self.topo
        per_node = topo.per_node if topo is not None and topo.nodes > 1 else None
        problem = Problem(r.batch, r.seqlen, r.heads, r.kv_heads, r.head_dim, r.dtype.itemsize, r.mask)
        found = fastest_layout(problem, self.size, rates_for(r.backend, facts["device"], facts["fixed"]), per_node,
                               r.scheme, r.backward, r.backward_ring)
        return found if found.per_node is None else found.held_by(topo.arrangement.order)

    def shard(self, x, axis=1):
        """This rank's shard of the global array ``x`` (NumPy or CuPy, the tokens along ``axis``)."""
        return self.layout.shard(x, self.rank, axis)

    def unshard(self, shards, axis=1):
        """The global array from every rank's shard (``shards[r]`` from rank r)."""
        return self.layout.unshard(shards, axis)

    def work(self):
        """Visible (query, key) pairs each rank computes in a forward pass under its scheme's schedule (the
        balanced schedule moves work off the ranks whose queries see most: workload.account)."""
        from .workload import account

        per_node = self.topo.per_node if self.topo is not None and self.topo.nodes > 1 else None
        return tuple(int(x) for x in account(self.layout, self.request.mask, self.scheme.name, "forward",
                                             per_node).work.sum(axis=0))

    def indices(self):
        """Global token indices of this rank's shard, in local order."""
        return self.layout.indices(self.rank)

    def pieces(self, position):
        """The tokens of the shard at ``position`` of the scheme's ring."""
        return self.scheme.pieces(position)

    def steps(self, near, returns):
        """This rank's schedule (cached by the schedule); ``near``: the side a plain ring sends
        around; ``returns``: the sides whose partials go home."""
        return self.scheme.steps(near, returns)

    def transports(self, xp):
        """(near, far, inner) for arrays of module ``xp``: the scheme's ring transport; the one for
        transfers between nodes that complete steps after they are posted (the double ring's network
        lane, the balanced schedule's far transfers); the one for the balanced schedule's transfers
        inside a node due steps later (None: none). Each over its own communicator, so none queues
        behind another's (NCCL); made once and kept open (open_transport). With BURST_HPC_EMULATE_NETWORK all are held
        to one emulated NIC between nodes (a new one each pass)."""
        name = self.transport_name
        near = open_transport(name, self.scheme.comm, xp)
        far, inner = (None if comm is None else open_transport(name, comm, xp)
                      for comm in (self.scheme.far_comm, self.scheme.inner_comm))
        far = near if far is None else far
        if self.network is None:
            return near, far, inner
        nic = Nic(*self.network)
        held = EmulatedNetwork(near, self.scheme.remote, nic)
        return (held, held if far is near else EmulatedNetwork(far, self.scheme.remote, nic),
                None if inner is None else EmulatedNetwork(inner, self.scheme.remote, nic))

    def node_transport(self, xp):
        """The transport over this rank's node (ulysses_ring's all-to-alls), made once and kept open
        (open_transport)."""
        return open_transport(self.transport_name, self.topo.node_comm, xp)

    def bind(self, q, directions=("fwd", "bwd")):
        """The CallPlan of this decomposition for arrays like ``q`` (collective on the GPU: the kernels
        of the passes ``directions`` are compiled once per node)."""
        return CallPlan(self, get_backend(q), directions)

    def bound(self, q, directions):
        """The CallPlan of this decomposition for arrays like ``q`` and the passes ``directions``: bound
        once (:meth:`bind`, collective on the GPU) and kept in ``plans`` by :func:`binding`."""
        key = binding(q, directions)
        if key not in self.plans:
            self.plans[key] = self.bind(q, directions)
        return self.plans[key]

    def attention(self, q, k, v, on_step=None):
        """This rank's (o, lse) of exact attention (burst_attention's result) on its shards of q, k, v."""
        return bound_call(self, "forward", (q, k, v), on_step)

    def attention_backward(self, do, q, k, v, o, lse, on_step=None):
        """This rank's (dq, dk, dv) (burst_attention_backward's result), reusing (o, lse) of :meth:`attention`."""
        return bound_call(self, "backward", (do, q, k, v, o, lse), on_step)

    def __repr__(self):
        return (f"Decomposition({self.layout!r}, scheme={self.scheme.name!r}, transport={self.transport_name!r}, "
                f"rank={self.rank})")


class CallPlan:
    """A Decomposition bound to a backend: ``decomposition`` (what every rank agreed on), ``backend``
    (the block kernels, prepared for ``directions``: 'fwd', 'bwd'), ``xp`` (its array module),
    ``acc`` (the accumulators' dtype) and ``passes`` (passes.py) that run the call."""

    def __init__(self, decomposition, backend, directions):
        """Collective on the GPU: the kernels of ``directions`` compiled once per node before any launch."""
        d = self.decomposition = decomposition
        self.backend, self.xp, self.acc = backend, backend.xp, accum_dtype(d.dtype)
        self.passes = (PackedPasses if d.scheme.packed else passes.for_plan)(self)
        if backend.name == "cuda":
            backend.prepare(d.comm, d.dtype, d.head_dim, self.passes.mask, directions)

    # what the callers read of the decomposition
    layout = property(lambda self: self.decomposition.layout)
    mask = property(lambda self: self.decomposition.mask)
    scheme = property(lambda self: self.decomposition.scheme)
    ring = property(lambda self: self.decomposition.ring)
    comm = property(lambda self: self.decomposition.comm)
    size = property(lambda self: self.decomposition.size)


def binding(q, directions):
    """What a CallPlan binds a decomposition to: the module of arrays like ``q``, their device and the
    passes ``directions`` it prepares."""
    return type(q).__module__, getattr(getattr(q, "device", None), "id", None), tuple(directions)


def bound_call(decomposition, name, arrays, on_step=None):
    """Collective: the forward (``arrays`` q, k, v) or backward (do, q, k, v, o, lse) pass ``name`` on
    ``decomposition`` (Decomposition.attention): the arrays checked against it, the verdict agreed
    (one allgather), on the plan of their backend (kept per backend, array kind and pass)."""
    d, error, plan = decomposition, None, None
    backward = name == "backward"
    q = arrays[1] if backward else arrays[0]
    try:
        want = {"q": (d.batch, d.local, d.heads, d.head_dim), "k": (d.batch, d.local, d.kv_heads, d.head_dim)}
        names = ("do", "q", "k", "v", "o", "lse") if backward else ("q", "k", "v")
        check_same_kind(**dict(zip(names, arrays)))
        backend = "cuda" if type(q).__module__.startswith("cupy") else "numpy"
        if backend != d.request.backend:   # its transport moves the other kind of buffer
            raise BackendError(f"this decomposition was made for backend={d.request.backend!r} arrays; got "
                               f"{'CuPy' if backend == 'cuda' else 'NumPy'} arrays (make one with backend={backend!r})")
        for label, x in zip(names, arrays):
            shape = (d.batch, d.heads, d.local) if label == "lse" else want["k" if label in "kv" else "q"]
            check_like(label, x, shape, np.float32 if label == "lse" else d.dtype)
    except Exception as e:  # noqa: BLE001
        error = as_burst_error(e)
    agree(d.comm, error, {"pass": name, "arrays": type(q).__module__.split(".")[0]})
    plan = d.bound(q, ("bwd",) if backward else ("fwd",))
    with array_device(q), one_fails_all(d.comm, f"Decomposition.attention{'_backward' if backward else ''}"):
        if backward:
            return plan.passes.backward(d.ring, *arrays, on_step=on_step)
        return plan.passes.forward(*arrays, on_step=on_step)


def as_burst_error(error):
    """``error`` as a BurstError (ours as they are, others as 'Type: message')."""
    return error if isinstance(error, BurstError) else BurstError(describe(error))


__all__ = ["Decomposition", "CallPlan", "Request", "DecompositionKey"]
