"""The steps of the balanced schedule (docs/RING.md, "Balanced"): each rank's tasks after
balancing (balance.assign) in order, cut into steps of equal work.

A rank's tasks run in order: the first rows of its local pair, the work it does for others, its own
pairs, the rest of the local pair; across nodes the work whose data or partial crosses the network
sits in the middle of the rest. They are cut into ``steps`` pieces of equal work; step 0 holds only
local work (nothing has arrived yet), as much as every rank has, up to two steps' work. Across nodes
the forward then works NEAR_STEPS steps inside its node (the first on its local pair) before work
whose data crosses the network.

Everything is a pure function of (mask, ranks, near side, returned sides, nodes), cached, so every
rank computes the same plan.
"""
from functools import lru_cache

import numpy as np

from .balance import assign, block_work
from .masks import ranges

BEFORE = 0.5      # the share of its work inside the node a rank runs before its work across nodes
# across nodes, the steps after step 0 a rank works inside its node (where it has the work) before work
# whose data crosses the network (that data, posted at step 0, arrives under them), and the first of
# them on its local pair (the owners' links then have two steps for the first pieces they send). The
# backward's steps are ~3x longer for the same bytes: step 0 hides its first pieces, and work pulled
# forward is missed at the end (the model: 64 GPUs, three document sets, 335 -> 328 TFLOP/s with it)
NEAR_STEPS = {"forward": 2, "backward": 0}
LOCAL_STEPS = {"forward": 1, "backward": 0}


@lru_cache(maxsize=16)
def work_plan(mask, size, near, returns, steps=None, nodes=None):
    """Each rank's visits per step: a tuple over ranks of tuples over steps of tuples of
    (q_shard, kv_shard, row0, row1) (local query rows of the query shard), and the work of each
    (rank, step) as an int64 array (steps, ranks). ``steps`` defaults to ``default_steps``.

    A rank's tasks run in order: the first rows of its local pair (step 0: nothing has arrived
    yet), the work it does for other ranks (their partials go home early), its own pairs, the
    rest of its local pair (while the last partials go home). The step boundaries sit where the work reaches
    equal shares: at a row block's edge when that is within 2% of a step's work, otherwise at
    the exact query row (a kernel tile cut short costs less than an uneven step)."""
    prefix, unit = block_work(mask, size)
    assigned = assign(mask, size, near, returns, nodes)
    count = default_steps(mask, size, near, returns, nodes) if steps is None else steps
    direction = "backward" if "kv" in returns else "forward"
    node = None if nodes is None else np.asarray(nodes)

    def order(r, task):
        """Work for others first (its partials go home early), then own pairs: the nearest key
        chunk first where no key-side partial returns (each rank starts on different key chunks,
        which mostly live on its own node), else in chunk order (a far pair's partial has time)."""
        i, j, b0, b1, kind = task
        return (kind == "home", (i - j) % size if "kv" not in returns else 0, i, j, b0)

    runs = []   # per rank: (i, j, block) units in order, their cumulative work, the units of step 0
    for r in range(size):
        local = _expand([t[:4] for t in assigned[r] if t[0] == t[1] == r])
        others = _expand([t[:4] for t in sorted(assigned[r], key=lambda t: order(r, t)) if not t[0] == t[1] == r])
        turn = 0 if nodes is None else sum(1 for x in range(r) if nodes[x] == nodes[r])   # its place in its node
        runs.append((local, _middle(prefix, others, _far_of(node, r), turn, r, near, size), _far_of(node, r)))
    totals = [int(_weight(prefix, local).sum() + _weight(prefix, others).sum()) for local, others, _ in runs]
    # step 0: as much of the local pair as every rank has, up to two steps' work (the first pieces
    # arrive meanwhile; a larger step 0 where any rank lacks the local work would idle the others)
    first = (min(min(int(_weight(prefix, local).sum()) for local, _, _ in runs), 2 * min(totals) // count)
             if count > 1 else 0)
    for r, (local, others, far) in enumerate(runs):   # the local pair: step 0's work first, the rest last
        cum = np.cumsum(_weight(prefix, local))
        split = int(np.searchsorted(cum, first, side="left")) + 1 if first else 0
        share = (totals[r] - first) / max(1, count - 1)
        units = np.concatenate([local[:split], others, local[split:]])
        if nodes is not None:
            units = _inside_first(prefix, units, first + NEAR_STEPS[direction] * share, far)
            units = _inside_first(prefix, units, first + LOCAL_STEPS[direction] * share,
                                  lambda u: ~((u[:, 0] == r) & (u[:, 1] == r)))
        runs[r] = (units, np.concatenate([[0], np.cumsum(_weight(prefix, units))]), min(split, len(local)))
    plan, work = [], np.zeros((count, size), np.int64)
    for r, (units, cum, locals_end) in enumerate(runs):
        share = (totals[r] - first) / max(1, count - 1)
        cuts = [(0, 0, 0)] + step_cuts(mask, size, unit, units, cum, locals_end, first, share, count)
        cuts.append((len(units), 0, totals[r]))
        work[:, r] = np.diff([w for _, _, w in cuts])
        plan.append(visits_of(units, unit, cuts))
    work.setflags(write=False)
    return tuple(plan), work


def _weight(prefix, units):
    """The work of each unit (rows of a (i, j, block) int array), from block_work's ``prefix``."""
    return prefix[units[:, 0], units[:, 2] + 1, units[:, 1]] - prefix[units[:, 0], units[:, 2], units[:, 1]]


def _far_of(node, r):
    """far(units): whether each unit's data or partial crosses the network (rank r's node; ``node``
    None: one node)."""
    if node is None:
        return lambda units: np.zeros(len(units), bool)
    return lambda units: ~((node[units[:, 0]] == node[r]) & (node[units[:, 1]] == node[r]))


def _expand(tasks):
    """The units (i, j, block) of tasks (i, j, b0, b1), in order."""
    tasks = np.asarray(tasks, np.int64).reshape(-1, 4)
    blocks, task = ranges(tasks[:, 2], tasks[:, 3] - tasks[:, 2])
    return np.column_stack([tasks[task, 0], tasks[task, 1], blocks])


def _middle(prefix, units, far, turn, r, near, size):
    """``units`` with those whose data or partial crosses the network (``far``) moved to
    the middle of the near ones, by work: their data has steps to arrive in, their partials
    steps to go home in: first those for others (one owner after another), then its own
    (``r``'s side stays); each start ``turn`` shards later in their order of shards (the moving
    side's): the ranks of a node fetch different shards first and pass them on to each other
    (schedule.relays), so no owner's link sends one shard to all of them at once."""
    crossing = far(units)
    close, away = units[~crossing], units[crossing]
    side = 1 if near == "kv" else 0
    shards, first = np.unique(away[:, side], return_index=True)
    order = shards[np.argsort(first)]   # the shards in their order of first appearance
    place = np.empty(size, np.int64)
    place[order] = (np.arange(len(order)) - turn) % max(1, len(order))
    owner = away[:, 1 - side]
    # the work for others first, one owner at a time (its rows arrive one after another)
    away = away[np.lexsort((place[away[:, side]], np.where(owner != r, owner, 0), owner == r))]
    if not len(away) or not len(close):
        return np.concatenate([close, away])
    cum = np.cumsum(_weight(prefix, close))
    split = int(np.searchsorted(cum, cum[-1] * BEFORE))
    return np.concatenate([close[:split], away, close[split:]])


def _inside_first(prefix, units, need, far):
    """``units`` with work inside the node (the nearest after it first) moved before the first
    unit whose data or partial crosses the network until ``need`` work comes before it: its
    data, posted at step 0, then arrives under that work besides step 0's."""
    crossing = far(units)
    if not crossing.any():
        return units
    first = int(np.argmax(crossing))
    head, rest, crossing = units[:first], units[first:], crossing[first:]
    done = int(_weight(prefix, head).sum())
    inside = np.flatnonzero(~crossing)
    before = done + np.concatenate([[0], np.cumsum(_weight(prefix, rest[inside]))[:-1]]) if len(inside) else inside
    taken = np.zeros(len(rest), bool)
    taken[inside[before < need]] = True   # while less than ``need`` comes before it
    return np.concatenate([head, rest[taken], rest[~taken]])


def step_cuts(mask, size, unit, units, cum, locals_end, first, share, count):
    """Where a rank's steps 1..count-1 start: (unit index, rows into it, work before the cut) where
    its units' work ``cum`` (cumulative, from 0) reaches ``first`` + ``share`` t (step 1 no later
    than the end of its local work, unit ``locals_end``): at a unit's edge when one is within 2% of a
    step's work, else at the query row nearest the target; never before the cut before."""
    if count < 2:
        return []
    if not len(units):
        return [(0, 0, 0)] * (count - 1)
    target = first + share * np.arange(count - 1)
    target[0] = min(target[0], cum[locals_end])
    u = np.minimum(np.searchsorted(cum, target, side="right") - 1, len(units) - 1)
    tolerance = 0.02 * max(share, 1.0)
    edge = (target - cum[u] <= tolerance) | (cum[u + 1] - target <= tolerance)
    u = u + (edge & (cum[u + 1] - target < target - cum[u]))
    rows, done = np.zeros(len(u), np.int64), cum[u].copy()
    inside = np.flatnonzero(~edge)
    if inside.size:   # the visible pairs of each row of those units, cumulative: the row nearest the target
        i, j, b = units[u[inside]].T
        chunk = mask.seqlen // size
        first_row = (i * chunk + b * unit)[:, None] + np.arange(unit)
        lo, hi = mask.intervals
        seen = np.clip(np.minimum(hi[first_row], (j[:, None] + 1) * chunk) - np.maximum(lo[first_row], j[:, None] * chunk),
                       0, None)
        before = np.concatenate([np.zeros((inside.size, 1), np.int64), np.cumsum(seen, axis=1)], axis=1)
        x = np.argmin(np.abs(cum[u[inside]][:, None] + before - target[inside, None]), axis=1)
        rows[inside], done[inside] = x, cum[u[inside]] + before[np.arange(inside.size), x]
    # never before the cut before: the running maximum of (unit, rows) (the work follows from them)
    key = np.concatenate([[0], u * (unit + 1) + rows])
    latest = np.maximum.accumulate(np.where(key == np.maximum.accumulate(key), np.arange(key.size), 0))[1:] - 1
    held = latest >= 0
    return [(int(u[n]), int(rows[n]), int(done[n])) if ok else (0, 0, 0) for n, ok in zip(latest.tolist(), held.tolist())]


def visits_of(units, unit, cuts):
    """Each step's visits, (q_shard, kv_shard, row0, row1) tuples, of a rank's ``units`` (i, j,
    block) in order, step t from ``cuts[t]`` to ``cuts[t + 1]`` ((unit index, rows into it, work
    before): a step ends ``rows`` into its last unit, or with the unit before when that is 0);
    neighbouring rows of one pair joined."""
    count = len(cuts) - 1
    first = np.array([u for u, _, _ in cuts[:-1]], np.int64)
    last = np.minimum(np.array([u for u, _, _ in cuts[1:]], np.int64) + 1, len(units))   # one past
    lengths = np.maximum(last - first, 0)
    at, step = ranges(first, lengths)
    lo = units[at, 2] * unit
    hi = lo + unit
    starts = np.cumsum(lengths) - lengths
    has = lengths > 0
    lo[starts[has]] += np.array([x for _, x, _ in cuts[:-1]], np.int64)[has]
    ends_inside = has & (np.array([u for u, _, _ in cuts[1:]]) < len(units))   # the step ends inside a unit
    hi[(starts + lengths - 1)[ends_inside]] = (units[at[(starts + lengths - 1)[ends_inside]], 2] * unit +
                                               np.array([x for _, x, _ in cuts[1:]], np.int64)[ends_inside])
    keep = lo < hi
    step, at, lo, hi = step[keep], at[keep], lo[keep], hi[keep]
    pairs = units[at, :2]
    joined = np.zeros(len(at), bool)
    joined[1:] = (step[1:] == step[:-1]) & (pairs[1:] == pairs[:-1]).all(axis=1) & (lo[1:] == hi[:-1])
    begin = np.flatnonzero(~joined)
    stop = np.append(begin[1:], len(at)) - 1
    visits = zip(pairs[begin, 0].tolist(), pairs[begin, 1].tolist(), lo[begin].tolist(), hi[stop].tolist())
    out = [[] for _ in range(count)]
    for t, v in zip(step[begin].tolist(), visits):
        out[t].append(v)
    return tuple(tuple(v) for v in out)


def default_steps(mask, size, near, returns, nodes=None):
    """The number of steps: each about half a full chunk pair's work (a plain causal ring's step:
    P steps), at least 8 on one node and 16 across nodes (smaller steps: the first pieces arrive
    and the last partials go home behind less idle time; across nodes the network's transfers,
    posted steps ahead, overlap several of them), and at most P."""
    prefix, _ = block_work(mask, size)
    chunk = mask.seqlen // size
    mean = prefix[:, -1, :].sum() / size
    return int(min(size, max(8 if nodes is None else 16, round(mean / (chunk * chunk / 2)))))
