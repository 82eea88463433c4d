"""A job's clean end on a shared machine: SIGTERM / SIGINT remove the job's temporary files and end
it with one line, also when a rank is stuck in MPI or a long C routine; and I/O failures (disk full,
quota) end with one line instead of HDF5 tracebacks and a segfault at exit."""
import contextlib
import os
import signal
import sys
import threading

from ..collective import before_abort, live_world, rank_and_size
from ..errors import say
from .owner import lock_path, release_all

_LOCK = threading.Lock()  # guards this module's registries (signal watcher threads read them)

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
