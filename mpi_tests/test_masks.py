"""Documents (cu_seqlens) and sliding windows through the ring, on the CPU path, against the
float64 oracle on the whole sequence. Runs under mpiexec with 1..4 ranks."""
import numpy as np
import pytest

import burst_hpc
from burst_hpc.plan import masks
from burst_hpc.plan.callplan import Backward, checked_call, plan_arrays
from burst_hpc.plan.layout import default_kind
from burst_hpc.errors import MaskError, RankMismatchError
from burst_hpc.reference import attention_backward_reference, attention_reference
from test_ring import raises_everywhere, shared_rng

LOCAL = 12  # tokens per rank: zigzag halves of 6


def packed(rng, seqlen, kind):
    """Document offsets: None; 'one' document; 'many' random ones with no cut on a rank or zigzag-half
    boundary (so documents span them) and two of length 1."""
    if kind is None:
        return None
    if kind == "one":
        return np.array([0, seqlen])
    half = LOCAL // 2
    inner = [c for c in range(2, seqlen - 2) if c % half not in (0, half - 1)]
    cuts = set(rng.choice(inner, size=min(len(inner), max(1, seqlen // 8)), replace=False).tolist())
    for c in rng.choice(inner, size=min(len(inner), 2), replace=False):
        cuts |= {int(c), int(c) + 1}  # a one-token document
    return np.array([0, *sorted(cuts), seqlen])


CASES = [  # (documents, window, causal, layout); layout None: the default
    ("many", None, True, None),
    ("many", None, True, "zigzag"),
    ("many", None, True, "contiguous"),     # the kv-ring stops early; dK, dV go straight home
    ("many", None, True, "balanced"),       # hidden chunk pairs leave the balanced schedule
    (None, (15, 0), True, "balanced"),
    ("many", (4, 0), True, "balanced"),
    (None, (5, 2), False, "balanced"),      # not causal: the plain ring, shortened by the window
    ("many", None, False, "contiguous"),
    ("one", None, True, "zigzag"),
    (None, (0, 0), True, "contiguous"),
    (None, (1, 0), True, None),
    (None, (5, 2), False, "zigzag"),
    (None, (15, 0), True, "contiguous"),    # larger than a shard
    (None, (15, 15), False, "contiguous"),
    (None, (0, 15), False, "contiguous"),    # the q-ring stops early; dQ goes straight home
    ("many", (4, 0), True, "zigzag"),
    ("many", (3, 20), False, None),
]


@pytest.mark.parametrize("docs,window,causal,layout", CASES)
def test_forward_and_both_backward_rings(comm, docs, window, causal, layout):
    rng, seed = shared_rng(comm)
    seqlen = LOCAL * comm.size
    check_against_oracle(comm, rng, seed, seqlen, packed(rng, seqlen, docs), window, causal, layout)


@pytest.mark.parametrize("local", [12, 40])
@pytest.mark.parametrize("draw", range(6))
def test_balanced_schedule_on_random_documents_and_windows(comm, draw, local):
    """The work-aware schedule (pieces of rows on other ranks, partials home) on random masks."""
    from burst_hpc.plan.workload import documents

    rng, seed = shared_rng(comm)
    seqlen = local * comm.size
    lengths = ("uniform", "capped", "lognormal", "uniform", "capped", "equal")[draw]
    cu = documents(rng, seqlen, lengths, count=int(rng.integers(1, seqlen // 3 + 1)) if lengths != "capped" else None,
                   longest=max(1, seqlen // 4))
    window = (int(rng.integers(0, seqlen // 2)), int(rng.integers(-1, 3))) if draw in (3, 4) else None
    causal = draw != 5 and bool(rng.integers(4))
    check_against_oracle(comm, rng, seed, seqlen, cu, window, causal, "balanced")
    if draw == 0:   # a window alone
        check_against_oracle(comm, rng, seed, seqlen, None, (int(rng.integers(0, seqlen)), 0), True, "balanced")


def check_against_oracle(comm, rng, seed, seqlen, cu, window, causal, layout):
    """Forward and both backward rings against the float64 oracle on the whole sequence."""
    P, r = comm.size, comm.rank
    q, k, v, do = (rng.standard_normal((1, seqlen, h, 8)) for h in (4, 2, 2, 4))
    kw = dict(causal=causal, cu_seqlens=cu, window=window)
    ref_o, ref_lse = attention_reference(q, k, v, **kw)
    ref_grads = attention_backward_reference(do, q, k, v, **kw)
    used = layout or default_kind(causal)
    ctx = f"seed {seed} {kw} layout {used}"

    def mine(x, axis=1):
        return burst_hpc.shard(x, r, P, used, axis=axis)

    o, lse = burst_hpc.burst_attention(mine(q), mine(k), mine(v), comm=comm, layout=layout, **kw)
    np.testing.assert_allclose(o, mine(ref_o), atol=1e-10, err_msg=ctx)
    np.testing.assert_allclose(lse, mine(ref_lse, axis=2), rtol=1e-6, err_msg=ctx)
    for ring in ("q", "kv"):
        grads = burst_hpc.burst_attention_backward(mine(do), mine(q), mine(k), mine(v), o, lse, comm=comm,
                                                   layout=layout, backward_ring=ring, **kw)
        for name, got, want in zip("dq dk dv".split(), grads, ref_grads):
            np.testing.assert_allclose(got, mine(want), atol=2e-5, rtol=1e-4, err_msg=f"{name} {ring}-ring {ctx}")


class CountingTransport:
    """The real transport, counting the exchanges that carry data."""

    def __init__(self, inner):
        self.inner, self.exchanges = inner, 0
        self.xp, self.rank, self.size = inner.xp, inner.rank, inner.size

    def exchange(self, sends, recvs):
        self.exchanges += 1
        return self.inner.exchange(sends, recvs)


@pytest.mark.parametrize("ring", ["q", "kv"])
def test_a_window_runs_only_the_steps_it_reaches(comm, ring):
    """A causal window of 3 with the contiguous layout reaches one shard back: two steps forward
    (one exchange), and the kv-ring backward sends dK/dV one hop back home; nothing more moves."""
    P = comm.size
    rng, seed = shared_rng(comm)
    q, k, v, do = (rng.standard_normal((1, LOCAL * P, 2, 8)) for _ in range(4))  # MHA
    kw = dict(causal=True, window=(3, 0))

    def mine(x):
        return burst_hpc.shard(x, comm.rank, P, "contiguous")

    shards = [mine(x) for x in (q, k, v)]
    contiguous = burst_hpc.make_layout("contiguous", LOCAL * P, P)
    plan = plan_arrays(comm, shards[0], checked_call(P, *shards, True, None, contiguous, "auto", window=(3, 0)))
    steps = min(P, 2)
    assert masks.ring_steps(plan.mask, plan.layout, False) == steps and plan.layout.kind == "contiguous"
    assert masks.ring_steps(plan.mask, plan.layout, True) == P  # queries travel forward: later queries come last
    counting = CountingTransport(plan.decomposition.transports(plan.xp)[0])
    o, lse = plan.passes.forward(mine(q), mine(k), mine(v), transport=counting)
    assert counting.exchanges == steps - 1
    ref_o, _ = attention_reference(q, k, v, **kw)
    np.testing.assert_allclose(o, mine(ref_o), atol=1e-10, err_msg=f"seed {seed}")
    counting = CountingTransport(plan.decomposition.transports(plan.xp)[0])
    grads = plan.passes.backward(ring, mine(do), mine(q), mine(k), mine(v), o, lse, transport=counting)
    # every step of a ring of P > 1 exchanges once, and one more exchange brings the carried
    # accumulators home (straight to their owner when the ring stopped early)
    if ring == "kv":
        assert counting.exchanges == (0 if P == 1 else 3)
    else:
        assert counting.exchanges == (0 if P == 1 else P + 1)
    for name, got, want in zip("dq dk dv".split(), grads, attention_backward_reference(do, q, k, v, **kw)):
        np.testing.assert_allclose(got, mine(want), atol=2e-5, rtol=1e-4, err_msg=f"{name} {ring} seed {seed}")
    auto = plan_arrays(comm, shards[0], checked_call(P, *shards, True, None, contiguous, "auto",
                                                     backward=Backward(mine(do), o, lse), window=(3, 0)))
    # MHA takes the q-ring, unless its P steps lose; one rank runs the packed passes, whose backward is the kv side
    assert auto.ring == ("q" if P == 2 else "kv")


def local_inputs(comm, local=LOCAL):
    rng = np.random.default_rng()
    return [rng.standard_normal((1, local, h, 8)) for h in (2, 1, 1)]


def test_bad_documents_on_one_rank_fail_on_every_rank(comm):
    seqlen = LOCAL * comm.size
    cu = np.array([0, 5, 3, seqlen]) if comm.rank == comm.size - 1 else np.array([0, 3, 5, seqlen])
    q, k, v = local_inputs(comm)
    raises_everywhere(comm, MaskError, lambda: burst_hpc.burst_attention(q, k, v, comm=comm, causal=True, cu_seqlens=cu),
                      match="strictly increasing")
    short = np.array([0, 3, seqlen - 1])
    raises_everywhere(comm, MaskError, lambda: burst_hpc.burst_attention(q, k, v, comm=comm, cu_seqlens=short),
                      match=f"end at the sequence length {seqlen}")


def test_bad_window_fails_on_every_rank(comm):
    q, k, v = local_inputs(comm)
    raises_everywhere(comm, MaskError, lambda: burst_hpc.burst_attention(q, k, v, comm=comm, window=(-3, 0)),
                      match="window sizes must be >= 0")


def test_ranks_with_different_documents_or_windows_fail_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    seqlen = LOCAL * comm.size
    q, k, v = local_inputs(comm)
    cu = np.array([0, 4 if comm.rank == 1 else 5, seqlen])
    message = raises_everywhere(comm, RankMismatchError,
                                lambda: burst_hpc.burst_attention(q, k, v, comm=comm, cu_seqlens=cu))
    assert message.startswith("ranks disagree on cu_seqlens: rank 0 has 3 values, rank 1 has 3; they first differ "
                              "at index 1: 5 on rank 0, 4 on rank 1"), message  # in words, not digests
    longer = np.array([0, 5, seqlen - 1, seqlen]) if comm.rank == comm.size - 1 else np.array([0, 5, seqlen])
    message = raises_everywhere(comm, RankMismatchError,
                                lambda: burst_hpc.burst_attention(q, k, v, comm=comm, cu_seqlens=longer))
    assert f"rank {comm.size - 1} has 4; they first differ at index 2: {seqlen} on rank 0" in message, message
    mine = cu if comm.rank == 0 else None
    message = raises_everywhere(comm, RankMismatchError,
                                lambda: burst_hpc.burst_attention(q, k, v, comm=comm, cu_seqlens=mine))
    assert "ranks disagree on cu_seqlens: rank 0 passes one, rank 1 passes none" in message, message
    window = (2, 0) if comm.rank == 1 else (3, 0)
    raises_everywhere(comm, RankMismatchError, lambda: burst_hpc.burst_attention(q, k, v, comm=comm, window=window),
                      match=r"ranks disagree on window: rank 0 has \(3, 0\), rank 1 has \(2, 0\)")
    o, lse = burst_hpc.burst_attention(q, k, v, comm=comm, window=(3, 0), causal=True)  # the ring still works
    assert np.isfinite(lse).all()


@pytest.mark.parametrize("cu,window", [((0, 4000), None), ((0, 96), None), ((0, 2048), None), ((0, 1), None),
                                       (None, (128, 0))])
def test_the_default_layout_is_zigzag_whatever_the_mask(comm, cu, window):
    """Shards cut in zigzag (the causal default, README) and a causal call naming no layout: right
    whatever the documents or the window (issue 37: some offsets used to switch the call to
    contiguous shards, max |o - ref| 0.35-3.7, no error)."""
    rng, seed = shared_rng(comm)
    P, seqlen = comm.size, 4080   # a multiple of 2P for 1..5 ranks
    offsets = None if cu is None else np.array([*cu, seqlen])
    q, k, v = (rng.standard_normal((1, seqlen, 1, 8)) for _ in range(3))
    ref_o, ref_lse = comm.bcast(attention_reference(q, k, v, causal=True, cu_seqlens=offsets, window=window)
                                if comm.rank == 0 else None)

    def mine(x, axis=1):
        return burst_hpc.shard(x, comm.rank, P, "zigzag", axis=axis)

    o, lse = burst_hpc.burst_attention(mine(q), mine(k), mine(v), comm=comm, causal=True, cu_seqlens=offsets,
                                       window=window)
    np.testing.assert_allclose(o, mine(ref_o), atol=1e-10, err_msg=f"seed {seed}")
    np.testing.assert_allclose(lse, mine(ref_lse, axis=2), rtol=1e-6, err_msg=f"seed {seed}")
