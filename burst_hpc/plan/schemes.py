"""How the shards move over the two link classes of a cluster (docs/RING.md, "Across nodes").

A scheme gives the ring engine its communicator, this rank's position in it, the tokens each
position holds (``pieces``) and the schedule (``steps``); every scheme runs through the one step
loop of ring.py.

- ``ring``: the flat ring over the caller's communicator (and the balanced schedule), unchanged.
- ``double_ring``: an inner ring inside each node, one transfer per rank and inner round over the
  rails (schedule.double_ring_steps); positions are node by node (topology).
- ``ulysses_ring``: all-to-all over heads inside the node (ulysses.py), then a flat ring over the
  rails whose shards are whole nodes' tokens for 1/w of the heads, then all-to-all back.
- ``gather``: every rank keeps its queries; the keys and values another rank's queries see go
  straight to it from their owner, and only those (gather.py); the chunks layout's scheme.
- ``auto``: the chunks layout -> ``gather``; else one node -> ``ring``, several -> the cost
  model's pick (costmodel.pick).
"""
import numpy as np

from . import gather, masks
from ..errors import LayoutError, TopologyError
from .schedule import balanced_by_schedule, double_ring_steps, plain_ring_steps, steps as flat_steps
from .topology import inner_lane

SCHEMES = ("auto", "ring", "double_ring", "ulysses_ring", "gather")
NODE_SCHEMES = ("double_ring", "ulysses_ring")


def check_scheme(name):
    if name not in SCHEMES:
        raise TopologyError(f"unknown scheme {name!r}; use one of {', '.join(SCHEMES)}")
    return name


class Flat:
    name = "ring"
    packed = False   # the gather scheme's one block call a pass (engine/packed.py)

    def __init__(self, comm, layout, mask, topo=None):
        self.comm, self.position, self.size = comm, comm.rank, comm.size
        self.layout, self.mask, self.topo = layout, mask, topo

    @property
    def balanced(self):
        """Whether the ring runs the balanced layout's work-aware schedule (schedule.work_steps)."""
        return self.name == "ring" and balanced_by_schedule(self.layout, self.mask)

    @property
    def far_comm(self):
        """Across nodes the balanced schedule posts transfers between nodes steps before they are
        due (schedule.LEAD): on their own lane, so they never queue behind (NCCL) the transfers of
        the steps in between."""
        if not self.balanced or self.topo is None or self.topo.nodes == 1:
            return None
        return self.topo.lane

    @property
    def inner_comm(self):
        """The balanced schedule posts transfers inside a node a step before they are due, and lets
        partials complete a step after they are posted (schedule.INNER_LEAD, INNER_LAG): on a lane
        of their own, behind neither the network's transfers nor those due at each step."""
        return inner_lane(self.comm) if self.balanced else None

    def remote(self, peer):
        """Whether ``peer`` (a rank of ``comm``) is on another node than this rank."""
        if self.topo is None:
            return False
        node = self.topo.arrangement.node_of
        return node(self.topo.arrangement.position(peer)) != self.topo.node

    def pieces(self, position):
        return self.layout.pieces(position)

    def steps(self, near, returns):
        return flat_steps(self.layout, self.position, near, returns, self.mask, self.nodes())

    def nodes(self):
        """The node of each rank of ``comm`` (None: unknown, or one node)."""
        if self.topo is None or self.topo.nodes == 1:
            return None
        arrangement = self.topo.arrangement
        return tuple(arrangement.node_of(arrangement.position(r)) for r in range(self.size))


class DoubleRing(Flat):
    name = "double_ring"

    def __init__(self, topo, layout, mask):
        check_node_layout(self.name, layout, mask)
        super().__init__(topo.ordered, layout, mask, topo)

    @property
    def far_comm(self):   # the network lane: one transfer per rank and inner round
        return self.topo.far

    def remote(self, peer):
        return peer // self.topo.per_node != self.topo.node

    def pieces(self, position):  # the shard at a position is its rank's (the caller's numbering)
        return self.layout.pieces(self.topo.arrangement.order[position])

    def steps(self, near, returns):
        nodes, w = self.topo.nodes, self.topo.per_node
        rounds = work_rounds(position_pairs(self.mask, self.layout, self.topo.arrangement.order), nodes, near == "q",
                             lambda p, o: [(p // w - o) % nodes * w + (p % w - t) % w for t in range(w)])
        return double_ring_steps(self.position, nodes, w, near, returns, rounds)


class UlyssesRing(Flat):
    name = "ulysses_ring"

    def __init__(self, topo, layout, mask):
        check_node_layout(self.name, layout, mask)
        super().__init__(topo.rail, layout, mask, topo)
        self.ranks = topo.nodes * topo.per_node

    far_comm = None   # every transfer is due the step it is posted

    def pieces(self, node):  # a node's tokens: its ranks' shards in local order
        order, w = self.topo.arrangement.order, self.topo.per_node
        return tuple(run for r in order[node * w:(node + 1) * w] for run in self.layout.pieces(r))

    def remote(self, peer):  # the ring runs over the rail: one rank per node
        return peer != self.position

    def steps(self, near, returns):
        nodes = self.topo.nodes
        pairs = position_pairs(self.mask, self.layout, self.topo.arrangement.order, self.topo.per_node)
        count = work_rounds(pairs, nodes, near == "q", lambda p, o: [(p - o) % nodes])
        return plain_ring_steps(self.position, nodes, near, returns, count)


class Gather(Flat):
    name = "gather"

    @property
    def packed(self):
        """Every rank on one node: a pass is one exchange and one block call on packed keys (plan/packing.py;
        the transfers cross NVLink in less than the stepped gather's many small launches cost). Across nodes
        the stepped gather hides the transfers under each rank's own work."""
        return self.topo is None or self.topo.nodes == 1

    def steps(self, near, returns):
        assert near == "kv", "the gather schedule moves keys and values"
        return gather.steps(self.position, self.layout, self.mask, tuple(returns))


def check_node_layout(name, layout, mask):
    """Refuse the balanced layout's work-aware schedule (causal, documents, windows: ``mask`` a
    masks.Mask) off the flat ring."""
    if layout.balances_by_schedule and not mask.is_full:
        raise LayoutError(f"scheme {name!r} works with the zigzag and contiguous layouts; the balanced layout's "
                          f"schedule (causal, documents, windows) runs on the flat ring (scheme='ring')")


def position_pairs(mask, layout, order, group=1):
    """Visible (query, key) pairs between the shards of every two groups of ``group`` consecutive
    positions of a ring, ``order[position]`` the rank whose shard a position holds (masks.pair_work;
    None for full and causal masks: every pair counts, as in masks.ring_steps)."""
    if mask.kind != "intervals":
        return None
    ranks = np.asarray(order)
    pairs = masks.pair_work(mask, layout)[np.ix_(ranks, ranks)]
    count = len(ranks) // group
    return pairs.reshape(count, group, count, group).sum(axis=(1, 3))


def work_rounds(pairs, rounds, queries_travel, visited):
    """1 + the last round in which some position has a visible pair (documents or a window leave
    the later rounds empty); ``pairs`` the visible pairs of a position's queries with another's keys
    (position_pairs; None: every round has work); ``visited(position, round)``: the shards it meets
    then."""
    if pairs is None:
        return rounds
    held = pairs.T if queries_travel else pairs   # [staying position, travelling shard]
    last = 0
    for o in range(1, rounds):
        if any(held[p, shard] > 0 for p in range(len(held)) for shard in visited(p, o)):
            last = o
    return last + 1


def make(name, comm, topo, layout, mask):
    """The scheme object for a resolved ``name`` (not 'auto'), ranks holding tokens by ``layout``,
    ``mask`` the call's masks.Mask."""
    if name == "ring":
        return Flat(comm, layout, mask, topo)
    if name == "gather":
        return Gather(comm, layout, mask, topo)
    return {"double_ring": DoubleRing, "ulysses_ring": UlyssesRing}[name](topo, layout, mask)


def ulysses_heads(heads, kv_heads, per_node):
    """Query and K/V head ranges of each local rank under ulysses_ring: [(q range, kv range)].
    Query heads split evenly over the node; each rank gets the K/V heads its query heads use, so
    with Hkv < w several ranks share a K/V head (it is sent to each of them)."""
    if heads % per_node:
        raise TopologyError(f"scheme 'ulysses_ring' splits the {heads} query heads over the {per_node} ranks of a "
                            f"node, and {per_node} does not divide {heads}; use scheme='double_ring' or 'ring'")
    group, mine = heads // kv_heads, heads // per_node
    if mine % group and group % mine:
        raise TopologyError(f"scheme 'ulysses_ring' gives each rank {mine} query heads, which neither holds whole "
                            f"GQA groups of {group} nor divides one; use scheme='double_ring' or 'ring'")
    out = []
    for local in range(per_node):
        q = range(local * mine, (local + 1) * mine)
        out.append((q, range(q.start // group, (q.stop - 1) // group + 1)))
    return out


__all__ = ["SCHEMES", "check_scheme", "make", "ulysses_heads"]
