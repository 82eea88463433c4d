"""K/V only where a query sees it: the gather schedule (scheme ``gather``; MagiAttention's GroupCast
and GroupReduce are the idea, this is our own).

Every rank computes its own queries only. The keys and values of another rank travel straight
from their owner, and only the runs of it that some query of the receiver sees (at the layout's
granularity: a chunk of the chunks layout, a piece of the others), packed into one message; no
shard is forwarded, and nothing comes back in the forward. The backward sends each dK/dV partial
of those runs home to their owner once.

Steps: a rank's work is its own keys' pairs, cut in two (a first part, the rest), and a visit to
each other rank whose keys it sees, in the order: the first part, the visits (by ring distance to
their owner), the rest; in blocks of query rows (balance.row_unit), cut into step_count steps of equal
work, step 0 holding only the first part (as much as a step's share, as much as the rank has).
The owners post every transfer of keys and values at step 0 (their inputs are ready), each due
at the end of the step before its first use: the data crosses the links under the rank's own
work, and ranks are coupled only by their data arriving. A dK/dV partial is posted the step after
the last visit adding to it (the own rest still runs, so it crosses under that) and is due at the
last step. Every rank derives the same steps from (mask, ranks, layout).
"""
from functools import lru_cache

import numpy as np

from . import balance, masks
from .schedule import Transfer, Visit, make_step


@lru_cache(maxsize=16)
def sight(mask, layout):
    """(units, seen, unit): ``units[r]`` the global unit indices of rank r's shard in local order;
    ``seen[a][b]`` the (lo, hi) runs of rank b's local rows holding keys some query of rank a sees
    (empty: none; a == b too), ``unit`` tokens a unit (``layout.grain``: the chunk of the chunks
    layout). ``mask``: the call's masks.Mask; ``layout`` a layout.Layout."""
    size, unit = layout.size, layout.grain
    units = [[start // unit + i for start, n in layout.pieces(r) for i in range(n // unit)] for r in range(size)]
    ptr, key, pairs = masks.block_band(mask, unit, unit)
    seen = []
    for a in range(size):
        rows = np.array(units[a], np.int64)
        at, _ = masks.ranges(ptr[rows], ptr[rows + 1] - ptr[rows])
        sees = np.zeros(ptr.size - 1, bool)
        sees[key[at][pairs[at] > 0]] = True
        seen.append(tuple(_runs([i for i, u in enumerate(units[b]) if sees[u]], unit) for b in range(size)))
    return tuple(tuple(u) for u in units), tuple(seen), unit


def held(mask, layout):
    """The most keys and values any rank holds at once under the gather scheme, in shards: its own and every
    run its queries see (the packed passes' buffer; the stepped schedule posts them all at step 0)."""
    _, seen, _ = sight(mask, layout)
    local = layout.seqlen // layout.size
    return max(local + sum(hi - lo for b, runs in enumerate(seen[a]) if b != a for lo, hi in runs)
               for a in range(layout.size)) / local


# the most bytes the gather scheme's received keys and values (with their float32 gradients in the backward)
# may take on a rank for scheme='auto' to pick it (costmodel.auto_schemes): it holds every run a rank's queries
# see at once, and under plain causal the last of P ranks sees every key (the ring holds two shards whatever P)
HELD_BYTES = 16 << 30


def held_bytes(pr, layout, backward=True):
    """Bytes a rank holds at once under the gather scheme beyond its own inputs, at the most, for the problem
    ``pr`` (costmodel.Problem): the keys and values of every run its queries see and, in the ``backward``,
    their float32 dK, dV."""
    received = (held(pr.mask, layout) - 1) * pr.batch * pr.seqlen / layout.size
    return received * 2 * pr.kv_heads * pr.head_dim * (pr.itemsize + (4 if backward else 0))


def fits(pr, layout):
    """Whether ``scheme='auto'`` may run the gather scheme for ``pr`` in ``layout`` (held_bytes <= HELD_BYTES)."""
    return held_bytes(pr, layout) <= HELD_BYTES


def _runs(positions, unit):
    """(lo, hi) local row runs of the sorted unit ``positions`` (adjacent ones joined)."""
    out = []
    for p in positions:
        if out and out[-1][1] == p * unit:
            out[-1] = (out[-1][0], (p + 1) * unit)
        else:
            out.append((p * unit, (p + 1) * unit))
    return tuple(out)


def step_count(layout):
    """Steps that hold work when some rank receives keys: as many as the nodes (``layout.nodes``: a layout placed
    by nodes), three at the least and eight at the most, so that the keys of more nodes arrive under more of a
    rank's own work. Predicted (MagiAttention's documents, 8k tokens a GPU, 8 a node, H100 rates, 50 GB/s; steps 2
    to 8 priced), forward / backward TFLOP/s a GPU: 16 GPUs three best (463 / 364); 32 four best (450 / 353,
    three 428 / 331); 64 eight best (420 / 337, three 329 / 287, five 383 / 324). Beyond eight nodes untried."""
    nodes = 1 if layout.nodes is None else len(set(layout.nodes))
    return min(8, max(3, nodes))


@lru_cache(maxsize=16)
def plan(mask, layout, returns):
    """(count, tasks, moves): the steps; ``tasks[r][t]`` the visits of rank r at step t as (kv shard,
    (lo, hi) local query rows, work); ``moves`` every transfer as (posted, due, sender, receiver,
    what, shard, rows): data from its owner, partials (``returns`` holds 'kv': the backward) home."""
    units, seen, unit = sight(mask, layout)
    size = layout.size
    remote = any(seen[a][b] for a in range(size) for b in range(size) if a != b)
    steps = step_count(layout) if remote else 1
    band = masks.block_band(mask, balance.row_unit(unit), unit)   # (row block, key unit): visible pairs
    works = [_rank_work(band, units, seen, unit, r, layout.nodes, "kv" in returns) for r in range(size)]
    # step 0 holds own work only: the same share on every rank (as much as the least has, up to a step's)
    head = min(min(int(w[r].sum()) for r, w in enumerate(works)),
               min(sum(int(x.sum()) for x in w.values()) for w in works) / steps) if steps > 1 else None
    tasks = tuple(_cut(r, works[r], balance.row_unit(unit), steps, head) for r in range(size))
    used = {}   # (receiver, shard) -> (first step, last step) of its visits
    for r, mine in enumerate(tasks):
        for t, visits in enumerate(mine):
            for shard, _, _ in visits:
                if shard != r:
                    used[(r, shard)] = (used.get((r, shard), (t, t))[0], t)
    count = steps + (1 if "kv" in returns and any(b == steps - 1 for _, b in used.values()) else 0)
    moves = []
    for (r, shard), (first, last) in sorted(used.items()):
        moves.append((0, first - 1, shard, r, "data", shard, seen[r][shard]))
        if "kv" in returns:
            moves.append((last + 1, count - 1, r, shard, "partial", shard, seen[r][shard]))
    return count, tasks, tuple(moves)


def _rank_work(band, units, seen, unit, rank, nodes=None, far_first=False):
    """{shard: int64 work of each block of ``rank``'s query rows (local order) against the keys of
    ``shard`` it sees}, own keys first, then the others by ring distance; ``band`` the visible pairs
    of every block of rows against the units of keys it can see (masks.block_band), ``units``, ``seen``,
    ``unit`` as ``sight`` gives them. With ``nodes`` (the layout's node of each rank) the other nodes' keys
    come last, so their transfers have the longest to arrive, or with ``far_first`` (the backward) first, so
    their partials go home under the rest of the work."""
    size, count = len(units), sum(len(u) for u in units)
    ptr, key, pairs = band
    ratio = (ptr.size - 1) // count   # row blocks a unit
    blocks = np.array([u * ratio + i for u in units[rank] for i in range(ratio)], np.int64)
    at, local = masks.ranges(ptr[blocks], ptr[blocks + 1] - ptr[blocks])
    others = [(rank - d) % size for d in range(1, size) if seen[rank][(rank - d) % size]]
    if nodes is not None:
        others.sort(key=lambda b: (nodes[b] == nodes[rank]) == far_first)
    owners = [(rank, None)] + [(b, seen[rank][b]) for b in others]
    owner = np.full(count, -1)   # the place in ``owners`` of each key unit it sees
    for i, (shard, keys) in enumerate(owners):
        owner[_key_units(units[shard], keys, unit)] = i
    shard_of = owner[key[at]]
    kept = shard_of >= 0
    work = np.bincount(shard_of[kept] * blocks.size + local[kept], pairs[at][kept], len(owners) * blocks.size)
    return {shard: w for (shard, _), w in zip(owners, work.reshape(len(owners), blocks.size).astype(np.int64))}


def _cut(rank, work, rows, steps, head):
    """Rank ``rank``'s visits by step, as ``plan`` gives them: its ``work`` (_rank_work) in blocks of
    ``rows`` query rows, in the order (own keys' first part, the other ranks' keys, own keys' rest),
    cut into ``steps`` steps of equal work, step 0 the first part alone (``head`` work at most; None:
    everything, in one step). Blocks with no work are left out."""
    total = sum(int(w.sum()) for w in work.values())
    cumulative = np.cumsum(work[rank])
    first = len(cumulative) if head is None else int(np.searchsorted(cumulative, head, side="right"))
    share = (total - (int(cumulative[first - 1]) if first else 0)) / (steps - 1) if steps > 1 else 0
    sequence = [(rank, 0, first)] + [(shard, 0, len(cumulative)) for shard in work if shard != rank]
    sequence.append((rank, first, len(cumulative)))
    out, done = [[] for _ in range(steps)], 0
    for index, (shard, lo, hi) in enumerate(sequence):
        for b in range(lo, hi):
            w = int(work[shard][b])
            if w == 0:
                continue
            t = 0 if index == 0 else min(steps - 1, 1 + int((done + w / 2) // share))
            done += w if index else 0
            if out[t] and out[t][-1][0] == shard:   # the blocks between were this step's or had no work
                _, (a, _), v = out[t][-1]
                out[t][-1] = (shard, (a, (b + 1) * rows), v + w)
            else:
                out[t].append((shard, (b * rows, (b + 1) * rows), w))
    return tuple(tuple(visits) for visits in out)


def _key_units(owned_units, keys, unit):
    """The global key units of ``keys`` (local row runs; None: all) of a shard of ``owned_units``."""
    if keys is None:
        return list(owned_units)
    return [owned_units[p] for lo, hi in keys for p in range(lo // unit, hi // unit)]


@lru_cache(maxsize=256)
def steps(rank, layout, mask, returns):
    """This rank's steps (schedule.Step) of ``plan``."""
    count, tasks, moves = plan(mask, layout, returns)
    seen = sight(mask, layout)[1]
    sends, recvs = [[] for _ in range(count)], [[] for _ in range(count)]
    for posted, due, sender, receiver, what, shard, rows in moves:
        due = None if due == posted else due
        if sender == rank:
            sends[posted].append(Transfer(receiver, what, "kv", shard, due, rows))
        if receiver == rank:
            recvs[posted].append(Transfer(sender, what, "kv", shard, due, rows))
    visits = list(tasks[rank]) + [()] * (count - len(tasks[rank]))
    return tuple(make_step([Visit(rank, shard, rows, None if shard == rank else seen[rank][shard])
                            for shard, rows, _ in visits[t]], sends[t], recvs[t]) for t in range(count))
