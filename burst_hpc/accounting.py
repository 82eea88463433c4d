"""Bytes and FLOPs: the one account of what a pass moves and computes, read by the call's plan, the
cost model, the CLI's summary and the bench scripts (DESIGN.md, "Communication volume per step")."""

BACKWARD_FLOPS = 2.5   # backward FLOPs per forward FLOP (5 matrix products against 2)


def backward_ring_bytes(heads, kv_heads, head_dim, itemsize):
    """Bytes per token moved each step by the (q-ring, kv-ring) backward: Q, dO, dQ (+ lse and delta,
    float32 per head) against K, V, dK, dV (the gradients travel as float32)."""
    q_ring = heads * head_dim * (2 * itemsize + 4) + 8 * heads
    kv_ring = kv_heads * head_dim * (2 * itemsize + 2 * 4)
    return q_ring, kv_ring


def attention_flops(batch, seqlen, heads, head_dim, causal, mask=None, backward=False):
    """FLOPs of a pass by the FlashAttention convention: 4 B S^2 Hq D forward (two matmuls), half of
    it when causal; with documents or a window (``mask``, a masks.Mask) those of the visible (query,
    key) pairs; the backward BACKWARD_FLOPS times the forward."""
    if mask is not None:
        lo, hi = mask.intervals
        flops = 4.0 * batch * heads * head_dim * float((hi - lo).sum())
    else:
        flops = 4.0 * batch * seqlen * seqlen * heads * head_dim * (0.5 if causal else 1.0)
    return flops * BACKWARD_FLOPS if backward else flops
