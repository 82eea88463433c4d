"""--verify's predicted cost against its measured cost, and its share of the passes (issue 37).

    mpiexec -n P python bench/verify_cost.py --seqlen 4096 8192 [--window 128] [--documents 12]
        [--heads 8 --kv-heads 2 --head-dim 64 --dtype bf16] [--backend numpy|cuda] [--verify-rows N]
        [--reps 2] [--profile]

For each S: gen an input (rank 0, a temporary directory), then run the job (job.run, forward and
backward, causal, --verify) --reps times, the first untimed when --reps > 1 (it fills caches: CuPy's
kernels, the page cache). Rank 0 prints one Markdown row per S from the last run: the passes'
seconds, the prediction the check announced, the seconds it took, measured / predicted, and the
check's share of the passes (the budget: verify.BUDGET). --profile prints rank 0's cProfile of the
last run's verification (the 30 most expensive calls by cumulative time).
"""
import argparse
import cProfile
import io as textio
import os
import pstats
import shutil
import tempfile

from mpi4py import MPI

from burst_hpc import io
from burst_hpc.job import verify
from burst_hpc.job.run import RunOptions, run
from burst_hpc.dtypes import parse_dtype


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, nargs="+", required=True)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--window", type=int, default=None, help="causal window of L keys")
    parser.add_argument("--documents", type=int, default=None)
    parser.add_argument("--backend", default="numpy")
    parser.add_argument("--verify-rows", type=int, default=None)
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    work = comm.bcast(tempfile.mkdtemp(prefix="burst-verify-cost-") if comm.rank == 0 else None)
    mask = "causal" + (f" window {args.window}" if args.window else "") + \
        (f" {args.documents} documents" if args.documents else "")
    if comm.rank == 0:
        print(f"| S | ranks | backend | mask | passes (s) | verify predicted (s) | verify measured (s) | "
              f"measured / predicted | verify / passes | budget | mode |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
    try:
        for seqlen in args.seqlen:
            src = os.path.join(work, f"in{seqlen}.h5")
            if comm.rank == 0:
                io.generate(src, 1, seqlen, args.heads, args.kv_heads, args.head_dim, parse_dtype(args.dtype),
                            with_grad=True, documents=args.documents)
            comm.Barrier()
            for rep in range(args.reps):
                options = RunOptions(src, os.path.join(work, f"out{seqlen}.h5"), causal=True,
                                     window=None if args.window is None else (args.window, 0),
                                     backward=not args.no_backward, backend=args.backend, verify=True,
                                     verify_rows=args.verify_rows, overwrite=True, progress=False)
                profile = cProfile.Profile() if args.profile and comm.rank == 0 and rep == args.reps - 1 else None
                if profile is not None:
                    resident = verify.verify_resident

                    def profiled(*a, **k):
                        profile.enable()
                        try:
                            return resident(*a, **k)
                        finally:
                            profile.disable()
                    verify.verify_resident = profiled
                outcome = run(options, comm)
                if profile is not None:
                    verify.verify_resident = resident
            facts = outcome.report
            seconds, checked = facts["seconds"], facts["verify"]
            passes = seconds["forward"] + (seconds["backward"] or 0.0)
            if comm.rank == 0:
                budget, predicted = verify.BUDGET[facts["backend"]], checked.get("predicted_s")
                ratio = "-" if predicted is None else f"{seconds['verify'] / predicted:.2f}"
                print(f"| {seqlen} | {comm.size} | {facts['backend']} | {mask} | {passes:.3f} | "
                      f"{'-' if predicted is None else f'{predicted:.3f}'} | {seconds['verify']:.3f} | "
                      f"{ratio} | {seconds['verify'] / passes:.2f} | {budget:.2f} | {checked['mode']} |", flush=True)
                if profile is not None:
                    text = textio.StringIO()
                    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(30)
                    print(text.getvalue(), flush=True)
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
