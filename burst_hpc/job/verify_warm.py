"""``burst-hpc compile``'s warming of ``--verify``: CuPy compiles a kernel per operation of the sampled
check (:mod:`burst_hpc.job.verify`), dtypes and dimensions, into its cache (CUPY_CACHE_DIR); checking
small problems here, ahead of the jobs, leaves a job's verification nothing to compile.
"""
import itertools
import time
from types import SimpleNamespace

import numpy as np

from ..collective import Alone, agree, describe
from ..device import gpu_count, sync
from ..dtypes import dtype_name, parse_dtype
from ..errors import BurstError
from ..plan import masks
from ..reference import attention_backward_reference, attention_reference
from .verify import check, failures
from .verify_sums import Tokens

# warm's problems: CuPy compiles a kernel per operation, dtypes and dimensions left once it merges
# contiguous ones and drops those of size 1, so batch 1 and 2, GQA and MHA, with and without documents
WARM_SHAPES = ((1, 4, 1), (2, 4, 2), (1, 2, 2))          # (batch, query heads, key/value heads)
WARM_MASKS = (masks.make(2048, True), masks.make(2048, False, (100, 30), np.array([0, 600, 1400, 2048])))


def warm(dtypes, xp=None):
    """Check small random problems per dtype (WARM_SHAPES x WARM_MASKS, with gradients) on this
    process's GPU (``xp`` None: CuPy), so that CuPy compiles the kernels a job's --verify runs into its
    own cache (CUPY_CACHE_DIR) now, not in the job (``burst-hpc compile``). Returns the seconds it
    took; raises BurstError if a check fails."""
    if xp is None:
        import cupy as xp
    start = time.perf_counter()
    s, d = 2048, 16           # B Hq S^2 above FULL_LIMIT: the sampled check a job runs
    rng = np.random.default_rng(0)
    for dtype, (b, hq, hk), mask in itertools.product(dtypes, WARM_SHAPES, WARM_MASKS):
        host = {n: rng.standard_normal((b, s, hk if n in ("k", "v") else hq, d)).astype(dtype) for n in ("q", "k", "v", "do")}
        exact = {n: host[n].astype(np.float64) for n in host}
        kw = mask.arguments
        o, lse = attention_reference(exact["q"], exact["k"], exact["v"], **kw)
        dq, dk, dv = attention_backward_reference(exact["do"], exact["q"], exact["k"], exact["v"], **kw)
        outputs = {"o": o.astype(dtype), "lse": lse.astype(np.float32), "dq": dq.astype(dtype), "dk": dk.astype(dtype),
                   "dv": dv.astype(dtype)}
        spec = SimpleNamespace(batch=b, seqlen=s, heads=hq, kv_heads=hk, head_dim=d, dtype=np.dtype(dtype))
        arrays = {n: xp.asarray(x) for n, x in dict(host, **outputs).items()}
        report = check(Tokens.resident(arrays, np.arange(s)), spec, Alone(), mask, d ** -0.5, True, 16, xp=xp)
        if not report["ok"]:
            raise BurstError(f"the verification's own check failed on this GPU ({dtype_name(dtype)}): {failures(report)}")
    sync(xp)
    return time.perf_counter() - start


def warm_verification(dtypes, comm):
    """Collective: run --verify's CuPy kernels once on every rank's GPU (:func:`warm`) so that a job's
    verification compiles nothing; '' where there is no GPU."""
    error, seconds = None, None
    try:
        if gpu_count():
            seconds = warm([parse_dtype(n) for n in dict.fromkeys(dtypes or ("bfloat16", "float16"))])
    except Exception as e:  # noqa: BLE001
        error = e if isinstance(e, BurstError) else BurstError(f"warming the verification's kernels failed: {describe(e)}")
    agree(comm, error)
    every = comm.allgather(seconds) if comm.size > 1 else [seconds]
    if any(s is None for s in every):
        return ""
    return f"verification kernels: compiled into CuPy's cache (CUPY_CACHE_DIR); {max(every):.1f} s"

