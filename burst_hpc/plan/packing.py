"""The gather scheme in one launch a pass (packed keys): what a rank holds and sends when it runs its
queries against every key they see at once instead of pair by pair over steps.

Each rank's keys and values, and the runs of other ranks' keys its queries see (gather.sight: the same
runs the stepped gather sends), are laid end to end in one buffer in global order. Every query row sees
one interval of global keys (masks.py) and every key of it is in the buffer, so in the buffer's order it
still sees one interval: the kernels' interval masks run unchanged on buffer positions, and one block
call covers all of a rank's queries. Each row is computed once: no float32 partial, no merge, the
output written in the input's dtype by that call; in the backward the dK/dV of the other ranks' runs go
home once, added there into the owner's own.

The forward runs first, while the keys travel, the runs of query rows that see only the rank's own keys
(``early``: local documents, the first rows of a document that starts here); the rest of its rows, and the
backward, wait for every run (the backward's rows as calls of their own measured 0.75-0.8x on 2 x H200 run under
the keys' exchange, 0.93-0.94x run last under the way home of dK/dV: split calls cost the host, and their
kernels, more than the waits they hide): on one node a run crosses NVLink in a fraction of what the many small
pair launches of the stepped gather cost; between nodes the stepped gather hides the transfers under the rank's
own work (gather.py)."""
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache

import numpy as np

from . import gather

# the forward's early runs (Packing.early): runs of query rows that see only own keys, each with at least
# EARLY_SHARE of the rank's visible pairs, at most EARLY_RUNS of them (the heaviest): each is a block call of its
# own, and so is each stretch of rows between them
EARLY_SHARE = 0.05
EARLY_RUNS = 3


@dataclass(frozen=True, eq=False)
class Packing:
    """Rank ``rank``'s packed keys. ``keys``: buffer length; ``own``: the buffer slot of each of the rank's
    local rows (int64, local order); ``receives``: (sender, slots) per rank whose keys arrive, the slots of
    the rows it sends, in the order it sends them; ``sends``: (receiver, local rows) per rank that sees
    some of this rank's keys, the rows in local order; ``receive_cuts``, ``send_cuts``: for each of those, where
    the rows or their global positions stop following each other (offsets into the rows, from 0 to their
    count): between two cuts the rows are consecutive on the sender and the slots on the receiver, and both
    sides cut alike, so a run can travel as one message from and into its place; ``lo``, ``hi``: each local
    query row's visible keys as buffer positions [lo, hi) (int32); ``start``: where no keys arrive and the
    rank's own rows are one run of the sequence (one rank; documents that do not cross ranks), that run's first
    global position: the buffer is then the rank's own keys as they are, in the call's mask from ``start``
    (else None); ``early``: (lo, hi) runs of local query rows, in order, every key of whose rows is the rank's
    own, which the forward computes while the other keys travel (none where nothing arrives)."""
    rank: int
    keys: int
    own: np.ndarray
    receives: tuple
    sends: tuple
    lo: np.ndarray
    hi: np.ndarray
    receive_cuts: tuple
    send_cuts: tuple
    start: int = None
    early: tuple = ()

    @cached_property
    def pairs(self):
        """int64 (rows + 1,): the visible pairs of the query rows before each row (prefix sums of hi - lo)."""
        return np.concatenate([[0], np.cumsum(self.hi - self.lo, dtype=np.int64)])

    def split(self, rows):
        """(early, late): the forward's block calls over the first ``rows`` query rows as (lo, hi) runs, those
        computed while the keys travel and those after, together every row once, each list in order."""
        early = tuple((lo, min(hi, rows)) for lo, hi in self.early if lo < rows)
        late, at = [], 0
        for lo, hi in early + ((rows, rows),):
            if lo > at:
                late.append((at, lo))
            at = hi
        return early, tuple(late)

    def call(self, mask, key):
        """The one block call's mask and positions (dict: masked, mask, q_start, k_start) over this buffer for the
        call's ``mask``: the packed bounds as a masks.Packed named ``key``, or with ``start`` the call's own mask
        from there. The engine runs it; the cost model prices it (workload.packed_tiles)."""
        from .masks import Packed

        if self.start is None:
            return dict(masked=True, mask=Packed(self.lo, self.hi, self.keys, key), q_start=0, k_start=0)
        return dict(masked=not mask.is_full, mask=mask, q_start=self.start, k_start=self.start)


def _cuts(positions, rows):
    """Offsets 0, ..., len(rows) where a message's ``rows`` (the sender's local rows, in message order) or their
    global ``positions`` stop being consecutive: both ends know both, so they cut alike."""
    stops = (np.diff(positions) != 1) | (np.diff(rows) != 1)
    return np.concatenate([[0], np.flatnonzero(stops) + 1, [len(rows)]]).astype(np.int64)


def _rows(runs):
    """int64 local rows of (lo, hi) runs, in order."""
    return np.concatenate([np.arange(lo, hi, dtype=np.int64) for lo, hi in runs] or [np.zeros(0, np.int64)])


@lru_cache(maxsize=64)
def packing(mask, layout, rank):
    """The Packing of ``rank`` (``mask``: a masks.Mask, plain causal too; ``layout``: a layout.Layout)."""
    seen = gather.sight(mask, layout)[1]
    size = layout.size
    own_global = layout.indices(rank)
    arriving = [(b, _rows(seen[rank][b])) for b in range(size) if b != rank and seen[rank][b]]
    places = np.concatenate([own_global] + [layout.indices(b)[rows] for b, rows in arriving])
    order = np.sort(places)
    lo_g, hi_g = (np.concatenate(parts) for parts in zip(*(mask.rows(start, n) for start, n in layout.pieces(rank))))
    lo, hi = np.searchsorted(order, lo_g), np.searchsorted(order, hi_g)
    if not np.array_equal(hi - lo, hi_g - lo_g):
        raise AssertionError("packed keys miss keys a query sees")   # gather.sight sends every seen unit
    receives = tuple((b, np.searchsorted(order, layout.indices(b)[rows])) for b, rows in arriving)
    sends = tuple((a, _rows(seen[a][rank])) for a in range(size) if a != rank and seen[a][rank])
    first = int(own_global[0]) if len(own_global) else 0
    alone = not arriving and np.array_equal(own_global, np.arange(first, first + len(own_global)))
    packed = Packing(rank, len(order), np.searchsorted(order, own_global), receives, sends, lo.astype(np.int32),
                     hi.astype(np.int32), tuple(_cuts(layout.indices(b)[rows], rows) for b, rows in arriving),
                     tuple(_cuts(own_global[rows], rows) for _, rows in sends), first if alone else None)
    return replace(packed, early=_early(packed)) if arriving else packed


def _early(packed):
    """Packing.early of ``packed``: the runs of its query rows whose keys [lo, hi) are all own slots, those of at
    least EARLY_SHARE of the visible pairs, the EARLY_RUNS heaviest, in order."""
    foreign = np.ones(packed.keys + 1, np.int64)
    foreign[packed.own] = 0
    foreign = np.concatenate([[0], np.cumsum(foreign[:-1])])
    local = np.concatenate([[False], foreign[packed.hi] == foreign[packed.lo], [False]])
    edges = np.flatnonzero(np.diff(local.astype(np.int8)))
    pairs = packed.pairs
    runs = [(int(pairs[b] - pairs[a]), (a, b)) for a, b in zip(edges[::2].tolist(), edges[1::2].tolist())]
    heavy = sorted(run for run in runs if run[0] > 0 and run[0] >= EARLY_SHARE * pairs[-1])[::-1]
    return tuple(sorted(run for _, run in heavy[:EARLY_RUNS]))
