"""The project's exception types (all derive from BurstError, a ValueError, so callers can catch one),
and the one writer of the lines the command prints about them ("burst-hpc: error: ...")."""
import sys


def say(message, kind="error"):
    """Write 'burst-hpc: KIND: MESSAGE' on stderr, flushed (stdout too, so the lines keep their order).
    Never raises: a signal's or an abort's last word may find the stream gone with the launcher."""
    try:
        sys.stderr.write(f"burst-hpc: {kind}: {message}\n")
        sys.stderr.flush()
        sys.stdout.flush()
    except Exception:  # noqa: BLE001
        pass


class BurstError(ValueError):
    """Base class of every error burst-hpc raises on bad input or setup."""


class ShapeError(BurstError):
    """Arrays have the wrong rank or mismatched sizes."""


class DTypeError(BurstError):
    """Unsupported or mismatched element types."""


class LayoutError(BurstError):
    """A sequence length does not split over the ranks, or an unknown layout."""


class TransportError(BurstError):
    """A transport cannot be used here (e.g. device buffers with an MPI that is not CUDA-aware)."""


class RankMismatchError(BurstError):
    """Ranks disagree on arguments that must be equal everywhere (shapes, dtype, causal, ...)."""


class BackendError(BurstError):
    """A compute backend cannot run the request (no GPU, unsupported head dim, ...)."""


class FileError(BurstError):
    """An input or output file cannot be read or written as asked."""


class MaskError(BurstError):
    """Bad document offsets (cu_seqlens) or window sizes."""


class MpiError(BurstError):
    """No usable MPI library (mpi4py missing, or it cannot load libmpi)."""


class TopologyError(BurstError):
    """The ranks do not form equal nodes, or a scheme does not fit the nodes or the heads."""
