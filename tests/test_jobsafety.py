"""A job's life on a shared machine, through real mpiexec and real HDF5 files (issue 20):
two jobs racing for one output name, SIGTERM / SIGINT / SIGKILL at a random moment, stale
temporary files, and a file system that fills up while a job writes.

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

from burst_hpc import io, jobsafety
from burst_hpc.dtypes import bfloat16
from burst_hpc.errors import FileError
from burst_hpc.reference import attention_reference
from test_cli import ENV, MPIEXEC, burst, needs_mpiexec

REPS = int(os.environ.get("BURST_RACE_REPS", "1"))
CLEAN_END = ("Traceback", "Exception ignored", "Segmentation", "Bus error", "core dumped", "signal 7", "signal 11")


def _temps(directory):
    return sorted(p for p in os.listdir(directory) if ".tmp-" in p)


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
    a, b = jobsafety.temp_name(final), jobsafety.temp_name(final)
    for path, text in ((a, "first"), (b, "second")):
        with open(path, "w") as f:
            f.write(text)
    jobsafety.publish(a, final)
    with pytest.raises(FileError, match="appeared while this job ran") as info:
        jobsafety.publish(b, final)
    kept = re.search(r"kept as '([^']+)'", str(info.value))[1]
    assert final.read_text() == "first" and open(kept).read() == "second"
    assert not _temps(tmp_path)

    # a file system without hard links: the same guarantee through renameat2(RENAME_NOREPLACE)
    def no_link(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    c = jobsafety.temp_name(final)
    with open(c, "w") as f:
        f.write("third")
    with pytest.raises(FileExistsError):
        jobsafety.link_noreplace(c, final)
    jobsafety.link_noreplace(c, tmp_path / "other.h5")
    assert (tmp_path / "other.h5").read_text() == "third" and final.read_text() == "first"
    jobsafety.publish(kept, final, overwrite=True)  # --overwrite replaces, on purpose
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
    while not _temps(tmp_path) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert _temps(tmp_path) and proc.poll() is None, "the run ended before it could be stopped; make it larger"
    time.sleep(random.uniform(earliest, latest))
    pids = _ranks_of(proc)
    assert len(pids) == ranks and proc.poll() is None, (pids, "the run ended before it could be stopped")
    t0 = time.time()
    if target == "mpiexec":
        proc.send_signal(sig)
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


# --------------------------------------------------------------------------- stale temporary files

@needs_mpiexec
def test_sigkill_leaves_a_stale_temp_that_is_named_and_cleaned(tmp_path, long_input):
    gone, _ = stop_run_at_random(tmp_path, long_input, "mpiexec", signal.SIGKILL, ranks=2, latest=0.5,
                                 flags=["--causal", "--backward"])
    # SIGKILL of mpiexec: the ranks die with it (or a moment later), their temporary file stays
    (stale,) = _temps(tmp_path)
    dst = tmp_path / "out.h5"
    # a live job's temporary file (a running burst process on this host) and one of another host
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "burst"])
    try:
        live_tmp = tmp_path / f"out.h5.tmp-{jobsafety.host_tag()}-{live.pid}-0123abcd"
        other_tmp = tmp_path / "out.h5.tmp-othernode-4242-89abcdef"
        live_tmp.write_bytes(b"x")
        other_tmp.write_bytes(b"x")
        r = burst("gen", dst, "--seqlen", 64, "--heads", 2, "--head-dim", 8, "--quiet")
        assert r.returncode == 0, r.stderr
        notes = [line for line in r.stderr.splitlines() if line.startswith("burst-hpc: note:")]
        assert len(notes) == 2, r.stderr
        assert stale in r.stderr and f"burst-hpc clean {dst}" in r.stderr, r.stderr
        assert str(other_tmp) in r.stderr and "host othernode" in r.stderr and live_tmp.name not in r.stderr
        r = burst("clean", dst)
        assert r.returncode == 0, r.stderr
        assert f"removed {tmp_path / stale}" in r.stdout and "a running job owns it" in r.stdout, r.stdout
        assert "cannot tell whether its job runs" in r.stdout, r.stdout
        assert _temps(tmp_path) == sorted([live_tmp.name, other_tmp.name])
    finally:
        live.kill()
        live.wait()
    r = burst("clean", dst)  # its owner is gone now
    assert f"removed {live_tmp}" in r.stdout and _temps(tmp_path) == [other_tmp.name], r.stdout


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


def test_clean_dry_run_and_help(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"out.h5.tmp-{jobsafety.host_tag()}-{dead.pid}-0123abcd"
    stale.write_bytes(b"x")
    r = burst("clean", tmp_path / "out.h5", "--dry-run")
    assert r.returncode == 0 and f"would remove {stale}" in r.stdout and stale.exists(), r.stdout
    assert "no temporary files" in burst("clean", tmp_path / "other.h5").stdout
    r = burst("clean", "--help")
    assert r.returncode == 0 and "--dry-run" in r.stdout and "never removed" in " ".join(r.stdout.split())
