"""A job's life on a shared machine, through real mpiexec and real HDF5 files (issues 20, 24):
two jobs racing for one output name, SIGTERM / SIGINT at a random moment, a time limit during
--verify, and a file system that fills up while a job writes (stale temporary files and their lock:
test_leftovers.py).

BURST_RACE_REPS (default 1) repeats each race; bench/job_safety.py runs the long versions.
"""
import errno
import os
import random
import re
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from burst_hpc import config, io
from burst_hpc.job import owner, publish, verify
from burst_hpc.dtypes import bfloat16
from burst_hpc.errors import FileError
from burst_hpc.reference import attention_reference
from test_cli import ENV, MPIEXEC, burst, needs_mpiexec

REPS = int(os.environ.get("BURST_RACE_REPS", "1"))
CLEAN_END = ("Traceback", "Exception ignored", "Segmentation", "Bus error", "core dumped", "signal 7", "signal 11")


def _temps(directory):
    """Temporary files and their lock files (``.tmp-...lock``)."""
    return sorted(p for p in os.listdir(directory) if ".tmp-" in p)


def _temp_outputs(directory):
    """Temporary files without their lock files."""
    return [p for p in _temps(directory) if not p.endswith(owner.LOCK_SUFFIX)]


def _popen(args, ranks=None):
    cmd = [sys.executable, "-m", "burst_hpc", *map(str, args)]
    if ranks is not None:
        cmd = [MPIEXEC, "-n", str(ranks)] + cmd
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(procs, timeout=240):
    outputs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, *o) for p, o in zip(procs, outputs)]


# --------------------------------------------------------------------------- publishing

def _check_race(results, tmp_path, dst):
    """Exactly one job won; the other failed with one clear line; returns (winner, loser, kept)."""
    codes = [r[0] for r in results]
    assert sorted(codes) == [0, 1], results
    winner, loser = codes.index(0), codes.index(1)
    err = results[loser][2]
    assert err.count("burst-hpc: error:") == 1, err
    assert "already exists" in err or "appeared while this job ran" in err, err
    for needle in CLEAN_END:
        assert needle not in err, err
    kept = re.search(r"kept as '([^']+)'", err)
    if kept:
        assert os.path.exists(kept[1]), err
    outputs = sorted(p for p in os.listdir(tmp_path) if p.startswith(dst.stem))
    assert outputs == sorted([dst.name] + ([os.path.basename(kept[1])] if kept else [])), outputs
    assert not _temps(tmp_path)
    return winner, loser, kept[1] if kept else None


@needs_mpiexec
@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "balanced"])
def test_two_runs_race_for_one_output(tmp_path, layout):
    """Two 2-rank jobs with different scales, one output name: one file with one job's complete result."""
    src, dst = tmp_path / "in.h5", tmp_path / "out.h5"
    assert burst("gen", src, "--seqlen", 64, "--heads", 2, "--head-dim", 8, "--dtype", "float32").returncode == 0
    data = io.read_global(src)
    scales = (0.25, 0.5)
    for _ in range(REPS):
        procs = [_popen(["run", src, dst, "--causal", "--layout", layout, "--scale", s, "--backend", "numpy",
                         "--quiet"], ranks=2) for s in scales]
        winner, loser, kept = _check_race(_finish(procs), tmp_path, dst)
        for path, scale in ((dst, scales[winner]), (kept, scales[loser])):
            if path is None:
                continue
            out = io.read_global(path)
            o_ref, lse_ref = attention_reference(data["q"], data["k"], data["v"], True, scale)
            assert np.abs(out["o"] - o_ref).max() < 1e-5 and np.abs(out["lse"] - lse_ref).max() < 1e-4
            with h5py.File(path, "r") as f:
                assert f.attrs["scale"] == scale and f.attrs["run_layout"] == layout
        for p in os.listdir(tmp_path):
            if p != "in.h5":
                os.remove(tmp_path / p)


def test_two_gens_race_for_one_output(tmp_path):
    dst = tmp_path / "in.h5"
    for _ in range(REPS):
        procs = [_popen(["gen", dst, "--seqlen", 2048, "--heads", 4, "--head-dim", 32, "--seed", s, "--quiet"])
                 for s in (1, 2)]
        winner, _, _ = _check_race(_finish(procs), tmp_path, dst)
        ref = tmp_path / "ref.h5"
        io.generate(ref, 1, 2048, 4, 4, 32, bfloat16, seed=winner + 1)
        got, want = io.read_global(dst), io.read_global(ref)
        assert all(np.array_equal(got[n].view(np.uint16), want[n].view(np.uint16)) for n in want)
        for p in os.listdir(tmp_path):
            os.remove(tmp_path / p)


def test_publish_never_replaces(tmp_path, monkeypatch):
    final = tmp_path / "out.h5"
    a, b = owner.temp_name(final), owner.temp_name(final)
    for path, text in ((a, "first"), (b, "second")):
        with open(path, "w") as f:
            f.write(text)
    publish.publish(a, final)
    with pytest.raises(FileError, match="appeared while this job ran") as info:
        publish.publish(b, final)
    kept = re.search(r"kept as '([^']+)'", str(info.value))[1]
    assert final.read_text() == "first" and open(kept).read() == "second"
    assert not _temps(tmp_path)

    # a file system without hard links: the same guarantee through renameat2(RENAME_NOREPLACE)
    def no_link(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    c = owner.temp_name(final)
    with open(c, "w") as f:
        f.write("third")
    with pytest.raises(FileExistsError):
        publish.link_noreplace(c, final)
    publish.link_noreplace(c, tmp_path / "other.h5")
    assert (tmp_path / "other.h5").read_text() == "third" and final.read_text() == "first"
    publish.publish(kept, final, overwrite=True)  # --overwrite replaces, on purpose
    assert final.read_text() == "second"


# --------------------------------------------------------------------------- signals

def _ranks_of(proc):
    """PIDs of the burst_hpc processes under ``proc`` (mpiexec)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    children = {}
    for line in out.splitlines():
        pid, ppid, args = line.split(None, 2)
        children.setdefault(int(ppid), []).append((int(pid), args))
    found, todo = [], [proc.pid]
    while todo:
        for pid, args in children.get(todo.pop(), []):
            todo.append(pid)
            if "burst_hpc" in args and "mpiexec" not in args:
                found.append(pid)
    return found


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def stop_run_at_random(tmp_path, src, target, sig, ranks=4, earliest=0.2, latest=2.0, flags=()):
    """Start a run, wait until its temporary file exists, send ``sig`` to ``target`` ('mpiexec' or
    'rank') after a random delay; return (seconds until every rank was gone, result)."""
    dst = tmp_path / "out.h5"
    proc = _popen(["run", src, dst, "--backend", "numpy", "--quiet", *flags], ranks=ranks)
    deadline = time.time() + 120
    while not _temp_outputs(tmp_path) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert _temp_outputs(tmp_path) and proc.poll() is None, "the run ended before it could be stopped; make it larger"
    time.sleep(random.uniform(earliest, latest))
    pids = _ranks_of(proc)
    assert len(pids) == ranks and proc.poll() is None, (pids, "the run ended before it could be stopped")
    t0 = time.time()
    if target == "mpiexec":
        proc.send_signal(sig)
        if sig == signal.SIGKILL:  # a job killed from outside: the batch system kills its whole tree
            for pid in pids:       # (Open MPI's ranks outlive a killed mpiexec, and run on)
                os.kill(pid, sig)
    else:
        os.kill(random.choice(pids), sig)
    while any(_running(p) for p in pids) and time.time() - t0 < 30:
        time.sleep(0.02)
    gone = time.time() - t0
    out, err = proc.communicate(timeout=60)
    return gone, (proc.returncode, out, err)


@pytest.fixture(scope="module")
def long_input(tmp_path_factory):
    src = tmp_path_factory.mktemp("long") / "in.h5"
    # a run of 30 s or more on 4 ranks here: the signal comes within its first seconds whatever the load
    assert burst("gen", src, "--seqlen", 16384, "--heads", 4, "--head-dim", 64, "--dtype", "float32",
                 "--with-grad").returncode == 0
    return src


@needs_mpiexec
@pytest.mark.parametrize("target,sig", [("rank", signal.SIGTERM), ("mpiexec", signal.SIGTERM), ("rank", signal.SIGINT)])
def test_signal_ends_every_rank_and_removes_temp(tmp_path, long_input, target, sig):
    gone, (code, _, err) = stop_run_at_random(tmp_path, long_input, target, sig, flags=["--causal", "--backward"])
    assert gone < 5, f"ranks still running {gone:.1f}s after {sig.name}"
    assert code != 0, err
    assert not _temps(tmp_path) and not (tmp_path / "out.h5").exists(), os.listdir(tmp_path)
    for needle in CLEAN_END:
        assert needle not in err, err
    if target == "rank":  # the launcher is alive to pass the line on
        assert f"stopped by {sig.name}" in err and "no output written" in err, err


def test_a_job_ended_from_one_rank_removes_its_temporary_file(tmp_path):
    """collective.abort_job (a pass failing on one rank, a failed parallel HDF5 write) runs the job's
    clean-up first: the temporary file it tracks and its lock file are gone, one error line is said.
    One process, so no launcher's SIGTERM to the other ranks removes the file instead."""
    tmp = tmp_path / "out.h5.tmp-test"
    script = (f"from burst_hpc.collective import abort_job\nfrom burst_hpc.job import owner, safety\n"
              f"owner.hold({str(tmp)!r})\nopen({str(tmp)!r}, 'wb').close()\nsafety.track({str(tmp)!r})\n"
              f"abort_job('ending the job')\n")
    r = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.endswith("burst-hpc: error: ending the job\n"), r.stderr
    assert _temps(tmp_path) == [], os.listdir(tmp_path)


# --------------------------------------------------------------------------- a time limit during --verify

@needs_mpiexec
def test_sigterm_during_verify_keeps_the_published_output(tmp_path):
    """Issue 24: a time limit (SIGTERM to every rank, as Slurm sends it) during --verify: the output is
    already published, complete, and marked verify = 'not finished'; each rank says so in one line."""
    src, dst = tmp_path / "in.h5", tmp_path / "out.h5"
    assert burst("gen", src, "--seqlen", 64, "--heads", 2, "--head-dim", 8, "--dtype", "float32", "--with-grad",
                 "--quiet").returncode == 0
    env = dict(ENV, **{config.TEST_HOOK_VERIFY_PAUSE: "120"})
    proc = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, "-m", "burst_hpc", "run", src, dst, "--causal",
                             "--backward", "--verify", "--backend", "numpy", "--quiet"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while not dst.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert dst.exists() and proc.poll() is None, proc.communicate()
    pids = _ranks_of(proc)
    assert len(pids) == 2
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, out, err)
    lines = [line for line in err.splitlines() if "stopped by SIGTERM" in line]
    assert lines, err
    for line in lines:
        assert line.startswith("burst-hpc: error: rank ") and "no output written" not in line, err
        assert f"{dst} is written and complete, but its verification did not finish" in line, err
    for needle in CLEAN_END:
        assert needle not in err, err
    assert _temps(tmp_path) == []
    assert verify.recorded(dst)["verify"] == "not finished"
    data, got = io.read_global(src), io.read_global(dst)
    o_ref, lse_ref = attention_reference(data["q"], data["k"], data["v"], True)
    assert np.abs(got["o"] - o_ref).max() < 1e-5 and np.abs(got["lse"] - lse_ref).max() < 1e-4
    assert set(got) == {"o", "lse", "dq", "dk", "dv"}


def test_verify_outcome_rewrites_values_in_place(tmp_path):
    """Recording the outcome changes attribute values only: same file size, every dataset intact."""
    import h5py

    path = tmp_path / "out.h5"
    o = np.arange(2 * 64 * 2 * 8, dtype=np.float32).reshape(2, 64, 2, 8)
    io.write_global(path, {"o": o, "lse": np.zeros((2, 2, 64), np.float32)},
                    verify.pending_attrs(["o", "lse"], True))
    assert verify.recorded(path)["verify"] == "not finished"
    size = os.path.getsize(path)
    report = {"ok": False, "mode": "sampled 256 rows/rank", "err": {"o": 0.5, "lse": 1e-7}, "tol": {"o": 0.1, "lse": 1e-6}}
    verify.record(path, report)
    assert os.path.getsize(path) == size
    got = verify.recorded(path)
    assert got["verify"] == "fail" and got["verify_mode"] == "sampled 256 rows/rank", got
    assert got["verify_max_err_o"] == 0.5 and got["verify_tol_lse"] == 1e-6, got
    assert np.array_equal(io.read_global(path)["o"], o)
    with h5py.File(path, "r") as f:
        assert f.attrs.get_id("verify").dtype == np.dtype("S12")  # fixed size: rewritten in place


# --------------------------------------------------------------------------- disk full

@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs the test mounts (root only); skipped where it cannot."""
    where = tmp_path / "small"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fails_cleanly(r, directory, fragment, lines=1):
    assert r.returncode == 1, r.stdout + r.stderr
    assert 1 <= r.stderr.count("burst-hpc: error:") <= lines and fragment in r.stderr, r.stderr
    for needle in CLEAN_END:
        assert needle not in r.stderr, r.stderr
    assert os.listdir(directory) == [], os.listdir(directory)


@pytest.mark.parametrize("check", ["early", "mid-write"])
def test_gen_on_a_full_disk(small_fs, check):
    env = dict(ENV, BURST_HPC_SPACE_CHECK="1" if check == "early" else "0")
    args = ["gen", small_fs / "in.h5", "--seqlen", 8192, "--heads", 4, "--head-dim", 64, "--dtype", "float32", "--quiet"]
    r = subprocess.run([sys.executable, "-m", "burst_hpc", *map(str, args)], env=env, capture_output=True, text=True,
                       timeout=120)
    _fails_cleanly(r, small_fs, "not enough space" if check == "early" else "file system is full")


@needs_mpiexec
@pytest.mark.parametrize("check", ["early", "mid-write"])
def test_run_on_a_full_disk(tmp_path, small_fs, check):
    src = tmp_path / "in.h5"
    assert burst("gen", src, "--seqlen", 2048, "--heads", 4, "--head-dim", 64, "--dtype", "float32").returncode == 0
    env = dict(ENV, BURST_HPC_SPACE_CHECK="1" if check == "early" else "0")
    r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "burst_hpc", "run", str(src), str(small_fs / "out.h5"),
                        "--backend", "numpy", "--quiet"], env=env, capture_output=True, text=True, timeout=180)
    # parallel HDF5 cannot agree after a failed collective write: the failing rank aborts the job
    # (its line, then the other rank's 'stopped by SIGTERM'); token passing agrees on one line
    mpio = h5py.get_config().mpi and check == "mid-write"
    _fails_cleanly(r, small_fs, "not enough space" if check == "early" else "file system is full", 2 if mpio else 1)


def test_info_names_the_write_path():
    r = burst("info")
    assert r.returncode == 0, r.stderr
    line = [x for x in r.stdout.splitlines() if x.startswith("HDF5 output:")]
    assert len(line) == 1, r.stdout
    expected = "parallel HDF5 (mpio driver)" if h5py.get_config().mpi else "rank-ordered token passing"
    assert expected in line[0], line
