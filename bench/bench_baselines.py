"""Our ring against the seeds' baselines (bench/baselines.py), under mpirun on GPUs, one rank per GPU.

Timing (default): for each tokens-per-GPU value and method, the median time per call of the forward and
the forward+backward (bench_ring.timed: between barriers), TFLOP/s per GPU, bytes sent per rank per call
and peak memory per rank (CuPy pool high-water; the pool is emptied between methods). A method that
fails (out of memory, heads that do not divide) gets a row with its error, and is not tried longer.

    mpirun -np 2 python bench/bench_baselines.py --tokens-per-rank 8192,16384 --causal

Accuracy (--accuracy): the same seeded global inputs (bench/evidence.py) for every P; each rank runs
its zigzag shard and compares o, dq, dk, dv with the float64 reference; the max over ranks is reported.

    mpirun -np 2 python bench/bench_baselines.py --accuracy --tokens 16384 --kv-heads 8 --causal
"""
import cupy
from mpi4py import MPI

import baselines
import burst_hpc
import evidence
from bench_ring import timed
from burst_hpc.collective import describe
from burst_hpc.dtypes import bfloat16


def device_name():
    return cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()


def time_method(comm, args, method, q, k, v, do):
    """JSON rows (fwd, fwdbwd) of one method at this rank's shard size."""
    P, n = comm.size, q.shape[1]
    pool = cupy.get_default_memory_pool()
    run = baselines.make(method, q, k, v, comm, args.causal, "zigzag", args.transport)
    rows = []
    for pass_ in args.passes.split(","):
        backward = pass_ == "fwdbwd"

        def call():
            o, lse = run.forward()
            if backward:
                run.backward(do, o, lse)

        sent = run.bytes_sent
        seconds = timed(comm, call, args.iters, args.warmup)
        ring = {"ring": run.backward_ring if backward else "kv"} if hasattr(run, "backward_ring") else {}
        rows.append({"pass": pass_, "full": seconds, **ring,
                     "tflops_per_gpu": evidence.flops(n * P, args.heads, args.head_dim, args.causal, backward) / P / seconds / 1e12,
                     "bytes_sent": max(comm.allgather(run.bytes_sent - sent)) // (args.iters + args.warmup),
                     "peak_gib": max(comm.allgather(pool.total_bytes())) / 2**30})
    return rows


def timing(comm, args):
    P = comm.size
    rng = cupy.random.default_rng()
    failed = set()
    for n in map(int, args.tokens_per_rank.split(",")):
        for method in args.methods.split(","):
            base = {"kind": "time", "method": method, "P": P, "tokens": n * P, "heads": args.heads,
                    "kv_heads": args.kv_heads, "head_dim": args.head_dim, "causal": args.causal,
                    "transport": args.transport}
            if method in failed:
                continue
            cupy.get_default_memory_pool().free_all_blocks()
            try:
                q, do = (rng.standard_normal((1, n, args.heads, args.head_dim), dtype=cupy.float32)
                         .astype(bfloat16) for _ in range(2))
                k, v = (rng.standard_normal((1, n, args.kv_heads, args.head_dim), dtype=cupy.float32)
                        .astype(bfloat16) for _ in range(2))
                rows = [{**base, **row} for row in time_method(comm, args, method, q, k, v, do)]
            except Exception as e:  # out of memory, or a method that cannot split these heads
                failed.add(method)
                rows = [{**base, "pass": pass_, "error": describe(e)[:200]} for pass_ in args.passes.split(",")]
            finally:
                q = k = v = do = None
            for row in rows:
                if comm.rank == 0:
                    evidence.emit(evidence.stamp(row, device_name()), args.out)


def accuracy(comm, args):
    """Max error of o, dq, dk, dv against the float64 reference, every method, same inputs for every P."""
    P, r = comm.size, comm.rank
    inputs = evidence.global_inputs(args.seed, args.tokens, args.heads, args.kv_heads, args.head_dim)
    want = evidence.reference(*inputs, args.causal, xp=cupy)
    want = {name: burst_hpc.shard(x, r, P, "zigzag") for name, x in want.items()}
    q, k, v, do = (cupy.asarray(burst_hpc.shard(x, r, P, "zigzag")) for x in inputs)
    for method in args.methods.split(","):
        row = {"kind": "accuracy", "method": method, "P": P, "tokens": args.tokens, "heads": args.heads,
               "kv_heads": args.kv_heads, "head_dim": args.head_dim, "causal": args.causal, "seed": args.seed}
        try:
            run = baselines.make(method, q, k, v, comm, args.causal, "zigzag", args.transport)
            o, lse = run.forward()
            got = dict(zip(("o",) + evidence.GRADS, [o, *run.backward(do, o, lse)]))
            errors = evidence.max_errors({name: cupy.asnumpy(x) for name, x in got.items()}, want)
            row.update({name: comm.allreduce(err, op=MPI.MAX) for name, err in errors.items()})
        except Exception as e:
            row["error"] = describe(e)[:200]
        if r == 0:
            evidence.emit(evidence.stamp(row, device_name()), args.out)


def main():
    ap = evidence.parser(__doc__.splitlines()[0])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--methods", default=",".join(baselines.METHODS))
    ap.add_argument("--transport", default="nccl", help="our ring: nccl or mpi; the baselines' collectives: nccl")
    args = evidence.parse(ap)
    comm = MPI.COMM_WORLD
    burst_hpc.select_device(comm)
    (accuracy if args.accuracy else timing)(comm, args)


if __name__ == "__main__":
    main()
