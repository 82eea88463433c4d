"""The seeds' baselines of bench/baselines.py on GPUs (CuPy, NCCL collectives, our CUDA kernels), against the
float64 oracle with test_ring_gpu.py's FlashAttention-style tolerances. Skips without CuPy or a GPU (CI); run on
a machine with 2 or 4 GPUs: mpirun -np N python -m mpi4py -m pytest mpi_tests/test_baselines_gpu.py."""
import pathlib
import sys

import numpy as np
import pytest

from burst_hpc.device import gpu_count  # noqa: E402

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.skipif(gpu_count() < 1, reason="no GPU")

import burst_hpc  # noqa: E402
from burst_hpc.device import gpus_shared  # noqa: E402
from burst_hpc.dtypes import bfloat16  # noqa: E402
from burst_hpc.reference import attention_backward_reference, attention_reference  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import baselines  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_gpu_per_rank():
    from mpi4py import MPI

    burst_hpc.select_device(MPI.COMM_WORLD)


@pytest.mark.parametrize("method", ["untiled-ring", "allgather-kv", "ulysses"])
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_baseline_matches_oracle(comm, method, dim):
    if gpus_shared(comm, cupy.cuda.Device()):
        pytest.skip("NCCL needs one GPU per rank")
    P, r = comm.size, comm.rank
    seed = comm.bcast(int(np.random.SeedSequence().entropy % 2**63) if r == 0 else None)
    rng = np.random.default_rng(seed)
    local, heads, kv_heads = 2 * 61, 24, 12  # chunks of 61 tokens; heads divide over 1..4 ranks
    S = local * P
    q, k, v, do = (rng.standard_normal((1, S, h, dim)).astype(bfloat16) for h in (heads, kv_heads, kv_heads, heads))
    ref_o, _ = attention_reference(q, k, v, causal=True)
    ref_grads = attention_backward_reference(do, q, k, v, causal=True)

    def mine(x):
        return burst_hpc.shard(x, r, P, "zigzag")

    run = baselines.make(method, *(cupy.asarray(mine(x)) for x in (q, k, v)), comm, True, "zigzag", "nccl")
    o, lse = run.forward()
    assert isinstance(o, cupy.ndarray) and o.dtype == bfloat16
    err = np.abs(cupy.asnumpy(o).astype(np.float64) - mine(ref_o)).max()
    base = np.abs(ref_o.astype(bfloat16).astype(np.float64) - ref_o).max()
    assert err <= 2 * base + 2e-3, f"{method} forward {err} vs {base} (seed {seed})"
    for name, got, want in zip("dq dk dv".split(), run.backward(cupy.asarray(mine(do)), o, lse), ref_grads):
        err = np.abs(cupy.asnumpy(got).astype(np.float64) - mine(want)).max()
        base = np.abs(want.astype(bfloat16).astype(np.float64) - want).max()
        assert err <= 3 * base + 5e-3 * max(1.0, np.abs(want).max()), f"{method} {name}: {err} vs {base} (seed {seed})"
