"""The schedule: which block pairs run at each ring step, and that causal work balances."""
import itertools

import pytest

from burst_hpc.layout import pieces
from burst_hpc.schedule import block_pairs


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
