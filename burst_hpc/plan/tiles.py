"""The tiles a block call's kernels run under a mask: what the sm90 kernels schedule (backends/cuda/sm90.py reads
the ranges and counts from here) and what the cost model prices (docs/RING.md, "The cost model").

The forward runs query tiles of at most bm rows: a call's rows cut into runs (a long document, or a stretch of
shorter ones), each into tiles of bm rows from its first, or a grid of tiles where that runs fewer
(``forward_tiles``), each against the key tiles of bn from the first key its first row sees to the last its last
row sees, skipping a tile that sees none; the backward runs one CTA per key block of at most bn keys, walking
the query tiles of at most bm rows in which some row sees one of its keys, both laid out from document starts
too, or on a grid where that walks fewer steps (``backward_tiles``). A full pair (no mask) runs every tile of its
rectangle, a causal one is counted by the same rule on its rows' bounds. ``call_tiles`` counts, per head, what
the cost model prices (COUNTS):

- ``fwd_key_tiles``: the forward's key tiles (each a bm x bn product and its softmax update);
- ``fwd_query_tiles``: the forward's query tiles with any key (each one's Q load, merge and store);
- ``bwd_steps``: the backward's steps, a (key block, query tile) each (its five products);
- ``bwd_shared``: the sum over the backward's query tiles of the square root of the key blocks that see each
  (the steps of a query tile seen by n key blocks share its Q, dO and dQ rows through L2: a step costs
  1 / sqrt(n) of a query tile's traffic, as the single-GPU sweep of bench/predict_sweep.py shows), over the
  tiles whose key blocks walk up; ``bwd_shared_down`` the same over those whose key blocks walk down
  (``walk_down``: a short document's, which meet on its rows and share them better).
"""
import math
from typing import NamedTuple

import numpy as np

from . import masks

# the tiles the cost model counts: the sm90 kernels' at D = 128 (their kernel tables: the forward's 128-row
# instance, the backward's 64-row one), the shapes the per-tile rates of rates.py were measured on
FORWARD_TILE = (128, 128)
BACKWARD_TILE = (64, 128)
COUNTS = ("fwd_key_tiles", "fwd_query_tiles", "bwd_steps", "bwd_shared", "bwd_shared_down")
# how each count grows with the tokens of both sides scaled by s (costmodel.predict's ``scale``): s^2 tiles of a
# rectangle, s query tiles, s^2 steps, s query tiles of sqrt(s) key blocks
COUNT_POWERS = np.array([2.0, 1.0, 2.0, 1.5, 1.5])


# the longest piece (key blocks) whose sm90 backward CTAs walk their query tiles down under documents (walk_down)
WALK_DOWN_BLOCKS = 64
# the forward's query tiles (forward_tiles) and the backward's tiles and key blocks (backward_tiles): a document of
# at least this many tiles is a run of tiles of its own; shorter ones share runs. Every document its own run would
# give a 200-token document two tiles of which the second holds a few rows: on packs of documents up to 200 / 400
# tokens 1.17x / 1.06x the query and key tiles of a grid of tiles; with 4, 1.00x there and 0.89-0.91x on the 8k
# MagiAttention sets (bench_packed.py's)
LONG_DOCUMENT_TILES = 4
# PackGQA: under an interval mask the sm90 forward's tile rows hold up to this many query heads of one K/V group
# (FlashAttention-3 packs every varlen call), a tile of 128 rows then 16 positions of 8 heads
MAX_PACKED_HEADS = 8


def packed_heads(group):
    """The query heads of one K/V group (``group`` query heads per K/V head) that the sm90 forward packs into a
    tile's rows under an interval mask: the largest power of two up to MAX_PACKED_HEADS that divides the group (its
    tile's rows are then bm / that positions of that many heads; 1: no packing). A short document's last tile
    wastes at most those fewer positions' rows."""
    return math.gcd(int(group), MAX_PACKED_HEADS)


def pieces(t_end):
    """Per key block, the index of its piece: a run of key blocks that walk to the same end tile ``t_end`` (under
    documents, one document's; the sm90 backward's CTA order, launch.key_block_order, starts a piece together)."""
    t_end = np.asarray(t_end, np.int64)
    return np.concatenate(([0], np.cumsum(t_end[1:] != t_end[:-1]))) if len(t_end) else np.zeros(0, np.int64)


def walk_down(t_lo, t_end, most=None):
    """Per key block (0 or 1), whether the sm90 backward walks its query tiles [t_lo, t_end) from the last down
    (WalkStep in attn_bwd_sm90.cu) under documents: the seen key blocks of pieces with at most ``most`` (None:
    WALK_DOWN_BLOCKS) of them. Walking down, a document's key blocks meet on the same Q, dO and dq rows and share
    them in L2 (the 8k bench sets 1.4x); a longer piece's CTAs of a head slot would all start on its last rows at
    once (one document of 16k tokens, 128 key blocks at D = 128: 0.94x), so they walk up, each from its own
    diagonal (one of 8k: down 1.045x). Plain causal and full masks walk up, and so do sliding windows as the
    host decides (sm90's schedule; a window's keys packed by the gather scheme are documents to the kernel)."""
    most = WALK_DOWN_BLOCKS if most is None else most
    t_lo, t_end = np.asarray(t_lo, np.int64), np.asarray(t_end, np.int64)
    piece, seen = pieces(t_end), t_end > t_lo
    if not len(piece):
        return np.zeros(0, np.int64)
    return (seen & (np.bincount(piece, seen)[piece] <= most)).astype(np.int64)


class ForwardTiles(NamedTuple):
    """The sm90 forward's query tiles of block calls (``forward_tiles``), one entry per tile."""
    call: np.ndarray       # the call (an index into the calls' arrays)
    first: np.ndarray      # its first row, local to the call
    end: np.ndarray        # one past its last row
    key_begin: np.ndarray  # its first key, local: the first row's lo, clipped to the call's keys
    key_tiles: np.ndarray  # key tiles of bn from key_begin to its last row's hi; 0: it sees no key (skipped)


def forward_tiles(mask, q_start, sq, k_start, sk, bm, bn):
    """ForwardTiles of one call, or of many (each argument an array over the calls), under ``mask``: what the
    sm90 forward's interval instance runs (its host table: backends/cuda/sm90.py), and what the cost model counts
    for every masked call (a causal mask's rows form one run: its tiles are those of the causal instance).

    A call's rows are cut into runs at document starts (masks.document_starts; ``_document_runs``): each document
    of at least LONG_DOCUMENT_TILES * bm rows is a run of its own, and so is each stretch of shorter documents
    between two such. A run is cut into tiles of bm rows from its first. A tile's keys go from its first row's lo to its
    last row's hi, in key tiles of bn from that first key: a long document's tiles start on its first row and its
    key tiles on its first key, so the tile at i bm rows into it loads exactly i + 1 key tiles (FlashAttention-3's
    varlen tiles). Tiles on a grid of bm rows would straddle documents: the rows past a boundary load the earlier
    document's keys too, about a key tile more per query tile (the 8k MagiAttention sets: 393 -> 342 key tiles).
    Short documents share tiles: a tile of a short document's last few rows would compute bm rows for them. A
    long document's last tile is whole work for its last few rows too, so where a call's grid of tiles (one run)
    runs fewer query and key tiles, the call keeps the grid (random packs of 8k tokens: the runs 0.92-1.04x the
    grid's tiles)."""
    q_start, sq, k_start, sk = _calls(q_start, sq, k_start, sk)
    lo, hi = mask.intervals
    laid = [_tiles(*_cut(*runs(masks.document_starts(mask), q_start, sq, bm), bm), lo, hi, q_start, k_start, sk, bn)
            for runs in (_document_runs, _grid_runs)]
    cost = [np.bincount(t.call, t.key_tiles + (t.key_tiles > 0), q_start.size) for t in laid]
    return ForwardTiles(*_merged(laid, cost[0] <= cost[1], lambda t: t[:2]))


def _calls(*columns):
    """The block calls' columns (q_start, sq, k_start, sk: ints or arrays) as flat int64 arrays of one length."""
    return tuple(x.reshape(-1) for x in np.broadcast_arrays(*(np.asarray(x, np.int64) for x in columns)))


def _merged(laid, keep, key):
    """Two layouts (tuples of per-item arrays, the first the item's call) merged: the first's items of the calls
    where ``keep``, the second's elsewhere, ordered by ``key(merged)`` (call, then first position)."""
    first, second = laid
    chosen = [np.flatnonzero(keep[first[0]]), np.flatnonzero(~keep[second[0]])]
    merged = [np.concatenate([x[chosen[0]], y[chosen[1]]]) for x, y in zip(first, second)]
    call, at = key(merged)
    order = np.lexsort((at, call))
    return tuple(x[order] for x in merged)


def _document_runs(starts, begin, count, size):
    """(call, first, end) of the runs of positions [begin, begin + count) of each call (arrays over the calls;
    first and end local to the call), cut at ``starts`` (sorted global positions where a document begins): each
    document of at least LONG_DOCUMENT_TILES * size positions is a run of its own, and so is each stretch of
    shorter documents between two such (the forward's query tiles, the backward's query tiles and key blocks)."""
    inside_lo = np.searchsorted(starts, begin, side="right")
    inside_end = np.maximum(inside_lo, np.searchsorted(starts, begin + count, side="left"))
    parts = np.where(count > 0, 1 + inside_end - inside_lo, 0)
    k, call = masks.ranges(0, parts)
    if not call.size:   # no call has positions
        return (np.zeros(0, np.int64),) * 3
    at = np.clip(inside_lo[call] + k - 1, 0, max(starts.size - 1, 0))
    doc = np.where(k == 0, 0, starts[at] - begin[call]) if starts.size else np.zeros(call.size, np.int64)
    last_of_call = np.append(k[1:] == 0, True)
    doc_end = np.where(last_of_call, count[call], np.append(doc[1:], 0))
    long = doc_end - doc >= LONG_DOCUMENT_TILES * size
    at = np.flatnonzero((k == 0) | long | np.append(True, long[:-1]))
    return call[at], doc[at], doc_end[np.append(at[1:] - 1, call.size - 1)]


def _grid_runs(starts, begin, count, size):
    """(call, first, end): each call's positions one run (a grid of tiles), as _document_runs gives them."""
    call = np.flatnonzero(count > 0)
    return call, np.zeros(call.size, np.int64), count[call]


def _cut(call, first, end, size):
    """(call, first, end) of the tiles of ``size`` positions of runs [first, end) of the calls ``call``, each run's
    from its first position."""
    j, run = masks.ranges(0, -(-(end - first) // size))
    tile_first = first[run] + j * size
    return call[run], tile_first, np.minimum(tile_first + size, end[run])


def _tiles(tile_call, first, end, lo, hi, q_start, k_start, sk, bn):
    """ForwardTiles of the query tiles [first, end) of the calls tile_call: their keys from the first row's lo to
    the last row's hi (bounds lo, hi), clipped to the call's, in key tiles of bn."""
    q0, k0, keys = q_start[tile_call], k_start[tile_call], sk[tile_call]
    begin = np.clip(lo[q0 + first] - k0, 0, keys)
    stop = np.clip(hi[q0 + end - 1] - k0, 0, keys)
    return ForwardTiles(tile_call, first, end, begin, np.where(stop > begin, -(-(stop - begin) // bn), 0))


class BackwardTiles(NamedTuple):
    """The sm90 backward's tiles of block calls under an interval mask (``backward_tiles``): its query tiles and
    key blocks, one entry each, ordered by call then position."""
    tile_call: np.ndarray    # per query tile: the call
    tile_first: np.ndarray   # its first row, local to the call (a call's tiles partition its rows)
    block_call: np.ndarray   # per key block (a CTA of a head slot): the call
    block_first: np.ndarray  # its first key, local to the call (a call's blocks partition its keys)
    block_end: np.ndarray    # one past its last key
    t_lo: np.ndarray         # the query tiles it walks, [t_lo, t_end) counted from its call's first tile: those
    t_end: np.ndarray        # in which some row sees one of its keys (t_lo = t_end: none)


def backward_tiles(mask, q_start, sq, k_start, sk, bm, bn):
    """BackwardTiles of one call, or of many (each argument an array over the calls), under ``mask``: what the
    sm90 backward's interval instance runs (backends/cuda/sm90.py) and what the cost model counts.

    Its CTAs own key blocks of at most bn keys and walk the query tiles of at most bm rows in which some row sees
    one of their keys. Both start on documents, as the forward's query tiles do (``_document_runs``: a document
    of at least LONG_DOCUMENT_TILES tiles a run of its own, shorter ones between such sharing runs; the key side
    cut at the first key of each document of rows): a block on a grid of bn keys that straddles two documents
    walks the query tiles of both, and a grid tile of rows straddling two documents is walked by the key blocks
    of both (the 8k MagiAttention sets: 758 / 859 -> 686 / 773 steps, 80-82% -> 89-91% of their pairs visible;
    uniform documents 744 / 926 -> 715 / 884). Where a call's grid of tiles and blocks walks no more steps, the
    call keeps the grid."""
    q_start, sq, k_start, sk = _calls(q_start, sq, k_start, sk)
    lo, hi = mask.intervals
    cuts = [(runs(masks.document_starts(mask), q_start, sq, bm), runs(masks.document_keys(mask), k_start, sk, bn))
            for runs in (_document_runs, _grid_runs)]
    if all(len(rows[0]) == len(grid[0]) for rows, grid in zip(*cuts)):   # one run a call: the grid
        cuts = cuts[1:]
    laid = [_walks(_cut(*rows, bm), _cut(*keys, bn), lo, hi, q_start, sq, k_start) for rows, keys in cuts]
    if len(laid) == 1:
        return laid[0]
    steps = [np.bincount(t.block_call, t.t_end - t.t_lo, q_start.size) for t in laid]
    keep = steps[0] < steps[1]
    return BackwardTiles(*_merged([t[:2] for t in laid], keep, lambda t: t),
                         *_merged([t[2:] for t in laid], keep, lambda t: t[:2]))


def _walks(tiles, blocks, lo, hi, q_start, sq, k_start):
    """BackwardTiles of the query tiles ``tiles`` and key blocks ``blocks`` ((call, first, end) of each, local,
    ordered by call then position): the query tiles each block walks, found by two binary searches in the bounds
    (each row's bounds never decrease): the first row whose end passes the block's first key, the first row after
    it whose start passes its last key."""
    tile_call, tile_first, _ = tiles
    call, first, end = blocks
    rows_lo, rows_end = q_start[call], (q_start + sq)[call]
    r_first = np.clip(np.searchsorted(hi, k_start[call] + first, side="right"), rows_lo, rows_end) - rows_lo
    r_end = np.maximum(r_first, np.clip(np.searchsorted(lo, k_start[call] + end - 1, side="right"), rows_lo,
                                        rows_end) - rows_lo)
    # a row's tile: the last tile of its call starting at or before it
    span = int(sq.max()) + 1 if sq.size else 1
    tile_key = tile_call * span + tile_first
    call_first_tile = np.searchsorted(tile_call, np.arange(sq.size))

    def tile_of(r):
        return np.searchsorted(tile_key, call * span + r, side="right") - 1 - call_first_tile[call]

    t_lo = np.where(sq[call] > 0, tile_of(r_first), 0)   # a call without rows: no tiles, nothing walked
    t_end = np.where(r_end > r_first, tile_of(r_end - 1) + 1, t_lo)
    return BackwardTiles(tile_call, tile_first, call, first, end, t_lo, t_end)


def call_tiles(mask, q_start, sq, k_start, sk, masked=True, gqa_pack=1):
    """float64 (len(COUNTS),): the tiles of one block call of queries [q_start, +sq) against keys [k_start, +sk)
    per head; ``masked`` False: a full pair (every tile of the rectangle). ``gqa_pack``: the query heads the
    forward packs into a tile under an interval mask (packed_heads of the call's group; 1: none)."""
    return calls_tiles(mask, *([x] for x in (q_start, sq, k_start, sk, masked)), gqa_pack)[0]


def calls_tiles(mask, q_start, sq, k_start, sk, masked, gqa_pack=1):
    """float64 (calls, len(COUNTS)): call_tiles of many block calls at once (each argument an array over the
    calls; ``mask``: a masks.Mask over the positions of every call's rows and keys): the forward's query tiles
    and the backward's key blocks of every call laid end to end, each searched in the mask's bounds. Under an
    interval mask the forward's tiles of ``gqa_pack`` heads count 1 / gqa_pack each a head."""
    q_start, sq, k_start, sk, masked = (x.reshape(-1) for x in np.broadcast_arrays(
        *(np.asarray(x, np.int64) for x in (q_start, sq, k_start, sk)), np.asarray(masked, bool)))
    masked = masked & (sq > 0) & (sk > 0) & (not mask.is_full)
    (fm, fn), (bm, bn) = FORWARD_TILE, BACKWARD_TILE
    query_tiles, key_blocks = -(-sq // bm), -(-sk // bn)
    out = np.zeros((sq.size, len(COUNTS)))
    full = ~masked & (sq > 0) & (sk > 0)
    out[full] = np.stack([-(-sq // fm) * -(-sk // fn), -(-sq // fm), query_tiles * key_blocks,
                          query_tiles * np.sqrt(key_blocks), np.zeros(sq.size)], axis=1)[full]
    if masked.any():
        calls = np.flatnonzero(masked)
        documents = mask.kind == "intervals" and mask.window is None   # the backward's walks down (walk_down)
        pack = gqa_pack if mask.kind == "intervals" else 1   # the interval instance packs (backends/cuda/sm90.py)
        out[calls, :2] = _forward_tiles(mask, q_start[calls], sq[calls], k_start[calls], sk[calls], pack)
        out[calls, 2:] = _backward_tiles(mask, q_start[calls], sq[calls], k_start[calls], sk[calls], documents)
    return out


def _forward_tiles(mask, q_start, sq, k_start, sk, pack):
    """(calls, 2): the forward's key tiles (forward_tiles) and its query tiles with any key, of every call, per
    head: tiles of FORWARD_TILE rows hold ``pack`` heads' rows, FORWARD_TILE / pack positions."""
    rows, keys = FORWARD_TILE
    t = forward_tiles(mask, q_start, sq, k_start, sk, rows // pack, keys)
    return np.stack([np.bincount(t.call, t.key_tiles, sq.size), np.bincount(t.call, t.key_tiles > 0, sq.size)],
                    axis=1) / pack


def _backward_tiles(mask, q_start, sq, k_start, sk, documents):
    """(calls, 3): the backward's steps and its query tiles' sqrt(key blocks that see them), summed apart for the
    key blocks walking up and down (walk_down, where ``documents``), of every call (backward_tiles)."""
    t = backward_tiles(mask, q_start, sq, k_start, sk, *BACKWARD_TILE)
    tiles_of = np.bincount(t.tile_call, minlength=sq.size)
    # a piece never spans two calls: its key is the call and the end tile
    key = t.block_call * (tiles_of.max(initial=0) + 1)
    down = (walk_down(key + t.t_lo, key + t.t_end).astype(bool) if documents
            else np.zeros(t.block_call.size, bool))
    # key blocks that see each query tile, every call's tiles end to end: +1 at t_lo, -1 at t_end (within the call),
    # apart for the blocks walking up and down (a query tile's blocks are one document's: one direction)
    offsets = (np.cumsum(tiles_of) - tiles_of)[t.block_call]
    shared = []
    for walking in (~down, down):
        seen_by = np.zeros(t.tile_call.size + 1, np.int64)
        np.add.at(seen_by, offsets[walking] + t.t_lo[walking], 1)
        np.add.at(seen_by, offsets[walking] + t.t_end[walking], -1)
        shared.append(np.bincount(t.tile_call, np.sqrt(np.cumsum(seen_by[:-1])), sq.size))
    return np.stack([np.bincount(t.block_call, t.t_end - t.t_lo, sq.size), *shared], axis=1)


def pairs_tiles(mask, pairs, gqa_pack=1):
    """call_tiles summed over block pairs (schedule.BlockPair, as the engine runs them)."""
    return pairs_calls_tiles(mask, pairs, gqa_pack).sum(axis=0)


def pairs_calls_tiles(mask, pairs, gqa_pack=1):
    """calls_tiles of block pairs (schedule.BlockPair, each under its own mask where it has one, else ``mask``),
    one row each."""
    out = np.zeros((len(pairs), len(COUNTS)))
    plain = [i for i, p in enumerate(pairs) if p.mask is None]
    if plain:
        out[plain] = calls_tiles(mask, *_columns([pairs[i] for i in plain]), gqa_pack)
    own = [i for i, p in enumerate(pairs) if p.mask is not None]
    if own:
        out[own] = _own_masks_tiles([pairs[i] for i in own], gqa_pack)
    return out


def _columns(pairs, rows=0, keys=0):
    """calls_tiles' arguments of ``pairs``, their rows and keys moved by ``rows`` and ``keys`` (arrays or ints)."""
    q_start, sq, k_start, sk, masked = np.array(
        [(p.q_start, p.q.stop - p.q.start, p.k_start, p.k.stop - p.k.start, p.masked) for p in pairs], np.int64).T
    return q_start + rows, sq, k_start + keys, sk, masked.astype(bool)


def _own_masks_tiles(pairs, gqa_pack):
    """calls_tiles of pairs under masks of their own (the gather's visits, masks.Packed, whose bounds never
    decrease: schedule.packed_visit makes none other), in one search: the masks laid end to end, each one's rows
    and keys after the previous ones', so the bounds still never decrease (a stepped gather's account meets a
    mask for every visit: one search each was most of the planning time at 256 ranks)."""
    from .masks import Packed

    distinct = list(dict.fromkeys(p.mask for p in pairs))
    rows = np.cumsum([0] + [m.bounds[0].size for m in distinct])
    keys = np.cumsum([0] + [m.seqlen for m in distinct])
    lo = np.concatenate([m.bounds[0] + k for m, k in zip(distinct, keys)])
    hi = np.concatenate([m.bounds[1] + k for m, k in zip(distinct, keys)])
    at = {m: i for i, m in enumerate(distinct)}
    index = np.array([at[p.mask] for p in pairs])
    joined = Packed(lo, hi, int(keys[-1]), ("joined",) + tuple(m.key for m in distinct))
    return calls_tiles(joined, *_columns(pairs, rows[index], keys[index]), gqa_pack)
