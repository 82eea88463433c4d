"""``burst-hpc plan``: the cost model's table for one problem on one cluster (costmodel.py).

One row per scheme: predicted forward and forward+backward time, the communication left exposed
(time - compute alone), bytes the busiest GPU sends over the network (forward+backward), peak
memory per rank (forward / backward call), and the fewest tokens per GPU at which the scheme
hides its communication (within 5% of compute; forward / forward+backward). The pick is what
``scheme="auto"`` runs for this problem.
"""
import math

import numpy as np

from . import costmodel
from .accounting import BACKWARD_FLOPS, attention_flops, visible_pairs
from .errors import BurstError, MaskError, ShapeError


def problem(seqlen, batch, heads, kv_heads, head_dim, dtype, causal, window=None, cu_seqlens=None, layout=None,
            nodes=1, per_node=8, rates=None):
    """(costmodel.Problem, layout) of a planned call (``plan``'s options), or a BurstError saying why it
    has none. ``kv_heads`` None: MHA; ``window`` a causal window of that many keys (-1 or None: none);
    ``cu_seqlens`` the documents' offsets (planned_documents). The layout defaults as a call's does
    (masks.call_layout, priced with ``rates``, H100's by default); the visible share and the
    imbalance (critical path over mean work of the flat ring's schedule, workload.schedule_work's
    account) come from the mask itself."""
    from . import masks
    from .layout import check_split
    from .workload import work_of

    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads:
        raise ShapeError(f"--heads {heads} must be a multiple of --kv-heads {kv_heads}")
    window = None if window in (None, -1) else (window, 0)
    causal = causal or window is not None
    mask = masks.make(seqlen, causal, window, cu_seqlens)
    ranks = nodes * per_node
    itemsize = np.dtype(dtype).itemsize
    shape = costmodel.CallShape(batch, heads, kv_heads, head_dim, itemsize, True, per_node if nodes > 1 else None,
                                rates or costmodel.GPU_RATES["H100"])
    layout = layout or masks.call_layout(mask, causal, ranks, shape)
    check_split(seqlen, ranks, layout)
    visible = None if mask is None else visible_pairs(seqlen, causal, mask) / float(seqlen) ** 2
    work = work_of(seqlen, ranks, causal, mask, layout, "forward")
    imbalance = float(work.max(axis=1).sum() * ranks / max(1, work.sum()))
    reach = window[0] if window is not None and layout == "contiguous" else None
    return costmodel.Problem(batch, seqlen, heads, kv_heads, head_dim, itemsize, causal, visible, reach,
                             imbalance), layout


def _gib(x):
    return x / 2 ** 30


def _tokens(n):
    if n is None:
        return "never"
    return f"{n / 1024:.0f}k" if n >= 1024 else str(n)


def table(pr, cl, rates, layout="zigzag"):
    """The Markdown table and the pick."""
    pick = costmodel.pick(pr, cl, rates, layout)
    head = ("| scheme | fwd (s) | fwd exposed | fwd+bwd (s) | fwd+bwd exposed | network GB/GPU | "
            "peak GiB/rank fwd / bwd | hides from (tokens/GPU) fwd / fwd+bwd | |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for scheme in ("ring", "double_ring", "ulysses_ring"):
        why = costmodel.fits(scheme, pr, cl, layout)
        if why is not None:
            lines.append(f"| {scheme} | - | - | - | - | - | - | - | does not fit: {why} |")
            continue
        p = costmodel.predict(scheme, pr, cl, rates)
        times = (p.fwd.compute, p.bwd.compute, p.fwd.time, p.bwd.time)
        if not all(math.isfinite(t) and t > 0 for t in times):
            raise BurstError(f"the cost model leaves the floating-point range with these sizes and rates ({scheme}: "
                             f"forward compute {p.fwd.compute:.3g} s, time {p.fwd.time:.3g} s)")
        fwd_exp = p.fwd.exposed / p.fwd.time
        all_exp = p.exposed_fwdbwd / p.fwdbwd
        peak = [_gib(costmodel.peak_memory(scheme, pr, cl, b)) for b in (False, True)]
        hides = [_tokens(costmodel.hiding_tokens(scheme, pr, cl, rates, b)) for b in (False, True)]
        lines.append(f"| {scheme} | {p.fwd.time:.3g} | {fwd_exp:.1%} | {p.fwdbwd:.3g} | {all_exp:.1%} | "
                     f"{p.network_fwdbwd / 1e9:.3g} | {peak[0]:.2f} / {peak[1]:.2f} | {hides[0]} / {hides[1]} | "
                     f"{'**pick**' if scheme == pick else ''} |")
    return "\n".join(lines), pick


def describe(pr, cl, rates):
    kind = "MHA" if pr.heads == pr.kv_heads else f"GQA {pr.heads // pr.kv_heads}:1"
    mask = "causal" if pr.causal else "full"
    if pr.visible is not None:
        mask += f", {pr.visible:.3g} of the scores visible"
    return (f"{cl.nodes} nodes x {cl.per_node} {rates.name} ({cl.ranks} GPUs), S={pr.seqlen} "
            f"({pr.seqlen // cl.ranks} tokens/GPU), B={pr.batch}, Hq={pr.heads}, Hkv={pr.kv_heads} ({kind}), "
            f"D={pr.head_dim}, {pr.itemsize}-byte elements, {mask}; rates: {rates.fwd_tflops:g} / "
            f"{rates.bwd_tflops:g} TFLOP/s fwd / bwd, {rates.intra_gbps:g} GB/s inside a node, "
            f"{rates.inter_gbps:g} GB/s between nodes ({rates.inter_latency_us:g} us)")


def measure(comm, pr, per_node=None, tokens=2048, nbytes=16 << 20):
    """Rates measured here, collectively under mpiexec: one kernel timing forward and backward
    (this rank's device, ``tokens`` tokens of the problem's heads) and one exchange over each link
    class (local ranks 0 and 1 of the first node; local rank 0 of the first two nodes)."""
    import time

    import numpy as np

    from . import attention, attention_backward
    from .topology import topology

    topo = topology(comm, per_node)
    rng = np.random.default_rng(0)
    dtype = np.float32 if pr.itemsize >= 4 else np.float16
    q = rng.standard_normal((1, tokens, pr.heads, pr.head_dim)).astype(dtype)
    k = rng.standard_normal((1, tokens, pr.kv_heads, pr.head_dim)).astype(dtype)
    try:
        import cupy

        q, k = cupy.asarray(q), cupy.asarray(k)
        sync = cupy.cuda.get_current_stream().synchronize
    except Exception:  # noqa: BLE001
        sync = lambda: None  # noqa: E731
    flops = attention_flops(1, pr.heads, pr.head_dim, visible_pairs(tokens, pr.causal))
    attention(q, k, k, causal=pr.causal)
    sync()
    t0 = time.perf_counter()
    o, lse = attention(q, k, k, causal=pr.causal)
    sync()
    t1 = time.perf_counter()
    attention_backward(o, q, k, k, o, lse, causal=pr.causal)
    sync()
    t2 = time.perf_counter()
    fwd = comm.allreduce(flops / (t1 - t0) / 1e12) / comm.size
    bwd = comm.allreduce(BACKWARD_FLOPS * flops / (t2 - t1) / 1e12) / comm.size

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
    base = costmodel.GPU_RATES["H100"]
    return costmodel.Rates("measured", fwd, bwd, *(intra or (base.intra_gbps, None))[:1],
                           *(inter or (base.inter_gbps, None))[:1],
                           (intra or (0, base.intra_latency_us))[1], (inter or (0, base.inter_latency_us))[1]), topo


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


def layout_table(pr, ranks, rates, causal, window=None, cu_seqlens=None, per_node=8):
    """Per layout that splits this sequence: the critical path over the mean work (the ring waits
    for the busiest rank of every step), the steps, the visible share and, from the cost model
    step by step (costmodel.step_prediction), the communication left exposed and the TFLOP/s per
    GPU of the visible pairs at the slowest rank's pace, forward and backward. A Markdown table."""
    from . import masks
    from .layout import LAYOUTS

    mask = masks.make(pr.seqlen, causal, window, cu_seqlens)
    lines = ["| layout | critical path / mean | steps | visible share | exposed fwd / bwd | "
             "TFLOP/s per GPU fwd / bwd |", "|---|---|---|---|---|---|"]
    for layout in LAYOUTS:
        parts = ranks if layout != "zigzag" or ranks == 1 else 2 * ranks
        if pr.seqlen % parts:
            lines.append(f"| {layout} | - | - | - | - | does not split: S must be a multiple of {parts} |")
            continue
        preds = [costmodel.step_prediction(pr, ranks, rates, layout, mask, b, per_node) for b in (False, True)]
        share = accounting_share(pr.seqlen, causal, mask)
        flops = [(rates.bwd_tflops if b else rates.fwd_tflops) * p.mean / p.time for b, p in zip((False, True), preds)]
        lines.append(f"| {layout} | {preds[0].imbalance:.2f} | {preds[0].steps} | {share:.3g} | "
                     f"{preds[0].exposed:.1%} / {preds[1].exposed:.1%} | {flops[0]:.0f} / {flops[1]:.0f} |")
    return "\n".join(lines)


def accounting_share(seqlen, causal, mask):
    """Share of the S x S scores that is visible."""
    return visible_pairs(seqlen, causal, mask) / float(seqlen) ** 2
