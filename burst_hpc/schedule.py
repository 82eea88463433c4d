"""Which (query part, key part, mask) block pairs run when one shard meets another.

A shard is a list of pieces, (global_start, length) runs in local order (layout.pieces).
Each query piece against each key piece is one of:
- hidden: every key comes after every query (causal) -> skipped, costs nothing;
- full: no key comes after any query (or not causal) -> no mask;
- diagonal: some keys are hidden -> masked inside the kernel on global positions.
Full pairs that sit next to each other in local memory are fused into one call, so a
zigzag step with no diagonal is a single kernel launch.
"""
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class BlockPair:
    q: slice        # local rows of the query-side shard
    k: slice        # local rows of the key-side shard
    q_start: int    # global position of the first query row
    k_start: int    # global position of the first key row
    causal: bool    # True only for pairs that need the mask (diagonal, or masks.Mask's 'masked')


def _classify(q_start, q_len, k_start, k_len, causal):
    if not causal or k_start + k_len - 1 <= q_start:
        return "full"
    if k_start > q_start + q_len - 1:
        return "hidden"
    return "diagonal"


def _fuse(a, b):
    """a and b fused into one pair when both are unmasked and adjacent along one side."""
    if a.causal or b.causal:
        return None
    if a.q == b.q and a.k.stop == b.k.start:
        return BlockPair(a.q, slice(a.k.start, b.k.stop), a.q_start, a.k_start, False)
    if a.k == b.k and a.q.stop == b.q.start:
        return BlockPair(slice(a.q.start, b.q.stop), a.k, a.q_start, a.k_start, False)
    return None


@lru_cache(maxsize=1024)
def block_pairs(q_pieces, k_pieces, causal, mask=None):
    """The block pairs to run for a query shard against a key shard (pieces as tuples).
    ``mask``: a masks.Mask (documents, window) classifies the pairs instead of plain causal."""
    pairs = []
    q_off = 0
    for q_start, q_len in q_pieces:
        k_off = 0
        for k_start, k_len in k_pieces:
            if mask is not None:
                kind = mask.classify(q_start, q_len, k_start, k_len)
            else:
                kind = _classify(q_start, q_len, k_start, k_len, causal)
            if kind != "hidden":
                pairs.append(BlockPair(slice(q_off, q_off + q_len), slice(k_off, k_off + k_len),
                                       q_start, k_start, kind != "full"))
            k_off += k_len
        q_off += q_len
    fused = True
    while fused:
        fused = False
        for i in range(len(pairs)):
            for j in range(len(pairs)):
                if i != j and (merged := _fuse(pairs[i], pairs[j])) is not None:
                    pairs = [p for n, p in enumerate(pairs) if n not in (i, j)] + [merged]
                    fused = True
                    break
            if fused:
                break
    return tuple(sorted(pairs, key=lambda p: (p.q.start, p.k.start)))
