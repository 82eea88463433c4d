"""NumPy block backend: tiled online-softmax attention, the CPU twin of the CUDA kernels.

Each (query tile, key tile) pair is scored on its own, so no more than one tile of scores
exists at a time. The same code runs on CuPy arrays (``NumpyBackend(xp=cupy)``): the CUDA
backend's path for head dims wider than its kernels, where each tile is a batched cuBLAS product.
Query heads are grouped under their key/value head (GQA) so a key tile is read once per group. Masks use global positions: plain causal from q_start/k_start, documents
and windows from a masks.Mask (each row's visible key interval). Key tiles with nothing visible
are never visited; tiles wholly visible are not masked.
"""
import numpy as np

from ..dtypes import accum_dtype
from ..merge import merge_into


def _grouped(x, n_kv, acc):
    """(B, n, Hq, D) -> (B, Hkv, G, n, D) in the accumulator type."""
    b, n, h, d = x.shape
    return x.astype(acc, copy=False).reshape(b, n, n_kv, h // n_kv, d).transpose(0, 2, 3, 1, 4)


def _heads_first(x, acc):
    """(B, m, Hkv, D) -> (B, Hkv, 1, m, D): broadcasts over the query heads of a group."""
    return x.astype(acc, copy=False).transpose(0, 2, 1, 3)[:, :, None]


def _ungroup(x):
    """(B, Hkv, G, n, D) -> (B, n, Hkv*G, D)."""
    b, hk, g, n, d = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, n, hk * g, d)


class NumpyBackend:
    name = "numpy"

    def __init__(self, block_q=128, block_k=128, xp=np):
        self.block_q = block_q
        self.block_k = block_k
        self.xp = xp  # numpy, or cupy: then the masks of diagonal tiles are built on the host and copied

    def _key_tiles(self, q0, q1, n_keys, causal, q_start, k_start, mask):
        """Key tiles (k0, k1, hidden) with something visible to query rows q0..q1-1; ``hidden`` is
        None for tiles that need no mask, else the boolean (rows, keys) mask of hidden pairs.
        An unmasked pair (``causal`` False) ignores ``mask``: it may be several runs fused in local
        memory (schedule.block_pairs), whose rows are not at q_start + i."""
        if not causal:
            mask = None
        if mask is not None:
            lo, hi = (x - k_start for x in mask.rows(q_start + q0, q1 - q0))
            k_begin, k_end = max(0, int(lo[0])), min(n_keys, int(hi[-1]))  # both ends never decrease
        else:
            k_begin, k_end = 0, n_keys if not causal else max(0, min(n_keys, q_start + q1 - k_start))
        for k0 in range(k_begin - k_begin % self.block_k, k_end, self.block_k):
            k1 = min(k_end, k0 + self.block_k)
            keys = np.arange(k0, k1)
            if mask is not None:
                if lo[-1] <= k0 and hi[0] >= k1:
                    yield k0, k1, None
                elif (np.minimum(hi, k1) > np.maximum(lo, k0)).any():
                    yield k0, k1, self.xp.asarray(~((keys >= lo[:, None]) & (keys < hi[:, None])))
            elif causal and k_start + k1 - 1 > q_start + q0:
                yield k0, k1, self.xp.asarray(k_start + keys[None, :] > q_start + np.arange(q0, q1)[:, None])
            else:
                yield k0, k1, None

    def forward_block(self, q, k, v, o, lse, *, scale, causal=False, q_start=0, k_start=0, mask=None):
        xp = self.xp
        acc = o.dtype
        n_kv = k.shape[2]
        for q0 in range(0, q.shape[1], self.block_q):
            q1 = min(q.shape[1], q0 + self.block_q)
            qt = _grouped(q[:, q0:q1], n_kv, acc) * acc.type(scale)
            shape = qt.shape[:-1]
            row_max = xp.full(shape, -xp.inf, acc)
            row_sum = xp.zeros(shape, acc)
            out = xp.zeros(qt.shape, acc)
            for k0, k1, hidden in self._key_tiles(q0, q1, k.shape[1], causal, q_start, k_start, mask):
                kt = _heads_first(k[:, k0:k1], acc)
                vt = _heads_first(v[:, k0:k1], acc)
                s = qt @ kt.swapaxes(-1, -2)
                if hidden is not None:
                    s = xp.where(hidden, -xp.inf, s)
                new_max = xp.maximum(row_max, s.max(-1))
                safe_max = xp.where(xp.isneginf(new_max), 0, new_max)
                p = xp.exp(s - safe_max[..., None])
                rescale = xp.exp(row_max - safe_max)
                row_sum = row_sum * rescale + p.sum(-1)
                out = out * rescale[..., None] + p @ vt
                row_max = new_max
            seen = row_sum > 0
            block_lse = xp.where(seen, row_max + xp.log(xp.where(seen, row_sum, 1)), -xp.inf)
            block_o = out / xp.where(seen, row_sum, 1)[..., None]
            b, hk, g, n = block_lse.shape
            merge_into(o[:, q0:q1], lse[:, :, q0:q1], _ungroup(block_o), block_lse.reshape(b, hk * g, n))

    def backward_block(self, q, k, v, do, lse, delta, dq, dk, dv, *, scale, causal=False, q_start=0, k_start=0,
                       mask=None):
        xp = self.xp
        acc = dq.dtype
        b, _, n_kv, d = k.shape
        group = q.shape[2] // n_kv
        for q0 in range(0, q.shape[1], self.block_q):
            q1 = min(q.shape[1], q0 + self.block_q)
            qt = _grouped(q[:, q0:q1], n_kv, acc)
            dot = _grouped(do[:, q0:q1], n_kv, acc)
            n = q1 - q0
            lse_t = lse[:, :, q0:q1].astype(acc).reshape(b, n_kv, group, n)
            delta_t = delta[:, :, q0:q1].astype(acc).reshape(b, n_kv, group, n)
            visible = ~xp.isneginf(lse_t)
            lse_t = xp.where(visible, lse_t, 0)
            dq_t = xp.zeros(qt.shape, acc)
            for k0, k1, hidden in self._key_tiles(q0, q1, k.shape[1], causal, q_start, k_start, mask):
                kt = _heads_first(k[:, k0:k1], acc)
                vt = _heads_first(v[:, k0:k1], acc)
                s = (qt @ kt.swapaxes(-1, -2)) * acc.type(scale)
                keep = visible[..., None]
                if hidden is not None:
                    keep = keep & ~hidden
                # mask before exp: a hidden score can sit far above the row's lse and overflow
                p = xp.exp(xp.where(keep, s - lse_t[..., None], -xp.inf))
                dp = dot @ vt.swapaxes(-1, -2)
                ds = p * (dp - delta_t[..., None])
                dq_t += (ds @ kt) * acc.type(scale)
                # sum over the group's query heads: (B, Hkv, G, m, D) -> (B, m, Hkv, D)
                dv[:, k0:k1] += (p.swapaxes(-1, -2) @ dot).sum(2).transpose(0, 2, 1, 3)
                dk[:, k0:k1] += ((ds.swapaxes(-1, -2) @ qt).sum(2) * acc.type(scale)).transpose(0, 2, 1, 3)
            dq[:, q0:q1] += _ungroup(dq_t)

    def delta(self, do, o):
        acc = accum_dtype(do.dtype)
        return self.xp.einsum("bshd,bshd->bhs", do.astype(acc, copy=False), o.astype(acc, copy=False))
