"""A stand-in for compile.CupyCompiler (no CuPy, no GPU): the kernel cache's tests count its compiles.

A compile waits ``delay`` seconds (so racing processes overlap), appends one line "<build> <rank> <pid>"
to ``log`` (O_APPEND: whole lines from any number of processes) and stores a module file in ``store``
(as CuPy stores a cubin); a load reads that file, and fails when it is absent, as a module would that was
never built. ``meet``: a threading.Barrier every compile waits at (proves compiles run at once)."""
import contextlib
import hashlib
import os
import time
from pathlib import Path


class FakeCompiler:
    def __init__(self, store, log, delay=0.0, rank=0, meet=None, fail=None):
        self.store, self.log, self.delay, self.rank, self.meet, self.fail = Path(store), Path(log), delay, rank, meet, fail

    def options(self, source):
        return ("-std=c++17", "-arch=sm_90a") if "sm90" in source else ("-std=c++17",)

    def target(self, source):
        return "sm_90a" if "sm90" in source else "sm_90"

    def toolchain(self):
        return "fake 1.0"

    def thread_context(self):
        return contextlib.nullcontext

    def _file(self, code, options):
        return self.store / hashlib.sha256((code + repr(options)).encode()).hexdigest()

    def compile(self, build, code, options):
        if self.meet is not None:
            self.meet.wait()
        time.sleep(self.delay)
        if self.fail is not None and build.name() == self.fail:
            raise RuntimeError(f"nvrtc: error in {build.name()}")
        self.store.mkdir(parents=True, exist_ok=True)
        self._file(code, options).write_text(build.name())
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{build.name()} {self.rank} {os.getpid()}\n".encode())
        finally:
            os.close(fd)
        return {"module": build.name(), "compiled here": True}

    def load(self, build, code, options):
        return {"module": self._file(code, options).read_text(), "compiled here": False}

    def compiles(self):
        """The lines of the log: [(build, rank, pid)]."""
        if not self.log.exists():
            return []
        return [tuple(line.split()) for line in self.log.read_text().splitlines()]
