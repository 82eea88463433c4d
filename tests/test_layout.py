"""Layouts: which global tokens each rank owns, and shard/unshard round trips."""
import dataclasses
import pickle
import re

import numpy as np
import pytest

import burst_hpc
from burst_hpc.errors import BurstError, LayoutError
from burst_hpc.plan import masks
from burst_hpc.plan.layout import LAYOUTS, Layout, as_layout, default_kind, layout_indices, make_layout, shard, unshard

from burst_testing import BF16


def pieces(seqlen, rank, size, kind):
    return make_layout(kind, seqlen, size).pieces(rank)


def check_split(seqlen, size, kind):
    return make_layout(kind, seqlen, size).local


def _array(rng, shape, axis, seqlen, dtype=np.float64):
    shape = list(shape)
    shape[axis] = seqlen
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("axis", [1, 0, 2, -1, -3])
def test_shard_unshard_round_trip(layout, size, axis, rng, seed):
    chunks = size if layout == "contiguous" else 2 * size
    seqlen = chunks * int(rng.integers(1, 6))
    x = _array(rng, (2, 3, 4, 5), axis, seqlen)
    ctx = f"seed={seed} layout={layout} P={size} S={seqlen} axis={axis}"
    shards = [shard(x, r, size, layout, axis=axis, causal=True, cu_seqlens=None, window=None) for r in range(size)]   # chunks: placed by it
    seen = []
    for r, part in enumerate(shards):
        idx = layout_indices(seqlen, r, size, layout, causal=True, cu_seqlens=None, window=None)
        assert part.shape[axis] == seqlen // size, ctx
        np.testing.assert_array_equal(part, np.take(x, idx, axis=axis), err_msg=f"{ctx} rank={r}")
        assert part.dtype == x.dtype, ctx
        seen.append(idx)
    # every token is owned by exactly one rank
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(seqlen), err_msg=ctx)
    back = unshard(shards, layout, axis=axis, causal=True, cu_seqlens=None, window=None)
    assert back.shape == x.shape and back.dtype == x.dtype, ctx
    np.testing.assert_array_equal(back, x, err_msg=ctx)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_low_precision_and_public_names(layout, rng, seed):
    x = _array(rng, (1, 1, 2, 8), 1, 24, BF16)
    shards = [burst_hpc.shard(x, r, 3, layout, causal=True, cu_seqlens=None, window=None) for r in range(3)]
    back = burst_hpc.unshard(shards, layout, causal=True, cu_seqlens=None, window=None)
    assert back.dtype == BF16
    np.testing.assert_array_equal(back.view(np.uint16), x.view(np.uint16), err_msg=f"seed={seed}")


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_zigzag_ownership(size):
    seqlen = 2 * size * 3
    if size == 1:  # one rank owns every token: one run, and any length splits
        assert pieces(seqlen, 0, 1, "zigzag") == ((0, seqlen),) and pieces(7, 0, 1, "zigzag") == ((0, 7),)
        return
    for r in range(size):
        assert pieces(seqlen, r, size, "zigzag") == ((r * 3, 3), ((2 * size - 1 - r) * 3, 3))
        idx = layout_indices(seqlen, r, size, "zigzag")
        chunks = sorted(set((idx // 3).tolist()))
        assert chunks == sorted({r, 2 * size - 1 - r})
        # local order: chunk r first, then chunk 2P-1-r
        np.testing.assert_array_equal(idx, np.r_[r * 3:r * 3 + 3, (2 * size - 1 - r) * 3:(2 * size - r) * 3])


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_contiguous_ownership(size, layout):
    """balanced owns the tokens contiguous does (natural order); only the schedule differs."""
    seqlen = size * 4
    for r in range(size):
        assert pieces(seqlen, r, size, layout) == ((r * 4, 4),)
        np.testing.assert_array_equal(layout_indices(seqlen, r, size, layout), np.arange(r * 4, r * 4 + 4))
    assert check_split(3 * size, size, layout) == 3  # S % P == 0 is enough


def test_zigzag_balances_causal_work():
    """Visible (query, key) pairs per rank are equal under zigzag (the reason it exists)."""
    size, seqlen = 4, 64
    work = [int(np.sum(layout_indices(seqlen, r, size, "zigzag") + 1)) for r in range(size)]
    assert len(set(work)) == 1, work


def test_length_that_does_not_split():
    with pytest.raises(LayoutError, match=r"multiple of 6"):
        check_split(9, 3, "zigzag")
    # contiguous needs only S % P == 0; zigzag needs S % 2P == 0
    assert check_split(9, 3, "contiguous") == 3
    with pytest.raises(LayoutError, match=r"sequence length 9 does not split over 3 ranks with the zigzag layout"):
        shard(np.zeros((1, 9, 1, 1)), 0, 3, "zigzag")
    with pytest.raises(LayoutError, match=r"multiple of 4"):
        layout_indices(10, 1, 4, "contiguous")
    with pytest.raises(LayoutError, match=r"multiple of 4"):
        shard(np.zeros((1, 6, 1, 1)), 0, 2, "zigzag")
    with pytest.raises(LayoutError):  # a zigzag shard must have an even length
        unshard([np.zeros((1, 3, 1, 1))] * 2, "zigzag")


SPLIT_ERRORS = [  # (S, P, layout): what the error says after "sequence length S does not split over P ranks with
    # the L layout: "; zigzag needs a multiple of 2P, balanced and contiguous of P (issue 37: S = 4096 on 3 ranks)
    ((4096, 3, "zigzag"), "it must be a multiple of 6 (two chunks a rank); the balanced and contiguous layouts need "
                          "only a multiple of 3: pad the sequence to 4098, which splits with every layout"),
    ((4095, 3, "zigzag"), "it must be a multiple of 6 (two chunks a rank); the balanced and contiguous layouts need "
                          "only a multiple of 3, which it is: use one of them, or pad the sequence to 4098"),
    ((7, 3, "zigzag"), "it must be a multiple of 6 (two chunks a rank); the balanced and contiguous layouts need only "
                       "a multiple of 3: pad the sequence to 9 with one of them, or to 12"),
    ((1000, 24, "balanced"), "it must be a multiple of 24 (zigzag: of 48); pad the sequence to 1008, which splits with "
                             "every layout"),
    ((10, 4, "contiguous"), "it must be a multiple of 4 (zigzag: of 8); pad the sequence to 12, or to 16 for zigzag too"),
]


@pytest.mark.parametrize("args,what", SPLIT_ERRORS, ids=[f"S{s}-P{p}-{layout}" for (s, p, layout), _ in SPLIT_ERRORS])
def test_length_error_names_the_layouts_that_fit_and_the_padding(args, what):
    seqlen, size, layout = args
    with pytest.raises(LayoutError) as error:
        check_split(seqlen, size, layout)
    assert str(error.value) == f"sequence length {seqlen} does not split over {size} ranks with the {layout} layout: {what}"
    padded = [int(n) for n in re.findall(r"pad the sequence to (\d+)(?:[^,]*, or to (\d+))?", what)[0] if n]
    for length in padded:   # the advice holds: the padded lengths split with the layouts said
        assert check_split(length, size, "balanced") and check_split(length, size, "contiguous")
    assert check_split(padded[-1], size, "zigzag")


def test_bad_arguments_raise_layout_error():
    with pytest.raises(LayoutError, match=r"unknown layout 'ring'.*contiguous, zigzag"):
        layout_indices(8, 0, 2, "ring")
    with pytest.raises(LayoutError, match=r"unknown layout"):
        shard(np.zeros((1, 8)), 0, 2, "Zigzag")
    with pytest.raises(LayoutError, match=r"unknown layout"):
        unshard([np.zeros((1, 4))] * 2, "striped")
    with pytest.raises(LayoutError, match=r"rank 2 is outside 0..1"):
        pieces(8, 2, 2, "contiguous")
    with pytest.raises(LayoutError, match=r"rank -1"):
        shard(np.zeros((1, 8)), -1, 2, "zigzag")
    with pytest.raises(LayoutError, match=r"at least one rank"):
        check_split(8, 0, "contiguous")
    with pytest.raises(LayoutError, match=r"axis 3 is out of range"):
        shard(np.zeros((1, 8, 2)), 0, 2, "contiguous", axis=3)
    with pytest.raises(LayoutError, match=r"at least one rank"):
        unshard([], "contiguous")
    with pytest.raises(LayoutError, match=r"shard 1 has shape"):
        unshard([np.zeros((1, 4, 2)), np.zeros((1, 2, 2))], "contiguous")
    with pytest.raises(LayoutError, match=r"shard 1 has shape"):
        unshard([np.zeros((1, 4, 2)), np.zeros((1, 4, 1))], "contiguous")
    assert issubclass(LayoutError, BurstError) and issubclass(LayoutError, ValueError)


def test_shard_is_a_copy(rng):
    x = rng.standard_normal((1, 8, 2))
    for layout in LAYOUTS:
        part = shard(x, 0, 2, layout, causal=False, cu_seqlens=None, window=None)
        part[...] = 0
        assert np.all(x != 0), layout


def test_default_layout():
    assert default_kind(True) == "zigzag" and make_layout("zigzag", 8, 2).is_default(True)
    assert default_kind(False) == "contiguous" and make_layout("contiguous", 8, 2).is_default(False)
    assert not make_layout("balanced", 8, 2).is_default(True)


def test_a_layout_is_a_value():
    """Equal by kind, sizes and pieces; hashable (the plan caches key by it); survives pickling
    between processes (its hash is rebuilt there); only the balanced layout balances by schedule."""
    a, b = make_layout("zigzag", 16, 4), make_layout("zigzag", 16, 4)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != make_layout("contiguous", 16, 4) and a != make_layout("zigzag", 32, 4) and a != "zigzag"
    # one rank: zigzag and contiguous hold the same tokens, but are different layouts
    assert make_layout("zigzag", 8, 1).pieces(0) == make_layout("contiguous", 8, 1).pieces(0)
    assert make_layout("zigzag", 8, 1) != make_layout("contiguous", 8, 1)
    assert pickle.loads(pickle.dumps(a)) == a and hash(pickle.loads(pickle.dumps(a))) == hash(a)
    causal = masks.Mask(8, True, None, None)   # the chunks layout places tokens by it
    assert {kind: make_layout(kind, 8, 2, causal).balances_by_schedule for kind in LAYOUTS} == \
        {"contiguous": False, "zigzag": False, "balanced": True, "chunks": False}
    chunks = make_layout("chunks", 8, 2, causal)
    assert pickle.loads(pickle.dumps(chunks)) == chunks and pickle.loads(pickle.dumps(chunks)).grain == chunks.grain
    assert (a.kind, a.seqlen, a.size, a.local) == ("zigzag", 16, 4, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.kind = "contiguous"


@pytest.mark.parametrize("size", [1, 2, 3])
def test_slabs_join_runs_that_follow_each_other(size):
    """The HDF5 slabs a rank reads: its pieces in local order, a run that starts where the one
    before ends joined to it (zigzag's middle rank holds one slab)."""
    layout = make_layout("zigzag", 4 * size, size)
    for r in range(size):
        slabs = layout.slabs(r)
        assert np.array_equal(np.concatenate([np.arange(a, b) for a, b in slabs]), layout.indices(r))
        assert all(slabs[i][1] != slabs[i + 1][0] for i in range(len(slabs) - 1))
    if size == 2:
        assert layout.slabs(1) == ((2, 6),) and layout.pieces(1) == ((2, 2), (4, 2))


def test_public_functions_take_a_layout_or_a_name(rng):
    x = rng.standard_normal((1, 12, 2))
    layout = make_layout("zigzag", 12, 3)
    for r in range(3):
        np.testing.assert_array_equal(burst_hpc.shard(x, r, 3, layout), burst_hpc.shard(x, r, 3, "zigzag"))
        np.testing.assert_array_equal(layout.shard(x, r), burst_hpc.shard(x, r, 3, "zigzag"))
        np.testing.assert_array_equal(layout_indices(12, r, 3, layout), layout.indices(r))
    shards = [layout.shard(x, r) for r in range(3)]
    np.testing.assert_array_equal(burst_hpc.unshard(shards, layout), x)
    np.testing.assert_array_equal(layout.unshard(shards), x)
    assert burst_hpc.Layout is Layout and burst_hpc.make_layout is make_layout
    assert as_layout("balanced", 12, 3) == make_layout("balanced", 12, 3) and as_layout(layout, 12, 3) is layout
    with pytest.raises(LayoutError, match=r"Layout\('zigzag', seqlen=12, size=3\) is of 12 tokens over 3 ranks; "
                                          r"the call's sequence is 24 tokens over 3 ranks"):
        burst_hpc.shard(np.zeros((1, 24, 2)), 0, 3, layout)
    with pytest.raises(LayoutError, match=r"of 12 tokens over 3 ranks; the call's sequence is 8 tokens over 2"):
        burst_hpc.unshard([np.zeros((1, 4, 2))] * 2, layout)
    with pytest.raises(LayoutError, match=r"the array holds 24 tokens along axis 1; the layout is of 12"):
        layout.shard(np.zeros((1, 24, 2)), 0)
    with pytest.raises(LayoutError, match=r"each of the layout's 3 ranks; got 2"):
        layout.unshard(shards[:2])
    with pytest.raises(LayoutError, match=r"layout must be a Layout or one of contiguous, zigzag, balanced, chunks; got 3"):
        as_layout(3, 12, 3)


def test_chunks_layouts_with_the_same_runs_but_other_chunks_differ():
    """The gather schedule sends a chunks layout's runs whole in chunks (grain): two placements with the
    same runs but other chunks move different messages, so they must not agree or share a cached plan."""
    runs = (((48, 64),), ((0, 48), (112, 16)))
    a, b = (Layout("chunks", 128, 2, runs, chunk=chunk) for chunk in (16, 8))
    assert a != b and a.key != b.key and a.grain == 16 and b.grain == 8


@pytest.mark.parametrize("unsaid", ["cu_seqlens", "window"])
def test_sharding_by_the_chunks_name_needs_the_whole_mask_said(unsaid):
    """A caller who shards by the name and leaves the documents (or the window) out would get shards
    placed by another mask than the call's: refused, not silently wrong. None says 'the call has none'."""
    x = np.arange(2 * 128 * 3, dtype=np.float32).reshape(2, 128, 3)
    said = dict(causal=True, cu_seqlens=np.array([0, 40, 128]), window=None)
    said.pop(unsaid)
    with pytest.raises(LayoutError, match="pass the call's causal, cu_seqlens and window"):
        shard(x, 0, 2, "chunks", **said)
    with pytest.raises(LayoutError, match="pass the call's causal, cu_seqlens and window"):
        layout_indices(128, 0, 2, "chunks", **said)
    assert shard(x, 0, 2, "chunks", causal=True, cu_seqlens=None, window=None).shape == (2, 64, 3)
