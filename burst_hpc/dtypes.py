"""Element types: what is accepted, and which float type accumulates.

bfloat16 on the host is ``ml_dtypes.bfloat16``. Accumulation is float32 for every
input type except float64 (kept in float64 on the CPU, where the oracle lives).
"""
import ml_dtypes
import numpy as np

from .errors import DTypeError
from .device import array_module

bfloat16 = np.dtype(ml_dtypes.bfloat16)
SUPPORTED = (np.dtype(np.float16), bfloat16, np.dtype(np.float32), np.dtype(np.float64))
SUPPORTED_NAMES = {"float16": SUPPORTED[0], "bfloat16": bfloat16, "float32": SUPPORTED[2], "float64": SUPPORTED[3]}
# the other spellings every name-taking place (the API, each verb's --dtype) accepts, in any case
ALIASES = {"bf16": "bfloat16", "f16": "float16", "fp16": "float16", "half": "float16", "f32": "float32",
           "fp32": "float32", "f64": "float64", "fp64": "float64"}
SPELLINGS = f"{', '.join(SUPPORTED_NAMES)} (or {', '.join(ALIASES)}; any case)"


def dtype_name(dtype):
    dtype = np.dtype(dtype)
    return "bfloat16" if dtype == bfloat16 else dtype.name


def parse_dtype(name_or_dtype):
    """A supported dtype from a name (any of SPELLINGS: 'bfloat16', 'bf16', 'f16', 'fp16', ..., in any
    case) or a dtype."""
    if isinstance(name_or_dtype, str):
        name = ALIASES.get(name_or_dtype.lower(), name_or_dtype.lower())
        if name not in SUPPORTED_NAMES:
            raise DTypeError(f"unsupported dtype {name_or_dtype!r}; use one of {SPELLINGS}")
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


# 16-bit floats are read on their bits (fast in NumPy, where bfloat16's ufuncs are slow, and with no
# bfloat16 support needed from CuPy): with the sign bit cleared, finite magnitudes order like the bits,
# and bits from these up are Inf or NaN
_NONFINITE_BITS = {"bfloat16": 0x7F80, "float16": 0x7C00}


def magnitude_bits(x):
    """|x| as uint16 bits for a 16-bit float array (NumPy or CuPy), else None."""
    if dtype_name(x.dtype) not in _NONFINITE_BITS:
        return None
    return x.view(np.uint16) & np.uint16(0x7FFF)


def nonfinite(x):
    """Where x (NumPy or CuPy, a supported float dtype) is NaN or Inf, as a boolean array."""
    bits = magnitude_bits(x)
    if bits is None:
        return ~array_module(x).isfinite(x)
    return bits >= _NONFINITE_BITS[dtype_name(x.dtype)]


def largest_magnitude(x):
    """max |x| of an array (NumPy or CuPy) as a float, 0.0 when empty; NaN or Inf when x holds one."""
    if not x.size:
        return 0.0
    bits = magnitude_bits(x)
    if bits is None:
        return max(float(x.max()), -float(x.min()))
    return float(np.array(int(bits.max()), np.uint16).view(x.dtype))
