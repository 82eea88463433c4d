"""Documents (cu_seqlens) and sliding windows on one device: the oracle's mask against the
definitions, the per-row intervals and block classification against the oracle's mask, and the
NumPy backend against the oracle."""
import itertools

import numpy as np
import pytest

from burst_hpc import MaskError, ShapeError, attention, attention_backward
from burst_hpc.plan import masks
from burst_hpc.backends.numpy_backend import NumpyBackend
from burst_hpc.reference import attention_backward_reference, attention_reference, visible

from burst_testing import qkv, random_blocks, randn

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

WINDOWS = [None, (0, 0), (1, 0), (0, 1), (1, 1), (5, -1), (-1, 3), (7, 2), (40, 40), (500, 500)]


def documents(rng, seqlen, count=None, short=True):
    """Random document offsets; with ``short``, some documents of one token."""
    count = count or int(rng.integers(1, min(seqlen, 12) + 1))
    cu = masks.random_documents(rng, seqlen, count)
    if short and seqlen > 3:  # force length-1 documents at random places
        for cut in rng.choice(np.arange(1, seqlen - 1), size=min(3, seqlen - 2), replace=False):
            cu = np.union1d(cu, [cut, cut + 1])
    return cu


def test_oracle_mask_is_the_definition():
    cu = np.array([0, 3, 4, 9])
    doc = [0, 0, 0, 1, 2, 2, 2, 2, 2]
    for causal, window, docs in itertools.product([False, True], [None, (0, 0), (2, 1), (-1, 2), (3, -1)], [None, cu]):
        got = visible(np.arange(9), np.arange(9), causal, window, docs)
        for i, j in itertools.product(range(9), range(9)):
            want = (not causal or j <= i) and (docs is None or doc[i] == doc[j])
            if window is not None:
                want = want and (window[0] == -1 or j >= i - window[0]) and (window[1] == -1 or j <= i + window[1])
            assert got[i, j] == want, (causal, window, docs is not None, i, j)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
def test_intervals_and_block_classes_match_the_oracle(causal, window, rng, seed):
    """Every kind of mask (full, causal in closed form, the intervals of documents and windows) says
    what the oracle says of rows, blocks and their visible pairs."""
    seqlen = int(rng.integers(1, 90))
    docs = documents(rng, seqlen) if rng.random() < 0.7 else None
    mask = masks.make(seqlen, causal, window, docs)
    kind = "intervals" if window is not None or docs is not None else "causal" if causal else "full"
    assert mask.kind == kind and mask.is_full == (kind == "full")
    dense = visible(np.arange(seqlen), np.arange(seqlen), causal, window, docs)
    lo, hi = mask.intervals
    keys = np.arange(seqlen)
    np.testing.assert_array_equal((keys >= lo[:, None]) & (keys < hi[:, None]), dense, err_msg=f"seed={seed}")
    for q0, q1, _, _ in random_blocks(mask, dense, rng, 40, f"seed={seed}"):
        row_lo, row_hi = mask.rows(q0, q1 - q0)
        np.testing.assert_array_equal((keys >= row_lo[:, None]) & (keys < row_hi[:, None]), dense[q0:q1])


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
def test_blocks_classified_at_once_match_the_oracle(causal, window, rng, seed):
    """classify_many (a visit's pieces in one numpy pass, broadcast as block_pairs asks it: query pieces down,
    key pieces across) says of every block what the oracle does, empty blocks and the sequence's ends included."""
    seqlen = int(rng.integers(1, 90))
    docs = documents(rng, seqlen) if rng.random() < 0.7 else None
    mask = masks.make(seqlen, causal, window, docs)
    dense = visible(np.arange(seqlen), np.arange(seqlen), causal, window, docs)
    q0, k0 = rng.integers(0, seqlen, (2, 60))
    q1, k1 = (rng.integers(0, seqlen - x + 1) for x in (q0, k0))
    got = mask.classify_many(q0[:, None], q1[:, None], k0[None, :], k1[None, :])
    for i, (a, n) in enumerate(zip(q0, q1)):
        for j, (b, m) in enumerate(zip(k0, k1)):
            block = dense[a:a + n, b:b + m]
            want = 0 if not block.any() else 1 if block.all() else 2
            assert got[i, j] == want, f"seed={seed} rows {a}+{n} keys {b}+{m}"


# plain full and causal attention (no documents, no window) are test_api's
MASK_CASES = [(docs, window) for docs in (False, True) for window in WINDOWS if docs or window is not None]


@pytest.mark.parametrize("with_docs,window", MASK_CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_oracle(with_docs, causal, window, rng, seed):
    seqlen = int(rng.integers(1, 300))
    docs = documents(rng, seqlen) if with_docs else None
    q, k, v = qkv(rng, 2, seqlen, seqlen, 4, 2, 16)
    do = randn(rng, q.shape)
    kw = dict(causal=causal, window=window, cu_seqlens=docs)
    ctx = f"seed={seed} S={seqlen} {kw}"
    o, lse = attention(q, k, v, **kw)
    ref_o, ref_lse = attention_reference(q, k, v, **kw)
    np.testing.assert_allclose(o, ref_o, rtol=1e-10, atol=1e-12, err_msg=ctx)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, err_msg=ctx)  # lse comes back as float32
    assert np.isfinite(lse).all(), ctx  # every row sees at least itself
    grads = attention_backward(do, q, k, v, o, lse, **kw)
    for name, got, want in zip(("dq", "dk", "dv"), grads, attention_backward_reference(do, q, k, v, **kw)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{ctx} {name}")


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_low_precision_packed_causal(dtype, rng, seed):
    seqlen = 257
    docs = documents(rng, seqlen, 9)
    q, k, v = qkv(rng, 1, seqlen, seqlen, 2, 1, 32, dtype)
    o, _ = attention(q, k, v, causal=True, cu_seqlens=docs, window=(60, 0))
    ref_o, _ = attention_reference(q, k, v, causal=True, cu_seqlens=docs, window=(60, 0))
    tol = 1e-5 if dtype == np.float32 else 3e-3
    np.testing.assert_allclose(o.astype(np.float64), ref_o, atol=tol, err_msg=f"seed={seed}")


def test_single_document_equals_plain_causal(rng, seed):
    seqlen = 150
    q, k, v = qkv(rng, 1, seqlen, seqlen, 2, 2, 8)
    do = randn(rng, q.shape)
    whole = np.array([0, seqlen])
    o, lse = attention(q, k, v, causal=True, cu_seqlens=whole)
    o_c, lse_c = attention(q, k, v, causal=True)
    np.testing.assert_allclose(o, o_c, rtol=1e-12, atol=1e-13, err_msg=f"seed={seed}")
    np.testing.assert_allclose(lse, lse_c, rtol=1e-7)
    for g, g_c in zip(attention_backward(do, q, k, v, o, lse, causal=True, cu_seqlens=whole),
                      attention_backward(do, q, k, v, o_c, lse_c, causal=True)):
        np.testing.assert_allclose(g, g_c, rtol=1e-10, atol=1e-12, err_msg=f"seed={seed}")
    # an unbounded window is no window
    o_w, _ = attention(q, k, v, causal=True, window=(-1, -1))
    np.testing.assert_array_equal(o_w, o_c)


def test_documents_are_independent(rng, seed):
    """Packed attention equals each document run on its own, concatenated."""
    seqlen = 200
    docs = documents(rng, seqlen, 6)
    q, k, v = qkv(rng, 1, seqlen, seqlen, 2, 1, 8)
    o, lse = attention(q, k, v, causal=True, cu_seqlens=docs)
    for a, b in zip(docs[:-1], docs[1:]):
        o_d, lse_d = attention(q[:, a:b], k[:, a:b], v[:, a:b], causal=True)
        np.testing.assert_allclose(o[:, a:b], o_d, rtol=1e-12, atol=1e-13, err_msg=f"seed={seed} doc {a}:{b}")
        np.testing.assert_allclose(lse[:, :, a:b], lse_d, rtol=1e-7)


def test_blocks_skip_hidden_tiles_and_mask_only_where_needed(rng, seed):
    """Tiles the NumPy backend visits: never a hidden one, unmasked only when wholly visible, and
    blocks of a longer sequence (q_start, k_start) whose rows see nothing keep o = 0, lse = -inf."""
    seqlen = 300
    mask = masks.make(seqlen, True, (37, 0), documents(rng, seqlen, 5))
    dense = visible(np.arange(seqlen), np.arange(seqlen), True, (37, 0), mask.cu_seqlens)
    be = NumpyBackend(block_q=16, block_k=16)
    for q_start, q_len, k_start, k_len in ((0, 300, 0, 300), (130, 70, 40, 100), (20, 40, 200, 60)):
        visited = np.zeros((q_len, k_len), int)
        for q0 in range(0, q_len, 16):
            q1 = min(q_len, q0 + 16)
            for k0, k1, hidden in be.key_tiles(q0, q1, k_len, True, q_start, k_start, mask):
                block = dense[q_start + q0:q_start + q1, k_start + k0:k_start + k1]
                assert block.any(), f"seed={seed} hidden tile visited"
                assert (hidden is None) == block.all(), f"seed={seed}"
                if hidden is not None:
                    np.testing.assert_array_equal(hidden, ~block)
                visited[q0:q1, k0:k1] += 1
        seen = dense[q_start:q_start + q_len, k_start:k_start + k_len]
        assert visited.max() <= 1 and np.all(visited[seen] == 1), f"seed={seed}"
        q, k, v = qkv(rng, 1, q_len, k_len, 2, 1, 8)
        o, lse = np.zeros(q.shape), np.full((1, 2, q_len), -np.inf)
        be.forward_block(q, k, v, o, lse, scale=0.3, masked=True, mask=mask, q_start=q_start, k_start=k_start)
        ref_o, ref_lse = attention_reference(q, k, v, causal=True, scale=0.3, q_start=q_start, k_start=k_start,
                                             window=(37, 0), cu_seqlens=mask.cu_seqlens)
        assert not np.isnan(o).any()
        np.testing.assert_allclose(o, ref_o, rtol=1e-10, atol=1e-12, err_msg=f"seed={seed}")
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))


@pytest.mark.parametrize("cu_seqlens,message", [
    ([0, 5, 5, 8], r"strictly increasing .* entry 2 is 5 after 5"),
    ([0, 6, 3, 8], r"strictly increasing"),
    ([1, 4, 8], r"start at 0 and end at the sequence length 8; got 1 \.\.\. 8"),
    ([0, 4, 7], r"end at the sequence length 8; got 0 \.\.\. 7"),
    ([0, 4, 9], r"end at the sequence length 8"),
    ([0.0, 8.0], r"1-D integer array"),
    ([[0, 8]], r"1-D integer array"),
    ([8], r"1-D integer array"),
])
def test_bad_documents(cu_seqlens, message, rng):
    q, k, v = qkv(rng, 1, 8, 8, 2, 1, 8)
    with pytest.raises(MaskError, match=message):
        attention(q, k, v, causal=True, cu_seqlens=np.array(cu_seqlens))
    with pytest.raises(MaskError, match=message):
        attention_backward(q, q, k, v, q, np.zeros((1, 2, 8), np.float32), cu_seqlens=np.array(cu_seqlens))


@pytest.mark.parametrize("window,message", [
    ((-2, 0), r"window sizes must be >= 0, or -1 for unbounded; got \(-2, 0\)"),
    ((3, -5), r"got \(3, -5\)"),
    (4, r"window must be a \(left, right\) pair of integers"),
    ((1, 2, 3), r"pair of integers"),
    ((1.5, 0), r"pair of integers"),
    ((True, 0), r"pair of integers"),
    ((2 ** 63 - 1, 0), r"window sizes must be at most 4611686018427387904 \(-1: unbounded\); got \(9223372036854775807, 0\)"),
    ((0, 2 ** 62 + 1), r"at most 4611686018427387904"),
])
def test_bad_windows(window, message, rng):
    q, k, v = qkv(rng, 1, 8, 8, 2, 1, 8)
    with pytest.raises(MaskError, match=message):
        attention(q, k, v, window=window)


def test_the_largest_window_is_no_window(rng):
    q, k, v = qkv(rng, 2, 37, 37, 2, 1, 8)
    for got, want in zip(attention(q, k, v, window=(2 ** 62, 2 ** 62)), attention(q, k, v)):
        np.testing.assert_array_equal(got, want)


def test_masks_need_one_sequence(rng):
    q, k, v = qkv(rng, 1, 8, 6, 2, 1, 8)
    for kw in (dict(window=(2, 2)), dict(cu_seqlens=np.array([0, 3, 8]))):
        with pytest.raises(ShapeError, match=r"masks need as many queries as keys; got 8 and 6"):
            attention(q, k, v, **kw)


def test_random_documents_fill_the_sequence(rng):
    for seqlen, count in ((1, 1), (10, 10), (1000, 64)):
        cu = masks.random_documents(rng, seqlen, count)
        assert cu[0] == 0 and cu[-1] == seqlen and len(cu) == count + 1 and np.all(np.diff(cu) >= 1)
    with pytest.raises(MaskError, match=r"cannot pack 11 documents into 10 tokens"):
        masks.random_documents(rng, 10, 11)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_ring_pairs_and_steps_match_the_oracle(layout, size, rng, seed):
    """Block pairs with a Mask cover each visible (query, key) pair once and mask only where needed;
    ring_steps is 1 + the last step at which some rank sees something, for either travelling side."""
    from burst_hpc.plan.layout import layout_indices, make_layout
    from burst_hpc.plan.schedule import block_pairs

    seqlen = 12 * size
    placed = make_layout(layout, seqlen, size)
    window = [None, (int(rng.integers(0, 30)), 0), (int(rng.integers(0, 15)), int(rng.integers(0, 15)))][seed % 3]
    docs = documents(rng, seqlen) if rng.random() < 0.5 else None
    causal = bool(rng.integers(2))
    mask = masks.make(seqlen, causal, window, docs)
    dense = visible(np.arange(seqlen), np.arange(seqlen), causal, window, docs)
    ctx = f"seed={seed} {mask}"
    last = {False: 0, True: 0}
    for step in range(size):
        for rank in range(size):
            source = (rank - step) % size
            for queries_travel in (False, True):
                q_rank, k_rank = (source, rank) if queries_travel else (rank, source)
                if dense[np.ix_(layout_indices(seqlen, q_rank, size, layout), layout_indices(seqlen, k_rank, size, layout))].any():
                    last[queries_travel] = step
            q_pos, k_pos = layout_indices(seqlen, rank, size, layout), layout_indices(seqlen, source, size, layout)
            covered = np.zeros((q_pos.size, k_pos.size), int)
            for p in block_pairs(placed.pieces(rank), placed.pieces(source), mask):
                block = dense[np.ix_(q_pos[p.q], k_pos[p.k])]
                assert p.masked == (not block.all()), ctx  # unmasked only where wholly visible
                assert q_pos[p.q][0] == p.q_start and k_pos[p.k][0] == p.k_start
                covered[p.q, p.k] += 1
            seen = dense[np.ix_(q_pos, k_pos)]
            assert covered.max(initial=0) <= 1 and np.all(covered[seen] == 1), ctx
    for queries_travel in (False, True):
        assert masks.ring_steps(mask, placed, queries_travel) == last[queries_travel] + 1, ctx


def test_short_documents_end_the_contiguous_ring_early():
    """Documents of 16 tokens across every chunk boundary: two steps in contiguous shards, every
    step in zigzag ones (their second chunks meet every other rank's)."""
    seqlen, size = 64 * 8, 8
    short = masks.make(seqlen, True, None, np.concatenate([[0], np.arange(8, seqlen, 16), [seqlen]]))
    from burst_hpc.plan.layout import make_layout

    assert masks.ring_steps(short, make_layout("contiguous", seqlen, size)) == 2
    assert masks.ring_steps(short, make_layout("zigzag", seqlen, size)) == size


@pytest.mark.parametrize("causal", [True, False])
def test_the_call_default_never_depends_on_the_mask(causal):
    """A call naming no layout runs zigzag when causal, contiguous otherwise, whatever its documents
    or window: the caller shards by it before the call (issue 37)."""
    from mpi4py import MPI

    from burst_hpc.plan.callplan import checked_call, plan_arrays

    seqlen = 4096
    q, k, v = (np.zeros((1, seqlen, 2, 8)) for _ in range(3))
    want = "zigzag" if causal else "contiguous"
    for cu in (None, [0, 4000, seqlen], [0, 96, seqlen], [0, 2048, seqlen], [0, 1, seqlen]):
        for window in (None, (128, 0), (3, 5)):
            plan = plan_arrays(MPI.COMM_SELF, q, checked_call(1, q, k, v, causal, None, None, "auto",
                                                              cu_seqlens=None if cu is None else np.array(cu),
                                                              window=window))
            assert plan.layout.kind == want and plan.layout.is_default(causal), (cu, window)


@pytest.mark.parametrize("causal,window,cu,text", [
    (True, (128, 0), np.array([0, 100, 1000, 4096]), "causal, 3 documents (longest 3096 tokens), window (128, 0)"),
    (False, (-1, 64), None, "window (unbounded, 64)"),
    (False, None, np.array([0, 4096]), "1 document (longest 4096 tokens)"),
    (True, None, None, "causal"),
    (False, None, None, "no mask"),
])
def test_a_mask_is_said_in_words(causal, window, cu, text):
    """What --progress prints of the mask: words, not a repr."""
    assert str(masks.make(4096, causal, window, cu)) == text


@pytest.mark.parametrize("size", [2, 3, 4])
def test_a_packed_mask_counts_its_own_rows_against_its_keys(size, rng, seed):
    """A Packed mask (a rank's queries against its packed keys: fewer or more keys than rows) is classified and
    counted block by block as its own intervals say, its rows and its keys each by their own count."""
    from burst_hpc.plan.layout import make_layout
    from burst_hpc.plan.packing import packing

    seqlen = 48 * size
    mask = masks.make(seqlen, True, None, documents(rng, seqlen))
    layout = make_layout("chunks", seqlen, size, mask, chunk=8)
    for rank in range(size):
        packed = packing(mask, layout, rank).call(mask, (mask.key, layout, rank))["mask"]
        lo, hi = packed.intervals
        rows, keys = lo.size, packed.seqlen
        dense = (np.arange(keys)[None, :] >= lo[:, None]) & (np.arange(keys)[None, :] < hi[:, None])
        q0, k0 = rng.integers(0, rows, 40), rng.integers(0, keys, 40)
        q1, k1 = (rng.integers(0, n - x + 1) for x, n in ((q0, rows), (k0, keys)))
        got = packed.classify_many(q0[:, None], q1[:, None], k0[None, :], k1[None, :])
        for i, (a, n) in enumerate(zip(q0, q1)):
            for j, (b, m) in enumerate(zip(k0, k1)):
                block = dense[a:a + n, b:b + m]
                assert got[i, j] == (0 if not block.any() else 1 if block.all() else 2), f"seed={seed}"
        counts = masks.block_counts(packed, 8, 8)
        want = np.add.reduceat(np.add.reduceat(dense, np.arange(0, rows, 8), axis=0), np.arange(0, keys, 8), axis=1)
        np.testing.assert_array_equal(counts, want, err_msg=f"seed={seed} rank {rank}")


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
def test_block_counts_are_the_oracle_mask_summed_over_blocks(causal, window, rng, seed):
    """masks.block_counts (each block of rows computed over its band of key blocks only) sums the oracle's mask
    over every block of rows and keys, grains that do not divide the sequence, with and without documents."""
    for docs in (None, documents(rng, 97)):
        mask = masks.make(97, causal, window, docs)
        dense = visible(np.arange(97), np.arange(97), causal, window, docs)
        for rows, keys in ((1, 1), (8, 8), (5, 13), (64, 7), (97, 97), (200, 3)):
            want = np.add.reduceat(np.add.reduceat(dense.astype(np.int64), np.arange(0, 97, rows), axis=0),
                                   np.arange(0, 97, keys), axis=1)
            np.testing.assert_array_equal(masks.block_counts(mask, rows, keys), want,
                                          err_msg=f"seed={seed} {rows}x{keys} docs={docs}")


def test_a_repeated_argument_set_gets_its_mask_and_a_bad_one_is_still_refused(rng):
    """masks.make keeps the Masks of recent argument sets (validate.given_key): the same arguments give the same
    Mask; offsets changed in place, or arguments equal only in value (True for 1), are checked anew."""
    cu = np.array([0, 5, 17, 30])
    first = masks.make(30, True, (4, 0), cu)
    assert masks.make(30, True, (4, 0), cu.copy()) is first
    assert masks.make(30, True, [4, 0], cu) is not first   # a list is checked as given
    cu[1] = 7
    moved = masks.make(30, True, (4, 0), cu)
    assert moved is not first and moved.cu_seqlens[1] == 7
    with pytest.raises(MaskError, match="window must be"):
        masks.make(30, True, (True, 0), cu)               # equal to (1, 0), not integers
    cu[2] = 3
    with pytest.raises(MaskError, match="strictly increasing"):
        masks.make(30, True, (4, 0), cu)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
def test_document_keys_are_the_distinct_first_keys_of_the_document_starts(causal, window, rng, seed):
    """document_keys: the first key of every run of document_starts, sorted and distinct, read-only, as np.unique
    gives them, for the masks the API makes and for bounds that decrease (a Packed mask made by hand)."""
    seqlen = int(rng.integers(1, 600))
    made = [masks.make(seqlen, causal, window, cu) for cu in (None, documents(rng, seqlen))]
    lo = np.sort(rng.integers(1, 50, 40))[::-1].copy()   # rows that see nothing: every row starts a run
    made.append(masks.Packed(lo, np.zeros_like(lo), 60, ("decreasing", seed)))
    for mask in made:
        if mask.kind != "intervals":
            continue
        got = masks.document_keys(mask)
        starts = masks.document_starts(mask)
        want = np.unique(mask.intervals[0][starts])
        np.testing.assert_array_equal(got, want, err_msg=f"seed={seed}")
        assert got.dtype == want.dtype and not got.flags.writeable
