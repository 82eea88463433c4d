"""Reading inputs: what a file holds (:func:`inspect_input`), each rank's own tokens
(:func:`read_shards`), and the checks on the values read (finite, and small enough for the sums).

Every rank opens the input read-only and reads only the token runs it owns (both halves under the
zigzag layout). The collective steps end with :func:`agree`: if any rank failed, every rank raises
the same error (the lowest failing rank's message).
"""
import math
import os

import numpy as np

from ..collective import agree
from ..dtypes import accum_dtype, dtype_name, largest_magnitude, nonfinite
from ..errors import DTypeError, FileError, MaskError, ShapeError
from ..plan.layout import as_layout
from .format import INPUTS, dataset_dtype, read_slab


class InputSpec:
    """What an input file holds: shapes and dtype of q, k, v (and do)."""

    def __init__(self, path, batch, seqlen, heads, kv_heads, head_dim, dtype, names, attrs, cu_seqlens=None):
        self.path, self.cu_seqlens = path, cu_seqlens
        self.batch, self.seqlen, self.heads, self.kv_heads, self.head_dim = batch, seqlen, heads, kv_heads, head_dim
        self.dtype = dtype
        self.names = names
        self.attrs = attrs

    @property
    def has_grad(self):
        return "do" in self.names

    def shape(self, name):
        if name in ("k", "v", "dk", "dv"):
            return (self.batch, self.seqlen, self.kv_heads, self.head_dim)
        if name == "lse":
            return (self.batch, self.heads, self.seqlen)
        return (self.batch, self.seqlen, self.heads, self.head_dim)

    def describe(self):
        docs = "" if self.cu_seqlens is None else f" documents={len(self.cu_seqlens) - 1}"
        return (f"B={self.batch} S={self.seqlen} Hq={self.heads} Hkv={self.kv_heads} D={self.head_dim} "
                f"dtype={dtype_name(self.dtype)}{docs}")


def open_input(path):
    """``path`` opened read-only as an h5py File; FileError when it is missing or not HDF5."""
    import h5py

    if not os.path.exists(path):
        raise FileError(f"input file {path!r} does not exist")
    if os.path.isdir(path):
        raise FileError(f"input {path!r} is a directory, not an HDF5 file")
    try:
        return h5py.File(path, "r")
    except OSError as e:
        raise FileError(f"cannot open {path!r} as HDF5: {e}") from None


def inspect_input(path, need=("q", "k", "v")):
    """Check an input file's datasets and return its InputSpec (reads metadata only)."""
    with open_input(path) as f:
        return _inspect(f, path, need)


def _inspect(f, path, need):
    import h5py

    names = [n for n in INPUTS if n in f]
    for name in need:
        if name not in f:
            hint = " (make one with: burst-hpc gen ... --with-grad)" if name == "do" else ""
            raise FileError(f"{path}: dataset {name!r} is missing{hint}; found {sorted(f.keys()) or 'no datasets'}")
        if not isinstance(f[name], h5py.Dataset):
            raise FileError(f"{path}: {name!r} is a group, not a dataset")
    dtypes = {n: dataset_dtype(f[n], n, path) for n in names}
    shapes = {n: tuple(f[n].shape) for n in names}
    for n in names:
        if len(shapes[n]) != 4:
            raise ShapeError(f"{path}: dataset {n!r} must be rank 4 (batch, seqlen, heads, head_dim); got shape {shapes[n]}")
    b, s, hq, d = shapes["q"]
    _, sk, hkv, dk = shapes["k"]
    if shapes["v"] != shapes["k"]:
        raise ShapeError(f"{path}: k and v must have the same shape; got {shapes['k']} and {shapes['v']}")
    if shapes["k"][0] != b or dk != d:
        raise ShapeError(f"{path}: q {shapes['q']} and k {shapes['k']} must agree in batch and head_dim")
    if sk != s:
        raise ShapeError(f"{path}: q has {s} tokens but k and v have {sk}; the ring splits one sequence, they must match")
    if hkv == 0 or hq % hkv:
        raise ShapeError(f"{path}: query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if 0 in shapes["q"]:
        raise ShapeError(f"{path}: q has an empty dimension: {shapes['q']}")
    if "do" in names and shapes["do"] != shapes["q"]:
        raise ShapeError(f"{path}: do must have q's shape {shapes['q']}; got {shapes['do']}")
    for n in names:
        if dtypes[n] != dtypes["q"]:
            raise DTypeError(f"{path}: all inputs must share one dtype; q is {dtype_name(dtypes['q'])}, "
                             f"{n} is {dtype_name(dtypes[n])}")
    attrs = {key: _plain(value) for key, value in f.attrs.items()}
    return InputSpec(path, b, s, hq, hkv, d, dtypes["q"], tuple(names), attrs, _documents(f, path, s))


def _documents(f, path, seqlen):
    """The optional ``cu_seqlens`` dataset, checked (every rank reads it: it is small)."""
    import h5py

    if "cu_seqlens" not in f:
        return None
    if not isinstance(f["cu_seqlens"], h5py.Dataset):
        raise FileError(f"{path}: 'cu_seqlens' is a group, not a dataset")
    from ..plan.masks import check_cu_seqlens

    try:
        return check_cu_seqlens(f["cu_seqlens"][()], seqlen)
    except MaskError as e:
        raise MaskError(f"{path}: dataset 'cu_seqlens': {e}") from None


def _plain(value):
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    return value


def read_tokens(ds, slabs, dtype, token_axis=1):
    """The token slabs ``[(start, stop), ...]`` of a dataset (Layout.slabs), concatenated along ``token_axis``."""
    parts = []
    for start, stop in slabs:
        index = (slice(None),) * token_axis + (slice(start, stop),)
        parts.append(read_slab(ds, index, dtype))
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=token_axis)


def read_shards(path, comm, layout, names=("q", "k", "v"), spec=None):
    """(InputSpec, {name: this rank's shard}) for ``names``; collective, errors agreed on every rank.

    Each rank reads only its own token slabs in ``layout`` (a plan.layout.Layout of the file's length
    over the ranks of ``comm``, or a layout's name: both zigzag halves) with the file opened read-only.
    ``spec``: the file's InputSpec from :func:`inspect_input` (on this rank, with ``need`` covering
    ``names``), so the file is not inspected again; None inspects it here.
    """
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    shards, err = {}, None
    try:
        with open_input(path) as f:
            if spec is None:
                spec = _inspect(f, path, names)
            else:
                _check_inspected(spec, path, names)
            layout = as_layout(layout, spec.seqlen, size)
            for name in names:
                shards[name] = read_tokens(f[name], layout.slabs(rank), spec.dtype)
    except Exception as e:  # noqa: BLE001 - every failure is agreed across ranks below
        err = e
    agree(comm, err)
    return spec, shards


def _check_inspected(spec, path, names):
    """Refuse a ``spec`` that is not of ``path`` or lacks one of ``names``."""
    if os.path.abspath(spec.path) != os.path.abspath(path):
        raise FileError(f"{path}: the InputSpec given was inspected from {spec.path!r}, another file")
    for name in names:
        if name not in spec.names:
            raise FileError(f"{path}: dataset {name!r} is missing; the inspected input holds {', '.join(spec.names)}")


def _first_nonfinite(x, block_tokens=4096):
    """(index, value) of the first NaN or Inf of x (B, S, ...) in C order, or None; a block of
    tokens at a time, so the mask never costs more than a block."""
    for b in range(x.shape[0]):
        for t0 in range(0, x.shape[1], block_tokens):
            bad = nonfinite(x[b, t0:t0 + block_tokens])
            if bad.any():
                t, *rest = np.unravel_index(int(bad.argmax()), bad.shape)
                index = (b, t0 + int(t), *map(int, rest))
                return index, float(x[index])
    return None


def check_finite(path, shards, comm, layout, scale=None):
    """Collective: refuse NaN and Inf in the input shards (this rank's tokens of each dataset), and
    finite values so large that the kernels' sums overflow (:func:`check_range`; ``scale``: the
    softmax scale of the run, default head_dim**-0.5).

    Every rank raises the same FileError, naming the dataset and the first non-finite value in the
    file's order (datasets q, k, v, do; then batch, token, head, dim with global token positions)."""
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    largest = largest_magnitudes(shards)   # one pass over the data; NaN or Inf when a shard holds one
    mine = None
    for order, name in enumerate(INPUTS):
        if name in shards and not math.isfinite(largest[name]):
            (b, t, *rest), value = _first_nonfinite(shards[name])
            mine = (order, b, int(layout.indices(rank)[t]), *rest, name, value)
            largest = None
            break
    everyone = [(mine, largest)] if size == 1 else comm.allgather((mine, largest))
    found = [f for f, _ in everyone if f is not None]
    if found:
        *_, b, t, h, d, name, value = min(found)
        error = FileError(f"{path}: dataset {name!r} holds {value} at [{b}, {t}, {h}, {d}] (batch, token, head, dim), "
                          "its first non-finite value; NaN or Inf inputs make NaN outputs. Fix the input, or pass "
                          "--allow-nonfinite to run on it anyway")
        error.agreed = True
        raise error
    largest = {name: max(theirs[name] for _, theirs in everyone) for name in largest}
    head_dim = shards["q"].shape[-1]
    check_range(path, largest, head_dim, layout.seqlen, head_dim ** -0.5 if scale is None else scale, shards["q"].dtype)


def largest_magnitudes(shards):
    """{dataset: max |value|} of this rank's shards (0.0 for an empty one), as floats: NaN or Inf
    for a shard that holds one."""
    return {name: largest_magnitude(x) for name, x in shards.items()}


# the kernels scale scores by scale * log2(e) for exp2 and sum in several orders: keep a factor 2 spare
RANGE_HEADROOM = 2.0


def check_range(path, largest, head_dim, seqlen, scale, dtype):
    """Refuse finite inputs so large that the float32 sums of the kernels (float64 for float64
    inputs) overflow, which makes every output NaN or Inf: FileError (marked agreed) naming the
    datasets and their largest magnitudes. ``largest``: {dataset: max |value|} over all ranks.
    Bounds, each times RANGE_HEADROOM below the accumulator's largest number: the scores,
    |scale q.k| <= max(1, scale) D max|q| max|k| (the dot product is formed before scaling); the
    output's running sum, <= S max|v| (softmax weights <= 1); with do, the backward's
    do.v <= D max|do| max|v|."""
    accum = accum_dtype(dtype)
    largest_sum = float(np.finfo(accum).max)
    bounds = [(("q", "k"), max(1.0, scale) * head_dim, "the scores scale * q.k"),
              (("v",), seqlen, "the output's running sum over the keys")]
    if "do" in largest:
        bounds.append((("do", "v"), head_dim, "the backward's do.v"))
    for names, factor, what in bounds:
        reach = float(factor) * math.prod(largest[name] for name in names)
        if reach * RANGE_HEADROOM > largest_sum:
            held = f"dataset {names[0]!r} holds values up to {largest[names[0]]:.3g} in magnitude"
            held += "".join(f" and {name!r} up to {largest[name]:.3g}" for name in names[1:])
            error = FileError(f"{path}: {held}: {what} may reach {reach:.3g}; {accum.name} sums overflow at "
                              f"{largest_sum:.3g}, so the outputs would be NaN or Inf. Scale the input down, or pass "
                              "--allow-nonfinite to run on it anyway")
            error.agreed = True
            raise error



# --------------------------------------------------------------------------- whole files

def read_global(path, names=None):
    """{name: whole array} from a burst-hpc file (single process; small files, tests)."""
    with open_input(path) as f:
        out = {}
        for name in names or list(f.keys()):
            if name not in f:
                raise FileError(f"{path}: dataset {name!r} is missing")
            if name == "cu_seqlens":  # document offsets: integers, not a tensor
                out[name] = np.asarray(f[name][()])
            else:
                out[name] = read_slab(f[name], (), dataset_dtype(f[name], name, path))
        return out


