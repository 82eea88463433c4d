"""Issue 20's repetition targets, through real mpiexec jobs (the short versions run in make test,
tests/test_jobsafety.py, whose helpers this reuses).

    python bench/job_safety.py race --reps 20        # two 2-rank runs racing for one output, per layout
    python bench/job_safety.py sigterm --reps 20     # SIGTERM at a random moment of a ~30 s 4-rank run
                                                     # (0 to 80% of its measured length after the temp appears)

race: every repetition must end with exactly one output file holding one job's complete result, the
other job exiting 1 with one clear line (refused at start, or at publish time with its result kept).
sigterm: every rank gone within 5 s, no temporary file, no output. One line per repetition, then a
summary line; exit status 1 if any repetition missed its target.
"""
import argparse
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_jobsafety as tj  # noqa: E402
from test_cli import mpirun  # noqa: E402


def race(reps, layouts):
    bad = 0
    counts = {"refused at start": 0, "lost at publish (result kept)": 0}
    for layout in layouts:
        for i in range(reps):
            work = Path(tempfile.mkdtemp(prefix="burst-race-"))
            try:
                src, dst = work / "in.h5", work / "out.h5"
                assert tj.burst("gen", src, "--seqlen", 64, "--heads", 2, "--head-dim", 8, "--dtype",
                                "float32").returncode == 0
                procs = [tj._popen(["run", src, dst, "--causal", "--layout", layout, "--scale", s, "--backend",
                                    "numpy", "--quiet"], ranks=2) for s in (0.25, 0.5)]
                results = tj._finish(procs)
                _, loser, kept = tj._check_race(results, work, dst)
                how = "lost at publish (result kept)" if kept else "refused at start"
                counts[how] += 1
                print(f"race {layout:10s} {i + 1:2d}/{reps}: ok, winner job {1 - loser}, other {how}", flush=True)
            except AssertionError as e:
                bad += 1
                print(f"race {layout:10s} {i + 1:2d}/{reps}: FAILED {str(e)[:300]}", flush=True)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    total = reps * len(layouts)
    print(f"race: {total - bad}/{total} repetitions met the target ({', '.join(f'{v} {k}' for k, v in counts.items())})")
    return bad == 0


def sigterm(reps, seqlen, ranks, latest):
    work = Path(tempfile.mkdtemp(prefix="burst-sigterm-"))
    src = work / "in.h5"
    assert tj.burst("gen", src, "--seqlen", seqlen, "--heads", 4, "--head-dim", 64, "--dtype", "float32",
                    "--with-grad").returncode == 0
    t0 = time.time()
    r = mpirun(ranks, "run", src, work / "full.h5", "--causal", "--backward", "--backend", "numpy", "--quiet",
                  timeout=600)
    full = time.time() - t0
    assert r.returncode == 0, r.stderr
    os.remove(work / "full.h5")
    latest = min(latest, 0.8 * full) if latest else 0.8 * full  # the signal must land inside the run
    print(f"sigterm: an uninterrupted run takes {full:.1f} s on {ranks} ranks (S={seqlen}, causal fwd+bwd); "
          f"signals 0-{latest:.1f} s after its temporary file appears")
    bad, worst = 0, 0.0
    for i in range(reps):
        run = work / f"rep{i}"
        run.mkdir()
        shutil.copy(src, run / "in.h5")
        target = random.choice(["rank", "mpiexec"])
        try:
            gone, (code, _, err) = tj.stop_run_at_random(run, run / "in.h5", target, signal.SIGTERM, ranks=ranks,
                                                         earliest=0.0, latest=latest, flags=["--causal", "--backward"])
            left = [p for p in os.listdir(run) if p != "in.h5"]
            ok = gone < 5 and code != 0 and not left and "Traceback" not in err
            worst = max(worst, gone)
            bad += not ok
            print(f"sigterm {i + 1:2d}/{reps}: to {target:7s} every rank gone in {gone:4.2f} s, exit {code}, "
                  f"left {left or 'nothing'}: {'ok' if ok else 'FAILED'}", flush=True)
        except AssertionError as e:
            print(f"sigterm {i + 1:2d}/{reps}: not counted ({str(e)[:120]})", flush=True)
            bad += 1
        finally:
            shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    print(f"sigterm: {reps - bad}/{reps} repetitions met the target; slowest end {worst:.2f} s")
    return bad == 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("race", "sigterm"))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--layouts", default="zigzag,contiguous,balanced")
    parser.add_argument("--seqlen", type=int, default=24576, help="sigterm: tokens (24576: about 30 s on 4 ranks here)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--latest", type=float, default=None,
                        help="sigterm: latest signal, seconds after the temp appears (default: 80%% of an uninterrupted run)")
    args = parser.parse_args()
    if tj.MPIEXEC is None:
        sys.exit("no mpiexec")
    ok = race(args.reps, args.layouts.split(",")) if args.what == "race" else \
        sigterm(args.reps, args.seqlen, args.ranks, args.latest)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
