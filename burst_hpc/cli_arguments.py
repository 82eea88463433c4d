"""The command line's numbers and names: one type function per kind, each a clear "argument --x:
expected ..." line and exit status 2 for anything else (zero, negative, NaN, infinite, too large)."""
import argparse

import numpy as np

from .dtypes import dtype_name, parse_dtype
from .errors import BackendError, DTypeError
from .plan.masks import LARGEST_WINDOW

LARGEST_INT = 2 ** 63 - 1    # sizes, counts and seeds become int64 (NumPy, HDF5)


def _whole(text, least, what, largest=LARGEST_INT):
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < least:
        raise argparse.ArgumentTypeError(f"expected {what}; got {text!r}")
    if value > largest:
        raise argparse.ArgumentTypeError(f"expected {what}; got {text!r}, more than the largest accepted, {largest}")
    return value


def _finite(text, what, positive):
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not np.isfinite(value) or value < 0 or (positive and value == 0):
        raise argparse.ArgumentTypeError(f"expected {what}; got {text!r}")
    return value


def positive_int(text):
    """A size or a count: a whole number > 0."""
    return _whole(text, 1, "a whole number > 0")


def nonnegative_int(text):
    """A seed: a whole number >= 0."""
    return _whole(text, 0, "a whole number >= 0")


def positive_float(text):
    """A rate or a scale: a finite number > 0."""
    return _finite(text, "a finite number > 0", positive=True)


def nonnegative_float(text):
    """A latency: a finite number >= 0."""
    return _finite(text, "a finite number >= 0", positive=False)


def window_size(text):
    """One side of a sliding window: a whole number of tokens >= 0, or -1 for unbounded."""
    return _whole(text, -1, "a window size: a whole number >= 0, or -1 for unbounded", LARGEST_WINDOW)


def dtype_argument(text):
    """An element type, by any spelling dtypes.parse_dtype takes; its canonical name ('bfloat16', ...)."""
    try:
        return dtype_name(parse_dtype(text))
    except DTypeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def kernel_dtype_argument(text):
    """An input element type the CUDA kernels run (launch.dtype_kind says which); its canonical name."""
    from .backends.cuda.launch import dtype_kind

    name = dtype_argument(text)
    try:
        dtype_kind(parse_dtype(name))
    except BackendError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def parse_window(text):
    """'L' -> (L, 0) (the L tokens before each query and itself); 'L,R' -> (L, R); -1 unbounded."""
    parts = text.split(",")
    if len(parts) not in (1, 2):
        raise argparse.ArgumentTypeError(f"expected L or L,R (window sizes, -1 unbounded); got {text!r}")
    sizes = [window_size(part) for part in parts]
    return (sizes[0], sizes[1] if len(sizes) == 2 else 0)
