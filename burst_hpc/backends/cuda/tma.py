"""TMA tensor maps for the sm90 kernels, made on the host with the driver's cuTensorMapEncodeTiled.

A BSHD array of 16-bit values (or a float32 accumulator) becomes a 4-d tensor map (D, H, S, B) with the
array's own strides, so strided views (a zigzag half, heads interleaved with other data) need no copy. A
box is 128 bytes of head-dim columns (the 128-byte swizzle width: 64 16-bit or 32 float32 values) of
``rows`` tokens of one head (or of a few: the query heads the forward packs into a tile, PackGQA) of one batch
entry; rows past the end of S read as zeros and are not written. The kernels take the maps from global memory:
``device_maps`` packs them into one device buffer, cached by geometry (a map holds only an address and a shape,
so the same geometry always gives the same bytes).
"""
import ctypes

import numpy as np

from ...errors import BackendError
from ...recent import Recent

_MAP_BYTES = 128
_DTYPE_CODE = {"bfloat16": 9, "uint16": 9, "float16": 6, "float32": 7}  # CU_TENSOR_MAP_DATA_TYPE_*
_SWIZZLE_128B, _L2_PROMOTION_256B, _OOB_FILL_ZERO, _INTERLEAVE_NONE = 3, 3, 0, 0
_CACHE_SIZE = 256

_encode = None
_cache = Recent(_CACHE_SIZE)


class TensorMapError(BackendError):
    """The driver refused a tensor map for this array's geometry."""


def _encoder():
    global _encode
    if _encode is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise BackendError(f"the sm90 kernels need the CUDA driver library (libcuda.so.1): {exc}") from exc
        fn = lib.cuTensorMapEncodeTiled
        u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        _encode = fn
    return _encode


def encode_bshd(x, rows, heads=1):
    """The 128-byte tensor map of the BSHD device array ``x`` (16-bit or float32) with boxes of 128 bytes of
    head-dim columns x ``heads`` heads x ``rows`` tokens (in shared memory: token-major, then head)."""
    b, s, h, d = x.shape
    item = x.itemsize
    cols = 128 // item
    if x.dtype.name not in _DTYPE_CODE or x.strides[-1] != item or d % cols:
        raise TensorMapError(f"tensor maps take 16-bit or float32 arrays with a contiguous head dim that is a "
                             f"multiple of {cols}; got {x.dtype}, shape {x.shape}, strides {x.strides}")
    dims = (ctypes.c_uint64 * 4)(d, h, s, b)
    strides = (ctypes.c_uint64 * 3)(x.strides[2], x.strides[1], x.strides[0])
    box = (ctypes.c_uint32 * 4)(cols, heads, rows, 1)
    steps = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
    raw = ctypes.create_string_buffer(_MAP_BYTES + 64)  # the driver wants a 64-byte aligned CUtensorMap
    addr = (ctypes.addressof(raw) + 63) & ~63
    code = _DTYPE_CODE[x.dtype.name]  # uint16 holds bf16 bits
    err = _encoder()(addr, code, 4, x.data.ptr, dims, strides, box, steps, _INTERLEAVE_NONE, _SWIZZLE_128B,
                     _L2_PROMOTION_256B, _OOB_FILL_ZERO)
    if err != 0:
        raise TensorMapError(f"cuTensorMapEncodeTiled failed (CUresult {err}) for shape {x.shape}, "
                             f"strides {x.strides}, box rows {rows}, heads {heads}")
    return ctypes.string_at(addr, _MAP_BYTES)


def _geometry(x, box):
    return (x.data.ptr, x.shape, x.strides, x.dtype.name, box)


def device_maps(cupy, boxes):
    """One device buffer holding the tensor maps of [(array, box rows) or (array, box rows, box heads), ...]
    back to back (cached)."""
    key = (cupy.cuda.Device().id, tuple(_geometry(x, tuple(box)) for x, *box in boxes))
    buf = _cache.get(key)
    if buf is None:
        host = np.frombuffer(b"".join(encode_bshd(x, *box) for x, *box in boxes), dtype=np.uint8)
        buf = _cache.put(key, cupy.asarray(host))
    return buf
