"""GPU tests of head dims without a native kernel (skipped without CuPy or a GPU): D <= 128 other
than 64 and 128 runs zero-padded inside the CUDA backend (backends/padding.py), wider heads on the
tiled online softmax over CuPy (numpy_backend with xp=cupy), forward and backward, against the
float64 oracle with the FlashAttention rule (tests/conftest.py). Every kernel family the GPU runs is
covered.

    python3 -m pytest -q tests/test_cuda_padding.py
"""
import numpy as np
import pytest

from burst_hpc.device import gpu_count  # noqa: E402

cupy = pytest.importorskip("cupy")
_NGPU = gpu_count()
pytestmark = pytest.mark.skipif(_NGPU < 1, reason="no GPU")

import burst_hpc  # noqa: E402
from burst_hpc.backends import cuda  # noqa: E402
from burst_hpc.reference import attention_backward_reference, attention_reference  # noqa: E402
from burst_testing import (BF16, FP16, assert_lse_close, assert_rule, plain_backward, plain_forward,  # noqa: E402
                           plain_mask, randn)

FAMILIES = list(cuda.kernel_families()) if _NGPU else []


def _backend(family):
    return cuda.CudaBackend.instance(family=family)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("d", [32, 80, 96, 112, 160, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_padded_head_dim_forward_backward(rng, family, d, causal, dtype):
    be = _backend(family)
    b, sq, sk, hq, hkv = 2, 200, 333, 8, 2   # GQA 4:1; lengths off every tile
    q_start, k_start = 0, 100               # causal: rows that see nothing, diagonal and visible tiles
    scale = d ** -0.5                       # from the true D
    q, do = (randn(rng, (b, sq, hq, d), dtype) for _ in range(2))
    k, v = (randn(rng, (b, sk, hkv, d), dtype) for _ in range(2))
    qd = cupy.empty((b, sq + 5, hq, d), dtype)[:, 5:]  # a strided view along S, as a zigzag half is
    qd[...] = cupy.asarray(q)
    kd, vd, dod = (cupy.asarray(x) for x in (k, v, do))

    o = cupy.full((b, sq, hq, d), cupy.nan, cupy.float32)  # poison: every visible row must be written
    lse = cupy.full((b, hq, sq), -cupy.inf, cupy.float32)
    be.forward_block(qd, kd, vd, o, lse, scale=scale, **plain_mask(causal), q_start=q_start, k_start=k_start)
    o_ref, lse_ref = attention_reference(q, k, v, causal, scale, q_start, k_start)
    o_plain, _ = plain_forward(q, k, v, causal, scale, q_start, k_start)
    visible = np.isfinite(lse_ref)[0, 0] if causal else np.ones(sq, bool)
    ctx = f"{family} D={d} {'causal' if causal else 'full'} {dtype}"
    assert_rule("o", cupy.asnumpy(o)[:, visible], o_ref[:, visible], o_plain[:, visible], dtype, ctx)
    assert_lse_close(cupy.asnumpy(lse), lse_ref, 1e-3, ctx)

    o[:, ~cupy.asarray(visible)] = 0  # rows that see nothing hold o = 0, as the library's running o starts
    delta = be.delta(dod, o.astype(dtype))
    init = [cupy.random.standard_normal(x.shape, dtype=cupy.float32) for x in (qd, kd, vd)]
    dq, dk, dv = (x.copy() for x in init)  # gradients are added to what is there
    be.backward_block(qd, kd, vd, dod, lse, delta, dq, dk, dv, scale=scale, **plain_mask(causal), q_start=q_start,
                      k_start=k_start)
    ref = attention_backward_reference(do, q, k, v, causal, scale, q_start, k_start)
    plain = plain_backward(do, q, k, v, causal, scale, q_start, k_start)
    for name, got, start, r, p in zip(("dq", "dk", "dv"), (dq, dk, dv), init, ref, plain):
        assert_rule(name, cupy.asnumpy(got - start), r, p, dtype, ctx)


@pytest.mark.parametrize("d", [80, 96, 192])
def test_padded_head_dim_through_the_api(rng, d):
    """burst_hpc.attention / attention_backward on CuPy arrays with D = 80, 96, 192 (default family)."""
    b, s, hq, hkv = 1, 257, 4, 1
    q, k, v, do = (randn(rng, (b, s, h, d), BF16) for h in (hq, hkv, hkv, hq))
    o, lse = burst_hpc.attention(*(cupy.asarray(x) for x in (q, k, v)), causal=True)
    assert o.shape == (b, s, hq, d) and o.dtype == BF16
    o_ref, _ = attention_reference(q, k, v, True)
    o_plain, _ = plain_forward(q, k, v, True)
    assert_rule("o", cupy.asnumpy(o), o_ref, o_plain, BF16, f"api D={d}")
    grads = burst_hpc.attention_backward(*(cupy.asarray(x) for x in (do, q, k, v)), o, lse, causal=True)
    o_host = cupy.asnumpy(o)
    ref = attention_backward_reference(do, q, k, v, True)
    plain = plain_backward(do, q, k, v, True)
    for name, got, r, p in zip(("dq", "dk", "dv"), grads, ref, plain):
        assert got.shape[-1] == d
        assert_rule(name, cupy.asnumpy(got), r, p, BF16, f"api D={d}")
    assert np.isfinite(o_host.astype(np.float32)).all()
