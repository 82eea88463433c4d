"""Shared helpers for the single-process tests.

Randomness: every test that takes the ``seed``/``rng`` fixtures draws a fresh seed each run.
On failure the seed is printed (report section "burst seed"); rerun with
``BURST_TEST_SEED=<seed> pytest ...`` to reproduce it.

Tolerances follow the FlashAttention rule (DESIGN.md, Conventions): against the float64 oracle,
our error must be at most 2x (forward) / 3x (gradients) the error of a plain implementation
that works in the same precision as the inputs (``plain_forward`` / ``plain_backward`` below,
written like eager PyTorch: every matmul/softmax result rounded to the input dtype), plus a
small floor relative to the size of the reference values.
"""
import os
import secrets
import sys

import ml_dtypes
import numpy as np
import pytest

BF16 = np.dtype(ml_dtypes.bfloat16)
FP16 = np.dtype(np.float16)
FP32 = np.dtype(np.float32)
FP64 = np.dtype(np.float64)
DTYPES = [FP16, BF16, FP32, FP64]
DTYPE_IDS = ["fp16", "bf16", "fp32", "fp64"]

# Test modules import these helpers as ``burst_testing``: the plain name ``conftest`` is ambiguous
# when tests/ and mpi_tests/ (which has its own conftest.py) are collected in one run.
sys.modules.setdefault("burst_testing", sys.modules[__name__])

# floor of the tolerance, relative to max(1, max |reference|)
FLOOR = {FP16: 1e-4, BF16: 1e-3, FP32: 1e-5, FP64: 1e-12}


@pytest.fixture
def seed(request):
    value = int(os.environ.get("BURST_TEST_SEED") or secrets.randbits(63))
    request.node.user_properties.append(("burst_seed", value))
    return value


@pytest.fixture
def rng(seed):
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for name, value in item.user_properties:
            if name == "burst_seed":
                report.sections.append(("burst seed", f"reproduce with BURST_TEST_SEED={value}"))


def randn(rng, shape, dtype=FP64, scale=1.0):
    """Standard normal values (times ``scale``) rounded to ``dtype``."""
    return (rng.standard_normal(shape) * scale).astype(dtype)


def qkv(rng, b, sq, sk, hq, hkv, d, dtype=FP64, scale=1.0):
    return (randn(rng, (b, sq, hq, d), dtype, scale), randn(rng, (b, sk, hkv, d), dtype, scale),
            randn(rng, (b, sk, hkv, d), dtype, scale))


def f64(x):
    return np.asarray(x).astype(np.float64)


# ---------------------------------------------------------------------------------------------
# plain same-precision implementation: the baseline of the tolerance rule


def _round(x, dtype):
    return np.asarray(x).astype(dtype).astype(np.float32 if dtype != FP64 else np.float64)


def _work(dtype):
    return np.float64 if dtype == FP64 else np.float32


def _bhsd(x):
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3))


def _bshd(x):
    return x.transpose(0, 2, 1, 3)


def _plain_probs(q, k, scale, causal, q_start, k_start, dtype):
    w = _work(dtype)
    group = q.shape[2] // k.shape[2]
    qw = _bhsd(q.astype(w))
    kw = _bhsd(np.repeat(k.astype(w), group, axis=2))
    s = _round(qw @ kw.swapaxes(-1, -2), dtype)                        # matmul output in dtype
    s = _round(s * w(scale), dtype)
    if causal:
        q_pos = q_start + np.arange(q.shape[1])
        k_pos = k_start + np.arange(k.shape[1])
        s = np.where(k_pos[None, :] > q_pos[:, None], -np.inf, s)
    m = s.max(-1, keepdims=True) if s.shape[-1] else np.full(s.shape[:-1] + (1,), -np.inf, w)
    m = np.where(np.isneginf(m), 0, m)
    e = np.exp(s - m)
    tot = e.sum(-1, keepdims=True)
    p = _round(e / np.where(tot > 0, tot, 1), dtype)                   # softmax output in dtype
    with np.errstate(divide="ignore"):
        lse = (np.log(tot) + m)[..., 0]
    return p, lse, group


def plain_forward(q, k, v, causal=False, scale=None, q_start=0, k_start=0):
    """(o, lse) computed eagerly in the precision of q (returned in float32/float64)."""
    dtype = np.dtype(q.dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    p, lse, group = _plain_probs(q, k, scale, causal, q_start, k_start, dtype)
    vw = _bhsd(np.repeat(v.astype(_work(dtype)), group, axis=2))
    return _bshd(_round(p @ vw, dtype)), lse


def plain_backward(do, q, k, v, causal=False, scale=None, q_start=0, k_start=0):
    """(dq, dk, dv) of sum(do * o) computed eagerly in the precision of q."""
    dtype = np.dtype(q.dtype)
    w = _work(dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    p, _, group = _plain_probs(q, k, scale, causal, q_start, k_start, dtype)
    qw, dow = _bhsd(q.astype(w)), _bhsd(do.astype(w))
    kw = _bhsd(np.repeat(k.astype(w), group, axis=2))
    vw = _bhsd(np.repeat(v.astype(w), group, axis=2))
    dv = _bshd(_round(p.swapaxes(-1, -2) @ dow, dtype))
    dp = _round(dow @ vw.swapaxes(-1, -2), dtype)
    ds = _round(p * (dp - _round((p * dp).sum(-1, keepdims=True), dtype)), dtype)
    dq = _bshd(_round(_round(ds @ kw, dtype) * w(scale), dtype))
    dk = _bshd(_round(_round(ds.swapaxes(-1, -2) @ qw, dtype) * w(scale), dtype))
    b, sk, h, d = dk.shape
    dk = _round(dk.reshape(b, sk, h // group, group, d).sum(3), dtype)
    dv = _round(dv.reshape(b, sk, h // group, group, d).sum(3), dtype)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# comparisons


def max_err(got, ref):
    """Max |got - ref| over finite reference entries (0 for empty arrays)."""
    got, ref = f64(got), f64(ref)
    if ref.size == 0:
        return 0.0
    return float(np.max(np.abs(got - ref)))


def assert_lse_close(got, ref, tol, ctx):
    """lse: -inf exactly where the reference is -inf, close elsewhere; never NaN."""
    got, ref = f64(got), f64(ref)
    assert got.shape == ref.shape, f"{ctx}: lse shape {got.shape} != {ref.shape}"
    assert not np.isnan(got).any(), f"{ctx}: NaN in lse"
    empty = np.isneginf(ref)
    assert np.array_equal(np.isneginf(got), empty), \
        f"{ctx}: lse is -inf at {np.argwhere(np.isneginf(got) != empty)[:5].tolist()} where the reference disagrees"
    if (~empty).any():
        err = float(np.max(np.abs(got[~empty] - ref[~empty])))
        assert err <= tol, f"{ctx}: lse max error {err:.3e} > {tol:.3e}"


def assert_rule(name, got, ref, plain, factor, dtype, ctx, floor=None):
    """FlashAttention-style check: err(got) <= factor * err(plain) + floor * max(1, max|ref|)."""
    got64, ref64 = f64(got), f64(ref)
    assert got64.shape == ref64.shape, f"{ctx}: {name} shape {got64.shape} != {ref64.shape}"
    assert np.isfinite(got64).all(), f"{ctx}: {name} has non-finite values"
    scale = max(1.0, float(np.max(np.abs(ref64))) if ref64.size else 1.0)
    floor = FLOOR[np.dtype(dtype)] if floor is None else floor
    base = max_err(plain, ref64)
    tol = factor * base + floor * scale
    err = max_err(got64, ref64)
    assert err <= tol, (f"{ctx}: {name} max error {err:.3e} > {factor} x plain {base:.3e} + floor "
                        f"{floor * scale:.3e}")
    return err, base


# ---------------------------------------------------------------------------------------------
# non-finite inputs (DESIGN.md, "What every call promises")


def poke_nonfinite(rng, x, value, count=1):
    """Put ``value`` (NaN or +-Inf) at ``count`` random distinct entries of ``x``, in place; returns
    their indices (for the failure message)."""
    flat = rng.choice(x.size, size=count, replace=False)
    spots = [tuple(int(i) for i in np.unravel_index(f, x.shape)) for f in flat]
    for s in spots:
        x[s] = value
    return spots


def assert_finite_like(name, got, ref, tol, ctx, superset=False):
    """``got`` is non-finite exactly where the oracle ``ref`` is (``superset``: at least there), lse-style
    -inf exactly where ``ref`` is -inf (a row that sees nothing, never a NaN one), and within
    tol * max(1, max |ref|) of ``ref`` where both are finite."""
    got, ref = f64(got), f64(ref)
    assert got.shape == ref.shape, f"{ctx}: {name} shape {got.shape} != {ref.shape}"
    lost = ~np.isfinite(ref) & np.isfinite(got)
    assert not lost.any(), (f"{ctx}: {name} finite at {np.argwhere(lost)[:5].tolist()} (of {int(lost.sum())}) "
                            f"where the oracle is not: a NaN or Inf was dropped")
    if not superset:
        extra = np.isfinite(ref) & ~np.isfinite(got)
        assert not extra.any(), (f"{ctx}: {name} non-finite at {np.argwhere(extra)[:5].tolist()} (of "
                                 f"{int(extra.sum())}) where the oracle is finite: a NaN or Inf leaked")
        empty = np.isneginf(ref)
        assert np.array_equal(np.isneginf(got), empty), \
            f"{ctx}: {name} is -inf at {np.argwhere(np.isneginf(got) != empty)[:5].tolist()} where the oracle disagrees"
    both = np.isfinite(ref) & np.isfinite(got)
    if both.any():
        err = float(np.abs(got[both] - ref[both]).max())
        bound = tol * max(1.0, float(np.abs(ref[both]).max()))
        assert err <= bound, f"{ctx}: {name} max error {err:.3e} > {bound:.3e} where both are finite"
