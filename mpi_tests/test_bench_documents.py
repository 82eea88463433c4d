"""bench/bench_documents.py (MagiAttention's packed-documents setting) end to end on the CPU path with
small shapes: a row per layout with its timings, the schedule's account and the cost model's
prediction, and every layout's output equal to the first's."""
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import bench_documents  # noqa: E402
from burst_hpc.plan.layout import LAYOUTS  # noqa: E402


def test_rows_for_every_layout(comm, tmp_path):
    out = comm.bcast(str(tmp_path / "rows.md") if comm.rank == 0 else None)
    bench_documents.main(["--cpu", "--tokens-per-rank", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
                          "--iters", "1", "--warmup", "0", "--check", "--out", out])
    if comm.rank != 0:
        return
    rows = [json.loads(line) for line in open(out) if line.startswith("{")]
    assert [r["layout"] for r in rows] == list(LAYOUTS)
    assert [r["scheme"] for r in rows] == ["ring", "ring", "ring", "gather"] and sum(r["pick"] for r in rows) == 1
    for row in rows:
        assert row["P"] == comm.size and row["device"] == "CPU" and row["max_diff_vs_first"] < 1e-4
        for pass_ in ("fwd", "fwdbwd"):
            assert row[pass_] > 0 and row[pass_ + "_tflops_per_gpu"] > 0 and row[pass_ + "_predicted_tflops_per_gpu"] > 0
    # tiny shards balance coarsely (tests/test_balance.py holds the 1.10 bar at 8k tokens per rank)
    assert rows[2]["critical_over_mean"] <= min(rows[0]["critical_over_mean"], rows[1]["critical_over_mean"]) + 1e-9
    text = open(out).read()
    assert all(f"| {row['layout']} |" in text or f"| **{row['layout']}** (pick) |" in text for row in rows)
