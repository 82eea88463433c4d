"""K/V only where a query sees it: the gather schedule (scheme ``gather``; MagiAttention's GroupCast
and GroupReduce are the idea, this is our own).

Every rank computes its own queries only. The keys and values of another rank travel straight
from their owner, and only the runs of it that some query of the receiver sees (at the layout's
granularity: a chunk of the chunks layout, a piece of the others), packed into one message; no
shard is forwarded, and nothing comes back in the forward. The backward sends each dK/dV partial
of those runs home to their owner once, the step after it is made.

Stages: the ranks a rank receives from are taken by ring distance d = receiver - owner (mod P),
one stage per distance at which some rank receives (documents and windows leave most empty):
step 0 computes the rank's own keys while the first stage's data arrives; step i computes the
data of stage i while stage i + 1's arrives (and, backward, stage i - 1's partials go home). Each
rank sends to one rank and receives from one rank per stage, as on a ring. Every rank derives
the same steps from (mask, ranks, layout).
"""
from functools import lru_cache

import numpy as np

from . import masks
from .layout import pieces
from .schedule import Transfer, Visit, make_step


@lru_cache(maxsize=16)
def sight(mask, size, layout):
    """(units, seen, unit): ``units[r]`` the global unit indices of rank r's shard in local order;
    ``seen[a][b]`` the (lo, hi) runs of rank b's local rows holding keys some query of rank a sees
    (empty: none; a == b too), ``unit`` tokens a unit (the chunk of the chunks layout, else the
    largest length every piece is made of). ``mask``: a masks.Mask (plain causal too)."""
    owned = [pieces(mask.seqlen, r, size, layout, mask) for r in range(size)]
    if layout == "chunks" and size > 1:
        from .placement import place

        unit = place(mask, size).chunk
    else:
        unit = int(np.gcd.reduce([n for runs in owned for _, n in runs]))
    units = [[start // unit + i for start, n in runs for i in range(n // unit)] for runs in owned]
    visible = masks.block_counts(mask, unit, unit) > 0
    seen = []
    for a in range(size):
        sees = visible[units[a]].any(axis=0)
        seen.append(tuple(_runs([i for i, u in enumerate(units[b]) if sees[u]], unit) for b in range(size)))
    return tuple(tuple(u) for u in units), tuple(seen), unit


def _runs(positions, unit):
    """(lo, hi) local row runs of the sorted unit ``positions`` (adjacent ones joined)."""
    out = []
    for p in positions:
        if out and out[-1][1] == p * unit:
            out[-1] = (out[-1][0], (p + 1) * unit)
        else:
            out.append((p * unit, (p + 1) * unit))
    return tuple(out)


def stages(mask, size, layout):
    """The ring distances at which some rank receives keys, in order: one stage each."""
    seen = sight(mask, size, layout)[1]
    return tuple(d for d in range(1, size) if any(seen[r][(r - d) % size] for r in range(size)))


@lru_cache(maxsize=256)
def steps(rank, size, mask, layout, returns):
    """This rank's steps (schedule.Step): its own keys at step 0, then a stage's received runs per
    step; ``returns`` holds 'kv' in the backward (the dK/dV partials of received runs go home the
    step after their visit; a last step delivers the last ones)."""
    seen = sight(mask, size, layout)[1]
    distances = stages(mask, size, layout)
    back = "kv" in returns
    count = 1 + len(distances) + (1 if back and distances else 0)
    sends, recvs, visits = ([[] for _ in range(count)] for _ in range(3))
    visits[0].append(Visit(rank, rank))
    for i, d in enumerate(distances):
        to, owner = (rank + d) % size, (rank - d) % size
        if seen[to][rank]:   # at step i this rank's runs go to the rank d ahead, used there at step i + 1
            sends[i].append(Transfer(to, "data", "kv", rank, rows=seen[to][rank]))
            if back:
                recvs[i + 2].append(Transfer(to, "partial", "kv", rank, rows=seen[to][rank]))
        if seen[rank][owner]:
            recvs[i].append(Transfer(owner, "data", "kv", owner, rows=seen[rank][owner]))
            visits[i + 1].append(Visit(rank, owner, keys=seen[rank][owner]))
            if back:
                sends[i + 2].append(Transfer(owner, "partial", "kv", owner, rows=seen[rank][owner]))
    return tuple(make_step(*parts) for parts in zip(visits, sends, recvs))
