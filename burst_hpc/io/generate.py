"""Random inputs for ``burst-hpc gen``: standard-normal q, k, v (and do), written a block at a time."""
import numpy as np

from ..dtypes import dtype_name
from ..errors import ShapeError
from .format import create_dataset, stamp, write_slab
from .output import bytes_needed, write_new

GEN_BLOCK_TOKENS = 1024  # random numbers come in blocks of this many tokens (fixed: same data whatever chunking)


def generate(path, batch, seqlen, heads, kv_heads, head_dim, dtype, seed=0, with_grad=False,
             max_elements=1 << 22, attrs=None, progress=None, overwrite=False, documents=None):
    """Write random standard-normal q, k, v (and do) to ``path``, chunk by chunk (single process).
    ``documents``: also write ``cu_seqlens`` for that many documents of random lengths.

    A block of GEN_BLOCK_TOKENS tokens of one batch entry of one tensor draws from its own
    generator seeded by (seed, tensor, batch, block), so the data does not depend on how much is
    written at once, and no more than about ``max_elements`` values are in memory at a time.
    The file is built under a temporary name and renamed when complete; an existing file at
    ``path`` is refused unless ``overwrite``.
    """
    dtype = np.dtype(dtype)
    for label, n in (("batch", batch), ("seqlen", seqlen), ("heads", heads), ("kv-heads", kv_heads),
                     ("head-dim", head_dim)):
        if n < 1:
            raise ShapeError(f"--{label} must be positive; got {n}")
    if heads % kv_heads:
        raise ShapeError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    cu_seqlens = None
    if documents is not None:
        from ..plan.masks import random_documents

        cu_seqlens = random_documents(np.random.default_rng([int(seed), 1 << 20]), seqlen, documents)
    names = ("q", "k", "v", "do") if with_grad else ("q", "k", "v")
    shapes = {"q": (batch, seqlen, heads, head_dim), "k": (batch, seqlen, kv_heads, head_dim)}
    shapes["v"] = shapes["k"]
    shapes["do"] = shapes["q"]
    total = sum(batch * seqlen * shapes[n][2] * head_dim for n in names)
    written = 0

    def fill(f):
        nonlocal written
        stamp(f, {"kind": "inputs", "seed": int(seed), "batch": batch, "seqlen": seqlen, "heads": heads,
                  "kv_heads": kv_heads, "head_dim": head_dim, "dtype": dtype_name(dtype), **(attrs or {})})
        if cu_seqlens is not None:
            f.create_dataset("cu_seqlens", data=cu_seqlens)
        for t, name in enumerate(names):
            shape = shapes[name]
            ds = create_dataset(f, name, shape, dtype)
            row = shape[2] * head_dim
            blocks_per_write = max(1, max_elements // (GEN_BLOCK_TOKENS * row))
            step = blocks_per_write * GEN_BLOCK_TOKENS
            for b in range(batch):
                for s0 in range(0, seqlen, step):
                    s1 = min(seqlen, s0 + step)
                    buf = np.empty((1, s1 - s0, shape[2], head_dim), dtype)
                    for blk0 in range(s0, s1, GEN_BLOCK_TOKENS):
                        blk1 = min(s1, blk0 + GEN_BLOCK_TOKENS)
                        rng = np.random.default_rng([int(seed), t, b, blk0 // GEN_BLOCK_TOKENS])
                        values = rng.standard_normal((1, blk1 - blk0, shape[2], head_dim), np.float32)
                        buf[:, blk0 - s0:blk1 - s0] = values.astype(dtype)
                    write_slab(ds, (slice(b, b + 1), slice(s0, s1)), buf)
                    written += buf.size
                    if progress is not None:
                        progress(written, total)

    write_new(path, fill, overwrite, bytes_needed({0: ((total,), dtype)}))
    return names if cu_seqlens is None else names + ("cu_seqlens",)
