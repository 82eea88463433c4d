"""Which node each rank is on, and the communicators the schemes across nodes use.

A cluster is ``nodes`` nodes of ``per_node`` ranks each (one GPU per rank). Membership comes from
``MPI_Comm_split_type(COMM_TYPE_SHARED)`` on the caller's communicator (the ranks that share
memory share a node). Two overrides, for emulation and tests:

- ``ranks_per_node=`` (API) or ``BURST_HPC_RANKS_PER_NODE``: one host acts as several nodes, cut
  into groups of that many ranks in the order of their rank on the host;
- ``BURST_HPC_NODE_ID``: this rank's node, as the launcher knows it (any integer; e.g. SLURM_NODEID).

Every node must hold the same number of ranks (a clear error on every rank otherwise). Ranks
need not be placed node by node: *positions* number the ranks node by node (position
``node * per_node + local``, nodes ordered by their lowest rank, ranks inside a node by rank),
and ``ordered`` is the communicator whose rank is the position (``far``: a duplicate of it, the double
ring's network lane; ``lane``: a duplicate of the caller's communicator, the flat ring's far lane;
``inner_lane(comm)``: another, its inner lane). ``rails[local]`` is the same
local rank on every node (one NIC rail); ``node_comm`` this rank's node.
"""
from dataclasses import dataclass

from .. import config
from ..collective import kept
from ..errors import RankMismatchError, TopologyError


@dataclass(frozen=True)
class Arrangement:
    """Pure description (no MPI): ``order[position]`` is the caller's rank at that position."""
    nodes: int
    per_node: int
    order: tuple

    def position(self, rank):
        return self.order.index(rank)

    def node_of(self, position):
        return position // self.per_node

    def local_of(self, position):
        return position % self.per_node

    def at(self, node, local):
        return (node % self.nodes) * self.per_node + local % self.per_node


def arrange(node_ids, ranks_per_node=None):
    """The Arrangement of ranks whose nodes are ``node_ids[rank]`` (any hashable). ``ranks_per_node``
    cuts each node further into groups of that many ranks (one host acting as several nodes)."""
    members = {}
    for rank, node in enumerate(node_ids):
        members.setdefault(node, []).append(rank)
    groups = sorted(members.values(), key=min)
    if ranks_per_node is not None:
        if ranks_per_node < 1:
            raise TopologyError(f"ranks_per_node must be positive; got {ranks_per_node}")
        if any(len(g) % ranks_per_node for g in groups):
            sizes = sorted({len(g) for g in groups})
            raise TopologyError(f"ranks_per_node={ranks_per_node} does not divide the ranks of each host "
                                f"({', '.join(map(str, sizes))} ranks per host)")
        groups = [g[i:i + ranks_per_node] for g in groups for i in range(0, len(g), ranks_per_node)]
    sizes = sorted({len(g) for g in groups})
    if len(sizes) != 1:
        raise TopologyError(f"every node needs the same number of ranks; these nodes hold "
                            f"{', '.join(str(len(g)) for g in groups)} ranks (launch the same number per node)")
    return Arrangement(len(groups), sizes[0], tuple(r for g in groups for r in g))


def ranks_per_node_setting(ranks_per_node=None):
    """``ranks_per_node`` or the environment's BURST_HPC_RANKS_PER_NODE (None: detect)."""
    return config.ranks_per_node() if ranks_per_node is None else ranks_per_node


def node_ids(comm, setting=None):
    """Collective: every rank's (node id, ``setting``): the id BURST_HPC_NODE_ID, else its shared-memory
    group, named by the group's lowest rank and found once per communicator."""
    from mpi4py import MPI

    state = kept(comm)
    if "host" not in state:
        host = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
        state["host"] = host.allreduce(comm.rank, op=MPI.MIN)
        host.Free()
    env = config.node_id()
    return comm.allgather((("env", env) if env else ("host", state["host"]), setting))


class Topology:
    """The caller's communicator seen as nodes (see the module's docstring)."""

    def __init__(self, comm, ranks_per_node, ids):
        """Collective on ``comm``. ``ids``: every rank's node id; ``ranks_per_node``: the setting."""
        self.comm = comm
        self.arrangement = arrange(ids, ranks_per_node)
        self.nodes, self.per_node = self.arrangement.nodes, self.arrangement.per_node
        self.position = self.arrangement.position(comm.rank)
        self.node, self.local = self.arrangement.node_of(self.position), self.arrangement.local_of(self.position)
        self.ordered = comm.Split(0, key=self.position)
        self.far = self.ordered.Dup()   # the double ring's network lane (its own NCCL communicator)
        self.lane = comm.Dup()          # the flat ring's network lane (the balanced schedule's far transfers)
        self.node_comm = self.ordered.Split(self.node, key=self.local)
        self.rail = self.ordered.Split(self.local, key=self.node)


def inner_lane(comm):
    """Collective on first use: a duplicate of ``comm``, made once per communicator, for the balanced
    schedule's transfers inside a node posted steps before they are due (schedule.Transfer.inner):
    on their own lane they never queue behind (NCCL) the network's or the steps' in between."""
    state = kept(comm)
    if "inner lane" not in state:
        state["inner lane"] = comm.Dup()
    return state["inner lane"]


def topology(comm, ranks_per_node=None):
    """Collective: the Topology of ``comm`` (one allgather; the communicators are split once per
    communicator, node assignment and setting). The allgather carries each rank's setting too, so
    ranks that cut their hosts otherwise (ranks_per_node or BURST_HPC_RANKS_PER_NODE) get the same
    error on every rank, never some splitting the communicator while others do not."""
    try:
        setting, problem = ranks_per_node_setting(ranks_per_node), None
    except TopologyError as e:
        setting, problem = None, str(e)
    ids, settings = zip(*node_ids(comm, (setting, problem)))
    for rank, (theirs, problem) in enumerate(settings):
        if problem is not None:
            raise TopologyError(problem if all(p == problem for _, p in settings) else f"{problem} (rank {rank})")
        if theirs != settings[0][0]:
            raise RankMismatchError(f"ranks disagree on ranks_per_node (or BURST_HPC_RANKS_PER_NODE): rank 0 has "
                                    f"{settings[0][0]!r}, rank {rank} has {theirs!r}")
    state, key = kept(comm), ("topology", tuple(ids), setting)
    if key not in state:
        state[key] = Topology(comm, setting, ids)
    return state[key]
