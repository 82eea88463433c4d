"""The work and the traffic of a call's schedule, step by step: ``schedule_work`` (public: tests,
plots and the cost model share this one account), the bytes each rank sends and receives at each
step, and the document sets the balance figures and the planner draw (equal, uniform, lognormal
lengths; MagiAttention's "up to S/4")."""
from functools import lru_cache

import numpy as np

from . import balance, masks
from .errors import BurstError, MaskError
from .layout import check_layout, check_split, pieces
from .schedule import steps as schedule_steps

DIRECTIONS = {"forward": ("kv", ("q",)), "backward": ("kv", ("kv", "q"))}   # near side, returned sides


def schedule_work(seqlen, size, *, causal=False, window=None, cu_seqlens=None, layout="balanced",
                  direction="forward"):
    """The visible (query, key) pairs each rank computes at each step of the ring.

    Parameters
    ----------
    seqlen, size : int
        Tokens in the whole sequence and ranks.
    causal, window, cu_seqlens
        The mask, as burst_attention takes it.
    layout : {'contiguous', 'zigzag', 'balanced'}
    direction : {'forward', 'backward'}
        The forward ring, or the backward's kv-ring (the q-ring computes the same pairs per rank).

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
    check_layout(layout)
    check_split(seqlen, size, layout)
    if direction not in DIRECTIONS:
        raise BurstError(f"direction must be one of {', '.join(DIRECTIONS)}; got {direction!r}")
    return work_of(seqlen, size, bool(causal), mask, layout, direction).copy()


@lru_cache(maxsize=32)
def work_of(seqlen, size, causal, mask, layout, direction, per_node=None):
    """schedule_work on checked arguments (``mask`` a masks.Mask or None; ``per_node`` ranks a node,
    rank order node by node: None, one node), cached and read-only."""
    near, returns = DIRECTIONS[direction]
    nodes = node_list(size, per_node)
    plans = [schedule_steps(layout, causal, r, size, near, returns, mask, seqlen, nodes) for r in range(size)]
    work = np.zeros((max(len(p) for p in plans), size), np.int64)
    if layout == "balanced" and size > 1 and (causal or mask is not None):   # the plan counted it exactly
        _, planned = balance.work_plan(mask if mask is not None else masks.Mask(seqlen, True, None, None), size, near,
                                       returns, None, nodes)
        work[:len(planned)] = planned
    else:
        pairs = rank_pair_work(mask if mask is not None else masks.Mask(seqlen, causal, None, None), size, layout)
        for r, plan in enumerate(plans):
            for t, step in enumerate(plan):
                work[t, r] = sum(pairs[v.q_shard, v.kv_shard] for v in step.visits)
    work.setflags(write=False)
    return work


@lru_cache(maxsize=8)
def rank_pair_work(mask, size, layout):
    """(size, size) int64: the visible pairs of rank a's queries against rank b's keys."""
    parts = size if layout != "zigzag" or size == 1 else 2 * size
    piece = mask.seqlen // parts
    lo, hi = mask.intervals
    blocks = np.empty((parts, parts), np.int64)
    for b in range(parts):
        counts = np.clip(np.minimum(hi, (b + 1) * piece) - np.maximum(lo, b * piece), 0, None)
        blocks[:, b] = counts.reshape(parts, piece).sum(axis=1)
    owner = [pieces(mask.seqlen, r, size, layout) for r in range(size)]
    index = [[start // piece for start, _ in runs] for runs in owner]
    return np.array([[blocks[np.ix_(index[a], index[b])].sum() for b in range(size)] for a in range(size)], np.int64)


def node_list(size, per_node):
    """The node of each rank when ranks fill nodes of ``per_node`` in order (None: one node)."""
    if per_node is None or per_node >= size:
        return None
    return tuple(r // per_node for r in range(size))


def visit_work(mask, seqlen, size, layout, visit):
    """Visible pairs of one visit (schedule.Visit)."""
    q_pieces = pieces(seqlen, visit.q_shard, size, layout)
    if visit.rows is not None:
        ((start, _),) = q_pieces
        q_pieces = [(start + visit.rows[0], visit.rows[1] - visit.rows[0])]
    return sum(mask.visible_count(qs, ql, ks, kl) for qs, ql in q_pieces
               for ks, kl in pieces(seqlen, visit.kv_shard, size, layout))


@lru_cache(maxsize=32)
def schedule_traffic(seqlen, size, causal, mask, layout, direction, per_node=None):
    """Tokens each rank sends and receives at each step (of the transfers completing then), per
    kind of transfer and link: {(what, side): ((sent, received) inside the node, (sent, received)
    between nodes)}, int64 arrays (steps, ranks); ``per_node`` ranks a node (None: one node)."""
    near, returns = DIRECTIONS[direction]
    plans = [schedule_steps(layout, causal, r, size, near, returns, mask, seqlen, node_list(size, per_node))
             for r in range(size)]
    count = max(len(p) for p in plans)
    out = {}
    tokens = seqlen // size
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
def schedule_transfers(seqlen, size, causal, mask, layout, direction, per_node=None):
    """Every transfer of the schedule, once (from its sender's steps), in the order the engine posts
    them: a tuple of (posted, due, sender, receiver, what, side, tokens), ``due`` the step at whose
    end it completes, ``per_node`` ranks a node (None: one node)."""
    near, returns = DIRECTIONS[direction]
    nodes = node_list(size, per_node)
    tokens = seqlen // size
    out = []
    for r in range(size):
        for t, step in enumerate(schedule_steps(layout, causal, r, size, near, returns, mask, seqlen, nodes)):
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
