"""``burst-hpc check``: the correctness self-test a user runs after installing, from the package alone.

Kernels: every kernel family the GPU runs (the NumPy backend when there is no GPU), forward and
backward through ``burst_hpc.attention``, on odd shapes: lengths off the tiles, GQA and MQA, causal
and not, bfloat16 and float16, a head dim that is zero-padded. Ring (under ``mpiexec`` with P > 1):
``burst_attention`` forward and backward over every transport available here, zigzag/causal on the
q-ring, balanced/causal on the kv variant and contiguous/full on the kv-ring. Every output meets the rule of ``--verify``
(tolerance.tolerance / tolerance.passes) against the float64 oracle. Every rank runs the checks on its
own device; rank 0 prints the table with the worst result over the ranks.
"""
import time

import numpy as np

from ..api import attention, attention_backward
from ..device import HOW_TO_GET_CUPY, to_host
from ..dtypes import bfloat16, dtype_name
from ..reference import attention_backward_reference, attention_reference
from ..tolerance import max_abs, max_err, passes, plain_attention, tolerance

NAMES = ("o", "lse", "dq", "dk", "dv")
DTYPES = (np.dtype(bfloat16), np.dtype(np.float16))
# (B, S, Hq, Hkv, D): lengths off the 64/128-row tiles, GQA 2:1, MQA, MHA with a zero-padded head dim
KERNEL_CASES = ((1, 200, 4, 2, 64), (2, 77, 3, 1, 128), (1, 130, 2, 2, 80))
RING_CHUNK = 37  # tokens per zigzag half: S = 2 * P * RING_CHUNK, never a tile multiple
RING_SHAPE = (1, 4, 2, 64)  # B, Hq, Hkv, D


def judge(ours, q, k, v, do, causal, rows=None):
    """(worst err/tol ratio, the output it belongs to): ``ours`` {name: array} against the float64 oracle
    and the FlashAttention rule; ``rows`` (token indices) selects a shard of the global outputs."""
    dtype = np.dtype(q.dtype)
    scale = q.shape[-1] ** -0.5
    ref = dict(zip(NAMES, attention_reference(q, k, v, causal) + attention_backward_reference(do, q, k, v, causal)))
    plain = dict(zip(NAMES, plain_attention(q, k, v, do, causal, scale, dtype)))
    worst = (0.0, "o")
    for name in NAMES:
        axis = 2 if name == "lse" else 1
        r, p = ref[name], plain[name].astype(np.float32 if name == "lse" else dtype)
        if rows is not None:
            r, p = np.take(r, rows, axis=axis), np.take(p, rows, axis=axis)
        err = max_err(to_host(ours[name]), r)
        tol = tolerance(name, max_err(p, r), max_abs(r), dtype)
        ratio = err / tol if passes(err, tol) else float("inf")
        worst = max(worst, (ratio, name))
    return worst


def _random(rng, shape, dtype):
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def kernel_rows(backends, rng):
    """Rows (check, case, dtype, mask, ratio, output) of every kernel case on each (label, backend)."""
    rows = []
    for label, backend in backends:
        for b, s, hq, hkv, d in KERNEL_CASES:
            for dtype in DTYPES:
                for causal in (True, False):
                    q, do = (_random(rng, (b, s, hq, d), dtype) for _ in range(2))
                    k, v = (_random(rng, (b, s, hkv, d), dtype) for _ in range(2))
                    try:
                        dev = [backend.xp.asarray(x) for x in (q, k, v, do)]
                        o, lse = attention(*dev[:3], causal=causal, backend=backend)
                        dq, dk, dv = attention_backward(dev[3], *dev[:3], o, lse, causal=causal, backend=backend)
                        result = judge(dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv), q, k, v, do, causal)
                    except Exception as e:  # noqa: BLE001 - a failing kernel is a row of the table
                        result = (float("inf"), f"{type(e).__name__}: {e}")
                    rows.append((f"kernels {label}", f"B={b} S={s} Hq={hq} Hkv={hkv} D={d}", dtype_name(dtype),
                                 "causal" if causal else "full", *result))
    return rows


def available_transports(comm, on_device):
    """[(transport, None or why it is skipped)], the same on every rank (collective)."""
    from ..device import gpus_shared
    from ..transport import DEVICE_TRANSPORTS, choose_transport

    if not on_device:
        return [("host", None)]
    import cupy

    shared = gpus_shared(comm, cupy.cuda.Device())
    out = []
    for name in DEVICE_TRANSPORTS:
        try:
            choose_transport(name, True, shared)
            why = None
        except Exception as e:  # noqa: BLE001
            why = str(e)
        everyone = comm.allgather(why)
        out.append((name, next((w for w in everyone if w is not None), None)))
    return out


def ring_rows(comm, xp, transports, seed):
    """Rows of the ring forward + backward over each usable transport (collective)."""
    from ..distributed import burst_attention, burst_attention_backward
    from ..plan.layout import make_layout

    rows = []
    b, hq, hkv, d = RING_SHAPE
    seqlen = 2 * comm.size * RING_CHUNK
    rng = np.random.default_rng(seed)  # the same global inputs on every rank
    for transport, why in transports:
        if why is not None:
            rows.append((f"ring {transport}", "not available here", "-", "-", None, why))
            continue
        for kind, causal, ring in (("zigzag", True, "q"), ("balanced", True, "kv"), ("contiguous", False, "kv")):
            layout = make_layout(kind, seqlen, comm.size)
            for dtype in DTYPES:
                q, do = (_random(rng, (b, seqlen, hq, d), dtype) for _ in range(2))
                k, v = (_random(rng, (b, seqlen, hkv, d), dtype) for _ in range(2))
                mine = [xp.asarray(layout.shard(x, comm.rank)) for x in (q, k, v, do)]
                kw = dict(comm=comm, causal=causal, layout=layout, transport=transport)
                o, lse = burst_attention(*mine[:3], **kw)
                dq, dk, dv = burst_attention_backward(mine[3], *mine[:3], o, lse, backward_ring=ring, **kw)
                rows_here = layout.indices(comm.rank)
                result = judge(dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv), q, k, v, do, causal, rows_here)
                rows.append((f"ring {transport} {kind} {ring}-ring", f"P={comm.size} S={seqlen} Hq={hq} Hkv={hkv} "
                             f"D={d}", dtype_name(dtype), "causal" if causal else "full", *result))
    return rows


def _merge(per_rank):
    """One row per check: the worst ratio over the ranks (rows keyed by their first four fields)."""
    merged = {}
    for rows in per_rank:
        for row in rows:
            key = row[:4]
            old = merged.get(key)
            if old is None or (row[4] is not None and (old[4] is None or row[4] > old[4])):
                merged[key] = row
    return list(merged.values())


def _table(rows):
    lines = [f"{'check':<32} {'case':<30} {'dtype':<9} {'mask':<7} {'result':<7} worst err/tol"]
    for check, case, dtype, mask, ratio, detail in rows:
        if ratio is None:
            result, worst = "skip", detail
        else:
            result, worst = "PASS" if ratio <= 1.0 else "FAIL", f"{ratio:.2f} ({detail})"
        lines.append(f"{check:<32} {case:<30} {dtype:<9} {mask:<7} {result:<7} {worst}")
    return "\n".join(lines)


def main(comm, out=print, seed=None):
    """Run every check (collective); rank 0 prints the table. True when every check passed. ``seed``
    (rank 0's counts) replays the inputs of an earlier run; None draws a fresh one."""
    from ..device import gpu_count

    t0 = time.perf_counter()
    on_device = gpu_count() > 0
    if seed is None:
        seed = int(np.random.SeedSequence().entropy % (1 << 63))
    seed = comm.bcast(seed, root=0)
    if on_device:
        import cupy

        from ..backends.cuda import CudaBackend, kernel_families
        from ..device import select_device

        if comm.size > 1:  # one rank keeps device 0, which needs no MPI (check runs without one)
            select_device(comm)
        backends = [(f"cuda {f}", CudaBackend.instance(family=f)) for f in kernel_families()]
        xp = cupy
        where = (f"GPU {cupy.cuda.Device().id} of each rank; kernel families {', '.join(kernel_families())} "
                 "(a call compiles the kernels it needs, once per cache directory: see 'burst-hpc info')")
    else:
        from ..backends.numpy_backend import NumpyBackend

        backends = [("numpy", NumpyBackend())]
        xp = np
        where = ("no GPU visible: checked the NumPy backend (the CPU path) only; run on a GPU node with CuPy "
                 f"to check the CUDA kernels ({HOW_TO_GET_CUPY})")
    rows = kernel_rows(backends, np.random.default_rng([seed, comm.rank]))
    if comm.size > 1:
        rows += ring_rows(comm, xp, available_transports(comm, on_device), seed)
    per_rank = comm.gather(rows, root=0)
    if comm.rank != 0:
        return comm.bcast(None, root=0)
    rows = _merge(per_rank)
    failed = sum(1 for row in rows if row[4] is not None and not row[4] <= 1.0)
    passed = sum(1 for row in rows if row[4] is not None and row[4] <= 1.0)
    out(f"burst-hpc check: {comm.size} rank(s); {where}\n"
        f"rule: max|ours - float64 oracle| <= 2x (o, lse) / 3x (dq, dk, dv) the error of a plain same-precision "
        f"computation + floor (as run --verify); seed {seed}\n")
    out(_table(rows))
    out(f"\n{passed} passed, {failed} failed in {time.perf_counter() - t0:.1f} s: {'PASS' if not failed else 'FAIL'}")
    return comm.bcast(failed == 0, root=0)


# --------------------------------------------------------------------------- burst-hpc info

def _version(module):
    try:
        mod = __import__(module)
        return getattr(mod, "__version__", "?")
    except Exception:  # noqa: BLE001
        return "not installed"


def installation():
    """``burst-hpc info``: what this installation has and would pick (versions, MPI, GPUs, transports,
    the HDF5 write path), as text on rank 0 (None on the others). Collective under MPI; works without."""
    import sys

    import h5py

    from .. import __version__
    from ..backends.cuda.compile import describe_cache
    from ..collective import HOW_TO_GET_MPI, mpi_problem, rank_and_size, world
    from ..device import gpu_count
    from ..errors import BurstError
    from ..io import write_path

    from ..transport import choose_transport, cuda_aware_mpi, nccl_available

    missing = mpi_problem()  # info works without an MPI library, and says how to get one
    if missing is not None and rank_and_size()[0] != 0:
        return None
    if missing is None:
        from mpi4py import MPI

        comm = world()
        hosts = comm.gather(MPI.Get_processor_name(), root=0)
        if comm.rank != 0:
            return None
    gpus = _gpu_summary()
    lines = [f"burst-hpc {__version__}",
             f"python {sys.version.split()[0]}; numpy {np.__version__}; mpi4py {_version('mpi4py')}; "
             f"ml_dtypes {_version('ml_dtypes')}",
             f"h5py {h5py.__version__} (HDF5 {h5py.version.hdf5_version}; parallel HDF5: "
             f"{'yes' if h5py.get_config().mpi else 'no, rank-ordered writes'})"]
    if missing is None:
        aware, reason = cuda_aware_mpi()
        library = MPI.Get_library_version().replace("\0", "")  # Open MPI's ends in a NUL byte
        lines += [f"MPI: {library.splitlines()[0].strip()} "
                  f"(MPI {'.'.join(map(str, MPI.Get_version()))})",
                  f"ranks: {comm.size} on {len(set(hosts))} host(s): {', '.join(sorted(set(hosts)))}",
                  f"CUDA-aware MPI: {'yes' if aware else 'no'} ({reason})"]
    else:
        lines += [f"MPI: none usable: {missing}. 'burst-hpc run' and the ring need one; {HOW_TO_GET_MPI}",
                  "ranks: 1 (no MPI)", "CUDA-aware MPI: no (no MPI)"]
    lines.append(f"cupy: {_version('cupy')}")
    lines.append(f"GPUs: {gpus}")
    lines.append(f"NCCL: {'available' if nccl_available() else 'not available'}")
    try:
        on_device = "none (no MPI)" if missing is not None else choose_transport("auto", on_device=True)
        shared = None if missing is not None else choose_transport("auto", on_device=True, gpus_shared=True)
        if shared is not None and shared != on_device:
            on_device += f" ({shared} where ranks share a GPU)"
    except BurstError as e:
        on_device = f"none ({e})"
    lines.append(f"transport auto: NumPy arrays -> {choose_transport('auto', on_device=False)}; "
                 f"CuPy arrays -> {on_device}")
    lines.append(f"backend auto: {'cuda' if gpu_count() else 'numpy'}")
    lines.append(f"HDF5 output: {write_path(1 if missing is not None else comm.size)}")
    lines += describe_cache()
    return "\n".join(lines)


def _gpu_summary():
    try:
        import cupy
    except Exception:  # noqa: BLE001
        return f"none visible (cupy not installed; {HOW_TO_GET_CUPY})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
        names = []
        for i in range(n):
            props = cupy.cuda.runtime.getDeviceProperties(i)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            names.append(f"{i}: {name} ({props['totalGlobalMem'] / 2**30:.0f} GiB, sm_{props['major']}{props['minor']})")
        rt = cupy.cuda.runtime.runtimeGetVersion()
        return f"{n} (CUDA runtime {rt // 1000}.{rt % 1000 // 10}) " + "; ".join(names) if n else "none"
    except Exception as e:  # noqa: BLE001
        return f"none ({type(e).__name__}: {e})"
