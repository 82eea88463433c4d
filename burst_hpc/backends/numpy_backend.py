"""NumPy block backend: tiled online-softmax attention, the CPU twin of the CUDA kernels.

Each (query tile, key tile) pair is scored on its own, so no more than one tile of scores
exists at a time. The same code runs on CuPy arrays (``NumpyBackend(xp=cupy)``): the CUDA
backend's path for head dims wider than its kernels, where each tile is a batched cuBLAS product.
Query heads are grouped under their key/value head (GQA) so a key tile is read once per group. A
masked pair reads each query row's visible key interval from the call's masks.Mask (global
positions, any kind: causal, documents, windows). Key tiles with nothing visible are never visited;
tiles wholly visible are not masked.

Non-finite inputs propagate as in the float64 oracle (burst_hpc.reference): a NaN or Inf reaches the
rows that see it and the gradients they feed, and no other. Only lse = -inf means "nothing seen" (a
NaN row sum or lse is a row that saw a NaN); masks select, never multiply by 0; and on a partly
masked tile whose inputs hold NaN or Inf, the products skip the hidden pairs (``_visible_product``).
"""

import numpy as np

from . import backward_ends, forward_ends
from ..dtypes import accum_dtype
from ..engine.merge import merge_into


def _grouped(x, n_kv, acc):
    """(B, n, Hq, D) -> (B, Hkv, G, n, D) in the accumulator type."""
    b, n, h, d = x.shape
    return x.astype(acc, copy=False).reshape(b, n, n_kv, h // n_kv, d).transpose(0, 2, 3, 1, 4)


def _heads_first(x, acc):
    """(B, m, Hkv, D) -> (B, Hkv, 1, m, D): broadcasts over the query heads of a group."""
    return x.astype(acc, copy=False).transpose(0, 2, 1, 3)[:, :, None]


def _finite(xp, *tiles):
    """True when every element of these tiles is finite: a partly masked tile's plain products are then
    exact. Asked of tiles only, so the test costs at most a tile's worth of memory (mpi_tests/test_memory.py)."""
    return all(bool(xp.isfinite(t).all()) for t in tiles)


def _visible_product(xp, w, x, hidden):
    """w @ x over the visible pairs (~hidden) alone: w (..., n, m), x (..., m, D), hidden (n, m).
    A hidden pair adds nothing, also where x is NaN or Inf (its weight 0 times NaN would be NaN): x's
    non-finite entries are taken out of the product and added back, pair by visible pair, for the
    few keys that hold one."""
    w = xp.where(hidden, 0, w)
    bad = ~xp.isfinite(x)
    out = w @ xp.where(bad, 0, x)
    for j in xp.flatnonzero(bad.any(axis=tuple(range(bad.ndim - 2)) + (-1,))).tolist():
        term = w[..., :, j, None] * xp.where(bad[..., j, :], x[..., j, :], 0)[..., None, :]
        out += xp.where(hidden[:, j, None], 0, term)
    return out


def _ungroup(x):
    """(B, Hkv, G, n, D) -> (B, n, Hkv*G, D)."""
    b, hk, g, n, d = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, n, hk * g, d)


class NumpyBackend:
    name = "numpy"

    def __init__(self, block_q=128, block_k=128, xp=np):
        self.block_q = block_q
        self.block_k = block_k
        self.xp = xp  # numpy, or cupy: then the masks of partly masked tiles are built on the host and copied

    def key_tiles(self, q0, q1, n_keys, masked, q_start, k_start, mask):
        """Key tiles (k0, k1, hidden) with something visible to query rows q0..q1-1; ``hidden`` is
        None for tiles that need no mask, else the boolean (rows, keys) mask of hidden pairs.
        An unmasked pair (``masked`` False) does not read ``mask``: it may be several runs fused in
        local memory (schedule.block_pairs), whose rows are not at q_start + i."""
        if not masked:
            for k0 in range(0, n_keys, self.block_k):
                yield k0, min(n_keys, k0 + self.block_k), None
            return
        lo, hi = (x - k_start for x in mask.rows(q_start + q0, q1 - q0))
        # both ends never decrease: the first row sees the fewest keys after, the last the fewest before
        k_begin, k_end, tightest = max(0, int(lo[0])), min(n_keys, int(hi[-1])), (int(lo[-1]), int(hi[0]))
        for k0 in range(k_begin - k_begin % self.block_k, k_end, self.block_k):
            k1 = min(k_end, k0 + self.block_k)
            if tightest[0] <= k0 and tightest[1] >= k1:
                yield k0, k1, None
            # some row's keys meet the tile: the rows ending after k0 are a suffix, those starting before k1 a prefix
            elif np.searchsorted(hi, k0, side="right") < np.searchsorted(lo, k1, side="left"):
                keys = np.arange(k0, k1)
                yield k0, k1, self.xp.asarray((keys < lo[:, None]) | (keys >= hi[:, None]))

    def forward_block(self, q, k, v, o, lse, *, scale, masked=False, mask=None, q_start=0, k_start=0, first=False,
                      out=None):
        def run(o, lse):
            # inf - inf is NaN where the inputs hold Inf, as it should be: no 'invalid value' warnings
            with np.errstate(invalid="ignore"):
                self._forward(q, k, v, o, lse, scale, masked, q_start, k_start, mask)

        forward_ends(self.xp, run, o, lse, first=first, out=out, spend=True)

    def _forward(self, q, k, v, o, lse, scale, masked, q_start, k_start, mask):
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
            for k0, k1, hidden in self.key_tiles(q0, q1, k.shape[1], masked, q_start, k_start, mask):
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
                pv = p @ vt if hidden is None or _finite(xp, vt) else _visible_product(xp, p, vt, hidden)
                out = out * rescale[..., None] + pv
                row_max = new_max
            # nothing seen: a row sum of exactly 0 (a NaN sum is a row that saw a NaN, and stays NaN)
            empty = row_sum == 0
            block_lse = xp.where(empty, -xp.inf, row_max + xp.log(xp.where(empty, 1, row_sum)))
            block_o = out / xp.where(empty, 1, row_sum)[..., None]
            b, hk, g, n = block_lse.shape
            merge_into(o[:, q0:q1], lse[:, :, q0:q1], _ungroup(block_o), block_lse.reshape(b, hk * g, n))

    def backward_block(self, q, k, v, do, lse, delta, dq, dk, dv, *, scale, masked=False, mask=None, q_start=0,
                       k_start=0, o=None, **ends):
        def run(delta, dq, dk, dv):
            with np.errstate(invalid="ignore"):
                self._backward(q, k, v, do, lse, delta, dq, dk, dv, scale, masked, q_start, k_start, mask)

        backward_ends(self.xp, run, self.delta, do, o, delta, dq, dk, dv, spend=True, **ends)

    def _backward(self, q, k, v, do, lse, delta, dq, dk, dv, scale, masked, q_start, k_start, mask):
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
            visible = ~xp.isneginf(lse_t)  # a NaN lse is a row that saw a NaN: its P is NaN
            lse_t = xp.where(visible, lse_t, 0)
            dq_t = xp.zeros(qt.shape, acc)
            rows_finite = _finite(xp, qt, dot)
            for k0, k1, hidden in self.key_tiles(q0, q1, k.shape[1], masked, q_start, k_start, mask):
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
                if hidden is not None:  # hidden pairs add nothing: not a NaN delta or dP times P = 0 ...
                    xp.copyto(ds, 0, where=hidden)  # in place: no second tile at the peak
                if hidden is None or (rows_finite and _finite(xp, kt)):
                    def product(w, x, _hidden):
                        return w @ x
                else:  # ... nor 0 times a NaN or Inf input
                    def product(w, x, hidden):
                        return _visible_product(xp, w, x, hidden)
                transposed = None if hidden is None else hidden.T
                # each product is used at once: one tile-sized temporary at a time (mpi_tests/test_memory.py)
                dq_t += product(ds, kt, hidden) * acc.type(scale)
                # sum over the group's query heads: (B, Hkv, G, m, D) -> (B, m, Hkv, D)
                dv[:, k0:k1] += product(p.swapaxes(-1, -2), dot, transposed).sum(2).transpose(0, 2, 1, 3)
                dk[:, k0:k1] += (product(ds.swapaxes(-1, -2), qt, transposed).sum(2)
                                 * acc.type(scale)).transpose(0, 2, 1, 3)
            dq[:, q0:q1] += _ungroup(dq_t)

    def rows_copy(self, src, src_rows, dst, dst_rows):
        n = len(src_rows) if src_rows is not None else len(dst_rows) if dst_rows is not None else src.shape[1]
        dst[:, slice(n) if dst_rows is None else dst_rows] = src[:, slice(n) if src_rows is None else src_rows]

    def rows_sum(self, src, own, ptr, at, step, parts, out):
        xp = self.xp
        total = src[:, own]
        counts = ptr[1:] - ptr[:-1]
        # the k-th partial of every row that has one at a time: no row twice in one indexed add
        for k in range(int(counts.max()) if counts.size else 0):
            rows = xp.flatnonzero(counts > k)
            j = ptr[rows] + k
            for b in range(out.shape[0]):
                total[b, rows] += parts[at[j] + b * step[j]]
        out[...] = total

    def delta(self, do, o):
        acc = accum_dtype(do.dtype)
        return self.xp.einsum("bshd,bshd->bhs", do.astype(acc, copy=False), o.astype(acc, copy=False))
