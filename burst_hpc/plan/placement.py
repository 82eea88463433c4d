"""Placement by chunks: the ``chunks`` layout (MagiAttention's dispatch, our own solver).

The sequence is cut into chunks of equal length; each rank gets the same number of chunks (so the
same number of tokens) and chunks are dealt so each rank's *visible area* (the visible (query, key)
pairs of its query chunks, against every key) is balanced: greedy over chunks sorted by area, each
to the lightest rank that has room (largest processing time first). A rank keeps its chunks in
natural order, tokens in natural order inside each, so its shard is a few runs of the sequence.

Documents stay on one rank where that costs no balance: after the deal, chunks are swapped between
ranks to keep the visible pairs of a document (or a window across a boundary) on one rank, while no
rank's area grows past SLACK over the deal's busiest (``gather_documents``): a document then needs no
communication, unless splitting it is what balances.

Then, given a ``receive`` weight (the visible pairs a key row costs a rank that receives it: its K, V
in and, in the backward, its dK, dV home, against a pair's compute; costmodel.receive_weight prices it
from the call's shapes and the link), chunks are swapped to lower the most any rank costs, its area
plus ``receive`` for each key row of another rank its queries see (``balance_receives``): under the
gather scheme a rank receives exactly those rows, and equal areas can leave one rank receiving several
times the rows of another and waiting for them (docs/BENCHMARKS.md, "The placement weighs the keys each
rank receives"). Without a weight (a layout named 'chunks', which knows only the mask) the placement
balances area alone.

Across nodes (``per_node`` ranks a node, positions node by node) the chunks are dealt twice: to the
nodes first, by the same rules (each node's area balanced, documents kept on one node where that costs
no balance), then each node's chunks to its ranks. A key a query sees on another node crosses the
network (several times slower than the links inside a node): dealt flat, a document's chunks land on
ranks of any node; dealt by nodes, only a document too heavy for a node's share crosses.

Across nodes the receive weight balances each node's ranks (the keys a rank receives inside its node);
the nodes' deal keeps area and documents only.

Everything is a pure function of (mask, ranks, ranks a node, weight; integers): every rank computes the
same placement from the agreed arguments (kept with its Layout: layout.make_layout).
"""
from dataclasses import dataclass

import numpy as np

from . import masks

TILE = 128                        # the kernels' tile height: chunks are multiples of it where the shard allows
CHUNKS_PER_RANK = (4, 8, 16, 32)  # the counts the plan tries, fewest first
TOLERANCE = 0.02                  # the fewest chunks whose busiest rank holds at most this share over the mean
SLACK = 0.01                      # a document kept whole may cost this share of critical area over the best
PARTNERS = 8                      # the cheapest parts the costliest may swap with, a round of balance_receives


@dataclass(frozen=True)
class Placement:
    """Chunks of ``chunk`` tokens; ``owned[r]`` the chunk indices rank r holds, in natural order;
    ``area[r]`` its visible (query, key) pairs; ``load[r]`` its area plus the receive weight for each key
    row of another rank its queries see (its area without a weight); ``receive`` that weight where it moved
    chunks (0: placed as by area alone)."""
    chunk: int
    owned: tuple
    area: tuple
    load: tuple
    receive: int = 0

    def pieces(self, rank):
        """Rank ``rank``'s (global_start, length) runs, in local order (adjacent chunks joined)."""
        runs = []
        for index in self.owned[rank]:
            start = index * self.chunk
            if runs and runs[-1][0] + runs[-1][1] == start:
                runs[-1] = (runs[-1][0], runs[-1][1] + self.chunk)
            else:
                runs.append((start, self.chunk))
        return tuple(runs)

    @property
    def imbalance(self):
        """The busiest rank's load over the mean area (1.0: areas balanced and no key received or weighed; no
        visible pair: 1.0): the mean area is the same for every chunk, so the least imbalance is the least load."""
        mean = sum(self.area) / len(self.area)
        return max(self.load) / mean if mean else 1.0


def place(mask, size, per_node=None, receive=0):
    """The Placement of ``mask`` (the call's masks.Mask, of any kind) over ``size`` ranks;
    ``mask.seqlen`` must be a multiple of ``size``. ``per_node``: ranks a node, positions node by node
    (None: one node; it must divide ``size``); ``receive``: visible pairs a received key row weighs (an
    int; 0: area alone)."""
    local = mask.seqlen // size
    best = None
    for count in chunk_counts(local):
        found = place_chunks(mask, size, local // count, per_node, receive)
        if found.imbalance <= 1 + TOLERANCE:
            return found
        if best is None or found.imbalance < best.imbalance:
            best = found
    return best


def chunk_counts(local):
    """Chunks per rank the plan tries for a shard of ``local`` tokens, fewest first: those of
    CHUNKS_PER_RANK whose chunk is a multiple of TILE; else those that divide the shard; else its
    divisors up to the largest of CHUNKS_PER_RANK (small shapes)."""
    tiled = [n for n in CHUNKS_PER_RANK if local % (n * TILE) == 0]
    if tiled:
        return tiled
    exact = [n for n in CHUNKS_PER_RANK if local % n == 0]
    return exact or [n for n in range(1, min(local, CHUNKS_PER_RANK[-1]) + 1) if local % n == 0]


def place_chunks(mask, size, chunk, per_node=None, receive=0):
    """The Placement of chunks of ``chunk`` tokens: dealt to the nodes (``per_node`` ranks each; None:
    one node), then each node's to its ranks (``split``), the last level balancing each rank's area with the
    keys it receives at ``receive`` visible pairs a row (``balance_receives``)."""
    pairs = masks.block_counts(mask, chunk, chunk)
    areas = pairs.sum(axis=1)
    per_node = size if per_node is None else per_node
    owner = np.zeros(len(areas), np.int64)
    levels = (size // per_node, per_node) if per_node < size else (size,)
    moved = False
    for level, parts in enumerate(levels):
        below = np.empty_like(owner)
        for group in range(owner.max() + 1):
            held = np.flatnonzero(owner == group)
            part = split(areas[held], pairs[np.ix_(held, held)], parts)
            if receive and parts > 1 and level == len(levels) - 1:
                weighed = balance_receives(part, areas[held], pairs[np.ix_(held, held)] > 0, parts,
                                           int(receive) * chunk)
                moved = moved or not np.array_equal(weighed, part)
                part = weighed
            below[held] = group * parts + part
        owner = below
    owned = tuple(tuple(np.flatnonzero(owner == r).tolist()) for r in range(size))
    area = tuple(int(areas[list(c)].sum()) for c in owned)
    sight = pairs > 0
    received = [int((sight[list(c)].any(axis=0) & (owner != r)).sum()) * chunk for r, c in enumerate(owned)]
    return Placement(chunk, owned, area, tuple(a + int(receive) * n for a, n in zip(area, received)),
                     int(receive) if moved else 0)


def split(areas, pairs, parts):
    """The part (of ``parts``) of each chunk of ``areas`` (``pairs``: the visible pairs between them): dealt
    by area (``deal``), then chunks swapped between parts to keep documents together within SLACK of that
    balance (``gather_documents``)."""
    owned, area = deal(areas, parts)
    owner = np.empty(len(areas), np.int64)
    for part, chunks in enumerate(owned):
        owner[list(chunks)] = part
    return gather_documents(owner, areas, pairs + pairs.T, parts, max(area) * (1 + SLACK))


def balance_receives(owner, areas, sight, size, weight):
    """``owner`` after swaps of two chunks between parts that lower the most any part costs: its area (the
    visible pairs of its chunks) plus ``weight`` for each chunk of another part its queries see (``sight``
    (n, n) bool: chunk i's queries see chunk j's keys), the keys it receives. Each round the costliest part
    (the first of equals) takes the swap, with one of the PARTNERS cheapest other parts, that lowers the
    highest cost most (the first such in chunk order); it stops when none does (each round lowers the highest
    cost, so within chunks x parts rounds). Counts never change; integers throughout, so every rank finds the
    same."""
    owner = owner.copy()
    seen = sight.astype(np.int64)
    count = np.stack([seen[owner == p].sum(axis=0) for p in range(size)])   # chunks of a part that see each
    area = np.bincount(owner, areas, minlength=size).astype(np.int64)

    def received(p):
        return int(((count[p] > 0) & (owner != p)).sum())

    def after(p, out, into):
        """(len(out), len(into)): the chunks part p receives once it gives chunk ``out[x]`` (``out``: every chunk
        of p) for ``into[y]``: those it received, less the keys only the chunk given saw (and the chunk taken
        does not), plus those no chunk of it saw that the chunk taken does, then the two chunks' own places: the
        one given is another's, the one taken its own. A key only one chunk of p sees is that chunk's alone, so
        the keys each chunk given loses are sums over runs of columns, not a product."""
        other = owner != p
        only = np.flatnonzero((count[p] == 1) & other)                 # keys one chunk of p sees, of others
        whose = seen[np.ix_(out, only)].argmax(axis=0) if len(only) else only   # the chunk of out seeing each
        order = np.argsort(whose, kind="stable")
        runs = np.searchsorted(whose[order], np.arange(len(out) + 1))
        sums = np.zeros((len(into), len(only) + 1), np.int64)
        np.cumsum(seen[np.ix_(into, only[order])], axis=1, out=sums[:, 1:])
        kept = (sums[:, runs[1:]] - sums[:, runs[:-1]]).T                # keys only out[x] sees that into[y] sees
        lost = np.diff(runs)[:, None] - kept
        gained = seen[np.ix_(into, np.flatnonzero((count[p] == 0) & other))].sum(axis=1)[None]
        give = count[p, out][:, None] - seen[out, out][:, None] + seen[np.ix_(into, out)].T
        take = count[p, into][None] - seen[np.ix_(out, into)] + seen[into, into][None]
        return received(p) - lost + gained + (give > 0) - (take > 0)

    cost = area + weight * np.array([received(p) for p in range(size)], np.int64)
    for _ in range(len(owner) * size):
        a = int(np.argmax(cost))
        mine = np.flatnonzero(owner == a)
        best, swap = cost[a], None
        partners = sorted((p for p in range(size) if p != a), key=lambda p: (cost[p], p))[:PARTNERS]
        held = [np.flatnonzero(owner == b) for b in partners]   # parts without chunks take no swap
        partners, held = [b for b, x in zip(partners, held) if len(x)], [x for x in held if len(x)]
        candidates = np.concatenate(held) if held else np.zeros(0, np.int64)
        gives_all = areas[mine][:, None] - areas[candidates][None]
        mine_after = after(a, mine, candidates)   # what part a receives, whichever partner it swaps with
        ends = np.cumsum([0] + [len(theirs) for theirs in held])
        for b, theirs, lo, hi in zip(partners, held, ends[:-1], ends[1:]):
            rest = max((cost[p] for p in range(size) if p not in (a, b)), default=0)
            high = np.maximum(np.maximum(area[a] - gives_all[:, lo:hi] + weight * mine_after[:, lo:hi],
                                         area[b] + gives_all[:, lo:hi] + weight * after(b, theirs, mine).T), rest)
            k = int(np.argmin(high))
            if high.flat[k] < best:
                best, swap = high.flat[k], (int(mine[k // len(theirs)]), int(theirs[k % len(theirs)]))
        if swap is None:
            break
        i, j = swap
        a, b = owner[i], owner[j]
        owner[i], owner[j] = b, a
        count[a] += seen[j] - seen[i]
        count[b] += seen[i] - seen[j]
        area[a] += areas[j] - areas[i]
        area[b] += areas[i] - areas[j]
        for p in (a, b):
            cost[p] = area[p] + weight * received(p)
    return owner


def deal(areas, size):
    """(owned, area): chunks dealt heaviest first (ties: the earlier), each to the lightest rank
    (ties: the lower) with room (the same count each)."""
    share = len(areas) // size
    owned, area = [[] for _ in range(size)], [0] * size
    for i in sorted(range(len(areas)), key=lambda c: (-areas[c], c)):
        rank = min((r for r in range(size) if len(owned[r]) < share), key=lambda r: (area[r], r))
        owned[rank].append(i)
        area[rank] += int(areas[i])
    return tuple(tuple(sorted(chunks)) for chunks in owned), tuple(area)


def gather_documents(owner, areas, affinity, size, limit, rounds=4):
    """``owner`` (the rank of each chunk) after swaps of two chunks between ranks that raise the
    visible pairs kept on one rank (``affinity`` (n, n): the pairs between two chunks, both ways)
    and leave both ranks' areas at most ``limit``: each chunk, heaviest first, with the chunk of the
    rank it shares most pairs with whose swap gains most. Counts never change; at most ``rounds``
    passes, in a fixed order (every rank finds the same)."""
    owner = owner.copy()
    area = np.bincount(owner, areas, minlength=size).astype(np.int64)
    shared = np.zeros((size, len(areas)), np.int64)   # pairs each chunk shares with each rank's chunks
    for rank in range(size):
        shared[rank] = affinity[owner == rank].sum(axis=0)
    own = np.diagonal(affinity)
    for _ in range(rounds):
        swapped = False
        for i in sorted(range(len(areas)), key=lambda c: (-areas[c], c)):
            a = owner[i]
            gains = shared[:, i].copy()
            gains[a] = -1
            b = int(np.argmax(gains))
            gain = shared[b, i] - (shared[a, i] - own[i])
            if gain <= 0:
                continue
            js = np.flatnonzero(owner == b)
            fit = (area[a] - areas[i] + areas[js] <= limit) & (area[b] - areas[js] + areas[i] <= limit)
            total = gain + shared[a, js] - (shared[b, js] - own[js]) - 2 * affinity[i, js]
            total[~fit] = 0
            if total.max() <= 0:
                continue
            j = int(js[np.argmax(total)])
            owner[i], owner[j] = b, a
            area[a] += areas[j] - areas[i]
            area[b] += areas[i] - areas[j]
            shared[a] += affinity[j] - affinity[i]
            shared[b] += affinity[i] - affinity[j]
            swapped = True
        if not swapped:
            break
    return owner
