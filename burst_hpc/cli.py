"""The ``burst-hpc`` command (also ``python -m burst_hpc``).

    burst-hpc info
    burst-hpc gen OUT.h5 --batch B --seqlen S --heads H --kv-heads K --head-dim D --dtype T --seed N [--with-grad]
                         [--documents N]
    mpiexec -n P burst-hpc run IN.h5 OUT.h5 [--causal] [--window L[,R]] [--backward] [--layout L] [--transport T]
                                             [--backend numpy|cuda|auto] [--verify] [--overwrite] [--json FILE]
    [mpiexec -n P] burst-hpc verify IN.h5 OUT.h5 [--causal|--no-causal] [--window L[,R]] [--scale X] [--backward]
                                                  [--rows N]
    [mpiexec -n P] burst-hpc check
    [mpiexec -n P] burst-hpc compile [--family F] [--head-dim D] [--dtype T] [--pass fwd|bwd]
    burst-hpc clean OUT.h5 [--dry-run] [--force]

Exit status: 0 success, 1 bad input or a failed run (one message, on rank 0, every rank exits 1),
2 bad command line, 3 ``--verify`` found a mismatch (OUT.h5 written, marked verify = "fail") / ``verify``
or ``check`` found a failure, 128+N stopped by signal N. ``--help`` of each command documents every option and the
file format.
"""
import argparse
import os
import sys
import textwrap
import time

import numpy as np

from . import __version__
from .dtypes import SPELLINGS, dtype_name, parse_dtype
from .job import safety
from .collective import (HOW_TO_GET_MPI, Alone, abort_world, agree, describe, launched, live_world, mpi_problem,
                         rank_and_size, world as _world)
from .errors import BackendError, BurstError, DTypeError, FileError, UsageError, say
from .plan.masks import LARGEST_WINDOW

EXIT_ERROR, EXIT_USAGE, EXIT_MISMATCH = 1, 2, 3


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line once (rank 0), not once per rank, and surely:
    every rank parses the same command line, so every rank meets rank 0 before it exits. It knows
    how the command line spells each of its arguments (``spellings``: dest -> '--name' or 'IN.h5')."""

    def __init__(self, *args, **kwargs):
        self.spellings = {}   # before argparse's own __init__ adds --help
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        self.spellings[action.dest] = action.option_strings[-1] if action.option_strings else action.metavar
        return action

    def error(self, message):
        def write():
            self.print_usage(sys.stderr)
            say(message)

        try:   # ranks whose command line parsed wait in the command's agreement: meet them there
            _agree_command(error=UsageError(message))
        except BurstError:
            pass
        _say_once(write)
        sys.exit(EXIT_USAGE)

    def exit(self, status=0, message=None):
        if status == 0:   # --help or --version (a bad command line goes through error)
            try:   # ranks whose command line runs a command wait in its agreement: meet them there
                _agree_command({"the command": "--help or --version"})
            except BurstError as e:
                _say_once(lambda: say(str(e)))
                sys.exit(EXIT_ERROR)
        super().exit(status, message)

    def print_help(self, file=None):
        if rank_and_size()[0] == 0:   # under a launcher: once, from rank 0 (the launcher's rank, no MPI call)
            super().print_help(file)


# how long a rank waits at the end of a job that failed for rank 0 to say why (see _say_once)
SAY_WAIT_S = 30.0


def _say_once(write):
    """Deliver an error every rank of the job has alike (a bad command line, an agreed BurstError):
    rank 0 calls ``write`` (lines on stderr, flushed), then every rank meets at a barrier, so no
    rank exits, and makes the launcher end the job, before rank 0's lines are out. MPI is
    initialised here if it was not yet (a bad command line is found before any verb runs); where no
    MPI library loads, every rank writes (the same lines P times, never none). A rank that waits
    SAY_WAIT_S without rank 0 at the barrier (ranks started with different command lines) writes
    the lines itself. Afterwards a SIGTERM (the launcher ending ranks still exiting once the first
    has gone) ends this rank without a second error line."""
    comm = _job_world()
    if comm is None or comm.rank == 0:
        write()
    if comm is not None and comm.size > 1 and not _meet(comm, SAY_WAIT_S) and comm.rank != 0:
        write()
    safety.error_reported()


def _job_world():
    """MPI.COMM_WORLD when MPI is up, or when launched by mpiexec and an MPI library loads (it is
    initialised then); None otherwise (one process, or no usable MPI)."""
    if live_world() is None and launched() and mpi_problem() is None:
        from mpi4py import MPI  # noqa: F401  (initialises MPI)
    return live_world()


def _meet(comm, seconds):
    """A barrier that gives up after ``seconds``: True when every rank came."""
    request = comm.Ibarrier()
    deadline = time.monotonic() + seconds
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


# =========================================================================== info

def cmd_info(args):
    from .job.selfcheck import installation

    text = installation()
    if text is not None:  # rank 0's
        print(text, flush=True)
    return 0


# =========================================================================== gen

def cmd_gen(args):
    from . import io
    from .job.progress import Progress

    comm = _world() if launched() else None
    rank = comm.rank if comm is not None else 0
    progress = Progress(rank == 0 and not args.quiet)
    err = None
    if rank == 0:
        try:
            for line in safety.stale_note(args.output):
                sys.stderr.write(line + "\n")
            dtype = parse_dtype(args.dtype)
            total = args.batch * args.seqlen
            shown = [time.perf_counter()]

            def report(done, all_):
                now = time.perf_counter()
                if now - shown[0] > 2.0 and done < all_:
                    shown[0] = now
                    progress(f"gen {100 * done / all_:5.1f}%")

            kv_heads = args.kv_heads if args.kv_heads is not None else args.heads
            names = io.generate(args.output, args.batch, args.seqlen, args.heads, kv_heads,
                                args.head_dim, dtype, seed=args.seed, with_grad=args.with_grad, progress=report,
                                documents=args.documents, overwrite=args.overwrite)
            print(f"burst-hpc gen: wrote {args.output}: {', '.join(names)} with B={args.batch} S={args.seqlen} "
                  f"Hq={args.heads} Hkv={kv_heads} D={args.head_dim} {dtype_name(dtype)} "
                  f"seed={args.seed} ({total} tokens)", flush=True)
        except Exception as e:  # noqa: BLE001
            err = e if isinstance(e, BurstError) else FileError(f"cannot write {args.output!r}: {describe(e)}")
    agree(comm, err)
    return 0


# =========================================================================== run

# The command line's numbers: one type function per kind, each a clear "argument --x: expected ..."
# line and exit status 2 for anything else (zero, negative, NaN, infinite, too large).
LARGEST_INT = 2 ** 63 - 1    # sizes, counts and seeds become int64 (NumPy, HDF5)


def _whole(text, least, what, largest=LARGEST_INT):
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < least:
        raise argparse.ArgumentTypeError(f"expected {what}; got {text!r}")
    if value > largest:
        raise argparse.ArgumentTypeError(f"expected {what}; got {text!r}, more than the largest accepted, {largest}")
    return value


def _finite(text, what, positive):
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not np.isfinite(value) or value < 0 or (positive and value == 0):
        raise argparse.ArgumentTypeError(f"expected {what}; got {text!r}")
    return value


def positive_int(text):
    """A size or a count: a whole number > 0."""
    return _whole(text, 1, "a whole number > 0")


def nonnegative_int(text):
    """A seed: a whole number >= 0."""
    return _whole(text, 0, "a whole number >= 0")


def positive_float(text):
    """A rate or a scale: a finite number > 0."""
    return _finite(text, "a finite number > 0", positive=True)


def nonnegative_float(text):
    """A latency: a finite number >= 0."""
    return _finite(text, "a finite number >= 0", positive=False)


def window_size(text):
    """One side of a sliding window: a whole number of tokens >= 0, or -1 for unbounded."""
    return _whole(text, -1, "a window size: a whole number >= 0, or -1 for unbounded", LARGEST_WINDOW)


def dtype_argument(text):
    """An element type, by any spelling dtypes.parse_dtype takes; its canonical name ('bfloat16', ...)."""
    try:
        return dtype_name(parse_dtype(text))
    except DTypeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def kernel_dtype_argument(text):
    """An input element type the CUDA kernels run (launch.dtype_kind says which); its canonical name."""
    from .backends.cuda.launch import dtype_kind

    name = dtype_argument(text)
    try:
        dtype_kind(parse_dtype(name))
    except BackendError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def parse_window(text):
    """'L' -> (L, 0) (the L tokens before each query and itself); 'L,R' -> (L, R); -1 unbounded."""
    parts = text.split(",")
    if len(parts) not in (1, 2):
        raise argparse.ArgumentTypeError(f"expected L or L,R (window sizes, -1 unbounded); got {text!r}")
    sizes = [window_size(part) for part in parts]
    return (sizes[0], sizes[1] if len(sizes) == 2 else 0)


def cmd_run(args):
    from .job.run import RunOptions, run

    fields = RunOptions.__dataclass_fields__
    options = RunOptions(**{name: getattr(args, name) for name in fields if name != "progress"},
                         progress=False if args.quiet else (True if args.progress else None))
    outcome = run(options, _world())
    if _world().rank == 0:
        print(outcome.summary, flush=True)
        if outcome.verified is False:
            say(f"verification failed; {args.output} is written and marked verify = 'fail' "
                 f"(see it with: h5dump -a verify {args.output})")
    return EXIT_MISMATCH if outcome.verified is False else 0


def cmd_verify(args):
    from .job import verify
    from .job.run import Progress, setup_backend

    comm = _world()
    xp, _ = _collective(setup_backend, args.backend, comm)
    lines = Progress(comm.rank == 0 and not args.quiet)
    report = verify.verify_output(args.input, args.output, comm, args.causal, args.window, args.backward,
                                  rows=args.rows, seed=args.seed, xp=xp, announce=lines, progress=lines,
                                  scale=args.scale)
    if comm.rank == 0:
        errs = " ".join(f"{name}={report['err'][name]:.2e}/{report['tol'][name]:.1e}" for name in report["err"])
        print(f"burst-hpc verify: {'PASS' if report['ok'] else 'FAIL'} {args.output} ({report['mode']}, {comm.size} "
              f"rank(s), {report['seconds']:.2f}s) max_err/tol {errs}", flush=True)
        if not report["ok"]:
            say(f"verification failed: {verify.failures(report)}")
    return 0 if report["ok"] else EXIT_MISMATCH


# =========================================================================== main

FILE_FORMAT = """\
HDF5 files (gen writes them; any tool can):
  inputs   q (B, S, Hq, D), k and v (B, S, Hkv, D), do (B, S, Hq, D) for --backward; one dtype for all
           cu_seqlens (N+1,) integers, optional: document offsets [0, ..., S] of packed documents (no
           attention across them), the same for every batch entry ('gen --documents N' writes one)
  outputs  o (B, S, Hq, D) and, with --backward, dq (B, S, Hq, D), dk and dv (B, S, Hkv, D), all in the
           input dtype; lse (B, Hq, S) float32, the natural-log sum-exp of each row's scaled scores
  B batch, S tokens in global order (whatever --layout a run uses), Hq query heads, Hkv key/value
  heads (Hq a multiple of Hkv: GQA/MQA), D head dim. Query head h reads key/value head h // (Hq/Hkv).
  dtypes: float16, float32, float64 stored natively; bfloat16 stored as uint16 bits with the dataset
  attribute dtype = "bfloat16" (from NumPy: x.astype(ml_dtypes.bfloat16).view(numpy.uint16)).
  Head dims: any. On the cuda backend 64 and 128 run natively, and on Hopper (sm90) 256 as well;
  any other D is zero-padded to the next of those (exact), wider heads (above 256 on Hopper, above
  128 on other GPUs) run on tiled float32 cuBLAS products (exact, slower than the fused kernels).
"""

EXIT_CODES = """\
exit status: 0 done; 1 bad input or a failed run (one "burst-hpc: error:" line from rank 0, every
rank exits 1, no output file appears); 2 bad command line; 3 --verify found a mismatch (OUT.h5 is
written, its attribute verify = "fail"); 128+N stopped by signal N (143 SIGTERM, a time limit; 130
SIGINT): no output, or with --verify once the passes are done, OUT.h5 written and complete with
verify = "not finished". See the outcome with: h5dump -a verify OUT.h5.
"""


def _wrap(text):
    return textwrap.fill(text, 100)


def _verb(sub, name, func, **kwargs):
    """The sub-parser of one verb, run by ``func`` (descriptions pre-wrapped, epilogs kept as written)."""
    parser = sub.add_parser(name, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
    parser.set_defaults(func=func, spellings=parser.spellings)
    return parser


# options that change only what rank 0 prints, so ranks may differ in them; and those naming files
DISPLAY_OPTIONS = ("quiet", "progress")
PATH_OPTIONS = ("input", "output", "json", "cu_seqlens")


def command_signature(args):
    """What every rank of a job must run alike: the command and each of its options (paths made
    absolute: ranks in different directories may name one file differently), by their spelling."""
    signature = {"the command": args.command}
    for dest, spelling in args.spellings.items():
        if hasattr(args, dest) and dest not in DISPLAY_OPTIONS:
            value = getattr(args, dest)
            signature[spelling] = os.path.abspath(value) if dest in PATH_OPTIONS and value is not None else value
    return signature


def _agree_command(signature=None, error=None):
    """Collective under a launcher: every rank runs the same command with the same options (``signature``:
    command_signature), or every rank gets one RankMismatchError naming the first that differs, before the
    command reads, creates or replaces anything or meets the others in any other collective. ``error``:
    this rank's command line does not parse; every rank raises it."""
    comm = _job_world()
    if comm is not None and comm.size > 1:
        agree(comm, error, signature)


def build_parser():
    from .plan.layout import LAYOUTS
    from .plan.costmodel import GPU_RATES
    from .plan.schemes import SCHEMES
    from .transport import TRANSPORTS

    raw = argparse.RawDescriptionHelpFormatter
    parser = _Parser(prog="burst-hpc", formatter_class=raw,
                     description=_wrap("Exact attention over sequences split across MPI ranks (BurstAttention ring): "
                     "one GPU (or one CPU process) per rank, HDF5 in and out."),
                     epilog="Run 'burst-hpc COMMAND --help' for each command's options, the HDF5 layout and "
                     "the exit status.\nTypical job:\n"
                     "  burst-hpc gen in.h5 --seqlen 65536 --heads 32 --kv-heads 8 --head-dim 128 --dtype bf16 "
                     "--with-grad\n"
                     "  mpiexec -n 8 burst-hpc run in.h5 out.h5 --causal --backward --verify\n"
                     "  mpiexec -n 8 burst-hpc check      # self-test of the kernels and the ring on this machine")
    parser.add_argument("--version", action="version", version=f"burst-hpc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{info,gen,run,verify,plan,check,compile,clean}",
                                parser_class=_Parser)
    sub.required = True

    p = _verb(sub, "info", cmd_info, help="versions, GPUs, MPI library, CUDA-awareness, NCCL, transport choice",
                       description=_wrap("Print versions (burst-hpc, Python, NumPy, mpi4py, h5py/HDF5 and whether it "
                       "has parallel HDF5), the MPI library, ranks and hosts, whether the MPI is CUDA-aware "
                       "(BURST_HPC_CUDA_AWARE=1/0 overrides), CuPy and the GPUs, NCCL, and what --transport auto "
                       "and --backend auto pick. Run it under mpiexec to see the job's view. Without a usable MPI library it "
                       "says what is missing and how to get one."))

    p = _verb(sub, "gen", cmd_gen, help="write random inputs q, k, v (and do) to an HDF5 file, chunk by chunk",
                       epilog=FILE_FORMAT,
                       description=_wrap("Write standard-normal q, k, v (and do) to OUT.h5 for 'burst-hpc run'. Written "
                       "in blocks (about 4M values in memory at a time), so a million-token input never needs a "
                       "whole tensor in memory. Run it as one process (under mpiexec rank 0 writes, the others "
                       "wait). The file appears under its name only when complete."))
    p.add_argument("output", metavar="OUT.h5", help="HDF5 file to create (refused if it exists, unless --overwrite)")
    p.add_argument("--batch", type=positive_int, default=1, help="B, sequences in the batch (default 1)")
    p.add_argument("--seqlen", type=positive_int, required=True, help="S, tokens per sequence (required)")
    p.add_argument("--heads", type=positive_int, default=8, help="Hq, query heads (default 8)")
    p.add_argument("--kv-heads", type=positive_int, default=None,
                   help="Hkv, key/value heads; Hq must be a multiple (GQA/MQA) (default: --heads)")
    p.add_argument("--head-dim", type=positive_int, default=64, help="D, the head dimension (default 64)")
    p.add_argument("--dtype", type=dtype_argument, default="bfloat16",
                   help=f"element type of every dataset: {SPELLINGS} (default bfloat16)")
    p.add_argument("--seed", type=nonnegative_int, default=0,
                   help="random seed, >= 0; each block of 1024 tokens of one batch entry of one tensor draws from its "
                   "own generator seeded by (seed, tensor, batch, block), so the data never depends on chunk "
                   "sizes (default 0)")
    p.add_argument("--with-grad", action="store_true", help="also write do, the output gradient 'run --backward' needs")
    p.add_argument("--documents", type=positive_int, default=None, metavar="N",
                   help="also write cu_seqlens: N packed documents of random lengths, seeded by --seed (run masks "
                   "attention across them)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT.h5 if it exists (atomically, when done)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")

    p = _verb(sub, "run", cmd_run, help="attention over the ranks of mpiexec; outputs written to OUT.h5",
                       epilog=FILE_FORMAT + "\n" + EXIT_CODES,
                       description=_wrap("Under 'mpiexec -n P': read q, k, v (and do) from IN.h5, each rank only its own "
                       "tokens, run the forward pass (and the backward pass) over the ring of ranks and write o, "
                       "lse (and dq, dk, dv) to OUT.h5, each rank only its own token ranges. OUT.h5 is built under "
                       "a temporary name next to it and appears only when every rank has finished. Inputs holding "
                       "NaN or Inf are refused before any work (the error names the dataset and the first bad "
                       "index), and so are values large enough to overflow the kernels' float32 sums (the error "
                       "names the datasets and their largest magnitudes). Rank 0 prints one summary line: sizes, ranks, layout, backend, transport, time "
                       "and TFLOP/s per pass (FlashAttention convention), with --verify max error / tolerance "
                       "per output, and the wall seconds of each phase (read, setup, forward, backward, write, "
                       "verify, total; set-up: the backend's start, the plan, a rehearsal of the passes that loads "
                       "their kernels, connects the communicators and allocates their buffers, and --warmup)."))
    p.add_argument("input", metavar="IN.h5", help="HDF5 file with q, k, v (and do for --backward); layout below")
    p.add_argument("output", metavar="OUT.h5", help="HDF5 file to write: o, lse (and dq, dk, dv); refused if it exists, "
                   "unless --overwrite")
    p.add_argument("--causal", action="store_true", help="causal mask on global token positions (key j visible "
                   "from query i when j <= i)")
    p.add_argument("--window", type=parse_window, default=None, metavar="L[,R]",
                   help="sliding window: keys at most L before and R after each query (R default 0; -1 unbounded: "
                   "write --window=-1,R); composes with --causal and the input's cu_seqlens")
    p.add_argument("--backward", action="store_true",
                   help="also compute dq, dk, dv, the gradients of sum(do * o); needs do in the input")
    p.add_argument("--layout", choices=LAYOUTS, default=None,
                   help="which tokens each rank owns: contiguous (rank r: chunk r of P; S a multiple of P) or "
                   "zigzag (rank r: chunks r and 2P-1-r of 2P, balanced causal work; S a multiple of 2P) or "
                   "balanced (contiguous ownership in natural token order, the visible work of causal, documents "
                   "and windows balanced by ranks computing pieces of block pairs for each other; S a multiple "
                   "of P) (default: zigzag with --causal, else contiguous; with documents or --window balanced "
                   "when the cost model predicts the job faster with it (never with --scheme double_ring or "
                   "ulysses_ring, which refuse it), else contiguous unless zigzag's busiest rank has clearly less "
                   "work)")
    p.add_argument("--transport", choices=TRANSPORTS, default="auto",
                   help="how shards travel between ranks: host (NumPy over MPI), mpi (GPU buffers to a CUDA-aware "
                   "MPI), nccl, staged (GPU -> pinned host -> MPI); auto: host for numpy, else mpi when the MPI is "
                   "CUDA-aware, else nccl, else staged ('burst-hpc info' shows the pick) (default auto)")
    p.add_argument("--scheme", choices=SCHEMES, default="auto",
                   help="how shards cross nodes: ring (flat), double_ring (inner ring per node, one transfer per "
                   "rank and inner round over the network), ulysses_ring (all-to-all over heads inside the node, "
                   "ring between nodes); auto: ring on one node, else the cost model's pick ('burst-hpc plan' "
                   "shows it) (default auto)")
    p.add_argument("--ranks-per-node", type=positive_int, default=None, metavar="W",
                   help="treat every W ranks of a host as one node (emulation; default: detect, or "
                   "BURST_HPC_RANKS_PER_NODE)")
    p.add_argument("--backward-ring", choices=("auto", "q", "kv"), default="auto",
                   help="what travels in the backward pass: q (q, do, dq: BurstAttention) or kv (k, v, dk, dv: "
                   "RingAttention); auto picks the one that moves fewer bytes (default auto)")
    p.add_argument("--backend", choices=("auto", "numpy", "cuda"), default="auto",
                   help="numpy (CPU), or cuda (shards moved to the GPU with CuPy, one GPU per rank: node-local "
                   "rank mod GPU count); auto: cuda when a GPU is visible (default auto)")
    p.add_argument("--scale", type=positive_float, default=None, help="softmax scale, a finite number > 0 (default head_dim**-0.5)")
    p.add_argument("--verify", action="store_true",
                   help="check every output against the float64 oracle on the shards the job holds (a cuda run's "
                   "on its GPUs, or on host copies with BURST_HPC_VERIFY_ON_GPU=0): max error <= 2x (o, lse) / 3x "
                   "(dq, dk, dv) the error of a plain "
                   "same-precision computation plus a small floor; NaN or Inf where the oracle has none fails. "
                   "OUT.h5 is published first; the outcome goes into its attributes (verify = pass, fail, or 'not "
                   "finished' when stopped), a mismatch exits 3. Every token when B*Hq*S^2 <= 4M, else sampled "
                   "tokens of each rank, each checked as a query row (o, lse, dq against every key) and as a key "
                   "column (dk, dv against every query); the predicted cost is printed first. To check later "
                   "instead: burst-hpc verify IN.h5 OUT.h5")
    p.add_argument("--verify-rows", type=positive_int, default=None,
                   help="tokens per rank --verify samples, > 0 (default: as many as cost at most half the passes' "
                   "time on the CPU, 8%% on a GPU, between 16 and 256)")
    p.add_argument("--verify-seed", type=nonnegative_int, default=0,
                   help="where the sampled rows fall, >= 0 (default 0)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT.h5 if it exists (atomically, once the run has finished); without it an existing "
                   "OUT.h5 is an error before any work and is left untouched")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="run on inputs holding NaN or Inf: they propagate into the outputs of the rows that see them "
                   "(the summary counts them: nonfinite o=N ...; --verify passes NaN and Inf only where the float64 "
                   "oracle has them too); or on values large enough to overflow the kernels' float32 sums")
    p.add_argument("--warmup", action="store_true",
                   help="run the passes once more in the set-up before the timed ones (the set-up already loads "
                   "what the passes use; this also warms clocks and caches)")
    p.add_argument("--progress", action="store_true", help="show stage lines on stderr even on short runs (they show "
                   "anyway on long runs or a terminal): each stage, and inside a pass a line every 5 seconds "
                   "(BURST_HPC_PROGRESS_SECONDS) with the share of rank 0's visible (query, key) pairs done and "
                   "the ETA")
    p.add_argument("--quiet", action="store_true", help="no stage lines")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="also write the run's report to FILE as one JSON object: seconds of read, setup, forward, "
                   "backward, write, verify and total, TFLOP/s, sizes, layout, scheme, transport, backend, device, "
                   "versions (the summary line's facts; OUT.h5's attributes hold them too). Checked before any "
                   "work; an existing FILE is replaced")

    p = _verb(sub, "verify", cmd_verify,
              help="check a published output against the float64 oracle, on any number of ranks",
              epilog="exit status: 0 the output passed; 3 it failed (the error names each output that failed); 1 the "
              "check could not run.\nexample: mpiexec -n 4 burst-hpc verify in.h5 out.h5",
              description=_wrap("Check OUT.h5, written by 'burst-hpc run' from IN.h5 (or any program writing the same "
              "datasets), as --verify does, so a job can publish first and verify later, with any number of "
              "ranks: each reads its share of the tokens once. Sampled tokens of each rank are checked as query "
              "rows (o, lse, dq against every key) and key columns (dk, dv against every query) in float64; every "
              "token when B*Hq*S^2 <= 4M. The mask, gradients and scale default to what OUT.h5 records; flags "
              "given must agree with it. An OUT.h5 that records no mask (written by another program) is refused "
              "unless --causal or --no-causal says it. Prints the predicted cost first, then one line: PASS or FAIL, max "
              "error / tolerance per output. OUT.h5 is only read."))
    p.add_argument("input", metavar="IN.h5", help="the input the output was computed from")
    p.add_argument("output", metavar="OUT.h5", help="the output to check: o, lse (and dq, dk, dv)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                   help="causal mask or not (default: as OUT.h5 records; an output that records no mask is refused "
                   "unless one of the two is given)")
    p.add_argument("--window", type=parse_window, default=None, metavar="L[,R]",
                   help="sliding window, as for run (default: as OUT.h5 records; none for an output that records no "
                   "mask)")
    p.add_argument("--scale", type=positive_float, default=None,
                   help="softmax scale, a finite number > 0 (default: as OUT.h5 records, else head_dim**-0.5)")
    p.add_argument("--backward", action="store_true", default=None,
                   help="check dq, dk, dv too (default: when OUT.h5 holds them)")
    p.add_argument("--rows", type=positive_int, default=256, help="tokens per rank sampled, > 0 (default 256)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="where the samples fall, >= 0 (default 0)")
    p.add_argument("--backend", choices=("auto", "numpy", "cuda"), default="auto",
                   help="where to check: numpy (CPU) or cuda (this rank's GPU, float64); auto (the default): the "
                   "GPU when this rank sees one (at S = 131072 on an H100: 7.6 s against 71 s on the CPU)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")

    p = _verb(sub, "plan", cmd_plan, help="predicted time of each layout and scheme for a problem and a cluster",
                       description=_wrap("The cost model's table (docs/RING.md, 'Across nodes'): for each layout "
                       "(contiguous, zigzag, balanced) and scheme (ring, double_ring, ulysses_ring) the predicted "
                       "forward and forward+backward time, the communication left exposed, the steps, the critical "
                       "path over the mean work, TFLOP/s per GPU, bytes per GPU over the network, peak memory per "
                       "rank, and the fewest tokens per GPU at which it hides its communication, all from one "
                       "step-by-step model of the schedules; the pick is the fastest row (burst_hpc.choose_layout "
                       "names its layout; scheme='auto' runs its scheme in it). Rates: the built-in table of --gpu with any of them overridden, or --measure under "
                       "mpiexec (one kernel timing, one exchange over each link class)."),
                       epilog="example: burst-hpc plan --seqlen 1048576 --heads 32 --kv-heads 8 --causal --nodes 32 "
                       "--gpus-per-node 8 --gpu H100 --inter-gbps 50")
    p.add_argument("--seqlen", type=positive_int, required=True, help="S, tokens in the whole sequence (required)")
    p.add_argument("--batch", type=positive_int, default=1, help="B (default 1)")
    p.add_argument("--heads", type=positive_int, default=32, help="Hq (default 32)")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="Hkv (default: --heads)")
    p.add_argument("--head-dim", type=positive_int, default=128, help="D (default 128)")
    p.add_argument("--dtype", type=dtype_argument, default="bfloat16",
                   help=f"element type: {SPELLINGS} (default bfloat16)")
    p.add_argument("--causal", action="store_true", help="causal mask")
    p.add_argument("--window", type=window_size, default=None, metavar="L",
                   help="causal sliding window of L keys before each query (the visible share follows; -1 none)")
    p.add_argument("--documents", type=positive_int, default=None, metavar="N",
                   help="N packed documents (lengths: --doc-lengths)")
    p.add_argument("--doc-lengths", choices=("equal", "uniform", "lognormal"), default="equal",
                   help="the lengths of --documents: equal, cut at uniform random places, or lognormal "
                   "(long-tailed), drawn from --seed (default equal)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of --doc-lengths (default 0)")
    p.add_argument("--cu-seqlens", default=None, metavar="FILE",
                   help="real document offsets [0, ..., S]: a text or .npy file, or an HDF5 input holding cu_seqlens")
    p.add_argument("--layout", choices=LAYOUTS, default=None,
                   help="only this layout's rows (default: every layout's; the pick is the fastest row)")
    p.add_argument("--nodes", type=positive_int, default=None, help="nodes (default 1; with --measure: the job's)")
    p.add_argument("--gpus-per-node", type=positive_int, default=None, help="ranks per node (default 8; with --measure: "
                   "the job's)")
    p.add_argument("--gpu", choices=sorted(GPU_RATES), default="H100", help="built-in rates (default H100)")
    for name, unit, kind in (("fwd-tflops", "forward kernel TFLOP/s", positive_float),
                             ("bwd-tflops", "backward kernel TFLOP/s", positive_float),
                             ("intra-gbps", "GB/s per GPU inside a node", positive_float),
                             ("inter-gbps", "GB/s per GPU between nodes", positive_float),
                             ("intra-latency-us", "latency inside a node (us)", nonnegative_float),
                             ("inter-latency-us", "latency between nodes (us)", nonnegative_float)):
        p.add_argument(f"--{name}", type=kind, default=None, help=f"override the {unit}")
    p.add_argument("--measure", action="store_true", help="measure the rates here, under mpiexec")
    p.add_argument("--ranks-per-node", type=positive_int, default=None, metavar="W",
                   help="with --measure: treat every W ranks of a host as one node")

    p = _verb(sub, "check", cmd_check, help="self-test: kernels and ring against the float64 oracle, pass/fail table",
                       description=_wrap("Correctness self-test of this installation, in seconds. On a GPU: every kernel "
                       "family the GPU runs, forward and backward, on odd shapes (lengths off the tile, GQA, causal "
                       "and not, bfloat16 and float16, padded head dims); without a GPU the NumPy backend, and it "
                       "says so. Under 'mpiexec -n P' (P > 1) also the ring over every transport 'burst-hpc info' "
                       "lists as available. Each result must meet the FlashAttention rule against the float64 "
                       "oracle (as --verify). Prints a pass/fail table on rank 0."),
                       epilog="exit status: 0 every check passed; 3 a check failed; 1 the check could not run.")
    p.add_argument("--seed", type=nonnegative_int, default=None,
                   help="draw the inputs from this seed, >= 0 (the table's header prints the seed of every run, so a "
                   "failure can be replayed) (default: a fresh seed)")
    p = _verb(sub, "compile", cmd_compile, help="compile kernels into the cache ahead of jobs (job prologue, image build)",
              description=_wrap("Compile the CUDA kernels of the chosen families, head dims and dtypes (every mask, "
              "forward and backward) into the kernel cache that jobs with the same CUPY_CACHE_DIR read, so their "
              "first calls compile nothing ('burst-hpc info' lists what the cache holds; a job with "
              "BURST_HPC_NO_JIT=1 refuses to compile). Runs on a GPU node of the kind the jobs use; under 'mpiexec "
              "-n P' the ranks of a node share the compiles out. Each kernel is compiled once per cache directory, "
              "whatever number of processes or jobs share it."))
    p.add_argument("--family", action="append", choices=("sm90", "sm80"),
                   help="a kernel family, repeatable (default: those this GPU runs)")
    p.add_argument("--head-dim", action="append", type=positive_int, metavar="D",
                   help="a head dim, repeatable (default: every one the kernels run natively)")
    p.add_argument("--dtype", action="append", type=kernel_dtype_argument,
                   help=f"an input dtype the kernels run, repeatable: {SPELLINGS}, but float64; float32 runs the "
                   "bfloat16 kernels (default: bfloat16 and float16)")
    p.add_argument("--pass", dest="passes", action="append", choices=("fwd", "bwd"),
                   help="forward or backward kernels only (default: both)")
    _add_clean(sub)
    return parser


def cmd_compile(args):
    from .backends.cuda.backend import compile_ahead

    comm = Alone() if mpi_problem() is not None else _world()
    line = compile_ahead(args.family, args.head_dim, args.dtype, tuple(args.passes or ("fwd", "bwd")), comm)
    if comm.rank == 0:
        print(line, flush=True)
    line = _collective(warm_verification, args.dtype, comm)
    if comm.rank == 0 and line:
        print(line, flush=True)
    return 0


def warm_verification(dtypes, comm):
    """Collective: run --verify's CuPy kernels once on every rank's GPU (verify.warm) so that a job's
    verification compiles nothing; '' where there is no GPU."""
    from .job import verify
    from .device import gpu_count

    error, seconds = None, None
    try:
        if gpu_count():
            seconds = verify.warm([parse_dtype(n) for n in dict.fromkeys(dtypes or ("bfloat16", "float16"))])
    except Exception as e:  # noqa: BLE001
        error = e if isinstance(e, BurstError) else BurstError(f"warming the verification's kernels failed: {describe(e)}")
    agree(comm, error)
    every = comm.allgather(seconds) if comm.size > 1 else [seconds]
    if any(s is None for s in every):
        return ""
    return f"verification kernels: compiled into CuPy's cache (CUPY_CACHE_DIR); {max(every):.1f} s"


def _collective(fn, *args, **kwargs):
    """Run a call that raises the same BurstError on every rank; mark it as agreed."""
    try:
        return fn(*args, **kwargs)
    except BurstError as e:
        e.agreed = True
        raise


def cmd_plan(args):
    from dataclasses import replace

    from .plan import tables
    from .plan.costmodel import GPU_RATES, Cluster

    # the command line alone decides all but --measure: every rank finds the same, one message if refused
    cu_seqlens = _collective(tables.planned_documents, args.seqlen, args.documents, args.doc_lengths, args.seed,
                             args.cu_seqlens)
    problem, mask = _collective(tables.problem, args.seqlen, args.batch, args.heads, args.kv_heads, args.head_dim,
                                parse_dtype(args.dtype), args.causal, args.window, cu_seqlens)
    rank = rank_and_size()[0]
    if args.measure:
        comm = _world()
        rates, topo = tables.measure(comm, problem, args.ranks_per_node)
        rank = comm.rank
        nodes, per_node = args.nodes or topo.nodes, args.gpus_per_node or topo.per_node
    else:
        rates, nodes, per_node = GPU_RATES[args.gpu], args.nodes or 1, args.gpus_per_node or 8
    overrides = {f: getattr(args, f) for f in ("fwd_tflops", "bwd_tflops", "intra_gbps", "inter_gbps",
                                               "intra_latency_us", "inter_latency_us") if getattr(args, f) is not None}
    rates = replace(rates, **overrides)
    cluster = Cluster(nodes, per_node)
    text, pick = _collective(tables.table, problem, cluster, rates, mask, args.layout)
    if rank == 0:
        print(tables.describe(problem, cluster, rates, mask))
        print(text)
        print(f"pick: layout {pick.layout.kind}, scheme {pick.scheme} ({pick.fwdbwd:.3g} s forward+backward; "
              f"shard by it: burst_hpc.choose_layout)")
    return 0


def cmd_check(args):
    from .job import selfcheck

    missing = mpi_problem()  # without an MPI library the kernels are still checked, in this one process
    if missing is not None and launched():
        _world()  # launched as a job whose MPI mpi4py cannot load: one error, not P separate tables
    passed = selfcheck.main(Alone() if missing is not None else _world(), seed=args.seed)
    if missing is not None:
        print(f"MPI: none usable: {missing}. The ring over ranks was not checked; {HOW_TO_GET_MPI}", flush=True)
    return EXIT_MISMATCH if not passed else 0


# =========================================================================== clean (job/safety.py)

def _add_clean(sub):
    p = _verb(sub, "clean", cmd_clean, help="remove temporary files a killed job left next to an output",
                       description=_wrap("A job killed from outside (SIGKILL, a node failure) can leave "
                       "OUT.h5.tmp-<host>-<pid>-<tag> (and its lock file, the same name + .lock) next to OUT.h5. "
                       "The job writing such a file holds a lock on its lock file for as long as it runs, whatever "
                       "program it is (burst-hpc, or a script using burst_hpc.io.OutputFile). clean lists the "
                       "files and removes those whose lock nobody holds (written on this host). A running job's "
                       "file is never removed. A file written on another host is listed and kept, since a lock "
                       "held there is not always visible here (it depends on the file system and its mount); "
                       "--force removes it, and files without a lock file, once you know no job writes OUT.h5."))
    p.add_argument("output", metavar="OUT.h5", help="the output whose temporary files to look for")
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.add_argument("--force", action="store_true",
                   help="also remove the files whose job this host cannot judge (another host's; none with a "
                   "lock file held, which is never removed)")


def cmd_clean(args):
    print("\n".join(safety.clean(args.output, args.dry_run, args.force)), flush=True)
    return 0


def main(argv=None):
    """The command; with ``argv`` None (the real command line) SIGTERM/SIGINT end the job cleanly
    and an HDF5 write failure ends the process without HDF5's exit handler (no crash at exit)."""
    if argv is None:
        safety.watch_signals()
        safety.quiet_hdf5_dealloc()
    code = _main(argv)
    if argv is None and safety.hdf5_broken():
        safety.exit_now(code)
    return code


def _main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        _agree_command(command_signature(args))
        return args.func(args)
    except BurstError as e:
        if getattr(e, "agreed", False):
            # every rank raised the same error: one message from rank 0, out before any rank exits
            message = str(e)
            _say_once(lambda: say(message))
            return EXIT_USAGE if isinstance(e, UsageError) else EXIT_ERROR
        say(f"[rank {rank_and_size()[0]}] {e}")
        abort_world(EXIT_ERROR)
        return EXIT_ERROR
    except KeyboardInterrupt:
        abort_world(EXIT_ERROR)
        return 130
    except Exception:  # a bug on one rank: say so and take the whole job down instead of hanging
        import traceback

        sys.stderr.write(f"burst-hpc: internal error on rank {rank_and_size()[0]}:\n{traceback.format_exc()}")
        sys.stderr.flush()
        abort_world(EXIT_ERROR)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
