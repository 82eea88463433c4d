"""The ring engine: one step loop for the forward pass and both backward passes, for every
layout and schedule (schedule.steps says what to compute and what to send to whom).

Step t

1. posts one nonblocking exchange (the step's list of (peer, buffers) sends and receives):
   the data the visit of step t+1 needs goes into a spare buffer (double buffering) while
   the partial finished at step t-1 goes on;
2. runs the local block kernels of this step's visit (the caller's ``compute``);
3. waits for the exchange (on the GPU: while the queued kernels still run), then combines
   each partial received: one for this rank's own shard into its results, one for the shard
   visited now (a plain ring's carried accumulator) into this step's partial; swaps buffers.

A partial that goes nowhere (this rank's own shard) is computed straight into the results.
Receive and partial buffers are allocated once per call, per side, on first use; a buffer
is never written while it is sent, and the caller's arrays are only ever read.
"""
from dataclasses import dataclass
from typing import Callable


@dataclass
class Side:
    """One side of the attention ("kv" or "q") as the engine sees it."""
    travelling: list     # this rank's arrays of this side, sent to the ranks that visit them
    results: list        # this rank's accumulators that partials of this side's visits combine into
    fills: tuple = ()    # the value each partial starts from (0 for a sum, -inf for a log-sum-exp)
    combine: Callable = None  # combine(into, part): folds a partial into accumulators


class _Buffers:
    """The receive and partial buffers of one side."""

    def __init__(self, xp, side):
        self.xp, self.side = xp, side
        self.current = self.spare = None    # received data: this step's visit, the next one's
        self.partial = self.outgoing = None  # this step's partial, last step's (being sent)
        self.incoming = None

    def _like(self, arrays):
        return [self.xp.empty_like(a) for a in arrays]

    def receive_data(self):
        if self.spare is None:
            self.spare = self._like(self.side.travelling)
        return self.spare

    def received_data(self):
        self.current, self.spare = self.spare, self.current

    def receive_partial(self):
        if self.incoming is None:
            self.incoming = self._like(self.side.results)
        return self.incoming

    def fresh_partial(self):
        if self.partial is None:
            self.partial = self._like(self.side.results)
        for a, fill in zip(self.partial, self.side.fills):
            a.fill(fill)
        return self.partial

    def partial_done(self):
        self.partial, self.outgoing = self.outgoing, self.partial


def run(transport, steps, sides, compute, skip_compute=False, on_step=None):
    """Run this rank's ``steps`` (schedule.Step). ``sides``: {"kv": Side, "q": Side};
    ``compute(visit, data, partial)`` adds the visit's block pairs into this rank's results and
    into ``partial`` (the visiting shard's, or this rank's results when it stays here).
    ``on_step(done, total)``, if given, is called after each step (progress reports)."""
    rank = transport.rank
    buffers = {name: _Buffers(transport.xp, side) for name, side in sides.items()}

    def payload(t):
        b = buffers[t.side]
        if t.what == "partial":
            return b.outgoing
        return sides[t.side].travelling if t.shard == rank else b.current

    for index, step in enumerate(steps):
        sends = [(t.peer, payload(t)) for t in step.sends]
        recvs = [(t.peer, buffers[t.side].receive_data() if t.what == "data" else buffers[t.side].receive_partial())
                 for t in step.recvs]
        pending = transport.exchange(sends, recvs) if sends or recvs else None
        visit, partial, travels_on = step.visit, None, False
        if visit is not None:
            b = buffers[visit.side]
            later = steps[index + 1].sends if index + 1 < len(steps) else ()
            travels_on = any(t.what == "partial" and (t.side, t.shard) == (visit.side, visit.shard) for t in later)
            partial = b.fresh_partial() if travels_on else sides[visit.side].results
            if not skip_compute:
                data = sides[visit.side].travelling if visit.shard == rank else b.current
                compute(visit, data, partial)
        if pending is not None:
            pending.wait()
        for t in step.recvs:
            b = buffers[t.side]
            if t.what == "data":
                b.received_data()
            elif t.shard == rank:
                sides[t.side].combine(sides[t.side].results, b.incoming)
            else:  # a carried accumulator meets the shard it belongs to
                assert travels_on and (t.side, t.shard) == (visit.side, visit.shard), (t, visit)
                sides[t.side].combine(partial, b.incoming)
        if travels_on:
            buffers[visit.side].partial_done()
        if on_step is not None:
            on_step(index + 1, len(steps))
