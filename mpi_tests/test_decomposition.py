"""The Decomposition: built from shapes (no arrays) and agreed by every rank in one collective; arrays
are cut by it and run on it, with the results of burst_attention and the float64 oracle."""
import numpy as np
import pytest

import burst_hpc
from burst_hpc.errors import RankMismatchError, ShapeError
from burst_hpc.plan import callplan, decomposition
from burst_hpc.reference import attention_backward_reference, attention_reference
from test_ring import raises_everywhere

S_PER_RANK, H, HKV, D = 16, 4, 2, 8


def shared_inputs(comm, seqlen, seed=5):
    rng = np.random.default_rng(seed)   # the same global arrays on every rank
    q, do = (rng.standard_normal((1, seqlen, H, D)) for _ in range(2))
    k, v = (rng.standard_normal((1, seqlen, HKV, D)) for _ in range(2))
    return q, k, v, do


@pytest.mark.parametrize("layout", [None, "balanced", "auto"])
def test_a_decomposition_from_shapes_cuts_and_runs_the_arrays(comm, layout):
    seqlen = S_PER_RANK * 2 * comm.size
    cu = np.array([0, 3, seqlen // 2, seqlen - 5, seqlen])
    d = burst_hpc.Decomposition(comm, seqlen=seqlen, heads=H, kv_heads=HKV, head_dim=D, dtype="float64",
                                causal=True, cu_seqlens=cu, layout=layout)
    if layout is None:
        assert d.layout == burst_hpc.make_layout("zigzag", seqlen, comm.size)
    if layout == "auto":   # the cost model's pick for this call, priced as choose_layout prices it
        assert d.layout == burst_hpc.choose_layout(seqlen, comm.size, causal=True, cu_seqlens=cu, heads=H,
                                                   kv_heads=HKV, head_dim=D, dtype="float64", backend="numpy")
    q, k, v, do = shared_inputs(comm, seqlen)
    mine = [d.shard(x) for x in (q, k, v, do)]
    np.testing.assert_array_equal(mine[0], np.take(q, d.indices(), axis=1))
    o, lse = d.attention(*mine[:3])
    grads = d.attention_backward(mine[3], *mine[:3], o, lse)
    ref_o, ref_lse = attention_reference(q, k, v, causal=True, cu_seqlens=cu)
    np.testing.assert_allclose(o, d.shard(ref_o), atol=1e-10)
    np.testing.assert_allclose(lse, d.shard(ref_lse, axis=2), rtol=1e-6)
    for got, want in zip(grads, attention_backward_reference(do, q, k, v, causal=True, cu_seqlens=cu)):
        np.testing.assert_allclose(got, d.shard(want), atol=2e-5, rtol=1e-4)   # lse is float32
    # the function API on the same shards gives the same numbers
    same = burst_hpc.burst_attention(*mine[:3], comm=comm, causal=True, cu_seqlens=cu, layout=d.layout)
    np.testing.assert_array_equal(same[0], o)
    np.testing.assert_allclose(d.unshard(comm.allgather(o)), ref_o, atol=1e-10)


def test_a_call_plan_agrees_once_and_decides_the_rest_from_what_was_agreed(comm, monkeypatch):
    """One agreement collective per plan: the arguments, each rank's checks and what each rank's
    machine says travel together (before, a second agreement followed the decisions, and the GPUs
    were gathered on their own)."""
    calls = []
    agree = decomposition.agree

    def counted(*args, **kwargs):
        calls.append(args[2] if len(args) > 2 else kwargs.get("signature"))
        return agree(*args, **kwargs)

    monkeypatch.setattr(decomposition, "agree", counted)
    seqlen = S_PER_RANK * comm.size
    q, k, v, _ = (d_.astype(np.float32) for d_ in shared_inputs(comm, seqlen))
    contiguous = burst_hpc.make_layout("contiguous", seqlen, comm.size)
    cut = [contiguous.shard(x, comm.rank) for x in (q, k, v)]
    plan = callplan.plan_arrays(comm, cut[0], callplan.checked_call(comm.size, *cut, True, None, contiguous, "auto"))
    assert len(calls) == 1 and calls[0]["q shape"] == cut[0].shape and calls[0]["layout"] == contiguous
    assert plan.decomposition.transport_name == "host" and plan.ring in ("q", "kv")


def test_open_transports_are_kept(comm):
    d = burst_hpc.Decomposition(comm, seqlen=S_PER_RANK * comm.size, heads=H, kv_heads=HKV, head_dim=D,
                                dtype="float32", causal=True, layout="balanced")
    first = d.transports(np)
    assert all(a is b for a, b in zip(first, d.transports(np)))   # not new transports each pass


def test_decompositions_over_one_communicator_share_its_transports(comm):
    """A training loop with new documents every step plans anew each time, and the plan cache keeps the
    plans: their transports (streams, pinned buffers on the GPU) are one set per communicator, not one
    set per plan."""
    made = set()
    for seed in range(5):
        cu = np.unique(np.concatenate([[0, S_PER_RANK * comm.size],
                                       np.random.default_rng(seed).integers(1, S_PER_RANK * comm.size, 3)]))
        d = burst_hpc.Decomposition(comm, seqlen=S_PER_RANK * comm.size, heads=H, kv_heads=HKV, head_dim=D,
                                    dtype="float32", causal=True, cu_seqlens=cu, layout="chunks")
        made.update(id(t) for t in d.transports(np) if t is not None)
    assert len(made) == 1, made


def test_ranks_that_build_different_decompositions_fail_alike(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    message = raises_everywhere(comm, RankMismatchError, lambda: burst_hpc.Decomposition(
        comm, seqlen=S_PER_RANK * comm.size, heads=H, head_dim=D, dtype="float32",
        causal=comm.rank == 0))
    assert message.startswith("ranks disagree on causal: rank 0 has True, rank 1 has False"), message


def test_arrays_that_do_not_fit_the_decomposition_fail_alike(comm):
    seqlen = S_PER_RANK * comm.size
    d = burst_hpc.Decomposition(comm, seqlen=seqlen, heads=H, kv_heads=HKV, head_dim=D, dtype="float64")
    q, k, v, _ = shared_inputs(comm, seqlen)
    mine = [d.shard(x) for x in (q, k, v)]
    if comm.rank == 0:
        mine[0] = mine[0][:, :-1]
    message = raises_everywhere(comm, ShapeError, lambda: d.attention(*mine))
    assert message.startswith(f"q must have shape (1, {S_PER_RANK}, {H}, {D})"), message
    with pytest.raises(ShapeError, match="heads must be a positive integer; got 0"):
        burst_hpc.Decomposition(comm, seqlen=seqlen, heads=0, head_dim=D, dtype="float32")


def test_arrays_of_another_kind_than_the_decomposition_is_for_fail_alike(comm):
    """A NumPy decomposition's transport moves host buffers: CuPy arrays are refused before any exchange
    (a stand-in of CuPy's array type: the check reads only the type's module)."""
    class Device:
        __module__ = "cupy._core.core"
        dtype, shape = np.dtype(np.float32), (1, S_PER_RANK, H, D)

    d = burst_hpc.Decomposition(comm, seqlen=S_PER_RANK * comm.size, heads=H, head_dim=D, dtype="float32")
    q = Device()
    message = raises_everywhere(comm, burst_hpc.BackendError, lambda: d.attention(q, q, q))
    assert "made for backend='numpy' arrays; got CuPy arrays (make one with backend='cuda')" in message, message


def test_ranks_that_price_for_different_passes_fail_alike(comm):
    """``backward`` decides what 'auto' prices (forward alone or forward+backward): before, it was left
    out of the agreement, so ranks could place tokens differently and the pass hung."""
    if comm.size == 1:
        pytest.skip("needs ranks that differ")
    seqlen = 384 * comm.size
    cu = np.array([0, 499 * seqlen // 768, 717 * seqlen // 768, seqlen])
    message = raises_everywhere(comm, RankMismatchError, lambda: burst_hpc.Decomposition(
        comm, seqlen=seqlen, heads=2, head_dim=8, dtype="float64", causal=True, cu_seqlens=cu, layout="auto",
        backward=comm.rank != 0))
    assert "backward" in message


def test_every_rank_prices_with_one_machines_fixed_costs(comm, tmp_path_factory, monkeypatch):
    """The fixed costs `burst-hpc compile` keeps are per node (beside the kernel cache): a node that
    measured other ones must not make its ranks pick another layout or scheme than the rest."""
    from burst_hpc.plan import calibrate

    cache = tmp_path_factory.mktemp(f"cache{comm.rank}")
    monkeypatch.setenv("CUPY_CACHE_DIR", str(cache))
    if comm.rank % 2:   # these nodes measured no fixed cost at all: priced alone they pick otherwise
        calibrate.save("cpu", {"intra_latency_us": 0.0, "step_us": 0.0, "fwd_launch_us": 0.0, "bwd_launch_us": 0.0})
    seqlen = 128 * max(2, comm.size)
    cu = np.array([0, 40, 100, 130, seqlen])
    d = burst_hpc.Decomposition(comm, seqlen=seqlen, heads=2, head_dim=8, dtype="float64", causal=True, cu_seqlens=cu,
                                layout="auto")
    picks = comm.allgather((d.layout.key, d.scheme.name))
    assert all(pick == picks[0] for pick in picks), picks


def test_topology_state_goes_with_the_communicator(comm):
    """What the topology finds of a communicator is kept on it (an MPI attribute), not by the address of
    one Python handle: another handle of the same communicator finds the same Topology and inner lane
    (no second collective split), a duplicate its own."""
    from mpi4py import MPI

    from burst_hpc.plan.topology import inner_lane, topology

    mine = comm.Dup()
    other = mine.Dup()
    try:
        same = MPI.Comm.f2py(mine.py2f())
        assert same is not mine
        assert topology(same) is topology(mine)
        assert inner_lane(same) is inner_lane(mine)
        assert topology(other) is not topology(mine) and inner_lane(other) is not inner_lane(mine)
    finally:
        other.Free()
        mine.Free()
