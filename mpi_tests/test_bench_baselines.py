"""bench/bench_baselines.py end to end on the CPU path (--cpu: NumPy + MPI), so the driver the GPU run
depends on is checked here: its JSON rows, the bytes it reports, a method that cannot run, accuracy."""
import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import bench_baselines  # noqa: E402


def run(comm, tmp_path, *args):
    out = comm.bcast(str(tmp_path / "rows.jsonl") if comm.rank == 0 else None)
    bench_baselines.main(["--cpu", "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--causal", "--out", out, *args])
    rows = [json.loads(line) for line in open(out)] if comm.rank == 0 else None
    return comm.bcast(rows)


def test_timing_rows(comm, tmp_path):
    P = comm.size
    rows = run(comm, tmp_path, "--tokens-per-rank", "8,16", "--iters", "1", "--warmup", "0")
    ran = {(r["method"], r["tokens"], r["pass"]): r for r in rows if "error" not in r}
    failed = [r for r in rows if "error" in r]
    ulysses_fits = 2 % P == 0  # 2 key/value heads over P ranks
    for method in ("burst", "untiled-ring", "allgather-kv") + (("ulysses",) if ulysses_fits else ()):
        for n in (8, 16):
            for pass_ in ("fwd", "fwdbwd"):
                row = ran[(method, n * P, pass_)]
                assert row["P"] == P and row["full"] > 0 and row["tflops_per_gpu"] > 0 and row["device"] == "CPU"
    # bfloat16 K and V travel P-1 steps in the forward
    assert ran[("burst", 16 * P, "fwd")]["bytes_sent"] == (P - 1) * 16 * 2 * 2 * 8 * 2
    assert ran[("allgather-kv", 16 * P, "fwd")]["bytes_sent"] == (P - 1) * 16 * 2 * 2 * 8 * 2
    if ulysses_fits:
        assert not failed
    else:  # one error row per pass, and the longer length is not tried
        assert [(r["method"], r["tokens"], r["pass"]) for r in failed] == [("ulysses", 8 * P, "fwd"), ("ulysses", 8 * P, "fwdbwd")]
        assert "do not divide over" in failed[0]["error"]


def test_accuracy_rows(comm, tmp_path):
    tokens = 12 * comm.size  # zigzag splits it into 2P chunks
    rows = run(comm, tmp_path, "--accuracy", "--tokens", str(tokens), "--methods", "burst,untiled-ring,allgather-kv")
    assert [r["method"] for r in rows] == ["burst", "untiled-ring", "allgather-kv"]
    for r in rows:
        errors = np.array([r[f"err_{name}"] for name in ("o", "dq", "dk", "dv")])
        assert r["P"] == comm.size and r["tokens"] == tokens
        assert (errors > 0).all() and (errors < 0.1).all(), r  # bfloat16 results against the float64 reference
