"""bench/call_overhead.py's library-call mode end to end on the CPU path (NumPy, no-op block calls) with
small shapes: both ways are timed phase by phase, and the cached way plans once and reuses the plan."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import call_overhead  # noqa: E402


def test_both_ways_phase_by_phase(comm):
    rows = call_overhead.main(["--backend", "numpy", "--host-only", "--tokens-per-rank", "64", "--head-dim", "8",
                               "--calls", "3", "--warmup", "1", "--profile", "0", "--backward", "--json"])
    assert [row["way"] for row in rows] == ["uncached", "cached"]
    uncached, cached = rows
    assert (uncached["hits"], uncached["misses"]) == (0, 0)       # CallPlan every call, no cache
    assert (cached["hits"], cached["misses"]) == (2 * 4 - 2, 2)   # forward and backward: one plan each
    for row in rows:
        assert row["ranks"] == comm.size and row["documents"] >= 4
        for phase in ("plan", "forward", "backward_plan", "backward", "wall"):
            assert row[phase + "_ms"] > 0, (phase, row)
        assert row["gpu_ms"] is None
