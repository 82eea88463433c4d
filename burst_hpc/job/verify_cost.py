"""What the sampled check (:mod:`burst_hpc.job.verify`) costs, so a job can size its sample to a budget
and announce the check's time before it starts.

The check streams over this rank's tokens in blocks (:func:`block_spans`); a block costs, per pass (the
keys pass adds to the sampled rows' sums, the queries pass to the sampled columns'), a fixed part, a
part per token (its inputs to float64), a part per active sample (its sums updated) and a part per
(token, active sample) pair, where a sample is active in a block when its row sees a key of the block
(rows), or a query of the block sees its key (columns): the block's rectangle, not only its visible
pairs. :func:`measure` times blocks of the job's own shapes and dtype on this machine and fits the four
parts; :class:`Blocks` counts each block's active samples as the loop finds them (reference.meets), so a
prediction adds up what the loop will run.
"""
import time
from dataclasses import dataclass

import numpy as np

from ..device import sync
from ..dtypes import dtype_name
from ..plan import masks
from ..reference import meets
from .verify_sums import Samples

BLOCK_ELEMENTS = {"numpy": 1 << 18, "cuda": 1 << 25}   # B * Hq * samples * tokens of one score block
CALIBRATION_ELEMENTS = {"numpy": 1 << 14, "cuda": 1 << 23}   # the same of the calibration's smallest (its largest: 16x)
LEAST_WIDTH = 64    # tokens of a block at least: narrower, the part per sample (its sums, D wide) outweighs the pairs


@dataclass(frozen=True)
class Rates:
    """Seconds of one pass over a block on this machine: ``keys`` (the rows' sums) and ``queries`` (the
    columns', None without gradients), each (per block, per token, per active sample, per (token,
    active sample) pair)."""
    keys: tuple
    queries: tuple = None

    def block(self, tokens, rows, cols):
        """Predicted (fixed, samples) seconds of a block of ``tokens`` tokens with ``rows`` active sample
        rows and ``cols`` active sample columns: the parts per block and per token, and the parts that
        grow with the samples (a pass with no active sample costs nothing: it returns before any work)."""
        fixed = varying = 0.0
        for part, active in ((self.keys, rows), (self.queries, cols)):
            if part is not None and active > 0:
                per_block, per_token, per_sample, per_pair = part
                fixed += per_block + per_token * tokens
                varying += (per_sample + per_pair * tokens) * active
        return fixed, varying


def block_width(spec, samples, xp):
    """Tokens per block when ``samples`` samples (all ranks') are checked: BLOCK_ELEMENTS of scores, at
    least LEAST_WIDTH tokens."""
    return max(LEAST_WIDTH, BLOCK_ELEMENTS[device_kind(xp)] // (spec.batch * spec.heads * max(samples, 1)))


def block_spans(positions, width):
    """[(lo, hi)]: local token indices in blocks of at most ``width`` tokens, each a run of consecutive
    global positions (a zigzag shard's two chunks are never mixed in one block)."""
    positions = np.asarray(positions)
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    runs = zip(np.concatenate([[0], breaks]), np.concatenate([breaks, [len(positions)]]))
    return [(int(lo), int(min(end, lo + width))) for start, end in runs for lo in range(start, end, width)]


class Blocks:
    """This rank's blocks (``spans``, from :func:`block_spans`: runs of consecutive positions) and what
    they cost: a sample is active in a block as a row when it sees one of the block's keys, as a
    column when one of the block's queries sees it (reference.meets, as the check itself finds them)."""

    def __init__(self, positions, width, mask):
        self.spans = block_spans(positions, width)
        positions = np.asarray(positions, np.int64)
        self.runs = [(int(positions[lo]), int(positions[hi - 1]) + 1) for lo, hi in self.spans]
        self.mask = mask.arguments   # the run's masks.Mask, as the oracle takes it

    def active(self, samples):
        """(rows, cols): per block, how many of ``samples`` (global positions) are active rows, columns."""
        rows = np.array([meets(samples, a, b, **self.mask).sum() for a, b in self.runs], np.int64)
        cols = np.array([meets(samples, a, b, as_keys=True, **self.mask).sum() for a, b in self.runs], np.int64)
        return rows, cols

    def seconds(self, rates, samples):
        """Predicted (fixed, samples) seconds of the loop over the blocks with these ``samples``."""
        rows, cols = self.active(samples)
        parts = [rates.block(b - a, r, c) for (a, b), r, c in zip(self.runs, rows, cols)]
        return sum(f for f, _ in parts), sum(v for _, v in parts)

    def budget_rows(self, rates, grids, budget_s, most):
        """The most samples per rank (at most ``most``) whose loop fits ``budget_s`` seconds, by the
        expected active counts: each rank draws its samples from its own tokens, for which ``grids``
        (one array of evenly spaced positions of each rank's tokens) stand in."""
        fixed, _ = self.seconds(rates, np.concatenate(grids))
        per_sample = sum(self.seconds(rates, grid)[1] / len(grid) for grid in grids)   # one sample of each rank
        return most if per_sample <= 0 else int(min(most, max(0.0, budget_s - fixed) / per_sample))



def measure(spec, scale, backward, xp):
    """This process's costs of the check, an array (pass: keys, queries; part: per block, per token, per
    sample, per pair), for the problem's shapes and dtype. An untimed first go under a causal mask loads
    what the check uses (CuPy's kernels, also those of a block where only some samples are active);
    then four timed blocks, (T, c), (4T, c), (T, 4c) and (4T, 4c) samples x tokens (the best of two
    goes), separate the parts of each pass."""
    from types import SimpleNamespace

    kind = device_kind(xp)
    b, hq, hk, d = spec.batch, spec.heads, spec.kv_heads, spec.head_dim
    samples = 16
    tokens = max(16, CALIBRATION_ELEMENTS[kind] // (b * hq * samples))
    rng = np.random.default_rng(0)
    shape = SimpleNamespace(batch=b, heads=hq, kv_heads=hk, head_dim=d, dtype=spec.dtype, seqlen=4 * tokens)

    def host(t, h):
        return rng.standard_normal((b, t, h, d), np.float32).astype(spec.dtype)

    def device(t, h):   # a large block is drawn where it is used (NumPy's generator would take seconds)
        if xp is np:
            return host(t, h)
        x = xp.random.standard_normal((b, t, h, d), np.float32)
        return (x.view(xp.uint32) >> 16).astype(xp.uint16) if dtype_name(spec.dtype) == "bfloat16" else \
            x.astype(spec.dtype)

    n = 4 * samples
    gathered = {"positions": np.arange(n) * tokens // samples, "q": host(n, hq), "k": host(n, hk), "v": host(n, hk),
                "lse": np.full((b, hq, n), 5.0), "do": host(n, hq) if backward else None, "delta": np.zeros((b, hq, n))}
    block = {name: device(4 * tokens, hk if name in ("k", "v") else hq) for name in ("q", "k", "v", "do", "o")}
    lse = xp.full((b, hq, 4 * tokens), 5.0, xp.float32)

    full, causal = masks.make(shape.seqlen), masks.make(shape.seqlen, True)

    def timed(t, c, mask=full, first=0):
        part = {name: x[:t] if name == "positions" else None if x is None else x[:, :, :t] if x.ndim == 3 else x[:, :t]
                for name, x in gathered.items()}
        check = Samples(part, shape, mask, scale, xp)
        pos, keys = np.arange(first, first + c), slice(first, first + c)
        sync(xp)
        begin = time.perf_counter()
        check.add_keys(pos, block["k"][:, keys], block["v"][:, keys])
        sync(xp)
        middle = time.perf_counter()
        if backward:
            check.add_queries(pos, block["q"][:, keys], block["do"][:, keys], lse[:, :, keys], block["o"][:, keys])
            sync(xp)
        return np.array([middle - begin, time.perf_counter() - middle])

    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for first in (0, 2 * tokens):   # causal: some samples see none of the keys, some keys no sample sees
            timed(n, 16, causal, first)
        sizes = ((samples, tokens), (n, tokens), (samples, 4 * tokens), (n, 4 * tokens))
        base, more_samples, more_tokens, more_both = np.min([[timed(*size) for size in sizes] for _ in range(2)],
                                                            axis=0)
    pairs = samples * tokens
    per_pair = np.maximum(0.0, (more_both - more_tokens - more_samples + base) / (9 * pairs))
    per_sample = np.maximum(0.0, (more_samples - base - 3 * per_pair * pairs) / (3 * samples))
    per_token = np.maximum(0.0, (more_tokens - base - 3 * per_pair * pairs) / (3 * tokens))
    per_block = np.maximum(0.0, base - per_token * tokens - per_sample * samples - per_pair * pairs)
    return np.stack([per_block, per_token, per_sample, per_pair], axis=1)


def device_kind(xp):
    """The key of ``xp`` in the tables above: "numpy" or "cuda"."""
    return "numpy" if xp is np else "cuda"

