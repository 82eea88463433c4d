"""Timing hook for benchmarks: the passes of ``burst_attention`` / ``burst_attention_backward`` with
one agreed plan and one open transport, so each call times the ring alone, in one of three modes:

- ``"full"``: the real ring, exactly what burst_attention / burst_attention_backward compute;
- ``"compute"``: every exchange completes at once and moves nothing: the local kernels alone
  (each rank keeps attending to its own shard, so the results are not attention);
- ``"comm"``: the exchanges alone, no kernels (o and the gradients stay zero).

How well communication hides behind compute is then full time against max(compute, comm)::

    ring = RingBenchmark(q, k, v, comm=comm, causal=True, transport="nccl")
    o, lse = ring.forward()                           # "full"
    for mode in RingBenchmark.MODES:
        ring.forward(mode); ring.backward(do, o, lse, mode)   # time each between barriers

``bytes_sent`` counts the bytes this rank hands to the transport (every mode but "compute"), so the
volume of a call is measured, not computed. ``backend`` runs the block pairs with another block
backend (a backend object, as burst_hpc.attention takes it): bench/baselines.py times the ring with
an untiled one.

Inputs are checked once, collectively, as burst_attention checks them. Every rank calls the same
methods in the same order. bench/bench_ring.py is the worked example.
"""
from .backends import get_backend
from .collective import world
from .plan.callplan import checked_call, plan_arrays
from .plan.decisions import choose_backward_ring
from .device import array_device
from .errors import BurstError


class _Counted:
    """A transport that counts the bytes this rank sends through it, in all and per peer."""

    def __init__(self, transport):
        self._transport = transport
        self.xp, self.rank, self.size = transport.xp, transport.rank, transport.size
        self.bytes_sent, self.bytes_to = 0, {}

    def exchange(self, sends, recvs):
        for peer, bufs in sends:
            nbytes = sum(buf.nbytes for buf in bufs)
            self.bytes_sent += nbytes
            self.bytes_to[peer] = self.bytes_to.get(peer, 0) + nbytes
        return self._transport.exchange(sends, recvs)


class NoExchange:
    """A transport whose exchanges complete at once and move nothing: receive buffers are zeroed
    (a memset, no communication), so the compute they feed sees finite data rather than whatever
    a reused buffer held (a partial's -inf lse, say, which would turn the merge into NaN)."""

    def __init__(self, like):
        self.xp, self.rank, self.size = like.xp, like.rank, like.size

    def exchange(self, sends, recvs):
        for _, arrays in recvs:
            for a in arrays:
                a.fill(0)
        return self

    def wait(self):
        pass


class RingBenchmark:
    MODES = ("full", "compute", "comm")

    def __init__(self, q, k, v, comm=None, causal=False, scale=None, layout=None, transport="auto",
                 backward_ring="auto", backend=None, scheme="ring", ranks_per_node=None):
        """This rank's shards and the arguments of burst_attention, ``layout`` a Layout (make_layout makes
        one of a name) or None for the default; ``backward_ring`` as in burst_attention_backward ('auto'
        picks by bytes moved). ``scheme`` (default the flat ring):
        as burst_attention's; the bytes counted are those of the scheme's ring (``bytes_to``: per
        peer, ranks of ``network_peer``'s numbering), not of Ulysses' all-to-alls."""
        self.q, self.k, self.v = q, k, v
        comm = world() if comm is None else comm
        self._plan = plan_arrays(comm, q, checked_call(comm.size, q, k, v, causal, scale, layout, transport,
                                                       scheme=scheme, ranks_per_node=ranks_per_node))
        d = self._plan.decomposition
        self.scheme = d.scheme
        if backend is not None:
            self._plan.backend = get_backend(q, backend)
        self.transport_name, self.layout = d.transport_name, d.layout
        self.backward_ring = choose_backward_ring(backward_ring, d.heads, d.kv_heads, d.head_dim, q.dtype.itemsize)
        counted = {}   # id of a transport -> its _Counted (near and far may be one)
        self._near, self._far, self._inner = (None if t is None else counted.setdefault(id(t), _Counted(t))
                                              for t in d.transports(self._plan.xp))
        self._lanes = tuple(counted.values())
        self._no_exchange = NoExchange(self._near)

    @property
    def bytes_sent(self):
        return sum(lane.bytes_sent for lane in self._lanes)

    @property
    def bytes_to(self):
        total = {}
        for lane in self._lanes:
            for peer, n in lane.bytes_to.items():
                total[peer] = total.get(peer, 0) + n
        return total

    def network_bytes(self):
        """Bytes this rank sent to ranks on other nodes."""
        return sum(n for peer, n in self.bytes_to.items() if self.scheme.remote(peer))

    def _mode(self, mode):
        if mode not in self.MODES:
            raise BurstError(f"unknown benchmark mode {mode!r}; use one of {', '.join(self.MODES)}")
        if mode == "compute":
            return dict(transport=self._no_exchange)
        return dict(skip_compute=mode == "comm", transport=self._near, far=self._far, inner=self._inner)

    def forward(self, mode="full"):
        """(o, lse) of this rank, as burst_attention returns them (in the "full" mode)."""
        with array_device(self.q):
            return self._plan.passes.forward(self.q, self.k, self.v, **self._mode(mode))

    def backward(self, do, o, lse, mode="full"):
        """(dq, dk, dv) of this rank, as burst_attention_backward returns them (in the "full" mode);
        ``do``, ``o``, ``lse`` as it takes them (o, lse from :meth:`forward`)."""
        with array_device(self.q):
            return self._plan.passes.backward(self.backward_ring, do, self.q, self.k, self.v, o, lse,
                                              **self._mode(mode))
