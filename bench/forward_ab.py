"""The sm90 forward alone, for A/B runs of kernel versions: run it once per checkout (each with its own
PYTHONPATH), interleaved, in one GPU call, and compare the lines; --torch adds cuDNN's forward on the same
inputs. Prints `label D S causal TFLOP/s` (bf16, B=1, H=--heads; median of --reps samples of 5 queued calls).
--key-splits times each case twice in one process, without and with the forward's key splits (label+split);
--cross-tile likewise without and with the cross-tile step (label+cross); --gpu-only times GPU work alone
(the calls queued behind a busy kernel, so host work per call is hidden even where it exceeds the kernel's).

    PYTHONPATH=$PWD python3 bench/forward_ab.py new --dims 128,64 --seqs 4096,16384 --torch
    (cd ../base && PYTHONPATH=$PWD python3 ../new/bench/forward_ab.py base --dims 128,64 --seqs 4096,16384)
"""
import argparse
import statistics

import cupy
import numpy as np

from timing import cupy_gpu_sample, cupy_sample, torch_gpu_sample, torch_sample
from burst_hpc.backends.cuda import CudaBackend
from burst_hpc.plan import masks

BF16 = np.dtype("bfloat16")


def median_ms(record, fn, reps):
    """Median over reps of (one sample: BATCH queued calls between two events) / BATCH; record(fn) times it."""
    for _ in range(3):
        fn()
    return statistics.median(record(fn) for _ in range(reps))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("label")
    ap.add_argument("--dims", default="128")
    ap.add_argument("--seqs", default="4096,16384")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--torch", action="store_true", help="also time torch's cuDNN forward")
    ap.add_argument("--key-splits", action="store_true", help="also time with the forward's key splits on")
    ap.add_argument("--cross-tile", action="store_true", help="also time with the forward's cross-tile step on")
    ap.add_argument("--gpu-only", action="store_true", help="time GPU work alone (calls queued behind a busy kernel)")
    args = ap.parse_args()
    sample = cupy_gpu_sample if args.gpu_only else cupy_sample
    heads = args.heads
    be = CudaBackend.instance(family="sm90")
    if args.torch:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def torch_record(fn):
            return (torch_gpu_sample if args.gpu_only else torch_sample)(torch, fn)
    for d in map(int, args.dims.split(",")):
        for s in map(int, args.seqs.split(",")):
            q, k, v = (cupy.random.standard_normal((1, s, heads, d), dtype=cupy.float32).astype(BF16) for _ in range(3))
            o = cupy.zeros((1, s, heads, d), cupy.float32)
            lse = cupy.full((1, heads, s), -cupy.inf, cupy.float32)
            for causal in (False, True):
                flops = 4 * s * s * heads * d / (2 if causal else 1)
                variants = [("", {})]
                if args.key_splits:
                    variants.append(("+split", {"key_splits": True}))
                if args.cross_tile:  # the cross-tile step switched from its default
                    variants.append(("-cross" if be.kernels.cross_tile else "+cross",
                                     {"cross_tile": not be.kernels.cross_tile}))
                for suffix, switches in variants:
                    defaults = {name: getattr(be.kernels, name) for name in switches}
                    for name, value in switches.items():
                        setattr(be.kernels, name, value)
                    try:
                        t = median_ms(sample, lambda: be.forward_block(q, k, v, o, lse, scale=d ** -0.5, masked=causal,
                                                                         mask=masks.make(q.shape[1], True)),
                                      args.reps)
                    finally:
                        for name, value in defaults.items():
                            setattr(be.kernels, name, value)
                    print(f"{args.label}{suffix} {d} {s} {int(causal)} {flops / t / 1e9:.1f}", flush=True)
                if args.torch:
                    tq, tk, tv = (torch.as_tensor(x.view(cupy.int16), device="cuda").view(torch.bfloat16)
                                  .transpose(1, 2).contiguous() for x in (q, k, v))

                    def cudnn():
                        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

                    print(f"cudnn {d} {s} {int(causal)} {flops / median_ms(torch_record, cudnn, args.reps) / 1e9:.1f}",
                          flush=True)


if __name__ == "__main__":
    main()
