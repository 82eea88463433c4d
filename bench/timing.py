"""How the GPU benchmarks time a call: CUDA events around queued calls (imports no burst_hpc, so a
script timing another checkout's kernels can use it)."""
import cupy

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
