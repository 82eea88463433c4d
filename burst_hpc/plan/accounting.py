"""Bytes and FLOPs: the one account of what a pass moves and computes, read by the call's plan, the
cost model, the CLI's summary and the bench scripts (DESIGN.md, "Communication volume per step")."""

BACKWARD_FLOPS = 2.5   # backward FLOPs per forward FLOP (5 matrix products against 2)


def step_bytes(heads, kv_heads, head_dim, itemsize):
    """Bytes per token one ring step moves, as (data out, partial back), for each pass and side:
    'forward' K and V out, nothing back; backward 'q' (q-ring) Q, dO (+ lse and delta, float32 per
    head) out and float32 dQ back; backward 'kv' (kv-ring) K, V out and float32 dK, dV back."""
    d, it = head_dim, itemsize
    return {"forward": (2 * kv_heads * d * it, 0),
            "q": (heads * (2 * d * it + 8), heads * d * 4),
            "kv": (2 * kv_heads * d * it, 2 * kv_heads * d * 4)}


def backward_ring_bytes(heads, kv_heads, head_dim, itemsize):
    """Bytes per token moved each step by the (q-ring, kv-ring) backward, both directions."""
    sides = step_bytes(heads, kv_heads, head_dim, itemsize)
    return sum(sides["q"]), sum(sides["kv"])


def cheaper_backward_ring(heads, kv_heads, head_dim, itemsize, q_steps=1, kv_steps=1, size=1):
    """'q' or 'kv': the backward ring moving fewer bytes over its steps (with documents or a window
    a ring may stop early: ``q_steps``/``kv_steps`` of ``size``); a tie goes to the kv-ring."""
    q_bytes, kv_bytes = backward_ring_bytes(heads, kv_heads, head_dim, itemsize)
    if (q_steps, kv_steps) != (size, size):  # a shortened ring sends its carried accumulator home in one hop
        q_bytes, kv_bytes = q_bytes * q_steps, kv_bytes * kv_steps
    return "q" if q_bytes < kv_bytes else "kv"


def visible_pairs(mask):
    """The (query, key) pairs a pass computes under ``mask`` (a masks.Mask), by the FlashAttention
    convention for full and causal masks: S^2, half of it when causal; else those of the visible pairs."""
    if mask.kind == "intervals":
        lo, hi = mask.intervals
        return float((hi - lo).sum())
    return float(mask.seqlen) * mask.seqlen * (0.5 if mask.causal else 1.0)


def attention_flops(batch, heads, head_dim, pairs, backward=False):
    """FLOPs of a pass over ``pairs`` visible (query, key) pairs (visible_pairs): 4 B Hq D per pair
    forward (two matmuls), BACKWARD_FLOPS times that backward."""
    flops = 4.0 * batch * heads * head_dim * pairs
    return flops * BACKWARD_FLOPS if backward else flops


def transfer_bytes(heads, kv_heads, head_dim, itemsize, backward):
    """Bytes per token of each kind of transfer, {(what, side): bytes}: a shard's travelling data
    (forward: K, V or Q; backward: K, V or Q, dO, lse, delta) and a partial of its results
    (forward: float32 o and lse; backward: float32 dQ, or dK and dV), as the ring engine sends
    them on any schedule (step_bytes: the plain rings' pairs of these)."""
    d, it = head_dim, itemsize
    q_data = heads * (2 * d * it + 8) if backward else heads * d * it
    q_partial = heads * d * 4 if backward else heads * (d + 1) * 4
    return {("data", "kv"): 2 * kv_heads * d * it, ("data", "q"): q_data,
            ("partial", "q"): q_partial, ("partial", "kv"): 2 * kv_heads * d * 4}
