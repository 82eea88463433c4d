"""``burst-hpc plan``: the cost model's table for one problem on one cluster (costmodel.py).

One row per (layout, scheme), every number from the one step-by-step model (costmodel.predict):
predicted forward and forward+backward time, the communication left exposed (time - compute
alone - the steps' fixed costs), what the fixed costs (block calls, steps, messages) add, the steps, the critical path over the mean work, TFLOP/s per GPU of the visible pairs,
bytes the busiest GPU sends over the network (forward+backward), peak memory per rank (forward /
backward call), and the fewest tokens per GPU at which the row hides its communication (within 5%
of compute; forward / forward+backward). The pick is the fastest row: the layout
``burst_hpc.choose_layout`` names, with the scheme ``scheme="auto"`` runs in it.
"""
import math
from dataclasses import replace

import numpy as np

from . import costmodel
from .memory import peak_memory
from .pricing import call_seconds
from .rates import rates_for, scaled
from .accounting import visible_pairs
from ..errors import BurstError, MaskError, ShapeError


def problem(seqlen, batch, heads, kv_heads, head_dim, dtype, causal, window=None, cu_seqlens=None):
    """The costmodel.Problem of a planned call (``plan``'s options), its mask included, or a BurstError
    saying why it has none. ``kv_heads`` None: MHA; ``window`` a causal window of that many keys (-1
    or None: none); ``cu_seqlens`` the documents' offsets (planned_documents)."""
    from . import masks

    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads:
        raise ShapeError(f"--heads {heads} must be a multiple of --kv-heads {kv_heads}")
    window = None if window in (None, -1) else (window, 0)
    mask = masks.make(seqlen, causal or window is not None, window, cu_seqlens)
    return costmodel.Problem(batch, seqlen, heads, kv_heads, head_dim, np.dtype(dtype).itemsize, mask)


def _gib(x):
    return x / 2 ** 30


def _tokens(n):
    if n is None:
        return "never"
    return f"{n / 1024:.0f}k" if n >= 1024 else str(n)


def table(pr, cl, rates, layouts):
    """The Markdown table of every (layout, scheme) of ``layouts`` ({kind: Layout or why the length does
    not split in it}, layout.layouts_for) and the pick: (text, costmodel.Prediction), the fastest
    predicted forward+backward (costmodel.best: what a call with scheme='auto' in the layout
    costmodel.choose_layout names runs)."""
    pick, found = costmodel.best(pr, cl, rates, layouts)
    head = ("| layout | scheme | fwd (s) | fwd exposed | fwd+bwd (s) | fwd+bwd exposed | fixed costs (ms) fwd / bwd | "
            "steps fwd / bwd | critical path / mean | TFLOP/s per GPU fwd / bwd | network GB/GPU | "
            "peak GiB/rank fwd / bwd | hides from (tokens/GPU) fwd / fwd+bwd | |")
    lines = [head, "|" + "---|" * 14]
    for (name, scheme), p in found.items():
        if isinstance(p, str):
            lines.append(f"| {name} | {scheme} | - | - | - | - | - | - | - | - | - | - | - | does not fit: {p} |")
            continue
        times = (p.fwd.compute, p.bwd.compute, p.fwd.time, p.bwd.time)
        if not all(math.isfinite(t) and t > 0 for t in times):
            raise BurstError(f"the cost model leaves the floating-point range with these sizes and rates ({scheme}: "
                             f"forward compute {p.fwd.compute:.3g} s, time {p.fwd.time:.3g} s)")
        flops = [x.flops / x.time / 1e12 for x in (p.fwd, p.bwd)]
        peak = [_gib(peak_memory(scheme, pr, cl, b, p.layout)) for b in (False, True)]
        hides = [_tokens(costmodel.hiding_tokens(scheme, pr, cl, rates, b, layout=p.layout))
                 for b in (False, True)]
        lines.append(f"| {name} | {scheme} | {p.fwd.time:.3g} | {p.fwd.exposed:.1%} | {p.fwdbwd:.3g} | {p.exposed:.1%} | "
                     f"{p.fwd.fixed * 1e3:.3g} / {p.bwd.fixed * 1e3:.3g} | {p.fwd.steps} / {p.bwd.steps} | {p.fwd.imbalance:.2f} | {flops[0]:.0f} / {flops[1]:.0f} | "
                     f"{p.network / 1e9:.3g} | {peak[0]:.2f} / {peak[1]:.2f} | {hides[0]} / {hides[1]} | "
                     f"{'**pick**' if p is pick else ''} |")
    return "\n".join(lines), pick


def describe(pr, cl, rates):
    kind = "MHA" if pr.heads == pr.kv_heads else f"GQA {pr.heads // pr.kv_heads}:1"
    shown = "causal" if pr.mask.causal else "full"
    if pr.mask.kind == "intervals":
        shown += f", {visible_pairs(pr.mask) / float(pr.seqlen) ** 2:.3g} of the scores visible"
    return (f"{cl.nodes} nodes x {cl.per_node} {rates.name} ({cl.ranks} GPUs), S={pr.seqlen} "
            f"({pr.seqlen // cl.ranks} tokens/GPU), B={pr.batch}, Hq={pr.heads}, Hkv={pr.kv_heads} ({kind}), "
            f"D={pr.head_dim}, {pr.itemsize}-byte elements, {shown}; rates: {kernel_words(rates)}; "
            f"{rates.intra_gbps:g} GB/s inside a node, "
            f"{rates.inter_gbps:g} GB/s between nodes; fixed costs: {rates.fwd_launch_us:g} / {rates.bwd_launch_us:g} us "
            f"a block call fwd / bwd, {rates.step_us:g} us a step, {rates.intra_latency_us:g} / "
            f"{rates.inter_latency_us:g} us a message inside / between nodes")


def placement_words(layout):
    """How a layout placed by the mask was placed, for the plan's pick line: ' (chunks of N tokens, placed by
    nodes of w, the keys each rank receives weighed at W pairs a row)', each part where it holds; '' for the
    other layouts."""
    if not layout.placed_by_mask:
        return ""
    words = [f"chunks of {layout.grain} tokens"]
    if layout.per_node:
        words.append(f"placed by nodes of {layout.per_node}")
    if layout.receive:
        words.append(f"the keys each rank receives weighed at {layout.receive} pairs a row")
    return f" ({', '.join(words)})"


def kernel_words(rates):
    """The kernels' prices of ``rates`` in words (per tile and per visible pair, those that apply)."""
    fwd = [f"{rates.fwd_key_tile_ns:.3g} ns a key tile + {rates.fwd_query_tile_ns:.3g} ns a query tile"
           ] if rates.fwd_key_tile_ns or rates.fwd_query_tile_ns else []
    bwd = [f"{rates.bwd_step_ns:.3g} ns a step + {rates.bwd_shared_ns:.3g} ns x sqrt(key blocks) a query tile "
           f"({rates.bwd_shared_down_ns:.3g} walking down) + {rates.bwd_token_ns:.3g} ns a token"
           ] if rates.bwd_step_ns or rates.bwd_shared_ns or rates.bwd_shared_down_ns or rates.bwd_token_ns else []
    fwd += [f"{rates.fwd_tflops:g} TFLOP/s"] if math.isfinite(rates.fwd_tflops) else []
    bwd += [f"{rates.bwd_tflops:g} TFLOP/s"] if math.isfinite(rates.bwd_tflops) else []
    return (f"kernels fwd {' + '.join(fwd) or 'free'}, bwd {' + '.join(bwd) or 'free'} "
            f"(tiles: a head at D = 128)")


def measure(comm, pr, per_node=None, tokens=2048, nbytes=16 << 20):
    """Rates measured here, collectively under mpiexec: one kernel timing forward and backward
    (this rank's device, ``tokens`` tokens of the problem's heads; the built-in kernel prices scaled by the
    measured time over the one they predict for that call, rates.scaled) and one exchange over each link
    class (local ranks 0 and 1 of the first node; local rank 0 of the first two nodes); the fixed
    costs of block calls and steps those of rates.rates_for (measured by `burst-hpc compile`)."""
    import time

    import numpy as np

    from .. import attention, attention_backward
    from . import masks
    from .topology import topology

    topo = topology(comm, per_node)
    rng = np.random.default_rng(0)
    dtype = np.float32 if pr.itemsize >= 4 else np.float16
    q = rng.standard_normal((1, tokens, pr.heads, pr.head_dim)).astype(dtype)
    k = rng.standard_normal((1, tokens, pr.kv_heads, pr.head_dim)).astype(dtype)
    on_gpu, device = False, None
    try:
        import cupy

        q, k = cupy.asarray(q), cupy.asarray(k)
        sync = cupy.cuda.get_current_stream().synchronize
        on_gpu, device = True, cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    except Exception:  # noqa: BLE001
        sync = lambda: None  # noqa: E731
    causal = pr.mask.causal
    attention(q, k, k, causal=causal)
    sync()
    t0 = time.perf_counter()
    o, lse = attention(q, k, k, causal=causal)
    sync()
    t1 = time.perf_counter()
    attention_backward(o, q, k, k, o, lse, causal=causal)
    sync()
    t2 = time.perf_counter()
    # the built-in kernel prices (and the fixed costs `burst-hpc compile` measured here), scaled by this call
    base = rates_for("cuda" if on_gpu else "numpy", device)
    fwd, bwd = (comm.allreduce(seconds / call_seconds(base, masks.make(tokens, causal), 1, pr.heads, pr.head_dim,
                                                      backward)) / comm.size
                for seconds, backward in ((t1 - t0, False), (t2 - t1, True)))

    def link(a, b):
        """GB/s and latency (us) of a ping-pong between ordered ranks a and b (None if absent)."""
        if max(a, b) >= comm.size:
            return None
        me = topo.ordered.rank
        big, small = np.zeros(nbytes, np.uint8), np.zeros(1, np.uint8)
        times = []
        for buf in (small, big):
            topo.ordered.Barrier()
            t = time.perf_counter()
            for _ in range(3):
                if me == a:
                    topo.ordered.Send(buf, b)
                    topo.ordered.Recv(buf, b)
                elif me == b:
                    topo.ordered.Recv(buf, a)
                    topo.ordered.Send(buf, a)
            times.append((time.perf_counter() - t) / 6)
        lat, total = topo.ordered.bcast(times if me == a else None, root=a)
        return nbytes / max(total - lat, 1e-9) / 1e9, lat * 1e6

    intra = link(0, 1) if topo.per_node > 1 else None
    inter = link(0, topo.per_node) if topo.nodes > 1 else None
    return replace(scaled(base, fwd, bwd), name="measured",
                   intra_gbps=intra[0] if intra else base.intra_gbps, inter_gbps=inter[0] if inter else base.inter_gbps,
                   intra_latency_us=intra[1] if intra else base.intra_latency_us,
                   inter_latency_us=inter[1] if inter else base.inter_latency_us), topo


def read_cu_seqlens(path):
    """Document offsets from a file: text (numbers separated by white space or commas), a .npy
    array, or an HDF5 file holding a ``cu_seqlens`` dataset (a run's input)."""
    import h5py

    try:
        if h5py.is_hdf5(path):
            with h5py.File(path, "r") as f:
                if "cu_seqlens" not in f:
                    raise MaskError(f"{path} holds no 'cu_seqlens' dataset (it has: {', '.join(sorted(f)) or 'none'})")
                return np.asarray(f["cu_seqlens"][...])
        if str(path).endswith(".npy"):
            return np.load(path, allow_pickle=False)
        with open(path) as f:
            return np.array([int(x) for x in f.read().replace(",", " ").split()], np.int64)
    except OSError as e:
        raise MaskError(f"cannot read cu_seqlens from {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise MaskError(f"cannot read cu_seqlens from {path}: {e}") from None


def planned_documents(seqlen, count=None, lengths="equal", seed=0, path=None):
    """cu_seqlens of a planned call: read from ``path``, or ``count`` documents of ``lengths``
    (equal, uniform, lognormal) drawn from ``seed``; None when neither is given."""
    from .workload import documents

    if path is not None:
        return read_cu_seqlens(path)
    if count is None:
        return None
    if count > seqlen:
        raise MaskError(f"--documents {count}: more documents than the {seqlen} tokens of --seqlen")
    return documents(np.random.default_rng(seed), seqlen, lengths, count=count)
