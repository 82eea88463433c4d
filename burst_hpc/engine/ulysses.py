"""The all-to-alls of scheme 'ulysses_ring' (DeepSpeed-Ulysses inside the node, USP's layout).

Inside a node of w ranks, each rank holds n tokens of every head. ``to_node`` gives local rank l
all w*n tokens of the node (in local order) for its heads: query heads range(l*Hq/w, (l+1)*Hq/w)
and the K/V heads those use (schemes.ulysses_heads), so GQA K/V are never expanded: each rank
receives only the K/V heads its query heads read, and a K/V head is sent to several ranks only
when Hkv < w (w/Hkv copies of it cross the node's links, the price of sharing). ``from_node``
is the way back: each rank's tokens of every head, results of a shared K/V head summed.
"""


def _rows(x, axis, r):
    return x[(slice(None),) * axis + (slice(r.start, r.stop),)]


def to_node(transport, ranges, local, arrays):
    """``arrays``: (x, which, token_axis, head_axis) with ``which`` 0 for query-head arrays, 1 for
    K/V-head ones. Returns each x as the node's tokens of this rank's heads."""
    xp = transport.xp
    w = len(ranges)
    sends, recvs, parts = [], [], []
    for x, which, tokens, heads in arrays:
        mine = ranges[local][which]
        shape = list(x.shape)
        shape[heads] = len(mine)
        got = []
        for peer in range(w):
            if peer == local:
                got.append(xp.ascontiguousarray(_rows(x, heads, mine)))
                continue
            sends.append((peer, [xp.ascontiguousarray(_rows(x, heads, ranges[peer][which]))]))
            got.append(xp.empty(shape, x.dtype))
            recvs.append((peer, [got[-1]]))
        parts.append((got, tokens))
    transport.exchange(sends, recvs).wait()
    return [xp.concatenate(got, axis=tokens) for got, tokens in parts]


def from_node(transport, ranges, local, arrays):
    """``arrays``: (y, out, which, token_axis, head_axis): y holds the node's tokens of this rank's
    heads; ``out`` (this rank's tokens, every head) receives them, summed over the ranks that
    share a head (out starts at zero)."""
    xp = transport.xp
    w = len(ranges)
    sends, recvs, back = [], [], []
    for y, out, which, tokens, heads in arrays:
        n = out.shape[tokens]
        for peer in range(w):
            piece = _rows(y, tokens, range(peer * n, (peer + 1) * n))
            if peer == local:
                back.append((out, heads, ranges[local][which], piece))
                continue
            sends.append((peer, [xp.ascontiguousarray(piece)]))
            shape = list(out.shape)
            shape[heads] = len(ranges[peer][which])
            back.append((out, heads, ranges[peer][which], xp.empty(shape, y.dtype)))
            recvs.append((peer, [back[-1][3]]))
    transport.exchange(sends, recvs).wait()
    for out, heads, r, piece in back:
        _rows(out, heads, r)[...] += piece

