"""Predicted time of a call across ranks and nodes (docs/RING.md, "Across nodes"): one model for
every layout and scheme, read off the schedule the engine runs (workload.account), from

- the problem: batch B, sequence S, heads Hq / Hkv, head dim D, bytes per element, and the
  mask (causal, documents, window): which (query, key) pairs are visible, so which steps have work;
- the cluster: nodes N of w ranks (P = N w), one GPU each;
- rates (rates.py): the kernels' seconds per tile they run (tiles.py: the forward's key tiles and query
  tiles, the backward's steps and its query tiles' L2 sharing; the NumPy path: per visible pair), the
  backward's seconds per query token outside its kernel, and per link class (NVLink inside a node, the network
  between nodes) the bandwidth per GPU each way and a latency per message.

Step by step as the engine runs it: every rank starts a step's kernels when the step before has
ended everywhere, and a step ends when its busiest rank's kernels (the critical path, not the
mean) are done and every transfer due then has arrived. A transfer is posted at the start of its
step (some schedules post transfers steps before they are due) and has arrived when both its
sender's outgoing and its receiver's incoming link of its class have carried it: each link carries
its transfers one after another in the order they are posted, a latency once per step and link.
The packed passes (the gather on one node: Account.stepped False) are priced rank by rank instead
(pricing._run_ranks): a rank's step ends when its own kernels and the transfers at its own link ends are
done, without waiting for the other ranks, and a step's transfers start when the last rank reaches it.
What cannot overlap is added: Ulysses' all-to-alls inside the node, the backward's work outside its
kernels (pricing.outside_seconds). Exposed communication =
predicted time - compute alone.

``predict`` prices one (scheme, layout); ``best`` the fastest of those that run; ``choose_layout``
(public) is the layout of that pick, for a caller to shard by. The rates: rates.py; peak memory:
memory.py.
"""
from dataclasses import dataclass

import numpy as np

from . import gather, tiles
from .accounting import attention_flops, cheaper_backward_ring, step_bytes, transfer_bytes
from .pricing import Costs, kernel_prices, outside_seconds
from ..errors import BurstError, LayoutError
from .layout import LAYOUTS, Layout, layouts_for, make_layout
from .placement import chunk_counts
from .rates import rates_for
from .tiles import packed_heads


SCHEMES = ("ring", "double_ring", "ulysses_ring", "gather")
MARGIN = 0.02   # another scheme replaces the flat ring only when predicted faster by more than this share


@dataclass(frozen=True)
class Problem:
    """The shapes of a call over the whole sequence and its mask (masks.Mask)."""
    batch: int
    seqlen: int
    heads: int
    kv_heads: int
    head_dim: int
    itemsize: int
    mask: object


@dataclass(frozen=True)
class Cluster:
    nodes: int
    per_node: int

    @property
    def ranks(self):
        return self.nodes * self.per_node


def token_bytes(pr, backward, heads=None, kv_heads=None):
    """(data, partial) bytes per token (and batch row) one ring step moves: the forward's K/V;
    the backward's cheaper ring (q-ring: Q, dO, lse, delta out and dQ back; kv-ring: K, V out and
    dK, dV back). ``heads``/``kv_heads``: the heads one rank carries (Ulysses: a share of them)."""
    sides = step_bytes(pr.heads if heads is None else heads, pr.kv_heads if kv_heads is None else kv_heads,
                       pr.head_dim, pr.itemsize)
    if not backward:
        return sides["forward"]
    return min(sides["kv"], sides["q"], key=sum)   # a tie goes to the kv-ring, as choose_backward_ring does


def ulysses_kv_heads(pr, per_node):
    """K/V heads one rank holds under ulysses_ring (shared when Hkv < w)."""
    group, mine = pr.heads // pr.kv_heads, pr.heads // per_node
    return max(1, mine // group)


@dataclass(frozen=True)
class PassPrediction:
    """One pass predicted step by step (``predict``)."""
    time: float          # seconds
    compute: float       # seconds of the critical path's kernels (Costs.compute), block calls' too
    mean: float          # seconds of the mean rank's kernels (no block calls' fixed costs)
    steps: int
    network: float       # bytes the busiest GPU sends over the network
    fixed: float = 0.0   # seconds the fixed costs (launches, steps, messages) add to ``time``
    stepping: float = 0.0   # seconds of the steps' own fixed costs (in ``time``, not waiting for transfers)
    imbalance: float = 1.0  # the critical path's visible pairs over the mean rank's
    flops: float = 0.0   # FLOPs of the mean rank's visible pairs (FlashAttention's count)

    @property
    def waited(self):
        """Seconds spent waiting for transfers: the time but the kernels and the steps' fixed costs."""
        return self.time - self.compute - self.stepping

    @property
    def exposed(self):
        """Share of the time spent waiting for transfers."""
        return max(0.0, self.waited) / self.time if self.time else 0.0



@dataclass(frozen=True)
class Prediction:
    """A call's forward and backward pass under one (scheme, layout)."""
    scheme: str
    layout: Layout
    fwd: PassPrediction
    bwd: PassPrediction

    @property
    def fwdbwd(self):
        return self.fwd.time + self.bwd.time

    @property
    def exposed(self):
        """Share of the forward+backward time spent waiting for transfers."""
        return max(0.0, self.fwd.waited + self.bwd.waited) / self.fwdbwd if self.fwdbwd else 0.0

    @property
    def network(self):
        return self.fwd.network + self.bwd.network

    def seconds(self, backward=True):
        """What the picks compare: forward+backward, or the forward alone."""
        return self.fwdbwd if backward else self.fwd.time


def backward_side(pr, layout):
    """The side a call's backward ring sends around (backward_ring 'auto', decisions.choose_backward_ring):
    the one moving fewer bytes over the steps that have work."""
    from . import masks

    steps = [masks.ring_steps(pr.mask, layout, queries_travel) for queries_travel in (True, False)]
    return cheaper_backward_ring(pr.heads, pr.kv_heads, pr.head_dim, pr.itemsize, *steps, layout.size)


def direction_of(pr, layout, backward):
    """The workload direction of a pass (workload.DIRECTIONS)."""
    if not backward:
        return "forward"
    return "backward" if backward_side(pr, layout) == "kv" else "backward-q"


def zigzag(pr, cl):
    """The zigzag Layout of the problem over the cluster: the layout the model prices unless told another."""
    return make_layout("zigzag", pr.seqlen, cl.ranks)


def auto_schemes(layout, cl, pr, backward_ring="auto"):
    """The schemes 'auto' chooses among in ``layout`` for ``pr`` (decisions.settled_scheme): chunks or one rank:
    gather (the ring where gather.fits says no or ``backward_ring`` is 'q'); else the ring, several nodes: all."""
    if layout.placed_by_mask or layout.size == 1:
        return ("gather",) if backward_ring != "q" and gather.fits(pr, layout) else ("ring",)
    return ("ring", "double_ring", "ulysses_ring") if cl.nodes > 1 else ("ring",)


def fits(scheme, pr, cl, layout=None):
    """None when ``scheme`` runs this problem in ``layout`` (a Layout; None: zigzag), else why not (the
    reason the library gives)."""
    from .schemes import check_node_layout, ulysses_heads

    try:
        layout = zigzag(pr, cl) if layout is None else layout
        if scheme in ("ring", "gather"):
            return None
        check_node_layout(scheme, layout, pr.mask)
        if scheme == "ulysses_ring":
            ulysses_heads(pr.heads, pr.kv_heads, cl.per_node)
    except BurstError as e:
        return str(e)
    return None


def predict(scheme, pr, cl, rates, layout=None, scale=1):
    """The Prediction of ``scheme`` in ``layout`` (a Layout, None: zigzag; it must fit: ``fits``).
    ``scale``: the same
    schedule with ``scale`` times the tokens per GPU (work by its square, bytes by it;
    hiding_tokens' question)."""
    layout = zigzag(pr, cl) if layout is None else layout
    return Prediction(scheme, layout, *(pass_prediction(scheme, pr, cl, rates, layout, b, scale)
                                        for b in (False, True)))


def pass_prediction(scheme, pr, cl, rates, layout, backward, scale=1):
    """One pass of ``predict``; with ``scale`` an array, ``time`` and ``compute`` are arrays too (one
    for each scale: hiding_tokens asks many at once). ``fixed`` (scale 1 only, else 0): the seconds
    the fixed costs add (the same pass priced without them, subtracted)."""
    from .workload import KINDS, account

    # the gather schedule's backward moves keys and values (decisions.gather_backward_ring)
    direction = "backward" if backward and scheme == "gather" else direction_of(pr, layout, backward)
    heads, kv_heads = pr.heads, pr.kv_heads
    if scheme == "ulysses_ring":
        heads, kv_heads = pr.heads // cl.per_node, ulysses_kv_heads(pr, cl.per_node)
    # the forward's tiles pack a group's query heads (the backward's prices never read those counts)
    acc = account(layout, pr.mask, scheme, direction, cl.per_node if cl.nodes > 1 else None,
                  1 if backward else packed_heads(heads // kv_heads))
    prices = kernel_prices(rates, pr.batch, heads, pr.head_dim, backward)
    tokens = layout.local * (cl.per_node if scheme == "ulysses_ring" else 1)   # a rank's query tokens
    outside = outside_seconds(rates, pr.batch, heads, pr.head_dim, tokens, backward)
    sizes = transfer_bytes(heads, kv_heads, pr.head_dim, pr.itemsize, backward)
    nbytes = np.array([sizes[kind] * pr.batch for kind in KINDS])[acc.ends["kind"]] * acc.ends["tokens"]
    scales = np.atleast_1d(np.asarray(scale, np.float64))
    costs = Costs(acc, prices, nbytes, rates, backward, outside, alone=cl.ranks == 1)
    time = costs.run(scales)
    if scheme == "ulysses_ring":
        time = time + _all_to_alls(pr, cl, rates, backward, scales)
    sent = acc.ends["far"].astype(bool) & acc.ends["out"].astype(bool)
    network = np.bincount(acc.ends["rank"][sent], nbytes[sent], minlength=1).max()
    compute = costs.compute(scales) + outside * scales
    mean = costs.kernels(scales).sum(axis=(0, 1)) / cl.ranks + outside * scales
    fixed = 0.0
    if np.ndim(scale) == 0:
        time, compute, mean = float(time[0]), float(compute[0]), float(mean[0])
        fixed = time - float(costs.run(scales, fixed=False)[0])
    work = acc.work.sum()
    return PassPrediction(time, compute, mean, acc.work.shape[0], float(network), fixed, acc.work.shape[0] * costs.step,
                          acc.critical * cl.ranks / work if work else 1.0,
                          attention_flops(pr.batch, heads, pr.head_dim, work / cl.ranks, backward))


def _all_to_alls(pr, cl, rates, backward, scale):
    """Seconds of Ulysses' all-to-alls inside the node (heads out, results back), not overlapped."""
    w = cl.per_node
    if w == 1:
        return 0.0
    hq, hk = pr.heads // w, ulysses_kv_heads(pr, w)
    d, it = pr.head_dim, pr.itemsize
    if backward:
        into, back = hq * (2 * d * it + 8) + 2 * hk * d * it, (hq + 2 * hk) * d * 4
    else:
        into, back = (hq + 2 * hk) * d * it, hq * (d * it + 4)
    shard = pr.batch * pr.seqlen / cl.ranks * scale
    return sum(rates.intra_latency_us * 1e-6 + (w - 1) * shard * nbytes / (rates.intra_gbps * 1e9)
               for nbytes in (into, back))


def cluster_layouts(pr, cl, rates, kinds=LAYOUTS, backward=True, scheme="auto", backward_ring="auto"):
    """layout.layouts_for the problem over the cluster, the chunks layout placed by its nodes in the chunk
    (placement.chunk_counts) predicted fastest (forward+backward, or the forward alone) under ``scheme`` (auto:
    its pick, ``backward_ring`` as ``auto_schemes`` takes it); placement.place's (its chunk, each rank's area
    balanced) unless another is faster by more than MARGIN. Across nodes the fewest chunks are often fastest
    though the least balanced: a document cut into more chunks crosses more nodes. Under the gather scheme
    (which auto runs in this layout) the other chunks are placed weighing the keys each rank receives
    (receive_weight): it sends a rank only the keys its queries see (docs/BENCHMARKS.md, "The placement weighs
    the keys each rank receives"); a ring sends every key to every rank, so the area alone is its balance."""
    per_node = cl.per_node if cl.nodes > 1 else None
    out = layouts_for(pr.seqlen, cl.ranks, pr.mask, kinds, per_node)
    chosen = out.get("chunks")
    if isinstance(chosen, Layout) and cl.ranks > 1 and pr.mask.kind == "intervals":   # else zigzag's or contiguous's
        def seconds(layout):
            schemes = (scheme,) if scheme != "auto" else auto_schemes(layout, cl, pr, backward_ring)
            picked = _pick(options(pr, cl, rates, {"chunks": layout}, schemes), backward, MARGIN)
            return picked["chunks"].seconds(backward) if picked else np.inf   # the scheme named does not run

        least = seconds(chosen)
        receive = receive_weight(pr, rates, backward) if scheme in ("auto", "gather") else 0
        for count in chunk_counts(chosen.local):
            layout = make_layout("chunks", pr.seqlen, cl.ranks, pr.mask, per_node, chosen.local // count, receive)
            if layout != chosen and (time := seconds(layout)) < least * (1 - MARGIN):
                chosen, least = layout, time
        out["chunks"] = chosen
    return out


def receive_weight(pr, rates, backward=True):
    """The visible pairs a key row weighs for the rank that receives it (placement.balance_receives), whole: the
    row's K and V in and, with the backward, its float32 dK and dV home, at a link's rate inside a node, against
    a visible pair's kernel time (forward, plus backward) at the rates' prices of a key tile's (a backward
    step's) pairs. Whole pairs: every rank weighs alike. bf16, Hq 64, Hkv 8, D 128: 413 on H200's rates, 405
    on H100's."""
    row = 2 * pr.kv_heads * pr.head_dim * (pr.itemsize + (4 if backward else 0)) / (rates.intra_gbps * 1e9)
    pair = 0.0
    for bwd, (rows, cols), price in ((False, tiles.FORWARD_TILE, "fwd_key_tile_ns"),
                                     (True, tiles.BACKWARD_TILE, "bwd_step_ns"))[:1 + bool(backward)]:
        per_pair, _ = kernel_prices(rates, 1, pr.heads, pr.head_dim, bwd)
        pair += per_pair + getattr(rates, price) * 1e-9 * pr.heads * pr.head_dim / 128 / (rows * cols)
    return int(round(row / pair)) if pair > 0 else 0


def options(pr, cl, rates, layouts=None, schemes=SCHEMES):
    """{(layout kind, scheme): Prediction, or the reason it does not run}, for every pair asked;
    ``layouts`` {kind: Layout or why the length does not split in it} (None: every kind, ``cluster_layouts``)."""
    out = {}
    layouts = cluster_layouts(pr, cl, rates) if layouts is None else layouts
    for kind, layout in layouts.items():
        for scheme in schemes:
            why = layout if isinstance(layout, str) else fits(scheme, pr, cl, layout)
            out[(kind, scheme)] = why if why is not None else predict(scheme, pr, cl, rates, layout)
    return out


def pick(pr, cl, rates, layout=None, backward=True, margin=MARGIN):
    """The scheme ``scheme='auto'`` runs in ``layout`` (a Layout, None: zigzag): the least predicted
    time (forward+backward, or the forward alone) among those that fit (``auto_schemes``); the flat
    ring unless another beats it by more than ``margin``; one node: ring (the chunks layout, one rank: gather)."""
    layout = zigzag(pr, cl) if layout is None else layout
    found = options(pr, cl, rates, {layout.kind: layout}, auto_schemes(layout, cl, pr))
    picked = _pick(found, backward, margin)
    if layout.kind not in picked:
        raise BurstError(found[(layout.kind, "ring")])
    return picked[layout.kind].scheme


def _pick(found, backward, margin):
    """{layout kind: its picked Prediction} of ``options``' output."""
    picked = {}
    for (kind, scheme), p in found.items():
        if isinstance(p, str):
            continue
        held = picked.get(kind)
        if held is None or p.seconds(backward) < held.seconds(backward) * (1 - margin):
            picked[kind] = p
    return picked


def best(pr, cl, rates, layouts=None, scheme="auto", backward=True, backward_ring="auto"):
    """The fastest predicted (layout, scheme): each layout with its ``pick`` (or ``scheme`` when one is
    named), the least time among them; on a tie the call's default layout (zigzag when causal,
    contiguous otherwise: one rank holds every layout alike). ``layouts`` as ``options`` takes them,
    ``backward_ring`` as ``auto_schemes``. (Prediction, ``options``' output of the pairs priced.)"""
    ring = backward_ring if backward else "auto"
    if layouts is None:
        layouts = cluster_layouts(pr, cl, rates, backward=backward, scheme=scheme, backward_ring=ring)
    found = {}
    for kind, layout in layouts.items():
        schemes = ((scheme,) if scheme != "auto" else ("ring",) if isinstance(layout, str)
                   else auto_schemes(layout, cl, pr, ring))
        found.update(options(pr, cl, rates, {kind: layout}, schemes))
    picked = _pick(found, backward, MARGIN)
    if not picked:   # no layout splits the sequence, or the scheme named runs none that does
        raise LayoutError("; ".join(dict.fromkeys(why for why in found.values())))
    return min(picked.values(), key=lambda p: (p.seconds(backward), not p.layout.is_default(pr.mask.causal))), found


def hiding_tokens(scheme, pr, cl, rates, backward=False, within=0.05, layout=None):
    """The fewest tokens per GPU (a multiple of 64) at which ``scheme`` in ``layout`` (a Layout,
    None: zigzag) exposes at
    most ``within`` of its compute as communication (None beyond 16M tokens per GPU): the same
    schedule, its mask scaled with the tokens (``predict``'s ``scale``). Narrowed down 64 sizes at
    a time (one pass of the model prices them together)."""
    tokens = pr.seqlen / cl.ranks
    layout = zigzag(pr, cl) if layout is None else layout

    def hidden(units):
        passes = [pass_prediction(scheme, pr, cl, rates, layout, b, units * 64 / tokens)
                  for b in ((False, True) if backward else (False,))]
        return sum(p.waited for p in passes) <= within * sum(p.compute for p in passes)

    lo, hi = 1, 1 << 18   # units of 64 tokens
    if not hidden(np.array([hi]))[0]:
        return None
    while lo < hi:
        grid = np.unique(np.linspace(lo, hi, 64).round().astype(np.int64))
        first = int(np.argmax(hidden(grid)))   # the last point (hi) hides
        if first == 0:
            return int(grid[0]) * 64
        lo, hi = int(grid[first - 1]) + 1, int(grid[first])
    return lo * 64


def choose_layout(seqlen, size, *, causal=False, cu_seqlens=None, window=None, heads=32, kv_heads=None,
                  head_dim=128, dtype="bfloat16", batch=1, backend="cuda", ranks_per_node=None, scheme="auto",
                  backward=True, rates=None):
    """The layout the cost model predicts fastest for a call: the one to shard by and to pass as
    ``layout=`` (a call that names none uses zigzag when causal, contiguous otherwise, whatever the
    mask). A local computation, priced with the fixed costs measured on this node unless ``rates``
    are given: nodes that measured differently can pick differently (a call with the layouts mixed
    fails on every rank), so compute it on one rank and broadcast it, or let
    ``Decomposition(layout='auto')`` decide it for every rank alike.

    Parameters
    ----------
    seqlen, size : int
        Tokens in the whole sequence and ranks.
    causal, cu_seqlens, window
        The mask, as burst_attention takes it.
    heads, kv_heads, head_dim : int
        Hq, Hkv (default: ``heads``) and D.
    dtype : str or numpy dtype
        Element type of q, k, v.
    batch : int
        B.
    backend : {'cuda', 'numpy'}
        Whose built-in rates price the call (rates_for: H100's, or this library's CPU path).
    ranks_per_node : int, optional
        Ranks a node (None: one node). The chunks layout is then placed by nodes (documents kept on
        one node first), for ranks numbered node by node (the launcher's default, by slot).
    scheme : {'auto', 'ring', 'double_ring', 'ulysses_ring'}
        The scheme the call names (auto: each layout with the scheme it would pick).
    backward : bool
        Price the backward pass too (a training step: the forward and backward calls share shards).
    rates : burst_hpc.plan.rates.Rates, optional
        Overrides ``backend``'s rates.

    Returns
    -------
    Layout
        Of kind 'contiguous', 'zigzag', 'balanced' or 'chunks' (placed by the mask): shard by it and
        pass it as ``layout=``.

    Raises
    ------
    BurstError
        A bad mask, or a length that splits over ``size`` ranks in no layout.

    Examples
    --------
    ::

        layout = burst_hpc.choose_layout(S, P, causal=True, cu_seqlens=cu, heads=32, kv_heads=8)
        mine = lambda x: layout.shard(x, rank)
        o, lse = burst_hpc.burst_attention(mine(q), mine(k), mine(v), causal=True, cu_seqlens=cu, layout=layout)
    """
    from . import masks
    from ..dtypes import parse_dtype

    pr = Problem(batch, seqlen, heads, heads if kv_heads is None else kv_heads, head_dim,
                 np.dtype(parse_dtype(dtype)).itemsize, masks.make(seqlen, causal, window, cu_seqlens))
    return fastest_layout(pr, size, rates or rates_for(backend), ranks_per_node, scheme, backward)


def fastest_layout(pr, size, rates, ranks_per_node=None, scheme="auto", backward=True, backward_ring="auto"):
    """choose_layout's Layout for the problem ``pr`` (its mask made already) over ``size`` ranks."""
    per_node = size if ranks_per_node is None or ranks_per_node >= size else ranks_per_node
    if size % per_node:
        raise BurstError(f"{size} ranks do not fill nodes of {ranks_per_node}")
    cl = Cluster(size // per_node, per_node)
    return best(pr, cl, rates, scheme=scheme, backward=backward, backward_ring=backward_ring)[0].layout
