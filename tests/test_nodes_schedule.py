"""Schedule invariants of the schemes across nodes, without MPI: every (query shard, key shard)
pair exactly once, sends matching receives, the double ring's network traffic (one shard on the
rail and at most one partial per rank and inner round) and the bytes each link class carries
equal to the cost model's formula."""
import pytest

from burst_hpc.plan import costmodel, masks
from burst_hpc.plan.rates import GPU_RATES
from burst_hpc.engine.ring import lifetimes
from burst_hpc.plan.schedule import double_ring_steps, plain_ring_steps
from burst_hpc.plan.topology import arrange
from burst_hpc.errors import TopologyError

SHAPES = [(2, 2), (2, 3), (3, 2), (2, 4), (4, 2), (3, 3), (1, 4), (4, 1)]
PASSES = [("kv", ("q",)), ("kv", ("kv", "q")), ("q", ("kv", "q"))]   # forward, kv-ring, q-ring


def all_steps(nodes, w, near, returns):
    return [double_ring_steps(p, nodes, w, near, returns) for p in range(nodes * w)]


@pytest.mark.parametrize("nodes,w", SHAPES)
@pytest.mark.parametrize("near,returns", PASSES)
def test_double_ring_meets_every_pair_once_and_sends_match_receives(nodes, w, near, returns):
    P = nodes * w
    steps = all_steps(nodes, w, near, returns)
    met = sorted((p, v.kv_shard if near == "kv" else v.q_shard) for p in range(P) for s in steps[p] for v in s.visits)
    assert met == [(a, b) for a in range(P) for b in range(P)]
    for p in range(P):
        for index, step in enumerate(steps[p]):
            for t in step.sends:
                peer_step = steps[t.peer][index]
                match = [u for u in peer_step.recvs if u.peer == p and (u.what, u.side, u.shard, u.due) ==
                         (t.what, t.side, t.shard, t.due)]
                assert len(match) == 1, (p, index, t)
                assert t.due is None or index <= t.due < len(steps[p])


@pytest.mark.parametrize("nodes,w", SHAPES)
@pytest.mark.parametrize("near,returns", PASSES)
def test_double_ring_sends_one_message_per_rank_and_inner_round_on_its_rail(nodes, w, near, returns):
    """Per rank and inner round the network carries one exchange: posted in one step, to one peer
    on the rank's own rail (the next node's same local rank), holding at most one shard and one
    partial; the last partials go home over the rail too, after the last round."""
    for p in range(nodes * w):
        steps = double_ring_steps(p, nodes, w, near, returns)
        for start in range(0, len(steps), w):
            out = [(i, t) for i in range(start, min(start + w, len(steps))) for t in steps[i].sends
                   if t.peer // w != p // w]
            assert len({i for i, _ in out}) <= 1 and len({t.peer for _, t in out}) <= 1
            assert all(t.peer % w == p % w for _, t in out)
            assert sum(t.what == "data" for _, t in out) <= 1 and sum(t.what == "partial" for _, t in out) <= 1


def network_bytes(steps, position, w, sizes):
    """Bytes ``position`` sends to other nodes (``sizes``: {(what, side): bytes} of a transfer)."""
    return sum(sizes[(t.what, t.side)] for s in steps for t in s.sends if t.peer // w != position // w)


@pytest.mark.parametrize("nodes,w", [(2, 2), (3, 2), (2, 4), (4, 2), (8, 4)])
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2)])
def test_bytes_on_the_network_equal_the_cost_model(nodes, w, backward, hq, hkv):
    """The busiest GPU's bytes over the network, counted off every rank's schedule, equal the cost
    model's (costmodel.predict), for the backward ring the call picks (q-ring for MHA here)."""
    from burst_hpc.plan.accounting import transfer_bytes
    from burst_hpc.plan.workload import DIRECTIONS

    pr = costmodel.Problem(2, 64 * nodes * w, hq, hkv, 16, 2, masks.make(64 * nodes * w, True))
    cl = costmodel.Cluster(nodes, w)
    n = pr.batch * pr.seqlen // cl.ranks
    zigzag = costmodel.zigzag(pr, cl)
    near, returns = DIRECTIONS[costmodel.direction_of(pr, zigzag, backward)]
    assert near == ("q" if backward and hq == hkv else "kv")
    rates = GPU_RATES["H100"]

    def model(scheme):
        return costmodel.pass_prediction(scheme, pr, cl, rates, zigzag, backward).network

    def sizes(heads, kv_heads, tokens):
        return {key: tokens * x for key, x in transfer_bytes(heads, kv_heads, 16, 2, backward).items()}

    # double ring: every rank alike
    for p in range(cl.ranks):
        assert network_bytes(double_ring_steps(p, nodes, w, near, returns), p, w, sizes(hq, hkv, n)) == model("double_ring")
    # flat ring: the busiest rank is a node's last one
    flat = max(network_bytes(plain_ring_steps(p, cl.ranks, near, returns), p, w, sizes(hq, hkv, n))
               for p in range(cl.ranks))
    assert flat == model("ring")
    # ulysses: a flat ring over the rails of node shards (w n tokens, 1/w of the heads)
    hq_l, hk_l = hq // w, costmodel.ulysses_kv_heads(pr, w)
    got = network_bytes(plain_ring_steps(0, nodes, near, returns), 0, 1, sizes(hq_l, hk_l, w * n))
    assert got == model("ulysses_ring")


def test_double_ring_buffers():
    """Shards held at once: two inside a node (as the flat ring), three or four with the rail's."""
    assert lifetimes(double_ring_steps(0, 1, 4, "kv", ("q",)), 0)[2] == {"data": 2, "partial": 0}
    assert lifetimes(double_ring_steps(4, 3, 3, "kv", ("q",)), 4)[2]["data"] == 4
    assert lifetimes(plain_ring_steps(1, 4, "kv", ("kv", "q")), 1)[2] == {"data": 2, "partial": 3}


def test_arrange_orders_ranks_node_by_node():
    arrangement = arrange(["b", "a", "b", "a", "c", "c"])
    assert (arrangement.nodes, arrangement.per_node, arrangement.order) == (3, 2, (0, 2, 1, 3, 4, 5))
    assert arrange(["h"] * 8, ranks_per_node=4).order == tuple(range(8))
    with pytest.raises(TopologyError, match="same number of ranks"):
        arrange([0, 0, 1])
    with pytest.raises(TopologyError, match="does not divide"):
        arrange(["h"] * 6, ranks_per_node=4)
