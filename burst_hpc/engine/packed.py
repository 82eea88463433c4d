"""The gather scheme's passes on packed keys (plan/packing.py): the keys and values this rank's queries see,
its own and the runs other ranks send it, laid end to end in global order, and every query row run once against
them through its interval of buffer positions (masks.Packed). The forward runs the rows that see only own keys
(Packing.early) while the others travel, then the rest, each run a block call, and writes the output in the
input's dtype from them; the backward runs its rows in one block call after the exchange, adds dK/dV into
float32 over the buffer, sends each other rank's runs home and adds the ones that come back into its own.

The passes take the modes RingPasses takes (passes.py): ``skip_compute`` (the exchanges alone),
``transport`` (in place of the plan's), ``on_step`` (called once, after the single step), ``meter``,
``clock`` and ``rehearse`` (the launch over the first REHEARSAL_KEYS query rows only)."""
from contextlib import contextmanager, nullcontext

import numpy as np

from .passes import PROGRESS_PARTS, REHEARSAL_KEYS, lanes
from ..plan.packing import packing


# the most runs a peer's keys travel in as messages of their own: an NCCL group of thousands of sends and receives
# is slow to post and has hung (a user's small chunk can make hundreds of runs a peer; the placement's, 32 at most)
IN_PLACE_RUNS = 64


class PackedPasses:
    """The gather scheme's passes on packed keys: one exchange of keys a pass, the block calls around it."""

    def __init__(self, plan):
        d = plan.decomposition
        self.plan = plan
        self.packing = packing(d.mask, d.layout, d.rank)
        self.where = self.packing.call(d.mask, (d.mask.key, d.layout, d.rank))
        self.mask = self.where["mask"]   # what the block calls get
        self._index = {}

    def index(self, name, rows):
        """``rows`` (int64 NumPy) as an index array on the plan's device, made once."""
        if name not in self._index:
            self._index[name] = self.plan.xp.asarray(rows, dtype=np.int64)
        return self._index[name]

    def gather(self, arrays, transport, meanwhile=None, in_place=False, zeroed=False):
        """The packed buffers of ``arrays`` (this rank's K and V, contiguous): the runs other ranks' queries see
        posted first, own rows placed while they travel (and ``meanwhile(buffers)`` queued, work that needs no
        other rank's keys: it may read the own slots of the buffers; ``zeroed``: the others hold zeros until
        their keys land, so a kernel's tile that reaches past its rows' keys multiplies its weights 0 by finite
        values), then the runs this rank's queries see placed. ``in_place`` with one sequence in the batch: each run of
        consecutive rows to or from a peer with at most IN_PLACE_RUNS of them travels as its own message, from its
        place and into its place, nothing copied on either side (the forward: 4 x H200, 8k tokens a GPU,
        1.08-1.20x on uniform documents, 1.10-1.42x on MagiAttention's; the backward measured 0.96x on uniform
        ones so, and keeps one gathered message a peer). Both ends of a pair see the same runs, so they decide
        alike."""
        xp, p = self.plan.xp, self.packing
        single = in_place and arrays[0].shape[0] == 1

        def runs(cuts):
            return single and len(cuts) - 1 <= IN_PLACE_RUNS

        sends = [(a, self.messages(arrays, ("send", a), rows, cuts, runs(cuts)))
                 for (a, rows), cuts in zip(p.sends, p.send_cuts, strict=True)]
        if p.start is not None:   # nothing arrives: the buffer is the rank's own keys
            if sends:
                transport.exchange(sends, []).wait()
            return arrays
        packed = [(xp.zeros if zeroed else xp.empty)((x.shape[0], p.keys) + x.shape[2:], x.dtype) for x in arrays]
        staged = {b: [xp.empty((x.shape[0], len(slots)) + x.shape[2:], x.dtype) for x in arrays]
                  for (b, slots), cuts in zip(p.receives, p.receive_cuts, strict=True) if not runs(cuts)}
        recvs = [(b, self.places(staged.get(b, packed), slots, cuts, b not in staged))
                 for (b, slots), cuts in zip(p.receives, p.receive_cuts, strict=True)]
        pending = transport.exchange(sends, recvs) if sends or recvs else None
        try:
            for buf, x in zip(packed, arrays):
                self.put(buf, self.index("own", p.own), x)
            if meanwhile is not None:
                meanwhile(packed)
        finally:   # the posted receives complete before their buffers could be let go
            if pending is not None:
                pending.wait()
        for b, slots in p.receives:
            for buf, part in zip(packed, staged.get(b, ())):
                self.put(buf, self.index(("recv", b), slots), part)
        return packed

    def messages(self, arrays, name, rows, cuts, in_place):
        """The messages carrying ``rows`` of each of ``arrays``: a view a run (``cuts``) ``in_place``, else one
        gathered copy an array."""
        if in_place:
            return _run_views(arrays, rows, cuts)
        return [self.take(x, self.index(name, rows)) for x in arrays]

    @staticmethod
    def places(buffers, slots, cuts, in_place):
        """Where the messages of ``messages`` land: ``in_place`` each run's slots of each of ``buffers``, else the
        buffers themselves (one a message, placed after)."""
        if in_place:
            return _run_views(buffers, slots, cuts)
        return list(buffers)

    def take(self, x, at):
        """x[:, at]: rows ``at`` (an index array on the device) of a contiguous (B, S, ...) array, a new array."""
        out = self.plan.xp.empty((x.shape[0], len(at)) + x.shape[2:], x.dtype)
        self.plan.backend.rows_copy(x, at, out, None)
        return out

    def put(self, buf, at, x):
        """buf[:, at] = x, rows of contiguous arrays."""
        self.plan.backend.rows_copy(x, None, buf, at)

    def home(self, grads, transport, dtypes):
        """This rank's own rows of the float32 buffers ``grads`` (dK, dV over the packed keys), with what the
        other ranks computed for them added in, each converted to its one of ``dtypes``; each other rank's runs
        sent home, gathered into one message a gradient (a run a message from its place measured 0.98-0.99x on
        4 x H200). Every sender's runs land in one buffer a gradient, and one pass a gradient (the backend's
        rows_sum) reads a row's own slot and its partials and writes it converted."""
        xp, p, be = self.plan.xp, self.packing, self.plan.backend
        if p.start is not None and not p.sends and all(g.dtype == d for g, d in zip(grads, dtypes)):
            return list(grads)   # the buffer is the rank's own keys and nothing comes home: they are its gradients
        batch, shape = grads[0].shape[0], grads[0].shape[2:]
        sends = [(b, [self.take(g, self.index(("recv", b), slots)) for g in grads]) for b, slots in p.receives]
        table, blocks = self.home_table(batch)
        parts = [xp.empty((batch * blocks[-1],) + shape, g.dtype) for g in grads]
        recvs = [(a, [x[batch * lo:batch * hi].reshape((batch, hi - lo) + shape) for x in parts])
                 for (a, _), lo, hi in zip(p.sends, blocks[:-1], blocks[1:])]
        pending = transport.exchange(sends, recvs) if sends or recvs else None
        outs = [xp.empty((batch, len(p.own)) + shape, dtype) for dtype in dtypes]
        if pending is not None:
            pending.wait()
        for g, part, out in zip(grads, parts, outs):
            be.rows_sum(g, *table, part, out)
        return outs

    def home_table(self, batch):
        """(own, ptr, at, step) of the backend's rows_sum over the partials of ``home`` for a batch of ``batch``,
        on the plan's device, and the offsets of each sender's block of rows in the partials buffer (one block a
        rank in ``packing.sends``, (batch, rows) each): made once per batch size."""
        if ("home", batch) not in self._index:
            p = self.packing
            blocks = np.cumsum([0] + [len(rows) for _, rows in p.sends])
            rows = np.concatenate([rows for _, rows in p.sends] or [np.zeros(0, np.int64)])
            at = np.concatenate([batch * lo + np.arange(hi - lo) for lo, hi in zip(blocks[:-1], blocks[1:])]
                                or [np.zeros(0, np.int64)]).astype(np.int64)
            step = np.repeat(np.diff(blocks), np.diff(blocks)).astype(np.int32)
            order = np.argsort(rows, kind="stable")
            ptr = np.zeros(len(p.own) + 1, np.int32)
            np.cumsum(np.bincount(rows, minlength=len(p.own)), out=ptr[1:])
            table = (self.index("own", p.own),) + tuple(self.plan.xp.asarray(x) for x in (ptr, at[order], step[order]))
            self._index[("home", batch)] = table, blocks
        return self._index[("home", batch)]

    def spans(self, runs, meter, rows):
        """The (lo, hi) query rows of each block call over ``runs`` ((lo, hi) each) of a pass over ``rows`` rows: a
        call a run, or on the NumPy backend under a meter calls of whole tiles, about PROGRESS_PARTS over the pass,
        so progress comes during it."""
        be, step = self.plan.backend, None
        if meter is not None and be.name == "numpy" and rows > be.block_q:
            step = be.block_q * -(-rows // (PROGRESS_PARTS * be.block_q))
        return [(a, min(hi, a + (step or hi - lo))) for lo, hi in runs
                for a in range(lo, hi, step or max(1, hi - lo))] or list(runs[:1])

    @contextmanager
    def metered(self, spans, meter):
        """Around a pass's block calls over ``spans``: ``meter`` told their visible pairs (begin, then end)."""
        if meter is not None:
            pairs = self.packing.pairs
            meter.begin(int(sum(pairs[b] - pairs[a] for a, b in spans)))
        try:
            yield
        finally:
            if meter is not None:
                meter.end()

    def timed(self, lo, hi, meter, clock, call):
        """``call()``, the block call of query rows lo..hi, timed by ``clock`` and its visible pairs told to
        ``meter`` after it."""
        with clock() if clock is not None else nullcontext():
            call()
        if meter is not None:
            meter.done(int(self.packing.pairs[hi] - self.packing.pairs[lo]))

    def at(self, lo):
        """The block call's mask arguments for the query rows from local row ``lo``."""
        return dict(self.where, q_start=self.where["q_start"] + lo)

    def forward(self, q, k, v, skip_compute=False, transport=None, far=None, on_step=None, meter=None,
                rehearse=False, inner=None, clock=None):
        """(o, lse) of this rank's queries."""
        plan, d = self.plan, self.plan.decomposition
        xp, be = plan.xp, plan.backend
        near = lanes(plan, transport, far, inner)[0]
        rows = min(q.shape[1], REHEARSAL_KEYS) if rehearse else q.shape[1]
        q = q[:, :rows]
        lse = xp.empty((q.shape[0], q.shape[2], rows), xp.float32 if q.dtype != plan.acc else plan.acc)
        if q.dtype == plan.acc:
            o, out = xp.empty(q.shape, plan.acc), None
        else:
            o, out = None, xp.empty(q.shape, q.dtype)
        arrays = [xp.ascontiguousarray(k), xp.ascontiguousarray(v)]
        if skip_compute:
            self.gather(arrays, near, in_place=True)
        else:
            early, late = (self.spans(runs, meter, rows) for runs in self.packing.split(rows))

            def run(spans, kp, vp):
                for a, b in spans:
                    self.timed(a, b, meter, clock, lambda: be.forward_block(
                        q[:, a:b], kp, vp, _rows(o, a, b), lse[:, :, a:b], scale=d.scale, first=True,
                        out=_rows(out, a, b), **self.at(a)))

            with self.metered(early + late, meter):
                kp, vp = self.gather(arrays, near, (lambda buffers: run(early, *buffers)) if early else None,
                                     in_place=True, zeroed=bool(early))
                run(late, kp, vp)
        if on_step is not None:
            on_step(1, 1)
        return (o if out is None else out), lse.astype(xp.float32, copy=False)

    def backward(self, ring, do, q, k, v, o, lse, skip_compute=False, transport=None, far=None, delta=None,
                 cast=True, on_step=None, meter=None, rehearse=False, inner=None, clock=None):
        """(dq, dk, dv) of this rank's shards (``ring`` is the gather's: dK/dV go home); ``delta`` (rowsum(do * o))
        when already known, then ``o`` is not read; ``cast`` False keeps float32."""
        plan, d = self.plan, self.plan.decomposition
        xp, be, acc = plan.xp, plan.backend, plan.acc
        near = lanes(plan, transport, far, inner)[0]
        rows = min(q.shape[1], REHEARSAL_KEYS) if rehearse else q.shape[1]
        q, do, lse = q[:, :rows], do[:, :rows], lse[:, :, :rows]
        o = None if o is None else o[:, :rows]
        delta = None if delta is None else delta[:, :, :rows]

        def meanwhile(_):   # where keys arrive, rowsum(do * o) runs while they travel, not after in the call
            nonlocal delta
            if delta is None and not skip_compute:
                delta = be.delta(do, o)

        kp, vp = self.gather([xp.ascontiguousarray(k), xp.ascontiguousarray(v)], near, meanwhile)
        convert = cast and q.dtype != acc
        dq = None if convert else xp.empty(q.shape, acc)
        dq_out = xp.empty(q.shape, q.dtype) if convert else None
        # keys no other rank sees, in the buffer as they are: their gradients written once, in the inputs' dtype
        alone = convert and self.packing.start is not None and not self.packing.sends and not skip_compute
        spans = self.spans([(0, rows)], meter, rows)
        one = alone and len(spans) == 1   # one call: no float32 dK, dV at all
        dkp, dvp = (None, None) if one else (xp.empty(x.shape, acc) for x in (kp, vp))
        dk_out, dv_out = (xp.empty(x.shape, x.dtype) for x in (k, v)) if alone else (None, None)
        if not skip_compute:
            with self.metered(spans, meter):
                for i, (a, b) in enumerate(spans):
                    first, last = i == 0, i == len(spans) - 1
                    self.timed(a, b, meter, clock, lambda: be.backward_block(
                        q[:, a:b], kp, vp, do[:, a:b], lse[:, :, a:b], _rows(delta, a, b, 2), _rows(dq, a, b), dkp,
                        dvp, scale=d.scale, o=None if delta is not None else o[:, a:b], first_q=True, first_kv=first,
                        dq_out=_rows(dq_out, a, b), dk_out=dk_out if last else None,
                        dv_out=dv_out if last else None, **self.at(a)))
        else:
            dkp.fill(0)
            dvp.fill(0)
        dtypes = (k.dtype, v.dtype) if convert else (acc, acc)
        dk, dv = (dk_out, dv_out) if alone else self.home([dkp, dvp], near, dtypes)
        if on_step is not None:
            on_step(1, 1)
        return (dq_out if convert else dq), dk, dv


def _run_views(arrays, at, cuts):
    """Each run between two of ``cuts`` of each of ``arrays``, from the run's first position in ``at``: views."""
    return [x[:, at[a]:at[a] + b - a] for x in arrays for a, b in zip(cuts[:-1], cuts[1:])]


def _rows(x, lo, hi, axis=1):
    """Rows lo..hi of ``x`` along ``axis`` (None stays None)."""
    return None if x is None else x[(slice(None),) * axis + (slice(lo, hi),)]
