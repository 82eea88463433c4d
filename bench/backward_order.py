"""The sm90 backward's two CTA orders (Sm90Kernels.heavy_first off and on; issue 34) under packed documents and a
plain causal mask: bench_packed.py's document sets (bf16, Hq 64, Hkv 8, D 128; documents up to S/4, uniform and
MagiAttention's lengths) and one causal row per length, burst_hpc.attention_backward's GPU-alone time (queued behind a busy kernel, bench/timing.py), the two
orders' samples interleaved, median of 6 after 2 warm-up rounds.

    python3 bench/backward_order.py [--seqs 8192,16384,32768] [--sets 2]
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_packed  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="8192,16384,32768")
    ap.add_argument("--sets", type=int, default=2)
    args = ap.parse_args()
    from timing import cupy_gpu_sample

    from burst_hpc.backends import cuda

    kernels = cuda.CudaBackend.instance(family="sm90").kernels
    default = kernels.heavy_first
    for s in (int(x) for x in args.seqs.split(",")):
        cases = [(f"{kind} set {i} ({len(cu) - 1} documents)", cu) for kind in bench_packed.DISTS
                 for i, cu in enumerate(bench_packed.document_sets(kind, s, args.sets))]
        for name, cu in cases + [("causal", None)]:
            bwd = bench_packed.our_calls(*bench_packed.bf16_inputs(s), cu)["bwd"]
            samples = {False: [], True: []}
            for rnd in range(8):
                for on in samples:
                    kernels.heavy_first = on
                    t = cupy_gpu_sample(bwd)
                    if rnd >= 2:
                        samples[on].append(t)
            kernels.heavy_first = default
            plain, heavy = (statistics.median(samples[on]) for on in (False, True))
            print(f"S={s} {name}: in order {plain:.3f} ms, heavy first {heavy:.3f} ms ({plain / heavy:.3f}x)",
                  flush=True)


if __name__ == "__main__":
    main()
