"""The NumPy block backend (DESIGN.md layer 5) against the float64 oracle.

Each test draws its block lengths and offsets from the per-run seed, so the shapes vary from
run to run (S is almost never a multiple of the tile); the seed and the shapes are in every
failure message.
"""
import numpy as np
import pytest

from burst_hpc.backends import get_backend
from burst_hpc.backends.numpy_backend import NumpyBackend
from burst_hpc.dtypes import accum_dtype
from burst_hpc.plan.layout import make_layout
from burst_hpc.reference import attention_backward_reference, attention_reference

from burst_testing import (BF16, DTYPE_IDS, DTYPES, FLOOR, FP32, FP64, assert_lse_close, assert_rule, f64, max_err,
                      plain_backward, plain_forward, plain_mask, qkv, randn)

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

HEADS = [(8, 1), (8, 2), (4, 4)]
HEAD_IDS = ["gqa8", "gqa4", "mha"]
TILES = [(16, 32), (48, 16), (128, 128)]
TILE_IDS = ["t16x32", "t48x16", "t128"]


def _blocks(rng, causal):
    """Random (Sq, Sk, q_start, k_start): lengths of different sizes, offsets that put the causal
    diagonal somewhere inside the block pair (rows that see nothing included now and then)."""
    sq, sk = (int(x) for x in rng.integers(20, 100, size=2))
    if not causal:
        return sq, sk, int(rng.integers(0, 200)), int(rng.integers(0, 200))
    q_start = int(rng.integers(0, 150))
    k_start = max(0, q_start + int(rng.integers(-sk + 1, sq // 2)))
    return sq, sk, q_start, k_start


def _empty_acc(be, b, s, h, d, dtype):
    acc = accum_dtype(dtype)
    return np.zeros((b, s, h, d), acc), np.full((b, h, s), -np.inf, acc)


def _fwd(be, q, k, v, scale, causal, q_start, k_start):
    o, lse = _empty_acc(be, q.shape[0], q.shape[1], q.shape[2], q.shape[3], q.dtype)
    be.forward_block(q, k, v, o, lse, scale=scale, **plain_mask(causal), q_start=q_start, k_start=k_start)
    return o, lse


def _check_forward(o, lse, q, k, v, scale, causal, q_start, k_start, ctx):
    ref_o, ref_lse = attention_reference(q, k, v, causal=causal, scale=scale, q_start=q_start, k_start=k_start)
    pl_o, pl_lse = plain_forward(q, k, v, causal=causal, scale=scale, q_start=q_start, k_start=k_start)
    dtype = np.dtype(q.dtype)
    assert o.dtype == accum_dtype(dtype) and lse.dtype == accum_dtype(dtype), ctx
    assert_rule("o", o, ref_o, pl_o, dtype, ctx)
    finite = ~np.isneginf(ref_lse)
    lse_tol = 2 * (max_err(pl_lse[finite], ref_lse[finite]) if finite.any() else 0) + FLOOR[dtype] * max(
        1.0, float(np.abs(ref_lse[finite]).max()) if finite.any() else 1.0)
    assert_lse_close(lse, ref_lse, lse_tol, ctx)


def block_cases(test):
    """Every dtype x head layout x head dim x mask x tile size."""
    for name, values, ids in [("dtype", DTYPES, DTYPE_IDS), ("heads", HEADS, HEAD_IDS), ("d", [64, 128], None),
                              ("causal", [False, True], ["full", "causal"]), ("tiles", TILES, TILE_IDS)]:
        test = pytest.mark.parametrize(name, values, ids=ids)(test)
    return test


def _block_case(rng, seed, dtype, heads, d, causal, tiles):
    """Random block pair: (q, k, v, q_start, k_start, context string for failures)."""
    hq, hkv = heads
    sq, sk, q_start, k_start = _blocks(rng, causal)
    ctx = f"seed={seed} {dtype} Sq={sq} Sk={sk} H={hq}:{hkv} D={d} causal={causal} q_start={q_start} " \
          f"k_start={k_start} tiles={tiles}"
    q, k, v = qkv(rng, 2, sq, sk, hq, hkv, d, dtype)
    return q, k, v, q_start, k_start, ctx


@block_cases
def test_forward_block_matches_oracle(dtype, heads, d, causal, tiles, rng, seed):
    q, k, v, q_start, k_start, ctx = _block_case(rng, seed, dtype, heads, d, causal, tiles)
    scale = d ** -0.5
    be = NumpyBackend(*tiles)
    o, lse = _fwd(be, q, k, v, scale, causal, q_start, k_start)
    _check_forward(o, lse, q, k, v, scale, causal, q_start, k_start, ctx)


@block_cases
def test_backward_block_matches_oracle(dtype, heads, d, causal, tiles, rng, seed):
    q, k, v, q_start, k_start, ctx = _block_case(rng, seed, dtype, heads, d, causal, tiles)
    hq, sq = q.shape[2], q.shape[1]
    do = randn(rng, q.shape, dtype)
    scale = d ** -0.5
    be = NumpyBackend(*tiles)
    o, lse = _fwd(be, q, k, v, scale, causal, q_start, k_start)
    # what the API / ring hand over: o in the input dtype, lse in float32
    o_in, lse_in = o.astype(dtype), lse.astype(np.float32)
    delta = be.delta(do, o_in)
    acc = accum_dtype(dtype)
    assert delta.dtype == acc and delta.shape == (2, hq, sq), ctx
    np.testing.assert_allclose(delta, np.einsum("bshd,bshd->bhs", f64(do), f64(o_in)), rtol=1e-5, atol=1e-5,
                               err_msg=ctx)
    dq, dk, dv = np.zeros(q.shape, acc), np.zeros(k.shape, acc), np.zeros(v.shape, acc)
    be.backward_block(q, k, v, do, lse_in, delta, dq, dk, dv, scale=scale, **plain_mask(causal), q_start=q_start,
                      k_start=k_start)
    ref = attention_backward_reference(do, q, k, v, causal=causal, scale=scale, q_start=q_start, k_start=k_start)
    plain = plain_backward(do, q, k, v, causal=causal, scale=scale, q_start=q_start, k_start=k_start)
    # float64 inputs: lse is handed over in float32 (DESIGN.md), which bounds the accuracy to ~1e-7 relative
    floor = 1e-6 if dtype == FP64 else None
    for name, g, r, p in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, plain):
        assert g.dtype == acc, ctx
        assert_rule(name, g, r, p, dtype, ctx, floor=floor)


def test_backward_block_with_float64_lse_is_tight(rng, seed):
    """With lse kept in the float64 accumulator the float64 path is exact to rounding."""
    q, k, v = qkv(rng, 2, 37, 53, 8, 2, 64, FP64)
    do = randn(rng, q.shape, FP64)
    be = NumpyBackend(16, 16)
    o, lse = _fwd(be, q, k, v, 0.125, True, 20, 10)
    dq, dk, dv = (np.zeros(x.shape) for x in (q, k, v))
    be.backward_block(q, k, v, do, lse, be.delta(do, o), dq, dk, dv, scale=0.125, **plain_mask(True), q_start=20,
                      k_start=10)
    ref = attention_backward_reference(do, q, k, v, causal=True, scale=0.125, q_start=20, k_start=10)
    for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-12, err_msg=f"seed={seed} {name}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_key_blocks_merge_into_running_result(dtype, causal, rng, seed):
    """Forward over 2-3 key blocks (with k_start offsets), in random order, merged into a running
    (o, lse) that is already non-empty, equals one pass over all keys; the backward accumulates
    dq over key blocks and dk, dv over query blocks."""
    hq, hkv, d = 8, 2, 64
    sq = int(rng.integers(40, 90))
    sk = sq if causal else int(rng.integers(40, 90))
    n_parts = int(rng.integers(2, 4))
    cuts = [0] + sorted(int(c) for c in rng.choice(np.arange(1, sk), n_parts - 1, replace=False)) + [sk]
    order = rng.permutation(n_parts)
    ctx = f"seed={seed} {dtype} Sq={sq} Sk={sk} causal={causal} cuts={cuts} order={order.tolist()}"
    q, k, v = qkv(rng, 2, sq, sk, hq, hkv, d, dtype)
    do = randn(rng, q.shape, dtype)
    be = NumpyBackend(int(rng.choice([16, 32])), int(rng.choice([16, 32])))
    o, lse = _empty_acc(be, 2, sq, hq, d, dtype)
    for part in order:
        k0, k1 = cuts[part], cuts[part + 1]
        be.forward_block(q, k[:, k0:k1], v[:, k0:k1], o, lse, scale=d ** -0.5, **plain_mask(causal), q_start=0,
                         k_start=k0)
    _check_forward(o, lse, q, k, v, d ** -0.5, causal, 0, 0, ctx)

    o_in, lse_in = o.astype(dtype), lse.astype(np.float32)
    delta = be.delta(do, o_in)
    acc = accum_dtype(dtype)
    dq, dk, dv = np.zeros(q.shape, acc), np.zeros(k.shape, acc), np.zeros(v.shape, acc)
    q_cut = int(rng.integers(1, sq))
    for part in order:
        k0, k1 = cuts[part], cuts[part + 1]
        for q0, q1 in ((q_cut, sq), (0, q_cut)):
            be.backward_block(q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], do[:, q0:q1], lse_in[:, :, q0:q1],
                              delta[:, :, q0:q1], dq[:, q0:q1], dk[:, k0:k1], dv[:, k0:k1], scale=d ** -0.5,
                              **plain_mask(causal), q_start=q0, k_start=k0)
    ref = attention_backward_reference(do, q, k, v, causal=causal, scale=d ** -0.5)
    plain = plain_backward(do, q, k, v, causal=causal, scale=d ** -0.5)
    floor = 1e-6 if dtype == FP64 else None
    for name, g, r, p in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, plain):
        assert_rule(name, g, r, p, dtype, ctx + f" q_cut={q_cut}", floor=floor)


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_zigzag_halves_and_strided_views(dtype, rng, seed):
    """One rank of a P-rank zigzag layout, simulated in one process: the rank's queries are two
    strided views of the global q; its o/lse/dq accumulators are used half by half through views;
    each key chunk of the global sequence is a view; the result equals the oracle's rows."""
    size = int(rng.integers(2, 4))
    rank = int(rng.integers(0, size))
    chunk = int(rng.integers(9, 20))
    s, hq, hkv, d = 2 * size * chunk, 8, 2, 64
    ctx = f"seed={seed} {dtype} P={size} rank={rank} chunk={chunk}"
    # the global inputs live inside bigger arrays, so every operand is a non-contiguous view
    big = randn(rng, (2, s + 7, hq + 3, d), dtype)
    q = big[:, 5:5 + s, 1:1 + hq]
    k = randn(rng, (2, 2 * s, hkv, d), dtype)[:, ::2]
    v = np.ascontiguousarray(randn(rng, (2, hkv, s, d), dtype)).transpose(0, 2, 1, 3)
    do = randn(rng, (2, s, hq, d), dtype)
    assert not q.flags.c_contiguous and not k.flags.c_contiguous and not v.flags.c_contiguous
    be = NumpyBackend(int(rng.choice([16, 32])), int(rng.choice([16, 48])))
    acc = accum_dtype(dtype)
    n = 2 * chunk
    sentinel = 12345.0
    o = np.full((2, n + 3, hq, d), sentinel, acc)[:, 1:1 + n]  # guard rows on both sides
    o[...] = 0
    lse = np.full((2, hq, n), -np.inf, acc)
    zigzag = make_layout("zigzag", s, size)
    runs = zigzag.pieces(rank)
    for t in range(size):  # key chunks in ring order, both halves of the owning rank
        for k0, kn in zigzag.pieces((rank - t) % size):
            offset = 0
            for q0, qn in runs:
                be.forward_block(q[:, q0:q0 + qn], k[:, k0:k0 + kn], v[:, k0:k0 + kn], o[:, offset:offset + qn],
                                 lse[:, :, offset:offset + qn], scale=d ** -0.5, **plain_mask(True), q_start=q0,
                                 k_start=k0)
                offset += qn
    base = o.base
    assert np.all(base[:, 0] == sentinel) and np.all(base[:, n + 1:] == sentinel), ctx + ": wrote outside the view"
    rows = np.concatenate([np.arange(a, a + m) for a, m in runs])
    ref_o, ref_lse = attention_reference(q, k, v, causal=True, scale=d ** -0.5)
    pl_o, _ = plain_forward(q, k, v, causal=True, scale=d ** -0.5)
    assert_rule("o", o, ref_o[:, rows], pl_o[:, rows], dtype, ctx)
    assert_lse_close(lse, ref_lse[:, :, rows], 1e-4, ctx)

    # backward: this rank's dq (two halves) and its contribution to every key chunk's dk, dv
    o_in, lse_in = o.astype(dtype), lse.astype(np.float32)
    do_r = do[:, rows]
    delta = be.delta(do_r, o_in)
    dq = np.zeros((2, n, hq, d), acc)
    dk, dv = np.zeros(k.shape, acc), np.zeros(v.shape, acc)
    for t in range(size):
        for k0, kn in zigzag.pieces((rank + t) % size):
            offset = 0
            for q0, qn in runs:
                sl = slice(offset, offset + qn)
                be.backward_block(q[:, q0:q0 + qn], k[:, k0:k0 + kn], v[:, k0:k0 + kn], do_r[:, sl], lse_in[:, :, sl],
                                  delta[:, :, sl], dq[:, sl], dk[:, k0:k0 + kn], dv[:, k0:k0 + kn],
                                  scale=d ** -0.5, **plain_mask(True), q_start=q0, k_start=k0)
                offset += qn
    # the oracle on the rank's rows only (do = 0 elsewhere) gives this rank's share of dk, dv
    do_only = np.zeros(do.shape, np.float64)
    do_only[:, rows] = f64(do_r)
    ref = attention_backward_reference(do_only, q, k, v, causal=True, scale=d ** -0.5)
    plain = plain_backward(do_only.astype(dtype), q, k, v, causal=True, scale=d ** -0.5)
    assert_rule("dq", dq, ref[0][:, rows], plain[0][:, rows], dtype, ctx)
    assert_rule("dk", dk, ref[1], plain[1], dtype, ctx)
    assert_rule("dv", dv, ref[2], plain[2], dtype, ctx)


def test_hidden_key_block_is_a_no_op(rng, seed):
    """Keys wholly after every query leave (o, lse) and the gradients exactly as they were."""
    q, k, v = qkv(rng, 2, 20, 30, 4, 2, 64, FP32)
    be = NumpyBackend(16, 16)
    o = randn(rng, q.shape, FP32)
    lse = randn(rng, (2, 4, 20), FP32)
    o0, lse0 = o.copy(), lse.copy()
    be.forward_block(q, k, v, o, lse, scale=0.1, **plain_mask(True), q_start=100, k_start=120)
    np.testing.assert_array_equal(o, o0, err_msg=f"seed={seed}")
    np.testing.assert_array_equal(lse, lse0, err_msg=f"seed={seed}")
    dq, dk, dv = (randn(rng, x.shape, FP32) for x in (q, k, v))
    saved = [x.copy() for x in (dq, dk, dv)]
    do = randn(rng, q.shape, FP32)
    be.backward_block(q, k, v, do, lse, be.delta(do, o), dq, dk, dv, scale=0.1, **plain_mask(True), q_start=100,
                      k_start=120)
    for got, want in zip((dq, dk, dv), saved):
        np.testing.assert_array_equal(got, want, err_msg=f"seed={seed}")


def test_rows_that_see_nothing_and_large_scores(rng, seed):
    """Causal block whose first rows see no key, with large logits: o = 0 and lse = -inf on
    those rows, no NaN, no overflow warning (RuntimeWarning is an error here) in either pass."""
    hq, hkv, d = 4, 2, 64
    q, k, v = qkv(rng, 2, 40, 40, hq, hkv, d, FP32, scale=6.0)  # logits ~ 36 * N(0, 1): exp overflows float32 if unmasked
    do = randn(rng, q.shape, FP32)
    be = NumpyBackend(16, 16)
    o, lse = _fwd(be, q, k, v, d ** -0.5, True, 0, 10)
    ctx = f"seed={seed}"
    assert np.all(o[:, :10] == 0) and np.all(np.isneginf(lse[:, :, :10])), ctx
    _check_forward(o, lse, q, k, v, d ** -0.5, True, 0, 10, ctx)
    dq, dk, dv = (np.zeros(x.shape, np.float32) for x in (q, k, v))
    be.backward_block(q, k, v, do, lse, be.delta(do, o), dq, dk, dv, scale=d ** -0.5, **plain_mask(True), q_start=0,
                      k_start=10)
    assert np.all(dq[:, :10] == 0), ctx
    ref = attention_backward_reference(do, q, k, v, causal=True, scale=d ** -0.5, k_start=10)
    for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        assert np.isfinite(g).all(), f"{ctx} {name}"
        scale = max(1.0, np.abs(r).max())
        assert max_err(g, r) <= 1e-4 * scale, f"{ctx} {name}: {max_err(g, r):.3e}"


def test_empty_key_block(rng, seed):
    q, k, v = qkv(rng, 1, 9, 0, 4, 1, 64, FP32)
    be = NumpyBackend(16, 16)
    o, lse = _fwd(be, q, k, v, 0.125, False, 0, 0)
    assert np.all(o == 0) and np.all(np.isneginf(lse)), f"seed={seed}"


def test_get_backend_defaults_to_numpy():
    be = get_backend(np.zeros(1))
    assert isinstance(be, NumpyBackend) and be.xp is np


# ---- the block contract's first / last flags (backends/__init__.py) ---------------------------------------
def test_first_and_last_pairs_of_a_block_grid(rng, seed):
    """Key blocks in turn over two query blocks, as a pass visits them: each accumulator's first pair ignores
    what it held (NaN poison), its last writes the output in the inputs' dtype; the result is the oracle's."""
    b, s, hq, hkv, d = 1, 90, 4, 2, 16
    q, k, v, do = (randn(rng, (b, s, h, d), FP32) for h in (hq, hkv, hkv, hq))
    be = NumpyBackend(16, 32)
    cuts = (0, 37, s)
    blocks = [slice(a, z) for a, z in zip(cuts, cuts[1:])]
    o, lse = np.full(q.shape, np.nan, FP32), np.full((b, hq, s), np.nan, FP32)
    out = np.full(q.shape, np.nan, FP32)
    for qb in blocks:
        for j, kb in enumerate(blocks):
            be.forward_block(q[:, qb], k[:, kb], v[:, kb], o[:, qb], lse[:, :, qb], scale=d ** -0.5, **plain_mask(True),
                             q_start=qb.start, k_start=kb.start, first=j == 0,
                             out=out[:, qb] if j == len(blocks) - 1 else None)
    ref_o, ref_lse = attention_reference(*(f64(x) for x in (q, k, v)), causal=True)
    assert max_err(out, ref_o) < 1e-5 and max_err(lse, ref_lse) < 1e-5, f"seed {seed}"
    grads = [np.full(x.shape, np.nan, FP32) for x in (q, k, v)]
    outs = [np.full(x.shape, np.nan, FP32) for x in (q, k, v)]
    last = len(blocks) - 1
    for i, qb in enumerate(blocks):
        for j, kb in enumerate(blocks):
            be.backward_block(q[:, qb], k[:, kb], v[:, kb], do[:, qb], lse[:, :, qb], None, grads[0][:, qb],
                              grads[1][:, kb], grads[2][:, kb], scale=d ** -0.5, **plain_mask(True), q_start=qb.start,
                              k_start=kb.start, o=out[:, qb], first_q=j == 0, first_kv=i == 0,
                              dq_out=outs[0][:, qb] if j == last else None,
                              dk_out=outs[1][:, kb] if i == last else None,
                              dv_out=outs[2][:, kb] if i == last else None)
    ref = attention_backward_reference(*(f64(x) for x in (do, q, k, v)), causal=True)
    for got, want in zip(outs, ref):
        assert max_err(got, want) < 1e-4 * max(1.0, np.abs(want).max()), f"seed {seed}"


def test_one_pair_needs_no_accumulators(rng):
    """A pair that is the first and the last takes None accumulators and writes its outputs in their dtype;
    a None accumulator anywhere else is refused."""
    from burst_hpc.errors import BackendError

    b, s, h, d = 1, 40, 2, 8
    q, k, v, do = (randn(rng, (b, s, h, d), BF16) for _ in range(4))
    be = NumpyBackend(16, 16)
    o, lse = np.empty(q.shape, BF16), np.empty((b, h, s), FP32)
    be.forward_block(q, k, v, None, lse, scale=0.3, **plain_mask(True), first=True, out=o)
    ref_o, _ = attention_reference(*(f64(x) for x in (q, k, v)), causal=True, scale=0.3)
    assert o.dtype == BF16 and max_err(o, ref_o) < 2e-2
    outs = [np.empty(x.shape, BF16) for x in (q, k, v)]
    be.backward_block(q, k, v, do, lse, None, None, None, None, scale=0.3, **plain_mask(True), o=o, first_q=True,
                      first_kv=True, dq_out=outs[0], dk_out=outs[1], dv_out=outs[2])
    ref = attention_backward_reference(*(f64(x) for x in (do, q, k, v)), causal=True, scale=0.3)
    for got, want in zip(outs, ref):
        assert max_err(got, want) < 5e-2 * max(1.0, np.abs(want).max())
    with pytest.raises(BackendError, match="first and the last"):
        be.forward_block(q, k, v, None, lse, scale=0.3, **plain_mask(True), out=o)
    with pytest.raises(BackendError, match="delta or o"):
        be.backward_block(q, k, v, do, lse, None, *outs, scale=0.3, **plain_mask(True))


def test_rows_sum_adds_each_rows_partials_to_its_own_slot(rng):
    """rows_sum: a row's own slot plus every partial listed for it (none, one, several; a batch of 2 where a
    partial of batch b sits ``step`` rows after batch 0's), converted once into out's dtype."""
    batch, keys, rows = 2, 9, 5
    src = rng.standard_normal((batch, keys, 3)).astype(FP32)
    parts = rng.standard_normal((12, 3)).astype(FP32)
    own = np.array([8, 0, 3, 4, 1])
    # row 0: none; row 1: partial rows 0 and 6 (step 3 and 2); row 2: none; row 3: 2 (step 3); row 4: 7 (step 2)
    ptr = np.array([0, 0, 2, 2, 3, 4], np.int32)
    at, step = np.array([0, 6, 2, 7]), np.array([3, 2, 3, 2], np.int32)
    out = np.empty((batch, rows, 3), BF16)
    NumpyBackend().rows_sum(src, own, ptr, at, step, parts, out)
    want = src[:, own].astype(FP64)
    for b in range(batch):
        want[b, 1] += parts[0 + 3 * b] + parts[6 + 2 * b]
        want[b, 3] += parts[2 + 3 * b]
        want[b, 4] += parts[7 + 2 * b]
    assert out.dtype == BF16 and max_err(out, want) <= 2.0 ** -7 * np.abs(want).max()


def test_rows_copy_moves_the_listed_rows_and_no_other(rng):
    """rows_copy: dst[:, dst_rows] = src[:, src_rows], an index None meaning the first rows in order."""
    src = rng.standard_normal((2, 6, 3)).astype(FP32)
    be = NumpyBackend()
    dst = np.zeros((2, 4, 3), FP32)
    be.rows_copy(src, np.array([5, 0, 2]), dst, None)
    assert np.array_equal(dst[:, :3], src[:, [5, 0, 2]]) and not dst[:, 3].any()
    dst = np.zeros((2, 8, 3), FP32)
    be.rows_copy(src, None, dst, np.array([7, 1]))
    assert np.array_equal(dst[:, [7, 1]], src[:, :2]) and not dst[:, [0, 2, 3, 4, 5, 6]].any()
    dst = np.zeros((2, 6, 3), FP32)
    be.rows_copy(src, None, dst, None)
    assert np.array_equal(dst, src)
