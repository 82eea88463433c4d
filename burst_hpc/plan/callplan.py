"""The plan of one library call from its arrays: a Decomposition (decomposition.py: the layout, topology, scheme,
transport and backward ring, decided once from shapes and agreed by every rank in one collective) bound to
the arrays' backend (decomposition.CallPlan: the block kernels, prepared for the call's passes, and the
passes that run it). ``checked_call`` is the library calls' way in: it checks the arrays and arguments
on this rank into a Call (the Decomposition's Request, or the error; its layout a Layout, made of a
name by the caller, or None for the default); ``plan_arrays`` builds the Decomposition of the Call, the
checks' verdict agreed in the same collective (ranks that pass different arguments get one
RankMismatchError naming it, never a hang), and binds it.

A training loop makes the same call (shapes, mask, options) thousands of times: ``plan_call`` keeps the
Decompositions of recent calls by their own key (decomposition.DecompositionKey: what their ranks agreed
on, the communicator and the settings), each with its bound plans, and reuses one when every rank finds
it, agreed by one allreduce over the key's digest. Any other call (a miss on some rank, ranks whose
arguments differ, a bad argument) is planned anew by every rank, with the agreement that names what
differs."""
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..collective import same_everywhere
from ..device import array_device
from ..errors import ShapeError
from .decomposition import Decomposition, Request, as_burst_error, binding
from .layout import check_layout
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


@dataclass(frozen=True, eq=False)
class Call:
    """A library call's arguments as checked on this rank (:func:`checked_call`): its ``request``
    (decomposition.Request; None where a check failed with ``error``, a BurstError its plan's agreement
    raises on every rank), ``facts`` (what else every rank must pass alike: the pass, the arrays' kind,
    the q and k shapes) and the ``passes`` its plan prepares ('fwd', 'bwd')."""
    request: object
    error: object
    facts: dict
    passes: tuple

    def key(self, comm):
        """The key of this call's Decomposition over ``comm`` (Request.key), or None where a check failed.
        Never raises, so no rank leaves the collective that follows."""
        if self.request is None:
            return None
        try:
            return self.request.key(comm, self.facts)
        except Exception:   # noqa: BLE001  no key: planned anew, and the agreement says what is wrong
            return None


def checked_call(size, q, k, v, causal, scale, layout, transport, backward=None, cu_seqlens=None, window=None,
                 scheme="auto", ranks_per_node=None, error=None):
    """The Call of a library call on this rank's shards q, k, v over ``size`` ranks (burst_attention's
    arguments, ``layout`` a Layout or None for the default: a name is made into a Layout before);
    ``backward``: a Backward for the backward pass, its arrays checked too; None: the forward pass alone;
    ``error``: what went wrong before (making the Layout of a name), raised after the arrays' checks.
    Never raises: a bad argument is the Call's error, raised on every rank by its plan."""
    passes = ("fwd",) if backward is None else backward.passes
    try:
        arrays = {"q": q, "k": k, "v": v}
        if backward is not None:
            arrays.update(backward.arrays)
        check_same_kind(**arrays)
        b, sq, sk, hq, hkv, d = check_qkv(q, k, v)
        if sq != sk:
            raise ShapeError(f"q and k shards must hold the same tokens; got {sq} and {sk} per rank")
        if error is not None:
            raise error
        if layout is not None:
            check_layout(layout, sq * size, size)   # shards cut already: a Layout, no name (no 'auto')
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
    except Exception as e:  # noqa: BLE001  agreed in the decomposition's collective
        return Call(None, as_burst_error(e), None, passes)
    facts = {"pass": "forward" if backward is None else "backward" if backward.o is not None
             else "forward and backward", "arrays": "cupy" if on_device else "numpy", "q shape": q.shape,
             "k shape": k.shape}
    return Call(request, None, facts, passes)


def plan_arrays(comm, q, call):
    """Collective: the CallPlan of ``call`` (:func:`checked_call`) on shards like ``q``, planned anew: the
    Decomposition of its shapes, agreed by every rank with the checks' verdict, bound to the arrays' backend."""
    with array_device(q):   # the GPU whose facts the agreement gathers, and whose kernels are prepared
        return Decomposition.agreed(comm, call.request, call.error, call.facts).bound(q, call.passes)


PLAN_CACHE_SIZE = 32   # distinct calls whose plans are kept (a training step makes a few: forward, backward)


class PlanCache:
    """The Decompositions of recent calls by their key (decomposition.DecompositionKey), each with the
    key's digest (what the ranks compare, worked out once per decomposition) and its bound plans
    (Decomposition.plans), the least recently used dropped beyond ``maxsize`` (0: keep none). ``hits``
    and ``misses`` count plan_call's outcomes on this rank."""

    def __init__(self, maxsize=PLAN_CACHE_SIZE):
        self.maxsize = maxsize
        self.kept = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key):
        """(decomposition, digest) kept for ``key`` (now the most recently used), or None."""
        kept = self.kept.get(key)
        if kept is not None:
            self.kept.move_to_end(key)
        return kept

    def put(self, decomposition):
        """Keep ``decomposition`` under its key in place of any kept for the same agreed values (a plan
        also depends on the other ranks' state when it was made: only the one every rank made together
        last may be reused), dropping the least recently used beyond ``maxsize``."""
        key = decomposition.key
        for old in [k for k in self.kept if k.shared == key.shared]:
            del self.kept[old]
        self.kept[key] = (decomposition, key.digest())
        while len(self.kept) > self.maxsize:
            self.kept.popitem(last=False)

    def clear(self):
        """Forget every decomposition and reset the counts."""
        self.kept.clear()
        self.hits = self.misses = 0

    def __len__(self):
        return len(self.kept)


PLANS = PlanCache()   # the library calls' plans in this process (burst_attention, burst_attention_backward)


def plan_call(comm, q, call, cache=PLANS, key=False):
    """Collective: the CallPlan of ``call`` (:func:`checked_call`) on shards like ``q``: the one bound to the
    Decomposition ``cache`` keeps under the call's key, when every rank has one for the same digest (one
    allreduce), else a new one (its Decomposition kept in ``cache`` once every rank agreed on it). A
    reused plan skips the layout decision, the schedule and the agreement: an earlier call made and
    agreed them on values equal to these, and the digests show every rank's are equal again. ``key``: the call's
    key over ``comm`` when already known (False: worked out here)."""
    key = call.key(comm) if key is False else key
    kept = None if key is None else cache.get(key)
    plan = None if kept is None else kept[0].plans.get(binding(q, call.passes))
    if comm.size > 1 and not same_everywhere(comm, None if plan is None else kept[1]):
        plan = None   # every rank reuses its plan, or every rank plans anew (and checks, and agrees)
    if plan is not None:
        cache.hits += 1
        return plan
    cache.misses += 1
    plan = plan_arrays(comm, q, call)
    if key is not None:
        cache.put(plan.decomposition)
    return plan
