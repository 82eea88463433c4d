"""What each rank computes at each step, what it sends to whom, and which (query part, key
part, mask) block pairs run when one shard meets another.

Steps (what the ring engine runs, ring.py):
- a *visit* meets the query side of ``q_shard`` (some of its rows, or all) with the keys and
  values of ``kv_shard``; what is not this rank's own has arrived at an earlier step. Its
  results for another rank's shard go into a *partial* for that shard (query side: o and lse,
  or dq; key side: dk and dv) when that side is returned; several visits, over several steps,
  may add into one partial before it is sent.
- a step runs its visits in order; it posts its exchanges (``sends``, ``recvs``) first: the data
  later visits need and the partials finished before; a last step with no visit delivers the
  last partials.
- plain ring (contiguous, zigzag, and balanced on full attention): one side travels to rank+1
  each step for P steps (fewer when documents or a window hide the later ones,
  masks.ring_steps), partials ride one step behind it and go home at the end.
- balanced (any mask, balance.py): contiguous shards; the visible work of every chunk pair is
  dealt to ranks, in row pieces, so every rank and step has the same; the data travels
  straight from its owner to the computing rank, the partial straight back (across nodes a
  node's dK/dV partials of one key chunk are summed inside the node first).

Block pairs:

A shard is a list of pieces, (global_start, length) runs in local order (layout.pieces).
Each query piece against each key piece is, by the call's mask (masks.Mask.classify), one of:
- hidden: no query sees any key -> skipped, costs nothing;
- full: every query sees every key -> no mask;
- masked: some keys are hidden -> the mask is applied inside the kernel on global positions.
Full pairs that sit next to each other in local memory are fused into one call, so a
zigzag step with no masked pair is a single kernel launch.
"""
from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import accumulate

import numpy as np

from . import masks, workplan


@dataclass(frozen=True)
class BlockPair:
    q: slice        # local rows of the query-side shard
    k: slice        # local rows of the key-side shard
    q_start: int    # global position of the first query row
    k_start: int    # global position of the first key row
    masked: bool    # the pair needs the call's mask applied (masks.Mask.classify: 'masked')
    mask: object = None   # its own mask (None: the call's): the gather's visit over its held keys (masks.Packed)

    def visible(self, mask):
        """The visible (query, key) pairs of this block pair, the work it costs (``mask``: the call's
        masks.Mask)."""
        rows, keys = self.q.stop - self.q.start, self.k.stop - self.k.start
        if not self.masked:
            return rows * keys
        return (mask if self.mask is None else self.mask).visible_count(self.q_start, rows, self.k_start, keys)

    def rows(self, lo, hi):
        """The pair of this pair's query rows lo..hi-1 (local to the pair)."""
        return replace(self, q=slice(self.q.start + lo, self.q.start + hi), q_start=self.q_start + lo)

    def first_keys(self, n):
        """The pair of this pair's first ``n`` keys (all of them when it has fewer)."""
        return replace(self, k=slice(self.k.start, min(self.k.stop, self.k.start + n)))


def _fused(pairs, side):
    """``pairs`` (unmasked) with those adjacent along ``side`` ('k': the same query rows, keys that follow each
    other; 'q': the other way round) joined into one."""
    along = (lambda p: p.k) if side == "k" else (lambda p: p.q)
    across = (lambda p: p.q) if side == "k" else (lambda p: p.k)
    out = []
    for p in sorted(pairs, key=lambda p: (across(p).start, across(p).stop, along(p).start)):
        last = out[-1] if out else None
        if last is not None and across(last) == across(p) and along(last).stop == along(p).start:
            joined = slice(along(last).start, along(p).stop)
            out[-1] = (BlockPair(last.q, joined, last.q_start, last.k_start, False) if side == "k" else
                       BlockPair(joined, last.k, last.q_start, last.k_start, False))
        else:
            out.append(p)
    return out


@lru_cache(maxsize=1024)
def block_pairs(q_pieces, k_pieces, mask):
    """The block pairs to run for a query shard against a key shard (pieces as tuples), classified by
    ``mask`` (the call's masks.Mask)."""
    q_off, k_off = ([0, *accumulate(n for _, n in pieces)] for pieces in (q_pieces, k_pieces))
    q, k = (np.array(pieces, np.int64).reshape(-1, 2) for pieces in (q_pieces, k_pieces))
    kinds = mask.classify_many(q[:, :1], q[:, 1:], k[:, 0], k[:, 1]).tolist()   # 0 hidden, 1 full, 2 masked
    pairs = [BlockPair(slice(q_off[i], q_off[i] + ql), slice(k_off[j], k_off[j] + kl), qs, ks, kinds[i][j] == 2)
             for i, (qs, ql) in enumerate(q_pieces) for j, (ks, kl) in enumerate(k_pieces) if kinds[i][j]]
    full = [p for p in pairs if not p.masked]
    while len(full) > 1:   # unmasked pairs adjacent along one side joined, until none is
        count = len(full)
        full = _fused(_fused(full, "k"), "q")
        if len(full) == count:
            break
    return tuple(sorted([p for p in pairs if p.masked] + full, key=lambda p: (p.q.start, p.k.start)))


def visit_pairs(q_pieces, k_pieces, mask, rows=None, packed=False):
    """The block pairs of one visit; ``rows`` (lo, hi) keeps only those local query rows (a piece
    of a chunk pair in the balanced schedule, a step's share of a shard in the gather schedule).
    ``packed`` (the gather schedule): the visit as one block call, its query rows against every key it holds
    through a masks.Packed of their positions (``packed_visit``), where the held keys are in global order."""
    if packed:
        pair = packed_visit(q_pieces, k_pieces, mask, (0, sum(n for _, n in q_pieces)) if rows is None else rows)
        if pair is not False:
            return pair
    if rows is None:
        return block_pairs(q_pieces, k_pieces, mask)
    lo, hi = rows
    if lo >= hi:
        return ()
    return tuple(replace(p, q=slice(p.q.start + lo, p.q.stop + lo))
                 for p in block_pairs(held_pieces(q_pieces, (rows,)), k_pieces, mask))


def packed_visit(q_pieces, k_pieces, mask, rows):
    """One visit as one block call: a tuple of the BlockPair of local query rows ``rows`` (lo, hi) against every
    held key, under the masks.Packed of the shard's rows against the held keys' positions (each row sees one
    interval of them: the held keys are in global order), or () where those rows see none of them; False where
    the held keys are not in global order (then the visit's block pairs). A stepped gather's visit otherwise
    makes a call for every chunk pair (16 GPUs, 8k documents a GPU: 30 calls on the backward's critical path)."""
    lo, hi = rows
    packed = _packed_mask(q_pieces, k_pieces, mask)
    if packed is None:
        return False
    if lo >= hi or not np.any(packed.bounds[1][lo:hi] > packed.bounds[0][lo:hi]):
        return ()
    return (BlockPair(slice(lo, hi), slice(0, packed.seqlen), lo, 0, True, packed),)


@lru_cache(maxsize=256)
def _packed_mask(q_pieces, k_pieces, mask):
    """masks.Packed of the query shard ``q_pieces``' local rows against the keys of ``k_pieces`` laid end to end
    (positions in that buffer), or None where the keys or the query pieces are not in global order (a row's
    bounds would not grow with it, which the kernels' searches need)."""
    if not k_pieces:
        return None
    starts, lengths = np.array(k_pieces, np.int64).reshape(-1, 2).T
    if np.any(starts[1:] < starts[:-1] + lengths[:-1]):
        return None
    before = np.concatenate([[0], np.cumsum(lengths)])   # held keys before each piece

    def position(x):   # the held keys before global position x: searchsorted over the held positions, by pieces
        j = np.searchsorted(starts, x, side="right") - 1
        inside = np.clip(x - starts[np.maximum(j, 0)], 0, lengths[np.maximum(j, 0)])
        return np.where(j < 0, 0, before[np.maximum(j, 0)] + inside)

    lo, hi = position(_shard_bounds(q_pieces, mask))
    if lo.size > 1 and (np.any(np.diff(lo) < 0) or np.any(np.diff(hi) < 0)):   # query pieces out of order
        return None
    return masks.Packed(lo, hi, int(before[-1]), ("visit", mask.key, q_pieces, k_pieces))


def packs_visits(scheme, mask):
    """Whether scheme ``scheme`` (a name) runs each visit as one call (packed_visit) under the call's ``mask``: the
    gather's, unless the mask is full (its chunk pairs then run the unmasked kernels)."""
    return scheme == "gather" and not mask.is_full


def packed_kind(mask):
    """A masks.Packed standing for the kind of mask a packed visit's call gets under the call's ``mask`` (what
    a backend prepares its kernels for): no rows, no keys."""
    none = np.zeros(0, np.int64)
    return masks.Packed(none, none, 0, ("kind", mask.key))


@lru_cache(maxsize=16)
def _shard_bounds(q_pieces, mask):
    """int64 (2, rows): the global bounds [lo, hi) of each local row of the shard ``q_pieces``."""
    return np.stack([np.concatenate(parts) for parts in zip(*(mask.rows(start, n) for start, n in q_pieces))])


@dataclass(frozen=True)
class Visit:
    q_shard: int         # whose queries (this rank's own: the query-side results are its own)
    kv_shard: int        # whose keys and values
    rows: tuple = None   # (lo, hi): only these local query rows of q_shard; None: all of them
    keys: tuple = None   # ((lo, hi), ...): only these runs of kv_shard's local rows, received one after
    #                      another (the gather schedule, gather.py); None: the whole shard


def held_pieces(pieces, keys=None):
    """The (global_start, length) pieces of the local rows ``keys`` ((lo, hi) runs, in order; None:
    every row) of a shard of ``pieces``: the pieces of a buffer holding those rows one after another."""
    if keys is None:
        return tuple(pieces)
    out = []
    for lo, hi in keys:
        offset = 0
        for start, n in pieces:
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                out.append((start + a - offset, b - a))
            offset += n
    return tuple(out)


@dataclass(frozen=True)
class Transfer:
    peer: int            # the rank sent to or received from
    what: str            # "data" (a shard's travelling side) or "partial" (results for a shard)
    side: str            # the side that travels, or the side whose results the partial holds
    shard: int           # whose tokens
    due: int = None      # the step at whose end it completes (None: the step that posts it)
    rows: tuple = None   # (lo, hi): only these local rows of the query side (None: the whole shard); or
    #                      ((lo, hi), ...): these runs of either side, one after another (gather.py)
    inner: bool = False  # due steps later, inside a node: on the inner lane (ring.run), not the far one


@dataclass(frozen=True)
class Step:
    visits: tuple        # Visits run in order (none: the last step delivers partials only)
    sends: tuple         # Transfers posted at the start of the step: data first, then partials
    recvs: tuple


def make_step(visits, sends, recvs):
    """A Step of these visits and transfers, the transfers in the order both ends post them."""
    # both ends order a peer's transfers the same way (data, then partials), so the transports
    # can match messages by their position among those exchanged with that peer
    order = lambda t: (t.what, t.side, t.shard, t.peer, -1 if t.due is None else t.due)  # noqa: E731
    return Step(tuple(visits), tuple(sorted(sends, key=order)), tuple(sorted(recvs, key=order)))


def ring_visit(side, rank, shard):
    """The visit of a plain ring at ``rank`` when ``side`` of ``shard`` travels to it."""
    return Visit(rank, shard) if side == "kv" else Visit(shard, rank)


def balanced_by_schedule(layout, mask):
    """Whether a call in ``layout`` runs the work-aware schedule (balance.py): the layout balances
    by schedule, over several ranks, with something masked (causal, documents, a window)."""
    return layout.balances_by_schedule and layout.size > 1 and not mask.is_full


@lru_cache(maxsize=256)
def steps(layout, rank, near, returns, mask, nodes=None):
    """This rank's steps, ranks holding tokens by ``layout`` (layout.Layout). ``near``: the side that
    travels on a plain ring, and the cheaper side for the balanced schedule to move; ``returns``:
    the sides whose partials go back to their owners; ``mask``: the call's masks.Mask; ``nodes`` the
    node of each rank (the balanced schedule keeps its moves inside nodes where it can; None: one
    node)."""
    size = layout.size
    if balanced_by_schedule(layout, mask):
        return work_steps(rank, size, near, returns, mask, nodes)
    return plain_ring_steps(rank, size, near, returns, masks.ring_steps(mask, layout, near == "q"))


def plain_ring_steps(rank, size, side, returns, count=None):
    """The plain ring: at step t this rank visits shard rank-t, which it then forwards to rank+1;
    its partial follows it one step behind. After the last of ``count`` steps (P, or fewer when
    the later ones have no work) each partial goes straight home, to rank-(count-1)."""
    count = size if count is None else count
    after, before = (rank + 1) % size, (rank - 1) % size
    carries = side in returns and count > 1
    out = []
    for t in range(count + 1):
        sends, recvs = [], []
        if t + 1 < count:
            sends.append(Transfer(after, "data", side, (rank - t) % size))
            recvs.append(Transfer(before, "data", side, (rank - t - 1) % size))
        if carries and 1 <= t < count:
            sends.append(Transfer(after, "partial", side, (rank - t + 1) % size))
            recvs.append(Transfer(before, "partial", side, (rank - t) % size))
        if carries and t == count:
            home, visitor = (rank - count + 1) % size, (rank + count - 1) % size
            sends.append(Transfer(home, "partial", side, home))
            recvs.append(Transfer(visitor, "partial", side, rank))
        if t < count or carries:
            out.append(make_step([ring_visit(side, rank, (rank - t) % size)] if t < count else [], sends, recvs))
    return tuple(out)


INNER_LEAD = 1   # steps ahead of its due step that data inside a node is posted (schedule.work_transfers)
INNER_LAG = 1    # steps after it is posted that a partial going home inside a node is due
LEAD = 8   # steps ahead of its due step that a transfer between nodes is posted (schedule.work_transfers)


@lru_cache(maxsize=16)
def work_transfers(mask, size, near, returns, nodes=None):
    """The balanced schedule's transfers, for every rank: (steps, [(step, sender, receiver, what, side,
    shard, rows, due)]). Data goes to the rank that computes with it, due at the end of the step
    before its first use, from its owner (a whole shard: or from the rank of the receiver's node
    that got it first, ``relays``); a partial goes straight to its owner, posted the step after its
    last contribution (one step more than the plan's when a partial is made at the last), but for a
    node's dK/dV partials of one key chunk bound for another node: those go to the node's rank that
    contributes last, which adds them and sends the sum. The query side moves only the rows the
    receiving rank computes with, and its partial holds only those.

    Between nodes a transfer is posted up to LEAD steps before it is due (data: as early as step 0;
    a partial: due LEAD steps after it is posted, at most at the last step), on the far lane: the
    network then carries it under several steps of compute, not one. Inside a node data is posted
    INNER_LEAD steps before it is due and a partial going home is due INNER_LAG steps after it is
    posted (one bound for its node's summer completes when posted: the sum leaves sooner), on the
    inner lane (Transfer.inner): a rank that many others send to (a busy owner) then takes them in
    under two steps of compute, and never behind the network's transfers."""
    plan, _ = workplan.work_plan(mask, size, near, returns, None, nodes)
    chunk = mask.seqlen // size
    first, last = {}, {}   # (computing rank, side, shard) -> first use; the same -> last contribution
    rows = {}              # (computing rank, "q", shard) -> the query rows it needs of that shard
    for c in range(size):
        for t, visits in enumerate(plan[c]):
            for i, j, lo, hi in visits:
                for side, shard in (("q", i), ("kv", j)):
                    if shard != c:
                        first.setdefault((c, side, shard), t)
                        if side in returns:
                            last[(c, side, shard)] = t
                if i != c:
                    a, b = rows.get((c, "q", i), (lo, hi))
                    rows[(c, "q", i)] = (min(a, lo), max(b, hi))

    def cut(key):
        r = rows.get(key)
        return None if r is None or r == (0, chunk) else r

    def far(a, b):
        return nodes is not None and nodes[a] != nodes[b]

    count = len(plan[0]) + (1 if any(t + 1 == len(plan[0]) for t in last.values()) else 0)
    moves = []
    for (c, side, shard), t, source in relays(first, nodes):
        due = t - 1
        lead = LEAD if far(source, c) else INNER_LEAD
        ready = 0 if source == shard else first[(source, side, shard)]   # a relay has it from its first use
        moves.append((max(ready, due - lead), source, c, "data", side, shard, cut((c, side, shard)), due))

    def home(c, side, shard, t, to=None):
        """The partial of rank c, its last contribution at step t, straight home (due INNER_LAG
        steps later inside a node), or to ``to``, its node's summing rank (due when posted)."""
        lag = INNER_LAG if to is None else 0
        to = shard if to is None else to
        moves.append((t + 1, c, to, "partial", side, shard, cut((c, side, shard)),
                      min(count - 1, t + 1 + (LEAD if far(c, to) else lag))))

    summed = {}   # (shard, node) -> [(last contribution, rank)] of the key-side partials bound across nodes
    for (c, side, shard), t in last.items():
        if side == "kv" and far(c, shard):
            summed.setdefault((shard, nodes[c]), []).append((t, c))
        else:
            home(c, side, shard, t)
    for (shard, _), members in summed.items():
        # a node's dK/dV partials of one key chunk cross the network once, as the key chunk does: the
        # rank that contributes last receives the others' over the node's links, adds them, sends the
        # sum (one made at the last step has no step left to reach it: it goes straight home)
        members.sort()
        (t_sum, summer), others = members[-1], members[:-1]
        send = t_sum + 1
        for t, c in others:
            if t + 2 <= count - 1:
                home(c, "kv", shard, t, summer)
                send = max(send, t + 2)
            else:
                home(c, "kv", shard, t)
        moves.append((send, summer, shard, "partial", "kv", shard, None, min(count - 1, send + LEAD)))
    assert all(m[-1] >= 0 for m in moves), "step 0 needs data from another rank"
    return count, tuple(sorted(moves, key=lambda m: m[:6] + (m[7],)))


def relays(first, nodes):
    """(receiver key, first use, sender) of every data transfer of ``first`` ({(rank, side, shard):
    first use}). A whole shard (the key side) crosses the network once per node: the rank of a node
    that uses it first gets it from its owner and passes it on over the node's links to the ranks
    there that use it at least one step later (it has arrived by then); the rest get it from the
    owner. Query rows always come from their owner (each receiver needs its own rows)."""
    out = []
    entry = {}   # (side, shard, node) -> (first use, rank) of the node's first receiver
    for (c, side, shard), t in sorted(first.items(), key=lambda item: (item[1], item[0])):
        source = shard
        if side == "kv" and nodes is not None and nodes[c] != nodes[shard]:
            got = entry.setdefault((side, shard, nodes[c]), (t, c))
            if got[0] < t:
                source = got[1]
        out.append(((c, side, shard), t, source))
    return out


@lru_cache(maxsize=16)
def transfers_of(mask, size, near, returns, nodes=None):
    """work_transfers' moves by rank: a tuple over ranks of the moves it sends or receives."""
    out = [[] for _ in range(size)]
    for m in work_transfers(mask, size, near, returns, nodes)[1]:
        out[m[1]].append(m)
        if m[2] != m[1]:
            out[m[2]].append(m)
    return tuple(tuple(m) for m in out)


@lru_cache(maxsize=256)
def work_steps(rank, size, near, returns, mask, nodes=None):
    """The balanced schedule seen by ``rank`` (workplan.work_plan: any mask, contiguous shards):
    each step's visits of chunk pieces, the data they need arriving the step before from its
    owner, each partial sent home after the last visit adding to it (work_transfers)."""
    plan, _ = workplan.work_plan(mask, size, near, returns, None, nodes)
    count, _ = work_transfers(mask, size, near, returns, nodes)
    chunk = mask.seqlen // size
    sends, recvs = [[] for _ in range(count)], [[] for _ in range(count)]
    for t, sender, receiver, what, side, shard, rows, due in transfers_of(mask, size, near, returns, nodes)[rank]:
        inner = due != t and (nodes is None or nodes[sender] == nodes[receiver])
        due = None if due == t else due
        if sender == rank:
            sends[t].append(Transfer(receiver, what, side, shard, due, rows, inner))
        if receiver == rank:
            recvs[t].append(Transfer(sender, what, side, shard, due, rows, inner))
    mine = list(plan[rank]) + [()] * (count - len(plan[rank]))
    return tuple(make_step([Visit(i, j, None if (lo, hi) == (0, chunk) else (lo, hi)) for i, j, lo, hi in mine[t]],
                       sends[t], recvs[t]) for t in range(count))


@lru_cache(maxsize=256)
def double_ring_steps(position, nodes, per_node, side, returns, rounds=None):
    """The double ring (LoongTrain, BurstEngine) seen by the rank at ``position`` = node * w +
    local of ``nodes`` nodes of w = ``per_node`` ranks; shards are named by position too.

    Round o (of ``rounds``, nodes by default; fewer when documents or a window leave the later
    ones without work) is an inner ring of w steps over the shards that started on node n - o:
    at its step t rank (n, l) visits shard (n - o, l - t) and forwards it to (n, l + 1).

    The network carries one exchange per rank and round, on the rank's rail, posted at the
    round's second step and due at its last (w - 1 steps of compute to hide behind): the shard
    the rank started the round with goes to (n + 1, l), where it starts the next round, and with
    it the partial results the rail has gathered so far for one shard. Partials ride the inner ring
    one step behind their shard; after the round one more inner hop brings the node's partial of
    shard (n - o, l) to (n, l), which started it: there it meets the partial of the nodes before
    (arrived over the rail) and goes on to the next node in the next round's exchange, until the
    last node sends it home (one extra step after the last round). The partial of a node's own
    shards is home after the inner hop. One rank per node (w = 1) is the flat ring over nodes."""
    w, rounds = per_node, nodes if rounds is None else rounds
    if w == 1:
        return plain_ring_steps(position, nodes, side, returns, rounds)
    n, l = divmod(position, w)

    def at(node, local):
        return (node % nodes) * w + local % w

    carries = side in returns
    out = []
    last = rounds * w + (1 if carries and rounds > 1 else 0)   # steps after the last round's: partials only
    for index in range(last + 1):
        o, t = divmod(index, w)
        sends, recvs = [], []
        in_round = o < rounds
        if in_round and t + 1 < w:
            sends.append(Transfer(at(n, l + 1), "data", side, at(n - o, l - t)))
            recvs.append(Transfer(at(n, l - 1), "data", side, at(n - o, l - t - 1)))
        if in_round and t == 1:
            due = index + w - 2
            if o + 1 < rounds:
                sends.append(Transfer(at(n + 1, l), "data", side, at(n - o, l), due))
                recvs.append(Transfer(at(n - 1, l), "data", side, at(n - o - 1, l), due))
            if carries and o >= 2:   # the rail's partial of shard (n - o + 1, l) on to the next node,
                sends.append(Transfer(at(n + 1, l), "partial", side, at(n - o + 1, l), due))
                # and from the node before, the one of shard (n - o, l), visited in this round
                recvs.append(Transfer(at(n - 1, l), "partial", side, at(n - o, l), due))
        if carries and in_round and 1 <= t:
            sends.append(Transfer(at(n, l + 1), "partial", side, at(n - o, l - t + 1)))
            recvs.append(Transfer(at(n, l - 1), "partial", side, at(n - o, l - t)))
        if carries and t == 0 and 1 <= o <= rounds:   # the inner hop after round o - 1
            sends.append(Transfer(at(n, l + 1), "partial", side, at(n - o + 1, l + 1)))
            recvs.append(Transfer(at(n, l - 1), "partial", side, at(n - o + 1, l)))
        if carries and index == last and rounds > 1:   # the last node's partial goes home
            home = at(n - rounds + 1, l)
            sends.append(Transfer(home, "partial", side, home))
            recvs.append(Transfer(at(n + rounds - 1, l), "partial", side, position))
        if in_round or sends or recvs:
            out.append(make_step([ring_visit(side, position, at(n - o, l - t))] if in_round else [], sends, recvs))
    return tuple(out)
