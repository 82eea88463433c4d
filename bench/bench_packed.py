"""Packed documents on one GPU: burst-hpc against torch's document kernels in the same run, FlashAttention-3's
published figures beside them (issue 34).

bf16, B = 1, Hq = 64, Hkv = 8, D = 128, causal documents packed into S tokens (default 8k, 16k, 32k), drawn two ways:

- ``uniform``: lengths uniform in 1..S/4, drawn until the sequence is full (workload.documents 'capped', seed 0);
- ``magi``: MagiAttention's real-world length distribution (bench/data/doc_length_distribution.csv), sampled as
  their kernel benchmark samples it (magi_packs: their seed 42, documents chunked at S/4).

Each pass (forward, backward alone, forward+backward) is timed for ours (burst_hpc.attention and
attention_backward on CuPy arrays, cu_seqlens as host offsets), torch's ``varlen_attn`` (flash; K/V expanded to Hq
heads unless it takes ``enable_gqa``) and ``flex_attention`` (compiled, document causal block mask, enable_gqa), in
one process on the same inputs. Every peer's output and gradients are compared with ours (max abs diff); a peer off
by more than CHECK_TOLERANCE of ours' largest value is marked wrong and left out of the ratios. A sample is the
CUDA-event time of 5 calls queued back to back (bench/timing.py); the median of --reps samples after warm-up
(which also compiles every kernel, ours and flex's, before anything is timed).

TFLOP/s count accounting.attention_flops over the visible (query, key) pairs: 4 Hq D per pair forward, 2.5x that
backward, 3.5x forward+backward. MagiAttention counts the same (calculate_attn_flops: 4 x area x Hq x D, backward
2.5x, a causal document of L tokens has area L(L+1)/2, as visible_pairs counts), so one figure serves both
conventions. FA3's figures are read off MagiAttention's H100 chart (fwd+bwd derived from the two).

Each of our passes is also queued behind a kernel that keeps the GPU busy: "GPU alone" is our rate without launch
gaps between calls (every kernel of the call counted), "host ms" the host's time to issue one call. Where the host
ms exceed the timed call's length, the call is host-bound. And each is timed as MagiAttention's kernel benchmark
times the figures FA3's come from (evidence.queued, their do_bench: a 256 MB L2 flush queued before each call, CUDA
events around it, the mean of QUEUED_CALLS calls; the host issues a call while the GPU flushes): "ours, as
MagiAttention times".

After every set is timed (a torch.profiler session leaves CUPTI attached and slows the host side of every call
after it; TEARDOWN_CUPTI=1 is set unless given), a torch.profiler trace of our calls names every kernel they
launch; "outside" is the share of a call's timed length not spent in attention kernels (attn_fwd*/attn_bwd* with a
head-dim tag; delta, casts, fills, memsets and gaps all count as outside), and "attention kernels alone" our rate
were nothing outside them.

    python3 bench/bench_packed.py [--seqs 8192,16384,32768] [--dists uniform,magi] [--sets 2] [--reps 10]
                                  [--impls ours,varlen_attn,flex] [--md out.md] [--json out.json]
    python3 bench/bench_packed.py --dry-run        # no GPU: the document sets, FLOP counts, FA3 figures, and the
                                                   # share of useful pairs in the kernels' tiles (TILE_SHAPES)
"""
import argparse
import csv
import datetime
import json
import os
import re
import shlex
import statistics
import sys
import tempfile
import warnings
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from burst_hpc.plan import masks, tiles  # noqa: E402
from burst_hpc.plan.accounting import BACKWARD_FLOPS, attention_flops, visible_pairs  # noqa: E402
from burst_hpc.plan.workload import documents  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 64, 8, 128
PASSES = ("fwd", "bwd", "fwd+bwd")
IMPLS = ("ours", "varlen_attn", "flex")
DISTS = ("uniform", "magi")
LENGTHS_CSV = Path(__file__).resolve().parent / "data" / "doc_length_distribution.csv"
UNIFORM_SEED = 0
MAGI_SEED, MAGI_CHUNK_RATIO = 42, 0.25        # their kernel benchmark's SEED and chunk_ratio
# FlashAttention-3 varlen causal, H100, MagiAttention's real-world lengths capped at S/4 (assets/magi_attn/exp/
# kernel/h100/varlen_causal_mask/, read off the chart; issue 34): S -> (forward, backward alone) TFLOP/s
FA3_H100 = {8192: (483, 318), 16384: (543, 375), 32768: (583, 425)}
CHECK_TOLERANCE = 2e-2
ATTENTION_KERNEL = re.compile(r"^attn_(fwd|bwd)\w*_d\d+")
PROFILED_CALLS = 3
HOST_SAMPLES = 3
QUEUED_CALLS = 30
# tile shapes (query rows x keys) on a grid whose share of useful pairs --dry-run shows beside the sm90 forward's own
# tiles (kernel_tile_use): the forward's on a grid, the same with the 8 query heads of a K/V group packed into its
# 128 rows (PackGQA: 16 positions), the backward's
TILE_SHAPES = {"fwd 128 x 128 grid": (128, 128), "fwd PackGQA 16 x 128": (16, 128), "bwd 64 x 128": (64, 128)}


# ---------------------------------------------------------------- document sets and FLOPs (no GPU)

def read_length_table(path=LENGTHS_CSV):
    """(lengths, counts) of a binned length table ("[lo, hi]",count,...): each bin at its midpoint (lo + hi) // 2,
    as MagiAttention's DatasetSampler reads it."""
    lengths, counts = [], []
    with open(path, newline="") as f:
        rows = csv.reader(f)
        next(rows)
        for cell, count, *_ in rows:
            lo, hi = (int(x) for x in cell.strip("[]").split(","))
            lengths.append((lo + hi) // 2)
            counts.append(int(count))
    return np.array(lengths, np.int64), np.array(counts, np.int64)


def magi_packs(table, seqlen, count, seed=MAGI_SEED, chunk_ratio=MAGI_CHUNK_RATIO):
    """cu_seqlens of the first ``count`` packs MagiAttention's benchmark draws for ``seqlen`` tokens: every
    document of the table (lengths, counts) is cut into pieces of at most seqlen * chunk_ratio tokens (whole
    chunks, then the remainder), the pieces are shuffled and laid end to end, the stream is cut into packs of
    ``seqlen`` tokens (a piece crossing a cut is split there) and the packs are shuffled. The same generator and
    the same order of draws as their DatasetSampler (exps/dist_attn/benchmark/utils.py, which their kernel
    benchmark exps/attn/run_blackwell_benchmark.py draws with chunk_ratio 0.25 and seed 42), so the same packs."""
    lengths, counts = table
    chunk = seqlen * chunk_ratio
    if chunk != int(chunk) or chunk < 1:
        raise ValueError(f"seqlen * chunk_ratio must be a whole number of tokens; got {seqlen} * {chunk_ratio}")
    chunk = int(chunk)
    tails = lengths % chunk
    pieces = np.concatenate([np.full(int((lengths // chunk * counts).sum()), chunk, np.int32),
                             np.repeat(tails[tails > 0], counts[tails > 0]).astype(np.int32)])
    rng = np.random.default_rng(seed)
    rng.shuffle(pieces)
    ends = np.cumsum(pieces, dtype=np.int64)
    order = np.arange(int(ends[-1] // seqlen))
    rng.shuffle(order)
    packs = []
    for index in order[:count]:
        start = int(index) * seqlen
        inside = ends[np.searchsorted(ends, start, "right"):np.searchsorted(ends, start + seqlen, "left")]
        packs.append(np.concatenate([[0], inside - start, [seqlen]]).astype(np.int64))
    return packs


def document_sets(kind, seqlen, sets):
    """``sets`` cu_seqlens of ``kind`` ('uniform' or 'magi') documents, S/4 tokens at most, filling seqlen."""
    if kind == "uniform":
        rng = np.random.default_rng(UNIFORM_SEED)
        return [documents(rng, seqlen, "capped", longest=seqlen // 4) for _ in range(sets)]
    if kind == "magi":
        return magi_packs(read_length_table(), seqlen, sets)
    raise ValueError(f"document distribution must be one of {', '.join(DISTS)}; got {kind!r}")


def pass_flops(mask, heads=HEADS, head_dim=HEAD_DIM):
    """{pass: FLOPs} of one call over ``mask``'s visible pairs (accounting's count, MagiAttention's too)."""
    pairs = visible_pairs(mask)
    forward, backward = (attention_flops(1, heads, head_dim, pairs, backward=b) for b in (False, True))
    return {"fwd": forward, "bwd": backward, "fwd+bwd": forward + backward}


def combined_rate(forward, backward):
    """TFLOP/s of forward+backward from the two passes' rates (the backward counting BACKWARD_FLOPS x)."""
    return (1 + BACKWARD_FLOPS) / (1 / forward + BACKWARD_FLOPS / backward)


def fa3_published(seqlen):
    """{pass: TFLOP/s} of FA3 from MagiAttention's chart at this length ({} where it has none)."""
    if seqlen not in FA3_H100:
        return {}
    forward, backward = FA3_H100[seqlen]
    return {"fwd": forward, "bwd": backward, "fwd+bwd": combined_rate(forward, backward)}


def is_attention_kernel(name):
    """Whether a device activity of our calls is an attention kernel (the forward or backward tile loop, named
    attn_fwd*/attn_bwd* with a head-dim tag), not a helper (delta, row/range/order pre-passes), cast, fill or memset."""
    return ATTENTION_KERNEL.match(name) is not None


def outside_share(kernels, call_us):
    """Share of a call's ``call_us`` microseconds outside attention kernels, from {kernel name: us per call}."""
    attention = sum(us for name, us in kernels.items() if is_attention_kernel(name))
    return 1.0 - attention / call_us


# ---------------------------------------------------------------- the GPU side

def bf16_inputs(seqlen):
    """q, do (1, S, Hq, D) and k, v (1, S, Hkv, D): fresh standard normal bf16 CuPy arrays."""
    import cupy

    from burst_hpc.dtypes import bfloat16

    shapes = ((1, seqlen, HEADS, HEAD_DIM), (1, seqlen, KV_HEADS, HEAD_DIM))
    return tuple(cupy.random.standard_normal(shapes[name in "kv"], dtype=cupy.float32).astype(bfloat16)
                 for name in ("q", "k", "v", "do"))


def as_torch(torch, x):
    """A CuPy bf16 array as a torch bf16 tensor on the same memory."""
    import cupy

    return torch.as_tensor(x.view(cupy.int16), device="cuda").view(torch.bfloat16)


def median_ms(sample, fn, warm, reps):
    for _ in range(warm):
        fn()
    return statistics.median(sample(fn) for _ in range(reps))


def our_calls(q, k, v, do, cu):
    """{pass: fn} of burst_hpc's public calls on these inputs (the backward's o, lse from one forward call)."""
    import burst_hpc

    kw = dict(causal=True, cu_seqlens=cu)

    def fwd():
        return burst_hpc.attention(q, k, v, **kw)

    o, lse = fwd()

    def bwd():
        return burst_hpc.attention_backward(do, q, k, v, o, lse, **kw)

    def fwdbwd():
        burst_hpc.attention_backward(do, q, k, v, *fwd(), **kw)

    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwdbwd}


def time_ours(q, k, v, do, cu, reps):
    """({pass: ms}, (o, dq, dk, dv), {pass: (host ms, GPU ms) per call}, {pass: ms}) of burst_hpc's public calls:
    the timed call, its outputs, each pass queued behind a busy GPU (the host's issue time; the GPU's time without
    launch gaps), the median of HOST_SAMPLES, and each timed as MagiAttention times (evidence.queued)."""
    import cupy
    from mpi4py import MPI

    from evidence import queued
    from timing import cupy_host_and_gpu_sample, cupy_sample

    calls = our_calls(q, k, v, do, cu)
    warm = {"fwd": 3, "bwd": 2, "fwd+bwd": 2}
    ms = {p: median_ms(cupy_sample, fn, warm[p], reps) for p, fn in calls.items()}
    split = {}
    for p, fn in calls.items():
        samples = [cupy_host_and_gpu_sample(fn) for _ in range(HOST_SAMPLES)]
        split[p] = tuple(statistics.median(x) for x in zip(*samples))
    as_magi = {p: 1e3 * queued(MPI.COMM_SELF, fn, QUEUED_CALLS, warm[p], xp=cupy) for p, fn in calls.items()}
    o = calls["fwd"]()[0]
    return ms, (o,) + calls["bwd"](), split, as_magi


def kernel_times(fn, calls=PROFILED_CALLS):
    """{name: microseconds per call} of every kernel, memset and copy ``fn`` puts on the device, from a
    torch.profiler (CUPTI) trace, which sees CuPy's launches as well as torch's."""
    import cupy
    from torch.profiler import ProfilerActivity, profile

    cupy.cuda.Device().synchronize()
    warnings.filterwarnings("ignore", message=".*Profiler clears events")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        cupy.cuda.Device().synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    times = defaultdict(float)
    for event in events:
        if event.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "dur" in event:
            times[event["name"]] += event["dur"] / calls
    return dict(times)


def varlen_peer(torch, q, k, v, do, cu):
    """torch.nn.attention.varlen.varlen_attn on (T, H, D) views of our arrays: (fn(q, k, v) -> out, the inputs,
    a map of its (o, dq, dk, dv) onto ours' (S, H, D) layout)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    tq, tk, tv, tdo = (as_torch(torch, x)[0] for x in (q, k, v, do))
    kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    group = HEADS // KV_HEADS
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    else:
        tk, tv = (x.repeat_interleave(group, dim=1) for x in (tk, tv))
    offsets = torch.tensor(cu, dtype=torch.int32, device="cuda")
    longest = int(np.diff(cu).max())

    def fn(a, b, c):
        return varlen_attn(a, b, c, offsets, offsets, longest, longest, **kw)

    def ours_layout(o, dq, dk, dv):
        if "enable_gqa" not in kw:   # gradients of the expanded heads, summed over each group
            dk, dv = (g.float().view(g.shape[0], KV_HEADS, group, HEAD_DIM).sum(2) for g in (dk, dv))
        return o, dq, dk, dv

    return fn, (tq, tk, tv, tdo), ours_layout


_flex = {}


def flex_peer(torch, q, k, v, do, cu):
    """Compiled flex_attention with a document causal block mask on (1, H, S, D) copies, as varlen_peer."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    seqlen = q.shape[1]
    if "compiled" not in _flex:
        _flex["compiled"] = torch.compile(flex_attention, dynamic=False)
    if seqlen not in _flex:
        # one mask_mod and one document-id buffer per length: a new set refills the buffer, so the compiled
        # function never sees a new closure (no recompilation per document set)
        document = torch.empty(seqlen, dtype=torch.int32, device="cuda")

        def mask_mod(b, h, q_idx, kv_idx):
            return (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)

        _flex[seqlen] = document, mask_mod
    document, mask_mod = _flex[seqlen]
    document.copy_(torch.as_tensor(np.repeat(np.arange(len(cu) - 1), np.diff(cu)), dtype=torch.int32))
    block_mask = create_block_mask(mask_mod, None, None, seqlen, seqlen, device="cuda")
    inputs = tuple(as_torch(torch, x).transpose(1, 2).contiguous() for x in (q, k, v, do))

    def fn(a, b, c):
        return _flex["compiled"](a, b, c, block_mask=block_mask, enable_gqa=True)

    def ours_layout(*outputs):
        return tuple(x.transpose(1, 2)[0] for x in outputs)

    return fn, inputs, ours_layout


PEERS = {"varlen_attn": varlen_peer, "flex": flex_peer}


def peer_signature(torch):
    """varlen_attn's signature in this torch (how it takes causal and GQA), or why it is missing."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:
        return f" missing: {exc}"
    return str(inspect.signature(varlen_attn))


def time_peer(torch, fn, inputs, reps):
    """({pass: ms}, (o, dq, dk, dv)) of a torch attention function; its backward alone is autograd.grad over a
    retained graph (fresh gradient tensors, like our call's)."""
    from timing import torch_sample

    tq, tk, tv, tdo = inputs
    leaves = tuple(x.detach().requires_grad_(True) for x in (tq, tk, tv))

    def fwd():
        with torch.no_grad():
            fn(tq, tk, tv)

    def fwdbwd():
        torch.autograd.grad(fn(*leaves), leaves, tdo)

    out = fn(*leaves)

    def bwd():
        return torch.autograd.grad(out, leaves, tdo, retain_graph=True)

    ms = {"fwd": median_ms(lambda f: torch_sample(torch, f), fwd, 3, reps),
          "bwd": median_ms(lambda f: torch_sample(torch, f), bwd, 2, reps),
          "fwd+bwd": median_ms(lambda f: torch_sample(torch, f), fwdbwd, 2, reps)}
    return ms, (out.detach(),) + bwd()


def differences(ours, theirs):
    """{output: (max abs diff, that over ours' largest magnitude)} for o, dq, dk, dv."""
    out = {}
    for name, a, b in zip(("o", "dq", "dk", "dv"), ours, theirs):
        a = a.float()
        diff = float((b.float() - a).abs().max())
        out[name] = (diff, diff / max(float(a.abs().max()), 1e-30))
    return out


def measure_set(torch, seqlen, cu, impls, reps):
    """One document set: {'ms': {impl: {pass: ms}}, 'tflops', 'diffs', 'ok', 'kernels'}."""
    import cupy

    mask = masks.make(seqlen, True, None, cu)
    flops = pass_flops(mask)
    q, k, v, do = bf16_inputs(seqlen)
    result = {"ms": {}, "diffs": {}, "ok": {}, "errors": {}}
    ms, ours_out, result["split"], as_magi = time_ours(q, k, v, do, cu, reps)
    result["ms"]["ours"] = ms
    reference = tuple(as_torch(torch, x)[0] for x in ours_out)
    for impl in impls:
        if impl == "ours":
            continue
        try:
            fn, inputs, ours_layout = PEERS[impl](torch, q, k, v, do, cu)
            ms, outputs = time_peer(torch, fn, inputs, reps)
        except Exception as exc:  # noqa: BLE001 - a peer this torch lacks or refuses: say so, measure the rest
            result["errors"][impl] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"# {impl} failed at S={seqlen}: {result['errors'][impl]}", flush=True)
            continue
        diffs = differences(reference, ours_layout(*outputs))
        result["ms"][impl], result["diffs"][impl] = ms, diffs
        result["ok"][impl] = all(rel <= CHECK_TOLERANCE for _, rel in diffs.values())
        del fn, inputs, outputs
    result["tflops"] = {impl: {p: flops[p] / t / 1e9 for p, t in ms.items()} for impl, ms in result["ms"].items()}
    result["gpu_tflops"] = {p: flops[p] / gpu / 1e9 for p, (_, gpu) in result["split"].items()}
    result["magi_tflops"] = {p: flops[p] / t / 1e9 for p, t in as_magi.items()}
    del q, k, v, do, ours_out, reference
    cupy.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()
    return result


def profile_set(seqlen, cu, result):
    """Our calls' kernels on one set ({pass: {kernel: us per call}}) and the share of each timed pass outside
    attention kernels, into ``result``. Runs after every set is timed: a torch.profiler session leaves CUPTI
    attached to the process, which would slow the host side of every call timed after it."""
    import cupy

    q, k, v, do = bf16_inputs(seqlen)
    calls = our_calls(q, k, v, do, cu)
    kernels = result["kernels"] = {p: kernel_times(calls[p]) for p in ("fwd", "bwd")}
    result["outside"] = {p: outside_share(kernels[p], result["ms"]["ours"][p] * 1e3) for p in ("fwd", "bwd")}
    both = {name: kernels["fwd"].get(name, 0.0) + kernels["bwd"].get(name, 0.0)
            for name in set(kernels["fwd"]) | set(kernels["bwd"])}
    result["outside"]["fwd+bwd"] = outside_share(both, result["ms"]["ours"]["fwd+bwd"] * 1e3)
    del q, k, v, do, calls
    cupy.get_default_memory_pool().free_all_blocks()


# ---------------------------------------------------------------- the report

def describe(cu):
    lengths = np.diff(cu)
    return {"documents": int(lengths.size), "longest": int(lengths.max()), "mean": float(lengths.mean())}


def plan(args):
    """{(seqlen, kind): [cu_seqlens, ...]} of the run."""
    return {(s, kind): document_sets(kind, s, args.sets) for s in args.seqs for kind in args.dists}


def tile_use(mask, rows, keys):
    """The share of the (query, key) pairs a kernel computes that ``mask`` leaves visible, when it runs blocks of
    ``rows`` queries against the tiles of ``keys`` keys that some row of the block sees (the interval kernels do:
    a block's visible keys are one run of tiles), every tile whole; None unless both divide the sequence."""
    if mask.seqlen % rows or mask.seqlen % keys:
        return None
    counts = masks.block_counts(mask, rows, keys)
    return float(counts.sum()) / (np.count_nonzero(counts) * rows * keys)


def kernel_tile_use(mask, rows=128, keys=128):
    """The share of the pairs the sm90 forward computes that ``mask`` leaves visible: its query tiles
    (plan/tiles.forward_tiles: a long document's from its first row), each rows x keys a key tile, whole."""
    t = tiles.forward_tiles(mask, 0, mask.seqlen, 0, mask.seqlen, rows, keys)
    return visible_pairs(mask) / (float(t.key_tiles.sum()) * rows * keys)


def dry_run(sets):
    lines = ["| S | documents | set | count | longest | mean | fwd GFLOP | bwd GFLOP | fwd+bwd GFLOP | FA3 published "
             "fwd / bwd / fwd+bwd | pairs used, fwd (the kernel's tiles) | "
             + " | ".join(f"pairs used, {name}" for name in TILE_SHAPES) + " |",
             "|---" * (11 + len(TILE_SHAPES)) + "|"]
    for (seqlen, kind), cus in sets.items():
        fa3 = fa3_published(seqlen)
        for index, cu in enumerate(cus):
            mask = masks.make(seqlen, True, None, cu)
            d, flops = describe(cu), pass_flops(mask)
            lines.append(f"| {seqlen} | {kind} | {index} | {d['documents']} | {d['longest']} | {d['mean']:.0f} | "
                         + " | ".join(f"{flops[p] / 1e9:.1f}" for p in PASSES) + " | "
                         + (" / ".join(f"{fa3[p]:.0f}" for p in PASSES) if fa3 else "-") + " | "
                         + f"{kernel_tile_use(mask):.0%} | "
                         + " | ".join(f"{use:.0%}" if use is not None else "-"
                                      for use in (tile_use(mask, *shape) for shape in TILE_SHAPES.values())) + " |")
    return "\n".join(lines)


def mean_over_sets(rows, key, impl, pass_):
    values = [r[key][impl][pass_] for r in rows if impl in r[key] and r["ok"].get(impl, True)]
    return statistics.mean(values) if values else None


def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "-"


def report(results, args, device, versions):
    """The Markdown tables of a run: TFLOP/s (means over the sets) with ratios, then the kernels of one call."""
    peers = [i for i in args.impls if i != "ours"]
    head = ["S", "documents (per set)", "pass"] + list(args.impls) + ["FA3 (published)"]
    head += [f"ours / {p}" for p in peers] + ["ours / FA3", "ours outside attention kernels",
                                               "ours, attention kernels alone", "ours, GPU alone", "ours, host ms",
                                               "ours, as MagiAttention times", "that / FA3"]
    lines = [f"{datetime.date.today().isoformat()}, {device}, {versions}: `{command()}` (bf16, B = 1, Hq = {HEADS}, "
             f"Hkv = {KV_HEADS}, D = {HEAD_DIM}, causal documents; TFLOP/s over the visible pairs, backward 2.5x "
             f"forward (ours = MagiAttention's count), mean over {args.sets} document sets of the median of "
             f"{args.reps} five-call CUDA-event samples)", "",
             "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for (seqlen, kind), rows in results.items():
        fa3 = fa3_published(seqlen)
        docs = ", ".join(str(r["describe"]["documents"]) for r in rows)
        for p in PASSES:
            rates = {impl: mean_over_sets(rows, "tflops", impl, p) for impl in args.impls}
            outside = statistics.mean(r["outside"][p] for r in rows)
            alone = statistics.mean(r["tflops"]["ours"][p] / (1 - r["outside"][p]) for r in rows)
            cells = [str(seqlen), f"{kind} ({docs})", p] + [f"{rates[i]:.0f}" if rates[i] else "-"
                                                            for i in args.impls]
            cells.append(f"{fa3[p]:.0f}" if fa3 else "-")
            cells += [ratio(rates.get("ours"), rates[i]) for i in peers]
            gpu = statistics.mean(r["gpu_tflops"][p] for r in rows)
            host = statistics.mean(r["split"][p][0] for r in rows)
            as_magi = statistics.mean(r["magi_tflops"][p] for r in rows)
            cells += [ratio(rates.get("ours"), fa3.get(p)), f"{outside:.0%}", f"{alone:.0f}", f"{gpu:.0f}",
                      f"{host:.2f}", f"{as_magi:.0f}", ratio(as_magi, fa3.get(p))]
            lines.append("| " + " | ".join(cells) + " |")
    wrong = [(key, impl, r["diffs"][impl]) for key, rows in results.items() for r in rows
             for impl, ok in r["ok"].items() if not ok]
    checks = [max(rel for _, rel in r["diffs"][impl].values()) for rows in results.values() for r in rows
              for impl in r["diffs"]]
    lines += ["", f"Every peer's o, dq, dk, dv against ours: largest |diff| / max |ours| {max(checks):.2g}"
              if checks else "", *(f"WRONG: {impl} at {key}: {diffs}" for key, impl, diffs in wrong)]
    first_key = next(iter(results))
    first = results[first_key][0]
    lines += ["", f"Our calls' device work at S = {first_key[0]}, {first_key[1]} set 0 (torch.profiler, "
              f"microseconds per call; * = attention kernel):", "", "| pass | kernel | us |", "|---|---|---|"]
    for p in ("fwd", "bwd"):
        for name, us in sorted(first["kernels"][p].items(), key=lambda item: -item[1]):
            lines.append(f"| {p} | {'*' if is_attention_kernel(name) else ''}`{name[:80]}` | {us:.0f} |")
    return "\n".join(lines) + "\n"


def command():
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items()) if k.startswith("BURST_HPC_")]
    return " ".join(env + ["python3", shlex.join(sys.argv)])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="8192,16384,32768", help="comma-separated total tokens S")
    ap.add_argument("--dists", default=",".join(DISTS), help="document length distributions: uniform, magi")
    ap.add_argument("--sets", type=int, default=2, help="document sets per S and distribution")
    ap.add_argument("--reps", type=int, default=10, help="timing samples per pass (median)")
    ap.add_argument("--impls", default=",".join(IMPLS), help="ours first, then any of varlen_attn, flex")
    ap.add_argument("--md", default=None, help="write the Markdown report here")
    ap.add_argument("--json", default=None, help="write every set's numbers here")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: the document sets and FLOP counts only")
    args = ap.parse_args(argv)
    args.seqs = tuple(int(x) for x in args.seqs.split(","))
    args.dists = tuple(args.dists.split(","))
    args.impls = tuple(args.impls.split(","))
    for kind in args.dists:
        if kind not in DISTS:
            ap.error(f"--dists: unknown distribution {kind!r}; use {', '.join(DISTS)}")
    if args.impls[0] != "ours" or any(i not in IMPLS for i in args.impls):
        ap.error(f"--impls: ours first, then any of {', '.join(IMPLS[1:])}; got {','.join(args.impls)}")
    if any(s % 4 for s in args.seqs) or args.sets < 1 or args.reps < 1:
        ap.error("--seqs must be multiples of 4 (documents up to S/4), --sets and --reps at least 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    sets = plan(args)
    if args.dry_run:
        print(dry_run(sets))
        return sets
    import cupy

    os.environ.setdefault("TEARDOWN_CUPTI", "1")   # the profiler lets CUPTI go when it ends (Kineto's switch)
    import torch

    device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    versions = f"torch {torch.__version__}, CuPy {cupy.__version__}"
    limits = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):    # flex compiles once per length and grad mode
        if hasattr(limits, name):
            setattr(limits, name, max(64, getattr(limits, name)))
    print(f"# {device}; {versions}; varlen_attn{peer_signature(torch)}", flush=True)
    results = {}
    for (seqlen, kind), cus in sets.items():
        rows = results[seqlen, kind] = []
        for index, cu in enumerate(cus):
            row = measure_set(torch, seqlen, cu, args.impls, args.reps)
            row["describe"] = describe(cu)
            rows.append(row)
            print(json.dumps({"S": seqlen, "documents": kind, "set": index, **row["describe"],
                              "tflops": {i: {p: round(t, 1) for p, t in r.items()} for i, r in row["tflops"].items()},
                              "ours_host_ms": {p: round(h, 3) for p, (h, _) in row["split"].items()},
                              "ours_gpu_tflops": {p: round(t, 1) for p, t in row["gpu_tflops"].items()},
                              "max_rel_diff": {i: max(rel for _, rel in d.values()) for i, d in row["diffs"].items()},
                              "errors": row["errors"]}), flush=True)
    for (seqlen, kind), rows in results.items():   # profiled last: see profile_set
        for cu, row in zip(sets[seqlen, kind], rows):
            profile_set(seqlen, cu, row)
    md = report(results, args, device, versions)
    print("\n" + md, flush=True)
    if args.md:
        Path(args.md).write_text(md)
    if args.json:
        Path(args.json).write_text(json.dumps([{"S": s, "documents": kind, "set": i, "cu_seqlens": cu.tolist(), **row}
                                               for (s, kind), rows in results.items()
                                               for i, (cu, row) in enumerate(zip(sets[s, kind], rows))], default=float))
    return results


if __name__ == "__main__":
    main()
