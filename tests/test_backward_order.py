"""The sm90 backward's schedule made on the host (no GPU needed): its key blocks and query tiles under an interval
mask and the tiles each block walks (tiles.backward_tiles), and the CTA order (launch.key_block_order)."""
import heapq
import sys
import types

import numpy as np
import pytest

from burst_hpc.backends.cuda import launch, sm90
from burst_hpc.plan import masks, tiles
from burst_hpc.recent import Recent


def test_blocks_and_tiles_partition_the_call_and_walk_the_tiles_whose_rows_see_them(rng):
    for _ in range(300):
        s = int(rng.integers(2, 900))
        window = (int(rng.integers(-1, 150)), int(rng.integers(-1, 40))) if rng.random() < 0.5 else None
        cu = (masks.random_documents(rng, s, int(rng.integers(1, min(s, 12) + 1)))
              if window is None or rng.random() < 0.5 else None)
        mask = masks.make(s, bool(rng.random() < 0.8), window, cu)
        if mask.kind != "intervals":
            continue
        q0, k0 = (int(x) for x in rng.integers(0, s, 2))
        sq, sk = int(rng.integers(1, s - q0 + 1)), int(rng.integers(1, s - k0 + 1))
        bm, bn = int(rng.choice([64, 128])), int(rng.choice([64, 128]))
        t = tiles.backward_tiles(mask, q0, sq, k0, sk, bm, bn)
        firsts, blocks = np.append(t.tile_first, sq), np.stack([t.block_first, t.block_end], 1)
        assert (t.tile_call == 0).all() and (t.block_call == 0).all()
        assert firsts[0] == 0 and (np.diff(firsts) > 0).all() and (np.diff(firsts) <= bm).all()
        assert blocks[0, 0] == 0 and blocks[-1, 1] == sk and (blocks[1:, 0] == blocks[:-1, 1]).all()
        assert ((blocks[:, 1] > blocks[:, 0]) & (blocks[:, 1] - blocks[:, 0] <= bn)).all()
        lo, hi = mask.rows(q0, sq)
        for (first, end), got in zip(blocks, zip(t.t_lo, t.t_end)):
            seen = np.flatnonzero((hi > k0 + first) & (lo < k0 + end))  # rows seeing a key of the block
            tile = np.searchsorted(firsts, seen, side="right") - 1
            want = (tile[0], tile[-1] + 1) if len(seen) else None
            assert (got if got[1] > got[0] else None) == want, (s, q0, sq, k0, sk, bm, bn, first)


def test_blocks_and_tiles_start_on_documents():
    """A document of at least LONG_DOCUMENT_TILES tiles starts a query tile and a key block (its keys are its rows'
    positions), so no block or tile holds two such documents' positions; short ones share them; a call whose
    grid walks no more steps keeps the grid."""
    cu = np.array([0, 300, 900, 1000, 1100, 2000])   # long, long, short, short, long (bm 64: at least 256 rows)
    mask = masks.make(2000, True, None, cu)
    t = tiles.backward_tiles(mask, 0, 2000, 0, 2000, 64, 128)
    for start in (0, 300, 900, 1100):
        assert start in t.tile_first and start in t.block_first
    assert 1000 not in t.block_first   # 900-1100: a run of two short documents, blocks of 128 from 900
    assert np.intersect1d(t.block_first, [900, 1028]).tolist() == [900, 1028]
    aligned = int((t.t_end - t.t_lo).sum())
    grid = tiles.backward_tiles(masks.make(2000, True), 0, 2000, 0, 2000, 64, 128)   # plain causal: the grid
    assert grid.tile_first.tolist() == list(range(0, 2000, 64))
    assert grid.block_first.tolist() == list(range(0, 2000, 128))
    on_grid = sum(int(((mask.rows(0, 2000)[1][a:a + 64, None] > np.arange(0, 2000, 128)) &
                       (mask.rows(0, 2000)[0][a:a + 64, None] < np.minimum(np.arange(0, 2000, 128) + 128, 2000))
                       ).any(axis=0).sum()) for a in range(0, 2000, 64))
    assert aligned < on_grid


def _ranges(mask, s):
    t = tiles.backward_tiles(mask, 0, s, 0, s, 64, 128)
    return t.t_lo, t.t_end


def test_order_runs_every_cta_once_documents_together_heaviest_first(rng):
    cu = masks.random_documents(rng, 4000, 9)
    mask = masks.make(4000, True, None, cu)
    t_lo, t_end = _ranges(mask, 4000)
    nkb, slots = len(t_lo), 5
    order = launch.key_block_order(t_lo, t_end, slots)
    assert order.dtype == np.int32 and sorted(order.tolist()) == list(range(nkb * slots))
    slot, kb = order // nkb, order % nkb
    # each slot's key blocks of one piece are contiguous, in key block order, all of the key blocks that walk to
    # one end tile (one document's)
    runs = np.flatnonzero((np.diff(slot) != 0) | (np.diff(kb) != 1) | (np.diff(t_end[kb]) != 0)) + 1
    pieces = np.split(np.arange(len(order)), runs)
    weights = []
    for p in pieces:
        blocks = kb[p]
        assert (t_end[blocks] == t_end[blocks[0]]).all()
        assert set(np.flatnonzero(t_end == t_end[blocks[0]])) == set(blocks)
        weights.append(int((t_end[blocks] - t_lo[blocks]).sum()))
    # a piece's slots follow each other, and the pieces go heaviest first
    assert all(len(set(weights[i:i + slots])) == 1 for i in range(0, len(weights), slots))
    per_piece = weights[::slots]
    assert per_piece == sorted(per_piece, reverse=True)


def _makespan(order, nkb, work, sms=132):
    """The slowest SM's load over the mean when the CTAs start in ``order`` on the first SM free."""
    costs = [work[v % nkb] for v in order]
    heap = [0.0] * sms
    for c in costs:
        heapq.heappush(heap, heapq.heappop(heap) + c)
    return max(heap) / (sum(costs) / sms)


def test_order_shortens_the_tail_of_packed_documents():
    """Head slot after head slot, a late slot's long documents start in the last wave; documents heaviest first
    leave the last wave to light ones (8 slots, documents of up to S/4 in 8k tokens: 1.38 -> 1.11)."""
    rng = np.random.default_rng(0)
    ends = [0]
    while ends[-1] < 8192:
        ends.append(min(8192, ends[-1] + int(rng.integers(1, 2049))))
    mask = masks.make(8192, True, None, np.array(ends))
    t_lo, t_end = _ranges(mask, 8192)
    nkb, slots = len(t_lo), 8
    work = (t_end - t_lo) * 8 + 4  # steps of 8 heads, and a start and epilogue
    in_order = _makespan(range(nkb * slots), nkb, work)
    pieces = _makespan(launch.key_block_order(t_lo, t_end, slots), nkb, work)
    assert in_order > 1.3 and pieces < 1.15


def test_causal_pieces_shorten_a_short_grids_tail(monkeypatch):
    """A causal mask is one run: on a grid of a few waves its key blocks go in pieces of CAUSAL_ORDER_BAND, every
    slot's heavy blocks first (8 slots, 8k tokens: 1.24 -> about 1.04 in the model); from 8 waves on, in order."""
    monkeypatch.setattr(launch, "sm_count", lambda: 132)
    nkb, slots = 64, 8
    t_end = np.full(nkb, 128)
    t_lo = np.arange(nkb) * 2  # key block kb of 128 keys is first seen by query tile 2 kb (64 rows)
    band = launch.causal_order_band(nkb, slots)
    assert band == launch.CAUSAL_ORDER_BAND and launch.causal_order_band(4 * nkb, slots) is None
    order = launch.key_block_order(t_lo, t_end, slots, band)
    assert sorted(order.tolist()) == list(range(nkb * slots))
    assert [int(v) % nkb for v in order[:band]] == list(range(band))   # slot 0's heaviest piece
    assert int(order[band]) // nkb == 1                                # then slot 1's same piece
    work = (t_end - t_lo) * 8 + 4
    assert _makespan(range(nkb * slots), nkb, work) > 1.2 > 1.08 > _makespan(order, nkb, work)


@pytest.fixture
def host_schedule(monkeypatch):
    """sm90's backward schedule on the host: a CuPy stand-in whose arrays are NumPy's, an empty schedule cache and
    an H100's 132 SMs."""
    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0))
    fake.asarray = np.asarray
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(sm90, "_ORDERS", Recent(64))
    monkeypatch.setattr(launch, "sm_count", lambda: 132)


def test_which_masks_take_an_order(host_schedule):
    """Documents and a short causal grid get the host's order; sliding windows (equal key blocks, no tail to
    shorten), long causal grids, full masks and heavy_first off keep head slot after head slot (a null order);
    interval masks always get the host's ranges."""
    s, cu = 8192, np.array([0, 1000, 5000, 8192])

    def schedule(mode, mask, heavy_first=True, s=s):
        plan = sm90._backward_schedule(mode, mask, 0, s, 0, s, 64, 128, 64)
        order = sm90._key_block_order(mode, mask, plan, 0, s, 0, s, 64, 128, 8, heavy_first)
        return isinstance(plan.ranges, np.ndarray), isinstance(order, np.ndarray)

    documents = masks.make(s, True, None, cu)
    assert schedule("interval", documents) == (True, True)
    assert schedule("interval", documents, heavy_first=False) == (True, False)
    assert schedule("interval", masks.make(s, True, (512, 0))) == (True, False)
    assert schedule("interval", masks.make(s, True, (512, 0), cu)) == (True, False)
    assert schedule("causal", masks.make(s, True)) == (False, True)
    assert schedule("causal", masks.make(s, True), heavy_first=False) == (False, False)
    assert schedule("causal", masks.make(4 * s, True), s=4 * s) == (False, False)   # 8 waves or more
    assert schedule("full", masks.make(s)) == (False, False)


def test_short_documents_walk_down_long_ones_up(host_schedule):
    """tiles.walk_down: the key blocks of a document (a run with one end tile) of at most ``most`` blocks walk
    down, a longer document's walk up; the host's ranges carry it as each key block's third int, its keys as
    the fourth and fifth, and the query tiles' first rows go with them."""
    t_end = np.array([3, 3, 3, 9, 9, 20, 20, 20, 20, 20, 21, 21])
    t_lo = np.array([0, 1, 2, 3, 5, 9, 11, 13, 15, 17, 19, 21])   # the last block is seen by no row
    assert tiles.pieces(t_end).tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 3]
    assert tiles.walk_down(t_lo, t_end, 3).tolist() == [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0]
    assert tiles.walk_down(t_lo, t_end, 0).tolist() == [0] * 12
    assert tiles.walk_down(np.zeros(0), np.zeros(0, np.int64), 64).tolist() == []

    s = 32768
    cu = np.array([0, 512, 512 + 16384, s])    # documents of 4, 128 and 124 key blocks of 128
    mask = masks.make(s, True, None, cu)
    plan = sm90._backward_schedule("interval", mask, 0, s, 0, s, 64, 128, 64)
    rows = plan.ranges.reshape(-1, 5)
    t = tiles.backward_tiles(mask, 0, s, 0, s, 64, 128)
    assert plan.blocks == len(rows) == 256 and plan.tiles == len(t.tile_first)
    assert (rows[:, 0] == t.t_lo).all() and (rows[:, 1] == t.t_end).all()
    assert (rows[:, 3] == t.block_first).all() and (rows[:, 4] == t.block_end).all()
    assert plan.firsts.tolist() == t.tile_first.tolist() + [s]
    assert rows[:, 2].tolist() == [1] * 4 + [0] * 252
    again = sm90._backward_schedule("interval", mask, 0, s, 0, s, 64, 128, 128)
    assert again.ranges.reshape(-1, 5)[:, 2].tolist() == [1] * 256   # a different rule is a different entry
    window = masks.make(s, True, (1000, 0), cu)                          # sliding windows walk up
    plan = sm90._backward_schedule("interval", window, 0, s, 0, s, 64, 128, 64)
    assert not plan.ranges.reshape(-1, 5)[:, 2].any()


def test_the_group_splits_until_its_heaviest_cta_holds_half_an_sms_share(rng, monkeypatch):
    """launch.split_group: the most query heads per CTA (a divisor of the group) for which the heaviest CTA's steps
    are at most half of an SM's share of all the steps; with equal walks that is two waves of CTAs (the rule
    before walks were weighed), and a call whose few working blocks walk long is split further."""
    monkeypatch.setattr(launch, "sm_count", lambda: 132)
    assert launch.split_group(8, np.ones(40), 8) == (8, 1)      # 320 CTAs: two waves and more
    assert launch.split_group(8, np.ones(20), 8) == (4, 2)      # 160 CTAs: split to 320
    assert launch.split_group(8, np.zeros(5), 8) == (8, 1)      # nothing walks: nothing to balance
    assert launch.split_group(8, np.ones(33), 8) == (8, 1) and launch.split_group(8, np.ones(32), 8) == (4, 2)
    for group in range(1, 17):   # equal walks: the two waves of the rule before walks were weighed
        for blocks in range(1, 70):
            old = next(h for h in range(group, 0, -1) if group % h == 0 and (h == 1 or blocks * 3 * group // h >= 264))
            assert launch.split_group(group, np.full(blocks, 7), 3)[0] == old
    for _ in range(200):
        group = int(rng.choice([1, 2, 3, 4, 6, 8, 16]))
        walks = rng.integers(0, 80, int(rng.integers(1, 120))) * (rng.random(1) < 0.9)
        kv = int(rng.integers(1, 9))
        hpb, nsplit = launch.split_group(group, walks, kv)
        share = walks.sum() * group * kv / (2 * 132)
        assert hpb * nsplit == group and hpb >= 1
        assert hpb == 1 or walks.max() * hpb <= share
        assert all(walks.max() * h > share for h in range(hpb + 1, group + 1) if group % h == 0)


def test_a_launch_splits_its_group_by_the_walks_it_runs(host_schedule):
    """sm90._group_split: a causal grid's blocks walk from where they are first seen (64:8 heads at 8k: the first
    block's 128 tiles x 8 heads pass half an SM's share, so the group splits, even where dK, dV could go straight
    into 16 bits); a full mask's walk every tile (two waves: whole); documents split for their heaviest block only
    where dK, dV go through float32 anyway, and a call over a few documents' rows splits further."""
    s = 8192
    rng = np.random.default_rng(0)
    ends = [0]
    while ends[-1] < s:
        ends.append(min(s, ends[-1] + int(rng.integers(1, 2049))))
    cases = {"causal": masks.make(s, True), "full": masks.make(s),
             "interval": masks.make(s, True, None, np.array(ends))}

    def split(mode, direct, q_start=0, sq=s):
        plan = sm90._backward_schedule(mode, cases[mode], q_start, sq, 0, s, 64, 128, 64)
        return sm90._group_split(mode, plan, 8, 8, direct)

    assert split("causal", True) == split("causal", False) == (4, 2)
    assert split("full", True) == split("full", False) == (8, 1)
    assert split("interval", True) == (8, 1) and split("interval", False) == (4, 2)
    assert split("interval", False, s - 1000, 1000) == (2, 4)
    assert split("interval", True, s - 1000, 1000) == (2, 4)   # split to fill the GPU anyway: by the walks
