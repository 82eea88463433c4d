"""The work-aware schedule of the balanced layout: which rank computes which query rows of which
(query chunk, key chunk) pair, and at which step, for any mask (causal, documents, windows and
their compositions), decided on the host from the mask alone.

Contiguous ownership (rank r owns chunk r, natural token order) leaves the work of a chunk pair
where its tokens are: with packed documents the ranks inside a long document hold ~m/2 chunk
pairs each while those inside short ones hold ~1/2, and no choice between the two owners can
move work between documents. So a pair's rows may also run on a third rank: both sides travel
there and the partials go back to their owners (DistFlashAttn's idea, generalised from the causal
distance to the visible work of each block pair).

1. Work: ``block_work`` counts the visible (query, key) pairs of every row block (``row_unit``
   query rows: the kernels' tile height, 128, where the chunk allows) against every key chunk.
2. Assignment (``assign``): every pair with visible work starts on its *home* rank, the owner
   of the side that does not travel on a plain ring (the query owner when K/V travel). Across
   nodes first: each heavy node's excess over the mean node goes, an equal share from each of its
   ranks, to the rank of the same place in a light node (its rail), so only that excess crosses
   the network and every NIC carries as much. Then inside each node, while a rank holds more than
   the mean (by SETTLED), it hands its last rows to the rank of its node where that costs the
   fewest bytes per unit of work: the last rows of one pair, or whole rows (the same last rows of
   every own pair of one query chunk: its query rows and partial travel once for all their key
   chunks), never filling the receiver past the mean. The local pair keeps its first half of rows.
3. Steps (``work_plan``): each rank's tasks in order (the first rows of its local pair, the work
   it does for others, its own pairs, the rest of the local pair) are cut into ``steps`` pieces
   of equal work; step 0 holds only local work (nothing has arrived yet), as much as every rank
   has, up to two steps' work.

Everything is a pure function of (mask, ranks, near side, returned sides, nodes), cached, so
every rank computes the same plan.
"""
from functools import lru_cache

import numpy as np

ROW_TILE = 128          # the kernels' tile height: row cuts at its multiples where the chunk allows


def row_unit(chunk):
    """Query rows per row block: ROW_TILE for chunks of at least 8 tiles that it divides, else the
    largest divisor of the chunk up to chunk / 8 (small test shapes still get split)."""
    if chunk % ROW_TILE == 0 and chunk >= 8 * ROW_TILE:
        return ROW_TILE
    return next(d for d in range(max(1, chunk // 8), 0, -1) if chunk % d == 0)


@lru_cache(maxsize=8)
def block_work(mask, size):
    """(prefix, unit): prefix[i, b, j] = visible pairs of the first b row blocks of chunk i against
    key chunk j (int64, shape (size, blocks + 1, size)); ``unit`` rows per block."""
    chunk = mask.seqlen // size
    unit = row_unit(chunk)
    lo, hi = mask.intervals
    work = np.empty((mask.seqlen // unit, size), np.int64)
    for j in range(size):
        k0, k1 = j * chunk, (j + 1) * chunk
        work[:, j] = np.clip(np.minimum(hi, k1) - np.maximum(lo, k0), 0, None).reshape(-1, unit).sum(1)
    blocks = chunk // unit
    prefix = np.zeros((size, blocks + 1, size), np.int64)
    prefix[:, 1:, :] = np.cumsum(work.reshape(size, blocks, size), axis=1)
    return prefix, unit


# bytes per token of what travels when a rank computes for another (bf16, GQA 8:1 at D = 128,
# the common training shape; only their ratios matter): a query row and its float32 partial, a key
# chunk's K/V and its float32 dK/dV; a transfer between nodes costs REMOTE times one inside a node
_Q_ROW, _Q_PARTIAL, _KV_ROW, _KV_PARTIAL = 16.0, 33.0, 4.0, 8.0
REMOTE = 6.0
FRAGMENT = 8      # a new piece of query rows costs as much as this many more row blocks


SETTLED = 0.02    # a rank (a node) within this share of the mean work is balanced: smaller moves cost more than they save


@lru_cache(maxsize=16)
def assign(mask, size, near, returns, nodes=None):
    """Every rank's tasks after balancing: a tuple over ranks of tuples (i, j, b0, b1, kind), rows
    [b0, b1) (row blocks) of query chunk i against key chunk j, ``kind`` 'home', 'owner' (the
    other owner computes it) or 'helper' (a third rank). ``nodes``: the node of each rank (None:
    one node).

    Nodes first: while a node holds more than the mean node's work (by SETTLED), its busiest rank
    hands work to a rank of a node under the mean; then inside each node, while a rank holds more
    than the mean, to a rank of its own node. So only each node's excess crosses the network. Each
    move takes the last rows of one of the donor's own pairs, as much work as the donor has over
    the mean and the receiver has under it, to the receiver where it costs the fewest bytes per
    unit of work: the query rows and their partial (rows of that chunk already going there cost
    nothing more: the same rows against another key chunk is more work per byte), the key chunk
    (and its partial) when the receiver does not hold it yet, and FRAGMENT row blocks more for a
    new piece of query rows (fewer, larger pieces: each is a transfer in some step). Diagonal
    pairs move last (their queries and keys are one rank's: moving them starts two transfers)."""
    prefix, unit = block_work(mask, size)
    chunk = mask.seqlen // size
    blocks = prefix.shape[1] - 1
    tasks = [[] for _ in range(size)]
    load = np.zeros(size, np.float64)
    for i in range(size):
        for j in range(size):
            rows = np.flatnonzero(np.diff(prefix[i, :, j]))
            if rows.size:
                home = i if near == "kv" else j
                tasks[home].append([i, j, int(rows[0]), int(rows[-1]) + 1, "home"])
                load[home] += prefix[i, blocks, j]
    mean = load.sum() / size
    # the local pair keeps its first half of rows: the first and the last steps' work
    keep = {i: (b0 + b1 + 1) // 2 for r in range(size) for i, j, b0, b1, _ in tasks[r] if i == j}
    held = [{("kv", r)} for r in range(size)]   # the key chunks each rank holds or will receive
    sent = {}                                    # (rank, query chunk) -> the row blocks of it going there
    node = np.asarray(nodes or (0,) * size)
    count = int(node.max()) + 1
    q_row = _Q_ROW + (_Q_PARTIAL if "q" in returns else 0.0)
    kv_chunk = chunk * (_KV_ROW + (_KV_PARTIAL if "kv" in returns else 0.0))

    def price(h, i, cut, b1, keys):
        """Bytes of moving rows [cut, b1) of query chunk i against key chunks ``keys`` to rank h."""
        nbytes = 0.0
        if h != i:
            lo, hi = sent.get((h, i), (cut, cut))
            new_rows = max(hi, b1) - min(lo, cut) - (hi - lo)
            nbytes = q_row * (new_rows + (0 if (h, i) in sent else FRAGMENT)) * unit
            nbytes *= REMOTE if node[h] != node[i] else 1.0
        return nbytes + sum(kv_chunk * (REMOTE if node[h] != node[j] else 1.0) for j in keys if ("kv", j) not in held[h])

    def best_move(donor, excess, spare, receivers):
        """The cheapest move per unit of work from ``donor``: (score, h, [(task index, cut)], work).
        A move is the last rows of one own pair, or whole rows: the same last rows of every own pair
        of one query chunk (more work for the same query rows and partial)."""
        best = None
        own = [(index, t) for index, t in enumerate(tasks[donor]) if t[4] == "home"]
        options = [[(index, t)] for index, t in own]
        for i in {t[0] for _, t in own}:
            group = [(index, t) for index, t in own if t[0] == i]
            if len(group) > 1:
                options.append(group)
        for option in options:
            i = option[0][1][0]
            lo = max([min(t[2] for _, t in option)] + [keep[t[0]] for _, t in option if t[0] == t[1]])
            hi = max(t[3] for _, t in option)
            if lo >= hi:
                continue
            cuts = np.arange(lo, hi)
            work = sum(prefix[i, t[3], t[1]] - prefix[i, np.clip(cuts, t[2], t[3]), t[1]] for _, t in option)
            for h in receivers:
                if spare[h] <= 0:
                    continue
                amount = min(work[0], excess, spare[h])
                c = int(cuts[min(int(np.argmax(work <= amount)) if (work <= amount).any() else len(cuts) - 1,
                                 len(cuts) - 1)])
                moved = sum(prefix[i, t[3], t[1]] - prefix[i, max(c, t[2]), t[1]] for _, t in option if t[3] > c)
                # a receiver is filled past the mean only to where the donor is left
                if moved <= 0 or (moved > spare[h] + SETTLED * mean / 2 and load[h] + moved > load[donor] - moved):
                    continue
                keys = [t[1] for _, t in option if t[3] > c]
                score = (len(option) == 1 and i == option[0][1][1], price(h, i, c, hi, keys) / moved, h, i, len(option))
                if best is None or score < best[0]:   # a diagonal pair alone moves last
                    best = (score, h, [(index, c) for index, t in option if t[3] > c], moved)
        return best

    def move(donor, best):
        _, h, parts, moved = best
        for index, cut in sorted(parts, reverse=True):
            i, j, b0, b1, kind = tasks[donor][index]
            cut = max(cut, b0)
            if cut == b0:
                tasks[donor].pop(index)
            else:
                tasks[donor][index][3] = cut
            tasks[h].append([i, j, cut, b1, "owner" if h in (i, j) else "helper"])
            held[h].add(("kv", j))
            if h != i:
                lo, hi = sent.get((h, i), (cut, b1))
                sent[(h, i)] = (min(lo, cut), max(hi, b1))
        load[donor] -= moved
        load[h] += moved

    def ship(donor, receivers, amount, spare):
        """Moves from ``donor`` to ``receivers`` until ``amount`` of work has gone; the work moved."""
        gone = 0.0
        while amount - gone > max(1.0, 1e-3 * mean):
            best = best_move(donor, amount - gone, spare, receivers)
            if best is None:
                break
            move(donor, best)
            gone += best[-1]
            spare[best[1]] -= best[-1]
        return gone

    # across nodes: only each node's excess, an equal share from every rank of a heavy node to the
    # rank of the same place in a light node (its rail), so every network link carries as much
    node_load = np.bincount(node, load, count)
    node_mean = node_load.sum() / count
    excess, room = np.maximum(0.0, node_load - node_mean), np.maximum(0.0, node_mean - node_load)
    if count > 1 and excess.max() > SETTLED * node_mean:
        members = [np.flatnonzero(node == n) for n in range(count)]
        for heavy in np.argsort(-excess, kind="stable"):
            for light in np.argsort(-room, kind="stable"):
                flow = min(excess[heavy], room[light])
                if flow <= SETTLED * mean:
                    continue
                excess[heavy] -= flow
                room[light] -= flow
                share = flow / len(members[heavy])
                for place, donor in enumerate(members[heavy]):
                    rail = int(members[light][place % len(members[light])])
                    ship(int(donor), [rail], share, np.full(size, share))
        stuck = set()   # what the rails left (a rank short of rows to move): any rank to any light node
        for _ in range(64 * size * size):
            node_load = np.bincount(node, load, count)
            heavy = int(np.argmax(node_load))
            donors = [int(r) for r in np.flatnonzero(node == heavy) if r not in stuck]
            if node_load[heavy] - node_mean <= SETTLED * node_mean or not donors:
                break
            donor = max(donors, key=lambda r: load[r])
            spare = np.where(node_load[node] < node_mean, np.maximum(0.0, node_mean - node_load[node]), 0.0)
            spare = np.minimum(spare, np.maximum(0.0, mean - load) + SETTLED * mean)
            receivers = [int(h) for h in np.argsort(-spare, kind="stable")[:8] if spare[h] > 0]
            if not receivers or not ship(donor, receivers, node_load[heavy] - node_mean, spare):
                stuck.add(donor)
    stuck = set()   # ranks left with no own rows to hand out
    for _ in range(64 * size * size):   # inside each node
        candidates = [r for r in range(size) if r not in stuck]
        if not candidates:
            break
        donor = max(candidates, key=lambda r: load[r])
        excess = load[donor] - mean
        if excess <= max(1.0, SETTLED * mean):
            break
        spare = np.where(node == node[donor], mean - load, 0.0)
        receivers = [int(h) for h in np.argsort(-spare, kind="stable")[:8] if spare[h] > 0]
        best = best_move(donor, excess, spare, receivers)
        if best is None:
            stuck.add(donor)
            continue
        move(donor, best)
    return tuple(tuple(tuple(t) for t in rank_tasks) for rank_tasks in tasks)


def row_work(mask, size, i, j, lo, hi):
    """Visible pairs of each query row lo..hi-1 of chunk i against key chunk j (int64 array)."""
    chunk = mask.seqlen // size
    first, last = mask.rows(i * chunk + lo, hi - lo)
    return np.clip(np.minimum(last, (j + 1) * chunk) - np.maximum(first, j * chunk), 0, None)


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

    def order(r, task):
        """Work for others first (its partials go home early), then own pairs: the nearest key
        chunk first where no key-side partial returns (each rank starts on different key chunks,
        which mostly live on its own node), else in chunk order (a far pair's partial has time)."""
        i, j, b0, b1, kind = task
        return (kind == "home", (i - j) % size if "kv" not in returns else 0, i, j, b0)

    runs = []   # per rank: (i, j, block) units in order, their cumulative work, the units of step 0
    for r in range(size):
        local = [(r, r, b) for i, j, b0, b1, _ in assigned[r] if i == j == r for b in range(b0, b1)]
        others = [(i, j, b) for i, j, b0, b1, _ in sorted(assigned[r], key=lambda t: order(r, t))
                  if not i == j == r for b in range(b0, b1)]
        runs.append((local, others))
    weight = lambda units: np.array([prefix[i, b + 1, j] - prefix[i, b, j] for i, j, b in units], np.int64)  # noqa: E731
    totals = [int(weight(local).sum() + weight(others).sum()) for local, others in runs]
    # step 0: as much of the local pair as every rank has, up to two steps' work (the first pieces
    # arrive meanwhile; a larger step 0 where any rank lacks the local work would idle the others)
    first = min(min(int(weight(local).sum()) for local, _ in runs), 2 * min(totals) // count) if count > 1 else 0
    for r, (local, others) in enumerate(runs):   # the local pair: step 0's work first, the rest last
        cum = np.cumsum(weight(local))
        split = int(np.searchsorted(cum, first, side="left")) + 1 if first else 0
        units = local[:split] + others + local[split:]
        runs[r] = (units, np.concatenate([[0], np.cumsum(weight(units))]), min(split, len(local)))
    plan, work = [], np.zeros((count, size), np.int64)
    for r, (units, cum, locals_end) in enumerate(runs):
        share = (totals[r] - first) / max(1, count - 1)
        cuts = [(0, 0, 0)]   # (unit index, rows into it, work before the cut)
        for t in range(count - 1):
            target = first + share * t
            if t == 0:
                target = min(target, cum[locals_end])
            u = min(int(np.searchsorted(cum, target, side="right")) - 1, len(units) - 1)
            if u < 0 or not units:
                cuts.append((0, 0, 0))
                continue
            tolerance = 0.02 * max(share, 1.0)
            if target - cum[u] <= tolerance or cum[u + 1] - target <= tolerance:
                u += 1 if cum[u + 1] - target < target - cum[u] else 0
                cut = (u, 0, int(cum[u]))
            else:
                i, j, b = units[u]
                rows = np.concatenate([[0], np.cumsum(row_work(mask, size, i, j, b * unit, (b + 1) * unit))])
                x = int(np.argmin(np.abs(cum[u] + rows - target)))
                cut = (u, x, int(cum[u] + rows[x]))
            cuts.append(max(cuts[-1], cut))
        cuts.append((len(units), 0, totals[r]))
        per_step = []
        for t in range(count):
            (u0, x0, w0), (u1, x1, w1) = cuts[t], cuts[t + 1]
            visits = []
            for u in range(u0, min(u1 + 1, len(units))):
                i, j, b = units[u]
                lo = b * unit + (x0 if u == u0 else 0)
                hi = b * unit + (x1 if u == u1 else unit)
                if lo >= hi:
                    continue
                if visits and visits[-1][:2] == (i, j) and visits[-1][3] == lo:
                    visits[-1] = (i, j, visits[-1][2], hi)
                else:
                    visits.append((i, j, lo, hi))
            per_step.append(tuple(visits))
            work[t, r] = w1 - w0
        plan.append(tuple(per_step))
    work.setflags(write=False)
    return tuple(plan), work


def default_steps(mask, size, near, returns, nodes=None):
    """The number of steps: each about half a full chunk pair's work (a plain causal ring's step:
    P steps), at least 8 (smaller steps: the first pieces arrive and the last partials go home
    behind less idle time; across nodes the network's transfers, posted steps ahead, overlap
    several of them), and at most P."""
    prefix, _ = block_work(mask, size)
    chunk = mask.seqlen // size
    mean = prefix[:, -1, :].sum() / size
    return int(min(size, max(8, round(mean / (chunk * chunk / 2)))))
