"""The float64 oracle against an independent naive formula and against finite differences."""
import math

import numpy as np
import pytest

from burst_hpc.reference import attention_backward_reference, attention_reference

from burst_testing import assert_lse_close

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


def naive_forward(q, k, v, causal, scale, q_start, k_start):
    """Explicit loops over batch, head and query row; softmax written out with Python math."""
    b_n, sq, hq, d = q.shape
    _, sk, hkv, _ = k.shape
    group = hq // hkv
    o = np.zeros((b_n, sq, hq, d))
    lse = np.full((b_n, hq, sq), -np.inf)
    for b in range(b_n):
        for h in range(hq):
            kv = h // group
            for i in range(sq):
                scores = []
                for j in range(sk):
                    if causal and k_start + j > q_start + i:
                        continue
                    scores.append((j, scale * sum(q[b, i, h, c] * k[b, j, kv, c] for c in range(d))))
                if not scores:
                    continue
                m = max(s for _, s in scores)
                z = sum(math.exp(s - m) for _, s in scores)
                lse[b, h, i] = m + math.log(z)
                for j, s in scores:
                    o[b, i, h] += math.exp(s - m) / z * v[b, j, kv]
    return o, lse


def naive_backward(do, q, k, v, causal, scale, q_start, k_start):
    """Per (batch, head): P from the naive forward, then dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O))."""
    b_n, sq, hq, d = q.shape
    _, sk, hkv, _ = k.shape
    group = hq // hkv
    o, lse = naive_forward(q, k, v, causal, scale, q_start, k_start)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(b_n):
        for h in range(hq):
            kv = h // group
            for i in range(sq):
                if lse[b, h, i] == -np.inf:
                    continue
                delta = float(np.dot(do[b, i, h], o[b, i, h]))
                for j in range(sk):
                    if causal and k_start + j > q_start + i:
                        continue
                    p = math.exp(scale * float(np.dot(q[b, i, h], k[b, j, kv])) - lse[b, h, i])
                    dv[b, j, kv] += p * do[b, i, h]
                    ds = p * (float(np.dot(do[b, i, h], v[b, j, kv])) - delta)
                    dq[b, i, h] += scale * ds * k[b, j, kv]
                    dk[b, j, kv] += scale * ds * q[b, i, h]
    return dq, dk, dv


def _tiny(rng, b, sq, sk, hq, hkv, d, mag=1.0):
    return (rng.standard_normal((b, sq, hq, d)) * mag, rng.standard_normal((b, sk, hkv, d)) * mag,
            rng.standard_normal((b, sk, hkv, d)), rng.standard_normal((b, sq, hq, d)))


CASES = [  # b, sq, sk, hq, hkv, d, causal, q_start, k_start
    (1, 5, 5, 1, 1, 3, False, 0, 0),
    (2, 4, 7, 4, 2, 3, False, 0, 0),       # GQA 2:1, Sq != Sk
    (1, 6, 6, 4, 1, 2, True, 0, 0),        # MQA, causal
    (2, 5, 4, 2, 1, 3, True, 7, 5),        # causal block of a longer sequence
    (1, 4, 6, 3, 3, 2, True, 2, 3),        # some rows see nothing
    (1, 3, 5, 2, 2, 4, True, 0, 10),       # every key after every query: all rows empty
    (1, 3, 0, 2, 1, 2, False, 0, 0),       # no keys at all
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_sq{}_sk{}_h{}:{}_d{}_{}_q{}k{}".format(
    c[0], c[1], c[2], c[3], c[4], c[5], "causal" if c[6] else "full", c[7], c[8]))
def test_oracle_matches_naive_formula(case, rng, seed):
    b, sq, sk, hq, hkv, d, causal, q_start, k_start = case
    scale = float(rng.uniform(0.2, 1.5))
    q, k, v, do = _tiny(rng, b, sq, sk, hq, hkv, d, mag=1.5)
    ctx = f"seed={seed} case={case} scale={scale}"
    o, lse = attention_reference(q, k, v, causal=causal, scale=scale, q_start=q_start, k_start=k_start)
    o_n, lse_n = naive_forward(q, k, v, causal, scale, q_start, k_start)
    assert o.dtype == np.float64 and lse.dtype == np.float64, ctx
    assert o.shape == q.shape and lse.shape == (b, hq, sq), ctx
    np.testing.assert_allclose(o, o_n, rtol=1e-12, atol=1e-12, err_msg=ctx)
    assert_lse_close(lse, lse_n, 1e-12, ctx)
    grads = attention_backward_reference(do, q, k, v, causal=causal, scale=scale, q_start=q_start, k_start=k_start)
    for name, g, g_n, like in zip(("dq", "dk", "dv"), grads, naive_backward(do, q, k, v, causal, scale, q_start, k_start),
                                  (q, k, v)):
        assert g.shape == like.shape and g.dtype == np.float64, f"{ctx} {name}"
        np.testing.assert_allclose(g, g_n, rtol=1e-11, atol=1e-12, err_msg=f"{ctx} {name}")


def test_default_scale_is_inverse_sqrt_head_dim(rng, seed):
    q, k, v, _ = _tiny(rng, 1, 4, 5, 2, 1, 5)
    o, lse = attention_reference(q, k, v)
    o_s, lse_s = attention_reference(q, k, v, scale=5 ** -0.5)
    np.testing.assert_array_equal(o, o_s, err_msg=f"seed={seed}")
    np.testing.assert_array_equal(lse, lse_s, err_msg=f"seed={seed}")


@pytest.mark.parametrize("case", [
    (1, 4, 4, 2, 1, 3, False, 0, 0),
    (1, 4, 5, 4, 2, 2, False, 0, 0),
    (2, 4, 4, 2, 2, 2, True, 0, 0),
    (1, 3, 4, 4, 2, 2, True, 4, 2),
], ids=["mqa", "gqa_sq_ne_sk", "causal", "causal_offsets"])
def test_oracle_gradients_match_finite_differences(case, rng, seed):
    b, sq, sk, hq, hkv, d, causal, q_start, k_start = case
    scale = float(rng.uniform(0.3, 1.2))
    q, k, v, do = _tiny(rng, b, sq, sk, hq, hkv, d)
    kw = dict(causal=causal, scale=scale, q_start=q_start, k_start=k_start)

    def loss(q_, k_, v_):
        return float(np.sum(do * attention_reference(q_, k_, v_, **kw)[0]))

    grads = attention_backward_reference(do, q, k, v, **kw)
    eps = 1e-6
    for which, (name, g) in enumerate(zip(("dq", "dk", "dv"), grads)):
        args = [q, k, v]
        num = np.zeros_like(args[which])
        for idx in np.ndindex(args[which].shape):
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            num[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-7, err_msg=f"seed={seed} case={case} {name}")


def test_causal_block_equals_rows_of_full_sequence(rng, seed):
    """Rows a:b of the full causal result equal the oracle run on that query block with q_start=a;
    key blocks with k_start offsets see exactly their part of the mask; gradients add up."""
    s, hq, hkv, d = 24, 4, 2, 8
    q, k, v, do = _tiny(rng, 2, s, s, hq, hkv, d)
    a, bnd = sorted(rng.choice(np.arange(1, s), 2, replace=False))
    ctx = f"seed={seed} rows {a}:{bnd}"
    o, lse = attention_reference(q, k, v, causal=True)
    dq, dk, dv = attention_backward_reference(do, q, k, v, causal=True)

    # a query block against every key
    o_b, lse_b = attention_reference(q[:, a:bnd], k, v, causal=True, q_start=a)
    np.testing.assert_allclose(o_b, o[:, a:bnd], rtol=1e-13, atol=1e-14, err_msg=ctx)
    np.testing.assert_allclose(lse_b, lse[:, :, a:bnd], rtol=1e-13, atol=1e-14, err_msg=ctx)
    # same block against only the keys it can see (0..bnd-1): unchanged
    o_c, lse_c = attention_reference(q[:, a:bnd], k[:, :bnd], v[:, :bnd], causal=True, q_start=a)
    np.testing.assert_allclose(o_c, o_b, rtol=1e-13, atol=1e-14, err_msg=ctx)
    np.testing.assert_allclose(lse_c, lse_b, rtol=1e-13, atol=1e-14, err_msg=ctx)

    # gradients: dq rows depend only on their own rows; dk, dv are sums over query blocks
    acc_dk, acc_dv = np.zeros_like(dk), np.zeros_like(dv)
    for r0, r1 in ((0, a), (a, bnd), (bnd, s)):
        g = attention_backward_reference(do[:, r0:r1], q[:, r0:r1], k, v, causal=True, q_start=r0)
        np.testing.assert_allclose(g[0], dq[:, r0:r1], rtol=1e-12, atol=1e-13, err_msg=ctx)
        acc_dk += g[1]
        acc_dv += g[2]
    np.testing.assert_allclose(acc_dk, dk, rtol=1e-12, atol=1e-13, err_msg=ctx)
    np.testing.assert_allclose(acc_dv, dv, rtol=1e-12, atol=1e-13, err_msg=ctx)


def test_fully_masked_rows(rng, seed):
    """Queries at positions 0..5 against keys at 4..9: rows 0..3 see nothing."""
    q, k, v, do = _tiny(rng, 2, 6, 6, 4, 2, 4, mag=3.0)
    ctx = f"seed={seed}"
    o, lse = attention_reference(q, k, v, causal=True, q_start=0, k_start=4)
    assert not np.isnan(o).any() and not np.isnan(lse).any(), ctx
    assert np.all(o[:, :4] == 0), ctx
    assert np.all(np.isneginf(lse[:, :, :4])), ctx
    assert np.all(np.isfinite(lse[:, :, 4:])), ctx
    # row 4 sees key 4 only: o = v[4] (its kv head), lse = score
    np.testing.assert_allclose(o[:, 4], np.repeat(v[:, 0], 2, axis=1), rtol=1e-13, err_msg=ctx)
    dq, dk, dv = attention_backward_reference(do, q, k, v, causal=True, q_start=0, k_start=4)
    for g in (dq, dk, dv):
        assert np.isfinite(g).all(), ctx
    assert np.all(dq[:, :4] == 0), ctx
    # keys 6..9 (local 2..5) are after every query: no gradient at all
    assert np.all(dk[:, 2:] == 0) and np.all(dv[:, 2:] == 0), ctx
