"""The float64 oracle: plain full-matrix attention, forward and backward.

Masks use global positions: query i sits at q_start + i, key j at k_start + j. So a block cut
from a longer sequence can be checked on its own. Each mask is built densely from its
definition (DESIGN.md), on purpose independently of burst_hpc.masks and the kernels:
causal hides later keys, ``window=(left, right)`` hides keys more than left before or right
after the query (-1: unbounded), ``cu_seqlens`` hides keys of other documents. Rows with every
key hidden give o = 0, lse = -inf and zero gradients.
"""
import numpy as np


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
        document = np.repeat(np.arange(len(cu_seqlens) - 1), np.diff(cu_seqlens))  # document of each token
        seen &= document[i] == document[j]
    return seen


def _probabilities(q, k, scale, causal, q_start, k_start, window=None, cu_seqlens=None):
    """(p, lse): p (B, H, Sq, Sk) softmax probabilities, lse (B, H, Sq)."""
    s = np.einsum("bqhd,bkhd->bhqk", q, k, optimize=True) * scale
    if causal or window is not None or cu_seqlens is not None:
        seen = visible(q_start + np.arange(q.shape[1]), k_start + np.arange(k.shape[1]), causal, window, cu_seqlens)
        s = np.where(seen, s, -np.inf)
    row_max = s.max(-1, keepdims=True) if s.shape[-1] else np.full(s.shape[:-1] + (1,), -np.inf)
    safe_max = np.where(np.isneginf(row_max), 0.0, row_max)
    e = np.exp(s - safe_max)
    total = e.sum(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = (np.log(total) + safe_max)[..., 0]
    p = e / np.where(total > 0, total, 1.0)
    return p, lse


def _sum_groups(x, group):
    b, s, h, d = x.shape
    return x.reshape(b, s, h // group, group, d).sum(3)


def attention_reference(q, k, v, causal=False, scale=None, q_start=0, k_start=0, window=None, cu_seqlens=None):
    """(o, lse) in float64: o (B, Sq, Hq, D), lse (B, Hq, Sq)."""
    q, k, v, _, scale = _inputs(q, k, v, scale)
    p, lse = _probabilities(q, k, scale, causal, q_start, k_start, window, cu_seqlens)
    return np.einsum("bhqk,bkhd->bqhd", p, v, optimize=True), lse


def attention_backward_reference(do, q, k, v, causal=False, scale=None, q_start=0, k_start=0, window=None,
                                 cu_seqlens=None):
    """(dq, dk, dv) in float64 for the loss sum(do * o)."""
    q, k, v, group, scale = _inputs(q, k, v, scale)
    do = np.asarray(do).astype(np.float64)
    p, _ = _probabilities(q, k, scale, causal, q_start, k_start, window, cu_seqlens)
    dv = np.einsum("bhqk,bqhd->bkhd", p, do, optimize=True)
    dp = np.einsum("bqhd,bkhd->bhqk", do, v, optimize=True)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    dq = np.einsum("bhqk,bkhd->bqhd", ds, k, optimize=True) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q, optimize=True) * scale
    return dq, _sum_groups(dk, group), _sum_groups(dv, group)
