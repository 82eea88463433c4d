"""GPU parts of the run's set-up and progress (skipped without CuPy or without a GPU): the rehearsal of
the passes loads every kernel module the passes use, so the timed passes load none; the progress meter
counts the work whose CUDA events have completed."""
import numpy as np
import pytest

from burst_hpc.device import gpu_count

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.skipif(gpu_count() < 1, reason="no GPU")

from mpi4py import MPI  # noqa: E402

from burst_hpc.backends.cuda import CudaBackend, default_family  # noqa: E402
from burst_hpc.plan.callplan import Backward, checked_call, plan_arrays  # noqa: E402
from burst_hpc.plan.layout import as_layout  # noqa: E402
from burst_hpc.job.progress import PassMeter, Progress  # noqa: E402


def _plan(seqlen, causal, layout, window=None, heads=8, kv_heads=2, d=128):
    rng = np.random.default_rng(0)
    q = cupy.asarray(rng.standard_normal((1, seqlen, heads, d)), dtype=cupy.float16)
    k, v = (cupy.asarray(rng.standard_normal((1, seqlen, kv_heads, d)), dtype=cupy.float16) for _ in range(2))
    do = cupy.asarray(rng.standard_normal(q.shape), dtype=cupy.float16)
    placed = as_layout(layout, seqlen, 1, causal=causal, cu_seqlens=None, window=window)
    plan = plan_arrays(MPI.COMM_SELF, q, checked_call(1, q, k, v, causal, None, placed, "auto", backward=Backward(do),
                                                      window=window))
    plan.backend = CudaBackend(default_family())  # its own modules: nothing loaded yet
    return plan, q, k, v, do


@pytest.mark.parametrize("causal,layout,window", [(True, "zigzag", None), (False, "contiguous", None),
                                                  (True, "contiguous", (700, 0))])
def test_the_rehearsal_loads_every_module_the_passes_use(monkeypatch, causal, layout, window):
    plan, q, k, v, do = _plan(4096, causal, layout, window)
    made, real = [], cupy.RawModule

    def counted(*args, **kwargs):
        made.append(kwargs.get("options"))
        return real(*args, **kwargs)

    monkeypatch.setattr(cupy, "RawModule", counted)
    o, lse = plan.passes.forward(q, k, v, rehearse=True)
    plan.passes.backward(plan.ring, do, q, k, v, o, lse, rehearse=True)
    cupy.cuda.Device().synchronize()
    assert made, "the rehearsal loaded no module"
    made.clear()
    o, lse = plan.passes.forward(q, k, v)
    plan.passes.backward(plan.ring, do, q, k, v, o, lse)
    cupy.cuda.Device().synchronize()
    assert made == [], "the timed passes loaded modules the rehearsal did not"


def test_the_meter_counts_finished_work_on_the_gpu():
    plan, q, k, v, _ = _plan(8192, True, "zigzag")
    meter = PassMeter(Progress(False, 60), "forward", cupy)
    plan.passes.forward(q, k, v, meter=meter)
    cupy.cuda.Device().synchronize()
    assert meter.queued == meter.total > 0
    assert meter.line().startswith("forward: 100.0% of rank 0's visible pairs") and meter.finished == meter.total
