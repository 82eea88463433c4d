"""A new mask of the interval model is written in the Mask alone: the schedules, the balance, the ring
engine and the block backend take it through the object, with no word of its kind (DESIGN.md, the one
mask object). The kind here, a prefix-LM mask (the first ``prefix`` tokens see each other, the rest
causal), lives only in this file: its intervals and, as the oracle, its dense definition."""
import numpy as np
import pytest

from burst_hpc.backends.numpy_backend import NumpyBackend
from burst_hpc.plan import masks, placement
from burst_hpc.plan.layout import make_layout
from burst_hpc.plan.schedule import block_pairs
from burst_testing import random_blocks
from test_schedule import PASSES, check_schedule


class Prefix(masks.Mask):
    """Prefix-LM: query i sees keys j < max(prefix, i + 1) (one interval per row, both ends non-decreasing)."""

    def __init__(self, seqlen, prefix):
        super().__init__(seqlen, causal=True)
        self.prefix, self.kind = prefix, "intervals"
        self.key = self.key + (("prefix", prefix),)

    @property
    def intervals(self):
        i = np.arange(self.seqlen, dtype=np.int64)
        return np.zeros_like(i), np.maximum(i + 1, self.prefix)


def dense(seqlen, prefix):
    """The oracle's view: key j visible from query i, from the definition."""
    i, j = np.arange(seqlen)[:, None], np.arange(seqlen)[None, :]
    return (j <= i) | (j < prefix)


def test_blocks_and_pairs_follow_the_definition(rng, seed):
    seqlen, size = 96, 4
    mask = Prefix(seqlen, int(rng.integers(1, seqlen)))
    seen = dense(seqlen, mask.prefix)
    random_blocks(mask, seen, rng, 50, f"seed={seed}")
    layout = make_layout("zigzag", seqlen, size)
    for a in range(size):
        for b in range(size):
            q_pos, k_pos = layout.indices(a), layout.indices(b)
            covered = np.zeros((q_pos.size, k_pos.size), int)
            for p in block_pairs(layout.pieces(a), layout.pieces(b), mask):
                covered[p.q, p.k] += 1
                assert p.masked == (not seen[np.ix_(q_pos[p.q], k_pos[p.k])].all()), f"seed={seed}"
            assert covered.max(initial=0) <= 1 and (covered[seen[np.ix_(q_pos, k_pos)]] == 1).all()
    assert masks.pair_work(mask, layout).sum() == seen.sum()


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "balanced"])
@pytest.mark.parametrize("near,returns", PASSES)
def test_the_ring_engine_runs_a_new_kind(layout, near, returns):
    """Every rank's schedule through ring.run (test_schedule.check_schedule): each visible pair once, each
    result home; on the balanced layout the work-aware schedule deals the new kind's work."""
    check_schedule(layout, 4, near, returns, 64, Prefix(64, 24))


def test_the_chunks_layout_places_a_new_kind():
    mask = Prefix(8 * 256, 700)
    placed = placement.place(mask, 8)
    assert placed.imbalance <= 1 + placement.TOLERANCE


def test_the_numpy_backend_masks_a_new_kind(rng, seed):
    """A block pair cut from the sequence, against softmax over the dense definition."""
    seqlen, prefix, q_start, k_start, sq, sk = 200, 70, 60, 20, 90, 120
    mask = Prefix(seqlen, prefix)
    q, k, v = (rng.standard_normal((1, n, 2, 8)) for n in (sq, sk, sk))
    o, lse = np.zeros(q.shape), np.full((1, 2, sq), -np.inf)
    NumpyBackend(16, 16).forward_block(q, k, v, o, lse, scale=0.5, masked=True, mask=mask, q_start=q_start,
                                       k_start=k_start)
    seen = dense(seqlen, prefix)[q_start:q_start + sq, k_start:k_start + sk]
    s = np.where(seen, np.einsum("bqhd,bkhd->bhqk", q, k) * 0.5, -np.inf)
    want_lse = np.logaddexp.reduce(s, axis=-1)
    want_o = np.einsum("bhqk,bkhd->bqhd", np.exp(s - want_lse[..., None]), v)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, err_msg=f"seed={seed}")
    np.testing.assert_allclose(o, want_o, rtol=1e-10, atol=1e-12, err_msg=f"seed={seed}")


@pytest.mark.parametrize("layout", ["zigzag", "balanced", "chunks"])
def test_the_cost_model_prices_a_new_kind(layout):
    """The Problem carries the mask: each pass's work is the new kind's visible pairs (the whole ring's)."""
    from burst_hpc.plan import costmodel
    from burst_hpc.plan.rates import GPU_RATES
    from burst_hpc.plan.workload import account

    mask = Prefix(4 * 256, 300)
    placed = make_layout(layout, mask.seqlen, 4, mask)
    problem = costmodel.Problem(1, mask.seqlen, 4, 4, 16, 2, mask)
    prediction = costmodel.predict("gather" if layout == "chunks" else "ring", problem, costmodel.Cluster(1, 4),
                                   GPU_RATES["H100"], placed)
    assert prediction.fwd.time > 0 and prediction.bwd.time > 0
    assert account(placed, mask, "ring", "forward").work.sum() == dense(mask.seqlen, mask.prefix).sum()
