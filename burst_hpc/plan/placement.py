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

Across nodes (``per_node`` ranks a node, positions node by node) the chunks are dealt twice: to the
nodes first, by the same rules (each node's area balanced, documents kept on one node where that costs
no balance), then each node's chunks to its ranks. A key a query sees on another node crosses the
network (several times slower than the links inside a node): dealt flat, a document's chunks land on
ranks of any node; dealt by nodes, only a document too heavy for a node's share crosses.

Everything is a pure function of (mask, ranks, ranks a node): every rank computes the same placement from
the agreed arguments (kept with its Layout: layout.make_layout).
"""
from dataclasses import dataclass

import numpy as np

from . import masks

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


def place(mask, size, per_node=None):
    """The Placement of ``mask`` (the call's masks.Mask, of any kind) over ``size`` ranks;
    ``mask.seqlen`` must be a multiple of ``size``. ``per_node``: ranks a node, positions node by node
    (None: one node; it must divide ``size``)."""
    local = mask.seqlen // size
    best = None
    for count in chunk_counts(local):
        found = place_chunks(mask, size, local // count, per_node)
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


def place_chunks(mask, size, chunk, per_node=None):
    """The Placement of chunks of ``chunk`` tokens: dealt to the nodes (``per_node`` ranks each; None:
    one node), then each node's to its ranks (``split``)."""
    pairs = masks.block_counts(mask, chunk, chunk)
    areas = pairs.sum(axis=1)
    per_node = size if per_node is None else per_node
    owner = np.zeros(len(areas), np.int64)
    for parts in ((size // per_node, per_node) if per_node < size else (size,)):
        below = np.empty_like(owner)
        for group in range(owner.max() + 1):
            held = np.flatnonzero(owner == group)
            below[held] = group * parts + split(areas[held], pairs[np.ix_(held, held)], parts)
        owner = below
    owned = tuple(tuple(np.flatnonzero(owner == r).tolist()) for r in range(size))
    return Placement(chunk, owned, tuple(int(areas[list(c)].sum()) for c in owned))


def split(areas, pairs, parts):
    """The part (of ``parts``) of each chunk of ``areas`` (``pairs``: the visible pairs between them): dealt
    by area (``deal``), then chunks swapped between parts to keep documents together within SLACK of that
    balance (``gather_documents``)."""
    owned, area = deal(areas, parts)
    owner = np.empty(len(areas), np.int64)
    for part, chunks in enumerate(owned):
        owner[list(chunks)] = part
    return gather_documents(owner, areas, pairs + pairs.T, parts, max(area) * (1 + SLACK))


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
