"""The ring on GPUs, per transport. Skips without CuPy or a GPU (CI); run on a machine with
2 or 4 GPUs: mpirun -np N python -m mpi4py -m pytest mpi_tests/test_ring_gpu.py."""
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
try:
    HAVE_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:  # no driver
    HAVE_GPU = False
pytestmark = pytest.mark.skipif(not HAVE_GPU, reason="no GPU")

import burst_hpc  # noqa: E402
from burst_hpc.dtypes import bfloat16  # noqa: E402
from burst_hpc.errors import TransportError  # noqa: E402
from burst_hpc.reference import attention_backward_reference, attention_reference  # noqa: E402
from burst_hpc.device import gpus_shared  # noqa: E402
from burst_hpc.transport import cuda_aware_mpi, make_transport  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_gpu_per_rank():
    from mpi4py import MPI

    burst_hpc.select_device(MPI.COMM_WORLD)


def device_transports(comm):
    names = ["staged"]
    if not gpus_shared(comm, cupy.cuda.Device()):
        names.append("nccl")  # NCCL needs one GPU per rank
    if cuda_aware_mpi()[0]:
        names.append("mpi")
    return names


def to_device(x):
    return cupy.asarray(x)  # CuPy 14 holds ml_dtypes.bfloat16 arrays natively


def to_host(x, dtype):
    return cupy.asnumpy(x).astype(np.float64)


@pytest.mark.parametrize("transport", ["nccl", "staged", "mpi"])
def test_exchange_moves_every_byte(comm, transport):
    if transport not in device_transports(comm):
        pytest.skip(f"{transport} not usable here")
    t = make_transport(transport, comm, cupy)
    rng = np.random.default_rng()
    sizes = [(3, 1000, 7), (5,), ((17 << 20) + 3,)]  # the last crosses a staging chunk boundary
    mine = [cupy.asarray(rng.integers(0, 255, s, dtype=np.uint8)) for s in sizes]
    mine.append(cupy.asarray(rng.standard_normal((4, 33), dtype=np.float32)))
    recv = [cupy.full(x.shape, 7, x.dtype) for x in mine]
    t.exchange(mine, recv).wait()
    everyone = comm.allgather([cupy.asnumpy(x) for x in mine])
    for got, want in zip(recv, everyone[(comm.rank - 1) % comm.size]):
        np.testing.assert_array_equal(cupy.asnumpy(got), want)


def test_auto_never_picks_mpi_without_cuda_awareness(comm):
    from burst_hpc.transport import choose_transport

    if cuda_aware_mpi()[0]:
        assert choose_transport("auto", on_device=True) == "mpi"
    else:
        assert choose_transport("auto", on_device=True) in ("nccl", "staged")
        with pytest.raises(TransportError):
            choose_transport("mpi", on_device=True)


def test_ranks_sharing_a_gpu_never_get_nccl(comm):
    """Arrays of every rank on GPU 0: auto falls back to a transport that works, explicit nccl
    fails with one clear error on every rank instead of an NCCL crash."""
    if comm.size == 1:
        pytest.skip("needs two ranks")
    with cupy.cuda.Device(0):
        q, k, v = (cupy.asarray(np.random.default_rng().standard_normal((1, 64, 2, 64)).astype(bfloat16))
                   for _ in range(3))
        o, _ = burst_hpc.burst_attention(q, k, v, comm=comm, causal=True, transport="auto")
        assert bool(cupy.isfinite(o.astype(cupy.float32)).all())
        with pytest.raises(TransportError, match="same GPU"):
            burst_hpc.burst_attention(q, k, v, comm=comm, causal=True, transport="nccl")


@pytest.mark.parametrize("transport", ["nccl", "staged", "mpi"])
@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", False), ("contiguous", True)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 128), (4, 4, 64)])
def test_gpu_ring_matches_oracle(comm, transport, layout, causal, heads, kv_heads, dim):
    if transport not in device_transports(comm):
        pytest.skip(f"{transport} not usable here")
    P, r = comm.size, comm.rank
    seed = comm.bcast(int(np.random.SeedSequence().entropy % 2**63) if r == 0 else None)
    rng = np.random.default_rng(seed)
    local, batch, dtype = 2 * 61, 2, bfloat16  # chunks of 61 tokens: tails that are not a multiple of any tile
    S = local * P
    q, k, v, do = (rng.standard_normal((batch, S, h, dim)).astype(dtype) for h in (heads, kv_heads, kv_heads, heads))
    ref_o, _ = attention_reference(q, k, v, causal=causal)
    ref_grads = attention_backward_reference(do, q, k, v, causal=causal)

    def mine(x):
        return burst_hpc.shard(x, r, P, layout)

    dq_, dk_, dv_, ddo = (to_device(mine(x)) for x in (q, k, v, do))
    o, lse = burst_hpc.burst_attention(dq_, dk_, dv_, comm=comm, causal=causal, layout=layout, transport=transport)
    assert isinstance(o, cupy.ndarray)
    # FlashAttention rule: at most 2x / 3x the error of storing the exact result in bf16, plus a floor
    err = np.abs(to_host(o, dtype) - mine(ref_o)).max()
    base = np.abs(ref_o.astype(dtype).astype(np.float64) - ref_o).max()
    assert err <= 2 * base + 2e-3, f"forward {err} vs {base} (seed {seed})"
    for ring in ("q", "kv"):
        grads = burst_hpc.burst_attention_backward(ddo, dq_, dk_, dv_, o, lse, comm=comm, causal=causal,
                                                   layout=layout, transport=transport, backward_ring=ring)
        for name, got, want in zip("dq dk dv".split(), grads, ref_grads):
            err = np.abs(to_host(got, dtype) - mine(want)).max()
            base = np.abs(want.astype(dtype).astype(np.float64) - want).max()
            assert err <= 3 * base + 5e-3 * max(1.0, np.abs(want).max()), f"{name} {ring}: {err} vs {base} (seed {seed})"


@pytest.mark.parametrize("transport", ["nccl", "staged", "mpi"])
@pytest.mark.parametrize("layout,window,documents", [("zigzag", None, 7), ("contiguous", (150, 0), None),
                                                     ("contiguous", (100, 0), 5), (None, (40, 40), 3)])
def test_gpu_ring_with_documents_and_windows(comm, transport, layout, window, documents):
    """Interval-masked kernels through the ring (shortened by the window where it can be)."""
    from burst_hpc import masks

    if transport not in device_transports(comm):
        pytest.skip(f"{transport} not usable here")
    P, r = comm.size, comm.rank
    seed = comm.bcast(int(np.random.SeedSequence().entropy % 2**63) if r == 0 else None)
    rng = np.random.default_rng(seed)
    local, dim, dtype = 2 * 122, 128, bfloat16
    S = local * P
    causal = window != (40, 40)
    cu = masks.random_documents(rng, S, documents) if documents else None
    kw = dict(causal=causal, window=window, cu_seqlens=cu)
    q, k, v, do = (rng.standard_normal((1, S, h, dim)).astype(dtype) for h in (4, 2, 2, 4))
    ref_o, _ = attention_reference(q, k, v, **kw)
    ref_grads = attention_backward_reference(do, q, k, v, **kw)
    used = layout or masks.default_layout(masks.make(S, causal, window, cu), P)

    def mine(x):
        return burst_hpc.shard(x, r, P, used)

    dq_, dk_, dv_, ddo = (to_device(mine(x)) for x in (q, k, v, do))
    o, lse = burst_hpc.burst_attention(dq_, dk_, dv_, comm=comm, layout=layout, transport=transport, **kw)
    err = np.abs(to_host(o, dtype) - mine(ref_o)).max()
    base = np.abs(ref_o.astype(dtype).astype(np.float64) - ref_o).max()
    assert err <= 2 * base + 2e-3, f"forward {err} vs {base} (seed {seed})"
    for ring in ("q", "kv"):
        grads = burst_hpc.burst_attention_backward(ddo, dq_, dk_, dv_, o, lse, comm=comm, layout=layout,
                                                   transport=transport, backward_ring=ring, **kw)
        for name, got, want in zip("dq dk dv".split(), grads, ref_grads):
            err = np.abs(to_host(got, dtype) - mine(want)).max()
            base = np.abs(want.astype(dtype).astype(np.float64) - want).max()
            assert err <= 3 * base + 5e-3 * max(1.0, np.abs(want).max()), f"{name} {ring}: {err} vs {base} (seed {seed})"
