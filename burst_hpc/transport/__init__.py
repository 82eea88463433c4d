"""Transports: the nonblocking point-to-point exchange of one ring step.

``exchange(sends, recvs)`` takes the step's lists of (peer, arrays): it posts the transfer of
every array of each send to its peer and into every array of each receive from its peer, and
returns a handle whose ``wait()`` completes them all (a plain ring: one send to rank+1, one
receive from rank-1). The arrays exchanged with one peer are matched in list order, so both
ends list them the same way (schedule.Step does). Arrays travel as raw bytes, so bfloat16 and
float16 need no MPI datatype.

- host:   NumPy buffers over MPI (the CPU path).
- mpi:    CuPy device buffers handed straight to a CUDA-aware MPI.
- nccl:   cupy.cuda.nccl send/recv on a communication stream.
- staged: device -> pinned host -> MPI -> pinned host -> device, in pipelined chunks.
- auto:   host for NumPy; for CuPy nccl where it works (one GPU a rank), else mpi if the MPI is known to be
          CUDA-aware, else staged. NCCL first: it queues on the GPU's stream, where MPI makes the host wait for
          the stream before each exchange; short calls pay for that (docs/BENCHMARKS.md: the packed documents
          at 8k tokens a GPU ran 1.6-1.8x faster forward over NCCL), long rings run alike over either.

The protocol they share is transport.base.Transport.
"""
import ctypes
import functools
import logging
import os

from .. import config
from ..errors import TransportError
from .base import Transport  # noqa: F401  (the protocol every transport satisfies)

log = logging.getLogger("burst_hpc")

TRANSPORTS = ("auto", "host", "mpi", "nccl", "staged")
DEVICE_TRANSPORTS = ("mpi", "nccl", "staged")


def _libmpi_path():
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libmpi" in os.path.basename(path) and ".so" in path:
                    return path
    except OSError:
        pass
    return None


def cuda_aware_mpi():
    """(is_cuda_aware, reason). BURST_HPC_CUDA_AWARE=1/0 overrides what the library reports."""
    forced = config.cuda_aware()
    if forced is not None:
        return forced
    return _reported_cuda_support()


@functools.lru_cache(maxsize=1)
def _reported_cuda_support():
    # asked once per process (every call plan chooses a transport; reading /proc/self/maps cost ms)
    from mpi4py import MPI  # noqa: F401  (loads libmpi)

    path = _libmpi_path()
    if path is None:
        return False, "libmpi not found in this process"
    try:
        query = ctypes.CDLL(path).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return False, "the MPI library has no MPIX_Query_cuda_support"
    query.restype = ctypes.c_int
    aware = bool(query())
    return aware, f"MPIX_Query_cuda_support() = {int(aware)}"


def nccl_available():
    try:
        from cupy.cuda import nccl
    except Exception:
        return False
    return bool(getattr(nccl, "available", True))


def choose_transport(name, on_device, gpus_shared=False):
    """The concrete transport for ``name`` ('auto' or one of TRANSPORTS) and the data's location.
    ``gpus_shared``: two ranks use the same GPU (NCCL refuses that)."""
    if name not in TRANSPORTS:
        raise TransportError(f"unknown transport {name!r}; use one of {', '.join(TRANSPORTS)}")
    if not on_device:
        if name not in ("auto", "host"):
            raise TransportError(f"transport {name!r} moves CuPy device arrays; NumPy arrays use 'host'")
        return "host"
    if name == "host":
        raise TransportError("transport 'host' moves NumPy arrays; for CuPy arrays use mpi, nccl, staged or auto")
    if name == "mpi":
        aware, reason = cuda_aware_mpi()
        if not aware:
            raise TransportError(
                "transport 'mpi' needs a CUDA-aware MPI and this one is not known to be (" + reason + "); "
                "device buffers are never handed to it. Use nccl or staged, or set BURST_HPC_CUDA_AWARE=1 "
                "if your MPI is CUDA-aware.")
        return "mpi"
    if name == "nccl" and not nccl_available():
        raise TransportError("transport 'nccl' needs cupy.cuda.nccl, which is not available")
    if name == "nccl" and gpus_shared:
        raise TransportError("transport 'nccl' needs one GPU per rank, and two ranks use the same GPU: call "
                             "burst_hpc.select_device() before creating arrays, or use staged (or mpi with a "
                             "CUDA-aware MPI)")
    if name != "auto":
        return name
    aware, reason = cuda_aware_mpi()
    if nccl_available() and not gpus_shared:
        choice = "nccl"
    elif aware:
        choice = "mpi"
    else:
        choice = "staged"
    log.info("transport auto -> %s (CUDA-aware MPI: %s)", choice, reason)
    return choice


def make_transport(name, comm, xp):
    """An open transport of the concrete kind ``name`` over ``comm``."""
    if name == "host":
        from .mpi import MpiTransport

        return MpiTransport(comm, xp, device=False)
    if name == "mpi":
        from .mpi import MpiTransport

        return MpiTransport(comm, xp, device=True)
    if name == "nccl":
        from .nccl import NcclTransport

        return NcclTransport(comm)
    if name == "staged":
        from .staged import StagedTransport

        return StagedTransport(comm)
    raise TransportError(f"unknown transport {name!r}")
