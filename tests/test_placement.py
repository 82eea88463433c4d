"""The chunks layout's placement (plan/placement.py) and the gather schedule's sight (plan/gather.py)."""
import numpy as np
import pytest

from burst_hpc.errors import LayoutError
from burst_hpc.plan import gather, masks, placement
from burst_hpc.plan.layout import layout_indices, make_layout, shard, unshard
from burst_hpc.plan.workload import documents


def capped(seed, size, local):
    """MagiAttention's benchmark mask: causal documents of uniform length up to S/4."""
    seqlen = size * local
    cu = documents(np.random.default_rng(seed), seqlen, "capped", longest=seqlen // 4)
    return masks.make(seqlen, True, None, cu)


@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("seed", range(4))
def test_area_is_balanced_on_the_issues_documents(seed, size):
    mask = capped(seed, size, 8192)
    found = placement.place(mask, size)
    assert found.imbalance <= 1 + placement.TOLERANCE
    assert found.chunk % placement.TILE == 0 and 8192 // found.chunk in placement.CHUNKS_PER_RANK
    # every chunk once, the same count on every rank, the areas the mask's
    chunks = sorted(c for owned in found.owned for c in owned)
    assert chunks == list(range(size * 8192 // found.chunk))
    assert len({len(owned) for owned in found.owned}) == 1
    lo, hi = mask.intervals
    for owned, area in zip(found.owned, found.area):
        rows = np.concatenate([np.arange(c * found.chunk, (c + 1) * found.chunk) for c in owned])
        assert area == (hi - lo)[rows].sum()


def test_plain_causal_is_balanced_exactly():
    mask = masks.Mask(4 * 2048, True, None, None)
    assert placement.place(mask, 4).imbalance == 1.0


def test_short_documents_stay_on_one_rank_when_balance_allows():
    """Documents of 1, 2, 1, 2, 1, 1 chunks over two ranks of four chunks: each rank can hold one
    document of two chunks and two of one at equal area, so none crosses ranks; dealing by area
    alone splits the first of two chunks."""
    size, chunk = 2, 4
    cu = np.array([0, 1, 3, 4, 6, 7, 8]) * chunk
    mask = masks.make(int(cu[-1]), True, None, cu)
    found = placement.place_chunks(mask, size, chunk)
    assert found.imbalance == 1.0
    doc = np.searchsorted(cu, np.arange(8) * chunk, side="right") - 1   # the document of each chunk
    assert all(len({r for r, owned in enumerate(found.owned) for c in owned if doc[c] == d}) == 1 for d in range(6))
    loose, _ = placement.deal(masks.block_counts(mask, chunk, chunk).sum(axis=1), size)
    assert {1, 2} not in [set(owned) & {1, 2} for owned in loose]   # what the swaps repair


def test_a_document_longer_than_a_share_must_cross():
    mask = masks.make(64, True, None, np.array([0, 40, 64]))
    found = placement.place(mask, 2)
    owner = {c: r for r, owned in enumerate(found.owned) for c in owned}
    first_doc = {owner[c] for c in range(40 // found.chunk)}
    assert first_doc == {0, 1}


def test_layout_functions_follow_the_placement():
    size, local = 4, 512
    seqlen = size * local
    cu = documents(np.random.default_rng(3), seqlen, "capped", longest=seqlen // 4)
    mask = masks.make(seqlen, True, None, cu)
    kw = dict(causal=True, cu_seqlens=cu, window=None)
    x = np.random.default_rng(0).standard_normal((2, seqlen, 3))
    parts = [shard(x, r, size, "chunks", **kw) for r in range(size)]
    np.testing.assert_array_equal(unshard(parts, "chunks", **kw), x)
    every = np.concatenate([layout_indices(seqlen, r, size, "chunks", **kw) for r in range(size)])
    assert sorted(every) == list(range(seqlen))
    for r in range(size):
        assert make_layout("chunks", seqlen, size, mask).pieces(r) == placement.place(mask, size).pieces(r)
        np.testing.assert_array_equal(parts[r], x[:, layout_indices(seqlen, r, size, "chunks", **kw)])
    with pytest.raises(LayoutError, match="places tokens by the mask"):
        make_layout("chunks", seqlen, size)
    with pytest.raises(LayoutError, match="places tokens by the mask"):   # a name needs the call's mask said
        shard(x, 0, size, "chunks")


@pytest.mark.parametrize("layout", ["chunks", "chunks weighing receives", "zigzag", "contiguous"])
@pytest.mark.parametrize("seed", range(3))
def test_each_rank_receives_exactly_the_keys_its_queries_see(seed, layout):
    """sight's runs against a brute force over the mask: the units of another rank's shard that hold
    a key some query of this rank sees, no more, no fewer."""
    size, local = 4, 64
    rng = np.random.default_rng(seed)
    seqlen = size * local
    cu = documents(rng, seqlen, "capped", longest=seqlen // 4)
    window = (int(rng.integers(0, seqlen // 2)), 0) if seed == 2 else None
    mask = masks.make(seqlen, True, window, cu)
    weighted = layout == "chunks weighing receives"
    placed = make_layout("chunks", seqlen, size, mask, chunk=16, receive=40) if weighted else \
        make_layout(layout, seqlen, size, mask)
    units, seen, unit = gather.sight(mask, placed)
    lo, hi = mask.intervals
    for a in range(size):
        rows = np.concatenate([np.arange(s, s + n) for s, n in placed.pieces(a)])
        visible = np.zeros(seqlen, bool)
        for i in rows:
            visible[lo[i]:hi[i]] = True
        for b in range(size):
            keys = np.concatenate([np.arange(s, s + n) for s, n in placed.pieces(b)])
            wanted = {p // unit for p, key in enumerate(keys) if visible[key]}
            got = {p // unit for lo_, hi_ in seen[a][b] for p in range(lo_, hi_)}
            assert got == wanted, (a, b)


@pytest.mark.parametrize("per_node,steps", [(None, 3), (8, 3), (4, 4), (2, 8), (1, 8)])
def test_the_gather_takes_a_step_a_node(per_node, steps):
    """Across nodes the gather's work is cut into as many steps as the nodes (three at least, eight at most), the
    same in the plan the engine runs and the model prices; over one node three."""
    size = 16
    mask = capped(1, size, 512)
    layout = make_layout("chunks", mask.seqlen, size, mask, per_node)
    assert gather.step_count(layout) == steps
    count, tasks, _ = gather.plan(mask, layout, ("q",))
    assert count == steps and max(len(t) for t in tasks) == steps


@pytest.mark.parametrize("returns", [("q",), ("kv", "q")], ids=["forward", "backward"])
def test_gather_steps_hold_equal_work_and_move_each_run_once(returns):
    """The gather plan on the issue's documents (4 ranks, 8k tokens each): step 0 holds each rank's own
    keys only, every step's busiest rank within 5% of the mean rank (the critical path the step
    model prices), each rank's work all its visible pairs; each (receiver, owner) pair's keys move
    once, posted at step 0 and due before their first use, and (backward) their dK/dV once, home
    after their last use."""
    size = 4
    mask = capped(0, size, 8192)
    layout = make_layout("chunks", mask.seqlen, size, mask)
    count, tasks, moves = gather.plan(mask, layout, returns)
    work = np.array([[sum(w for _, _, w in tasks[r][t]) if t < len(tasks[r]) else 0 for r in range(size)]
                     for t in range(count)])
    assert work.max(axis=1).sum() <= 1.05 * work.sum() / size
    assert all(shard == r for r in range(size) for shard, _, _ in tasks[r][0])
    assert list(work.sum(axis=0)) == list(masks.pair_work(mask, layout).sum(axis=1))
    used = {}
    for r in range(size):
        for t, visits in enumerate(tasks[r]):
            for shard, _, _ in visits:
                if shard != r:
                    used.setdefault((r, shard), []).append(t)
    data = [(m[3], m[2]) for m in moves if m[4] == "data"]
    assert sorted(data) == sorted(used) and len(set(data)) == len(data)
    for posted, due, sender, receiver, what, _, _ in moves:
        steps = used[(receiver, sender) if what == "data" else (sender, receiver)]
        if what == "data":
            assert posted == 0 and due == min(steps) - 1
        else:
            assert posted == max(steps) + 1 and due == count - 1
    assert sum(m[4] == "partial" for m in moves) == (len(used) if "kv" in returns else 0)


def test_auto_runs_the_gather_scheme_only_where_its_held_keys_fit():
    """Plain causal over 8 ranks at 512k tokens a rank: the last rank's queries see every key, 7 shards of K/V
    received (and their float32 gradients) past gather.HELD_BYTES: 'auto' runs the chunks layout on
    the ring. MagiAttention's documents at 8k tokens a rank over 8 ranks: a few shards, a few hundred MB:
    'auto' gathers."""
    from burst_hpc.plan import costmodel

    one_node = costmodel.Cluster(1, 8)
    seqlen = 8 * 512 * 1024
    causal = costmodel.Problem(1, seqlen, 32, 8, 128, 2, masks.Mask(seqlen, True))
    layout = make_layout("chunks", seqlen, 8, causal.mask)
    assert gather.held(causal.mask, layout) == 8.0
    assert gather.held_bytes(causal, layout) > gather.HELD_BYTES
    assert costmodel.auto_schemes(layout, one_node, causal) == ("ring",)
    docs = capped(0, 8, 8192)
    pr = costmodel.Problem(1, 8 * 8192, 64, 8, 128, 2, docs)
    layout = make_layout("chunks", 8 * 8192, 8, docs)
    assert gather.held(docs, layout) > 2 and gather.held_bytes(pr, layout) < 1 << 30
    assert costmodel.auto_schemes(layout, one_node, pr) == ("gather",)


def test_plan_prices_what_the_gather_holds():
    """The peak memory of the gather scheme is the ring's plus every received run of keys and values (and their
    float32 gradients in the backward): with full attention over 4 ranks, three shards of K/V more."""
    from burst_hpc.plan import costmodel
    from burst_hpc.plan.memory import peak_memory

    seqlen, ranks = 4 * 1024, 4
    pr = costmodel.Problem(1, seqlen, 8, 2, 64, 2, masks.Mask(seqlen))
    cl = costmodel.Cluster(1, ranks)
    layout = make_layout("chunks", seqlen, ranks, pr.mask)
    kv = 1024 * 2 * 2 * 64   # a shard of K and V: tokens x (K, V) x Hkv x D, in elements
    assert peak_memory("gather", pr, cl, False, layout) - peak_memory("ring", pr, cl) == 3 * kv * 2
    assert peak_memory("gather", pr, cl, True, layout) - peak_memory("ring", pr, cl, True) == 3 * kv * (2 + 4)


def cross_node_pairs(mask, found, per_node):
    """Visible (query, key) pairs whose query and key chunks lie on different nodes."""
    pairs = masks.block_counts(mask, found.chunk, found.chunk)
    node = np.empty(pairs.shape[0], np.int64)
    for rank, owned in enumerate(found.owned):
        node[list(owned)] = rank // per_node
    return int(pairs[node[:, None] != node[None, :]].sum())


def test_by_nodes_a_document_stays_on_its_node():
    """Two documents of 8 chunks over 2 nodes of 2 ranks (4 chunks a rank): each node holds one whole, so no
    key crosses the network, and every rank's area is the same."""
    chunk = 4
    cu = np.array([0, 8, 16]) * chunk
    mask = masks.make(int(cu[-1]), True, None, cu)
    found = placement.place_chunks(mask, 4, chunk, per_node=2)
    assert cross_node_pairs(mask, found, 2) == 0
    assert found.imbalance == 1.0
    assert sorted(c for owned in found.owned for c in owned) == list(range(16))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("size,per_node", [(16, 8), (16, 4), (12, 4)])
def test_by_nodes_fewer_pairs_cross_the_network(seed, size, per_node):
    """MagiAttention's documents: dealt to the nodes first, fewer visible pairs cross nodes than dealt flat, every
    chunk once, the same count on every rank, each node's area within a few percent of the mean."""
    mask = capped(seed, size, 2048)
    for count in placement.chunk_counts(2048)[:2]:
        chunk = 2048 // count
        flat = placement.place_chunks(mask, size, chunk)
        found = placement.place_chunks(mask, size, chunk, per_node)
        assert cross_node_pairs(mask, found, per_node) < cross_node_pairs(mask, flat, per_node)
        assert sorted(c for owned in found.owned for c in owned) == list(range(size * count))
        assert {len(owned) for owned in found.owned} == {count}
        nodes = np.add.reduceat(np.array(found.area), np.arange(0, size, per_node))
        assert nodes.max() <= 1.1 * nodes.mean() and found.imbalance <= 1.15


def test_layout_by_nodes():
    """make_layout's ranks_per_node: the placement by nodes, said in its repr and kept through pickling; one
    node (or none said) the flat placement; nodes that do not split the ranks refused; held_by moves a
    position's pieces to the rank the launcher put there."""
    import pickle

    size, local = 8, 1024
    mask = capped(1, size, local)
    by_nodes = make_layout("chunks", mask.seqlen, size, mask, ranks_per_node=4)
    assert by_nodes.per_node == 4 and by_nodes.nodes == (0,) * 4 + (1,) * 4 and "by nodes of 4" in repr(by_nodes)
    assert [by_nodes.pieces(r) for r in range(size)] == [placement.place(mask, size, 4).pieces(r) for r in range(size)]
    again = pickle.loads(pickle.dumps(by_nodes))
    assert again == by_nodes and again.per_node == 4
    flat = make_layout("chunks", mask.seqlen, size, mask)
    assert make_layout("chunks", mask.seqlen, size, mask, ranks_per_node=size) == flat and flat.per_node is None
    assert make_layout("zigzag", mask.seqlen, size, mask, ranks_per_node=4).per_node is None
    with pytest.raises(LayoutError, match="do not fill nodes of 3"):
        make_layout("chunks", mask.seqlen, size, mask, ranks_per_node=3)
    with pytest.raises(LayoutError, match="do not split"):
        make_layout("chunks", mask.seqlen, size, mask, chunk=300)
    assert make_layout("chunks", mask.seqlen, size, mask, chunk=128).grain == 128
    order = [0, 4, 1, 5, 2, 6, 3, 7]   # round-robin over two nodes: position p is rank order[p]
    moved = by_nodes.held_by(order)
    assert all(moved.pieces(order[p]) == by_nodes.pieces(p) and moved.nodes[order[p]] == p // 4 for p in range(size))
    assert by_nodes.held_by(range(size)) is by_nodes


def test_choose_layout_places_by_nodes_across_them():
    """16 ranks as 2 nodes of 8 on MagiAttention's documents: the chunks layout priced is placed by nodes, and
    predicted faster than the flat placement (fewer keys cross the network)."""
    from burst_hpc.plan import costmodel
    from burst_hpc.plan.rates import GPU_RATES

    size = 16
    mask = capped(0, size, 8192)
    pr = costmodel.Problem(1, mask.seqlen, 64, 8, 128, 2, mask)
    cl, rates = costmodel.Cluster(2, 8), GPU_RATES["H100"]
    placed = costmodel.cluster_layouts(pr, cl, rates)["chunks"]
    assert placed.per_node == 8
    flat = make_layout("chunks", mask.seqlen, size, mask)
    assert (costmodel.predict("gather", pr, cl, rates, placed).fwdbwd <
            0.9 * costmodel.predict("gather", pr, cl, rates, flat).fwdbwd)


@pytest.mark.parametrize("returns", [("q",), ("kv", "q")], ids=["forward", "backward"])
def test_gather_visits_other_nodes_keys_last_forward_first_backward(returns):
    """Placed by nodes (4 nodes of 4 on the issue's documents), the gather's visits take another node's keys
    after the node's own in the forward (they have the longest to cross the network) and before them in the
    backward (their partials go home under the rest); each rank's work is all its visible pairs either way."""
    size, per_node = 16, 4
    mask = capped(2, size, 2048)
    layout = make_layout("chunks", mask.seqlen, size, mask, ranks_per_node=per_node)
    _, tasks, _ = gather.plan(mask, layout, returns)
    crossed = 0
    for r in range(size):
        far = [layout.nodes[shard] != layout.nodes[r] for step in tasks[r] for shard, _, _ in step if shard != r]
        crossed += any(far)
        assert far == sorted(far, reverse="kv" in returns), r
        assert sum(w for step in tasks[r] for _, _, w in step) == masks.pair_work(mask, layout)[r].sum()
    assert crossed   # some rank sees keys on another node


def test_a_named_scheme_prices_the_chunks_it_runs():
    """cluster_layouts with a scheme named: the chunk is within MARGIN of the fastest under that scheme, the
    flat ring here (not the gather 'auto' runs), and choose_layout with it returns a layout."""
    import burst_hpc
    from burst_hpc.plan import costmodel
    from burst_hpc.plan.rates import GPU_RATES

    mask = capped(1, 8, 2048)
    pr = costmodel.Problem(1, mask.seqlen, 16, 4, 128, 2, mask)
    cl, rates = costmodel.Cluster(2, 4), GPU_RATES["H100"]
    chosen = costmodel.cluster_layouts(pr, cl, rates, scheme="ring")["chunks"]
    times = [costmodel.predict("ring", pr, cl, rates, make_layout("chunks", mask.seqlen, 8, mask, 4, 2048 // n)).fwdbwd
             for n in placement.chunk_counts(2048)]
    assert costmodel.predict("ring", pr, cl, rates, chosen).fwdbwd <= min(times) / (1 - costmodel.MARGIN)
    assert isinstance(burst_hpc.choose_layout(mask.seqlen, 8, causal=True, cu_seqlens=mask.cu_seqlens, heads=16,
                                              kv_heads=4, ranks_per_node=4, scheme="ring", rates=rates),
                      burst_hpc.Layout)


def naive_balance_receives(owner, areas, sight, size, weight):
    """balance_receives written plainly: every cost from scratch, every swap tried in its order (the costliest
    part; its partners cheapest first, then its chunks, then theirs, in chunk order)."""
    owner = owner.copy()

    def cost(p):
        held = owner == p
        return int(areas[held].sum()) + weight * int((sight[held].any(axis=0) & ~held).sum())

    while True:
        costs = [cost(p) for p in range(size)]
        a = int(np.argmax(costs))
        best, swap = costs[a], None
        for b in sorted((p for p in range(size) if p != a), key=lambda p: (costs[p], p))[:placement.PARTNERS]:
            for i in np.flatnonzero(owner == a):
                for j in np.flatnonzero(owner == b):
                    owner[i], owner[j] = b, a
                    high = max(cost(p) for p in range(size))
                    owner[i], owner[j] = a, b
                    if high < best:
                        best, swap = high, (i, j)
        if swap is None:
            return owner
        i, j = swap
        owner[i], owner[j] = owner[j], owner[i]


@pytest.mark.parametrize("seed", range(40))
def test_balance_receives_takes_the_swaps_a_plain_search_takes(seed):
    """The incremental search (counts of the chunks that see each key, a part's swaps priced at once) ends where
    the plain one does, on random areas and sight: up to 11 parts (more than PARTNERS, the partners a round
    tries), chunks that do not see themselves, chunks whose queries see nothing, areas all zero."""
    rng = np.random.default_rng(seed)
    size = int(rng.integers(2, 12))
    n = size * int(rng.integers(1, 5))
    areas = rng.integers(0, 50, n) if seed % 7 else np.zeros(n, np.int64)
    sight = rng.random((n, n)) < rng.uniform(0.05, 0.5)
    if seed % 3:
        np.fill_diagonal(sight, True)
    sight[rng.random(n) < 0.15] = False
    owner = rng.permutation(np.repeat(np.arange(size), n // size))
    weight = int(rng.integers(1, 400))
    got = placement.balance_receives(owner, areas, sight, size, weight)
    assert np.array_equal(got, naive_balance_receives(owner, areas, sight, size, weight))
    assert np.array_equal(np.bincount(got, minlength=size), np.bincount(owner, minlength=size))


def loads(mask, found, weight):
    """Each rank's area plus ``weight`` for each key row of another rank its queries see, counted here."""
    chunk = found.chunk
    sight = masks.block_counts(mask, chunk, chunk) > 0
    owner = np.empty(len(sight), np.int64)
    for r, held in enumerate(found.owned):
        owner[list(held)] = r
    return [a + weight * chunk * int((sight[owner == r].any(axis=0) & (owner != r)).sum())
            for r, a in enumerate(found.area)]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("size,chunk", [(2, 256), (4, 256), (4, 1024), (8, 512)])
def test_weighing_receives_keeps_the_counts_and_says_its_load(seed, size, chunk):
    """With a weight every chunk is placed once, each rank holds as many, and the load the Placement states is
    its area plus the weight for each key row of another rank its queries see; without one the load is the
    area."""
    mask, weight = capped(seed, size, 8192), 400
    plain = placement.place_chunks(mask, size, chunk)
    weighed = placement.place_chunks(mask, size, chunk, receive=weight)
    assert plain.load == plain.area
    assert loads(mask, weighed, weight) == list(weighed.load)
    assert sorted(c for held in weighed.owned for c in held) == list(range(size * 8192 // chunk))
    assert {len(held) for held in weighed.owned} == {8192 // chunk}


def test_weighing_receives_lowers_the_busiest_load_on_the_issues_setting():
    """MagiAttention's 4-GPU setting (documents up to S/4, 8k tokens a rank, chunks of 256): the area-balanced
    placement leaves the busiest rank's load (weight 230, H100's) well above the weighed placement's, and the
    most key rows a rank receives falls."""
    mask, weight = capped(0, 4, 8192), 230
    plain = placement.place_chunks(mask, 4, 256)
    weighed = placement.place_chunks(mask, 4, 256, receive=weight)
    assert max(weighed.load) < 0.97 * max(loads(mask, plain, weight))
    received = [(load - area) // weight for load, area in zip(weighed.load, weighed.area)]
    before = [(load - area) // weight for load, area in zip(loads(mask, plain, weight), plain.area)]
    assert max(received) < max(before)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("size,weight", [(4, 50), (4, 1000), (8, 230)])
def test_place_with_a_weight_picks_a_chunk_within_tolerance_of_the_least_load(seed, size, weight):
    """place() with a weight: the fewest chunks whose busiest load is within TOLERANCE of the mean area, else
    the least busiest load, so never more than TOLERANCE over the least any chunk gives."""
    mask = capped(seed, size, 4096)
    found = placement.place(mask, size, receive=weight)
    least = min(max(placement.place_chunks(mask, size, 4096 // n, receive=weight).load)
                for n in placement.chunk_counts(4096))
    assert max(found.load) <= (1 + placement.TOLERANCE) * least


def test_by_nodes_the_weight_moves_chunks_within_their_node():
    """Across nodes the weight balances each node's ranks: every node holds the same chunks with it and without."""
    mask = capped(1, 8, 4096)
    plain = placement.place_chunks(mask, 8, 512, per_node=4)
    weighed = placement.place_chunks(mask, 8, 512, per_node=4, receive=300)
    for node in range(2):
        ranks = range(4 * node, 4 * node + 4)
        assert sorted(c for r in ranks for c in plain.owned[r]) == sorted(c for r in ranks for c in weighed.owned[r])
    assert plain.owned != weighed.owned


def test_a_received_row_weighs_its_bytes_against_a_pairs_time():
    """receive_weight: the K/V heads' share of a row's bytes against the query heads' of a pair's work (8 times
    the GQA group's weight with as many K/V heads as query heads), float32 heavier than bf16, the backward's
    gradients home included when it is priced; the head dim cancels."""
    from burst_hpc.plan import costmodel
    from burst_hpc.plan.rates import GPU_RATES

    mask, rates = capped(0, 4, 1024), GPU_RATES["H200"]

    def weight(heads, kv_heads, head_dim=128, itemsize=2, backward=True):
        return costmodel.receive_weight(costmodel.Problem(1, mask.seqlen, heads, kv_heads, head_dim, itemsize, mask),
                                        rates, backward)

    gqa = weight(64, 8)
    assert 300 < gqa < 600
    assert abs(weight(64, 64) - 8 * gqa) <= 8
    assert weight(64, 8, head_dim=64) == gqa
    assert weight(64, 8, itemsize=4) > gqa
    assert weight(64, 8, backward=False) > gqa   # K, V alone against the forward's work, which is lighter still
    # the NumPy path's rates: a pair is slow against its link, a row weighs next to nothing
    cpu = costmodel.receive_weight(costmodel.Problem(1, mask.seqlen, 64, 8, 128, 2, mask), costmodel.rates_for("numpy"))
    assert 0 <= cpu < 5
    for bad in (-1, 2.5, None, True):
        with pytest.raises(LayoutError, match="receive is the visible pairs"):
            make_layout("chunks", mask.seqlen, 4, mask, receive=bad)


def test_the_planner_picks_the_fastest_chunk_and_weight():
    """cluster_layouts (the gather scheme auto runs) picks, among every chunk with the keys received weighed or
    not, one within MARGIN of the fastest predicted; on MagiAttention's 4-GPU setting a weighed one."""
    from burst_hpc.plan import costmodel
    from burst_hpc.plan.rates import GPU_RATES

    mask, rates = capped(0, 4, 8192), GPU_RATES["H100"]
    pr = costmodel.Problem(1, mask.seqlen, 64, 8, 128, 2, mask)
    cl = costmodel.Cluster(1, 4)
    weight = costmodel.receive_weight(pr, rates)
    chosen = costmodel.cluster_layouts(pr, cl, rates)["chunks"]
    times = {(n, w): costmodel.predict("gather", pr, cl, rates,
                                       make_layout("chunks", mask.seqlen, 4, mask, chunk=8192 // n, receive=w)).fwdbwd
             for n in placement.chunk_counts(8192) for w in (0, weight)}
    assert costmodel.predict("gather", pr, cl, rates, chosen).fwdbwd <= min(times.values()) / (1 - costmodel.MARGIN)
    assert chosen in {make_layout("chunks", mask.seqlen, 4, mask, chunk=8192 // n, receive=weight)
                      for n in placement.chunk_counts(8192)}
