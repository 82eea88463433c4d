"""A job's life on a shared machine, through real mpiexec and real HDF5 files (issues 20, 24):
two jobs racing for one output name, SIGTERM / SIGINT / SIGKILL at a random moment, stale
temporary files and the lock that tells a running job's from a dead one's, a time limit during
--verify, and a file system that fills up while a job writes.

BURST_RACE_REPS (default 1) repeats each race; bench/job_safety.py runs the long versions.
"""
import errno
import json
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
from burst_hpc.job import leftovers, owner, publish, verify
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


# --------------------------------------------------------------------------- stale temporary files

HOLDER = """import sys, time
from burst_hpc.job import owner
owner.hold(sys.argv[1])
open(sys.argv[1], "wb").write(b"x")
print("ready", flush=True)
time.sleep(120)
"""


def _holder(tmp_path, tmp):
    """A process that holds the lock of temporary file ``tmp`` (as a job's rank 0 does) and waits."""
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp)], env=ENV, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _sidecar(tmp, **record):
    """A temporary file and a lock file that nobody holds, recording ``record`` as its owner."""
    with open(tmp, "wb") as f:
        f.write(b"x")
    with open(owner.lock_path(tmp), "w") as f:
        json.dump(record, f)


@needs_mpiexec
def test_sigkill_leaves_a_stale_temp_that_is_named_and_cleaned(tmp_path, long_input):
    gone, _ = stop_run_at_random(tmp_path, long_input, "mpiexec", signal.SIGKILL, ranks=2, latest=0.5,
                                 flags=["--causal", "--backward"])
    # SIGKILL of mpiexec: the ranks die with it (or a moment later), their temporary file stays
    (stale,) = _temp_outputs(tmp_path)
    assert _temps(tmp_path) == [stale, stale + owner.LOCK_SUFFIX]  # and the lock file nobody holds now
    dst = tmp_path / "out.h5"
    # a live job's temporary file (its writer holds the lock) and one of another host
    live_tmp = tmp_path / f"out.h5.tmp-{owner.host_tag()}-{os.getpid()}-0123abcd"
    live = _holder(tmp_path, live_tmp)
    try:
        other_tmp = tmp_path / "out.h5.tmp-othernode-4242-89abcdef"
        other_tmp.write_bytes(b"x")
        r = burst("gen", dst, "--seqlen", 64, "--heads", 2, "--head-dim", 8, "--quiet")
        assert r.returncode == 0, r.stderr
        notes = [line for line in r.stderr.splitlines() if line.startswith("burst-hpc: note:")]
        assert len(notes) == 2, r.stderr
        assert stale in r.stderr and f"burst-hpc clean {dst}" in r.stderr, r.stderr
        assert str(other_tmp) in r.stderr and "host othernode" in r.stderr and live_tmp.name not in r.stderr
        assert f"burst-hpc clean --force {dst}" in r.stderr, r.stderr
        r = burst("clean", dst)
        assert r.returncode == 0, r.stderr
        assert f"removed {tmp_path / stale} and its lock file" in r.stdout, r.stdout
        assert "a running job owns it" in r.stdout, r.stdout
        assert "cannot tell from this host whether its job runs" in r.stdout, r.stdout
        live_files = [live_tmp.name, live_tmp.name + owner.LOCK_SUFFIX]
        assert _temps(tmp_path) == sorted(live_files + [other_tmp.name])
    finally:
        live.kill()
        live.wait()
    r = burst("clean", dst)  # its owner is gone now
    assert f"removed {live_tmp} and its lock file" in r.stdout and _temps(tmp_path) == [other_tmp.name], r.stdout


JOB = """# a job written with the documented Python API (docs/USAGE.md), which waits before publishing
import sys, time
from mpi4py import MPI
from burst_hpc import io, burst_attention

comm = MPI.COMM_WORLD
spec, shards = io.read_shards(sys.argv[1], comm, "contiguous", names=("q", "k", "v"))
o, lse = burst_attention(shards["q"], shards["k"], shards["v"], comm, layout="contiguous")
out = io.OutputFile.create(sys.argv[2], comm, io.output_datasets(spec, backward=False), {"causal": False})
try:
    out.write({"o": o, "lse": lse}, "contiguous")
    if comm.rank == 0:
        print("written", flush=True)
    time.sleep(600)
    out.commit()
except BaseException:
    out.abort()
    raise
"""


def _children(pid):
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    pairs = [tuple(map(int, line.split())) for line in out.splitlines()]
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for child, ppid in pairs:
            if ppid == parent:
                found.append(child)
                todo.append(child)
    return found


@needs_mpiexec
def test_clean_never_removes_a_running_python_api_job(tmp_path):
    """Issue 24: a job that is not 'burst-hpc' (a script using io.OutputFile) holds its temporary file
    by the lock; clean keeps it while the job runs, and removes it once the job is SIGKILLed."""
    src, dst = tmp_path / "in.h5", tmp_path / "out.h5"
    assert burst("gen", src, "--seqlen", 64, "--heads", 2, "--head-dim", 8, "--dtype", "float32",
                 "--quiet").returncode == 0
    (tmp_path / "job.py").write_text(JOB)
    proc = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, "job.py", "in.h5", "out.h5"], cwd=tmp_path, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "written", proc.stderr.read()
        (tmp,) = _temp_outputs(tmp_path)
        owner_pid = int(re.search(r"\.tmp-.+-(\d+)-[0-9a-f]{8}$", tmp)[1])
        with open(f"/proc/{owner_pid}/cmdline", "rb") as f:
            assert b"burst" not in f.read().lower()  # nothing in its command line says what it is
        assert _temps(tmp_path) == [tmp, tmp + owner.LOCK_SUFFIX]
        for flags in ([], ["--force"]):
            r = burst("clean", dst, *flags)
            assert r.returncode == 0, r.stderr
            assert f"kept {tmp_path / tmp}: a running job owns it (pid {owner_pid} on this host holds its lock)" \
                in r.stdout, r.stdout
            assert _temps(tmp_path) == [tmp, tmp + owner.LOCK_SUFFIX], r.stdout
        assert leftovers.stale_note(dst) == []  # run and gen would not point at it either
        family = _children(proc.pid)  # the launcher's helpers and the ranks
        assert owner_pid in family
        for pid in family:  # SIGKILL: no clean-up of any kind runs
            os.kill(pid, signal.SIGKILL)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        deadline = time.time() + 30
        while any(_running(pid) for pid in family) and time.time() < deadline:
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert _temps(tmp_path) == [tmp, tmp + owner.LOCK_SUFFIX]  # SIGKILL left both behind
    r = burst("clean", dst)
    assert r.returncode == 0, r.stderr
    assert f"removed {tmp_path / tmp} and its lock file (no process holds its lock: pid {owner_pid} is gone)" \
        in r.stdout, r.stdout
    assert _temps(tmp_path) == [] and not dst.exists()


def test_a_reused_pid_is_not_taken_for_the_owner(tmp_path, monkeypatch):
    """The lock decides: a pid that runs but holds no lock (whatever its start time) is not the owner.
    Where the file system has no locks, the pid and its start time decide."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host, pid = owner.host_tag(), other.pid
        start, boot = owner.owner_record(pid)["start"], owner.owner_record()["boot"]
        assert start is not None  # /proc is there
        dst = tmp_path / "out.h5"
        reused = tmp_path / f"out.h5.tmp-{host}-{pid}-0000aaaa"  # pid now another process: started later
        unlocked = tmp_path / f"out.h5.tmp-{host}-{pid}-0000bbbb"  # the same process, but no lock held
        no_lock_file = tmp_path / f"out.h5.tmp-{host}-{pid}-0000cccc"  # an older burst-hpc's file
        _sidecar(reused, host=host, pid=pid, start=start - 100, boot=boot)
        _sidecar(unlocked, host=host, pid=pid, start=start, boot=boot)
        no_lock_file.write_bytes(b"x")
        r = burst("clean", dst)
        assert r.returncode == 0, r.stderr
        assert f"removed {reused} and its lock file (no process holds its lock: pid {pid} is now another " \
               "process, started after the job's)" in r.stdout, r.stdout
        assert f"removed {unlocked} and its lock file (no process holds its lock: pid {pid} runs but does not " \
               "hold it)" in r.stdout, r.stdout
        assert f"kept {no_lock_file}: cannot tell whether its job runs" in r.stdout, r.stdout
        assert _temps(tmp_path) == [no_lock_file.name]
        r = burst("clean", dst, "--force")
        assert f"removed {no_lock_file} (no lock file, and pid {pid} on this host runs" in r.stdout, r.stdout
        assert _temps(tmp_path) == []

        # a file system without locks (ENOLCK): the recorded start time tells the owner from a reused pid
        monkeypatch.setattr(owner, "_try_lock", lambda path: ("untestable", None))
        _sidecar(reused, host=host, pid=pid, start=start - 100, boot=boot)
        _sidecar(unlocked, host=host, pid=pid, start=start, boot=boot)
        lines = leftovers.clean(dst)
        assert f"removed {reused} and its lock file (pid {pid} is now another process, started after the " \
               "job's; no file locks here)" in lines, lines
        assert f"kept {unlocked}: a running job owns it (pid {pid} on this host runs, with the same start time; " \
               "no file locks here)" in lines, lines
        assert _temps(tmp_path) == [unlocked.name, unlocked.name + owner.LOCK_SUFFIX]
    finally:
        other.kill()
        other.wait()
    assert leftovers.clean(dst) == [f"removed {unlocked} and its lock file (pid {pid} is gone; no file locks here)"]


def test_another_hosts_file_is_kept_unless_force(tmp_path):
    """A lock seen free says nothing about another host's job (its locks may stay on that host):
    listed and kept, removed with --force; a lock seen held is a live job's, kept even with --force."""
    dst = tmp_path / "out.h5"
    free = tmp_path / "out.h5.tmp-othernode-4242-89abcdef"
    held = tmp_path / "out.h5.tmp-othernode-4343-0123abcd"
    _sidecar(free, host="othernode", pid=4242, start=1, boot="b")
    holder = _holder(tmp_path, held)
    try:
        r = burst("clean", dst)
        assert r.returncode == 0, r.stderr
        assert f"kept {free}: cannot tell from this host whether its job runs (owned by pid 4242 on host " \
               "othernode; no lock on it is seen from here" in r.stdout, r.stdout
        assert f"burst-hpc clean --force {dst}" in r.stdout, r.stdout
        assert f"kept {held}: a running job owns it (pid 4343 on host othernode holds its lock)" in r.stdout
        both = sorted(p + s for p in (free.name, held.name) for s in ("", owner.LOCK_SUFFIX))
        assert _temps(tmp_path) == both
        r = burst("clean", dst, "--force", "--dry-run")
        assert f"would remove {free} and its lock file" in r.stdout and _temps(tmp_path) == both, r.stdout
        r = burst("clean", dst, "--force")
        assert f"removed {free} and its lock file (owned by pid 4242 on host othernode" in r.stdout, r.stdout
        assert f"kept {held}: a running job owns it" in r.stdout, r.stdout
        assert _temps(tmp_path) == [held.name, held.name + owner.LOCK_SUFFIX]
    finally:
        holder.kill()
        holder.wait()


def test_lone_and_own_lock_files(tmp_path):
    """A lock file left without its temporary file (killed between the two) is removed when stale; a
    process never probes (and so never drops) the locks it holds itself."""
    dst = tmp_path / "out.h5"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lone = owner.lock_path(tmp_path / f"out.h5.tmp-{owner.host_tag()}-{dead.pid}-0123abcd")
    with open(lone, "w") as f:
        f.write("{}")
    mine = owner.temp_name(dst)
    owner.hold(mine)
    try:
        with open(mine, "wb") as f:
            f.write(b"x")
        for _ in range(2):  # probing twice: a probe that dropped our lock would find it free the second time
            states = {path: state for path, state, _ in leftovers.temp_files(dst)}
            assert states == {str(lone): "stale", mine: "live"}, states
        r = burst("clean", dst)  # another process sees the lock held
        assert f"removed {lone} (no process holds its lock: pid {dead.pid} is gone)" in r.stdout, r.stdout
        assert f"kept {mine}: a running job owns it" in r.stdout, r.stdout
    finally:
        os.remove(mine)
        owner.release(mine)
    assert _temps(tmp_path) == []


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


def test_clean_dry_run_and_help(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"out.h5.tmp-{owner.host_tag()}-{dead.pid}-0123abcd"
    stale.write_bytes(b"x")
    r = burst("clean", tmp_path / "out.h5", "--dry-run")
    assert r.returncode == 0 and f"would remove {stale}" in r.stdout and stale.exists(), r.stdout
    assert "no temporary files" in burst("clean", tmp_path / "other.h5").stdout
    r = burst("clean", "--help")
    assert r.returncode == 0 and "--dry-run" in r.stdout and "never removed" in " ".join(r.stdout.split())
