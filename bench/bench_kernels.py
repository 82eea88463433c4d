"""Kernel benchmark: burst-hpc CUDA block kernels vs torch SDPA (flash = FlashAttention-2, cuDNN).

Same process, same bf16 inputs, B=1, H=32, D in {128, 64}, S in {4k, 16k, 32k}, causal and not.
TFLOP/s with the FlashAttention count: 4*S^2*H*D forward, 3.5x that for forward+backward, halved
when causal. Each number is the median of CUDA-event timings of single calls after warm-up.
"ours fwd" is one forward_block into a running (o, lse) (what a ring step runs); "ours fwd+bwd"
adds zeroing the float32 accumulators, the delta pre-pass and one backward_block.

    PYTHONPATH=$PWD python3 bench/bench_kernels.py [--quick] [--md out.md] [--write-docs]

--write-docs replaces the "## Kernels (single GPU)" latest-table block of docs/BENCHMARKS.md.
"""
import argparse
import datetime
import statistics
import sys
from pathlib import Path

import numpy as np
import cupy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from burst_hpc.backends import get_backend  # noqa: E402

BF16 = np.dtype("bfloat16")


def time_cupy(fn, warm, reps):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(cupy.cuda.get_elapsed_time(a, b))
    return statistics.median(ts)


def time_torch(torch, fn, warm, reps):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="S=16k, D=128 only")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--md", default=None, help="write the markdown table here")
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--dims", default=None, help="comma-separated head dims (default 128,64)")
    ap.add_argument("--seqs", default=None, help="comma-separated sequence lengths (default 4096,16384,32768)")
    args = ap.parse_args()

    torch = None
    if not args.no_torch:
        try:
            import torch
            from torch.nn.attention import SDPBackend, sdpa_kernel
        except ImportError:
            torch = None
    be = get_backend(cupy.zeros(1))
    dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    B, H = 1, 32
    dims = (128,) if args.quick else (128, 64)
    seqs = (16384,) if args.quick else (4096, 16384, 32768)
    if args.dims:
        dims = tuple(int(x) for x in args.dims.split(","))
    if args.seqs:
        seqs = tuple(int(x) for x in args.seqs.split(","))
    rows = []
    for d in dims:
        for s in seqs:
            for causal in (False, True):
                flops = 4.0 * s * s * H * d * (0.5 if causal else 1.0)
                q, k, v, do = (cupy.random.standard_normal((B, s, H, d), dtype=cupy.float32).astype(BF16)
                               for _ in range(4))
                o = cupy.zeros((B, s, H, d), cupy.float32)
                lse = cupy.full((B, H, s), -cupy.inf, cupy.float32)
                dq, dk, dv = (cupy.zeros((B, s, H, d), cupy.float32) for _ in range(3))
                scale = d ** -0.5

                def fwd():
                    be.forward_block(q, k, v, o, lse, scale=scale, causal=causal)

                def fwdbwd():
                    be.forward_block(q, k, v, o, lse, scale=scale, causal=causal)
                    dq.fill(0)
                    dk.fill(0)
                    dv.fill(0)
                    delta = be.delta(do, o)
                    be.backward_block(q, k, v, do, lse, delta, dq, dk, dv, scale=scale, causal=causal)

                t_f = time_cupy(fwd, 3, args.reps)
                t_fb = time_cupy(fwdbwd, 2, args.reps)
                row = {"d": d, "s": s, "causal": causal, "ours_f": flops / t_f / 1e9,
                       "ours_fb": 3.5 * flops / t_fb / 1e9}
                if torch is not None:
                    def tt(x):
                        return torch.as_tensor(x.view(cupy.int16), device="cuda").view(torch.bfloat16).transpose(1, 2)

                    tq, tk, tv, tdo = (tt(x).contiguous() for x in (q, k, v, do))
                    # (B, H, S, D) contiguous, as torch users hold them
                    for name, bk in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                        try:
                            with sdpa_kernel(bk):
                                def tf():
                                    with torch.no_grad():
                                        torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

                                gq, gk, gv = (x.detach().requires_grad_(True) for x in (tq, tk, tv))

                                def tfb():
                                    out = torch.nn.functional.scaled_dot_product_attention(gq, gk, gv, is_causal=causal)
                                    out.backward(tdo)

                                row[name + "_f"] = flops / time_torch(torch, tf, 3, args.reps) / 1e9
                                row[name + "_fb"] = 3.5 * flops / time_torch(torch, tfb, 2, args.reps) / 1e9
                                gq.grad = gk.grad = gv.grad = None
                        except Exception as exc:  # noqa: BLE001 - a backend may be unavailable
                            print(f"# torch {name} failed: {exc}", file=sys.stderr)
                    del tq, tk, tv, tdo
                    torch.cuda.empty_cache()
                rows.append(row)
                print(fmt_row(row), flush=True)
                del q, k, v, do, o, lse, dq, dk, dv
                cupy.get_default_memory_pool().free_all_blocks()

    cmd = "PYTHONPATH=$PWD python3 bench/bench_kernels.py" + (" --quick" if args.quick else "")
    md = table(rows, dev, cmd)
    print()
    print(md)
    if args.md:
        Path(args.md).write_text(md)
    if args.write_docs:
        write_docs(md)


def fmt(x):
    return f"{x:.0f}" if x is not None else "-"


def fmt_row(r):
    g = r.get
    ratio_f = r["ours_f"] / g("flash_f") if g("flash_f") else None
    ratio_fb = r["ours_fb"] / g("flash_fb") if g("flash_fb") else None
    return (f"| {r['d']} | {r['s']} | {'yes' if r['causal'] else 'no'} | {fmt(r['ours_f'])} | {fmt(g('flash_f'))} | "
            f"{fmt(g('cudnn_f'))} | {ratio_f:.2f}x | {fmt(r['ours_fb'])} | {fmt(g('flash_fb'))} | {fmt(g('cudnn_fb'))} | "
            f"{ratio_fb:.2f}x |" if ratio_f and ratio_fb else
            f"| {r['d']} | {r['s']} | {'yes' if r['causal'] else 'no'} | {fmt(r['ours_f'])} | - | - | - | "
            f"{fmt(r['ours_fb'])} | - | - | - |")


def table(rows, dev, cmd):
    date = datetime.date.today().isoformat()
    from burst_hpc.backends import cuda_backend

    head = (f"{date}, {dev}, `{cmd}` (bf16, B=1, H=32; TFLOP/s; median of CUDA-event timings; "
            f"backward layout {cuda_backend._BWD_LAYOUT})\n\n"
            "| D | S | causal | ours fwd | flash fwd | cuDNN fwd | ours/flash fwd | ours fwd+bwd | flash fwd+bwd | "
            "cuDNN fwd+bwd | ours/flash fwd+bwd |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "\n".join(fmt_row(r) for r in rows) + "\n"


def write_docs(md):
    path = ROOT / "docs" / "BENCHMARKS.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start, end = "<!-- kernels-latest-begin -->", "<!-- kernels-latest-end -->"
    block = f"{start}\n{md}{end}"
    if start in text and end in text:
        a, b = text.index(start), text.index(end) + len(end)
        text = text[:a] + block + text[b:]
    else:
        if "## Kernels (single GPU)" not in text:
            text = text.rstrip() + "\n\n## Kernels (single GPU)\n\n"
        text = text.rstrip() + "\n\n### Latest\n\n" + block + "\n"
    path.write_text(text)


if __name__ == "__main__":
    main()
