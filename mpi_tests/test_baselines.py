"""The seeds' baselines of bench/baselines.py on the CPU path (NumPy + MPI), against the float64 oracle,
and the bytes the benchmark hook counts against DESIGN.md's formulas. Runs under mpiexec, 1..4 ranks."""
import pathlib
import sys

import numpy as np
import pytest

import burst_hpc
from burst_hpc.benchmark import RingBenchmark
from burst_hpc.plan.accounting import backward_ring_bytes
from burst_hpc.dtypes import bfloat16
from burst_hpc.errors import BurstError
from burst_hpc.reference import attention_backward_reference, attention_reference

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import baselines  # noqa: E402


def problem(comm, local, heads, kv_heads, dim, dtype=np.float64):
    seed = comm.bcast(int(np.random.SeedSequence().entropy % 2**63) if comm.rank == 0 else None)
    rng = np.random.default_rng(seed)
    seqlen = local * comm.size
    q, do = (rng.standard_normal((1, seqlen, heads, dim)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((1, seqlen, kv_heads, dim)).astype(dtype) for _ in range(2))
    return q, k, v, do, seed


def heads_for(method, size, heads, kv_heads):
    """Ulysses splits heads over the ranks: give it a multiple of the rank count, same GQA ratio."""
    if method != "ulysses" or (heads % size == 0 and kv_heads % size == 0):
        return heads, kv_heads
    return heads // kv_heads * size, size


# lse travels in float32 (as in the ring), hence test_ring.py's tolerances; GQA 2:1
@pytest.mark.parametrize("method", ["untiled-ring", "allgather-kv", "ulysses"])
@pytest.mark.parametrize("causal,layout", [(True, "zigzag"), (True, "contiguous"), (False, "contiguous")])
def test_baseline_matches_oracle(comm, method, causal, layout):
    P, r = comm.size, comm.rank
    q, k, v, do, seed = problem(comm, 10, *heads_for(method, P, 24, 12), 8)

    def mine(x, axis=1):
        return burst_hpc.shard(x, r, P, layout, axis=axis)

    run = baselines.make(method, mine(q), mine(k), mine(v), comm, causal, layout, "auto")
    o, lse = run.forward()
    ref_o, ref_lse = attention_reference(q, k, v, causal=causal)
    np.testing.assert_allclose(o, mine(ref_o), atol=1e-6, err_msg=f"{method} o, seed {seed}")
    np.testing.assert_allclose(lse, mine(ref_lse, axis=2), atol=1e-5, err_msg=f"{method} lse, seed {seed}")
    grads = run.backward(mine(do), o, lse)
    for name, got, want in zip(("dq", "dk", "dv"), grads, attention_backward_reference(do, q, k, v, causal=causal)):
        assert got.shape == mine(want).shape and got.dtype == q.dtype
        np.testing.assert_allclose(got, mine(want), atol=2e-5, rtol=1e-4, err_msg=f"{method} {name}, seed {seed}")


@pytest.mark.parametrize("method", ["untiled-ring", "allgather-kv", "ulysses"])
def test_baseline_bf16_inputs(comm, method):
    """16-bit inputs: bfloat16 results close to the oracle (each method rounds like eager code)."""
    P, r = comm.size, comm.rank
    q, k, v, do, seed = problem(comm, 8, *heads_for(method, P, 12, 12), 16, bfloat16)
    mine = [burst_hpc.shard(x, r, P, "zigzag") for x in (q, k, v, do)]
    run = baselines.make(method, *mine[:3], comm, True, "zigzag", "auto")
    o, lse = run.forward()
    assert o.dtype == bfloat16
    np.testing.assert_allclose(o.astype(np.float64), burst_hpc.shard(attention_reference(q, k, v, causal=True)[0],
                                                                     r, P, "zigzag"), atol=3e-2, err_msg=f"seed {seed}")
    refs = attention_backward_reference(do, q, k, v, causal=True)
    for got, want in zip(run.backward(mine[3], o, lse), refs):
        np.testing.assert_allclose(got.astype(np.float64), burst_hpc.shard(want, r, P, "zigzag"), atol=1e-1,
                                   rtol=5e-2, err_msg=f"seed {seed}")


def test_ulysses_refuses_heads_that_do_not_divide(comm):
    P, r = comm.size, comm.rank
    heads = P + 1  # divides over one rank only
    q, k, v, _, _ = problem(comm, 4, heads, heads, 8)
    mine = [burst_hpc.shard(x, r, P, "zigzag") for x in (q, k, v)]
    if P == 1:
        assert baselines.make("ulysses", *mine, comm, True, "zigzag", "auto").forward()[0].shape == mine[0].shape
    else:
        with pytest.raises(BurstError, match=f"{heads} query and {heads} key/value heads do not divide over {P} ranks"):
            baselines.make("ulysses", *mine, comm, True, "zigzag", "auto")


def test_unknown_method_and_transport(comm):
    q, k, v, _, _ = problem(comm, 4, 2, 2, 8)
    with pytest.raises(BurstError, match="unknown method"):
        baselines.make("flash", q, k, v, comm, False, "contiguous", "auto")
    with pytest.raises(BurstError, match="not 'nccl'"):
        baselines.make("allgather-kv", q[:, :4], k[:, :4], v[:, :4], comm, False, "contiguous", "nccl")


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1)])
def test_bytes_counted_against_design(comm, heads, kv_heads):
    """The hook counts what each rank sends. Per step the forward moves K, V and the backward the
    DESIGN.md volume of its ring; the carried accumulator (dQ or dK, dV) makes one more trip home."""
    P, r = comm.size, comm.rank
    n, d = 6, 8
    q, k, v, do, _ = problem(comm, n, heads, kv_heads, d, np.float32)
    mine = [burst_hpc.shard(x, r, P, "zigzag") for x in (q, k, v, do)]
    q_bytes, kv_bytes = backward_ring_bytes(heads, kv_heads, d, 4)
    for ring, per_token, carried in (("q", q_bytes, heads * d * 4), ("kv", kv_bytes, 2 * kv_heads * d * 4)):
        bench = RingBenchmark(*mine[:3], comm=comm, causal=True, backward_ring=ring)
        o, lse = bench.forward()
        assert bench.bytes_sent == (P - 1) * n * 2 * kv_heads * d * 4
        before = bench.bytes_sent
        bench.backward(mine[3], o, lse)
        assert bench.bytes_sent - before == (P - 1) * n * per_token + (n * carried if P > 1 else 0)
        before = bench.bytes_sent
        bench.forward("compute")
        assert bench.bytes_sent == before
    gather = baselines.make("allgather-kv", *mine[:3], comm, True, "zigzag", "auto")
    gather.forward()
    assert gather.bytes_sent == (P - 1) * 2 * mine[1].nbytes
