"""The plan cache across ranks (callplan.plan_call): a repeated call reuses its plan on every rank (results
as the float64 oracle's and as an uncached call's), and ranks that pass different arguments after
their plans were kept get the same clear error on every rank as without a cache, never a hang."""
import pathlib
import sys

import numpy as np
import pytest

import burst_hpc
from burst_hpc.plan import callplan, placement
from burst_hpc.plan.decomposition import DecompositionKey
from burst_hpc.errors import RankMismatchError, ShapeError
from burst_hpc.reference import attention_backward_reference, attention_reference
from test_ring import raises_everywhere, shared_rng

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from call_counts import ONCE_PER_PLAN, counted  # noqa: E402

LOCAL = 16


@pytest.fixture(autouse=True)
def fresh_cache():
    callplan.PLANS.clear()
    yield
    callplan.PLANS.clear()


def offsets(seqlen, cut):
    return np.array([0, cut, seqlen - 3, seqlen])


def test_a_repeated_call_reuses_its_plan_on_every_rank(comm):
    rng, seed = shared_rng(comm)
    P, r, S = comm.size, comm.rank, LOCAL * comm.size
    q, k, v, do = (rng.standard_normal((1, S, h, 8)) for h in (4, 2, 2, 4))
    cu = offsets(S, 5)
    kw = dict(comm=comm, causal=True, cu_seqlens=cu, layout="balanced")

    def mine(x, axis=1):
        return burst_hpc.shard(x, r, P, "balanced", axis=axis)

    def step():
        o, lse = burst_hpc.burst_attention(mine(q), mine(k), mine(v), **kw)
        return (o, lse) + burst_hpc.burst_attention_backward(mine(do), mine(q), mine(k), mine(v), o, lse, **kw)

    first = step()
    cached = step()
    assert (callplan.PLANS.hits, callplan.PLANS.misses) == (2, 2)
    assert len(set(comm.allgather((callplan.PLANS.hits, callplan.PLANS.misses)))) == 1
    for a, b in zip(first, cached):
        np.testing.assert_array_equal(a, b)
    ref_o, ref_lse = attention_reference(q, k, v, causal=True, cu_seqlens=cu)
    ctx = f"seed {seed}"
    np.testing.assert_allclose(cached[0], mine(ref_o), atol=1e-10, err_msg=ctx)
    np.testing.assert_allclose(cached[1], mine(ref_lse, axis=2), rtol=1e-6, err_msg=ctx)
    for got, want in zip(cached[2:], attention_backward_reference(do, q, k, v, causal=True, cu_seqlens=cu)):
        np.testing.assert_allclose(got, mine(want), atol=2e-5, rtol=1e-4, err_msg=ctx)


def test_ranks_with_different_offsets_after_kept_plans_fail_alike_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    S = LOCAL * comm.size
    rng = np.random.default_rng(comm.rank)
    q, k, v = (rng.standard_normal((1, LOCAL, h, 8)) for h in (2, 1, 1))
    mine = offsets(S, 4) if comm.rank == 1 else offsets(S, 5)

    def call(cu):
        return burst_hpc.burst_attention(q, k, v, comm=comm, causal=True, cu_seqlens=cu, layout="contiguous")

    uncached = raises_everywhere(comm, RankMismatchError, lambda: call(mine))
    for cut in (4, 5):   # every rank now holds a plan for both
        call(offsets(S, cut))
    assert len(callplan.PLANS) == 2
    message = raises_everywhere(comm, RankMismatchError, lambda: call(mine))
    assert message == uncached
    assert message.startswith("ranks disagree on cu_seqlens: rank 0 has 4 values, rank 1 has 4; they first differ "
                              "at index 1: 5 on rank 0, 4 on rank 1"), message
    call(offsets(S, 5))   # agreeing again: the kept plan serves
    assert callplan.PLANS.hits == 1


def test_a_rank_with_another_shape_after_kept_plans_fails_alike_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    rng = np.random.default_rng(comm.rank)

    def call(local):
        q, k, v = (rng.standard_normal((1, local, h, 8)) for h in (2, 1, 1))
        return burst_hpc.burst_attention(q, k, v, comm=comm, causal=True, cu_seqlens=offsets(local * comm.size, 5),
                                         layout="contiguous")

    call(LOCAL)
    call(LOCAL + 2)
    odd = comm.rank == comm.size - 1
    message = raises_everywhere(comm, (RankMismatchError, ShapeError), lambda: call(LOCAL + 2 if odd else LOCAL))
    assert "disagree" in message or "shape" in message, message
    call(LOCAL)
    assert callplan.PLANS.hits == 1


def test_a_rank_without_the_plan_makes_every_rank_plan_anew(comm):
    rng, seed = shared_rng(comm)
    P, r, S = comm.size, comm.rank, LOCAL * comm.size
    q, k, v = (rng.standard_normal((1, S, h, 8)) for h in (2, 1, 1))
    cu = offsets(S, 7)

    def call():
        return burst_hpc.burst_attention(*(burst_hpc.shard(x, r, P, "contiguous") for x in (q, k, v)), comm=comm,
                                         causal=True, cu_seqlens=cu, layout="contiguous")

    call()
    if r == P - 1:
        callplan.PLANS.clear()   # this rank lost its plan (another sequence of calls, say)
    o, lse = call()
    assert callplan.PLANS.hits == 0
    ref_o, _ = attention_reference(q, k, v, causal=True, cu_seqlens=cu)
    np.testing.assert_allclose(o, burst_hpc.shard(ref_o, r, P, "contiguous"), atol=1e-10, err_msg=f"seed {seed}")
    call()
    assert callplan.PLANS.hits == 1


def test_only_the_plan_every_rank_made_together_last_is_reused(comm, monkeypatch):
    """A plan also depends on the other ranks' state when it was made (here their node ids): after a
    call where the ranks' settings changed, a rank whose settings went back must not reuse its older
    plan while the others reuse the newer one."""
    P, r, S = comm.size, comm.rank, LOCAL * comm.size
    rng, seed = shared_rng(comm)
    q, k, v = (rng.standard_normal((1, S, h, 8)) for h in (2, 1, 1))

    def call():
        balanced = burst_hpc.make_layout("balanced", S, P)
        shards = [balanced.shard(x, r) for x in (q, k, v)]
        plan = callplan.plan_call(comm, shards[0], callplan.checked_call(P, *shards, True, None, balanced, "auto"))
        return comm.allgather(plan.decomposition.topo.nodes)

    monkeypatch.delenv("BURST_HPC_NODE_ID", raising=False)
    monkeypatch.delenv("BURST_HPC_RANKS_PER_NODE", raising=False)
    call()                                           # one node
    monkeypatch.setenv("BURST_HPC_NODE_ID", str(3 + 4 * r))
    assert len(set(call())) == 1                     # every rank a node: planned anew together
    if r == P - 1:
        monkeypatch.delenv("BURST_HPC_NODE_ID")      # this rank's settings as in the first call
    assert len(set(call())) == 1, "ranks run different plans"


def test_same_everywhere_is_the_same_verdict_on_every_rank(comm):
    from burst_hpc.collective import same_everywhere

    digest = bytes(range(16))
    other = bytes(range(1, 17))
    last = comm.rank == comm.size - 1
    assert same_everywhere(comm, digest)
    assert same_everywhere(comm, b"\xff" * 16)   # the top bits are dropped, never negated out of range
    assert same_everywhere(comm, other if last else digest) == (comm.size == 1)
    assert not same_everywhere(comm, None if last else digest)
    high = bytes(8) + b"\x80" + bytes(7)   # differs in the second half only
    assert same_everywhere(comm, high if last else bytes(16)) == (comm.size == 1)


@pytest.mark.parametrize("layout, documents", [("zigzag", False), (None, True), ("balanced", True), ("chunks", True)])
def test_a_repeated_call_decides_nothing_again_on_any_rank(comm, monkeypatch, layout, documents):
    """What a plan works out once (call_counts.ONCE_PER_PLAN: the steps, the engine's route, the block
    pairs), and the digest the ranks compare, is not worked out again by a repeated call on any rank:
    each call's work is the key, one allreduce and the passes; the chunks name places no tokens again
    (placement.place_chunks), though the call makes the name into its Layout before its plan."""
    counts = counted(monkeypatch, *ONCE_PER_PLAN, (DecompositionKey, "digest"), (placement, "place_chunks"))
    rng, _ = shared_rng(comm)
    P, r, S = comm.size, comm.rank, LOCAL * comm.size
    q, k, v, do = (rng.standard_normal((1, S, h, 8)) for h in (4, 2, 2, 4))
    cu = offsets(S, 5) if documents else None
    # one rank runs 'auto' as the packed passes; the ring's own work is counted by naming it
    kw = dict(comm=comm, causal=True, cu_seqlens=cu, layout=layout, scheme="auto" if layout == "chunks" else "ring")
    mine = [burst_hpc.shard(x, r, P, layout or "zigzag", causal=True, cu_seqlens=cu, window=None) for x in (q, k, v, do)]

    def step():
        o, lse = burst_hpc.burst_attention(*mine[:3], **kw)
        burst_hpc.burst_attention_backward(mine[3], *mine[:3], o, lse, **kw)

    step()
    first = dict(counts)
    assert first["digest"] == 2
    if layout == "chunks":   # the gather scheme on one node: packed passes, a packing for each pass's plan
        assert first["packing"] == 2 and first["steps"] == first["_pairs"] == first["lifetimes"] == 0
    else:
        assert first["steps"] == 2 and first["_pairs"] > 0 and first["lifetimes"] == 2 and first["packing"] == 0
    for _ in range(3):
        step()
    assert counts == first and callplan.PLANS.hits == 6
