"""locking.lock_exclusive, the polling POSIX lock of temporary outputs' owners and of the kernel cache:
held once free, waited for while another process holds it, given up past the deadline."""
import contextlib
import errno
import os
import subprocess
import sys
import time

import pytest

from burst_hpc.locking import lock_exclusive

HOLDER = """import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.lockf(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


@contextlib.contextmanager
def _held_elsewhere(directory, seconds):
    """A descriptor of a lock file that another process holds for ``seconds``; the process ends after."""
    path = directory / "x.lock"
    path.touch()
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    fd = os.open(path, os.O_RDWR)
    try:
        yield fd
    finally:
        os.close(fd)
        proc.kill()
        proc.wait()


def test_a_free_lock_is_taken(tmp_path):
    fd = os.open(tmp_path / "x.lock", os.O_RDWR | os.O_CREAT)
    try:
        assert lock_exclusive(fd, deadline=time.monotonic() + 1) is True
    finally:
        os.close(fd)


def test_past_the_deadline_a_held_lock_raises_busy(tmp_path):
    with _held_elsewhere(tmp_path, 30) as fd:
        began = time.monotonic()
        with pytest.raises(OSError) as raised:
            lock_exclusive(fd, deadline=began + 0.2)
        assert raised.value.errno in (errno.EAGAIN, errno.EACCES)
        assert 0.2 <= time.monotonic() - began < 5


def test_a_lock_released_meanwhile_is_taken_without_a_deadline(tmp_path):
    with _held_elsewhere(tmp_path, 0.5) as fd:
        began = time.monotonic()
        assert lock_exclusive(fd, longest_pause=0.05) is True
        assert time.monotonic() - began >= 0.3   # it waited for the holder to end
