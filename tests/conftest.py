"""Shared helpers for the single-process tests.

Randomness: every test that takes the ``seed``/``rng`` fixtures draws a fresh seed each run.
On failure the seed is printed (report section "burst seed"); rerun with
``BURST_TEST_SEED=<seed> pytest ...`` to reproduce it.

Tolerances follow the FlashAttention rule (DESIGN.md, Conventions), the library's
(``burst_hpc.tolerance``): against the float64 oracle, our error must be at most 2x (forward) / 3x
(gradients) the error of a plain implementation that works in the same precision as the inputs
(``tolerance.plain_attention``: every product rounded to the input dtype), plus a small floor relative
to the size of the reference values.
"""
import os
import secrets
import sys

import ml_dtypes
import numpy as np
import pytest

from burst_hpc import tolerance
from burst_hpc.dtypes import dtype_name
from burst_hpc.plan import masks
from burst_hpc.tolerance import max_abs, max_err

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
FLOOR = {dtype: tolerance.ATOL[dtype_name(dtype)] for dtype in DTYPES}


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
# the tolerance rule and its plain same-precision baseline: the library's (burst_hpc.tolerance)


CAUSAL = masks.Mask(1 << 40, causal=True)   # plain causal attention on any positions a test uses


def plain_mask(causal):
    """The block contract's mask keywords of a pair under plain causal attention (``causal``: the pair is
    masked, keys after their query hidden on global positions) or of an unmasked pair."""
    return dict(masked=bool(causal), mask=CAUSAL)


def random_blocks(mask, dense, rng, count, context=""):
    """``count`` random (query rows, keys) blocks of a sequence whose visibility is the boolean matrix
    ``dense``, each checked: ``mask.classify`` and ``mask.visible_count`` say what ``dense`` says. Returns
    the blocks as (q0, q1, k0, k1)."""
    blocks = []
    for _ in range(count):
        q0, q1 = sorted(rng.integers(0, len(dense) + 1, 2))
        k0, k1 = sorted(rng.integers(0, len(dense) + 1, 2))
        block = dense[q0:q1, k0:k1]
        want = "hidden" if not block.any() else "full" if block.all() else "masked"
        where = f"{context} rows {q0}:{q1} keys {k0}:{k1}"
        assert mask.classify(q0, q1 - q0, k0, k1 - k0) == want, where
        assert mask.visible_count(q0, q1 - q0, k0, k1 - k0) == block.sum(), where
        blocks.append((q0, q1, k0, k1))
    return blocks


def plain_forward(q, k, v, causal=False, scale=None, q_start=0, k_start=0):
    """(o, lse) of the plain computation in the precision of q (returned in float32/float64)."""
    return tolerance.plain_attention(q, k, v, causal=causal, scale=scale, lowp=q.dtype, q_start=q_start,
                                     k_start=k_start)[:2]


def plain_backward(do, q, k, v, causal=False, scale=None, q_start=0, k_start=0):
    """(dq, dk, dv) of the plain computation in the precision of q."""
    return tolerance.plain_attention(q, k, v, do, causal, scale, q.dtype, q_start=q_start, k_start=k_start)[2:]


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


def assert_rule(name, got, ref, plain, dtype, ctx, floor=None):
    """The tolerance rule (burst_hpc.tolerance): err(got) <= FACTOR[name] * err(plain) + floor * max(1, max|ref|),
    the floor ATOL[dtype] unless given; ``got`` must be finite."""
    got64, ref64 = f64(got), f64(ref)
    assert got64.shape == ref64.shape, f"{ctx}: {name} shape {got64.shape} != {ref64.shape}"
    assert np.isfinite(got64).all(), f"{ctx}: {name} has non-finite values"
    base, ref_max = max_err(plain, ref64), max_abs(ref64)
    tol = tolerance.tolerance(name, base, ref_max, dtype) if floor is None else \
        tolerance.FACTOR[name] * base + floor * max(1.0, ref_max)
    err = max_err(got64, ref64)
    assert err <= tol, f"{ctx}: {name} max error {err:.3e} > tolerance {tol:.3e} (plain {base:.3e})"
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
