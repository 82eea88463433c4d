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

The steps (each rank's tasks in order, cut into steps of equal work): workplan.py.

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
    deal = _Deal(mask, size, near, returns, nodes)
    deal.across_nodes()
    deal.inside_nodes()
    return tuple(tuple(tuple(t) for t in rank_tasks) for rank_tasks in deal.tasks)


class _Deal:
    """The state of ``assign`` while it moves work: each rank's tasks and load, the key chunks each
    rank (node) holds or will receive, the query rows going to each rank, the bytes on each NIC."""

    def __init__(self, mask, size, near, returns, nodes):
        prefix, self.unit = block_work(mask, size)
        self.prefix = prefix
        self.size = size
        chunk = mask.seqlen // size
        blocks = prefix.shape[1] - 1
        self.tasks = [[] for _ in range(size)]
        self.load = np.zeros(size, np.float64)
        busy = np.diff(prefix, axis=1) != 0   # [i, row block, j]: the block sees keys of chunk j
        first, last = busy.argmax(axis=1), blocks - 1 - busy[:, ::-1, :].argmax(axis=1)
        for i, j in zip(*(x.tolist() for x in np.nonzero(busy.any(axis=1)))):
            home = i if near == "kv" else j
            self.tasks[home].append([i, j, int(first[i, j]), int(last[i, j]) + 1, "home"])
            self.load[home] += prefix[i, blocks, j]
        self.mean = self.load.sum() / size
        # the local pair keeps its first half of rows: the first and the last steps' work
        self.keep = {i: (b0 + b1 + 1) // 2 for r in range(size) for i, j, b0, b1, _ in self.tasks[r] if i == j}
        self.held = np.eye(size, dtype=bool)   # [rank, key chunk]: it holds the chunk or will receive it
        # [rank, query chunk] -> the row blocks [first, last) of it going there (-1: none)
        self.sent_first, self.sent_last = np.full((size, size), -1, np.int64), np.full((size, size), -1, np.int64)
        self.node = node = np.asarray(nodes or (0,) * size)
        self.count = int(node.max()) + 1
        self.pairs_per_kb = NETWORK_KB_PAIRS["backward" if "kv" in returns else "forward"]
        self.nic = np.zeros(size)   # bytes (REMOTE-weighted) that moves send across each rank's network link
        self.nic_budget = NIC_SHARE * self.mean / self.pairs_per_kb * REMOTE
        self.reached = node[None, :] == np.arange(self.count)[:, None]   # [node, key chunk]: the node holds it
        self.q_row = _Q_ROW + (_Q_PARTIAL if "q" in returns else 0.0)
        self.kv_chunk = chunk * (_KV_ROW + (_KV_PARTIAL if "kv" in returns else 0.0))
        self.keep_of = np.full(size, -1, np.int64)   # keep, by query chunk
        for i, rows in self.keep.items():
            self.keep_of[i] = rows

    def price(self, h, i, cut, b1, keys):
        """Bytes of moving rows [cut, b1) of query chunk i against key chunks ``keys`` to rank h."""
        node = self.node
        nbytes = 0.0
        if h != i:
            known = self.sent_first[h, i] >= 0
            lo, hi = (int(self.sent_first[h, i]), int(self.sent_last[h, i])) if known else (cut, cut)
            new_rows = max(hi, b1) - min(lo, cut) - (hi - lo)
            nbytes = self.q_row * (new_rows + (0 if known else FRAGMENT)) * self.unit
            nbytes *= REMOTE if node[h] != node[i] else 1.0
        # a key chunk crosses the network once per node (schedule.relays), then NVLink
        return nbytes + sum(self.kv_chunk * (REMOTE if not self.reached[node[h], j] else 1.0)
                            for j in keys if not self.held[h, j])

    def prices(self, h, i, cut, b1, j):
        """price of moving one pair's rows, for arrays of moves (keys [j]: the pair's key chunk)."""
        node = self.node
        known = self.sent_first[h, i] >= 0
        lo, hi = np.where(known, self.sent_first[h, i], cut), np.where(known, self.sent_last[h, i], cut)
        new_rows = np.maximum(hi, b1) - np.minimum(lo, cut) - (hi - lo)
        nbytes = self.q_row * (new_rows + np.where(known, 0, FRAGMENT)) * self.unit
        nbytes = np.where(h != i, nbytes * np.where(node[h] != node[i], REMOTE, 1.0), 0.0)
        return nbytes + np.where(self.held[h, j], 0.0, self.kv_chunk * np.where(self.reached[node[h], j], 1.0, REMOTE))

    def best_move(self, donor, excess, spare, receivers):
        """The cheapest move per unit of work from ``donor``: (score, h, [(task index, cut)], work, bytes).
        A move is the last rows of one own pair, or whole rows: the same last rows of every own pair
        of one query chunk (more work for the same query rows and partial)."""
        node, nic = self.node, self.nic
        receivers = [h for h in receivers if node[h] == node[donor] or max(nic[donor], nic[h]) < self.nic_budget]
        takers = np.array([h for h in receivers if spare[h] > 0], np.int64)
        if not takers.size:
            return None
        own = [(index, t) for index, t in enumerate(self.tasks[donor]) if t[4] == "home"]
        best = self.pair_move(donor, own, excess, spare, takers) if own else None
        for option in self.row_options(own):
            for candidate in self.row_moves(donor, option, excess, spare, takers):
                if best is None or candidate[0] < best[0]:   # a diagonal pair alone moves last
                    best = candidate
        return best

    def fitting(self, donor, moved, spare, takers):
        """Where a move fits its receiver: it moves work, and fills a receiver past the mean only to
        where the donor is left."""
        return (moved > 0) & ~((moved > spare[takers] + SETTLED * self.mean / 2) &
                               (self.load[takers] + moved > self.load[donor] - moved))

    def pair_move(self, donor, own, excess, spare, takers):
        """The best move of the last rows of one own pair, every pair at once: the work moved by a cut
        at each row block (it never grows with the cut; past a pair's last block it is 0, never more
        than an amount); None when none fits."""
        node, nic, prefix = self.node, self.nic, self.prefix
        i, j, b0, b1 = np.array([t[:4] for _, t in own], np.int64).T
        lo = np.where(i == j, np.maximum(b0, self.keep_of[i]), b0)
        blocks = np.minimum(lo[:, None] + np.arange(max(1, int((b1 - lo).max()))), b1[:, None])
        work = prefix[i, b1, j][:, None] - prefix[i[:, None], blocks, j[:, None]]
        amounts = np.minimum(np.minimum(work[:, 0], excess)[:, None], spare[takers])
        # the first cut that moves at most the amount (the last when none does)
        at = np.minimum((work[:, :, None] > amounts[:, None, :]).sum(axis=1), (b1 - lo - 1)[:, None])
        moved = work[np.arange(len(own))[:, None], at]
        n, k = np.nonzero((lo < b1)[:, None] & self.fitting(donor, moved, spare, takers))
        h, c, moved = takers[k], lo[n] + at[n, k], moved[n, k]
        nbytes = self.prices(h, i[n], c, b1[n], j[n])
        # the network would take longer than the work it moves, or fill a NIC
        ok = (node[h] == node[donor]) | ~((nbytes / REMOTE * self.pairs_per_kb > WORTH * moved) |
                                          (np.maximum(nic[donor], nic[h]) + nbytes > self.nic_budget))
        if not ok.any():
            return None
        # the least score (a diagonal pair alone moves last), the first of equals
        ratio = nbytes / moved
        m = np.flatnonzero(ok)[np.lexsort((i[n][ok], h[ok], ratio[ok], (i == j)[n][ok]))[0]]
        return ((bool(i[n[m]] == j[n[m]]), ratio[m], int(h[m]), int(i[n[m]]), 1), int(h[m]),
                [(own[n[m]][0], int(c[m]))], moved[m], float(nbytes[m]))

    @staticmethod
    def row_options(own):
        """The own pairs of each query chunk that has several: whole rows move together."""
        for chunk in {t[0] for _, t in own}:
            option = [(index, t) for index, t in own if t[0] == chunk]
            if len(option) > 1:
                yield option

    def row_moves(self, donor, option, excess, spare, takers):
        """The moves that fit of whole rows: the same last rows of every pair of ``option`` (one query chunk)."""
        chunk = option[0][1][0]
        lo = max([min(t[2] for _, t in option)] + [self.keep[t[0]] for _, t in option if t[0] == t[1]])
        hi = max(t[3] for _, t in option)
        if lo >= hi:
            return
        cuts = np.arange(lo, hi)
        b0, j, b1 = (np.array([t[n] for _, t in option])[:, None] for n in (2, 1, 3))
        work = (self.prefix[chunk, b1, j] - self.prefix[chunk, np.clip(cuts, b0, b1), j]).sum(axis=0)
        amounts = np.minimum(min(work[0], excess), spare[takers])
        at = np.minimum(np.searchsorted(-work, -amounts, side="left"), len(cuts) - 1)
        moved = work[at]
        for k in np.flatnonzero(self.fitting(donor, moved, spare, takers)):
            h, c = int(takers[k]), int(cuts[at[k]])
            keys = [t[1] for _, t in option if t[3] > c]
            nbytes = self.price(h, chunk, c, hi, keys)
            if self.node[h] != self.node[donor] and (
                    nbytes / REMOTE * self.pairs_per_kb > WORTH * moved[k]
                    or max(self.nic[donor], self.nic[h]) + nbytes > self.nic_budget):
                continue   # the network would take longer than the work it moves, or fill a NIC
            score = (len(option) == 1 and chunk == option[0][1][1], nbytes / moved[k], h, chunk, len(option))
            yield score, h, [(index, c) for index, t in option if t[3] > c], moved[k], nbytes

    def move(self, donor, best):
        """Make the move ``best`` (best_move's) from ``donor``."""
        _, h, parts, moved, nbytes = best
        node, nic, tasks = self.node, self.nic, self.tasks
        if node[h] != node[donor]:
            nic[donor] += nbytes
            nic[h] += nbytes
        for j in {tasks[donor][index][1] for index, _ in parts if not self.reached[node[h], tasks[donor][index][1]]}:
            nic[j] += self.kv_chunk * REMOTE
            self.reached[node[h], j] = True
        for index, cut in sorted(parts, reverse=True):
            i, j, b0, b1, kind = tasks[donor][index]
            cut = max(cut, b0)
            if cut == b0:
                tasks[donor].pop(index)
            else:
                tasks[donor][index][3] = cut
            tasks[h].append([i, j, cut, b1, "owner" if h in (i, j) else "helper"])
            self.held[h, j] = True
            if h != i:
                known = self.sent_first[h, i] >= 0
                lo, hi = (int(self.sent_first[h, i]), int(self.sent_last[h, i])) if known else (cut, b1)
                self.sent_first[h, i], self.sent_last[h, i] = min(lo, cut), max(hi, b1)
        self.load[donor] -= moved
        self.load[h] += moved

    def across_nodes(self):
        """Only each node's excess crosses the network, in pieces of an equal share per rank of the
        heavy node, each from the rank of the heavy node to the rank of the light node whose network
        links then carry the least (a move's bytes cross both): no NIC carries much more than another."""
        node, count, mean = self.node, self.count, self.mean
        node_load = np.bincount(node, self.load, count)
        node_mean = node_load.sum() / count
        excess, room = np.maximum(0.0, node_load - node_mean), np.maximum(0.0, node_mean - node_load)
        if count < 2 or excess.max() <= SETTLED * node_mean:
            return
        members = [[int(r) for r in np.flatnonzero(node == n)] for n in range(count)]
        for heavy in np.argsort(-excess, kind="stable"):
            for light in np.argsort(-room, kind="stable"):
                flow = min(excess[heavy], room[light])
                if flow <= SETTLED * mean:
                    continue
                excess[heavy] -= flow
                room[light] -= flow
                self.send(members[heavy], members[light], light, flow)

    def send(self, heavy, light, light_node, flow):
        """Moves from the ranks ``heavy`` of one node to the ranks ``light`` of node ``light_node``
        until ``flow`` of work has gone (or nothing more moves)."""
        load, nic, mean, tasks = self.load, self.nic, self.mean, self.tasks
        piece, gone, stuck = flow / len(heavy), 0.0, set()
        for _ in range(8 * len(heavy)):
            if flow - gone <= max(1.0, 1e-3 * mean):
                break
            amount, best, best_key = min(piece, flow - gone), None, None
            # no rank of the light node filled past the mean: it could not hand helper work on
            spare = np.minimum(amount, np.maximum(0.0, mean - load) + SETTLED * mean / 2)
            # the ranks over the mean give first (what they keep, the rest cannot take inside the
            # node), the two whose links carry least, to the two of the light node likewise
            over = [r for r in heavy if r not in stuck and load[r] - mean > SETTLED * mean / 2]
            donors = sorted(over or [r for r in heavy if r not in stuck], key=lambda r: nic[r])[:2]
            receivers = sorted([h for h in light if spare[h] > 0], key=lambda h: nic[h])[:2]
            for donor in donors:
                option = self.best_move(donor, min(amount, load[donor] - mean) if over else amount, spare, receivers)
                if option is None:
                    stuck.add(donor)
                    continue
                h = option[1]
                if load[h] + option[3] > (1 + SETTLED) * mean:
                    continue
                # key chunks the light node gets for the first time: their owners send them
                owners = {tasks[donor][index][1] for index, _ in option[2]
                          if not self.reached[light_node, tasks[donor][index][1]]}
                key = max([nic[donor], nic[h]] + [nic[j] + self.kv_chunk * REMOTE for j in owners])
                key += option[0][1] * amount
                if best_key is None or key < best_key:
                    best, best_key = (donor, option), key
            if best is None:
                break
            self.move(*best)
            gone += best[1][3]

    def inside_nodes(self):
        """Inside each node, to the mean (a node whose excess stays home: to its own mean)."""
        node, count, load, size = self.node, self.count, self.load, self.size
        target = np.maximum(self.mean, (np.bincount(node, load, count) / np.bincount(node, minlength=count))[node])
        stuck = set()   # ranks left with no own rows to hand out
        for _ in range(64 * size * size):
            candidates = [r for r in range(size) if r not in stuck]
            if not candidates:
                break
            donor = max(candidates, key=lambda r: load[r] - target[r])
            excess = load[donor] - target[donor]
            if excess <= max(1.0, SETTLED * self.mean):
                break
            spare = np.where(node == node[donor], target - load, 0.0)
            receivers = [int(h) for h in np.argsort(-spare, kind="stable")[:8] if spare[h] > 0]
            best = self.best_move(donor, excess, spare, receivers)
            if best is None:
                stuck.add(donor)
                continue
            self.move(donor, best)
