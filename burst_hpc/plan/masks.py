"""Masks on global token positions: causal, sliding window and documents (packed sequences).

Key j is visible from query i when each given mask allows it (DESIGN.md, the math):
- causal: j <= i;
- window (left, right), flash-attn's ``window_size``: i - left <= j <= i + right, -1 unbounded;
- documents, ``cu_seqlens`` = [0, ..., S] (flash-attn's varlen offsets): doc(i) == doc(j).

Together they leave each query row one interval of visible keys [lo(i), hi(i)):

    lo(i) = max(doc_start(i), i - left)
    hi(i) = min(doc_end(i), i + right + 1, i + 1 if causal)

Both ends never decrease with i, and i itself is always inside. So a block of query rows meets a
block of keys [k0, k1) as one of: hidden (no row's interval meets the keys), full (every row's
interval covers them: no mask) or masked; and a kernel needs only two int32 arrays, lo and hi,
indexed by global query position (docs/KERNELS.md, "Masks").

A call's mask is one Mask, made here once (``make``) and handed down: the schedule, balance,
placement, cost model, engine, block backends, kernels and verification read it through the Mask
alone. A new mask of this model (each row one interval that holds the row itself, both ends never
decreasing) is a field of Mask (in its ``key``, its words and ``arguments``; ``kind`` 'intervals'), a
term of ``_intervals`` and an argument of ``make``; the float64 oracle (burst_hpc/reference.py)
defines it again, independently.
"""
import hashlib
from functools import lru_cache

import numpy as np

from ..errors import MaskError
from ..recent import Recent
from ..validate import given_key


LARGEST_WINDOW = 2 ** 62     # masks add window sizes to token positions in int64


def check_window(window):
    """None, or the window as a (left, right) pair of ints >= -1 (-1: unbounded on that side), each at
    most LARGEST_WINDOW."""
    if window is None:
        return None
    try:
        left, right = window
        left, right = _integer(left), _integer(right)
    except (TypeError, ValueError):
        raise MaskError(f"window must be a (left, right) pair of integers (-1: unbounded); got {window!r}") from None
    if left < -1 or right < -1:
        raise MaskError(f"window sizes must be >= 0, or -1 for unbounded; got ({left}, {right})")
    if max(left, right) > LARGEST_WINDOW:
        raise MaskError(f"window sizes must be at most {LARGEST_WINDOW} (-1: unbounded); got ({left}, {right})")
    return None if (left, right) == (-1, -1) else (left, right)


def _integer(x):
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise TypeError
    return int(x)


def check_cu_seqlens(cu_seqlens, seqlen):
    """None, or the document offsets as an int64 array [0, ..., seqlen], strictly increasing."""
    if cu_seqlens is None:
        return None
    if type(cu_seqlens).__module__.startswith("cupy"):
        cu_seqlens = cu_seqlens.get()
    offsets = np.asarray(cu_seqlens)
    if offsets.ndim != 1 or offsets.size < 2 or not np.issubdtype(offsets.dtype, np.integer):
        raise MaskError(f"cu_seqlens must be a 1-D integer array [0, ..., S] of document offsets; "
                        f"got {offsets.dtype} with shape {offsets.shape}")
    offsets = offsets.astype(np.int64)
    offsets.setflags(write=False)   # a Mask is immutable (calls with the same arguments share one)
    if offsets[0] != 0 or offsets[-1] != seqlen:
        raise MaskError(f"cu_seqlens must start at 0 and end at the sequence length {seqlen}; "
                        f"got {offsets[0]} ... {offsets[-1]}")
    if np.any(np.diff(offsets) <= 0):
        at = int(np.argmax(np.diff(offsets) <= 0))
        raise MaskError(f"cu_seqlens must be strictly increasing (every document at least one token); "
                        f"entry {at + 1} is {offsets[at + 1]} after {offsets[at]}")
    return offsets


class Mask:
    """The agreed mask of one call on a sequence of ``seqlen`` tokens (``make``): full attention, causal,
    documents, a window, or any composition of them; made once where a call comes in and handed down.

    ``kind`` is how the mask is computed: 'full' (every key visible), 'causal' (key j visible from
    query i when j <= i: closed forms, no per-row arrays) or 'intervals' (any other mask of the
    interval model: each row's bounds lo, hi, which the kernels read). A block pair is 'hidden',
    'full' or 'masked' (``classify``): only a masked pair needs its mask applied."""

    def __init__(self, seqlen, causal=False, window=None, cu_seqlens=None):
        self.seqlen, self.causal, self.window, self.cu_seqlens = seqlen, bool(causal), window, cu_seqlens
        self.key = (seqlen, self.causal, window, None if cu_seqlens is None else hashlib.sha256(cu_seqlens.tobytes()).hexdigest())
        self.kind = "intervals" if window is not None or cu_seqlens is not None else "causal" if causal else "full"

    @property
    def is_full(self):
        """True when every key is visible from every query: no pair is ever masked."""
        return self.kind == "full"

    def __eq__(self, other):
        return isinstance(other, Mask) and self.key == other.key

    def __hash__(self):
        return hash(self.key)

    def __repr__(self):
        docs = "none" if self.cu_seqlens is None else f"{self.cu_seqlens.size - 1}"
        return f"Mask(seqlen={self.seqlen}, causal={self.causal}, window={self.window}, documents={docs})"

    def __str__(self):
        """The mask in words, for people: 'causal, 12 documents (longest 900 tokens), window (128, 0)';
        'no mask' for full attention."""
        parts = ["causal"] if self.causal else []
        if self.cu_seqlens is not None:
            count, longest = len(self.cu_seqlens) - 1, int(np.diff(self.cu_seqlens).max())
            parts.append(f"{count} document{'s' if count != 1 else ''} (longest {longest} tokens)")
        if self.window is not None:
            parts.append("window ({}, {})".format(*("unbounded" if side == -1 else side for side in self.window)))
        return ", ".join(parts) or "no mask"

    @property
    def arguments(self):
        """{name: value}: the mask as burst_attention and the float64 oracle (reference.py) take it."""
        return {"causal": self.causal, "window": self.window, "cu_seqlens": self.cu_seqlens}

    @property
    def intervals(self):
        """(lo, hi): int64 arrays over global query positions; row i sees keys lo[i] <= j < hi[i]."""
        return _intervals(self)

    def rows(self, q_start, n):
        """(lo, hi) of the n query rows from global position q_start (full and causal masks: made for
        these rows alone, so positions past ``seqlen`` are fine)."""
        if self.kind == "intervals":
            lo, hi = self.intervals
            return lo[q_start:q_start + n], hi[q_start:q_start + n]
        lo = np.zeros(n, np.int64)
        if self.kind == "causal":
            return lo, np.arange(q_start + 1, q_start + n + 1, dtype=np.int64)
        return lo, np.full(n, self.seqlen, np.int64)

    def classify(self, q_start, q_len, k_start, k_len):
        """'hidden', 'full' or 'masked' for queries [q_start, +q_len) against keys [k_start, +k_len)."""
        return ("hidden", "full", "masked")[int(self.classify_many(q_start, q_len, k_start, k_len))]

    def classify_many(self, q_start, q_len, k_start, k_len):
        """``classify`` of many blocks at once (int64 arrays that broadcast): 0 hidden, 1 full, 2 masked (a
        visit's pieces in one numpy pass). The row intervals never shrink, so a block's first and last row
        bound it; a row sees itself, so a block with a row whose interval ends after the block's first key and
        starts before its end sees some key of it."""
        q_start, q_len, k_start, k_len = (np.asarray(x, np.int64) for x in (q_start, q_len, k_start, k_len))
        k_end, q_end = k_start + k_len, q_start + q_len
        empty = (q_len == 0) | (k_len == 0)
        if self.kind == "full":
            return np.where(empty, 0, 1 + 0 * k_end)
        if self.kind == "causal":
            return np.where(empty | (k_start >= q_end), 0, np.where(k_end <= q_start + 1, 1, 2))
        lo, hi = self.intervals
        rows = lo.size   # the sequence's length; a Packed mask's own rows (its seqlen counts its keys)
        last_row = np.clip(q_end - 1, 0, rows - 1)
        full = (lo[last_row] <= k_start) & (hi[np.clip(q_start, 0, rows - 1)] >= k_end)
        first = np.clip(np.searchsorted(hi, k_start, side="right"), q_start, q_end)
        last = np.clip(np.searchsorted(lo, k_end, side="left"), q_start, q_end)
        return np.where(empty, 0, np.where(full, 1, np.where(first < last, 2, 0)))

    def visible_count(self, q_start, q_len, k_start, k_len):
        """How many (query, key) pairs of the two blocks are visible: the work they cost."""
        if self.kind == "full":
            return q_len * k_len
        lo, hi = self.rows(q_start, q_len)
        return int(np.clip(np.minimum(hi, k_start + k_len) - np.maximum(lo, k_start), 0, None).sum())

    def device_intervals(self, xp):
        """(lo, hi) as int32 arrays on ``xp``'s current device: the kernels' view of an 'intervals' mask."""
        return _device_intervals(self, xp, xp.cuda.Device().id)


class Packed(Mask):
    """One rank's queries against its packed keys (plan/packing.py, engine/packed.py): local query row i
    sees the keys at buffer positions lo[i] <= j < hi[i]. Positions are the buffer's and the rank's own
    rows, not the sequence's, so only block calls at k_start = 0 read it (q_start: a local row). ``of``: what makes
    the buffer (the call's mask, the layout and the rank), its identity in the caches."""

    def __init__(self, lo, hi, keys, of):
        super().__init__(keys)
        self.kind, self.key = "intervals", ("packed", of)
        self.bounds = (lo.astype(np.int64), hi.astype(np.int64))

    @property
    def intervals(self):
        return self.bounds

    def __repr__(self):
        return f"Packed(rows={self.bounds[0].size}, keys={self.seqlen})"


# Bounded caches (a training loop meets new document offsets every batch): only the intervals
# of the last few masks are kept; a Mask itself holds just its offsets.
@lru_cache(maxsize=4)
def _intervals(mask):
    i = np.arange(mask.seqlen, dtype=np.int64)
    lo, hi = np.zeros_like(i), np.full_like(i, mask.seqlen)
    if mask.cu_seqlens is not None:
        doc = np.searchsorted(mask.cu_seqlens, i, side="right") - 1
        lo, hi = mask.cu_seqlens[doc], mask.cu_seqlens[doc + 1]
    if mask.window is not None:
        left, right = mask.window
        if left >= 0:
            lo = np.maximum(lo, i - left)
        if right >= 0:
            hi = np.minimum(hi, i + right + 1)
    if mask.causal:
        hi = np.minimum(hi, i + 1)
    return lo, hi


@lru_cache(maxsize=4)
def document_starts(mask):
    """int64, read-only: the rows (a Packed mask's own rows) at which a run of rows with disjoint keys begins:
    row 0 and every row that sees none of the keys the row before it sees (lo[r] >= hi[r - 1]; under documents,
    each document's first row). The sm90 forward and backward start their query tiles there (plan/tiles)."""
    lo, hi = mask.intervals
    starts = np.concatenate([[0], np.flatnonzero(lo[1:] >= hi[:-1]) + 1]) if lo.size else np.zeros(0, np.int64)
    starts.setflags(write=False)
    return starts


@lru_cache(maxsize=4)
def document_keys(mask):
    """int64, read-only: the first key of each run of rows of ``document_starts``, sorted and distinct (under
    documents, each document's first key). The sm90 backward starts its key blocks there (plan/tiles.backward_tiles)."""
    firsts = mask.intervals[0][document_starts(mask)]
    if firsts.size and np.all(firsts[1:] >= firsts[:-1]):   # bounds that never decrease (every mask the API makes)
        keys = firsts[np.concatenate([[True], firsts[1:] != firsts[:-1]])]
    else:
        keys = np.unique(firsts)
    keys.setflags(write=False)
    return keys


@lru_cache(maxsize=16)   # a stepped gather's pass calls under a Packed mask of each shard it visits
def _device_intervals(mask, xp, device):
    return tuple(xp.asarray(x.astype(np.int32)) for x in mask.intervals)


_MADE = Recent(8)   # the masks of recent argument sets (a training loop repeats one or two)


def make(seqlen, causal=False, window=None, cu_seqlens=None):
    """The Mask of a call's arguments, as the API takes them (validated; MaskError if bad). A repeated argument
    set (validate.given_key: the same types and values) gets the Mask made for it before: masks are immutable,
    and checking the offsets is a share of a short call's host time."""
    key = given_key((seqlen, causal, window), cu_seqlens)
    mask = None if key is None else _MADE.get(key)
    if mask is None:
        mask = Mask(seqlen, causal, check_window(window), check_cu_seqlens(cu_seqlens, seqlen))
        if mask.kind == "intervals" and seqlen >= 2 ** 31:
            raise MaskError(f"documents and windows need a sequence shorter than 2**31 tokens; got {seqlen}")
        if key is not None:
            _MADE.put(key, mask)
    return mask


@lru_cache(maxsize=4)   # a planner asks the same few grains over and over; an entry can be large
def block_band(mask, rows, keys):
    """(ptr, key, pairs), read-only int64: the visible (query, key) pairs of every block of ``rows`` query rows
    against the blocks of ``keys`` keys in its band, those from its first row's first key to its last row's last
    (the only ones it can see: zeros among them), block i's entries from ptr[i] to ptr[i + 1], ``key`` the key
    block of each. The row intervals never shrink, so the pairs of a block of rows with the keys before a point
    come from prefix sums and searchsorted, without visiting the rows one by one; a grid of short documents costs
    its band, not its square. A Packed mask: its own rows against its keys (``seqlen`` of them)."""
    lo, hi = mask.intervals
    lo_sums, span_sums = (np.concatenate([[0], np.cumsum(x)]) for x in (lo, hi - lo))
    starts = np.arange(0, lo.size, rows, dtype=np.int64)
    nkeys = -(-mask.seqlen // keys)
    first = np.minimum(lo[starts].astype(np.int64) // keys, nkeys)
    width = np.maximum(np.minimum(-(-hi[np.minimum(starts + rows, lo.size) - 1].astype(np.int64) // keys), nkeys)
                       - first, 0)
    # each block of rows at the key boundaries of its band: the pairs with the keys before each boundary x
    at, block = ranges(0, width + 1)
    ends, begin = np.minimum((first[block] + at) * keys, mask.seqlen), starts[block]
    done = np.clip(np.searchsorted(hi, ends, side="right"), begin, begin + rows)   # rows seeing no key past x
    begun = np.clip(np.searchsorted(lo, ends, side="right"), begin, begin + rows)  # rows seeing a key before x
    before = span_sums[done] - span_sums[begin] + (begun - done) * ends - (lo_sums[begun] - lo_sums[done])
    inside = at[1:] > 0   # the differences within a band, not across two
    out = (np.concatenate([[0], np.cumsum(width)]), (first[block] + at - 1)[1:][inside], np.diff(before)[inside])
    for x in out:
        x.setflags(write=False)
    return out


@lru_cache(maxsize=4)
def block_counts(mask, rows, keys):
    """int64 (ceil(S / rows), ceil(S / keys)), read-only: the visible (query, key) pairs of every block of ``rows``
    query rows against every block of ``keys`` keys (block_band's entries, zeros elsewhere, never written)."""
    ptr, key, pairs = block_band(mask, rows, keys)
    out = np.zeros((ptr.size - 1, -(-mask.seqlen // keys)), np.int64)
    out[np.repeat(np.arange(ptr.size - 1), np.diff(ptr)), key] = pairs
    out.setflags(write=False)
    return out


def ranges(first, lengths):
    """(positions, index): the ranges first[i], ..., first[i] + lengths[i] - 1 (``first`` an array or one int)
    laid end to end, int64, and the i of each position."""
    lengths = np.asarray(lengths, np.int64)
    index = np.repeat(np.arange(lengths.size), lengths)
    offsets = np.arange(index.size) - (np.cumsum(lengths) - lengths)[index]
    return np.broadcast_to(np.asarray(first, np.int64), lengths.shape)[index] + offsets, index


@lru_cache(maxsize=16)
def pair_work(mask, layout):
    """(size, size) int64, read-only: the visible (query, key) pairs of rank a's queries against rank
    b's keys, ranks holding tokens by ``layout`` (a layout.Layout)."""
    owner = [layout.pieces(r) for r in range(layout.size)]
    piece = int(np.gcd.reduce([n for runs in owner for start, n in runs] + [start for runs in owner for start, _ in runs]))
    blocks = block_counts(mask, piece, piece)
    index = [[i for start, n in runs for i in range(start // piece, (start + n) // piece)] for runs in owner]
    rows = np.array([blocks[i].sum(axis=0) for i in index])                           # (rank, key piece)
    out = np.stack([rows[:, i].sum(axis=1) for i in index], axis=1).astype(np.int64)   # (rank, rank)
    out.setflags(write=False)
    return out


@lru_cache(maxsize=64)
def ring_steps(mask, layout, queries_travel=False):
    """How many ring steps have work: 1 + the last step t at which some rank has a visible pair.
    At step t rank r holds the travelling shard of rank (r - t) mod P: its keys (forward and
    kv-ring), or its queries (q-ring, ``queries_travel``). Every rank computes the same number;
    full and causal masks: every step (they hide no whole shard from every rank)."""
    size = layout.size
    if mask.kind != "intervals":
        return size
    pairs = pair_work(mask, layout)
    rank = np.arange(size)
    busy = [t for t in range(1, size)
            if (pairs[(rank - t) % size, rank] if queries_travel else pairs[rank, (rank - t) % size]).any()]
    return 1 + (busy[-1] if busy else 0)


def rank_work(mask, layout):
    """Visible (query, key) pairs each rank computes over a whole ring (its queries against every
    shard's keys): the per-rank work, whose max over mean is the imbalance."""
    return tuple(int(x) for x in pair_work(mask, layout).sum(axis=1))


def random_documents(rng, seqlen, count):
    """cu_seqlens of ``count`` documents of random lengths (at least 1 token each) filling seqlen."""
    if not 1 <= count <= seqlen:
        raise MaskError(f"cannot pack {count} documents into {seqlen} tokens (need 1 <= documents <= tokens)")
    cuts = np.sort(rng.choice(np.arange(1, seqlen), size=count - 1, replace=False))
    return np.concatenate([[0], cuts, [seqlen]]).astype(np.int64)
