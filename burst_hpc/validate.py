"""Argument checks shared by the single-device and the distributed API."""
import numpy as np

from .dtypes import check_supported, dtype_name
from .errors import BurstError, DTypeError, ShapeError


def check_qkv(q, k, v, masked=False):
    """Validate q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D), as many queries as keys when ``masked``
    (a mask is on the positions of one sequence); return (B, Sq, Sk, Hq, Hkv, D)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ShapeError(f"{name} must be rank 4 (batch, seqlen, heads, head_dim); got shape {getattr(x, 'shape', None)}")
    b, sq, hq, d = q.shape
    _, sk, hkv, _ = k.shape
    if k.shape != v.shape:
        raise ShapeError(f"k and v must have the same shape; got {k.shape} and {v.shape}")
    if k.shape[0] != b or k.shape[3] != d:
        raise ShapeError(f"q {q.shape} and k {k.shape} must agree in batch and head_dim")
    if hkv == 0 or hq % hkv:
        raise ShapeError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if d == 0:
        raise ShapeError("head_dim must be positive")
    if masked and sq != sk:
        raise ShapeError(f"causal, document and window masks need as many queries as keys; got {sq} and {sk}")
    dtype = check_supported(q.dtype)
    for name, x in (("k", k), ("v", v)):
        if np.dtype(x.dtype) != dtype:
            raise DTypeError(f"q, k and v must share one dtype; q is {dtype_name(dtype)}, {name} is {dtype_name(x.dtype)}")
    return b, sq, sk, hq, hkv, d


def check_like(name, x, shape, dtype):
    if getattr(x, "shape", None) != tuple(shape):
        raise ShapeError(f"{name} must have shape {tuple(shape)}; got {getattr(x, 'shape', None)}")
    if dtype is not None and np.dtype(x.dtype) != np.dtype(dtype):
        raise DTypeError(f"{name} must be {dtype_name(dtype)}; got {dtype_name(x.dtype)}")


def check_same_kind(**arrays):
    """Every argument (name=array, in call order) a NumPy or CuPy array, all of one kind."""
    for name, x in arrays.items():
        if type(x).__module__.split(".")[0] not in ("numpy", "cupy") or not hasattr(x, "dtype"):
            raise DTypeError(f"{name} must be a NumPy or CuPy array; got {type(x).__name__} "
                             f"(wrap it with numpy.asarray)")
    kinds = {type(x).__module__.split(".")[0] for x in arrays.values()}
    if len(kinds) > 1:
        raise DTypeError("mix of NumPy and CuPy arrays; pass all on the host or all on the device")


def resolve_scale(scale, head_dim):
    """The softmax scale: head_dim**-0.5 by default; a given one must be a finite number > 0."""
    if scale is None:
        return head_dim ** -0.5
    try:
        value = float(scale)
    except (TypeError, ValueError):
        value = None
    if value is None or not np.isfinite(value) or value <= 0:
        raise BurstError(f"scale must be a finite number > 0; got {scale!r}")
    return value


def given_key(options, offsets=None, arrays=()):
    """A hashable key of a call's arguments as given, equal only for calls whose checks are sure to agree, or None
    where none can be made (the call is then checked anew): ``options`` by type and value (True and 1, 1.0 and 1
    differ: a check may refuse one), document ``offsets`` (None, a NumPy array or a sequence) by value, ``arrays``
    by kind, shape and dtype (None stays None). What a repeated call's checks and plans are kept by."""
    if offsets is None or isinstance(offsets, np.ndarray):
        held = None if offsets is None else (offsets.dtype, offsets.shape, offsets.tobytes())
    elif isinstance(offsets, (list, tuple)):
        held = _typed(tuple(offsets))
    else:
        return None
    try:
        key = (_typed(options), held, tuple(None if x is None else (type(x), x.shape, x.dtype) for x in arrays))
        hash(key)
    except (AttributeError, TypeError):   # not arrays, or an option that is not hashable
        return None
    return key


def _typed(value):
    if isinstance(value, (tuple, list)):
        return type(value), tuple(_typed(x) for x in value)
    return type(value), value
