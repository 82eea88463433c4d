"""How the GPU benchmarks time a call: CUDA events around queued calls (imports no burst_hpc, so a
script timing another checkout's kernels can use it)."""
import cupy
import numpy as np

BATCH = 5  # calls queued back to back per timing sample, as ring steps queue them: host overhead hidden


def cupy_sample(fn, calls=BATCH):
    """Milliseconds per call of ``calls`` calls of ``fn`` queued between two CUDA events."""
    a, b = cupy.cuda.Event(), cupy.cuda.Event()
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    b.synchronize()
    return cupy.cuda.get_elapsed_time(a, b) / calls


def torch_sample(torch, fn, calls=BATCH):
    """The same with torch's CUDA events (``torch``: the module, imported by the caller)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / calls


_spin = None


def gpu_busy(ms):
    """Queue a kernel that keeps the GPU busy for about ``ms`` milliseconds: calls queued behind it are timed
    without the host's launch work between them (their GPU time alone)."""
    global _spin
    if _spin is None:
        _spin = cupy.RawKernel(r"""extern "C" __global__ void spin(long long cycles) {
            const long long t0 = clock64();
            while (clock64() - t0 < cycles) {}
        }""", "spin")
    _spin((1,), (1,), (np.int64(ms * cupy.cuda.Device().attributes["ClockRate"]),))


def cupy_gpu_sample(fn, calls=BATCH, busy_ms=5.0):
    """Milliseconds per call of GPU time: ``calls`` calls queued behind gpu_busy(busy_ms), between events."""
    gpu_busy(busy_ms)
    return cupy_sample(fn, calls)


def torch_gpu_sample(torch, fn, calls=BATCH, busy_ms=5.0):
    """The same with torch's CUDA events (torch's current stream must be CuPy's, the legacy default one)."""
    gpu_busy(busy_ms)
    return torch_sample(torch, fn, calls)


def cupy_host_and_gpu_sample(fn, calls=BATCH, busy_ms=20.0):
    """(host ms, GPU ms) per call of ``calls`` calls queued behind gpu_busy(busy_ms): the host's time to issue a
    call (perf_counter, no synchronization inside) and the GPU's time to run it with no launch gaps between
    calls (events; exact while the host issues the calls faster than busy_ms)."""
    import time

    gpu_busy(busy_ms)
    a, b = cupy.cuda.Event(), cupy.cuda.Event()
    a.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / calls
    b.record()
    b.synchronize()
    return host, cupy.cuda.get_elapsed_time(a, b) / calls
