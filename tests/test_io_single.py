"""Single-process checks of the io helpers, of --verify's plain computation and of its verdict in the run."""
import os

import numpy as np
import pytest

from burst_hpc import cli, io, tolerance
from burst_hpc.cli_delivery import EXIT_MISMATCH
from burst_hpc.job import verify
from burst_hpc.dtypes import bfloat16
from burst_hpc.plan.layout import make_layout
from burst_hpc.reference import attention_backward_reference, attention_reference


def _inputs(seqlen=40, hq=4, hkv=2, d=8, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, seqlen, hq, d)).astype(dtype)
    k = rng.standard_normal((2, seqlen, hkv, d)).astype(dtype)
    v = rng.standard_normal((2, seqlen, hkv, d)).astype(dtype)
    do = rng.standard_normal((2, seqlen, hq, d)).astype(dtype)
    return q, k, v, do


def test_chunk_shape_bounds_bytes():
    assert io.chunk_shape((2, 1 << 20, 32, 128), 2, 1) == (1, 128, 32, 128)
    assert io.chunk_shape((1, 10, 2, 4), 4, 1) == (1, 10, 2, 4)
    assert io.chunk_shape((2, 8, 1 << 20), 4, 2) == (1, 1, 1 << 18)


def test_read_shards_with_spec_reads_without_inspecting(tmp_path, monkeypatch):
    from burst_hpc.io import read

    q, k, v, do = _inputs(dtype=bfloat16)
    src = str(tmp_path / "in.h5")
    io.write_global(src, {"q": q, "k": k, "v": v, "do": do})
    spec = io.inspect_input(src, ("q", "k", "v", "do"))
    monkeypatch.setattr(read, "_inspect", lambda *args: pytest.fail("the input was inspected again"))
    got, shards = io.read_shards(src, None, make_layout("zigzag", spec.seqlen, 1), ("q", "k", "v", "do"), spec=spec)
    assert got is spec
    for name, want in zip(("q", "k", "v", "do"), (q, k, v, do)):
        assert np.array_equal(shards[name].view(np.uint16), want.view(np.uint16)), name


def test_every_writer_stamps_the_format(tmp_path):
    import h5py

    written = str(tmp_path / "global.h5")
    io.write_global(written, {"o": np.zeros((1, 4, 1, 2), np.float32)}, attrs={"causal": True})
    generated = str(tmp_path / "gen.h5")
    io.generate(generated, 1, 8, 2, 1, 4, np.float32, attrs={"note": "x"})
    for path in (written, generated):
        with h5py.File(path, "r") as f:
            assert f.attrs["format"] == io.FORMAT and f.attrs["burst_hpc_version"], path
    with h5py.File(generated, "r") as f:
        assert f.attrs["kind"] == "inputs" and f.attrs["head_dim"] == 4 and f.attrs["note"] == "x"


@pytest.mark.parametrize("causal", [False, True])
def test_plain_float64_matches_oracle(causal):
    q, k, v, do = _inputs(dtype=np.float64)
    o, lse, dq, dk, dv = tolerance.plain_attention(q, k, v, do, causal, 0.3)
    ro, rlse = attention_reference(q, k, v, causal, 0.3)
    rdq, rdk, rdv = attention_backward_reference(do, q, k, v, causal, 0.3)
    for ours, ref in ((o, ro), (lse, rlse), (dq, rdq), (dk, rdk), (dv, rdv)):
        np.testing.assert_allclose(ours, ref, rtol=1e-12, atol=1e-12)


def test_mismatch_exits_3_and_marks_the_output_failed(tmp_path, monkeypatch):
    """The CLI in-process on one rank, with a broken attention: exit 3, the output published (before
    verification) and marked verify = 'fail' with the errors; a good run marks it 'pass'."""
    from burst_hpc.engine.packed import PackedPasses   # one rank: the packed passes

    src, dst = tmp_path / "in.h5", tmp_path / "out.h5"
    io.generate(src, 1, 32, 2, 1, 8, np.float32, seed=0)
    real = PackedPasses.forward

    def broken(*args, **kwargs):
        o, lse = real(*args, **kwargs)
        return o + 1, lse

    monkeypatch.setattr(PackedPasses, "forward", broken)
    assert cli.main(["run", str(src), str(dst), "--verify", "--quiet", "--backend", "numpy"]) == EXIT_MISMATCH
    assert dst.exists() and not list(tmp_path.glob("*.tmp*"))
    marks = verify.recorded(dst)
    assert marks["verify"] == "fail" and marks["verify_mode"] == "full", marks
    assert marks["verify_max_err_o"] > marks["verify_tol_o"] and marks["verify_max_err_lse"] <= marks["verify_tol_lse"]
    data = io.read_global(src)
    o_ref, _ = attention_reference(data["q"], data["k"], data["v"], False)
    assert np.abs(io.read_global(dst)["o"] - (o_ref + 1)).max() < 1e-5  # the result as computed, kept
    monkeypatch.setattr(PackedPasses, "forward", real)
    assert cli.main(["run", str(src), str(dst), "--verify", "--quiet", "--backend", "numpy", "--overwrite"]) == 0
    assert verify.recorded(dst)["verify"] == "pass"
