"""Which global tokens each rank owns.

- contiguous: S is cut into P equal chunks; rank r owns chunk r.
- zigzag: S is cut into 2P equal chunks; rank r owns chunks r and 2P-1-r (in that order),
  which balances causal work across ranks. One rank owns the whole sequence in one run (any S).
- balanced: the tokens of contiguous (natural order, one run per rank); the visible work
  (causal, documents, windows) is balanced by the schedule instead (balance.py).
- chunks: S is cut into chunks dealt to ranks by the mask so each rank's visible work is
  balanced, documents kept on one rank where that costs no balance (placement.py); a rank's
  chunks in natural order. Its pieces depend on the mask: every function here takes it.

A rank's shard is described by its pieces: (global_start, length) runs, in local order.
"""
import numpy as np

from ..device import array_module
from ..errors import LayoutError

LAYOUTS = ("contiguous", "zigzag", "balanced", "chunks")
CONTIGUOUS_OWNERSHIP = ("contiguous", "balanced")


def default_layout(causal):
    return "zigzag" if causal else "contiguous"


def check_layout(layout):
    if layout not in LAYOUTS:
        raise LayoutError(f"unknown layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    return layout


def _parts(size, layout):
    """The equal chunks ``layout`` cuts a sequence into over ``size`` ranks (one rank owns all: no split)."""
    return size if layout in CONTIGUOUS_OWNERSHIP + ("chunks",) or size == 1 else 2 * size


def check_split(seqlen, size, layout):
    """Tokens per rank; LayoutError unless ``seqlen`` tokens split evenly over ``size`` ranks in
    ``layout``, saying which layouts the length fits and what to pad it to."""
    check_layout(layout)
    if size < 1:
        raise LayoutError(f"need at least one rank; got {size}")
    parts = _parts(size, layout)
    if seqlen % parts:
        def padded(multiple):
            return -(-seqlen // multiple) * multiple

        zigzag, contiguous = _parts(size, "zigzag"), _parts(size, "contiguous")
        if layout == "zigzag":
            what = (f"it must be a multiple of {zigzag} (two chunks a rank); the balanced and contiguous layouts "
                    f"need only a multiple of {contiguous}")
            if seqlen % contiguous == 0:
                what += f", which it is: use one of them, or pad the sequence to {padded(zigzag)}"
            elif padded(zigzag) == padded(contiguous):
                what += f": pad the sequence to {padded(zigzag)}, which splits with every layout"
            else:
                what += f": pad the sequence to {padded(contiguous)} with one of them, or to {padded(zigzag)}"
        else:
            what = f"it must be a multiple of {contiguous} (zigzag: of {zigzag}); pad the sequence to {padded(contiguous)}"
            what += (", which splits with every layout" if padded(zigzag) == padded(contiguous) else
                     f", or to {padded(zigzag)} for zigzag too")
        raise LayoutError(f"sequence length {seqlen} does not split over {size} ranks with the {layout} layout: {what}")
    return seqlen // size


def pieces(seqlen, rank, size, layout, mask=None):
    """The (global_start, length) runs rank ``rank`` owns, in local order. ``mask``: the masks.Mask
    that places the chunks layout's tokens (plain causal or full attention too: ``placement_mask``);
    the other layouts ignore it."""
    local = check_split(seqlen, size, layout)
    if not 0 <= rank < size:
        raise LayoutError(f"rank {rank} is outside 0..{size - 1}")
    if layout == "chunks" and size > 1:
        if mask is None or mask.seqlen != seqlen:
            raise LayoutError("the chunks layout places tokens by the mask: pass the call's causal, cu_seqlens "
                              "and window (the same as burst_attention's)")
        from .placement import place

        return list(place(mask, size).pieces(rank))
    if layout in CONTIGUOUS_OWNERSHIP or size == 1:
        return [(rank * local, local)]
    chunk = local // 2
    return [(rank * chunk, chunk), ((2 * size - 1 - rank) * chunk, chunk)]


def placement_mask(seqlen, causal=False, cu_seqlens=None, window=None):
    """The masks.Mask the chunks layout places tokens by: the call's mask (MaskError if bad), plain
    causal and full attention included."""
    from . import masks

    return masks.counting(seqlen, causal, masks.make(seqlen, causal, window, cu_seqlens))


def _mask_for(layout, seqlen, causal, cu_seqlens, window):
    """The placement mask when ``layout`` needs one (chunks), else None."""
    return placement_mask(seqlen, causal, cu_seqlens, window) if layout == "chunks" else None


def layout_indices(seqlen, rank, size, layout, *, causal=False, cu_seqlens=None, window=None):
    """Global token indices of rank ``rank``'s shard, in local order.

    Parameters
    ----------
    seqlen : int
        Tokens in the whole sequence.
    rank, size : int
        This rank and the number of ranks.
    layout : {'contiguous', 'zigzag', 'balanced', 'chunks'}
    causal, cu_seqlens, window
        The call's mask, as burst_attention takes it: the chunks layout places tokens by it (the
        other layouts do not read it).

    Returns
    -------
    int64 array of S/P indices (positions for rotary embeddings, labels, ...).

    Raises
    ------
    LayoutError
        ``seqlen`` does not split over ``size`` ranks in ``layout``.
    """
    mask = _mask_for(layout, seqlen, causal, cu_seqlens, window)
    return np.concatenate([np.arange(start, start + n) for start, n in pieces(seqlen, rank, size, layout, mask)])


def shard(x, rank, size, layout, axis=1, *, causal=False, cu_seqlens=None, window=None):
    """Rank ``rank``'s shard of the global array ``x``.

    Parameters
    ----------
    x : array (NumPy or CuPy)
        The whole sequence along ``axis`` (1 for q, k, v; 2 for lse).
    rank, size : int
    layout : {'contiguous', 'zigzag', 'balanced', 'chunks'}
    axis : int
    causal, cu_seqlens, window
        The call's mask (the chunks layout places tokens by it).

    Returns
    -------
    array of the same kind: this rank's tokens in local order (a copy).

    Raises
    ------
    LayoutError
        The length does not split over ``size`` ranks in ``layout``.

    Examples
    --------
    >>> mine = burst_hpc.shard(q, comm.rank, comm.size, "zigzag")
    """
    axis = _normalize_axis(axis, x.ndim)
    seqlen = x.shape[axis]
    runs = pieces(seqlen, rank, size, layout, _mask_for(layout, seqlen, causal, cu_seqlens, window))
    parts = [x[(slice(None),) * axis + (slice(start, start + n),)] for start, n in runs]
    if len(parts) == 1:
        return parts[0].copy()
    xp = array_module(x)
    return xp.concatenate(parts, axis=axis)


def unshard(shards, layout, axis=1, *, causal=False, cu_seqlens=None, window=None):
    """The global array from every rank's shard: the inverse of ``shard``.

    Parameters
    ----------
    shards : sequence of arrays
        ``shards[r]`` from rank r (e.g. ``comm.gather(o)`` on rank 0).
    layout : {'contiguous', 'zigzag', 'balanced', 'chunks'}
    axis : int
    causal, cu_seqlens, window
        The call's mask (the chunks layout places tokens by it).

    Returns
    -------
    array of the same kind, the tokens in natural order.

    Raises
    ------
    LayoutError
        No shards, or shards that do not fit ``layout``.
    """
    shards = list(shards)
    size = len(shards)
    if size == 0:
        raise LayoutError("unshard needs the shard of at least one rank; got none")
    axis = _normalize_axis(axis, shards[0].ndim)
    local = shards[0].shape[axis]
    seqlen = local * size
    check_split(seqlen, size, layout)
    mask = _mask_for(layout, seqlen, causal, cu_seqlens, window)
    xp = array_module(shards[0])
    out = xp.empty(shards[0].shape[:axis] + (seqlen,) + shards[0].shape[axis + 1:], shards[0].dtype)
    for rank, part in enumerate(shards):
        if part.shape != shards[0].shape:
            raise LayoutError(f"shard {rank} has shape {part.shape}; shard 0 has {shards[0].shape} "
                              f"(every rank's shard must have the same shape)")
        offset = 0
        for start, n in pieces(seqlen, rank, size, layout, mask):
            index = (slice(None),) * axis
            out[index + (slice(start, start + n),)] = part[index + (slice(offset, offset + n),)]
            offset += n
    return out


def relayout(x, source, target, transport, axis=1):
    """Collective: this rank's shard in layout ``target`` of the global array whose shard in
    layout ``source`` is ``x`` (for example contiguous data into zigzag shards and back). One
    exchange over ``transport`` (transport.make_transport) with every rank that holds tokens
    this rank needs, so an all-to-all at most; the tokens both layouts give this rank stay."""
    axis = _normalize_axis(axis, x.ndim)
    rank, size, xp = transport.rank, transport.size, transport.xp
    seqlen = x.shape[axis] * size
    check_split(seqlen, size, source)
    check_split(seqlen, size, target)

    def rows(array, offset, n):
        return array[(slice(None),) * axis + (slice(offset, offset + n),)]

    def runs(src, dst):  # (local offset at src, local offset at dst, length) of the tokens src sends dst
        return _overlaps(pieces(seqlen, src, size, source), pieces(seqlen, dst, size, target))

    out = xp.empty_like(x)
    sends, recvs, arrivals = [], [], []
    for peer in range(size):
        for src_off, dst_off, n in runs(rank, peer):
            if peer == rank:
                rows(out, dst_off, n)[...] = rows(x, src_off, n)
            else:
                sends.append((peer, [xp.ascontiguousarray(rows(x, src_off, n))]))
        for src_off, dst_off, n in (runs(peer, rank) if peer != rank else ()):
            shape = x.shape[:axis] + (n,) + x.shape[axis + 1:]
            arrivals.append((dst_off, n, xp.empty(shape, x.dtype)))
            recvs.append((peer, [arrivals[-1][2]]))
    if sends or recvs:
        transport.exchange(sends, recvs).wait()
    for dst_off, n, part in arrivals:
        rows(out, dst_off, n)[...] = part
    return out


def _overlaps(a_pieces, b_pieces):
    """(offset in a's local order, offset in b's local order, length) of each run a and b share,
    in global token order."""
    shared = []
    a_off = 0
    for a0, an in a_pieces:
        b_off = 0
        for b0, bn in b_pieces:
            lo, hi = max(a0, b0), min(a0 + an, b0 + bn)
            if lo < hi:
                shared.append((lo, a_off + lo - a0, b_off + lo - b0, hi - lo))
            b_off += bn
        a_off += an
    return [run[1:] for run in sorted(shared)]


def _normalize_axis(axis, ndim):
    """``axis`` in 0..ndim-1 (negative counts from the end, as in NumPy)."""
    if not -ndim <= axis < ndim:
        raise LayoutError(f"axis {axis} is out of range for an array of rank {ndim}")
    return axis % ndim
