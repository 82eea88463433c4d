"""The cost model and `burst-hpc plan` (no MPI): the issue's target cases, the cases where the flat
ring suffices, one node, and the single-node ring times of docs/BENCHMARKS.md."""
from dataclasses import replace

import pytest

import burst_hpc
from burst_hpc.plan import costmodel, masks
from burst_hpc.cli import main
from burst_hpc.plan.costmodel import Cluster, Problem
from burst_hpc.plan.memory import peak_memory
from burst_hpc.plan.rates import GPU_RATES, Rates, per_pair
from burst_hpc.plan.layout import LAYOUTS, make_layout

M = 1 << 20
# the per-pair and per-byte rates alone: what the overlap formulas speak of (tests/test_fixed_costs.py
# prices the fixed costs)
NO_FIXED = dict(intra_latency_us=0.0, inter_latency_us=0.0, fwd_launch_us=0.0, bwd_launch_us=0.0, step_us=0.0)
H100_50 = replace(GPU_RATES["H100"], inter_gbps=50.0, **NO_FIXED)


@pytest.fixture(autouse=True)
def no_measured_costs(tmp_path, monkeypatch):
    """The built-in rates: no fixed costs `burst-hpc compile` measured on this machine are read."""
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))


TARGETS = [(Problem(1, M, 32, 32, 128, 2, masks.make(M, True)), Cluster(16, 8)),    # 16 x 8 H100, MHA
           (Problem(1, M, 32, 8, 128, 2, masks.make(M, True)), Cluster(32, 8))]     # 32 x 8 H100, GQA 4:1


@pytest.mark.parametrize("pr,cl", TARGETS)
def test_targets_flat_ring_is_comm_bound_and_the_pick_hides(pr, cl):
    ring = costmodel.predict("ring", pr, cl, H100_50)
    assert ring.fwd.exposed > 0.2
    pick = costmodel.pick(pr, cl, H100_50)
    assert pick != "ring"
    p = costmodel.predict(pick, pr, cl, H100_50)
    assert p.fwd.exposed <= 0.05 and p.exposed <= 0.05


@pytest.mark.parametrize("nodes,tokens", [(2, 1 << 16), (4, 1 << 15)])
def test_auto_keeps_the_flat_ring_where_it_hides(nodes, tokens):
    """Enough tokens per GPU (the formula's 24k for causal MHA at 50 GB/s): the flat ring hides."""
    cl = Cluster(nodes, 8)
    pr = Problem(1, tokens * cl.ranks, 32, 32, 128, 2, masks.make(tokens * cl.ranks, True))
    assert costmodel.pick(pr, cl, H100_50) == "ring"


def test_one_node_is_always_the_flat_ring():
    pr = Problem(1, 8 * 4096, 32, 32, 128, 2, masks.make(8 * 4096, True))
    assert costmodel.pick(pr, Cluster(1, 8), replace(H100_50, intra_gbps=1.0)) == "ring"


def test_thresholds_follow_the_formulas():
    """forward n >= c F / (g B): 2 * 714e12 / 50e9 = 28.6k tokens for causal MHA (F: H100's forward on full
    tiles, 1.55 us a 128 x 128 key tile over 132 SMs; a shard's diagonal tiles and query tiles slow it: 26.8k);
    GQA 4:1 a quarter; a two-level scheme divides B's requirement by w, where its inner ring (the link inside a
    node, g' = 170 GB/s) needs no more: c F / (g' B) = 50 / 170 of the flat ring's."""
    pr, cl = Problem(1, M, 32, 32, 128, 2, masks.make(M, True)), Cluster(16, 8)
    flat = costmodel.hiding_tokens("ring", pr, cl, H100_50)
    assert 23000 <= flat <= 27000
    gqa = costmodel.hiding_tokens("ring", replace(pr, kv_heads=8), cl, H100_50)
    assert abs(gqa - flat / 4) <= 0.1 * flat / 4
    assert costmodel.hiding_tokens("double_ring", pr, cl, H100_50) <= max(flat / 8, flat * 50 / 170) * 1.1
    fast_inside = replace(H100_50, intra_gbps=400.0)
    assert costmodel.hiding_tokens("double_ring", pr, cl, fast_inside) <= flat / 8 * 1.5


@pytest.mark.parametrize("tokens,passes,measured", [(32768, "fwd", 0.115), (32768, "fwdbwd", 0.443),
                                                    (262144, "fwd", 7.008), (262144, "fwdbwd", 27.03)])
def test_predicts_the_single_node_ring_of_benchmarks(tokens, passes, measured):
    """4 x H200, causal bf16 H=32 D=128 zigzag, nccl (docs/BENCHMARKS.md): given the kernel rates of
    those runs (compute-only times) and the NVLink rate measured there (~300 GB/s), within 15%."""
    rates = Rates("H200 run", 305.0, 276.0, 300.0, 300.0) if tokens == 32768 else \
        Rates("H200 run", 321.0, 283.0, 300.0, 300.0)
    pr, cl = Problem(1, 4 * tokens, 32, 32, 128, 2, masks.make(4 * tokens, True)), Cluster(1, 4)
    p = costmodel.predict("ring", pr, cl, rates)
    got = p.fwd.time if passes == "fwd" else p.fwdbwd
    assert abs(got - measured) <= 0.15 * measured, (got, measured)


def test_plan_prints_a_table_and_the_pick(capsys):
    assert main(["plan", "--seqlen", str(M), "--heads", "32", "--kv-heads", "8", "--causal", "--nodes", "32",
                 "--gpus-per-node", "8", "--gpu", "H100", "--inter-gbps", "50"]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| layout")]
    timed = [r for r in rows if r[4] != "-"]
    fastest = min(timed, key=lambda r: float(r[4]))   # forward+backward seconds
    assert "ulysses_ring" in {r[1] for r in timed} and len(timed) >= 8
    assert [r for r in rows if r[-1] == "**pick**"] == [fastest]
    assert f"pick: layout {fastest[0]}" in out and f"scheme {fastest[1]}" in out.split("pick: layout")[-1]


@pytest.mark.parametrize("nodes,per_node", [(2, 4), (1, 4)])
def test_plan_names_the_chunks_placement_it_picks(capsys, nodes, per_node):
    """Packed documents over 2 nodes of 4 (and one node of 4): the pick is the chunks layout placed by the nodes,
    and the pick's line says so, with its chunk and whether the keys each rank receives weighed in its placement
    (what choose_layout returns for the call)."""
    from burst_hpc.plan import tables

    size, seqlen = nodes * per_node, nodes * per_node * 8192
    args = ["--seqlen", str(seqlen), "--heads", "64", "--kv-heads", "8", "--causal", "--documents", str(2 * size),
            "--doc-lengths", "uniform", "--nodes", str(nodes), "--gpus-per-node", str(per_node), "--gpu", "H100"]
    assert main(["plan", *args]) == 0
    cu = tables.planned_documents(seqlen, 2 * size, "uniform")
    chosen = burst_hpc.choose_layout(seqlen, size, causal=True, cu_seqlens=cu, heads=64, kv_heads=8,
                                     ranks_per_node=per_node, rates=GPU_RATES["H100"])
    area = make_layout("chunks", seqlen, size, masks.make(seqlen, True, None, cu), chosen.per_node, chosen.chunk)
    assert chosen.kind == "chunks" and chosen.per_node == (per_node if nodes > 1 else None)
    words = [f"chunks of {chosen.grain} tokens"] + ([f"placed by nodes of {per_node}"] if nodes > 1 else [])
    if chosen != area:
        words.append(f"the keys each rank receives weighed at {chosen.receive} pairs a row")
    out = capsys.readouterr().out
    assert f"pick: layout chunks ({', '.join(words)}), scheme gather" in out, out.splitlines()[-1]
    if nodes == 1:   # on one node of 4 the weighed placement is the pick (as measured: docs/BENCHMARKS.md)
        assert chosen != area


def test_plan_says_why_a_scheme_does_not_fit(capsys):
    assert main(["plan", "--seqlen", str(1 << 16), "--heads", "12", "--causal", "--nodes", "2",
                 "--gpus-per-node", "8"]) == 0
    assert "does not fit" in capsys.readouterr().out


@pytest.mark.parametrize("tokens,fwd_gib,fwdbwd_gib", [(32768, 3.0, 5.3), (262144, 24.0, 42.0)])
def test_peak_memory_matches_the_gpu_figures_of_benchmarks(tokens, fwd_gib, fwdbwd_gib):
    """4 x H200, causal bf16 H=32 D=128 zigzag (docs/BENCHMARKS.md, CuPy pool high-water mark per
    rank). bench_ring.py's pool also holds do (bf16) and the float32 buffer its inputs were drawn
    in (cached by the pool) during the forward row; the backward row is the call itself."""
    pr, cl = Problem(1, 4 * tokens, 32, 32, 128, 2, masks.make(4 * tokens, True)), Cluster(1, 4)
    gib = 2 ** 30
    bench_extra = tokens * 32 * 128 * (2 + 4)
    assert abs((peak_memory("ring", pr, cl) + bench_extra) / gib - fwd_gib) <= 0.05 * fwd_gib
    assert abs(peak_memory("ring", pr, cl, True) / gib - fwdbwd_gib) <= 0.06 * fwdbwd_gib


@pytest.mark.parametrize("backward", [False, True])
def test_step_prediction_charges_every_byte_and_every_pair(backward):
    """The balanced schedule across nodes (transfers posted steps before they are due): the predicted
    time is never less than the critical path's kernels, nor than the bytes any rank's network link
    carries at its rate, nor than its total with every data transfer due the step before its first
    use (posting earlier does not lose time here), which is the step-by-step charge: every step the
    larger of its busiest rank's kernels and the most bytes any link carries then."""
    import numpy as np

    from burst_hpc.plan import masks, schedule, workload
    from burst_hpc.plan.accounting import transfer_bytes

    ranks, per_node, seqlen = 16, 4, 16 * 256
    # priced per visible pair: the charge below is independent of how kernels are priced (pricing.py)
    rates = per_pair(replace(GPU_RATES["H100"], **NO_FIXED), 600.0, 520.0)
    mask = masks.make(seqlen, True, None, masks.random_documents(np.random.default_rng(2), seqlen, 4))
    pr = costmodel.Problem(1, seqlen, 64, 8, 128, 2, mask)
    direction = "backward" if backward else "forward"
    cluster = costmodel.Cluster(ranks // per_node, per_node)
    balanced = make_layout("balanced", seqlen, ranks)
    got = costmodel.pass_prediction("ring", pr, cluster, rates, balanced, backward)
    sizes = transfer_bytes(64, 8, 128, 2, backward)
    load = {}
    for _, _, sender, receiver, what, side, tokens in workload.schedule_transfers(balanced, mask, direction,
                                                                                per_node):
        if sender // per_node != receiver // per_node:
            for end in ((sender, "out"), (receiver, "in")):
                load[end] = load.get(end, 0.0) + sizes[(what, side)] * tokens / (rates.inter_gbps * 1e9)
    assert load and got.time >= max(load.values())
    assert any(due > posted for posted, due, *_ in workload.schedule_transfers(balanced, mask, direction,
                                                                              per_node))
    assert got.time >= got.compute >= got.mean > 0

    def without_lead():
        caches = (schedule.work_transfers, schedule.transfers_of, schedule.work_steps, schedule.steps, workload.work_of,
                  workload.schedule_transfers, workload.schedule_traffic, workload.account)
        leads = schedule.LEAD, schedule.INNER_LEAD, schedule.INNER_LAG
        try:
            schedule.LEAD = schedule.INNER_LEAD = schedule.INNER_LAG = 0
            for f in caches:
                f.cache_clear()
            late = costmodel.pass_prediction("ring", pr, cluster, rates, balanced, backward)
            # every transfer due in the step that posts it: each step costs the larger of its busiest
            # rank's kernels and the most any link carries then (a latency once per link and step)
            work = workload.work_of(balanced, mask, direction, per_node)
            traffic = workload.schedule_traffic(balanced, mask, direction, per_node)
            pair_seconds = costmodel.attention_flops(1, 64, 128, 1.0, backward) / (
                (rates.bwd_tflops if backward else rates.fwd_tflops) * 1e12)
            charged = 0.0
            for t in range(work.shape[0]):
                links = [0.0]
                for far, (gbps, us) in ((0, (rates.intra_gbps, rates.intra_latency_us)),
                                        (1, (rates.inter_gbps, rates.inter_latency_us))):
                    for end in (0, 1):
                        nbytes = sum(sizes[key] * counts[far][end][t] for key, counts in traffic.items())
                        links += [us * 1e-6 + b / (gbps * 1e9) for b in nbytes if b]
                charged += max(work[t].max() * pair_seconds, max(links))
            return late, charged
        finally:
            schedule.LEAD, schedule.INNER_LEAD, schedule.INNER_LAG = leads
            for f in caches:
                f.cache_clear()

    late, charged = without_lead()
    assert got.time <= late.time and late.compute == got.compute
    assert late.time == pytest.approx(charged, rel=1e-9)


def plan_rows(capsys, *args):
    """{(layout, scheme): the row's cells} of `burst-hpc plan`'s table, and the picked (layout, scheme)."""
    assert main(["plan", *map(str, args)]) == 0
    rows, pick = {}, None
    for line in capsys.readouterr().out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("|") and cells[0] in LAYOUTS:
            rows[(cells[0], cells[1])] = cells[2:-1]
            if cells[-1] == "**pick**":
                pick = (cells[0], cells[1])
    return rows, pick


PLANS = [  # (seqlen, nodes, per node, extra options)
    (8192, 2, 4, ["--causal"]),
    (8192, 2, 4, ["--causal", "--window", "300"]),
    (8192, 2, 4, ["--causal", "--documents", "6", "--doc-lengths", "lognormal"]),
    (16384, 4, 2, ["--causal", "--documents", "12", "--doc-lengths", "uniform", "--inter-gbps", "5"]),
    (16384, 4, 4, ["--window", "100", "--inter-gbps", "12"]),
    (6144, 1, 4, []),
    (6144, 3, 2, ["--causal", "--heads", "12", "--kv-heads", "4"]),
]


@pytest.mark.parametrize("seqlen,nodes,per_node,extra", PLANS)
def test_plan_picks_its_fastest_row_and_every_row_says_one_thing(capsys, seqlen, nodes, per_node, extra):
    """One model, one answer (issue 37): the pick is the row of least forward+backward time among
    those shown, a (layout, scheme) row reads the same with or without --layout, and the pick's
    layout is what choose_layout names for the call."""
    from burst_hpc.plan import tables

    args = ["--seqlen", seqlen, "--nodes", nodes, "--gpus-per-node", per_node, "--heads", 8, *extra]
    rows, pick = plan_rows(capsys, *args)
    timed = {key: float(cells[2]) for key, cells in rows.items() if cells[2] != "-"}
    assert pick is not None and timed[pick] == min(timed.values()), (pick, timed)
    for layout in LAYOUTS:
        alone, _ = plan_rows(capsys, *args, "--layout", layout)
        assert alone == {key: cells for key, cells in rows.items() if key[0] == layout}
    def value(name, kind, default=None):
        return kind(extra[extra.index(name) + 1]) if name in extra else default

    count = value("--documents", int)
    cu = None if count is None else tables.planned_documents(seqlen, count, value("--doc-lengths", str))
    window = None if value("--window", int) is None else (value("--window", int), 0)
    heads = value("--heads", int, 8)
    kv_heads = value("--kv-heads", int, heads)
    gbps = value("--inter-gbps", float, GPU_RATES["H100"].inter_gbps)
    causal = "--causal" in extra or window is not None
    chosen = burst_hpc.choose_layout(seqlen, nodes * per_node, causal=causal,
                                     cu_seqlens=cu, window=window, heads=heads, kv_heads=kv_heads,
                                     ranks_per_node=per_node, rates=replace(GPU_RATES["H100"], inter_gbps=gbps))
    placed = masks.make(seqlen, causal, window, cu)   # the chunks layout places tokens by it, and by the nodes
    assert chosen.kind == pick[0] and chosen == make_layout(pick[0], seqlen, nodes * per_node, placed, per_node,
                                                            chosen.chunk)


def test_the_plan_of_issue_37_picks_what_it_shows_fastest(capsys):
    """1M tokens on 16 x 8 H100 with a 4096 window: the balanced layout's 16 steps (not zigzag's
    128) wherever balanced + ring appears, and the pick no slower than any row (contiguous + ring
    was 76x faster than the pick before)."""
    rows, pick = plan_rows(capsys, "--seqlen", 1 << 20, "--heads", 32, "--kv-heads", 8, "--causal", "--nodes", 16,
                           "--gpus-per-node", 8, "--inter-gbps", 50, "--window", 4096)
    assert rows[("balanced", "ring")][5] == "16 / 16"
    timed = {key: float(cells[2]) for key, cells in rows.items() if cells[2] != "-"}
    assert timed[pick] == min(timed.values())


@pytest.mark.parametrize("scheme,layout", [("ring", "zigzag"), ("ring", "contiguous"), ("double_ring", "zigzag"),
                                           ("double_ring", "contiguous")])
@pytest.mark.parametrize("direction", ["forward", "backward", "backward-q"])
def test_the_account_of_a_rotated_schedule_is_every_ranks_own(scheme, layout, direction):
    """workload.account reads one rank's steps and rotates them: the work equals every rank's own
    schedule's visits, and the link ends listed are those ranks' own sends and receives."""
    import numpy as np

    from burst_hpc.plan import masks, workload
    from burst_hpc.plan.schedule import double_ring_steps, steps as flat_steps
    from burst_hpc.plan.schemes import position_pairs, work_rounds

    nodes, w, seqlen = 3, 2, 6 * 16
    size = nodes * w
    mask = masks.make(seqlen, True, (20, 0), np.array([0, 7, 40, 41, 70, seqlen]))
    near, returns = workload.DIRECTIONS[direction]
    layout = make_layout(layout, seqlen, size)
    acc = workload.account(layout, mask, scheme, direction, w)
    if scheme == "ring":
        plans = [flat_steps(layout, r, near, returns, mask) for r in range(size)]
    else:
        rounds = work_rounds(position_pairs(mask, layout, range(size)), nodes, near == "q",
                             lambda p, o: [(p // w - o) % nodes * w + (p % w - t) % w for t in range(w)])
        plans = [double_ring_steps(r, nodes, w, near, returns, rounds) for r in range(size)]
    pairs = masks.pair_work(mask, layout)
    own = np.zeros_like(acc.work)
    for r, plan in enumerate(plans):
        for t, step in enumerate(plan):
            own[t, r] = sum(pairs[v.q_shard, v.kv_shard] for v in step.visits)
    np.testing.assert_array_equal(acc.work, own)
    listed = sorted(zip(*(acc.ends[k].tolist() for k in ("posted", "due", "rank", "far", "out", "tokens"))))
    shown = sorted(set(acc.ends["rank"].tolist()))
    counted = sorted((t, t if m.due is None else m.due, r, int(m.peer // w != r // w), int(out), seqlen // size)
                     for r in shown for t, step in enumerate(plans[r])
                     for out, transfers in ((True, step.sends), (False, step.recvs)) for m in transfers)
    assert listed == counted and shown == (list(range(w)) if scheme == "ring" else [0])
