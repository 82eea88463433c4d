"""The tolerance rule every check of an output against the float64 oracle follows (``--verify``,
``burst-hpc verify``, ``burst-hpc check`` and the tests), and the plain computation it measures by.

Error of our result against the float64 oracle must stay within FACTOR x the error of a plain
computation in the input precision (scores, probabilities and products rounded to the input dtype,
float32 accumulation, as a PyTorch-style implementation does) plus a floor:
    max|ours - ref| <= FACTOR[name] * max|plain - ref| + ATOL[dtype] * max(1, max|ref|)
FACTOR is 2 for o and lse, 3 for dq, dk, dv (FlashAttention's test convention). A NaN or Inf in our
output where the oracle has a number (or the reverse) fails whatever the tolerance; one where the
oracle has a NaN or Inf too (inputs holding them, --allow-nonfinite) is no error.
"""
import math

import numpy as np

from .dtypes import dtype_name, parse_dtype
from .reference import visible

FACTOR = {"o": 2.0, "lse": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}
ATOL = {"float64": 1e-10, "float32": 1e-5, "float16": 1e-4, "bfloat16": 1e-3}
LSE_ATOL = 5e-7  # lse is stored as float32 whatever the inputs
LSE_SPREAD = 4.0  # dk, dv: the stored lse's rounding reaches them summed over rows with random signs


def tolerance(name, plain_err, ref_max, dtype, lse_rounding=0.0):
    """The allowed max error of output ``name``: FACTOR x the plain computation's error + the floor.
    ``lse_rounding``: for dk and dv checked with P from a stored lse, that lse's rounding error at its
    largest magnitude (its dtype's eps / 2 times max|lse|), which the reference inherits (relative)."""
    atol = max(ATOL[dtype_name(dtype)], LSE_ATOL if name == "lse" else 0.0)
    inherited = LSE_SPREAD * lse_rounding if name in ("dk", "dv") else 0.0
    return FACTOR[name] * plain_err + (atol + inherited) * max(1.0, ref_max)


def plain_error(name, plain, ref, dtype):
    """max |plain - ref| of output ``name``, the plain computation's error. Where the plain computation is not
    finite and the oracle is (it multiplies a hidden pair's weight 0 by a NaN operand), it says nothing of
    rounding: there it is credited with the oracle rounded once to the output's dtype (``dtype``; lse is
    float32), an error no computation in that precision avoids."""
    plain, ref = np.asarray(plain, np.float64), np.asarray(ref, np.float64)
    stored = np.float32 if name == "lse" else parse_dtype(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        rounded = ref.astype(stored).astype(np.float64)
    return max_err(np.where(np.isfinite(plain) | ~np.isfinite(ref), plain, rounded), ref)


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
    """max |ref| over its finite entries (0 when there are none)."""
    ref = np.asarray(ref, np.float64)
    finite = ref[np.isfinite(ref)]
    return float(np.abs(finite).max()) if finite.size else 0.0


def plain_attention(q, k, v, do=None, causal=False, scale=None, lowp=None, window=None, cu_seqlens=None,
                    q_start=0, k_start=0):
    """(o, lse, dq, dk, dv) by the textbook formulas; in float64 when ``lowp`` is None, else as a plain
    same-precision implementation: products rounded to ``lowp``, float32 arithmetic in between.
    Positions are global, as the oracle's: query i at ``q_start + i``, key j at ``k_start + j``."""
    ct = np.float64 if lowp is None or np.dtype(lowp) == np.float64 else np.float32
    rnd = (lambda x: x) if lowp is None else (lambda x: x.astype(lowp).astype(ct))
    heads, group = q.shape[2], q.shape[2] // k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qc, kc, vc = q.astype(ct), _expand(k, heads, ct), _expand(v, heads, ct)
    s = rnd(np.einsum("bqhd,bkhd->bhqk", qc, kc) * scale)
    if causal or window is not None or cu_seqlens is not None:
        seen = visible(q_start + np.arange(q.shape[1]), k_start + np.arange(k.shape[1]), causal, window, cu_seqlens)
        s = np.where(seen, s, -np.inf)
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


def _expand(x, heads, ct):
    return np.repeat(x.astype(ct), heads // x.shape[2], axis=2)


def _logsumexp(s):
    m = s.max(-1)
    safe = np.where(np.isneginf(m), 0, m)
    with np.errstate(divide="ignore"):
        return np.log(np.exp(s - safe[..., None]).sum(-1)) + safe
