"""Single-device attention: NumPy arrays run on the CPU backend, CuPy arrays on the CUDA kernels."""
from .plan import masks
from .backends import get_backend
from .dtypes import accum_dtype
from .validate import check_like, check_qkv, check_same_kind, resolve_scale


def _mask(q, k, v, causal, window, cu_seqlens):
    """Checked shapes and the call's masks.Mask. A mask is on the positions of one sequence, so it
    needs as many queries as keys."""
    shapes = check_qkv(q, k, v, causal or window is not None or cu_seqlens is not None)
    return shapes, masks.make(shapes[1], causal, window, cu_seqlens)


def attention(q, k, v, causal=False, scale=None, backend=None, cu_seqlens=None, window=None):
    """Exact attention on one device (no MPI).

    Parameters
    ----------
    q : array (B, Sq, Hq, D)
        NumPy arrays run on the CPU, CuPy arrays on the current GPU (CUDA kernels).
    k, v : array (B, Sk, Hkv, D)
        Hq a multiple of Hkv (GQA/MQA); with a mask (causal, documents, window) Sk == Sq.
    causal : bool
        Key j visible from query i only when j <= i.
    scale : float, optional
        Score scale (default D ** -0.5).
    backend : {'numpy', 'cuda'} or a backend object, optional
        Default: by the arrays' kind.
    cu_seqlens : 1-D integer array, optional
        Document offsets [0, ..., S] of a packed sequence (no attention across documents).
    window : (int, int), optional
        (left, right) sliding window, -1 unbounded (flash-attn's meaning).

    Returns
    -------
    o : array like q
    lse : float32 array (B, Hq, Sq)
        Natural-log sum-exp of each row's scaled scores (-inf for a row that sees nothing, o = 0).

    Raises
    ------
    BurstError
        Bad shapes, dtypes, masks or backend.

    Notes
    -----
    Inputs are not scanned for NaN or Inf: they reach exactly the rows that see them, as in the
    float64 oracle (``burst-hpc run`` refuses such inputs unless ``--allow-nonfinite``).

    Examples
    --------
    >>> o, lse = burst_hpc.attention(q, k, v, causal=True)
    """
    check_same_kind(q=q, k=k, v=v)
    (b, sq, _, hq, _, d), mask = _mask(q, k, v, causal, window, cu_seqlens)
    be = get_backend(q, backend)
    # one block pair, the first and the last: the output is written in q's dtype where it is computed
    o = be.xp.empty(q.shape, q.dtype)
    lse = be.xp.empty((b, hq, sq), accum_dtype(q.dtype))
    be.forward_block(q, k, v, None, lse, scale=resolve_scale(scale, d), masked=not mask.is_full, mask=mask,
                     first=True, out=o)
    return o, lse.astype(be.xp.float32, copy=False)


def attention_backward(do, q, k, v, o, lse, causal=False, scale=None, backend=None, cu_seqlens=None, window=None):
    """Gradients of sum(do * o) on one device, from the forward's (o, lse) (no recomputation of them).

    Parameters
    ----------
    do : array like q
    q, k, v, o, lse, causal, scale, backend, cu_seqlens, window :
        As ``attention`` took and returned them.

    Returns
    -------
    dq : array like q
    dk, dv : arrays like k
        Each in its input's dtype (float32 accumulation). NaN or Inf inputs propagate.

    Raises
    ------
    BurstError
        Bad shapes, dtypes, masks or backend.

    Examples
    --------
    >>> dq, dk, dv = burst_hpc.attention_backward(do, q, k, v, o, lse, causal=True)
    """
    check_same_kind(do=do, q=q, k=k, v=v, o=o, lse=lse)
    (b, sq, _, hq, _, d), mask = _mask(q, k, v, causal, window, cu_seqlens)
    check_like("do", do, q.shape, q.dtype)
    check_like("o", o, q.shape, q.dtype)
    check_like("lse", lse, (b, hq, sq), None)
    be = get_backend(q, backend)
    # one block pair, the first and the last for every row: delta in the backend's pre-pass, the gradients
    # written in their inputs' dtypes where they are last written
    dq, dk, dv = (be.xp.empty(x.shape, x.dtype) for x in (q, k, v))
    be.backward_block(q, k, v, do, lse, None, None, None, None, scale=resolve_scale(scale, d),
                      masked=not mask.is_full, mask=mask, o=o, first_q=True, first_kv=True, dq_out=dq, dk_out=dk,
                      dv_out=dv)
    return dq, dk, dv
