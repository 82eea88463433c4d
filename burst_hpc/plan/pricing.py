"""The prices of a pass's schedule (costmodel.pass_prediction): its kernels' seconds from the tiles they run
(tiles.py) or their visible pairs, with the rates of rates.py, and the steps' time as the transfers on each link
allow it (``Costs.run``)."""
from functools import lru_cache

import numpy as np

from . import tiles
from .accounting import attention_flops, visible_pairs


# the Rates field pricing each of tiles.COUNTS (ns a tile of one head at D = 128)
TILE_PRICES = ("fwd_key_tile_ns", "fwd_query_tile_ns", "bwd_step_ns", "bwd_shared_ns", "bwd_shared_down_ns")


def backward_counts():
    """bool (len(tiles.COUNTS),): which counts the backward's kernels run (the others the forward's)."""
    return np.array([name.startswith("bwd") for name in tiles.COUNTS])


def kernel_prices(rates, batch, heads, head_dim, backward):
    """(seconds a visible pair, seconds a tile of each of tiles.COUNTS (float64 array)) of a pass's kernels over
    ``batch`` x ``heads`` heads of ``head_dim``: the rates' per-tile terms are per head at D = 128, scaled by
    D / 128 (the work of a tile); the per-pair rate counts FlashAttention's FLOPs (inf: no per-pair term)."""
    rate = (rates.bwd_tflops if backward else rates.fwd_tflops) * 1e12
    per_pair = attention_flops(batch, heads, head_dim, 1.0, backward) / rate
    terms = np.array([getattr(rates, name) for name in TILE_PRICES]) * (backward_counts() == backward)
    return per_pair, terms * 1e-9 * batch * heads * head_dim / 128


def outside_seconds(rates, batch, heads, head_dim, tokens, backward):
    """Seconds a pass spends outside its attention kernels for ``tokens`` query tokens of ``batch`` x ``heads``
    heads: the backward's row pre-pass (delta) and dQ conversion, memory-bound, once a pass."""
    return rates.bwd_token_ns * 1e-9 * batch * heads * head_dim / 128 * tokens if backward else 0.0


def call_seconds(rates, mask, batch, heads, head_dim, backward, gqa_pack=1):
    """Predicted seconds of one call over the whole of ``mask`` (a masks.Mask) on one device: its kernels and
    the seconds outside them, no fixed costs (bench/predict_sweep.py; `burst-hpc plan --measure`); ``gqa_pack``
    as tiles.call_tiles takes it."""
    per_pair, per_tile = kernel_prices(rates, batch, heads, head_dim, backward)
    counts = tiles.call_tiles(mask, 0, mask.seqlen, 0, mask.seqlen, not mask.is_full, gqa_pack)
    return (per_pair * visible_pairs(mask) + counts @ per_tile
            + outside_seconds(rates, batch, heads, head_dim, mask.seqlen, backward))


class Costs:
    """The prices of one pass's Account: its kernels' seconds per tile, per visible pair and per block call
    (``prices``: kernel_prices' pair), the seconds outside its kernels (``outside``, at scale 1), each transfer's
    seconds on its link and its message's fixed cost, each step's fixed cost."""

    def __init__(self, acc, prices, nbytes, rates, backward, outside=0.0, alone=False):
        links = np.array([[rates.intra_gbps * 1e9, rates.intra_latency_us * 1e-6],
                          [rates.inter_gbps * 1e9, rates.inter_latency_us * 1e-6]])
        self.acc, (self.per_pair, self.per_tile), self.outside = acc, prices, outside
        self.seconds, self.latency = nbytes / links[acc.ends["far"], 0], links[acc.ends["far"], 1]
        self.launch = (rates.bwd_launch_us if backward else rates.fwd_launch_us) * 1e-6
        # a step's fixed cost is its exchanges' (the host posting, waiting, bookkeeping): a pass on one rank
        # (``alone``) has none, its calls queue on the GPU behind each other (one H200, 8k documents: a step's
        # 150 us made the one-GPU backward predicted 22-23% slow); nor the packed passes (Account.stepped)
        self.step = 0.0 if alone or not acc.stepped else rates.step_us * 1e-6

    def kernels(self, scales):
        """(steps, ranks, scales): each rank's kernel seconds at each step, at each scale (tiles.COUNT_POWERS)."""
        tiled = self.per_tile[:, None] * scales[None, :] ** tiles.COUNT_POWERS[:, None]
        return self.acc.work[:, :, None] * self.per_pair * scales ** 2 + self.acc.tiles @ tiled

    def calls(self, scales, fixed=True):
        """(steps, ranks, scales): each rank's kernels at each step (its work and, ``fixed``, its block calls)."""
        work = self.kernels(scales)
        if fixed and self.launch:
            work = work + self.acc.launches[:, :, None] * self.launch
        return work

    def critical(self, scales, fixed=True):
        """(steps, scales): each step's busiest rank's kernels."""
        return self.calls(scales, fixed).max(axis=1)

    def compute(self, scales):
        """(scales,): the kernels' seconds on the pass's critical path: each step's busiest rank's, summed; where the
        ranks do not wait for each other between steps (not ``Account.stepped``), the busiest rank's over all."""
        if self.acc.stepped:
            return self.critical(scales).sum(axis=0)
        return self.calls(scales).sum(axis=0).max(axis=0)

    def run(self, scales, fixed=True):
        """Seconds of the pass for each of ``scales`` (``fixed``: with the fixed costs), the seconds outside the
        kernels (they grow with the tokens) after its steps."""
        latency = self.latency if fixed else np.zeros_like(self.latency)
        if not self.acc.stepped:
            return (_run_ranks(self.acc, self.calls(scales, fixed), self.seconds, latency, scales)
                    + self.outside * scales)
        return _run(self.acc, self.critical(scales, fixed), self.seconds, latency, self.step if fixed else 0.0,
                    scales) + self.outside * scales


def _run(acc, critical, seconds, latency, step, scales):
    """Seconds of the steps, for each of ``scales`` (the tokens per GPU scaled: transfers by it;
    ``critical`` (steps, scales) each step's busiest rank's kernels at each scale): each step the
    larger of those kernels and the arrival of every transfer due at its end, then its fixed cost
    ``step``; each link end carries its messages one after another in posting order (``seconds``
    each at scale 1, plus its message's fixed cost ``latency``), none before it is posted."""
    steps = _link_steps(acc)
    free = np.zeros((4 * acc.work.shape[1], scales.size))   # when each (rank, far, out) link end is next free
    arrived = np.zeros((len(critical), scales.size))
    time = np.zeros(scales.size)
    for t, compute in enumerate(critical):
        start = time
        if t in steps:
            by_due, dues, due_starts = steps[t][4:]
            done = _carried(steps[t], start, free, seconds, latency, scales)
            arrived[dues] = np.maximum(arrived[dues], np.maximum.reduceat(done[by_due], due_starts, axis=0))
        time = np.maximum(start + compute, arrived[t]) + step
    return time


def _carried(posted, start, free, seconds, latency, scales):
    """(rows, scales): when each message a step posts (``posted``: its _link_steps entry) is done at its link end,
    the ends carrying theirs one after another from ``start`` (scales,) or when each end is ``free``, which is
    advanced past them."""
    rows, ends, counts, last = posted[:4]
    carried = np.cumsum(seconds[rows, None] * scales + latency[rows, None], axis=0)   # end after end
    before = np.concatenate([np.zeros((1, scales.size)), carried[last[:-1]]])
    begin = np.maximum(start, free[ends]) - before
    done = np.repeat(begin, counts, axis=0) + carried
    free[ends] = done[last]
    return done


def _run_ranks(acc, calls, seconds, latency, scales):
    """Seconds of the steps of a pass whose ranks do not wait for each other between steps (the packed passes: the
    host issues the whole pass, each rank's GPU waits only for its own transfers), for each of ``scales``
    (``calls`` (steps, ranks, scales): each rank's kernels at each step): a rank's step ends when its kernels
    and every transfer at one of its link ends due then are done (its senders' outgoing ends are not waited for: a
    message queued behind others there is priced as arriving early). A step's transfers start once every rank
    has reached it (sender and receiver both post them); each link end carries its messages one after another."""
    steps = _link_steps(acc)
    ranks = calls.shape[1]
    free = np.zeros((4 * ranks, scales.size))
    arrived = np.zeros(calls.shape)
    time = np.zeros((ranks, scales.size))
    for t, compute in enumerate(calls):
        start = time
        if t in steps:
            rows = steps[t][0]
            done = _carried(steps[t], start.max(axis=0), free, seconds, latency, scales)
            np.maximum.at(arrived, (acc.ends["due"][rows], acc.ends["rank"][rows]), done)
        time = np.maximum(start + compute, arrived[t])
    return time.max(axis=0)


@lru_cache(maxsize=64)
def _link_steps(acc):
    """{step: (rows of acc.ends it posts, their link ends (rank, far, out) as indices, how many rows
    each end has, the last row of each, the rows (of those) by due step, the
    due steps, where each due step's rows start)}."""
    ends = acc.ends
    key = ends["rank"] * 4 + ends["far"] * 2 + ends["out"]
    out = {}
    for t in np.unique(ends["posted"]):
        rows = np.flatnonzero(ends["posted"] == t)
        first = np.flatnonzero(np.diff(key[rows], prepend=-1) != 0)
        counts = np.diff(np.append(first, rows.size))
        by_due = np.argsort(ends["due"][rows], kind="stable")
        due = ends["due"][rows][by_due]
        due_starts = np.flatnonzero(np.diff(due, prepend=-1) != 0)
        out[int(t)] = (rows, key[rows][first], counts, first + counts - 1, by_due,
                       due[due_starts], due_starts)
    return out
