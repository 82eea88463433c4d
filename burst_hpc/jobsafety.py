"""A job's life on a shared machine: publishing an output without replacing one that appeared
meanwhile, temporary files that name their owner, clean ends on SIGTERM / SIGINT, and I/O
failures (disk full, quota) that end with one line instead of HDF5 tracebacks and a segfault.

Temporary outputs are named ``OUT.tmp-<host>-<pid>-<tag>`` (host and pid of the process that
owns the file: rank 0, or the single ``gen`` process), so a later run can tell a dead job's
leftovers (same host, process gone) from a live job's, and never deletes the latter.
"""
import ctypes
import errno
import glob
import os
import re
import signal
import socket
import sys
import threading
import uuid

from .errors import FileError

_TMP = re.compile(r"\.tmp-(?P<host>.+)-(?P<pid>\d+)-(?P<tag>[0-9a-f]{8})$")

# --------------------------------------------------------------------------- temporary names

def host_tag():
    """This host's short name, as temporary names carry it."""
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname().split(".")[0]) or "host"


def temp_name(final):
    """A temporary name next to ``final`` that encodes this host and process."""
    return f"{os.path.abspath(final)}.tmp-{host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _alive_here(pid):
    """True when ``pid`` is a running burst-hpc process on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running, owner unknown; treat as live
        return True
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return True  # no /proc: the pid runs, assume it is the job
    return b"burst" in cmdline


def temp_files(final):
    """[(path, state, why)] for the temporary files of output ``final``; state is 'stale' (its
    owner is gone: safe to remove), 'live' (its owner runs on this host) or 'unknown' (another
    host's job, or a name without an owner)."""
    host = host_tag()
    found = []
    for path in sorted(glob.glob(glob.escape(os.path.abspath(final)) + ".tmp-*")):
        m = _TMP.search(path)
        if m is None:
            found.append((path, "unknown", "written by an older burst-hpc (no owner in its name)"))
        elif m["host"] != host:
            found.append((path, "unknown", f"owned by pid {m['pid']} on host {m['host']}"))
        elif _alive_here(int(m["pid"])):
            found.append((path, "live", f"pid {m['pid']} on this host is still running"))
        else:
            found.append((path, "stale", f"pid {m['pid']} on this host is gone"))
    return found


def _size(path):
    try:
        return f"{os.path.getsize(path) / 1e6:.1f} MB"
    except OSError:
        return "?"


def stale_note(final):
    """Lines to print before a job writes ``final``: its leftover temporary files, if any."""
    lines = []
    for path, state, why in temp_files(final):
        if state == "live":
            continue
        how = f"burst-hpc clean {final}" if state == "stale" else f"rm {path}  (only if no job is writing {final})"
        lines.append(f"burst-hpc: note: temporary file {path} ({_size(path)}) is left from an earlier job "
                     f"({why}); remove it with: {how}")
    return lines


def clean(final, dry_run=False):
    """Remove the stale temporary files of ``final``; return report lines (live and unknown kept)."""
    lines = []
    entries = temp_files(final)
    if not entries:
        return [f"burst-hpc clean: no temporary files of {final}"]
    for path, state, why in entries:
        if state == "stale":
            if not dry_run:
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass
            lines.append(f"{'would remove' if dry_run else 'removed'} {path} ({why})")
        elif state == "live":
            lines.append(f"kept {path}: a running job owns it ({why})")
        else:
            lines.append(f"kept {path}: cannot tell whether its job runs ({why}); "
                         f"remove it by hand if none does: rm {path}")
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

_LOCK = threading.Lock()
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
    """Remove every tracked temporary file (idempotent; any rank may do it: the path is shared)."""
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
            pass
    return removed


def _rank():
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD.rank, mpi.COMM_WORLD.size
    for var in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var]), 2
    return 0, 1


def _stop(signum):
    """Signal received: remove our temporary files, say so in one line, end this rank now (the
    launcher then ends the others, which do the same if the signal reached them too)."""
    removed = remove_tracked()
    rank, size = _rank()
    name = signal.Signals(signum).name
    where = f"rank {rank} " if size > 1 else ""
    gone = f"; temporary output {removed[0]} removed" if removed else ""
    try:
        sys.stderr.write(f"burst-hpc: error: {where}stopped by {name}{gone}; no output written\n")
        sys.stderr.flush()
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - the stream may be gone with the launcher
        pass
    os._exit(128 + signum)


def abort_job(message):
    """End the whole job now from this rank: remove the temporary files, print ``message`` as one
    error line, then MPI_Abort (a plain exit for one process). For failures after which the ranks
    cannot agree (they wait in different collectives)."""
    remove_tracked()
    try:
        sys.stderr.write(f"burst-hpc: error: {message}\n")
        sys.stderr.flush()
        sys.stdout.flush()
    except Exception:  # noqa: BLE001
        pass
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.size > 1:
        mpi.COMM_WORLD.Abort(1)
    os._exit(1)


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
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    os._exit(code)


def check_space(directory, needed, what):
    """Refuse early when the file system holding ``directory`` has less than ``needed`` bytes free
    (BURST_HPC_SPACE_CHECK=0 skips: free space can be misreported, e.g. under quotas)."""
    if os.environ.get("BURST_HPC_SPACE_CHECK", "1") == "0":
        return
    try:
        st = os.statvfs(directory)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if free < needed:
        raise FileError(f"not enough space for {what}: it needs about {needed / 1e6:.1f} MB, "
                        f"{directory} has {free / 1e6:.1f} MB free")
