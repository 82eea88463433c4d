"""The sm80 family's launches: the mma.sync / ldmatrix / cp.async kernels of attn_fwd.cu and attn_bwd.cu,
which run on any GPU of compute capability >= 8.0 (docs/KERNELS.md, "sm80 forward", "sm80 backward")."""
import numpy as np

from . import launch
from .contract import mask_mode
from .launch import LOG2E, mask_args, strides

_FWD_BN, _BWD_BM = 64, 64
# sm80 backward (attn_bwd.cu, layout k4x2): 8 warps, keys per CTA
_BWD_WARPS, _BWD_BN = 8, 128


class Sm80Kernels:
    """Forward and backward launches of the sm80 family (inputs already marshalled by the backend)."""

    def __init__(self, modules):
        self.modules = modules

    def forward(self, kind, q, k, v, o, lse, *, scale, causal, q_start, k_start, mask):
        b, sq, hq, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        nw, bm, bn = 4, 128, _FWD_BN  # 4 warps x 32 query rows, 64-key tiles
        smem = (bm * d + 4 * bn * d) * 2
        name = f"attn_fwd_{kind}_d{d}_{mask_mode(causal, mask)}"
        kern = self.modules.kernel("attn_fwd.cu", name, smem)
        grid = ((sq + bm - 1) // bm, hq, b)
        args = (q, k, v, o, lse, *strides(q)[:3], *strides(k)[:3], *strides(v)[:3], *strides(o)[:3], *strides(lse),
                np.int32(sq), np.int32(sk), np.int32(hq // hkv), np.float32(scale * LOG2E),
                np.int64(int(q_start) - int(k_start)), *mask_args(mask, q_start, sq, k_start))
        kern(grid, (nw * 32,), args, shared_mem=smem)

    def backward(self, kind, q, k, v, do, lse, delta, dq, dk, dv, *, scale, causal, q_start, k_start, mask):
        b, sq, hq, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        group = hq // hkv
        mode = mask_mode(causal, mask)
        bn = _BWD_BN
        smem = (2 * bn * d + 4 * _BWD_BM * d + 2 * bn * _BWD_BM) * 2 + (8 if mask is not None else 4) * _BWD_BM * 4
        nkb = (sk + bn - 1) // bn
        hpb, nsplit = launch.split_group(group, nkb, b * hkv)
        s = strides
        # 1-D grid; causal: heavy key blocks first inside chunks of order_g head slots (see attn_bwd.cu)
        slots = nsplit * b * hkv
        order_g = min(slots, max(1, -(-2 * launch.sm_count() // nkb))) if mode == "causal" else 1
        args = (q, k, v, do, lse, delta, dq, dk, dv, *s(q)[:3], *s(k)[:3], *s(v)[:3], *s(do)[:3], *s(lse), *s(delta),
                *s(dq)[:3], *s(dk)[:3], *s(dv)[:3], np.int32(sq), np.int32(sk), np.int32(hkv), np.int32(group),
                np.int32(hpb), np.float32(scale), np.float32(scale * LOG2E), np.int64(int(q_start) - int(k_start)),
                np.int32(1 if nsplit > 1 else 0), np.int32(order_g), *mask_args(mask, q_start, sq, k_start))
        kern = self.modules.kernel("attn_bwd.cu", f"attn_bwd_{kind}_d{d}_{mode}_k4x2", smem)
        kern((nkb * slots, 1, 1), (_BWD_WARPS * 32,), args, shared_mem=smem)
