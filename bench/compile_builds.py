"""Compile the kernel builds with nvcc to cubin (no GPU needed): every build compiles, and what each costs
against the whole source (a proxy for NVRTC's time on the GPU machine, which runs the same front end and
ptxas).

    python3 bench/compile_builds.py                       # every build of every source (71, about 1 s each)
    python3 bench/compile_builds.py --sample              # each source's table and its first instance
    python3 bench/compile_builds.py --whole               # also the whole sources, for the comparison
    python3 bench/compile_builds.py --source attn_fwd_sm90.cu --jobs 4

Prints one line per build (seconds, cubin bytes) and a summary per source; exits 1 when a build fails.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from burst_hpc.backends.cuda import contract  # noqa: E402
from burst_hpc.backends.cuda.compile import Build, inline_source  # noqa: E402


def nvcc(source, code, tmp):
    arch = "-gencode=arch=compute_90a,code=sm_90a" if "sm90" in source else "-arch=sm_90"
    src = Path(tmp, f"{abs(hash(code))}.cu")
    out = src.with_suffix(".cubin")
    src.write_text(code)
    t0 = time.perf_counter()
    r = subprocess.run(["nvcc", arch, "-std=c++17", "-cubin", "-o", str(out), str(src)], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if r.returncode:
        return seconds, None, r.stderr[-3000:]
    return seconds, out.stat().st_size, None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", action="append", help="only these sources (default: every family source)")
    parser.add_argument("--sample", action="store_true", help="each source's table and first instance only")
    parser.add_argument("--whole", action="store_true", help="also compile each whole source")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    sources = args.source or [*contract.SOURCES.values(), contract.DELTA_SOURCE]
    root = contract.cuda_dir()
    work = []
    for source in sources:
        listed = [] if source == contract.DELTA_SOURCE else contract.instances(source)
        builds = [Build(source)] + [Build(source, inst) for inst in (listed[:1] if args.sample else listed)]
        work += [(b.name(), source, b.code(root)) for b in builds]
        if args.whole:
            work.append((f"{Path(source).stem} (whole)", source, inline_source(source, root)))
    failed = 0
    totals = {}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        results = pool.map(lambda w: (w, nvcc(w[1], w[2], tmp)), work)
        for (name, source, _), (seconds, size, error) in results:
            if error:
                failed += 1
                print(f"FAIL {name}:\n{error}", flush=True)
                continue
            print(f"{name:<48} {seconds:6.2f} s {size:>9} bytes", flush=True)
            kind = "whole" if name.endswith("(whole)") else "table" if name.endswith("-table") else "instance"
            totals.setdefault((source, kind), []).append(seconds)
    for (source, kind), times in sorted(totals.items()):
        print(f"{source:<18} {kind:<8} n={len(times):<3} mean {sum(times) / len(times):6.2f} s  max {max(times):6.2f} s")
    print(f"{len(work) - failed} built, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
