"""Ranks that pass different arguments: every argument that shapes a call (or a run job) is agreed in
one collective before any collective whose participation depends on one, so each disagreement ends
every rank within seconds with the same RankMismatchError naming it, never a hang, a crash or a
result computed from some rank's arguments; and the ring works again once the ranks agree."""
import faulthandler
import os

import numpy as np
import pytest

import burst_hpc
from burst_hpc.plan import callplan
from burst_hpc import io
from burst_hpc.errors import BurstError, LayoutError, MaskError, RankMismatchError
from burst_hpc.job.run import RunOptions, run
from test_ring import local_inputs, raises_everywhere

LOCAL = 8
DEADLINE_S = 60   # a call that hangs ends the job (a traceback of every thread, then exit 1) instead of waiting


@pytest.fixture(autouse=True)
def deadline():
    faulthandler.dump_traceback_later(DEADLINE_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def two_or_more(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")


# (argument, what rank 0 passes, what the other ranks pass): each alone shapes the call
DISAGREEMENTS = [
    ("scheme", "ring", "double_ring"),      # hung: only the double ring gathered the topology
    ("ranks_per_node", None, 1),             # hung the same way
    ("transport", "auto", "host"),           # ran: both the host transport, but not what the ranks asked
    ("layout", "contiguous", "zigzag"),
    ("window", None, (3, 0)),
    ("cu_seqlens", None, "documents"),
    ("dtype", np.float32, np.float64),
    ("causal", False, True),
    ("scale", None, 0.5),
]


@pytest.mark.parametrize("name,first,other", DISAGREEMENTS, ids=[d[0] for d in DISAGREEMENTS])
def test_a_forward_call_whose_ranks_disagree_fails_alike_on_every_rank(comm, name, first, other):
    value = first if comm.rank == 0 else other
    seqlen = LOCAL * comm.size
    q, k, v = local_inputs(comm, local=LOCAL, dim=8, dtype=value if name == "dtype" else np.float32)
    kw = {} if name == "dtype" else {name: np.array([0, 3, seqlen]) if value == "documents" else value}
    message = raises_everywhere(comm, RankMismatchError,
                                lambda: burst_hpc.burst_attention(q, k, v, comm=comm, **kw))
    assert message.startswith(f"ranks disagree on {name}: "), message
    if name == "layout":   # a name is made into the call's Layout: the message names it by kind and sizes
        assert message.startswith(f"ranks disagree on layout: rank 0 has Layout('contiguous', seqlen={seqlen}, "
                                  f"size={comm.size}), rank 1 has Layout('zigzag', seqlen={seqlen}"), message
    o, lse = burst_hpc.burst_attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), comm=comm)
    assert np.isfinite(o).all() and np.isfinite(lse).all()   # the ring works once they agree


def test_a_backward_call_whose_ranks_disagree_on_its_ring_fails_alike(comm):
    q, k, v = local_inputs(comm, local=LOCAL, dim=8)
    o, lse = burst_hpc.burst_attention(q, k, v, comm=comm, causal=True)
    ring = "q" if comm.rank == 0 else "kv"
    message = raises_everywhere(comm, RankMismatchError, lambda: burst_hpc.burst_attention_backward(
        q, q, k, v, o, lse, comm=comm, causal=True, backward_ring=ring))
    assert message.startswith("ranks disagree on backward_ring: rank 0 has 'q', rank 1 has 'kv'"), message


def test_ranks_with_kept_plans_that_disagree_on_the_scheme_fail_alike(comm):
    """Every rank keeps a plan of each call; then the ranks mix them: the digests differ, every rank plans
    anew and the agreement names the scheme (the plan cache never serves a call the ranks disagree on)."""
    q, k, v = local_inputs(comm, local=LOCAL, dim=8)
    callplan.PLANS.clear()
    for scheme in ("ring", "auto"):
        burst_hpc.burst_attention(q, k, v, comm=comm, scheme=scheme)
    mine = "ring" if comm.rank == 0 else "auto"
    message = raises_everywhere(comm, RankMismatchError, lambda: burst_hpc.burst_attention(q, k, v, comm=comm,
                                                                                          scheme=mine))
    assert message.startswith("ranks disagree on scheme: rank 0 has 'ring', rank 1 has 'auto'"), message
    callplan.PLANS.clear()


def test_a_call_that_is_forward_on_some_ranks_and_backward_on_others_fails_alike(comm):
    q, k, v = local_inputs(comm, local=LOCAL, dim=8)
    o, lse = burst_hpc.burst_attention(q, k, v, comm=comm)

    def call():
        if comm.rank == 0:
            return burst_hpc.burst_attention(q, k, v, comm=comm)
        return burst_hpc.burst_attention_backward(q, q, k, v, o, lse, comm=comm)

    message = raises_everywhere(comm, RankMismatchError, call)
    assert message.startswith("ranks disagree on pass: rank 0 has 'forward', rank 1 has 'backward'"), message


def test_a_layout_name_bad_on_one_rank_is_refused_alike_on_every_rank(comm):
    """A layout's name is made into the Layout of the call before its agreement: a name that is no layout,
    a length that does not split in it, or a bad mask for the chunks layout (placed by it), on one rank
    only, is refused on every rank with that rank's message, never raised there alone while the others
    wait in the agreement (the deadline ends a hang)."""
    last = comm.rank == comm.size - 1
    q, k, v = local_inputs(comm, local=LOCAL, dim=8)
    odd = local_inputs(comm, local=LOCAL - 1, dim=8)
    o, lse = burst_hpc.burst_attention(q, k, v, comm=comm)
    cases = [
        (LayoutError, "unknown layout 'zigzg'", (q, k, v), dict(layout="zigzg" if last else "zigzag")),
        (LayoutError, "layout must be a Layout or one of", (q, k, v), dict(layout=3 if last else "zigzag")),
        (LayoutError, "does not split", odd, dict(layout="zigzag" if last else "contiguous")),
        (MaskError, "cu_seqlens", (q, k, v), dict(layout="chunks", cu_seqlens=np.array([0, 5]) if last else None)),
    ]
    for error, match, (q_, k_, v_), kw in cases:
        for call in (lambda: burst_hpc.burst_attention(q_, k_, v_, comm=comm, causal=True, **kw),
                     lambda: burst_hpc.burst_attention_backward(q_, q_, k_, v_, q_, lse[:, :, :q_.shape[1]],
                                                                comm=comm, causal=True, **kw)):
            message = raises_everywhere(comm, error, call, match=match)
            assert message.endswith(f"(rank {comm.size - 1})"), message


def test_a_communicator_that_is_not_one_is_a_clear_error(comm):
    q, k, v = local_inputs(comm, local=LOCAL, dim=8)
    with pytest.raises(BurstError, match=r"comm must be an mpi4py communicator such as MPI.COMM_WORLD .*got str"):
        burst_hpc.burst_attention(q, k, v, comm="world")
    with pytest.raises(BurstError, match=r"comm must be an mpi4py communicator"):
        burst_hpc.burst_attention_backward(q, q, k, v, q, None, comm=object())


@pytest.mark.parametrize("option", ["verify", "backward", "overwrite", "warmup", "input", "json"])
def test_a_run_job_whose_ranks_disagree_creates_nothing_and_fails_alike(comm, tmp_path_factory, option):
    """job.run from Python: an option on some ranks only is refused on every rank before anything is read,
    created or replaced (an existing output stays as it was)."""
    where = comm.bcast(str(tmp_path_factory.mktemp("agree")) if comm.rank == 0 else None)
    src, other, dst = (os.path.join(where, name) for name in ("in.h5", "other.h5", "out.h5"))
    if comm.rank == 0:
        for path in (src, other):
            io.generate(path, 1, 4 * comm.size, 2, 2, 8, np.float32, seed=1, with_grad=True)
        with open(dst, "w") as f:
            f.write("an earlier result")
    comm.Barrier()
    options = RunOptions(src, dst, backend="numpy", overwrite=True)
    if comm.rank == 1:
        options.verify, options.backward, options.warmup = (option == name for name in ("verify", "backward", "warmup"))
        options.overwrite = option != "overwrite"
        options.input = other if option == "input" else src
        options.json = os.path.join(where, "report.json") if option == "json" else None
    message = raises_everywhere(comm, RankMismatchError, lambda: run(options, comm))
    assert message.startswith(f"ranks disagree on {option}: "), message
    with open(dst) as f:
        assert f.read() == "an earlier result"
    assert sorted(os.listdir(where)) == ["in.h5", "other.h5", "out.h5"]
    comm.Barrier()


def test_ranks_that_cut_their_hosts_otherwise_fail_alike_in_the_topology(comm, monkeypatch):
    """topology() gathers every rank's setting with its node: one rank with another
    BURST_HPC_RANKS_PER_NODE (the kernels' compile and the run job read it there) or a bad one gets the
    same error on every rank; before, those ranks built different nodes, or one split the
    communicator while the others waited."""
    from burst_hpc.errors import TopologyError
    from burst_hpc.plan.topology import topology

    if comm.rank == 1:
        monkeypatch.setenv("BURST_HPC_RANKS_PER_NODE", "1")
    message = raises_everywhere(comm, RankMismatchError, lambda: topology(comm))
    assert message == ("ranks disagree on ranks_per_node (or BURST_HPC_RANKS_PER_NODE): rank 0 has None, rank 1 "
                       "has 1"), message
    if comm.rank == 1:
        monkeypatch.setenv("BURST_HPC_RANKS_PER_NODE", "two")
    message = raises_everywhere(comm, TopologyError, lambda: topology(comm))
    assert message == "BURST_HPC_RANKS_PER_NODE must be a positive integer; got 'two' (rank 1)", message
    monkeypatch.delenv("BURST_HPC_RANKS_PER_NODE", raising=False)
    assert topology(comm).nodes == 1
