"""An emulated network: a transport wrapper that holds transfers between nodes to a bandwidth and
a latency, so one host (or one 8-GPU machine) can act as several nodes joined by IB-like links.

Each rank's NIC sends one message at a time: a step's bytes to other nodes take ``latency +
bytes / bandwidth`` after the later of their posting and the end of this NIC's previous
transfer; ``wait()`` returns no earlier than that (the data itself moves through the wrapped
transport at full speed). Transfers inside a node are not held. Switched on for any call by
``BURST_HPC_EMULATE_NETWORK="GBPS[,LATENCY_US]"`` (e.g. "50,5"); every rank sets the same value.
"""
import time


class _Held:
    def __init__(self, pending, ready):
        self.pending, self.ready = pending, ready

    def wait(self):
        self.pending.wait()
        delay = self.ready - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


class Nic:
    """One rank's emulated network card: bandwidth (bytes/s), latency (s), busy until ``free_at``."""

    def __init__(self, bandwidth, latency):
        self.bandwidth, self.latency = bandwidth, latency
        self.free_at, self.held_bytes = 0.0, 0

    def send(self, nbytes):
        """When a message of ``nbytes`` posted now has left."""
        self.held_bytes += nbytes
        self.free_at = max(time.perf_counter(), self.free_at) + self.latency + nbytes / self.bandwidth
        return self.free_at


class EmulatedNetwork:
    def __init__(self, transport, remote, nic):
        """``remote(peer)``: True when ``peer`` (a rank of the wrapped transport) is on another node;
        ``nic``: the Nic this rank's transports share."""
        self._transport, self._remote, self.nic = transport, remote, nic
        self.xp, self.rank, self.size = transport.xp, transport.rank, transport.size

    def exchange(self, sends, recvs):
        pending = self._transport.exchange(sends, recvs)
        remote = sum(buf.nbytes for peer, bufs in sends if self._remote(peer) for buf in bufs)
        return _Held(pending, self.nic.send(remote) if remote else time.perf_counter())

    def close(self):
        getattr(self._transport, "close", lambda: None)()
