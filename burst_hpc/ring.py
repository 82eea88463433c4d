"""The ring engine: one loop for the forward pass and both backward rings, for every layout.

At step t this rank holds the travelling shard of rank (rank - t) mod P. The loop

1. posts one nonblocking exchange: the travelling shard goes to the next rank while the
   spare buffer receives the one for step t+1 (double buffering), and the carried
   accumulator finished last step goes on while the one for this step comes in;
2. runs the local block kernels for this step (the caller's ``compute``);
3. waits for the exchange (on the GPU: while the queued kernels still run), adds this
   step's partial into the incoming carried accumulator, and swaps buffers.

Carried accumulators (dQ on the q-ring, dK/dV on the kv-ring) follow their travelling
shard one step behind and, after P steps, one last exchange brings each home.
With documents or a window the ring may stop after T < P steps (masks.ring_steps: no rank has
anything visible later); the carried accumulators then walk T - 1 hops back home.
Receive buffers are allocated once per call; a buffer is never written while it is sent.
"""


def _zeros_like(xp, arrays):
    return [xp.zeros(a.shape, a.dtype) for a in arrays]


def ring_loop(transport, travelling, compute, carried=(), skip_compute=False, steps=None, back=None):
    """Run P steps (or the first ``steps``). ``travelling``: this rank's read-only arrays that visit
    every rank. ``carried``: (shape, dtype) of accumulators that travel with them; ``compute(source,
    travelling_bufs, carried_partials)`` adds this step's work. Returns the carried
    accumulators of this rank's own travelling shard. ``back``: a transport sending to the
    previous rank, for carried accumulators when 1 < steps < P."""
    xp, rank, size = transport.xp, transport.rank, transport.size
    steps = size if steps is None else steps
    if size == 1:
        partial = [xp.zeros(shape, dtype) for shape, dtype in carried]
        if not skip_compute:
            compute(rank, list(travelling), partial)
        return partial

    current = [xp.array(a, order="C", copy=True) for a in travelling]  # ours: the caller's arrays are never overwritten
    spare = [xp.empty_like(a) for a in current]
    partial = [xp.zeros(shape, dtype) for shape, dtype in carried]
    incoming = _zeros_like(xp, partial)
    outgoing = _zeros_like(xp, partial)
    for step in range(steps):
        source = (rank - step) % size
        sends, recvs = [], []
        if step + 1 < steps:
            sends += current
            recvs += spare
        if carried and step > 0:
            sends += outgoing
            recvs += incoming
        pending = transport.exchange(sends, recvs) if sends else None
        if carried and step > 0:
            for p in partial:
                p.fill(0)
        if not skip_compute:
            compute(source, current, partial)
        if pending is not None:
            pending.wait()
        if carried:
            if step > 0:
                for p, i in zip(partial, incoming):
                    p += i
            partial, outgoing = outgoing, partial
        current, spare = spare, current
    if not carried:
        return []
    if steps == size:
        transport.exchange(outgoing, incoming).wait()
        return incoming
    for _ in range(steps - 1):  # outgoing holds the accumulator of rank - (steps - 1): walk it back
        back.exchange(outgoing, incoming).wait()
        outgoing, incoming = incoming, outgoing
    return outgoing
