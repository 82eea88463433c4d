"""Shared by tests/test_packing.py (NumPy backend) and tests/test_cuda_masks.py (CUDA): the block contract's
flags across two calls on the same query rows, keys split in two sets (each row's visible keys are one interval
of each, as of any subset of keys in order: masks.Packed). The first call is `first` without `out`, the second
merges and writes `out`: o and lse must be those of one call over every key."""
import hashlib

import numpy as np

from burst_hpc.plan import masks


def split_forward(be, xp, q, k, v, mask, in_first):
    """(out, lse) of the two calls; ``in_first``: bool per key, the keys of the first call."""
    lo, hi = mask.intervals
    parts = []
    for keep in (in_first, ~in_first):
        at = np.flatnonzero(keep)
        bounds = np.searchsorted(at, lo), np.searchsorted(at, hi)
        digest = hashlib.sha256(b"".join(x.tobytes() for x in bounds)).hexdigest()   # the caches' key
        part = masks.Packed(*bounds, len(at), ("split", digest))
        parts.append((xp.asarray(np.ascontiguousarray(k[:, at])), xp.asarray(np.ascontiguousarray(v[:, at])), part))
    q = xp.asarray(q)
    o = xp.empty(q.shape, xp.float32)
    lse = xp.empty((q.shape[0], q.shape[2], q.shape[1]), xp.float32)
    out = xp.empty(q.shape, q.dtype)
    scale = q.shape[-1] ** -0.5
    (ka, va, ma), (kb, vb, mb) = parts
    be.forward_block(q, ka, va, o, lse, scale=scale, masked=True, mask=ma, q_start=0, k_start=0, first=True)
    be.forward_block(q, kb, vb, o, lse, scale=scale, masked=True, mask=mb, q_start=0, k_start=0, out=out)
    return out, lse


def case(rng, seqlen, documents, dtype):
    """q, k, v (B=1, Hq=4, Hkv=2, D=128) of ``dtype``, the causal mask with ``documents`` random documents (None:
    plain causal, as intervals) and the first call's keys: runs of 100 keys every other run."""
    q, k, v = (rng.standard_normal((1, seqlen, h, 128)).astype(dtype) for h in (4, 2, 2))
    cu = masks.random_documents(rng, seqlen, documents) if documents else np.array([0, seqlen])
    return q, k, v, masks.make(seqlen, True, None, cu), (np.arange(seqlen) // 100) % 2 == 0
