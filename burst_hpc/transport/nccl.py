"""NCCL transport: cupy.cuda.nccl send/recv inside one group, on a communication stream.

The communication stream first waits for the kernels queued so far (they wrote the send
buffers and may still read the receive buffers); ``wait()`` makes the compute stream wait
for the transfer, so the host never blocks.
"""
import cupy
from cupy.cuda import nccl

_communicators = {}


def _communicator(comm):
    """One NCCL communicator per MPI communicator and device, bootstrapped over MPI."""
    key = (comm.py2f(), cupy.cuda.Device().id)
    if key not in _communicators:
        uid = nccl.get_unique_id() if comm.rank == 0 else None
        uid = comm.bcast(uid, root=0)
        _communicators[key] = nccl.NcclCommunicator(comm.size, uid, comm.rank)
    return _communicators[key]


class Pending:
    def __init__(self, event):
        self.event = event

    def wait(self):
        cupy.cuda.get_current_stream().wait_event(self.event)


class NcclTransport:
    xp = cupy

    def __init__(self, comm):
        self.rank, self.size = comm.rank, comm.size
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self.nccl = _communicator(comm)
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def exchange(self, sends, recvs):
        self.stream.wait_event(cupy.cuda.get_current_stream().record())
        nccl.groupStart()
        for buf in sends:
            self.nccl.send(buf.data.ptr, buf.nbytes, nccl.NCCL_UINT8, self.next, self.stream.ptr)
        for buf in recvs:
            self.nccl.recv(buf.data.ptr, buf.nbytes, nccl.NCCL_UINT8, self.prev, self.stream.ptr)
        nccl.groupEnd()
        return Pending(self.stream.record())

    def close(self):
        pass
