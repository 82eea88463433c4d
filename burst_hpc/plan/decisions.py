"""The decisions a Decomposition makes after its agreement, from values every rank holds alike: the
transport and the scheme from every rank's machine facts (gathered in the agreement), the backward
ring from the agreed shapes and mask. A decision that differs between ranks' machines is a
RankMismatchError on every rank, never a hang."""
import logging

from .accounting import backward_ring_bytes, cheaper_backward_ring
from ..errors import BurstError, RankMismatchError, TransportError
from ..transport import choose_transport

log = logging.getLogger("burst_hpc")
BACKWARD_RINGS = ("auto", "q", "kv")


def machine_facts(request):
    """What this rank's machine says that the decisions need: its GPU (NCCL needs one GPU a rank), its
    GPU model (the cost model's rates) and the transport it would pick with and without a GPU shared
    by two ranks (each a name, or the TransportError's text)."""
    location, device = None, None
    if request.backend == "cuda":
        import cupy
        from mpi4py import MPI

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        location, device = (MPI.Get_processor_name(), cupy.cuda.Device().pci_bus_id), props["name"].decode()
    picks = []
    for shared in (False, True) if location is not None and request.transport in ("auto", "nccl") else (False,):
        try:
            picks.append(("ok", choose_transport(request.transport, request.backend == "cuda", shared)))
        except TransportError as e:
            picks.append(("error", str(e)))
    from . import calibrate

    # the fixed costs measured on this machine: every decision prices with one rank's, never each its own
    fixed = calibrate.load(calibrate.device_model(request.backend, device)) or {}
    return {"gpu": location, "device": device, "transport": tuple(picks),   # [shared]: the pick then
            "fixed": fixed}


def settled_transport(request, everyone):
    """The transport, the same on every rank: each rank's pick given whether two ranks share a GPU
    (from every rank's GPU); a TransportError where some rank cannot have it, RankMismatchError
    where the ranks' machines pick differently."""
    used = [facts["gpu"] for facts in everyone if facts["gpu"] is not None]
    shared = len(set(used)) < len(used)
    picks = [facts["transport"][shared if len(facts["transport"]) == 2 else 0] for facts in everyone]
    for rank, (outcome, text) in enumerate(picks):
        if outcome == "error":
            alone = sum(o == "error" for o, _ in picks) < len(picks)
            raise TransportError(f"{text} (rank {rank})" if alone else text)
    for rank, (_, name) in enumerate(picks):
        if name != picks[0][1]:
            raise RankMismatchError(f"ranks disagree on transport: rank 0 has {picks[0][1]!r}, rank {rank} has "
                                    f"{name!r}; every rank must pass matching arguments")
    return picks[0][1]


def settled_scheme(request, topo, layout, everyone):
    """The concrete scheme: the one named, or for 'auto' 'gather' for the chunks layout and on one rank
    (costmodel.auto_schemes), 'ring' on one node and otherwise the cost model's fastest of those that fit
    (costmodel.pick), priced with each GPU model's rates: RankMismatchError where ranks on different GPU
    models would pick differently."""
    from . import costmodel
    from .rates import rates_for

    if request.scheme != "auto":
        return request.scheme
    nodes, per_node = (1, layout.size) if topo is None else (topo.nodes, topo.per_node)
    problem = costmodel.Problem(request.batch, request.seqlen, request.heads, request.kv_heads, request.head_dim,
                                request.dtype.itemsize, request.mask)
    candidates = costmodel.auto_schemes(layout, costmodel.Cluster(nodes, per_node), problem,
                                        request.backward_ring if request.backward else "auto")
    if len(candidates) == 1:   # nothing to price: the chunks layout's gather, the flat ring on one node
        return candidates[0]
    cluster = costmodel.Cluster(topo.nodes, topo.per_node)
    picks = {}
    for facts in everyone:   # each GPU model priced with the fixed costs of the first rank that has it
        if facts["device"] not in picks:
            rates = rates_for(request.backend, facts["device"], facts["fixed"])
            picks[facts["device"]] = costmodel.pick(problem, cluster, rates, layout, request.backward)
    chosen = [picks[facts["device"]] for facts in everyone]
    for rank, name in enumerate(chosen):
        if name != chosen[0]:
            raise RankMismatchError(f"ranks disagree on scheme: rank 0 has {chosen[0]!r}, rank {rank} has {name!r}; "
                                    "every rank must pass matching arguments")
    log.info("scheme auto -> %s (%d nodes x %d ranks)", chosen[0], topo.nodes, topo.per_node)
    return chosen[0]


def check_backward_ring(name):
    if name not in BACKWARD_RINGS:
        raise BurstError(f"unknown backward_ring {name!r}; use one of {', '.join(BACKWARD_RINGS)}")
    return name


def gather_backward_ring(name):
    """The gather scheme's backward moves keys and values (and their gradients home): 'kv' for
    'auto' or 'kv'; 'q' is refused."""
    if check_backward_ring(name) == "q":
        raise BurstError("scheme 'gather' sends keys and values to the queries that see them, and dK/dV home; "
                         "backward_ring='q' runs on the other schemes: use backward_ring='auto' or 'kv', "
                         "or scheme='ring'")
    return "kv"


def choose_backward_ring(name, heads, kv_heads, head_dim, itemsize, q_steps=1, kv_steps=1, size=1):
    """The backward ring: ``name``, or for 'auto' the one moving fewer bytes over its steps
    (accounting.cheaper_backward_ring)."""
    if check_backward_ring(name) != "auto":
        return name
    choice = cheaper_backward_ring(heads, kv_heads, head_dim, itemsize, q_steps, kv_steps, size)
    log.debug("backward ring auto -> %s-ring (%d and %d bytes per token per step, q and kv)", choice,
              *backward_ring_bytes(heads, kv_heads, head_dim, itemsize))
    return choice
