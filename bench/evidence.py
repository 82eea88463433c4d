"""What every evidence benchmark shares, whatever runs it (our ring, the baselines, torch's context
parallelism): the FLOP count, the seeded global inputs, the float64 reference, the error measure and
the JSON lines (one object per line, read back by bench/plot_evidence.py). No torch, no CuPy here:
array code takes ``xp`` (NumPy or CuPy).

JSON line keys: kind ("time" or "accuracy"), method, pass ("fwd", "fwdbwd"), P, tokens (in all),
heads, kv_heads, head_dim, causal, transport, full (seconds per call), tflops_per_gpu, peak_gib
(per rank), bytes_sent (per rank per call), error (why a case did not run); accuracy rows carry
err_o, err_dq, err_dk, err_dv (max |ours - reference| over the whole sequence).
"""
import argparse
import datetime
import json
import time

import ml_dtypes
import numpy as np

from burst_hpc.plan import masks
from burst_hpc.plan.accounting import attention_flops, visible_pairs

GRADS = ("dq", "dk", "dv")


def flops(seqlen, heads, dim, causal, backward):
    """The FlashAttention count (burst_hpc.plan.accounting) of the forward, or of forward + backward."""
    pairs = visible_pairs(masks.make(seqlen, causal))
    return attention_flops(1, heads, dim, pairs) + (attention_flops(1, heads, dim, pairs, True) if backward else 0)


def problem_arguments(parser, tokens_per_rank=32768, dtype=True):
    """The attention problem every ring benchmark takes: --tokens-per-rank, --heads, --kv-heads,
    --head-dim and (unless ``dtype`` is False) --dtype."""
    parser.add_argument("--tokens-per-rank", type=int, default=tokens_per_rank)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--head-dim", type=int, default=128)
    if dtype:
        parser.add_argument("--dtype", default="bf16")


def marks(fn, iters, before, mark):
    """(start, end) of each of ``iters`` calls of ``fn``, each after ``before()``; ``mark()`` a point in time (a
    host clock reading, or a CUDA event recorded on the stream)."""
    found = []
    for _ in range(iters):
        before()
        start = mark()
        fn()
        found.append((start, mark()))
    return found


def timed(comm, fn, iters, warmup, xp=np):
    """Median seconds per call of ``fn`` over ``iters`` calls after ``warmup``, each between barriers
    (and, on the GPU, device synchronisations): the slowest rank's time."""
    def sync():
        if xp is not np:
            xp.cuda.Device().synchronize()
        comm.Barrier()

    def synced():
        fn()
        sync()

    for _ in range(warmup):
        fn()
    return float(np.median([b - a for a, b in marks(synced, iters, sync, time.perf_counter)]))


def queued(comm, fn, iters, warmup, xp=np, flush_bytes=256 * 10**6):
    """Mean seconds per call of ``fn`` timed as MagiAttention's benchmark times its distributed attention
    (magi_attention/benchmarking/bench.py, do_bench): before each call the GPU zeroes a 256 MB buffer (L2
    flush) and all-reduces it across the ranks (a barrier on the device, NCCL), then CUDA events bracket the
    call; the host is never synchronised inside the loop, so it issues a call while the GPU still flushes
    and waits. Each call's time is the slowest rank's; the mean over ``iters``. On the CPU (``xp`` NumPy):
    barriers and host clocks, as ``timed`` (mean instead of median)."""
    if xp is np:
        for _ in range(warmup):
            fn()
        mine = np.array([b - a for a, b in marks(fn, iters, comm.Barrier, time.perf_counter)])
        slowest = np.empty_like(mine)
        comm.Allreduce(mine, slowest, op=max_op())
        return float(slowest.mean())
    barrier, flush = device_barrier(comm, xp, flush_bytes)
    stream = xp.cuda.get_current_stream()
    fn()
    xp.cuda.Device().synchronize()
    for _ in range(warmup):
        fn()
    barrier()
    events = marks(fn, iters, flush, stream.record)
    barrier()
    xp.cuda.Device().synchronize()
    mine = np.array([xp.cuda.get_elapsed_time(a, b) / 1e3 for a, b in events])
    slowest = np.empty_like(mine)
    comm.Allreduce(mine, slowest, op=max_op())
    return float(slowest.mean())


def issued(comm, fn, iters, xp=np, busy_ms=30.0):
    """Median seconds the host takes to issue a call of ``fn``, the slowest rank's: on the GPU with the device
    kept busy for ``busy_ms`` first (bench/timing.gpu_busy), so the host never waits for it (a training loop
    whose GPU work is shorter than this waits for the host); on the CPU the call itself."""
    mine = []
    for _ in range(iters):
        if xp is not np:
            import timing

            xp.cuda.Device().synchronize()
            comm.Barrier()
            timing.gpu_busy(busy_ms)
        else:
            comm.Barrier()
        start = time.perf_counter()
        fn()
        mine.append(time.perf_counter() - start)
    if xp is not np:
        xp.cuda.Device().synchronize()
    return comm.allreduce(float(np.median(mine)), op=max_op())


def device_barrier(comm, xp, flush_bytes=256 * 10**6):
    """(barrier, flush) on the current CuPy stream, as MagiAttention's benchmark queues them before each call:
    ``barrier()`` all-reduces a ``flush_bytes`` buffer across the ranks (NCCL, the ring's own communicator on
    these ranks), ``flush()`` zeroes it first (the L2 flush) and then waits likewise."""
    from cupy.cuda import nccl

    from burst_hpc.transport.nccl import communicator

    devices = communicator(comm)
    cache = xp.empty(flush_bytes // 4, xp.int32)
    stream = xp.cuda.get_current_stream()

    def barrier():
        devices.allReduce(cache.data.ptr, cache.data.ptr, cache.size, nccl.NCCL_INT32, nccl.NCCL_SUM, stream.ptr)

    def flush():
        cache.fill(0)
        barrier()

    return barrier, flush


def max_op():
    from mpi4py import MPI

    return MPI.MAX


def global_inputs(seed, seqlen, heads, kv_heads, dim, batch=1):
    """q, k, v, do of the whole sequence as bfloat16 NumPy arrays (B, S, H, D), the same for every
    process that passes the same seed: ours, the baselines and the peer see identical inputs."""
    rng = np.random.default_rng(seed)
    shapes = [(batch, seqlen, h, dim) for h in (heads, kv_heads, kv_heads, heads)]
    return [rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16) for shape in shapes]


def reference(q, k, v, do, causal, xp=np):
    """float64 (o, dq, dk, dv) of the whole sequence, one head at a time on ``xp``'s device; returned
    as NumPy arrays. Inputs: NumPy arrays (B, S, H, D) as global_inputs makes them."""
    b, s, hq, d = q.shape
    group = hq // k.shape[2]
    scale = d ** -0.5
    out = {name: np.zeros(x.shape, np.float64) for name, x in (("o", q), ("dq", q), ("dk", k), ("dv", k))}
    hidden = xp.triu(xp.ones((s, s), dtype=bool), 1) if causal else None
    for bi in range(b):
        for h in range(hq):
            g = h // group
            qh, kh, vh, doh = (xp.asarray(x[bi, :, head].astype(np.float64)) for x, head in
                               ((q, h), (k, g), (v, g), (do, h)))
            scores = (qh @ kh.T) * scale
            if causal:
                scores[hidden] = -xp.inf
            p = xp.exp(scores - scores.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            o = p @ vh
            dp = doh @ vh.T
            ds = p * (dp - (doh * o).sum(-1, keepdims=True))
            host = (lambda x: x.get()) if xp is not np else (lambda x: x)  # noqa: E731
            out["o"][bi, :, h] = host(o)
            out["dq"][bi, :, h] = host(ds @ kh * scale)
            out["dk"][bi, :, g] += host(ds.T @ qh * scale)
            out["dv"][bi, :, g] += host(p.T @ doh)
    return out


def max_errors(got, want):
    """{"err_o": ..., "err_dq": ...}: max |got - want| per tensor (NumPy arrays of the same shards)."""
    return {f"err_{name}": float(np.abs(np.asarray(got[name], np.float64) - want[name]).max()) for name in got}


def stamp(row, device):
    """The row with the machine and the date, as every JSON line carries them."""
    return {**row, "device": device, "date": str(datetime.date.today())}


def emit(row, path=None):
    """Print one JSON line (and append it to ``path``)."""
    line = json.dumps(row)
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def parser(description):
    """The command line every evidence benchmark shares (shape, passes, timing, accuracy, output);
    ``parse(ap)`` then fills kv_heads (default: heads)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--tokens-per-rank", default="32768", help="comma-separated, shortest first")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--passes", default="fwd,fwdbwd")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--accuracy", action="store_true")
    ap.add_argument("--tokens", type=int, default=16384, help="--accuracy: tokens in all, the same for every P")
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--out", default=None, help="append the JSON lines here too (rank 0)")
    return ap


def parse(ap, argv=None):
    args = ap.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    return args
