"""The decisions a Decomposition makes from every rank's machine facts, gathered in its one agreement:
the same on every rank, or one error naming the rank or what differs."""
import pytest

from burst_hpc.errors import RankMismatchError, TransportError
from burst_hpc.plan.decisions import settled_scheme, settled_transport


class Asked:
    transport, scheme = "auto", "ring"


def facts(gpu=None, alone=("ok", "nccl"), shared=("ok", "staged"), device=None):
    return {"gpu": gpu, "device": device, "transport": (alone, shared)}


def test_the_transport_follows_whether_two_ranks_share_a_gpu():
    assert settled_transport(Asked, [facts(("a", "0")), facts(("a", "1"))]) == "nccl"
    assert settled_transport(Asked, [facts(("a", "0")), facts(("a", "0"))]) == "staged"   # NCCL refuses that
    assert settled_transport(Asked, [facts(("a", "0")), facts(("b", "0"))]) == "nccl"     # another host's bus 0


def test_machines_that_pick_differently_fail_alike():
    with pytest.raises(RankMismatchError, match=r"ranks disagree on transport: rank 0 has 'nccl', rank 1 has 'mpi'"):
        settled_transport(Asked, [facts(("a", "0")), facts(("a", "1"), alone=("ok", "mpi"))])


def test_a_rank_that_cannot_have_the_transport_is_named():
    refused = ("error", "transport 'mpi' needs a CUDA-aware MPI")
    with pytest.raises(TransportError, match=r"^transport 'mpi' needs a CUDA-aware MPI \(rank 1\)$"):
        settled_transport(Asked, [facts(), facts(alone=refused)])
    with pytest.raises(TransportError, match=r"^transport 'mpi' needs a CUDA-aware MPI$"):
        settled_transport(Asked, [facts(alone=refused), facts(alone=refused)])


def test_a_named_scheme_is_taken_as_named():
    assert settled_scheme(Asked, None, None, [facts(), facts()]) == "ring"
