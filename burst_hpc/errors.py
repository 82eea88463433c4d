"""The project's exception types (all derive from BurstError, a ValueError, so callers can catch one),
the one writer of the lines the command prints about them ("burst-hpc: error: ...") and the one
way those lines write a size (size_text)."""
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


SIZE_UNITS = ("B", "KB", "MB", "GB", "TB", "PB", "EB")


def size_text(nbytes):
    """A byte count for people, in decimal units (1 KB = 1000 B): '950 B', '4.19 MB', '109 TB'. Every
    message that prints a size says it so."""
    value, unit = float(nbytes), 0
    while abs(value) >= 999.5 and unit < len(SIZE_UNITS) - 1:
        value, unit = value / 1000, unit + 1
    return f"{value:.0f} B" if unit == 0 else f"{value:.3g} {SIZE_UNITS[unit]}"


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


class UsageError(BurstError):
    """A command line does not parse (on some rank of the job: every rank exits with the usage status)."""
