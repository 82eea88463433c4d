"""The head-dim padding path on the CPU: backends/padding.py wrapped around the NumPy backend (native
widths 64 and 128 stand in for the kernels) must give what the NumPy backend gives on the true head
dim, accumulating into running (o, lse) and gradient accumulators, on strided views."""
import numpy as np
import pytest

from burst_hpc.backends import padding
from burst_hpc.backends.numpy_backend import NumpyBackend
from burst_hpc.errors import BackendError
from burst_testing import BF16, FP64, plain_mask, randn

WIDTHS = (64, 128)


def test_native_width():
    assert [padding.native_width(d, WIDTHS) for d in (1, 63, 64, 65, 80, 96, 128)] == [64, 64, 64, 128, 128, 128, 128]
    for d in (129, 160, 256):
        with pytest.raises(BackendError, match=f"head_dim {d}, which has no kernel"):
            padding.native_width(d, WIDTHS)
    assert padding.native_width(160, WIDTHS + (256,)) == 256


def test_pad_keeps_values_and_zeroes_the_rest(rng):
    x = randn(rng, (2, 5, 3, 80), BF16)[:, 1:4]  # a view along S
    p = padding.pad(np, x, 128)
    assert p.dtype == x.dtype and p.shape == (2, 3, 3, 128) and p.flags.c_contiguous
    assert np.array_equal(p[..., :80].view(np.uint16), x.view(np.uint16)) and not p[..., 80:].astype(float).any()


@pytest.mark.parametrize("d", [40, 80, 96])
@pytest.mark.parametrize("dtype", [FP64, BF16], ids=["fp64", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_padded_blocks_match_the_true_head_dim(rng, d, dtype, causal):
    be = NumpyBackend(block_q=64, block_k=64)
    b, sq, sk, hq, hkv = 2, 77, 150, 4, 2
    q_start, k_start = 120, 40  # causal: diagonal, visible and hidden tiles, tails
    q = randn(rng, (b, sq + 3, hq, d), dtype)[:, 3:]
    k, v = (randn(rng, (b, sk, hkv, d), dtype) for _ in range(2))
    do = randn(rng, (b, sq, hq, d), dtype)
    acc = np.float64 if dtype == FP64 else np.float32
    kw = dict(scale=d ** -0.5, **plain_mask(causal), q_start=q_start)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == FP64 else dict(rtol=1e-5, atol=1e-5)

    # two key blocks merged into one running (o, lse): the second call starts from real running values
    results = []
    for fwd in (be.forward_block, lambda *a, **k_: padding.forward_block(be, WIDTHS, *a, **k_)):
        o = np.zeros((b, sq, hq, d), acc)
        lse = np.full((b, hq, sq), -np.inf, acc)
        fwd(q, k[:, :90], v[:, :90], o, lse, k_start=k_start, **kw)
        fwd(q, k[:, 90:], v[:, 90:], o, lse, k_start=k_start + 90, **kw)
        results.append((o, lse))
    (o_ref, lse_ref), (o_pad, lse_pad) = results
    assert np.isfinite(o_ref).all() and np.abs(o_ref).max() > 0
    np.testing.assert_allclose(o_pad, o_ref, **tol)
    np.testing.assert_allclose(lse_pad, lse_ref, **tol)

    delta = be.delta(do, o_ref)
    init = [randn(rng, x.shape, acc) for x in (q, k, v)]  # gradients are added to what is there
    grads = []
    for bwd in (be.backward_block, lambda *a, **k_: padding.backward_block(be, WIDTHS, *a, **k_)):
        dq, dk, dv = (x.copy() for x in init)
        bwd(q, k, v, do, lse_ref, delta, dq, dk, dv, k_start=k_start, **kw)
        grads.append((dq, dk, dv))
    for name, ref, got, start in zip(("dq", "dk", "dv"), grads[0], grads[1], init):
        assert not np.array_equal(ref, start), f"{name} untouched"
        np.testing.assert_allclose(got, ref, err_msg=name, **tol)


def test_mismatched_head_dims_refused(rng):
    be = NumpyBackend()
    q, k = randn(rng, (1, 8, 2, 80)), randn(rng, (1, 8, 2, 64))
    o, lse = np.zeros(q.shape), np.full((1, 2, 8), -np.inf)
    with pytest.raises(BackendError, match="one head_dim"):
        padding.forward_block(be, WIDTHS, q, k, k, o, lse, scale=0.1)
