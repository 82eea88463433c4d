"""The plan cache of the library calls (callplan.plan_call) on one rank: a repeated call reuses its plan
(the layout decision and the checks skipped), any change to what a plan depends on plans anew, bad
arguments are refused as without a cache, and cached results equal uncached ones and the float64 oracle."""
import numpy as np
import pytest
from mpi4py import MPI

import burst_hpc
from burst_hpc.plan import callplan
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
    "offsets, int32": dict(cu_seqlens=CU.astype(np.int32)),
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

    def plan(window):
        return callplan.plan_call(MPI.COMM_SELF, q, k, v, True, None, None, "auto", window=window, cache=cache)

    first = plan((1, 0))
    plan((2, 0))
    assert plan((1, 0)) is first           # now the most recently used
    plan((3, 0))                           # drops (2, 0)
    assert len(cache) == 2 and (cache.hits, cache.misses) == (1, 3)
    assert plan((1, 0)) is first
    plan((2, 0))
    assert (cache.hits, cache.misses) == (2, 4)
    nothing = callplan.PlanCache(maxsize=0)
    callplan.plan_call(MPI.COMM_SELF, q, k, v, True, None, None, "auto", cache=nothing)
    callplan.plan_call(MPI.COMM_SELF, q, k, v, True, None, None, "auto", cache=nothing)
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
    key = callplan.call_key(MPI.COMM_SELF, q, k, v, True, None, None, "auto", cu_seqlens=CU)
    monkeypatch.setenv("BURST_HPC_EMULATE_NETWORK", "50,5")
    assert callplan.call_key(MPI.COMM_SELF, q, k, v, True, None, None, "auto", cu_seqlens=CU) != key


def test_keys_tell_argument_types_apart():
    q, k, v, _ = inputs()

    def key(**kw):
        return callplan.call_key(MPI.COMM_SELF, q, k, v, kw.pop("causal", True), kw.pop("scale", None), None, "auto",
                                 **kw)

    assert key(scale=1) != key(scale=1.0) != key(scale=True)
    assert key(window=(1, 0)) != key(window=(True, 0))
    assert key(causal=1) != key(causal=True) != key(causal=np.True_)
    assert key(window=(1, 0)) != key(window=[1, 0]) != key(window=(np.int64(1), 0))
    assert key(cu_seqlens=CU) == key(cu_seqlens=CU.copy()) != key(cu_seqlens=CU.astype(np.int32))
    assert key(cu_seqlens=CU).digest() == key(cu_seqlens=CU.copy()).digest()
    assert key(window=object()) is None   # not a plain argument: planned anew every call
    assert key(cu_seqlens=[0, 2 ** 70]) is None   # unreadable as an integer array


def test_an_argument_without_a_key_is_planned_and_refused_as_before():
    q, k, v, _ = inputs()
    with pytest.raises(MaskError, match="1-D integer array"):
        forward(q, k, v, cu_seqlens=[0, 2 ** 70])
    forward(q, k, v, window=np.array([3, 0]))   # a window as an array: no key, planned every call
    forward(q, k, v, window=np.array([3, 0]))
    assert (callplan.PLANS.hits, callplan.PLANS.misses, len(callplan.PLANS)) == (0, 3, 0)



@pytest.mark.parametrize("layout, cu", [("zigzag", None), (None, CU), ("balanced", CU), ("chunks", CU)])
def test_a_repeated_call_decides_nothing_again(monkeypatch, layout, cu):
    """What a plan works out once for its passes (call_counts.ONCE_PER_PLAN) is not worked out again."""
    counts = counted(monkeypatch, *ONCE_PER_PLAN)
    q, k, v, do = inputs()
    kw = dict(comm=MPI.COMM_SELF, causal=True, layout=layout, cu_seqlens=cu)

    def step():
        o, lse = burst_hpc.burst_attention(q, k, v, **kw)
        burst_hpc.burst_attention_backward(do, q, k, v, o, lse, **kw)

    step()
    first = dict(counts)
    assert first["steps"] == 2 and first["_pairs"] > 0 and first["lifetimes"] == 2   # a forward, a backward
    for _ in range(3):
        step()
    assert counts == first and callplan.PLANS.hits == 6
