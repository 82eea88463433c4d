"""An output's life: the output path checked, its size checked against the free space, the file
built under a temporary name and published once complete (:class:`OutputFile` for every rank of a
job; :func:`write_new` and :func:`write_global` for one process).

The output is built under a temporary name next to the final one (``OUT.tmp-<host>-<pid>-<tag>``,
see job/owner.py) and published only once every rank has written its part, so a failure never leaves a
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

from .. import config
from ..job import owner, publish, safety
from ..collective import abort_job, agree, describe
from ..errors import BurstError, FileError, ShapeError, size_text
from ..plan.layout import as_layout
from .format import GRADS, TOKEN_AXIS, create_dataset, stamp, stored_dtype, write_slab

# writes go straight to the file (no chunk cache): a failed write (disk full, quota) raises at the
# write call, instead of when HDF5 flushes the cache while closing a dataset, after which it crashes
WRITE_OPTS = {"rdcc_nbytes": 0}
_TAG = 7301


# --------------------------------------------------------------------------- every rank of a job

def _mpio_enabled(comm):
    """Whether the ranks of ``comm`` write through parallel HDF5 (driver ``mpio``)."""
    import h5py

    if comm is None or comm.size == 1 or not config.hdf5_mpio():
        return False
    return bool(h5py.get_config().mpi)


def write_path(size):
    """How a run on ``size`` ranks writes its output (``burst-hpc info`` prints it)."""
    import h5py

    if not h5py.get_config().mpi:
        return ("rank-ordered token passing (this h5py has no parallel HDF5; 'make setup-phdf5' builds one "
                "against Debian's libhdf5-openmpi-dev)")
    if not config.hdf5_mpio():
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
                owner.hold(tmp)  # rank 0 owns the file: its lock says the job runs
                check_space(os.path.dirname(tmp), bytes_needed(datasets), f"output {path!r}")
            except Exception as e:  # noqa: BLE001
                err = e
                if tmp is not None:
                    owner.release(tmp)
        if comm is not None and comm.size > 1:
            tmp = comm.bcast(tmp, root=0)
        agree(comm, err)
        self = cls(path, tmp, comm, dict(datasets), mpio)
        self.overwrite = overwrite
        safety.track(tmp)  # every rank: a signal on any rank removes it
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
        stamp(f, attrs)

    def write(self, shards, layout):
        """Write this rank's shards ``{name: array}`` (local order of ``layout``, a plan.layout.Layout or
        a layout's name) into their token slabs."""
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
            abort_job(f"{_io_failure(what, e, self.tmp)}; parallel HDF5 cannot go on after a failed "
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
            offset = 0
            for start, stop in as_layout(layout, shape[axis], self.size).slabs(self.rank):
                src = (slice(None),) * axis + (slice(offset, offset + stop - start),)
                dst = (slice(None),) * axis + (slice(start, stop),)
                write_slab(f[name], dst, array[src])
                offset += stop - start
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
                publish.publish(self.tmp, self.path, self.overwrite)
            except FileError as e:
                err = e
            except OSError as e:
                err = FileError(f"cannot move the finished output to {self.path!r}: {e}")
            if err is None or getattr(err, "kept", None):
                owner.release(self.tmp)  # published or kept: the temporary name is gone
        safety.untrack(self.tmp)  # published, kept or gone: no longer ours to remove
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
            safety.untrack(self.tmp)
        if self.rank == 0 and not self.done and self.tmp:
            try:
                os.remove(self.tmp)
            except OSError:
                pass
            owner.release(self.tmp)  # after the file: its lock guards it until it is gone


_NEVER_CLOSED = []


# --------------------------------------------------------------------------- space

def bytes_needed(datasets):
    """Bytes of the datasets {name: (shape, dtype)} plus room for HDF5's metadata and chunk index."""
    data = sum(math.prod(map(int, shape)) * stored_dtype(dtype)[0].itemsize  # Python ints: no int64 overflow
               for shape, dtype in datasets.values())
    return int(data * 1.01) + (256 << 10)


def _free_bytes(directory):
    """Bytes free to this user on the file system holding ``directory``, or None if it cannot be told."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_space(directory, needed, what):
    """Refuse early when the file system holding ``directory`` has less than ``needed`` bytes free
    (BURST_HPC_SPACE_CHECK=0 skips: free space can be misreported, e.g. under quotas)."""
    if not config.space_check():
        return
    free = _free_bytes(directory)
    if free is not None and free < needed:
        raise FileError(f"not enough space for {what}: it needs about {size_text(needed)}, "
                        f"{directory} has {size_text(free)} free")


def _full(path):
    """True when the file system holding ``path`` has (almost) no space left."""
    if path is None:
        return False
    free = _free_bytes(os.path.dirname(os.path.abspath(path)))
    return free is not None and free < (64 << 10)


def _io_failure(what, error, path=None):
    """A FileError for a failed HDF5 write, in one line (ENOSPC and EDQUOT named plainly); an
    OS-level failure also marks HDF5 as broken, so the process exits without its exit handler."""
    if isinstance(error, BurstError):
        return FileError(f"{what}: {error}")
    safety.note_hdf5_failure()
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
    return owner.temp_name(full)


def output_datasets(spec, backward):
    """Output dataset declarations {name: (shape, dtype)} for a run over ``spec``."""
    out = {"o": (spec.shape("q"), spec.dtype), "lse": (spec.shape("lse"), np.dtype(np.float32))}
    if backward:
        for name in GRADS:
            out[name] = (spec.shape(name), spec.dtype)
    return out


# --------------------------------------------------------------------------- one process

def write_global(path, arrays, attrs=None, overwrite=False):
    """Write whole arrays {name: array} into a new file atomically (single process)."""
    def fill(f):
        for name, array in arrays.items():
            array = np.asarray(array)
            ds = create_dataset(f, name, array.shape, array.dtype)
            if array.size:
                write_slab(ds, (), array)
        stamp(f, attrs)

    needed = sum(np.asarray(a).nbytes for a in arrays.values())
    write_new(path, fill, overwrite, bytes_needed({0: ((needed,), np.uint8)}))


def write_new(path, fill, overwrite=False, needed=0):
    """Single process: build a new HDF5 file with ``fill(f)`` under a temporary name and publish it
    (never replacing a file that appeared meanwhile, unless ``overwrite``). A failed write (disk
    full, quota) raises one FileError and leaves no file behind."""
    import h5py

    tmp = check_output_path(path, overwrite=overwrite)
    held = tmp
    try:
        owner.hold(held)
        safety.track(tmp)
        check_space(os.path.dirname(tmp), needed, f"output {path!r}")
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
            publish.publish(tmp, path, overwrite)
        except FileError:
            tmp = None  # lost a race: the result stays under the name the message gives
            raise
    finally:
        if tmp is not None:
            safety.untrack(tmp)
            if os.path.exists(tmp):
                os.remove(tmp)
        owner.release(held)
