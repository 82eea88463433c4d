"""The sm90 family's launches: the wgmma / TMA / warp-specialized kernels of attn_fwd_sm90.cu and
attn_bwd_sm90.cu, Hopper only (sm_90a; docs/KERNELS.md, "sm90 forward", "sm90 backward"). Kernel names and
geometry come from the sources' kernel tables (contract.py)."""
from typing import NamedTuple

import numpy as np

from . import launch, tma
from ...recent import Recent
from ...plan.tiles import WALK_DOWN_BLOCKS, backward_tiles, forward_tiles, packed_heads, walk_down
from .contract import PARAMS, SOURCES, mask_mode
from .launch import mask_args, strides

FORWARD, BACKWARD = SOURCES["sm90", "fwd"], SOURCES["sm90", "bwd"]
# the forward's schedule: K/V bytes a chunk of heads may keep in L2 (H100: 50 MB), and the throughput of
# D = 64 with two consumer warpgroups relative to three (bench_kernels.py --fwd-shapes)
L2_CHUNK_BYTES = 24 << 20
D64_TWO_CONSUMER_RATE = 0.85
# key splits: what a part of a query tile costs beyond its key tiles (its start and its merge), in key tiles,
# and the most parts a query tile is cut into
SPLIT_PART_COST = 2
MAX_KEY_SPLITS = 8
_PREPASS_THREADS = 256  # the backward's row-table pre-pass and conversion (grid-stride loops: any block size)
_PREPASS_BLOCKS = 16384  # at most this many blocks of them (each thread then takes several rows)
# the backward adds into dq, dk, dv in parts of 64 rows (a dQ part of 64 queries; a consumer's 64 keys of dK,
# dV, at D = 256 its 128 head-dim columns of all 64): float32 boxes of 32 columns (128 bytes) x 64 rows
_ACCUMULATOR_BOX_ROWS = 64


class Sm90Kernels:
    """Forward and backward launches of the sm90 family (inputs already marshalled by the backend).

    ``forced_tile_height``: None, or the forward tile height (query rows) to run instead of the one the
    schedule picks (bench_kernels.py --fwd-shapes, the tests of every tile height).

    ``heavy_first``: the backward's CTA order under documents and causal masks. True (the default): one
    document's key blocks at a time, the heaviest documents first (``launch.key_block_order``; a causal mask's
    key blocks in pieces of a few while the grid is a few waves, ``launch.causal_order_band``); False: head slot
    after head slot, key blocks in order, the order of full masks and sliding windows (bench_kernels.py
    --bwd-order and bench/backward_order.py time both).
    ``walk_down_blocks``: under an interval mask, the longest piece (a document's key blocks) whose backward CTAs
    walk their query tiles from the last down (``plan.tiles.walk_down``); 0: every CTA walks up.
    ``key_splits``: let the forward cut each query tile's key range across CTAs when its query tiles leave
    SMs idle (``key_split``); ``forced_key_splits``: None, or the parts to cut into whatever the count.
    ``cross_tile``: the forward's cross-tile step (a tile's last P V issued with the next tile's first Q K^T;
    shapes with two Q buffers, D <= 128 with two consumer warpgroups; on by default: 3-6% at 16k, docs/KERNELS.md). ``max_ctas``: None, or at most this many
    CTAs for the persistent forward (tests and the sanitizer: many tiles per CTA on small shapes).
    ``pack_gqa``: under an interval mask the forward packs the query heads of a K/V group into a tile's rows
    (``plan.tiles.packed_heads``; PackGQA).

    The launches take the block contract's first / last flags (``ends``): the forward writes its 16-bit output
    from the epilogue and skips the running (o, lse) at a first pair; the backward's row pre-pass computes
    delta from do and o and zeroes dq at a first pair, dK and dV go straight to their 16-bit outputs where one
    CTA holds the whole GQA group of its keys, and dq is converted once after the launch (attn_bwd_sm90_to16)."""

    ends = True

    def __init__(self, modules):
        self.modules = modules
        self.forward_args = launch.KernelArgs(PARAMS["sm90", "fwd"])
        self.backward_args = launch.KernelArgs(PARAMS["sm90", "bwd"])
        self.forced_tile_height = None
        self.heavy_first = True
        self.walk_down_blocks = WALK_DOWN_BLOCKS
        self.key_splits = False
        self.forced_key_splits = None
        self.cross_tile = True
        self.max_ctas = None
        self.pack_gqa = True
        self._splits = {}
        self._counters = {}
        self._locks = {}
        # launches by call shape; those of at most 16 interval masks (each holds its mask's bounds on the device)
        self.launches = Recent(256, tags=16)

    def tile_heights(self, d):
        """The forward's tile heights (query rows per tile) for head dim d, as its source instantiates them."""
        return self.modules.table(FORWARD).tile_heights(d)

    def tile_height(self, d, heads, sq):
        """The forward's tile height for `heads` (batch x query heads) of sq queries: the one whose rounds
        over the SMs cover the fewest query rows, weighted by its throughput (D = 64: three consumer
        warpgroups, 192 rows, feed the tensor cores better than two). The rounds are counted on a grid of tiles:
        under documents the kernel runs a few more (plan/tiles.forward_tiles: one or so a long document)."""
        if self.forced_tile_height is not None:
            return self.forced_tile_height

        def cost(rows):
            rounds = -(-(-(-sq // rows) * heads) // launch.sm_count())
            return rounds * rows / (D64_TWO_CONSUMER_RATE if (d == 64 and rows == 128) else 1.0)

        return min(self.tile_heights(d), key=cost)

    def key_split(self, bm, bn, heads, sq, sk, mode, off):
        """The parts each forward query tile's key range is cut into (1: none). With ``key_splits`` on, for the
        full and causal kernels (``mode``, contract.mask_mode) whose query tiles (``heads`` x query blocks of bm
        rows) are fewer than the SMs:
        the count whose estimated time is least, in key tiles of bn: the longest part plus its cost
        (SPLIT_PART_COST), or all parts and their costs spread over the SMs, whichever is more."""
        if self.forced_key_splits is not None:
            return self.forced_key_splits
        nmb, sms = -(-sq // bm), launch.sm_count()
        if not self.key_splits or mode == "interval" or nmb * heads >= sms:
            return 1
        key = (bm, bn, heads, sq, sk, mode, off, sms)
        n = self._splits.get(key)
        if n is None:
            n = self._splits[key] = self._least_time_split(nmb, bm, bn, heads, sq, sk, mode == "causal", off, sms)
            if len(self._splits) > 256:
                self._splits.clear()
        return n

    @staticmethod
    def _least_time_split(nmb, bm, bn, heads, sq, sk, causal, off, sms):
        ends = np.full(nmb, sk, np.int64)
        if causal:
            ends = np.clip(np.minimum(np.arange(1, nmb + 1) * bm, sq) + off, 0, sk)
        key_tiles = -(-ends // bn)
        longest, work = int(key_tiles.max()), int(key_tiles.sum()) * heads
        if longest == 0:
            return 1

        def cost(n):
            return max(-(-longest // n) + SPLIT_PART_COST, (work + SPLIT_PART_COST * nmb * heads * n) / sms)

        return min(range(1, min(MAX_KEY_SPLITS, longest) + 1), key=cost)

    # ---- forward ---------------------------------------------------------------------------------------
    def tile_locks(self, n):
        """At least n int32 locks for the forward's key splits on the current device and stream, zero between
        launches (each is taken and given back inside the kernel); grown, never cleared, per call."""
        import cupy

        key = launch.stream_key(cupy)
        locks = self._locks.get(key)
        if locks is None or locks.size < n:
            locks = self._locks[key] = cupy.zeros(max(n, 1024), np.int32)
        return locks

    def tile_counter(self):
        """The forward's tile counter for the current device and stream: two int32 that are zero between
        launches (the kernel's last CTA zeroes them), made once, so a call allocates and clears nothing.
        Launches on one stream run one after another; each stream has its own counter."""
        import cupy

        key = launch.stream_key(cupy)
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = cupy.zeros(2, np.int32)
        return counter

    def settings(self):
        """The knobs above that change a launch (part of a kept launch's key)."""
        return (self.forced_tile_height, self.heavy_first, self.walk_down_blocks, self.key_splits,
                self.forced_key_splits, self.cross_tile, self.max_ctas, self.pack_gqa)

    def forward(self, kind, q, k, v, o, lse, *, scale, masked, mask, q_start, k_start, first=False, out=None):
        import cupy

        key = ("fwd", kind, _geometry(q), _geometry(k), _geometry(v), _geometry(o), _geometry(lse), _geometry(out),
               scale, masked, mask, int(q_start), int(k_start), first, self.settings(), launch.stream_key(cupy))
        made = self.launches.get(key)
        if made is None:
            made = self.launches.put(key, self._forward_launch(kind, q, k, v, o, lse, scale=scale, masked=masked,
                                                               mask=mask, q_start=q_start, k_start=k_start,
                                                               first=first, out=out), made_tag(masked, mask))
        if made.via_float32:
            # key splits merge their parts in float32, and the kernel writes only the query tiles it visits
            # (a last pair's other rows hold the running o): the output is converted afterwards
            o = cupy.empty(q.shape, np.float32) if o is None else o
            self.forward(kind, q, k, v, o, lse, scale=scale, masked=masked, mask=mask, q_start=q_start,
                         k_start=k_start, first=first)
            out[...] = o
            return
        if made.clear:
            # the running (o, lse) start empty here instead (lse = -inf: o is never read), so that rows no tile
            # visits hold (0, -inf)
            lse.fill(-np.inf)
            (o if out is None else out).fill(0)
        rows, bn, pack = made.tile
        try:
            maps = tma.device_maps(cupy, ((q, rows, pack), (k, bn), (v, bn)))
        except tma.TensorMapError:  # a stride order the driver refuses: run on contiguous copies
            copies = [cupy.ascontiguousarray(x) for x in (q, k, v)]
            if all(c is x for c, x in zip(copies, (q, k, v))):
                raise
            return self.forward(kind, *copies, o, lse, scale=scale, masked=masked, mask=mask, q_start=q_start,
                                k_start=k_start, first=first, out=out)
        made(tmaps=maps, o=o, lse=lse, out=out)

    def _forward_launch(self, kind, q, k, v, o, lse, *, scale, masked, mask, q_start, k_start, first, out):
        """The forward's launch.Kept for a call of these arrays' shapes and strides (their addresses apart)."""
        import cupy

        b, sq, hq, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        mode = mask_mode(masked, mask)
        kernel = self.modules.table(FORWARD).find(kind, d, mode, self.tile_height(d, b * hq, sq))
        bm, bn = kernel.query_rows, kernel.keys
        # a tile: `rows` positions of `pack` query heads (PackGQA under interval masks)
        pack = packed_heads(hq // hkv) if mode == "interval" and self.pack_gqa else 1
        rows = bm // pack
        off = int(q_start) - int(k_start)
        nsplit = self.key_split(bm, bn, b * hq, sq, sk, mode, off)
        every_tile = _every_tile_sees_keys(mode, mask, q_start, sq, k_start, sk, rows, bn)
        if out is not None and (nsplit > 1 or not (first or every_tile)):
            return launch.Kept(via_float32=True)
        clear = first and (nsplit > 1 or not every_tile)
        kern = self.modules.kernel(FORWARD, kernel.name, kernel.smem_bytes)
        # the schedule: heads (packs of them) in chunks whose K/V stay in L2, query tiles longest first inside a chunk
        kv_bytes_per_pack = 2 * sk * d * q.itemsize * hkv * pack // hq
        packs = b * hq // pack
        hchunk = max(1, min(packs, L2_CHUNK_BYTES // max(1, kv_bytes_per_pack)))
        order, nq = (None, -(-sq // bm))
        if mode == "interval":
            order, nq = _longest_first(mask, q_start, sq, k_start, sk, rows, bn)[:2]
        locks = self.tile_locks(nq * packs * (kernel.threads // 128 - 1)) if nsplit > 1 else None
        grid = (min(nq * packs * nsplit, launch.sm_count(), self.max_ctas or launch.sm_count()),)
        fields = dict(order=order, next_tile=self.tile_counter(), locks=locks)
        args = self.forward_args(q, k, scale=scale, q_start=q_start, k_start=k_start,
                                 mask=mask if mode == "interval" else None, tmaps=None, nq=nq, hchunk=hchunk,
                                 nsplit=nsplit, cross_tile=self.cross_tile, first=first and not clear,
                                 pack_log2=pack.bit_length() - 1, **fields,
                                 **launch.array_fields(("o", o, "osb oss osh"), ("lse", lse, "lsb lsh lss"),
                                                       ("out", out, "tsb tss tsh")))
        held = (fields, mask.device_intervals(cupy) if mode == "interval" else None)
        return launch.Kept(kern, grid, (kernel.threads,), kernel.smem_bytes, args, held=held, tile=(rows, bn, pack),
                           clear=clear, via_float32=False)

    # ---- backward --------------------------------------------------------------------------------------
    def backward(self, kind, q, k, v, do, lse, delta, dq, dk, dv, *, scale, masked, mask, q_start, k_start, o=None,
                 first_q=False, first_kv=False, dq_out=None, dk_out=None, dv_out=None):
        import cupy

        key = ("bwd", kind, *(_geometry(x) for x in (q, k, v, do, lse, delta, dq, dk, dv, o, dq_out, dk_out, dv_out)),
               scale, masked, mask, int(q_start), int(k_start), first_q, first_kv, self.settings(),
               launch.stream_key(cupy))
        made = self.launches.get(key)
        if made is None:
            made = self.launches.put(key, self._backward_launch(kind, q, k, v, do, delta, dq_out, dk_out, dv_out,
                                                                scale=scale, masked=masked, mask=mask,
                                                                q_start=q_start, k_start=k_start, first_kv=first_kv),
                                     made_tag(masked, mask))

        # dq, dk, dv are added into through float32 tensor maps (16-byte aligned address and strides); any
        # other accumulator gets a scratch array (zeroed, or at a first pair taken as it is), written back after;
        # None (a first and last pair) a scratch array
        def target(x, first):
            aligned = x.data.ptr % 16 == 0 and all(st % 16 == 0 for st in x.strides[:-1])
            return x if aligned else cupy.empty(x.shape, np.float32) if first else cupy.zeros(x.shape, np.float32)

        dq_w = cupy.empty(q.shape, np.float32) if dq is None else target(dq, first_q)
        if made.kv_direct:   # dk, dv are neither read nor written: their maps only fill the kernel's argument list
            dk_w = dv_w = dq_w
        else:
            dk_w = cupy.empty(k.shape, np.float32) if dk is None else target(dk, first_kv)
            dv_w = cupy.empty(v.shape, np.float32) if dv is None else target(dv, first_kv)
            if first_kv:
                dk_w.fill(0)
                dv_w.fill(0)
        bm, bn = made.tile

        def boxes():
            rows = _ACCUMULATOR_BOX_ROWS
            return (q, bm), (k, bn), (v, bn), (do, bm), (dq_w, rows), (dk_w, rows), (dv_w, rows)

        try:
            maps = tma.device_maps(cupy, boxes())
        except tma.TensorMapError:  # a stride order the driver refuses: contiguous copies, scratch accumulators
            q, k, v, do = (cupy.ascontiguousarray(x) for x in (q, k, v, do))
            dq_w, dk_w, dv_w = (w if w is not x else cupy.zeros(x.shape, np.float32)
                                for w, x in ((dq_w, dq), (dk_w, dk), (dv_w, dv)))
            maps = tma.device_maps(cupy, boxes())
        # the row table (attn_bwd_sm90_rows): lse * log2(e) and delta per (batch, head, row), delta computed
        # from do and o when not given, dq's rows zeroed at a first pair; then with a mask each row's visible key
        # range; the key blocks, query tiles and CTA order come from the host (_backward_schedule, _key_block_order)
        rows = cupy.empty(made.rows_size, np.float32)
        none = (np.uint64(0), *(np.int64(0),) * 3)
        delta_args = (delta, *strides(delta)) if delta is not None else none
        rows_of = ((do, o, *strides(do)[:3], *strides(o)[:3]) if delta is None
                   else (np.uint64(0),) * 2 + (np.int64(0),) * 6)
        zero_dq = (dq_w, *strides(dq_w)[:3]) if first_q else none
        made.prep(made.prep_grid, made.prep_block,
                  (lse, delta_args[0], rows, *strides(lse), *delta_args[1:], *made.prep_sizes, *rows_of,
                   made.prep_bf16, *zero_dq))
        made(tmaps=maps, rows=rows, **({"kv.dk": dk_out, "kv.dv": dv_out} if made.kv_direct else {}))
        results = ((dq_w, dq, dq_out, first_q),) + (() if made.kv_direct else ((dk_w, dk, dk_out, first_kv),
                                                                               (dv_w, dv, dv_out, first_kv)))
        for w, x, out, first in results:
            if w is not x and x is not None and not first:   # a scratch for a misaligned accumulator: added in
                x += w
                w = x
            if out is not None:   # the last pair: converted once, from the accumulator the kernel wrote
                if w is x and not (w.data.ptr % 16 == 0 and all(st % 16 == 0 for st in w.strides[:-1])):
                    out[...] = w
                else:
                    self.to16(kind, w, out)
            elif w is not x:
                x[...] = w

    def _backward_launch(self, kind, q, k, v, do, delta, dq_out, dk_out, dv_out, *, scale, masked, mask, q_start,
                         k_start, first_kv):
        """The backward's launch.Kept for a call of these arrays' shapes and strides (their addresses apart): its
        main launch, and the row pre-pass's kernel, grid and sizes."""
        import cupy

        b, sq, hq, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        mode = mask_mode(masked, mask)
        kernel = self.modules.table(BACKWARD).find(kind, d, mode)
        bm, bn = kernel.query_rows, kernel.keys
        group = hq // hkv
        plan = _backward_schedule(mode, mask, q_start, sq, k_start, sk, bm, bn, self.walk_down_blocks)
        nkb = plan.blocks
        # dK, dV straight into their 16-bit outputs when one CTA holds the whole GQA group of its keys and the
        # pair is their first and last; else added into float32 (zeroed here at a first pair, converted after)
        direct = first_kv and dk_out is not None and dk_out.strides == dv_out.strides
        hpb, nsplit = _group_split(mode, plan, group, b * hkv, direct)
        kv_direct = direct and nsplit == 1
        sq_pad = plan.tiles * bm
        mlo, mhi, kofs = mask_args(mask if mode == "interval" else None, q_start, sq, k_start)
        lanes = b * hq * sq_pad * (d // 8)
        slots = nsplit * b * hkv
        order = _key_block_order(mode, mask, plan, q_start, sq, k_start, sk, bm, bn, slots, self.heavy_first)
        kern = self.modules.kernel(BACKWARD, kernel.name, kernel.smem_bytes)
        kv = launch.array_fields(("dk", dk_out, "sb ss sh"), ("dv", dv_out, "")) if kv_direct else {}
        args = self.backward_args(q, k, scale=scale, q_start=q_start, k_start=k_start,
                                  mask=mask if mode == "interval" else None, tmaps=None,
                                  rows=None, ranges=plan.ranges, tiles=plan.firsts, order=order, Sq_pad=sq_pad,
                                  nkb=nkb, hpb=hpb, kv=kv)
        held = (plan, order, mask.device_intervals(cupy) if mode == "interval" else None)
        return launch.Kept(kern, (nkb * slots,), (kernel.threads,), kernel.smem_bytes, args, held=held,
                           tile=(bm, bn), kv_direct=kv_direct,
                           rows_size=2 * b * hq * sq_pad + (2 * sq_pad if mode == "interval" else 0),
                           prep=self.modules.kernel(BACKWARD, "attn_bwd_sm90_rows", 0),
                           prep_grid=(min(-(-lanes // _PREPASS_THREADS), _PREPASS_BLOCKS),),
                           prep_block=(_PREPASS_THREADS,),
                           prep_sizes=(np.int32(b), np.int32(hq), np.int32(sq), np.int32(sq_pad), plan.firsts,
                                       np.int32(bm), mlo, mhi, kofs, np.int32(sk), np.int32(d)),
                           prep_bf16=np.int32(kind == "bf16"))

    def to16(self, kind, x, out):
        """out (16-bit, ``kind``, rows 16-byte aligned) = the float32 accumulator x (B, S, H, D) (rows 16-byte
        aligned, as the kernels' accumulators are): one pass (attn_bwd_sm90_to16)."""
        b, s, h, d = x.shape
        kern = self.modules.kernel(BACKWARD, "attn_bwd_sm90_to16", 0)
        lanes = b * s * h * (d // 8)
        kern((min(-(-lanes // _PREPASS_THREADS), _PREPASS_BLOCKS),), (_PREPASS_THREADS,),
             (x, *strides(x)[:3], out, *strides(out)[:3], np.int32(b), np.int32(s), np.int32(h), np.int32(d),
              np.int32(kind == "bf16")))


_ORDERS = Recent(64)   # the schedules a ring repeats, a few kept


def made_tag(masked, mask):
    """What a kept launch holds on to: the interval mask whose device bounds its record points to, else None."""
    return mask if mask_mode(masked, mask) == "interval" else None


def _geometry(x):
    """What a launch's decisions read of an array (None stays None): its shape, strides and dtype, not its address."""
    return None if x is None else (x.shape, x.strides, x.dtype)


def _every_tile_sees_keys(mode, mask, q_start, sq, k_start, sk, bm, bn):
    """Whether the kernel instance ``mode`` (contract.mask_mode) visits every forward query tile of bm rows
    (it skips those that see no key)."""
    if mode == "interval":
        return _longest_first(mask, q_start, sq, k_start, sk, bm, bn)[2]
    # causal: the first tile sees the fewest keys, the key k_start when its last row is at or after it
    return sk > 0 and (mode == "full" or int(q_start) + min(bm, sq) - 1 >= int(k_start))


def _cached(key, make):
    """make() kept under ``key`` (with the current device)."""
    import cupy

    return _ORDERS.made(key + (cupy.cuda.Device().id,), make)


def _longest_first(mask, q_start, sq, k_start, sk, bm, bn):
    """The forward's interval schedule: (its query tiles (plan/tiles.forward_tiles) as int32 pairs (first row,
    end row) on the device, the most key tiles first; how many; whether the kernel visits every one)."""
    import cupy

    def make():
        t = forward_tiles(mask, q_start, sq, k_start, sk, bm, bn)
        by = np.argsort(-t.key_tiles, kind="stable")
        pairs = np.stack([t.first[by], t.end[by]], axis=1).astype(np.int32)
        return cupy.asarray(pairs.reshape(-1)), len(by), bool((t.key_tiles > 0).all())

    return _cached(("forward", mask, int(q_start), sq, int(k_start), sk, bm, bn), make)


class BackwardSchedule(NamedTuple):
    """The sm90 backward's key blocks and query tiles of one call (``_backward_schedule``)."""
    blocks: int        # key blocks (the CTAs of a head slot)
    tiles: int         # query tiles (the row table holds tiles x bm rows a head)
    ranges: object     # interval: per key block (t_lo, t_end, down, first key, end key), int32 on the device
    firsts: object     # interval: each query tile's first row, then sq, int32 on the device
    t_lo: np.ndarray   # the query tiles [t_lo, t_end) each key block walks (the CTA order's weights)
    t_end: np.ndarray


def _backward_schedule(mode, mask, q_start, sq, k_start, sk, bm, bn, down_blocks):
    """BackwardSchedule of a backward launch of instance ``mode``: under an interval mask the key blocks and query
    tiles of plan/tiles.backward_tiles (laid out from document starts) and each block's walk direction (walk_down
    with ``down_blocks``; a sliding window's walk up); else blocks of bn keys and tiles of bm rows on a grid, the
    kernel's own (null ranges and firsts), whose walks under a causal mask start where key block kb is first seen,
    at query kb * bn - off (the kernel's rule)."""
    import cupy

    if mode != "interval":
        nkb, tiles = -(-sk // bn), -(-sq // bm)
        t_end = np.full(nkb, tiles)
        t_lo = (np.clip((np.arange(nkb) * bn - (int(q_start) - int(k_start))) // bm, 0, t_end) if mode == "causal"
                else np.zeros(nkb, np.int64))
        return BackwardSchedule(nkb, tiles, np.uint64(0), np.uint64(0), t_lo, t_end)

    def make():
        t = backward_tiles(mask, q_start, sq, k_start, sk, bm, bn)
        down = walk_down(t.t_lo, t.t_end, down_blocks) if mask.window is None else np.zeros_like(t.t_end)
        ranges = np.stack([t.t_lo, t.t_end, down, t.block_first, t.block_end], 1).astype(np.int32)
        firsts = np.append(t.tile_first, sq).astype(np.int32)
        return BackwardSchedule(len(t.t_lo), len(t.tile_first), cupy.asarray(ranges.ravel()), cupy.asarray(firsts),
                                t.t_lo, t.t_end)

    return _cached(("backward", mask, int(q_start), sq, int(k_start), sk, bm, bn, down_blocks), make)


def _group_split(mode, plan, group, kv_heads, direct):
    """(query heads per CTA, CTAs per GQA group) of a backward launch of ``plan`` (a BackwardSchedule) over
    ``kv_heads`` (batch x K/V heads): launch.split_group over its blocks' walks. ``direct``: dK, dV could go
    straight into their 16-bit outputs, which a split forgoes; there, under an interval mask, the blocks that walk
    are weighed alike (the group split only to fill the GPU) unless that splits it anyway: the float32 round trip
    costs more than the heaviest CTA's tail (one H100, 8k documents, split for that tail: backward 0.94-0.96x),
    where a causal mask's many heavy blocks pay for it (8k, 64:8 heads: 1.07x)."""
    walks = plan.t_end - plan.t_lo
    if direct and mode == "interval":
        whole = launch.split_group(group, np.sign(walks), kv_heads)
        if whole[1] == 1:
            return whole
    return launch.split_group(group, walks, kv_heads)


def _key_block_order(mode, mask, plan, q_start, sq, k_start, sk, bm, bn, slots, heavy_first):
    """The backward's CTA order over plan's key blocks (a BackwardSchedule) x ``slots`` head slots: with
    ``heavy_first`` launch.key_block_order under documents, and under a causal mask while the grid is a few waves
    (launch.causal_order_band); else a null pointer, the kernel's own order, head slot after head slot. A sliding
    window keeps that plain order: its key blocks weigh alike (no tail to shorten) and each would be a piece of
    its own, the order that lost L2 sharing on documents."""
    import cupy

    band = launch.causal_order_band(plan.blocks, slots) if mode == "causal" else None
    ordered = heavy_first and (band is not None if mode == "causal" else mode == "interval" and mask.window is None)
    if not ordered:
        return np.uint64(0)
    return _cached(("order", mode, mask if mode == "interval" else None, int(q_start), sq, int(k_start), sk, bm, bn,
                    slots), lambda: cupy.asarray(launch.key_block_order(plan.t_lo, plan.t_end, slots, band)))
