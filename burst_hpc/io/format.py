"""The burst-hpc HDF5 file format (see docs/USAGE.md): dataset names, how dtypes are stored and read
back, chunking, slabs, and the stamp every file carries.

- datasets ``q`` (B, S, Hq, D), ``k``, ``v`` (B, S, Hkv, D) and optionally ``do`` (like ``q``)
  and ``cu_seqlens`` (int, [0, ..., S]: document offsets of a packed sequence, the same for every
  batch entry); outputs ``o`` (like ``q``), ``lse`` float32 (B, Hq, S) and optionally ``dq``, ``dk``, ``dv``.
  Tokens are stored in global order whatever layout a run used.
- float16 / float32 / float64 are stored natively; bfloat16 is stored as uint16 bits with the
  dataset attribute ``dtype = "bfloat16"``.
- every dataset is chunked along the token axis; file attributes record the format, the library
  version (:func:`stamp`), shapes, dtype and (for outputs) causal, scale and how the run was made.
"""
import time

import numpy as np

from .. import __version__
from ..dtypes import SUPPORTED, bfloat16
from ..errors import DTypeError

FORMAT = "burst-hpc/1"
INPUTS = ("q", "k", "v", "do")
GRADS = ("dq", "dk", "dv")
TOKEN_AXIS = {"q": 1, "k": 1, "v": 1, "do": 1, "o": 1, "dq": 1, "dk": 1, "dv": 1, "lse": 2}
CHUNK_BYTES = 1 << 20  # aim for about 1 MiB per chunk


def stamp(f, attrs=None):
    """Mark open file ``f`` as this format and library version, then set ``attrs`` on it."""
    f.attrs["format"] = FORMAT
    f.attrs["burst_hpc_version"] = __version__
    for key, value in (attrs or {}).items():
        f.attrs[key] = value


# --------------------------------------------------------------------------- dtypes

def stored_dtype(dtype):
    """(HDF5 dtype, attrs) for an array dtype: bfloat16 becomes uint16 plus a dtype attribute."""
    dtype = np.dtype(dtype)
    if dtype == bfloat16:
        return np.dtype(np.uint16), {"dtype": "bfloat16"}
    return dtype, {}


def dataset_dtype(ds, name="dataset", path=""):
    """The logical dtype of an HDF5 dataset (bfloat16 when stored as tagged uint16)."""
    tag = ds.attrs.get("dtype")
    if isinstance(tag, bytes):
        tag = tag.decode()
    if tag == "bfloat16":
        if ds.dtype != np.uint16:
            raise DTypeError(f"{path}: dataset {name!r} is tagged bfloat16 but stored as {ds.dtype}; expected uint16")
        return bfloat16
    dtype = np.dtype(ds.dtype)
    if dtype not in SUPPORTED or dtype == bfloat16:
        hint = " (bfloat16 must be stored as uint16 with attribute dtype='bfloat16')" if dtype == np.uint16 else ""
        raise DTypeError(f"{path}: dataset {name!r} has unsupported dtype {dtype}{hint}; "
                         "use float16, bfloat16, float32 or float64")
    return dtype


def to_stored(array):
    """``array`` as it is stored: C-contiguous, bfloat16 viewed as its uint16 bits."""
    array = np.ascontiguousarray(array)
    return array.view(np.uint16) if array.dtype == bfloat16 else array


def from_stored(array, dtype):
    """A stored array read back as ``dtype`` (uint16 bits viewed as bfloat16)."""
    return array.view(bfloat16) if np.dtype(dtype) == bfloat16 else array


# --------------------------------------------------------------------------- chunks and slabs

def chunk_shape(shape, itemsize, token_axis):
    """Chunks of whole rows along the token axis (a power of two of tokens, about CHUNK_BYTES)."""
    row = int(np.prod([n for i, n in enumerate(shape) if i > token_axis], dtype=np.int64)) * itemsize
    tokens = 1
    while tokens * 2 * max(row, 1) <= CHUNK_BYTES:
        tokens *= 2
    chunk = [1] * len(shape)
    chunk[token_axis] = max(1, min(shape[token_axis], tokens))
    for i in range(token_axis + 1, len(shape)):
        chunk[i] = max(1, shape[i])
    return tuple(chunk)


def create_dataset(f, name, shape, dtype):
    """A chunked dataset for a tensor of ``dtype`` (token axis from TOKEN_AXIS, else 1)."""
    stored, attrs = stored_dtype(dtype)
    chunks = chunk_shape(shape, stored.itemsize, TOKEN_AXIS.get(name, 1)) if all(shape) else None
    # no fill values written: every element is written by a rank (parallel HDF5 allocates every
    # chunk when the dataset is created and would otherwise write the whole dataset twice)
    ds = f.create_dataset(name, shape=shape, dtype=stored, chunks=chunks, fill_time="never")
    for key, value in attrs.items():
        ds.attrs[key] = value
    return ds


def write_slab(ds, index, array):
    """Write ``array`` into ``ds[index]`` in its stored form."""
    ds[index] = to_stored(array)


def read_slab(ds, index, dtype):
    """``ds[index]`` read back as ``dtype``."""
    return from_stored(np.asarray(ds[index]), dtype)


def fixed_text(text, size):
    """An ASCII attribute value of exactly ``size`` bytes (``text`` cut to fit), so that it can be
    rewritten in place later (:func:`modify_attrs`)."""
    return np.array(text[:size].encode("ascii"), dtype=f"S{size}")


def modify_attrs(path, values, tries=5):
    """Rewrite attributes of the published file ``path`` in place, in the order of ``values``
    ({name: value}; each made with its final size when the file was created), from one process.
    Tried a few times: a reader that has the file open holds HDF5's lock on it for a moment."""
    import h5py

    for attempt in range(tries):
        try:
            with h5py.File(path, "r+") as f:
                for name, value in values.items():
                    f.attrs.modify(name, value)
            return
        except OSError:
            if attempt == tries - 1:
                raise
            time.sleep(0.5)
