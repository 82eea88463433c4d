"""The ``burst-hpc`` command (also ``python -m burst_hpc``).

    burst-hpc info
    burst-hpc gen OUT.h5 --batch B --seqlen S --heads H --kv-heads K --head-dim D --dtype T --seed N [--with-grad]
    mpiexec -n P burst-hpc run IN.h5 OUT.h5 [--causal] [--backward] [--layout L] [--transport T]
                                             [--backend numpy|cuda|auto] [--verify]

Exit status: 0 success, 1 bad input or a failed run (one message, on rank 0, every rank exits 1),
2 bad command line, 3 ``--verify`` found a mismatch. See docs/USAGE.md.
"""
import argparse
import math
import os
import sys
import time

import numpy as np

from . import __version__
from .dtypes import SUPPORTED_NAMES, bfloat16, dtype_name, parse_dtype
from .collective import agree
from .device import gpu_count as _gpu_count
from .errors import BackendError, BurstError, FileError

EXIT_ERROR, EXIT_USAGE, EXIT_MISMATCH = 1, 2, 3
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")
_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def _env_rank():
    """This process's rank as the launcher says (0 when not under mpiexec); no MPI call."""
    for var in _RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def _under_mpi():
    return any(var in os.environ for var in _RANK_VARS + _SIZE_VARS)


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _err(message):
    sys.stderr.write(f"burst-hpc: error: {message}\n")
    sys.stderr.flush()


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line once (rank 0), not once per rank."""

    def error(self, message):
        if _env_rank() == 0:
            self.print_usage(sys.stderr)
            _err(message)
        sys.exit(EXIT_USAGE)


class Progress:
    """Stage lines on stderr from rank 0: '[burst-hpc   1.2s] forward ...'."""

    def __init__(self, enabled):
        self.enabled = enabled
        self.t0 = time.perf_counter()

    def __call__(self, message):
        if self.enabled:
            sys.stderr.write(f"[burst-hpc {time.perf_counter() - self.t0:7.1f}s] {message}\n")
            sys.stderr.flush()


# =========================================================================== info

def _version(module):
    try:
        mod = __import__(module)
        return getattr(mod, "__version__", "?")
    except Exception:  # noqa: BLE001
        return "not installed"


def cmd_info(args):
    import h5py

    comm = _world()
    from mpi4py import MPI

    from .transport import choose_transport, cuda_aware_mpi, nccl_available

    hosts = comm.gather(MPI.Get_processor_name(), root=0)
    gpus = _gpu_summary()
    if comm.rank != 0:
        return 0
    lines = [f"burst-hpc {__version__}",
             f"python {sys.version.split()[0]}; numpy {np.__version__}; mpi4py {_version('mpi4py')}; "
             f"ml_dtypes {_version('ml_dtypes')}",
             f"h5py {h5py.__version__} (HDF5 {h5py.version.hdf5_version}; parallel HDF5: "
             f"{'yes' if h5py.get_config().mpi else 'no, rank-ordered writes'})",
             f"MPI: {MPI.Get_library_version().splitlines()[0].strip()} (MPI {'.'.join(map(str, MPI.Get_version()))})",
             f"ranks: {comm.size} on {len(set(hosts))} host(s): {', '.join(sorted(set(hosts)))}"]
    aware, reason = cuda_aware_mpi()
    lines.append(f"CUDA-aware MPI: {'yes' if aware else 'no'} ({reason})")
    lines.append(f"cupy: {_version('cupy')}")
    lines.append(f"GPUs: {gpus}")
    lines.append(f"NCCL: {'available' if nccl_available() else 'not available'}")
    try:
        on_device = choose_transport("auto", on_device=True)
    except BurstError as e:
        on_device = f"none ({e})"
    lines.append(f"transport auto: NumPy arrays -> {choose_transport('auto', on_device=False)}; "
                 f"CuPy arrays -> {on_device}")
    lines.append(f"backend auto: {'cuda' if _gpu_count() else 'numpy'}")
    print("\n".join(lines), flush=True)
    return 0


def _gpu_summary():
    try:
        import cupy
    except Exception:  # noqa: BLE001
        return "none visible (cupy not installed; pip install 'burst-hpc[cuda12]')"
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


# =========================================================================== gen

def cmd_gen(args):
    from . import io

    comm = _world() if _under_mpi() else None
    rank = comm.rank if comm is not None else 0
    progress = Progress(rank == 0 and not args.quiet)
    err = None
    if rank == 0:
        try:
            dtype = parse_dtype(args.dtype)
            total = args.batch * args.seqlen
            shown = [time.perf_counter()]

            def report(done, all_):
                now = time.perf_counter()
                if now - shown[0] > 2.0 and done < all_:
                    shown[0] = now
                    progress(f"gen {100 * done / all_:5.1f}%")

            names = io.generate(args.output, args.batch, args.seqlen, args.heads, args.kv_heads or args.heads,
                                args.head_dim, dtype, seed=args.seed, with_grad=args.with_grad, progress=report)
            print(f"burst-hpc gen: wrote {args.output}: {', '.join(names)} with B={args.batch} S={args.seqlen} "
                  f"Hq={args.heads} Hkv={args.kv_heads or args.heads} D={args.head_dim} {dtype_name(dtype)} "
                  f"seed={args.seed} ({total} tokens)", flush=True)
        except Exception as e:  # noqa: BLE001
            err = e if isinstance(e, BurstError) else FileError(f"cannot write {args.output!r}: {io._message(e)}")
    agree(comm, err)
    return 0


# =========================================================================== run

def _setup_backend(name, comm):
    """(xp, backend name): NumPy, or CuPy with this rank on GPU (local rank mod GPU count)."""
    if name == "auto":
        name = "cuda" if _gpu_count() else "numpy"
    if name == "numpy":
        return np, "numpy"
    try:
        import cupy
    except Exception as e:  # noqa: BLE001
        raise BackendError(f"--backend cuda needs CuPy ({type(e).__name__}: {e}); "
                           "pip install 'burst-hpc[cuda12]' or use --backend numpy") from None
    from .device import select_device

    if _gpu_count() == 0:
        raise BackendError("--backend cuda: no GPU visible to this rank; use --backend numpy")
    select_device(comm)  # node-local rank mod GPU count
    return cupy, "cuda"


def _to_host(x):
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy.asnumpy(x)
    return x


def _sync(xp):
    if xp is not np:
        xp.cuda.Device().synchronize()


def attention_flops(batch, seqlen, heads, head_dim, causal):
    """Forward FLOPs by the FlashAttention convention (two matmuls; half of them when causal)."""
    flops = 4.0 * batch * seqlen * seqlen * heads * head_dim
    return flops / 2 if causal else flops


def cmd_run(args):
    from . import io
    from .distributed import burst_attention, burst_attention_backward
    from .layout import default_layout
    from .device import gpus_shared
    from .transport import choose_transport

    comm = _world()
    rank, size = comm.rank, comm.size
    causal = bool(args.causal)
    layout = args.layout or default_layout(causal)
    err, xp, backend = None, np, None
    try:
        xp, backend = _setup_backend(args.backend, comm)
    except Exception as e:  # noqa: BLE001
        err = e
    agree(comm, err)

    names = ("q", "k", "v", "do") if args.backward else ("q", "k", "v")
    spec, shards = io.read_shards(args.input, comm, layout, names)
    scale = args.scale if args.scale is not None else spec.head_dim ** -0.5
    big = attention_flops(spec.batch, spec.seqlen, spec.heads, spec.head_dim, causal) > 2e11
    progress = Progress(rank == 0 and not args.quiet and (args.progress or big or sys.stderr.isatty()))
    progress(f"read {args.input}: {spec.describe()}, {size} rank(s), layout {layout}, backend {backend}")

    err, transport = None, args.transport
    shared = gpus_shared(comm) if backend == "cuda" else False  # NCCL refuses two ranks on one GPU
    try:
        transport = choose_transport(args.transport, backend == "cuda", shared)
    except Exception as e:  # noqa: BLE001
        err = e
    agree(comm, err)

    attrs = {"kind": "outputs", "causal": causal, "scale": float(scale), "source": os.path.abspath(args.input),
             "batch": spec.batch, "seqlen": spec.seqlen, "heads": spec.heads, "kv_heads": spec.kv_heads,
             "head_dim": spec.head_dim, "dtype": dtype_name(spec.dtype), "backward": bool(args.backward),
             "run_ranks": size, "run_layout": layout, "run_backend": backend, "run_transport": transport}
    out = io.OutputFile.create(args.output, comm, io.output_datasets(spec, args.backward), attrs,
                               inputs=[args.input])
    try:
        summary, code = _run_and_write(args, comm, spec, shards, out, xp, backend, layout, causal, scale, transport,
                                       progress, burst_attention, burst_attention_backward)
        if code == 0:
            out.commit()
    except BaseException:
        out.abort()
        raise
    if code != 0:
        out.abort()
    if rank == 0:
        print(summary, flush=True)
        if code == EXIT_MISMATCH:
            _err(f"verification failed; {args.output} not written")
    return code


def _collective(fn, *args, **kwargs):
    """Run a library call that raises the same BurstError on every rank; mark it as agreed."""
    try:
        return fn(*args, **kwargs)
    except BurstError as e:
        e.agreed = True
        raise


def _run_and_write(args, comm, spec, shards, out, xp, backend, layout, causal, scale, transport, progress,
                   burst_attention, burst_attention_backward):
    from . import io

    size = comm.size
    dev = {name: xp.asarray(a) for name, a in shards.items()}
    kw = dict(comm=comm, causal=causal, scale=scale, layout=layout, transport=args.transport)
    if args.warmup:
        progress("warm-up pass (kernel compilation, transport set-up), not timed")
        o, lse = _collective(burst_attention, dev["q"], dev["k"], dev["v"], **kw)
        if args.backward:
            _collective(burst_attention_backward, dev["do"], dev["q"], dev["k"], dev["v"], o, lse,
                        backward_ring=args.backward_ring, **kw)
        _sync(xp)
    progress("forward")
    comm.Barrier()
    t0 = time.perf_counter()
    o, lse = _collective(burst_attention, dev["q"], dev["k"], dev["v"], **kw)
    _sync(xp)
    comm.Barrier()
    t_fwd = time.perf_counter() - t0
    results = {"o": o, "lse": lse}
    t_bwd = None
    if args.backward:
        progress(f"forward done in {t_fwd:.3f}s; backward")
        comm.Barrier()
        t0 = time.perf_counter()
        dq, dk, dv = _collective(burst_attention_backward, dev["do"], dev["q"], dev["k"], dev["v"], o, lse,
                                 backward_ring=args.backward_ring, **kw)
        _sync(xp)
        comm.Barrier()
        t_bwd = time.perf_counter() - t0
        results.update(dq=dq, dk=dk, dv=dv)
    del dev
    host = {name: _to_host(a) for name, a in results.items()}
    progress(f"writing {args.output}")
    out.write(host, layout)

    flops = attention_flops(spec.batch, spec.seqlen, spec.heads, spec.head_dim, causal)
    parts = [f"burst-hpc run: tokens={spec.batch * spec.seqlen} ({spec.describe()})", f"ranks={size}",
             f"layout={layout}", "causal" if causal else "non-causal", f"backend={backend}", f"transport={transport}",
             f"fwd {t_fwd:.3f}s {flops / max(t_fwd, 1e-12) / 1e12:.3g} TFLOP/s"]
    if t_bwd is not None:
        parts.append(f"bwd {t_bwd:.3f}s {2.5 * flops / max(t_bwd, 1e-12) / 1e12:.3g} TFLOP/s")
    code = 0
    if args.verify:
        progress("verifying against the float64 oracle")
        report = verify(args.input, spec, host, comm, layout, causal, scale, rows=args.verify_rows,
                        seed=args.verify_seed, progress=progress)
        errs = " ".join(f"{name}={report['err'][name]:.2e}/{report['tol'][name]:.1e}" for name in report["err"])
        parts.append(f"verify={'PASS' if report['ok'] else 'FAIL'}({report['mode']}) max_err/tol {errs}")
        code = 0 if report["ok"] else EXIT_MISMATCH
    parts.append(f"-> {args.output}")
    return "  ".join(parts), code


# =========================================================================== verification
#
# Error of our result against the float64 oracle must stay within FACTOR x the error of a plain
# computation in the input precision (scores, probabilities and products rounded to the input dtype,
# float32 accumulation, as a PyTorch-style implementation does) plus a floor:
#     max|ours - ref| <= FACTOR[name] * max|plain - ref| + ATOL[dtype] * max(1, max|ref|)
# FACTOR is 2 for o and lse, 3 for dq, dk, dv (FlashAttention's test convention).

FACTOR = {"o": 2.0, "lse": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}
ATOL = {"float64": 1e-10, "float32": 1e-5, "float16": 1e-4, "bfloat16": 1e-3}
LSE_ATOL = 5e-7  # lse is stored as float32 whatever the inputs
FULL_LIMIT = 1 << 22  # B * Hq * S * S at most this: every row, every output, checked in full
KEY_CHUNK = 1 << 21  # elements of one (B, Hq, rows, keys) score block in the sampled check


def _compute_type(lowp):
    return np.float64 if lowp is None or np.dtype(lowp) == np.float64 else np.float32


def _rounder(lowp, ct):
    if lowp is None:
        return lambda x: x
    return lambda x: x.astype(lowp).astype(ct)


def _expand(x, heads, ct):
    return np.repeat(x.astype(ct), heads // x.shape[2], axis=2)


def _scores(q, k, scale, causal, q_start, k_start, rnd):
    s = rnd(np.einsum("bqhd,bkhd->bhqk", q, k) * scale)
    if causal:
        hidden = (k_start + np.arange(k.shape[1]))[None, :] > (q_start + np.arange(q.shape[1]))[:, None]
        s = np.where(hidden, -np.inf, s)
    return s


def plain_attention(q, k, v, do=None, causal=False, scale=None, lowp=None):
    """(o, lse, dq, dk, dv) by the textbook formulas; in float64 when ``lowp`` is None, else as a plain
    same-precision implementation: products rounded to ``lowp``, float32 arithmetic in between."""
    ct = _compute_type(lowp)
    rnd = _rounder(lowp, ct)
    heads, group = q.shape[2], q.shape[2] // k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qc, kc, vc = q.astype(ct), _expand(k, heads, ct), _expand(v, heads, ct)
    s = _scores(qc, kc, scale, causal, 0, 0, rnd)
    lse = _logsumexp(s)
    p = rnd(np.exp(s - np.where(np.isneginf(lse), 0, lse)[..., None]))
    o = rnd(np.einsum("bhqk,bkhd->bqhd", p, vc))
    if do is None:
        return o, lse, None, None, None
    doc = do.astype(ct)
    dv = np.einsum("bhqk,bqhd->bkhd", p, doc)
    dp = rnd(np.einsum("bqhd,bkhd->bhqk", doc, vc))
    delta = np.einsum("bqhd,bqhd->bhq", doc, o)
    ds = rnd(p * (dp - delta[..., None]))
    dq = rnd(np.einsum("bhqk,bkhd->bqhd", ds, kc) * scale)
    dk = np.einsum("bhqk,bqhd->bkhd", ds, qc) * scale
    b, n, _, d = k.shape
    return o, lse, dq, rnd(dk.reshape(b, n, -1, group, d).sum(3)), rnd(dv.reshape(b, n, -1, group, d).sum(3))


def _logsumexp(s):
    m = s.max(-1)
    safe = np.where(np.isneginf(m), 0, m)
    with np.errstate(divide="ignore"):
        return np.log(np.exp(s - safe[..., None]).sum(-1)) + safe


def window_attention(q, do, key_blocks, causal, scale, q_start, lowp=None):
    """(o, lse, dq) of a window of query rows against keys that arrive in blocks.

    q, do (B, W, Hq, D) (do may be None); ``key_blocks()`` yields (k_start, k, v) blocks covering the
    keys, read again for each of the (up to) three passes, so memory stays at one score block.
    float64 and exact when ``lowp`` is None; else the plain same-precision computation."""
    ct = _compute_type(lowp)
    rnd = _rounder(lowp, ct)
    heads = q.shape[2]
    qc = q.astype(ct)
    lse = np.full((q.shape[0], heads, q.shape[1]), -np.inf, ct)
    for k0, k, _ in key_blocks():
        lse = np.logaddexp(lse, _logsumexp(_scores(qc, _expand(k, heads, ct), scale, causal, q_start, k0, rnd)))
    safe = np.where(np.isneginf(lse), 0, lse)[..., None]

    def probabilities(k0, k):
        kc = _expand(k, heads, ct)
        return kc, rnd(np.exp(_scores(qc, kc, scale, causal, q_start, k0, rnd) - safe))

    o = np.zeros(q.shape, ct)
    for k0, k, v in key_blocks():
        _, p = probabilities(k0, k)
        o += np.einsum("bhqk,bkhd->bqhd", p, _expand(v, heads, ct))
    o = rnd(o)
    if do is None:
        return o, lse, None
    doc = do.astype(ct)
    delta = np.einsum("bqhd,bqhd->bhq", doc, o)[..., None]
    dq = np.zeros(q.shape, ct)
    for k0, k, v in key_blocks():
        kc, p = probabilities(k0, k)
        dp = rnd(np.einsum("bqhd,bkhd->bhqk", doc, _expand(v, heads, ct)))
        dq += np.einsum("bhqk,bkhd->bqhd", rnd(p * (dp - delta)), kc) * scale
    return o, lse, rnd(dq)


def _max_err(ours, ref):
    ours = np.asarray(ours, np.float64)
    ref = np.asarray(ref, np.float64)
    both_inf = np.isneginf(ours) & np.isneginf(ref)
    diff = np.where(both_inf, 0.0, np.abs(ours - ref))
    diff = np.where(np.isnan(diff), np.inf, diff)
    return float(diff.max()) if diff.size else 0.0


def _max_abs(ref):
    ref = np.asarray(ref, np.float64)
    finite = ref[np.isfinite(ref)]
    return float(np.abs(finite).max()) if finite.size else 0.0


def verify(path, spec, ours, comm, layout, causal, scale, rows=256, seed=0, progress=None):
    """Check this rank's outputs ``ours`` (host arrays, local layout order) against the float64 oracle.

    Collective. Full check (every row of every output) when B*Hq*S*S <= FULL_LIMIT; otherwise
    ``rows`` query rows per rank in random windows, checking o, lse (and dq when present) with the
    keys read from ``path`` in blocks. Returns {'ok', 'mode', 'err', 'tol'} (the same on every rank).
    """
    from mpi4py import MPI

    from . import io
    from .layout import layout_indices, pieces
    from .reference import attention_backward_reference, attention_reference

    names = [n for n in ("o", "lse", "dq", "dk", "dv") if n in ours]
    full = spec.batch * spec.heads * spec.seqlen ** 2 <= FULL_LIMIT
    lowp = spec.dtype
    err, err_plain, ref_max = {}, {}, {}
    failure = None
    try:
        if full:
            data = io.read_global(path, ["q", "k", "v"] + (["do"] if "dq" in ours else []))
            q, k, v, do = data["q"], data["k"], data["v"], data.get("do")
            ref = dict(zip(("o", "lse"), attention_reference(q, k, v, causal, scale)))
            if do is not None:
                ref.update(zip(("dq", "dk", "dv"), attention_backward_reference(do, q, k, v, causal, scale)))
            plain = dict(zip(("o", "lse", "dq", "dk", "dv"), plain_attention(q, k, v, do, causal, scale, lowp)))
            idx = layout_indices(spec.seqlen, comm.rank, comm.size, layout)
            for name in names:
                axis = 2 if name == "lse" else 1
                mine = np.take(ref[name], idx, axis=axis)
                err[name] = _max_err(ours[name], mine)
                err_plain[name] = _max_err(np.take(plain[name], idx, axis=axis).astype(
                    np.float32 if name == "lse" else lowp), mine)
                ref_max[name] = _max_abs(mine)
        else:
            names = [n for n in names if n in ("o", "lse", "dq")]
            for n in names:
                err[n] = err_plain[n] = ref_max[n] = 0.0
            rng = np.random.default_rng([seed, comm.rank])
            runs = pieces(spec.seqlen, comm.rank, comm.size, layout)
            per_run = max(1, rows // len(runs))
            width = max(1, min(per_run, KEY_CHUNK // (spec.batch * spec.heads * 128)))
            with io._open_read(path) as f:
                dsq, dsk, dsv = f["q"], f["k"], f["v"]
                dsdo = f["do"] if "dq" in ours else None
                block = max(128, KEY_CHUNK // (spec.batch * spec.heads * width))
                offset = 0
                windows = []
                for start, n in runs:
                    for _ in range(max(1, per_run // width)):
                        w = min(width, n)
                        g0 = start + int(rng.integers(0, n - w + 1))
                        windows.append((g0, w, offset + g0 - start))
                    offset += n
                for i, (g0, w, local0) in enumerate(windows):
                    if progress is not None:
                        progress(f"verify window {i + 1}/{len(windows)} on rank 0: rows {g0}..{g0 + w - 1}")
                    q = io.read_slab(dsq, (slice(None), slice(g0, g0 + w)), spec.dtype)
                    do = io.read_slab(dsdo, (slice(None), slice(g0, g0 + w)), spec.dtype) if dsdo is not None else None
                    k_end = g0 + w if causal else spec.seqlen

                    def key_blocks():
                        for k0 in range(0, k_end, block):
                            k1 = min(k_end, k0 + block)
                            yield (k0, io.read_slab(dsk, (slice(None), slice(k0, k1)), spec.dtype),
                                   io.read_slab(dsv, (slice(None), slice(k0, k1)), spec.dtype))

                    ref = dict(zip(("o", "lse", "dq"), window_attention(q, do, key_blocks, causal, scale, g0)))
                    plain = dict(zip(("o", "lse", "dq"), window_attention(q, do, key_blocks, causal, scale, g0, lowp)))
                    for name in names:
                        axis = 2 if name == "lse" else 1
                        sel = (slice(None),) * axis + (slice(local0, local0 + w),)
                        err[name] = max(err[name], _max_err(ours[name][sel], ref[name]))
                        err_plain[name] = max(err_plain[name], _max_err(plain[name].astype(
                            np.float32 if name == "lse" else lowp), ref[name]))
                        ref_max[name] = max(ref_max[name], _max_abs(ref[name]))
    except Exception as e:  # noqa: BLE001
        failure = e if isinstance(e, BurstError) else BurstError(f"verification could not run: {io._message(e)}")
    agree(comm, failure)
    err = {n: comm.allreduce(err[n], op=MPI.MAX) for n in names}
    err_plain = {n: comm.allreduce(err_plain[n], op=MPI.MAX) for n in names}
    ref_max = {n: comm.allreduce(ref_max[n], op=MPI.MAX) for n in names}
    atol = ATOL[dtype_name(spec.dtype)]
    tol = {n: FACTOR[n] * err_plain[n] + max(atol, LSE_ATOL if n == "lse" else 0.0) * max(1.0, ref_max[n])
           for n in names}
    ok = all(err[n] <= tol[n] for n in names)
    return {"ok": ok, "mode": "full" if full else f"sampled {rows} rows/rank", "err": err, "tol": tol,
            "plain": err_plain}


# =========================================================================== main

def build_parser():
    from .layout import LAYOUTS
    from .transport import TRANSPORTS

    parser = _Parser(prog="burst-hpc", description="Exact attention over sequences split across MPI ranks "
                     "(BurstAttention ring). See docs/USAGE.md.")
    parser.add_argument("--version", action="version", version=f"burst-hpc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{info,gen,run}", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("info", help="versions, GPUs, MPI library, CUDA-awareness, NCCL, transport choice")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("gen", help="write random inputs q, k, v (and do) to an HDF5 file, chunk by chunk")
    p.add_argument("output", help="HDF5 file to create")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqlen", type=int, required=True)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", help=f"one of {', '.join(SUPPORTED_NAMES)} (or bf16, fp16, ...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--with-grad", action="store_true", help="also write do (the output gradient) for --backward")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_gen)

    p = sub.add_parser("run", help="attention over the ranks of mpiexec; outputs written to OUT.h5")
    p.add_argument("input", help="HDF5 file with q, k, v (and do for --backward)")
    p.add_argument("output", help="HDF5 file to write: o, lse (and dq, dk, dv)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--backward", action="store_true", help="also compute dq, dk, dv from the input's do")
    p.add_argument("--layout", choices=LAYOUTS, default=None, help="default: zigzag when --causal, else contiguous")
    p.add_argument("--transport", choices=TRANSPORTS, default="auto")
    p.add_argument("--backward-ring", choices=("auto", "q", "kv"), default="auto")
    p.add_argument("--backend", choices=("auto", "numpy", "cuda"), default="auto",
                   help="cuda: shards moved to the GPU (one per rank); auto: cuda when a GPU is visible")
    p.add_argument("--scale", type=float, default=None, help="softmax scale (default head_dim**-0.5)")
    p.add_argument("--verify", action="store_true", help="check against the float64 oracle; exit 3 on mismatch")
    p.add_argument("--verify-rows", type=int, default=256,
                   help="query rows per rank checked when the input is too large for a full check")
    p.add_argument("--verify-seed", type=int, default=0)
    p.add_argument("--warmup", action="store_true",
                   help="run the passes once untimed first (GPU kernels compile on first use)")
    p.add_argument("--progress", action="store_true", help="show stage progress even on short runs")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_run)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BurstError as e:
        if getattr(e, "agreed", False):
            # every rank raised the same error: one message from rank 0, exit 1 everywhere
            if _rank_now() == 0:
                _err(str(e))
            _barrier()  # the message is out before any rank exits (and mpiexec tears the job down)
            return EXIT_ERROR
        _err(f"[rank {_rank_now()}] {e}")
        _abort_job()
        return EXIT_ERROR
    except KeyboardInterrupt:
        _abort_job()
        return 130
    except Exception:  # a bug on one rank: say so and take the whole job down instead of hanging
        import traceback

        sys.stderr.write(f"burst-hpc: internal error on rank {_rank_now()}:\n{traceback.format_exc()}")
        sys.stderr.flush()
        _abort_job()
        return EXIT_ERROR


def _rank_now():
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD.rank
    return _env_rank()


def _barrier():
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.size > 1:
        mpi.COMM_WORLD.Barrier()


def _abort_job():
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.size > 1:
        mpi.COMM_WORLD.Abort(EXIT_ERROR)


if __name__ == "__main__":
    sys.exit(main())
