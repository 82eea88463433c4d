"""The plan cache of the library calls (callplan.plan_call) on one rank: it keeps Decompositions by their own
key (decomposition.DecompositionKey), so a repeated call, or any call whose arguments check to an equal
Decomposition, reuses its plan (the layout decision and the schedule skipped), a call that differs in any
value the ranks agree on plans anew, bad arguments are refused as without a cache, and cached results
equal uncached ones and the float64 oracle."""
import numpy as np
import pytest
from mpi4py import MPI

import burst_hpc
from burst_hpc.plan import callplan
from burst_hpc.plan.decomposition import Request
from burst_hpc.plan.layout import make_layout
from burst_hpc.errors import BurstError, DTypeError, MaskError, ShapeError
from burst_hpc.reference import attention_backward_reference, attention_reference
from call_counts import ONCE_PER_PLAN, counted

S = 48
CU = np.array([0, 5, 17, 18, 40, S])


@pytest.fixture(autouse=True)
def fresh_cache():
    callplan.PLANS.clear()
    yield
    callplan.PLANS.clear()


@pytest.fixture
def decisions(monkeypatch):
    """How many times a call was planned (the layout, the schedule and the checks decided)."""
    calls = []
    planned = callplan.plan_arrays

    def counted(*args, **kwargs):
        calls.append(args)
        return planned(*args, **kwargs)

    monkeypatch.setattr(callplan, "plan_arrays", counted)
    return calls


def inputs(seqlen=S, dtype=np.float64, heads=(4, 2, 2, 4), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, seqlen, h, 8)).astype(dtype) for h in heads]


def forward(q, k, v, **kw):
    kw.setdefault("causal", True)
    return burst_hpc.burst_attention(q, k, v, comm=MPI.COMM_SELF, **kw)


def check_oracle(q, k, v, o, lse, causal=True, cu_seqlens=None, window=None, scale=None):
    ref_o, ref_lse = attention_reference(q, k, v, causal=causal, cu_seqlens=cu_seqlens, window=window, scale=scale)
    np.testing.assert_allclose(o, ref_o, atol=1e-10)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)   # lse is float32


def test_a_repeated_call_reuses_its_plan(decisions):
    q, k, v, _ = inputs()
    first = forward(q, k, v, cu_seqlens=CU)
    again = forward(q, k, v, cu_seqlens=CU.copy())   # another array with the same offsets
    assert (callplan.PLANS.hits, callplan.PLANS.misses) == (1, 1)
    assert len(decisions) == 1
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    check_oracle(q, k, v, *again, cu_seqlens=CU)


def test_cached_and_uncached_results_are_identical():
    q, k, v, do = inputs()
    kw = dict(cu_seqlens=CU, window=(7, 0), layout="balanced")
    uncached = forward(q, k, v, **kw)
    grads_uncached = burst_hpc.burst_attention_backward(do, q, k, v, *uncached, comm=MPI.COMM_SELF, causal=True, **kw)
    for _ in range(2):
        cached = forward(q, k, v, **kw)
        grads = burst_hpc.burst_attention_backward(do, q, k, v, *cached, comm=MPI.COMM_SELF, causal=True, **kw)
    assert (callplan.PLANS.hits, callplan.PLANS.misses) == (4, 2)
    for a, b in zip(uncached + grads_uncached, cached + grads):
        np.testing.assert_array_equal(a, b)
    check_oracle(q, k, v, *cached, cu_seqlens=CU, window=(7, 0))
    for got, want in zip(grads, attention_backward_reference(do, q, k, v, causal=True, cu_seqlens=CU, window=(7, 0))):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)   # from the float32 lse


CHANGES = {   # name: (the arguments of the changed call, what the oracle needs to know of them)
    "offsets, same shape": dict(cu_seqlens=np.array([0, 6, 17, 18, 40, S])),
    "no documents": dict(cu_seqlens=None),
    "a window": dict(window=(5, 0)),
    "not causal": dict(causal=False),
    "scale": dict(scale=0.5),
    "layout": dict(layout="zigzag"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_changed_argument_plans_anew(change, decisions):
    q, k, v, _ = inputs()
    base = dict(cu_seqlens=CU, causal=True)
    forward(q, k, v, **base)
    changed = dict(base, **CHANGES[change])
    o, lse = forward(q, k, v, **changed)
    assert (callplan.PLANS.hits, callplan.PLANS.misses) == (0, 2)
    check_oracle(q, k, v, o, lse, **{name: changed.get(name) for name in ("causal", "cu_seqlens", "window", "scale")})
    forward(q, k, v, **changed)
    assert callplan.PLANS.hits == 1


EQUAL = {   # name: arguments whose checked values equal the base call's (causal, CU): the same Decomposition
    "offsets, int32": dict(cu_seqlens=CU.astype(np.int32)),
    "offsets, a list": dict(cu_seqlens=CU.tolist()),
    "the default scale said": dict(scale=8 ** -0.5),
    "causal as 1": dict(causal=1),
    "an unbounded window": dict(window=(-1, -1)),
    "a window as an array": dict(window=np.array([-1, -1])),
}


@pytest.mark.parametrize("change", sorted(EQUAL))
def test_calls_that_make_equal_decompositions_share_one_plan(change, decisions):
    q, k, v, _ = inputs()
    base = dict(cu_seqlens=CU, causal=True)
    first = forward(q, k, v, **base)
    again = forward(q, k, v, **dict(base, **EQUAL[change]))
    assert (callplan.PLANS.hits, callplan.PLANS.misses, len(callplan.PLANS), len(decisions)) == (1, 1, 1, 1)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)


def request(size=1, **change):
    return Request.checked(size, **dict(dict(seqlen=S, heads=4, kv_heads=2, head_dim=8, dtype="float64",
                                             causal=True, cu_seqlens=CU), **change))


AGREED_CHANGES = [dict(seqlen=2 * S, cu_seqlens=np.array([0, 7, 2 * S])), dict(batch=2), dict(heads=8),
                  dict(kv_heads=4), dict(head_dim=16), dict(dtype="float32"), dict(causal=False), dict(window=(5, 0)),
                  dict(scale=0.5), dict(layout="balanced"), dict(layout="auto"), dict(scheme="ring"),
                  dict(transport="host"), dict(backward_ring="q"), dict(ranks_per_node=1), dict(backend="cuda"),
                  dict(backward=False), dict(cu_seqlens=np.array([0, 6, 17, 18, 40, S]))]


def test_a_request_differing_in_any_agreed_value_has_another_key(monkeypatch):
    """Every value the ranks agree on (Request.agreement) is in the Decomposition's key: each change below
    gives a key of its own, and together they change every agreed value (a value added to the agreement
    without a change here fails the last assertion)."""
    comm = MPI.COMM_SELF
    base = request()
    signature, arrays = base.agreement()
    others = [request(**change) for change in AGREED_CHANGES] + [request(size=2)]
    monkeypatch.setenv("BURST_HPC_EMULATE_NETWORK", "50,5")
    others.append(request())
    changed = set()
    for other in others:
        theirs, their_arrays = other.agreement()
        changed |= {name for name in signature if theirs[name] != signature[name]}
        if not np.array_equal(their_arrays["cu_seqlens"], arrays["cu_seqlens"]):
            changed.add("cu_seqlens")
    keys = {base.key(comm)} | {other.key(comm) for other in others}
    assert len(keys) == len(others) + 1
    assert len({key.shared for key in keys}) == len(keys)   # told apart by what the ranks compare, too
    assert changed == set(signature) | {"cu_seqlens"}


@pytest.mark.parametrize("change", ["shape", "dtype", "heads"])
def test_changed_arrays_plan_anew(change):
    q, k, v, _ = inputs()
    forward(q, k, v, cu_seqlens=CU)
    if change == "shape":
        q, k, v, _ = inputs(seqlen=S + 2)
        cu = np.array([0, 20, S + 2])
    elif change == "dtype":
        q, k, v = (x.astype(np.float32) for x in (q, k, v))
        cu = CU
    else:
        q, k, v, _ = inputs(heads=(2, 2, 2, 2))
        cu = CU
    o, lse = forward(q, k, v, cu_seqlens=cu)
    assert (callplan.PLANS.hits, callplan.PLANS.misses) == (0, 2)
    ref_o, ref_lse = attention_reference(q, k, v, causal=True, cu_seqlens=cu)
    tol = 1e-5 if q.dtype == np.float32 else 1e-10
    np.testing.assert_allclose(o, ref_o, atol=tol)
    np.testing.assert_allclose(lse, ref_lse, rtol=max(tol, 1e-6))


def test_offsets_changed_in_place_plan_anew():
    q, k, v, _ = inputs()
    cu = CU.copy()
    forward(q, k, v, cu_seqlens=cu)
    cu[2] = 12   # the same array object, other documents
    o, lse = forward(q, k, v, cu_seqlens=cu)
    assert (callplan.PLANS.hits, callplan.PLANS.misses) == (0, 2)
    check_oracle(q, k, v, o, lse, cu_seqlens=cu)


@pytest.mark.parametrize("bad,error,match", [
    (dict(cu_seqlens=CU.astype(np.float64)), MaskError, "1-D integer array"),     # equal values, not integers
    (dict(cu_seqlens=CU, window=(True, 0)), MaskError, "window must be"),         # equal to (1, 0), not integers
    (dict(cu_seqlens=np.array([0, 5, 3, S])), MaskError, "strictly increasing"),
    (dict(cu_seqlens=CU, scale=-1.0), BurstError, "scale must be"),
    (dict(cu_seqlens=CU, layout="diagonal"), BurstError, "diagonal"),
])
def test_bad_arguments_are_refused_after_a_kept_plan(bad, error, match):
    q, k, v, _ = inputs()
    forward(q, k, v, cu_seqlens=CU, window=(1, 0))
    forward(q, k, v, cu_seqlens=CU)
    with pytest.raises(error, match=match):
        forward(q, k, v, **bad)
    assert callplan.PLANS.hits == 0 and len(callplan.PLANS) == 2


def test_bad_arrays_are_refused_after_a_kept_plan():
    q, k, v, _ = inputs()
    forward(q, k, v, cu_seqlens=CU)
    with pytest.raises(ShapeError):
        forward(q, k[:, :-1], v[:, :-1], cu_seqlens=CU)
    with pytest.raises(DTypeError):
        forward(q, k.astype(np.float32), v, cu_seqlens=CU)
    with pytest.raises(DTypeError):
        forward(q.tolist(), k, v, cu_seqlens=CU)   # no key for a list: planned, and refused
    assert callplan.PLANS.hits == 0


def test_the_cache_keeps_the_most_recently_used():
    q, k, v, _ = inputs()
    cache = callplan.PlanCache(maxsize=2)

    def plan(window=None, cache=cache):
        return callplan.plan_call(MPI.COMM_SELF, q, callplan.checked_call(1, q, k, v, True, None, None, "auto",
                                                                          window=window), cache=cache)

    first = plan((1, 0))
    plan((2, 0))
    assert plan((1, 0)) is first           # now the most recently used
    plan((3, 0))                           # drops (2, 0)
    assert len(cache) == 2 and (cache.hits, cache.misses) == (1, 3)
    assert plan((1, 0)) is first
    plan((2, 0))
    assert (cache.hits, cache.misses) == (2, 4)
    nothing = callplan.PlanCache(maxsize=0)
    plan(cache=nothing)
    plan(cache=nothing)
    assert len(nothing) == 0 and nothing.misses == 2


def test_another_communicator_plans_anew():
    q, k, v, _ = inputs()
    other = MPI.COMM_SELF.Dup()
    try:
        forward(q, k, v, cu_seqlens=CU)
        o, lse = burst_hpc.burst_attention(q, k, v, comm=other, causal=True, cu_seqlens=CU)
        assert (callplan.PLANS.hits, callplan.PLANS.misses) == (0, 2)
        check_oracle(q, k, v, o, lse, cu_seqlens=CU)
    finally:
        callplan.PLANS.clear()   # the plan holds the communicator
        other.Free()


def test_a_setting_changes_the_key(monkeypatch):
    q, k, v, _ = inputs()

    def key():
        return callplan.checked_call(1, q, k, v, True, None, None, "auto", cu_seqlens=CU).key(MPI.COMM_SELF)

    before = key()
    assert key() == before and key().digest() == before.digest()
    monkeypatch.setenv("BURST_HPC_EMULATE_NETWORK", "50,5")
    assert key() != before


def test_a_call_key_is_its_decompositions_key():
    """The key a call is looked up by is the key of the Decomposition planned for it (one home for what
    identifies a plan), and the cache keeps that Decomposition, with the plan bound to it."""
    q, k, v, _ = inputs()
    balanced = make_layout("balanced", q.shape[1], 1)
    call = callplan.checked_call(1, q, k, v, True, None, balanced, "auto", cu_seqlens=CU, window=(3, 0))
    plan = callplan.plan_call(MPI.COMM_SELF, q, call)
    assert plan.decomposition.key == call.key(MPI.COMM_SELF)
    (kept, digest), = callplan.PLANS.kept.values()
    assert kept is plan.decomposition and digest == call.key(MPI.COMM_SELF).digest()
    assert plan in kept.plans.values() and callplan.plan_call(MPI.COMM_SELF, q, call) is plan


def test_a_bad_argument_has_no_key_and_is_refused_on_every_call():
    q, k, v, _ = inputs()
    for bad in (dict(cu_seqlens=[0, 2 ** 70]), dict(window=object()), dict(window=(True, 0))):
        call = callplan.checked_call(1, q, k, v, True, None, None, "auto", **bad)
        assert call.key(MPI.COMM_SELF) is None and call.request is None
        for _ in range(2):
            with pytest.raises(MaskError):
                forward(q, k, v, **bad)
    assert (callplan.PLANS.hits, callplan.PLANS.misses, len(callplan.PLANS)) == (0, 6, 0)


@pytest.mark.parametrize("layout, cu", [("zigzag", None), (None, CU), ("balanced", CU), ("chunks", CU)])
def test_a_repeated_call_decides_nothing_again(monkeypatch, layout, cu):
    """What a plan works out once for its passes (call_counts.ONCE_PER_PLAN) is not worked out again."""
    counts = counted(monkeypatch, *ONCE_PER_PLAN)
    q, k, v, do = inputs()
    # one rank runs 'auto' as the packed passes; the ring's own work is counted by naming it
    kw = dict(comm=MPI.COMM_SELF, causal=True, layout=layout, cu_seqlens=cu, scheme="auto" if layout == "chunks" else "ring")

    def step():
        o, lse = burst_hpc.burst_attention(q, k, v, **kw)
        burst_hpc.burst_attention_backward(do, q, k, v, o, lse, **kw)

    step()
    first = dict(counts)
    if layout == "chunks":   # the gather scheme on one node: packed passes, a packing for each pass's plan
        assert first["packing"] == 2 and first["steps"] == first["_pairs"] == first["lifetimes"] == 0
    else:                    # a forward, a backward
        assert first["steps"] == 2 and first["_pairs"] > 0 and first["lifetimes"] == 2 and first["packing"] == 0
    for _ in range(3):
        step()
    assert counts == first and callplan.PLANS.hits == 6
