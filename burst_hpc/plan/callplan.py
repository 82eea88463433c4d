"""The plan of one call: validated shapes, the mask, the layout, the backward ring, the transport and
the scheme, decided once and agreed by every rank before the first exchange (bad input gives the
same error on every rank), then handed to the passes (passes.py) as one value. Every argument is
checked and agreed in one collective before any collective whose participation depends on one
(ranks that pass different arguments get one RankMismatchError naming it, never a hang); the
decisions made from them follow, agreed too (the transport depends on each rank's machine).

A training loop makes the same call (shapes, mask, options) thousands of times: ``plan_call`` keeps
the plans of recent calls (PlanCache, by CallKey: everything a plan depends on) and reuses one when
every rank finds it, agreed by one allreduce over a digest of the arguments. Any other call (a miss
on some rank, ranks whose arguments differ) is planned anew by every rank, with every check and the
agreement that names what differs."""
import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .. import config
from . import masks
from ..engine import passes
from .accounting import backward_ring_bytes, cheaper_backward_ring
from ..backends import get_backend
from ..collective import agree, same_everywhere
from ..device import gpus_shared
from ..dtypes import accum_dtype, dtype_name
from ..errors import BurstError, ShapeError, TransportError
from .layout import Layout, as_layout, check_kind, default_kind
from .schemes import check_scheme, make as make_scheme
from .topology import ranks_per_node_setting, topology
from ..transport import TRANSPORTS, choose_transport, make_transport
from ..transport.emulated import EmulatedNetwork, Nic
from ..validate import check_like, check_qkv, check_same_kind, resolve_scale

log = logging.getLogger("burst_hpc")
BACKWARD_RINGS = ("auto", "q", "kv")


class CallPlan:
    """What every rank agreed on before the first exchange: shapes, mask, layout, backward ring,
    transport, scheme and the passes that run it (``passes``), decided once here."""

    def __init__(self, comm, q, k, v, causal, scale, layout, transport, backward=None, cu_seqlens=None, window=None,
                 scheme="auto", ranks_per_node=None):
        """``backward``: (do, o, lse, backward_ring) for the backward pass, checked too (o and lse may be
        None when the caller makes them with this plan's forward pass)."""
        self.comm, self.rank, self.size = comm, comm.rank, comm.size
        on_device = type(q).__module__.startswith("cupy")
        shared = gpus_shared(comm, q.device if on_device else None)  # collective: before any check can fail
        # every argument, checked here first, agreed in one collective before any collective whose
        # participation depends on one (the topology, the kernels' compile, the passes)
        error, arguments, offsets = None, None, None
        try:
            check_scheme(scheme)
            arrays = {"q": q, "k": k, "v": v}
            if backward is not None:
                arrays.update((name, x) for name, x in zip(("do", "o", "lse"), backward[:3]) if x is not None)
            check_same_kind(**arrays)
            b, sq, sk, hq, hkv, d = check_qkv(q, k, v)
            if sq != sk:
                raise ShapeError(f"q and k shards must hold the same tokens; got {sq} and {sk} per rank")
            self.mask = masks.make(sq * self.size, causal, window, cu_seqlens)
            if layout is not None and not isinstance(layout, Layout):
                check_kind(layout)
            if backward is not None:
                do, o, lse, ring = backward
                check_like("do", do, q.shape, q.dtype)
                if o is not None:  # None: the caller's own forward pass makes them (the run job)
                    check_like("o", o, q.shape, q.dtype)
                    check_like("lse", lse, (b, hq, sq), np.float32)
                check_backward_ring(ring)
            if transport not in TRANSPORTS:
                raise TransportError(f"unknown transport {transport!r}; use one of {', '.join(TRANSPORTS)}")
            self.scale = resolve_scale(scale, d)
            self.causal = bool(causal)
            nodes = ranks_per_node_setting(ranks_per_node)
            self.network = config.emulated_network()
            arguments = {"pass": "forward" if backward is None else "backward" if backward[1] is not None
                         else "forward and backward", "arrays": "cupy" if on_device else "numpy",
                         "q shape": q.shape, "k shape": k.shape, "dtype": dtype_name(q.dtype), "causal": self.causal,
                         "window": None if self.mask is None else self.mask.window, "scale": self.scale,
                         "layout": layout, "scheme": scheme, "transport": transport,
                         "backward_ring": None if backward is None else backward[3], "ranks_per_node": nodes,
                         "emulated network": self.network}
            offsets = None if self.mask is None else self.mask.cu_seqlens
        except Exception as e:  # shared with every rank below, so no rank is left waiting
            error = e if isinstance(e, BurstError) else BurstError(f"{type(e).__name__}: {e}")
        agree(comm, error, arguments, {"cu_seqlens": offsets})
        # the decisions: from the agreed arguments, the same on every rank but for what its machine decides
        error, decided = None, None
        try:
            self.topo = None
            if scheme != "ring" or nodes is not None or self.network:   # the flat ring: to emulate or count it
                self.topo = topology(comm, nodes)   # collective: one allgather
            # never the data's: the caller shards by it (costmodel.choose_layout: the predicted fastest)
            self.layout = as_layout(default_kind(causal) if layout is None else layout, sq * self.size, self.size,
                                    masks.counting(sq * self.size, causal, self.mask))
            self.seqlen = self.layout.seqlen
            self.backend = get_backend(q)
            self.transport_name = choose_transport(transport, self.backend.name == "cuda", shared)
            self.heads, self.kv_heads, self.head_dim = hq, hkv, d
            scheme = resolve_scheme(scheme, self.topo, self.layout, self.causal, self.mask, q.shape, hkv,
                                    q.dtype.itemsize, backward is not None, self.backend.name)
            self.ring = None
            if backward is not None and scheme == "gather":
                self.ring = gather_backward_ring(backward[3])
            elif backward is not None:
                self.ring = choose_backward_ring(backward[3], hq, hkv, d, q.dtype.itemsize,
                                                 *(masks.ring_steps(self.mask, self.layout, queries_travel)
                                                   for queries_travel in (True, False)), self.size)
            self.scheme = make_scheme(scheme, comm, self.topo, self.layout, self.causal, self.mask)
            self.passes = passes.for_plan(self)
            decided = {"layout": self.layout, "scheme": self.scheme.name, "backward_ring": self.ring,
                       "transport": self.transport_name}
        except Exception as e:
            error = e if isinstance(e, BurstError) else BurstError(f"{type(e).__name__}: {e}")
        agree(comm, error, decided)
        if self.backend.name == "cuda":  # collective: every rank agreed on the call above
            directions = ("fwd",) if backward is None else ("bwd",) if backward[1] is not None else ("fwd", "bwd")
            self.backend.prepare(comm, q.dtype, self.head_dim, self.causal, self.mask is not None, directions)
        self.xp = self.backend.xp
        self.acc = accum_dtype(q.dtype)

    def pieces(self, position):
        """The tokens of the shard at ``position`` of the scheme's ring."""
        return self.scheme.pieces(position)

    def steps(self, near, returns):
        """This rank's schedule; ``near``: the side a plain ring sends around (and the one the
        balanced schedule keeps its pairs' home by); ``returns``: the sides whose partials go home."""
        return self.scheme.steps(near, returns)

    def transport(self):
        """The transport of the scheme's ring."""
        return self.transports()[0]

    def transports(self):
        """(near, far, inner): the scheme's ring transport; the one for transfers between nodes that
        complete steps after they are posted (the double ring's network lane, the balanced
        schedule's far transfers); the one for the balanced schedule's transfers inside a node due
        steps later (None: none). Each over a duplicate communicator, so none queues behind (NCCL)
        another's. With BURST_HPC_EMULATE_NETWORK all are held to one emulated NIC between nodes."""
        near = make_transport(self.transport_name, self.scheme.comm, self.xp)
        far, inner = (None if comm is None else make_transport(self.transport_name, comm, self.xp)
                      for comm in (self.scheme.far_comm, self.scheme.inner_comm))
        far = near if far is None else far
        if self.network is None:
            return near, far, inner
        nic = Nic(*self.network)
        held = EmulatedNetwork(near, self.scheme.remote, nic)
        return (held, held if far is near else EmulatedNetwork(far, self.scheme.remote, nic),
                None if inner is None else EmulatedNetwork(inner, self.scheme.remote, nic))


PLAN_CACHE_SIZE = 32   # distinct calls whose plans are kept (a training step makes a few: forward, backward)


class PlanCache:
    """The plans of recent calls by their CallKey, the least recently used dropped beyond ``maxsize``
    (0: keep none). ``hits`` and ``misses`` count plan_call's outcomes on this rank."""

    def __init__(self, maxsize=PLAN_CACHE_SIZE):
        self.maxsize = maxsize
        self.plans = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key):
        """The plan kept for ``key`` (now the most recently used), or None."""
        plan = self.plans.get(key)
        if plan is not None:
            self.plans.move_to_end(key)
        return plan

    def put(self, key, plan):
        """Keep ``plan`` for ``key`` in place of any plan kept for the same shared arguments (a plan
        also depends on the other ranks' state when it was made: only the one every rank made
        together last may be reused), dropping the least recently used beyond ``maxsize``."""
        for old in [k for k in self.plans if k.shared == key.shared]:
            del self.plans[old]
        self.plans[key] = plan
        self.plans.move_to_end(key)
        while len(self.plans) > self.maxsize:
            self.plans.popitem(last=False)

    def clear(self):
        """Forget every plan and reset the counts."""
        self.plans.clear()
        self.hits = self.misses = 0

    def __len__(self):
        return len(self.plans)


PLANS = PlanCache()   # the library calls' plans in this process (burst_attention, burst_attention_backward)


@dataclass(frozen=True)
class CallKey:
    """Everything a call's plan depends on. ``shared``: the arguments every rank must pass alike
    (ranks, array kinds, shapes and dtypes, document offsets by content, the options, each with its
    type: 1, 1.0 and True are different arguments); ``local``: this rank's communicator (the
    object, which the kept plan holds alive, so its id is never reused while the key is), device
    and BURST_HPC_* settings."""
    shared: tuple
    local: tuple

    def digest(self):
        """16 bytes from ``shared``, the same on every rank that passes the same arguments: what the
        ranks compare."""
        return hashlib.blake2b(repr(self.shared).encode(), digest_size=16).digest()


def call_key(comm, q, k, v, causal, scale, layout, transport, backward=None, cu_seqlens=None, window=None,
             scheme="auto", ranks_per_node=None):
    """The CallKey of a call to CallPlan with these arguments, or None where one cannot be made
    exactly (an argument of another type than plain numbers, strings, tuples, lists and arrays, or
    one that fails to read): such a call is planned anew. Never raises, so no rank leaves the
    collective that follows."""
    try:
        arrays = (q, k, v) if backward is None else (q, k, v, *backward[:3])
        options = plain((causal, scale, layout, transport, window, scheme, ranks_per_node,
                         None if backward is None else backward[3]))
        shared = (comm.size, tuple(array_facts(x) for x in arrays), offsets_facts(cu_seqlens), options)
        device = q.device.id if type(q).__module__.startswith("cupy") else None
        local = (id(comm), device, config.plan_settings())
    except Exception:   # noqa: BLE001  no key, whatever the argument: CallPlan says what is wrong, on every rank
        return None
    return CallKey(shared, local)


def plain(value):
    """``value`` (None, a bool, number or string, or a tuple or list of them) with the type of each
    part, as a hashable tuple whose repr is the same on every rank; TypeError for anything else."""
    if value is None or isinstance(value, (bool, int, float, str, np.bool_, np.number)):
        return type(value), value   # the class: True and numpy.True_ are told apart too
    if isinstance(value, Layout):
        return Layout, value.key
    if isinstance(value, (tuple, list)):
        return type(value), tuple(plain(part) for part in value)
    raise TypeError(f"{type(value).__name__} is not a plain argument")


def array_facts(x):
    """What a plan reads of an array argument: its kind, shape and dtype (None for None)."""
    if x is None:
        return None
    dtype = x.dtype   # its str and char tell the numeric types apart (bfloat16: '<V2', 'E'); name: any other
    return (type(x).__module__, type(x).__name__, tuple(x.shape), dtype.str, dtype.char,
            dtype.name if dtype.kind == "V" else "")


def offsets_facts(cu_seqlens):
    """Document offsets by kind, dtype, shape and a digest of their content (None for None); an
    offsets array changed in place has another key. TypeError for non-integer offsets (refused by
    every plan, so never kept)."""
    if cu_seqlens is None:
        return None
    kind = type(cu_seqlens).__name__
    if type(cu_seqlens).__module__.startswith("cupy"):
        cu_seqlens = cu_seqlens.get()
    offsets = np.ascontiguousarray(cu_seqlens)
    if offsets.dtype.kind not in "iu":
        raise TypeError("document offsets of a non-integer dtype")
    return kind, offsets.dtype.str, offsets.shape, hashlib.blake2b(offsets.tobytes(), digest_size=16).hexdigest()


def plan_call(comm, q, k, v, causal, scale, layout, transport, backward=None, cu_seqlens=None, window=None,
              scheme="auto", ranks_per_node=None, cache=PLANS):
    """Collective: the CallPlan of this call (CallPlan's arguments): the one ``cache`` kept for an
    earlier call with the same CallKey when every rank has one for the same digest (one allreduce),
    else a new CallPlan (kept in ``cache`` once every rank agreed on it). A reused plan skips the
    layout decision, the schedule and the agreement: the earlier call made and agreed them on
    arguments equal to these, and the digests show every rank passes the same ones again."""
    key = call_key(comm, q, k, v, causal, scale, layout, transport, backward, cu_seqlens, window, scheme,
                   ranks_per_node)
    plan = None if key is None else cache.get(key)
    if comm.size > 1 and not same_everywhere(comm, None if plan is None else key.digest()):
        plan = None   # every rank reuses its plan, or every rank plans anew (and checks, and agrees)
    if plan is not None:
        cache.hits += 1
        return plan
    cache.misses += 1
    plan = CallPlan(comm, q, k, v, causal, scale, layout, transport, backward, cu_seqlens, window, scheme,
                    ranks_per_node)
    if key is not None:
        cache.put(key, plan)
    return plan


def check_backward_ring(name):
    if name not in BACKWARD_RINGS:
        raise BurstError(f"unknown backward_ring {name!r}; use one of {', '.join(BACKWARD_RINGS)}")
    return name


def choose_backward_ring(name, heads, kv_heads, head_dim, itemsize, q_steps=1, kv_steps=1, size=1):
    """The backward ring: ``name``, or for 'auto' the one moving fewer bytes over its steps
    (accounting.cheaper_backward_ring)."""
    if check_backward_ring(name) != "auto":
        return name
    choice = cheaper_backward_ring(heads, kv_heads, head_dim, itemsize, q_steps, kv_steps, size)
    log.info("backward ring auto -> %s-ring (%d and %d bytes per token per step, q and kv)", choice,
             *backward_ring_bytes(heads, kv_heads, head_dim, itemsize))
    return choice


def gather_backward_ring(name):
    """The gather scheme's backward moves keys and values (and their gradients home): 'kv' for
    'auto' or 'kv'; 'q' is refused."""
    if check_backward_ring(name) == "q":
        raise BurstError("scheme 'gather' sends keys and values to the queries that see them, and dK/dV home; "
                         "backward_ring='q' runs on the other schemes: use backward_ring='auto' or 'kv', "
                         "or scheme='ring'")
    return "kv"


def resolve_scheme(name, topo, layout, causal, mask, q_shape, kv_heads, itemsize, backward, backend="numpy"):
    """The concrete scheme: ``name``, or for 'auto' 'gather' for the chunks layout, 'ring' on one node
    and otherwise the cost model's fastest of the schemes that fit the layout and heads
    (costmodel.pick), priced with this rank's GPU model's rates (no collective here: ranks on
    different GPU models that pick differently get the signature's RankMismatchError, never a hang)."""
    if name != "auto":
        return name
    if layout.kind == "chunks":
        return "gather"
    if topo is None or topo.nodes == 1:
        return "ring"
    from . import costmodel

    device_name = None
    if backend == "cuda":
        import cupy

        device_name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    batch, local, heads, head_dim = q_shape
    problem = costmodel.Problem(batch, local * topo.nodes * topo.per_node, heads, kv_heads, head_dim, itemsize, causal)
    choice = costmodel.pick(problem, costmodel.Cluster(topo.nodes, topo.per_node),
                            costmodel.rates_for(backend, device_name), layout, mask, backward)
    log.info("scheme auto -> %s (%d nodes x %d ranks)", choice, topo.nodes, topo.per_node)
    return choice
