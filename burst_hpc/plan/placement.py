"""Placement by chunks: the ``chunks`` layout (MagiAttention's dispatch, our own solver).

The sequence is cut into chunks of equal length; each rank gets the same number of chunks (so the
same number of tokens) and chunks are dealt so each rank's *visible area* (the visible (query, key)
pairs of its query chunks, against every key) is balanced: greedy over chunks sorted by area, each
to the lightest rank that has room (largest processing time first). A rank keeps its chunks in
natural order, tokens in natural order inside each, so its shard is a few runs of the sequence.

Documents stay on one rank where that costs no balance: chunks joined by visibility (a query of one
sees a key of the next: one document, or a window, across the boundary) form *units* of at most
``cap`` chunks that are dealt whole. The cap is halved from a rank's whole share down to one chunk;
the largest whose critical area is within SLACK of the best (usually one chunk, every chunk on its
own) is kept: a document then needs no communication, unless splitting it is what balances.

The chunk length is the plan's: the fewest chunks per rank (CHUNKS_PER_RANK, multiples of the
kernels' tile, TILE tokens, where the shard allows) whose critical area is within TOLERANCE of the
mean, else the best balanced of them: fewer chunks are fewer runs, kernel launches and messages.

Everything is a pure function of (mask, ranks), cached: every rank computes the same placement
from the agreed arguments.
"""
import heapq
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

TILE = 128                        # the kernels' tile height: chunks are multiples of it where the shard allows
CHUNKS_PER_RANK = (4, 8, 16, 32)  # the counts the plan tries, fewest first
TOLERANCE = 0.02                  # the fewest chunks whose busiest rank holds at most this share over the mean
SLACK = 0.01                      # a document kept whole may cost this share of critical area over the best


@dataclass(frozen=True)
class Placement:
    """Chunks of ``chunk`` tokens; ``owned[r]`` the chunk indices rank r holds, in natural order;
    ``area[r]`` its visible (query, key) pairs."""
    chunk: int
    owned: tuple
    area: tuple

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
        """The busiest rank's area over the mean (1.0: balanced; no visible pair: 1.0)."""
        mean = sum(self.area) / len(self.area)
        return max(self.area) / mean if mean else 1.0


@lru_cache(maxsize=16)
def place(mask, size):
    """The Placement of ``mask`` (a masks.Mask: plain causal and full attention as Mask(seqlen,
    causal, None, None)) over ``size`` ranks; ``mask.seqlen`` must be a multiple of ``size``."""
    local = mask.seqlen // size
    best = None
    for count in chunk_counts(local):
        found = place_chunks(mask, size, local // count)
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


def place_chunks(mask, size, chunk):
    """The Placement of chunks of ``chunk`` tokens: the largest unit cap within SLACK of the best."""
    areas, linked = chunk_facts(mask, chunk)
    share = len(areas) // size
    caps, cap = [], share
    while cap >= 1:
        caps.append(cap)
        cap //= 2
    if caps[-1] != 1:
        caps.append(1)
    tried = [deal(areas, linked, size, cap) for cap in caps]
    least = min(max(area) for _, area in tried)
    owned, area = next(t for t in tried if max(t[1]) <= least * (1 + SLACK))
    return Placement(chunk, owned, area)


def chunk_facts(mask, chunk):
    """(area, linked): int64 visible pairs of each chunk's queries against every key; bool,
    ``linked[i]`` whether a query of chunk i or i + 1 sees a key of the other."""
    lo, hi = mask.intervals
    area = (hi - lo).reshape(-1, chunk).sum(axis=1)
    bounds = np.arange(chunk, mask.seqlen, chunk)
    # the row intervals never shrink and each row sees itself: the rows next to a boundary decide
    linked = (lo[bounds] < bounds) | (hi[bounds - 1] > bounds)
    return area, linked


def units(linked, cap):
    """Runs of consecutive chunks (first, count): the chains of ``linked`` chunks, cut every ``cap``."""
    out, first = [], 0
    for i in range(len(linked) + 1):
        if i == len(linked) or not linked[i]:
            for start in range(first, i + 1, cap):
                out.append((start, min(cap, i + 1 - start)))
            first = i + 1
    return out


def deal(areas, linked, size, cap):
    """(owned, area): units of at most ``cap`` chunks dealt heaviest first, each to the lightest rank
    with room for it (ties: the lower rank); a unit no rank has room for is dealt chunk by chunk."""
    share = len(areas) // size
    pending = [(-int(areas[s:s + n].sum()), s, n) for s, n in units(linked, cap)]
    heapq.heapify(pending)
    owned, area = [[] for _ in range(size)], [0] * size
    while pending:
        weight, start, n = heapq.heappop(pending)
        room = [r for r in range(size) if len(owned[r]) + n <= share]
        if not room:
            for i in range(start, start + n):
                heapq.heappush(pending, (-int(areas[i]), i, 1))
            continue
        rank = min(room, key=lambda r: (area[r], r))
        owned[rank] += range(start, start + n)
        area[rank] -= weight
    return tuple(tuple(sorted(chunks)) for chunks in owned), tuple(area)
