"""bench/call_overhead.py's library-call mode end to end on the CPU path (NumPy, no-op block calls) with
small shapes: every way is timed phase by phase (the public calls whole), and the cached ways plan once and
reuse the plan."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import call_overhead  # noqa: E402


def test_both_ways_phase_by_phase(comm):
    rows = call_overhead.main(["--backend", "numpy", "--host-only", "--tokens-per-rank", "64", "--head-dim", "8",
                               "--calls", "3", "--warmup", "1", "--profile", "0", "--backward", "--json"])
    assert [row["way"] for row in rows] == ["uncached", "cached", "api"]
    uncached, cached, api = rows
    assert (uncached["hits"], uncached["misses"]) == (0, 0)       # CallPlan every call, no cache
    for row in (cached, api):
        assert (row["hits"], row["misses"]) == (2 * 4 - 2, 2)     # forward and backward: one plan each
    for row in rows:
        assert row["ranks"] == comm.size and row["documents"] >= 4
        phases = ("forward", "backward", "wall") if row is api else ("plan", "forward", "backward_plan", "backward",
                                                                        "wall")
        for phase in phases:
            assert row[phase + "_ms"] > 0, (phase, row)
        assert row["gpu_ms"] is None


def test_public_calls_without_documents(comm):
    """--mask causal (no documents) and the chunks layout, placed by the mask, through the public calls."""
    for layout, mask in (("zigzag", "causal"), ("chunks", "documents")):
        rows = call_overhead.main(["--backend", "numpy", "--tokens-per-rank", "32", "--head-dim", "8", "--calls", "2",
                                   "--warmup", "1", "--profile", "0", "--backward", "--json", "--ways", "api",
                                   "--mask", mask, "--layout", layout])
        (row,) = rows
        assert row["layout"] == layout and (row["documents"] == 0) == (mask == "causal")
        assert (row["hits"], row["misses"]) == (2 * 3 - 2, 2)
