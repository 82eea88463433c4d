"""CUDA block backend: the raw kernels of cuda/*.cu, compiled once per process with cupy.RawModule.

Conventions (docs/KERNELS.md has the full page):
- q, k, v, do: CuPy arrays of bfloat16 (``ml_dtypes.bfloat16``, which CuPy 14 supports natively),
  float16, or float32. float32 inputs are converted once per call to bfloat16 and then run on the
  bf16 tensor-core path (accumulation stays float32). A uint16 array is taken as raw bf16 bits.
- o, lse, dq, dk, dv, delta: float32, any strides along batch/seq/head (views are fine).
- head dims 64 and 128 natively on both families, 256 on sm90 (``native_widths``); any other D up to the
  widest is zero-padded to the next of those (padding.py: exact, the scale stays the caller's); wider
  heads run numpy_backend's tiled online softmax on CuPy arrays (float32 cuBLAS products per tile pair;
  exact, slower than the kernels).
- every launch goes on CuPy's current stream; nothing here synchronizes the device.
"""
import hashlib
import os
import re
from collections import OrderedDict
from importlib import resources
from pathlib import Path

import numpy as np

try:  # the module is importable without CuPy (CI); instance() says why it cannot run
    import cupy
except ImportError:  # pragma: no cover - exercised only where CuPy is missing
    cupy = None

from ..errors import BackendError
from . import padding, tma

SUPPORTED_HEAD_DIMS = (64, 128)  # native kernel widths of every family; narrower heads are zero-padded
# native widths per (family, direction): the sm90 family adds D = 256 (Gemma-style heads)
_NATIVE_WIDTHS = {("sm80", "fwd"): (64, 128), ("sm80", "bwd"): (64, 128),
                  ("sm90", "fwd"): (64, 128, 256), ("sm90", "bwd"): (64, 128, 256)}
# the sm90 forward's schedule: K/V bytes a chunk of heads may keep in L2 (H100: 50 MB), and the
# throughput of D = 64 with two consumer warpgroups relative to three (bench_kernels.py --fwd-shapes)
_L2_CHUNK_BYTES = 24 << 20
_D64_TWO_CONSUMER_RATE = 0.85
_SM90_HEAD_DIMS = (64, 128, 256)  # the rows of the sm90 sources' geometry tables (attn_*_sm90_geometry)
# wider heads run the tiled online softmax of numpy_backend on CuPy arrays (batched cuBLAS products per
# tile pair, float32): exact, slower than a fused kernel; tiles of this many queries x keys
_WIDE_TILE = 1024
_LOG2E = 1.4426950408889634
_FWD_BN, _BWD_BM = 64, 64
# sm80 backward (attn_bwd.cu, layout k4x2): 8 warps, keys per CTA
_BWD_WARPS, _BWD_BN = 8, 128
_THREADS = 256


def cuda_dir():
    """Directory holding the kernel sources: $BURST_HPC_CUDA_DIR, else the package's kernels/
    (the repository's cuda/, which the wheel installs as burst_hpc/kernels), else the cuda/ of the
    source tree this module runs from (a checkout on PYTHONPATH, an editable install)."""
    env = os.environ.get("BURST_HPC_CUDA_DIR")
    if env:
        return Path(env)
    installed = resources.files("burst_hpc") / "kernels"
    if installed.is_dir():
        return installed
    return Path(__file__).resolve().parents[2] / "cuda"


def _inline_source(name, root):
    """Source of cuda/<name> with its local #include "x.cuh" headers pasted in (once each), so the
    text CuPy hashes for its compile cache covers the headers too. #line directives keep error
    messages pointing at the real files."""
    seen = set()

    def expand(fname):
        text = (root / fname).read_text()
        out = [f'#line 1 "cuda/{fname}"']
        for i, line in enumerate(text.splitlines(), start=1):
            m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
            if m:
                inc = m.group(1)
                if inc not in seen:
                    seen.add(inc)
                    out.append(expand(inc))
                out.append(f'#line {i + 1} "cuda/{fname}"')
            elif line.strip() == "#pragma once":
                out.append("")
            else:
                out.append(line)
        return "\n".join(out)

    return expand(name)


def _dtype_kind(dtype):
    """'bf16' | 'f16' | 'f32' for an input dtype, or raise."""
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return "f16"
    if dtype.name == "bfloat16" or dtype == np.uint16:
        return "bf16"
    if dtype == np.float32:
        return "f32"
    raise BackendError(f"the cuda backend takes bfloat16, float16 or float32 inputs; got {dtype}")


# Kernel families, newest first. "sm90": wgmma / TMA / warp-specialized kernels for Hopper (sm_90a);
# "sm80": the mma.sync / ldmatrix / cp.async kernels, which run on any GPU of compute capability >= 8.0.
FAMILIES = ("sm90", "sm80")
_FAMILY_ENV = "BURST_HPC_KERNELS"  # set to "sm80" to force the mma.sync family on Hopper


def kernel_families(capability=None):
    """The kernel families the current GPU runs, the default first. ``capability``: (major, minor)."""
    if capability is None:
        capability = _capability()
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
    forced = os.environ.get(_FAMILY_ENV)
    if forced:
        if forced not in FAMILIES:
            raise BackendError(f"{_FAMILY_ENV} must be one of {FAMILIES}; got {forced!r}")
        if forced not in families:
            raise BackendError(f"{_FAMILY_ENV}={forced} does not run on this GPU (it runs {families or 'none'})")
        return forced
    if not families:
        raise BackendError("the cuda backend needs a GPU of compute capability 8.0 or newer")
    return families[0]


def _require_gpu():
    if cupy is None:
        raise BackendError("the cuda backend needs CuPy (pip install cupy-cuda13x)")
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - any runtime failure means no usable GPU
        raise BackendError(f"the cuda backend found no usable GPU: {exc}") from exc
    if n < 1:
        raise BackendError("the cuda backend found no GPU")


def _capability():
    cc = cupy.cuda.Device().compute_capability  # e.g. "90"
    return int(cc[:-1]), int(cc[-1])


class CudaBackend:
    name = "cuda"
    xp = cupy
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
        self.family = family
        self._modules = {}
        self._kernels = {}
        self._geometries = {}
        self._bf16 = np.dtype("bfloat16") if _has_bf16() else None
        self.source_hash = None
        self._wide_backend = None
        self._forced_fwd_rows = None  # bench_kernels.py --fwd-shapes: time one sm90 forward shape

    # ---- compilation -------------------------------------------------------------------------------
    def _module(self, fname):
        mod = self._modules.get(fname)
        if mod is None:
            src = _inline_source(fname, cuda_dir())
            self.source_hash = hashlib.sha256(src.encode()).hexdigest()[:12]
            options = ("-std=c++17", "-arch=sm_90a") if "sm90" in fname else ("-std=c++17",)
            mod = cupy.RawModule(code=src, options=options)
            self._modules[fname] = mod
        return mod

    def _sm90_geometry(self, fname, d):
        """The tile geometry the sm90 source defines for head dim d (its ``<name>_geometry`` table):
        fwd (query rows, keys, threads, shared bytes); bwd (keys, query rows, threads, shared bytes). Row
        ``_SM90_HEAD_DIMS.index(d)`` of the table, read alone (16 bytes), so a table with fewer rows than
        _SM90_HEAD_DIMS still serves the head dims it has."""
        key = (fname, d)
        geo = self._geometries.get(key)
        if geo is None:
            symbol = fname.replace(".cu", "_geometry")
            row = self._module(fname).get_global(symbol) + 16 * _SM90_HEAD_DIMS.index(d)
            geo = tuple(int(x) for x in cupy.ndarray((4,), np.int32, memptr=row).get())
            self._geometries[key] = geo
        return geo

    def _sm90_forward_shapes(self, d):
        """The sm90 forward's instantiated shapes for head dim d: [(query rows, keys, threads, shared bytes)]
        (its ``attn_fwd_sm90_geometry`` table, one row per shape, head dim first)."""
        key = ("attn_fwd_sm90.cu", "shapes")
        table = self._geometries.get(key)
        if table is None:
            mod = self._module("attn_fwd_sm90.cu")
            table = cupy.ndarray((4, 5), np.int32, memptr=mod.get_global("attn_fwd_sm90_geometry")).get().tolist()
            self._geometries[key] = table
        return [tuple(row[1:]) for row in table if row[0] == d]

    def native_widths(self, direction="fwd"):
        """The head dims this family runs natively (``direction``: 'fwd' or 'bwd'); others are padded."""
        return _NATIVE_WIDTHS[self.family, direction]

    def _kernel(self, fname, kname, smem):
        # keyed by device too: a RawKernel sets the shared-memory limit for the device current at the
        # time, and a launch on another device without it fails (CUDA_ERROR_INVALID_VALUE)
        key = (cupy.cuda.Device().id, fname, kname)
        kern = self._kernels.get(key)
        if kern is None:
            kern = self._module(fname).get_function(kname)
            if smem > 48 * 1024:
                kern.max_dynamic_shared_size_bytes = smem
            self._kernels[key] = kern
        return kern

    # ---- argument preparation ----------------------------------------------------------------------
    def _half(self, x, want):
        """A 16-bit device array (kernel input) with D contiguous and 16-byte aligned rows.
        want: 'bf16' or 'f16' (what float32 inputs are converted to)."""
        kind = _dtype_kind(x.dtype)
        if kind == "f32" or (kind != want):
            x = x.astype(self._bf16_dtype() if want == "bf16" else np.float16)
        item = x.itemsize
        ok = (x.strides[-1] == item and x.data.ptr % 16 == 0
              and all((s // item) % 8 == 0 and s % item == 0 for s in x.strides[:-1]))
        if not ok:
            x = cupy.ascontiguousarray(x)
        return x

    def _bf16_dtype(self):
        if self._bf16 is None:
            raise BackendError("float32 inputs need CuPy with bfloat16 support (CuPy >= 14 with ml_dtypes)")
        return self._bf16

    @staticmethod
    def _out(x, name):
        """(array the kernel writes, array to copy back into x or None). float32, D contiguous, 8-byte
        aligned pairs; otherwise a contiguous scratch copy is used and copied back on the stream."""
        if x.dtype != np.float32:
            raise BackendError(f"{name} must be a float32 accumulator; got {x.dtype}")
        ok = (x.strides[-1] == 4 and x.data.ptr % 8 == 0 and all(s % 8 == 0 for s in x.strides[:-1]))
        if ok:
            return x, None
        tmp = cupy.ascontiguousarray(x)
        return tmp, x

    @staticmethod
    def _f32_rows(x, name):
        """lse / delta (B, H, S) float32 views: any strides, element-aligned."""
        if x.dtype != np.float32:
            raise BackendError(f"{name} must be float32; got {x.dtype}")
        if x.data.ptr % 4 or any(s % 4 for s in x.strides):
            return cupy.ascontiguousarray(x), x
        return x, None

    @staticmethod
    def _strides(x):
        return [np.int64(s // x.itemsize) for s in x.strides]

    @staticmethod
    def _check_dims(q, k, widths=SUPPORTED_HEAD_DIMS):
        d = q.shape[-1]
        if d not in widths:
            raise BackendError(f"the cuda backend supports head_dim {widths}; got {d}")
        if k.shape[-1] != d or q.shape[2] % k.shape[2]:
            raise BackendError(f"bad shapes q {q.shape} k {k.shape}")
        return d

    def _kind_pair(self, q):
        kind = _dtype_kind(q.dtype)
        return "bf16" if kind in ("bf16", "f32") else "f16"

    @staticmethod
    def _mask_args(mask, q_start, sq, k_start):
        """Kernel arguments (mlo, mhi, kofs): the interval kernels read each query row's key bounds
        (masks.Mask, docs/KERNELS.md "Masks"); other modes take null pointers."""
        if mask is None:
            return (np.uint64(0), np.uint64(0), np.int64(0))
        lo, hi = mask.device_intervals(cupy)
        return (lo[q_start:q_start + sq], hi[q_start:q_start + sq], np.int64(k_start))

    # ---- the three block calls ---------------------------------------------------------------------
    def forward_block(self, q, k, v, o, lse, *, scale, causal=False, q_start=0, k_start=0, mask=None):
        widths = self.native_widths("fwd")
        if q.shape[-1] > max(widths):
            return self._wide().forward_block(*_wide_inputs(q, k, v), o, lse, scale=scale, causal=causal,
                                              q_start=q_start, k_start=k_start, mask=mask if causal else None)
        if q.shape[-1] not in widths:  # zero-padded to a native width, then back here
            return padding.forward_block(self, widths, q, k, v, o, lse, scale=scale, causal=causal,
                                         q_start=q_start, k_start=k_start, mask=mask)
        d = self._check_dims(q, k, widths)
        b, sq, hq, _ = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        if b == 0 or sq == 0 or hq == 0 or sk == 0:
            return
        kind = self._kind_pair(q)
        q, k, v = (self._half(x, kind) for x in (q, k, v))
        o_w, o_back = self._out(o, "o")
        l_w, l_back = self._f32_rows(lse, "lse")
        mask = mask if causal else None  # an unmasked pair runs the full kernel
        if self.family == "sm90":
            self._forward_sm90(kind, d, q, k, v, o_w, l_w, scale, causal, q_start, k_start, mask)
        else:
            self._forward_sm80(kind, d, q, k, v, o_w, l_w, scale, causal, q_start, k_start, mask)
        if o_back is not None:
            o_back[...] = o_w
        if l_back is not None:
            l_back[...] = l_w

    def _forward_sm90(self, kind, d, q, k, v, o_w, l_w, scale, causal, q_start, k_start, mask=None):
        b, sq, hq, _ = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        bm, bn, threads, smem = self._forward_shape(d, b * hq, sq)
        try:
            maps = tma.device_maps(cupy, ((q, bm), (k, bn), (v, bn)))
        except tma.TensorMapError:  # a stride order the driver refuses: run on contiguous copies
            q, k, v = (cupy.ascontiguousarray(x) for x in (q, k, v))
            maps = tma.device_maps(cupy, ((q, bm), (k, bn), (v, bn)))
        mode = _mode(causal, mask)
        kern = self._kernel("attn_fwd_sm90.cu", f"attn_fwd_sm90_{kind}_d{d}_m{bm // 64}_{mode}", smem)
        # the schedule: heads in chunks whose K/V stay in L2, query blocks longest first inside a chunk
        nmb = -(-sq // bm)
        kv_bytes_per_head = 2 * sk * d * q.itemsize * hkv // hq
        hchunk = max(1, min(b * hq, _L2_CHUNK_BYTES // max(1, kv_bytes_per_head)))
        order = _longest_first(mask, q_start, sq, k_start, sk, bm, bn) if mask is not None else np.uint64(0)
        grid = (min(nmb * b * hq, _sm_count()),)
        args = (maps, o_w, l_w, *self._strides(o_w)[:3], *self._strides(l_w), np.int32(sq), np.int32(sk),
                np.int32(b), np.int32(hq), np.int32(hq // hkv), np.float32(scale * _LOG2E),
                np.int64(int(q_start) - int(k_start)), np.int32(hchunk), order,
                *self._mask_args(mask, q_start, sq, k_start), cupy.zeros(1, np.int32))
        kern(grid, (threads,), args, shared_mem=smem)

    def _forward_shape(self, d, heads, sq):
        """The sm90 forward shape (query rows, keys, threads, shared bytes) for `heads` (batch x query heads)
        of sq queries: the one whose rounds over the SMs cover the fewest query rows, weighted by its
        throughput (D = 64: three consumer warpgroups feed the tensor cores better than two)."""
        shapes = self._sm90_forward_shapes(d)
        if self._forced_fwd_rows is not None:
            return next(s for s in shapes if s[0] == self._forced_fwd_rows)

        def cost(shape):
            rows = shape[0]
            rounds = -(-(-(-sq // rows) * heads) // _sm_count())
            return rounds * rows / (_D64_TWO_CONSUMER_RATE if (d == 64 and rows == 128) else 1.0)

        return min(shapes, key=cost)

    def _forward_sm80(self, kind, d, q, k, v, o_w, l_w, scale, causal, q_start, k_start, mask=None):
        b, sq, hq, _ = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        nw, bm, bn = 4, 128, _FWD_BN  # 4 warps x 32 query rows, 64-key tiles
        smem = (bm * d + 4 * bn * d) * 2
        name = f"attn_fwd_{kind}_d{d}_{_mode(causal, mask)}"
        kern = self._kernel("attn_fwd.cu", name, smem)
        grid = ((sq + bm - 1) // bm, hq, b)
        args = (q, k, v, o_w, l_w, *self._strides(q)[:3], *self._strides(k)[:3], *self._strides(v)[:3],
                *self._strides(o_w)[:3], *self._strides(l_w), np.int32(sq), np.int32(sk), np.int32(hq // hkv),
                np.float32(scale * _LOG2E), np.int64(int(q_start) - int(k_start)),
                *self._mask_args(mask, q_start, sq, k_start))
        kern(grid, (nw * 32,), args, shared_mem=smem)

    def backward_block(self, q, k, v, do, lse, delta, dq, dk, dv, *, scale, causal=False, q_start=0, k_start=0,
                       mask=None):
        widths = self.native_widths("bwd")
        if q.shape[-1] > max(widths):
            return self._wide().backward_block(*_wide_inputs(q, k, v, do), lse, delta, dq, dk, dv, scale=scale,
                                               causal=causal, q_start=q_start, k_start=k_start,
                                               mask=mask if causal else None)
        if q.shape[-1] not in widths:  # zero-padded to a native width, then back here
            return padding.backward_block(self, widths, q, k, v, do, lse, delta, dq, dk, dv, scale=scale,
                                          causal=causal, q_start=q_start, k_start=k_start, mask=mask)
        d = self._check_dims(q, k, widths)
        b, sq, hq, _ = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        if b == 0 or sq == 0 or hq == 0 or sk == 0:
            return
        kind = self._kind_pair(q)
        q, k, v, do = (self._half(x, kind) for x in (q, k, v, do))
        lse_r, _ = self._f32_rows(lse, "lse")
        delta_r, _ = self._f32_rows(delta, "delta")
        dq_w, dq_back = self._out(dq, "dq")
        dk_w, dk_back = self._out(dk, "dk")
        dv_w, dv_back = self._out(dv, "dv")
        mask = mask if causal else None  # an unmasked pair runs the full kernel
        if self.family == "sm90":
            self._backward_sm90(kind, d, q, k, v, do, lse_r, delta_r, dq_w, dk_w, dv_w, scale, causal, q_start, k_start,
                                mask)
        else:
            self._backward_sm80(kind, d, q, k, v, do, lse_r, delta_r, dq_w, dk_w, dv_w, scale, causal, q_start, k_start,
                                mask)
        for w, back in ((dq_w, dq_back), (dk_w, dk_back), (dv_w, dv_back)):
            if back is not None:
                back[...] = w

    def _wide(self):
        """The block backend of head dims wider than the kernels (see _WIDE_TILE)."""
        from .numpy_backend import NumpyBackend

        if self._wide_backend is None:
            self._wide_backend = NumpyBackend(_WIDE_TILE, _WIDE_TILE, xp=cupy)
        return self._wide_backend

    @staticmethod
    def _group_split(group, key_blocks, kv_heads):
        """(query heads per CTA, CTAs per GQA group): split the group over CTAs only as far as needed to
        fill the GPU (fewer dK/dV atomics). ``kv_heads``: batch x kv heads."""
        target = 2 * _sm_count()
        hpb = group
        while hpb > 1 and key_blocks * kv_heads * (group // hpb) < target:
            hpb -= 1
            while group % hpb:
                hpb -= 1
        return hpb, group // hpb

    def _backward_sm90(self, kind, d, q, k, v, do, lse, delta, dq, dk, dv, scale, causal, q_start, k_start,
                       mask=None):
        b, sq, hq, _ = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        bn, bm, threads, smem = self._sm90_geometry("attn_bwd_sm90.cu", d)
        group = hq // hkv
        nkb = (sk + bn - 1) // bn
        hpb, nsplit = self._group_split(group, nkb, b * hkv)
        # dq, dk, dv are added into through float32 tensor maps (16-byte aligned address and strides); any
        # other accumulator gets a zeroed scratch array, added in afterwards
        def target(x):
            aligned = x.data.ptr % 16 == 0 and all(st % 16 == 0 for st in x.strides[:-1])
            return x if aligned else cupy.zeros(x.shape, np.float32)

        dq_w, dk_w, dv_w = target(dq), target(dk), target(dv)
        # float32 boxes: 32 columns (128 bytes) x 64 rows at every D: the kernels add parts of 64 rows (a dQ
        # part of 64 queries; a consumer's 64 keys of dK, dV, at D = 256 its 128 head-dim columns of all 64)
        try:
            maps = tma.device_maps(cupy, ((q, bm), (k, bn), (v, bn), (do, bm), (dq_w, 64), (dk_w, 64), (dv_w, 64)))
        except tma.TensorMapError:  # a stride order the driver refuses: contiguous copies, scratch accumulators
            q, k, v, do = (cupy.ascontiguousarray(x) for x in (q, k, v, do))
            dq_w, dk_w, dv_w = (w if w is not x else cupy.zeros(x.shape, np.float32)
                                for w, x in ((dq_w, dq), (dk_w, dk), (dv_w, dv)))
            maps = tma.device_maps(cupy, ((q, bm), (k, bn), (v, bn), (do, bm), (dq_w, 64), (dk_w, 64), (dv_w, 64)))
        sq_pad = -(-sq // bm) * bm
        # the row table (attn_bwd_sm90_rows): lse * log2(e) and delta per (batch, head, row), then with a
        # mask each row's visible key range; the ranges of query tiles per key block (attn_bwd_sm90_ranges)
        mlo, mhi, kofs = self._mask_args(mask, q_start, sq, k_start)
        rows = cupy.empty(2 * b * hq * sq_pad + (2 * sq_pad if mask is not None else 0), np.float32)
        prep = self._kernel("attn_bwd_sm90.cu", "attn_bwd_sm90_rows", 0)
        s = self._strides
        prep((min(-(-b * hq * sq_pad // _THREADS), 4096),), (_THREADS,),
             (lse, delta, rows, *s(lse), *s(delta), np.int32(b), np.int32(hq), np.int32(sq), np.int32(sq_pad), mlo,
              mhi, kofs, np.int32(sk)))
        ranges = np.uint64(0)
        if mask is not None:
            ranges = cupy.empty(2 * nkb, np.int32)
            find = self._kernel("attn_bwd_sm90.cu", "attn_bwd_sm90_ranges", 0)
            find((-(-nkb // 128),), (128,), (mlo, mhi, kofs, np.int32(sq), np.int32(sk), np.int32(bn), np.int32(bm),
                                             np.int32(nkb), ranges))
        kern = self._kernel("attn_bwd_sm90.cu", f"attn_bwd_sm90_{kind}_d{d}_{_mode(causal, mask)}", smem)
        args = (maps, rows, np.int32(sq), np.int32(sq_pad), np.int32(sk), np.int32(hq), np.int32(hkv),
                np.int32(group), np.int32(hpb), np.float32(scale), np.float32(scale * _LOG2E),
                np.int64(int(q_start) - int(k_start)), ranges)
        kern((nkb, nsplit, b * hkv), (threads,), args, shared_mem=smem)
        for w, x in ((dq_w, dq), (dk_w, dk), (dv_w, dv)):
            if w is not x:
                x += w

    def _backward_sm80(self, kind, d, q, k, v, do, lse_r, delta_r, dq_w, dk_w, dv_w, scale, causal, q_start,
                       k_start, mask=None):
        b, sq, hq, _ = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        group = hq // hkv
        mode = _mode(causal, mask)
        bn = _BWD_BN
        smem = (2 * bn * d + 4 * _BWD_BM * d + 2 * bn * _BWD_BM) * 2 + (8 if mask is not None else 4) * _BWD_BM * 4
        nkb = (sk + bn - 1) // bn
        hpb, nsplit = self._group_split(group, nkb, b * hkv)
        s = self._strides
        # 1-D grid; causal: heavy key blocks first inside chunks of order_g head slots (see attn_bwd.cu)
        slots = nsplit * b * hkv
        order_g = min(slots, max(1, -(-2 * _sm_count() // nkb))) if mode == "causal" else 1
        extra = (np.int32(order_g), *self._mask_args(mask, q_start, sq, k_start))
        args = (q, k, v, do, lse_r, delta_r, dq_w, dk_w, dv_w, *s(q)[:3], *s(k)[:3], *s(v)[:3], *s(do)[:3],
                *s(lse_r), *s(delta_r), *s(dq_w)[:3], *s(dk_w)[:3], *s(dv_w)[:3], np.int32(sq), np.int32(sk),
                np.int32(hkv), np.int32(group), np.int32(hpb), np.float32(scale), np.float32(scale * _LOG2E),
                np.int64(int(q_start) - int(k_start)), np.int32(1 if nsplit > 1 else 0), *extra)
        kern = self._kernel("attn_bwd.cu", f"attn_bwd_{kind}_d{d}_{mode}_k4x2", smem)
        kern((nkb * slots, 1, 1), (_BWD_WARPS * 32,), args, shared_mem=smem)

    def delta(self, do, o):
        b, s, h, d = do.shape
        out = cupy.empty((b, h, s), np.float32)
        if out.size == 0:
            return out
        kinds = {"bf16": 0, "f16": 1, "f32": 2}
        if do.strides[-1] != do.itemsize:
            do = cupy.ascontiguousarray(do)
        if o.strides[-1] != o.itemsize:
            o = cupy.ascontiguousarray(o)
        kern = self._kernel("attn_delta.cu", "attn_delta", 0)
        rows = b * s * h
        kern(((rows + 7) // 8,), (_THREADS,),
             (do, o, out, *self._strides(do)[:3], *self._strides(o)[:3], np.int32(b), np.int32(s), np.int32(h),
              np.int32(d), np.int32(kinds[_dtype_kind(do.dtype)]), np.int32(kinds[_dtype_kind(o.dtype)])))
        return out


def _mode(causal, mask):
    """The kernel instance of a block pair: interval (documents / windows), causal or full."""
    return "interval" if mask is not None else "causal" if causal else "full"


_ORDERS = OrderedDict()


def _longest_first(mask, q_start, sq, k_start, sk, bm, bn):
    """The sm90 forward's interval schedule: the query blocks of bm rows ordered by their key tiles of bn
    (from the mask's bounds), most first, as an int32 device array; a few are kept (a ring repeats them)."""
    key = (mask, int(q_start), sq, int(k_start), sk, bm, bn, cupy.cuda.Device().id)
    order = _ORDERS.get(key)
    if order is None:
        lo, hi = mask.rows(q_start, sq)
        first = np.arange(0, sq, bm)
        last = np.minimum(first + bm, sq) - 1
        begin = np.clip(lo[first] - k_start, 0, sk) // bn
        end = -(-np.clip(hi[last] - k_start, 0, sk) // bn)
        order = cupy.asarray(np.argsort(-(end - begin), kind="stable").astype(np.int32))
        _ORDERS[key] = order
        if len(_ORDERS) > 64:
            _ORDERS.popitem(last=False)
    else:
        _ORDERS.move_to_end(key)
    return order


def _wide_inputs(*arrays):
    """Inputs of the wide-head path: uint16 arrays are raw bf16 bits, as for the kernels."""
    for x in arrays:
        _dtype_kind(x.dtype)  # raises on a dtype the backend does not take
    return [x.view(np.dtype("bfloat16")) if x.dtype == np.uint16 else x for x in arrays]


_SM_COUNT = None


def _sm_count():
    global _SM_COUNT
    if _SM_COUNT is None:
        _SM_COUNT = cupy.cuda.Device().attributes["MultiProcessorCount"]
    return _SM_COUNT


def _has_bf16():
    try:
        import ml_dtypes  # noqa: F401

        cupy.zeros(1, dtype=np.dtype("bfloat16"))
        return True
    except Exception:  # noqa: BLE001 - older CuPy: no bf16 arrays
        return False
