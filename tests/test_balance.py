"""The balanced layout's work-aware schedule: critical path over mean work (workload.schedule_work's
account) for fixed document sets at 8-64 ranks with 8k tokens per rank, against the issue's bar,
and schedule_work's own checks."""
import numpy as np
import pytest

import burst_hpc
from burst_hpc.errors import LayoutError, MaskError
from burst_hpc.plan.workload import documents

TOKENS = 8192


def ratio(work):
    """Critical path (the busiest rank of every step) over the mean rank's work."""
    return work.max(axis=1).sum() * work.shape[1] / work.sum()


def document_set(kind, seqlen, seed):
    rng = np.random.default_rng(seed)
    if kind == "capped":          # MagiAttention's benchmark: documents up to S/4
        return documents(rng, seqlen, "capped", longest=seqlen // 4)
    return documents(rng, seqlen, "lognormal", median=2048)   # long-tailed, median 2k tokens


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kind", ["capped", "lognormal"])
@pytest.mark.parametrize("ranks", [8, 16, 32, 64])
def test_documents_balance_within_10_percent(ranks, kind, causal):
    seqlen = TOKENS * ranks
    cu = document_set(kind, seqlen, seed=ranks)
    work = burst_hpc.schedule_work(seqlen, ranks, causal=causal, cu_seqlens=cu)
    assert ratio(work) <= 1.10, (ranks, kind, causal, ratio(work))
    for layout in ("contiguous", "zigzag"):   # what the balanced schedule is for: the others are far off
        other = burst_hpc.schedule_work(seqlen, ranks, causal=causal, cu_seqlens=cu,
                                       layout=burst_hpc.make_layout(layout, seqlen, ranks))
        assert other.sum() == work.sum()      # the same visible pairs, computed once
        if causal and ranks >= 16:
            assert ratio(other) > 1.5


@pytest.mark.parametrize("ranks", [8, 16, 32, 64])
def test_plain_causal_and_windows(ranks):
    seqlen = TOKENS * ranks
    assert ratio(burst_hpc.schedule_work(seqlen, ranks, causal=True)) <= 1.05
    for window in ((4096, 0), (3 * TOKENS, 0), (2048, 2048)):
        work = burst_hpc.schedule_work(seqlen, ranks, causal=window[1] == 0, window=window)
        assert ratio(work) <= 1.10, (ranks, window, ratio(work))


def test_backward_and_step_zero():
    seqlen, ranks = 64 * 16, 16
    cu = document_set("capped", seqlen, 0)
    fwd = burst_hpc.schedule_work(seqlen, ranks, causal=True, cu_seqlens=cu)
    bwd = burst_hpc.schedule_work(seqlen, ranks, causal=True, cu_seqlens=cu, direction="backward")
    assert fwd.sum() == bwd.sum() and ratio(bwd) <= 1.10
    plain = burst_hpc.schedule_work(seqlen, ranks, layout=burst_hpc.make_layout("contiguous", seqlen, ranks))
    assert plain.shape == (ranks, ranks) and (plain == (seqlen // ranks) ** 2).all()


def test_schedule_work_refuses_bad_arguments():
    with pytest.raises(LayoutError, match="balanced layout: it must be a multiple of 8"):
        burst_hpc.schedule_work(100, 8, causal=True)
    with pytest.raises(LayoutError, match="of 64 tokens over 8 ranks; the call's sequence is 128"):
        burst_hpc.schedule_work(128, 8, layout=burst_hpc.make_layout("zigzag", 64, 8))
    with pytest.raises(LayoutError, match="layout must be a Layout"):
        burst_hpc.schedule_work(64, 8, layout="zigzag")
    with pytest.raises(MaskError, match="cu_seqlens"):
        burst_hpc.schedule_work(64, 8, cu_seqlens=[0, 10])
    with pytest.raises(burst_hpc.BurstError, match="direction"):
        burst_hpc.schedule_work(64, 8, causal=True, direction="sideways")


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "balanced"])
@pytest.mark.parametrize("causal", [True, False])
def test_schedule_work_counts_the_schedules_visits(layout, causal):
    """schedule_work's account equals a direct count of every visit of every rank's steps."""
    from burst_hpc.plan import masks
    from burst_hpc.plan.schedule import steps
    from burst_hpc.plan.layout import make_layout
    from burst_hpc.plan.workload import visit_work

    size, seqlen = 6, 6 * 40
    cu = document_set("capped", seqlen, 3)
    for window in (None, (30, 5)):
        mask = masks.make(seqlen, causal, window, cu)
        placed = make_layout(layout, seqlen, size)
        work = burst_hpc.schedule_work(seqlen, size, causal=causal, window=window, cu_seqlens=cu, layout=placed,
                                       direction="backward")
        for r in range(size):
            plan = steps(placed, r, "kv", ("kv", "q"), mask)
            assert len(plan) == len(work)
            assert [sum(visit_work(mask, placed, v) for v in s.visits) for s in plan] == list(work[:, r])
