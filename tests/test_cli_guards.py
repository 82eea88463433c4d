"""What protects a user's data and results, through real mpiexec: NaN/Inf inputs refused with the
dataset and first bad index, --verify never passing a non-finite error, existing outputs kept unless
--overwrite, and --help complete enough to use without the docs."""
import argparse

import h5py
import numpy as np
import pytest

from burst_hpc import io
from burst_hpc.job import verify
from burst_hpc.cli_parser import build_parser
from burst_hpc.reference import attention_backward_reference, attention_reference
from test_cli import leftovers, random_qkv, write_input, burst, mpirun, needs_mpiexec


def _one_error(r):
    assert r.stderr.count("burst-hpc: error:") == 1, r.stderr  # one message, not one per rank
    assert "Traceback" not in r.stderr, r.stderr


@needs_mpiexec
@pytest.mark.parametrize("causal", [False, True])
def test_nonfinite_input_refused_with_first_index(tmp_path, causal):
    src, dst = tmp_path / "in.h5", tmp_path / "out.h5"
    data = random_qkv(32)
    # global token 9 is on rank 1 under both layouts (zigzag: rank 0 owns 0-7 and 24-31);
    # token 26 sits on rank 0 under zigzag: the message must name the first in file order
    data["q"][0, 26, 1, 2] = np.inf
    data["q"][0, 9, 0, 5] = np.nan
    data["k"][0, 1, 0, 0] = np.nan  # a later dataset: q is reported first
    write_input(src, **data)
    r = mpirun(2, "run", src, dst, "--backend", "numpy", *(["--causal"] if causal else []))
    assert r.returncode == 1, r.stdout + r.stderr
    _one_error(r)
    assert "dataset 'q' holds nan at [0, 9, 0, 5]" in r.stderr, r.stderr
    assert "--allow-nonfinite" in r.stderr
    assert not dst.exists() and not leftovers(tmp_path)


@needs_mpiexec
def test_verify_passes_nonfinite_outputs_that_match_the_oracle(tmp_path):
    """An Inf in v that every row sees: every o is non-finite where the float64 oracle's is, which --verify
    counts as no error (a NaN or Inf where the oracle has a number fails: tests/test_verify.py)."""
    src, dst = tmp_path / "in.h5", tmp_path / "out.h5"
    data = random_qkv(32)
    data["v"][0, 30, 0, 1] = np.inf
    write_input(src, **data)
    r = mpirun(2, "run", src, dst, "--backend", "numpy", "--allow-nonfinite", "--verify")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "nonfinite o=64" in r.stdout and "verify=PASS(full)" in r.stdout, r.stdout + r.stderr
    assert verify.recorded(dst)["verify"] == "pass" and not leftovers(tmp_path)


@needs_mpiexec
def test_allow_nonfinite_propagates_into_the_output(tmp_path):
    """--allow-nonfinite: the outputs hold NaN exactly where the float64 oracle does (the rows that see the
    NaN and Inf, and the gradients they feed: not zeros, as if masked), the run exits 0 and its summary
    counts them; a finite run's summary has no such count."""
    src, dst = tmp_path / "in.h5", tmp_path / "out.h5"
    data = random_qkv(32)
    data["do"] = np.random.default_rng(1).standard_normal(data["q"].shape).astype(np.float32)
    data["k"][0, 9, 0, 5] = np.nan   # on rank 1 (zigzag): rows 9.. see it
    data["q"][0, 26, 1, 2] = np.inf  # on rank 0 (zigzag)
    write_input(src, **data)
    r = mpirun(2, "run", src, dst, "--backend", "numpy", "--causal", "--backward", "--allow-nonfinite")
    assert r.returncode == 0, r.stdout + r.stderr
    out = io.read_global(dst)
    ref = dict(zip(("o", "lse"), attention_reference(data["q"], data["k"], data["v"], causal=True)))
    ref.update(zip(("dq", "dk", "dv"), attention_backward_reference(data["do"], data["q"], data["k"], data["v"],
                                                                    causal=True)))
    counts = []
    for name in ("o", "lse", "dq", "dk", "dv"):
        bad = ~np.isfinite(out[name])
        np.testing.assert_array_equal(bad, ~np.isfinite(ref[name]), err_msg=name)
        assert np.isnan(out[name][bad]).all(), name
        counts.append(f"{name}={int(bad.sum())}")
    assert np.isfinite(out["o"][:, :9]).all() and np.isnan(out["o"][:, 9:, 0]).all()  # head 0 reads kv head 0
    assert "nonfinite " + " ".join(counts) in r.stdout, r.stdout
    assert f"-> {dst}" in r.stdout and not leftovers(tmp_path)

    finite = tmp_path / "finite.h5"
    write_input(finite, **random_qkv(32))
    r = mpirun(2, "run", finite, tmp_path / "finite_out.h5", "--backend", "numpy", "--causal")
    assert r.returncode == 0 and "  nonfinite " not in r.stdout, r.stdout + r.stderr


@needs_mpiexec
def test_existing_output_kept_unless_overwrite(tmp_path):
    src, dst = tmp_path / "in.h5", tmp_path / "out.h5"
    write_input(src, **random_qkv(32))
    dst.write_bytes(b"a finished result")
    r = mpirun(2, "run", src, dst, "--backend", "numpy")
    assert r.returncode == 1, r.stdout + r.stderr
    _one_error(r)
    assert "already exists; pass --overwrite" in r.stderr, r.stderr
    assert dst.read_bytes() == b"a finished result" and not leftovers(tmp_path)

    r = mpirun(2, "run", src, dst, "--backend", "numpy", "--overwrite", "--verify")
    assert r.returncode == 0, r.stdout + r.stderr
    with h5py.File(dst, "r") as f:
        assert f["o"].shape == (1, 32, 2, 8)
    assert not leftovers(tmp_path)


def test_gen_keeps_existing_file_unless_overwrite(tmp_path):
    dst = tmp_path / "in.h5"
    dst.write_bytes(b"precious")
    r = burst("gen", dst, "--seqlen", 16, "--head-dim", 8)
    assert r.returncode == 1 and "already exists; pass --overwrite" in r.stderr, r.stderr
    assert dst.read_bytes() == b"precious"
    r = burst("gen", dst, "--seqlen", 16, "--head-dim", 8, "--overwrite")
    assert r.returncode == 0, r.stderr
    with h5py.File(dst, "r") as f:
        assert f["q"].shape == (1, 16, 8, 8)


def _subparser(name):
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", ["run", "gen", "check"])
def test_help_describes_every_option(command):
    r = burst(command, "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    for action in _subparser(command)._actions:
        assert action.help and len(action.help) > 8, f"{command} {action.option_strings or action.dest}: no help"
        for opt in action.option_strings:
            assert opt in text, f"{opt} missing from '{command} --help'"
    if command in ("run", "gen"):  # the file format and dtype convention, without the docs
        for needle in ("q (B, S, Hq, D)", "k and v (B, S, Hkv, D)", "lse (B, Hq, S) float32", "uint16",
                       'dtype = "bfloat16"', "GQA"):
            assert needle in text, f"'{needle}' missing from '{command} --help'"
    if command == "run":
        for needle in ("exit status", "NaN", "--overwrite", "mpiexec"):
            assert needle in text


def test_top_level_help_points_to_command_help():
    r = burst("--help")
    assert r.returncode == 0
    assert "USAGE.md" not in r.stdout and "COMMAND --help" in r.stdout, r.stdout
    for command in ("info", "gen", "run", "check"):
        assert command in r.stdout
