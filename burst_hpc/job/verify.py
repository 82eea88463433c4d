"""--verify and ``burst-hpc verify``: our outputs against the float64 oracle, on every token when the
problem is small, else on sampled tokens of every rank, each as a query row and as a key column.

Error of our result against the float64 oracle must stay within FACTOR x the error of a plain
computation in the input precision (scores, probabilities and products rounded to the input dtype,
float32 accumulation, as a PyTorch-style implementation does) plus a floor:
    max|ours - ref| <= FACTOR[name] * max|plain - ref| + ATOL[dtype] * max(1, max|ref|)
FACTOR is 2 for o and lse, 3 for dq, dk, dv (FlashAttention's test convention). A NaN or Inf in our
output where the oracle has a number (or the reverse) fails whatever the tolerance; one where the
oracle has a NaN or Inf too (inputs holding them, --allow-nonfinite) is no error.
The check runs where the job runs (CuPy arrays on the GPU), on sampled tokens of every rank: see
"the sampled check" below.
The outcome is recorded in the output file's attributes (see :func:`pending_attrs`):
``verify`` ("not run", "not finished", "pass" or "fail"), ``verify_mode`` and, per output X,
``verify_max_err_X`` and ``verify_tol_X`` (NaN where X was not checked).
"""
import itertools
import math
import time
from dataclasses import dataclass

import numpy as np

from ..collective import Alone, agree, describe
from ..device import array_module
from ..dtypes import dtype_name, nonfinite
from ..errors import BurstError
from ..io.format import fixed_text, modify_attrs
from ..reference import meets, visible

FACTOR = {"o": 2.0, "lse": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}
ATOL = {"float64": 1e-10, "float32": 1e-5, "float16": 1e-4, "bfloat16": 1e-3}
LSE_ATOL = 5e-7  # lse is stored as float32 whatever the inputs
LSE_SPREAD = 4.0  # dk, dv: the stored lse's rounding reaches them summed over rows with random signs
FULL_LIMIT = 1 << 22  # B * Hq * S * S at most this: every row, every output, checked in full
KEY_CHUNK = 1 << 21  # elements of one (B, Hq, rows, keys) score block in the sampled check


def _compute_type(lowp):
    return np.float64 if lowp is None or np.dtype(lowp) == np.float64 else np.float32


def _rounder(lowp, ct):
    if lowp is None:
        return lambda x: x
    return lambda x: x.astype(lowp).astype(ct)


def _expand(x, heads, ct):
    return np.repeat(x.astype(ct), heads // x.shape[2], axis=2)


def _scores(q, k, scale, causal, q_start, k_start, rnd, window=None, cu_seqlens=None):
    s = rnd(np.einsum("bqhd,bkhd->bhqk", q, k) * scale)
    if causal or window is not None or cu_seqlens is not None:
        seen = visible(q_start + np.arange(q.shape[1]), k_start + np.arange(k.shape[1]), causal, window, cu_seqlens)
        s = np.where(seen, s, -np.inf)
    return s


def plain_attention(q, k, v, do=None, causal=False, scale=None, lowp=None, window=None, cu_seqlens=None):
    """(o, lse, dq, dk, dv) by the textbook formulas; in float64 when ``lowp`` is None, else as a plain
    same-precision implementation: products rounded to ``lowp``, float32 arithmetic in between."""
    ct = _compute_type(lowp)
    rnd = _rounder(lowp, ct)
    heads, group = q.shape[2], q.shape[2] // k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qc, kc, vc = q.astype(ct), _expand(k, heads, ct), _expand(v, heads, ct)
    s = _scores(qc, kc, scale, causal, 0, 0, rnd, window, cu_seqlens)
    lse = _logsumexp(s)
    p = rnd(np.exp(s - np.where(np.isneginf(lse), 0, lse)[..., None]))
    o = rnd(np.einsum("bhqk,bkhd->bqhd", p, vc))
    if do is None:
        return o, lse, None, None, None
    doc = do.astype(ct)
    dv = np.einsum("bhqk,bqhd->bkhd", p, doc)
    dp = rnd(np.einsum("bqhd,bkhd->bhqk", doc, vc))
    delta = np.einsum("bqhd,bqhd->bhq", doc, o)
    ds = rnd(p * (dp - delta[..., None]))
    dq = rnd(np.einsum("bhqk,bkhd->bqhd", ds, kc) * scale)
    dk = np.einsum("bhqk,bqhd->bkhd", ds, qc) * scale
    b, n, _, d = k.shape
    return o, lse, dq, rnd(dk.reshape(b, n, -1, group, d).sum(3)), rnd(dv.reshape(b, n, -1, group, d).sum(3))


def _logsumexp(s):
    m = s.max(-1)
    safe = np.where(np.isneginf(m), 0, m)
    with np.errstate(divide="ignore"):
        return np.log(np.exp(s - safe[..., None]).sum(-1)) + safe


def tolerance(name, plain_err, ref_max, dtype, lse_rounding=0.0):
    """The allowed max error of output ``name``: FACTOR x the plain computation's error + the floor.
    ``lse_rounding``: for dk and dv checked with P from a stored lse, that lse's rounding error at its
    largest magnitude (its dtype's eps / 2 times max|lse|), which the reference inherits (relative)."""
    atol = max(ATOL[dtype_name(dtype)], LSE_ATOL if name == "lse" else 0.0)
    inherited = LSE_SPREAD * lse_rounding if name in ("dk", "dv") else 0.0
    return FACTOR[name] * plain_err + (atol + inherited) * max(1.0, ref_max)


def passes(err, tol):
    """The rule holds; a non-finite error (or tolerance) fails."""
    return math.isfinite(err) and math.isfinite(tol) and err <= tol


def max_err(ours, ref):
    """max |ours - ref|; a NaN or infinity counts as no error where the oracle holds one too (NaN or
    infinite: which one depends on the order of the sums), and as an infinite error anywhere else."""
    ours = np.asarray(ours, np.float64)
    ref = np.asarray(ref, np.float64)
    same = (ours == ref) | (~np.isfinite(ours) & ~np.isfinite(ref))
    with np.errstate(invalid="ignore"):
        diff = np.where(same, 0.0, np.abs(ours - ref))
    diff = np.where(np.isnan(diff), np.inf, diff)
    return float(diff.max()) if diff.size else 0.0


def max_abs(ref):
    ref = np.asarray(ref, np.float64)
    finite = ref[np.isfinite(ref)]
    return float(np.abs(finite).max()) if finite.size else 0.0


def nonfinite_summary(outputs, comm):
    """Collective: the run summary's account of NaN and Inf in the outputs (NumPy or CuPy), summed over the ranks:
    ``["nonfinite o=N lse=M ..."]`` naming each output that holds any, or ``[]`` when all are finite.
    An lse of -inf is a row that sees nothing, not counted. Inputs holding NaN or Inf
    (``--allow-nonfinite``) propagate into the rows that see them, and this says how far."""
    counts = []
    for name, x in outputs.items():
        bad = nonfinite(x)
        if name == "lse":
            bad &= ~array_module(x).isneginf(x)
        counts.append(int(bad.sum()))
    counts = comm.allreduce(np.array(counts, np.int64))
    found = [f"{name}={int(n)}" for name, n in zip(outputs, counts) if n]
    return ["nonfinite " + " ".join(found)] if found else []


# --------------------------------------------------------------------------- the sampled check
#
# Each rank samples tokens of its own and checks them as query rows (o, lse, dq against every key) and
# as key columns (dk, dv against every query). The samples of every rank travel to every rank (they are
# small); each rank then streams over its own tokens once, a block at a time, adding their share to
# every sample's sums, and the sums are reduced to the samples' owners. So the inputs are read once,
# by the rank that owns them (or not at all: a job checks the shards it holds, on its own device).
#   rows: online softmax over the key blocks in float64: l = sum e, A = sum e v, Bk = sum e k,
#         C = sum e (do.v) k with e = exp(s - m), m the running max; at the end lse = m + log l,
#         o = A / l, delta = do.o and dq = scale (C - delta Bk) / l (exact, no second pass).
#   columns: dv_j = sum_i P_ij do_i, dk_j = scale sum_i P_ij (do_i.v_j - delta_i) q_i with P_ij from the
#         output's lse and delta_i = do_i.o_i from the output's o (the checkpoint the backward pass
#         itself uses; o and lse are checked on the sampled rows).
# The plain same-precision computation that sets the tolerance runs alongside on the same blocks:
# scores, probabilities (normalized by the output's lse), dp and dS rounded to the input dtype,
# float32 sums. Hidden pairs add nothing, also where a hidden key, value or query is NaN or Inf.

ROWS = 256          # samples per rank unless told (the run job picks fewer when they would cost too much)
LEAST_ROWS = 16     # the job's budget never takes the sample below this
BUDGET = {"numpy": 0.5, "cuda": 0.08}      # the job's verification: at most this share of its passes' time
MARGIN = 0.8        # the sample is sized to this share of the budget: the prediction errs by up to 20%
BLOCK_ELEMENTS = {"numpy": 1 << 18, "cuda": 1 << 25}   # B * Hq * samples * tokens of one score block
CALIBRATION_ELEMENTS = {"numpy": 1 << 14, "cuda": 1 << 23}   # the same of the calibration's smallest (its largest: 16x)
LEAST_WIDTH = 64    # tokens of a block at least: narrower, the part per sample (its sums, D wide) outweighs the pairs
SAMPLE_ELEMENTS = 1 << 24   # B * Hq * D * samples of all ranks at most (each row sum is that big)
PROGRESS_S = 5.0


def as_float64(x, xp):
    """``x`` (NumPy or CuPy, any supported dtype; uint16 or bfloat16 holds bfloat16 bits) as a float64
    array of ``xp``, exact."""
    x = xp.asarray(x) if array_module(x) is xp else xp.asarray(_host_float(x))
    if x.dtype == xp.uint16 or str(x.dtype) == "bfloat16":
        x = (x.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    return x.astype(xp.float64)


def _host_float(x):
    x = _host(x)
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
    for j in np.flatnonzero(_host(bad.any(axis=tuple(a for a in range(bad.ndim) if a != bad.ndim - 2)))):
        term = w[..., :, j, None] * xp.where(bad[..., j, :], x[..., j, :], 0)[..., None, :]
        out += xp.where(seen[:, j, None], term, 0)
    return out


def _host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


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

    def __init__(self, gathered, spec, causal, scale, window, xp):
        self.xp, self.causal, self.scale, self.window, self.cu = xp, causal, scale, window, spec.cu_seqlens
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
        return visible(q_pos, k_pos, self.causal, self.window, self.cu)

    def active(self, pos, as_keys):
        """The samples (indices) that meet the block of tokens ``pos``: as query rows that see one of its
        keys, or (``as_keys``) as key columns one of its queries sees. A run of consecutive positions (the
        check's blocks) costs one test per sample; other blocks, the dense mask."""
        start, stop = int(pos[0]), int(pos[-1]) + 1
        if stop - start == len(pos) and np.all(np.diff(pos) == 1):
            return np.flatnonzero(meets(self.positions, start, stop, self.causal, self.window, self.cu, as_keys))
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

        m = _host(self.m)
        top = np.where(np.isnan(m), -np.inf, m)  # a NaN row stays NaN through its factor below
        if comm.size > 1:
            comm.Allreduce(MPI.IN_PLACE, top, op=MPI.MAX)
        safe = np.where(np.isneginf(top), 0.0, top)
        with np.errstate(invalid="ignore", over="ignore"):
            factor = np.where(np.isneginf(m), 0.0, np.exp(m - safe))
        names = list(self.sums) + (list(self.cols) if self.cols is not None else [])
        arrays = {n: _host(self.sums[n]).astype(np.float64) for n in self.sums}
        for n in ("l", "l_plain"):
            arrays[n] = arrays[n] * factor
        for n in ("A", "Bk", "C"):
            arrays[n] = arrays[n] * factor[..., None]
        if self.cols is not None:
            arrays.update({n: _host(x).astype(np.float64) for n, x in self.cols.items()})
        flat = np.concatenate([arrays[n].ravel() for n in names])
        if comm.size > 1:
            comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        out, at = {"top": safe}, 0
        for n in names:
            out[n] = flat[at:at + arrays[n].size].reshape(arrays[n].shape)
            at += arrays[n].size
        return out


def _sync(xp):
    if xp is not np:
        xp.cuda.Device().synchronize()


# --------------------------------------------------------------------------- what the check costs
#
# The check streams over this rank's tokens in blocks (block_spans); a block costs, per pass (the keys
# pass adds to the sampled rows' sums, the queries pass to the sampled columns'), a fixed part, a part
# per token (its inputs to float64), a part per active sample (its sums updated) and a part per (token,
# active sample) pair, where a sample is active in a block when its row sees a key of the block (rows),
# or a query of the block sees its key (columns): the block's rectangle, not only its visible pairs.
# calibrate times blocks of the job's own shapes and dtype on this machine and fits the four parts;
# Blocks counts each block's active samples as the loop finds them (reference.meets), so a prediction
# adds up what the loop will run.


@dataclass(frozen=True)
class Rates:
    """Seconds of one pass over a block on this machine: ``keys`` (the rows' sums) and ``queries`` (the
    columns', None without gradients), each (per block, per token, per active sample, per (token,
    active sample) pair)."""
    keys: tuple
    queries: tuple = None

    def block(self, tokens, rows, cols):
        """Predicted (fixed, samples) seconds of a block of ``tokens`` tokens with ``rows`` active sample
        rows and ``cols`` active sample columns: the parts per block and per token, and the parts that
        grow with the samples (a pass with no active sample costs nothing: it returns before any work)."""
        fixed = varying = 0.0
        for part, active in ((self.keys, rows), (self.queries, cols)):
            if part is not None and active > 0:
                per_block, per_token, per_sample, per_pair = part
                fixed += per_block + per_token * tokens
                varying += (per_sample + per_pair * tokens) * active
        return fixed, varying


def block_width(spec, samples, xp):
    """Tokens per block when ``samples`` samples (all ranks') are checked: BLOCK_ELEMENTS of scores, at
    least LEAST_WIDTH tokens."""
    return max(LEAST_WIDTH, BLOCK_ELEMENTS[_where(xp)] // (spec.batch * spec.heads * max(samples, 1)))


def block_spans(positions, width):
    """[(lo, hi)]: local token indices in blocks of at most ``width`` tokens, each a run of consecutive
    global positions (a zigzag shard's two chunks are never mixed in one block)."""
    positions = np.asarray(positions)
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    runs = zip(np.concatenate([[0], breaks]), np.concatenate([breaks, [len(positions)]]))
    return [(int(lo), int(min(end, lo + width))) for start, end in runs for lo in range(start, end, width)]


class Blocks:
    """This rank's blocks (``spans``, from :func:`block_spans`: runs of consecutive positions) and what
    they cost: a sample is active in a block as a row when it sees one of the block's keys, as a
    column when one of the block's queries sees it (reference.meets, as the check itself finds them)."""

    def __init__(self, positions, width, spec, causal, window):
        self.spans = block_spans(positions, width)
        positions = np.asarray(positions, np.int64)
        self.runs = [(int(positions[lo]), int(positions[hi - 1]) + 1) for lo, hi in self.spans]
        self.mask = dict(causal=causal, window=window, cu_seqlens=spec.cu_seqlens)

    def active(self, samples):
        """(rows, cols): per block, how many of ``samples`` (global positions) are active rows, columns."""
        rows = np.array([meets(samples, a, b, **self.mask).sum() for a, b in self.runs], np.int64)
        cols = np.array([meets(samples, a, b, as_keys=True, **self.mask).sum() for a, b in self.runs], np.int64)
        return rows, cols

    def seconds(self, rates, samples):
        """Predicted (fixed, samples) seconds of the loop over the blocks with these ``samples``."""
        rows, cols = self.active(samples)
        parts = [rates.block(b - a, r, c) for (a, b), r, c in zip(self.runs, rows, cols)]
        return sum(f for f, _ in parts), sum(v for _, v in parts)

    def budget_rows(self, rates, grids, budget_s, most):
        """The most samples per rank (at most ``most``) whose loop fits ``budget_s`` seconds, by the
        expected active counts: each rank draws its samples from its own tokens, for which ``grids``
        (one array of evenly spaced positions of each rank's tokens) stand in."""
        fixed, _ = self.seconds(rates, np.concatenate(grids))
        per_sample = sum(self.seconds(rates, grid)[1] / len(grid) for grid in grids)   # one sample of each rank
        return most if per_sample <= 0 else int(min(most, max(0.0, budget_s - fixed) / per_sample))


_MEASURED = {}   # (shapes, dtype, gradients, backend) -> this process's fitted costs


def calibrate(spec, scale, backward, xp):
    """The check's :class:`Rates` on this rank's device (each rank its own: the budget and the prediction
    take the slowest rank's result) for the problem's batch, heads, head dim and dtype; measured once
    per process and shape (:func:`measure`)."""
    key = (spec.batch, spec.heads, spec.kv_heads, spec.head_dim, dtype_name(spec.dtype), bool(backward), _where(xp))
    if key not in _MEASURED:
        _MEASURED[key] = measure(spec, scale, backward, xp)
    fitted = _MEASURED[key]
    return Rates(tuple(map(float, fitted[0])), tuple(map(float, fitted[1])) if backward else None)


def measure(spec, scale, backward, xp):
    """This process's costs of the check, an array (pass: keys, queries; part: per block, per token, per
    sample, per pair), for the problem's shapes and dtype. An untimed first go under a causal mask loads
    what the check uses (CuPy's kernels, also those of a block where only some samples are active);
    then four timed blocks, (T, c), (4T, c), (T, 4c) and (4T, 4c) samples x tokens (the best of two
    goes), separate the parts of each pass."""
    from types import SimpleNamespace

    where = _where(xp)
    b, hq, hk, d = spec.batch, spec.heads, spec.kv_heads, spec.head_dim
    samples = 16
    tokens = max(16, CALIBRATION_ELEMENTS[where] // (b * hq * samples))
    rng = np.random.default_rng(0)
    shape = SimpleNamespace(batch=b, heads=hq, kv_heads=hk, head_dim=d, dtype=spec.dtype, cu_seqlens=None,
                            seqlen=4 * tokens)

    def host(t, h):
        return rng.standard_normal((b, t, h, d), np.float32).astype(spec.dtype)

    def device(t, h):   # a large block is drawn where it is used (NumPy's generator would take seconds)
        if xp is np:
            return host(t, h)
        x = xp.random.standard_normal((b, t, h, d), np.float32)
        return (x.view(xp.uint32) >> 16).astype(xp.uint16) if dtype_name(spec.dtype) == "bfloat16" else \
            x.astype(spec.dtype)

    n = 4 * samples
    gathered = {"positions": np.arange(n) * tokens // samples, "q": host(n, hq), "k": host(n, hk), "v": host(n, hk),
                "lse": np.full((b, hq, n), 5.0), "do": host(n, hq) if backward else None, "delta": np.zeros((b, hq, n))}
    block = {name: device(4 * tokens, hk if name in ("k", "v") else hq) for name in ("q", "k", "v", "do", "o")}
    lse = xp.full((b, hq, 4 * tokens), 5.0, xp.float32)

    def timed(t, c, causal=False, first=0):
        part = {name: x[:t] if name == "positions" else None if x is None else x[:, :, :t] if x.ndim == 3 else x[:, :t]
                for name, x in gathered.items()}
        check = Samples(part, shape, causal, scale, None, xp)
        pos, keys = np.arange(first, first + c), slice(first, first + c)
        _sync(xp)
        begin = time.perf_counter()
        check.add_keys(pos, block["k"][:, keys], block["v"][:, keys])
        _sync(xp)
        middle = time.perf_counter()
        if backward:
            check.add_queries(pos, block["q"][:, keys], block["do"][:, keys], lse[:, :, keys], block["o"][:, keys])
            _sync(xp)
        return np.array([middle - begin, time.perf_counter() - middle])

    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for first in (0, 2 * tokens):   # causal: some samples see none of the keys, some keys no sample sees
            timed(n, 16, causal=True, first=first)
        sizes = ((samples, tokens), (n, tokens), (samples, 4 * tokens), (n, 4 * tokens))
        base, more_samples, more_tokens, more_both = np.min([[timed(*size) for size in sizes] for _ in range(2)],
                                                            axis=0)
    pairs = samples * tokens
    per_pair = np.maximum(0.0, (more_both - more_tokens - more_samples + base) / (9 * pairs))
    per_sample = np.maximum(0.0, (more_samples - base - 3 * per_pair * pairs) / (3 * samples))
    per_token = np.maximum(0.0, (more_tokens - base - 3 * per_pair * pairs) / (3 * tokens))
    per_block = np.maximum(0.0, base - per_token * tokens - per_sample * samples - per_pair * pairs)
    return np.stack([per_block, per_token, per_sample, per_pair], axis=1)


def _where(xp):
    return "numpy" if xp is np else "cuda"


def failures(report):
    """'o: max error 5.0e-01 > tolerance 3.9e-03; ...' for each output that failed, '' when none."""
    said = []
    for name in report["failed"]:
        err, tol = report["err"][name], report["tol"][name]
        why = "NaN or Inf where the float64 oracle has none (or the reverse)" if not math.isfinite(err) else \
            f"max error {err:.2e} > tolerance {tol:.2e}"
        said.append(f"{name}: {why}")
    return "; ".join(said)


def check(tokens, spec, comm, causal, scale, window=None, backward=False, rows=ROWS, seed=0, xp=np, budget_s=None,
          announce=None, progress=None, rates=None):
    """Check a rank's outputs against the float64 oracle, on sampled tokens; collective.

    Parameters
    ----------
    tokens : Tokens
        This rank's tokens of the input (q, k, v, do) and of the output (o, lse, dq, dk, dv).
    spec : io.InputSpec
        The input's shapes, dtype and documents (cu_seqlens mask the oracle as they masked the run).
    causal, scale, window
        The run's mask and softmax scale.
    backward : bool
        Check dq (sampled rows), dk and dv (sampled key columns) too.
    rows : int
        Tokens each rank samples, each checked as a query row and a key column; every token when the
        problem is small (B Hq S^2 <= FULL_LIMIT). With ``budget_s`` it is the most: fewer (down to
        LEAST_ROWS) when the predicted time would pass ``budget_s`` seconds.
    xp : module
        numpy, or cupy to check on this rank's GPU (float64 on the device).
    announce, progress : callable or None
        Take lines: ``announce`` the predicted cost before the check starts, ``progress`` a line every
        few seconds while it runs (rank 0 passes them; other ranks None).
    rates : Rates or None
        The check's costs on this machine (None: :func:`calibrate` here, its cost counted in the check's).

    Returns
    -------
    dict
        'ok', 'mode', 'failed' (names), 'err', 'tol', 'plain' ({name: float}), 'rows' (samples per
        rank: every token of a rank when full),
        'predicted_s' (announced before the loop: the seconds spent so far, the loop's blocks as
        :class:`Blocks` counts them, the reads) and 'seconds': the same on every rank.
    """
    from mpi4py import MPI

    start = time.perf_counter()
    rank, size = comm.rank, comm.size
    names = ["o", "lse"] + (["dq", "dk", "dv"] if backward else [])
    n_local = len(tokens.positions)
    full = spec.batch * spec.heads * spec.seqlen ** 2 <= FULL_LIMIT
    rates = calibrate(spec, scale, backward, xp) if rates is None else rates
    cap = max(1, SAMPLE_ELEMENTS // (spec.batch * spec.heads * spec.head_dim * size))
    count = min(rows, cap)
    if budget_s is not None and not full:
        blocks = Blocks(tokens.positions, block_width(spec, count * size, xp), spec, causal, window)
        grid = np.unique(tokens.positions[np.linspace(0, n_local - 1, min(n_local, 1024)).astype(np.int64)])
        grids = comm.allgather(grid) if size > 1 else [grid]
        fits = blocks.budget_rows(rates, grids, MARGIN * budget_s - (time.perf_counter() - start), count)
        count = max(min(LEAST_ROWS, count), comm.allreduce(fits, op=MPI.MIN) if size > 1 else fits)
    mine = n_local if full else min(count, n_local)
    every = full or comm.allreduce(int(mine == n_local), op=MPI.MIN) == 1
    mode = "full" if every else f"sampled {count} {'rows+cols' if backward else 'rows'}/rank"

    # this rank's samples, then every rank's
    rng = np.random.default_rng([seed, rank])
    idx = np.arange(n_local) if mine == n_local else np.sort(rng.choice(n_local, mine, replace=False))
    failure, ours, own, gathered = None, {}, {}, None
    try:
        inputs = ["q", "k", "v"] + (["do"] if backward else [])
        got = tokens.take(inputs + names + (["o"] if "o" not in names else []), idx) if mine else {}
        ours = {n: _host(got[n]) for n in names} if mine else {}
        own = {n: _host(as_float64(got[n], np)) for n in inputs + ["o", "lse"]} if mine else {}
        if mine and backward:
            own["delta"] = (own["do"] * own["o"]).sum(-1).transpose(0, 2, 1)  # (B, Hq, n)
    except Exception as e:  # noqa: BLE001
        failure = e if isinstance(e, BurstError) else \
            BurstError(f"verification could not read its samples: {describe(e)}")
    agree(comm, failure)
    part = (tokens.positions[idx], {n: own[n] for n in own if n != "o"})
    parts = comm.allgather(part) if size > 1 else [part]
    offsets = np.cumsum([0] + [len(pos) for pos, _ in parts])  # where each rank's samples start
    parts = [(pos, arrays) for pos, arrays in parts if len(pos)]
    axis = {"lse": 2, "delta": 2}
    gathered = {"positions": np.concatenate([pos for pos, _ in parts])}
    for n in [n for n in ("q", "k", "v", "do", "lse", "delta") if parts and n in parts[0][1]]:
        gathered[n] = np.concatenate([arrays[n] for _, arrays in parts], axis=axis.get(n, 1))
    total = len(gathered["positions"])

    # the prediction: what was spent, the loop's blocks with these samples, the reads (the first block's, timed)
    failure, first, predicted = None, None, 0.0
    blocks = Blocks(tokens.positions, block_width(spec, total, xp), spec, causal, window)
    reading = ["k", "v"] + (["q", "do", "o", "lse"] if backward else [])
    try:
        if total and blocks.spans:
            began = time.perf_counter()
            first = tokens.read(reading, *blocks.spans[0])
            read_s = (time.perf_counter() - began) * n_local / (blocks.spans[0][1] - blocks.spans[0][0])
            predicted = time.perf_counter() - start + read_s + sum(blocks.seconds(rates, gathered["positions"]))
    except Exception as e:  # noqa: BLE001
        failure = e if isinstance(e, BurstError) else BurstError(f"verification could not read: {describe(e)}")
    agree(comm, failure)
    predicted = comm.allreduce(predicted, op=MPI.MAX) if size > 1 else predicted
    if announce is not None:
        what = f"{mine} rows and {mine} key columns" if backward else f"{mine} rows"
        announce(f"verify: {what} per rank against {spec.seqlen} tokens ({mode}, {'GPU' if xp is not np else 'CPU'} "
                 f"float64), about {predicted:.2g}s")

    # this rank's tokens, a block at a time: every sample's sums
    samples = None
    try:
        if total:
            samples = Samples(gathered, spec, causal, scale, window, xp)
            shown = time.perf_counter()
            with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
                for lo, hi in blocks.spans:
                    pos = tokens.positions[lo:hi]
                    block, first = first or tokens.read(reading, lo, hi), None
                    samples.add_keys(pos, block["k"], block["v"])
                    if backward:
                        samples.add_queries(pos, block["q"], block["do"], block["lse"], block["o"])
                    if progress is not None and time.perf_counter() - shown > PROGRESS_S:
                        _sync(xp)
                        shown, done = time.perf_counter(), hi / n_local
                        spent = shown - start
                        progress(f"verify: {100 * done:.0f}% of rank 0's tokens, {spent:.1f}s, "
                                 f"ETA {spent / done * (1 - done):.1f}s")
    except Exception as e:  # noqa: BLE001
        failure = e if isinstance(e, BurstError) else BurstError(f"verification could not run: {describe(e)}")
    agree(comm, failure)

    # the sums reduced to the samples' owners: the oracle's values, the plain computation's, ours
    err, err_plain, ref_max = {n: 0.0 for n in names}, {n: 0.0 for n in names}, {n: 0.0 for n in names}
    reduced = samples.reduced(comm) if total else None
    try:
        if mine:
            with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
                ref, plain = finish(reduced, slice(offsets[rank], offsets[rank] + mine), own, spec, scale, backward)
            for n in names:
                err[n] = max_err(ours[n], ref[n])
                # where the plain computation took a NaN from the output's o or lse it says nothing of rounding
                err_plain[n] = max_err(np.where(np.isfinite(plain[n]), plain[n], ref[n]), ref[n])
                ref_max[n] = max_abs(ref[n])
    except Exception as e:  # noqa: BLE001
        failure = BurstError(f"verification could not compare: {describe(e)}")
    agree(comm, failure)
    if size > 1:
        err, err_plain, ref_max = ({n: comm.allreduce(x[n], op=MPI.MAX) for n in names}
                                   for x in (err, err_plain, ref_max))
    rounding = 0.0 if samples is None else samples.lse_rounding * samples.lse_max
    rounding = comm.allreduce(rounding, op=MPI.MAX) if size > 1 else rounding
    tol = {n: tolerance(n, err_plain[n], ref_max[n], spec.dtype, rounding) for n in names}
    failed = [n for n in names if not passes(err[n], tol[n])]
    _sync(xp)
    return {"ok": not failed, "mode": mode, "failed": failed, "err": err, "tol": tol, "plain": err_plain,
            "rows": mine, "predicted_s": predicted, "seconds": time.perf_counter() - start}


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


def verify_resident(inputs, outputs, positions, spec, comm, causal, scale, window=None, rows=ROWS, seed=0,
                    budget_s=None, announce=None, progress=None, rates=None):
    """Collective: the run job's check of the shards it holds (``inputs`` q, k, v (do) and ``outputs``
    o, lse (dq, dk, dv), NumPy or CuPy arrays in local layout order; ``positions`` their global token
    indices), on the device they are on. See :func:`check`."""
    arrays = dict(inputs, **outputs)
    xp = array_module(arrays["q"])
    return check(Tokens.resident(arrays, positions), spec, comm, causal, scale, window, "dq" in outputs, rows, seed,
                 xp, budget_s, announce, progress, rates)


# warm's problems: CuPy compiles a kernel per operation, dtypes and dimensions left once it merges
# contiguous ones and drops those of size 1, so batch 1 and 2, GQA and MHA, with and without documents
WARM_SHAPES = ((1, 4, 1), (2, 4, 2), (1, 2, 2))          # (batch, query heads, key/value heads)
WARM_MASKS = ((True, None, None), (False, (100, 30), np.array([0, 600, 1400, 2048])))   # (causal, window, cu_seqlens)


def warm(dtypes, xp=None):
    """Check small random problems per dtype (WARM_SHAPES x WARM_MASKS, with gradients) on this
    process's GPU (``xp`` None: CuPy), so that CuPy compiles the kernels a job's --verify runs into its
    own cache (CUPY_CACHE_DIR) now, not in the job (``burst-hpc compile``). Returns the seconds it
    took; raises BurstError if a check fails."""
    from types import SimpleNamespace

    from ..reference import attention_backward_reference, attention_reference

    if xp is None:
        import cupy as xp
    start = time.perf_counter()
    s, d = 2048, 16           # B Hq S^2 above FULL_LIMIT: the sampled check a job runs
    rng = np.random.default_rng(0)
    for dtype, (b, hq, hk), (causal, window, cu) in itertools.product(dtypes, WARM_SHAPES, WARM_MASKS):
        host = {n: rng.standard_normal((b, s, hk if n in ("k", "v") else hq, d)).astype(dtype) for n in ("q", "k", "v", "do")}
        exact = {n: host[n].astype(np.float64) for n in host}
        kw = dict(causal=causal, window=window, cu_seqlens=cu)
        o, lse = attention_reference(exact["q"], exact["k"], exact["v"], **kw)
        dq, dk, dv = attention_backward_reference(exact["do"], exact["q"], exact["k"], exact["v"], **kw)
        outputs = {"o": o.astype(dtype), "lse": lse.astype(np.float32), "dq": dq.astype(dtype), "dk": dk.astype(dtype),
                   "dv": dv.astype(dtype)}
        spec = SimpleNamespace(batch=b, seqlen=s, heads=hq, kv_heads=hk, head_dim=d, dtype=np.dtype(dtype), cu_seqlens=cu)
        arrays = {n: xp.asarray(x) for n, x in dict(host, **outputs).items()}
        report = check(Tokens.resident(arrays, np.arange(s)), spec, Alone(), causal, d ** -0.5, window, True, 16,
                       xp=xp)
        if not report["ok"]:
            raise BurstError(f"the verification's own check failed on this GPU ({dtype_name(dtype)}): {failures(report)}")
    _sync(xp)
    return time.perf_counter() - start


def verify_output(input_path, output_path, comm, causal=None, window=None, backward=None, rows=ROWS, seed=0,
                  xp=np, announce=None, progress=None, scale=None):
    """Collective: check a published output against its input, on any number of ranks (each reads
    its share of the tokens, once). ``causal``, ``window``, ``scale`` and ``backward`` left None are
    taken from what the output records (a ``burst-hpc run`` output records them); given, they must
    agree with it. An output that records no mask (no ``causal`` attribute: written by another
    program) is refused unless ``causal`` is given (its window then ``window``, None: none; its
    scale ``scale``, None: head_dim**-0.5). ``backward`` None: when the output holds dq, dk and dv.
    See :func:`check`."""
    from .. import io
    from ..errors import FileError, ShapeError

    error, spec, files, opened = None, None, {}, []
    try:
        out = io.open_input(output_path)
        opened.append(out)
        attrs = {key: (value.decode() if isinstance(value, bytes) else value) for key, value in out.attrs.items()}
        grads = all(n in out for n in ("dq", "dk", "dv"))
        text = str(attrs.get("window", "none"))
        recorded_window = None if text == "none" else tuple(int(x) for x in text.split(","))
        if "causal" not in attrs and causal is None:
            raise FileError(f"{output_path} does not record the mask it was computed with (no attribute 'causal': "
                            "not written by burst-hpc run); say it: --causal or --no-causal (and --window L[,R] if it "
                            "had one)")
        recorded_scale = float(attrs["scale"]) if "scale" in attrs else None
        for what, given, recorded in (("--causal", causal, attrs.get("causal")), ("--window", window, recorded_window),
                                      ("--scale", scale, recorded_scale)):
            recorded = bool(recorded) if what == "--causal" else recorded
            known = "causal" in attrs if what != "--scale" else recorded is not None
            if given is not None and known and given != recorded:
                raise FileError(f"{output_path} was written with {what[2:]} = {recorded}, not {given}: leave {what} "
                                "out to check it as it was written")
        causal = bool(attrs["causal"]) if causal is None else causal
        window = recorded_window if window is None and "causal" in attrs else window
        backward = grads if backward is None else backward
        need = ["q", "k", "v"] + (["do"] if backward else [])
        spec = io.inspect_input(input_path, need)
        for name in ["o", "lse"] + (["dq", "dk", "dv"] if backward else []):
            if name not in out:
                hint = " (it was written without --backward)" if name in ("dq", "dk", "dv") else ""
                raise FileError(f"{output_path}: dataset {name!r} is missing{hint}; it holds {', '.join(sorted(out))}")
            if tuple(out[name].shape) != spec.shape(name):
                raise ShapeError(f"{output_path}: {name} has shape {tuple(out[name].shape)}, but {input_path} "
                                 f"needs {spec.shape(name)}: is it the output of this input?")
        inp = io.open_input(input_path)
        opened.append(inp)
        files = {n: inp[n] for n in need}
        files.update({n: out[n] for n in ["o", "lse"] + (["dq", "dk", "dv"] if backward else [])})
        scale = next(x for x in (scale, recorded_scale, spec.head_dim ** -0.5) if x is not None)
    except Exception as e:  # noqa: BLE001
        error = e if isinstance(e, BurstError) else FileError(f"cannot verify {output_path}: {describe(e)}")
    try:
        agree(comm, error)
        start, stop = comm.rank * spec.seqlen // comm.size, (comm.rank + 1) * spec.seqlen // comm.size
        return check(Tokens.stored(files, start, stop), spec, comm, causal, scale, window, backward, rows, seed, xp,
                     None, announce, progress)
    finally:
        for f in opened:
            f.close()

# --------------------------------------------------------------------------- the outcome in the file

# fixed-size values, made with the file: recording the outcome later rewrites their bytes in place
# and never changes the file's structure, so a job killed while recording cannot damage its output
STATUS_BYTES, MODE_BYTES = 12, 40


def pending_attrs(outputs, requested):
    """The verification attributes a ``run`` output is created with: ``verify = "not finished"`` and
    room for the outcome when ``requested`` (a job stopped before :func:`record` leaves them so, which
    is the truth), else ``verify = "not run"``. ``outputs``: the names of the output datasets."""
    if not requested:
        return {"verify": fixed_text("not run", STATUS_BYTES)}
    attrs = {"verify": fixed_text("not finished", STATUS_BYTES), "verify_mode": fixed_text("", MODE_BYTES)}
    for name in outputs:
        attrs[f"verify_max_err_{name}"] = np.float64(np.nan)
        attrs[f"verify_tol_{name}"] = np.float64(np.nan)
    return attrs


def record(path, report):
    """Write ``report`` (from :func:`verify`) into the attributes of the published output ``path``
    (one process). The attributes were made by :func:`pending_attrs`; only their values change,
    ``verify`` last."""
    values = {"verify_mode": fixed_text(report["mode"], MODE_BYTES)}
    for name in report["err"]:
        values[f"verify_max_err_{name}"] = np.float64(report["err"][name])
        values[f"verify_tol_{name}"] = np.float64(report["tol"][name])
    values["verify"] = fixed_text("pass" if report["ok"] else "fail", STATUS_BYTES)
    modify_attrs(path, values)


def recorded(path):
    """The verification attributes of an output file, as plain Python values ({} without them)."""
    import h5py

    with h5py.File(path, "r") as f:
        return {key: (value.decode() if isinstance(value, bytes) else value.item() if isinstance(value, np.generic)
                      else value) for key, value in f.attrs.items() if key.startswith("verify")}
