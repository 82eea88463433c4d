"""The ring on GPUs, per transport. Skips without CuPy or a GPU (CI); run on a machine with
2 or 4 GPUs: mpirun -np N python -m mpi4py -m pytest mpi_tests/test_ring_gpu.py."""
import numpy as np
import pytest

from burst_hpc.device import gpu_count  # noqa: E402

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.skipif(gpu_count() < 1, reason="no GPU")

import burst_hpc  # noqa: E402
from burst_hpc.plan.layout import default_kind  # noqa: E402
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
    t.exchange([((comm.rank + 1) % comm.size, mine)], [((comm.rank - 1) % comm.size, recv)]).wait()
    everyone = comm.allgather([cupy.asnumpy(x) for x in mine])
    for got, want in zip(recv, everyone[(comm.rank - 1) % comm.size]):
        np.testing.assert_array_equal(cupy.asnumpy(got), want)


@pytest.mark.parametrize("transport", ["nccl", "staged", "mpi"])
def test_exchanges_in_flight_at_once(comm, transport):
    """The flat ring's far lane keeps several exchanges in flight: four posted one after another (one
    crossing a staging chunk boundary) and waited in the opposite order each arrive whole."""
    if transport not in device_transports(comm):
        pytest.skip(f"{transport} not usable here")
    t = make_transport(transport, comm, cupy)
    rng = np.random.default_rng()
    sizes = [(1000, 3), ((17 << 20) + 5,), (7,), (64, 64)]
    mine = [cupy.asarray(rng.integers(0, 255, n, dtype=np.uint8)) for n in sizes]
    recv = [cupy.zeros(x.shape, x.dtype) for x in mine]
    pending = [t.exchange([((comm.rank + 1) % comm.size, [x])], [((comm.rank - 1) % comm.size, [y])])
               for x, y in zip(mine, recv)]
    for handle in reversed(pending):
        handle.wait()
    everyone = comm.allgather([cupy.asnumpy(x) for x in mine])
    for got, want in zip(recv, everyone[(comm.rank - 1) % comm.size]):
        np.testing.assert_array_equal(cupy.asnumpy(got), want)


@pytest.mark.parametrize("transport", ["nccl", "staged", "mpi"])
def test_exchange_with_several_peers(comm, transport):
    """A balanced step: sends to rank+1 and rank+2 at once, two entries for one peer (data and a
    partial), the receives listed in the same order at the other end."""
    if transport not in device_transports(comm):
        pytest.skip(f"{transport} not usable here")
    P, r = comm.size, comm.rank
    t = make_transport(transport, comm, cupy)

    def payload(src, dst, n):
        return cupy.full((3, n + 1 + (17 << 20 if n == 2 else 0)), 1000 * src + 10 * dst + n, cupy.float32)

    hops = [1, 2] if P > 2 else [1]
    sends = [((r + h) % P, [payload(r, (r + h) % P, 0)]) for h in hops]
    sends.append(((r + 1) % P, [payload(r, (r + 1) % P, 1), payload(r, (r + 1) % P, 2)]))
    recvs = [((r - h) % P, [cupy.zeros((3, 1), cupy.float32)]) for h in hops]
    recvs.append(((r - 1) % P, [cupy.zeros((3, 2), cupy.float32), cupy.zeros((3, 3 + (17 << 20)), cupy.float32)]))
    t.exchange(sends, recvs).wait()
    for peer, arrays in recvs:
        for n, array in zip((0,) if len(arrays) == 1 else (1, 2), arrays):
            np.testing.assert_array_equal(cupy.asnumpy(array), cupy.asnumpy(payload(peer, r, n)))


def test_auto_never_picks_mpi_without_cuda_awareness(comm):
    from burst_hpc.transport import choose_transport

    if cuda_aware_mpi()[0]:
        assert choose_transport("auto", on_device=True) in ("nccl", "mpi")
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


def test_nccl_communicators_go_with_their_mpi_communicator(comm):
    """A communicator freed and another made in its place (MPI may hand out the same handle) gets an NCCL
    communicator of its own: the new one may hold other ranks."""
    from burst_hpc.transport.nccl import communicator

    if "nccl" not in device_transports(comm):
        pytest.skip("nccl not usable here")
    first = comm.Dup()
    made = communicator(first)
    assert communicator(first) is made
    first.Free()
    second = comm.Dup()
    try:
        assert communicator(second) is not made
    finally:
        second.Free()


@pytest.mark.parametrize("transport", ["staged", "nccl"])
def test_transport_follows_the_device(comm, transport):
    """A call on another GPU than the last one over the same communicator opens transports of its own:
    streams and NCCL communicators belong to the device they were made on."""
    if comm.size == 1 or gpus_shared(comm, cupy.cuda.Device()):
        pytest.skip("needs one GPU per rank")
    if transport not in device_transports(comm):
        pytest.skip(f"{transport} not usable here")
    rng = np.random.default_rng(comm.rank)
    for device in (comm.rank, (comm.rank + 1) % comm.size):
        with cupy.cuda.Device(device):
            q, k, v = (cupy.asarray(rng.standard_normal((1, 64, 2, 64)).astype(bfloat16)) for _ in range(3))
            o, _ = burst_hpc.burst_attention(q, k, v, comm=comm, causal=True, transport=transport)
            assert o.device.id == device and bool(cupy.isfinite(o.astype(cupy.float32)).all())


def check_ring(comm, layout, causal, batch, heads, kv_heads, dim, local, run):
    """``run([q, k, v, do] shards on the device)`` -> (o, {ring: (dq, dk, dv)}), checked against the
    float64 oracle with the FlashAttention rule: at most 2x / 3x the error of storing the exact
    result in bf16, plus a floor."""
    P, r = comm.size, comm.rank
    seed = comm.bcast(int(np.random.SeedSequence().entropy % 2**63) if r == 0 else None)
    rng = np.random.default_rng(seed)
    S, dtype = local * P, bfloat16
    q, k, v, do = (rng.standard_normal((batch, S, h, dim)).astype(dtype) for h in (heads, kv_heads, kv_heads, heads))
    ref_o, _ = attention_reference(q, k, v, causal=causal)
    ref_grads = attention_backward_reference(do, q, k, v, causal=causal)

    def mine(x):
        return burst_hpc.shard(x, r, P, layout)

    o, grads_by_ring = run([to_device(mine(x)) for x in (q, k, v, do)])
    assert isinstance(o, cupy.ndarray)
    err = np.abs(to_host(o, dtype) - mine(ref_o)).max()
    base = np.abs(ref_o.astype(dtype).astype(np.float64) - ref_o).max()
    assert err <= 2 * base + 2e-3, f"forward {err} vs {base} (seed {seed})"
    for ring, grads in grads_by_ring.items():
        for name, got, want in zip("dq dk dv".split(), grads, ref_grads):
            err = np.abs(to_host(got, dtype) - mine(want)).max()
            base = np.abs(want.astype(dtype).astype(np.float64) - want).max()
            assert err <= 3 * base + 5e-3 * max(1.0, np.abs(want).max()), f"{name} {ring}: {err} vs {base} (seed {seed})"


def public_api(comm, layout, causal, transport):
    """The ``run`` of check_ring through burst_attention and both backward rings."""
    def run(inputs):
        q, k, v, do = inputs
        kw = dict(comm=comm, causal=causal, layout=layout, transport=transport)
        o, lse = burst_hpc.burst_attention(q, k, v, **kw)
        return o, {ring: burst_hpc.burst_attention_backward(do, q, k, v, o, lse, backward_ring=ring, **kw)
                   for ring in ("q", "kv")}

    return run


@pytest.mark.parametrize("transport", ["nccl", "staged", "mpi"])
@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", False), ("contiguous", True),
                                           ("balanced", True), ("balanced", False)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 128), (4, 4, 64)])
def test_gpu_ring_matches_oracle(comm, transport, layout, causal, heads, kv_heads, dim):
    if transport not in device_transports(comm):
        pytest.skip(f"{transport} not usable here")
    # chunks of 61 tokens: tails that are not a multiple of any tile
    check_ring(comm, layout, causal, 2, heads, kv_heads, dim, 2 * 61, public_api(comm, layout, causal, transport))


def first_transport(comm):
    names = device_transports(comm)
    return "nccl" if "nccl" in names else names[0]


@pytest.mark.parametrize("heads,kv_heads,dim", [(33, 11, 64), (40, 8, 128), (1, 1, 64)])
def test_gpu_balanced_irregular_heads(comm, heads, kv_heads, dim):
    """Heads are never split across ranks: any Hq % Hkv == 0 on any number of GPUs; 61 tokens
    per rank, so the even-P split of the P/2 chunk pairs is uneven (30 + 31 rows)."""
    check_ring(comm, "balanced", True, 1, heads, kv_heads, dim, 61,
               public_api(comm, "balanced", True, first_transport(comm)))


def test_gpu_alltoall_around_zigzag(comm, alltoall_zigzag):
    """bench/alltoall_zigzag.py on the GPU: what bench_ring.py --layouts alltoall times."""
    transport = first_transport(comm)

    def run(inputs):
        q, k, v, do = inputs
        kw = dict(comm=comm, causal=True, layout="zigzag", transport=transport)
        exchange = make_transport(transport, comm, cupy)
        o, _, saved = alltoall_zigzag.forward(exchange, lambda *qkv: burst_hpc.burst_attention(*qkv, **kw), q, k, v)
        return o, {ring: alltoall_zigzag.backward(
            exchange, lambda *args: burst_hpc.burst_attention_backward(*args, backward_ring=ring, **kw), do, saved)
            for ring in ("q", "kv")}

    check_ring(comm, "contiguous", True, 1, 8, 2, 128, 2 * 61, run)


@pytest.mark.parametrize("transport", ["nccl", "staged", "mpi"])
@pytest.mark.parametrize("layout,window,documents,per_node", [
    ("zigzag", None, 7, None), ("contiguous", (150, 0), None, None), ("contiguous", (100, 0), 5, None),
    (None, (40, 40), 3, None), ("balanced", None, 5, 1), ("balanced", (100, 0), 3, 1), ("balanced", None, 5, None),
    ("balanced", None, 4, 2), ("chunks", None, 7, None), ("chunks", (100, 0), 5, 1)])
def test_gpu_ring_with_documents_and_windows(comm, transport, layout, window, documents, per_node):
    """Interval-masked kernels through the ring (shortened by the window where it can be); the
    balanced layout with every rank a node: transfers between nodes posted steps ahead on the far
    lane, several in flight at once; on one node (None) and two ranks a node: transfers inside a
    node a step ahead (data) or a step late (partials) on the inner lane, beside the far lane's; the
    chunks layout's gather scheme (packed runs of keys, posted steps before they are due; its
    backward the kv side only)."""
    from burst_hpc.plan import masks

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
    used = layout or default_kind(causal)

    placed = dict(kw)   # the chunks layout places tokens by the mask

    def mine(x):
        return burst_hpc.shard(x, r, P, used, **placed)

    dq_, dk_, dv_, ddo = (to_device(mine(x)) for x in (q, k, v, do))
    kw["ranks_per_node"] = per_node
    o, lse = burst_hpc.burst_attention(dq_, dk_, dv_, comm=comm, layout=layout, transport=transport, **kw)
    err = np.abs(to_host(o, dtype) - mine(ref_o)).max()
    base = np.abs(ref_o.astype(dtype).astype(np.float64) - ref_o).max()
    assert err <= 2 * base + 2e-3, f"forward {err} vs {base} (seed {seed})"
    for ring in ("kv",) if layout == "chunks" else ("q", "kv"):
        grads = burst_hpc.burst_attention_backward(ddo, dq_, dk_, dv_, o, lse, comm=comm, layout=layout,
                                                   transport=transport, backward_ring=ring, **kw)
        for name, got, want in zip("dq dk dv".split(), grads, ref_grads):
            err = np.abs(to_host(got, dtype) - mine(want)).max()
            base = np.abs(want.astype(dtype).astype(np.float64) - want).max()
            assert err <= 3 * base + 5e-3 * max(1.0, np.abs(want).max()), f"{name} {ring}: {err} vs {base} (seed {seed})"
