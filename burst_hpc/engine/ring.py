"""The ring engine: one step loop for the forward pass and both backward passes, for every
layout and schedule (schedule.steps says what to compute and what to send to whom).

Step t

1. posts its nonblocking exchanges (the step's (peer, buffers) sends and receives, one exchange
   per due step): on a plain ring the data the visit of step t+1 needs goes into a spare buffer
   (double buffering) while the partial finished at step t-1 goes on; a double ring also posts
   one transfer over the network that completes at the end of the inner round (its ``due``), and
   the balanced schedule across nodes its transfers between nodes steps before they are due;
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
    travelling_axes: tuple = None   # the token axis of each travelling array (None: 1 for all)
    results_axes: tuple = None      # the token axis of each result array (None: 1 for all)

    def axes(self, which):
        return getattr(self, which + "_axes") or (1,) * len(getattr(self, which))

    def cut(self, which, rows):
        """Views of rows (lo, hi) of the ``which`` ("travelling" or "results") arrays (all: None)."""
        arrays = getattr(self, which)
        if rows is None:
            return arrays
        return [a[(slice(None),) * axis + (slice(*rows),)] for a, axis in zip(arrays, self.axes(which))]

    def packed(self, xp, rows):
        """Contiguous copies of the travelling arrays' ``rows`` (row_runs), the runs one after another."""
        parts = [self.cut("travelling", run) for run in row_runs(rows)]
        if len(parts) == 1:
            return [xp.ascontiguousarray(a) for a in parts[0]]
        return [xp.concatenate(runs, axis=axis) for runs, axis in zip(zip(*parts), self.axes("travelling"))]

    def blank(self, xp, which, rows):
        """New arrays like the ``which`` arrays, of ``rows``' count of tokens (None: all)."""
        count = size_class(rows)
        return [xp.empty(a.shape if count is None else a.shape[:axis] + (count,) + a.shape[axis + 1:], a.dtype)
                for a, axis in zip(getattr(self, which), self.axes(which))]

    def fold(self, rows, part):
        """Combine ``part`` (a partial of this rank's own shard, holding ``rows`` one run after
        another; None: every row) into the results."""
        if rows is None:
            return self.combine(self.results, part)
        offset = 0
        for lo, hi in row_runs(rows):
            piece = [a[(slice(None),) * axis + (slice(offset, offset + hi - lo),)]
                     for a, axis in zip(part, self.axes("results"))]
            self.combine(self.cut("results", (lo, hi)), piece)
            offset += hi - lo


def row_runs(rows):
    """A transfer's ``rows`` as (lo, hi) runs: one run (lo, hi), or already several ((lo, hi), ...)."""
    return tuple(rows) if isinstance(rows[0], tuple) else (tuple(rows),)


def size_class(rows):
    """Buffers of one kind and side are reused among those of the same rows (None: a whole shard)."""
    return None if rows is None else sum(hi - lo for lo, hi in row_runs(rows))


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
    step's end sends complete before receives. Buffers of a side are reused only among those of
    the same size (``size_class``), and ``peak`` counts them so: the pool's allocations."""
    def due(t, index):
        return index if t.due is None else t.due

    ends, live = {}, []                 # live: (kind, side, first step, last step) of every buffer
    completing = {}                     # step -> completions
    returned = {(t.side, t.shard): t.rows for step in steps for t in step.sends if t.what == "partial"}
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
            live.append(((t.what, t.side, size_class(t.rows)), index, end))
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
                live.append((("partial", t.side, size_class(returned[key])), held.pop(key), index))
            elif t.shard != rank and key not in held:
                held[key] = index + 1   # the arriving buffer, counted as such until now, is kept
                returned.setdefault(key, t.rows)
    assert not held, f"partials made and never sent: {sorted(held)}"
    classes = {c for c, _, _ in live}
    most = {c: max(sum(1 for k, a, b in live if k == c and a <= i <= b) for i in range(len(steps))) for c in classes}
    peak = {kind: sum(n for c, n in most.items() if c[0] == kind) for kind in ("data", "partial")}
    return {step: tuple(keys) for step, keys in ends.items()}, returned, peak


class _Pool:
    """Buffers like a side's travelling arrays ("data") or results ("partial"), reused once given back."""

    def __init__(self, xp, sides):
        self.xp, self.sides, self.free = xp, sides, {}

    def take(self, kind, side, rows=None):
        spare = self.free.get((kind, side, size_class(rows)))
        if spare:
            return spare.pop()
        return self.sides[side].blank(self.xp, "travelling" if kind == "data" else "results", rows)

    def give(self, kind, side, arrays, rows=None):
        self.free.setdefault((kind, side, size_class(rows)), []).append(arrays)


class Route:
    """Rank ``rank``'s way through ``steps``, worked out once (a plan keeps it for every pass it runs):
    the buffers' lifetimes (``lifetimes``), each step's transfers grouped into the exchanges the engine
    posts and those that complete at its end (:meth:`lanes`)."""

    def __init__(self, steps, rank):
        self.steps, self.rank = steps, rank
        self.ends, self.returned, _ = lifetimes(steps, rank)
        self._lanes = {}

    def lanes(self, inner):
        """(exchanges, completions), each a tuple over steps. exchanges: ((due step, lane), ((direction
        'out' or 'in', Transfer), ...)) in posting order, one exchange each; lane 0 the ring transport
        (due at the step), 1 the far one, 2 the inner one (only when there is an ``inner`` transport:
        else its transfers go on the far lane). completions: the (direction, Transfer) due at the step's
        end, sends first (their buffers are free then), else in posting order."""
        if inner not in self._lanes:
            exchanges = tuple(self._grouped(index, step, inner) for index, step in enumerate(self.steps))
            completing = [[] for _ in self.steps]
            for groups in exchanges:
                for (due, _), transfers in groups:
                    completing[due] += transfers
            self._lanes[inner] = exchanges, tuple(tuple(sorted(c, key=lambda d: d[0] == "in")) for c in completing)
        return self._lanes[inner]

    @staticmethod
    def _grouped(index, step, inner):
        groups = {}
        for direction, transfers in (("out", step.sends), ("in", step.recvs)):
            for t in transfers:
                due = index if t.due is None else t.due
                lane = 0 if due == index else 2 if t.inner and inner else 1
                groups.setdefault((due, lane), []).append((direction, t))
        return tuple((key, tuple(group)) for key, group in sorted(groups.items()))


def run(transport, far, route, sides, compute, skip_compute=False, on_step=None, inner=None):
    """Run this rank's steps (schedule.Step) by their ``route`` (Route). ``sides``: {"kv": Side, "q": Side};
    ``compute(visit, q_data, kv_data, q_out, k_out, offset)`` adds the visit's block pairs into the
    query-side and key-side results ``q_out``, ``k_out`` (this rank's own results, or the partial
    of another rank's shard); ``q_data`` and ``q_out`` hold the query shard's rows from ``offset``
    on (a transfer of some rows only: Transfer.rows). ``on_step(done, total)``, if given, is called after each step
    (progress reports).

    A transfer completes at the end of its ``due`` step (the posting step when None): a plain
    ring's all do; a double ring's transfers over the network run under a whole inner round, on
    the ``far`` transport (the same as ``transport`` where nothing is due later); the balanced
    schedule's transfers inside a node due steps later (Transfer.inner) on the ``inner`` transport
    (None: ``far``), so they never queue behind (NCCL) the network's."""
    rank, steps, ends, returned = route.rank, route.steps, route.ends, route.returned
    assert rank == transport.rank, "the route of another rank"
    exchanges, completions = route.lanes(inner is not None)
    pool = _Pool(transport.xp, sides)
    data, partials, arriving = {}, {}, {}   # (side, shard) -> arrays; (what, side, shard, peer) -> arrays
    data_rows = {}                          # (side, shard) -> the rows of it received (None: all)
    waiting = {}                            # step -> [(handle, the sends it holds)]

    def payload(t):
        if t.what == "partial":
            return partials[(t.side, t.shard)]
        if t.rows is None:
            return travelling(t.side, t.shard)
        assert t.shard == rank, "only a shard's owner sends some of its rows"
        return sides[t.side].packed(transport.xp, t.rows)

    def travelling(side, shard):
        return sides[side].travelling if shard == rank else data[(side, shard)]

    def results(side, shard):
        """Where a visit's results for ``side`` of ``shard`` go: this rank's own, or the partial."""
        key = (side, shard)
        if key not in returned:   # this rank's own, or a side that is not returned (the forward's keys)
            assert shard == rank or not sides[side].results, f"results for {key} would go nowhere"
            return sides[side].results
        if key not in partials:
            partials[key] = pool.take("partial", side, returned[key])
            for a, fill in zip(partials[key], sides[side].fills):
                a.fill(fill)
        return partials[key]

    for index, step in enumerate(steps):
        for (due, lane), transfers in exchanges[index]:
            sends, recvs = [], []
            for direction, t in transfers:
                if direction == "out":
                    sends.append((t.peer, payload(t)))
                else:
                    key = (t.what, t.side, t.shard, t.peer)
                    assert key not in arriving, f"{key} received twice at once"
                    arriving[key] = pool.take(t.what, t.side, t.rows)
                    recvs.append((t.peer, arriving[key]))
            # the sends stay referenced until they complete: a row cut is a copy made for the send
            waiting.setdefault(due, []).append(((transport, far, inner)[lane].exchange(sends, recvs), sends))
        for visit in step.visits:
            q_out, k_out = results("q", visit.q_shard), results("kv", visit.kv_shard)
            rows = None if visit.q_shard == rank else data_rows[("q", visit.q_shard)]
            assert q_out is sides["q"].results or returned.get(("q", visit.q_shard)) == rows, "query rows disagree"
            assert visit.kv_shard == rank or data_rows[("kv", visit.kv_shard)] == visit.keys, "key rows disagree"
            if not skip_compute:
                compute(visit, travelling("q", visit.q_shard), travelling("kv", visit.kv_shard), q_out, k_out,
                        0 if rows is None else rows[0])
        for handle, _ in waiting.pop(index, ()):
            handle.wait()
        for direction, t in completions[index]:
            key = (t.side, t.shard)
            if direction == "out":
                if t.what == "partial":
                    pool.give("partial", t.side, partials.pop(key), t.rows)
                continue
            part = arriving.pop((t.what, t.side, t.shard, t.peer))
            if t.what == "data":             # held for this rank's visits and sends
                data[key], data_rows[key] = part, t.rows
            elif t.shard != rank and key not in partials:   # a relay: the arriving partial is kept
                partials[key] = part
            else:                            # folded into this rank's results, or its partial of that shard
                if t.shard == rank:
                    sides[t.side].fold(t.rows, part)
                else:
                    sides[t.side].combine(partials[key], part)
                pool.give("partial", t.side, part, t.rows)
        for _, side, shard in ends.get(index, ()):   # received shards whose last use was this step
            pool.give("data", side, data.pop((side, shard)), data_rows.pop((side, shard)))
        if on_step is not None:
            on_step(index + 1, len(steps))
    assert not waiting and not arriving, "transfers left in flight after the last step"
