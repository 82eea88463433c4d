"""Ring benchmark, under mpiexec on GPUs (one rank per GPU).

For each transport and layout: time per call of the forward and forward+backward ring, the
same run with communication skipped (compute only) and with compute skipped (communication
only), TFLOP/s per GPU, overlap (compute-only time / full time) and scaling efficiency against
one GPU running the whole sequence with the same kernels (T1 / (P * TP)). Peak device memory
per rank is the CuPy pool's high-water mark. Bytes sent per rank per call are counted by the hook
and set beside DESIGN.md's volume for the ring used (bytes_design: P-1 steps; the carried
accumulators' trip home comes on top). The three modes come from burst_hpc.benchmark.RingBenchmark,
the library's documented timing hook. JSON lines as bench/evidence.py describes them.

Layouts: contiguous, zigzag, balanced (contiguous shards, DistFlashAttn schedule), and
alltoall: contiguous shards turned into zigzag ones by an all-to-all around the zigzag ring
and back (bench/alltoall_zigzag.py), the simplest alternative to balanced.

    mpirun -np 4 python bench/bench_ring.py --tokens-per-rank 32768 --causal --transports nccl,mpi
"""
import argparse
import datetime
import functools
import json
import sys

import cupy
from mpi4py import MPI

import burst_hpc
from burst_hpc.benchmark import NoExchange, RingBenchmark
from burst_hpc.plan.accounting import backward_ring_bytes
from burst_hpc.dtypes import parse_dtype
from burst_hpc.transport import make_transport

import alltoall_zigzag
import evidence
from evidence import flops


def design_bytes(P, n, heads, kv_heads, dim, itemsize, ring, backward):
    """DESIGN.md's bytes per rank per call: K, V each step, plus the backward ring's volume."""
    sent = 2 * kv_heads * dim * itemsize
    if backward:
        sent += backward_ring_bytes(heads, kv_heads, dim, itemsize)[0 if ring == "q" else 1]
    return (P - 1) * n * sent


timed = functools.partial(evidence.timed, xp=cupy)  # median seconds per call, between barriers


def gpu_job(args):
    """(comm, dtype, kv_heads): MPI's world with each rank on its GPU, the problem's element type and
    K/V heads (evidence.problem_arguments)."""
    comm = MPI.COMM_WORLD
    burst_hpc.select_device(comm)
    return comm, parse_dtype(args.dtype), args.kv_heads or args.heads


def _arguments():
    """The benchmark's command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    evidence.problem_arguments(ap)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--transports", default="nccl")
    ap.add_argument("--layouts", default=None, help="contiguous, zigzag, balanced, alltoall; default: "
                    "zigzag,balanced,contiguous when causal, else contiguous")
    ap.add_argument("--passes", default="fwd,fwdbwd")
    ap.add_argument("--modes", default="full,compute,comm")
    ap.add_argument("--backward-ring", default="auto")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--single", action="store_true", help="also time one GPU on the whole sequence")
    ap.add_argument("--out", default=None, help="append JSON lines and a markdown table here (rank 0)")
    return ap.parse_args()


def _write_table(args, rows, singles, P, kv_heads):
    """Rank 0: the markdown table of ``rows`` (and the one-GPU times ``singles``), printed and appended to --out."""
    n = args.tokens_per_rank
    S = n * P
    dev = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    header = (f"\n### Ring, {P} x {dev}, {datetime.date.today()}: {'causal' if args.causal else 'non-causal'} "
              f"{args.dtype}, B={args.batch}, H={args.heads}, Hkv={kv_heads}, D={args.head_dim}, "
              f"{n} tokens per GPU ({S} total)\n\n`mpirun -np {P} python {' '.join(sys.argv)}`\n\n"
              "| transport | layout | pass | ring | time (s) | compute only (s) | comm only (s) | TFLOP/s/GPU | overlap | "
              "efficiency vs 1 GPU | peak GiB/rank |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for row in rows:
        eff = f"{singles[row['pass']] / (P * row['full']):.1%}" if row["pass"] in singles else "-"
        fmt = lambda key: f"{row[key]:.3f}" if key in row else "-"  # noqa: E731
        lines.append(f"| {row['transport']} | {row['layout']} | {row['pass']} | {row['ring']} | {fmt('full')} | "
                     f"{fmt('compute')} | {fmt('comm')} | {row['tflops_per_gpu']:.0f} | "
                     f"{format(row['overlap'], '.1%') if 'overlap' in row else '-'} | {eff} | {row['peak_gib']:.1f} |")
    if singles:
        lines.append(f"\nOne GPU, whole sequence ({S} tokens): " +
                     ", ".join(f"{p} {t:.3f} s" for p, t in singles.items()))
    table = header + "\n".join(lines) + "\n"
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(table)


def main():
    args = _arguments()

    comm, dtype, kv_heads = gpu_job(args)
    P, r = comm.size, comm.rank
    n, S = args.tokens_per_rank, args.tokens_per_rank * P
    layouts = (args.layouts or ("zigzag,balanced,contiguous" if args.causal else "contiguous")).split(",")
    rng = cupy.random.default_rng()

    def rand(h):
        return rng.standard_normal((args.batch, n, h, args.head_dim), dtype=cupy.float32).astype(dtype)

    q, k, v, do = rand(args.heads), rand(kv_heads), rand(kv_heads), rand(args.heads)
    rows = []
    pool = cupy.get_default_memory_pool()
    for transport in args.transports.split(","):
        for layout in layouts:
            placed = burst_hpc.make_layout("zigzag" if layout == "alltoall" else layout, S, P)
            bench = RingBenchmark(q, k, v, comm=comm, causal=args.causal, layout=placed, transport=transport,
                                  backward_ring=args.backward_ring)
            o, lse = bench.forward()
            # alltoall: q, k, v, do taken as contiguous shards are moved to zigzag and the results back; the
            # ring in between runs on the benchmark's own arrays of the same shapes (values do not change times)
            if layout == "alltoall":
                exchange = make_transport(bench.transport_name, comm, cupy)
                saved = alltoall_zigzag.forward(exchange, lambda *_: bench.forward(), q, k, v)[2]
            for pass_ in args.passes.split(","):
                backward = pass_ == "fwdbwd"
                result = {"kind": "time", "method": "burst", "transport": bench.transport_name, "layout": layout,
                          "pass": pass_, "P": P, "tokens": S, "heads": args.heads, "kv_heads": kv_heads,
                          "head_dim": args.head_dim, "causal": args.causal, "ring": bench.backward_ring if backward else "kv"}
                for mode in args.modes.split(","):

                    def run():
                        if layout == "alltoall":
                            t = NoExchange(exchange) if mode == "compute" else exchange
                            alltoall_zigzag.forward(t, lambda *_: bench.forward(mode), q, k, v)
                            if backward:
                                alltoall_zigzag.backward(t, lambda *_: bench.backward(do, o, lse, mode), do, saved)
                            return
                        bench.forward(mode)
                        if backward:
                            bench.backward(do, o, lse, mode)

                    sent = bench.bytes_sent
                    result[mode] = timed(comm, run, args.iters, args.warmup)
                    if mode == "full":  # every call sends the same
                        result["bytes_sent"] = max(comm.allgather(bench.bytes_sent - sent)) // (args.iters + args.warmup)
                        result["bytes_design"] = args.batch * design_bytes(P, n, args.heads, kv_heads, args.head_dim,
                                                                           dtype.itemsize, result["ring"], backward)
                result["tflops_per_gpu"] = flops(S, args.heads, args.head_dim, args.causal, backward) * args.batch / P / result["full"] / 1e12
                if "compute" in result:
                    result["overlap"] = result["compute"] / result["full"]
                result["peak_gib"] = max(comm.allgather(pool.total_bytes())) / 2**30
                rows.append(result)
                if r == 0:
                    print(json.dumps(result), flush=True)
    singles = {}
    if args.single:
        for pass_ in args.passes.split(","):
            if r == 0:
                qs = cupy.concatenate([q] * P, axis=1)
                ks, vs, dos = (cupy.concatenate([x] * P, axis=1) for x in (k, v, do))

                def one():
                    oo, ll = burst_hpc.attention(qs, ks, vs, causal=args.causal)
                    if pass_ == "fwdbwd":
                        burst_hpc.attention_backward(dos, qs, ks, vs, oo, ll, causal=args.causal)

                singles[pass_] = timed(MPI.COMM_SELF, one, args.iters, args.warmup)
                del qs, ks, vs, dos
            comm.Barrier()
        singles = comm.bcast(singles)
    if r != 0:
        return
    _write_table(args, rows, singles, P, kv_heads)


if __name__ == "__main__":
    main()
