"""The schedule: which block pairs run at each ring step, and that causal work balances."""
import itertools
import queue
import threading
from unittest import mock

import numpy as np
import pytest

from burst_hpc.plan import balance, masks, schedule, workplan
from burst_hpc.engine import ring
from burst_hpc.plan.layout import layout_indices, make_layout
from burst_hpc.engine.ring import lifetimes
from burst_hpc.plan.schedule import block_pairs, steps, visit_pairs


def pieces(seqlen, rank, size, kind):
    return make_layout(kind, seqlen, size).pieces(rank)


def visible_pairs(q_pieces, k_pieces):
    """Brute force: the set of (global query, global key) pairs with key <= query."""
    qs = [s + i for s, n in q_pieces for i in range(n)]
    ks = [s + j for s, n in k_pieces for j in range(n)]
    return {(a, b) for a in qs for b in ks if b <= a}


def covered_pairs(q_pieces, k_pieces, pairs):
    q_pos = [s + i for s, n in q_pieces for i in range(n)]
    k_pos = [s + j for s, n in k_pieces for j in range(n)]
    out = []
    for p in pairs:
        for i, j in itertools.product(range(p.q.start, p.q.stop), range(p.k.start, p.k.stop)):
            a, b = q_pos[i], k_pos[j]
            if not p.masked or b <= a:
                out.append((a, b))
    return out


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_causal_pairs_cover_each_visible_pair_once(layout, size):
    seqlen = 4 * size
    for r, s in itertools.product(range(size), repeat=2):
        qp, kp = tuple(pieces(seqlen, r, size, layout)), tuple(pieces(seqlen, s, size, layout))
        pairs = block_pairs(qp, kp, masks.make(seqlen, True))
        covered = covered_pairs(qp, kp, pairs)
        assert len(covered) == len(set(covered))
        assert set(covered) == visible_pairs(qp, kp)
        for p in pairs:  # global offsets match the local slices
            q_pos = [st + i for st, n in qp for i in range(n)]
            k_pos = [st + j for st, n in kp for j in range(n)]
            assert q_pos[p.q.start] == p.q_start and k_pos[p.k.start] == p.k_start
            if p.masked:  # masked pairs must be contiguous in global positions
                assert q_pos[p.q.stop - 1] - p.q_start == p.q.stop - 1 - p.q.start
                assert k_pos[p.k.stop - 1] - p.k_start == p.k.stop - 1 - p.k.start


def test_non_causal_is_one_call_per_step():
    for layout in ("contiguous", "zigzag"):
        qp, kp = tuple(pieces(16, 0, 4, layout)), tuple(pieces(16, 2, 4, layout))
        (pair,) = block_pairs(qp, kp, masks.make(16))
        assert (pair.q, pair.k, pair.masked) == (slice(0, 4), slice(0, 4), False)


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_zigzag_balances_causal_work_and_fuses_full_blocks(size):
    seqlen = 8 * size
    work = []
    for r in range(size):
        total = 0
        for step in range(size):
            s = (r - step) % size
            pairs = block_pairs(tuple(pieces(seqlen, r, size, "zigzag")), tuple(pieces(seqlen, s, size, "zigzag")),
                                 masks.make(seqlen, True))
            if step > 0:
                assert len(pairs) == 1 and not pairs[0].masked  # one unmasked kernel call
            total += sum((p.q.stop - p.q.start) * (p.k.stop - p.k.start) for p in pairs)
        work.append(total)
    assert len(set(work)) == 1, work  # every rank computes the same number of block entries


def test_contiguous_causal_is_unbalanced():
    size, seqlen = 4, 32
    work = [sum((p.q.stop - p.q.start) * (p.k.stop - p.k.start)
                for s in range(size)
                for p in block_pairs(tuple(pieces(seqlen, r, size, "contiguous")),
                                     tuple(pieces(seqlen, s, size, "contiguous")), masks.make(seqlen, True))) for r in range(size)]
    assert work[0] < work[-1]


# --- steps: who computes what, and who sends what to whom (schedule.steps) ---------------
#
# The real engine (ring.run) runs every rank's steps in threads over an in-process transport. A
# shard's travelling arrays hold its number (so a visit checks it meets the right data); results
# are (local rows, S) count matrices: a visit adds 1 for every (query, key) pair its block pairs
# cover, partials add into their owner's. At the end every rank's query-side counts must be its
# rows of the visible matrix exactly (each visible pair once, no hidden one), and with returned
# key sides the same for its keys; and the buffers the engine's pool allocated are the peak
# ring.lifetimes predicts.

class ThreadTransport:
    """In-process transport for ranks in threads: arrays are copied when posted, each into the slot
    of its place among those sent from one rank to another on this lane; a receive takes the slot
    of its place among those posted (both ends post in the same order, as MPI matches messages),
    so exchanges may complete in any order (a transfer due steps later)."""

    def __init__(self, rank, size, queues, lane=0):
        self.rank, self.size, self.xp, self.queues, self.lane = rank, size, np, queues, lane
        self.sent, self.posted = {}, {}

    def slot(self, counts, a, b):
        n = counts.get((a, b), 0)
        counts[(a, b)] = n + 1
        with self.queues["lock"]:
            return self.queues.setdefault((a, b, self.lane, n), queue.Queue())

    def exchange(self, sends, recvs):
        for peer, arrays in sends:
            for a in arrays:
                self.slot(self.sent, self.rank, peer).put(np.array(a, copy=True))
        slots = [(self.slot(self.posted, peer, self.rank), a) for peer, arrays in recvs for a in arrays]

        class Handle:
            def wait(self):
                for q, a in slots:
                    a[...] = q.get(timeout=20)
        return Handle()


class CountingPool(ring._Pool):
    def __init__(self, xp, sides):
        super().__init__(xp, sides)
        self.made = {"data": 0, "partial": 0}

    def take(self, kind, side, rows=None):
        if not self.free.get((kind, side, ring.size_class(rows))):
            self.made[kind] += 1
        return super().take(kind, side, rows)


def run_ranks(plans, seqlen, pieces_of, mask, returns):
    """Every rank's plan through ring.run; returns each rank's (query counts, key counts, pool)."""
    size = len(plans)
    queues = {"lock": threading.Lock()}
    out, errors = [None] * size, []

    def rank_main(r):
        try:
            n = sum(length for _, length in pieces_of(r))
            sides = {"q": ring.Side([np.full((n, 2), r)], [np.zeros((n, seqlen))], (0,), _add, (0,), (0,)),
                     "kv": ring.Side([np.full((n, 2), r)], [np.zeros((n, seqlen))] if "kv" in returns else [], (0,),
                                     _add, (0,), (0,))}
            def compute(visit, q_data, kv_data, q_out, k_out, offset):
                assert (q_data[0] == visit.q_shard).all() and (kv_data[0] == visit.kv_shard).all(), (r, visit)
                assert len(q_data[0]) == len(q_out[0]) and (visit.rows is None or len(q_data[0]) >= visit.rows[1] - offset)
                q_pos = [s + i for s, m in pieces_of(visit.q_shard) for i in range(m)]
                k_pos = [s + i for s, m in pieces_of(visit.kv_shard) for i in range(m)]
                for p in visit_pairs(pieces_of(visit.q_shard), pieces_of(visit.kv_shard), mask, visit.rows):
                    for a, b in itertools.product(range(p.q.start, p.q.stop), range(p.k.start, p.k.stop)):
                        if not p.masked or visible(mask, q_pos[a], k_pos[b]):
                            q_out[0][a - offset, k_pos[b]] += 1
                            if k_out:
                                k_out[0][b, q_pos[a]] += 1

            ring.run(ThreadTransport(r, size, queues), ThreadTransport(r, size, queues, 1), ring.Route(plans[r], r),
                     sides, compute, inner=ThreadTransport(r, size, queues, 2))
            out[r] = (sides["q"].results[0], sides["kv"].results[0] if "kv" in returns else None,
                      pools[threading.get_ident()])
        except BaseException as e:  # reported by the main thread
            errors.append((r, e))

    pools = {}

    def pool(xp, sides_):
        pools[threading.get_ident()] = CountingPool(xp, sides_)
        return pools[threading.get_ident()]

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    with mock.patch.object(ring, "_Pool", pool):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    return out


def _add(into, part):
    for a, b in zip(into, part):
        a += b


def visible(mask, i, j):
    lo, hi = mask.intervals
    return lo[i] <= j < hi[i]


def check_schedule(layout, size, near, returns, seqlen, mask=None, nodes=None):
    """Runs every rank's steps and checks the results, the messages and the buffers (``mask``: plain
    causal unless given; ``nodes``: the node of each rank, for the balanced schedule)."""
    mask = masks.make(seqlen, True) if mask is None else mask
    plans = [steps(make_layout(layout, seqlen, size), r, near, returns, mask, nodes) for r in range(size)]
    assert len({len(p) for p in plans}) == 1, "every rank runs the same number of steps"

    def pieces_of(r):
        return tuple(pieces(seqlen, r, size, layout))

    results = run_ranks(plans, seqlen, pieces_of, mask, returns)
    truth = np.array([[visible(mask, i, j) for j in range(seqlen)] for i in range(seqlen)], float)
    for r, (q_counts, k_counts, pool) in enumerate(results):
        tokens = layout_indices(seqlen, r, size, layout)
        np.testing.assert_array_equal(q_counts, truth[tokens], err_msg=f"rank {r} query side")
        if k_counts is not None:
            np.testing.assert_array_equal(k_counts, truth[:, tokens].T, err_msg=f"rank {r} key side")
        assert pool.made == lifetimes(plans[r], r)[2], (r, pool.made)
    return plans


PASSES = [("kv", ("q",)), ("kv", ("kv", "q")), ("q", ("kv", "q"))]   # forward, kv-ring, q-ring


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "balanced"])
@pytest.mark.parametrize("near,returns", PASSES)
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8])
def test_every_visible_pair_once_and_every_result_home_causal(layout, size, near, returns):
    check_schedule(layout, size, near, returns, 4 * size)


@pytest.fixture(params=["priced", "free"])
def network(request, monkeypatch):
    """The balanced schedule as priced (at these small shapes moves between nodes rarely pay), and
    with a free network (every move between nodes pays: helpers across nodes, relays, transfers
    posted steps ahead all run)."""
    if request.param == "free":
        monkeypatch.setattr(balance, "WORTH", float("inf"))
        monkeypatch.setattr(balance, "NIC_SHARE", float("inf"))
    caches = (balance.assign, workplan.work_plan, schedule.work_transfers, schedule.transfers_of, schedule.work_steps,
              schedule.steps)
    for f in caches:
        f.cache_clear()
    yield request.param
    for f in caches:
        f.cache_clear()


@pytest.mark.parametrize("near,returns", PASSES)
@pytest.mark.parametrize("size,per_node", [(2, None), (3, None), (5, None), (8, None)])
@pytest.mark.parametrize("seed", range(3))
def test_balanced_schedule_for_random_masks(size, per_node, near, returns, seed):
    """Random documents, windows and their compositions, causal or not, on one node."""
    check_random_mask(size, per_node, near, returns, seed)


@pytest.mark.parametrize("near,returns", PASSES)
@pytest.mark.parametrize("size,per_node", [(4, 2), (6, 2), (8, 4)])
@pytest.mark.parametrize("seed", range(3))
def test_balanced_schedule_for_random_masks_across_nodes(size, per_node, near, returns, seed, network):
    """The same on several nodes (key chunks relayed inside a node, schedule.relays; transfers
    between nodes posted steps before they are due)."""
    check_random_mask(size, per_node, near, returns, seed)


def check_random_mask(size, per_node, near, returns, seed):
    rng = np.random.default_rng(1000 * size + seed)
    seqlen = size * int(rng.choice([4, 8, 12]))
    causal = bool(rng.integers(2))
    docs = masks.random_documents(rng, seqlen, int(rng.integers(1, seqlen // 2 + 1))) if rng.integers(3) else None
    window = (int(rng.integers(0, seqlen)), int(rng.integers(-1, 3))) if docs is None or rng.integers(2) else None
    mask = masks.make(seqlen, causal, window, docs)
    if mask.kind != "intervals":   # one document: the interval kernels' path, full attention included
        mask = masks.make(seqlen, causal, None, np.array([0, seqlen]))
    nodes = None if per_node is None else tuple(r // per_node for r in range(size))
    plans = check_schedule("balanced", size, near, returns, seqlen, mask, nodes)
    assert all(not s.recvs or all(t.what == "data" for t in s.recvs) for s in (p[0] for p in plans))
    for r, plan in enumerate(plans):   # step 0 needs nothing from anyone
        assert all(v.q_shard == v.kv_shard == r for v in plan[0].visits)


def test_balanced_plain_causal_is_even_at_every_step():
    """The plain causal mask on contiguous shards: every rank and step within a few % of the mean."""
    from burst_hpc.plan.workplan import work_plan

    for size in (4, 8, 16):
        mask = masks.Mask(1024 * size, True, None, None)
        _, work = work_plan(mask, size, "kv", ("q",))
        assert work.max(axis=1).sum() <= 1.05 * work.sum() / size


@pytest.mark.parametrize("size", [2, 3, 5])
def test_a_shortened_ring_sends_each_partial_straight_home(size):
    """Documents or a window can stop the ring after T < P steps (masks.ring_steps): the last
    exchange sends each carried partial to its owner, one message each way."""
    from burst_hpc.plan.schedule import Transfer, plain_ring_steps

    for count in range(1, size + 1):
        plans = [plain_ring_steps(r, size, "kv", ("kv", "q"), count) for r in range(size)]
        for r, plan in enumerate(plans):
            assert [s.visits[0].kv_shard for s in plan[:count]] == [(r - t) % size for t in range(count)]
            if count == 1:  # nothing travels: the partial of its own shard stays
                assert len(plan) == 1 and not plan[0].sends and not plan[0].recvs
                continue
            (send,), (recv,) = plan[-1].sends, plan[-1].recvs
            assert send.peer == send.shard == (r - count + 1) % size  # to the owner of what it visited last
            assert recv.shard == r and recv.peer == (r + count - 1) % size
            assert Transfer(r, "partial", "kv", send.peer) in plans[send.peer][-1].recvs


def test_key_chunks_cross_the_network_once_per_node(network):
    """Across nodes a key chunk goes from its owner to one rank of each other node; the ranks there
    that need it a step later get it from that rank (schedule.relays), and the schedule still
    computes every visible pair once with every partial home."""
    from burst_hpc.plan.schedule import work_transfers

    size, per_node = 8, 2
    nodes = tuple(r // per_node for r in range(size))
    mask = masks.make(size * 16, True, None, masks.random_documents(np.random.default_rng(3), size * 16, 2))
    for near, returns in PASSES:
        check_schedule("balanced", size, near, returns, size * 16, mask, nodes)
        _, moves = work_transfers(mask, size, near, returns, nodes)
        data = [(t, sender, receiver, shard, due) for t, sender, receiver, what, side, shard, _, due in moves
                if what == "data" and side == "kv"]
        relayed = [m for m in data if m[1] != m[3]]
        assert relayed or near == "q", near   # the q-ring moves key chunks only to helpers
        for t, sender, receiver, shard, _ in relayed:
            assert nodes[sender] == nodes[receiver] != nodes[shard]
            # the relay has received it from the owner before it passes it on
            assert any(s == shard and r == sender and due < t for _, s, r, j, due in data if j == shard)


def test_transfers_between_nodes_are_posted_steps_before_they_are_due(network):
    """Between nodes data is posted up to LEAD steps before the step it is due at (the step before
    its first use), as early as step 0, and a partial is due up to LEAD steps after it is posted:
    the network carries them under several steps of compute. Inside a node data is posted
    INNER_LEAD steps early (a relay: once it has it) and a partial going home is due INNER_LAG steps
    late, on the inner lane
    (Transfer.inner); one bound for its node's summer completes in the step that posts it."""
    from burst_hpc.plan.schedule import INNER_LAG, INNER_LEAD, LEAD, work_transfers

    size, per_node = 16, 4
    nodes = tuple(r // per_node for r in range(size))
    seqlen = size * 64
    mask = masks.make(seqlen, True, None, masks.random_documents(np.random.default_rng(5), seqlen, 3))
    for near, returns in PASSES:
        count, moves = work_transfers(mask, size, near, returns, nodes)
        early = inner_early = 0
        for t, sender, receiver, what, side, shard, _, due in moves:
            if nodes[sender] == nodes[receiver]:
                if what == "data":   # a relay posts no sooner than the step it has the data from
                    assert t == max(0, due - INNER_LEAD) or (sender != shard and due - INNER_LEAD < t <= due)
                else:
                    assert due == (t if receiver != shard else min(count - 1, t + INNER_LAG))
                inner_early += due > t
            elif what == "data":
                assert due == t + LEAD or (t == 0 and due < LEAD)
                early += due > t
            else:
                assert due == min(count - 1, t + LEAD)
        assert early and inner_early, (near, returns)
        for r in range(size):
            for step in steps(make_layout("balanced", seqlen, size), r, near, returns, mask, nodes):
                for x in step.sends + step.recvs:
                    assert x.inner == (x.due is not None and nodes[x.peer] == nodes[r])


def test_key_partials_are_summed_inside_a_node_before_they_cross(network):
    """Across nodes the dK/dV partials of one key chunk leave a node once: the node's other
    contributors send theirs over the node's links to the one that contributes last, which has them
    before it sends the sum home (the engine adds them, check_schedule counts every pair home)."""
    from burst_hpc.plan.schedule import work_transfers

    size, per_node = 8, 2
    nodes = tuple(r // per_node for r in range(size))
    mask = masks.make(size * 16, True, None, masks.random_documents(np.random.default_rng(3), size * 16, 2))
    summed = 0
    for near, returns in PASSES[1:]:
        check_schedule("balanced", size, near, returns, size * 16, mask, nodes)
        count, moves = work_transfers(mask, size, near, returns, nodes)
        partials = [(t, sender, receiver, shard, due) for t, sender, receiver, what, side, shard, _, due in moves
                    if what == "partial" and side == "kv"]
        # more than once only for a partial made at the last step (no step left to reach the summing rank)
        crossing = [(nodes[s], shard) for t, s, r, shard, _ in partials if nodes[s] != nodes[r] and t < count - 1]
        assert len(crossing) == len(set(crossing))
        for t, sender, receiver, shard, _ in partials:
            if receiver != shard:   # to the node's summing rank, which sends the sum afterwards
                summed += 1
                assert nodes[sender] == nodes[receiver] != nodes[shard]
                assert [due for t2, s, r, j, due in partials if s == receiver and j == shard and t2 > t]
    if network == "free":
        assert summed


def test_one_node_data_is_posted_a_step_before_it_is_due():
    """On one node data leaves its owner INNER_LEAD steps before the step it is due at (the first
    pieces arrive under two steps of compute, not one) and partials are due INNER_LAG steps after
    they are posted, all of those on the inner lane; the engine still computes every pair once."""
    from burst_hpc.plan.schedule import INNER_LAG, INNER_LEAD, work_transfers

    size = 8
    mask = masks.make(size * 64, True, None, masks.random_documents(np.random.default_rng(7), size * 64, 3))
    for near, returns in PASSES:
        check_schedule("balanced", size, near, returns, size * 64, mask, None)
        count, moves = work_transfers(mask, size, near, returns, None)
        for t, sender, receiver, what, side, shard, _, due in moves:
            assert t == (max(0, due - INNER_LEAD) if what == "data" else due - min(INNER_LAG, count - 1 - t))
        assert any(due > t for t, *_, due in moves)
        for r in range(size):
            for step in steps(make_layout("balanced", size * 64, size), r, near, returns, mask):
                assert all(x.inner == (x.due is not None) for x in step.sends + step.recvs)


@pytest.mark.parametrize("size", [3, 4, 8])
def test_a_gather_visit_is_one_call_over_its_held_keys(size, rng):
    """packed visit_pairs: a gather visit (a rank's query rows against the runs of a shard it holds) is one block
    call whose Packed mask gives every row exactly the held keys it sees, as many visible pairs as the visit's
    chunk pairs; held keys out of global order keep the chunk pairs."""
    from burst_hpc.plan.layout import as_layout

    seqlen = 64 * size * 4
    cu = masks.random_documents(rng, seqlen, int(rng.integers(2, 12)))
    mask = masks.make(seqlen, True, None, cu)
    layout = as_layout("chunks", seqlen, size, causal=True, cu_seqlens=cu, window=None)
    lo_g, hi_g = mask.intervals
    for a in range(size):
        for b in range(size):
            pieces = layout.pieces(a)
            n = sum(length for _, length in pieces)
            keys = ((0, 32), (64, sum(length for _, length in layout.pieces(b))))
            held = schedule.held_pieces(layout.pieces(b), keys)
            rows = tuple(sorted(int(x) for x in rng.integers(0, n + 1, 2)))
            plain = visit_pairs(pieces, held, mask, rows)
            packed = visit_pairs(pieces, held, mask, rows, packed=True)
            assert len(packed) <= 1
            assert sum(p.visible(mask) for p in packed) == sum(p.visible(mask) for p in plain)
            if packed:
                (p,) = packed
                positions = np.concatenate([np.arange(s, s + k) for s, k in held])
                queries = np.concatenate([np.arange(s, s + k) for s, k in pieces])[p.q]
                lo, hi = p.mask.rows(p.q_start, p.q.stop - p.q.start)
                for i, g in enumerate(queries):
                    seen = np.flatnonzero((positions >= lo_g[g]) & (positions < hi_g[g]))
                    assert np.array_equal(np.arange(lo[i], hi[i]), seen)
    shuffled = ((64, 32), (0, 32))   # held keys out of global order
    assert visit_pairs(((0, 128),), shuffled, mask, None, packed=True) == visit_pairs(((0, 128),), shuffled, mask)


def test_the_stepped_gather_prepares_the_kernels_its_packed_visits_launch():
    """RingPasses.mask (what a CallPlan prepares the kernels for): the stepped gather's visits run the interval
    kernels under a causal call mask; the ring runs the call's mask; a full mask keeps the chunk pairs."""
    from types import SimpleNamespace

    from burst_hpc.backends.cuda.contract import mask_mode
    from burst_hpc.engine.passes import RingPasses

    def prepared(scheme, mask):
        plan = SimpleNamespace(decomposition=SimpleNamespace(scheme=SimpleNamespace(name=scheme), mask=mask))
        return RingPasses(plan).mask

    causal, full = masks.make(256, True), masks.make(256)
    assert mask_mode(True, prepared("gather", causal)) == "interval"
    assert prepared("ring", causal) is causal and prepared("gather", full) is full
