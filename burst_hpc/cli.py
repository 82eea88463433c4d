"""The ``burst-hpc`` command (also ``python -m burst_hpc``).

    burst-hpc info
    burst-hpc gen OUT.h5 --batch B --seqlen S --heads H --kv-heads K --head-dim D --dtype T --seed N [--with-grad]
    mpiexec -n P burst-hpc run IN.h5 OUT.h5 [--causal] [--backward] [--layout L] [--transport T]
                                             [--backend numpy|cuda|auto] [--verify]

Exit status: 0 success, 1 bad input or a failed run (one message, on rank 0, every rank exits 1),
2 bad command line, 3 ``--verify`` found a mismatch. See docs/USAGE.md.
"""
import argparse
import os
import sys
import time

import numpy as np

from . import __version__
from .dtypes import SUPPORTED_NAMES, dtype_name, parse_dtype
from . import verify
from .collective import agree, describe
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
            err = e if isinstance(e, BurstError) else FileError(f"cannot write {args.output!r}: {describe(e)}")
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
    shared = gpus_shared(comm, xp.cuda.Device() if backend == "cuda" else None)  # NCCL refuses that
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
        report = verify.verify(args.input, spec, host, comm, layout, causal, scale, rows=args.verify_rows,
                        seed=args.verify_seed, progress=progress)
        errs = " ".join(f"{name}={report['err'][name]:.2e}/{report['tol'][name]:.1e}" for name in report["err"])
        parts.append(f"verify={'PASS' if report['ok'] else 'FAIL'}({report['mode']}) max_err/tol {errs}")
        code = 0 if report["ok"] else EXIT_MISMATCH
    parts.append(f"-> {args.output}")
    return "  ".join(parts), code


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
    p.add_argument("--layout", choices=LAYOUTS, default=None, help="default: zigzag when --causal, else contiguous; balanced keeps "
                   "natural token order (one contiguous run per rank) and balances causal work by its schedule")
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
