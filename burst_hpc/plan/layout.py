"""Which global tokens each rank holds: the layout, an immutable value.

- contiguous: S is cut into P equal chunks; rank r holds chunk r.
- zigzag: S is cut into 2P equal chunks; rank r holds chunks r and 2P-1-r (in that order),
  which balances causal work across ranks. One rank holds the whole sequence in one run (any S).
- balanced: the tokens of contiguous (natural order, one run per rank); the visible work
  (causal, documents, windows) is balanced by the schedule instead (balance.py).
- chunks: S is cut into chunks dealt to ranks by the mask so each rank's visible work is
  balanced, documents kept on one rank where that costs no balance (placement.py); a rank's
  chunks in natural order. It needs the call's mask (make_layout's ``mask``; ``shard``,
  ``unshard`` and ``layout_indices`` take it as causal, cu_seqlens, window). Across nodes it
  can be placed by them (make_layout's ``ranks_per_node``: documents kept on one node first),
  as ``choose_layout`` and ``layout='auto'`` place it; the name alone places it over one node.

A rank's shard is described by its pieces: (global_start, length) runs, in local order. Names turn
into a :class:`Layout` once, at the edge (:func:`make_layout`, :func:`as_layout`); every layer below
asks the object.
"""
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from ..device import array_module
from ..errors import LayoutError

LAYOUTS = ("contiguous", "zigzag", "balanced", "chunks")


@dataclass(frozen=True, eq=False, repr=False)
class Layout:
    """Which global tokens each of ``size`` ranks holds of a sequence of ``seqlen`` tokens.

    Immutable and hashable; equal when ``kind``, ``seqlen``, ``size``, every rank's pieces and the
    chunk (the chunks layout's) are.
    Made by :func:`make_layout`. Every rank holds ``local`` tokens.

    Attributes
    ----------
    kind : str
        'contiguous', 'zigzag', 'balanced' or 'chunks'.
    seqlen, size, local : int
        Tokens in the sequence, ranks, and tokens a rank.
    balances_by_schedule : bool
        Whether the visible work of a masked call is balanced by the schedule (the balanced layout's
        helpers, balance.py) rather than by the placement of tokens.
    placed_by_mask : bool
        Whether the tokens were placed by the mask (the chunks layout): a rank's chunks lie anywhere
        in the sequence, so ``scheme='auto'`` moves them by 'gather' (costmodel.auto_schemes).
    grain : int
        Tokens every run is made of: the chunks layout's chunk, else the largest length that
        divides every run and start (what the gather schedule sends whole).
    nodes : tuple or None
        The chunks layout placed by nodes: the node of each rank (None: placed over one node).
    per_node : int or None
        Ranks a node of ``nodes``.
    receive : int
        The chunks layout's weight of a key row a rank receives (make_layout's ``receive``) where it
        moved chunks from the area's balance; 0 otherwise. Not part of equality: the runs are.
    """
    kind: str
    seqlen: int
    size: int
    runs: tuple = field(repr=False)   # runs[rank]: that rank's pieces
    balances_by_schedule: bool = False
    chunk: int = None                 # the chunks layout's chunk (None: grain is the runs' gcd)
    nodes: tuple = None               # the chunks layout's node of each rank (None: placed over one node)
    receive: int = 0                  # the chunks layout's weight of a received key row where it moved chunks

    def __post_init__(self):
        # the chunk and the nodes too: the gather schedule sends runs whole in chunks (grain) and orders its
        # visits by node, so two placements with the same runs but other chunks or nodes run other schedules
        object.__setattr__(self, "key", (self.kind, self.seqlen, self.size, self.runs, self.chunk, self.nodes))
        object.__setattr__(self, "hashed", hash(self.key))

    def __eq__(self, other):
        return isinstance(other, Layout) and self.key == other.key

    def __hash__(self):
        return self.hashed

    def __repr__(self):
        nodes = "" if self.per_node is None else f", by nodes of {self.per_node}"
        return f"Layout({self.kind!r}, seqlen={self.seqlen}, size={self.size}{nodes})"

    def __reduce__(self):   # rebuilt where unpickled: a string's hash differs from process to process
        return Layout, (self.kind, self.seqlen, self.size, self.runs, self.balances_by_schedule, self.chunk,
                        self.nodes, self.receive)

    @property
    def local(self):
        return self.seqlen // self.size

    @property
    def per_node(self):
        return None if self.nodes is None else self.size // (max(self.nodes) + 1)

    @property
    def grain(self):
        if self.chunk is not None:
            return self.chunk
        return int(np.gcd.reduce([x for runs in self.runs for run in runs for x in run]))

    @property
    def placed_by_mask(self):
        return self.kind == "chunks"

    def is_default(self, causal):
        """Whether this is the layout a call names none gets (:func:`default_kind`)."""
        return self.kind == default_kind(causal)

    def pieces(self, rank):
        """The (global_start, length) runs rank ``rank`` holds, in local order."""
        if not 0 <= rank < self.size:
            raise LayoutError(f"rank {rank} is outside 0..{self.size - 1}")
        return self.runs[rank]

    def held_by(self, order):
        """This placement with position p's pieces held by rank ``order[p]`` (topology.Arrangement.order):
        a layout placed by nodes numbers its ranks node by node, the launcher may not."""
        if list(order) == list(range(self.size)):
            return self
        runs, nodes = [None] * self.size, [None] * self.size
        for position, rank in enumerate(order):
            runs[rank] = self.runs[position]
            nodes[rank] = None if self.nodes is None else self.nodes[position]
        return Layout(self.kind, self.seqlen, self.size, tuple(runs), self.balances_by_schedule, self.chunk,
                      None if self.nodes is None else tuple(nodes), self.receive)

    def indices(self, rank):
        """Global token indices of rank ``rank``'s shard, in local order (int64)."""
        return np.concatenate([np.arange(start, start + n, dtype=np.int64) for start, n in self.pieces(rank)])

    def slabs(self, rank):
        """The (start, stop) token ranges of a file rank ``rank`` reads and writes, in local order
        (runs that follow each other in the file are one slab)."""
        out = []
        for start, n in self.pieces(rank):
            if out and out[-1][1] == start:
                out[-1] = (out[-1][0], start + n)
            else:
                out.append((start, start + n))
        return tuple(out)

    def shard(self, x, rank, axis=1):
        """Rank ``rank``'s shard of the global array ``x`` (NumPy or CuPy; a copy of the same kind),
        its tokens along ``axis`` in local order."""
        axis = normalize_axis(axis, x.ndim)
        if x.shape[axis] != self.seqlen:
            raise LayoutError(f"the array holds {x.shape[axis]} tokens along axis {axis}; the layout is of "
                              f"{self.seqlen}")
        parts = [x[(slice(None),) * axis + (slice(start, stop),)] for start, stop in self.slabs(rank)]
        if len(parts) == 1:
            return parts[0].copy()
        return array_module(x).concatenate(parts, axis=axis)

    def unshard(self, shards, axis=1):
        """The global array from every rank's shard (``shards[r]`` from rank r): the inverse of
        :meth:`shard`, of the shards' kind."""
        shards = list(shards)
        if len(shards) != self.size:
            raise LayoutError(f"unshard needs the shard of each of the layout's {self.size} ranks; got {len(shards)}")
        first = shards[0]
        axis = normalize_axis(axis, first.ndim)
        for rank, part in enumerate(shards):
            if part.shape != first.shape:
                raise LayoutError(f"shard {rank} has shape {part.shape}; shard 0 has {first.shape} "
                                  f"(every rank's shard must have the same shape)")
        if first.shape[axis] != self.local:
            raise LayoutError(f"a shard holds {first.shape[axis]} tokens along axis {axis}; the layout gives each "
                              f"rank {self.local}")
        out = array_module(first).empty(first.shape[:axis] + (self.seqlen,) + first.shape[axis + 1:], first.dtype)
        index = (slice(None),) * axis
        for rank, part in enumerate(shards):
            offset = 0
            for start, stop in self.slabs(rank):
                out[index + (slice(start, stop),)] = part[index + (slice(offset, offset + stop - start),)]
                offset += stop - start
        return out


def default_kind(causal):
    """The layout a call that names none uses: zigzag when causal, contiguous otherwise (never the
    data's: ``costmodel.choose_layout`` names the one predicted fastest)."""
    return "zigzag" if causal else "contiguous"


def check_kind(kind):
    if kind not in LAYOUTS:
        raise LayoutError(f"unknown layout {kind!r}; use one of {', '.join(LAYOUTS)}")
    return kind


def _parts(size, kind):
    """The equal chunks ``kind`` cuts a sequence into over ``size`` ranks (one rank holds all: no split)."""
    return 2 * size if kind == "zigzag" and size > 1 else size


def _split_error(seqlen, size, kind):
    """The LayoutError of a length that does not split, saying which layouts it fits and what to pad it to."""
    def padded(multiple):
        return -(-seqlen // multiple) * multiple

    zigzag, contiguous = _parts(size, "zigzag"), _parts(size, "contiguous")
    if kind == "zigzag":
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
    return LayoutError(f"sequence length {seqlen} does not split over {size} ranks with the {kind} layout: {what}")


def make_layout(kind, seqlen, size, mask=None, ranks_per_node=None, chunk=None, receive=0):
    """The Layout of ``kind`` for ``seqlen`` tokens over ``size`` ranks.

    Parameters
    ----------
    kind : {'contiguous', 'zigzag', 'balanced'}
    seqlen, size : int
        Tokens in the whole sequence and ranks.
    mask : masks.Mask, optional
        The call's mask, plain causal and full attention included (``masks.make``): the chunks
        layout places tokens by it (the other kinds place them without it).
    ranks_per_node : int, optional
        The chunks layout across nodes of this many ranks (ranks node by node): placed on the nodes
        first, each node's share then on its ranks (None, or every rank on one node: over one node).
    chunk : int, optional
        The chunks layout's chunk, dividing a rank's tokens (None: placement.place chooses it).
    receive : int, optional
        The chunks layout's weight of a key row a rank receives, in visible pairs (placement.py; 0: each
        rank's visible area balanced alone). choose_layout prices it from the call's shapes and links
        (costmodel.receive_weight).

    Returns
    -------
    Layout

    Raises
    ------
    LayoutError
        An unknown kind, no ranks, a length that does not split over ``size`` ranks in ``kind``
        (saying which layouts it fits and what to pad it to), or nodes that do not split the ranks.
    """
    check_kind(kind)
    seqlen, size = int(seqlen), int(size)
    if size < 1:
        raise LayoutError(f"need at least one rank; got {size}")
    per_node = None
    if kind == "chunks" and ranks_per_node is not None:
        per_node = int(ranks_per_node)
        if per_node < 1 or size % per_node:
            raise LayoutError(f"{size} ranks do not fill nodes of {ranks_per_node}")
        per_node = per_node if per_node < size else None
    if kind == "chunks" and chunk is not None and (chunk < 1 or seqlen % size or (seqlen // size) % chunk):
        raise LayoutError(f"chunks of {chunk} tokens do not split a rank's {seqlen / size:g} tokens")
    if isinstance(receive, bool) or not isinstance(receive, (int, np.integer)) or receive < 0:
        raise LayoutError(f"receive is the visible pairs a received key row weighs, a whole number of 0 or more; "
                          f"got {receive!r}")
    placed = kind == "chunks" and size > 1
    return _layout(kind, seqlen, size, mask if placed else None, per_node, chunk if placed else None,
                   int(receive) if placed else 0)


@lru_cache(maxsize=32)
def _layout(kind, seqlen, size, mask, per_node=None, chunk=None, receive=0):
    """:func:`make_layout`'s Layout, kept: a call that names its layout makes it again on every call, and
    the chunks layout places the tokens by the mask (placement.place) once."""
    parts = _parts(size, kind)
    if seqlen % parts:
        raise _split_error(seqlen, size, kind)
    if kind == "chunks" and size > 1:
        return _chunks(seqlen, size, mask, per_node, chunk, receive)
    chunk = seqlen // parts
    if parts == size:
        runs = tuple(((r * chunk, chunk),) for r in range(size))
    else:
        runs = tuple(((r * chunk, chunk), ((2 * size - 1 - r) * chunk, chunk)) for r in range(size))
    return Layout(kind, seqlen, size, runs, balances_by_schedule=kind == "balanced")


def _chunks(seqlen, size, mask, per_node, chunk, receive):
    """The chunks layout of ``mask`` (placement.place, or place_chunks of ``chunk``), keys received weighing
    ``receive``."""
    if mask is None or mask.seqlen != seqlen:
        raise LayoutError("the chunks layout places tokens by the mask: pass the call's causal, cu_seqlens and "
                          "window with it (as burst_attention takes them, None where the call has none), or shard "
                          "by the Layout burst_hpc.choose_layout or make_layout returns")
    from .placement import place, place_chunks

    found = (place(mask, size, per_node, receive) if chunk is None
             else place_chunks(mask, size, chunk, per_node, receive))
    return Layout("chunks", seqlen, size, tuple(found.pieces(r) for r in range(size)), chunk=found.chunk,
                  nodes=None if per_node is None else tuple(r // per_node for r in range(size)), receive=found.receive)


class _Unsaid:
    def __repr__(self):
        return "unsaid"


UNSAID = _Unsaid()   # a mask argument the caller did not pass (None is a value: no documents, no window)


def _said_mask(seqlen, causal, cu_seqlens, window):
    """The masks.Mask of a call's causal, cu_seqlens and window (as burst_attention takes them), or None
    unless all three are said (None where the call has none): the chunks layout is placed by the whole
    mask only, since shards placed by another mask than the call's would be wrong, silently."""
    if causal is None or cu_seqlens is UNSAID or window is UNSAID:
        return None
    from . import masks

    return masks.make(seqlen, causal, window, cu_seqlens)


def layouts_for(seqlen, size, mask=None, kinds=LAYOUTS, ranks_per_node=None, receive=0):
    """{kind: its Layout, or why the length does not split in it (the LayoutError's text)} for each
    of ``kinds``: the layouts a planner can choose among (chunks placed by nodes of ``ranks_per_node``,
    keys received weighing ``receive``)."""
    out = {}
    for kind in kinds:
        try:
            out[kind] = make_layout(kind, seqlen, size, mask, ranks_per_node, receive=receive)
        except LayoutError as e:
            out[kind] = str(e)
    return out


def as_layout(layout, seqlen, size, mask=None, *, causal=None, cu_seqlens=UNSAID, window=UNSAID):
    """``layout`` (a Layout or a kind's name) as the Layout of ``seqlen`` tokens over ``size`` ranks:
    a name made into one here, a Layout checked to be of these sizes (:func:`check_layout`). The name
    'chunks' is placed by ``mask`` (a masks.Mask), else by the mask of ``causal``, ``cu_seqlens`` and
    ``window`` when all three are said (None where the call has none); the other layouts read neither."""
    if isinstance(layout, str):
        if mask is None and layout == "chunks":
            mask = _said_mask(seqlen, causal, cu_seqlens, window)
        return make_layout(layout, seqlen, size, mask)
    if not isinstance(layout, Layout):
        raise LayoutError(f"layout must be a Layout or one of {', '.join(LAYOUTS)}; got {layout!r}")
    return check_layout(layout, seqlen, size)


def check_layout(layout, seqlen, size):
    """``layout`` when it is a Layout of ``seqlen`` tokens over ``size`` ranks, else a LayoutError:
    what the layers below the edge take (a name is made into a Layout there, :func:`as_layout`)."""
    if not isinstance(layout, Layout):
        raise LayoutError(f"layout must be a Layout (make_layout makes one of a name); got {layout!r}")
    if (layout.seqlen, layout.size) != (seqlen, size):
        raise LayoutError(f"{layout!r} is of {layout.seqlen} tokens over {layout.size} ranks; the call's sequence "
                          f"is {seqlen} tokens over {size} ranks")
    return layout


def layout_indices(seqlen, rank, size, layout, *, causal=None, cu_seqlens=UNSAID, window=UNSAID):
    """Global token indices of rank ``rank``'s shard, in local order.

    Parameters
    ----------
    seqlen : int
        Tokens in the whole sequence.
    rank, size : int
        This rank and the number of ranks.
    layout : Layout or {'contiguous', 'zigzag', 'balanced', 'chunks'}
    causal, cu_seqlens, window
        The call's mask, as burst_attention takes it: a name 'chunks' is placed by it (and needs
        all three said, None where the call has none); the other layouts do not read it.

    Returns
    -------
    int64 array of S/P indices (positions for rotary embeddings, labels, ...).

    Raises
    ------
    LayoutError
        ``seqlen`` does not split over ``size`` ranks in ``layout``.
    """
    return as_layout(layout, seqlen, size, causal=causal, cu_seqlens=cu_seqlens, window=window).indices(rank)


def shard(x, rank, size, layout, axis=1, *, causal=None, cu_seqlens=UNSAID, window=UNSAID):
    """Rank ``rank``'s shard of the global array ``x``.

    Parameters
    ----------
    x : array (NumPy or CuPy)
        The whole sequence along ``axis`` (1 for q, k, v; 2 for lse).
    rank, size : int
    layout : Layout or {'contiguous', 'zigzag', 'balanced', 'chunks'}
    axis : int
    causal, cu_seqlens, window
        The call's mask, as burst_attention takes it: a name 'chunks' is placed by it (and needs
        all three said, None where the call has none); the other layouts do not read it.

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
    axis = normalize_axis(axis, x.ndim)
    placed = as_layout(layout, x.shape[axis], size, causal=causal, cu_seqlens=cu_seqlens, window=window)
    return placed.shard(x, rank, axis)


def unshard(shards, layout, axis=1, *, causal=None, cu_seqlens=UNSAID, window=UNSAID):
    """The global array from every rank's shard: the inverse of ``shard``.

    Parameters
    ----------
    shards : sequence of arrays
        ``shards[r]`` from rank r (e.g. ``comm.gather(o)`` on rank 0).
    layout, axis, causal, cu_seqlens, window
        As :func:`shard` takes them.

    Returns
    -------
    array of the same kind, the tokens in natural order.

    Raises
    ------
    LayoutError
        No shards, or shards that do not fit ``layout``.
    """
    shards = list(shards)
    if not shards:
        raise LayoutError("unshard needs the shard of at least one rank; got none")
    axis = normalize_axis(axis, shards[0].ndim)
    seqlen = shards[0].shape[axis] * len(shards)
    placed = as_layout(layout, seqlen, len(shards), causal=causal, cu_seqlens=cu_seqlens, window=window)
    return placed.unshard(shards, axis)


def relayout(x, source, target, transport, axis=1):
    """Collective: this rank's shard in Layout ``target`` of the global array whose shard in Layout
    ``source`` is ``x`` (for example contiguous data into zigzag shards and back). One exchange over
    ``transport`` (transport.make_transport) with every rank that holds tokens this rank needs, so
    an all-to-all at most; the tokens both layouts give this rank stay."""
    axis = normalize_axis(axis, x.ndim)
    rank, size, xp = transport.rank, transport.size, transport.xp

    def rows(array, offset, n):
        return array[(slice(None),) * axis + (slice(offset, offset + n),)]

    def runs(src, dst):  # (local offset at src, local offset at dst, length) of the tokens src sends dst
        return _overlaps(source.pieces(src), target.pieces(dst))

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


def normalize_axis(axis, ndim):
    """``axis`` in 0..ndim-1 (negative counts from the end, as in NumPy)."""
    if not -ndim <= axis < ndim:
        raise LayoutError(f"axis {axis} is out of range for an array of rank {ndim}")
    return axis % ndim
