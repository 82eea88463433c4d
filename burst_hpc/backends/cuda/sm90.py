"""The sm90 family's launches: the wgmma / TMA / warp-specialized kernels of attn_fwd_sm90.cu and
attn_bwd_sm90.cu, Hopper only (sm_90a; docs/KERNELS.md, "sm90 forward", "sm90 backward")."""
from collections import OrderedDict

import numpy as np

from . import launch, tma
from .contract import mask_mode
from .launch import LOG2E, mask_args, strides

# the forward's schedule: K/V bytes a chunk of heads may keep in L2 (H100: 50 MB), and the throughput of
# D = 64 with two consumer warpgroups relative to three (bench_kernels.py --fwd-shapes)
L2_CHUNK_BYTES = 24 << 20
D64_TWO_CONSUMER_RATE = 0.85
_HEAD_DIMS = (64, 128, 256)  # the rows of the sources' geometry tables (attn_*_sm90_geometry)
_PREPASS_THREADS = 256  # the backward's row-table pre-pass (a grid-stride loop: any block size)


class Sm90Kernels:
    """Forward and backward launches of the sm90 family (inputs already marshalled by the backend).

    ``forced_tile_height``: None, or the forward tile height (query rows) to run instead of the one the
    schedule picks (bench_kernels.py --fwd-shapes, the tests of every tile height)."""

    def __init__(self, modules):
        self.modules = modules
        self.forced_tile_height = None
        self._geometries = {}

    # ---- the sources' geometry tables ----------------------------------------------------------------
    def _geometry(self, source, d):
        """The backward's tile geometry for head dim d (its ``<name>_geometry`` table): (keys, query rows,
        threads, shared bytes). Row ``_HEAD_DIMS.index(d)`` of the table, read alone (16 bytes)."""
        import cupy

        key = (source, d)
        geo = self._geometries.get(key)
        if geo is None:
            symbol = source.replace(".cu", "_geometry")
            row = self.modules.module(source).get_global(symbol) + 16 * _HEAD_DIMS.index(d)
            geo = tuple(int(x) for x in cupy.ndarray((4,), np.int32, memptr=row).get())
            self._geometries[key] = geo
        return geo

    def forward_shapes(self, d):
        """The forward's instantiated shapes for head dim d: [(query rows, keys, threads, shared bytes)]
        (its ``attn_fwd_sm90_geometry`` table, one row per shape, head dim first)."""
        import cupy

        key = ("attn_fwd_sm90.cu", "shapes")
        table = self._geometries.get(key)
        if table is None:
            mod = self.modules.module("attn_fwd_sm90.cu")
            table = cupy.ndarray((4, 5), np.int32, memptr=mod.get_global("attn_fwd_sm90_geometry")).get().tolist()
            self._geometries[key] = table
        return [tuple(row[1:]) for row in table if row[0] == d]

    def forward_shape(self, d, heads, sq):
        """The forward shape (query rows, keys, threads, shared bytes) for `heads` (batch x query heads)
        of sq queries: the one whose rounds over the SMs cover the fewest query rows, weighted by its
        throughput (D = 64: three consumer warpgroups feed the tensor cores better than two)."""
        shapes = self.forward_shapes(d)
        if self.forced_tile_height is not None:
            return next(s for s in shapes if s[0] == self.forced_tile_height)

        def cost(shape):
            rows = shape[0]
            rounds = -(-(-(-sq // rows) * heads) // launch.sm_count())
            return rounds * rows / (D64_TWO_CONSUMER_RATE if (d == 64 and rows == 128) else 1.0)

        return min(shapes, key=cost)

    # ---- forward ---------------------------------------------------------------------------------------
    def forward(self, kind, q, k, v, o, lse, *, scale, causal, q_start, k_start, mask):
        import cupy

        b, sq, hq, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        bm, bn, threads, smem = self.forward_shape(d, b * hq, sq)
        try:
            maps = tma.device_maps(cupy, ((q, bm), (k, bn), (v, bn)))
        except tma.TensorMapError:  # a stride order the driver refuses: run on contiguous copies
            q, k, v = (cupy.ascontiguousarray(x) for x in (q, k, v))
            maps = tma.device_maps(cupy, ((q, bm), (k, bn), (v, bn)))
        mode = mask_mode(causal, mask)
        kern = self.modules.kernel("attn_fwd_sm90.cu", f"attn_fwd_sm90_{kind}_d{d}_m{bm // 64}_{mode}", smem)
        # the schedule: heads in chunks whose K/V stay in L2, query blocks longest first inside a chunk
        nmb = -(-sq // bm)
        kv_bytes_per_head = 2 * sk * d * q.itemsize * hkv // hq
        hchunk = max(1, min(b * hq, L2_CHUNK_BYTES // max(1, kv_bytes_per_head)))
        order = _longest_first(mask, q_start, sq, k_start, sk, bm, bn) if mask is not None else np.uint64(0)
        grid = (min(nmb * b * hq, launch.sm_count()),)
        args = (maps, o, lse, *strides(o)[:3], *strides(lse), np.int32(sq), np.int32(sk), np.int32(b), np.int32(hq),
                np.int32(hq // hkv), np.float32(scale * LOG2E), np.int64(int(q_start) - int(k_start)),
                np.int32(hchunk), order, *mask_args(mask, q_start, sq, k_start), cupy.zeros(1, np.int32))
        kern(grid, (threads,), args, shared_mem=smem)

    # ---- backward --------------------------------------------------------------------------------------
    def backward(self, kind, q, k, v, do, lse, delta, dq, dk, dv, *, scale, causal, q_start, k_start, mask):
        import cupy

        b, sq, hq, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        bn, bm, threads, smem = self._geometry("attn_bwd_sm90.cu", d)
        group = hq // hkv
        nkb = (sk + bn - 1) // bn
        hpb, nsplit = launch.split_group(group, nkb, b * hkv)

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
        mlo, mhi, kofs = mask_args(mask, q_start, sq, k_start)
        rows = cupy.empty(2 * b * hq * sq_pad + (2 * sq_pad if mask is not None else 0), np.float32)
        prep = self.modules.kernel("attn_bwd_sm90.cu", "attn_bwd_sm90_rows", 0)
        prep((min(-(-b * hq * sq_pad // _PREPASS_THREADS), 4096),), (_PREPASS_THREADS,),
             (lse, delta, rows, *strides(lse), *strides(delta), np.int32(b), np.int32(hq), np.int32(sq),
              np.int32(sq_pad), mlo, mhi, kofs, np.int32(sk)))
        ranges = np.uint64(0)
        if mask is not None:
            ranges = cupy.empty(2 * nkb, np.int32)
            find = self.modules.kernel("attn_bwd_sm90.cu", "attn_bwd_sm90_ranges", 0)
            find((-(-nkb // 128),), (128,), (mlo, mhi, kofs, np.int32(sq), np.int32(sk), np.int32(bn), np.int32(bm),
                                             np.int32(nkb), ranges))
        kern = self.modules.kernel("attn_bwd_sm90.cu", f"attn_bwd_sm90_{kind}_d{d}_{mask_mode(causal, mask)}", smem)
        args = (maps, rows, np.int32(sq), np.int32(sq_pad), np.int32(sk), np.int32(hq), np.int32(hkv),
                np.int32(group), np.int32(hpb), np.float32(scale), np.float32(scale * LOG2E),
                np.int64(int(q_start) - int(k_start)), ranges)
        kern((nkb, nsplit, b * hkv), (threads,), args, shared_mem=smem)
        for w, x in ((dq_w, dq), (dk_w, dk), (dv_w, dv)):
            if w is not x:
                x += w


_ORDERS = OrderedDict()


def _longest_first(mask, q_start, sq, k_start, sk, bm, bn):
    """The forward's interval schedule: the query blocks of bm rows ordered by their key tiles of bn (from
    the mask's bounds), most first, as an int32 device array; a few are kept (a ring repeats them)."""
    import cupy

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
