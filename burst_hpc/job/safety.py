"""A job's life on a shared machine: publishing an output without replacing one that appeared
meanwhile, temporary files guarded by a lock their writer holds, clean ends on SIGTERM / SIGINT,
and I/O failures (disk full, quota) that end with one line instead of HDF5 tracebacks and a segfault.

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

import contextlib
import ctypes
import errno
import fcntl
import glob
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid

from ..collective import before_abort, live_world, rank_and_size
from ..errors import FileError, say, size_text

_TMP = re.compile(r"\.tmp-(?P<host>.+)-(?P<pid>\d+)-(?P<tag>[0-9a-f]{8})$")
LOCK_SUFFIX = ".lock"
_BUSY = (errno.EAGAIN, errno.EACCES)  # a conflicting lock is held
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL)  # no locks here
_LOCK = threading.Lock()  # guards this module's registries (signal watcher threads read them)

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
                locked = _lock(fd, deadline)
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


def _lock(fd, deadline):
    """Take the exclusive lock on ``fd``: True, or False where the file system has no locks."""
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno in _NO_LOCKS:
                return False
            if e.errno not in _BUSY or time.monotonic() > deadline:
                raise
        time.sleep(0.01)  # a `clean` probing it holds it for a moment


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
        return ("held" if e.errno in _BUSY else "untestable"), None


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


def _scan(final):
    """Every temporary file of ``final`` and every lone sidecar, judged (close each after use)."""
    found = set(glob.glob(glob.escape(os.path.abspath(final)) + ".tmp-*"))
    entries = []
    for path in sorted(found):
        lock = path.endswith(LOCK_SUFFIX)
        tmp = path[:-len(LOCK_SUFFIX)] if lock else path
        if lock and tmp in found:
            continue  # judged with its temporary file
        m = _TMP.search(tmp)
        entry = TempFile(None if lock else tmp, path if lock else (lock_path(tmp) if lock_path(tmp) in found else None),
                         m["host"] if m else None, int(m["pid"]) if m else None)
        entries.append(entry.judge())
    return [e for e in entries if e.state != "gone"]


def temp_files(final):
    """[(path, state, why)] for the temporary files of output ``final`` (lone sidecars included)."""
    entries = _scan(final)
    for e in entries:
        e.close()
    return [(e.path or e.lock, e.state, e.why) for e in entries]


def _size(path):
    try:
        return size_text(os.path.getsize(path))
    except OSError:
        return "?"


def stale_note(final):
    """Lines to print before a job writes ``final``: its leftover temporary files, if any."""
    lines = []
    for path, state, why in temp_files(final):
        if state == "live" or path.endswith(LOCK_SUFFIX):
            continue
        how = (f"burst-hpc clean {final}" if state == "stale" else
               f"burst-hpc clean --force {final}  (only once no job writes {final})")
        lines.append(f"burst-hpc: note: temporary file {path} ({_size(path)}) is left from an earlier job "
                     f"({why}); remove it with: {how}")
    return lines


def clean(final, dry_run=False, force=False):
    """Remove the stale temporary files of ``final`` (and with ``force`` those of other hosts or
    without a lock file); return report lines. A file whose lock is held is never removed."""
    entries = _scan(final)
    if not entries:
        return [f"burst-hpc clean: no temporary files of {final}"]
    lines = []
    try:
        for e in entries:
            name = e.path or e.lock
            what = name if e.lone_lock or e.lock is None else f"{name} and its lock file"
            if e.state == "stale" or (force and e.state in ("remote", "unknown")):
                if not dry_run:
                    for path in e.files():  # the temporary file first: its lock guards it until the end
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(path)
                forced = "" if e.state == "stale" else "; --force"
                lines.append(f"{'would remove' if dry_run else 'removed'} {what} ({e.why}{forced})")
            elif e.state == "live":
                lines.append(f"kept {name}: a running job owns it ({e.why})")
            elif e.state == "remote":
                lines.append(f"kept {name}: cannot tell from this host whether its job runs ({e.why}); once no "
                             f"job on host {e.host} writes {final}, remove it with: burst-hpc clean --force {final}")
            else:
                lines.append(f"kept {name}: cannot tell whether its job runs ({e.why}); once no job writes "
                             f"{final}, remove it with: burst-hpc clean --force {final}")
    finally:
        for e in entries:
            e.close()
    return lines


# --------------------------------------------------------------------------- publishing

RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def _renameat2_noreplace(src, dst):
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), RENAME_NOREPLACE) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), dst)


def link_noreplace(src, dst):
    """Give ``src`` the name ``dst`` (and drop ``src``) unless ``dst`` exists: FileExistsError
    then, and ``src`` stays. A hard link where the file system has them, else renameat2 with
    RENAME_NOREPLACE; both are atomic, so of two racing callers exactly one wins."""
    try:
        os.link(src, dst)
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS, errno.EACCES):
            raise
        try:
            _renameat2_noreplace(src, dst)
        except FileExistsError:
            raise
        except OSError as e2:
            if e2.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise FileError(f"this file system offers neither hard links nor RENAME_NOREPLACE, so "
                                f"{dst!r} cannot be created without risk of replacing another job's file; "
                                "pass --overwrite to publish by a plain rename") from None
            raise
        return
    os.unlink(src)


def kept_name(final, tmp):
    """Where a job that lost the race for ``final`` keeps its result: OUT.kept-<tag>.h5."""
    root, ext = os.path.splitext(os.path.abspath(final))
    m = _TMP.search(tmp)
    tag = f"{m['pid']}-{m['tag']}" if m else uuid.uuid4().hex[:8]
    return f"{root}.kept-{tag}{ext}"


def publish(tmp, final, overwrite=False):
    """Move the finished temporary file ``tmp`` to ``final``. With ``overwrite`` an existing file is
    replaced (atomically); without it a file that appeared at ``final`` meanwhile is never
    replaced: this job's result is moved to :func:`kept_name` and a FileError says where."""
    if overwrite:
        os.replace(tmp, final)
        return
    try:
        link_noreplace(tmp, final)
        return
    except FileExistsError:
        pass
    kept = kept_name(final, tmp)
    try:
        link_noreplace(tmp, kept)
    except OSError:
        kept = tmp
    error = FileError(f"output {final!r} appeared while this job ran (another job wrote it) and was not "
                      f"replaced; this job's complete result is kept as {kept!r} (rename it, or rerun with --overwrite)")
    error.kept = kept
    raise error


# --------------------------------------------------------------------------- signals

_TRACKED = set()  # temporary files this process must remove if the job is stopped
_HANDLED = (signal.SIGTERM, signal.SIGINT)
_watching = False


def track(path):
    with _LOCK:
        _TRACKED.add(path)


def untrack(path):
    with _LOCK:
        _TRACKED.discard(path)


def remove_tracked():
    """Remove every tracked temporary file, then its lock file (idempotent; any rank may do it: the
    paths are shared, and the rank that gets the signal may be the only one left to do it)."""
    with _LOCK:
        paths = sorted(_TRACKED)
        _TRACKED.clear()
    removed = []
    for path in paths:
        try:
            os.remove(path)
            removed.append(path)
        except FileNotFoundError:
            removed.append(path)  # another rank got there first
        except OSError:
            continue
        with contextlib.suppress(OSError):
            os.remove(lock_path(path))  # the file is gone: its lock guards nothing
    release_all()
    return removed


before_abort(remove_tracked)  # a job ended from one rank (collective.abort_job) leaves no temporary file


_STOP_NOTE = []  # what a stopped rank says once its output is written (replaces "no output written")


def on_stop_say(note):
    """From now on a rank stopped by a signal says ``note`` instead of 'no output written' (the
    output is published: a signal during verification must not claim the result is lost)."""
    with _LOCK:
        _STOP_NOTE[:] = [note]


_REPORTED = []


def error_reported():
    """This rank's job has failed and its error line is out: a SIGTERM or SIGINT from now on is the
    launcher ending the ranks still exiting once the first has gone, and ends this rank without
    another error line."""
    _REPORTED.append(True)


def _stop(signum):
    """Signal received: remove our temporary files, say so in one line, end this rank now (the
    launcher then ends the others, which do the same if the signal reached them too)."""
    removed = remove_tracked()
    if _REPORTED:
        os._exit(128 + signum)
    rank, size = rank_and_size()
    name = signal.Signals(signum).name
    where = f"rank {rank} " if size > 1 else ""
    gone = f"; temporary output {removed[0]} removed" if removed else ""
    outcome = _STOP_NOTE[0] if _STOP_NOTE else "no output written"
    say(f"{where}stopped by {name}{gone}; {outcome}")
    os._exit(128 + signum)


def _watch():
    while True:
        signum = signal.sigwait(_HANDLED)
        _stop(signum)


def _watch_wakeup(fd):
    while True:
        for signum in os.read(fd, 64):
            if signum in {int(s) for s in _HANDLED}:
                _stop(signum)


def watch_signals():
    """Handle SIGTERM and SIGINT in a thread of their own. They are blocked in this thread and in
    every thread started after this call (MPI's), so a rank stuck in an MPI call or a long C routine
    still reacts: the watcher removes the job's temporary file and ends the process at once.
    Threads started before it (a BLAS thread pool, at numpy's import) do not block them, and the
    kernel may deliver the signal there: Python's handler then writes it to a wakeup pipe, which a
    second watcher reads, so the signal is never left to its default action (death, file left)."""
    global _watching
    if _watching or threading.current_thread() is not threading.main_thread():
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED)
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    for signum in _HANDLED:
        signal.signal(signum, lambda *_: None)  # the watchers act; the main thread has nothing to do
    threading.Thread(target=_watch, name="burst-hpc-signals", daemon=True).start()
    threading.Thread(target=_watch_wakeup, args=(read_end,), name="burst-hpc-signal-pipe", daemon=True).start()
    _watching = True


# --------------------------------------------------------------------------- HDF5 failures

_HDF5_BROKEN = []


def note_hdf5_failure():
    """An HDF5 write or close failed: the library may hold dirty state it cannot flush, and its exit
    handler would then crash (H5D_close at exit); :func:`exit_now` ends the process without it."""
    _HDF5_BROKEN.append(True)


def hdf5_broken():
    return bool(_HDF5_BROKEN)


def _from_h5py_dealloc(tb):
    while tb is not None:
        if "h5py" in tb.tb_frame.f_code.co_filename and "dealloc" in tb.tb_frame.f_code.co_name:
            return True
        tb = tb.tb_next
    return False


def quiet_hdf5_dealloc():
    """h5py reports a failed close of a dataset during garbage collection as 'Exception ignored'
    with a traceback (through sys.excepthook, then sys.unraisablehook); the failure is already
    reported as one line, so keep only the flag."""
    unraisable_hook, except_hook = sys.unraisablehook, sys.excepthook

    def on_unraisable(unraisable):
        if "h5py" in repr(getattr(unraisable, "object", "")) or "h5py" in str(getattr(unraisable, "err_msg", "")):
            note_hdf5_failure()
            return
        unraisable_hook(unraisable)

    def on_exception(kind, value, tb):
        if _from_h5py_dealloc(tb):
            note_hdf5_failure()
            return
        except_hook(kind, value, tb)

    sys.unraisablehook, sys.excepthook = on_unraisable, on_exception


def exit_now(code):
    """End the process with ``code``, skipping HDF5's exit handler (MPI finalized first)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if live_world() is not None:
        from mpi4py import MPI

        MPI.Finalize()
    os._exit(code)
