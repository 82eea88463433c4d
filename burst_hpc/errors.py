"""The project's exception types. All derive from BurstError (a ValueError) so callers can catch one."""


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
