"""The float64 oracle: plain full-matrix attention, forward and backward.

Masks use global positions: query i sits at q_start + i, key j at k_start + j. So a block cut
from a longer sequence can be checked on its own. Each mask is built densely from its
definition (DESIGN.md), on purpose independently of burst_hpc.plan.masks and the kernels:
causal hides later keys, ``window=(left, right)`` hides keys more than left before or right
after the query (-1: unbounded), ``cu_seqlens`` hides keys of other documents. Rows with every
key hidden give o = 0, lse = -inf and zero gradients.

Non-finite inputs (DESIGN.md, "What every call promises"): every sum runs over the visible (query,
key) pairs alone, in IEEE arithmetic, so a NaN or Inf reaches exactly the rows that see it and the
gradients those rows feed: a hidden pair adds nothing even where its key, value or query holds NaN
(masking selects, it never multiplies by 0). A score of -inf gives its key weight 0, as a hidden key
has; a row whose visible scores are all -inf has o = 0, lse = -inf, like a row that sees nothing.
"""
import numpy as np


def _quiet(*arrays):
    """Inputs holding NaN or Inf: numpy's 'invalid value' warnings off (inf - inf is NaN, as it should be);
    finite inputs keep them, as the sign of a bug."""
    finite = all(np.isfinite(x).all() for x in arrays)
    return np.errstate() if finite else np.errstate(invalid="ignore")


def _inputs(q, k, v, scale):
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return q, np.repeat(k, group, axis=2), np.repeat(v, group, axis=2), group, scale


def visible(q_pos, k_pos, causal=False, window=None, cu_seqlens=None):
    """Dense boolean (len(q_pos), len(k_pos)): key j visible from query i, from the definitions."""
    i, j = np.asarray(q_pos)[:, None], np.asarray(k_pos)[None, :]
    seen = np.ones((i.shape[0], j.shape[1]), bool)
    if causal:
        seen &= j <= i
    if window is not None:
        left, right = window
        if left != -1:
            seen &= j >= i - left
        if right != -1:
            seen &= j <= i + right
    if cu_seqlens is not None:
        cu = np.asarray(cu_seqlens)
        document = lambda pos: np.searchsorted(cu, pos, side="right")  # the document holding each position
        seen &= document(i) == document(j)
    return seen


def meets(positions, start, stop, causal=False, window=None, cu_seqlens=None, as_keys=False):
    """Boolean (len(positions),): whether the query at each position sees some key of the run
    [start, stop) of consecutive positions; ``as_keys``: whether the key at each position is seen by
    some query of the run. From the definitions, like :func:`visible` (``visible(...).any(1)`` for a
    run of keys), at the cost of one position each."""
    p = np.asarray(positions, np.int64)
    lo, hi = np.full_like(p, start), np.full_like(p, stop - 1)   # the other side's positions it can meet
    if causal:                          # key j <= query i
        lo, hi = (np.maximum(lo, p), hi) if as_keys else (lo, np.minimum(hi, p))
    if window is not None:              # i - left <= j <= i + right
        left, right = window
        below, above = (right, left) if as_keys else (left, right)
        if below != -1:
            lo = np.maximum(lo, p - below)
        if above != -1:
            hi = np.minimum(hi, p + above)
    if cu_seqlens is not None:          # the same document
        cu = np.asarray(cu_seqlens)
        document = np.searchsorted(cu, p, side="right") - 1
        lo, hi = np.maximum(lo, cu[document]), np.minimum(hi, cu[document + 1] - 1)
    return lo <= hi


def _probabilities(q, k, scale, causal, q_start, k_start, window=None, cu_seqlens=None):
    """(p, lse, seen): p (B, H, Sq, Sk) softmax probabilities (0 on hidden pairs), lse (B, H, Sq),
    seen (Sq, Sk) the visible pairs (None: every pair)."""
    s = np.einsum("bqhd,bkhd->bhqk", q, k, optimize=True) * scale
    seen = None
    if causal or window is not None or cu_seqlens is not None:
        seen = visible(q_start + np.arange(q.shape[1]), k_start + np.arange(k.shape[1]), causal, window, cu_seqlens)
        s = np.where(seen, s, -np.inf)
    row_max = s.max(-1, keepdims=True) if s.shape[-1] else np.full(s.shape[:-1] + (1,), -np.inf)
    safe_max = np.where(np.isneginf(row_max), 0.0, row_max)
    e = np.exp(s - safe_max)
    total = e.sum(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = (np.log(total) + safe_max)[..., 0]
    p = e / np.where(total == 0, 1.0, total)
    if seen is not None and np.isnan(total).any():
        p = np.where(seen, p, 0.0)  # a NaN row's hidden pairs: exp(-inf - NaN) is NaN
    return p, lse, seen


def _visible_sum(w, x, seen):
    """sum_j w[b, h, i, j] x[b, j, h] over the visible pairs seen[i, j] alone (seen None: all): w (B, H, I,
    J), 0 on hidden pairs, x (B, J, H, D) -> (B, I, H, D). A hidden pair adds nothing, also where x is NaN
    or Inf (its weight 0 times NaN would be NaN): x's non-finite entries are taken out of the product and
    added back, pair by visible pair, for the few keys j that hold one."""
    bad = ~np.isfinite(x)
    if not bad.any():
        return np.einsum("bhij,bjhd->bihd", w, x, optimize=True)
    out = np.einsum("bhij,bjhd->bihd", w, np.where(bad, 0.0, x), optimize=True)
    for j in np.flatnonzero(bad.any(axis=(0, 2, 3))):
        term = w[:, :, :, j, None] * np.where(bad[:, j], x[:, j], 0.0)[:, :, None, :]  # (B, H, I, D)
        if seen is not None:
            term = np.where(seen[:, j, None], term, 0.0)
        out += term.transpose(0, 2, 1, 3)
    return out


def _sum_groups(x, group):
    b, s, h, d = x.shape
    return x.reshape(b, s, h // group, group, d).sum(3)


def _attention(q, k, v, scale, causal, q_start, k_start, window, cu_seqlens):
    """(o, lse, p, seen) on float64 inputs with k, v expanded to the query heads."""
    p, lse, seen = _probabilities(q, k, scale, causal, q_start, k_start, window, cu_seqlens)
    o = _visible_sum(p, v, seen)
    return np.where(np.isneginf(lse).transpose(0, 2, 1)[..., None], 0.0, o), lse, p, seen


def attention_reference(q, k, v, causal=False, scale=None, q_start=0, k_start=0, window=None, cu_seqlens=None):
    """(o, lse) in float64: o (B, Sq, Hq, D), lse (B, Hq, Sq)."""
    q, k, v, _, scale = _inputs(q, k, v, scale)
    with _quiet(q, k, v):
        o, lse, _, _ = _attention(q, k, v, scale, causal, q_start, k_start, window, cu_seqlens)
    return o, lse


def attention_backward_reference(do, q, k, v, causal=False, scale=None, q_start=0, k_start=0, window=None,
                                 cu_seqlens=None):
    """(dq, dk, dv) in float64 for the loss sum(do * o)."""
    q, k, v, group, scale = _inputs(q, k, v, scale)
    do = np.asarray(do).astype(np.float64)
    with _quiet(q, k, v, do):
        o, _, p, seen = _attention(q, k, v, scale, causal, q_start, k_start, window, cu_seqlens)
        seen_t = None if seen is None else seen.T
        dv = _visible_sum(p.swapaxes(-1, -2), do, seen_t)
        dp = np.einsum("bqhd,bkhd->bhqk", do, v, optimize=True)
        delta = np.einsum("bqhd,bqhd->bhq", do, o)[..., None]  # = sum_j p dp over the visible pairs
        ds = p * (dp - delta)
        if seen is not None:
            ds = np.where(seen, ds, 0.0)  # not p = 0 times a NaN dp or delta
        dq = _visible_sum(ds, k, seen) * scale
        dk = _visible_sum(ds.swapaxes(-1, -2), q, seen_t) * scale
        return dq, _sum_groups(dk, group), _sum_groups(dv, group)
