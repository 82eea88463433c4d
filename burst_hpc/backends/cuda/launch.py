"""Kernel arguments, shared by both families' launches: inputs as 16-bit arrays the kernels can read,
float32 accumulators they can write, strides, mask bounds, each family kernel's arguments as one record of its
contract.cuh struct (``KernelArgs``), and the GPU's size for the schedules.

Every launch goes on CuPy's current stream; nothing here synchronizes the device.
"""
import functools

import numpy as np

from ...errors import BackendError
from ...plan import tiles
from . import contract

LOG2E = 1.4426950408889634  # the kernels' softmax runs in base 2: they take scale * log2(e)


@functools.lru_cache(maxsize=None)   # every launch asks it of each array: a handful of dtypes
def dtype_kind(dtype):
    """'bf16' | 'f16' | 'f32' for an input dtype, or BackendError (uint16 holds raw bf16 bits)."""
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return "f16"
    if dtype.name == "bfloat16" or dtype == np.uint16:
        return "bf16"
    if dtype == np.float32:
        return "f32"
    raise BackendError(f"the cuda backend takes bfloat16, float16 or float32 inputs; got {dtype}")


def kernel_dtype(dtype):
    """The 16-bit type of the kernels that run inputs of ``dtype``: float32 inputs run the bf16 kernels."""
    return "f16" if dtype_kind(dtype) == "f16" else "bf16"


@functools.cache
def _bfloat16():
    """The bfloat16 dtype when this CuPy holds bf16 arrays (CuPy >= 14 with ml_dtypes), else None."""
    import cupy

    try:
        import ml_dtypes  # noqa: F401

        cupy.zeros(1, dtype=np.dtype("bfloat16"))
        return np.dtype("bfloat16")
    except Exception:  # noqa: BLE001 - older CuPy: no bf16 arrays
        return None


def half_input(x, want):
    """A 16-bit device array (kernel input) with D contiguous and 16-byte aligned rows, of type ``want``
    ('bf16' or 'f16'); x itself when it already is one, else a converted or contiguous copy."""
    import cupy

    if dtype_kind(x.dtype) != want:
        if want == "f16":
            x = x.astype(np.float16)
        elif _bfloat16() is None:
            raise BackendError("float32 inputs need CuPy with bfloat16 support (CuPy >= 14 with ml_dtypes)")
        else:
            x = x.astype(_bfloat16())
    item = x.itemsize
    ok = (x.strides[-1] == item and x.data.ptr % 16 == 0
          and all((s // item) % 8 == 0 and s % item == 0 for s in x.strides[:-1]))
    if not ok:
        x = cupy.ascontiguousarray(x)
    return x


def aligned_rows(x, kind):
    """Whether the kernels of 16-bit type ``kind`` read or write ``x`` in place: None (nothing to read or
    write), or an array of that type whose rows (the head dim) are contiguous and 16-byte aligned."""
    if x is None:
        return True
    try:
        if dtype_kind(x.dtype) != kind:
            return False
    except BackendError:
        return False
    return (x.strides[-1] == x.itemsize and x.data.ptr % 16 == 0 and all(s % 16 == 0 for s in x.strides[:-1]))


def accumulator(x, name):
    """(array the kernel writes, array to copy it back into or None) for the float32 accumulator ``x``:
    x itself when its head dim is contiguous in 8-byte aligned pairs, else a contiguous scratch copy."""
    import cupy

    if x.dtype != np.float32:
        raise BackendError(f"{name} must be a float32 accumulator; got {x.dtype}")
    if x.strides[-1] == 4 and x.data.ptr % 8 == 0 and all(s % 8 == 0 for s in x.strides[:-1]):
        return x, None
    return cupy.ascontiguousarray(x), x


def f32_rows(x, name):
    """(array the kernel uses, array to copy back into or None) for lse / delta (B, H, S) float32 views:
    any strides, element-aligned."""
    import cupy

    if x.dtype != np.float32:
        raise BackendError(f"{name} must be float32; got {x.dtype}")
    if x.data.ptr % 4 or any(s % 4 for s in x.strides):
        return cupy.ascontiguousarray(x), x
    return x, None


def strides(x):
    """x's strides in elements, as the kernels' int64 arguments."""
    return [np.int64(s // x.itemsize) for s in x.strides]


def check_dims(q, k, widths):
    """q's head dim, which must be one of ``widths`` and k's; q's heads a multiple of k's."""
    d = q.shape[-1]
    if d not in widths:
        raise BackendError(f"the cuda backend supports head_dim {widths}; got {d}")
    if k.shape[-1] != d or q.shape[2] % k.shape[2]:
        raise BackendError(f"bad shapes q {q.shape} k {k.shape}")
    return d


def mask_args(mask, q_start, sq, k_start):
    """Kernel arguments (mlo, mhi, kofs): the interval kernels read each query row's key bounds
    (masks.Mask, docs/KERNELS.md "Masks"); other modes take null pointers."""
    if mask is None:
        return (np.uint64(0), np.uint64(0), np.int64(0))
    import cupy

    lo, hi = mask.device_intervals(cupy)
    return (lo[q_start:q_start + sq], hi[q_start:q_start + sq], np.int64(k_start))


_NUMBERS = (int, float, np.generic)


def address(x):
    """What a kernel argument field holds for x: a device array's address, 0 for None (a null pointer), else x."""
    if x is None:
        return 0
    if isinstance(x, _NUMBERS):  # most fields: no attribute look-ups
        return x
    ptr = getattr(getattr(x, "data", None), "ptr", None)
    return x if ptr is None else ptr


def array_fields(*arrays):
    """The argument fields of device arrays, each given as (name, x, stride_fields): field ``name``, x's address,
    and ``stride_fields`` (names, in x's axis order), its strides in elements; none for x None (they stay null
    and zero)."""
    fields = {}
    for name, x, stride_fields in arrays:
        if x is not None:
            fields[name] = x
            fields.update(zip(stride_fields.split(), (s // x.itemsize for s in x.strides)))
    return fields


class KernelArgs:
    """The arguments of one family kernel: contract.cuh's ``struct`` as a NumPy record (``contract.params_dtype``),
    read from the header here, once; a launch only fills it (``__call__``, a few microseconds: it runs per block
    pair, and at short lengths the host's time per launch nears the kernel's)."""

    def __init__(self, struct):
        self.struct = struct
        self.dtype = contract.params_dtype(struct)
        self._record = _Record(self.dtype, struct)

    def __call__(self, q, k, /, *, scale, q_start, k_start, mask, **fields):  # /: the sm80 records have fields q, k
        """A one-element array of the record (CuPy passes a one-element NumPy array by value, as the struct's
        bytes): its block pair (PairParams: shapes from q and k, the scale, q_start - k_start, the mask's bounds)
        and ``fields`` by name (a device array as its address, None as null, a nested struct's fields as a
        dict), zero elsewhere."""
        b, sq, hq, _ = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        mlo, mhi, kofs = mask_args(mask, q_start, sq, k_start)
        fields.update(mlo=mlo, mhi=mhi, kofs=kofs, off=int(q_start) - int(k_start), Sq=sq, Sk=sk, B=b, Hq=hq, Hkv=hkv,
                      group=hq // hkv, scale=scale, sl2=scale * LOG2E)
        args = np.zeros(1, self.dtype)
        args[0] = self._record.row(fields)
        return args


class Kept:
    """A launch worked out once for a call's shapes (a family's forward or backward, kept in a recent.Recent): the
    kernel, grid, block, shared memory and argument record (``args``, a KernelArgs record) with every field filled but
    the addresses of the call's own arrays, which each call sets (``__call__``); ``held``: what the record points to
    that the launch must keep alive (schedules, mask bounds, counters); ``facts``: what else the family decided
    (attributes by name)."""

    def __init__(self, kern=None, grid=None, block=None, smem=0, args=None, held=None, **facts):
        self.kern, self.grid, self.block, self.smem, self.held = kern, grid, block, smem, held
        self.slots = {}   # address field name -> its word in the record
        self.__dict__.update(facts)
        if args is not None:   # the record as bytes, copied and patched a call (a record's own copy is slower)
            self.dtype, self.raw = args.dtype, args.view(np.uint8).copy()

    def slot(self, name):
        """The 8-byte word of the record holding address field ``name`` ('kv.dk': field dk of nested record kv)."""
        dtype, offset = self.dtype, 0
        for part in name.split("."):
            dtype, at = dtype.fields[part][:2]
            offset += at
        if dtype != np.uint64 or offset % 8:
            raise BackendError(f"kernel argument {name} is not an address field")
        return offset // 8

    def __call__(self, **arrays):
        """Launch with the record's address fields ``arrays`` (by name, as ``slot`` takes them) set to these arrays'
        addresses (None: null)."""
        args = self.raw.copy()
        words = args.view(np.uint64)
        for name, x in arrays.items():
            at = self.slots.get(name)
            if at is None:
                at = self.slots[name] = self.slot(name)
            words[at] = address(x)
        self.kern(self.grid, self.block, (by_value(args.view(self.dtype)),), shared_mem=self.smem)


def stream_key(cupy):
    """(device, stream) of the launches queued now: what per-stream launch state (a forward's tile counter) is
    kept by."""
    return cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr


@functools.cache
def _pointer_type():
    """CuPy's kernel argument that is a host address (cupy.cuda.function.CPointer), or None where there is none
    to trust: before CuPy 14 a CPointer kept the address of the Python int it was given, not its value."""
    try:
        import cupy
        from cupy.cuda.function import CPointer

        major = int(cupy.__version__.split(".")[0])
    except (ImportError, AttributeError, ValueError):
        return None
    return CPointer if major >= 14 else None


def by_value(record):
    """What a launch takes for ``record`` (a KernelArgs one-element array) to pass its bytes as the struct
    parameter: a pointer to them, which the driver reads when the launch is made (the caller holds ``record``
    until the launch returns). CuPy takes the array itself too, but reads its dtype's description field by field
    on every launch: 45 us a launch for a 64-field record against 5 us (H100 host, CuPy 14.2)."""
    pointer = _pointer_type()
    return record if pointer is None else pointer(record.ctypes.data)


class _Record:
    """One NumPy record filled by field name: ``row`` is the tuple NumPy assigns to it."""

    def __init__(self, dtype, name):
        self.name = name
        self.index = {field: i for i, field in enumerate(dtype.names)}
        self.nested = {field: _Record(dtype[field], f"{name}.{field}") for field in dtype.names if dtype[field].names}
        self.zeros = np.zeros((), dtype).item()

    def row(self, values):
        """``values`` by field name (``address`` of each; a nested record's as a dict), zero where absent."""
        row = list(self.zeros)
        index, nested = self.index, self.nested  # a launch fills some 50 fields: this loop is its host time
        for field, value in values.items():
            i = index.get(field)
            if i is None:
                raise BackendError(f"the kernel arguments {self.name} have no field {field}")
            if field in nested:
                row[i] = nested[field].row(value)
            elif value is not None:
                row[i] = value if isinstance(value, _NUMBERS) else address(value)
        return tuple(row)


# the sm90 backward's pieces under a causal mask (causal_order_band)
CAUSAL_ORDER_BAND = 4


@functools.cache
def sm_count():
    """The streaming multiprocessors of the GPU that was current at the first call (read once)."""
    import cupy

    return cupy.cuda.Device().attributes["MultiProcessorCount"]


def split_group(group, walks, kv_heads):
    """(query heads per CTA, CTAs per GQA group) of a backward whose key blocks walk ``walks`` query tiles each
    (an array; equal walks when the kernel plans none): split the group over CTAs only as far as needed (fewer
    dK/dV atomics) for the heaviest CTA to hold at most half an SM's share of the steps. With equal walks that is
    two waves of CTAs; under documents a call over a few of them (the packed backward's runs of rows) has few
    blocks that walk, long ones, which alone would set its length. ``kv_heads``: batch x kv heads."""
    walks = np.asarray(walks, np.int64)
    share = walks.sum() * group * kv_heads / (2 * sm_count())
    hpb = group
    while hpb > 1 and walks.max(initial=0) * hpb > share:
        hpb -= 1
        while group % hpb:
            hpb -= 1
    return hpb, group // hpb


def heavy_first_heads(key_blocks, head_slots):
    """Head slots per chunk of a backward's longest-first tile order: key blocks go slowest inside a chunk, so
    its heaviest blocks start first; about two waves of the GPU per chunk, so a chunk's Q, dO and dq stay few
    enough to share L2 while the light blocks of one chunk overlap the heavy ones of the next."""
    return min(head_slots, max(1, -(-2 * sm_count() // key_blocks)))


def key_block_order(t_lo, t_end, slots, band=None):
    """The sm90 backward's CTA order under an interval mask (its ``order`` argument, KeyBlockTile in
    attn_bwd_sm90.cu): an int32 array over the 1-D grid whose entry i is slot * len(t_lo) + kb, the (head slot,
    key block) CTA i runs; key block kb walks the query tiles [t_lo[kb], t_end[kb]).

    Key blocks that walk to the same end tile (one document's) share their query rows: each such run goes as a
    piece, heaviest piece first (query tiles summed), each piece as every head slot's key blocks in order. So the
    long documents' walks start in the first waves and the last one holds short documents', while the CTAs that
    read the same Q, dO and dq rows (one document of one head slot) run side by side and share them in L2.
    ``band``: cut each run into pieces of at most this many key blocks (a causal mask's one run, so its heavy
    blocks of every slot start before a late slot's)."""
    t_lo, t_end = np.asarray(t_lo, np.int64), np.asarray(t_end, np.int64)
    nkb = len(t_lo)
    kb = np.arange(nkb)
    piece = tiles.pieces(t_end)
    if band:
        first = np.flatnonzero(np.concatenate(([True], t_end[1:] != t_end[:-1])))
        piece = np.unique(piece * nkb + (kb - first[piece]) // band, return_inverse=True)[1].ravel()
    weight = np.bincount(piece, weights=np.maximum(t_end - t_lo, 0))
    rank = np.empty(len(weight), np.int64)
    rank[np.argsort(-weight, kind="stable")] = np.arange(len(weight))
    kbs, ss = np.tile(kb, slots), np.repeat(np.arange(slots), nkb)
    at = np.lexsort((kbs, ss, rank[piece][kbs]))
    return (ss * nkb + kbs)[at].astype(np.int32)


def causal_order_band(key_blocks, head_slots):
    """Key blocks per piece of the sm90 backward's order under a causal mask (launch.key_block_order), or None for
    head slot after head slot: pieces of 4 while the grid is under 8 waves of the GPU, where a late slot's heavy
    key blocks would otherwise start in the last wave (H100, 8k tokens, 8 slots: 1.09x; 16k 1.02x); from 8 waves
    on the tail is short and the plain order keeps each slot's CTAs together (32k: 1.00x)."""
    return CAUSAL_ORDER_BAND if key_blocks * head_slots < 8 * sm_count() else None
