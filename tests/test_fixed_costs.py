"""The cost model's fixed costs (issue 36, item 3): each block call, each ring step and each message
pays a fixed cost, and with the built-in H200 rates the model ranks the layouts of the issue's
measured table as measured and predicts forward+backward within 15%."""
from dataclasses import replace

import numpy as np
import pytest

import burst_hpc
from burst_hpc.plan import costmodel, masks
from burst_hpc.plan.accounting import visible_pairs
from burst_hpc.plan.layout import layouts_for, make_layout
from burst_hpc.plan.packing import packing
from burst_hpc.plan.rates import GPU_RATES, Rates, rates_for
from burst_hpc.plan.workload import account, documents

# Measured 2026-11-27 (tree c71d637) on 4 x H200 (NVLink, NCCL) by bench/bench_documents.py in MagiAttention's
# setting (bf16, D = 128, Hq = 64, Hkv = 8, causal, documents of uniform length up to S/4, seed 0), TFLOP/s per GPU
# at the slowest rank's pace (docs/BENCHMARKS.md, "4, 2 and 1 x H200 on the final tree";
# bench/data/documents-2026-11-27b.jsonl): {tokens per GPU: {layout: (forward, forward+backward)}}. The kernels
# priced by their tiles as the sweep of 2026-11-27 fits them (rates.py; faster kernels than these runs had: PackGQA
# and the backward from document starts came after) predict forward+backward within 12%, the forward 1-33% above
# (the balanced one at 32k: its forward's exposed partials are not priced as they run). The runs of 2026-11-26
# (older kernels: 8k contiguous 275 / 249, zigzag 234 / 219, balanced 147 / 199) ranked the same.
MEASURED = {8192: {"contiguous": (282, 275), "zigzag": (239, 228), "balanced": (150, 217)},
            32768: {"contiguous": (383, 365), "zigzag": (343, 315), "balanced": (423, 427)}}
RANKS = 4


@pytest.fixture(autouse=True)
def no_measured_costs(tmp_path, monkeypatch):
    """The built-in rates: no fixed costs `burst-hpc compile` measured on this machine are read."""
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))


def documents_setting(tokens):
    """(Problem, Mask, visible pairs) of bench_documents.py's call at ``tokens`` per GPU on 4 GPUs."""
    seqlen = tokens * RANKS
    cu = documents(np.random.default_rng(0), seqlen, "capped", longest=seqlen // 4)
    mask = masks.make(seqlen, True, None, cu)
    return costmodel.Problem(1, seqlen, 64, 8, 128, 2, mask), mask, visible_pairs(mask)


def predicted_tflops(rates, tokens, layout):
    """(forward, forward+backward) TFLOP/s per GPU as bench_documents.py counts them, predicted."""
    pr, mask, pairs = documents_setting(tokens)
    p = costmodel.predict("ring", pr, costmodel.Cluster(1, RANKS), rates, make_layout(layout, pr.seqlen, RANKS))
    flops = 4.0 * pairs * 64 * 128 / RANKS / 1e12
    return flops / p.fwd.time, flops * 3.5 / p.fwdbwd


@pytest.mark.parametrize("tokens", sorted(MEASURED))
def test_the_measured_table_is_ranked_and_forward_backward_predicted_within_15_percent(tokens):
    rates = rates_for("cuda", "NVIDIA H200")
    got = {layout: predicted_tflops(rates, tokens, layout) for layout in MEASURED[tokens]}
    for column in (0, 1):
        def ranked(table):
            return sorted(table, key=lambda layout: -table[layout][column])
        assert ranked(got) == ranked(MEASURED[tokens]), (column, got)
    for layout, measured in MEASURED[tokens].items():
        assert abs(got[layout][1] - measured[1]) <= 0.15 * measured[1], (layout, got[layout], measured)


def test_without_fixed_costs_the_model_ranks_balanced_first_where_it_is_slowest():
    """The failure the fixed costs fix: the old H200 rates (350 GB/s NVLink, 10 us latency, no launch or
    step costs) put balanced first for forward+backward at 8k tokens per GPU."""
    rates = replace(rates_for("cuda", "NVIDIA H200"), intra_gbps=350.0, intra_latency_us=10.0,
                    fwd_launch_us=0.0, bwd_launch_us=0.0, step_us=0.0)
    got = {layout: predicted_tflops(rates, 8192, layout)[1] for layout in MEASURED[8192]}
    assert max(got, key=got.get) == "balanced"


def test_the_pick_among_the_measured_layouts_is_the_fastest_measured():
    """The cost model's pick (costmodel.best, as choose_layout and scheme='auto' pick) with the fixed
    costs, among the layouts the table measured: contiguous at 8k tokens per GPU, balanced at 32k.
    (The chunks layout, not in the table, is priced beside them by choose_layout.)"""
    for tokens, fastest in ((8192, "contiguous"), (32768, "balanced")):
        pr, mask, _ = documents_setting(tokens)
        layouts = layouts_for(pr.seqlen, RANKS, mask, tuple(MEASURED[tokens]))
        pick, _ = costmodel.best(pr, costmodel.Cluster(1, RANKS), rates_for("cuda", "NVIDIA H200"), layouts)
        assert pick.layout.kind == fastest


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "balanced"])
@pytest.mark.parametrize("backward", [False, True])
def test_each_launch_step_and_message_pays_its_fixed_cost_once(layout, backward):
    """Raising one fixed cost by x raises the prediction by x times what the schedule counts of it
    where nothing overlaps it: the busiest rank's block calls summed over steps (with no per-pair
    cost and no bytes, so every step is its block calls), the steps, and the messages of the one
    link end that carries most of them (with everything else free)."""
    pr, mask, _ = documents_setting(256)
    cl = costmodel.Cluster(1, RANKS)
    free = Rates("free", 1e30, 1e30, 1e30, 1e30, 0.0, 0.0)
    layout = make_layout(layout, pr.seqlen, RANKS)
    direction = costmodel.direction_of(pr, layout, backward)
    acc = account(layout, mask, "ring", direction, None)

    def seconds(**fixed):
        return costmodel.pass_prediction("ring", pr, cl, replace(free, **fixed), layout, backward).time

    launch = "bwd_launch_us" if backward else "fwd_launch_us"
    assert seconds(**{launch: 1e6}) == pytest.approx(acc.launches.max(axis=1).sum())
    assert seconds(step_us=1e6) == pytest.approx(acc.work.shape[0])
    ends = acc.ends
    busiest = np.unique(np.stack([ends["rank"], ends["out"]]), axis=1, return_counts=True)[1].max()
    assert seconds(intra_latency_us=1e6) >= busiest
    assert acc.launches.sum() > 0 and acc.launches.max() >= 1


@pytest.mark.parametrize("scheme", ["ring", "gather"])
def test_a_pass_that_moves_nothing_pays_no_step(scheme):
    """A step's fixed cost is its exchange's: one rank's pass (nothing moves) is priced without it, a ring pass
    over two ranks with it once a step, and so the gather across nodes (its stepped passes); the gather on one
    node (the packed passes, whose host runs ahead of the GPU) pays none but waits for its transfers. Block
    calls pay their launches either way."""
    free = Rates("free", 1e30, 1e30, 1e30, 1e30, 0.0, 0.0)
    for ranks, nodes in ((1, 1), (2, 1), (2, 2)):
        seqlen = 256 * ranks
        mask = masks.make(seqlen, True, None, documents(np.random.default_rng(ranks), seqlen, "capped",
                                                        longest=seqlen // 2))
        pr = costmodel.Problem(1, seqlen, 4, 2, 64, 2, mask)
        layout = make_layout("chunks" if scheme == "gather" else "contiguous", seqlen, ranks, mask)
        per_node = ranks // nodes if nodes > 1 else None
        acc = account(layout, mask, scheme, costmodel.direction_of(pr, layout, False), per_node)

        def seconds(**fixed):
            return costmodel.pass_prediction(scheme, pr, costmodel.Cluster(nodes, ranks // nodes),
                                             replace(free, **fixed), layout, False).time

        stepped = ranks > 1 and (scheme == "ring" or nodes > 1)
        assert acc.stepped == (scheme == "ring" or nodes > 1)
        assert seconds(step_us=1e6) == pytest.approx(acc.work.shape[0] if stepped else 0.0)
        assert acc.launches.sum() > 0
        # a step's busiest rank's calls, summed; where ranks do not wait for each other between steps (the packed
        # passes), the busiest rank's calls over the pass
        launches = acc.launches.max(axis=1).sum() if acc.stepped else acc.launches.sum(axis=0).max()
        assert seconds(fwd_launch_us=1e6) == pytest.approx(launches)
        if scheme == "gather" and ranks > 1 and nodes == 1:   # the keys' exchange (the early runs under it), the rest
            assert acc.work.shape[0] == 2 and acc.ends["due"].max() == 0
            for r in range(ranks):
                p = packing(mask, layout, r)
                pairs = p.hi.astype(np.int64) - p.lo
                for t, runs in enumerate(p.split(len(pairs))):
                    assert acc.work[t, r] == sum(pairs[lo:hi].sum() for lo, hi in runs)
                    assert acc.launches[t, r] == len(runs)
            assert acc.work[0].any()


def test_ulysses_inside_one_node_still_pays_its_steps():
    """Alone on one rank a pass pays no step; Ulysses on one node of four (all-to-alls, no ring ends) does."""
    free = Rates("free", 1e30, 1e30, 1e30, 1e30, 0.0, 0.0)
    pr, _, _ = documents_setting(256)
    layout = make_layout("zigzag", pr.seqlen, RANKS)
    seconds = costmodel.pass_prediction("ulysses_ring", pr, costmodel.Cluster(1, RANKS), replace(free, step_us=1e6),
                                        layout, False).time
    assert seconds >= 1.0


def test_block_calls_follow_the_engines_block_pairs():
    """A zigzag visit of a plain causal ring runs its block pairs: 3 at a rank's own shard (the two
    diagonal pieces and the full pair between), 1 elsewhere (its two full pairs share a side and are
    fused into one call); contiguous 1 a visible pair, none for a hidden one (the keys after the
    queries: a forward ring that carries them still steps)."""
    causal = masks.make(64 * RANKS, True)
    zigzag = account(make_layout("zigzag", 64 * RANKS, RANKS), causal, "ring", "forward", None)
    assert (zigzag.launches[0] == 3).all() and (zigzag.launches[1:] == 1).all()
    contiguous = account(make_layout("contiguous", 64 * RANKS, RANKS), causal, "ring", "forward", None)
    assert (contiguous.launches[0] == 1).all()
    assert (contiguous.launches[1:] == (contiguous.work[1:] > 0)).all() and contiguous.launches[1:].min() == 0


def test_plan_shows_the_fixed_costs(capsys):
    from burst_hpc.cli import main

    assert main(["plan", "--seqlen", str(8192 * RANKS), "--heads", "64", "--kv-heads", "8", "--causal", "--gpu",
                 "H200", "--gpus-per-node", str(RANKS), "--documents", "11", "--doc-lengths", "uniform"]) == 0
    out = capsys.readouterr().out
    assert "fixed costs (ms) fwd / bwd" in out and "25 / 50 us a block call" in out


def test_compile_measures_the_fixed_costs_and_the_model_reads_them(tmp_path, capsys):
    """`burst-hpc compile --backend numpy` measures the NumPy path's fixed costs into the kernel cache;
    rates_for reads them over the built-in ones; a file that does not read is ignored."""
    from burst_hpc.cli import main
    from burst_hpc.plan import calibrate

    assert calibrate.load("cpu") is None
    assert main(["compile", "--backend", "numpy"]) == 0
    kept = calibrate.path("cpu")
    assert kept in capsys.readouterr().out and kept.startswith(str(tmp_path))
    measured = calibrate.load("cpu")
    assert set(measured) == {"fwd_launch_us", "bwd_launch_us", "step_us"}   # one rank: no message measured
    assert all(v > 0 for v in measured.values())
    rates = rates_for("numpy")
    assert all(getattr(rates, k) == v for k, v in measured.items())
    assert rates.intra_latency_us == GPU_RATES["cpu"].intra_latency_us
    assert rates_for("cuda", "NVIDIA H200") == GPU_RATES["H200"]   # another model's own
    with open(kept, "w") as f:
        f.write("{not json")
    assert calibrate.load("cpu") is None and rates_for("numpy") == GPU_RATES["cpu"]


def test_a_measured_step_cost_moves_the_pick():
    """What is measured decides: with a step cost of a second the fewest steps win (contiguous: 2; the chunks
    layout's gather on one node, packed: its transfers, then one block call, 2 too; balanced: 5)."""
    from burst_hpc.plan import calibrate

    pr, mask, _ = documents_setting(32768)
    kw = dict(causal=True, cu_seqlens=mask.cu_seqlens, heads=64, kv_heads=8)
    assert burst_hpc.choose_layout(pr.seqlen, RANKS, **kw).kind in ("balanced", "chunks")   # built-in H100 rates
    calibrate.save("H100", {"step_us": 1e6})
    assert burst_hpc.choose_layout(pr.seqlen, RANKS, **kw).kind in ("contiguous", "chunks")
    assert burst_hpc.choose_layout(pr.seqlen, RANKS, ranks_per_node=1, **kw).kind == "contiguous"   # stepped gather


def test_tile_prices_are_fitted_back_from_the_calls_they_price():
    """The calls `compile --tile-prices` times, priced by known tile prices (pricing.call_seconds), fit back to
    those prices: the six calls tell every term apart (the backward's walks up and down, its per-token pass);
    with 3% noise on each time the fit still prices every call within 5%, and no price is negative."""
    from burst_hpc.plan import calibrate
    from burst_hpc.plan.pricing import call_seconds

    rng = np.random.default_rng()
    truth = {name: getattr(GPU_RATES["H100"], name) * rng.uniform(0.5, 2.0) for name in calibrate.TILES}
    rates = replace(GPU_RATES["H100"], **truth)

    def seconds(mask, heads, kv_heads, backward, noise=0.0):
        return call_seconds(rates, mask, 1, heads, 128, backward) * (1 + noise * rng.uniform(-1, 1))

    fitted = calibrate.measure_tiles(calibrate.tile_times(seconds))
    for name in calibrate.TILES:
        assert fitted[name] == pytest.approx(truth[name], rel=1e-6), name
    noisy = calibrate.measure_tiles(calibrate.tile_times(lambda *a: seconds(*a, noise=0.03)))
    assert all(v >= 0 for v in noisy.values())
    again = replace(GPU_RATES["H100"], **noisy)
    for mask in calibrate.tile_masks():
        for backward in (False, True):
            assert call_seconds(again, mask, 1, 32, 128, backward) == pytest.approx(
                call_seconds(rates, mask, 1, 32, 128, backward), rel=0.05)


def test_tile_prices_are_kept_with_the_fixed_costs_and_read(tmp_path):
    """Kept tile prices (as `compile --tile-prices` saves them) price the model's kernels; asked of the NumPy
    backend they are refused (the CPU path prices per pair)."""
    from burst_hpc.errors import BurstError
    from burst_hpc.plan import calibrate

    prices = {name: getattr(GPU_RATES["H100"], name) * 1.5 for name in calibrate.TILES}
    calibrate.save("H100", dict(prices, fwd_launch_us=30.0))
    rates = rates_for("cuda", "NVIDIA H100 80GB HBM3")
    assert all(getattr(rates, name) == pytest.approx(v) for name, v in prices.items()) and rates.fwd_launch_us == 30
    with pytest.raises(BurstError, match="tile prices are the CUDA kernels'"):
        calibrate.calibrate("numpy", tile_prices=True)
