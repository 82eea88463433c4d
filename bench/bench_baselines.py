"""Our ring against the seeds' baselines (bench/baselines.py), under mpirun on GPUs, one rank per GPU.

Timing (default): for each tokens-per-GPU value and method, the median time per call of the forward and
the forward+backward (between barriers), TFLOP/s per GPU, bytes sent per rank per call and peak memory
per rank (CuPy pool high-water; the pool is emptied between methods). A method that fails (out of
memory, heads that do not divide) gets a row with its error, and is not tried longer.

    mpirun -np 2 python bench/bench_baselines.py --tokens-per-rank 8192,16384 --causal

Accuracy (--accuracy): the same seeded global inputs (bench/evidence.py) for every P; each rank runs
its zigzag shard and compares o, dq, dk, dv with the float64 reference; the max over ranks is reported.

    mpirun -np 2 python bench/bench_baselines.py --accuracy --tokens 16384 --kv-heads 8 --causal

--cpu runs the same on the CPU path (NumPy, MPI), at small sizes: how mpi_tests/test_bench_baselines.py
checks this script without a GPU.
"""
import numpy as np
from mpi4py import MPI

import baselines
import burst_hpc
import evidence
from burst_hpc.collective import describe
from burst_hpc.dtypes import bfloat16


class Device:
    """Where the arrays live: CuPy on this rank's GPU, or NumPy (--cpu)."""

    def __init__(self, cpu, comm):
        if cpu:
            self.xp, self.name, self.transport = np, "CPU", "host"
        else:
            import cupy

            burst_hpc.select_device(comm)
            self.xp, self.transport = cupy, "nccl"
            self.name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
        self.rng = self.xp.random.default_rng()

    def random(self, shape):
        return self.rng.standard_normal(shape, dtype=np.float32).astype(bfloat16)

    def peak_bytes(self):
        return 0 if self.xp is np else self.xp.get_default_memory_pool().total_bytes()

    def empty_pool(self):
        if self.xp is not np:
            self.xp.get_default_memory_pool().free_all_blocks()

    def host(self, x):
        return x if self.xp is np else self.xp.asnumpy(x)


def time_method(comm, args, dev, method, q, k, v, do):
    """JSON rows (fwd, fwdbwd) of one method at this rank's shard size."""
    P, n = comm.size, q.shape[1]
    run = baselines.make(method, q, k, v, comm, args.causal, "zigzag", args.transport)
    rows = []
    for pass_ in args.passes.split(","):
        backward = pass_ == "fwdbwd"

        def call():
            o, lse = run.forward()
            if backward:
                run.backward(do, o, lse)

        sent = run.bytes_sent
        seconds = evidence.timed(comm, call, args.iters, args.warmup, dev.xp)
        ring = {"ring": run.backward_ring if backward else "kv"} if hasattr(run, "backward_ring") else {}
        rows.append({"pass": pass_, "full": seconds, **ring,
                     "tflops_per_gpu": evidence.flops(n * P, args.heads, args.head_dim, args.causal, backward) / P / seconds / 1e12,
                     "bytes_sent": max(comm.allgather(run.bytes_sent - sent)) // (args.iters + args.warmup),
                     "peak_gib": max(comm.allgather(dev.peak_bytes())) / 2**30})
    return rows


def timing(comm, args, dev):
    P = comm.size
    failed = set()
    for n in map(int, args.tokens_per_rank.split(",")):
        for method in args.methods.split(","):
            base = {"kind": "time", "method": method, "P": P, "tokens": n * P, "heads": args.heads,
                    "kv_heads": args.kv_heads, "head_dim": args.head_dim, "causal": args.causal,
                    "transport": args.transport}
            if method in failed:
                continue
            dev.empty_pool()
            try:
                q, do = (dev.random((1, n, args.heads, args.head_dim)) for _ in range(2))
                k, v = (dev.random((1, n, args.kv_heads, args.head_dim)) for _ in range(2))
                rows = [{**base, **row} for row in time_method(comm, args, dev, method, q, k, v, do)]
            except Exception as e:  # out of memory, or a method that cannot split these heads
                failed.add(method)
                rows = [{**base, "pass": pass_, "error": describe(e)[:200]} for pass_ in args.passes.split(",")]
            finally:
                q = k = v = do = None
            for row in rows:
                if comm.rank == 0:
                    evidence.emit(evidence.stamp(row, dev.name), args.out)


def accuracy(comm, args, dev):
    """Max error of o, dq, dk, dv against the float64 reference, every method, same inputs for every P."""
    P, r = comm.size, comm.rank
    inputs = evidence.global_inputs(args.seed, args.tokens, args.heads, args.kv_heads, args.head_dim)
    want = evidence.reference(*inputs, args.causal, xp=dev.xp)
    want = {name: burst_hpc.shard(x, r, P, "zigzag") for name, x in want.items()}
    dev.empty_pool()
    q, k, v, do = (dev.xp.asarray(burst_hpc.shard(x, r, P, "zigzag")) for x in inputs)
    for method in args.methods.split(","):
        row = {"kind": "accuracy", "method": method, "P": P, "tokens": args.tokens, "heads": args.heads,
               "kv_heads": args.kv_heads, "head_dim": args.head_dim, "causal": args.causal, "seed": args.seed}
        try:
            run = baselines.make(method, q, k, v, comm, args.causal, "zigzag", args.transport)
            o, lse = run.forward()
            got = dict(zip(("o",) + evidence.GRADS, [o, *run.backward(do, o, lse)]))
            errors = evidence.max_errors({name: dev.host(x) for name, x in got.items()}, want)
            row.update({name: comm.allreduce(err, op=MPI.MAX) for name, err in errors.items()})
        except Exception as e:
            row["error"] = describe(e)[:200]
        if r == 0:
            evidence.emit(evidence.stamp(row, dev.name), args.out)


def main(argv=None):
    ap = evidence.parser(__doc__.splitlines()[0])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--methods", default=",".join(baselines.METHODS))
    ap.add_argument("--transport", default=None, help="our ring on the GPU: nccl (default) or mpi; the "
                    "baselines' collectives: nccl (host with --cpu)")
    ap.add_argument("--cpu", action="store_true", help="NumPy arrays and MPI: a check of this script without a GPU")
    args = evidence.parse(ap, argv)
    comm = MPI.COMM_WORLD
    dev = Device(args.cpu, comm)
    args.transport = args.transport or dev.transport
    (accuracy if args.accuracy else timing)(comm, args, dev)


if __name__ == "__main__":
    main()
