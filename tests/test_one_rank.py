"""One rank: scheme='auto' runs each pass as one block call on the rank's own keys (the gather scheme's packed
passes, engine/packed.py), as ``burst_hpc.attention`` does: the first and the last pair of every row, so the
outputs are written in the inputs' dtype by the call and no float32 accumulator exists outside it."""
import numpy as np
import pytest
from mpi4py import MPI

import burst_hpc
from burst_hpc.backends.numpy_backend import NumpyBackend
from burst_hpc.dtypes import bfloat16
from burst_hpc.plan import callplan
from burst_hpc.reference import attention_backward_reference, attention_reference


@pytest.fixture
def block_calls(monkeypatch):
    """The keyword arguments of every block call, by name."""
    calls = {"forward_block": [], "backward_block": []}
    for name, seen in calls.items():
        kept = getattr(NumpyBackend, name)

        def call(self, *args, _kept=kept, _seen=seen, **kw):
            _seen.append((args, kw))
            return _kept(self, *args, **kw)

        monkeypatch.setattr(NumpyBackend, name, call)
    callplan.PLANS.clear()
    yield calls
    callplan.PLANS.clear()


def whole(view, array):
    """Whether ``view`` is all of ``array``."""
    return view.shape == array.shape and np.shares_memory(view, array)


@pytest.mark.parametrize("layout", [None, "contiguous", "zigzag", "balanced", "chunks"])
@pytest.mark.parametrize("mask", ["causal", "documents", "window", "full"])
def test_one_rank_runs_one_block_call_a_pass(block_calls, layout, mask):
    rng = np.random.default_rng()
    s = int(rng.integers(40, 90)) * 2
    cu = np.array([0, int(rng.integers(1, s // 2)), int(rng.integers(s // 2, s)), s])
    kw = {"causal": dict(causal=True), "documents": dict(causal=True, cu_seqlens=cu),
          "window": dict(window=(int(rng.integers(1, 20)), 0), causal=True), "full": dict(causal=False)}[mask]
    q, k, v, do = (rng.standard_normal((1, s, h, 24)).astype(bfloat16) for h in (6, 2, 2, 6))
    o, lse = burst_hpc.burst_attention(q, k, v, comm=MPI.COMM_SELF, layout=layout, **kw)
    dq, dk, dv = burst_hpc.burst_attention_backward(do, q, k, v, o, lse, comm=MPI.COMM_SELF, layout=layout, **kw)
    (fwd_args, fwd), = block_calls["forward_block"]
    (bwd_args, bwd), = block_calls["backward_block"]
    assert fwd_args[3] is None and fwd["first"] and whole(fwd["out"], o)   # no float32 output: written by the call
    assert bwd_args[6:9] == (None, None, None)                             # nor float32 gradients
    assert bwd["first_q"] and bwd["first_kv"] and all(whole(bwd[n], x) for n, x in zip(("dq_out", "dk_out", "dv_out"),
                                                                                      (dq, dk, dv)))
    assert fwd["masked"] == (mask != "full") and fwd["q_start"] == fwd["k_start"] == 0
    assert o.dtype == dq.dtype == dk.dtype == dv.dtype == bfloat16
    f64 = [x.astype(np.float64) for x in (q, k, v, do)]
    ref_o, ref_lse = attention_reference(*f64[:3], **kw)
    np.testing.assert_allclose(o.astype(np.float64), ref_o, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-3, rtol=1e-3)
    for got, want in zip((dq, dk, dv), attention_backward_reference(f64[3], *f64[:3], **kw)):
        np.testing.assert_allclose(got.astype(np.float64), want, atol=5e-2, rtol=5e-2)
