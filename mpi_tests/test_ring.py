"""The ring on the CPU path: every rank runs these tests with its own shard, against the
float64 oracle on the whole (unsharded) problem. Runs under mpiexec with 1..5 ranks."""
import numpy as np
import pytest

import burst_hpc
from burst_hpc import tolerance as rule
from burst_hpc.dtypes import bfloat16
from burst_hpc.errors import DTypeError, LayoutError, RankMismatchError, ShapeError, TransportError
from burst_hpc.reference import attention_backward_reference, attention_reference


def shared_rng(comm):
    seed = comm.bcast(int(np.random.SeedSequence().entropy % 2**63) if comm.rank == 0 else None)
    return np.random.default_rng(seed), seed


def problem(comm, batch, local, heads, kv_heads, dim, dtype=np.float64):
    rng, seed = shared_rng(comm)
    seqlen = local * comm.size
    q = rng.standard_normal((batch, seqlen, heads, dim)).astype(dtype)
    k = rng.standard_normal((batch, seqlen, kv_heads, dim)).astype(dtype)
    v = rng.standard_normal((batch, seqlen, kv_heads, dim)).astype(dtype)
    do = rng.standard_normal((batch, seqlen, heads, dim)).astype(dtype)
    return q, k, v, do, seed


SHAPES = [(2, 4, 4, 64), (2, 8, 2, 128), (1, 8, 1, 64)]  # (batch, Hq, Hkv, D): MHA, GQA 4:1, MQA 8:1


def check_forward_and_both_backward_rings(comm, layout, causal, batch, local, heads, kv_heads, dim):
    P, r = comm.size, comm.rank
    q, k, v, do, seed = problem(comm, batch, local, heads, kv_heads, dim)
    ref_o, ref_lse = attention_reference(q, k, v, causal=causal)
    ref_grads = attention_backward_reference(do, q, k, v, causal=causal)

    def mine(x, axis=1):
        return burst_hpc.shard(x, r, P, layout, axis=axis)

    o, lse = burst_hpc.burst_attention(mine(q), mine(k), mine(v), comm=comm, causal=causal, layout=layout)
    assert o.dtype == q.dtype and lse.dtype == np.float32
    np.testing.assert_allclose(o, mine(ref_o), atol=1e-6, err_msg=f"seed {seed}")
    np.testing.assert_allclose(lse, mine(ref_lse, axis=2), atol=1e-5, err_msg=f"seed {seed}")
    for ring in ("q", "kv"):
        grads = burst_hpc.burst_attention_backward(mine(do), mine(q), mine(k), mine(v), o, lse, comm=comm,
                                                   causal=causal, layout=layout, backward_ring=ring)
        for name, got, want in zip("dq dk dv".split(), grads, ref_grads):
            np.testing.assert_allclose(got, mine(want), atol=2e-5, rtol=1e-4,
                                       err_msg=f"{name} {ring}-ring seed {seed}")


@pytest.mark.parametrize("batch,heads,kv_heads,dim", SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "balanced"])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_both_backward_rings(comm, causal, layout, batch, heads, kv_heads, dim):
    check_forward_and_both_backward_rings(comm, layout, causal, batch, 14, heads, kv_heads, dim)


IRREGULAR_HEADS = [(33, 33, 16), (33, 11, 16), (40, 8, 8), (1, 1, 32)]  # (Hq, Hkv, D)


@pytest.mark.parametrize("heads,kv_heads,dim", IRREGULAR_HEADS)
@pytest.mark.parametrize("causal", [True, False])
def test_balanced_with_odd_lengths_and_irregular_heads(comm, causal, heads, kv_heads, dim):
    """Any Hq % Hkv == 0 on any number of ranks (heads are never split across ranks), and 13
    tokens per rank: the even-P split of the P/2 chunk pairs is uneven (6 + 7 rows)."""
    check_forward_and_both_backward_rings(comm, "balanced", causal, 1, 13, heads, kv_heads, dim)


def test_exchange_with_several_peers(comm):
    """One step's sends and receives with several peers, two entries for the same peer and an
    empty list on some ranks (the balanced schedule's exchanges), on the host transport."""
    from burst_hpc.transport import make_transport

    P, r = comm.size, comm.rank
    t = make_transport("host", comm, np)

    def payload(src, dst, n):
        return np.full((3, n + 1), 1000 * src + 10 * dst + n, np.float32)

    hops = [1, 2] if P > 2 else [1]
    sends = [((r + h) % P, [payload(r, (r + h) % P, 0)]) for h in hops]
    sends.append(((r + 1) % P, [payload(r, (r + 1) % P, 1), payload(r, (r + 1) % P, 2)]))
    recvs = [((r - h) % P, [np.zeros((3, 1), np.float32)]) for h in hops]
    recvs.append(((r - 1) % P, [np.zeros((3, 2), np.float32), np.zeros((3, 3), np.float32)]))
    t.exchange(sends, recvs).wait()
    for peer, arrays in recvs:
        for array in arrays:
            n = array.shape[1] - 1
            np.testing.assert_array_equal(array, payload(peer, r, n))
    t.exchange([], []).wait()


def test_many_messages_to_one_peer_past_the_tag_bound(comm, monkeypatch):
    """More messages to one peer in one exchange than distinct tags under the MPI's TAG_UB (here made 2**13 - 1: two
    tags, 20 arrays each; an MPI with the standard's least bound has 8): tags wrap, and each message still lands in
    the array posted for it (MPI matches one tag's messages in posting order)."""
    from burst_hpc.transport import base, make_transport

    monkeypatch.setattr(base, "tag_bound", lambda: (1 << 13) - 1)
    P, r = comm.size, comm.rank
    t = make_transport("host", comm, np)
    count = 40   # a run a message: the packed forward sends one per run of consecutive positions

    def payload(src, n):
        return np.full(n + 1, 1000 * src + n, np.float64)

    sends = [((r + 1) % P, [payload(r, n) for n in range(count)])]
    recvs = [((r - 1) % P, [np.zeros(n + 1) for n in range(count)])]
    assert max(base.message_tag(n, 0) for n in range(count)) < 1 << 13   # wrapped: two tags
    t.exchange(sends, recvs).wait()
    for n, array in enumerate(recvs[0][1]):
        np.testing.assert_array_equal(array, payload((r - 1) % P, n))


@pytest.mark.parametrize("layout", ["zigzag", "balanced"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, bfloat16])
def test_low_precision_inputs_stay_within_flash_tolerance(comm, dtype, layout):
    """The tolerance rule (burst_hpc.tolerance): error against the float64 oracle at most 2x (forward)
    / 3x (grads) that of a plain single-device computation from the same low-precision inputs, plus a
    small floor."""
    P, r = comm.size, comm.rank
    q, k, v, do, seed = problem(comm, 2, 16, 4, 2, 64, dtype)
    ref = attention_reference(q, k, v, causal=True) + attention_backward_reference(do, q, k, v, causal=True)
    plain = rule.plain_attention(q, k, v, do, causal=True, lowp=np.dtype(dtype))

    def mine(x):
        return burst_hpc.shard(x, r, P, layout)

    o, lse = burst_hpc.burst_attention(mine(q), mine(k), mine(v), comm=comm, causal=True, layout=layout)
    grads = burst_hpc.burst_attention_backward(mine(do), mine(q), mine(k), mine(v), o, lse, comm=comm, causal=True,
                                               layout=layout)
    for name, got, want, low in zip(("o", "dq", "dk", "dv"), (o, *grads), ref[:1] + ref[2:], plain[:1] + plain[2:]):
        assert got.dtype == np.dtype(dtype)
        err = rule.max_err(got, mine(want))
        tol = rule.tolerance(name, rule.max_err(low, want), rule.max_abs(want), dtype)
        assert rule.passes(err, tol), f"{name}: error {err:.3e} > tolerance {tol:.3e} (seed {seed})"


@pytest.mark.parametrize("layout", ["zigzag", "balanced"])
def test_inputs_are_not_modified(comm, layout):
    q, k, v, do, _ = problem(comm, 1, 8, 2, 2, 64)
    shards = [burst_hpc.shard(x, comm.rank, comm.size, layout) for x in (q, k, v, do)]
    copies = [s.copy() for s in shards]
    o, lse = burst_hpc.burst_attention(*shards[:3], comm=comm, causal=True, layout=layout)
    for ring in ("q", "kv"):
        burst_hpc.burst_attention_backward(shards[3], *shards[:3], o, lse, comm=comm, causal=True, layout=layout,
                                           backward_ring=ring)
    for s, c in zip(shards, copies):
        np.testing.assert_array_equal(s, c)


def test_messages_split_under_the_size_limit(comm, monkeypatch):
    """Large shards travel in several messages (Open MPI 4 has no large-count calls)."""
    import burst_hpc.transport.mpi as mpi_transport

    monkeypatch.setattr(mpi_transport, "MAX_MESSAGE", 1000)
    P, r = comm.size, comm.rank
    q, k, v, do, seed = problem(comm, 1, 12, 4, 2, 64)
    ref_o, _ = attention_reference(q, k, v, causal=True)
    ref_dq, _, _ = attention_backward_reference(do, q, k, v, causal=True)

    def mine(x):
        return burst_hpc.shard(x, r, P, "zigzag")

    assert len(mpi_transport.byte_chunks(mine(q))) > 1
    o, lse = burst_hpc.burst_attention(mine(q), mine(k), mine(v), comm=comm, causal=True)
    np.testing.assert_allclose(o, mine(ref_o), atol=1e-6, err_msg=f"seed {seed}")
    dq, _, _ = burst_hpc.burst_attention_backward(mine(do), mine(q), mine(k), mine(v), o, lse, comm=comm, causal=True)
    np.testing.assert_allclose(dq, mine(ref_dq), atol=2e-5, rtol=1e-4, err_msg=f"seed {seed}")


def local_inputs(comm, local=8, heads=4, kv_heads=2, dim=64, dtype=np.float32):
    rng = np.random.default_rng()
    return [rng.standard_normal((1, local, h, dim)).astype(dtype) for h in (heads, kv_heads, kv_heads)]


def raises_everywhere(comm, error, fn, match=None):
    """Every rank raises ``error`` (nobody hangs) and all ranks got the same message."""
    with pytest.raises(error, match=match) as info:
        fn()
    messages = comm.allgather(str(info.value))
    assert len(set(messages)) == 1, messages
    return messages[0]


def test_length_that_does_not_split_fails_on_every_rank(comm):
    q, k, v = local_inputs(comm, local=7)
    if comm.size == 1:  # one rank owns the whole sequence: zigzag (the causal default) needs no even length
        o, lse = burst_hpc.burst_attention(q, k, v, comm=comm, causal=True)
        o_ref, _ = burst_hpc.attention(q, k, v, causal=True)
        np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-6)
        return
    raises_everywhere(comm, LayoutError, lambda: burst_hpc.burst_attention(q, k, v, comm=comm, causal=True),
                      match="does not split")


def test_one_rank_with_a_different_shape_fails_on_every_rank(comm):
    odd = comm.rank == comm.size - 1 and comm.size > 1
    q, k, v = local_inputs(comm, local=10 if odd else 8)
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    message = raises_everywhere(comm, RankMismatchError,
                                lambda: burst_hpc.burst_attention(q, k, v, comm=comm, layout="contiguous"))
    assert "q shape" in message


@pytest.mark.parametrize("field", ["dtype", "causal", "layout", "scale"])
def test_ranks_that_disagree_fail_on_every_rank(comm, field):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    odd = comm.rank == 1
    q, k, v = local_inputs(comm, dtype=np.float64 if (odd and field == "dtype") else np.float32)
    kwargs = {"causal": odd and field == "causal", "layout": "zigzag" if odd and field == "layout" else "contiguous",
              "scale": 0.5 if odd and field == "scale" else None}
    message = raises_everywhere(comm, RankMismatchError, lambda: burst_hpc.burst_attention(q, k, v, comm=comm, **kwargs))
    assert field in message


def test_bad_shape_on_one_rank_names_that_rank(comm):
    q, k, v = local_inputs(comm, heads=3 if comm.rank == 0 else 4)
    message = raises_everywhere(comm, ShapeError, lambda: burst_hpc.burst_attention(q, k, v, comm=comm))
    assert "multiple" in message


def test_backward_with_wrong_lse_shape_fails_on_every_rank(comm):
    q, k, v = local_inputs(comm)
    o, lse = burst_hpc.burst_attention(q, k, v, comm=comm)
    bad = lse[:, :, :-1] if comm.rank == 0 else lse
    raises_everywhere(comm, ShapeError, lambda: burst_hpc.burst_attention_backward(q, q, k, v, o, bad, comm=comm))


def test_device_transport_with_numpy_arrays_fails_on_every_rank(comm):
    q, k, v = local_inputs(comm)
    raises_everywhere(comm, TransportError, lambda: burst_hpc.burst_attention(q, k, v, comm=comm, transport="nccl"))


def test_mixed_dtypes_fail_on_every_rank(comm):
    q, k, v = local_inputs(comm)
    raises_everywhere(comm, DTypeError, lambda: burst_hpc.burst_attention(q, k.astype(np.float64), v, comm=comm))


def test_ring_still_works_after_errors(comm):
    q, k, v = local_inputs(comm)
    o, lse = burst_hpc.burst_attention(q, k, v, comm=comm)
    assert np.isfinite(o).all() and np.isfinite(lse).all()


def test_alltoall_around_zigzag_matches_oracle(comm, alltoall_zigzag):
    """bench/alltoall_zigzag.py, the alternative the balanced schedule is measured against."""
    from burst_hpc.transport import make_transport

    P, r = comm.size, comm.rank
    q, k, v, do, seed = problem(comm, 2, 10, 4, 2, 32)
    ref_o, ref_lse = attention_reference(q, k, v, causal=True)
    ref_grads = attention_backward_reference(do, q, k, v, causal=True)

    def mine(x, axis=1):
        return burst_hpc.shard(x, r, P, "contiguous", axis=axis)

    kw = dict(comm=comm, causal=True, layout="zigzag")
    exchange = make_transport("host", comm, np)
    o, lse, saved = alltoall_zigzag.forward(exchange, lambda *qkv: burst_hpc.burst_attention(*qkv, **kw),
                                            mine(q), mine(k), mine(v))
    np.testing.assert_allclose(o, mine(ref_o), atol=1e-6, err_msg=f"seed {seed}")
    np.testing.assert_allclose(lse, mine(ref_lse, axis=2), atol=1e-5, err_msg=f"seed {seed}")
    for ring in ("q", "kv"):
        grads = alltoall_zigzag.backward(
            exchange, lambda *args: burst_hpc.burst_attention_backward(*args, backward_ring=ring, **kw), mine(do), saved)
        for name, got, want in zip("dq dk dv".split(), grads, ref_grads):
            np.testing.assert_allclose(got, mine(want), atol=2e-5, rtol=1e-4, err_msg=f"{name} {ring} seed {seed}")


@pytest.mark.parametrize("layout,scheme,per_node", [("zigzag", "ring", None), ("contiguous", "ring", None),
                                                    ("balanced", "ring", None), ("balanced", "ring", 1),
                                                    ("zigzag", "double_ring", 1)])
@pytest.mark.parametrize("docs", [False, True])
def test_last_pairs_write_the_outputs_exactly(comm, layout, scheme, per_node, docs, monkeypatch):
    """The passes' last-pair flags (the block contract's out, dq_out, dk_out, dv_out) on every layout and
    schedule, the balanced one's partials coming home included: bf16 inputs, whose outputs the last pair of
    each row writes (the rest converted at the end), equal bit for bit the float32 run on the same values
    converted at the end (the NumPy backend computes both in float32). A pair flagged last too early, or
    not at all where it is, changes some rows."""
    monkeypatch.setenv("BURST_HPC_RING_LAST_PAIRS", "1")
    P, r = comm.size, comm.rank
    q, k, v, do, seed = problem(comm, 1, 24, 4, 2, 16, bfloat16)
    cu = np.array([0, 5, 6, 30, 24 * P]) if docs and 24 * P > 30 else None
    kw = dict(comm=comm, causal=True, layout=layout, scheme=scheme, ranks_per_node=per_node, cu_seqlens=cu)

    def mine(x):
        return burst_hpc.shard(x, r, P, layout)

    runs, first = [], None
    for dtype in (bfloat16, np.float32):
        inputs = [mine(x).astype(dtype) for x in (q, k, v, do)]
        o, lse = burst_hpc.burst_attention(*inputs[:3], **kw)
        first = first or (o, lse)   # both backwards from the same (o, lse)
        grads = burst_hpc.burst_attention_backward(inputs[3], *inputs[:3], first[0].astype(dtype), first[1], **kw)
        runs.append([x.astype(bfloat16) for x in (o, *grads)])
    for name, got, want in zip(("o", "dq", "dk", "dv"), *runs):
        assert got.dtype == bfloat16 and np.array_equal(got.view(np.uint16), want.view(np.uint16)), \
            f"{name} (seed {seed})"
