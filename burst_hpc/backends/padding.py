"""Head dims without a native kernel: zero-padded to the next native width (DESIGN.md, layer 5).

Exact: the padded columns of q and k are zero, so every q.k is unchanged; those of v (and do) are
zero, so the padded columns of o (and of dq, dk, dv) come out zero and are dropped. The scale is the
caller's, computed from the true D. The accumulators (o; dq, dk, dv) go through padded scratch: the
running values are copied in, the native kernel merges or adds into them, the first D columns are
copied back. lse and delta are per row and need no padding.

Head dims above the widest native kernel cannot be padded down: the q.k product cannot be split over
the head dim with kernels that take whole rows (the softmax needs the full dot product first). The
CUDA backend runs those on its tiled matmul path instead; once it lists a wider native kernel, this
module pads to it.
"""
from ..errors import BackendError


def native_width(head_dim, widths):
    """The smallest native width >= head_dim, or BackendError."""
    fits = [w for w in sorted(widths) if w >= head_dim]
    if not fits:
        raise BackendError(f"the cuda backend runs head_dim up to {max(widths)} (native {tuple(sorted(widths))}, "
                           f"smaller ones zero-padded); got head_dim {head_dim}, which has no kernel yet: "
                           "use the numpy backend for it")
    return fits[0]


def pad(xp, x, width):
    """x (..., D) zero-padded to (..., width), contiguous, in x's dtype."""
    out = xp.zeros(x.shape[:-1] + (width,), x.dtype)
    out[..., :x.shape[-1]] = x
    return out


def _width(arrays, widths):
    head_dim = arrays[0].shape[-1]
    if any(x.shape[-1] != head_dim for x in arrays):
        raise BackendError(f"q, k, v and the accumulators must share one head_dim; got {[x.shape for x in arrays]}")
    return native_width(head_dim, widths)


def forward_block(backend, widths, q, k, v, o, lse, **kwargs):
    """``backend.forward_block`` for a head dim outside ``widths`` (same arguments)."""
    width = _width((q, k, v, o), widths)
    xp = backend.xp
    o_padded = pad(xp, o, width)
    backend.forward_block(pad(xp, q, width), pad(xp, k, width), pad(xp, v, width), o_padded, lse, **kwargs)
    o[...] = o_padded[..., :o.shape[-1]]


def backward_block(backend, widths, q, k, v, do, lse, delta, dq, dk, dv, **kwargs):
    """``backend.backward_block`` for a head dim outside ``widths`` (same arguments)."""
    width = _width((q, k, v, do, dq, dk, dv), widths)
    xp = backend.xp
    grads = [pad(xp, g, width) for g in (dq, dk, dv)]
    backend.backward_block(*(pad(xp, x, width) for x in (q, k, v, do)), lse, delta, *grads, **kwargs)
    for g, g_padded in zip((dq, dk, dv), grads):
        g[...] = g_padded[..., :g.shape[-1]]


class Padded:
    """The block calls of ``backend`` for head dims outside its native ``widths``, zero-padded to them."""

    def __init__(self, backend, widths):
        self.backend, self.widths = backend, widths

    def forward_block(self, q, k, v, o, lse, **kwargs):
        forward_block(self.backend, self.widths, q, k, v, o, lse, **kwargs)

    def backward_block(self, q, k, v, do, lse, delta, dq, dk, dv, **kwargs):
        backward_block(self.backend, self.widths, q, k, v, do, lse, delta, dq, dk, dv, **kwargs)
