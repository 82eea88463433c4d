"""NCCL transport: cupy.cuda.nccl send/recv inside one group, on a communication stream.

Every send and receive of a step, whatever its peer, sits in the same groupStart/groupEnd:
NCCL then progresses them together, so no rank's send waits on a receive that its peer posts
only later (docs/RING.md).

The communication stream first waits for the kernels queued so far (they wrote the send
buffers and may still read the receive buffers); ``wait()`` makes the compute stream wait
for the transfer, so the host never blocks.
"""
import cupy
from cupy.cuda import nccl

from ..collective import kept


def communicator(comm):
    """The NCCL communicator of an MPI communicator on the current device, made once (collectively,
    bootstrapped over MPI) and shared by every user of that pair: the ring transport and anything
    else that wants NCCL on the same ranks (the collectives of bench/baselines.py). Kept on the MPI
    communicator (collective.kept): a freed one's never serves another that reuses its handle."""
    state, key = kept(comm), ("nccl", cupy.cuda.Device().id)
    if key not in state:
        uid = nccl.get_unique_id() if comm.rank == 0 else None
        uid = comm.bcast(uid, root=0)
        state[key] = nccl.NcclCommunicator(comm.size, uid, comm.rank)
    return state[key]


class Pending:
    def __init__(self, event):
        self.event = event

    def wait(self):
        cupy.cuda.get_current_stream().wait_event(self.event)


class NcclTransport:
    xp = cupy

    def __init__(self, comm):
        self.rank, self.size, self.comm = comm.rank, comm.size, comm
        # made at once (collectively); one rank alone makes it at its first transfer, which few calls have
        self.nccl = communicator(comm) if comm.size > 1 else None
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def exchange(self, sends, recvs):
        self.stream.wait_event(cupy.cuda.get_current_stream().record())
        if self.nccl is None:
            if not (sends or recvs):
                return Pending(self.stream.record())
            self.nccl = communicator(self.comm)
        nccl.groupStart()
        for peer, bufs in sends:
            for buf in bufs:
                self.nccl.send(buf.data.ptr, buf.nbytes, nccl.NCCL_UINT8, peer, self.stream.ptr)
        for peer, bufs in recvs:
            for buf in bufs:
                self.nccl.recv(buf.data.ptr, buf.nbytes, nccl.NCCL_UINT8, peer, self.stream.ptr)
        nccl.groupEnd()
        return Pending(self.stream.record())

    def close(self):
        pass
