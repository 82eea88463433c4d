"""Host-staged transport for MPIs that are not CUDA-aware.

device -> pinned host (copy stream) -> MPI -> pinned host -> device (copy stream), cut into
chunks so the copies of one chunk overlap the MPI transfer of another. A worker thread drives
the pipeline so the caller can queue kernels meanwhile; ``wait()`` joins it and makes the
compute stream wait for the last upload. Pinned buffers grow to the largest exchange and are
reused.
"""
import threading

import cupy
import numpy as np
from mpi4py import MPI

from .base import per_peer

CHUNK = 16 << 20


def _pinned(nbytes):
    mem = cupy.cuda.alloc_pinned_memory(nbytes)
    return np.frombuffer(mem, np.uint8, nbytes)


def _chunks(nbytes):
    return [(i, min(nbytes, i + CHUNK)) for i in range(0, nbytes, CHUNK)] or [(0, 0)]


def _slots(transfers, host):
    """(peer, tag, device chunk, host chunk): each buffer of ``transfers`` ((peer, buffers)
    pairs) in CHUNK pieces, end to end in ``host``; tags as the mpi transport's."""
    offset = 0
    for peer, index, buf in per_peer(transfers):
        flat = buf.reshape(-1).view(cupy.uint8)
        for n, (lo, hi) in enumerate(_chunks(buf.nbytes)):
            yield peer, (index << 12) + n, flat[lo:hi], host[offset + lo:offset + hi]
        offset += buf.nbytes


class Pending:
    def __init__(self, thread, transport):
        self.thread, self.transport = thread, transport

    def wait(self):
        self.thread.join()
        if self.transport.error is not None:
            error, self.transport.error = self.transport.error, None
            raise error
        cupy.cuda.get_current_stream().wait_event(self.transport.uploaded)


class StagedTransport:
    xp = cupy

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.down = cupy.cuda.Stream(non_blocking=True)
        self.up = cupy.cuda.Stream(non_blocking=True)
        self.host_send = self.host_recv = np.empty(0, np.uint8)
        self.device = cupy.cuda.Device()
        self.error = None
        self.uploaded = None

    def _reserve(self, send_bytes, recv_bytes):
        if self.host_send.size < send_bytes:
            self.host_send = _pinned(send_bytes)
        if self.host_recv.size < recv_bytes:
            self.host_recv = _pinned(recv_bytes)

    def exchange(self, sends, recvs):
        self._reserve(*(sum(b.nbytes for _, bufs in side for b in bufs) for side in (sends, recvs)))
        ready = cupy.cuda.get_current_stream().record()
        self.down.wait_event(ready)
        self.up.wait_event(ready)  # the kernels still reading the receive buffers come first
        downloads = []
        for peer, tag, device, host in _slots(sends, self.host_send):
            device.get(stream=self.down, out=host, blocking=False)
            downloads.append((peer, tag, host, self.down.record()))
        thread = threading.Thread(target=self._transfer, args=(downloads, recvs), daemon=True)
        thread.start()
        return Pending(thread, self)

    def _transfer(self, downloads, recvs):
        try:
            self.device.use()  # a new thread starts on device 0
            if self.uploaded is not None:
                self.uploaded.synchronize()  # the last uploads still read host_recv
            uploads = list(_slots(recvs, self.host_recv))
            requests = [self.comm.Irecv(host, source=peer, tag=tag) for peer, tag, _, host in uploads]
            sends = []
            for peer, tag, host, done in downloads:
                done.synchronize()
                sends.append(self.comm.Isend(host, dest=peer, tag=tag))
            for request, (_, _, device, host) in zip(requests, uploads):
                request.Wait()
                device.set(host, stream=self.up)
            MPI.Request.Waitall(sends)
            self.uploaded = self.up.record()
        except BaseException as error:  # surfaced by wait() on the calling thread
            self.error = error
            self.uploaded = None

    def close(self):
        pass
