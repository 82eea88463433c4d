"""MPI point-to-point transport: NumPy host buffers, or CuPy device buffers on a CUDA-aware MPI."""
from mpi4py import MPI

from .base import message_tag, per_peer

# Open MPI 4.x has no large-count calls: keep every message under 2**31 bytes
MAX_MESSAGE = 1 << 30


def byte_chunks(array, limit=None):
    """Contiguous ``array`` as a list of flat byte views of at most ``limit`` (MAX_MESSAGE) bytes."""
    limit = MAX_MESSAGE if limit is None else limit
    flat = array.reshape(-1).view("uint8")
    return [flat[i:i + limit] for i in range(0, flat.size, limit)] or [flat]


class Pending:
    def __init__(self, requests):
        self.requests = requests

    def wait(self):
        MPI.Request.Waitall(self.requests)
        self.requests = []


class MpiTransport:
    def __init__(self, comm, xp, device):
        self.comm, self.xp, self.device = comm, xp, device
        self.rank, self.size = comm.rank, comm.size

    def exchange(self, sends, recvs):
        if self.device:
            # MPI knows nothing of CUDA streams: kernels that wrote the send buffers, or still
            # read the receive buffers, must finish before MPI touches them
            self.xp.cuda.get_current_stream().synchronize()
        requests = []
        for peer, index, buf in per_peer(recvs):
            for n, chunk in enumerate(byte_chunks(buf)):
                requests.append(self.comm.Irecv(chunk, source=peer, tag=message_tag(index, n)))
        for peer, index, buf in per_peer(sends):
            for n, chunk in enumerate(byte_chunks(buf)):
                requests.append(self.comm.Isend(chunk, dest=peer, tag=message_tag(index, n)))
        return Pending(requests)

    def close(self):
        pass
