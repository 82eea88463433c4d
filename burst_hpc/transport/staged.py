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

from .base import message_tag, per_peer

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
            yield peer, message_tag(index, n), flat[lo:hi], host[offset + lo:offset + hi]
        offset += buf.nbytes


class Staging:
    """One exchange's pinned host buffers; ``uploaded``: the event after which the device no longer
    reads ``recv`` (None: free now)."""

    def __init__(self):
        self.send = self.recv = np.empty(0, np.uint8)
        self.uploaded = None

    def reserve(self, send_bytes, recv_bytes):
        if self.uploaded is not None:
            self.uploaded.synchronize()  # the last uploads from recv are done
            self.uploaded = None
        if self.send.size < send_bytes:
            self.send = _pinned(send_bytes)
        if self.recv.size < recv_bytes:
            self.recv = _pinned(recv_bytes)


class Pending:
    def __init__(self, transport, staging):
        self.transport, self.staging = transport, staging
        self.thread, self.error = None, None

    def wait(self):
        self.thread.join()
        self.transport.free.append(self.staging)
        if self.error is not None:
            raise self.error
        cupy.cuda.get_current_stream().wait_event(self.staging.uploaded)


class StagedTransport:
    """Exchanges may overlap (the flat ring's far lane keeps several in flight): each has its own
    pinned buffers, and each one's MPI transfers start after the one before it has finished, so
    they match on both ends in the order the exchanges were made."""
    xp = cupy

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.down = cupy.cuda.Stream(non_blocking=True)
        self.up = cupy.cuda.Stream(non_blocking=True)
        self.device = cupy.cuda.Device()
        self.free = []      # Staging buffers of finished exchanges, reused
        self.last = None    # the thread of the latest exchange

    def exchange(self, sends, recvs):
        staging = self.free.pop() if self.free else Staging()
        staging.reserve(*(sum(b.nbytes for _, bufs in side for b in bufs) for side in (sends, recvs)))
        ready = cupy.cuda.get_current_stream().record()
        self.down.wait_event(ready)
        self.up.wait_event(ready)  # the kernels still reading the receive buffers come first
        downloads = []
        for peer, tag, device, host in _slots(sends, staging.send):
            device.get(stream=self.down, out=host, blocking=False)
            downloads.append((peer, tag, host, self.down.record()))
        pending = Pending(self, staging)
        pending.thread = threading.Thread(target=self._transfer, args=(pending, self.last, downloads, recvs),
                                          daemon=True)
        pending.thread.start()
        self.last = pending.thread
        return pending

    def _transfer(self, pending, before, downloads, recvs):
        try:
            if before is not None:
                before.join()
            self.device.use()  # a new thread starts on device 0
            uploads = list(_slots(recvs, pending.staging.recv))
            requests = [self.comm.Irecv(host, source=peer, tag=tag) for peer, tag, _, host in uploads]
            sends = []
            for peer, tag, host, done in downloads:
                done.synchronize()
                sends.append(self.comm.Isend(host, dest=peer, tag=tag))
            for request, (_, _, device, host) in zip(requests, uploads):
                request.Wait()
                device.set(host, stream=self.up)
            MPI.Request.Waitall(sends)
            pending.staging.uploaded = self.up.record()
        except BaseException as error:  # surfaced by wait() on the calling thread
            pending.error = error

    def close(self):
        pass
