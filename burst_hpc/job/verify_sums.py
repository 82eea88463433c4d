"""The sampled check's sums (``burst-hpc verify`` and ``--verify``, :mod:`burst_hpc.job.verify`).

Each rank samples tokens of its own and checks them as query rows (o, lse, dq against every key) and
as key columns (dk, dv against every query). The samples of every rank travel to every rank (they are
small); each rank then streams over its own tokens once, a block at a time, adding their share to
every sample's sums (:class:`Samples`), and the sums are reduced to the samples' owners
(:meth:`Samples.reduced`, :func:`finish`). So the inputs are read once, by the rank that owns them (or
not at all: a job checks the shards it holds, on its own device).

  rows: online softmax over the key blocks in float64: l = sum e, A = sum e v, Bk = sum e k,
        C = sum e (do.v) k with e = exp(s - m), m the running max; at the end lse = m + log l,
        o = A / l, delta = do.o and dq = scale (C - delta Bk) / l (exact, no second pass).
  columns: dv_j = sum_i P_ij do_i, dk_j = scale sum_i P_ij (do_i.v_j - delta_i) q_i with P_ij from the
        output's lse and delta_i = do_i.o_i from the output's o (the checkpoint the backward pass
        itself uses; o and lse are checked on the sampled rows).

The plain same-precision computation that sets the tolerance runs alongside on the same blocks:
scores, probabilities (normalized by the output's lse), dp and dS rounded to the input dtype,
float32 sums. Hidden pairs add nothing, also where a hidden key, value or query is NaN or Inf.
"""
import numpy as np

from ..device import array_module, to_host
from ..dtypes import dtype_name
from ..reference import meets, visible


def as_float64(x, xp):
    """``x`` (NumPy or CuPy, any supported dtype; uint16 or bfloat16 holds bfloat16 bits) as a float64
    array of ``xp``, exact."""
    x = xp.asarray(x) if array_module(x) is xp else xp.asarray(_host_float(x))
    if x.dtype == xp.uint16 or str(x.dtype) == "bfloat16":
        x = (x.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    return x.astype(xp.float64)



def _host_float(x):
    """``x`` on the host, as float32 or float64 (exact)."""
    x = to_host(x)
    return x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)


def rounder(lowp, xp):
    """(plain compute type, rounding to ``lowp``): x -> x rounded to the input dtype, as the compute type
    (float64 and no rounding for float64 inputs; bfloat16 by round-to-nearest-even on float32 bits, so
    it needs no bfloat16 support from ``xp``)."""
    name = dtype_name(lowp)
    if name == "float64":
        return xp.float64, lambda x: x
    if name == "float32":
        return xp.float32, lambda x: x.astype(xp.float32)
    if name == "float16" or xp is np:   # NumPy rounds to bfloat16 by ml_dtypes' cast, 2.5x the bit arithmetic's speed
        return xp.float32, lambda x: x.astype(xp.float32).astype(lowp).astype(xp.float32)

    def bf16(x):
        x = x.astype(xp.float32)
        bits = x.view(xp.uint32)
        bits = (bits + xp.uint32(0x7FFF) + ((bits >> 16) & xp.uint32(1))) & xp.uint32(0xFFFF0000)
        return xp.where(xp.isnan(x), x, bits.view(xp.float32))

    return xp.float32, bf16


def visible_product(w, x, seen, finite):
    """w @ x over the visible pairs alone: w (..., I, J) zero on hidden pairs, x (..., J, D), seen (I, J)
    on the device. ``finite``: x holds no NaN or Inf (then a plain product); else its non-finite
    entries are taken out and added back, pair by visible pair, for the keys that hold one (a hidden
    pair's 0 times NaN would be NaN; the oracle's rule, reference.py)."""
    if finite:
        return w @ x
    xp = array_module(x)
    bad = ~xp.isfinite(x)
    out = w @ xp.where(bad, 0, x)
    for j in np.flatnonzero(to_host(bad.any(axis=tuple(a for a in range(bad.ndim) if a != bad.ndim - 2)))):
        term = w[..., :, j, None] * xp.where(bad[..., j, :], x[..., j, :], 0)[..., None, :]
        out += xp.where(seen[:, j, None], term, 0)
    return out



class Tokens:
    """One rank's tokens, which the check streams over: ``positions`` (global token indices in local
    order) and ``read(names, lo, hi)``, {name: array} of local tokens lo..hi of input datasets ('q',
    'k', 'v', 'do') and output datasets ('o', 'lse', 'dq', 'dk', 'dv'; lse's tokens on axis 2), NumPy
    or CuPy. ``take(names, index)``: the same at sorted local indices."""

    def __init__(self, positions, read, take):
        self.positions, self.read, self.take = np.asarray(positions, np.int64), read, take

    @classmethod
    def resident(cls, arrays, positions):
        """The shards a job holds (host or device), in local layout order."""
        def index(name, sel):
            return (slice(None), slice(None), sel) if name == "lse" else (slice(None), sel)

        def read(names, lo, hi):
            return {n: arrays[n][index(n, slice(lo, hi))] for n in names}

        def take(names, idx):
            return {n: arrays[n][index(n, array_module(arrays[n]).asarray(idx))] for n in names}

        return cls(positions, read, take)

    @classmethod
    def stored(cls, files, start, stop):
        """Global tokens start..stop of open HDF5 files (``files``: {dataset name: h5py dataset})."""
        from ..io.format import dataset_dtype, read_slab

        def index(name, sel):
            return (slice(None), slice(None), sel) if name == "lse" else (slice(None), sel)

        def read(names, lo, hi):
            return {n: read_slab(files[n], index(n, slice(start + lo, start + hi)), dataset_dtype(files[n], n))
                    for n in names}

        def take(names, idx):
            return {n: read_slab(files[n], index(n, start + np.asarray(idx)), dataset_dtype(files[n], n))
                    for n in names}

        return cls(np.arange(start, stop, dtype=np.int64), read, take)


class Samples:
    """The sums of every rank's sampled tokens against this rank's tokens, block by block (see above)."""

    def __init__(self, gathered, spec, mask, scale, xp):
        self.xp, self.scale, self.mask = xp, scale, mask.arguments   # the run's masks.Mask, as the oracle takes it
        self.batch, self.hkv, self.dim = spec.batch, spec.kv_heads, spec.head_dim
        self.group = spec.heads // spec.kv_heads
        self.plain_type, self.rnd = rounder(spec.dtype, xp)
        self.positions = gathered["positions"]
        b, g, hk, d, t = self.batch, self.group, self.hkv, self.dim, len(self.positions)
        heads = lambda x: as_float64(x, xp).reshape(b, t, hk, g, -1).transpose(0, 2, 3, 1, 4).copy()  # (B, Hk, g, T, D)
        self.q, self.do = heads(gathered["q"]), None if gathered.get("do") is None else heads(gathered["do"])
        self.k = as_float64(gathered["k"], xp).transpose(0, 2, 1, 3).copy()  # (B, Hk, T, D)
        self.v = as_float64(gathered["v"], xp).transpose(0, 2, 1, 3).copy()
        self.lse = as_float64(gathered["lse"], xp).reshape(b, hk, g, t)           # the output's, for the plain rows
        self.delta = None if self.do is None else as_float64(gathered["delta"], xp).reshape(b, hk, g, t)
        f64, low = xp.float64, self.plain_type
        self.m = xp.full((b, hk, g, t), -np.inf, f64)
        self.sums = {n: xp.zeros((b, hk, g, t), f64) for n in ("l", "l_plain")}
        self.sums.update({n: xp.zeros((b, hk, g, t, d), f64) for n in ("A", "Bk", "C")})
        self.sums.update({n: xp.zeros((b, hk, g, t, d), low) for n in ("o_plain", "dq_plain")})
        self.lse_max, self.lse_rounding = 0.0, 0.0  # the largest finite |lse| the columns took P from, its eps/2
        self.cols = None if self.do is None else {
            n: xp.zeros((b, hk, t, d), f64 if n in ("dk", "dv") else low) for n in ("dk", "dv", "dk_plain", "dv_plain")}

    def seen(self, q_pos, k_pos):
        return visible(q_pos, k_pos, **self.mask)

    def active(self, pos, as_keys):
        """The samples (indices) that meet the block of tokens ``pos``: as query rows that see one of its
        keys, or (``as_keys``) as key columns one of its queries sees. A run of consecutive positions (the
        check's blocks) costs one test per sample; other blocks, the dense mask."""
        start, stop = int(pos[0]), int(pos[-1]) + 1
        if stop - start == len(pos) and np.all(np.diff(pos) == 1):
            return np.flatnonzero(meets(self.positions, start, stop, as_keys=as_keys, **self.mask))
        seen = self.seen(pos, self.positions).T if as_keys else self.seen(self.positions, pos)
        return np.flatnonzero(seen.any(1))

    def add_keys(self, pos, k, v):
        """The rows' sums over keys ``pos`` (k, v (B, c, Hkv, D) of any dtype)."""
        xp, b, hk, g = self.xp, self.batch, self.hkv, self.group
        active = self.active(pos, as_keys=False)
        if active.size == 0:
            return
        ta = active.size
        sel = slice(None) if ta == len(self.positions) else xp.asarray(active)
        seen_f = xp.asarray(np.tile(self.seen(self.positions[active], pos), (g, 1)))   # (g Ta, c)
        kc = as_float64(k, xp).transpose(0, 2, 1, 3).copy()                       # (B, Hk, c, D)
        vc = as_float64(v, xp).transpose(0, 2, 1, 3).copy()
        k_ok, v_ok = bool(xp.isfinite(kc).all()), bool(xp.isfinite(vc).all())
        flat = lambda x: x[:, :, :, sel].reshape(b, hk, g * ta, *x.shape[4:])
        s = xp.where(seen_f, (flat(self.q) @ kc.swapaxes(-1, -2)) * self.scale, -np.inf)
        m_old = flat(self.m)
        m_new = xp.maximum(m_old, s.max(-1))
        safe = xp.where(xp.isneginf(m_new), 0, m_new)
        alpha = xp.exp(m_old - safe)
        e = xp.exp(s - safe[..., None])
        upd = {"l": e.sum(-1), "A": visible_product(e, vc, seen_f, v_ok), "Bk": visible_product(e, kc, seen_f, k_ok)}
        s_plain = self.rnd(s)
        upd["l_plain"] = xp.exp(s_plain - safe[..., None]).sum(-1)
        lse = flat(self.lse)
        p_plain = self.rnd(xp.exp(s_plain - xp.where(xp.isneginf(lse), 0, lse)[..., None]))
        del s, s_plain
        upd["o_plain"] = visible_product(p_plain, vc.astype(self.plain_type), seen_f, v_ok)
        if self.do is not None:
            dp = flat(self.do) @ vc.swapaxes(-1, -2)
            upd["C"] = visible_product(xp.where(seen_f, e * dp, 0), kc, seen_f, k_ok)
            ds_plain = self.rnd(xp.where(seen_f, p_plain * (self.rnd(dp) - flat(self.delta)[..., None]), 0))
            upd["dq_plain"] = visible_product(ds_plain, kc.astype(self.plain_type), seen_f, k_ok)
        del e, p_plain
        self.m[:, :, :, sel] = m_new.reshape(b, hk, g, ta)
        for name, add in upd.items():
            old = flat(self.sums[name])
            if name in ("l", "l_plain", "A", "Bk", "C"):
                old = old * (alpha if old.ndim == 3 else alpha[..., None])
            self.sums[name][:, :, :, sel] = (old + add).reshape(b, hk, g, ta, *add.shape[3:])

    def add_queries(self, pos, q, do, lse, o):
        """The columns' sums over queries ``pos`` (q, do, o (B, c, Hq, D), lse (B, Hq, c): the output's)."""
        if self.cols is None:
            return
        xp, b, hk, g, d = self.xp, self.batch, self.hkv, self.group, self.dim
        active = self.active(pos, as_keys=True)
        if active.size == 0:
            return
        c, tb = len(pos), active.size
        sel = slice(None) if tb == len(self.positions) else xp.asarray(active)
        seen_f = xp.asarray(np.tile(self.seen(pos, self.positions[active]).T, (1, g)))   # (Tb, g c)
        heads = lambda x: x.reshape(b, c, hk, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hk, g * c, d)
        qc, doc, oc = (heads(as_float64(x, xp)) for x in (q, do, o))
        q_ok, do_ok = bool(xp.isfinite(qc).all()), bool(xp.isfinite(doc).all())
        self.lse_rounding = float(np.finfo(lse.dtype).eps) / 2 if lse.dtype in (np.float32, np.float64) else 0.0
        lse = as_float64(lse, xp).reshape(b, hk, 1, g * c)
        finite = xp.abs(lse[xp.isfinite(lse)])
        self.lse_max = max(self.lse_max, float(finite.max()) if finite.size else 0.0)
        delta = (doc * oc).sum(-1)[:, :, None, :]
        st = (self.k[:, :, sel] @ qc.swapaxes(-1, -2)) * self.scale                # (B, Hk, Tb, g c)
        p = xp.where(seen_f, xp.exp(st - lse), 0)
        p_plain = self.rnd(xp.where(seen_f, xp.exp(self.rnd(st) - lse), 0))
        del st
        dp = self.v[:, :, sel] @ doc.swapaxes(-1, -2)
        ds = xp.where(seen_f, p * (dp - delta), 0)
        ds_plain = self.rnd(xp.where(seen_f, p_plain * (self.rnd(dp) - delta), 0))
        del dp
        low = self.plain_type
        upd = {"dv": visible_product(p, doc, seen_f, do_ok), "dk": visible_product(ds, qc, seen_f, q_ok),
               "dv_plain": visible_product(p_plain, doc.astype(low), seen_f, do_ok),
               "dk_plain": visible_product(ds_plain, qc.astype(low), seen_f, q_ok)}
        for name, add in upd.items():
            self.cols[name][:, :, sel] += add

    def reduced(self, comm):
        """Collective: the sums over every rank's tokens, as host float64 arrays."""
        from mpi4py import MPI

        m = to_host(self.m)
        top = np.where(np.isnan(m), -np.inf, m)  # a NaN row stays NaN through its factor below
        if comm.size > 1:
            comm.Allreduce(MPI.IN_PLACE, top, op=MPI.MAX)
        safe = np.where(np.isneginf(top), 0.0, top)
        with np.errstate(invalid="ignore", over="ignore"):
            factor = np.where(np.isneginf(m), 0.0, np.exp(m - safe))
        names = list(self.sums) + (list(self.cols) if self.cols is not None else [])
        arrays = {n: to_host(self.sums[n]).astype(np.float64) for n in self.sums}
        for n in ("l", "l_plain"):
            arrays[n] = arrays[n] * factor
        for n in ("A", "Bk", "C"):
            arrays[n] = arrays[n] * factor[..., None]
        if self.cols is not None:
            arrays.update({n: to_host(x).astype(np.float64) for n, x in self.cols.items()})
        flat = np.concatenate([arrays[n].ravel() for n in names])
        if comm.size > 1:
            comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        out, at = {"top": safe}, 0
        for n in names:
            out[n] = flat[at:at + arrays[n].size].reshape(arrays[n].shape)
            at += arrays[n].size
        return out



def finish(reduced, own_slice, own, spec, scale, backward):
    """({output: the oracle's values}, {output: the plain computation's}) at this rank's samples, in the
    outputs' shapes, from the reduced sums (:meth:`Samples.reduced`) and this rank's samples ``own``."""
    b, hq, hk, d = spec.batch, spec.heads, spec.kv_heads, spec.head_dim
    g = hq // hk
    _, rnd = rounder(spec.dtype, np)
    rows = lambda x: x[:, :, :, own_slice]                                    # (B, Hk, g, T[, D]) -> own
    top, l, l_plain = rows(reduced["top"]), rows(reduced["l"]), rows(reduced["l_plain"])
    n = l.shape[-1]
    as_o = lambda x: x.transpose(0, 3, 1, 2, 4).reshape(b, n, hq, d)
    as_lse = lambda x: x.reshape(b, hq, n)
    empty = l == 0
    safe = np.where(empty, 1.0, l)
    o = np.where(empty[..., None], 0.0, rows(reduced["A"]) / safe[..., None])
    ref = {"o": as_o(o), "lse": as_lse(top + np.log(l))}
    plain = {"o": as_o(rnd(rows(reduced["o_plain"]))), "lse": as_lse((top + np.log(l_plain)).astype(np.float32))}
    if backward:
        do = own["do"].reshape(b, n, hk, g, d).transpose(0, 2, 3, 1, 4)
        delta = (do * o).sum(-1)[..., None]
        dq = scale * (rows(reduced["C"]) - delta * rows(reduced["Bk"])) / safe[..., None]
        dq = np.where(empty[..., None], 0.0, dq)
        ref["dq"], plain["dq"] = as_o(dq), as_o(rnd(rows(reduced["dq_plain"]) * scale))
        cols = lambda x: x[:, :, own_slice].transpose(0, 2, 1, 3)             # (B, Hk, T, D) -> (B, n, Hk, D)
        ref["dk"], ref["dv"] = cols(reduced["dk"]) * scale, cols(reduced["dv"])
        plain["dk"], plain["dv"] = rnd(cols(reduced["dk_plain"]) * scale), rnd(cols(reduced["dv_plain"]))
    return ref, plain
