"""Single-device attention: NumPy arrays run on the CPU backend, CuPy arrays on the CUDA kernels."""
from . import masks
from .backends import get_backend
from .dtypes import accum_dtype
from .validate import check_like, check_qkv, check_same_kind, resolve_scale


def _mask(q, k, v, causal, window, cu_seqlens):
    """Checked shapes and the Mask (None: plain causal or full). Documents and windows are on the
    positions of one sequence, so they need as many queries as keys, like causal."""
    masked = causal or window is not None or cu_seqlens is not None
    shapes = check_qkv(q, k, v, masked)
    return shapes, masks.make(shapes[1], causal, window, cu_seqlens)


def attention(q, k, v, causal=False, scale=None, backend=None, cu_seqlens=None, window=None):
    """Exact attention. Returns (o, lse): o like q, lse float32 (B, Hq, Sq) in natural log.
    ``cu_seqlens``: document offsets [0, ..., S] of a packed sequence (no attention across
    documents); ``window``: (left, right) sliding window, -1 unbounded (flash-attn's meaning).

    Inputs are not scanned for NaN or Inf: like torch, they propagate into the outputs of every
    query row that sees them (``burst-hpc run`` refuses such inputs before any work)."""
    check_same_kind(q=q, k=k, v=v)
    (b, sq, _, hq, _, d), mask = _mask(q, k, v, causal, window, cu_seqlens)
    be = get_backend(q, backend)
    acc = accum_dtype(q.dtype)
    o = be.xp.zeros(q.shape, acc)
    lse = be.xp.full((b, hq, sq), -be.xp.inf, acc)
    be.forward_block(q, k, v, o, lse, scale=resolve_scale(scale, d), causal=causal or mask is not None,
                     q_start=0, k_start=0, mask=mask)
    return o.astype(q.dtype), lse.astype(be.xp.float32)


def attention_backward(do, q, k, v, o, lse, causal=False, scale=None, backend=None, cu_seqlens=None, window=None):
    """Gradients (dq, dk, dv) of sum(do * o), each in its input's dtype. NaN or Inf inputs propagate."""
    check_same_kind(do=do, q=q, k=k, v=v, o=o, lse=lse)
    (b, sq, _, hq, _, d), mask = _mask(q, k, v, causal, window, cu_seqlens)
    check_like("do", do, q.shape, q.dtype)
    check_like("o", o, q.shape, q.dtype)
    check_like("lse", lse, (b, hq, sq), None)
    be = get_backend(q, backend)
    acc = accum_dtype(q.dtype)
    dq = be.xp.zeros(q.shape, acc)
    dk = be.xp.zeros(k.shape, acc)
    dv = be.xp.zeros(v.shape, acc)
    delta = be.delta(do, o)
    be.backward_block(q, k, v, do, lse, delta, dq, dk, dv, scale=resolve_scale(scale, d),
                      causal=causal or mask is not None, q_start=0, k_start=0, mask=mask)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
