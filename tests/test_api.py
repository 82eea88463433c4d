"""Public single-device API: results, dtypes, and validation with the project's own errors."""
import numpy as np
import pytest

import burst_hpc
from burst_hpc import BurstError, DTypeError, ShapeError, attention, attention_backward
from burst_hpc.reference import attention_backward_reference, attention_reference

from burst_testing import (DTYPE_IDS, DTYPES, FLOOR, FP64, assert_lse_close, assert_rule, max_err, plain_backward,
                      plain_forward, qkv, randn)

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_attention_and_backward_match_oracle(dtype, causal, rng, seed):
    b, hq, hkv, d = 2, 4, 2, 64
    sq = int(rng.integers(129, 200))  # more than one default tile (128)
    sk = sq if causal else int(rng.integers(129, 200))
    scale = None if rng.random() < 0.5 else float(rng.uniform(0.05, 0.3))
    ctx = f"seed={seed} {dtype} Sq={sq} Sk={sk} causal={causal} scale={scale}"
    q, k, v = qkv(rng, b, sq, sk, hq, hkv, d, dtype)
    do = randn(rng, q.shape, dtype)
    o, lse = attention(q, k, v, causal=causal, scale=scale)
    assert isinstance(o, np.ndarray) and isinstance(lse, np.ndarray), ctx
    assert o.dtype == dtype and o.shape == q.shape, ctx
    assert lse.dtype == np.float32 and lse.shape == (b, hq, sq), ctx
    ref_o, ref_lse = attention_reference(q, k, v, causal=causal, scale=scale)
    pl_o, pl_lse = plain_forward(q, k, v, causal=causal, scale=scale)
    # plain_forward already rounds o to dtype, like the API does
    assert_rule("o", o, ref_o, pl_o, dtype, ctx)
    assert_lse_close(lse, ref_lse, 2 * max_err(pl_lse, ref_lse) + 2e-6 * np.abs(ref_lse).max(), ctx)

    dq, dk, dv = attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale)
    ref = attention_backward_reference(do, q, k, v, causal=causal, scale=scale)
    plain = plain_backward(do, q, k, v, causal=causal, scale=scale)
    # float64: lse comes back as float32 (by design), which bounds the gradients to ~1e-7 relative
    floor = 1e-6 if dtype == FP64 else FLOOR[dtype]
    for name, g, like, r, p in zip(("dq", "dk", "dv"), (dq, dk, dv), (q, k, v), ref, plain):
        assert g.dtype == dtype and g.shape == like.shape, f"{ctx} {name}"
        assert_rule(name, g, r, p, dtype, ctx, floor=floor)


def test_mha_and_mqa_shapes(rng, seed):
    for hq, hkv in ((4, 4), (8, 1)):
        q, k, v = qkv(rng, 1, 20, 20, hq, hkv, 32, np.float32)
        o, lse = attention(q, k, v, causal=True)
        ref_o, _ = attention_reference(q, k, v, causal=True)
        np.testing.assert_allclose(o, ref_o, rtol=1e-5, atol=1e-5, err_msg=f"seed={seed} {hq}:{hkv}")
        dq, dk, dv = attention_backward(o, q, k, v, o, lse, causal=True)
        assert dk.shape == k.shape and dv.shape == v.shape


def test_inputs_are_not_modified(rng):
    q, k, v = qkv(rng, 1, 16, 16, 2, 1, 16, np.float32)
    do = randn(rng, q.shape, np.float32)
    saved = [x.copy() for x in (q, k, v, do)]
    o, lse = attention(q, k, v, causal=True)
    o_saved, lse_saved = o.copy(), lse.copy()
    attention_backward(do, q, k, v, o, lse, causal=True)
    for x, y in zip((q, k, v, do, o, lse), saved + [o_saved, lse_saved]):
        np.testing.assert_array_equal(x, y)


def _good(rng, dtype=np.float32):
    return qkv(rng, 2, 8, 8, 4, 2, 16, dtype)


def test_rank_three_input(rng):
    q, k, v = _good(rng)
    with pytest.raises(ShapeError, match=r"q must be rank 4 \(batch, seqlen, heads, head_dim\); got shape \(8, 4, 16\)"):
        attention(q[0], k, v)
    with pytest.raises(ShapeError, match=r"k must be rank 4"):
        attention(q, k[0], v)
    with pytest.raises(ShapeError, match=r"v must be rank 4"):
        attention(q, k, v[..., None])


def test_mismatched_batch_or_head_dim(rng):
    q, k, v = _good(rng)
    with pytest.raises(ShapeError, match=r"batch and head_dim"):
        attention(q[:1], k, v)
    with pytest.raises(ShapeError, match=r"batch and head_dim"):
        attention(q[..., :8], k, v)
    with pytest.raises(ShapeError, match=r"k and v must have the same shape"):
        attention(q, k, v[..., :8])
    with pytest.raises(ShapeError, match=r"k and v must have the same shape"):
        attention(q, k, v[:, :4])


def test_heads_not_a_multiple(rng):
    q, k, v = qkv(rng, 1, 8, 8, 6, 4, 16, np.float32)
    with pytest.raises(ShapeError, match=r"query heads \(6\) must be a multiple of key/value heads \(4\)"):
        attention(q, k, v)
    with pytest.raises(ShapeError, match=r"multiple of key/value heads"):
        attention(q[:, :, :2], k, v)  # fewer query heads than kv heads


def test_causal_needs_equal_lengths(rng):
    q, k, v = _good(rng)
    with pytest.raises(ShapeError, match=r"causal, document and window masks need as many queries as keys; got 8 and 5"):
        attention(q, k[:, :5], v[:, :5], causal=True)
    o, lse = attention(q, k[:, :5], v[:, :5], causal=False)  # fine without the mask
    assert o.shape == q.shape and lse.shape == (2, 4, 8)


def test_mixed_and_unsupported_dtypes(rng):
    q, k, v = _good(rng)
    with pytest.raises(DTypeError, match=r"share one dtype; q is float32, k is float16"):
        attention(q, k.astype(np.float16), v)
    with pytest.raises(DTypeError, match=r"share one dtype; q is float32, v is bfloat16"):
        attention(q, k, v.astype(burst_hpc.dtypes.bfloat16))
    with pytest.raises(DTypeError, match=r"unsupported dtype int32"):
        attention(q.astype(np.int32), k.astype(np.int32), v.astype(np.int32))
    with pytest.raises(DTypeError, match=r"unsupported dtype"):
        attention(q.astype(np.complex64), k.astype(np.complex64), v.astype(np.complex64))


def test_backward_validation(rng):
    q, k, v = _good(rng)
    o, lse = attention(q, k, v)
    do = np.ones_like(q)
    with pytest.raises(ShapeError, match=r"do must have shape \(2, 8, 4, 16\)"):
        attention_backward(do[:, :4], q, k, v, o, lse)
    with pytest.raises(DTypeError, match=r"do must be float32; got float64"):
        attention_backward(do.astype(np.float64), q, k, v, o, lse)
    with pytest.raises(ShapeError, match=r"o must have shape"):
        attention_backward(do, q, k, v, o[:1], lse)
    with pytest.raises(DTypeError, match=r"o must be float32; got float16"):
        attention_backward(do, q, k, v, o.astype(np.float16), lse)
    with pytest.raises(ShapeError, match=r"lse must have shape \(2, 4, 8\)"):
        attention_backward(do, q, k, v, o, lse.transpose(0, 2, 1))
    with pytest.raises(ShapeError, match=r"causal, document and window masks need as many queries as keys"):
        attention_backward(do, q, k[:, :4], v[:, :4], o, lse, causal=True)
    with pytest.raises(ShapeError, match=r"q must be rank 4"):
        attention_backward(do, q[0], k, v, o, lse)


def test_errors_are_burst_errors():
    for err in (ShapeError, DTypeError, burst_hpc.LayoutError, burst_hpc.TransportError, burst_hpc.RankMismatchError,
                burst_hpc.BackendError):
        assert issubclass(err, BurstError) and issubclass(err, ValueError)


def test_every_error_the_package_raises_is_exported():
    """A caller catches any of them by its name in burst_hpc (TopologyError and MpiError were missing)."""
    from burst_hpc import errors

    defined = {name for name, value in vars(errors).items() if isinstance(value, type) and issubclass(value, BurstError)}
    assert defined <= set(burst_hpc.__all__), defined - set(burst_hpc.__all__)
    assert all(getattr(burst_hpc, name) is getattr(errors, name) for name in defined)
    assert {"TopologyError", "MpiError", "FileError"} <= defined


def test_unknown_backend(rng):
    q, k, v = _good(rng)
    with pytest.raises(burst_hpc.BackendError, match=r"unknown backend 'tpu'"):
        attention(q, k, v, backend="tpu")
    with pytest.raises(burst_hpc.BackendError, match=r"cuda backend takes CuPy arrays"):
        attention(q, k, v, backend="cuda")


def test_empty_sequences(rng):
    """No keys: o = 0 and lse = -inf; no queries: empty outputs; gradients zero, never NaN."""
    q, k, v = qkv(rng, 1, 5, 0, 4, 2, 16, np.float32)
    o, lse = attention(q, k, v)
    assert np.all(o == 0) and np.all(np.isneginf(lse)) and lse.dtype == np.float32
    dq, dk, dv = attention_backward(np.ones_like(q), q, k, v, o, lse)
    assert np.all(dq == 0) and dk.shape == k.shape and dv.shape == v.shape
    q, k, v = qkv(rng, 1, 0, 0, 4, 2, 16, np.float32)
    o, lse = attention(q, k, v, causal=True)
    assert o.shape == (1, 0, 4, 16) and lse.shape == (1, 4, 0)


def test_dtype_parsing():
    from burst_hpc.dtypes import accum_dtype, dtype_name, parse_dtype

    assert parse_dtype("bf16") == burst_hpc.dtypes.bfloat16 and dtype_name(parse_dtype("bf16")) == "bfloat16"
    assert parse_dtype("fp16") == np.float16 and parse_dtype(np.float32) == np.float32
    assert parse_dtype("float64") == np.float64
    for bad in ("int8", "bogus", np.int32, 3.5):
        with pytest.raises(DTypeError):
            parse_dtype(bad)
    assert accum_dtype(np.float16) == np.float32 and accum_dtype(burst_hpc.dtypes.bfloat16) == np.float32
    assert accum_dtype(np.float32) == np.float32 and accum_dtype(np.float64) == np.float64


def test_python_list_named_as_not_an_array(rng):
    q, k, v = qkv(rng, 1, 8, 8, 2, 1, 4)
    with pytest.raises(DTypeError, match=r"^k must be a NumPy or CuPy array; got list"):
        attention(q, k.tolist(), v)
    o, lse = attention(q, k, v)
    with pytest.raises(DTypeError, match=r"^lse must be a NumPy or CuPy array; got tuple"):
        attention_backward(q, q, k, v, o, tuple(lse))


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0, 0.0, "big"])
def test_scale_must_be_finite_and_positive(rng, scale):
    q, k, v = qkv(rng, 1, 8, 8, 2, 1, 4)
    with pytest.raises(BurstError, match=r"scale must be a finite number > 0; got"):
        attention(q, k, v, scale=scale)


def test_one_rank_runs_any_length_in_every_layout(rng):
    """One rank owns the whole sequence: the zigzag default needs no even length there."""
    from mpi4py import MPI

    q, k, v = qkv(rng, 1, 7, 7, 2, 1, 4)
    o_ref, lse_ref = attention(q, k, v, causal=True)
    for layout in (None, "zigzag", "contiguous", "balanced"):
        o, lse = burst_hpc.burst_attention(q, k, v, comm=MPI.COMM_SELF, causal=True, layout=layout)
        np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, lse_ref, rtol=1e-6)
