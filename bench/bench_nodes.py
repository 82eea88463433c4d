"""Schemes across nodes, measured against the cost model, under mpiexec (one rank per GPU, or NumPy).

For each scheme (ring, double_ring, ulysses_ring) and pass (fwd, fwdbwd): the time per call, the
same with communication skipped (compute only), the exposed communication (the difference), and
the cost model's prediction for the same problem and cluster. The model's kernel rates are the
ones this run measures (the flat ring's compute-only time), its link rates --intra-gbps and the
network of BURST_HPC_EMULATE_NETWORK (or --inter-gbps). One host acts as several nodes with
--ranks-per-node; with BURST_HPC_EMULATE_NETWORK="GBPS,LATENCY_US" the transfers between those
nodes are held to an IB-like link (burst_hpc/transport/emulated.py). The GPU run the issue asks for:

    BURST_HPC_EMULATE_NETWORK=50,5 mpirun -np 8 python bench/bench_nodes.py --ranks-per-node 4 \\
        --tokens-per-rank 16384 --causal --backend cuda        # and --ranks-per-node 2, and 25 GB/s
"""
import argparse
from dataclasses import replace

import numpy as np
from mpi4py import MPI

import burst_hpc
from burst_hpc.plan import costmodel, masks
from burst_hpc.plan.rates import Rates
from burst_hpc.plan.accounting import attention_flops, visible_pairs
from burst_hpc.benchmark import RingBenchmark
from burst_hpc.dtypes import parse_dtype
from burst_hpc.config import emulated_network as setting

import evidence

SCHEMES = ("ring", "double_ring", "ulysses_ring")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks-per-node", type=int, required=True)
    evidence.problem_arguments(ap, tokens_per_rank=16384)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--backend", choices=("numpy", "cuda"), default="cuda")
    ap.add_argument("--intra-gbps", type=float, default=300.0)
    ap.add_argument("--inter-gbps", type=float, default=50.0, help="used when no emulated network is set")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()

    comm = MPI.COMM_WORLD
    if args.backend == "cuda":
        import cupy as xp

        burst_hpc.select_device(comm)
    else:
        xp = np
        np.seterr(all="ignore")   # the compute-only mode attends over receive buffers never filled
    dtype = parse_dtype(args.dtype)
    kv_heads = args.kv_heads or args.heads
    n, w = args.tokens_per_rank, args.ranks_per_node
    rng = np.random.default_rng(comm.rank)
    q, k, v, do = (xp.asarray(rng.standard_normal((1, n, h, args.head_dim), dtype=np.float32).astype(dtype))
                   for h in (args.heads, kv_heads, kv_heads, args.heads))
    timed = lambda fn: evidence.timed(comm, fn, args.iters, args.warmup, xp=xp)  # noqa: E731

    rows = []
    for scheme in SCHEMES:
        try:
            bench = RingBenchmark(q, k, v, comm=comm, causal=args.causal, scheme=scheme, ranks_per_node=w)
        except burst_hpc.BurstError as e:
            rows.append((scheme, None, str(e)))
            continue
        o, lse = bench.forward()
        for name in ("fwd", "fwdbwd"):
            def call(mode):
                out = bench.forward(mode)
                if name == "fwdbwd":
                    bench.backward(do, o, lse, mode)
                return out
            rows.append((scheme, name, (timed(lambda: call("full")), timed(lambda: call("compute")))))

    pr = costmodel.Problem(1, n * comm.size, args.heads, kv_heads, args.head_dim, np.dtype(dtype).itemsize,
                           masks.make(n * comm.size, args.causal))
    cl = costmodel.Cluster(comm.size // w, w)
    fwd_compute = next(r[2][1] for r in rows if r[:2] == ("ring", "fwd"))
    all_compute = next(r[2][1] for r in rows if r[:2] == ("ring", "fwdbwd"))
    network = setting()
    flops = [attention_flops(1, args.heads, args.head_dim, visible_pairs(pr.mask), b) for b in (0, 1)]
    rates = Rates("this run", flops[0] / cl.ranks / fwd_compute / 1e12,
                            flops[1] / cl.ranks / max(all_compute - fwd_compute, 1e-12) / 1e12,
                            args.intra_gbps, network[0] / 1e9 if network else args.inter_gbps, 10.0,
                            network[1] * 1e6 if network else 10.0)
    if comm.rank:
        return
    print(f"{cl.nodes} nodes x {w} ranks, {n} tokens per rank, H={args.heads} Hkv={kv_heads} D={args.head_dim} "
          f"{args.dtype} {'causal' if args.causal else 'full'}, network {rates.inter_gbps:g} GB/s "
          f"{'(emulated)' if network else '(not held: real links)'}; model rates {rates.fwd_tflops:.3g} / "
          f"{rates.bwd_tflops:.3g} TFLOP/s from this run")
    print("| scheme | pass | time (s) | compute only (s) | exposed | predicted (s) | predicted exposed |")
    print("|---|---|---|---|---|---|---|")
    for scheme, name, result in rows:
        if name is None:
            print(f"| {scheme} | - | - | - | - | - | does not fit: {result} |")
            continue
        full, compute = result
        p = costmodel.predict(scheme, pr, cl, replace(rates))
        predicted = p.fwd.time if name == "fwd" else p.fwdbwd
        exposed = p.fwd.exposed if name == "fwd" else p.exposed
        print(f"| {scheme} | {name} | {full:.4g} | {compute:.4g} | {max(full - compute, 0) / full:.1%} | "
              f"{predicted:.4g} | {exposed:.1%} |")


if __name__ == "__main__":
    main()
