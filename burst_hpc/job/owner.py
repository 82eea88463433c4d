"""Temporary outputs and the lock their writer holds: their names, the owner's lock, and whether a
temporary file found next to an output still has a running writer (:class:`TempFile`).

Temporary outputs are named ``OUT.tmp-<host>-<pid>-<tag>`` (host and pid of the process that owns
the file: rank 0, or the single ``gen`` process). Before the file is created its owner creates the
sidecar ``OUT.tmp-<host>-<pid>-<tag>.lock`` and holds a POSIX record lock (``fcntl``) on it until
the file is published or removed, or the process ends (the kernel drops the lock then, SIGKILL
included). Whether a job still writes the file is decided by that lock, whatever program the job
is (``burst-hpc``, or a script using ``io.OutputFile``), never by its command line:

- POSIX (``fcntl``) locks, not ``flock``: they are the locks NFS (NLM, NFSv4), Lustre (mounted with
  ``-o flock``) and GPFS make coherent across hosts (``flock`` is node-local on some file systems),
  and they belong to the process, so they die with it and a child started with ``fork`` does not
  inherit (and keep alive) a dead job's lock.
- A sidecar, not the HDF5 file itself: HDF5 locks the files it opens (``flock``), so a ``flock`` of
  ours on the temporary file makes h5py's create fail, and a POSIX lock of ours on it is dropped the
  first time h5py closes a descriptor of that file (POSIX drops all of a process's locks on a file
  at any close). Nothing but this module opens a sidecar, and a process never probes its own.
- The sidecar records host, pid, process start time and boot id: where the file system offers no
  locks (ENOLCK, ENOSYS: NFS v3 without its lock daemon, Lustre without ``flock``) a file of this
  host is judged by those, so a reused pid is not taken for the owner.
- A lock seen held from here is trusted whatever host holds it; a lock seen free is trusted only
  for this host's files (mounts like NFS ``nolock`` or Lustre ``localflock`` keep locks node-local),
  so another host's file is listed and kept unless ``clean --force``.
"""
import errno
import fcntl
import glob
import json
import os
import re
import socket
import threading
import time
import uuid

from ..errors import FileError
from ..locking import BUSY, lock_exclusive

TEMP_NAME = re.compile(r"\.tmp-(?P<host>.+)-(?P<pid>\d+)-(?P<tag>[0-9a-f]{8})$")   # what temp_name makes
LOCK_SUFFIX = ".lock"
_LOCK = threading.Lock()  # guards this module's registry (signal watcher threads read it)

# --------------------------------------------------------------------------- temporary names

def host_tag():
    """This host's short name, as temporary names carry it."""
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname().split(".")[0]) or "host"


def temp_name(final):
    """A temporary name next to ``final`` that encodes this host and process."""
    return f"{os.path.abspath(final)}.tmp-{host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


# --------------------------------------------------------------------------- the owner's lock

def lock_path(tmp):
    """The sidecar whose lock guards temporary file ``tmp``."""
    return f"{tmp}{LOCK_SUFFIX}"


def _start_time(pid):
    """When process ``pid`` started (clock ticks after boot, /proc/<pid>/stat field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])  # after "(comm) ", the fields from 3 on
    except (OSError, ValueError, IndexError):
        return None


def _boot_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def owner_record(pid=None):
    """Who owns a temporary file: host, pid, the process's start time and the boot it runs in."""
    pid = os.getpid() if pid is None else pid
    return {"host": host_tag(), "pid": pid, "start": _start_time(pid), "boot": _boot_id()}


_HELD = {}  # sidecar path -> the descriptor whose lock guards it (this process's temporary files)


def hold(tmp, timeout=10.0):
    """Create the sidecar of ``tmp`` and lock it for this process, before ``tmp`` itself is created;
    the lock lasts until :func:`release` (after publishing or removing ``tmp``) or the process ends.

    Rank 0 (or the single ``gen`` process) holds it for the whole job: the file is only ever
    published by that process, and a job whose rank 0 is gone is over (MPI ends the others)."""
    path = lock_path(tmp)
    deadline = time.monotonic() + timeout
    try:
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                locked = lock_exclusive(fd, deadline)
                # `clean` may have judged the new file stale and removed it in the moment before our
                # lock: only the file under the name counts, so make it again
                if os.path.samestat(os.fstat(fd), os.stat(path)):
                    break
            except FileNotFoundError:
                pass
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
            if time.monotonic() > deadline:
                raise OSError(errno.EAGAIN, "removed again and again while being created", path)
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(dict(owner_record(), locked=locked)) + "\n").encode())
    except OSError as e:
        raise FileError(f"cannot create the lock file {path!r} of this job's temporary output: "
                        f"{e.strerror or e}") from None
    with _LOCK:
        _HELD[path] = fd


def release(tmp):
    """Remove the sidecar of ``tmp`` and drop its lock (once ``tmp`` is published or removed;
    a no-op in a process that does not hold it)."""
    path = lock_path(tmp)
    with _LOCK:
        fd = _HELD.pop(path, None)
    if fd is None:
        return
    try:
        os.remove(path)  # the name goes first: while it exists the lock guards it
    except OSError:
        pass
    os.close(fd)


def release_all():
    """Release every sidecar this process holds (its temporary files are gone: a stopped job)."""
    with _LOCK:
        paths = list(_HELD)
    for path in paths:
        release(path[:-len(LOCK_SUFFIX)])


def _held_here(path):
    """True when this process holds the lock of sidecar ``path``. POSIX locks never conflict inside
    one process, and closing any descriptor of the file would drop ours: we never probe our own."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    with _LOCK:
        fds = list(_HELD.values())
    for fd in fds:
        try:
            if os.path.samestat(os.fstat(fd), st):
                return True
        except OSError:
            pass
    return False


def _try_lock(path):
    """('held' | 'free' | 'gone' | 'untestable', descriptor): 'free' leaves a shared lock on the
    sidecar in the returned descriptor, so no owner can take it until the caller closes it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return "gone", None
    except OSError:
        return "untestable", None  # not readable by us
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return "free", fd
    except OSError as e:
        os.close(fd)
        return ("held" if e.errno in BUSY else "untestable"), None


def _read_record(path):
    try:
        with open(path) as f:
            record = json.loads(f.read() or "{}")
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def _pid_exists(pid):
    """True when process ``pid`` runs on this host (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:].split()[0] != b"Z"
    except (OSError, ValueError, IndexError):
        return True


def _same_process(record, pid):
    """Does ``pid`` on this host still run the process ``record`` names (same boot, same start time)?
    None when that cannot be told (no start time recorded or readable)."""
    if not _pid_exists(pid):
        return False
    if record.get("boot") and _boot_id() and record["boot"] != _boot_id():
        return False
    if record.get("start") is None or _start_time(pid) is None:
        return None
    return record["start"] == _start_time(pid)


def _pid_story(record, pid):
    same = _same_process(record, pid)
    if same is False:
        return (f"pid {pid} is gone" if not _pid_exists(pid) else
                f"pid {pid} is now another process, started after the job's")
    return f"pid {pid} runs but does not hold it"


# --------------------------------------------------------------------------- finding temporary files

class TempFile:
    """One temporary file of an output (or a lone sidecar), judged: ``state`` is 'live' (its
    writer holds the lock: never removed), 'stale' (its writer is gone: safe to remove), 'remote'
    (written on another host, whose lock this host cannot always see) or 'unknown' (no lock file
    to judge by). ``probe`` is the descriptor holding a shared lock on a stale file's sidecar
    while it is removed (close it with :meth:`close`)."""

    def __init__(self, path, lock, host, pid):
        self.path, self.lock, self.host, self.pid = path, lock, host, pid
        self.state, self.why, self.probe = "unknown", "", None

    @property
    def lone_lock(self):
        return self.path is None

    def files(self):
        return [p for p in (self.path, self.lock) if p is not None]

    def close(self):
        if self.probe is not None:
            os.close(self.probe)
            self.probe = None

    def judge(self):
        here = self.host == host_tag()
        owner = f"pid {self.pid} on {'this host' if here else f'host {self.host}'}"
        if self.pid is None:
            return self._set("unknown", "no owner in its name (written by an older burst-hpc)")
        if self.lock is None:  # an older burst-hpc's file, or its lock file was removed by hand
            if not here:
                return self._set("remote", f"owned by {owner}, no lock file")
            if not _pid_exists(self.pid):
                return self._set("stale", f"no lock file, and {owner} is gone")
            return self._set("unknown", f"no lock file, and {owner} runs: its writer or a reused pid")
        if _held_here(self.lock):
            return self._set("live", f"this process ({owner}) holds its lock")
        seen, fd = _try_lock(self.lock)
        if seen == "gone":
            return self._set("gone", "its job just finished")
        if seen == "held":
            return self._set("live", f"{owner} holds its lock")
        if not here:
            if fd is not None:
                os.close(fd)
            return self._set("remote", f"owned by {owner}; no lock on it is seen from here, but a lock taken on "
                                       "another host is not always visible here")
        record = _read_record(self.lock)
        if seen == "free":
            self.probe = fd
            return self._set("stale", f"no process holds its lock: {_pid_story(record, self.pid)}")
        # no locks on this file system: judged by the pid and its start time
        same = _same_process(record, self.pid)
        if same is False:
            return self._set("stale", f"{_pid_story(record, self.pid)}; no file locks here")
        return self._set("live" if same else "unknown",
                         f"{owner} runs{', with the same start time' if same else ''}; no file locks here")

    def _set(self, state, why):
        self.state, self.why = state, why
        return self


def scan(final):
    """Every temporary file of ``final`` and every lone sidecar, judged (close each after use)."""
    found = set(glob.glob(glob.escape(os.path.abspath(final)) + ".tmp-*"))
    entries = []
    for path in sorted(found):
        lock = path.endswith(LOCK_SUFFIX)
        tmp = path[:-len(LOCK_SUFFIX)] if lock else path
        if lock and tmp in found:
            continue  # judged with its temporary file
        m = TEMP_NAME.search(tmp)
        entry = TempFile(None if lock else tmp, path if lock else (lock_path(tmp) if lock_path(tmp) in found else None),
                         m["host"] if m else None, int(m["pid"]) if m else None)
        entries.append(entry.judge())
    return [e for e in entries if e.state != "gone"]
