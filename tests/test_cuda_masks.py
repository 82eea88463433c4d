"""GPU tests of the interval-masked CUDA kernels: documents (cu_seqlens) and sliding windows
(skipped without CuPy or without a GPU). Run on the GPU machine with
``python3 -m pytest -q tests/test_cuda_masks.py``: every test runs once per kernel family the GPU runs
(sm90 then sm80 on Hopper; the family leads the test id).

Rule (FlashAttention style, as tests/test_cuda_kernels.py): against the float64 oracle (the
dense boolean mask of burst_hpc.reference), the error of our result is at most 2x (forward) /
3x (gradients) the error of a plain same-precision implementation (burst_hpc.tolerance.plain_attention,
each product rounded to bf16) plus a small floor. Fresh random inputs every run; the seed is printed.
"""
import numpy as np
import pytest

from burst_hpc.device import gpu_count  # noqa: E402

cupy = pytest.importorskip("cupy")
_NGPU = gpu_count()
pytestmark = pytest.mark.skipif(_NGPU < 1, reason="no GPU")

import burst_hpc  # noqa: E402
from burst_hpc.plan import masks  # noqa: E402
from burst_hpc.backends import cuda, get_backend  # noqa: E402
from burst_hpc.reference import attention_backward_reference, attention_reference  # noqa: E402
from burst_hpc.tolerance import plain_attention  # noqa: E402

BF16 = np.dtype("bfloat16")


@pytest.fixture(scope="module", autouse=True, params=cuda.kernel_families() if _NGPU else ())
def family(request):
    """Run the module's tests on one kernel family (the API and get_backend read $BURST_HPC_KERNELS)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BURST_HPC_KERNELS", request.param)
        yield request.param


def documents(rng, seqlen, count):
    """Random offsets with two one-token documents and a document far longer than a tile."""
    cu = masks.random_documents(rng, seqlen, count)
    ones = rng.choice(np.arange(1, seqlen - 1), size=2, replace=False)
    cu = np.union1d(cu, np.concatenate([ones, ones + 1]))
    return cu


def _err(got, want):
    return float(np.abs(np.asarray(got, np.float64) - want).max())


CASES = [  # seqlen, hq, hkv, d, causal, documents, window (, dtype)
    (1000, 4, 2, 128, True, 9, None),
    (1000, 4, 2, 64, True, 9, None),
    (777, 2, 2, 128, False, 5, None),
    (1000, 4, 1, 128, True, None, (100, 0)),
    (1000, 2, 2, 64, True, None, (0, 0)),
    (1000, 2, 2, 64, True, None, (1, 0)),
    (901, 4, 2, 128, False, None, (37, 64)),
    (1000, 2, 1, 128, True, 12, (200, 0)),
    (1000, 2, 2, 64, False, 4, (-1, 5)),
    (333, 2, 2, 128, True, 1, None),  # one document: plain causal
    (1000, 4, 2, 128, True, 9, (150, 0), np.float16),
    (1000, 2, 1, 64, True, 6, None, np.float16),
    # documents of several forward tiles (plan/tiles.forward_tiles starts their tiles on their first rows)
    (3000, 4, 2, 128, True, 4, None),
    (2700, 2, 1, 64, True, 3, (800, 0)),
    (2200, 2, 2, 128, False, 3, None),
    # groups the forward packs into a tile's rows (PackGQA: 8, 8 of 16, 2 of 6, 4) and one it cannot (3)
    (1000, 16, 2, 128, True, 9, None),
    (1100, 16, 1, 64, True, 7, (300, 0)),
    (900, 12, 2, 128, True, 11, None, np.float16),
    (1000, 8, 2, 256, True, 9, None),
    (700, 3, 1, 128, True, 5, None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"S{c[0]}_h{c[1]}:{c[2]}_d{c[3]}_{'causal' if c[4] else 'full'}"
                         f"_docs{c[5]}_win{c[6]}" + ("_f16" if len(c) > 7 else ""))
def test_masked_attention_matches_oracle(case):
    seqlen, hq, hkv, d, causal, count, window = case[:7]
    dtype = np.dtype(case[7]) if len(case) > 7 else BF16
    seed = int(np.random.SeedSequence().entropy % 2**63)
    rng = np.random.default_rng(seed)
    cu = documents(rng, seqlen, count) if count and count > 1 else (np.array([0, seqlen]) if count else None)
    kw = dict(causal=causal, window=window, cu_seqlens=cu)
    q, k, v, do = (rng.standard_normal((2, seqlen, h, d)).astype(dtype) for h in (hq, hkv, hkv, hq))
    ctx = f"seed={seed} {case}"
    o, lse = burst_hpc.attention(*(cupy.asarray(x) for x in (q, k, v)), **kw)
    ref_o, ref_lse = attention_reference(q, k, v, **kw)
    plain = plain_attention(q, k, v, do, causal, None, dtype, window, cu)
    assert not bool(cupy.isnan(o.astype(cupy.float32)).any()), ctx
    assert _err(cupy.asnumpy(o), ref_o) <= 2 * _err(plain[0], ref_o) + 1e-3, ctx
    assert _err(cupy.asnumpy(lse), ref_lse) <= 2 * _err(plain[1].astype(np.float32), ref_lse) + 1e-3, ctx
    grads = burst_hpc.attention_backward(*(cupy.asarray(x) for x in (do, q, k, v)), o, lse, **kw)
    for name, got, want, base in zip(("dq", "dk", "dv"), grads, attention_backward_reference(do, q, k, v, **kw),
                                     plain[2:]):
        floor = 3e-3 * max(1.0, float(np.abs(want).max()))
        assert _err(cupy.asnumpy(got), want) <= 3 * _err(base, want) + floor, f"{ctx} {name}"


@pytest.mark.parametrize("case", CASES[:3] + CASES[7:9], ids=lambda c: f"S{c[0]}_d{c[3]}_docs{c[5]}_win{c[6]}")
@pytest.mark.parametrize("layout", [None, "chunks"])
def test_one_rank_of_the_distributed_call_is_the_single_device_call(case, layout):
    """burst_attention on one rank (scheme 'auto': its one block call a pass) gives attention's forward bits, and
    its gradients to the rounding of float32 atomics (dQ's order of addition varies from call to call)."""
    from mpi4py import MPI

    seqlen, hq, hkv, d, causal, count, window = case[:7]
    rng = np.random.default_rng()
    cu = documents(rng, seqlen, count) if count and count > 1 else None
    kw = dict(causal=causal, window=window, cu_seqlens=cu)
    q, k, v, do = (cupy.asarray(rng.standard_normal((1, seqlen, h, d)).astype(BF16)) for h in (hq, hkv, hkv, hq))
    single = burst_hpc.attention(q, k, v, **kw)
    single += burst_hpc.attention_backward(do, q, k, v, *single, **kw)
    ours = burst_hpc.burst_attention(q, k, v, comm=MPI.COMM_SELF, layout=layout, **kw)
    ours += burst_hpc.burst_attention_backward(do, q, k, v, *ours, comm=MPI.COMM_SELF, layout=layout, **kw)
    for name, a, b in zip(("o", "lse"), ours, single):
        assert a.dtype == b.dtype and bool((a == b).all()), name
    for name, a, b in zip(("dq", "dk", "dv"), ours[2:], single[2:]):
        a, b = (cupy.asnumpy(x).astype(np.float64) for x in (a, b))
        assert np.abs(a - b).max() <= 2 ** -7 * np.abs(b).max(), name   # a bf16 rounding step


@pytest.mark.parametrize("documents", [None, 9])
def test_a_first_call_then_a_merging_last_call_make_one_call(documents):
    """The block contract across two calls on the same rows: a `first` call without `out` on some keys, then a
    merging call with `out` on the rest, give one call's o (to a bf16 step) and lse (the pair the packed
    forward's own-keys-first trial made, whose gradients came out wrong on 4 GPUs: docs/BENCHMARKS.md)."""
    from split_calls import case, split_forward

    q, k, v, mask, in_first = case(np.random.default_rng(), 1000, documents, BF16)
    out, lse = split_forward(get_backend(cupy.zeros(1)), cupy, q, k, v, mask, in_first)
    single, single_lse = burst_hpc.attention(*(cupy.asarray(x) for x in (q, k, v)), **mask.arguments)
    a, b = (cupy.asnumpy(x).astype(np.float64) for x in (out, single))
    assert np.abs(a - b).max() <= 2 ** -7 * np.abs(b).max() + 1e-3
    np.testing.assert_allclose(cupy.asnumpy(lse), cupy.asnumpy(single_lse), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("heads", [(8, 1), (16, 2), (6, 1)], ids=lambda h: f"h{h[0]}:{h[1]}")
def test_packed_query_heads_give_the_unpacked_forward(heads):
    """The sm90 forward with the query heads of a K/V group packed into a tile's rows (PackGQA) against the same
    call unpacked and the oracle, on ring block pairs (rows and keys of a longer packed sequence, short and long
    documents, some rows seeing nothing), merging into a running (o, lse) and as one first-and-last call."""
    be = get_backend(cupy.zeros(1))
    if not hasattr(be, "kernels") or not hasattr(be.kernels, "pack_gqa"):
        pytest.skip("PackGQA is the sm90 forward's")
    seed = int(np.random.SeedSequence().entropy % 2**63)
    rng = np.random.default_rng(seed)
    hq, hkv = heads
    seqlen, d = 3000, 128
    cu = documents(rng, seqlen, 12)
    cu = np.union1d(cu, [1500, 2900])   # a long document and a short one at the end
    mask = masks.make(seqlen, True, None, cu)
    for q_start, q_len, k_start, k_len in ((0, seqlen, 0, seqlen), (1100, 1500, 333, 2000), (1400, 1000, 0, 1500)):
        q = rng.standard_normal((1, q_len, hq, d)).astype(BF16)
        k, v = (rng.standard_normal((1, k_len, hkv, d)).astype(BF16) for _ in range(2))
        kw = dict(causal=True, q_start=q_start, k_start=k_start, cu_seqlens=cu)
        ref_o, ref_lse = attention_reference(q, k, v, **kw)
        ctx = f"seed={seed} heads {heads} rows {q_start}+{q_len} keys {k_start}+{k_len}"
        results = {}
        for packed in (True, False):
            be.kernels.pack_gqa = packed
            try:
                o = cupy.zeros((1, q_len, hq, d), cupy.float32)
                lse = cupy.full((1, hq, q_len), -cupy.inf, cupy.float32)
                be.forward_block(*(cupy.asarray(x) for x in (q, k, v)), o, lse, scale=d ** -0.5, masked=True,
                                 q_start=q_start, k_start=k_start, mask=mask)
                out, lse1 = cupy.empty((1, q_len, hq, d), BF16), cupy.empty((1, hq, q_len), cupy.float32)
                be.forward_block(*(cupy.asarray(x) for x in (q, k, v)), None, lse1, scale=d ** -0.5, masked=True,
                                 q_start=q_start, k_start=k_start, mask=mask, first=True, out=out)
            finally:
                be.kernels.pack_gqa = True
            for name, got, got_lse in (("merged", o, lse), ("first and last", out, lse1)):
                got, got_lse = cupy.asnumpy(got).astype(np.float64), cupy.asnumpy(got_lse)
                np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(ref_lse), err_msg=f"{ctx} {name}")
                seen = ~np.isneginf(ref_lse)
                assert seen.any() and np.abs(got_lse[seen] - ref_lse[seen]).max() < 1e-3, f"{ctx} {name} {packed}"
                assert _err(got, ref_o) < 2e-2, f"{ctx} {name} packed={packed}"
                results[packed, name] = got
        for name in ("merged", "first and last"):
            assert np.abs(results[True, name] - results[False, name]).max() < 2e-2, f"{ctx} {name}"


@pytest.mark.parametrize("d", [64, 128])
def test_packed_query_heads_at_every_tile_height_with_key_splits(d):
    """PackGQA at each forward tile height (D = 64: 128 and 192 rows, 16 and 24 positions of 8 heads), with the key
    range cut in two across CTAs and on 3 CTAs (many tiles each): a ring block pair of 16 query heads a K/V head
    against the oracle; the tile counter and the locks are back at zero after each call."""
    be = get_backend(cupy.zeros(1))
    if not hasattr(be, "kernels") or not hasattr(be.kernels, "pack_gqa"):
        pytest.skip("PackGQA is the sm90 forward's")
    seed = int(np.random.SeedSequence().entropy % 2**63)
    rng = np.random.default_rng(seed)
    seqlen, q_start, q_len, k_start, k_len = 2000, 600, 1000, 200, 1300
    cu = documents(rng, seqlen, 9)
    mask = masks.make(seqlen, True, None, cu)
    q = rng.standard_normal((2, q_len, 16, d)).astype(BF16)
    k, v = (rng.standard_normal((2, k_len, 1, d)).astype(BF16) for _ in range(2))
    kw = dict(causal=True, q_start=q_start, k_start=k_start, cu_seqlens=cu)
    ref_o, ref_lse = attention_reference(q, k, v, **kw)
    seen = ~np.isneginf(ref_lse)
    for rows in be.kernels.tile_heights(d):
        for parts, ctas in ((None, None), (2, None), (None, 3)):
            ctx = f"seed={seed} d={d} BM={rows} key splits {parts} CTAs {ctas}"
            be.kernels.forced_tile_height, be.kernels.forced_key_splits, be.kernels.max_ctas = rows, parts, ctas
            try:
                o = cupy.zeros((2, q_len, 16, d), cupy.float32)
                lse = cupy.full((2, 16, q_len), -cupy.inf, cupy.float32)
                be.forward_block(*(cupy.asarray(x) for x in (q, k, v)), o, lse, scale=d ** -0.5, masked=True,
                                 q_start=q_start, k_start=k_start, mask=mask)
                cupy.cuda.get_current_stream().synchronize()
                assert cupy.asnumpy(be.kernels.tile_counter()).tolist() == [0, 0], ctx
                assert not cupy.asnumpy(be.kernels.tile_locks(1)).any(), ctx
            finally:
                be.kernels.forced_tile_height = be.kernels.forced_key_splits = be.kernels.max_ctas = None
            got_lse = cupy.asnumpy(lse)
            np.testing.assert_array_equal(np.isneginf(got_lse), ~seen, err_msg=ctx)
            assert seen.any() and np.abs(got_lse[seen] - ref_lse[seen]).max() < 1e-3, ctx
            assert _err(cupy.asnumpy(o), ref_o) < 2e-2, ctx


# documents of several tiles at offsets off every tile's grid: the sm90 backward's key blocks and query tiles start
# on them (plan/tiles.backward_tiles), some of a few keys or rows (1412-1421)
ALIGNED_DOCUMENTS = np.array([0, 300, 333, 900, 1421, 1500, 2100])


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("heads", [(2, 2), (16, 1)], ids=lambda h: f"h{h[0]}:{h[1]}")
def test_backward_blocks_and_tiles_from_document_starts(d, heads):
    """The backward under documents whose key blocks and query tiles start on them, off the grid (the host's
    layout checked first): short blocks and tiles, a tile's box reaching into the next tile's rows, a block's
    into the next block's keys. Against the oracle as one call (h2:2: one CTA holds a K/V head, dK and dV go
    straight to 16 bits; h16:1: the group split over CTAs, added in float32) and as a block pair of a longer
    sequence adding into poisoned float32 accumulators."""
    from burst_hpc.plan import tiles

    seed = int(np.random.SeedSequence().entropy % 2**63)
    rng = np.random.default_rng(seed)
    seqlen, cu, (hq, hkv) = int(ALIGNED_DOCUMENTS[-1]), ALIGNED_DOCUMENTS, heads
    mask = masks.make(seqlen, True, None, cu)
    bm, bn = (128, 128) if d == 64 else (64, 64) if d == 256 else (64, 128)   # the sm90 backward's tiles
    laid = tiles.backward_tiles(mask, 0, seqlen, 0, seqlen, bm, bn)
    assert 333 in laid.tile_first and 333 in laid.block_first and 1421 in laid.block_first
    kw = dict(causal=True, cu_seqlens=cu)
    q, k, v, do = (rng.standard_normal((1, seqlen, h, d)).astype(BF16) for h in (hq, hkv, hkv, hq))
    ctx = f"seed={seed} d={d} heads={heads}"
    o, lse = burst_hpc.attention(*(cupy.asarray(x) for x in (q, k, v)), **kw)
    plain = plain_attention(q, k, v, do, True, None, BF16, None, cu)
    grads = burst_hpc.attention_backward(*(cupy.asarray(x) for x in (do, q, k, v)), o, lse, **kw)
    for name, got, want, base in zip(("dq", "dk", "dv"), grads, attention_backward_reference(do, q, k, v, **kw),
                                     plain[2:]):
        floor = 3e-3 * max(1.0, float(np.abs(want).max()))
        assert _err(cupy.asnumpy(got), want) <= 3 * _err(base, want) + floor, f"{ctx} {name}"
    # a block pair: rows 333.. against keys 250.. (its key blocks start on 333 - 250 = 83 too)
    q0, sq, k0, sk = 333, 1500, 250, 1700
    pair = dict(causal=True, q_start=q0, k_start=k0, cu_seqlens=cu)
    qs, dos, ks, vs = q[:, q0:q0 + sq], do[:, q0:q0 + sq], k[:, k0:k0 + sk], v[:, k0:k0 + sk]
    ref_o, ref_lse = attention_reference(qs, ks, vs, **pair)
    delta = np.einsum("bshd,bshd->bhs", dos.astype(np.float64), ref_o).astype(np.float32)
    poison = [rng.standard_normal(x.shape).astype(np.float32) for x in (qs, ks, vs)]
    acc = [cupy.asarray(p.copy()) for p in poison]
    get_backend(cupy.zeros(1)).backward_block(
        *(cupy.asarray(np.ascontiguousarray(x)) for x in (qs, ks, vs, dos)),
        cupy.asarray(ref_lse.astype(np.float32)), cupy.asarray(delta), *acc, scale=d ** -0.5, masked=True,
        q_start=q0, k_start=k0, mask=mask)
    wants = attention_backward_reference(dos, qs, ks, vs, **pair)
    for name, got, p, want in zip(("dq", "dk", "dv"), acc, poison, wants):
        assert _err(cupy.asnumpy(got) - p, want) < 5e-2 * max(1.0, float(np.abs(want).max())), f"{ctx} pair {name}"


BLOCK_SETS = {  # seqlen, documents, window, (q_start, q_len, k_start, k_len) pairs
    "short documents, window": (2048, 7, (300, 0), ((1024, 512, 640, 512), (1500, 300, 0, 1600), (300, 200, 600, 128))),
    "long documents": (4096, 4, None, ((1100, 1500, 333, 2000), (2500, 1596, 0, 4096), (77, 900, 50, 1000))),
}


@pytest.mark.parametrize("blocks", BLOCK_SETS)
def test_blocks_of_a_longer_sequence_and_rows_that_see_nothing(blocks):
    """A (query block, key block) pair cut from a packed sequence, as the ring runs it: rows that see nothing
    keep o = 0, lse = -inf (no NaN); the rest match the oracle; gradients add into the poisoned accumulators."""
    seed = int(np.random.SeedSequence().entropy % 2**63)
    rng = np.random.default_rng(seed)
    (seqlen, count, window, pairs), d = BLOCK_SETS[blocks], 128
    cu = documents(rng, seqlen, count)
    mask = masks.make(seqlen, True, window, cu)
    be = get_backend(cupy.zeros(1))
    for q_start, q_len, k_start, k_len in pairs:
        q, do = (rng.standard_normal((1, q_len, 4, d)).astype(BF16) for _ in range(2))
        k, v = (rng.standard_normal((1, k_len, 2, d)).astype(BF16) for _ in range(2))
        o = cupy.zeros((1, q_len, 4, d), cupy.float32)
        lse = cupy.full((1, 4, q_len), -cupy.inf, cupy.float32)
        be.forward_block(*(cupy.asarray(x) for x in (q, k, v)), o, lse, scale=d ** -0.5, masked=True,
                         q_start=q_start, k_start=k_start, mask=mask)
        kw = dict(causal=True, q_start=q_start, k_start=k_start, window=window, cu_seqlens=cu)
        ref_o, ref_lse = attention_reference(q, k, v, **kw)
        ctx = f"seed={seed} rows {q_start}+{q_len} keys {k_start}+{k_len}"
        got_lse = cupy.asnumpy(lse)
        np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(ref_lse), err_msg=ctx)
        assert not np.isnan(cupy.asnumpy(o)).any(), ctx
        assert _err(cupy.asnumpy(o), ref_o) < 2e-2, ctx
        # backward of the same pair with the oracle's lse (what a finished forward leaves)
        delta = np.einsum("bshd,bshd->bhs", do.astype(np.float64), ref_o).astype(np.float32)
        poison = [rng.standard_normal(s).astype(np.float32) for s in ((1, q_len, 4, d), (1, k_len, 2, d), (1, k_len, 2, d))]
        acc = [cupy.asarray(p.copy()) for p in poison]
        be.backward_block(*(cupy.asarray(x) for x in (q, k, v, do)), cupy.asarray(ref_lse.astype(np.float32)),
                          cupy.asarray(delta), *acc, scale=d ** -0.5, masked=True, q_start=q_start, k_start=k_start,
                          mask=mask)
        for name, got, p, want in zip(("dq", "dk", "dv"), acc, poison,
                                      attention_backward_reference(do, q, k, v, **kw)):
            assert _err(cupy.asnumpy(got) - p, want) < 5e-2 * max(1.0, float(np.abs(want).max())), f"{ctx} {name}"


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "documents"])
def test_dq_out_at_a_last_pair_whose_first_rows_see_nothing(d, docs):
    """dq_out, dk_out, dv_out written at a last pair: a block pair whose first query rows see none of its keys
    (dq_out zero there, or what earlier pairs left), against the oracle; the same shapes again on other inputs (a
    kept launch); and a last pair that is not the first, adding to what an earlier pair left in the float32
    accumulator."""
    seed = int(np.random.SeedSequence().entropy % 2**63)
    rng = np.random.default_rng(seed)
    seqlen, hq, hkv = 1300, 4, 2
    cu = documents(rng, seqlen, 6) if docs else None
    mask = masks.make(seqlen, True, None, cu)
    q0, sq, k0, sk = 100, 1111, 400, 777   # rows 100..399 see no key of the block
    kw = dict(causal=True, q_start=q0, k_start=k0, cu_seqlens=cu)
    be = get_backend(cupy.zeros(1))
    for call in range(3):
        q, do = (rng.standard_normal((1, sq, hq, d)).astype(BF16) for _ in range(2))
        k, v = (rng.standard_normal((1, sk, hkv, d)).astype(BF16) for _ in range(2))
        ref_o, ref_lse = attention_reference(q, k, v, **kw)
        delta = np.einsum("bshd,bshd->bhs", do.astype(np.float64), ref_o).astype(np.float32)
        earlier = rng.standard_normal(q.shape).astype(np.float32) if call == 2 else np.zeros(q.shape, np.float32)
        dq_out, dk_out, dv_out = (cupy.full(x.shape, 7, BF16) for x in (q, k, v))
        be.backward_block(*(cupy.asarray(x) for x in (q, k, v, do)), cupy.asarray(ref_lse.astype(np.float32)),
                          cupy.asarray(delta), cupy.asarray(earlier) if call == 2 else None, None, None,
                          scale=d ** -0.5, masked=True, mask=mask, q_start=q0, k_start=k0, first_q=call < 2,
                          first_kv=True, dq_out=dq_out, dk_out=dk_out, dv_out=dv_out)
        ctx = f"seed={seed} d={d} call={call}"
        wants = attention_backward_reference(do, q, k, v, **kw)
        got = cupy.asnumpy(dq_out).astype(np.float64)
        want = earlier + wants[0]
        np.testing.assert_array_equal(got[:, :k0 - q0], earlier[:, :k0 - q0].astype(BF16).astype(np.float64),
                                      err_msg=ctx)
        assert _err(got, want) < 3e-2 * max(1.0, float(np.abs(want).max())), ctx
        for name, out, want in zip(("dk", "dv"), (dk_out, dv_out), wants[1:]):
            assert _err(cupy.asnumpy(out), want) < 3e-2 * max(1.0, float(np.abs(want).max())), f"{ctx} {name}"
