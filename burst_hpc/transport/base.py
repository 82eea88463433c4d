"""What every transport is (the ring engine's view of one): a ``typing.Protocol``, so the real ones
(host, mpi, nccl, staged) and the wrappers (the benchmark's counting and no-exchange transports, the
emulated network) satisfy it by shape, and the helpers they share."""
from functools import lru_cache
from typing import Any, Protocol, Sequence, Tuple, runtime_checkable


class Handle(Protocol):
    def wait(self) -> None:
        """Complete every transfer of the exchange that returned this handle."""


@runtime_checkable
class Transport(Protocol):
    xp: Any      # the array module of the buffers (numpy or cupy)
    rank: int
    size: int

    def exchange(self, sends: Sequence[Tuple[int, list]], recvs: Sequence[Tuple[int, list]]) -> Handle:
        """Post one step's transfers: each (peer, arrays) send to its peer, each receive from its peer,
        arrays matched in list order per peer, as raw bytes. Returns the handle that completes them."""


def per_peer(transfers):
    """(peer, index, array) for every array of ``transfers`` ((peer, arrays) pairs), ``index``
    counting the arrays exchanged with that peer so far: the message tag both ends agree on."""
    count = {}
    for peer, arrays in transfers:
        for array in arrays:
            index = count.get(peer, 0)
            count[peer] = index + 1
            yield peer, index, array


def message_tag(index, n):
    """The MPI tag of chunk ``n`` of the ``index``-th array exchanged with a peer in one exchange: distinct while it
    fits under the MPI's TAG_UB (32767 at the least: Open MPI over UCX 2**23 - 1, Intel MPI 2**19 - 1), wrapped
    beyond it. A tag shared by two messages between two ranks is safe: MPI matches them in the order they are
    posted (its non-overtaking rule), and both ends post an exchange's messages in the same order."""
    return ((index << 12) + n) % (tag_bound() + 1)


@lru_cache(maxsize=1)
def tag_bound():
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767
