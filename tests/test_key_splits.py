"""The sm90 forward's choice of key splits (Sm90Kernels.key_split), on the host: no GPU needed."""
import pytest

from burst_hpc.backends.cuda import launch, sm90
from burst_hpc.plan import tiles
from burst_hpc.recent import Recent


@pytest.fixture
def kernels(monkeypatch):
    monkeypatch.setattr(launch, "sm_count", lambda: 132)
    k = sm90.Sm90Kernels(None)
    k.key_splits = True
    return k


@pytest.mark.parametrize("heads,s,mode,want", [
    (32, 4096, "full", 1),    # 1024 query tiles: the SMs are full
    (8, 2048, "full", 1),     # 128 equal tiles on 132 SMs: parts would only add rounds
    (8, 1024, "full", 2),     # 64 tiles: half the SMs idle
    (8, 2048, "causal", 2),   # 128 causal tiles, the longest twice the mean
    (1, 4096, "full", 4),     # 32 tiles of 32 key tiles
])
def test_key_split_fills_idle_sms(kernels, heads, s, mode, want):
    assert kernels.key_split(128, 128, heads, s, s, mode, 0) == want


def test_key_split_off_masked_or_forced(kernels):
    assert kernels.key_split(128, 128, 1, 4096, 4096, "interval", 0) == 1  # interval masks: never
    kernels.key_splits = False
    assert kernels.key_split(128, 128, 1, 4096, 4096, "full", 0) == 1
    kernels.forced_key_splits = 3
    assert kernels.key_split(128, 128, 32, 4096, 4096, "full", 0) == 3


def test_key_split_nothing_visible(kernels):
    # a causal block pair whose keys all lie after the queries: no key tile to split
    assert kernels.key_split(128, 128, 1, 256, 256, "causal", -1000) == 1


def test_interval_tiles_match_the_kernels_visits(rng):
    """A query tile the interval kernel skips (no key of this shard) must count as unvisited, so a last pair
    converts its rows afterwards: past the end of a shard of 244 keys (no multiple of 128), rounding to key tiles
    first would have counted one tile (BURST_HPC_RING_LAST_PAIRS left such rows of the output unwritten)."""
    import numpy as np

    from burst_hpc.plan import masks

    mask = masks.make(3 * 244, True, (100, 0))
    assert tiles.forward_tiles(mask, 488, 244, 0, 244, 128, 128).key_tiles.tolist() == [0, 0]
    assert tiles.forward_tiles(mask, 244, 244, 0, 244, 128, 128).key_tiles.tolist() == [1, 0]
    for _ in range(200):
        s = int(rng.integers(2, 700))
        window = (int(rng.integers(-1, 200)), int(rng.integers(-1, 50))) if rng.random() < 0.7 else None
        cu = masks.random_documents(rng, s, int(rng.integers(1, min(s, 9) + 1))) if rng.random() < 0.7 else None
        mask = masks.make(s, bool(rng.random() < 0.8), window, cu)
        if mask.kind != "intervals":
            continue
        q0, k0 = (int(x) for x in rng.integers(0, s, 2))
        sq, sk = int(rng.integers(1, s - q0 + 1)), int(rng.integers(1, s - k0 + 1))
        bm, bn = int(rng.choice([64, 128, 192])), int(rng.choice([80, 128]))
        t = tiles.forward_tiles(mask, q0, sq, k0, sk, bm, bn)
        # the tiles cover the rows once, in order, bm rows at most
        assert t.first[0] == 0 and (t.first[1:] == t.end[:-1]).all() and t.end[-1] == sq
        assert (t.end - t.first <= bm).all() and (t.end > t.first).all()
        sees = [mask.visible_count(q0 + a, b - a, k0, sk) > 0 for a, b in zip(t.first, t.end)]
        assert (t.key_tiles > 0).tolist() == sees
        # every visible key of a tile's rows lies in its key tiles
        lo, hi = mask.rows(q0, sq)
        for a, b, begin, n in zip(t.first, t.end, t.key_begin, t.key_tiles):
            first, end = np.clip(lo[a:b] - k0, 0, sk), np.clip(hi[a:b] - k0, 0, sk)
            seen = end > first
            if seen.any():
                assert begin <= first[seen].min() and end[seen].max() <= begin + n * bn


def test_forward_tiles_of_calls_without_rows():
    """Calls with no query rows have no tiles (the cost model drops them before; the bench asks directly)."""
    from burst_hpc.plan import masks

    mask = masks.make(300, True, None, [0, 100, 300])
    assert tiles.forward_tiles(mask, 0, 0, 0, 100, 128, 128).key_tiles.size == 0
    t = tiles.forward_tiles(mask, [0, 50, 0], [0, 200, 0], [0, 0, 0], [100, 300, 100], 128, 128)
    assert set(t.call.tolist()) == {1} and t.end[-1] == 200


def test_forward_tiles_start_on_long_documents():
    """A long document's query tiles start on its first row and its key tiles on its first key: the tile i tiles
    into it loads i + 1 key tiles (a grid of tiles would load one more where the document starts off it);
    short documents share tiles; a call whose grid would run fewer tiles keeps it."""
    import numpy as np

    from burst_hpc.plan import masks

    bm = 128
    long = 2 * tiles.LONG_DOCUMENT_TILES * bm   # whole tiles: the grid, off them, runs 90 key tiles against 75
    cu = np.array([0, 5, 100, 190, 190 + long, 190 + long + 60, 190 + 2 * long + 60])
    mask = masks.make(int(cu[-1]), True, None, cu)
    t = tiles.forward_tiles(mask, 0, mask.seqlen, 0, mask.seqlen, bm, bm)
    assert t.first[0] == 0 and t.end[0] == 128 and t.first[1] == 128 and t.end[1] == 190   # three short ones
    for start in (190, 190 + long + 60):   # each long document: tiles from its first row, i + 1 key tiles each
        mine = (t.first >= start) & (t.first < start + long)
        assert t.first[mine].tolist() == list(range(start, start + long, bm))
        assert t.key_begin[mine].tolist() == [start] * mine.sum()
        assert t.key_tiles[mine].tolist() == list(range(1, mine.sum() + 1))
    short = np.flatnonzero(t.first == 190 + long)   # the short document between the two is a run of its own
    assert t.end[short].tolist() == [190 + long + 60] and t.key_tiles[short].tolist() == [1]
    # a long document's last tile is whole work for its few rows: where that leaves a grid the cheaper (fewer
    # query and key tiles), the call keeps the grid; each call of many chooses for itself
    tail = np.array([0, 5, 100, 190, 1224, 1284, 2318])   # documents of 1034 rows
    both = masks.make(2318 + mask.seqlen, True, None, np.concatenate([tail, 2318 + cu[1:]]))
    two = tiles.forward_tiles(both, [0, 2318], [2318, mask.seqlen], [0, 2318], [2318, mask.seqlen], bm, bm)
    assert two.first[two.call == 0].tolist() == list(range(0, 2318, bm))
    assert two.first[two.call == 1].tolist() == t.first.tolist()


def test_interval_schedule_is_made_once_per_mask(monkeypatch):
    """A training loop hands the same document offsets in a new array every call: the forward's tile order and
    the mask's intervals are made once (keyed by content), so a call's host work does not grow with documents."""
    import sys
    import types

    import numpy as np

    from burst_hpc.plan import masks

    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0))
    fake.asarray = np.asarray
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(sm90, "_ORDERS", Recent(64))
    made = []
    real = tiles.forward_tiles
    monkeypatch.setattr(sm90, "forward_tiles", lambda *a: made.append(a) or real(*a))
    offsets = [0, 139, 489, 1251, 3299, 3649, 4411, 5173, 6709, 7059, 8192]   # a magi pack
    before = masks._intervals.cache_info().misses
    for _ in range(5):
        mask = masks.make(8192, True, None, np.array(offsets))
        assert sm90._every_tile_sees_keys("interval", mask, 0, 8192, 0, 8192, 128, 128)
    assert len(made) == 1
    assert masks._intervals.cache_info().misses - before <= 1
