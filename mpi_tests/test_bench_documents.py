"""bench/bench_documents.py (MagiAttention's packed-documents setting) end to end on the CPU path with
small shapes: a row per (distribution, layout) with the timings of every pass, the schedule's account,
the cost model's prediction and the library's picks, and every layout's output equal to the first's."""
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import bench_documents  # noqa: E402
from burst_hpc.plan.layout import LAYOUTS  # noqa: E402


@pytest.mark.parametrize("timing", bench_documents.TIMINGS)
def test_rows_for_every_layout_pass_and_distribution(comm, tmp_path, timing):
    out = comm.bcast(str(tmp_path / "rows.md") if comm.rank == 0 else None)
    bench_documents.main(["--cpu", "--tokens-per-rank", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
                          "--iters", "2", "--warmup", "0", "--check", "--dists", "uniform", "--out", out,
                          "--timing", timing])
    if comm.rank != 0:
        return
    rows = [json.loads(line) for line in open(out) if line.startswith("{")]
    assert [(r["dist"], r["layout"]) for r in rows] == [("uniform", lay) for lay in LAYOUTS]
    # one rank: every layout's pass is one block call (the gather scheme's packed passes)
    assert [r["scheme"] for r in rows] == (["gather"] * 4 if comm.size == 1 else ["ring", "ring", "ring", "gather"])
    for row in rows:
        assert row["P"] == comm.size and row["device"] == "CPU" and row["max_diff_vs_first"] < 1e-4
        assert row["timing"] == timing
        for pass_ in bench_documents.PASSES:
            assert row[pass_] > 0 and row[pass_ + "_tflops_per_gpu"] > 0 and row[pass_ + "_predicted_tflops_per_gpu"] > 0
            assert 0 < row[pass_ + "_host_ms"] < 1e3 * 60
    for dist in ("uniform",):
        group = {r["layout"]: r for r in rows if r["dist"] == dist}
        assert [lay for lay, r in group.items() if r["default"]] == ["zigzag"]
        for pass_ in bench_documents.PASSES:   # exactly one layout is choose_layout's pick for each pass
            assert sum(pass_ in r["picked"] for r in group.values()) == 1
        # tiny shards balance coarsely (tests/test_balance.py holds the 1.10 bar at 8k tokens per rank)
        assert group["balanced"]["critical_over_mean"] <= min(
            group["contiguous"]["critical_over_mean"], group["zigzag"]["critical_over_mean"]) + 1e-9
    text = open(out).read()
    assert "| balanced |" in text and "| uniform (" in text and " d" in text and "| host ms |" in text
    assert bench_documents.TIMING_TEXT[timing] in text


def test_magi_lengths_are_their_packs_and_small_sequences_are_refused():
    cu = bench_documents.document_set("magi", 8192, 0, 2048)
    assert cu[0] == 0 and cu[-1] == 8192 and np.diff(cu).max() <= 2048 and len(cu) > 2
    assert np.array_equal(cu, bench_documents.bench_packed.magi_packs(
        bench_documents.bench_packed.read_length_table(), 8192, 1)[0])
    with pytest.raises(SystemExit, match="at least 4096 tokens"):
        bench_documents.document_set("magi", 64, 0, 16)
