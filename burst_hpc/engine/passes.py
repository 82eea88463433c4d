"""The forward and backward passes of a call over the ring engine (ring.py), one object per way a
scheme moves the data: ``RingPasses`` runs the scheme's ring on this rank's shards (flat ring, double
ring, balanced schedule: the schedule says what runs where); ``UlyssesPasses`` wraps the ring in
all-to-alls over heads inside the node (ulysses.py). ``for_plan`` picks one from the plan's scheme.

Each pass takes the modes the benchmark hook needs: ``skip_compute`` (exchanges alone), ``transport``
and ``far`` (counting or no-exchange transports in place of the plan's), ``on_step`` (a callback after
each ring step), and those of the run job: ``meter`` (progress.PassMeter: the work done, pair by pair),
``clock`` (a :class:`ComputeClock`: the time in the block kernels) and ``rehearse`` (the set-up of the
pass, below).

A rehearsal runs the pass as it will run, every exchange and every combine, but each distinct kind
of block pair (mask or not, query rows, keys up to REHEARSAL_KEYS) once, on its first
REHEARSAL_KEYS keys, and no other pair: whatever the pass makes on first use is made then, out of
the timed pass (the kernels it launches loaded, the communicators created and connected to every
peer, the memory pool grown to the pass's buffers), for a small share of its work. Its results are
meaningless."""
import time
from contextlib import contextmanager
from dataclasses import replace

import numpy as np

from .. import config
from . import ulysses
from .merge import merge_into
from .ring import Route, Side, row_runs, run
from ..plan.schedule import held_pieces, packed_kind, packs_visits, visit_pairs
from ..plan.schemes import ulysses_heads

REHEARSAL_KEYS = 256
# the NumPy backend's block pairs are cut into about this many row parts for the progress meter (its
# arithmetic is the same: it works one tile of query rows at a time); the GPU's are queued whole
PROGRESS_PARTS = 64


class RingPasses:
    """The passes over the scheme's ring, on this rank's shards."""

    def __init__(self, plan):
        self.plan = plan
        d = plan.decomposition
        # the kind of mask the block calls get (CallPlan prepares its kernels): the call's, or where each visit is
        # one call, a Packed mask of its held keys (the interval kernels)
        self.mask = packed_kind(d.mask) if packs_visits(d.scheme.name, d.mask) else d.mask
        self.programs = {}   # (near, returns) -> its _Program, made on the plan's first pass

    def program(self, near, returns):
        """The _Program of the schedule of ``near`` and ``returns`` (Decomposition.steps), made once."""
        if (near, returns) not in self.programs:
            self.programs[(near, returns)] = _Program(self.plan, near, returns)
        return self.programs[(near, returns)]

    def forward(self, q, k, v, skip_compute=False, transport=None, far=None, on_step=None, meter=None,
                rehearse=False, inner=None, clock=None):
        """(o, lse) of this rank's queries."""
        plan, d = self.plan, self.plan.decomposition
        xp, be = plan.xp, plan.backend
        o = xp.zeros(q.shape, plan.acc)
        lse = xp.full((q.shape[0], q.shape[2], q.shape[1]), -xp.inf, plan.acc)
        sides = {"kv": Side(_contiguous(xp, k, v), []),
                 "q": Side(_contiguous(xp, q), [o, lse], (0, -xp.inf), lambda into, part: merge_into(*into, *part),
                           results_axes=(1, 2))}

        program = self.program("kv", ("q",))
        # the last pair of a row writes the output in q's dtype (nothing to convert where it is the accumulator's)
        enabled = config.ring_last_pairs() and not (rehearse or skip_compute or q.dtype == plan.acc)
        final = program.finals("q", q.shape[1], enabled)
        out = _Output(xp, q)

        def pair(p, q_side, kv, q_out, _k_out, last):
            be.forward_block(q_side[0][:, p.q], kv[0][:, p.k], kv[1][:, p.k], q_out[0][:, p.q], q_out[1][:, :, p.q],
                             scale=d.scale, masked=p.masked, mask=d.mask if p.mask is None else p.mask,
                             q_start=p.q_start, k_start=p.k_start, out=out.rows(p.q) if last["q"] else None)

        with _metered(meter, plan, program):
            near, far, inner = lanes(plan, transport, far, inner)
            run(near, far, program.route, sides, _visits(plan, program, pair, meter, rehearse, {"q": final}, clock),
                skip_compute=skip_compute,
                on_step=on_step, inner=inner)
        if q.dtype == plan.acc:
            return o, lse.astype(xp.float32, copy=False)
        final.convert_rest(out.array(), o)
        return out.array(), lse.astype(xp.float32, copy=False)

    def backward(self, ring, do, q, k, v, o, lse, skip_compute=False, transport=None, far=None, delta=None,
                 cast=True, on_step=None, meter=None, rehearse=False, inner=None, clock=None):
        """(dq, dk, dv) of this rank's shards by the ``ring`` ('q' or 'kv') backward; ``delta``
        (rowsum(do * o)) when already known, then ``o`` is not read; ``cast`` False keeps float32."""
        plan, d = self.plan, self.plan.decomposition
        xp, be, acc = plan.xp, plan.backend, plan.acc
        delta = be.delta(do, o) if delta is None else delta
        dq, dk, dv = xp.zeros(q.shape, acc), xp.zeros(k.shape, acc), xp.zeros(v.shape, acc)
        sides = {"kv": Side(_contiguous(xp, k, v), [dk, dv], (0, 0), _add),
                 "q": Side(_contiguous(xp, q, do, lse.astype(xp.float32, copy=False), delta), [dq], (0,), _add,
                           travelling_axes=(1, 1, 2, 2))}

        program = self.program(ring, ("kv", "q"))
        # the last pair of a row writes its gradient in the input's dtype (unless float32 is kept, or is the dtype)
        convert = cast and q.dtype != acc
        enabled = config.ring_last_pairs() and convert and not (rehearse or skip_compute)
        finals = {side: program.finals(side, x.shape[1], enabled) for side, x in (("q", q), ("kv", k))}
        outs = [_Output(xp, x) for x in (q, k, v)]

        def pair(p, q_side, kv, q_out, k_out, last):
            q_, do_, lse_, delta_ = q_side
            be.backward_block(q_[:, p.q], kv[0][:, p.k], kv[1][:, p.k], do_[:, p.q], lse_[:, :, p.q], delta_[:, :, p.q],
                              q_out[0][:, p.q], k_out[0][:, p.k], k_out[1][:, p.k], scale=d.scale,
                              masked=p.masked, mask=d.mask if p.mask is None else p.mask, q_start=p.q_start,
                              k_start=p.k_start,
                              dq_out=outs[0].rows(p.q) if last["q"] else None,
                              dk_out=outs[1].rows(p.k) if last["kv"] else None,
                              dv_out=outs[2].rows(p.k) if last["kv"] else None)

        with _metered(meter, plan, program):
            near, far, inner = lanes(plan, transport, far, inner)
            run(near, far, program.route, sides, _visits(plan, program, pair, meter, rehearse, finals, clock),
                skip_compute=skip_compute, on_step=on_step, inner=inner)
        if not convert:
            return dq, dk, dv
        for out, grad, side in zip(outs, (dq, dk, dv), ("q", "kv", "kv")):
            finals[side].convert_rest(out.array(), grad)
        return tuple(out.array() for out in outs)


class UlyssesPasses(RingPasses):
    """All-to-all over heads inside the node, the ring over the rails, all-to-all back."""

    def __init__(self, plan):
        super().__init__(plan)
        d = plan.decomposition
        self.ranges = ulysses_heads(d.heads, d.kv_heads, d.topo.per_node)

    def forward(self, q, k, v, **mode):
        plan, ranges = self.plan, self.ranges
        node, local = plan.decomposition.node_transport(plan.xp), plan.decomposition.topo.local
        qn, kn, vn = ulysses.to_node(node, ranges, local, [(q, 0, 1, 2), (k, 1, 1, 2), (v, 1, 1, 2)])
        o_n, lse_n = super().forward(qn, kn, vn, **mode)
        o, lse = plan.xp.zeros(q.shape, o_n.dtype), plan.xp.zeros((q.shape[0], plan.decomposition.heads, q.shape[1]),
                                                                   lse_n.dtype)
        ulysses.from_node(node, ranges, local, [(o_n, o, 0, 1, 2), (lse_n, lse, 0, 2, 1)])
        return o, lse

    def backward(self, ring, do, q, k, v, o, lse, **mode):
        """delta here, then as the forward: all-to-all in, the ring over the rails, all-to-all back
        (the gradients of a K/V head shared by several ranks summed in float32)."""
        plan, ranges = self.plan, self.ranges
        node, local, xp = plan.decomposition.node_transport(plan.xp), plan.decomposition.topo.local, plan.xp
        delta = plan.backend.delta(do, o)
        arrays = [(q, 0, 1, 2), (k, 1, 1, 2), (v, 1, 1, 2), (do, 0, 1, 2), (lse, 0, 2, 1), (delta, 0, 2, 1)]
        qn, kn, vn, don, lsen, deltan = ulysses.to_node(node, ranges, local, arrays)
        grads = super().backward(ring, don, qn, kn, vn, None, lsen, delta=deltan, cast=False, **mode)
        dq, dk, dv = (xp.zeros(x.shape, plan.acc) for x in (q, k, v))
        ulysses.from_node(node, ranges, local, [(grads[0], dq, 0, 1, 2), (grads[1], dk, 1, 1, 2),
                                                (grads[2], dv, 1, 1, 2)])
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def for_plan(plan):
    """The passes of the plan's scheme."""
    return UlyssesPasses(plan) if plan.decomposition.scheme.name == "ulysses_ring" else RingPasses(plan)


def lanes(plan, transport, far, inner=None):
    """(near, far, inner) transports: the decomposition's, or the caller's (``far`` defaults to
    ``transport``, ``inner`` to ``far``)."""
    if transport is None:
        return plan.decomposition.transports(plan.xp)
    return transport, transport if far is None else far, inner


def _contiguous(xp, *arrays):
    return [xp.ascontiguousarray(a) for a in arrays]


def _add(into, part):
    for a, b in zip(into, part):
        a += b


def _pairs(plan, visit):
    """The block pairs of a visit: its query rows against its keys (rows local to the query shard)."""
    d = plan.decomposition
    return visit_pairs(d.pieces(visit.q_shard), held_pieces(d.pieces(visit.kv_shard), visit.keys), d.mask,
                       visit.rows, packed=packs_visits(d.scheme.name, d.mask))


class _Program:
    """What the passes of a plan read of one schedule (Decomposition.steps of ``near`` and ``returns``),
    worked out on its first pass and kept with the plan, so that a repeated call (a training loop's)
    decides nothing again: the steps, this rank's route through them (ring.Route), the block pairs of
    every visit in the engine's order (visit call number i: the i-th visit of the steps), and which
    pairs finish rows (_Finals)."""

    def __init__(self, plan, near, returns):
        self.steps = plan.decomposition.steps(near, returns)
        self.route = Route(self.steps, plan.decomposition.scheme.comm.rank)
        self.pairs = tuple(_pairs(plan, visit) for step in self.steps for visit in step.visits)
        self._moved, self._finals = {}, {}

    def visit_pairs(self, call, offset):
        """The block pairs of visit call ``call``, their query rows local to a buffer holding the shard's
        rows from ``offset`` on (a transfer of some rows only)."""
        if not offset:
            return self.pairs[call]
        if (call, offset) not in self._moved:
            self._moved[(call, offset)] = tuple(replace(p, q=slice(p.q.start - offset, p.q.stop - offset))
                                                for p in self.pairs[call])
        return self._moved[(call, offset)]

    def finals(self, side, n_rows, enabled):
        """The _Finals of ``side`` for a shard of ``n_rows`` rows (``enabled``: as _Finals takes it)."""
        key = (side, n_rows, enabled)
        if key not in self._finals:
            self._finals[key] = _Finals(self, side, n_rows, enabled)
        return self._finals[key]


@contextmanager
def _metered(meter, plan, program):
    """The pass inside ``meter``'s begin (with this rank's work over ``program``'s pairs) and end."""
    if meter is None:
        yield
        return
    mask = plan.decomposition.mask
    meter.begin(sum(p.visible(mask) for pairs in program.pairs for p in pairs))
    try:
        yield
    finally:
        meter.end()


class ComputeClock:
    """The seconds one pass spends in its block kernels on this rank, the engine's compute (not its
    waits for transfers, its merges of partials nor its bookkeeping): on NumPy the host's time in
    them; on the GPU the time between CUDA events recorded around them on the current stream
    (queued work: read by :meth:`seconds` once the pass is over)."""

    def __init__(self, xp):
        self.xp, self.host, self.events = xp, 0.0, []

    @contextmanager
    def __call__(self):
        if self.xp is np:
            began = time.perf_counter()
            yield
            self.host += time.perf_counter() - began
            return
        stream = self.xp.cuda.get_current_stream()
        began = stream.record()
        yield
        self.events.append((began, stream.record()))

    def seconds(self):
        """The seconds so far (waits for the GPU's events)."""
        for began, ended in self.events:
            ended.synchronize()
            self.host += self.xp.cuda.get_elapsed_time(began, ended) / 1e3
        self.events = []
        return self.host


def _visits(plan, program, pair, meter=None, rehearse=False, finals=None, clock=None):
    """The engine's compute: every block pair of the visit's query rows against its keys (``program``:
    the _Program of the pass's schedule).
    ``pair(p, q_side, kv, q_out, k_out, last)`` runs one block pair, ``last`` {side: whether it is the last to
    write its rows of this rank's own results on that side} (``finals``: {side: _Finals}); ``meter`` is told
    the work of each; ``rehearse``: the rehearsal's pairs only (the module's docstring); ``clock`` (a
    ComputeClock) times the visits."""
    rehearsed = set()
    numpy = meter is not None and plan.backend.name == "numpy"
    parts, tile = (PROGRESS_PARTS, plan.backend.block_q) if numpy else (1, None)
    finals = finals or {}
    calls = iter(range(1 << 62))

    def compute(visit, q_data, kv_data, q_out, k_out, offset):
        if clock is None:
            return visit_pairs(visit, q_data, kv_data, q_out, k_out, offset)
        with clock():
            return visit_pairs(visit, q_data, kv_data, q_out, k_out, offset)

    def visit_pairs(visit, q_data, kv_data, q_out, k_out, offset):
        call = next(calls)
        # q_data and q_out hold the rows from ``offset`` on
        for index, p in enumerate(program.visit_pairs(call, offset)):
            last = {side: final.last(call, index) for side, final in finals.items()}
            if rehearse:
                kind = (p.masked, p.q.stop - p.q.start, min(p.k.stop - p.k.start, REHEARSAL_KEYS))
                if kind in rehearsed:
                    continue
                rehearsed.add(kind)
                p = p.first_keys(REHEARSAL_KEYS)
            cut = _row_parts(p, parts, tile)
            for i, part in enumerate(cut):
                # each part holds its own query rows but all the pair's keys: only the last finishes those
                pair(part, q_data, kv_data, q_out, k_out, last if i == len(cut) - 1 else dict(last, kv=False))
                if meter is not None:
                    meter.done(part.visible(plan.decomposition.mask))

    return compute


def _row_parts(p, parts, tile):
    """``p`` cut into at most ``parts`` pairs of whole ``tile``s of query rows, in order."""
    rows = p.q.stop - p.q.start
    if parts == 1 or rows <= tile:
        return (p,)
    step = tile * -(-rows // (parts * tile))
    return tuple(p.rows(lo, min(rows, lo + step)) for lo in range(0, rows, step))


class _Output:
    """A pass's output like ``like`` (its shape and dtype), made when first written: at the last pair of some
    rows, or at the end, so it does not add to the ring's peak before."""

    def __init__(self, xp, like):
        self.xp, self.like, self._array = xp, like, None

    def array(self):
        if self._array is None:
            self._array = self.xp.empty(self.like.shape, self.like.dtype)
        return self._array

    def rows(self, rows):
        return self.array()[:, rows]


class _Finals:
    """Which block pairs of a pass are the last to write rows of this rank's own results on one ``side`` ('q':
    o, lse or dq; 'kv': dk, dv), read off the schedule: replaying ``steps`` in the engine's order (each step's
    visits, pair by pair, then the partials of this rank's own shard combined at its end), the last write of
    every row. A pair is the last (the block contract's ``out``) when it is the last write of all its rows;
    rows last written by a combine (the balanced schedule's partials coming home), or by a pair that another
    overwrites in part, are converted at the end (``convert_rest``). ``enabled`` False (the default,
    BURST_HPC_RING_LAST_PAIRS: not yet run on GPUs; the outputs then exist beside the ring's last buffers, a
    shard of them more at the peak): no pair is the last, every row is converted at the end."""

    def __init__(self, program, side, n_rows, enabled=True):
        self.finals = set()
        self.rest = np.ones(n_rows, bool)
        if not enabled:
            return
        steps, rank = program.steps, program.route.rank
        combines = {}   # step -> the rows of this rank's own partials folded in at its end (None: all)
        for index, step in enumerate(steps):
            for t in step.recvs:
                if t.what == "partial" and t.side == side and t.shard == rank:
                    combines.setdefault(index if t.due is None else t.due, []).append(t.rows)
        last = np.full(n_rows, -1)   # the event that writes each row last
        pairs = []                   # event -> (visit call, pair index, rows) of a pair, None for a combine
        call = 0
        for index, step in enumerate(steps):
            for visit in step.visits:
                if (visit.q_shard if side == "q" else visit.kv_shard) == rank:
                    for i, p in enumerate(program.pairs[call]):
                        rows = p.q if side == "q" else p.k
                        last[rows] = len(pairs)
                        pairs.append((call, i, rows.stop - rows.start))
                call += 1
            for rows in combines.get(index, ()):
                for rows_run in row_runs(rows) if rows else ((0, n_rows),):
                    last[slice(*rows_run)] = len(pairs)
                pairs.append(None)
        counts = np.bincount(last[last >= 0], minlength=len(pairs))
        for event, where in enumerate(pairs):
            if where is not None and where[2] > 0 and counts[event] == where[2]:
                self.finals.add(where[:2])
                self.rest[last == event] = False

    def last(self, call, index):
        """Whether pair ``index`` of the engine's visit call number ``call`` is the last for its rows."""
        return (call, index) in self.finals

    def convert_rest(self, out, acc):
        """The rows no pair finished: ``out[rows] = acc[rows]`` over runs of rows (token axis 1)."""
        edges = np.flatnonzero(np.diff(np.concatenate(([0], self.rest.astype(np.int8), [0]))))
        for lo, hi in zip(edges[::2], edges[1::2]):
            out[:, lo:hi] = acc[:, lo:hi]
