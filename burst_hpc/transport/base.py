"""What every transport is (the ring engine's view of one): a ``typing.Protocol``, so the real ones
(host, mpi, nccl, staged) and the wrappers (the benchmark's counting and no-exchange transports, the
emulated network) satisfy it by shape, and the helpers they share."""
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
