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


def uses(visit, side, shard):
    """Whether ``visit`` reads ``side`` of ``shard``."""
    return (visit.q_shard if side == "q" else visit.kv_shard) == shard


@lru_cache(maxsize=256)
def lifetimes(steps, rank):
    """What the engine holds and when, read off the schedule (cached: the schedules are): ``ends``
    {step: ((kind, side, shard), ...)} the received shards whose last use (a visit, a send still
    in flight) ends at that step; ``returned`` the (side, shard) partials this rank sends (a visit
    adds into the one held, or starts one); ``peak`` the most buffers of each kind ("data",
    "partial") alive at once. It follows ``run``: an accumulator lives from the first visit that
    adds into it, or from the arrival of a partial for a shard that has none here (a double
    ring's rail relay, which then keeps the arriving buffer), until its send completes; at a
    step's end sends complete before receives."""
    def due(t, index):
        return index if t.due is None else t.due

    ends, live = {}, []                 # live: (kind, side, first step, last step) of every buffer
    completing = {}                     # step -> completions
    returned = frozenset((t.side, t.shard) for step in steps for t in step.sends if t.what == "partial")
    for index, step in enumerate(steps):
        for t in step.recvs:
            key = (t.what, t.side, t.shard)
            end = due(t, index)
            if t.what == "data":
                for later in range(end + 1, len(steps)):
                    s = steps[later]
                    if any(uses(v, t.side, t.shard) for v in s.visits):
                        end = later
                    for u in s.sends:
                        if (u.what, u.side, u.shard) == key:
                            end = max(end, due(u, later))
                ends.setdefault(end, []).append(key)
            else:
                completing.setdefault(end, []).append((1, t))
            live.append((t.what, t.side, index, end))
        for t in step.sends:
            if t.what == "partial":
                completing.setdefault(due(t, index), []).append((0, t))
    held = {}   # partial key -> the step its accumulator was made
    for index, step in enumerate(steps):
        for visit in step.visits:
            for key in (("q", visit.q_shard), ("kv", visit.kv_shard)):
                if key in returned and key not in held:
                    held[key] = index
        for incoming, t in sorted(completing.get(index, ()), key=lambda c: c[0]):
            key = (t.side, t.shard)
            if not incoming:
                live.append(("partial", t.side, held.pop(key), index))
            elif t.shard != rank and key not in held:
                held[key] = index + 1   # the arriving buffer, counted as such until now, is kept
    assert not held, f"partials made and never sent: {sorted(held)}"
    peak = {kind: sum(max([sum(1 for k, s, a, b in live if (k, s) == (kind, side) and a <= i <= b)
                           for i in range(len(steps))] or [0]) for side in ("kv", "q"))
            for kind in ("data", "partial")}
    return {step: tuple(keys) for step, keys in ends.items()}, returned, peak


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
    ``compute(visit, q_data, kv_data, q_out, k_out)`` adds the visit's block pairs into the
    query-side and key-side results ``q_out``, ``k_out`` (this rank's own results, or the partial
    of another rank's shard). ``on_step(done, total)``, if given, is called after each step
    (progress reports).

    A transfer completes at the end of its ``due`` step (the posting step when None): a plain
    ring's all do; a double ring's transfers over the network run under a whole inner round, on
    the ``far`` transport (the same as ``transport`` where nothing is due later)."""
    rank = transport.rank
    pool = _Pool(transport.xp, sides)
    ends, returned, _ = lifetimes(steps, rank)
    data, partials, arriving = {}, {}, {}   # (side, shard) -> arrays; (what, side, shard, peer) -> arrays
    waiting = {}                            # step -> [(handle, transfers completed then)]

    def payload(t):
        if t.what == "partial":
            return partials[(t.side, t.shard)]
        return travelling(t.side, t.shard)

    def travelling(side, shard):
        return sides[side].travelling if shard == rank else data[(side, shard)]

    def results(side, shard):
        """Where a visit's results for ``side`` of ``shard`` go: this rank's own, or the partial."""
        key = (side, shard)
        if key not in returned:   # this rank's own, or a side that is not returned (the forward's keys)
            assert shard == rank or not sides[side].results, f"results for {key} would go nowhere"
            return sides[side].results
        if key not in partials:
            partials[key] = pool.take("partial", side)
            for a, fill in zip(partials[key], sides[side].fills):
                a.fill(fill)
        return partials[key]

    for index, step in enumerate(steps):
        groups = {}   # due step -> (sends, recvs, [(direction, transfer)])
        for direction, transfers in (("out", step.sends), ("in", step.recvs)):
            for t in transfers:
                sends, recvs, done = groups.setdefault(index if t.due is None else t.due, ([], [], []))
                if direction == "out":
                    sends.append((t.peer, payload(t)))
                else:
                    key = (t.what, t.side, t.shard, t.peer)
                    assert key not in arriving, f"{key} received twice at once"
                    arriving[key] = pool.take("data" if t.what == "data" else "partial", t.side)
                    recvs.append((t.peer, arriving[key]))
                done.append((direction, t))
        for due in sorted(groups):
            sends, recvs, done = groups[due]
            lane = transport if due == index else far
            waiting.setdefault(due, []).append((lane.exchange(sends, recvs), done))
        for visit in step.visits:
            q_out, k_out = results("q", visit.q_shard), results("kv", visit.kv_shard)
            if not skip_compute:
                compute(visit, travelling("q", visit.q_shard), travelling("kv", visit.kv_shard), q_out, k_out)
        done = []
        for handle, transfers in waiting.pop(index, ()):
            handle.wait()
            done += transfers
        for direction, t in sorted(done, key=lambda d: d[0] == "in"):   # sends first: their buffers are free
            key = (t.side, t.shard)
            if direction == "out":
                if t.what == "partial":
                    pool.give("partial", t.side, partials.pop(key))
                continue
            part = arriving.pop((t.what, t.side, t.shard, t.peer))
            if t.what == "data":             # held for this rank's visits and sends
                data[key] = part
            elif t.shard != rank and key not in partials:   # a relay: the arriving partial is kept
                partials[key] = part
            else:                            # folded into this rank's results, or its partial of that shard
                sides[t.side].combine(sides[t.side].results if t.shard == rank else partials[key], part)
                pool.give("partial", t.side, part)
        for _, side, shard in ends.get(index, ()):   # received shards whose last use was this step
            pool.give("data", side, data.pop((side, shard)))
        if on_step is not None:
            on_step(index + 1, len(steps))
    assert not waiting and not arriving, "transfers left in flight after the last step"
