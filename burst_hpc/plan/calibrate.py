"""The cost model's fixed costs measured on the machine it runs on (issue 36): a block call's launch
on a tiny block (forward and backward), a ring step's fixed cost and a small message's latency over
the call's transport, kept beside the kernel cache (config.kernel_cache_dir) in a small JSON file
named by the device model and this library's version. ``burst-hpc compile`` measures them (the
CUDA backend on a GPU; the NumPy backend without one, which is how the tests measure them);
rates.rates_for reads them over its built-in defaults (rates.GPU_RATES); rates given
outright (``choose_layout(rates=...)``, ``burst-hpc plan``'s overrides) still win.

A launch: the least over ROUNDS of the mean of REPEATS back-to-back block calls of one 64-row tile
of one head, the device drained after the last (the call's work is a few microseconds: the rest is
its fixed cost). A step:
a step of the ring engine (ring.run) over the transport with 1-token shards and no kernels (measured
alike), less one message. A message: ranks 0 and 1 exchanging a small message each way at once, the
way a ring step does (none on one rank: the built-in latency stays).

The kernels' prices per tile (``burst-hpc compile --tile-prices``, CUDA only): one call on this GPU over each
of TILE_CALLS (plain causal and causal documents, the backward's tiles walking up and down), its GPU time
alone (queued behind a kernel that keeps the GPU busy: the host's issue time, the launch, is priced apart and
varied the fit several-fold on a 4-GPU host); the prices (tiles.COUNTS' terms and the backward's per-token
pass) that fit those times best, each call's error relative to its time, none negative (``fit_tiles``)."""
import json
import os
import re
import socket
import time

import numpy as np

from .. import __version__, config
from ..errors import BurstError
from .pricing import TILE_PRICES as PRICED
from .tiles import packed_heads

FIXED = ("fwd_launch_us", "bwd_launch_us", "step_us", "intra_latency_us")   # the Rates fields measured here
TILES = PRICED + ("bwd_token_ns",)   # the kernels' prices (pricing.TILE_PRICES) and the backward's per-token pass
# (tokens, document length; None: plain causal) of the calls the tile prices are fitted on: short documents walk
# the backward down, long ones and plain causal up; two lengths tell the per-token pass from the tiles
TILE_CALLS = ((8192, 256), (8192, 1024), (8192, 4096), (8192, None), (32768, 2048), (32768, None))
TILE_HEADS = (32, 4)   # Hq, Hkv of those calls: enough query tiles a head to fill the GPU
REPEATS = 10
ROUNDS = 5


def device_model(backend_name, device_name=None):
    """The name the built-in rates and the measured fixed costs are kept under: 'H100' or 'H200' for
    those GPUs, the device's own name for another GPU, 'cpu' for the NumPy backend."""
    if backend_name != "cuda":
        return "cpu"
    for model in ("H200", "H100"):
        if device_name and model in device_name:
            return model
    return device_name or "H100"


def path(model):
    """Where the fixed costs of ``model`` measured with this version are kept."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", model)
    return os.path.join(config.kernel_cache_dir(), f"fixed-costs-{slug}-{__version__}.json")


def load(model):
    """{Rates field: microseconds} measured for ``model``, or None where none were (or the file does not
    read as such: it is then ignored, as the built-in defaults are a sound answer)."""
    try:
        with open(path(model)) as f:
            costs = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(costs, dict) or not all(isinstance(costs.get(k), (int, float)) for k in costs) \
            or not set(costs) <= set(FIXED + TILES):
        return None
    return {k: float(v) for k, v in costs.items() if np.isfinite(v) and v >= 0}


def save(model, costs):
    """Keep ``costs`` for ``model`` (atomically: a reader sees the old file or the new one)."""
    target = path(model)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    temporary = f"{target}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(costs, f, indent=1, sort_keys=True)
    os.replace(temporary, target)
    return target


def measure(backend, transport, xp, comm=None, head_dim=128, dtype="bfloat16"):
    """Collective on ``comm`` (the ranks of ``transport``; None: one rank): {Rates field: microseconds}
    of this machine, the same on every rank (the slowest rank's figures). ``backend`` a block backend,
    ``xp`` its array module; the block calls on ``head_dim`` and ``dtype`` (a kernel `compile` built)."""
    from ..dtypes import parse_dtype
    from . import masks

    rng = np.random.default_rng(0)
    dtype = parse_dtype(dtype) if xp is not np else np.float32   # NumPy: the CPU path's float32
    q, k, v, do = (xp.asarray(rng.standard_normal((1, 64, 1, head_dim)).astype(dtype)) for _ in range(4))
    o, dq, dk, dv = (xp.zeros(q.shape, np.float32) for _ in range(4))
    lse, delta = (xp.zeros((1, 1, 64), np.float32) for _ in range(2))
    where = dict(scale=head_dim ** -0.5, masked=True, mask=masks.make(64, causal=True))
    forward = lambda: backend.forward_block(q, k, v, o, lse, **where)  # noqa: E731
    backward = lambda: backend.backward_block(q, k, v, do, lse, delta, dq, dk, dv, **where)  # noqa: E731
    costs = {"fwd_launch_us": _least_us(forward, xp), "bwd_launch_us": _least_us(backward, xp)}
    message = _message_us(transport, xp) if transport.size > 1 else None
    costs["step_us"] = max(0.0, _step_us(transport, xp) - (message or 0.0))
    if message is not None:
        costs["intra_latency_us"] = message
    if comm is not None and comm.size > 1:
        every = comm.allgather(costs)
        costs = {name: max(c[name] for c in every) for name in costs}
    return {name: float(value) for name, value in costs.items()}


def tile_masks():
    """The masks.Mask of each of TILE_CALLS."""
    from . import masks

    return [masks.make(n, True, None, None if doc is None else np.arange(0, n + 1, doc)) for n, doc in TILE_CALLS]


def fit_tiles(samples, head_dim=128, gqa_pack=1):
    """{TILES field: ns} fitting ``samples`` [(mask, heads, forward seconds, backward seconds)] (one call each over
    the whole mask: its kernels and the backward's pass outside them, no launch; the forward's tiles holding
    ``gqa_pack`` heads under interval masks): the forward's and the backward's terms apart, by least squares on
    each call's error relative to its time, every price >= 0 (of the columns' subsets, the least error whose
    solution has none negative)."""
    from . import tiles
    from .pricing import backward_counts

    design, seconds = [], []
    for mask, heads, fwd, bwd in samples:
        per = heads * head_dim / 128 * 1e-9   # a price in ns a head at D = 128, the call's seconds
        counts = tiles.call_tiles(mask, 0, mask.seqlen, 0, mask.seqlen, not mask.is_full, gqa_pack)
        design.append(np.append(counts, mask.seqlen) * per)   # the last column: bwd_token_ns's tokens
        seconds.append((fwd, bwd))
    design, seconds = np.array(design), np.array(seconds)
    backward = np.append(backward_counts(), True)
    prices = np.zeros(len(TILES))
    for column, used in ((0, ~backward), (1, backward)):
        prices[used] = _nonnegative_fit(design[:, used] / seconds[:, column, None])
    return dict(zip(TILES, prices.tolist()))


def _nonnegative_fit(weighted):
    """x >= 0 least squares of weighted @ x = 1 (a relative error a row): of the columns' subsets, the least
    error whose solution has none negative."""
    from itertools import combinations

    best, least = np.zeros(weighted.shape[1]), np.inf
    for n in range(1, weighted.shape[1] + 1):
        for used in map(list, combinations(range(weighted.shape[1]), n)):
            solved = np.linalg.lstsq(weighted[:, used], np.ones(len(weighted)), rcond=None)[0]
            error = np.sum((weighted[:, used] @ solved - 1) ** 2)
            if (solved >= 0).all() and error < least:
                best, least = np.zeros(weighted.shape[1]), error
                best[used] = solved
    return best


def tile_times(time_call):
    """[(forward seconds, backward seconds)] of each of TILE_CALLS, timed by ``time_call(mask, heads, kv_heads,
    backward)`` (seconds of one call's GPU work, its launch not in it)."""
    heads, kv_heads = TILE_HEADS
    return [tuple(time_call(mask, heads, kv_heads, backward) for backward in (False, True)) for mask in tile_masks()]


def measure_tiles(times, head_dim=128):
    """{TILES field: ns} fitting ``times`` (tile_times' list; several ranks': the slowest of each call)."""
    heads, kv_heads = TILE_HEADS
    return fit_tiles([(mask, heads, fwd, bwd) for mask, (fwd, bwd) in zip(tile_masks(), times)], head_dim,
                     packed_heads(heads // kv_heads))


BUSY_MS = 3.0   # the GPU kept busy this long before a timed call: longer than the host takes to issue it


def gpu_call_seconds(head_dim=128, dtype="bfloat16"):
    """A ``time_call`` for measure_tiles: the least over ROUNDS of one call's GPU time between CUDA events, the
    forward (burst_hpc.attention) or the backward (attention_backward) over the whole mask on this GPU, each
    queued behind BUSY_MS of a kernel that spins (the host issues the call meanwhile: no launch gap inside)."""
    import cupy as xp

    spin = xp.RawKernel(r"""extern "C" __global__ void spin(long long cycles) {
        const long long t0 = clock64();
        while (clock64() - t0 < cycles) {}
    }""", "spin")
    cycles = np.int64(BUSY_MS * xp.cuda.Device().attributes["ClockRate"])   # the rate in kHz

    from ..api import attention, attention_backward
    from ..dtypes import parse_dtype

    def seconds(mask, heads, kv_heads, backward):
        rng = np.random.default_rng(0)
        shape = lambda h: (1, mask.seqlen, h, head_dim)  # noqa: E731
        q, do = (xp.asarray(rng.standard_normal(shape(heads), np.float32)).astype(parse_dtype(dtype)) for _ in "qd")
        k, v = (xp.asarray(rng.standard_normal(shape(kv_heads), np.float32)).astype(parse_dtype(dtype)) for _ in "kv")
        kw = mask.arguments
        o, lse = attention(q, k, v, **kw)
        call = (lambda: attention_backward(do, q, k, v, o, lse, **kw)) if backward else lambda: attention(q, k, v, **kw)
        call()
        start, end = xp.cuda.Event(), xp.cuda.Event()
        times = []
        for _ in range(ROUNDS):
            spin((1,), (1,), (cycles,))
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(xp.cuda.get_elapsed_time(start, end) * 1e-3)
        return min(times)

    return seconds


def _drain(xp):
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def _least_us(call, xp):
    """Microseconds per call: the least over ROUNDS of the mean of REPEATS back-to-back calls (after one
    to warm up), so that a busy host's stalls do not count as fixed costs."""
    call()
    _drain(xp)
    rounds = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(REPEATS):
            call()
        _drain(xp)
        rounds.append((time.perf_counter() - start) / REPEATS * 1e6)
    return min(rounds)


def _step_us(transport, xp):
    """Microseconds per step of the engine's plain ring over ``transport`` (a loopback alone: the
    engine's own bookkeeping), 1-token shards, no kernels."""
    from ..engine.ring import Route, Side, run
    from .schedule import plain_ring_steps

    size = max(2, transport.size)
    steps = plain_ring_steps(transport.rank, size, "kv", ("q",))
    route = Route(steps, transport.rank)
    sides = {"kv": Side([xp.zeros((1, 1, 1, 8), np.float16)] * 2, []), "q": Side([], [])}
    ring = transport if transport.size > 1 else Loopback(xp)
    return _least_us(lambda: run(ring, ring, route, sides, None, skip_compute=True), xp) / len(steps)


def _message_us(transport, xp):
    """Microseconds one small message takes: ranks 0 and 1 send each other one at once (the others wait)."""
    buffer, into = xp.zeros(8, np.float16), xp.zeros(8, np.float16)
    peer = {0: 1, 1: 0}.get(transport.rank)

    def ping_pong():
        if peer is not None:
            transport.exchange([(peer, [buffer])], [(peer, [into])]).wait()
            _drain(xp)

    return _least_us(ping_pong, xp)


class Loopback:
    """A transport of one rank whose sends arrive as its own receives (the engine's steps alone)."""
    rank, size = 0, 1

    def __init__(self, xp):
        self.xp = xp

    def exchange(self, sends, recvs):
        for (_, out), (_, into) in zip(sends, recvs):
            for a, b in zip(out, into):
                b[...] = a
        return self

    def wait(self):
        _drain(self.xp)


def calibrate(backend_name, comm=None, transport="auto", head_dim=128, dtype="bfloat16", tile_prices=False):
    """Collective on ``comm`` (None: this process alone): measure this machine's fixed costs with
    ``backend_name`` ('numpy' or 'cuda') over ``transport`` (block calls on ``head_dim`` and ``dtype``),
    with ``tile_prices`` the kernels' prices too (CUDA; the slowest rank's), and keep them (one rank a host
    writes the figures every rank agreed on). Returns (model, costs, file)."""
    from ..backends import get_backend
    from ..collective import agree
    from ..device import gpus_shared
    from ..transport import choose_transport, make_transport

    def agreed(error, fact=None):
        if comm is None and error is not None:
            raise error
        return [fact] if comm is None else agree(comm, error, facts=fact)

    def failure(e):
        return e if isinstance(e, BurstError) else BurstError(f"cannot measure the fixed costs here: {e}")

    error = None
    try:
        if tile_prices and backend_name != "cuda":
            raise BurstError("tile prices are the CUDA kernels': measure them with --backend cuda on a GPU")
        if backend_name == "cuda":
            import cupy as xp

            device = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)["name"].decode()
        else:
            xp, device = np, None
        backend = get_backend(xp.zeros(1), backend_name)
    except Exception as e:  # noqa: BLE001
        error = failure(e)
    agreed(error)
    several = comm is not None and comm.size > 1
    # ranks sharing a GPU (more ranks than GPUs on a node) cannot take NCCL; every rank must choose alike
    shared = several and gpus_shared(comm, xp.cuda.Device() if xp is not np else None)
    name = None
    try:
        name = choose_transport(transport, xp is not np, shared) if several else None
    except Exception as e:  # noqa: BLE001
        error = failure(e)
    names = set(agreed(error, name))
    if len(names) > 1:   # every rank holds the same names: each raises the same
        raise BurstError(f"the ranks chose different transports to measure over ({', '.join(sorted(names))}): "
                         "name one with --transport")
    try:
        ring = make_transport(name, comm, xp) if several else Loopback(xp)
    except Exception as e:  # noqa: BLE001
        error = failure(e)
    agreed(error)
    model = device_model(backend_name, device)
    costs = measure(backend, ring, xp, comm, head_dim, dtype)
    if tile_prices:   # the slowest rank's time of each call, fitted once
        times = tile_times(gpu_call_seconds(head_dim, dtype))
        every = np.array([times] if comm is None else comm.allgather(times))
        costs.update(measure_tiles(every.max(axis=0).tolist(), head_dim))
    if comm is None or comm.size == 1:
        return model, costs, save(model, costs)
    hosts = comm.allgather(socket.gethostname())
    written = save(model, costs) if hosts.index(hosts[comm.rank]) == comm.rank else None   # one rank a host
    return model, costs, comm.bcast(written)
