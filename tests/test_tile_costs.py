"""The cost model prices kernels by the tiles they run (plan/tiles.py, plan/pricing.py): the tile counts against a
brute-force count over the dense mask, short documents dearer per visible pair than long ones, the account's
tiles, and the single-GPU sweep the prices were fitted on predicted within 15% (bench/predict_sweep.py)."""
import pathlib
import sys
from dataclasses import replace

import numpy as np
import pytest

from burst_hpc.plan import costmodel, masks, tiles
from burst_hpc.plan.accounting import visible_pairs
from burst_hpc.plan.layout import make_layout
from burst_hpc.plan.rates import GPU_RATES, per_pair
from burst_hpc.plan.workload import account
from burst_hpc.reference import visible

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import predict_sweep  # noqa: E402

NO_FIXED = dict(intra_latency_us=0.0, inter_latency_us=0.0, fwd_launch_us=0.0, bwd_launch_us=0.0, step_us=0.0)


def runs_from(starts, size):
    """[first, end) runs of positions from the document starts ``starts`` (sorted, the first one the call's first
    position, then its end): each document of at least LONG_DOCUMENT_TILES * size positions a run of its own,
    the shorter ones between such sharing runs."""
    runs, before_long = [], True
    for first, end in zip(starts[:-1], starts[1:]):
        long = end - first >= tiles.LONG_DOCUMENT_TILES * size
        if long or before_long:
            runs.append([first, end])
        else:
            runs[-1][1] = end
        before_long = long
    return runs


def brute_tiles(whole, q0, k0, seen, documents=False):
    """tiles.COUNTS of a block call from the dense visibility of the whole sequence ``whole`` and of the call's
    rows x keys ``seen`` (from q0, k0), one row at a time. The call's documents: a row that sees none of the
    keys the row before it sees starts one (its first key starts one on the key side), each of at least
    LONG_DOCUMENT_TILES tiles a run of its own and the shorter ones between in runs. The forward's tiles of 128
    rows from each run's first, each with the key tiles of 128 from its first row's first key to its last row's
    last, clipped to the call's keys (counted where that holds any), or the call's grid of tiles where that
    runs fewer query and key tiles; the backward's (query tile, key block) pairs with any visible pair, tiles of
    64 rows and blocks of 128 keys cut so from the runs of rows and keys, or on a grid where that has no more
    such pairs, and the square root of each tile's such key blocks, summed apart for key blocks walking up and
    down (``documents``: those in runs of at most 64 with one last tile)."""
    (fm, fn), (bm, bn) = tiles.FORWARD_TILE, tiles.BACKWARD_TILE
    sq, sk = seen.shape
    lo = [int(np.flatnonzero(row)[0]) for row in whole]
    hi = [int(np.flatnonzero(row)[-1]) + 1 for row in whole]
    row_starts = [r for r in range(q0, q0 + sq) if r == q0 or lo[r] >= hi[r - 1]] + [q0 + sq]
    document_keys = {lo[r] for r in range(len(whole)) if r == 0 or lo[r] >= hi[r - 1]}
    key_starts = [k0] + sorted(k for k in document_keys if k0 < k < k0 + sk) + [k0 + sk]
    laid = []
    for cuts in (runs_from(row_starts, fm), [[q0, q0 + sq]]):   # the runs, and a grid: the fewer tiles kept
        key_tiles = query_tiles = 0
        for first, end in cuts:
            for m in range(first, end, fm):
                begin, stop = (min(max(x - k0, 0), sk) for x in (lo[m], hi[min(m + fm, end) - 1]))
                if stop > begin:
                    key_tiles += -(-(stop - begin) // fn)
                    query_tiles += 1
        laid.append((key_tiles + query_tiles, key_tiles, query_tiles))
    _, key_tiles, query_tiles = laid[0] if laid[0][0] <= laid[1][0] else laid[1]

    def cut(runs, size, at):
        return [(m - at, min(m + size, end) - at) for first, end in runs for m in range(first, end, size)]

    walked = []
    for rows, keys in ((runs_from(row_starts, bm), runs_from(key_starts, bn)), ([[q0, q0 + sq]], [[k0, k0 + sk]])):
        row_tiles, key_blocks = cut(rows, bm, q0), cut(keys, bn, k0)
        walked.append(np.array([[seen[a:b, c:d].any() for c, d in key_blocks] for a, b in row_tiles]))
    blocks = walked[0] if walked[0].sum() < walked[1].sum() else walked[1]
    down = np.zeros(blocks.shape[1], bool)
    if documents:   # runs of seen key blocks with one last tile, at most 64 long (tiles.walk_down)
        last = [np.flatnonzero(column).max() if column.any() else -1 for column in blocks.T]
        runs = [[]]
        for kb, end in enumerate(last):
            if end < 0 or (runs[-1] and last[runs[-1][-1]] != end):
                runs.append([])
            if end >= 0:
                runs[-1].append(kb)
        for run in runs:
            down[run] = len(run) <= tiles.WALK_DOWN_BLOCKS
    return np.array([key_tiles, query_tiles, blocks.sum(), np.sqrt(blocks[:, ~down].sum(axis=1)).sum(),
                     np.sqrt(blocks[:, down].sum(axis=1)).sum()])


def test_tile_counts_match_a_brute_force_count(rng, monkeypatch):
    checked = set()
    for case in range(150):
        # a few key blocks a document here: a small longest walking-down piece makes both directions appear
        monkeypatch.setattr(tiles, "WALK_DOWN_BLOCKS", [1, 2, 64][case % 3])
        # documents of one tile of rows and more a run of their own, or of four and more (the default)
        monkeypatch.setattr(tiles, "LONG_DOCUMENT_TILES", [1, 4][case % 2])
        s = int(rng.integers(2, 700))
        kind = rng.choice(["documents", "window", "causal", "full"])
        causal = kind == "causal" or (kind != "full" and bool(rng.random() < 0.8))
        window = (int(rng.integers(-1, 200)), int(rng.integers(-1, 60))) if kind == "window" else None
        cu = masks.random_documents(rng, s, int(rng.integers(1, min(s, 9) + 1))) if kind == "documents" else None
        mask = masks.make(s, causal, window, cu)
        q0, k0 = (int(x) for x in rng.integers(0, s, 2))
        sq, sk = int(rng.integers(1, s - q0 + 1)), int(rng.integers(1, s - k0 + 1))
        whole = visible(np.arange(s), np.arange(s), causal, window, cu)
        seen = whole[q0:q0 + sq, k0:k0 + sk]
        if not seen.any():
            continue
        got = tiles.call_tiles(mask, q0, sq, k0, sk, not mask.is_full)
        np.testing.assert_allclose(got, brute_tiles(whole, q0, k0, seen, kind == "documents"),
                                   err_msg=f"{mask!r} {q0} {sq} {k0} {sk}")
        checked.add(mask.kind)
    assert checked == {"intervals", "causal", "full"}


def test_a_full_pair_runs_every_tile_of_its_rectangle():
    mask = masks.make(1000, True)
    assert tiles.call_tiles(mask, 700, 300, 0, 200, masked=False).tolist() == [3 * 2, 3, 5 * 2, 5 * np.sqrt(2), 0.0]


def predicted_per_pair(cu, seqlen, rates):
    """(forward, backward) predicted seconds per visible pair of one rank's call over these documents."""
    mask = masks.make(seqlen, True, None, np.array(cu))
    pr = costmodel.Problem(1, seqlen, 64, 8, 128, 2, mask)
    p = costmodel.predict("ring", pr, costmodel.Cluster(1, 1), rates, make_layout("contiguous", seqlen, 1))
    return np.array([p.fwd.time, p.bwd.time]) / visible_pairs(mask)


def test_short_documents_cost_more_per_visible_pair_than_one_long_one():
    """64 documents of 128 tokens and one of 1024 hold about the same visible pairs (528k, 525k): the sweep
    measured the short ones at a quarter of the long one's rate forward (121 against 453 TFLOP/s), a third
    backward; priced per visible pair they would cost the same."""
    short, long = list(range(0, 8193, 128)), [0, 1024]
    rates = replace(GPU_RATES["H100"], **NO_FIXED)
    ratio = predicted_per_pair(short, 8192, rates) / predicted_per_pair(long, 1024, rates)
    assert (ratio > 2.5).all(), ratio
    pairs_only = per_pair(rates, 600.0, 520.0)
    flat = predicted_per_pair(short, 8192, pairs_only) / predicted_per_pair(long, 1024, pairs_only)
    assert flat == pytest.approx([1.0, 1.0])


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
def test_the_account_carries_each_block_calls_tiles(kind, rng):
    """The ring's account, summed over steps and ranks, holds the tiles of every block call the engine makes: each
    rank's queries against every shard's keys, a call per block pair (schedule.block_pairs)."""
    from burst_hpc.plan.schedule import block_pairs

    seqlen, size = 4096, 4
    mask = masks.make(seqlen, True, None, masks.random_documents(rng, seqlen, 5))
    layout = make_layout(kind, seqlen, size)
    acc = account(layout, mask, "ring", "forward")
    want = sum(tiles.pairs_tiles(mask, block_pairs(layout.pieces(a), layout.pieces(b), mask))
               for a in range(size) for b in range(size))
    np.testing.assert_allclose(acc.tiles.sum(axis=(0, 1)), want)
    assert acc.tiles.shape == acc.work.shape + (len(tiles.COUNTS),)


def test_the_single_gpu_sweep_is_predicted_within_15_percent():
    rows = predict_sweep.predictions()
    assert len(rows) == 38
    for S, case, pass_, measured, predicted in rows:
        assert abs(predicted / measured - 1) <= 0.15, (S, case, pass_, measured, predicted)


def test_a_long_documents_backward_walks_up_a_short_ones_down():
    """The backward's shared term goes to the direction its key blocks walk (tiles.walk_down): a document of
    more than WALK_DOWN_BLOCKS key blocks walks up, shorter ones down, a sliding window's up."""
    s = 2 * 128 * (tiles.WALK_DOWN_BLOCKS + 1)
    cu = np.array([0, 128 * (tiles.WALK_DOWN_BLOCKS + 1), s - 512, s])     # 65 key blocks, then 61, then 4
    counts = tiles.call_tiles(masks.make(s, True, None, cu), 0, s, 0, s)
    long_only = tiles.call_tiles(masks.make(s, True, None, cu[:2].tolist() + [s]), 0, s, 0, s)   # 65 and 65
    assert counts[3] > 0 and counts[4] > 0
    assert long_only[4] == 0 and long_only[3] > 0
    window = tiles.call_tiles(masks.make(s, True, (500, 0)), 0, s, 0, s)
    assert window[4] == 0 and window[3] > 0


def test_the_gather_call_is_priced_as_the_engine_runs_it():
    """workload.packed_tiles prices the call packing.Packing.call gives the engine: a rank alone with its own run
    keeps the call's mask (plain causal: the causal kernel, whose CTAs walk up), a packed buffer its bounds
    (documents' key blocks walking down)."""
    from burst_hpc.plan.layout import make_layout
    from burst_hpc.plan.packing import packing
    from burst_hpc.plan.workload import packed_tiles

    s = 2048
    causal = masks.make(s, True)
    alone = make_layout("contiguous", s, 1)
    assert packing(causal, alone, 0).call(causal, "k")["mask"] is causal
    counts = packed_tiles(causal, alone, 0)
    assert counts[3] > 0 and counts[4] == 0
    documents = masks.make(s, True, None, np.array([0, 700, s]))
    assert packed_tiles(documents, alone, 0)[4] > 0
    two = make_layout("zigzag", s, 2)
    call = packing(documents, two, 0).call(documents, "k")
    assert call["mask"].kind == "intervals" and call["q_start"] == 0
    assert packed_tiles(documents, two, 0)[4] > 0


def test_pairs_under_masks_of_their_own_count_as_each_alone(rng):
    """pairs_calls_tiles of the gather's visits (each pair under its own masks.Packed, counted in one joined
    search) gives every pair the tiles it has counted alone under its mask."""
    from burst_hpc.plan import schedule
    from burst_hpc.plan.layout import as_layout

    seqlen, size = 4096, 4
    cu = masks.random_documents(rng, seqlen, int(rng.integers(2, 20)))
    mask = masks.make(seqlen, True, None, cu)
    layout = as_layout("chunks", seqlen, size, causal=True, cu_seqlens=cu, window=None)
    pairs = [p for a in range(size) for b in range(size)
             for p in schedule.visit_pairs(layout.pieces(a), layout.pieces(b), mask, None, packed=True)]
    pairs += list(schedule.block_pairs(layout.pieces(0), layout.pieces(1), mask))   # the call's own mask too
    assert sum(p.mask is not None for p in pairs) >= size
    alone = np.array([tiles.calls_tiles(mask if p.mask is None else p.mask, [p.q_start], [p.q.stop - p.q.start],
                                        [p.k_start], [p.k.stop - p.k.start], [p.masked])[0] for p in pairs])
    assert np.allclose(tiles.pairs_calls_tiles(mask, pairs), alone)


def test_packed_query_heads_are_the_largest_power_of_two_dividing_the_group_up_to_eight():
    assert {g: tiles.packed_heads(g) for g in (1, 2, 3, 4, 6, 8, 12, 16, 24)} == {
        1: 1, 2: 2, 3: 1, 4: 4, 6: 2, 8: 8, 12: 4, 16: 8, 24: 8}


def test_packed_forward_tiles_are_counted_per_head_of_the_pack(rng):
    """Under documents the forward's tiles of 8 packed heads are tiles of 16 positions, 1/8 of a tile a head: short
    documents then run fewer tiles a head (a tile of 128 rows reaches over several of them), a long document about
    as many; a plain causal mask (the causal instance, never packed) and the backward's counts do not change."""
    one = masks.make(48, True, None, [0, 48])   # by hand: 3 tiles of 16 positions, 1 key tile each, 1/8 a head
    assert tiles.call_tiles(one, 0, 48, 0, 48, True, 8)[:2].tolist() == [3 / 8, 3 / 8]
    s = 4096
    short = masks.make(s, True, None, np.arange(0, s + 1, 48).tolist() + [s])
    plain, packed = (tiles.call_tiles(short, 0, s, 0, s, True, p) for p in (1, 8))
    assert packed[0] < 0.8 * plain[0] and packed[1] <= plain[1]
    assert packed[2:].tolist() == plain[2:].tolist()
    per_pos = tiles.forward_tiles(short, 0, s, 0, s, 16, 128)
    assert packed[0] == per_pos.key_tiles.sum() / 8 and packed[1] == (per_pos.key_tiles > 0).sum() / 8
    long = masks.make(s, True, None, [0, s])
    assert tiles.call_tiles(long, 0, s, 0, s, True, 8).tolist() == tiles.call_tiles(long, 0, s, 0, s, True).tolist()
    causal = masks.make(s, True)
    assert tiles.call_tiles(causal, 0, s, 0, s, True, 8).tolist() == tiles.call_tiles(causal, 0, s, 0, s).tolist()
    # the model packs by the problem's group: a pass of 8 query heads a K/V head is priced on packed tiles
    cu = masks.random_documents(rng, s, 20)
    mask = masks.make(s, True, None, cu)
    layout = make_layout("chunks", s, 2, mask=mask)
    a, b = (account(layout, mask, "gather", "forward", None, p).tiles.sum(axis=(0, 1)) for p in (1, 8))
    assert b[0] < a[0] and b[2:].tolist() == a[2:].tolist()
