"""The schedule: which block pairs run at each ring step, and that causal work balances."""
import itertools

import pytest

from burst_hpc.layout import layout_indices, pieces
from burst_hpc.schedule import block_pairs, steps, visit_pairs


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
            if not p.causal or b <= a:
                out.append((a, b))
    return out


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_causal_pairs_cover_each_visible_pair_once(layout, size):
    seqlen = 4 * size
    for r, s in itertools.product(range(size), repeat=2):
        qp, kp = tuple(pieces(seqlen, r, size, layout)), tuple(pieces(seqlen, s, size, layout))
        pairs = block_pairs(qp, kp, True)
        covered = covered_pairs(qp, kp, pairs)
        assert len(covered) == len(set(covered))
        assert set(covered) == visible_pairs(qp, kp)
        for p in pairs:  # global offsets match the local slices
            q_pos = [st + i for st, n in qp for i in range(n)]
            k_pos = [st + j for st, n in kp for j in range(n)]
            assert q_pos[p.q.start] == p.q_start and k_pos[p.k.start] == p.k_start
            if p.causal:  # masked pairs must be contiguous in global positions
                assert q_pos[p.q.stop - 1] - p.q_start == p.q.stop - 1 - p.q.start
                assert k_pos[p.k.stop - 1] - p.k_start == p.k.stop - 1 - p.k.start


def test_non_causal_is_one_call_per_step():
    for layout in ("contiguous", "zigzag"):
        qp, kp = tuple(pieces(16, 0, 4, layout)), tuple(pieces(16, 2, 4, layout))
        (pair,) = block_pairs(qp, kp, False)
        assert (pair.q, pair.k, pair.causal) == (slice(0, 4), slice(0, 4), False)


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_zigzag_balances_causal_work_and_fuses_full_blocks(size):
    seqlen = 8 * size
    work = []
    for r in range(size):
        total = 0
        for step in range(size):
            s = (r - step) % size
            pairs = block_pairs(tuple(pieces(seqlen, r, size, "zigzag")), tuple(pieces(seqlen, s, size, "zigzag")), True)
            if step > 0:
                assert len(pairs) == 1 and not pairs[0].causal  # one unmasked kernel call
            total += sum((p.q.stop - p.q.start) * (p.k.stop - p.k.start) for p in pairs)
        work.append(total)
    assert len(set(work)) == 1, work  # every rank computes the same number of block entries


def test_contiguous_causal_is_unbalanced():
    size, seqlen = 4, 32
    work = [sum((p.q.stop - p.q.start) * (p.k.stop - p.k.start)
                for s in range(size)
                for p in block_pairs(tuple(pieces(seqlen, r, size, "contiguous")),
                                     tuple(pieces(seqlen, s, size, "contiguous")), True)) for r in range(size)]
    assert work[0] < work[-1]


# --- steps: who computes what, and who sends what to whom (schedule.steps) ---------------

def visit_token_pairs(seqlen, rank, size, layout, visit):
    """The (global query, global key) pairs a visit computes."""
    mine, theirs = (tuple(pieces(seqlen, r, size, layout)) for r in (rank, visit.shard))
    q_pieces, k_pieces = (mine, theirs) if visit.side == "kv" else (theirs, mine)
    return covered_pairs(q_pieces, k_pieces, visit_pairs(q_pieces, k_pieces, True, visit.half))


def all_steps(layout, size, near, returns):
    plans = [steps(layout, True, r, size, near, returns) for r in range(size)]
    assert len({len(p) for p in plans}) == 1, "every rank runs the same number of steps"
    return plans


@pytest.mark.parametrize("near", ["kv", "q"])
@pytest.mark.parametrize("size", range(1, 10))
def test_balanced_computes_each_causal_pair_once_with_equal_work_per_step(size, near):
    local = 6
    seqlen = local * size
    plans = all_steps("balanced", size, near, ("kv", "q"))
    seen = []
    for t in range(len(plans[0])):
        work = []
        for r in range(size):
            visit = plans[r][t].visit
            assert visit is not None, f"rank {r} idles at step {t}"
            pairs = visit_token_pairs(seqlen, r, size, "balanced", visit)
            work.append(len(pairs))
            seen += pairs
        assert len(set(work)) == 1, f"P={size} step {t}: block entries per rank {work}"
    assert len(seen) == len(set(seen)), "a causal pair computed twice"
    assert set(seen) == {(a, b) for a in range(seqlen) for b in range(a + 1)}
    if size == 1:  # nothing to balance: the plain ring's one step
        return
    # the diagonal's query rows split between the first and the last step, P//2 steps between
    assert len(plans[0]) == size // 2 + 2
    for r in range(size):
        first, last = plans[r][0].visit, plans[r][-1].visit
        assert (first.shard, first.half, last.shard, last.half) == (r, 0, r, 1)
        assert all(m.what == "data" for m in plans[r][0].recvs)
        assert all(m.what == "partial" for m in plans[r][-1].sends + plans[r][-1].recvs)


@pytest.mark.parametrize("size", [2, 4, 6, 8])
def test_even_ranks_split_the_half_distance_pairs_by_query_rows(size):
    """DistFlashAttn leaves half the ranks idle at step P/2; here each P/2 pair is cut in two."""
    t = size // 2
    for r in range(size):
        visit = steps("balanced", True, r, size, "kv", ("q",))[t].visit
        if r >= size // 2:
            assert (visit.side, visit.shard, visit.half) == ("kv", r - size // 2, 0)
        else:
            assert (visit.side, visit.shard, visit.half) == ("q", r + size // 2, 1)


@pytest.mark.parametrize("size", [3, 5, 7])
def test_odd_ranks_near_pairs_go_to_the_side_that_travels(size):
    """Step s: distance s on the rank ``near`` travels to, distance P - s on the other owner."""
    for near, far in (("kv", "q"), ("q", "kv")):
        for s in range(1, size // 2 + 1):
            for r in range(size):
                visit = steps("balanced", True, r, size, near, ("q",))[s].visit
                near_source = (r - s) % size if near == "kv" else (r + s) % size
                expected = near if (r - s >= 0 if near == "kv" else r + s < size) else far
                assert visit.side == expected and visit.shard == near_source


def simulate(layout, size, near, returns, local=4):
    """Run every rank's steps in lockstep with token-pair sets for arrays; checks that each
    message is received as sent and that data is where the schedule says. Returns each rank's
    query-side and key-side results."""
    seqlen = local * size
    plans = all_steps(layout, size, near, returns)
    query_side = [set() for _ in range(size)]
    key_side = [set() for _ in range(size)]
    holds = [dict() for _ in range(size)]   # side -> shard whose data this rank holds now
    outgoing = [dict() for _ in range(size)]
    for t in range(len(plans[0])):
        sent = {}
        for r in range(size):
            for m in plans[r][t].sends:
                if m.what == "data":
                    assert m.shard == r or holds[r].get(m.side) == m.shard, (r, t, m)
                    payload = m.shard
                else:
                    payload = outgoing[r].pop(m.side)
                    assert payload[0] == m.shard
                key = (r, m.peer, m.what, m.side, m.shard)
                assert key not in sent, f"two identical messages {key}"
                sent[key] = payload
        partial_now = [None] * size
        for r in range(size):
            step = plans[r][t]
            kinds = [(m.what, m.side) for m in step.recvs]
            assert len(kinds) == len(set(kinds)), f"rank {r} step {t} receives twice into one buffer"
            if step.visit is None:
                continue
            v = step.visit
            assert v.shard == r or holds[r].get(v.side) == v.shard, (r, t, v)
            done = set(visit_token_pairs(seqlen, r, size, layout, v))
            (query_side if v.side == "kv" else key_side)[r].update(done)
            partial_now[r] = [v.shard, set(done)]
        for r in range(size):
            step = plans[r][t]
            for m in step.recvs:
                payload = sent.pop((m.peer, r, m.what, m.side, m.shard))
                if m.what == "data":
                    holds[r][m.side] = payload
                    continue
                shard, pairs = payload
                if shard == r:
                    (key_side if m.side == "kv" else query_side)[r].update(pairs)
                else:
                    assert step.visit and (step.visit.side, step.visit.shard) == (m.side, shard)
                    partial_now[r][1].update(pairs)
            v = step.visit
            if v is None:
                continue
            later = plans[r][t + 1].sends if t + 1 < len(plans[r]) else ()
            if any((m.what, m.side, m.shard) == ("partial", v.side, v.shard) for m in later):
                outgoing[r][v.side] = partial_now[r]
            elif v.side in returns:
                assert v.shard == r, f"rank {r} drops the partial of {v}"
                (key_side if v.side == "kv" else query_side)[r].update(partial_now[r][1])
        assert not sent, f"sent but never received: {list(sent)}"
    return query_side, key_side, seqlen


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "balanced"])
@pytest.mark.parametrize("near,returns", [("kv", ("q",)), ("kv", ("kv", "q")), ("q", ("kv", "q"))])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8, 9])
def test_every_message_is_matched_and_every_result_comes_home(layout, size, near, returns):
    query_side, key_side, seqlen = simulate(layout, size, near, returns)
    for r in range(size):
        tokens = set(layout_indices(seqlen, r, size, layout).tolist())
        visible = {(a, b) for a in range(seqlen) for b in range(a + 1)}
        assert query_side[r] == {p for p in visible if p[0] in tokens}
        if "kv" in returns:
            assert key_side[r] == {p for p in visible if p[1] in tokens}


def test_balanced_sends_one_shard_per_rank_and_step():
    """Odd P: at every exchange but the last two each rank sends its own data once and receives
    one shard; partials move one step later."""
    size = 5
    for r in range(size):
        plan = steps("balanced", True, r, size, "kv", ("kv", "q"))
        for t, step in enumerate(plan[:-2]):
            data = [m for m in step.sends if m.what == "data"]
            assert len(data) == 1 and data[0].shard == r
            assert len([m for m in step.recvs if m.what == "data"]) == 1
        assert all(m.what == "partial" for m in plan[-1].sends + plan[-1].recvs)


@pytest.mark.parametrize("size", [2, 3, 5])
def test_a_shortened_ring_sends_each_partial_straight_home(size):
    """Documents or a window can stop the ring after T < P steps (masks.ring_steps): the last
    exchange sends each carried partial to its owner, one message each way."""
    from burst_hpc.schedule import Transfer, plain_ring_steps

    for count in range(1, size + 1):
        plans = [plain_ring_steps(r, size, "kv", ("kv", "q"), count) for r in range(size)]
        for r, plan in enumerate(plans):
            assert [s.visit.shard for s in plan[:count]] == [(r - t) % size for t in range(count)]
            if count == 1:  # nothing travels: the partial of its own shard stays
                assert len(plan) == 1 and not plan[0].sends and not plan[0].recvs
                continue
            (send,), (recv,) = plan[-1].sends, plan[-1].recvs
            assert send.peer == send.shard == (r - count + 1) % size  # to the owner of what it visited last
            assert recv.shard == r and recv.peer == (r + count - 1) % size
            assert Transfer(r, "partial", "kv", send.peer) in plans[send.peer][-1].recvs
