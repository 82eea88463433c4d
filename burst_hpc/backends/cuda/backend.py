"""CudaBackend: the block interface (backends/__init__.py) on the kernels of one family.

Which family runs is decided here, once per backend; so is the route of a head dim: native (the family's
kernels), zero-padded to the next native width (padding.py: exact, the scale stays the caller's), or, for
heads wider than every kernel, numpy_backend's tiled online softmax on CuPy arrays (float32 cuBLAS products
per tile pair; exact, slower than the kernels). docs/KERNELS.md has the conventions.
"""
import math
import time
from typing import Protocol

import numpy as np

from ... import config
from ...dtypes import parse_dtype
from ...errors import BackendError, DTypeError
from .. import backward_ends, forward_ends, padding
from ..numpy_backend import NumpyBackend
from ...collective import agree, kept
from ...device import HOW_TO_GET_CUPY
from . import compile as compiling, contract, launch
from .compile import Modules, call_builds
from .sm80 import Sm80Kernels
from .sm90 import Sm90Kernels

# Kernel families, newest first. "sm90": wgmma / TMA / warp-specialized kernels for Hopper (sm_90a);
# "sm80": the mma.sync / ldmatrix / cp.async kernels, which run on any GPU of compute capability >= 8.0.
FAMILIES = ("sm90", "sm80")
# heads wider than every kernel: tiles of this many queries x keys
WIDE_TILE = 1024


def kernel_families(capability=None):
    """The kernel families the current GPU runs, the default first. ``capability``: (major, minor)."""
    if capability is None:
        capability = gpu_capability()
    major, minor = capability
    families = []
    if (major, minor) == (9, 0):
        families.append("sm90")
    if major >= 8:
        families.append("sm80")
    return tuple(families)


def default_family(capability=None):
    """The family used unless one is asked for: $BURST_HPC_KERNELS if set, else the newest this GPU runs."""
    families = kernel_families(capability)
    forced = config.kernel_family()
    if forced:
        if forced not in FAMILIES:
            raise BackendError(f"BURST_HPC_KERNELS must be one of {FAMILIES}; got {forced!r}")
        if forced not in families:
            raise BackendError(f"BURST_HPC_KERNELS={forced} does not run on this GPU (it runs {families or 'none'})")
        return forced
    if not families:
        raise BackendError("the cuda backend needs a GPU of compute capability 8.0 or newer")
    return families[0]


def route(head_dim, widths):
    """How a family whose kernels run the head dims ``widths`` runs ``head_dim``: 'native', 'padded' (zero-padded
    to the next native width) or 'wide' (wider than every kernel: the tiled path)."""
    if head_dim in widths:
        return "native"
    return "wide" if head_dim > max(widths) else "padded"


def kernel_builds(family, dtypes, head_dims, masks, directions=("fwd", "bwd")):
    """The builds (compile.Build) of the ``family``'s kernels that run inputs of the kernel ``dtypes``
    ('bf16', 'f16') and ``head_dims`` under ``masks`` ('full', 'causal', 'interval') in ``directions``,
    each head dim routed as a call routes it: native, zero-padded to the next native width, or (wide) no
    kernel at all."""
    builds = []
    for direction in directions:
        widths = contract.native_widths(family, direction)
        dims = {padding.native_width(d, widths) for d in head_dims if route(d, widths) != "wide"}
        builds += call_builds(family, dtypes, dims, masks, (direction,))
    return builds


def compile_ahead(families=None, head_dims=None, dtypes=None, directions=("fwd", "bwd"), comm=None):
    """Collective on ``comm`` (None: this process alone): fill the kernel cache ahead of jobs (``burst-hpc
    compile``) with the kernels of every mask for ``families`` (default: those this GPU runs), ``head_dims``
    (default: every native width; others are routed as a call routes them) and input ``dtypes`` (names
    as dtypes.parse_dtype takes them, or dtypes: bfloat16, float16, float32, which runs the bfloat16 kernels;
    default: both 16-bit ones) in ``directions``. The node's ranks share
    the compiles out (compile.prepare). Returns a summary line (the same on every rank)."""
    error, builds, cache = None, [], None
    try:
        cache = compiling.default_cache()
        families = list(families or kernel_families())
        unknown = [f for f in families if f not in FAMILIES]
        if unknown or any(d < 1 for d in head_dims or ()):
            raise BackendError(f"compile takes families {', '.join(FAMILIES)} and positive head dims; got "
                               f"{', '.join(map(str, unknown or head_dims))}")
        kinds = {launch.kernel_dtype(parse_dtype(t)) for t in dtypes or ("bfloat16", "float16")}
        for family in families:
            dims = head_dims or {d for direction in directions for d in contract.native_widths(family, direction)}
            builds += kernel_builds(family, kinds, dims, ("full", "causal", "interval"), directions)
    except (BackendError, DTypeError) as e:
        error = e
    agree(comm, error)
    t0 = time.perf_counter()
    done = compiling.prepare(cache, builds, comm)
    counts = [sum(1 for how in done.values() if how == word) for word in ("compiled", "cached", "waited")]
    if comm is not None and comm.size > 1:
        counts = [sum(c) for c in zip(*comm.allgather(counts))]
    return (f"kernel cache {cache.directory}: {len(set(builds))} build(s) of {', '.join(families)}: {counts[0]} "
            f"compiled, {counts[1]} already there, {counts[2]} compiled meanwhile by another process; "
            f"{time.perf_counter() - t0:.1f} s")


def gpu_capability():
    """(major, minor) compute capability of the current GPU."""
    import cupy

    cc = cupy.cuda.Device().compute_capability  # e.g. "90"
    return int(cc[:-1]), int(cc[-1])


def _require_gpu():
    try:
        import cupy
    except ImportError:
        raise BackendError(f"the cuda backend needs CuPy; {HOW_TO_GET_CUPY}") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - any runtime failure means no usable GPU
        raise BackendError(f"the cuda backend found no usable GPU: {exc}") from exc
    if n < 1:
        raise BackendError("the cuda backend found no GPU")


class FamilyKernels(Protocol):
    """The launches of one kernel family, on inputs the backend has marshalled: 16-bit q, k, v, do of the
    kernels' type ``kind``, float32 accumulators the kernels can write; ``masked`` and ``mask`` as the block
    contract takes them (backends/__init__.py; contract.mask_mode: the kernel instance they run).

    ``ends``: whether the launches take the block contract's first / last flags themselves (keyword
    arguments ``first``, ``out`` of the forward; ``o``, ``first_q``, ``first_kv``, ``dq_out``, ``dk_out``,
    ``dv_out`` of the backward, with outputs of the kernels' type ``kind``, rows 16-byte aligned
    (``launch.aligned_rows``), ``o`` likewise; accumulators None where the contract allows). Otherwise the
    backend runs them around plain launches (``forward_ends``, ``backward_ends``)."""

    ends: bool

    def forward(self, kind, q, k, v, o, lse, *, scale, masked, mask, q_start, k_start, **ends): ...

    def backward(self, kind, q, k, v, do, lse, delta, dq, dk, dv, *, scale, masked, mask, q_start, k_start,
                 **ends): ...


class CudaBackend:
    """The block backend of one kernel family (``CudaBackend.instance(family)``: one per process).

    q, k, v, do: CuPy arrays of bfloat16, float16 or float32 (converted once per call to bfloat16; a uint16
    array holds raw bf16 bits); o, lse, dq, dk, dv, delta: float32; any strides along batch, sequence and
    head. Every launch goes on CuPy's current stream."""

    name = "cuda"
    _instances = {}

    @classmethod
    def instance(cls, family=None):
        """The process-wide backend of ``family`` (None: ``default_family()``)."""
        _require_gpu()
        family = family or default_family()
        if family not in cls._instances:
            cls._instances[family] = cls(family)
        return cls._instances[family]

    def __init__(self, family="sm80"):
        if family not in FAMILIES:
            raise BackendError(f"unknown kernel family {family!r}; use one of {FAMILIES}")
        _require_gpu()
        import cupy

        self.xp = cupy
        self.family = family
        self.modules = Modules()
        self.kernels: FamilyKernels = (Sm90Kernels if family == "sm90" else Sm80Kernels)(self.modules)
        # read from the sources once: every block call routes on them
        self._widths = {direction: contract.native_widths(family, direction) for direction in ("fwd", "bwd")}
        self._dtype_codes = contract.header().dtypes
        self._wide = None
        self._alone = {}   # what prepare(None, ...) made ready: this process alone
        # attn_delta's 16-byte path (delta): 98 us against 245 for the element path on (8k, 64, 128) bf16 (H200)
        self.vector_delta = True

    def native_widths(self, direction="fwd"):
        """The head dims this family runs natively (``direction``: 'fwd' or 'bwd'), as its source lists them;
        narrower ones are zero-padded, wider ones run the tiled path."""
        return self._widths[direction]

    def _elsewhere(self, direction, head_dim):
        """None when this family's kernels run ``head_dim``; else the block backend that does: these kernels
        on zero-padded heads, or for heads wider than every kernel the tiled path."""
        widths = self.native_widths(direction)
        how = route(head_dim, widths)
        if how == "native":
            return None
        if how == "wide":
            if self._wide is None:
                self._wide = _WideHeads(self.xp)
            return self._wide
        return padding.Padded(self, widths)

    def prepare(self, comm, dtype, head_dim, mask, directions):
        """Collective on ``comm`` (None: this process alone): compile the kernels a call needs before its
        first launch, once per node and per cache directory (compile.prepare): for inputs of ``dtype`` and
        ``head_dim``, those of the passes ``directions`` ('fwd', 'bwd') with the full mask and the one of
        the call's masks.Mask ``mask`` (contract.mask_mode: causal or interval) unless it is full."""
        try:
            kind = launch.kernel_dtype(dtype)
        except BackendError:  # the call's first launch says so, as it would without this step
            return {}
        masks = ("full",) if mask.is_full else ("full", contract.mask_mode(True, mask))
        key = (kind, head_dim, masks, tuple(directions))
        # kept on the communicator: every rank of it made the same calls on it, so all skip together (a set
        # made ready by a collective on another communicator may be so on some of these ranks only); None:
        # this process alone
        prepared = (self._alone if comm is None else kept(comm)).setdefault(("prepared", self.family), set())
        if key in prepared:
            return {}
        result = self.modules.prepare(kernel_builds(self.family, (kind,), (head_dim,), masks, directions), comm)
        prepared.add(key)
        return result

    # ---- the three block calls ---------------------------------------------------------------------
    def forward_block(self, q, k, v, o, lse, *, scale, masked=False, mask=None, q_start=0, k_start=0, first=False,
                      out=None):
        where = dict(scale=scale, masked=masked, mask=mask, q_start=q_start, k_start=k_start)
        ends = dict(first=first, out=out)
        other = self._elsewhere("fwd", q.shape[-1])
        if other is not None:
            return forward_ends(self.xp, lambda o_, lse_: other.forward_block(q, k, v, o_, lse_, **where), o, lse,
                                **ends)
        launch.check_dims(q, k, self.native_widths("fwd"))
        if 0 in (q.shape[0], q.shape[1], q.shape[2], k.shape[1]):
            return forward_ends(self.xp, lambda *_: None, o, lse, **ends)
        kind = launch.kernel_dtype(q.dtype)
        q, k, v = (launch.half_input(x, kind) for x in (q, k, v))
        if first and o is None and out is not None and out.dtype == np.float32:
            o, ends["out"] = out, None  # a float32 output is the accumulator itself
        if not self.kernels.ends or not launch.aligned_rows(ends["out"], kind):
            return forward_ends(self.xp, lambda o_, lse_: self._forward(kind, q, k, v, o_, lse_, where), o, lse, **ends)
        self._forward(kind, q, k, v, o, lse, where, **ends)

    def _forward(self, kind, q, k, v, o, lse, where, **ends):
        o_w, o_back = launch.accumulator(o, "o") if o is not None else (None, None)
        lse_w, lse_back = launch.f32_rows(lse, "lse")
        self.kernels.forward(kind, q, k, v, o_w, lse_w, **where, **ends)
        if o_back is not None:
            o_back[...] = o_w
        if lse_back is not None:
            lse_back[...] = lse_w

    def backward_block(self, q, k, v, do, lse, delta, dq, dk, dv, *, scale, masked=False, mask=None, q_start=0,
                       k_start=0, o=None, first_q=False, first_kv=False, dq_out=None, dk_out=None, dv_out=None):
        where = dict(scale=scale, masked=masked, mask=mask, q_start=q_start, k_start=k_start)
        ends = dict(first_q=first_q, first_kv=first_kv, dq_out=dq_out, dk_out=dk_out, dv_out=dv_out)
        if delta is None and o is None:
            raise BackendError("backward_block needs delta or o")
        if (dk_out is None) != (dv_out is None):
            raise BackendError("dk_out and dv_out go together")
        other = self._elsewhere("bwd", q.shape[-1])
        if other is not None:
            def run(delta_, *grads):
                other.backward_block(q, k, v, do, lse, delta_, *grads, **where)

            return backward_ends(self.xp, run, self.delta, do, o, delta, dq, dk, dv, **ends)
        launch.check_dims(q, k, self.native_widths("bwd"))
        if 0 in (q.shape[0], q.shape[1], q.shape[2], k.shape[1]):
            return backward_ends(self.xp, lambda *_: None, self.delta, do, o, delta, dq, dk, dv, **ends)
        kind = launch.kernel_dtype(q.dtype)
        q, k, v, do = (launch.half_input(x, kind) for x in (q, k, v, do))
        for acc, out, first, name in ((dq, dq_out, first_q, "dq"), (dk, dk_out, first_kv, "dk"),
                                      (dv, dv_out, first_kv, "dv")):
            if first and acc is None and out is not None and out.dtype == np.float32:
                ends[name + "_out"] = None  # a float32 output is the accumulator itself
                dq, dk, dv = (out if n == name else x for x, n in ((dq, "dq"), (dk, "dk"), (dv, "dv")))
        writable = all(launch.aligned_rows(x, kind) for x in (ends["dq_out"], ends["dk_out"], ends["dv_out"]))
        if not (self.kernels.ends and writable):
            return backward_ends(self.xp, lambda *args: self._backward(kind, q, k, v, do, lse, *args, where),
                                 self.delta, do, o, delta, dq, dk, dv, **ends)
        if delta is None and not launch.aligned_rows(o, kind):  # the kernels' pre-pass reads o as it reads do
            delta = self.delta(do, o)
        self._backward(kind, q, k, v, do, lse, delta, dq, dk, dv, where, o=o if delta is None else None, **ends)

    def _backward(self, kind, q, k, v, do, lse, delta, dq, dk, dv, where, **ends):
        lse_r, _ = launch.f32_rows(lse, "lse")
        delta_r = launch.f32_rows(delta, "delta")[0] if delta is not None else None
        grads = [launch.accumulator(g, name) if g is not None else (None, None)
                 for g, name in ((dq, "dq"), (dk, "dk"), (dv, "dv"))]
        self.kernels.backward(kind, q, k, v, do, lse_r, delta_r, *(w for w, _ in grads), **where, **ends)
        for w, back in grads:
            if back is not None:
                back[...] = w

    def delta(self, do, o):
        """rowsum(do * o) as a float32 (B, H, S) array (attn_delta.cu, any head dim; do and o each bf16,
        fp16 or float32; with ``vector_delta``, 16-byte loads where both are 16-bit of one dtype with aligned
        rows)."""
        cupy = self.xp
        b, s, h, d = do.shape
        out = cupy.empty((b, h, s), np.float32)
        if out.size == 0:
            return out
        codes = self._dtype_codes
        if do.strides[-1] != do.itemsize:
            do = cupy.ascontiguousarray(do)
        if o.strides[-1] != o.itemsize:
            o = cupy.ascontiguousarray(o)
        kernel = self.modules.table(contract.DELTA_SOURCE).find()
        kern = self.modules.kernel(contract.DELTA_SOURCE, kernel.name, kernel.smem_bytes)
        strides = launch.strides
        kind = launch.dtype_kind(do.dtype)
        # 16-byte loads, `lanes` per row, where do and o share a 16-bit dtype and their rows are 16-byte aligned
        lanes = 0
        if (self.vector_delta and kind != "f32" and d % 8 == 0 and launch.aligned_rows(do, kind)
                and launch.aligned_rows(o, kind)):
            lanes = min(32, (d // 8) & -(d // 8))   # the largest power of two dividing d / 8, at most a warp
        grid = -(-b * s * h // kernel.query_rows) if not lanes else min(-(-b * s * h * lanes // kernel.threads), 16384)
        kern((grid,), (kernel.threads,),
             (do, o, out, *strides(do)[:3], *strides(o)[:3], np.int32(b), np.int32(s), np.int32(h), np.int32(d),
              np.int32(codes[kind]), np.int32(codes[launch.dtype_kind(o.dtype)]), np.int32(lanes)))
        return out

    def rows_sum(self, src, own, ptr, at, step, parts, out):
        """The block contract's ``rows_sum`` in one pass (attn_delta.cu's attn_rows_sum)."""
        b, s = out.shape[:2]
        width = math.prod(out.shape[2:])
        if (src.dtype != np.float32 or parts.dtype != np.float32 or src.shape[0] != b or src.shape[2:] != out.shape[2:]
                or not all(x.flags.c_contiguous for x in (src, parts, out)) or len(ptr) != s + 1
                or any(x.dtype != np.int64 for x in (own, at)) or any(x.dtype != np.int32 for x in (ptr, step))):
            raise BackendError("rows_sum takes contiguous float32 src and parts, a contiguous out of their rows, "
                               "int64 own and at, int32 ptr (one more than out's rows) and step")
        if out.size == 0:
            return
        vec = int(width % 8 == 0 and all(x.data.ptr % 16 == 0 for x in (src, parts, out)))
        grid = min(-(-b * s * (width // 8 if vec else width) // 256), 16384)
        self.modules.kernel(contract.DELTA_SOURCE, "attn_rows_sum", 0)(
            (grid,), (256,), (src, np.int64(src.shape[1]), own, ptr, at, step, parts, out, np.int32(b), np.int32(s),
                              np.int32(width), np.int32(self._dtype_codes[launch.dtype_kind(out.dtype)]),
                              np.int32(vec)))

    def rows_copy(self, src, src_rows, dst, dst_rows):
        """The block contract's ``rows_copy`` in one launch (attn_delta.cu's attn_rows_copy: a CuPy fancy index
        took 50-90 us of the host a call on a lent H200 host, 4 ranks)."""
        lists = [len(x) for x in (src_rows, dst_rows) if x is not None]
        n = lists[0] if lists else src.shape[1]
        b, row = src.shape[0], src.itemsize * math.prod(src.shape[2:])
        if (not (src.flags.c_contiguous and dst.flags.c_contiguous) or dst.dtype != src.dtype
                or dst.shape[0] != b or dst.shape[2:] != src.shape[2:] or len(set(lists)) > 1
                or any(x is not None and x.dtype != np.int64 for x in (src_rows, dst_rows))
                or (src_rows is None and n > src.shape[1]) or (dst_rows is None and n > dst.shape[1])):
            raise BackendError("rows_copy moves rows between contiguous arrays of one dtype and row shape, as many "
                               "as each int64 index lists (an index None: the first rows, as many as there are)")
        if n == 0 or b == 0 or row == 0:
            return
        vec = row % 16 == 0 and src.data.ptr % 16 == 0 and dst.data.ptr % 16 == 0
        threads = min(256, -(-(row // 16 if vec else row) // 32) * 32)
        null = np.uint64(0)
        self.modules.kernel(contract.DELTA_SOURCE, "attn_rows_copy", 0)(
            (min(b * n, 65535),), (threads,),
            (src, np.int64(src.shape[1]), null if src_rows is None else src_rows, dst, np.int64(dst.shape[1]),
             null if dst_rows is None else dst_rows, np.int32(b), np.int64(n), np.int32(row), np.int32(vec)))


class _WideHeads:
    """Heads wider than every kernel: numpy_backend's tiled online softmax on CuPy arrays (WIDE_TILE x
    WIDE_TILE tiles, batched float32 cuBLAS products, the same masks and GAO merge); uint16 arrays are raw
    bf16 bits, as for the kernels."""

    def __init__(self, xp):
        self.tiled = NumpyBackend(WIDE_TILE, WIDE_TILE, xp=xp)

    def forward_block(self, q, k, v, o, lse, **where):
        self.tiled.forward_block(*_as_float(q, k, v), o, lse, **where)

    def backward_block(self, q, k, v, do, lse, delta, dq, dk, dv, **where):
        self.tiled.backward_block(*_as_float(q, k, v, do), lse, delta, dq, dk, dv, **where)


def _as_float(*arrays):
    """The inputs as floating-point arrays: uint16 holds bf16 bits; a dtype the kernels do not take raises."""
    for x in arrays:
        launch.dtype_kind(x.dtype)
    return [x.view(np.dtype("bfloat16")) if x.dtype == np.uint16 else x for x in arrays]
