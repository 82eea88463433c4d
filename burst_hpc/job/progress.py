"""Progress lines on stderr (rank 0 of a job): its stages, and inside a long pass a line every few
seconds (BURST_HPC_PROGRESS_SECONDS) with the share of the pass's work done and the ETA:

    [burst-hpc    14.2s] forward: 37.5% of rank 0's visible pairs, 6.0s, ETA 10.0s

The work is counted in visible (query, key) pairs, the pass's FLOPs, not in ring steps: a step's
work varies with the mask and the layout. The passes (passes.py) tell a :class:`PassMeter` the work
of each block pair as they queue it; a thread of the meter writes the lines, so a line comes on
time also while a single long block pair runs (the NumPy backend's pairs are cut into row parts
for that) or while the host waits for the GPU at the end of a pass.
"""
import sys
import threading
import time
from collections import deque

import numpy as np

from .. import config


class Progress:
    """Stage lines on stderr when enabled: '[burst-hpc   1.2s] forward'."""

    def __init__(self, enabled, interval=None):
        self.enabled = enabled
        self.interval = config.progress_seconds() if interval is None else interval
        self.t0 = time.perf_counter()

    def __call__(self, message):
        if self.enabled:
            sys.stderr.write(f"[burst-hpc {time.perf_counter() - self.t0:7.1f}s] {message}\n")
            sys.stderr.flush()

    def meter(self, stage, xp):
        """The :class:`PassMeter` of one pass named ``stage`` on ``xp`` (None when disabled)."""
        return PassMeter(self, stage, xp) if self.enabled else None


class PassMeter:
    """The work done of one pass, told every ``progress.interval`` seconds by a thread.

    The passes call :meth:`begin` with the pass's total work, :meth:`done` with the work of each
    block pair (or part of one) they have run, and :meth:`end`. On NumPy a pair's work is done
    when the call returns. On the GPU the call only queues kernels: :meth:`done` records an event
    on the current stream, and the thread counts the work whose event has completed, so the
    share and the ETA are of finished work, and the pass is never synchronized for them."""

    def __init__(self, progress, stage, xp):
        self.progress, self.stage, self.xp = progress, stage, xp
        self.total = self.queued = self.finished = 0
        self.events = deque()   # (event, work queued up to it), oldest first
        self.start = None
        self.stop = threading.Event()
        self.thread = None
        self.device = None if xp is np else xp.cuda.Device()

    def begin(self, total):
        """Start timing a pass of ``total`` visible pairs; the lines start after one interval."""
        self.total, self.start = total, time.perf_counter()
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()

    def done(self, work):
        """``work`` more visible pairs run (queued, on the GPU)."""
        self.queued += work
        if self.device is None:
            self.finished = self.queued
        else:
            self.events.append((self.xp.cuda.get_current_stream().record(), self.queued))

    def end(self):
        """The pass is over (or failed): no more lines."""
        self.stop.set()
        if self.thread is not None:
            self.thread.join()

    def watch(self):
        if self.device is not None:
            self.device.use()  # a new thread starts on device 0
        while not self.stop.wait(self.progress.interval):
            self.progress(self.line())

    def line(self):
        """'forward: 37.5% of rank 0's visible pairs, 6.0s, ETA 10.0s' (ETA ? before any work is done)."""
        while self.events and self.events[0][0].done:
            self.finished = self.events.popleft()[1]
        elapsed = time.perf_counter() - self.start
        share = self.finished / self.total if self.total else 1.0
        eta = f"{elapsed * (1 - share) / share:.1f}s" if share > 0 else "?"
        return f"{self.stage}: {100 * share:.1f}% of rank 0's visible pairs, {elapsed:.1f}s, ETA {eta}"
