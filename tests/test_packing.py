"""The gather scheme's packed keys (plan/packing.py): every query row's visible keys are one interval of
the packed buffer, and what one rank sends another is what that one receives, cut into the same runs."""
import numpy as np
import pytest

from burst_hpc.plan import masks
from burst_hpc.plan.layout import make_layout
from burst_hpc.plan.packing import packing


def random_mask(rng, seqlen):
    causal = bool(rng.integers(2))
    window = (int(rng.integers(0, seqlen)), int(rng.integers(-1, 3)) if causal else int(rng.integers(0, seqlen)))
    cu = masks.random_documents(rng, seqlen, int(rng.integers(1, 9))) if rng.integers(4) else None
    window = window if rng.integers(3) == 0 or (cu is None and not causal) else None
    if causal and window is not None:
        window = (window[0], 0)
    return masks.make(seqlen, causal, window, cu)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("kind", ["chunks", "chunks by nodes", "contiguous", "zigzag", "balanced"])
def test_every_row_sees_one_interval_of_the_packed_keys(seed, kind):
    rng = np.random.default_rng([seed, 11])
    size = int(rng.integers(2, 6)) * (2 if kind == "chunks by nodes" else 1)
    seqlen = size * 128 * int(rng.integers(1, 4))
    mask = random_mask(rng, seqlen)
    layout = make_layout(kind.split()[0], seqlen, size, mask, 2 if kind == "chunks by nodes" else None)
    packs = [packing(mask, layout, r) for r in range(size)]
    lo_g, hi_g = mask.intervals
    for r, p in enumerate(packs):
        where = np.full(p.keys, -1)
        where[p.own] = layout.indices(r)
        for sender, slots in p.receives:
            rows = dict(packs[sender].sends)[r]   # what the sender sends, in its order
            assert len(rows) == len(slots)
            assert (where[slots] == -1).all()
            where[slots] = layout.indices(sender)[rows]
        assert (where >= 0).all() and (np.diff(where) > 0).all()   # every slot once, global order
        own = layout.indices(r)
        alone = not p.receives and np.array_equal(own, np.arange(own[0], own[0] + len(own)))
        assert (p.start is not None) == alone
        if alone:   # the buffer is the rank's own keys, at their places from start
            assert p.start == own[0] and np.array_equal(where, own)
        queries = layout.indices(r)
        for row in range(len(queries)):
            visible = where[p.lo[row]:p.hi[row]]
            assert np.array_equal(visible, np.arange(lo_g[queries[row]], hi_g[queries[row]]))
    # every send has its receive
    assert sorted((r, a) for r, p in enumerate(packs) for a, _ in p.sends) == \
        sorted((b, r) for r, p in enumerate(packs) for b, _ in p.receives)
    # the runs a message is cut into: the same on both ends, consecutive rows on the sender and slots on the
    # receiver, and each run's keys consecutive in the sequence (so a run moves from its place into its place)
    for r, p in enumerate(packs):
        for (sender, slots), cuts in zip(p.receives, p.receive_cuts):
            theirs = packs[sender]
            rows = dict(theirs.sends)[r]
            assert np.array_equal(cuts, theirs.send_cuts[[a for a, _ in theirs.sends].index(r)])
            assert cuts[0] == 0 and cuts[-1] == len(slots) and (np.diff(cuts) > 0).all()
            for a, b in zip(cuts[:-1], cuts[1:]):
                for run in (slots[a:b], rows[a:b], layout.indices(sender)[rows[a:b]]):
                    assert np.array_equal(run, np.arange(run[0], run[0] + b - a))


def test_documents_on_one_rank_need_no_transfer():
    seqlen, size = 4 * 256, 4
    cu = np.arange(0, seqlen + 1, 256)   # a document a rank under the contiguous layout
    mask = masks.make(seqlen, True, None, cu)
    layout = make_layout("contiguous", seqlen, size, mask)
    for r in range(size):
        p = packing(mask, layout, r)
        assert p.keys == 256 and not p.receives and not p.sends
        assert np.array_equal(p.own, np.arange(256)) and p.start == 256 * r


def test_one_rank_holds_its_own_keys_as_they_are():
    for mask in (masks.make(384, True, None, None), masks.make(384, False, None, None),
                 masks.make(384, True, None, np.array([0, 100, 384]))):
        for kind in ("contiguous", "zigzag", "chunks"):
            p = packing(mask, make_layout(kind, 384, 1, mask), 0)
            assert p.start == 0 and p.keys == 384 and not p.receives and not p.sends


@pytest.mark.parametrize("documents", [None, 6])
def test_a_first_call_then_a_merging_last_call_make_one_call(documents):
    """The block contract across two calls (the NumPy backend; tests/test_cuda_masks.py asks the same of the
    CUDA kernels): a `first` call without `out` on some keys, then a merging call with `out` on the rest."""
    from burst_hpc import reference
    from burst_hpc.backends.numpy_backend import NumpyBackend
    from split_calls import case, split_forward

    q, k, v, mask, in_first = case(np.random.default_rng(), 600, documents, np.float32)
    out, lse = split_forward(NumpyBackend(64, 64), np, q, k, v, mask, in_first)
    ref_o, ref_lse = reference.attention_reference(q, k, v, **mask.arguments)
    np.testing.assert_allclose(out, ref_o, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(12))
def test_the_forwards_early_runs_see_only_own_keys(seed):
    """Packing.early: runs of query rows, in order, each seeing only the rank's own keys and carrying at least
    EARLY_SHARE of its visible pairs, at most EARLY_RUNS; none where nothing arrives; with the late runs of
    ``spans`` every row once, also over the first rows only (a rehearsal)."""
    from burst_hpc.plan.packing import EARLY_RUNS, EARLY_SHARE

    rng = np.random.default_rng([seed, 12])
    size = int(rng.integers(2, 6))
    seqlen = size * 128 * int(rng.integers(1, 4))
    mask = random_mask(rng, seqlen)
    layout = make_layout(str(rng.choice(["chunks", "contiguous", "zigzag"])), seqlen, size, mask)
    for r in range(size):
        p = packing(mask, layout, r)
        work = (p.hi - p.lo).astype(np.int64)
        own = np.zeros(p.keys, bool)
        own[p.own] = True
        assert len(p.early) <= EARLY_RUNS and (not p.receives) <= (p.early == ())
        assert all(a < b for a, b in p.early) and all(b <= c for (_, b), (c, _) in zip(p.early, p.early[1:]))
        for lo, hi in p.early:
            assert all(own[p.lo[row]:p.hi[row]].all() for row in range(lo, hi))
            assert work[lo:hi].sum() >= EARLY_SHARE * work.sum() > 0
        for rows in (len(p.lo), int(rng.integers(0, len(p.lo) + 1))):
            early, late = p.split(rows)
            covered = np.zeros(rows, np.int64)
            for lo, hi in early + late:
                assert 0 <= lo < hi <= rows
                covered[lo:hi] += 1
            assert (covered == 1).all()
            assert late == tuple(sorted(late))
