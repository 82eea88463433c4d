"""The chunks layout through the ring and the gather schedule, on the CPU path, against the float64
oracle on the whole sequence; what the gather schedule moves, counted. Runs under mpiexec with 1..4 ranks."""
from collections import Counter
import os

import numpy as np
import pytest

import burst_hpc
from burst_hpc.errors import BurstError
from burst_hpc.plan import gather, masks
from burst_hpc.plan.callplan import checked_call, plan_arrays
from burst_hpc.plan.layout import as_layout
from burst_hpc.plan.packing import packing
from burst_hpc.plan.workload import documents
from burst_hpc.reference import attention_backward_reference, attention_reference
from test_ring import raises_everywhere, shared_rng

LOCAL = 32   # tokens per rank: chunks of 8 (four a rank)

MASKS = [  # (documents, window, causal)
    ("capped", None, True),      # MagiAttention's benchmark mask, small
    ("capped", None, False),
    (None, None, True),          # plain causal: the placement balances it like zigzag
    (None, (5, 0), True),
    (None, (3, 7), False),
    ("capped", (6, 0), True),
    (None, None, False),         # full attention: every rank sees every chunk
]


def draw(comm, docs, batch=1):
    rng, seed = shared_rng(comm)
    seqlen = LOCAL * comm.size
    cu = None if docs is None else documents(rng, seqlen, "capped", longest=max(1, seqlen // 4))
    q, k, v, do = (rng.standard_normal((batch, seqlen, h, 8)) for h in (4, 2, 2, 4))
    return seed, cu, q, k, v, do


# "gather" on one node runs packed (engine/packed.py: one block call a pass); with every rank a node of its
# own (ranks_per_node=1) the stepped gather schedule
@pytest.mark.parametrize("scheme,per_node", [("auto", None), ("gather", None), ("gather", 1), ("ring", None)])
@pytest.mark.parametrize("docs,window,causal", MASKS)
def test_chunks_forward_and_backward_match_the_oracle(comm, docs, window, causal, scheme, per_node):
    seed, cu, q, k, v, do = draw(comm, docs)
    kw = dict(causal=causal, cu_seqlens=cu, window=window, ranks_per_node=per_node)

    mask = dict(causal=causal, cu_seqlens=cu, window=window)

    def mine(x, axis=1):
        return burst_hpc.shard(x, comm.rank, comm.size, "chunks", axis=axis, **mask)

    ctx = f"seed {seed} {kw} scheme {scheme}"
    ref_o, ref_lse = attention_reference(q, k, v, **mask)
    o, lse = burst_hpc.burst_attention(mine(q), mine(k), mine(v), comm=comm, layout="chunks", scheme=scheme, **kw)
    np.testing.assert_allclose(o, mine(ref_o), atol=1e-10, err_msg=ctx)
    np.testing.assert_allclose(lse, mine(ref_lse, axis=2), rtol=1e-6, err_msg=ctx)
    grads = burst_hpc.burst_attention_backward(mine(do), mine(q), mine(k), mine(v), o, lse, comm=comm,
                                               layout="chunks", scheme=scheme, **kw)
    for name, got, want in zip("dq dk dv".split(), grads, attention_backward_reference(do, q, k, v, **mask)):
        np.testing.assert_allclose(got, mine(want), atol=2e-5, rtol=1e-4, err_msg=f"{name} {ctx}")


@pytest.mark.parametrize("docs,window,causal", [MASKS[0], MASKS[-1]])
def test_packed_gather_of_a_batch_matches_the_oracle(comm, docs, window, causal):
    """The packed passes over a batch of 2: each sequence's keys travel and their partials come home into its own
    rows (the sum home reads sender blocks of (batch, rows) each)."""
    seed, cu, q, k, v, do = draw(comm, docs, batch=2)
    mask = dict(causal=causal, cu_seqlens=cu, window=window)

    def mine(x, axis=1):
        return burst_hpc.shard(x, comm.rank, comm.size, "chunks", axis=axis, **mask)

    kw = dict(comm=comm, layout="chunks", scheme="gather", **mask)
    o, lse = burst_hpc.burst_attention(mine(q), mine(k), mine(v), **kw)
    np.testing.assert_allclose(o, mine(attention_reference(q, k, v, **mask)[0]), atol=1e-10, err_msg=f"seed {seed}")
    grads = burst_hpc.burst_attention_backward(mine(do), mine(q), mine(k), mine(v), o, lse, **kw)
    for name, got, want in zip("dq dk dv".split(), grads, attention_backward_reference(do, q, k, v, **mask)):
        np.testing.assert_allclose(got, mine(want), atol=2e-5, rtol=1e-4, err_msg=f"{name} seed {seed}")


@pytest.mark.parametrize("per_node", [None, 2])
def test_a_placement_weighing_receives_matches_the_oracle(comm, per_node):
    """The chunks Layout placed weighing the keys each rank receives (make_layout's receive; by nodes of 2 where
    there are several), as choose_layout hands it to a caller: shards cut by it, the gather scheme's passes over
    them, the oracle's output and gradients; and it is another placement than the area's where there are ranks
    to swap between."""
    seed, cu, q, k, v, do = draw(comm, "capped")
    mask = masks.make(q.shape[1], True, None, cu)
    nodes = per_node if per_node is not None and comm.size % per_node == 0 else None
    placed = burst_hpc.make_layout("chunks", q.shape[1], comm.size, mask, nodes, chunk=LOCAL // 4, receive=64)
    ctx = f"seed {seed} {placed!r}"

    def mine(x, axis=1):
        return placed.shard(x, comm.rank, axis=axis)

    kw = dict(comm=comm, causal=True, cu_seqlens=cu, layout=placed, scheme="gather", ranks_per_node=nodes)
    ref_o, ref_lse = attention_reference(q, k, v, causal=True, cu_seqlens=cu)
    o, lse = burst_hpc.burst_attention(mine(q), mine(k), mine(v), **kw)
    np.testing.assert_allclose(o, mine(ref_o), atol=1e-10, err_msg=ctx)
    np.testing.assert_allclose(lse, mine(ref_lse, axis=2), rtol=1e-6, err_msg=ctx)
    grads = burst_hpc.burst_attention_backward(mine(do), mine(q), mine(k), mine(v), o, lse, **kw)
    for name, got, want in zip("dq dk dv".split(), grads, attention_backward_reference(do, q, k, v, causal=True,
                                                                                      cu_seqlens=cu)):
        np.testing.assert_allclose(got, mine(want), atol=2e-5, rtol=1e-4, err_msg=f"{name} {ctx}")


@pytest.mark.parametrize("per_node", [None, 1])
def test_gather_runs_packed_on_one_node_and_stepped_across_nodes(comm, per_node, monkeypatch):
    """One node: the gather scheme's passes are one block call each on packed keys; every rank a node of its
    own: the stepped schedule (ring passes), which hides the transfers under each rank's own work."""
    from burst_hpc.engine.packed import PackedPasses

    seed, cu, q, k, v, do = draw(comm, "capped")
    placed = as_layout("chunks", q.shape[1], comm.size, causal=True, cu_seqlens=cu, window=None)
    shards = [placed.shard(x, comm.rank) for x in (q, k, v)]
    plan = plan_arrays(comm, shards[0], checked_call(comm.size, *shards, True, None, placed, "auto", cu_seqlens=cu,
                                                     scheme="gather", ranks_per_node=per_node))
    packed = per_node is None or comm.size == 1
    assert isinstance(plan.passes, PackedPasses) == packed
    if packed:
        calls = []
        monkeypatch.setattr(plan.backend, "forward_block", lambda *a, **kw: calls.append(kw))
        plan.passes.forward(*shards)
        p = plan.passes.packing
        start = p.start    # a rank alone with its own run keeps the call's own mask from there
        early, late = p.split(shards[0].shape[1])
        assert len(calls) == len(early) + len(late) and all(c["first"] for c in calls)
        assert [c["q_start"] for c in calls] == [(0 if start is None else start) + lo for lo, _ in early + late]
        assert all(c["k_start"] == (0 if start is None else start) for c in calls)


def test_the_forward_computes_rows_that_see_only_own_keys_while_the_others_travel(comm, monkeypatch):
    """The packed forward's early runs (rows whose keys are all the rank's own) are block calls issued before the
    keys' exchange is waited for, the rest after; every row is computed once and the results (the backward's
    too, after such a forward) are the oracle's."""
    seqlen = LOCAL * comm.size
    cu, placed = None, as_layout("chunks", seqlen, comm.size, causal=True, cu_seqlens=None, window=None)
    for seed in range(100 if comm.size > 1 else 0):   # the first whose documents give a rank early runs
        cu = documents(np.random.default_rng(seed), seqlen, "capped", longest=max(1, seqlen // 4))
        placed = as_layout("chunks", seqlen, comm.size, causal=True, cu_seqlens=cu, window=None)
        if any(packing(masks.make(seqlen, True, None, cu), placed, r).early for r in range(comm.size)):
            break
    else:
        seed = 0
    rng = np.random.default_rng([seed, 5])
    q, k, v, do = (rng.standard_normal((1, seqlen, h, 8)) for h in (4, 2, 2, 4))
    shards = [placed.shard(x, comm.rank) for x in (q, k, v, do)]
    plan = plan_arrays(comm, shards[0], checked_call(comm.size, *shards[:3], True, None, placed, "auto",
                                                     cu_seqlens=cu, scheme="gather"))
    log, real = [], plan.backend.forward_block

    def block(q, *a, **kw):
        lo = kw["q_start"] - plan.passes.where["q_start"]
        log.append(("call", lo, lo + q.shape[1]))
        return real(q, *a, **kw)

    class Waits:   # the plan's transport, the moment its exchange is waited for logged
        def __init__(self, inner):
            self.inner = inner

        def exchange(self, sends, recvs):
            pending = self.inner.exchange(sends, recvs)

            class Logged:
                def wait(self):
                    log.append(("wait",))
                    pending.wait()
            return Logged()

    p = plan.passes.packing
    early, late = p.split(shards[0].shape[1])
    own = np.zeros(p.keys, bool)
    own[p.own] = True
    for lo, hi in early:   # every key an early row sees is the rank's own
        assert all(own[p.lo[r]:p.hi[r]].all() for r in range(lo, hi))
    assert comm.allreduce(len(early)) > 0 or comm.size == 1
    assert sum(hi - lo for lo, hi in early + late) == shards[0].shape[1]
    near = plan.decomposition.transports(plan.xp)[0]
    monkeypatch.setattr(plan.backend, "forward_block", block)
    o, lse = plan.passes.forward(*shards[:3], transport=Waits(near))
    waits = [n for n, entry in enumerate(log) if entry[0] == "wait"]
    assert [entry[1:] for entry in log[:waits[0]] if entry[0] == "call"] == list(early) if waits else not early
    assert sorted(entry[1:] for entry in log if entry[0] == "call") == sorted(early + late)
    grads = plan.passes.backward(None, shards[3], *shards[:3], o, lse)
    mask = dict(causal=True, cu_seqlens=cu)
    ref_o, ref_lse = attention_reference(q, k, v, **mask)
    np.testing.assert_allclose(o, placed.shard(ref_o, comm.rank), atol=1e-10, err_msg=f"seed {seed}")
    np.testing.assert_allclose(lse, placed.shard(ref_lse, comm.rank, axis=2), rtol=1e-6, err_msg=f"seed {seed}")
    for name, got, want in zip("dq dk dv".split(), grads, attention_backward_reference(do, q, k, v, **mask)):
        np.testing.assert_allclose(got, placed.shard(want, comm.rank), atol=2e-5, rtol=1e-4, err_msg=f"{name} {seed}")


def test_gather_ranks_alone_with_their_documents_run_their_own_mask(comm, monkeypatch):
    """Documents ending at rank boundaries: nothing arrives, each rank's packed call is the call's own mask from
    its first position (no packed bounds), and the result is the oracle's."""
    rng, seed = shared_rng(comm)
    seqlen = LOCAL * comm.size
    cu = np.arange(0, seqlen + 1, LOCAL)
    q, k, v, do = (rng.standard_normal((1, seqlen, h, 8)) for h in (4, 2, 2, 4))
    mask = dict(causal=True, cu_seqlens=cu, window=None)
    placed = as_layout("chunks", seqlen, comm.size, **mask)
    shards = [placed.shard(x, comm.rank) for x in (q, k, v)]
    plan = plan_arrays(comm, shards[0], checked_call(comm.size, *shards, True, None, placed, "auto", cu_seqlens=cu,
                                                     scheme="gather"))
    assert plan.passes.packing.start == comm.rank * LOCAL and not plan.passes.packing.receives
    o, lse = plan.passes.forward(*shards)
    ref_o, ref_lse = attention_reference(q, k, v, **mask)
    np.testing.assert_allclose(o, placed.shard(ref_o, comm.rank), atol=1e-10, err_msg=f"seed {seed}")
    np.testing.assert_allclose(lse, placed.shard(ref_lse, comm.rank, axis=2), rtol=1e-6, err_msg=f"seed {seed}")


def test_a_rank_that_receives_nothing_adds_what_others_send_home(comm):
    """Rank 0's queries see only its own keys (its first document ends inside it, the second starts there and
    runs over every rank), so nothing arrives and its buffer is its own keys as they are; every other rank's
    queries see its last keys, whose dK, dV come home and are added into rank 0's own gradients."""
    rng, seed = shared_rng(comm)
    seqlen = LOCAL * comm.size
    cu = np.array([0, LOCAL - 3, seqlen])
    q, k, v, do = (rng.standard_normal((1, seqlen, h, 8)) for h in (4, 2, 2, 4))
    mask = dict(causal=True, cu_seqlens=cu, window=None)
    placed = as_layout("contiguous", seqlen, comm.size, **mask)
    shards = [placed.shard(x, comm.rank) for x in (q, k, v, do)]
    plan = plan_arrays(comm, shards[0], checked_call(comm.size, *shards[:3], True, None, placed, "auto",
                                                     cu_seqlens=cu, scheme="gather"))
    if comm.rank == 0:
        assert plan.passes.packing.start == 0 and not plan.passes.packing.receives
        assert bool(plan.passes.packing.sends) == (comm.size > 1)
    o, lse = plan.passes.forward(*shards[:3])
    grads = plan.passes.backward(None, shards[3], *shards[:3], o, lse)
    for name, got, want in zip("dq dk dv".split(), grads, attention_backward_reference(do, q, k, v, **mask)):
        np.testing.assert_allclose(got, placed.shard(want, comm.rank), atol=2e-5, rtol=1e-4,
                                   err_msg=f"{name} seed {seed}")


class Counting:
    """The real transport, counting every array sent and received by this rank (and its bytes)."""

    def __init__(self, inner):
        self.inner, self.sent, self.received = inner, [], []
        self.xp, self.rank, self.size = inner.xp, inner.rank, inner.size

    def exchange(self, sends, recvs):
        self.sent += [(peer, a.shape[1], a.nbytes, a) for peer, arrays in sends for a in arrays]
        self.received += [(peer, a.shape[1], a.nbytes, a) for peer, arrays in recvs for a in arrays]
        return self.inner.exchange(sends, recvs)


def by_peer(messages):
    """[(peer, tokens)] summed over ``messages`` (Counting's), by peer."""
    totals = Counter()
    for peer, n, _, _ in messages:
        totals[peer] += n
    return sorted(totals.items())


@pytest.mark.parametrize("layout", ["chunks", "zigzag"])
def test_gather_moves_exactly_the_keys_a_rank_sees(comm, layout):
    """Forward: from each other rank, K and V of the runs this rank's queries see (gather.sight), sent from the
    owner's own arrays (a message a run of consecutive positions: no copy), and nothing else (no partial comes
    back). Backward: the same K/V, and dK, dV (float64 here) of those runs go home once."""
    seed, cu, q, k, v, do = draw(comm, "capped")
    kw = dict(causal=True, cu_seqlens=cu, window=None)
    P, r = comm.size, comm.rank

    def mine(x):
        return burst_hpc.shard(x, r, P, layout, **kw)

    shards = [mine(x) for x in (q, k, v)]
    placed = as_layout(layout, q.shape[1], P, **kw)
    plan = plan_arrays(comm, shards[0], checked_call(P, *shards, True, None, placed, "auto", cu_seqlens=cu,
                                                     scheme="gather"))
    _, seen, _ = gather.sight(plan.mask, plan.layout)

    def expected(receiver):
        """(owner, tokens) ``receiver`` gets of K and V together from each owner."""
        return [(b, 2 * sum(hi - lo for lo, hi in seen[receiver][b])) for b in range(P)
                if b != receiver and seen[receiver][b]]

    counting = Counting(plan.decomposition.transports(plan.xp)[0])
    o, lse = plan.passes.forward(*shards, transport=counting)
    kv_bytes = 2 * 8 * 8   # Hkv * D * float64, a token of K or of V
    mine_in = expected(r)
    assert by_peer(counting.received) == sorted(mine_in), f"seed {seed}"
    assert sum(b for _, _, b, _ in counting.received) == kv_bytes * sum(n for _, n in mine_in)
    theirs = sorted((a, n) for a in range(P) for b, n in expected(a) if b == r)   # who sees this rank's runs
    assert by_peer(counting.sent) == theirs, f"seed {seed}"
    assert all(np.shares_memory(a, shards[1]) or np.shares_memory(a, shards[2]) for *_, a in counting.sent)
    counting = Counting(plan.decomposition.transports(plan.xp)[0])
    plan.passes.backward("kv", mine(do), *shards, o, lse, transport=counting)
    both = sorted((Counter(dict(mine_in)) + Counter(dict(theirs))).items())   # K/V in and partials home, alike
    assert by_peer(counting.received) == both, f"seed {seed}"
    assert by_peer(counting.sent) == both, f"seed {seed}"


def test_a_peer_with_many_runs_gets_one_gathered_message(comm, monkeypatch):
    """Past IN_PLACE_RUNS runs to a peer (here 1) the packed forward sends that peer one gathered copy of K and one
    of V, received apart and placed after the wait (both ends decide alike: no hang), and the output is the
    oracle's."""
    from burst_hpc.engine import packed

    monkeypatch.setattr(packed, "IN_PLACE_RUNS", 1)
    seed, cu, q, k, v, _ = draw(comm, "capped")
    kw = dict(causal=True, cu_seqlens=cu, window=None)
    P, r = comm.size, comm.rank
    shards = [burst_hpc.shard(x, r, P, "chunks", **kw) for x in (q, k, v)]
    placed = as_layout("chunks", q.shape[1], P, **kw)
    plan = plan_arrays(comm, shards[0], checked_call(P, *shards, True, None, placed, "auto", cu_seqlens=cu,
                                                     scheme="gather"))
    counting = Counting(plan.decomposition.transports(plan.xp)[0])
    o, _ = plan.passes.forward(*shards, transport=counting)
    runs = {a: len(cuts) - 1 for (a, _), cuts in zip(plan.passes.packing.sends, plan.passes.packing.send_cuts)}
    for peer, n, _, a in counting.sent:
        assert np.shares_memory(a, shards[1]) or np.shares_memory(a, shards[2]) or runs[peer] > 1, f"seed {seed}"
        assert runs[peer] == 1 or n == sum(hi - lo for lo, hi in gather.sight(plan.mask, plan.layout)[1][peer][r])
    ref_o, _ = attention_reference(q, k, v, **kw)
    np.testing.assert_allclose(o, placed.shard(ref_o, r), rtol=1e-9, atol=1e-9, err_msg=f"seed {seed}")


def test_gather_refuses_the_q_ring_on_every_rank(comm):
    """scheme='gather' named with backward_ring='q' is refused alike on every rank ('auto' runs the ring then:
    test_backward_ring_q_keeps_auto_off_the_gather)."""
    _, _, q, k, v, do = draw(comm, None)

    def mine(x):
        return burst_hpc.shard(x, comm.rank, comm.size, "chunks", causal=True, cu_seqlens=None, window=None)

    o, lse = burst_hpc.burst_attention(mine(q), mine(k), mine(v), comm=comm, causal=True, layout="chunks")
    raises_everywhere(comm, BurstError, lambda: burst_hpc.burst_attention_backward(
        mine(do), mine(q), mine(k), mine(v), o, lse, comm=comm, causal=True, layout="chunks", scheme="gather",
        backward_ring="q"), match="backward_ring='q' runs on the other schemes")


def test_a_run_job_in_the_chunks_layout_writes_every_token_in_its_place(comm, tmp_path_factory):
    """job.run with --layout chunks: each rank reads and writes its own chunks of the HDF5 files, and the
    output (natural order) matches the float64 oracle on the whole sequence."""
    from burst_hpc import io
    from burst_hpc.job.run import RunOptions, run

    where = comm.bcast(str(tmp_path_factory.mktemp("chunks")) if comm.rank == 0 else None)
    src, dst = os.path.join(where, "in.h5"), os.path.join(where, "out.h5")
    if comm.rank == 0:
        io.generate(src, 1, LOCAL * comm.size, 4, 2, 8, np.float64, seed=2, with_grad=True, documents=5)
    comm.Barrier()
    run(RunOptions(src, dst, backend="numpy", causal=True, backward=True, layout="chunks", progress=False), comm)
    if comm.rank == 0:
        inputs, got = io.read_global(src), io.read_global(dst)
        kw = dict(causal=True, cu_seqlens=inputs["cu_seqlens"])
        o, lse = attention_reference(inputs["q"], inputs["k"], inputs["v"], **kw)
        grads = attention_backward_reference(inputs["do"], inputs["q"], inputs["k"], inputs["v"], **kw)
        for name, want in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, *grads)):
            np.testing.assert_allclose(got[name], want, atol=2e-5, rtol=1e-4, err_msg=name)
    comm.Barrier()


def test_a_decomposition_in_the_chunks_layout_runs_the_gather_scheme(comm):
    """Decomposition(layout='chunks'): the placement of its mask, the gather scheme, arrays cut and run."""
    seed, cu, q, k, v, do = draw(comm, "capped")
    S = LOCAL * comm.size
    d = burst_hpc.Decomposition(comm, seqlen=S, heads=4, kv_heads=2, head_dim=8, dtype="float64", causal=True,
                                cu_seqlens=cu, layout="chunks")
    assert d.layout == burst_hpc.make_layout("chunks", S, comm.size, masks.make(S, True, None, cu))
    assert d.scheme.name == "gather" and d.ring == "kv"
    mine = [d.shard(x) for x in (q, k, v, do)]
    o, lse = d.attention(*mine[:3])
    grads = d.attention_backward(mine[3], *mine[:3], o, lse)
    np.testing.assert_allclose(o, d.shard(attention_reference(q, k, v, causal=True, cu_seqlens=cu)[0]), atol=1e-10,
                               err_msg=f"seed {seed}")
    for got, want in zip(grads, attention_backward_reference(do, q, k, v, causal=True, cu_seqlens=cu)):
        np.testing.assert_allclose(got, d.shard(want), atol=2e-5, rtol=1e-4, err_msg=f"seed {seed}")


def test_backward_ring_q_keeps_auto_off_the_gather(comm):
    """The gather scheme's backward moves keys and values: with backward_ring='q' and the backward, 'auto' runs
    the chunks layout on the ring and never picks a layout it would gather for; a forward alone does not ask."""
    _, cu, *_ = draw(comm, "capped")
    kw = dict(seqlen=LOCAL * comm.size, heads=4, kv_heads=2, head_dim=8, dtype="float64", causal=True, cu_seqlens=cu,
              backward_ring="q")
    assert burst_hpc.Decomposition(comm, layout="chunks", backward=True, **kw).scheme.name == "ring"
    assert burst_hpc.Decomposition(comm, layout="chunks", backward=False, **kw).scheme.name == "gather"
    assert burst_hpc.Decomposition(comm, layout="auto", backward=True, **kw).scheme.name != "gather"
