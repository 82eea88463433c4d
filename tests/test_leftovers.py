"""Leftover temporary files and the lock that tells a running job's from a dead one's (job/owner.py,
job/leftovers.py), through real processes: burst-hpc jobs killed by SIGKILL, a job written with the
Python API, reused pids, another host's files, lone lock files; ``burst-hpc clean`` and the note a new
job prints."""
import json
import os
import re
import signal
import subprocess
import sys
import time

from burst_hpc.job import leftovers, owner
from test_cli import ENV, MPIEXEC, burst, needs_mpiexec
# long_input: the module-scoped fixture of test_jobsafety.py, its long input shared here
from test_jobsafety import _running, _temp_outputs, _temps, long_input, stop_run_at_random  # noqa: F401

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
