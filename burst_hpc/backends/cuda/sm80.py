"""The sm80 family's launches: the mma.sync / ldmatrix / cp.async kernels of attn_fwd.cu and attn_bwd.cu,
which run on any GPU of compute capability >= 8.0 (docs/KERNELS.md, "sm80 forward", "sm80 backward").
Kernel names and geometry come from the sources' kernel tables (contract.py)."""
import numpy as np

from . import launch
from .contract import SOURCES, mask_mode
from .launch import LOG2E, mask_args, strides

FORWARD, BACKWARD = SOURCES["sm80", "fwd"], SOURCES["sm80", "bwd"]


class Sm80Kernels:
    """Forward and backward launches of the sm80 family (inputs already marshalled by the backend). They take
    no first / last flags: the backend runs those around them (``ends``)."""

    ends = False

    def __init__(self, modules):
        self.modules = modules

    def forward(self, kind, q, k, v, o, lse, *, scale, masked, mask, q_start, k_start):
        b, sq, hq, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        mode = mask_mode(masked, mask)
        bounds = mask_args(mask if mode == "interval" else None, q_start, sq, k_start)   # the interval kernels'
        kernel = self.modules.table(FORWARD).find(kind, d, mode)
        kern = self.modules.kernel(FORWARD, kernel.name, kernel.smem_bytes)
        grid = (-(-sq // kernel.query_rows), hq, b)
        args = (q, k, v, o, lse, *strides(q)[:3], *strides(k)[:3], *strides(v)[:3], *strides(o)[:3], *strides(lse),
                np.int32(sq), np.int32(sk), np.int32(hq // hkv), np.float32(scale * LOG2E),
                np.int64(int(q_start) - int(k_start)), *bounds)
        kern(grid, (kernel.threads,), args, shared_mem=kernel.smem_bytes)

    def backward(self, kind, q, k, v, do, lse, delta, dq, dk, dv, *, scale, masked, mask, q_start, k_start):
        b, sq, hq, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        group = hq // hkv
        mode = mask_mode(masked, mask)
        bounds = mask_args(mask if mode == "interval" else None, q_start, sq, k_start)   # the interval kernels'
        kernel = self.modules.table(BACKWARD).find(kind, d, mode)
        nkb = -(-sk // kernel.keys)
        hpb, nsplit = launch.split_group(group, nkb, b * hkv)
        s = strides
        # 1-D grid; causal: heavy key blocks first inside chunks of order_g head slots (see attn_bwd.cu)
        slots = nsplit * b * hkv
        order_g = launch.heavy_first_heads(nkb, slots) if mode == "causal" else 1
        args = (q, k, v, do, lse, delta, dq, dk, dv, *s(q)[:3], *s(k)[:3], *s(v)[:3], *s(do)[:3], *s(lse), *s(delta),
                *s(dq)[:3], *s(dk)[:3], *s(dv)[:3], np.int32(sq), np.int32(sk), np.int32(hkv), np.int32(group),
                np.int32(hpb), np.float32(scale), np.float32(scale * LOG2E), np.int64(int(q_start) - int(k_start)),
                np.int32(1 if nsplit > 1 else 0), np.int32(order_g), *bounds)
        kern = self.modules.kernel(BACKWARD, kernel.name, kernel.smem_bytes)
        kern((nkb * slots, 1, 1), (kernel.threads,), args, shared_mem=kernel.smem_bytes)
