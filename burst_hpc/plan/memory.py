"""Peak memory per rank of a call (``peak_memory``): the inputs, the accumulators, the ring's
buffers as the engine holds them (ring.lifetimes) and the outputs; ``burst-hpc plan`` reports it."""
from .costmodel import token_bytes, ulysses_kv_heads
from .gather import held_bytes


def _schedule(scheme, cl, near, returns):
    """Position 0's schedule under ``scheme`` (every position holds as many buffers)."""
    from .schedule import double_ring_steps, plain_ring_steps

    if scheme == "double_ring":
        return double_ring_steps(0, cl.nodes, cl.per_node, near, returns)
    return plain_ring_steps(0, cl.nodes if scheme == "ulysses_ring" else cl.ranks, near, returns)


def _ring_memory(tokens, heads, kv_heads, d, it, backward, buffers):
    """Bytes one ring call allocates at its peak (inputs excluded): float32 accumulators (float64
    for float64 inputs) and delta (backward), plus the larger of the receive and partial buffers
    the schedule holds at once (``buffers``: {"data": n, "partial": n} of the side that travels)
    and the outputs in the input dtype (made after the ring has given its buffers back)."""
    acc = 8 if it == 8 else 4
    if not backward:
        results = heads * (d + 1) * acc                    # o, lse
        travelling = 2 * kv_heads * d * it                 # k, v
        return tokens * (results + max(buffers["data"] * travelling + buffers["partial"] * results,
                                       heads * (d * it + 4)))
    kv_res, q_res = 2 * kv_heads * d * acc, heads * d * acc                        # dk, dv; dq
    kv_data, q_data = 2 * kv_heads * d * it, heads * (2 * d * it + 4 + acc)        # k, v; q, do, lse, delta
    data, partial = (kv_data, kv_res) if buffers["side"] == "kv" else (q_data, q_res)
    return tokens * (kv_res + q_res + heads * acc + max(buffers["data"] * data + buffers["partial"] * partial,
                                                        (heads + 2 * kv_heads) * d * it))


def peak_memory(scheme, pr, cl, backward=False, layout=None):
    """Bytes per rank of the inputs and what one call allocates at its peak (the ring's buffers as
    the engine holds them, ring.lifetimes, plus accumulators and outputs). Ulysses adds the node's
    gathered inputs (held twice while they are joined) and runs its ring on w times the tokens
    for 1/w of the heads; the gather scheme in ``layout`` (a Layout) every run of keys and values a
    rank's queries see, at once, and their float32 gradients in the backward (gather.held_bytes).
    Kernel workspace (none on the GPU) is not counted."""
    from ..engine.ring import lifetimes

    it, d = pr.itemsize, pr.head_dim
    n = pr.batch * pr.seqlen // cl.ranks
    heads, kv_heads, tokens = pr.heads, pr.kv_heads, n
    inputs = n * (heads + 2 * kv_heads) * d * it * (2 if backward else 1) + (n * heads * 4 if backward else 0)
    extra = 0
    if scheme == "ulysses_ring":
        heads, kv_heads, tokens = pr.heads // cl.per_node, ulysses_kv_heads(pr, cl.per_node), n * cl.per_node
        extra = 2 * tokens * (heads + 2 * kv_heads) * d * it * (2 if backward else 1)
    if backward:
        data, partial = token_bytes(pr, True, heads, kv_heads)
        near = "kv" if data == 2 * kv_heads * d * it else "q"
        returns = ("kv", "q")
    else:
        near, returns = "kv", ("q",)
    if scheme == "gather" and layout is not None:
        extra = held_bytes(pr, layout, backward)
    buffers = dict(lifetimes(_schedule(scheme, cl, near, returns), 0)[2], side=near)
    return inputs + extra + _ring_memory(tokens, heads, kv_heads, d, it, backward, buffers)
