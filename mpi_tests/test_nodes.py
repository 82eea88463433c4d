"""Schemes across nodes on the CPU path, one host acting as several nodes (ranks_per_node), against
the float64 oracle: 4 ranks as 2x2, 6 as 2x3 and 3x2, 8 as 2x4 and 4x2 (`make test` runs this
module on 4, 6 and 8 ranks with BURST_HPC_NODE_TESTS=1; elsewhere it is skipped)."""
import os

import numpy as np
import pytest
from mpi4py import MPI

import burst_hpc
import burst_hpc.plan.topology
from burst_hpc.errors import LayoutError, TopologyError
from burst_hpc.plan import masks
from burst_hpc.plan.masks import random_documents
from burst_hpc.reference import attention_backward_reference, attention_reference
from test_ring import problem



def shapes(size):
    """(nodes, ranks per node) with both > 1 that make ``size``."""
    return [(size // w, w) for w in range(2, size) if size % w == 0 and size // w > 1]


pytestmark = pytest.mark.skipif(not os.environ.get("BURST_HPC_NODE_TESTS") or not shapes(MPI.COMM_WORLD.size),
                                reason="run by make test on 4, 6 and 8 ranks (as nodes)")


def cases(size):
    return [(n, w) for n, w in shapes(size)]


def heads(kind, w):
    """(Hq, Hkv) of each head case for w ranks per node."""
    return {"mha": (w, w), "gqa": (2 * w, w), "kv_shared": (2 * w, 1), "indivisible": (w + 1, w + 1)}[kind]


def run_and_check(comm, scheme, per_node, layout, causal, hq, hkv, local=8, cu_seqlens=None, window=None,
                  rings=("q", "kv")):
    P, r = comm.size, comm.rank
    q, k, v, do, seed = problem(comm, 1, local, hq, hkv, 8)
    kw = dict(causal=causal, cu_seqlens=cu_seqlens, window=window)
    ref_o, ref_lse = attention_reference(q, k, v, **kw)
    ref_grads = attention_backward_reference(do, q, k, v, **kw)

    def mine(x, axis=1):
        return burst_hpc.shard(x, r, P, layout, axis=axis)

    common = dict(comm=comm, layout=layout, scheme=scheme, ranks_per_node=per_node, **kw)
    o, lse = burst_hpc.burst_attention(mine(q), mine(k), mine(v), **common)
    np.testing.assert_allclose(o, mine(ref_o), atol=1e-6, err_msg=f"{scheme} seed {seed}")
    np.testing.assert_allclose(lse, mine(ref_lse, axis=2), atol=1e-5, err_msg=f"{scheme} seed {seed}")
    for ring in rings:
        grads = burst_hpc.burst_attention_backward(mine(do), mine(q), mine(k), mine(v), o, lse, backward_ring=ring,
                                                   **common)
        for name, got, want in zip("dq dk dv".split(), grads, ref_grads):
            np.testing.assert_allclose(got, mine(want), atol=2e-5, rtol=1e-4,
                                       err_msg=f"{scheme} {name} {ring}-ring seed {seed}")


@pytest.mark.parametrize("kind", ["mha", "gqa", "kv_shared", "indivisible"])
@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", False), ("contiguous", True)])
@pytest.mark.parametrize("scheme", ["double_ring", "ulysses_ring"])
def test_schemes_match_the_oracle(comm, scheme, layout, causal, kind):
    for nodes, w in cases(comm.size):
        hq, hkv = heads(kind, w)
        if scheme == "ulysses_ring" and kind == "indivisible":
            with pytest.raises(TopologyError, match="does not divide"):
                run_and_check(comm, scheme, w, layout, causal, hq, hkv)
            continue
        run_and_check(comm, scheme, w, layout, causal, hq, hkv)


@pytest.mark.parametrize("scheme", ["double_ring", "ulysses_ring"])
def test_documents_and_window(comm, scheme):
    for nodes, w in cases(comm.size):
        seqlen = 8 * comm.size
        docs = random_documents(np.random.default_rng(comm.bcast(np.random.SeedSequence().entropy % 2**32)), seqlen, 3)
        run_and_check(comm, scheme, w, "contiguous", True, w, w, cu_seqlens=docs, rings=("kv",))
        run_and_check(comm, scheme, w, "zigzag", True, 2 * w, 1, window=(5, 0), rings=("q",))
        run_and_check(comm, scheme, w, "contiguous", False, w, w, window=(3, 3), rings=("kv",))


@pytest.mark.parametrize("scheme", ["double_ring", "ulysses_ring", "auto"])
def test_ranks_out_of_node_order(comm, scheme, monkeypatch):
    """The launcher placed ranks round-robin over the nodes (rank r on node r % N)."""
    for nodes, w in cases(comm.size):
        monkeypatch.setenv("BURST_HPC_NODE_ID", str(comm.rank % nodes))
        topo = burst_hpc.plan.topology.topology(comm)
        assert (topo.nodes, topo.per_node) == (nodes, w)
        assert topo.arrangement.order[topo.position] == comm.rank and topo.node == comm.rank % nodes
        assert topo.rail.size == nodes and topo.node_comm.size == w
        run_and_check(comm, scheme, None, "zigzag", True, 2 * w, w)


@pytest.mark.parametrize("round_robin", [False, True])
def test_chunks_placed_by_nodes(comm, round_robin, monkeypatch):
    """The chunks layout placed by nodes through the gather scheme across the simulated nodes: the oracle's results.
    Launched round-robin (rank r on node r % N), ``layout='auto'`` hands each rank the pieces of its position
    (Layout.held_by), so a node's ranks still hold that node's share."""
    from burst_hpc.plan import costmodel
    from burst_hpc.plan.layout import make_layout

    for nodes, w in cases(comm.size):
        rng = np.random.default_rng(comm.bcast(np.random.SeedSequence().entropy % 2**32))
        seqlen = 16 * comm.size
        docs = random_documents(rng, seqlen, int(rng.integers(2, 6)))
        by_nodes = make_layout("chunks", seqlen, comm.size, masks.make(seqlen, True, None, docs), ranks_per_node=w)
        assert by_nodes.per_node == w
        per_node = w
        if round_robin:
            monkeypatch.setenv("BURST_HPC_NODE_ID", str(comm.rank % nodes))
            per_node = None
        monkeypatch.setattr(costmodel, "fastest_layout", lambda *a, **kw: by_nodes)
        d = burst_hpc.Decomposition(comm, seqlen=seqlen, heads=4, kv_heads=2, head_dim=8, dtype="float64",
                                    causal=True, cu_seqlens=docs, layout="auto", ranks_per_node=per_node)
        assert d.layout.pieces(comm.rank) == by_nodes.pieces(d.topo.position)
        assert d.topo.node == (comm.rank % nodes if round_robin else comm.rank // w)
        run_and_check(comm, "gather", per_node, d.layout, True, 4, 2, local=16, cu_seqlens=docs, rings=("kv",))


def test_balanced_layout_is_refused_by_node_schemes(comm):
    nodes, w = cases(comm.size)[0]
    docs = random_documents(np.random.default_rng(comm.bcast(np.random.SeedSequence().entropy % 2**32)), 8 * comm.size, 3)
    for scheme in ("double_ring", "ulysses_ring"):
        with pytest.raises(LayoutError, match="zigzag and contiguous"):
            run_and_check(comm, scheme, w, "balanced", True, w, w)
        with pytest.raises(LayoutError, match="zigzag and contiguous"):   # documents, not causal: the same schedule
            run_and_check(comm, scheme, w, "balanced", False, w, w, cu_seqlens=docs)


@pytest.mark.parametrize("scheme", ["ring", "auto"])
def test_balanced_schedule_across_nodes(comm, scheme):
    """The work-aware schedule on the flat ring of simulated nodes ('auto' keeps it there)."""
    for nodes, w in cases(comm.size):
        rng = np.random.default_rng(comm.bcast(np.random.SeedSequence().entropy % 2**32))
        seqlen = 16 * comm.size
        docs = random_documents(rng, seqlen, int(rng.integers(2, 6)))
        run_and_check(comm, scheme, w, "balanced", True, w, 1, local=16, cu_seqlens=docs)
        run_and_check(comm, scheme, w, "balanced", False, 2 * w, w, local=16, cu_seqlens=docs, window=(9, 2),
                      rings=("q",))


def test_unequal_nodes_give_one_error_everywhere(comm, monkeypatch):
    monkeypatch.setenv("BURST_HPC_NODE_ID", "0" if comm.rank == 0 else "1")
    with pytest.raises(TopologyError, match="same number of ranks"):
        run_and_check(comm, "double_ring", None, "zigzag", True, 2, 2)
    monkeypatch.delenv("BURST_HPC_NODE_ID")
    with pytest.raises(TopologyError, match="does not divide"):
        run_and_check(comm, "double_ring", comm.size + 1, "zigzag", True, 2, 2)


def test_auto_keeps_the_flat_ring_on_one_node_and_schemes_agree(comm):
    """One node -> ring (nothing changes); any pick gives the same results."""
    from burst_hpc.plan.callplan import checked_call, plan_arrays

    q, k, v, _, _ = problem(comm, 1, 8, 4, 2, 8)
    mine = burst_hpc.shard(q, comm.rank, comm.size, "zigzag")
    kv = burst_hpc.shard(k, comm.rank, comm.size, "zigzag")
    plan = plan_arrays(comm, mine, checked_call(comm.size, mine, kv, kv, True, None, None, "auto",
                                                ranks_per_node=comm.size))
    assert plan.scheme.name == "ring"
    run_and_check(comm, "auto", cases(comm.size)[0][1], "zigzag", True, 4, 2, rings=("q",))


@pytest.mark.parametrize("scheme", ["ring", "double_ring", "ulysses_ring"])
@pytest.mark.parametrize("backward", [False, True])
def test_bytes_over_the_network_equal_the_cost_model(comm, scheme, backward):
    """Counted by the benchmark transport (the scheme's ring; Ulysses' all-to-alls stay inside)."""
    from burst_hpc.plan import costmodel
    from burst_hpc.plan.rates import GPU_RATES
    from burst_hpc.benchmark import RingBenchmark

    for nodes, w in cases(comm.size):
        hq, hkv = 2 * w, w
        q, k, v, do, _ = problem(comm, 1, 8, hq, hkv, 8, np.float32)
        mine = [burst_hpc.shard(x, comm.rank, comm.size, "zigzag") for x in (q, k, v, do)]
        bench = RingBenchmark(*mine[:3], comm=comm, causal=True, scheme=scheme, ranks_per_node=w)
        o, lse = bench.forward("comm")
        if backward:
            before = bench.network_bytes()
            bench.backward(mine[3], o, lse, "comm")
            sent = bench.network_bytes() - before
        else:
            sent = bench.network_bytes()
        pr = costmodel.Problem(1, q.shape[1], hq, hkv, 8, 4, masks.make(q.shape[1], True))
        cluster = costmodel.Cluster(nodes, w)
        model = costmodel.pass_prediction(scheme, pr, cluster, GPU_RATES["cpu"], costmodel.zigzag(pr, cluster),
                                          backward)
        assert comm.allreduce(sent, op=max_op()) == model.network


def max_op():
    return MPI.MAX


@pytest.mark.parametrize("scheme", ["ring", "double_ring"])
@pytest.mark.parametrize("backward", [False, True])
def test_peak_memory_matches_the_cost_model(comm, scheme, backward):
    """The model's peak bytes per rank against the CPU path's high-water mark (tracemalloc) of
    one call with its kernels skipped (the ring's buffers, accumulators and outputs)."""
    import tracemalloc

    from burst_hpc.plan import costmodel
    from burst_hpc.plan.memory import peak_memory
    from burst_hpc.benchmark import RingBenchmark

    for nodes, w in cases(comm.size):
        hq, hkv, local, d = 2 * w, w, 128, 64
        q, k, v, do, _ = problem(comm, 1, local, hq, hkv, d, np.float32)
        mine = [burst_hpc.shard(x, comm.rank, comm.size, "zigzag") for x in (q, k, v, do)]
        bench = RingBenchmark(*mine[:3], comm=comm, causal=True, scheme=scheme, ranks_per_node=w)
        o, lse = bench.forward("comm")
        inputs = sum(x.nbytes for x in mine[:3]) + ((mine[3].nbytes + o.nbytes + lse.nbytes) if backward else 0)
        tracemalloc.start()
        if backward:
            bench.backward(mine[3], o, lse, "comm")
        else:
            bench.forward("comm")
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        pr = costmodel.Problem(1, q.shape[1], hq, hkv, d, 4, masks.make(q.shape[1], True))
        model = peak_memory(scheme, pr, costmodel.Cluster(nodes, w), backward)
        measured = comm.allreduce(peak, op=max_op()) + inputs
        assert abs(measured - model) <= 0.05 * model, (measured, model)


def test_emulated_network_holds_transfers_between_nodes(comm, monkeypatch):
    """Same results; each rail transfer of the double ring held by the latency (50 ms here)."""
    import time

    nodes, w = cases(comm.size)[0]
    monkeypatch.setenv("BURST_HPC_EMULATE_NETWORK", "100,50000")
    start = time.perf_counter()
    run_and_check(comm, "double_ring", w, "zigzag", True, w, w, rings=())
    elapsed = comm.allreduce(time.perf_counter() - start, op=max_op())
    assert elapsed >= (nodes - 1) * 0.05


def test_plan_measures_rates_under_mpiexec(comm):
    """`burst-hpc plan --measure`: one kernel timing and one ping-pong over each link class."""
    from burst_hpc.plan import costmodel, tables

    nodes, w = cases(comm.size)[0]
    pr = costmodel.Problem(1, 64 * comm.size, 2, 2, 16, 4, masks.make(64 * comm.size, True))
    rates, topo = tables.measure(comm, pr, w, tokens=128, nbytes=1 << 16)
    assert (topo.nodes, topo.per_node) == (nodes, w)
    assert min(rates.fwd_tflops, rates.bwd_tflops, rates.intra_gbps, rates.inter_gbps) > 0
    assert rates == comm.bcast(rates)   # every rank holds the same rates
