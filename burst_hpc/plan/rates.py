"""The rates the cost model prices a call with (costmodel.py): per-pair kernel rates, per-byte link
rates, and the fixed costs per block call, per ring step and per message (issue 36); built in for
the GPUs this project measured (``GPU_RATES``), or with the fixed costs measured on this machine
(calibrate.py) where `burst-hpc compile` kept them (``rates_for``)."""
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Rates:
    """What the model prices a call with: per-pair kernel rates, per-byte link rates, and the fixed
    costs that do not shrink with the work (issue 36): each block call (a kernel launch and its
    pipeline's fill and drain), each ring step (the host's posting, waiting and bookkeeping), each
    message (its latency on its link class)."""
    name: str
    fwd_tflops: float        # kernel rate, forward (FlashAttention count)
    bwd_tflops: float        # kernel rate, backward
    intra_gbps: float        # GB/s per GPU each way inside a node
    inter_gbps: float        # GB/s per GPU each way between nodes (one NIC per GPU)
    intra_latency_us: float = 10.0   # fixed cost of one message inside a node
    inter_latency_us: float = 10.0   # fixed cost of one message between nodes
    fwd_launch_us: float = 0.0       # fixed cost of one forward block call
    bwd_launch_us: float = 0.0       # fixed cost of one backward block call
    step_us: float = 0.0             # fixed cost of one ring step


# Kernel rates from docs/BENCHMARKS.md (sm90 kernels on H100 at D=128, S >= 16k: forward 580-620,
# backward 500-558 TFLOP/s with the FlashAttention-3-shaped backward; H200 scaled by its forward).
# Links: ../shared/DEVICE.md's NCCL ring exchange on 4 x H200 (16 MiB at 130 GB/s, 64 MiB at 157 GB/s:
# 30 us a message and 170 GB/s beyond it; H100: 300 GB/s, its larger messages); 50 GB/s per GPU between
# nodes is a 400 Gb/s NIC per GPU. The launch and step fixed costs are those the 4 x H200 run of packed
# documents (issue 36, tests/test_fixed_costs.py) shows beside docs/BENCHMARKS.md's 20-40 us launches:
# 25 us a forward block call, 50 us a backward one (three or four kernels), 300 us a step; `burst-hpc
# compile` measures them on the GPU it runs on (calibrate.py). "cpu" is this library's NumPy path on
# one host (emulated nodes).
GPU_FIXED = dict(intra_latency_us=30.0, inter_latency_us=30.0, fwd_launch_us=25.0, bwd_launch_us=50.0,
                 step_us=300.0)
GPU_RATES = {
    "H100": Rates("H100", 600.0, 520.0, 300.0, 50.0, **GPU_FIXED),
    "H200": Rates("H200", 610.0, 530.0, 170.0, 50.0, **GPU_FIXED),
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
