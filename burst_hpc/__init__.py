"""burst-hpc: exact attention over sequences split across MPI ranks (BurstAttention + DistFlashAttn)."""
__version__ = "0.1.0"

from .api import attention, attention_backward
from .plan.costmodel import choose_layout
from .device import select_device
from .distributed import burst_attention, burst_attention_backward
from .errors import (BackendError, BurstError, DTypeError, FileError, LayoutError, MaskError, MpiError,
                     RankMismatchError, ShapeError, TopologyError, TransportError)
from .plan.layout import layout_indices, shard, unshard
from .reference import attention_backward_reference, attention_reference
from .plan.workload import schedule_work

__all__ = ["select_device", "attention", "attention_backward", "burst_attention", "burst_attention_backward", "layout_indices",
           "choose_layout", "shard", "unshard", "schedule_work", "attention_reference", "attention_backward_reference",
           "BurstError", "ShapeError", "DTypeError", "LayoutError", "MaskError", "TransportError", "RankMismatchError",
           "BackendError", "FileError", "MpiError", "TopologyError", "__version__"]
