"""The rates the cost model prices a call with (costmodel.py, pricing.py): the kernels' seconds per tile they
run (GPUs) or per visible pair (the NumPy path), per-byte link rates, and the fixed costs per block call, per
ring step and per message (issue 36); built in for
the GPUs this project measured (``GPU_RATES``), or with the fixed costs measured on this machine
(calibrate.py) where `burst-hpc compile` kept them (``rates_for``)."""
import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Rates:
    """What the model prices a call with: the kernels' seconds per tile (tiles.COUNTS, per head at D = 128,
    scaled by D / 128; the GPU's time, all its SMs at work) and per visible pair (a rate in TFLOP/s, inf: none),
    the backward's seconds per query token and head outside its kernel, per-byte link rates, and the fixed
    costs that do not shrink with the work (issue 36): each block call (a kernel launch and its
    pipeline's fill and drain), each ring step (the host's posting, waiting and bookkeeping), each
    message (its latency on its link class)."""
    name: str
    fwd_tflops: float        # kernel rate per visible pair, forward (FlashAttention count; inf: priced by tiles)
    bwd_tflops: float        # kernel rate per visible pair, backward
    intra_gbps: float        # GB/s per GPU each way inside a node
    inter_gbps: float        # GB/s per GPU each way between nodes (one NIC per GPU)
    intra_latency_us: float = 10.0   # fixed cost of one message inside a node
    inter_latency_us: float = 10.0   # fixed cost of one message between nodes
    fwd_launch_us: float = 0.0       # fixed cost of one forward block call
    bwd_launch_us: float = 0.0       # fixed cost of one backward block call
    step_us: float = 0.0             # fixed cost of one ring step
    fwd_key_tile_ns: float = 0.0     # a forward key tile (128 x 128) of one head
    fwd_query_tile_ns: float = 0.0   # a forward query tile (128 rows) with any key: its load, merge and store
    bwd_step_ns: float = 0.0         # a backward step (64-row query tile x 128-key block) of one head
    bwd_shared_ns: float = 0.0       # a backward query tile seen by n key blocks walking up: this x sqrt(n)
    bwd_shared_down_ns: float = 0.0  # the same, its key blocks walking down (tiles.walk_down)
    bwd_token_ns: float = 0.0        # a query token of one head in the backward's pre-pass and dQ conversion


def per_pair(rates, fwd_tflops=None, bwd_tflops=None):
    """``rates`` pricing the forward (``fwd_tflops`` given) or the backward (``bwd_tflops``) kernels per visible
    pair at that rate, their tile terms off (`burst-hpc plan --fwd-tflops`)."""
    out = rates
    if fwd_tflops is not None:
        out = replace(out, fwd_tflops=fwd_tflops, fwd_key_tile_ns=0.0, fwd_query_tile_ns=0.0)
    if bwd_tflops is not None:
        out = replace(out, bwd_tflops=bwd_tflops, bwd_step_ns=0.0, bwd_shared_ns=0.0, bwd_shared_down_ns=0.0,
                      bwd_token_ns=0.0)
    return out


def scaled(rates, fwd, bwd):
    """``rates`` with the forward's kernel terms (per tile and per pair) ``fwd`` times as slow, the backward's
    ``bwd`` times (a measured call against the one predicted: `burst-hpc plan --measure`)."""
    return replace(rates, fwd_tflops=rates.fwd_tflops / fwd, bwd_tflops=rates.bwd_tflops / bwd,
                   fwd_key_tile_ns=rates.fwd_key_tile_ns * fwd, fwd_query_tile_ns=rates.fwd_query_tile_ns * fwd,
                   bwd_step_ns=rates.bwd_step_ns * bwd, bwd_shared_ns=rates.bwd_shared_ns * bwd,
                   bwd_shared_down_ns=rates.bwd_shared_down_ns * bwd, bwd_token_ns=rates.bwd_token_ns * bwd)


# Kernel prices: the sm90 kernels timed on one H100 (bench/data/sweep-2026-11-27.json, bench/predict_sweep.py:
# causal documents of 128..32768 tokens at S = 8k and 32k, Hq = 64, Hkv = 8, D = 128, bf16, the forward packing a
# K/V group's query heads), fitted by calibrate.fit_tiles as time x 132 SMs = 1.55 us a key tile + 2.87 us a
# query tile (forward, within 8.5% of every point, the bench sets within 2.2%) and 2.24 us a step + 4.69 us x
# sqrt(n) a query tile seen by n key blocks (the backward's kernel; its tiles walking down share nothing more in
# this fit), + 0.96 ns a query token and head outside it, its pre-pass and dQ conversion (memory-bound; within
# 12.3% of every point, the bench sets within 8.9%). H200: the kernels scaled by its measured forward / backward
# rates (610 / 530 TFLOP/s against H100's 600 / 520), the memory-bound pass by its bandwidth (4.8 against 3.35 TB/s).
# Links: ../shared/DEVICE.md's NCCL ring exchange on 4 x H200 (16 MiB at 130 GB/s, 64 MiB at 157 GB/s:
# 30 us a message and 170 GB/s beyond it), H100 and H200 alike (the same NVLink; at H100's former 300 GB/s, what
# 256 MiB messages reach, 8 of the 24 rows of the 2026-11-28 4 x H100 table were predicted over 15% fast, 3 at
# 170); 50 GB/s per GPU between
# nodes is a 400 Gb/s NIC per GPU. The launch fixed costs are docs/BENCHMARKS.md's 20-40 us launches: 25 us a
# forward block call, 50 us a backward one (three or four kernels); 150 us a step (an exchange's: a pass on one rank
# pays none, pricing.Costs) is what the 2 and 4 x H100
# runs of packed documents (bench/predict_documents.py) leave beside the kernels priced by their tiles (300 us
# while the kernels were priced per visible pair, which missed the tiles' own costs); `burst-hpc compile`
# measures them on the GPU it runs on (calibrate.py), and with --tile-prices the kernels' prices too. "cpu" is this library's NumPy path on one host
# (emulated nodes), priced per visible pair (its block calls compute whole blocks: no tiles of their own).
GPU_FIXED = dict(intra_latency_us=30.0, inter_latency_us=30.0, fwd_launch_us=25.0, bwd_launch_us=50.0,
                 step_us=150.0)
SMS = 132
H100_TILES = dict(fwd_key_tile_ns=1550.0 / SMS, fwd_query_tile_ns=2870.0 / SMS, bwd_step_ns=2240.0 / SMS,
                  bwd_shared_ns=4690.0 / SMS, bwd_shared_down_ns=0.0, bwd_token_ns=0.96)
H200_TILES = dict(fwd_key_tile_ns=H100_TILES["fwd_key_tile_ns"] * 600 / 610,
                  fwd_query_tile_ns=H100_TILES["fwd_query_tile_ns"] * 600 / 610,
                  bwd_step_ns=H100_TILES["bwd_step_ns"] * 520 / 530,
                  bwd_shared_ns=H100_TILES["bwd_shared_ns"] * 520 / 530,
                  bwd_shared_down_ns=H100_TILES["bwd_shared_down_ns"] * 520 / 530,
                  bwd_token_ns=H100_TILES["bwd_token_ns"] * 3.35 / 4.8)
GPU_RATES = {
    "H100": Rates("H100", math.inf, math.inf, 170.0, 50.0, **GPU_FIXED, **H100_TILES),
    "H200": Rates("H200", math.inf, math.inf, 170.0, 50.0, **GPU_FIXED, **H200_TILES),
    # the NumPy path's block call and step as `burst-hpc compile --backend numpy` measured them on a 2-core host
    "cpu": Rates("cpu", 0.02, 0.01, 5.0, 5.0, 20.0, 20.0, 120.0, 130.0, 5.0),
}


def rates_for(backend_name, device_name=None, measured=None):
    """The rates for this call's device: the built-in rates of the GPU model named in ``device_name``
    (else H100's; the NumPy backend: 'cpu'), with the fixed costs ``measured`` ({field: us}; None: those
    measured on this machine where `burst-hpc compile` kept them, calibrate.load - a decision every rank
    makes alike passes one machine's instead), and the network's rate and latency of
    BURST_HPC_EMULATE_NETWORK when it is set."""
    from . import calibrate
    from ..config import emulated_network as setting

    model = calibrate.device_model(backend_name, device_name)
    rates = GPU_RATES.get(model, GPU_RATES["cpu" if backend_name != "cuda" else "H100"])
    measured = calibrate.load(model) if measured is None else measured
    if measured:
        rates = replace(rates, **measured)
    network = setting()
    if network is not None:
        rates = replace(rates, inter_gbps=network[0] / 1e9, inter_latency_us=network[1] * 1e6)
    return rates
