"""GAO merge: properties of merging partial (o, lse) results over disjoint key sets."""
import itertools

import numpy as np
import pytest

from burst_hpc.device import array_module
from burst_hpc.engine.merge import merge, merge_into, merge_weights
from burst_hpc.reference import attention_reference

from burst_testing import assert_lse_close, qkv

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


def _merge_all(parts, order, dtype):
    o, lse = parts[order[0]]
    o, lse = o.astype(dtype), lse.astype(dtype)
    for i in order[1:]:
        o, lse = merge(o, lse, parts[i][0].astype(dtype), parts[i][1].astype(dtype))
    return o, lse


@pytest.mark.parametrize("n_parts", [2, 3])
def test_any_split_of_the_keys_in_any_order_equals_the_whole(n_parts, rng, seed):
    """Keys dealt at random (not contiguously) into n parts; every merge order gives the whole."""
    b, sq, sk, hq, hkv, d = 2, int(rng.integers(5, 30)), int(rng.integers(10, 40)), 4, 2, 16
    q, k, v = qkv(rng, b, sq, sk, hq, hkv, d, scale=1.5)
    owner = rng.integers(0, n_parts, sk)
    owner[:n_parts] = rng.permutation(n_parts)  # no part is empty
    parts = []
    for i in range(n_parts):
        idx = np.flatnonzero(owner == i)
        parts.append(attention_reference(q, k[:, idx], v[:, idx]))
    ref_o, ref_lse = attention_reference(q, k, v)
    for order in itertools.permutations(range(n_parts)):
        ctx = f"seed={seed} owner={owner.tolist()} order={order}"
        o, lse = _merge_all(parts, order, np.float64)
        assert o.dtype == np.float64 and lse.dtype == np.float64, ctx
        np.testing.assert_allclose(o, ref_o, rtol=1e-12, atol=1e-13, err_msg=ctx)
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-13, atol=1e-13, err_msg=ctx)
        o32, lse32 = _merge_all(parts, order, np.float32)
        assert o32.dtype == np.float32 and lse32.dtype == np.float32, ctx
        np.testing.assert_allclose(o32, ref_o, rtol=1e-5, atol=2e-6, err_msg=ctx)
        np.testing.assert_allclose(lse32, ref_lse, rtol=1e-6, atol=2e-6, err_msg=ctx)


@pytest.mark.parametrize("n_parts", [2, 3])
def test_causal_key_blocks_merge_in_place(n_parts, rng, seed):
    """Contiguous causal key blocks (k_start offsets): early rows see nothing in the later blocks,
    so -inf rows meet finite rows; merge_into on views of a bigger accumulator gives the whole."""
    s, hq, hkv, d = int(rng.integers(12, 40)), 4, 1, 8
    q, k, v = qkv(rng, 2, s, s, hq, hkv, d)
    cuts = [0] + sorted(int(c) for c in rng.choice(np.arange(1, s), n_parts - 1, replace=False)) + [s]
    order = rng.permutation(n_parts)
    ctx = f"seed={seed} S={s} cuts={cuts} order={order.tolist()}"
    o_buf = np.zeros((2, s + 4, hq, d), np.float32)
    lse_buf = np.full((2, hq, s + 4), -np.inf, np.float32)
    o, lse = o_buf[:, 2:2 + s], lse_buf[:, :, 2:2 + s]
    for i in order:
        k0, k1 = cuts[i], cuts[i + 1]
        o_p, lse_p = attention_reference(q, k[:, k0:k1], v[:, k0:k1], causal=True, k_start=k0)
        assert np.isneginf(lse_p[:, :, :k0]).all(), ctx
        merge_into(o, lse, o_p.astype(np.float32), lse_p.astype(np.float32))
    ref_o, ref_lse = attention_reference(q, k, v, causal=True)
    np.testing.assert_allclose(o, ref_o, rtol=1e-5, atol=2e-6, err_msg=ctx)
    assert_lse_close(lse, ref_lse, 1e-5, ctx)
    assert np.all(o_buf[:, :2] == 0) and np.all(o_buf[:, 2 + s:] == 0), ctx + ": wrote outside the view"
    assert np.isneginf(lse_buf[:, :, :2]).all() and np.isneginf(lse_buf[:, :, 2 + s:]).all(), ctx


def _parts(rng, shape=(2, 6, 3, 5)):
    b, s, h, d = shape
    return rng.standard_normal(shape), rng.standard_normal((b, h, s)), rng.standard_normal(shape), \
        rng.standard_normal((b, h, s))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_empty_rows(dtype, rng, seed):
    """lse = -inf on both sides gives o = 0, lse = -inf; on one side gives the other side."""
    o_a, lse_a, o_b, lse_b = (x.astype(dtype) for x in _parts(rng))
    ctx = f"seed={seed}"
    empty_a = rng.random(lse_a.shape) < 0.5
    empty_b = rng.random(lse_a.shape) < 0.5
    empty_a[0, 0, 0] = empty_b[0, 0, 0] = True        # at least one row empty on both sides
    empty_a[0, 0, 1], empty_b[0, 0, 1] = True, False  # ... and one on one side only
    lse_a[empty_a] = -np.inf
    lse_b[empty_b] = -np.inf
    # an empty part's o is 0 (that is what the backends produce)
    o_a[empty_a.transpose(0, 2, 1)] = 0
    o_b[empty_b.transpose(0, 2, 1)] = 0
    for (x, lx, y, ly, ex, ey) in ((o_a, lse_a, o_b, lse_b, empty_a, empty_b), (o_b, lse_b, o_a, lse_a, empty_b, empty_a)):
        o, lse = merge(x, lx, y, ly)
        assert o.dtype == dtype and lse.dtype == dtype, ctx
        assert not np.isnan(o).any() and not np.isnan(lse).any(), ctx
        both = ex & ey
        assert np.isneginf(lse[both]).all() and np.all(o.transpose(0, 2, 1, 3)[both] == 0), ctx
        only_y = ex & ~ey
        np.testing.assert_array_equal(lse[only_y], ly[only_y], err_msg=ctx)
        np.testing.assert_array_equal(o.transpose(0, 2, 1, 3)[only_y], y.transpose(0, 2, 1, 3)[only_y], err_msg=ctx)
        only_x = ~ex & ey
        np.testing.assert_array_equal(o.transpose(0, 2, 1, 3)[only_x], x.transpose(0, 2, 1, 3)[only_x], err_msg=ctx)
        assert np.isfinite(lse[~both]).all(), ctx
    _, w_a, w_b = merge_weights(lse_a, lse_b)
    assert np.all(w_a[empty_a] == 0) and np.all(w_b[empty_b] == 0), ctx


@pytest.mark.parametrize("gap", [1e4, -1e4, 3e4])
def test_huge_lse_differences(gap, rng, seed):
    """|lse_a - lse_b| ~ 1e4: the small side's weight is exactly 0, nothing overflows."""
    o_a, lse_a, o_b, lse_b = _parts(rng)
    lse_a = lse_a + gap
    ctx = f"seed={seed} gap={gap}"
    for dtype in (np.float64, np.float32):
        o, lse = merge(o_a.astype(dtype), lse_a.astype(dtype), o_b.astype(dtype), lse_b.astype(dtype))
        assert np.isfinite(o).all() and np.isfinite(lse).all(), ctx
        big_o, big_lse = (o_a, lse_a) if gap > 0 else (o_b, lse_b)
        np.testing.assert_allclose(o, big_o.astype(dtype), rtol=0, atol=0, err_msg=ctx)
        np.testing.assert_allclose(lse, big_lse.astype(dtype), rtol=0, atol=0, err_msg=ctx)


@pytest.mark.parametrize("base", [1e4, -1e4, 0.0])
def test_large_lse_with_close_parts(base, rng, seed):
    """Both lse near +-1e4 and close to each other: weights are the logistic of the gap."""
    o_a, lse_a, o_b, lse_b = _parts(rng)
    lse_a, lse_b = lse_a + base, lse_a + base + rng.uniform(-5, 5, lse_a.shape)
    o, lse = merge(o_a, lse_a, o_b, lse_b)
    w_a = 1.0 / (1.0 + np.exp(lse_b - lse_a))
    want_lse = np.maximum(lse_a, lse_b) + np.log1p(np.exp(-np.abs(lse_a - lse_b)))
    want_o = o_a * w_a.transpose(0, 2, 1)[..., None] + o_b * (1 - w_a).transpose(0, 2, 1)[..., None]
    ctx = f"seed={seed} base={base}"
    # lse = max + log1p(...) may cancel to near 0: its rounding is relative to the terms, not to the sum
    terms = np.abs(np.maximum(lse_a, lse_b)) + 1
    assert (np.abs(lse - want_lse) <= 1e-14 * terms).all(), f"{ctx}: {np.abs(lse - want_lse).max()}"
    # float64 lse near 1e4 carries ~2e-12 of rounding into the weights
    np.testing.assert_allclose(o, want_o, rtol=0, atol=1e-10, err_msg=ctx)
    o32, lse32 = merge(o_a.astype(np.float32), lse_a.astype(np.float32), o_b.astype(np.float32), lse_b.astype(np.float32))
    assert np.isfinite(o32).all() and np.isfinite(lse32).all(), ctx
    # float32 lse near 1e4 is only known to ~5e-4, so the weights are too
    np.testing.assert_allclose(o32, want_o, rtol=0, atol=5e-3 if base else 1e-5, err_msg=ctx)


def test_merge_is_symmetric_and_associative(rng, seed):
    o_a, lse_a, o_b, lse_b = _parts(rng)
    o_c, lse_c = rng.standard_normal(o_a.shape), rng.standard_normal(lse_a.shape)
    ab = merge(o_a, lse_a, o_b, lse_b)
    ba = merge(o_b, lse_b, o_a, lse_a)
    np.testing.assert_allclose(ab[0], ba[0], rtol=1e-14, atol=1e-15, err_msg=f"seed={seed}")
    np.testing.assert_array_equal(ab[1], ba[1], err_msg=f"seed={seed}")
    left = merge(*ab, o_c, lse_c)
    right = merge(o_a, lse_a, *merge(o_b, lse_b, o_c, lse_c))
    np.testing.assert_allclose(left[0], right[0], rtol=1e-13, atol=1e-14, err_msg=f"seed={seed}")
    np.testing.assert_allclose(left[1], right[1], rtol=1e-14, atol=1e-14, err_msg=f"seed={seed}")


def test_array_module_is_numpy_for_numpy_arrays():
    assert array_module(np.zeros(3)) is np


def test_an_empty_part_is_ignored_whatever_its_o_holds(rng):
    """A running o never written (lse = -inf) may hold NaN: the merge takes the other part's o there,
    as the CUDA kernels do; a part with a finite lse keeps its NaN (non-finite inputs propagate)."""
    b, s, h, d = 1, 6, 2, 4
    o_new = rng.standard_normal((b, s, h, d))
    lse_new = rng.standard_normal((b, h, s))
    o_old = np.full((b, s, h, d), np.nan)
    lse_old = np.full((b, h, s), -np.inf)
    lse_old[:, :, 0] = 0.0  # row 0 had a part: its NaN o must stay NaN
    o, lse = merge(o_old, lse_old, o_new, lse_new)
    assert np.isnan(o[:, 0]).all()
    np.testing.assert_array_equal(o[:, 1:], o_new[:, 1:])
    np.testing.assert_array_equal(lse[:, :, 1:], lse_new[:, :, 1:])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_nan_part_stays_nan_through_every_merge(dtype, rng, seed):
    """A NaN lse (a part whose rows saw a NaN or Inf input) is not "empty": merged with a finite part, an
    empty part (-inf) or another NaN part, in any order and through later merges, lse and o stay NaN
    there; rows with no NaN part merge as usual; two empty parts still give o = 0, lse = -inf."""
    parts = [tuple(x.astype(dtype) for x in _parts(rng)[:2]) for _ in range(3)]
    nan_row = rng.random(parts[0][1].shape) < 0.3
    empty = rng.random(parts[0][1].shape) < 0.3
    owner = rng.integers(0, 3, nan_row.shape)  # the part that holds each NaN row
    nan_row[0, 0, 0], empty[0, 0, 0] = True, True   # NaN meets empty somewhere,
    nan_row[0, 0, 1], empty[0, 0, 1] = False, True  # two empty rows meet somewhere else
    for i, (o, lse) in enumerate(parts):
        lse[empty & ~(nan_row & (owner == i))] = -np.inf
        o[(empty & ~(nan_row & (owner == i))).transpose(0, 2, 1)] = rng.choice([0.0, np.nan])  # empty: o ignored
        lse[nan_row & (owner == i)] = np.nan
        o[(nan_row & (owner == i)).transpose(0, 2, 1)] = np.nan
    clean = [(o.copy(), lse.copy()) for o, lse in parts]
    for o, lse in clean:  # the same parts with the NaN rows empty: what the other rows must give
        lse[nan_row] = -np.inf
    for order in itertools.permutations(range(3)):
        ctx = f"seed={seed} order={order}"
        o, lse = _merge_all(parts, order, dtype)
        o_clean, lse_clean = _merge_all(clean, order, dtype)
        rows = nan_row.transpose(0, 2, 1)
        assert np.isnan(lse[nan_row]).all() and np.isnan(o[rows]).all(), ctx
        np.testing.assert_array_equal(lse[~nan_row], lse_clean[~nan_row], err_msg=ctx)
        np.testing.assert_array_equal(o[~rows], o_clean[~rows], err_msg=ctx)
        both_empty = empty & ~nan_row
        assert np.isneginf(lse[both_empty]).all() and np.all(o[both_empty.transpose(0, 2, 1)] == 0), ctx
        assert not np.isnan(o[~rows]).any() and not np.isnan(lse[~nan_row]).any(), ctx


def test_merge_into_keeps_a_running_nan(rng, seed):
    """merge_into, in place: a running NaN row stays NaN when a finite part arrives, a NaN part makes a
    finite running row NaN, and an empty part changes nothing (the kernels' epilogue follows the same rule)."""
    o, lse, o_b, lse_b = _parts(rng)
    lse[:, :, 0], o[:, 0] = np.nan, np.nan  # running NaN, finite part
    lse_b[:, :, 1], o_b[:, 1] = np.nan, np.nan  # finite running, NaN part
    lse_b[:, :, 2] = -np.inf  # empty part
    before = o[:, 2].copy(), lse[:, :, 2].copy()
    merge_into(o, lse, o_b, lse_b)
    ctx = f"seed={seed}"
    assert np.isnan(o[:, :2]).all() and np.isnan(lse[:, :, :2]).all(), ctx
    np.testing.assert_array_equal(o[:, 2], before[0], err_msg=ctx)
    np.testing.assert_array_equal(lse[:, :, 2], before[1], err_msg=ctx)
    assert np.isfinite(o[:, 3:]).all() and np.isfinite(lse[:, :, 3:]).all(), ctx
