"""Kernel benchmark: burst-hpc CUDA block kernels (each kernel family) vs torch SDPA (flash =
FlashAttention-2, cuDNN).

Same process, same bf16 inputs, B=1, H=32, D in {128, 64}, S in {4k, 16k, 32k}, causal and not.
TFLOP/s with the FlashAttention count: 4*S^2*H*D forward, 3.5x that for forward+backward and 2.5x for
the backward alone, halved when causal. Each number is the median over --reps samples after warm-up;
a sample is the CUDA-event time of 5 calls queued back to back, divided by 5, for ours and torch alike
(ring steps queue their kernels the same way, so host-side launch overhead is hidden when the GPU is
the slower side).
"ours fwd" is one forward_block into a running (o, lse) (what a ring step runs); "ours bwd" is the
backward call sequence alone: zeroing the float32 accumulators, the delta pre-pass and one
backward_block (timed by itself, after one forward); "ours fwd+bwd" is the two back to back.
torch's bwd is torch.autograd.grad over a retained graph (fresh gradient tensors, like our zeroing).
Ratios are to cuDNN, for the first family of --families (the default family of the GPU).

    python3 bench/bench_kernels.py [--quick] [--dims 128,64] [--seqs 4096,16384] [--families sm90,sm80]
                                   [--no-torch] [--reps N] [--md out.md] [--write-docs]
    python3 bench/bench_kernels.py --masks [--families ...] [--md out.md]
    python3 bench/bench_kernels.py --fwd-shapes [--dims 64] [--seqs 4096,16384]
    python3 bench/bench_kernels.py --bwd-order [--dims 128,64,256] [--seqs 16384]

--masks: the masked rows instead (D = 128, S = 16k, causal): packed documents of 2k-8k tokens and a 4k
sliding window against plain causal, TFLOP/s counted over the visible (query, key) pairs only; torch
takes the same mask as a dense boolean attn_mask (cuDNN where it accepts one, else its
memory-efficient kernel; the column says which ran).

--fwd-shapes: the sm90 forward at each of its instantiated tile heights for D (default 64), forced, and the
one the backend picks: the numbers behind D64_TWO_CONSUMER_RATE in burst_hpc/backends/cuda/sm90.py.

--bwd-order: the sm90 backward in each CTA order, in one process (Sm90Kernels.heavy_first off and on: the
order of masked rows; their samples interleaved), non-causal and causal, with torch cuDNN's
backward beside it; then the masked rows (D = 128, S = 16k) in each order, TFLOP/s over visible pairs and the
ratio to causal of the same order.

--write-docs replaces the "## Kernels (single GPU)" latest-table block of docs/BENCHMARKS.md.
"""
import argparse
import datetime
import os
import shlex
import statistics
import sys
from pathlib import Path

import numpy as np
import cupy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from burst_hpc.plan import masks  # noqa: E402
from burst_hpc.plan.accounting import attention_flops, visible_pairs  # noqa: E402
from burst_hpc.backends import cuda  # noqa: E402
from timing import cupy_sample, torch_sample  # noqa: E402

BF16 = np.dtype("bfloat16")
PHASES = (("f", "fwd", 1.0), ("fb", "fwd+bwd", 3.5), ("b", "bwd", 2.5))  # key, label, FLOPs / forward FLOPs
FLOP_FACTOR = {key: factor for key, _, factor in PHASES}
TORCH = (("flash", "flash"), ("cudnn", "cuDNN"))




def time_cupy(fn, warm, reps):
    for _ in range(warm):
        fn()
    return statistics.median(cupy_sample(fn) for _ in range(reps))


def time_torch(torch, fn, warm, reps):
    for _ in range(warm):
        fn()
    return statistics.median(torch_sample(torch, fn) for _ in range(reps))


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="S=16k, D=128 only")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--md", default=None, help="write the markdown table here")
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--masks", action="store_true", help="the masked rows (documents, window) instead")
    ap.add_argument("--fwd-shapes", action="store_true", help="the sm90 forward at each tile height")
    ap.add_argument("--bwd-order", action="store_true", help="the sm90 backward in each tile order")
    ap.add_argument("--dims", default=None, help="comma-separated head dims (default 128,64)")
    ap.add_argument("--seqs", default=None, help="comma-separated sequence lengths (default 4096,16384,32768)")
    ap.add_argument("--families", default=None,
                    help="comma-separated kernel families (default: every family this GPU runs, default first)")
    return ap.parse_args()


def main():
    args = parse_args()
    runnable = cuda.kernel_families()
    families = tuple(args.families.split(",")) if args.families else runnable
    for f in families:
        if f not in runnable:
            sys.exit(f"bench_kernels: family {f!r} does not run on this GPU (it runs {runnable})")
    torch = None
    if not args.no_torch:
        try:
            import torch
            from torch.nn.attention import SDPBackend, sdpa_kernel
        except ImportError:
            torch = None
    dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    if args.masks:
        for d in tuple(int(x) for x in (args.dims or "128").split(",")):
            mask_rows(families, torch, args.reps, dev, args.md, d=d)
        return 0
    if args.fwd_shapes:
        return forward_shapes(args)
    if args.bwd_order:
        return backward_orders(args, torch)
    B, H = 1, 32
    dims = (128,) if args.quick else (128, 64)
    seqs = (16384,) if args.quick else (4096, 16384, 32768)
    if args.dims:
        dims = tuple(int(x) for x in args.dims.split(","))
    if args.seqs:
        seqs = tuple(int(x) for x in args.seqs.split(","))
    print(header(families), flush=True)
    rows = []
    for d in dims:
        for s in seqs:
            for causal in (False, True):
                flops = attention_flops(1, H, d, visible_pairs(masks.make(s, causal)))
                q, k, v, do = (cupy.random.standard_normal((B, s, H, d), dtype=cupy.float32).astype(BF16)
                               for _ in range(4))
                o = cupy.zeros((B, s, H, d), cupy.float32)
                lse = cupy.full((B, H, s), -cupy.inf, cupy.float32)
                dq, dk, dv = (cupy.zeros((B, s, H, d), cupy.float32) for _ in range(3))
                ms = {}  # (impl, phase) -> milliseconds
                for family in families:
                    be = cuda.CudaBackend.instance(family=family)
                    for key, t in time_ours(be, q, k, v, do, o, lse, dq, dk, dv, causal, args.reps).items():
                        ms[family, key] = t
                if torch is not None:
                    def tt(x):
                        return torch.as_tensor(x.view(cupy.int16), device="cuda").view(torch.bfloat16).transpose(1, 2)

                    tq, tk, tv, tdo = (tt(x).contiguous() for x in (q, k, v, do))
                    # (B, H, S, D) contiguous, as torch users hold them
                    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
                    for name, _ in TORCH:
                        try:
                            ms.update(time_torch_sdpa(torch, sdpa_kernel, backends[name], name, tq, tk, tv, tdo,
                                                      causal, args.reps))
                        except Exception as exc:  # noqa: BLE001 - a backend may be unavailable
                            print(f"# torch {name} failed: {exc}", file=sys.stderr)
                    del tq, tk, tv, tdo
                    torch.cuda.empty_cache()
                row = {(impl, key): FLOP_FACTOR[key] * flops / t / 1e9 for (impl, key), t in ms.items()}
                row.update(d=d, s=s, causal=causal)
                rows.append(row)
                print(fmt_row(row, families), flush=True)
                del q, k, v, do, o, lse, dq, dk, dv
                cupy.get_default_memory_pool().free_all_blocks()

    md = table(rows, families, dev, command())
    print()
    print(md)
    if args.md:
        Path(args.md).write_text(md)
    if args.write_docs:
        write_docs(md)


def time_ours(be, q, k, v, do, o, lse, dq, dk, dv, causal, reps):
    """{phase: ms} of one backend: forward, forward+backward, backward alone."""
    scale = q.shape[-1] ** -0.5

    def fwd():
        be.forward_block(q, k, v, o, lse, scale=scale, masked=causal, mask=masks.make(q.shape[1], True))

    def bwd():
        dq.fill(0)
        dk.fill(0)
        dv.fill(0)
        delta = be.delta(do, o)
        be.backward_block(q, k, v, do, lse, delta, dq, dk, dv, scale=scale, masked=causal,
                          mask=masks.make(q.shape[1], True))

    def fwdbwd():
        fwd()
        bwd()

    times = {"f": time_cupy(fwd, 3, reps), "fb": time_cupy(fwdbwd, 2, reps)}
    o.fill(0)  # the backward alone reads the (o, lse) of one forward
    lse.fill(-cupy.inf)
    fwd()
    times["b"] = time_cupy(bwd, 2, reps)
    return times


def time_torch_sdpa(torch, sdpa_kernel, backend, name, tq, tk, tv, tdo, causal, reps):
    """{(name, phase): ms} of torch SDPA on one backend: forward, forward+backward, backward alone."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with sdpa_kernel(backend):
        gq, gk, gv = (x.detach().requires_grad_(True) for x in (tq, tk, tv))

        def tf():
            with torch.no_grad():
                sdpa(tq, tk, tv, is_causal=causal)

        def tfb():
            out = sdpa(gq, gk, gv, is_causal=causal)
            torch.autograd.grad(out, (gq, gk, gv), tdo)

        out = sdpa(gq, gk, gv, is_causal=causal)

        def tb():
            torch.autograd.grad(out, (gq, gk, gv), tdo, retain_graph=True)

        return {(name, "f"): time_torch(torch, tf, 3, reps), (name, "fb"): time_torch(torch, tfb, 2, reps),
                (name, "b"): time_torch(torch, tb, 2, reps)}


def mask_cases(s):
    """(name, mask) of the masked rows: plain causal (mask None), documents of 2k-8k tokens, a 4k window."""
    rng = np.random.default_rng(0)
    bounds = [0]
    while bounds[-1] < s:
        bounds.append(min(s, bounds[-1] + int(rng.integers(2048, 8193))))
    return (("causal", masks.make(s, True)), (f"documents 2k-8k ({len(bounds) - 1})", masks.make(s, True, None, np.array(bounds))),
            ("window 4096", masks.make(s, True, (4096, 0), None)))


def forward_shapes(args, B=1, H=32):
    """TFLOP/s of the sm90 forward at each tile height (forced), and the height the backend picks."""
    be = cuda.CudaBackend.instance(family="sm90")
    for d in tuple(int(x) for x in (args.dims or "64").split(",")):
        for s in tuple(int(x) for x in (args.seqs or "4096,16384").split(",")):
            q, k, v = (cupy.random.standard_normal((B, s, H, d), dtype=cupy.float32).astype(BF16) for _ in range(3))
            o = cupy.zeros((B, s, H, d), cupy.float32)
            lse = cupy.full((B, H, s), -cupy.inf, cupy.float32)
            for causal in (False, True):
                flops = attention_flops(1, H, d, visible_pairs(masks.make(s, causal)))
                cells = []
                for rows in be.kernels.tile_heights(d):
                    be.kernels.forced_tile_height = rows
                    t = time_cupy(lambda: be.forward_block(q, k, v, o, lse, scale=d ** -0.5, masked=causal,
                                                          mask=masks.make(s, True)), 3,
                                  args.reps)
                    cells.append(f"BM={rows}: {flops / t / 1e9:.0f}")
                be.kernels.forced_tile_height = None
                picked = be.kernels.tile_height(d, B * H, s)
                print(f"D={d} S={s} causal={causal}: " + ", ".join(cells) + f" TFLOP/s; picked BM={picked}",
                      flush=True)


def backward_orders(args, torch, B=1, H=32):
    """TFLOP/s of the sm90 backward (zeroing, delta, backward_block) in each tile order, torch cuDNN's beside."""
    be = cuda.CudaBackend.instance(family="sm90")
    orders = [("in order", False), ("heavy first", True)]  # (name, Sm90Kernels.heavy_first)

    default = be.kernels.heavy_first

    def run_orders(flops, bwd):
        """{order: TFLOP/s}: the orders' samples interleaved (one of each per round), so clock and power drift
        over the run reach every order alike; the median of --reps rounds."""
        samples = {name: [] for name, _ in orders}
        for rnd in range(args.reps + 2):
            for name, on in orders:
                be.kernels.heavy_first = on
                t = cupy_sample(bwd)
                if rnd >= 2:  # two warm-up rounds
                    samples[name].append(t)
        be.kernels.heavy_first = default
        return {name: 2.5 * flops / statistics.median(ts) / 1e9 for name, ts in samples.items()}

    for d in tuple(int(x) for x in (args.dims or "128").split(",")):
        for s in tuple(int(x) for x in (args.seqs or "16384").split(",")):
            q, k, v, do = (cupy.random.standard_normal((B, s, H, d), dtype=cupy.float32).astype(BF16)
                           for _ in range(4))
            o = cupy.zeros((B, s, H, d), cupy.float32)
            lse = cupy.full((B, H, s), -cupy.inf, cupy.float32)
            dq, dk, dv = (cupy.zeros((B, s, H, d), cupy.float32) for _ in range(3))
            for causal in (False, True):
                flops = attention_flops(1, H, d, visible_pairs(masks.make(s, causal)))
                o.fill(0)
                lse.fill(-cupy.inf)
                be.forward_block(q, k, v, o, lse, scale=d ** -0.5, masked=causal, mask=masks.make(s, True))

                def bwd():
                    dq.fill(0)
                    dk.fill(0)
                    dv.fill(0)
                    be.backward_block(q, k, v, do, lse, be.delta(do, o), dq, dk, dv, scale=d ** -0.5, masked=causal,
                                      mask=masks.make(s, True))

                cells = run_orders(flops, bwd)
                line = f"D={d} S={s} causal={causal}: " + ", ".join(f"{n} {t:.0f}" for n, t in cells.items())
                if torch is not None:
                    from torch.nn.attention import SDPBackend, sdpa_kernel

                    def tt(x):
                        return torch.as_tensor(x.view(cupy.int16), device="cuda").view(torch.bfloat16).transpose(1, 2)

                    tq, tk, tv, tdo = (tt(x).contiguous() for x in (q, k, v, do))
                    cudnn = time_torch_sdpa(torch, sdpa_kernel, SDPBackend.CUDNN_ATTENTION, "cudnn", tq, tk, tv, tdo,
                                            causal, args.reps)[("cudnn", "b")]
                    ref = 2.5 * flops / cudnn / 1e9
                    line += f"; cuDNN {ref:.0f}; ratio " + ", ".join(f"{t / ref:.2f}x" for t in cells.values())
                    del tq, tk, tv, tdo
                    torch.cuda.empty_cache()
                print(line + " TFLOP/s", flush=True)
            del q, k, v, do, o, lse, dq, dk, dv
            cupy.get_default_memory_pool().free_all_blocks()

    s, d, heads = 16384, 128, 32  # the masked rows, over visible pairs, against causal in the same order
    q, k, v, do = (cupy.random.standard_normal((1, s, heads, d), dtype=cupy.float32).astype(BF16) for _ in range(4))
    o = cupy.zeros((1, s, heads, d), cupy.float32)
    lse = cupy.full((1, heads, s), -cupy.inf, cupy.float32)
    dq, dk, dv = (cupy.zeros((1, s, heads, d), cupy.float32) for _ in range(3))
    causal_rate = None
    for name, mask in mask_cases(s):
        visible = mask.visible_count(0, s, 0, s)
        flops = attention_flops(1, heads, d, visible)
        o.fill(0)
        lse.fill(-cupy.inf)
        be.forward_block(q, k, v, o, lse, scale=d ** -0.5, masked=True, mask=mask)

        def bwd():
            be.backward_block(q, k, v, do, lse, be.delta(do, o), dq, dk, dv, scale=d ** -0.5, masked=True, mask=mask)

        cells = run_orders(flops, bwd)
        causal_rate = causal_rate or cells
        print(f"D={d} S={s} {name}: " + ", ".join(
            f"{n} {t:.0f} ({t / causal_rate[n]:.2f}x causal)" for n, t in cells.items()) + " TFLOP/s", flush=True)


def mask_rows(families, torch, reps, dev, md_path, s=16384, d=128, heads=32):
    """Masked rows: TFLOP/s over visible pairs, ours (each family) and torch with a dense attn_mask."""
    rows = []
    q, k, v, do = (cupy.random.standard_normal((1, s, heads, d), dtype=cupy.float32).astype(BF16) for _ in range(4))
    o = cupy.zeros((1, s, heads, d), cupy.float32)
    lse = cupy.full((1, heads, s), -cupy.inf, cupy.float32)
    dq, dk, dv = (cupy.zeros((1, s, heads, d), cupy.float32) for _ in range(3))
    scale = d ** -0.5
    for name, mask in mask_cases(s):
        visible = mask.visible_count(0, s, 0, s)
        flops = attention_flops(1, heads, d, visible)
        row = {"case": name, "visible": visible / (s * s)}
        for family in families:
            be = cuda.CudaBackend.instance(family=family)

            def fwd():
                be.forward_block(q, k, v, o, lse, scale=scale, masked=True, mask=mask)

            def bwd():
                be.backward_block(q, k, v, do, lse, be.delta(do, o), dq, dk, dv, scale=scale, masked=True, mask=mask)

            row[family, "f"] = flops / time_cupy(fwd, 3, reps) / 1e9
            row[family, "b"] = 2.5 * flops / time_cupy(bwd, 2, reps) / 1e9
        if torch is not None:
            row.update(torch_masked(torch, q, k, v, do, mask, flops, reps))
        rows.append(row)
        print(row, flush=True)
    impls = list(families) + (["torch"] if torch is not None else [])
    cols = ["case", "visible pairs"] + [f"fwd {i}" for i in impls] + [f"bwd {i}" for i in impls]
    cols += [f"fwd {families[0]}/torch", f"bwd {families[0]}/torch", "torch kernel"]
    lines = ["| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
    for r in rows:
        cells = [r["case"], f"{r['visible']:.1%}"]
        cells += [fmt(r.get((i, "f"))) for i in impls] + [fmt(r.get((i, "b"))) for i in impls]
        for key in ("f", "b"):
            ours, theirs = r.get((families[0], key)), r.get(("torch", key))
            cells.append(f"{ours / theirs:.2f}x" if ours and theirs else "-")
        cells.append(r.get("torch kernel", "-"))
        lines.append("| " + " | ".join(cells) + " |")
    md = (f"{datetime.date.today().isoformat()}, {dev}, `{command()}` (bf16, B=1, H={heads}, D={d}, S={s}, causal; "
          f"TFLOP/s over visible pairs; median of 5-call CUDA-event samples)\n\n" + "\n".join(lines) + "\n")
    print()
    print(md)
    if md_path:
        Path(md_path).write_text(md)


def torch_masked(torch, q, k, v, do, mask, flops, reps):
    """torch SDPA with the same mask (dense boolean, True = visible): cuDNN if it takes it, else efficient."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def tt(x):
        return torch.as_tensor(x.view(cupy.int16), device="cuda").view(torch.bfloat16).transpose(1, 2).contiguous()

    tq, tk, tv, tdo = (tt(x) for x in (q, k, v, do))
    attn_mask, causal = None, True
    if mask.kind == "intervals":
        lo, hi = mask.device_intervals(cupy)
        pos = cupy.arange(q.shape[1], dtype=cupy.int32)
        dense = (pos[None, :] >= lo[:, None]) & (pos[None, :] < hi[:, None])
        attn_mask, causal = torch.as_tensor(dense, device="cuda"), False
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for label, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                gq, gk, gv = (x.detach().requires_grad_(True) for x in (tq, tk, tv))

                def tf():
                    with torch.no_grad():
                        sdpa(tq, tk, tv, attn_mask=attn_mask, is_causal=causal)

                out = sdpa(gq, gk, gv, attn_mask=attn_mask, is_causal=causal)

                def tb():
                    torch.autograd.grad(out, (gq, gk, gv), tdo, retain_graph=True)

                return {("torch", "f"): flops / time_torch(torch, tf, 3, reps) / 1e9,
                        ("torch", "b"): 2.5 * flops / time_torch(torch, tb, 2, reps) / 1e9, "torch kernel": label}
        except Exception as exc:  # noqa: BLE001 - the backend may not take a mask
            print(f"# torch {label} with this mask failed: {exc}", file=sys.stderr)
    return {}


def command():
    """The command line of this run, with the BURST_HPC_* settings it ran under."""
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items()) if k.startswith("BURST_HPC_")]
    return " ".join(env + ["python3", shlex.join(sys.argv)])


def fmt(x):
    return f"{x:.0f}" if x is not None else "-"


def columns(families):
    cols = []
    for _, label, _ in PHASES:
        cols += [f"{label} {f}" for f in families] + [f"{label} {t}" for _, t in TORCH]
        cols.append(f"{label} {families[0]}/cuDNN")
    return cols


def fmt_row(r, families):
    cells = [str(r["d"]), str(r["s"]), "yes" if r["causal"] else "no"]
    for key, _, _ in PHASES:
        cells += [fmt(r.get((impl, key))) for impl in tuple(families) + tuple(n for n, _ in TORCH)]
        ours, cudnn = r.get((families[0], key)), r.get(("cudnn", key))
        cells.append(f"{ours / cudnn:.2f}x" if ours and cudnn else "-")
    return "| " + " | ".join(cells) + " |"


def header(families):
    cols = ["D", "S", "causal"] + columns(families)
    return "| " + " | ".join(cols) + " |\n" + "|---" * len(cols) + "|"


def table(rows, families, dev, cmd):
    date = datetime.date.today().isoformat()
    head = (f"{date}, {dev}, `{cmd}` (bf16, B=1, H=32; TFLOP/s; median of 5-call CUDA-event samples; "
            f"families {', '.join(families)})\n\n")
    return head + header(families) + "\n" + "\n".join(fmt_row(r, families) for r in rows) + "\n"


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
