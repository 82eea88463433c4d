"""Single-device attention: NumPy arrays run on the CPU backend, CuPy arrays on the CUDA kernels."""
from .backends import get_backend
from .dtypes import accum_dtype
from .validate import check_like, check_qkv, check_same_kind, resolve_scale


def attention(q, k, v, causal=False, scale=None, backend=None):
    """Exact attention. Returns (o, lse): o like q, lse float32 (B, Hq, Sq) in natural log.

    Inputs are not scanned for NaN or Inf: like torch, they propagate into the outputs of every
    query row that sees them (``burst-hpc run`` refuses such inputs before any work)."""
    check_same_kind(q, k, v)
    b, sq, _, hq, _, d = check_qkv(q, k, v, causal)
    be = get_backend(q, backend)
    acc = accum_dtype(q.dtype)
    o = be.xp.zeros(q.shape, acc)
    lse = be.xp.full((b, hq, sq), -be.xp.inf, acc)
    be.forward_block(q, k, v, o, lse, scale=resolve_scale(scale, d), causal=causal, q_start=0, k_start=0)
    return o.astype(q.dtype), lse.astype(be.xp.float32)


def attention_backward(do, q, k, v, o, lse, causal=False, scale=None, backend=None):
    """Gradients (dq, dk, dv) of sum(do * o), each in its input's dtype. NaN or Inf inputs propagate."""
    check_same_kind(do, q, k, v, o, lse)
    b, sq, _, hq, _, d = check_qkv(q, k, v, causal)
    check_like("do", do, q.shape, q.dtype)
    check_like("o", o, q.shape, q.dtype)
    check_like("lse", lse, (b, hq, sq), None)
    be = get_backend(q, backend)
    acc = accum_dtype(q.dtype)
    dq = be.xp.zeros(q.shape, acc)
    dk = be.xp.zeros(k.shape, acc)
    dv = be.xp.zeros(v.shape, acc)
    delta = be.delta(do, o)
    be.backward_block(q, k, v, do, lse, delta, dq, dk, dv, scale=resolve_scale(scale, d), causal=causal, q_start=0, k_start=0)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
