"""The seeds' baselines on this project's kernels and transports, so a comparison with the ring
isolates one idea at a time (NumPy + MPI on the CPU, CuPy + NCCL on GPUs; never torch):

- ``untiled_ring``: RingAttention without tiling. The same ring, layout and GAO merge as ours, with
  a block backend that materialises each block pair's whole float32 score matrix (one head at a time:
  (S/P) x (S/P) on the contiguous layout, halves of it on zigzag) with plain matmuls and a softmax.
  Its backward is RingAttention's kv-ring. It isolates LAO (tiling) from the distribution.
- ``AllGatherKV``: Llama-3 style. K and V are all-gathered, then one local call of our kernels per
  query piece; the backward all-gathers them again and reduce-scatters the float32 dK, dV.
- ``Ulysses``: all-to-all from sequence shards to head shards, one local call of our kernels on the
  whole sequence for Hq/P query heads, all-to-all back. Needs Hq and Hkv divisible by P; otherwise
  every rank raises the same BurstError. Its backward reuses the head-sharded (o, lse) kept from the
  last forward, as autograd would: only dO goes out and dQ, dK, dV come back.

Every method has ``forward() -> (o, lse)``, ``backward(do, o, lse) -> (dq, dk, dv)`` on this rank's
shards in ``layout`` (results as burst_attention returns them) and ``bytes_sent``: the bytes this
rank has handed to the network so far (ring: every exchange; collectives: what leaves the rank:
(P-1)/P of an all-to-all, (P-1) x its part of an all-gather or a reduce-scatter).
"""
import numpy as np

import burst_hpc
from burst_hpc.backends import backward_ends, forward_ends, get_backend
from burst_hpc.benchmark import RingBenchmark
from burst_hpc.collective import agree
from burst_hpc.dtypes import accum_dtype
from burst_hpc.errors import BurstError
from burst_hpc.device import array_module
from burst_hpc.engine.merge import merge_weights
from burst_hpc.validate import check_qkv, resolve_scale

METHODS = ("burst", "untiled-ring", "allgather-kv", "ulysses")


def make(method, q, k, v, comm, causal, layout, transport):
    """One method on this rank's shards in ``layout`` (a Layout or a name). 'burst' is our ring (its backward
    ring picked by bytes)."""
    layout = burst_hpc.plan.layout.as_layout(layout, q.shape[1] * comm.size, comm.size)
    if method == "burst":
        return RingBenchmark(q, k, v, comm=comm, causal=causal, layout=layout, transport=transport)
    if method == "untiled-ring":
        return untiled_ring(q, k, v, comm, causal, layout, transport)
    if method == "allgather-kv":
        return AllGatherKV(q, k, v, comm, causal, layout, transport)
    if method == "ulysses":
        return Ulysses(q, k, v, comm, causal, layout, transport)
    raise BurstError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")


# ---------------------------------------------------------------- (a) RingAttention without tiling

class UntiledBackend:
    """Block backend (burst_hpc.backends interface) that scores a whole block pair at once."""

    name = "untiled"

    def __init__(self, xp):
        self.xp = xp

    @staticmethod
    def _mm(a, b, acc):
        """a @ b in the accumulator type (CuPy: TF32 tensor cores when CUPY_TF32=1; its 16-bit matmuls
        do not cover bfloat16)."""
        return a.astype(acc, copy=False) @ b.astype(acc, copy=False)

    def _scores(self, q, k, acc, scale, masked, q_start, k_start):
        s = self._mm(q, k.T, acc) * acc.type(scale)
        if masked:
            xp = self.xp
            hidden = (k_start + xp.arange(k.shape[0]))[None, :] > (q_start + xp.arange(q.shape[0]))[:, None]
            s[hidden] = -xp.inf
        return s

    @staticmethod
    def _plain(masked, mask):
        if masked and mask.kind != "causal":
            raise BurstError("the untiled baseline knows plain causal masks only, not documents or windows")

    def forward_block(self, q, k, v, o, lse, *, scale, masked=False, mask=None, q_start=0, k_start=0, first=False,
                      out=None):
        self._plain(masked, mask)
        forward_ends(self.xp, lambda o, lse: self._forward(q, k, v, o, lse, scale, masked, q_start, k_start), o, lse,
                     first=first, out=out)

    def _forward(self, q, k, v, o, lse, scale, masked, q_start, k_start):
        xp, acc = self.xp, o.dtype
        group = q.shape[2] // k.shape[2]
        for b in range(q.shape[0]):
            for h in range(q.shape[2]):
                s = self._scores(q[b, :, h], k[b, :, h // group], acc, scale, masked, q_start, k_start)
                row_max = s.max(-1)
                safe_max = xp.where(xp.isneginf(row_max), 0, row_max)
                p = xp.exp(s - safe_max[:, None])
                total = p.sum(-1)
                seen = total > 0
                block_lse = xp.where(seen, safe_max + xp.log(xp.where(seen, total, 1)), -xp.inf)
                block_o = self._mm(p, v[b, :, h // group], acc) / xp.where(seen, total, 1)[:, None]
                merged, w_old, w_new = merge_weights(lse[b, h], block_lse)  # GAO
                o[b, :, h] = o[b, :, h] * w_old[:, None] + block_o * w_new[:, None]
                lse[b, h] = merged

    def backward_block(self, q, k, v, do, lse, delta, dq, dk, dv, *, scale, masked=False, mask=None, q_start=0,
                       k_start=0, o=None, **ends):
        self._plain(masked, mask)

        def run(delta, dq, dk, dv):
            self._backward(q, k, v, do, lse, delta, dq, dk, dv, scale, masked, q_start, k_start)

        backward_ends(self.xp, run, self.delta, do, o, delta, dq, dk, dv, **ends)

    def _backward(self, q, k, v, do, lse, delta, dq, dk, dv, scale, masked, q_start, k_start):
        xp, acc = self.xp, dq.dtype
        group = q.shape[2] // k.shape[2]
        for b in range(q.shape[0]):
            for h in range(q.shape[2]):
                g = h // group
                s = self._scores(q[b, :, h], k[b, :, g], acc, scale, masked, q_start, k_start)
                row_lse = lse[b, h].astype(acc)
                p = xp.exp(s - xp.where(xp.isneginf(row_lse), 0, row_lse)[:, None])
                p[xp.isneginf(row_lse)] = 0
                ds = p * (self._mm(do[b, :, h], v[b, :, g].T, acc) - delta[b, h].astype(acc)[:, None])
                dq[b, :, h] += self._mm(ds, k[b, :, g], acc) * acc.type(scale)
                dk[b, :, g] += self._mm(ds.T, q[b, :, h], acc) * acc.type(scale)
                dv[b, :, g] += self._mm(p.T, do[b, :, h], acc)

    def delta(self, do, o):
        acc = accum_dtype(do.dtype)
        return (do.astype(acc) * o.astype(acc)).sum(-1).transpose(0, 2, 1)


def untiled_ring(q, k, v, comm, causal, layout, transport):
    return RingBenchmark(q, k, v, comm=comm, causal=causal, layout=layout, transport=transport,
                         backward_ring="kv", backend=UntiledBackend(array_module(q)))


# ---------------------------------------------------------------- collectives over whole arrays

class Collectives:
    """All-gather, all-to-all and reduce-scatter of arrays whose leading axis is the rank: NumPy over
    MPI ('host'), CuPy over NCCL ('nccl', on the current stream). The machine's MPI is not CUDA-aware
    and reductions need the MPI to compute on the buffers, so device arrays always go through NCCL."""

    def __init__(self, comm, xp, transport):
        self.comm, self.xp, self.size = comm, xp, comm.size
        self.kind = "host" if xp is np else "nccl"
        if transport not in ("auto", self.kind):
            raise BurstError(f"the baselines move {'NumPy' if xp is np else 'CuPy'} arrays with "
                             f"{self.kind}, not {transport!r}")
        if self.kind == "nccl":
            from cupy.cuda import nccl

            from burst_hpc.transport.nccl import communicator

            self._nccl, self._lib = communicator(comm), nccl
        self.bytes_sent = 0

    def _stream(self):
        return self.xp.cuda.get_current_stream().ptr

    def allgather(self, x):
        """(P, *x.shape): every rank's x, in rank order."""
        x = self.xp.ascontiguousarray(x)
        out = self.xp.empty((self.size,) + x.shape, x.dtype)
        self.bytes_sent += (self.size - 1) * x.nbytes
        if self.kind == "host":
            self.comm.Allgather(x.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8))
        else:
            self._nccl.allGather(x.data.ptr, out.data.ptr, x.nbytes, self._lib.NCCL_UINT8, self._stream())
        return out

    def alltoall(self, x):
        """x (P, ...): part j goes to rank j; returns part i from rank i."""
        x = self.xp.ascontiguousarray(x)
        out = self.xp.empty_like(x)
        part = x.nbytes // self.size
        self.bytes_sent += (self.size - 1) * part
        if self.kind == "host":
            self.comm.Alltoall(x.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8))
        else:
            self._lib.groupStart()
            for peer in range(self.size):
                self._nccl.send(x[peer].data.ptr, part, self._lib.NCCL_UINT8, peer, self._stream())
                self._nccl.recv(out[peer].data.ptr, part, self._lib.NCCL_UINT8, peer, self._stream())
            self._lib.groupEnd()
        return out

    def reduce_scatter(self, x):
        """x (P, ...) float32/float64: this rank's part of the sum over ranks."""
        x = self.xp.ascontiguousarray(x)
        out = self.xp.empty(x.shape[1:], x.dtype)
        self.bytes_sent += (self.size - 1) * out.nbytes
        if self.kind == "host":
            self.comm.Reduce_scatter_block(x, out)
        else:
            if x.dtype != np.float32:
                raise BurstError("the NCCL reduce-scatter here sums float32 only")
            self._nccl.reduceScatter(x.data.ptr, out.data.ptr, out.size, self._lib.NCCL_FLOAT32,
                                     self._lib.NCCL_SUM, self._stream())
        return out


class _Collective:
    """Shared set-up of the collective baselines: checked shapes, every rank agreeing, the order that
    takes rank-major gathered tokens (each rank's shard in ``layout`` order) to global order."""

    def __init__(self, q, k, v, comm, causal, layout, transport):
        error = None
        try:
            self.batch, self.local, _, self.heads, self.kv_heads, self.head_dim = check_qkv(q, k, v)
            self.size, self.rank = comm.size, comm.rank
            self.seqlen = self.local * self.size
            self.pieces = burst_hpc.plan.layout.as_layout(layout, self.seqlen, self.size).pieces(self.rank)
            self.check()
        except BurstError as e:
            error = e
        agree(comm, error)
        self.q, self.k, self.v, self.causal, self.layout = q, k, v, causal, layout
        self.mask = burst_hpc.plan.masks.make(self.seqlen, causal)
        self.xp = array_module(q)
        self.backend = get_backend(q)
        self.acc = accum_dtype(q.dtype)
        self.scale = resolve_scale(None, self.head_dim)
        self.net = Collectives(comm, self.xp, transport)
        rank_major = np.concatenate([burst_hpc.layout_indices(self.seqlen, r, self.size, layout)
                                     for r in range(self.size)])
        identity = bool((rank_major == np.arange(self.seqlen)).all())
        self.to_global = None if identity else self.xp.asarray(np.argsort(rank_major))
        self.to_rank_major = None if identity else self.xp.asarray(rank_major)

    def check(self):
        pass

    @property
    def bytes_sent(self):
        return self.net.bytes_sent

    def _reorder(self, x, index, axis=1):
        return x if index is None else self.xp.take(x, index, axis=axis)


# ---------------------------------------------------------------- (b) all-gather of K/V

class AllGatherKV(_Collective):
    def _gather(self, x):
        """This rank's shard (B, n, H, D) -> the whole sequence (B, S, H, D) in global order."""
        parts = self.net.allgather(x)  # (P, B, n, H, D)
        whole = parts.transpose(1, 0, 2, 3, 4).reshape((x.shape[0], self.seqlen) + x.shape[2:])
        return self._reorder(whole, self.to_global)

    def forward(self):
        xp = self.xp
        keys, values = self._gather(self.k), self._gather(self.v)
        o = xp.zeros(self.q.shape, self.acc)
        lse = xp.full((self.batch, self.heads, self.local), -xp.inf, self.acc)
        for rows, start in self._query_pieces():
            self.backend.forward_block(self.q[:, rows], keys, values, o[:, rows], lse[:, :, rows], scale=self.scale,
                                       masked=self.causal, mask=self.mask, q_start=start,
                                       k_start=0)
        return o.astype(self.q.dtype), lse.astype(xp.float32)

    def backward(self, do, o, lse):
        xp = self.xp
        keys, values = self._gather(self.k), self._gather(self.v)
        delta = self.backend.delta(do, o)
        dq = xp.zeros(self.q.shape, self.acc)
        dkeys, dvalues = xp.zeros(keys.shape, self.acc), xp.zeros(values.shape, self.acc)
        for rows, start in self._query_pieces():
            self.backend.backward_block(self.q[:, rows], keys, values, do[:, rows], lse[:, :, rows], delta[:, :, rows],
                                        dq[:, rows], dkeys, dvalues, scale=self.scale, masked=self.causal,
                                        mask=self.mask, q_start=start, k_start=0)
        dk, dv = (self._scatter(g) for g in (dkeys, dvalues))
        return dq.astype(self.q.dtype), dk.astype(self.k.dtype), dv.astype(self.v.dtype)

    def _query_pieces(self):
        offset = 0
        for start, n in self.pieces:
            yield slice(offset, offset + n), start
            offset += n

    def _scatter(self, whole):
        """Global-order float gradients (B, S, H, D) summed over ranks; this rank's shard back."""
        b, _, h, d = whole.shape
        parts = self._reorder(whole, self.to_rank_major).reshape(b, self.size, self.local, h, d)
        return self.net.reduce_scatter(parts.transpose(1, 0, 2, 3, 4))


# ---------------------------------------------------------------- (c) Ulysses

class Ulysses(_Collective):
    def check(self):
        if self.heads % self.size or self.kv_heads % self.size:
            raise BurstError(f"Ulysses splits heads over the ranks: {self.heads} query and {self.kv_heads} "
                             f"key/value heads do not divide over {self.size} ranks")

    def _to_heads(self, x):
        """(B, n, H, D) sequence shard -> (B, S, H/P, D): the whole sequence, this rank's heads."""
        b, n, h, d = x.shape
        parts = x.reshape(b, n, self.size, h // self.size, d).transpose(2, 0, 1, 3, 4)
        got = self.net.alltoall(parts)  # (P, B, n, H/P, D), part i: rank i's tokens
        whole = got.transpose(1, 0, 2, 3, 4).reshape(b, self.seqlen, h // self.size, d)
        return self._reorder(whole, self.to_global)

    def _to_tokens(self, x):
        """(B, S, H/P, D) -> (B, n, H, D): the inverse of _to_heads."""
        b, _, hp, d = x.shape
        parts = self._reorder(x, self.to_rank_major).reshape(b, self.size, self.local, hp, d).transpose(1, 0, 2, 3, 4)
        got = self.net.alltoall(parts)  # (P, B, n, H/P, D), part i: head group i
        return got.transpose(1, 2, 0, 3, 4).reshape(b, self.local, self.size * hp, d)

    def forward(self):
        q, k, v = (self._to_heads(x) for x in (self.q, self.k, self.v))
        self._saved = (q, k, v) + burst_hpc.attention(q, k, v, causal=self.causal)
        o_heads, lse_heads = self._saved[3:]
        lse = self._to_tokens(lse_heads.transpose(0, 2, 1)[..., None])[..., 0].transpose(0, 2, 1)
        return self._to_tokens(o_heads), self.xp.ascontiguousarray(lse)

    def backward(self, do, o, lse):
        """``o`` and ``lse`` are ignored: the head-sharded ones of the last forward() are used."""
        grads = burst_hpc.attention_backward(self._to_heads(do), *self._saved, causal=self.causal)
        return tuple(self._to_tokens(g) for g in grads)
