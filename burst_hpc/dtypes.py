"""Element types: what is accepted, and which float type accumulates.

bfloat16 on the host is ``ml_dtypes.bfloat16``. Accumulation is float32 for every
input type except float64 (kept in float64 on the CPU, where the oracle lives).
"""
import ml_dtypes
import numpy as np

from .errors import DTypeError

bfloat16 = np.dtype(ml_dtypes.bfloat16)
SUPPORTED = (np.dtype(np.float16), bfloat16, np.dtype(np.float32), np.dtype(np.float64))
SUPPORTED_NAMES = {"float16": SUPPORTED[0], "bfloat16": bfloat16, "float32": SUPPORTED[2], "float64": SUPPORTED[3]}


def dtype_name(dtype):
    dtype = np.dtype(dtype)
    return "bfloat16" if dtype == bfloat16 else dtype.name


def parse_dtype(name_or_dtype):
    """A supported dtype from a name ('bf16', 'bfloat16', 'fp16', ..., in any case) or a dtype."""
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "fp64": "float64"}
    if isinstance(name_or_dtype, str):
        name = aliases.get(name_or_dtype.lower(), name_or_dtype.lower())
        if name not in SUPPORTED_NAMES:
            raise DTypeError(f"unsupported dtype {name_or_dtype!r}; use one of {sorted(SUPPORTED_NAMES)}")
        return SUPPORTED_NAMES[name]
    return check_supported(name_or_dtype)


def check_supported(dtype):
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise DTypeError(f"{dtype!r} is not a dtype; use float16, bfloat16, float32 or float64") from None
    if dtype not in SUPPORTED:
        raise DTypeError(f"unsupported dtype {dtype_name(dtype)}; use float16, bfloat16, float32 or float64")
    return dtype


def accum_dtype(dtype):
    """float64 stays float64; every other supported input accumulates in float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)
