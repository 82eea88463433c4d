"""HDF5 in and out, each MPI rank touching only its own tokens.

File format (see docs/USAGE.md):
- datasets ``q`` (B, S, Hq, D), ``k``, ``v`` (B, S, Hkv, D) and optionally ``do`` (like ``q``)
  and ``cu_seqlens`` (int, [0, ..., S]: document offsets of a packed sequence, the same for every
  batch entry); outputs ``o`` (like ``q``), ``lse`` float32 (B, Hq, S) and optionally ``dq``, ``dk``, ``dv``.
  Tokens are stored in global order whatever layout a run used.
- float16 / float32 / float64 are stored natively; bfloat16 is stored as uint16 bits with the
  dataset attribute ``dtype = "bfloat16"``.
- every dataset is chunked along the token axis; file attributes record the format, the library
  version, shapes, dtype and (for outputs) causal, scale and how the run was made.

Reading: every rank opens the input read-only and reads only the token runs it owns
(both halves under the zigzag layout).

Writing: the output is built under a temporary name next to the final one (``OUT.tmp-<host>-<pid>-<tag>``,
see jobsafety) and published only once every rank has written its part, so a failure never leaves a
file under the output's name; publishing never replaces a file that appeared under that name while
the job ran (unless ``overwrite``). Rank 0 holds the lock of the temporary file's sidecar
(``OUT.tmp-...lock``) from before the file exists until it is published or removed, so
``burst-hpc clean`` never removes a running job's file, whatever program the job is.
With an MPI-enabled h5py the ranks write through parallel HDF5 (driver ``mpio``); otherwise rank 0
creates the file and the ranks write their token runs one after another, passing a token along
the ranks (each opens, writes, closes, then hands on), which is safe on any file system.

Every collective step ends with :func:`agree`: if any rank failed, every rank raises the same
error (the lowest failing rank's message), so the job exits cleanly everywhere.
"""
import math
import os

import numpy as np

from . import __version__, jobsafety
from .collective import agree, describe
from .dtypes import SUPPORTED, accum_dtype, bfloat16, dtype_name
from .errors import BurstError, DTypeError, FileError, MaskError, ShapeError
from .layout import check_split, pieces

FORMAT = "burst-hpc/1"
INPUTS = ("q", "k", "v", "do")
GRADS = ("dq", "dk", "dv")
TOKEN_AXIS = {"q": 1, "k": 1, "v": 1, "do": 1, "o": 1, "dq": 1, "dk": 1, "dv": 1, "lse": 2}
CHUNK_BYTES = 1 << 20  # aim for about 1 MiB per chunk
# writes go straight to the file (no chunk cache): a failed write (disk full, quota) raises at the
# write call, instead of when HDF5 flushes the cache while closing a dataset, after which it crashes
WRITE_OPTS = {"rdcc_nbytes": 0}
_TAG = 7301


# --------------------------------------------------------------------------- dtypes and chunks

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
    array = np.ascontiguousarray(array)
    return array.view(np.uint16) if array.dtype == bfloat16 else array


def from_stored(array, dtype):
    return array.view(bfloat16) if np.dtype(dtype) == bfloat16 else array


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
    ds[index] = to_stored(array)


def read_slab(ds, index, dtype):
    return from_stored(np.asarray(ds[index]), dtype)


# --------------------------------------------------------------------------- inputs

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


def _open_read(path):
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
    with _open_read(path) as f:
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
    from .masks import check_cu_seqlens

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


def read_tokens(ds, runs, dtype, token_axis=1):
    """The token runs ``[(start, length), ...]`` of a dataset, concatenated along ``token_axis``."""
    parts = []
    for start, n in runs:
        index = (slice(None),) * token_axis + (slice(start, start + n),)
        parts.append(read_slab(ds, index, dtype))
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=token_axis)


def read_shards(path, comm, layout, names=("q", "k", "v")):
    """(InputSpec, {name: this rank's shard}) for ``names``; collective, errors agreed on every rank.

    Each rank reads only its own token runs (both zigzag halves) with the file opened read-only.
    """
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    spec, shards, err = None, {}, None
    try:
        with _open_read(path) as f:
            spec = _inspect(f, path, names)
            check_split(spec.seqlen, size, layout)
            runs = pieces(spec.seqlen, rank, size, layout)
            for name in names:
                shards[name] = read_tokens(f[name], runs, spec.dtype)
    except Exception as e:  # noqa: BLE001 - every failure is agreed across ranks below
        err = e
    agree(comm, err)
    return spec, shards


def _first_nonfinite(x, block_tokens=4096):
    """(index, value) of the first NaN or Inf of x (B, S, ...) in C order, or None; a block of
    tokens at a time, so the mask never costs more than a block."""
    for b in range(x.shape[0]):
        for t0 in range(0, x.shape[1], block_tokens):
            bad = ~np.isfinite(x[b, t0:t0 + block_tokens])
            if bad.any():
                t, *rest = np.unravel_index(int(np.argmax(bad)), bad.shape)
                index = (b, t0 + int(t), *map(int, rest))
                return index, float(x[index])
    return None


def check_finite(path, shards, comm, layout, seqlen, scale=None):
    """Collective: refuse NaN and Inf in the input shards (this rank's tokens of each dataset), and
    finite values so large that the kernels' sums overflow (:func:`check_range`; ``scale``: the
    softmax scale of the run, default head_dim**-0.5).

    Every rank raises the same FileError, naming the dataset and the first non-finite value in the
    file's order (datasets q, k, v, do; then batch, token, head, dim with global token positions)."""
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    runs = pieces(seqlen, rank, size, layout)
    mine = None
    for order, name in enumerate(INPUTS):
        found = _first_nonfinite(shards[name]) if name in shards else None
        if found is not None:
            (b, t, *rest), value = found
            for start, n in runs:  # local token t -> its position in the file
                if t < n:
                    break
                t -= n
            mine = (order, b, start + t, *rest, name, value)
            break
    largest = largest_magnitudes(shards) if mine is None else None
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
    check_range(path, largest, head_dim, seqlen, head_dim ** -0.5 if scale is None else scale, shards["q"].dtype)


def largest_magnitudes(shards):
    """{dataset: max |value|} of this rank's shards (0.0 for an empty one), as floats."""
    return {name: max(float(x.max()), -float(x.min())) if x.size else 0.0 for name, x in shards.items()}


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


# --------------------------------------------------------------------------- outputs

def _mpio_enabled(comm):
    import h5py

    if comm is None or comm.size == 1 or os.environ.get("BURST_HPC_HDF5_MPIO", "1") == "0":
        return False
    return bool(h5py.get_config().mpi)


def write_path(size):
    """How a run on ``size`` ranks writes its output (``burst-hpc info`` prints it)."""
    import h5py

    if not h5py.get_config().mpi:
        return ("rank-ordered token passing (this h5py has no parallel HDF5; 'make setup-phdf5' builds one "
                "against Debian's libhdf5-openmpi-dev)")
    if os.environ.get("BURST_HPC_HDF5_MPIO", "1") == "0":
        return "rank-ordered token passing (BURST_HPC_HDF5_MPIO=0; this h5py has parallel HDF5)"
    if size < 2:
        return "parallel HDF5 (mpio driver) with 2 or more ranks; one rank writes alone"
    return "parallel HDF5 (mpio driver): every rank writes its tokens at once"


class OutputFile:
    """One HDF5 output written by every rank, visible under its name only after :meth:`commit`.

    Collective use (every rank, same order)::

        out = OutputFile.create(path, comm, {"o": (shape, dtype), ...}, attrs)   # early: path checked
        try:
            out.write(shards, layout)        # each rank writes only its token runs
            out.commit()                     # rename once every rank has finished
        except BaseException:
            out.abort()                      # temporary file removed; nothing under ``path``
            raise
    """

    def __init__(self, path, tmp, comm, datasets, mpio):
        self.path, self.tmp, self.comm, self.datasets, self.mpio = path, tmp, comm, datasets, mpio
        self.done = False
        self.overwrite = False

    @property
    def rank(self):
        return self.comm.rank if self.comm is not None else 0

    @property
    def size(self):
        return self.comm.size if self.comm is not None else 1

    @classmethod
    def create(cls, path, comm, datasets, attrs=None, inputs=(), overwrite=False):
        """Create the temporary file with every dataset and attribute (collective). An existing
        file at ``path`` is refused unless ``overwrite``."""
        import h5py

        rank = comm.rank if comm is not None else 0
        mpio = _mpio_enabled(comm)
        tmp, err = None, None
        if rank == 0:
            try:
                tmp = check_output_path(path, inputs, overwrite)
                jobsafety.hold(tmp)  # rank 0 owns the file: its lock says the job runs
                jobsafety.check_space(os.path.dirname(tmp), _bytes_needed(datasets), f"output {path!r}")
            except Exception as e:  # noqa: BLE001
                err = e
                if tmp is not None:
                    jobsafety.release(tmp)
        if comm is not None and comm.size > 1:
            tmp = comm.bcast(tmp, root=0)
        agree(comm, err)
        self = cls(path, tmp, comm, dict(datasets), mpio)
        self.overwrite = overwrite
        jobsafety.track(tmp)  # every rank: a signal on any rank removes it
        err = None
        try:
            if mpio:
                self._mpio("w", lambda f: self._layout(f, attrs), f"cannot write output {path!r}")
            elif rank == 0:
                with h5py.File(tmp, "w", **WRITE_OPTS) as f:
                    self._layout(f, attrs)
        except Exception as e:  # noqa: BLE001
            err = _io_failure(f"cannot write output {path!r}", e, tmp)
        try:
            agree(comm, err)
        except BurstError:
            self._remove()
            raise
        return self

    def _layout(self, f, attrs):
        for name, (shape, dtype) in self.datasets.items():
            create_dataset(f, name, tuple(int(n) for n in shape), dtype)
        f.attrs["format"] = FORMAT
        f.attrs["burst_hpc_version"] = __version__
        for key, value in (attrs or {}).items():
            f.attrs[key] = value

    def write(self, shards, layout):
        """Write this rank's shards ``{name: array}`` (local layout order) into their token runs."""
        import h5py

        err = None
        if self.mpio:
            try:
                self._mpio("r+", lambda f: self._write_mine(f, shards, layout),
                           f"writing {self.path!r} failed on rank {self.rank}")
            except Exception as e:  # noqa: BLE001
                err = e
        else:
            # rank-ordered: wait for the previous rank's token, write, close, hand the token on
            failed = False
            if self.rank > 0:
                failed = self.comm.recv(source=self.rank - 1, tag=_TAG)
            if not failed:
                try:
                    with h5py.File(self.tmp, "r+", **WRITE_OPTS) as f:
                        self._write_mine(f, shards, layout)
                except Exception as e:  # noqa: BLE001
                    err = e
            if self.rank < self.size - 1:
                self.comm.send(bool(failed or err), dest=self.rank + 1, tag=_TAG)
        if err is not None:
            err = _io_failure(f"writing {self.path!r} failed on rank {self.rank}", err, self.tmp)
        agree(self.comm, err)

    def _mpio(self, mode, fn, what):
        """Parallel HDF5: open, ``fn(f)``, close, all collective. Our own checks (a BurstError)
        raise before the ranks' HDF5 calls diverge and are agreed as usual. An HDF5 failure (disk
        full, quota) on some ranks leaves the others inside an HDF5 collective that never
        completes, and closing the file would wait for them too: the failing rank then removes the
        temporary file, says why in one line and aborts the job, instead of a hang."""
        import h5py

        f = h5py.File(self.tmp, mode, driver="mpio", comm=self.comm, **WRITE_OPTS)
        try:
            try:
                fn(f)
            except BurstError:
                f.close()
                raise
            f.close()
        except BurstError:
            raise
        except Exception as e:  # noqa: BLE001
            _NEVER_CLOSED.append(f)  # its close is collective: it must not run at garbage collection
            jobsafety.abort_job(f"{_io_failure(what, e, self.tmp)}; parallel HDF5 cannot go on after a failed "
                                "collective write, so the job is stopped")

    def _write_mine(self, f, shards, layout):
        for name, array in shards.items():
            if name not in self.datasets:
                raise BurstError(f"output dataset {name!r} was not declared")
            shape, dtype = self.datasets[name]
            axis = TOKEN_AXIS.get(name, 1)
            array = np.asarray(array)
            if array.dtype != np.dtype(dtype):
                array = array.astype(dtype)
            seqlen = shape[axis]
            offset = 0
            for start, n in pieces(seqlen, self.rank, self.size, layout):
                src = (slice(None),) * axis + (slice(offset, offset + n),)
                dst = (slice(None),) * axis + (slice(start, start + n),)
                write_slab(f[name], dst, array[src])
                offset += n
            if offset != array.shape[axis]:
                raise ShapeError(f"output {name!r}: shard has {array.shape[axis]} tokens, layout gives {offset}")

    def commit(self):
        """Publish the temporary file under the output's name once every rank has finished; a file
        that appeared there meanwhile is replaced only with ``overwrite`` (else every rank raises
        the FileError that says where this job's result is kept)."""
        err = None
        if self.comm is not None and self.size > 1:
            self.comm.Barrier()
        if self.rank == 0:
            try:
                jobsafety.publish(self.tmp, self.path, self.overwrite)
            except FileError as e:
                err = e
            except OSError as e:
                err = FileError(f"cannot move the finished output to {self.path!r}: {e}")
            if err is None or getattr(err, "kept", None):
                jobsafety.release(self.tmp)  # published or kept: the temporary name is gone
        jobsafety.untrack(self.tmp)  # published, kept or gone: no longer ours to remove
        if getattr(err, "kept", None):
            self.done = True  # the result lives under the kept name: abort must not touch it
        try:
            agree(self.comm, err)
        except BurstError:
            self._remove()
            raise
        self.done = True

    def abort(self):
        """Remove the temporary file (rank 0; no communication, safe after any agreed error)."""
        if not self.done:
            self._remove()

    def _remove(self):
        if self.tmp:
            jobsafety.untrack(self.tmp)
        if self.rank == 0 and not self.done and self.tmp:
            try:
                os.remove(self.tmp)
            except OSError:
                pass
            jobsafety.release(self.tmp)  # after the file: its lock guards it until it is gone


_NEVER_CLOSED = []


def _bytes_needed(datasets):
    """Bytes of the datasets plus room for HDF5's metadata and chunk index."""
    data = sum(math.prod(map(int, shape)) * stored_dtype(dtype)[0].itemsize  # Python ints: no int64 overflow
               for shape, dtype in datasets.values())
    return int(data * 1.01) + (256 << 10)


def _full(path):
    """True when the file system holding ``path`` has (almost) no space left."""
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)))
    except (OSError, TypeError):
        return False
    return st.f_bavail * st.f_frsize < (64 << 10)


def _io_failure(what, error, path=None):
    """A FileError for a failed HDF5 write, in one line (ENOSPC and EDQUOT named plainly); an
    OS-level failure also marks HDF5 as broken, so the process exits without its exit handler."""
    if isinstance(error, BurstError):
        return FileError(f"{what}: {error}")
    jobsafety.note_hdf5_failure()
    text = str(error)
    if "errno = 28" in text or getattr(error, "errno", None) == 28 or _full(path):
        reason = "the file system is full (No space left on device)"
    elif "errno = 122" in text or getattr(error, "errno", None) == 122:
        reason = "the disk quota is exceeded"
    else:
        reason = describe(error).split("\n")[0]
    return FileError(f"{what}: {reason}")


def check_output_path(path, inputs=(), overwrite=False):
    """Validate the output path (on one rank) and return a temporary name next to it. An existing
    file at ``path`` is an error unless ``overwrite`` (it is then replaced atomically on commit)."""
    if not path:
        raise FileError("no output path given")
    full = os.path.abspath(path)
    for src in inputs:
        if src and os.path.exists(src) and os.path.exists(full) and os.path.samefile(src, full):
            raise FileError(f"output {path!r} is the input file; choose another name")
    if os.path.isdir(full):
        raise FileError(f"cannot write output {path!r}: it is a directory")
    parent = os.path.dirname(full)
    if not os.path.isdir(parent):
        raise FileError(f"cannot write output {path!r}: directory {parent!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise FileError(f"cannot write output {path!r}: directory {parent!r} is not writable")
    if os.path.lexists(full) and not overwrite:
        raise FileError(f"output {path!r} already exists; pass --overwrite to replace it (or choose another name)")
    return jobsafety.temp_name(full)


def output_datasets(spec, backward):
    """Output dataset declarations {name: (shape, dtype)} for a run over ``spec``."""
    out = {"o": (spec.shape("q"), spec.dtype), "lse": (spec.shape("lse"), np.dtype(np.float32))}
    if backward:
        for name in GRADS:
            out[name] = (spec.shape(name), spec.dtype)
    return out


# --------------------------------------------------------------------------- whole-file helpers

def read_global(path, names=None):
    """{name: whole array} from a burst-hpc file (single process; small files, tests)."""
    with _open_read(path) as f:
        out = {}
        for name in names or list(f.keys()):
            if name not in f:
                raise FileError(f"{path}: dataset {name!r} is missing")
            if name == "cu_seqlens":  # document offsets: integers, not a tensor
                out[name] = np.asarray(f[name][()])
            else:
                out[name] = read_slab(f[name], (), dataset_dtype(f[name], name, path))
        return out


def write_global(path, arrays, attrs=None, overwrite=False):
    """Write whole arrays {name: array} into a new file atomically (single process)."""
    def fill(f):
        for name, array in arrays.items():
            array = np.asarray(array)
            ds = create_dataset(f, name, array.shape, array.dtype)
            if array.size:
                write_slab(ds, (), array)
        f.attrs["format"] = FORMAT
        f.attrs["burst_hpc_version"] = __version__
        for key, value in (attrs or {}).items():
            f.attrs[key] = value

    needed = sum(np.asarray(a).nbytes for a in arrays.values())
    write_new(path, fill, overwrite, _bytes_needed({0: ((needed,), np.uint8)}))


def write_new(path, fill, overwrite=False, needed=0):
    """Single process: build a new HDF5 file with ``fill(f)`` under a temporary name and publish it
    (never replacing a file that appeared meanwhile, unless ``overwrite``). A failed write (disk
    full, quota) raises one FileError and leaves no file behind."""
    import h5py

    tmp = check_output_path(path, overwrite=overwrite)
    held = tmp
    try:
        jobsafety.hold(held)
        jobsafety.track(tmp)
        jobsafety.check_space(os.path.dirname(tmp), needed, f"output {path!r}")
        failure = None
        try:
            with h5py.File(tmp, "w", **WRITE_OPTS) as f:
                fill(f)
        except BurstError:
            raise
        except Exception as e:  # noqa: BLE001 - one line below, without HDF5's objects in a traceback
            failure = _io_failure(f"cannot write {path!r}", e, tmp)
        if failure is not None:
            raise failure
        try:
            jobsafety.publish(tmp, path, overwrite)
        except FileError:
            tmp = None  # lost a race: the result stays under the name the message gives
            raise
    finally:
        if tmp is not None:
            jobsafety.untrack(tmp)
            if os.path.exists(tmp):
                os.remove(tmp)
        jobsafety.release(held)


# --------------------------------------------------------------------------- random inputs

GEN_BLOCK_TOKENS = 1024  # random numbers come in blocks of this many tokens (fixed: same data whatever chunking)


def generate(path, batch, seqlen, heads, kv_heads, head_dim, dtype, seed=0, with_grad=False,
             max_elements=1 << 22, attrs=None, progress=None, overwrite=False, documents=None):
    """Write random standard-normal q, k, v (and do) to ``path``, chunk by chunk (single process).
    ``documents``: also write ``cu_seqlens`` for that many documents of random lengths.

    A block of GEN_BLOCK_TOKENS tokens of one batch entry of one tensor draws from its own
    generator seeded by (seed, tensor, batch, block), so the data does not depend on how much is
    written at once, and no more than about ``max_elements`` values are in memory at a time.
    The file is built under a temporary name and renamed when complete; an existing file at
    ``path`` is refused unless ``overwrite``.
    """
    dtype = np.dtype(dtype)
    for label, n in (("batch", batch), ("seqlen", seqlen), ("heads", heads), ("kv-heads", kv_heads),
                     ("head-dim", head_dim)):
        if n < 1:
            raise ShapeError(f"--{label} must be positive; got {n}")
    if heads % kv_heads:
        raise ShapeError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    cu_seqlens = None
    if documents is not None:
        from .masks import random_documents

        cu_seqlens = random_documents(np.random.default_rng([int(seed), 1 << 20]), seqlen, documents)
    names = ("q", "k", "v", "do") if with_grad else ("q", "k", "v")
    shapes = {"q": (batch, seqlen, heads, head_dim), "k": (batch, seqlen, kv_heads, head_dim)}
    shapes["v"] = shapes["k"]
    shapes["do"] = shapes["q"]
    total = sum(batch * seqlen * shapes[n][2] * head_dim for n in names)
    written = 0

    def fill(f):
        nonlocal written
        f.attrs["format"] = FORMAT
        f.attrs["burst_hpc_version"] = __version__
        f.attrs["kind"] = "inputs"
        f.attrs["seed"] = int(seed)
        f.attrs["batch"], f.attrs["seqlen"] = batch, seqlen
        f.attrs["heads"], f.attrs["kv_heads"], f.attrs["head_dim"] = heads, kv_heads, head_dim
        f.attrs["dtype"] = dtype_name(dtype)
        for key, value in (attrs or {}).items():
            f.attrs[key] = value
        if cu_seqlens is not None:
            f.create_dataset("cu_seqlens", data=cu_seqlens)
        for t, name in enumerate(names):
            shape = shapes[name]
            ds = create_dataset(f, name, shape, dtype)
            row = shape[2] * head_dim
            blocks_per_write = max(1, max_elements // (GEN_BLOCK_TOKENS * row))
            step = blocks_per_write * GEN_BLOCK_TOKENS
            for b in range(batch):
                for s0 in range(0, seqlen, step):
                    s1 = min(seqlen, s0 + step)
                    buf = np.empty((1, s1 - s0, shape[2], head_dim), dtype)
                    for blk0 in range(s0, s1, GEN_BLOCK_TOKENS):
                        blk1 = min(s1, blk0 + GEN_BLOCK_TOKENS)
                        rng = np.random.default_rng([int(seed), t, b, blk0 // GEN_BLOCK_TOKENS])
                        values = rng.standard_normal((1, blk1 - blk0, shape[2], head_dim), np.float32)
                        buf[:, blk0 - s0:blk1 - s0] = values.astype(dtype)
                    write_slab(ds, (slice(b, b + 1), slice(s0, s1)), buf)
                    written += buf.size
                    if progress is not None:
                        progress(written, total)

    write_new(path, fill, overwrite, _bytes_needed({0: ((total,), dtype)}))
    return names if cu_seqlens is None else names + ("cu_seqlens",)
