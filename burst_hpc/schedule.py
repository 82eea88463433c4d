"""What each rank computes at each step, what it sends to whom, and which (query part, key
part, mask) block pairs run when one shard meets another.

Steps (what the ring engine runs, ring.py):
- a *visit* is one shard met by this rank: side "kv" brings the keys/values of ``shard`` to
  this rank's queries, side "q" brings the query side of ``shard`` to this rank's keys. The
  visit also makes a *partial* for the visiting shard (key-side results after a kv visit,
  query-side results after a q visit) unless nothing of that side is returned (the forward
  pass returns nothing for kv visits).
- step t posts one exchange (``sends``, ``recvs``): the data of the visit of step t+1 and the
  partial of step t-1; a last step with no visit delivers the last partials.
- plain ring (contiguous, zigzag, and balanced without a causal mask): one side travels to
  rank+1 each step for P steps (fewer when documents or a window hide the later ones,
  masks.ring_steps), partials ride one step behind it and go home at the end.
- balanced (causal, DistFlashAttn): contiguous shards; chunk pairs are dealt to ranks by
  ``balanced_tasks`` and the data travels straight from its owner to the computing rank,
  the partial straight back.

Block pairs:

A shard is a list of pieces, (global_start, length) runs in local order (layout.pieces).
Each query piece against each key piece is one of:
- hidden: every key comes after every query (causal) -> skipped, costs nothing;
- full: no key comes after any query (or not causal) -> no mask;
- diagonal: some keys are hidden -> masked inside the kernel on global positions.
Full pairs that sit next to each other in local memory are fused into one call, so a
zigzag step with no diagonal is a single kernel launch.
"""
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from . import masks


@dataclass(frozen=True)
class BlockPair:
    q: slice        # local rows of the query-side shard
    k: slice        # local rows of the key-side shard
    q_start: int    # global position of the first query row
    k_start: int    # global position of the first key row
    causal: bool    # True only for pairs that need the mask (diagonal, or masks.Mask's 'masked')

    def visible(self, mask=None):
        """The visible (query, key) pairs of this block pair, the work it costs (``mask``: the call's
        masks.Mask, None for plain causal or full attention)."""
        rows, keys = self.q.stop - self.q.start, self.k.stop - self.k.start
        if not self.causal:
            return rows * keys
        if mask is not None:
            return mask.visible_count(self.q_start, rows, self.k_start, keys)
        seen = np.arange(self.q_start, self.q_start + rows, dtype=np.int64) - self.k_start + 1
        return int(np.clip(seen, 0, keys).sum())

    def rows(self, lo, hi):
        """The pair of this pair's query rows lo..hi-1 (local to the pair)."""
        return replace(self, q=slice(self.q.start + lo, self.q.start + hi), q_start=self.q_start + lo)

    def first_keys(self, n):
        """The pair of this pair's first ``n`` keys (all of them when it has fewer)."""
        return replace(self, k=slice(self.k.start, min(self.k.stop, self.k.start + n)))


def _classify(q_start, q_len, k_start, k_len, causal):
    if not causal or k_start + k_len - 1 <= q_start:
        return "full"
    if k_start > q_start + q_len - 1:
        return "hidden"
    return "diagonal"


def _fuse(a, b):
    """a and b fused into one pair when both are unmasked and adjacent along one side."""
    if a.causal or b.causal:
        return None
    if a.q == b.q and a.k.stop == b.k.start:
        return BlockPair(a.q, slice(a.k.start, b.k.stop), a.q_start, a.k_start, False)
    if a.k == b.k and a.q.stop == b.q.start:
        return BlockPair(slice(a.q.start, b.q.stop), a.k, a.q_start, a.k_start, False)
    return None


@lru_cache(maxsize=1024)
def block_pairs(q_pieces, k_pieces, causal, mask=None):
    """The block pairs to run for a query shard against a key shard (pieces as tuples).
    ``mask``: a masks.Mask (documents, window) classifies the pairs instead of plain causal."""
    pairs = []
    q_off = 0
    for q_start, q_len in q_pieces:
        k_off = 0
        for k_start, k_len in k_pieces:
            if mask is not None:
                kind = mask.classify(q_start, q_len, k_start, k_len)
            else:
                kind = _classify(q_start, q_len, k_start, k_len, causal)
            if kind != "hidden":
                pairs.append(BlockPair(slice(q_off, q_off + q_len), slice(k_off, k_off + k_len),
                                       q_start, k_start, kind != "full"))
            k_off += k_len
        q_off += q_len
    fused = True
    while fused:
        fused = False
        for i in range(len(pairs)):
            for j in range(len(pairs)):
                if i != j and (merged := _fuse(pairs[i], pairs[j])) is not None:
                    pairs = [p for n, p in enumerate(pairs) if n not in (i, j)] + [merged]
                    fused = True
                    break
            if fused:
                break
    return tuple(sorted(pairs, key=lambda p: (p.q.start, p.k.start)))


def visit_pairs(q_pieces, k_pieces, causal, half=None, mask=None):
    """The block pairs of one visit; ``half`` 0 or 1 keeps only the first or second half of the
    query rows (a split chunk pair of the balanced schedule; contiguous shards only)."""
    if half is None:
        return block_pairs(q_pieces, k_pieces, causal, mask)
    ((start, n),) = q_pieces
    lo, hi = (0, n // 2) if half == 0 else (n // 2, n)
    if lo == hi:
        return ()
    return tuple(replace(p, q=slice(p.q.start + lo, p.q.stop + lo))
                 for p in block_pairs(((start + lo, hi - lo),), k_pieces, causal, mask))


@dataclass(frozen=True)
class Visit:
    side: str            # "kv": this rank's queries meet shard's keys; "q": shard's queries meet this rank's keys
    shard: int           # whose tokens visit (this rank's own on the first step)
    half: int = None     # None: every query row; 0 / 1: the first / second half of them


@dataclass(frozen=True)
class Transfer:
    peer: int            # the rank sent to or received from
    what: str            # "data" (a shard's travelling side) or "partial" (results for a shard)
    side: str            # the side that travels, or the side of the visit that made the partial
    shard: int           # whose tokens
    due: int = None      # the step at whose end it completes (None: the step that posts it)


@dataclass(frozen=True)
class Step:
    visit: Visit         # None: nothing to compute (the last step delivers partials only)
    sends: tuple         # Transfers posted at the start of the step: data first, then partials
    recvs: tuple


def _step(visit, sends, recvs):
    # both ends order a peer's transfers the same way (data, then partials), so the transports
    # can match messages by their position among those exchanged with that peer
    order = lambda t: (t.what, t.side, t.shard, t.peer, -1 if t.due is None else t.due)  # noqa: E731
    return Step(visit, tuple(sorted(sends, key=order)), tuple(sorted(recvs, key=order)))


@lru_cache(maxsize=256)
def steps(layout, causal, rank, size, near, returns, mask=None):
    """This rank's steps. ``near``: the side that travels on a plain ring, and to the near chunk
    pairs of the balanced schedule; ``returns``: the sides whose visits send partials back;
    ``mask``: a masks.Mask (documents, window) or None."""
    if layout == "balanced" and causal and size > 1:
        return balanced_steps(rank, size, near, returns, mask)
    return plain_ring_steps(rank, size, near, returns, masks.ring_steps(mask, size, layout, near == "q"))


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
            out.append(_step(Visit(side, (rank - t) % size) if t < count else None, sends, recvs))
    return tuple(out)


def balanced_tasks(i, j, size, near):
    """Who computes the causal chunk pair (q_i, k_j), j <= i, of contiguous shards, and when:
    a list of (step, computing rank, side that visits it, half of the query rows or None).

    DistFlashAttn: the pair at distance d = i - j runs at step min(d, P - d), so step s holds
    the distances s and P - s and every rank computes one pair. The near distance (d < P/2) goes
    to the rank that ``near`` travels to: the query owner i when K/V travel, the key owner j
    when the query side does; the far one (d > P/2) to the other owner. With an even P the P/2
    pairs are alone in their step: each is cut in two by query rows, the first half computed by
    its query owner, the second by its key owner, so no rank idles there. The diagonal pairs
    (d = 0) need nothing from anyone: their first half of query rows runs first, while the
    first data arrives, their second half last, while the last partials go home."""
    d = i - j
    last = size // 2 + 1
    by_query_owner = (i, "kv")
    by_key_owner = (j, "q")
    if d == 0:
        return [(0, i, near, 0), (last, i, near, 1)]
    step = min(d, size - d)
    if 2 * d == size:
        return [(step,) + by_query_owner + (0,), (step,) + by_key_owner + (1,)]
    near_pair = 2 * d < size
    return [(step,) + (by_query_owner if near_pair == (near == "kv") else by_key_owner) + (None,)]


def balanced_steps(rank, size, near, returns, mask=None):
    """The balanced schedule seen by ``rank``: floor(P/2) + 2 steps (balanced_tasks). Chunk pairs
    that documents or a window hide entirely cost nothing: no transfer, no visit."""
    count = size // 2 + 2
    visits = [None] * count
    sends = [[] for _ in range(count)]
    recvs = [[] for _ in range(count)]
    chunk = None if mask is None else mask.seqlen // size
    for i in range(size):
        for j in range(i + 1):
            if mask is not None and mask.classify(i * chunk, chunk, j * chunk, chunk) == "hidden":
                continue
            for step, computer, side, half in balanced_tasks(i, j, size, near):
                provider = j if side == "kv" else i
                if computer == rank:
                    visits[step] = Visit(side, provider, half)
                if provider == computer:
                    continue
                for who, peer, box in ((provider, computer, sends), (computer, provider, recvs)):
                    if who == rank:
                        box[step - 1].append(Transfer(peer, "data", side, provider))
                if side in returns:
                    for who, peer, box in ((computer, provider, sends), (provider, computer, recvs)):
                        if who == rank:
                            box[step + 1].append(Transfer(peer, "partial", side, provider))
    return tuple(_step(visits[t], sends[t], recvs[t]) for t in range(count))


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
            out.append(_step(Visit(side, at(n - o, l - t)) if in_round else None, sends, recvs))
    return tuple(out)
