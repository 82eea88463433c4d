"""Non-finite inputs through the ring (DESIGN.md, "What every call promises"; issue 24): a NaN or Inf in
q, k or v reaches, on every rank's shard, exactly the outputs the float64 oracle on the whole sequence
says it reaches: across the ranks' merges (GAO), the balanced layout's returned partials, and both
backward rings. CPU path; runs under mpiexec with 1..5 ranks."""
import numpy as np
import pytest

import burst_hpc
from burst_hpc.plan import masks
from burst_hpc.reference import attention_backward_reference, attention_reference
from test_ring import shared_rng

LOCAL = 10  # tokens per rank: zigzag halves of 5
NAMES = ("o", "lse", "dq", "dk", "dv")

CASES = [  # (where, value, causal, window, documents, layout)
    ("q", np.nan, True, None, False, "zigzag"),
    ("k", np.nan, True, None, False, "balanced"),
    ("k", np.nan, False, None, False, "contiguous"),
    ("k", np.inf, True, None, False, "zigzag"),
    ("q", -np.inf, True, None, True, "contiguous"),
    ("k", np.nan, True, None, True, "balanced"),
    ("v", np.nan, True, None, True, "zigzag"),
    ("v", np.inf, False, (4, 3), False, "contiguous"),
    ("k", np.nan, True, (6, 0), False, "balanced"),
    ("q", np.nan, False, (3, 3), True, "zigzag"),
]


def _assert_like(name, got, ref, ctx):
    """Non-finite exactly where the oracle is, -inf exactly where it is -inf, close elsewhere."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    differ = np.isfinite(got) != np.isfinite(ref)
    assert not differ.any(), (f"{ctx}: {name} finite where the oracle is not, or the reverse, at "
                              f"{np.argwhere(differ)[:5].tolist()} (of {int(differ.sum())})")
    assert np.array_equal(np.isneginf(got), np.isneginf(ref)), f"{ctx}: {name} -inf where the oracle is not"
    both = np.isfinite(ref)
    if both.any():
        np.testing.assert_allclose(got[both], ref[both], atol=2e-5, rtol=1e-4, err_msg=f"{ctx}: {name}")


@pytest.mark.parametrize("where,value,causal,window,documents,layout", CASES)
def test_nonfinite_through_the_ring(comm, where, value, causal, window, documents, layout):
    P, r = comm.size, comm.rank
    rng, seed = shared_rng(comm)
    seqlen = LOCAL * P
    cu = masks.random_documents(rng, seqlen, int(rng.integers(1, seqlen // 4 + 2))) if documents else None
    q, k, v, do = (rng.standard_normal((1, seqlen, h, 8)) for h in (4, 2, 2, 4))
    x = {"q": q, "k": k, "v": v}[where]
    spot = tuple(int(rng.integers(0, n)) for n in x.shape)
    x[spot] = value
    kw = dict(causal=causal, window=window, cu_seqlens=cu)
    ref = (*attention_reference(q, k, v, **kw), *attention_backward_reference(do, q, k, v, **kw))
    ctx = f"seed {seed} {where}{list(spot)}={value} {kw} layout {layout} P={P}"
    assert not all(np.isfinite(x).all() for x in ref), ctx + ": the case tests nothing"

    def mine(x, axis=1):
        return burst_hpc.shard(x, r, P, layout, axis=axis)

    o, lse = burst_hpc.burst_attention(mine(q), mine(k), mine(v), comm=comm, layout=layout, **kw)
    _assert_like("o", o, mine(ref[0]), ctx)
    _assert_like("lse", lse, mine(ref[1], axis=2), ctx)
    for ring in ("q", "kv"):
        grads = burst_hpc.burst_attention_backward(mine(do), mine(q), mine(k), mine(v), o, lse, comm=comm,
                                                   layout=layout, backward_ring=ring, **kw)
        for name, got, want in zip(NAMES[2:], grads, ref[2:]):
            _assert_like(name, got, mine(want), f"{ctx} {ring}-ring")
