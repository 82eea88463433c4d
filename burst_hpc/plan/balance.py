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
   nodes first: each heavy node's excess over the mean node goes to light nodes in pieces, each
   piece from a rank of the heavy node to one of the light node whose network links carry the
   least so far (no NIC carries much more than another); a move whose bytes would take the
   network longer than its work (WORTH), or fill a NIC past NIC_SHARE of the mean work's time,
   stays home, and that node then levels to its own mean. Then inside each node, while a rank
   holds more than the mean (by SETTLED), it hands its last rows to the rank of its node where that costs the
   fewest bytes per unit of work: the last rows of one pair, or whole rows (the same last rows of
   every own pair of one query chunk: its query rows and partial travel once for all their key
   chunks), never filling the receiver past the mean. The local pair keeps its first half of rows.
3. Steps (``work_plan``): each rank's tasks in order (the first rows of its local pair, the work
   it does for others, its own pairs, the rest of the local pair; across nodes the work whose data
   or partial crosses the network in the middle of the rest) are cut into ``steps`` pieces
   of equal work; step 0 holds only local work (nothing has arrived yet), as much as every rank
   has, up to two steps' work. Across nodes the forward then works NEAR_STEPS steps inside its
   node (the first on its local pair) before work whose data crosses the network.

Everything is a pure function of (mask, ranks, near side, returned sides, nodes), cached, so
every rank computes the same plan.
"""
from functools import lru_cache

import numpy as np

from . import masks

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
    work = masks.block_counts(mask, unit, chunk)
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


# a KB over the network (50 GB/s a GPU) takes as long as this many (query, key) pairs of kernel work
# (H100, 600 / 520 TFLOP/s forward / backward, Hq = 64, D = 128: the shape the byte ratios above are for)
NETWORK_KB_PAIRS = {"forward": 375.0, "backward": 130.0}
NIC_SHARE = 0.8   # moves between nodes fill no rank's network link past this share of the mean work's time
BEFORE = 0.5      # the share of its work inside the node a rank runs before its work across nodes
# across nodes, the steps after step 0 a rank works inside its node (where it has the work) before work
# whose data crosses the network (that data, posted at step 0, arrives under them), and the first of
# them on its local pair (the owners' links then have two steps for the first pieces they send). The
# backward's steps are ~3x longer for the same bytes: step 0 hides its first pieces, and work pulled
# forward is missed at the end (the model: 64 GPUs, three document sets, 335 -> 328 TFLOP/s with it)
NEAR_STEPS = {"forward": 2, "backward": 0}
LOCAL_STEPS = {"forward": 1, "backward": 0}
WORTH = 1.0       # a move between nodes whose bytes take longer than WORTH times its work stays home

SETTLED = 0.02    # a rank (a node) within this share of the mean work is balanced: smaller moves cost more than they save


@lru_cache(maxsize=16)
def assign(mask, size, near, returns, nodes=None):
    """Every rank's tasks after balancing: a tuple over ranks of tuples (i, j, b0, b1, kind), rows
    [b0, b1) (row blocks) of query chunk i against key chunk j, ``kind`` 'home', 'owner' (the
    other owner computes it) or 'helper' (a third rank). ``nodes``: the node of each rank (None:
    one node).

    Nodes first: each node's work over the mean node's (by SETTLED) goes to nodes under it, in
    pieces, each from a rank over the mean to the rank of the light node whose network links then
    carry the least, as long as the move's bytes take the network no longer than WORTH times its
    work and fill no link past NIC_SHARE of the mean work's time; then inside each node, while a
    rank holds more than the mean (its node's, where excess stayed home), to a rank of its own
    node. So only each node's excess crosses the network, where that pays. Each
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
    busy = np.diff(prefix, axis=1) != 0   # [i, row block, j]: the block sees keys of chunk j
    first, last = busy.argmax(axis=1), blocks - 1 - busy[:, ::-1, :].argmax(axis=1)
    for i, j in zip(*(x.tolist() for x in np.nonzero(busy.any(axis=1)))):
        home = i if near == "kv" else j
        tasks[home].append([i, j, int(first[i, j]), int(last[i, j]) + 1, "home"])
        load[home] += prefix[i, blocks, j]
    mean = load.sum() / size
    # the local pair keeps its first half of rows: the first and the last steps' work
    keep = {i: (b0 + b1 + 1) // 2 for r in range(size) for i, j, b0, b1, _ in tasks[r] if i == j}
    held = np.eye(size, dtype=bool)   # [rank, key chunk]: it holds the chunk or will receive it
    # [rank, query chunk] -> the row blocks [first, last) of it going there (-1: none)
    sent_first, sent_last = np.full((size, size), -1, np.int64), np.full((size, size), -1, np.int64)
    node = np.asarray(nodes or (0,) * size)
    count = int(node.max()) + 1
    pairs_per_kb = NETWORK_KB_PAIRS["backward" if "kv" in returns else "forward"]
    nic = np.zeros(size)   # bytes (REMOTE-weighted) that moves send across each rank's network link
    nic_budget = NIC_SHARE * mean / pairs_per_kb * REMOTE
    reached = node[None, :] == np.arange(count)[:, None]   # [node, key chunk]: the node holds it
    q_row = _Q_ROW + (_Q_PARTIAL if "q" in returns else 0.0)
    kv_chunk = chunk * (_KV_ROW + (_KV_PARTIAL if "kv" in returns else 0.0))

    def price(h, i, cut, b1, keys):
        """Bytes of moving rows [cut, b1) of query chunk i against key chunks ``keys`` to rank h."""
        nbytes = 0.0
        if h != i:
            known = sent_first[h, i] >= 0
            lo, hi = (int(sent_first[h, i]), int(sent_last[h, i])) if known else (cut, cut)
            new_rows = max(hi, b1) - min(lo, cut) - (hi - lo)
            nbytes = q_row * (new_rows + (0 if known else FRAGMENT)) * unit
            nbytes *= REMOTE if node[h] != node[i] else 1.0
        # a key chunk crosses the network once per node (schedule.relays), then NVLink
        return nbytes + sum(kv_chunk * (REMOTE if not reached[node[h], j] else 1.0) for j in keys if not held[h, j])

    def prices(h, i, cut, b1, j):
        """price of moving one pair's rows, for arrays of moves (keys [j]: the pair's key chunk)."""
        known = sent_first[h, i] >= 0
        lo, hi = np.where(known, sent_first[h, i], cut), np.where(known, sent_last[h, i], cut)
        new_rows = np.maximum(hi, b1) - np.minimum(lo, cut) - (hi - lo)
        nbytes = q_row * (new_rows + np.where(known, 0, FRAGMENT)) * unit
        nbytes = np.where(h != i, nbytes * np.where(node[h] != node[i], REMOTE, 1.0), 0.0)
        return nbytes + np.where(held[h, j], 0.0, kv_chunk * np.where(reached[node[h], j], 1.0, REMOTE))

    keep_of = np.full(size, -1, np.int64)   # keep, by query chunk
    for i, rows in keep.items():
        keep_of[i] = rows

    def best_move(donor, excess, spare, receivers):
        """The cheapest move per unit of work from ``donor``: (score, h, [(task index, cut)], work).
        A move is the last rows of one own pair, or whole rows: the same last rows of every own pair
        of one query chunk (more work for the same query rows and partial)."""
        best = None
        receivers = [h for h in receivers if node[h] == node[donor] or max(nic[donor], nic[h]) < nic_budget]
        takers = np.array([h for h in receivers if spare[h] > 0], np.int64)
        if not takers.size:
            return None
        own = [(index, t) for index, t in enumerate(tasks[donor]) if t[4] == "home"]

        def consider(option, i, hi, h, c, moved):
            """Keep the move of ``option``'s rows from block c to rank h if it is the best so far."""
            nonlocal best
            keys = [t[1] for _, t in option if t[3] > c]
            nbytes = price(h, i, c, hi, keys)
            if node[h] != node[donor] and (nbytes / REMOTE * pairs_per_kb > WORTH * moved
                                           or max(nic[donor], nic[h]) + nbytes > nic_budget):
                return   # the network would take longer than the work it moves, or fill a NIC
            score = (len(option) == 1 and i == option[0][1][1], nbytes / moved, h, i, len(option))
            if best is None or score < best[0]:   # a diagonal pair alone moves last
                best = (score, h, [(index, c) for index, t in option if t[3] > c], moved, nbytes)

        def fitting(moved):
            """Where a move fits its receiver: it moves work, and fills a receiver past the mean
            only to where the donor is left."""
            return (moved > 0) & ~((moved > spare[takers] + SETTLED * mean / 2) &
                                   (load[takers] + moved > load[donor] - moved))

        # the last rows of one own pair, every pair at once: the work moved by a cut at each row block
        # (it never grows with the cut; past a pair's last block it is 0, never more than an amount)
        if own:
            i, j, b0, b1 = np.array([t[:4] for _, t in own], np.int64).T
            lo = np.where(i == j, np.maximum(b0, keep_of[i]), b0)
            blocks = np.minimum(lo[:, None] + np.arange(max(1, int((b1 - lo).max()))), b1[:, None])
            work = prefix[i, b1, j][:, None] - prefix[i[:, None], blocks, j[:, None]]
            amounts = np.minimum(np.minimum(work[:, 0], excess)[:, None], spare[takers])
            # the first cut that moves at most the amount (the last when none does)
            at = np.minimum((work[:, :, None] > amounts[:, None, :]).sum(axis=1), (b1 - lo - 1)[:, None])
            moved = work[np.arange(len(own))[:, None], at]
            n, k = np.nonzero((lo < b1)[:, None] & fitting(moved))
            h, c, moved = takers[k], lo[n] + at[n, k], moved[n, k]
            nbytes = prices(h, i[n], c, b1[n], j[n])
            # the network would take longer than the work it moves, or fill a NIC
            ok = (node[h] == node[donor]) | ~((nbytes / REMOTE * pairs_per_kb > WORTH * moved) |
                                              (np.maximum(nic[donor], nic[h]) + nbytes > nic_budget))
            if ok.any():   # the least score (a diagonal pair alone moves last), the first of equals
                ratio = nbytes / moved
                m = np.flatnonzero(ok)[np.lexsort((i[n][ok], h[ok], ratio[ok], (i == j)[n][ok]))[0]]
                best = ((bool(i[n[m]] == j[n[m]]), ratio[m], int(h[m]), int(i[n[m]]), 1), int(h[m]),
                        [(own[n[m]][0], int(c[m]))], moved[m], float(nbytes[m]))
        # whole rows: the same last rows of every own pair of one query chunk
        for chunk in {t[0] for _, t in own}:
            option = [(index, t) for index, t in own if t[0] == chunk]
            if len(option) == 1:
                continue
            lo = max([min(t[2] for _, t in option)] + [keep[t[0]] for _, t in option if t[0] == t[1]])
            hi = max(t[3] for _, t in option)
            if lo >= hi:
                continue
            cuts = np.arange(lo, hi)
            b0, j, b1 = (np.array([t[n] for _, t in option])[:, None] for n in (2, 1, 3))
            work = (prefix[chunk, b1, j] - prefix[chunk, np.clip(cuts, b0, b1), j]).sum(axis=0)
            amounts = np.minimum(min(work[0], excess), spare[takers])
            at = np.minimum(np.searchsorted(-work, -amounts, side="left"), len(cuts) - 1)
            moved = work[at]
            for k in np.flatnonzero(fitting(moved)):
                consider(option, chunk, hi, int(takers[k]), int(cuts[at[k]]), moved[k])
        return best

    def move(donor, best):
        _, h, parts, moved, nbytes = best
        if node[h] != node[donor]:
            nic[donor] += nbytes
            nic[h] += nbytes
        for j in {tasks[donor][index][1] for index, _ in parts if not reached[node[h], tasks[donor][index][1]]}:
            nic[j] += kv_chunk * REMOTE
            reached[node[h], j] = True
        for index, cut in sorted(parts, reverse=True):
            i, j, b0, b1, kind = tasks[donor][index]
            cut = max(cut, b0)
            if cut == b0:
                tasks[donor].pop(index)
            else:
                tasks[donor][index][3] = cut
            tasks[h].append([i, j, cut, b1, "owner" if h in (i, j) else "helper"])
            held[h, j] = True
            if h != i:
                known = sent_first[h, i] >= 0
                lo, hi = (int(sent_first[h, i]), int(sent_last[h, i])) if known else (cut, b1)
                sent_first[h, i], sent_last[h, i] = min(lo, cut), max(hi, b1)
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
            gone += best[3]
            spare[best[1]] -= best[3]
        return gone

    # across nodes: only each node's excess, in pieces of an equal share per rank of the heavy node,
    # each from the rank of the heavy node to the rank of the light node whose network links then
    # carry the least (a move's bytes cross both): no NIC carries much more than another
    node_load = np.bincount(node, load, count)
    node_mean = node_load.sum() / count
    excess, room = np.maximum(0.0, node_load - node_mean), np.maximum(0.0, node_mean - node_load)
    if count > 1 and excess.max() > SETTLED * node_mean:
        members = [[int(r) for r in np.flatnonzero(node == n)] for n in range(count)]
        for heavy in np.argsort(-excess, kind="stable"):
            for light in np.argsort(-room, kind="stable"):
                flow = min(excess[heavy], room[light])
                if flow <= SETTLED * mean:
                    continue
                excess[heavy] -= flow
                room[light] -= flow
                piece, gone, stuck = flow / len(members[heavy]), 0.0, set()
                for _ in range(8 * len(members[heavy])):
                    if flow - gone <= max(1.0, 1e-3 * mean):
                        break
                    amount, best, best_key = min(piece, flow - gone), None, None
                    # no rank of the light node filled past the mean: it could not hand helper work on
                    spare = np.minimum(amount, np.maximum(0.0, mean - load) + SETTLED * mean / 2)
                    # the ranks over the mean give first (what they keep, the rest cannot take inside the
                    # node), the two whose links carry least, to the two of the light node likewise
                    over = [r for r in members[heavy] if r not in stuck and load[r] - mean > SETTLED * mean / 2]
                    donors = sorted(over or [r for r in members[heavy] if r not in stuck], key=lambda r: nic[r])[:2]
                    receivers = sorted([h for h in members[light] if spare[h] > 0], key=lambda h: nic[h])[:2]
                    for donor in donors:
                        option = best_move(donor, min(amount, load[donor] - mean) if over else amount, spare, receivers)
                        if option is None:
                            stuck.add(donor)
                            continue
                        h = option[1]
                        if load[h] + option[3] > (1 + SETTLED) * mean:
                            continue
                        # key chunks the light node gets for the first time: their owners send them
                        owners = {tasks[donor][index][1] for index, _ in option[2]
                                  if not reached[light, tasks[donor][index][1]]}
                        key = max([nic[donor], nic[h]] + [nic[j] + kv_chunk * REMOTE for j in owners])
                        key += option[0][1] * amount
                        if best_key is None or key < best_key:
                            best, best_key = (donor, option), key
                    if best is None:
                        break
                    move(*best)
                    gone += best[1][3]
    # inside each node, to the mean (a node whose excess stays home: to its own mean)
    target = np.maximum(mean, (np.bincount(node, load, count) / np.bincount(node, minlength=count))[node])
    stuck = set()   # ranks left with no own rows to hand out
    for _ in range(64 * size * size):
        candidates = [r for r in range(size) if r not in stuck]
        if not candidates:
            break
        donor = max(candidates, key=lambda r: load[r] - target[r])
        excess = load[donor] - target[donor]
        if excess <= max(1.0, SETTLED * mean):
            break
        spare = np.where(node == node[donor], target - load, 0.0)
        receivers = [int(h) for h in np.argsort(-spare, kind="stable")[:8] if spare[h] > 0]
        best = best_move(donor, excess, spare, receivers)
        if best is None:
            stuck.add(donor)
            continue
        move(donor, best)
    return tuple(tuple(tuple(t) for t in rank_tasks) for rank_tasks in tasks)


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

    def weight(units):
        """The work of each unit (rows of a (i, j, block) int array)."""
        return prefix[units[:, 0], units[:, 2] + 1, units[:, 1]] - prefix[units[:, 0], units[:, 2], units[:, 1]]

    def far_of(r):
        """far(units): whether each unit's data or partial crosses the network (rank r's node)."""
        if node is None:
            return lambda units: np.zeros(len(units), bool)
        return lambda units: ~((node[units[:, 0]] == node[r]) & (node[units[:, 1]] == node[r]))

    def expand(tasks):
        """The units (i, j, block) of tasks (i, j, b0, b1), in order."""
        tasks = np.asarray(tasks, np.int64).reshape(-1, 4)
        lengths = tasks[:, 3] - tasks[:, 2]
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        blocks = np.arange(lengths.sum()) - starts + np.repeat(tasks[:, 2], lengths)
        return np.column_stack([np.repeat(tasks[:, 0], lengths), np.repeat(tasks[:, 1], lengths), blocks])

    def middle(units, far, turn, r):
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
        cum = np.cumsum(weight(close))
        split = int(np.searchsorted(cum, cum[-1] * BEFORE))
        return np.concatenate([close[:split], away, close[split:]])

    def order(r, task):
        """Work for others first (its partials go home early), then own pairs: the nearest key
        chunk first where no key-side partial returns (each rank starts on different key chunks,
        which mostly live on its own node), else in chunk order (a far pair's partial has time)."""
        i, j, b0, b1, kind = task
        return (kind == "home", (i - j) % size if "kv" not in returns else 0, i, j, b0)

    def inside_first(units, need, far):
        """``units`` with work inside the node (the nearest after it first) moved before the first
        unit whose data or partial crosses the network until ``need`` work comes before it: its
        data, posted at step 0, then arrives under that work besides step 0's."""
        crossing = far(units)
        if not crossing.any():
            return units
        first = int(np.argmax(crossing))
        head, rest, crossing = units[:first], units[first:], crossing[first:]
        done = int(weight(head).sum())
        inside = np.flatnonzero(~crossing)
        before = done + np.concatenate([[0], np.cumsum(weight(rest[inside]))[:-1]]) if len(inside) else inside
        taken = np.zeros(len(rest), bool)
        taken[inside[before < need]] = True   # while less than ``need`` comes before it
        return np.concatenate([head, rest[taken], rest[~taken]])

    runs = []   # per rank: (i, j, block) units in order, their cumulative work, the units of step 0
    for r in range(size):
        local = expand([t[:4] for t in assigned[r] if t[0] == t[1] == r])
        others = expand([t[:4] for t in sorted(assigned[r], key=lambda t: order(r, t)) if not t[0] == t[1] == r])
        turn = 0 if nodes is None else sum(1 for x in range(r) if nodes[x] == nodes[r])   # its place in its node
        runs.append((local, middle(others, far_of(r), turn, r), far_of(r)))
    totals = [int(weight(local).sum() + weight(others).sum()) for local, others, _ in runs]
    # step 0: as much of the local pair as every rank has, up to two steps' work (the first pieces
    # arrive meanwhile; a larger step 0 where any rank lacks the local work would idle the others)
    first = min(min(int(weight(local).sum()) for local, _, _ in runs), 2 * min(totals) // count) if count > 1 else 0
    for r, (local, others, far) in enumerate(runs):   # the local pair: step 0's work first, the rest last
        cum = np.cumsum(weight(local))
        split = int(np.searchsorted(cum, first, side="left")) + 1 if first else 0
        share = (totals[r] - first) / max(1, count - 1)
        units = np.concatenate([local[:split], others, local[split:]])
        if nodes is not None:
            units = inside_first(units, first + NEAR_STEPS[direction] * share, far)
            units = inside_first(units, first + LOCAL_STEPS[direction] * share,
                                 lambda u: ~((u[:, 0] == r) & (u[:, 1] == r)))
        runs[r] = (units, np.concatenate([[0], np.cumsum(weight(units))]), min(split, len(local)))
    plan, work = [], np.zeros((count, size), np.int64)
    for r, (units, cum, locals_end) in enumerate(runs):
        share = (totals[r] - first) / max(1, count - 1)
        cuts = [(0, 0, 0)] + step_cuts(mask, size, unit, units, cum, locals_end, first, share, count)
        cuts.append((len(units), 0, totals[r]))
        work[:, r] = np.diff([w for _, _, w in cuts])
        plan.append(visits_of(units, unit, cuts))
    work.setflags(write=False)
    return tuple(plan), work


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
    step = np.repeat(np.arange(count), lengths)
    at = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths) + np.repeat(first, lengths)
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
