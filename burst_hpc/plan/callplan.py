"""The plan of one call from its arrays: a Decomposition (decomposition.py: the layout, topology, scheme, transport and
backward ring, decided once from shapes and agreed by every rank in one collective) bound to the
arrays' backend (decomposition.CallPlan: the block kernels, prepared for the call's passes, and the
passes that run it). ``plan_arrays`` is the library calls' way in: it checks the arrays on every
rank and builds the Decomposition of their shapes, the checks' verdict agreed in the same collective
(ranks that pass different arguments get one RankMismatchError naming it, never a hang).

A training loop makes the same call (shapes, mask, options) thousands of times: ``plan_call`` keeps
the plans of recent calls (PlanCache, by CallKey: everything a plan depends on) and reuses one when
every rank finds it, agreed by one allreduce over a digest of the arguments. Any other call (a miss
on some rank, ranks whose arguments differ) is planned anew by every rank, with every check and the
agreement that names what differs."""
import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .. import config
from ..collective import same_everywhere
from ..device import array_device
from ..errors import ShapeError
from .decomposition import Decomposition, Request, as_burst_error
from .layout import Layout, check_kind
from ..validate import check_like, check_qkv, check_same_kind


@dataclass(frozen=True, eq=False)
class Backward:
    """The backward pass's own arguments to a call's plan: dO, the forward pass's (o, lse) (None:
    the caller makes them with this plan's forward pass, as the run job does) and the backward ring
    setting (burst_attention_backward's ``backward_ring``)."""
    do: object
    o: object = None
    lse: object = None
    ring: str = "auto"

    @property
    def arrays(self):
        """{name: array} of the arrays given (do, and o, lse unless the plan's forward makes them)."""
        return {name: x for name, x in (("do", self.do), ("o", self.o), ("lse", self.lse)) if x is not None}

    @property
    def passes(self):
        """The passes the plan prepares: the backward alone, or the forward too when it makes (o, lse)."""
        return ("bwd",) if self.o is not None else ("fwd", "bwd")


def plan_arrays(comm, q, k, v, causal, scale, layout, transport, backward=None, cu_seqlens=None, window=None,
                scheme="auto", ranks_per_node=None):
    """Collective: the CallPlan of a call on this rank's shards q, k, v (the Decomposition of their
    shapes, bound to their backend). ``backward``: a Backward for the backward pass, its arrays
    checked too; None: the forward pass alone."""
    error, request, call = None, None, None
    try:
        request, call = arrays_request(comm.size, q, k, v, causal, scale, layout, transport, backward, cu_seqlens,
                                       window, scheme, ranks_per_node)
    except Exception as e:  # noqa: BLE001  agreed in the decomposition's collective
        error = as_burst_error(e)
    with array_device(q):   # the GPU whose facts the agreement gathers, and whose kernels are prepared
        decomposition = Decomposition.agreed(comm, request, error, call)
        return decomposition.bind(q, ("fwd",) if backward is None else backward.passes)


def arrays_request(size, q, k, v, causal, scale, layout, transport, backward, cu_seqlens, window, scheme,
                   ranks_per_node):
    """(Request, {name: what else the ranks must pass alike}) of a call on shards q, k, v; BurstError
    for bad arrays."""
    arrays = {"q": q, "k": k, "v": v}
    if backward is not None:
        arrays.update(backward.arrays)
    check_same_kind(**arrays)
    b, sq, sk, hq, hkv, d = check_qkv(q, k, v)
    if sq != sk:
        raise ShapeError(f"q and k shards must hold the same tokens; got {sq} and {sk} per rank")
    if layout is not None and not isinstance(layout, Layout):
        check_kind(layout)   # a call's shards are cut already: no 'auto'
    if backward is not None:
        check_like("do", backward.do, q.shape, q.dtype)
        if backward.o is not None:
            check_like("o", backward.o, q.shape, q.dtype)
            check_like("lse", backward.lse, (b, hq, sq), np.float32)
    on_device = type(q).__module__.startswith("cupy")
    request = Request.checked(size, seqlen=sq * size, heads=hq, kv_heads=hkv, head_dim=d, dtype=q.dtype, batch=b,
                              causal=causal, scale=scale, cu_seqlens=cu_seqlens, window=window, layout=layout,
                              scheme=scheme, transport=transport,
                              backward_ring="auto" if backward is None else backward.ring,
                              ranks_per_node=ranks_per_node, backend="cuda" if on_device else "numpy",
                              backward=backward is not None)
    call = {"pass": "forward" if backward is None else "backward" if backward.o is not None
            else "forward and backward", "arrays": "cupy" if on_device else "numpy", "q shape": q.shape,
            "k shape": k.shape}
    return request, call


PLAN_CACHE_SIZE = 32   # distinct calls whose plans are kept (a training step makes a few: forward, backward)


class PlanCache:
    """The plans of recent calls by their CallKey, each with the key's digest (what the ranks compare,
    worked out once per plan), the least recently used dropped beyond ``maxsize`` (0: keep none).
    ``hits`` and ``misses`` count plan_call's outcomes on this rank."""

    def __init__(self, maxsize=PLAN_CACHE_SIZE):
        self.maxsize = maxsize
        self.plans = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key):
        """(plan, digest) kept for ``key`` (now the most recently used), or None."""
        kept = self.plans.get(key)
        if kept is not None:
            self.plans.move_to_end(key)
        return kept

    def put(self, key, plan):
        """Keep ``plan`` for ``key`` in place of any plan kept for the same shared arguments (a plan
        also depends on the other ranks' state when it was made: only the one every rank made
        together last may be reused), dropping the least recently used beyond ``maxsize``."""
        for old in [k for k in self.plans if k.shared == key.shared]:
            del self.plans[old]
        self.plans[key] = (plan, key.digest())
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
    """The CallKey of a call to plan_arrays with these arguments, or None where one cannot be made
    exactly (an argument of another type than plain numbers, strings, tuples, lists and arrays, or
    one that fails to read): such a call is planned anew. Never raises, so no rank leaves the
    collective that follows."""
    try:
        arrays = (q, k, v) if backward is None else (q, k, v, backward.do, backward.o, backward.lse)
        options = plain((causal, scale, layout, transport, window, scheme, ranks_per_node,
                         None if backward is None else backward.ring))
        shared = (comm.size, tuple(array_facts(x) for x in arrays), offsets_facts(cu_seqlens), options)
        device = q.device.id if type(q).__module__.startswith("cupy") else None
        local = (id(comm), device, config.plan_settings())
    except Exception:   # noqa: BLE001  no key, whatever the argument: plan_arrays says what is wrong, on every rank
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
    """Collective: the CallPlan of this call (plan_arrays' arguments): the one ``cache`` kept for an
    earlier call with the same CallKey when every rank has one for the same digest (one allreduce),
    else a new CallPlan (kept in ``cache`` once every rank agreed on it). A reused plan skips the
    layout decision, the schedule and the agreement: the earlier call made and agreed them on
    arguments equal to these, and the digests show every rank passes the same ones again."""
    key = call_key(comm, q, k, v, causal, scale, layout, transport, backward, cu_seqlens, window, scheme,
                   ranks_per_node)
    kept = None if key is None else cache.get(key)
    if comm.size > 1 and not same_everywhere(comm, None if kept is None else kept[1]):
        kept = None   # every rank reuses its plan, or every rank plans anew (and checks, and agrees)
    if kept is not None:
        cache.hits += 1
        return kept[0]
    cache.misses += 1
    plan = plan_arrays(comm, q, k, v, causal, scale, layout, transport, backward, cu_seqlens, window, scheme,
                       ranks_per_node)
    if key is not None:
        cache.put(key, plan)
    return plan
