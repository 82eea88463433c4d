"""The peer: PyTorch's context parallelism on the same GPUs and shapes as our ring, one GPU per rank.

torch.distributed.tensor.experimental.context_parallel (head-tail load balancing, causal), SDPA backend
chosen with sdpa_kernel (cuDNN, flash). Launch with torchrun or mpirun: the rank comes from the
launcher's environment and the NCCL process group starts over env:// (MASTER_ADDR 127.0.0.1).

Each rank builds only its own shard ("--buffers shard", the default). context_parallel() shards the
global buffers it is given (every rank holding every token: that set-up ran out of memory at 2M tokens
on 8 x H200) and then patches SDPA so that any local tensors called inside it are this rank's sequence
shards. So it is entered with a 2P-token placeholder buffer (it needs at least one) and q, k, v, dO are
made directly as the head-tail shard: chunks r and 2P-1-r of 2P, which is our zigzag layout. The
accuracy mode checks that mapping against the reference. "--buffers global" takes the documented path
with global buffers, for a cross-check at sizes that fit.

    torchrun --nproc-per-node 2 bench/peer_torch_cp.py --tokens-per-rank 32768 --kv-heads 8
    mpirun -np 2 python3 bench/peer_torch_cp.py --accuracy --tokens 16384 --kv-heads 8

Timing: median of CUDA-event times per call (the slowest rank's), forward (under no_grad) and forward +
backward; peak memory per rank = torch.cuda.max_memory_allocated. JSON lines as bench/evidence.py
describes them, method torch-cp-cudnn / torch-cp-flash; a case torch refuses (GQA on a backend, out
of memory) gets a row with its error.
"""
import contextlib
import os
import statistics

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.nn.attention import SDPBackend, sdpa_kernel

import burst_hpc.plan.layout
import evidence

try:  # the options moved between torch releases
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options, set_rotate_method
except ImportError:
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def launch():
    """(rank, world size, local rank) from torchrun or Open MPI; the NCCL process group and this rank's GPU."""
    env = os.environ
    if "RANK" in env:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    else:
        rank, world = int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"])
        local = int(env["OMPI_COMM_WORLD_LOCAL_RANK"])
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world,
                            device_id=torch.device("cuda", local))
    return rank, world, local


def max_over_ranks(value):
    t = torch.tensor(float(value), device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(fn, iters, warmup):
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(max_over_ranks(start.elapsed_time(end) / 1e3))
    return statistics.median(times)


@contextlib.contextmanager
def cp_context(mesh, world, buffers=None):
    """context_parallel() with head-tail load balancing; with no buffers, a 2P-token placeholder."""
    _cp_options.enable_load_balance = True
    if buffers is None:
        buffers = [torch.zeros(1, 1, 2 * world, 1, device="cuda")]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * len(buffers),
                          no_restore_buffers=set(buffers)):
        yield


def sdpa(q, k, v):
    """F.scaled_dot_product_attention looked up at call time: context_parallel() patches it."""
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)


def to_bhsd(x):
    """A (B, S, H, D) NumPy array (bfloat16 or float) as a CUDA bf16 (B, H, S, D) tensor."""
    return torch.from_numpy(np.asarray(x, np.float32)).cuda().to(torch.bfloat16).transpose(1, 2).contiguous()


def rows_for(args, mesh, world, n, backend):
    """Timing rows (fwd, fwdbwd) of one backend at n tokens per rank."""
    torch.cuda.reset_peak_memory_stats()
    h, hk, d = args.heads, args.kv_heads, args.head_dim
    if args.buffers == "global":
        shapes = [(1, x, n * world, d) for x in (h, hk, hk, h)]
    else:
        shapes = [(1, x, n, d) for x in (h, hk, hk, h)]
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for shape in shapes)
    rows = []
    with sdpa_kernel([BACKENDS[backend]]), cp_context(mesh, world, [q, k, v, do] if args.buffers == "global" else None):
        for x in (q, k, v):
            x.requires_grad_()

        def forward():
            with torch.no_grad():
                sdpa(q, k, v)

        def forward_backward():
            q.grad = k.grad = v.grad = None
            sdpa(q, k, v).backward(do)

        for pass_, fn in (("fwd", forward), ("fwdbwd", forward_backward)):
            if pass_ not in args.passes.split(","):
                continue
            seconds = timed(fn, args.iters, args.warmup)
            rows.append({"pass": pass_, "full": seconds,
                         "tflops_per_gpu": evidence.flops(n * world, h, d, True, pass_ == "fwdbwd") / world / seconds / 1e12,
                         "peak_gib": max_over_ranks(torch.cuda.max_memory_allocated()) / 2**30})
    return rows


def timing(args, mesh, rank, world):
    failed = set()
    for n in map(int, args.tokens_per_rank.split(",")):
        for backend in args.backends.split(","):
            base = {"kind": "time", "method": f"torch-cp-{backend}", "P": world, "tokens": n * world,
                    "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "causal": True,
                    "transport": "nccl", "layout": "head-tail", "rotate": _cp_options.rotate_method.name.lower(),
                    "buffers": args.buffers}
            if backend in failed:
                continue
            try:
                rows = [{**base, **row} for row in rows_for(args, mesh, world, n, backend)]
            except Exception as e:  # torch refuses the case (GQA on this backend) or runs out of memory
                failed.add(backend)
                rows = [{**base, "pass": p, "error": f"{type(e).__name__}: {e}"[:200]} for p in args.passes.split(",")]
            torch.cuda.empty_cache()
            if rank == 0:
                for row in rows:
                    evidence.emit(evidence.stamp(row, torch.cuda.get_device_name()), args.out)


def reference_shards(args, rank, world, local):
    """This rank's zigzag shards of the inputs and of the float64 reference (on this rank's GPU)."""
    inputs = evidence.global_inputs(args.seed, args.tokens, args.heads, args.kv_heads, args.head_dim)
    try:
        import cupy

        cupy.cuda.Device(local).use()
        want = evidence.reference(*inputs, True, xp=cupy)
        cupy.get_default_memory_pool().free_all_blocks()
    except ImportError:
        want = evidence.reference(*inputs, True)
    shard = lambda x: burst_hpc.plan.layout.shard(x, rank, world, "zigzag")  # noqa: E731
    return [shard(x) for x in inputs], {name: shard(x) for name, x in want.items()}


def accuracy(args, mesh, rank, world, local):
    inputs, want = reference_shards(args, rank, world, local)
    for backend in args.backends.split(","):
        row = {"kind": "accuracy", "method": f"torch-cp-{backend}", "P": world, "tokens": args.tokens,
               "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "causal": True,
               "seed": args.seed, "rotate": _cp_options.rotate_method.name.lower()}
        try:
            q, k, v, do = (to_bhsd(x) for x in inputs)
            with sdpa_kernel([BACKENDS[backend]]), cp_context(mesh, world):
                for x in (q, k, v):
                    x.requires_grad_()
                o = sdpa(q, k, v)
                o.backward(do)
            got = {name: x.detach().transpose(1, 2).float().cpu().numpy()
                   for name, x in zip(("o",) + evidence.GRADS, (o, q.grad, k.grad, v.grad))}
            row.update({name: max_over_ranks(err) for name, err in evidence.max_errors(got, want).items()})
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:200]
        if rank == 0:
            evidence.emit(evidence.stamp(row, torch.cuda.get_device_name()), args.out)


def main():
    ap = evidence.parser(__doc__.splitlines()[0])
    ap.add_argument("--backends", default="cudnn,flash")
    ap.add_argument("--buffers", choices=("shard", "global"), default="shard")
    ap.add_argument("--rotate", choices=("allgather", "alltoall"), default=None, help="default: torch's")
    args = evidence.parse(ap)
    rank, world, local = launch()
    if args.rotate:
        set_rotate_method(args.rotate)
    mesh = init_device_mesh("cuda", (world,))
    try:
        if args.accuracy:
            accuracy(args, mesh, rank, world, local)
        else:
            timing(args, mesh, rank, world)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
