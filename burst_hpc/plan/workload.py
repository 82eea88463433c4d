"""The work and the traffic of a call's schedule, step by step: ``schedule_work`` (public: tests,
plots and the cost model share this one account), the bytes each rank sends and receives at each
step, and the document sets the balance figures and the planner draw (equal, uniform, lognormal
lengths; MagiAttention's "up to S/4")."""
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from . import masks, schedule, tiles, workplan
from .packing import packing
from ..errors import BurstError, MaskError
from .layout import check_layout, make_layout
from .schedule import balanced_by_schedule, double_ring_steps, held_pieces, plain_ring_steps, steps as schedule_steps

# near side, returned sides: the forward, the backward's kv-ring and its q-ring
DIRECTIONS = {"forward": ("kv", ("q",)), "backward": ("kv", ("kv", "q")), "backward-q": ("q", ("kv", "q"))}


def schedule_work(seqlen, size, *, causal=False, window=None, cu_seqlens=None, layout=None, direction="forward"):
    """The visible (query, key) pairs each rank computes at each step of the ring.

    Parameters
    ----------
    seqlen : int
        Tokens in the whole sequence (every rank holds seqlen / size).
    size : int
        Ranks of the ring.
    causal, window, cu_seqlens
        The mask whose visible pairs are counted, as burst_attention takes it.
    layout : Layout, optional
        Whose tokens each rank holds (make_layout makes one of a name; the chunks layout of this
        mask). Default: the balanced layout.
    direction : {'forward', 'backward', 'backward-q'}
        The forward ring, or the backward's kv-ring or q-ring.

    Returns
    -------
    int64 array (steps, ranks). Its column sums are each rank's work; ``work.max(1).sum()`` is
    the critical path (what a ring waits for: the busiest rank of every step).

    Raises
    ------
    MaskError, LayoutError
        A bad mask, or a length that does not split over ``size`` ranks in ``layout``.
    """
    mask = masks.make(seqlen, causal, window, cu_seqlens)
    layout = make_layout("balanced", seqlen, size) if layout is None else check_layout(layout, seqlen, size)
    if direction not in DIRECTIONS:
        raise BurstError(f"direction must be one of {', '.join(DIRECTIONS)}; got {direction!r}")
    return work_of(layout, mask, direction).copy()


@lru_cache(maxsize=32)
def work_of(layout, mask, direction, per_node=None):
    """schedule_work on checked arguments (``layout`` a layout.Layout; ``mask`` the call's masks.Mask;
    ``per_node`` ranks a node, rank order node by node: None, one node), cached and read-only: the
    flat ring's account."""
    return account(layout, mask, "ring", direction, per_node).work


KINDS = (("data", "kv"), ("data", "q"), ("partial", "q"), ("partial", "kv"))   # (what, side) of a transfer


@dataclass(frozen=True, eq=False)
class Account:
    """A pass of one scheme as its schedule runs it (``account``): what the cost model prices.

    ``work`` (steps, ranks) int64: the visible (query, key) pairs each rank computes at each step
    (Ulysses: for its share of the heads, on its node's tokens); ``launches`` (steps, ranks) int64:
    the block calls it makes for them (schedule.block_pairs: one per block pair the engine runs, each
    with its fixed cost); ``tiles`` (steps, ranks, len(tiles.COUNTS)) float64: the tiles those calls'
    kernels run, per head (tiles.call_tiles: what the kernels' time follows). ``ends``: every link end a
    transfer uses, as int64 arrays of one length, ordered by the step that posts it, then by link end,
    then as the engine posts them (by due step):
    ``posted``, ``due``, ``rank``, ``far`` (between nodes), ``out`` (the sender's end, else the
    receiver's), ``kind`` (an index into KINDS) and ``tokens``. A ring and a double ring are the
    same at every rank up to a rotation, so only some ranks' ends are listed (the ranks of one
    node for the ring: whether a neighbour is across the network depends on the local rank; one
    rank for the double ring and Ulysses, whose rails are alike); the balanced schedule lists
    every rank's. Every row of ``ends`` is one message at one end: the count of messages a step
    posts, and their bytes, are what the cost model charges a link for. ``stepped``: whether each step pays a
    step's fixed cost (the host posting and waiting between steps); the packed passes do not: the host issues
    the whole pass ahead of the GPU, which waits only for the transfers."""
    work: np.ndarray
    launches: np.ndarray
    tiles: np.ndarray
    ends: dict
    stepped: bool = True

    @property
    def critical(self):
        """The visible pairs on the pass's critical path: each step's busiest rank's, summed; where the ranks do not
        wait for each other between steps (not ``stepped``), the busiest rank's over all steps."""
        if self.stepped:
            return int(self.work.max(axis=1).sum())
        return int(self.work.sum(axis=0).max())


@lru_cache(maxsize=64)
def account(layout, mask, scheme, direction, per_node=None, gqa_pack=1):
    """The Account of ``direction``'s pass under ``scheme`` ('ring', 'double_ring', 'ulysses_ring', 'gather')
    over the ranks of ``layout`` (a layout.Layout) under ``mask`` (a masks.Mask), ``per_node`` a node (None: one node), from the
    schedules the engine runs (schedule.py, schemes.py); its tiles counted with ``gqa_pack`` query heads in a
    forward tile under interval masks (tiles.packed_heads of the problem's group)."""
    from .schemes import position_pairs, work_rounds

    near, returns = DIRECTIONS[direction]
    seqlen, size = layout.seqlen, layout.size
    w = size if per_node is None else per_node
    nodes = size // w
    shard = seqlen // size
    if scheme == "ring" and balanced_by_schedule(layout, mask):
        return _balanced_account(mask, size, near, returns, node_list(size, per_node), per_node, gqa_pack)
    if scheme == "gather":
        return _gather_account(mask, layout, returns, per_node, gqa_pack)
    if scheme == "ring":
        template = schedule_steps(layout, 0, near, returns, mask, None)
        pairs = (masks.pair_work(mask, layout),) + pair_calls(mask, layout, gqa_pack)
        return _rotated(template, pairs, lambda x, r: (x + r) % size, size, shard, w, w if nodes > 1 else 1)
    if scheme == "double_ring":
        rounds = work_rounds(position_pairs(mask, layout, range(size)), nodes, near == "q",
                             lambda p, o: [(p // w - o) % nodes * w + (p % w - t) % w for t in range(w)])
        template = double_ring_steps(0, nodes, w, near, returns, rounds)
        pairs = (masks.pair_work(mask, layout),) + pair_calls(mask, layout, gqa_pack)
        return _rotated(template, pairs, lambda x, r: ((x // w + r // w) % nodes) * w + (x % w + r % w) % w, size,
                        shard, w, 1)
    if scheme == "ulysses_ring":   # a ring over the rails: shards are whole nodes' tokens, for 1/w of the heads
        count = work_rounds(position_pairs(mask, layout, range(size), w), nodes, near == "q",
                            lambda p, o: [(p - o) % nodes])
        template = plain_ring_steps(0, nodes, near, returns, count)
        pairs = masks.pair_work(mask, layout).reshape(nodes, w, nodes, w).sum(axis=(1, 3))
        node_account = _rotated(template, (pairs,) + position_calls(mask, layout, w, gqa_pack),
                                lambda x, r: (x + r) % nodes, nodes, w * shard, 1, 1)
        return replace(node_account, work=np.repeat(node_account.work, w, axis=1),
                       launches=np.repeat(node_account.launches, w, axis=1),
                       tiles=np.repeat(node_account.tiles, w, axis=1))
    raise BurstError(f"unknown scheme {scheme!r}")


def _rotated(template, pairs, rotate, positions, tokens, per_node, shown):
    """The Account of a schedule that every position runs rotated (``rotate(x, r)``: what position
    0's ``x`` is at position r), from position 0's steps ``template`` and the visible pairs, the
    block calls and their tiles of every (query, key) pair of shards ``pairs`` (three arrays); the link ends of
    positions 0..``shown``-1 (ranks ``per_node`` a node), shards of ``tokens`` tokens."""
    every = np.arange(positions)
    work, launches = (np.zeros((len(template), positions), np.int64) for _ in range(2))
    tiled = np.zeros((len(template), positions, len(tiles.COUNTS)))
    for t, step in enumerate(template):
        for v in step.visits:
            at = rotate(v.q_shard, every), rotate(v.kv_shard, every)
            work[t] += pairs[0][at]
            launches[t] += pairs[1][at]
            tiled[t] += pairs[2][at]
    ends = {}
    for r in range(shown):
        for t, step in enumerate(template):
            for end, transfers in (("out", step.sends), ("in", step.recvs)):
                for m in transfers:
                    far = rotate(m.peer, r) // per_node != r // per_node
                    ends.setdefault(t, []).append((t if m.due is None else m.due, r, far, end, m.what, m.side,
                                                   tokens if m.rows is None else m.rows[1] - m.rows[0]))
    for x in (work, launches, tiled):
        x.setflags(write=False)
    return Account(work, launches, tiled, _in_order(ends))


def _balanced_account(mask, size, near, returns, nodes, per_node, gqa_pack):
    plan, work = workplan.work_plan(mask, size, near, returns, None, nodes)
    count, moves = schedule.work_transfers(mask, size, near, returns, nodes)
    full, calls = np.zeros((count, size), np.int64), np.zeros((count, size), np.int64)
    full[:len(work)] = work
    chunk = mask.seqlen // size
    visits = np.array([(t, r, i * chunk + lo, i * chunk + hi, j * chunk) for r, steps in enumerate(plan)
                       for t, step in enumerate(steps) for i, j, lo, hi in step], np.int64).reshape(-1, 5)
    t, r, first_row, end_row, first_key = visits.T
    seen = _seen(mask, first_row, end_row, first_key, first_key + chunk)
    np.add.at(calls, (t, r), seen)
    tiled = np.zeros((count, size, len(tiles.COUNTS)))
    np.add.at(tiled, (t, r), tiles.calls_tiles(mask, first_row, end_row - first_row, first_key, chunk, True,
                                                     gqa_pack))
    for x in (full, calls, tiled):
        x.setflags(write=False)
    ends = {}
    for posted, sender, receiver, what, side, _, rows, due in moves:
        far = nodes is not None and nodes[sender] != nodes[receiver]
        tokens = chunk if rows is None else rows[1] - rows[0]
        for end, rank in (("out", sender), ("in", receiver)):
            ends.setdefault(posted, []).append((due, rank, far, end, what, side, tokens))
    return Account(full, calls, tiled, _in_order(ends))


def _seen(mask, first_row, end_row, first_key, end_key):
    """1 where some query row of [first_row, end_row) sees a key of [first_key, end_key), else 0 (arrays):
    a visit of one piece against one piece makes one block call or none (Mask.classify, for many at
    once: the rows' intervals never shrink)."""
    lo, hi = mask.intervals
    first = np.clip(np.searchsorted(hi, first_key, side="right"), first_row, end_row)
    last = np.clip(np.searchsorted(lo, end_key, side="left"), first_row, end_row)
    return (first < last).astype(np.int64)


def _gather_account(mask, layout, returns, per_node, gqa_pack):
    """The Account of the gather schedule (gather.plan), every rank's ends listed; on one node (``per_node``
    None) as the packed passes run it."""
    from . import gather

    count, tasks, moves = gather.plan(mask, layout, returns)
    _, seen, _ = gather.sight(mask, layout)
    stepped = True
    work, launches = (np.zeros((count, layout.size), np.int64) for _ in range(2))
    tiled = np.zeros((count, layout.size, len(tiles.COUNTS)))
    for r, mine in enumerate(tasks):
        step_of, pairs = [], []   # the rank's block calls, counted in one search (tiles.pairs_calls_tiles)
        for t, visits in enumerate(mine):
            work[t, r] = sum(w for _, _, w in visits)
            if per_node is None:   # the packed passes' calls and tiles, below
                continue
            # the block calls the engine makes for each visit (engine.passes: visit_pairs over the held keys)
            made = [p for shard, rows, w in visits if w for p in schedule.visit_pairs(
                layout.pieces(r), schedule.held_pieces(layout.pieces(shard), None if shard == r else seen[r][shard]),
                mask, rows, packed=schedule.packs_visits("gather", mask))]
            launches[t, r] = len(made)
            step_of += [t] * len(made)
            pairs += made
        if pairs:
            np.add.at(tiled[:, r], np.array(step_of), tiles.pairs_calls_tiles(mask, pairs, gqa_pack))
    if per_node is None:
        # one node: the packed passes (engine/packed.py): every run moves, then the block calls; in the backward
        # the exchange home and the sum after it. The forward is two steps (its keys' exchange with its early runs
        # under it, packing.Packing.early; the rest of its rows), the backward three (its keys' exchange; its one
        # call; the partials home), none with a step's fixed cost (a 4 x H200 timeline, GPU-paced: 20 us from the
        # posting to the transfer, the host long ahead); one rank alone, its calls. The engine runs the delta
        # pre-pass under the backward's exchange, priced after the steps with the rest outside the kernels; the
        # row moves and the sum home (memory-bound, 20-60 us) are not priced
        stepped = False
        total = work.sum(axis=0)
        steps = 1 + bool(moves) + ("kv" in returns and bool(moves))
        at = int(bool(moves))
        work, launches = (np.zeros((steps, layout.size), np.int64) for _ in range(2))
        tiled = np.zeros(work.shape + (len(tiles.COUNTS),))
        for r in range(layout.size):
            if not total[r]:
                continue
            p = packing(mask, layout, r)
            split = ((), ((0, len(p.lo)),)) if "kv" in returns else p.split(len(p.lo))
            for t, runs in zip((0, at), split):
                for lo, hi in runs:
                    work[t, r] += p.pairs[hi] - p.pairs[lo]
                    launches[t, r] += 1
                    tiled[t, r] += packed_tiles(mask, layout, r, (lo, hi), gqa_pack)
        moves = [(0, 0) + move[2:] if move[4] == "data" else (2, 2) + move[2:] for move in moves]
    for x in (work, launches, tiled):
        x.setflags(write=False)
    ends = {}
    for posted, due, sender, receiver, what, _, rows in moves:
        far = per_node is not None and sender // per_node != receiver // per_node
        tokens = sum(hi - lo for lo, hi in rows)
        for end, rank in (("out", sender), ("in", receiver)):
            ends.setdefault(posted, []).append((due, rank, far, end, what, "kv", tokens))
    return Account(work, launches, tiled, _in_order(ends), stepped)


def packed_tiles(mask, layout, rank, rows=None, gqa_pack=1):
    """tiles.call_tiles of a block call of ``rank``'s packed passes over its query ``rows`` ((lo, hi); None: all)
    against its packed keys, the call the engine runs (packing.Packing.call: the packed bounds, or the rank's own
    run in the call's mask)."""
    packed = packing(mask, layout, rank)
    lo, hi = (0, packed.lo.size) if rows is None else rows
    call = packed.call(mask, ("priced", mask, layout, rank))
    return tiles.call_tiles(call["mask"], call["q_start"] + lo, hi - lo, call["k_start"], packed.keys, call["masked"],
                            gqa_pack)


def _in_order(ends):
    """``ends`` ({posted: [(due, rank, far, 'out'/'in', what, side, tokens)]}) as Account.ends."""
    rows = [(t, rank, far, end == "out", due, n, KINDS.index((what, side)), tokens)
            for t, items in ends.items() for n, (due, rank, far, end, what, side, tokens) in enumerate(items)]
    rows.sort(key=lambda row: row[:6])
    columns = np.array(rows, np.int64).reshape(-1, 8).T
    return {name: columns[n] for n, name in enumerate(("posted", "rank", "far", "out", "due", "order", "kind", "tokens"))
            if name != "order"}


@lru_cache(maxsize=16)
def pair_calls(mask, layout, gqa_pack=1):
    """(launches, tiles), read-only: the block calls of rank a's queries against rank b's keys, as the engine
    makes them (schedule.block_pairs: hidden pairs make none; ``mask`` as pair_work takes it), (size, size)
    int64, and their kernels' tiles (tiles.pairs_tiles), (size, size, len(tiles.COUNTS)) float64. Only the
    pairs with visible work are asked."""
    size = layout.size
    owned = [layout.pieces(r) for r in range(size)]
    visible = masks.pair_work(mask, layout)
    launches, tiled = np.zeros((size, size), np.int64), np.zeros((size, size, len(tiles.COUNTS)))
    at, pairs = [], []
    for a, b in zip(*np.nonzero(visible)):
        made = schedule.block_pairs(owned[a], owned[b], mask)
        launches[a, b] = len(made)
        at += [(a, b)] * len(made)
        pairs += made
    if pairs:
        np.add.at(tiled, tuple(np.array(at).T), tiles.pairs_calls_tiles(mask, pairs, gqa_pack))
    for x in (launches, tiled):
        x.setflags(write=False)
    return launches, tiled


def position_calls(mask, layout, per_node, gqa_pack=1):
    """pair_calls of Ulysses' positions (a node's ``per_node`` shards joined, schemes.position_pairs): the
    block calls and tiles of every (query, key) pair of shards of the positions, summed. An upper bound: the
    engine runs a position's joined pieces through one block_pairs, which fuses neighbouring full pairs
    into fewer calls (counting those exactly takes seconds at 16 nodes of 8)."""
    nodes = layout.size // per_node
    launches, tiled = pair_calls(mask, layout, gqa_pack)
    return (launches.reshape(nodes, per_node, nodes, per_node).sum(axis=(1, 3)),
            tiled.reshape(nodes, per_node, nodes, per_node, -1).sum(axis=(1, 3)))


def node_list(size, per_node):
    """The node of each rank when ranks fill nodes of ``per_node`` in order (None: one node)."""
    if per_node is None or per_node >= size:
        return None
    return tuple(r // per_node for r in range(size))


def visit_work(mask, layout, visit):
    """Visible pairs of one visit (schedule.Visit), ranks holding tokens by ``layout``."""
    q_pieces = held_pieces(layout.pieces(visit.q_shard), None if visit.rows is None else (visit.rows,))
    return sum(mask.visible_count(qs, ql, ks, kl) for qs, ql in q_pieces
               for ks, kl in held_pieces(layout.pieces(visit.kv_shard), visit.keys))


@lru_cache(maxsize=32)
def schedule_traffic(layout, mask, direction, per_node=None):
    """Tokens each rank sends and receives at each step (of the transfers completing then), per
    kind of transfer and link: {(what, side): ((sent, received) inside the node, (sent, received)
    between nodes)}, int64 arrays (steps, ranks); ``per_node`` ranks a node (None: one node)."""
    near, returns = DIRECTIONS[direction]
    size = layout.size
    plans = [schedule_steps(layout, r, near, returns, mask, node_list(size, per_node)) for r in range(size)]
    count = max(len(p) for p in plans)
    out = {}
    tokens = layout.local
    for r, plan in enumerate(plans):
        for t, step in enumerate(plan):
            for index, transfers in enumerate((step.sends, step.recvs)):
                for m in transfers:
                    arrays = out.setdefault((m.what, m.side), tuple((np.zeros((count, size), np.int64),
                                                                     np.zeros((count, size), np.int64)) for _ in "ab"))
                    far = per_node is not None and m.peer // per_node != r // per_node
                    arrays[far][index][t if m.due is None else m.due, r] += tokens if m.rows is None else m.rows[1] - m.rows[0]
    return out


@lru_cache(maxsize=32)
def schedule_transfers(layout, mask, direction, per_node=None):
    """Every transfer of the schedule, once (from its sender's steps), in the order the engine posts
    them: a tuple of (posted, due, sender, receiver, what, side, tokens), ``due`` the step at whose
    end it completes, ``per_node`` ranks a node (None: one node)."""
    near, returns = DIRECTIONS[direction]
    size = layout.size
    nodes = node_list(size, per_node)
    tokens = layout.local
    out = []
    for r in range(size):
        for t, step in enumerate(schedule_steps(layout, r, near, returns, mask, nodes)):
            for m in step.sends:
                out.append((t, t if m.due is None else m.due, r, m.peer, m.what, m.side,
                            tokens if m.rows is None else m.rows[1] - m.rows[0]))
    return tuple(sorted(out, key=lambda m: m[:2]))


def documents(rng, seqlen, lengths, count=None, longest=None, median=None):
    """cu_seqlens of packed documents filling ``seqlen`` tokens, of ``lengths``:

    - 'equal': ``count`` documents of (nearly) equal length;
    - 'uniform': ``count`` documents cut at random places;
    - 'lognormal': long-tailed lengths (sigma 1), ``count`` of them scaled to fill the sequence,
      or with ``median`` tokens drawn until it is full;
    - 'capped': lengths uniform in 1..``longest`` drawn until the sequence is full (MagiAttention's
      benchmark: documents up to S/4)."""
    if lengths == "equal":
        _check_count(count, seqlen)
        return np.linspace(0, seqlen, count + 1).round().astype(np.int64)
    if lengths == "uniform":
        _check_count(count, seqlen)
        return masks.random_documents(rng, seqlen, count)
    if lengths == "lognormal" and count is not None:
        _check_count(count, seqlen)
        weights = rng.lognormal(0.0, 1.0, count)
        sizes = 1 + np.floor(weights / weights.sum() * (seqlen - count)).astype(np.int64)
        sizes[np.argmax(sizes)] += seqlen - sizes.sum()
        return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    if lengths in ("lognormal", "capped"):
        cuts = [0]
        while cuts[-1] < seqlen:
            n = rng.lognormal(np.log(median), 1.0) if lengths == "lognormal" else rng.integers(1, longest + 1)
            cuts.append(min(seqlen, cuts[-1] + max(1, int(n))))
        return np.asarray(cuts, np.int64)
    raise MaskError(f"document lengths must be equal, uniform, lognormal or capped; got {lengths!r}")


def _check_count(count, seqlen):
    if count is None or not 1 <= count <= seqlen:
        raise MaskError(f"cannot pack {count} documents into {seqlen} tokens (need 1 <= documents <= tokens)")
