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

One function per verb here; the command line's text is in :mod:`burst_hpc.cli_parser`, its argument
types in :mod:`burst_hpc.cli_arguments`, and the exit statuses with the delivery of one error message
for the whole job in :mod:`burst_hpc.cli_delivery`.
"""
import sys
import time

from .cli_delivery import (EXIT_ERROR, EXIT_MISMATCH, EXIT_USAGE, agree_command, command_signature, say_once)
from .cli_parser import build_parser
from .collective import (HOW_TO_GET_MPI, Alone, abort_world, agree, describe, launched, mpi_problem, rank_and_size,
                         world as _world)
from .dtypes import dtype_name, parse_dtype
from .errors import BurstError, FileError, UsageError, say
from .job import leftovers, safety


def cmd_info(args):
    from .job.selfcheck import installation

    text = installation()
    if text is not None:  # rank 0's
        print(text, flush=True)
    return 0


def cmd_gen(args):
    from . import io
    from .job.progress import Progress

    comm = _world() if launched() else None
    rank = comm.rank if comm is not None else 0
    progress = Progress(rank == 0 and not args.quiet)
    err = None
    if rank == 0:
        try:
            for line in leftovers.stale_note(args.output):
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



def cmd_compile(args):
    from .device import gpu_count, select_device
    from .plan.calibrate import calibrate

    comm = Alone() if mpi_problem() is not None else _world()
    on_gpus = args.backend == "cuda" and all(comm.allgather(bool(gpu_count())))
    if on_gpus and not isinstance(comm, Alone):
        select_device(comm)   # one GPU a rank, as a run job's: the fixed costs are measured over its transport
    if args.backend == "cuda":
        from .backends.cuda.backend import compile_ahead
        from .job.verify_warm import warm_verification

        line = compile_ahead(args.family, args.head_dim, args.dtype, tuple(args.passes or ("fwd", "bwd")), comm)
        if comm.rank == 0:
            print(line, flush=True)
        line = _collective(warm_verification, args.dtype, comm)
        if comm.rank == 0 and line:
            print(line, flush=True)
    if args.backend == "cuda" and not on_gpus:
        if comm.rank == 0:
            print("fixed costs: not measured (no GPU here; the cost model keeps its built-in ones)", flush=True)
        return 0
    # the block calls on a kernel just compiled: the first head dim and dtype asked for
    model, costs, path = _collective(calibrate, args.backend, comm if comm.size > 1 else None, args.transport,
                                     (args.head_dim or [128])[0], (args.dtype or ["bfloat16"])[0], args.tile_prices)
    if comm.rank == 0:
        print(f"fixed costs of {model} ({', '.join(f'{k} {v:.3g}' for k, v in sorted(costs.items()))}): {path}",
              flush=True)
    return 0


def _collective(fn, *args, **kwargs):
    """Run a call that raises the same BurstError on every rank; mark it as agreed."""
    try:
        return fn(*args, **kwargs)
    except BurstError as e:
        e.agreed = True
        raise


def cmd_plan(args):
    from dataclasses import replace

    from .plan import calibrate, tables
    from .plan.costmodel import Cluster, cluster_layouts
    from .plan.layout import LAYOUTS
    from .plan.rates import GPU_RATES, per_pair

    # the command line alone decides all but --measure: every rank finds the same, one message if refused
    cu_seqlens = _collective(tables.planned_documents, args.seqlen, args.documents, args.doc_lengths, args.seed,
                             args.cu_seqlens)
    problem = _collective(tables.problem, args.seqlen, args.batch, args.heads, args.kv_heads, args.head_dim,
                                parse_dtype(args.dtype), args.causal, args.window, cu_seqlens)
    rank = rank_and_size()[0]
    if args.measure:
        comm = _world()
        rates, topo = tables.measure(comm, problem, args.ranks_per_node)
        rank = comm.rank
        nodes, per_node = args.nodes or topo.nodes, args.gpus_per_node or topo.per_node
    else:
        rates, nodes, per_node = GPU_RATES[args.gpu], args.nodes or 1, args.gpus_per_node or 8
        rates = replace(rates, **(calibrate.load(args.gpu) or {}))   # fixed costs `burst-hpc compile` measured
    overrides = {f: getattr(args, f) for f in ("intra_gbps", "inter_gbps", "intra_latency_us", "inter_latency_us",
                                               "fwd_launch_us", "bwd_launch_us", "step_us")
                 if getattr(args, f) is not None}
    rates = per_pair(replace(rates, **overrides), args.fwd_tflops, args.bwd_tflops)   # a kernel rate: per pair
    cluster = Cluster(nodes, per_node)
    layouts = _collective(cluster_layouts, problem, cluster, rates,
                          LAYOUTS if args.layout is None else (args.layout,))   # chunks: placed by the mask and the nodes
    text, pick = _collective(tables.table, problem, cluster, rates, layouts)
    if rank == 0:
        print(tables.describe(problem, cluster, rates))
        print(text)
        placed = tables.placement_words(pick.layout)
        print(f"pick: layout {pick.layout.kind}{placed}, scheme {pick.scheme} ({pick.fwdbwd:.3g} s forward+backward; "
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


def cmd_clean(args):
    print("\n".join(leftovers.clean(args.output, args.dry_run, args.force)), flush=True)
    return 0


COMMANDS = {"info": cmd_info, "gen": cmd_gen, "run": cmd_run, "verify": cmd_verify, "plan": cmd_plan,
            "check": cmd_check, "compile": cmd_compile, "clean": cmd_clean}


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
        agree_command(command_signature(args))
        return COMMANDS[args.command](args)
    except BurstError as e:
        if getattr(e, "agreed", False):
            # every rank raised the same error: one message from rank 0, out before any rank exits
            message = str(e)
            say_once(lambda: say(message))
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
