"""Taking a POSIX record lock (``fcntl``) by polling, for the two places that guard files shared by
processes and hosts: a temporary output's owner (job/owner.py) and the kernel cache's entries
(backends/cuda/compile.py). POSIX locks, not ``flock``: they are the locks NFS, Lustre (``-o flock``)
and GPFS make coherent across hosts, and they belong to the process, so they die with it.
"""
import errno
import fcntl
import time

BUSY = (errno.EAGAIN, errno.EACCES)  # another process holds a conflicting lock
NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL)  # the file system has none
FIRST_PAUSE = 0.01   # seconds between the first tries; each later pause is 1.5x the one before


def lock_exclusive(fd, deadline=None, longest_pause=FIRST_PAUSE):
    """Take the exclusive lock on open file ``fd``: True once held, False where the file system has no
    locks. Polled, not a blocking wait: that fails with EDEADLK when threads of two processes hold and
    wait for two locks (POSIX locks belong to processes). The pauses grow up to ``longest_pause``
    seconds (a long wait on a shared file system's lock server should not poll it hard). Past
    ``deadline`` (``time.monotonic()``; None: wait as long as it takes), or on any other failure, the
    OSError of the last try is raised."""
    pause = FIRST_PAUSE
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno in NO_LOCKS:
                return False
            if e.errno not in BUSY or (deadline is not None and time.monotonic() > deadline):
                raise
        time.sleep(pause)
        pause = min(longest_pause, pause * 1.5)
