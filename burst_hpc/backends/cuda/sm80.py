"""The sm80 family's launches: the mma.sync / ldmatrix / cp.async kernels of attn_fwd.cu and attn_bwd.cu,
which run on any GPU of compute capability >= 8.0 (docs/KERNELS.md, "sm80 forward", "sm80 backward").
Kernel names and geometry come from the sources' kernel tables (contract.py)."""
import numpy as np

from . import launch
from .contract import PARAMS, SOURCES, mask_mode

FORWARD, BACKWARD = SOURCES["sm80", "fwd"], SOURCES["sm80", "bwd"]


class Sm80Kernels:
    """Forward and backward launches of the sm80 family (inputs already marshalled by the backend). They take
    no first / last flags: the backend runs those around them (``ends``)."""

    ends = False

    def __init__(self, modules):
        self.modules = modules
        self.forward_args = launch.KernelArgs(PARAMS["sm80", "fwd"])
        self.backward_args = launch.KernelArgs(PARAMS["sm80", "bwd"])

    def forward(self, kind, q, k, v, o, lse, *, scale, masked, mask, q_start, k_start):
        b, sq, hq, d = q.shape
        mode = mask_mode(masked, mask)
        kernel = self.modules.table(FORWARD).find(kind, d, mode)
        kern = self.modules.kernel(FORWARD, kernel.name, kernel.smem_bytes)
        grid = (-(-sq // kernel.query_rows), hq, b)
        arrays = (("q", q, "qsb qss qsh"), ("k", k, "ksb kss ksh"), ("v", v, "vsb vss vsh"), ("o", o, "osb oss osh"),
                  ("lse", lse, "lsb lsh lss"))
        args = self.forward_args(q, k, scale=scale, q_start=q_start, k_start=k_start,
                                 mask=mask if mode == "interval" else None,
                                 **launch.array_fields(*arrays))
        kern(grid, (kernel.threads,), (launch.by_value(args),), shared_mem=kernel.smem_bytes)

    def backward(self, kind, q, k, v, do, lse, delta, dq, dk, dv, *, scale, masked, mask, q_start, k_start):
        b, sq, hq, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        group = hq // hkv
        mode = mask_mode(masked, mask)
        kernel = self.modules.table(BACKWARD).find(kind, d, mode)
        nkb = -(-sk // kernel.keys)
        hpb, nsplit = launch.split_group(group, np.ones(nkb), b * hkv)
        # 1-D grid; causal: heavy key blocks first inside chunks of order_g head slots (see attn_bwd.cu)
        slots = nsplit * b * hkv
        order_g = launch.heavy_first_heads(nkb, slots) if mode == "causal" else 1
        arrays = (("q", q, "qsb qss qsh"), ("k", k, "ksb kss ksh"), ("v", v, "vsb vss vsh"), ("dout", do, "gsb gss gsh"),
                  ("lse", lse, "lsb lsh lss"), ("delta", delta, "dsb dsh dss"), ("dq", dq, "qgsb qgss qgsh"),
                  ("dk", dk, "kgsb kgss kgsh"), ("dv", dv, "vgsb vgss vgsh"))
        args = self.backward_args(q, k, scale=scale, q_start=q_start, k_start=k_start,
                                  mask=mask if mode == "interval" else None, hpb=hpb,
                                  atomic_kv=nsplit > 1, order_g=order_g, **launch.array_fields(*arrays))
        kern = self.modules.kernel(BACKWARD, kernel.name, kernel.smem_bytes)
        kern((nkb * slots, 1, 1), (kernel.threads,), (launch.by_value(args),), shared_mem=kernel.smem_bytes)
