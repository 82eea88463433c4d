"""The ring engine: one step loop for the forward pass and both backward passes, for every
layout and schedule (schedule.steps says what to compute and what to send to whom).

Step t

1. posts its nonblocking exchanges (the step's (peer, buffers) sends and receives, one exchange
   per due step): on a plain ring the data the visit of step t+1 needs goes into a spare buffer
   (double buffering) while the partial finished at step t-1 goes on; a double ring also posts
   one transfer over the network that completes at the end of the inner round (its ``due``);
2. runs the local block kernels of this step's visit (the caller's ``compute``);
3. waits for the exchanges due at step t (on the GPU: while the queued kernels still run), then
   combines each partial received: one for this rank's own shard into its results, a carried
   accumulator into this rank's partial of the same shard; gives back the buffers whose last
   use was step t (``lifetimes``: computed from the schedule, so the peak is known beforehand).

A partial that goes nowhere (this rank's own shard) is computed straight into the results.
Receive and partial buffers come from a pool, allocated on first use and reused once given
back (a plain ring: two shards, three partials, as with fixed double buffering); a buffer is
never written while it is sent, and the caller's arrays are only ever read.
"""
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable


@dataclass
class Side:
    """One side of the attention ("kv" or "q") as the engine sees it."""
    travelling: list     # this rank's arrays of this side, sent to the ranks that visit them
    results: list        # this rank's accumulators that partials of this side's visits combine into
    fills: tuple = ()    # the value each partial starts from (0 for a sum, -inf for a log-sum-exp)
    combine: Callable = None  # combine(into, part): folds a partial into accumulators


@lru_cache(maxsize=256)
def lifetimes(steps, rank):
    """What the engine holds and when, read off the schedule (cached: the schedules are): ``ends``
    {step: ((kind, side, shard), ...)} the received shards whose last use (a visit, a send still
    in flight) ends at that step; ``fresh`` the steps whose visit makes a partial that is sent on;
    ``peak`` the most buffers of each kind ("data", "partial") alive at once. It follows ``run``:
    an accumulator lives from the visit that makes it, or from the arrival of a partial for a
    shard that has none here (a double ring's rail relay, which then keeps the arriving buffer),
    until its send completes; at a step's end sends complete before receives."""
    def due(t, index):
        return index if t.due is None else t.due

    ends, fresh, live = {}, set(), []   # live: (kind, first step, last step) of every buffer
    sent, completing = {}, {}           # partial key -> steps posting its sends; step -> completions
    for index, step in enumerate(steps):
        for t in step.recvs:
            key = (t.what, t.side, t.shard)
            end = due(t, index)
            if t.what == "data":
                for later in range(end + 1, len(steps)):
                    s = steps[later]
                    if s.visit is not None and (s.visit.side, s.visit.shard) == (t.side, t.shard):
                        end = later
                    for u in s.sends:
                        if (u.what, u.side, u.shard) == key:
                            end = max(end, due(u, later))
                ends.setdefault(end, []).append(key)
            else:
                completing.setdefault(end, []).append((1, t))
            live.append((t.what, index, end))
        for t in step.sends:
            if t.what == "partial":
                sent.setdefault((t.side, t.shard), []).append(index)
                completing.setdefault(due(t, index), []).append((0, t))
    held = {}   # partial key -> the step its accumulator was made
    for index, step in enumerate(steps):
        visit = step.visit
        if visit is not None and any(i > index for i in sent.get((visit.side, visit.shard), ())):
            fresh.add(index)
            held[(visit.side, visit.shard)] = index
        for incoming, t in sorted(completing.get(index, ()), key=lambda c: c[0]):
            key = (t.side, t.shard)
            if not incoming:
                live.append(("partial", held.pop(key), index))
            elif t.shard != rank and key not in held:
                held[key] = index + 1   # the arriving buffer, counted as such until now, is kept
    peak = {kind: max([sum(1 for k, a, b in live if k == kind and a <= i <= b) for i in range(len(steps))] or [0])
            for kind in ("data", "partial")}
    return {step: tuple(keys) for step, keys in ends.items()}, frozenset(fresh), peak


class _Pool:
    """Buffers like a side's travelling arrays ("data") or results ("partial"), reused once given back."""

    def __init__(self, xp, sides):
        self.xp, self.sides, self.free = xp, sides, {}

    def take(self, kind, side):
        spare = self.free.get((kind, side))
        if spare:
            return spare.pop()
        like = self.sides[side].travelling if kind == "data" else self.sides[side].results
        return [self.xp.empty_like(a) for a in like]

    def give(self, kind, side, arrays):
        self.free.setdefault((kind, side), []).append(arrays)


def run(transport, far, steps, sides, compute, skip_compute=False, on_step=None):
    """Run this rank's ``steps`` (schedule.Step). ``sides``: {"kv": Side, "q": Side};
    ``compute(visit, data, partial)`` adds the visit's block pairs into this rank's results and
    into ``partial`` (the visiting shard's, or this rank's results when it stays here).
    ``on_step(done, total)``, if given, is called after each step (progress reports).

    A transfer completes at the end of its ``due`` step (the posting step when None): a plain
    ring's all do; a double ring's transfers over the network run under a whole inner round, on
    the ``far`` transport (the same as ``transport`` where nothing is due later)."""
    rank = transport.rank
    pool = _Pool(transport.xp, sides)
    ends, fresh, _ = lifetimes(steps, rank)
    data, partials, arriving = {}, {}, {}   # (side, shard) -> arrays; (what, side, shard) -> arrays
    waiting = {}                            # step -> [(handle, transfers completed then)]

    def payload(t):
        if t.what == "partial":
            return partials[(t.side, t.shard)]
        return sides[t.side].travelling if t.shard == rank else data[(t.side, t.shard)]

    for index, step in enumerate(steps):
        groups = {}   # due step -> (sends, recvs, [(direction, transfer)])
        for direction, transfers in (("out", step.sends), ("in", step.recvs)):
            for t in transfers:
                sends, recvs, done = groups.setdefault(index if t.due is None else t.due, ([], [], []))
                if direction == "out":
                    sends.append((t.peer, payload(t)))
                else:
                    key = (t.what, t.side, t.shard)
                    assert key not in arriving, f"{key} received twice at once"
                    arriving[key] = pool.take("data" if t.what == "data" else "partial", t.side)
                    recvs.append((t.peer, arriving[key]))
                done.append((direction, t))
        for due in sorted(groups):
            sends, recvs, done = groups[due]
            lane = transport if due == index else far
            waiting.setdefault(due, []).append((lane.exchange(sends, recvs), done))
        visit = step.visit
        if visit is not None:
            key = (visit.side, visit.shard)
            if index in fresh:
                partial = partials[key] = pool.take("partial", visit.side)
                for a, fill in zip(partial, sides[visit.side].fills):
                    a.fill(fill)
            else:
                partial = sides[visit.side].results
            if not skip_compute:
                compute(visit, sides[visit.side].travelling if visit.shard == rank else data[key], partial)
        done = []
        for handle, transfers in waiting.pop(index, ()):
            handle.wait()
            done += transfers
        for direction, t in sorted(done, key=lambda d: d[0] == "in"):   # sends first: their buffers are free
            key = (t.side, t.shard)
            if direction == "out":
                if t.what == "partial":
                    pool.give("partial", t.side, partials.pop(key))
            elif t.what == "data":           # held for this rank's visits and sends
                data[key] = arriving.pop(("data",) + key)
            elif t.shard != rank and key not in partials:   # a relay: the arriving partial is kept
                partials[key] = arriving.pop(("partial",) + key)
            else:                            # folded into this rank's results, or its partial of that shard
                part = arriving.pop(("partial",) + key)
                sides[t.side].combine(sides[t.side].results if t.shard == rank else partials[key], part)
                pool.give("partial", t.side, part)
        for _, side, shard in ends.get(index, ()):   # received shards whose last use was this step
            pool.give("data", side, data.pop((side, shard)))
        if on_step is not None:
            on_step(index + 1, len(steps))
    assert not waiting and not arriving, "transfers left in flight after the last step"
