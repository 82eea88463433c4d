"""Ranks launched with different command lines (``mpiexec -n 1 burst-hpc ... : -n 1 burst-hpc ...``): the
ranks agree on the command and every option that shapes the job (paths by absolute path) in one
collective before anything else, so each difference ends every rank within seconds with one error
naming it, exit status 1, and nothing created or replaced. Before, these hung with the output
published as 'not finished', crashed (KeyError 'do'), or ran on rank 0's options (an existing
output replaced)."""
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from burst_hpc import io
from burst_hpc.plan.schemes import SCHEMES
from test_cli import ENV, MPIEXEC, leftovers, needs_mpiexec

HANG_S = 60   # these end in about two seconds; a launch still running then hangs


def mpmd(*command_lines):
    """``mpiexec -n 1 python -m burst_hpc LINE0 : -n 1 ... LINE1 ...``: one rank per command line. A
    launch that runs past HANG_S is killed with its ranks and fails the test."""
    cmd = [MPIEXEC]
    for rank, line in enumerate(command_lines):
        cmd += ([":"] if rank else []) + ["-n", "1", sys.executable, "-m", "burst_hpc", *map(str, line)]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"hung: killed after {HANG_S} s\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture
def files(tmp_path):
    """Two small inputs (with do) and the names of an output and a report."""
    names = {"src": "in.h5", "other": "other.h5", "dst": "out.h5", "report": "report.json"}
    for key in ("src", "other"):
        io.generate(tmp_path / names[key], 1, 16, 2, 2, 8, np.float32, seed=1, with_grad=True)
    return {key: tmp_path / name for key, name in names.items()}


def run_line(files, *extra, src="src", dst="dst"):
    return ["run", files[src], files[dst], "--causal", "--backend", "numpy", *extra]


# (rank 0's command line, rank 1's, what the one error line says after "ranks disagree on ")
CASES = {
    "verify": (lambda f: run_line(f, "--verify"), lambda f: run_line(f), "--verify: rank 0 has True, rank 1 has False"),
    "warmup": (lambda f: run_line(f), lambda f: run_line(f, "--warmup"), "--warmup: rank 0 has False, rank 1 has True"),
    "allow-nonfinite": (lambda f: run_line(f, "--allow-nonfinite"), lambda f: run_line(f),
                        "--allow-nonfinite: rank 0 has True, rank 1 has False"),
    "scheme": (lambda f: run_line(f, "--scheme", "ring"), lambda f: run_line(f, "--scheme", "double_ring"),
               "--scheme: rank 0 has 'ring', rank 1 has 'double_ring'"),
    "backward": (lambda f: run_line(f), lambda f: run_line(f, "--backward"),
                 "--backward: rank 0 has False, rank 1 has True"),
    "run or verify": (lambda f: run_line(f), lambda f: ["verify", f["src"], f["dst"], "--backend", "numpy"],
                      "the command: rank 0 has 'run', rank 1 has 'verify'"),
    "input": (lambda f: run_line(f), lambda f: run_line(f, src="other"), "IN.h5: rank 0 has '{src}', rank 1 has "
              "'{other}'"),
    "output": (lambda f: run_line(f), lambda f: run_line(f, dst="report"), "OUT.h5: rank 0 has '{dst}', rank 1 "
               "has '{report}'"),
    "json": (lambda f: run_line(f, "--json", f["report"]), lambda f: run_line(f),
             "--json: rank 0 has '{report}', rank 1 has None"),
}


@needs_mpiexec
@pytest.mark.parametrize("case", CASES)
def test_ranks_with_different_command_lines_fail_alike_and_create_nothing(files, case):
    first, second, expected = CASES[case]
    r = mpmd(first(files), second(files))
    assert r.returncode == 1, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("burst-hpc: error:")]
    wanted = f"burst-hpc: error: ranks disagree on {expected.format(**files)}; every rank must pass matching arguments"
    assert errors == [wanted], r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert not files["dst"].exists() and not files["report"].exists()
    assert not leftovers(files["dst"].parent)


@needs_mpiexec
def test_overwrite_on_one_rank_only_leaves_the_existing_output(files):
    """Before, rank 0's --overwrite won: the existing output was replaced."""
    files["dst"].write_bytes(b"an earlier result")
    r = mpmd(run_line(files, "--overwrite"), run_line(files))
    assert r.returncode == 1, r.stdout + r.stderr
    assert ("burst-hpc: error: ranks disagree on --overwrite: rank 0 has True, rank 1 has False; every rank must pass "
            "matching arguments") in r.stderr, r.stderr
    assert files["dst"].read_bytes() == b"an earlier result"
    assert not leftovers(files["dst"].parent)


@needs_mpiexec
def test_display_options_may_differ(files):
    """--progress and --quiet change only what rank 0 prints: ranks may differ in them."""
    r = mpmd(run_line(files, "--progress"), run_line(files, "--quiet"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert files["dst"].exists()


@needs_mpiexec
def test_a_rank_whose_command_line_does_not_parse_meets_the_others_in_the_agreement(files):
    """Before, the ranks that parsed waited in the job for the one that did not, which gave up after
    cli_delivery.SAY_WAIT_S (30 s) and wrote its own line; now every rank meets in the agreement and rank 0
    says which rank's command line is bad."""
    r = mpmd(run_line(files), run_line(files, "--scheme", "bogus"))
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("burst-hpc: error:")]
    choices = ", ".join(f"'{name}'" for name in SCHEMES)
    assert errors == [f"burst-hpc: error: argument --scheme: invalid choice: 'bogus' (choose from {choices}) (rank 1)"], \
        r.stderr
    assert not files["dst"].exists() and not leftovers(files["dst"].parent)


@needs_mpiexec
@pytest.mark.parametrize("asks", [("run", "--help"), ("--version",)])
def test_help_or_version_on_one_rank_meets_the_others_in_the_agreement(files, asks):
    """Before, a rank asking for --help (or --version) printed it and left, and the others waited for it in
    the command's agreement until killed."""
    r = mpmd(run_line(files), asks)
    assert r.returncode == 1, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("burst-hpc: error:")]
    assert errors == ["burst-hpc: error: ranks disagree on the command: rank 0 has 'run', rank 1 has '--help or "
                      "--version'; every rank must pass matching arguments"], r.stderr
    assert not files["dst"].exists() and not leftovers(files["dst"].parent)

