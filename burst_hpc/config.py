"""Every BURST_HPC_* environment setting, each read and checked in one function here (at call time,
so a job or a test may set it before any call). docs/USAGE.md lists them for users.

| variable | meaning |
|---|---|
| BURST_HPC_RANKS_PER_NODE=W | treat every W ranks of a host as one node (emulation, tests) |
| BURST_HPC_NODE_ID=ID | this rank's node as the launcher knows it (e.g. $SLURM_NODEID) |
| BURST_HPC_EMULATE_NETWORK=GBPS[,LATENCY_US] | hold transfers between nodes to an emulated NIC |
| BURST_HPC_CUDA_AWARE=1/0 | override what the MPI library says of its CUDA support |
| BURST_HPC_KERNELS=sm80 | force a kernel family (the mma.sync one on Hopper) |
| BURST_HPC_CUDA_DIR=DIR | read the kernel sources from DIR instead of the package |
| BURST_HPC_NO_JIT=1 | never compile a kernel: one missing from the cache is an error naming `burst-hpc compile` |
| CUPY_CACHE_DIR=DIR | (CuPy's) where compiled kernels are kept; burst-hpc's entries in DIR/burst_hpc |
| BURST_HPC_HDF5_MPIO=0 | write outputs by rank-ordered token passing even with parallel HDF5 |
| BURST_HPC_SPACE_CHECK=0 | skip the free-space check before writing (quotas can misreport it) |
| BURST_HPC_PROGRESS_SECONDS=S | seconds between the progress lines inside a pass (default 5) |
| BURST_HPC_VERIFY_ON_GPU=0 | a cuda run's --verify checks on host copies of its shards (NumPy) instead of on its GPUs |
| BURST_HPC_TEST_HOOK_VERIFY_PAUSE=S | tests only: every rank sleeps S seconds as verification starts |
| BURST_HPC_RING_LAST_PAIRS=1 | the ring's passes let each row's last block pair write the output in the inputs' dtype (off until it has run on GPUs) |
"""
import os

from .errors import BurstError, TopologyError, TransportError

ON = ("1", "yes", "true", "on")
OFF = ("0", "no", "false", "off")


def _value(name):
    return os.environ.get(name, "").strip()


def ranks_per_node():
    """BURST_HPC_RANKS_PER_NODE as a positive int, or None (detect the nodes)."""
    value = _value("BURST_HPC_RANKS_PER_NODE")
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise TopologyError(f"BURST_HPC_RANKS_PER_NODE must be a positive integer; got {value!r}")
    return int(value)


def node_id():
    """BURST_HPC_NODE_ID (any text), or None."""
    return _value("BURST_HPC_NODE_ID") or None


def emulated_network():
    """(bytes per second, latency in seconds) from BURST_HPC_EMULATE_NETWORK, or None."""
    value = _value("BURST_HPC_EMULATE_NETWORK")
    if not value:
        return None
    try:
        parts = [float(x) for x in value.split(",")]
        gbps, latency_us = parts[0], parts[1] if len(parts) > 1 else 0.0
        if not gbps > 0 or not latency_us >= 0 or len(parts) > 2 or gbps == float("inf"):
            raise ValueError
    except ValueError:
        raise TransportError(f"BURST_HPC_EMULATE_NETWORK must be 'GBPS[,LATENCY_US]' with GBPS > 0; "
                             f"got {value!r}") from None
    return gbps * 1e9, latency_us * 1e-6


def cuda_aware():
    """BURST_HPC_CUDA_AWARE as (True or False, the text), or None when unset."""
    value = _value("BURST_HPC_CUDA_AWARE")
    return None if not value else (value.lower() in ON, f"BURST_HPC_CUDA_AWARE={value}")


def hdf5_mpio():
    """False when BURST_HPC_HDF5_MPIO=0 (parallel HDF5 off); True otherwise."""
    return _value("BURST_HPC_HDF5_MPIO") != "0"


def space_check():
    """False when BURST_HPC_SPACE_CHECK=0; True otherwise."""
    return _value("BURST_HPC_SPACE_CHECK") != "0"


PROGRESS_SECONDS = 5.0


PLAN_SETTINGS = ("BURST_HPC_RANKS_PER_NODE", "BURST_HPC_NODE_ID", "BURST_HPC_EMULATE_NETWORK", "BURST_HPC_CUDA_AWARE",
                 "BURST_HPC_KERNELS")


def plan_settings():
    """The raw text of every setting a call's plan reads (nodes, network, transport, kernel family),
    as a tuple: part of the key its Decomposition is kept under (decomposition.DecompositionKey)."""
    return tuple(_value(name) for name in PLAN_SETTINGS)


def progress_seconds():
    """BURST_HPC_PROGRESS_SECONDS: seconds between the progress lines inside a pass, a number > 0
    (default PROGRESS_SECONDS)."""
    value = _value("BURST_HPC_PROGRESS_SECONDS")
    if not value:
        return PROGRESS_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise BurstError(f"BURST_HPC_PROGRESS_SECONDS must be a number of seconds > 0; got {value!r}")
    return seconds


def verify_on_gpu():
    """False when BURST_HPC_VERIFY_ON_GPU is off (0, no, false, off): a cuda run's --verify then runs on
    host copies of its shards (NumPy); by default on its GPUs (CuPy, float64)."""
    return _value("BURST_HPC_VERIFY_ON_GPU").lower() not in OFF


def kernel_family():
    """BURST_HPC_KERNELS (a kernel family name), or None."""
    return _value("BURST_HPC_KERNELS") or None


def cuda_dir():
    """BURST_HPC_CUDA_DIR, or None (the package's own kernel sources)."""
    return _value("BURST_HPC_CUDA_DIR") or None


def no_jit():
    """True when BURST_HPC_NO_JIT is on (1, yes, true, on): kernels come from the cache only."""
    return _value("BURST_HPC_NO_JIT").lower() in ON


def ring_last_pairs():
    """True when BURST_HPC_RING_LAST_PAIRS is on: the ring passes flag each row's last block pair (passes.py)."""
    return _value("BURST_HPC_RING_LAST_PAIRS").lower() in ON


def kernel_cache_dir():
    """The directory of burst-hpc's kernel cache entries: burst_hpc/ inside CuPy's cache directory
    ($CUPY_CACHE_DIR, else CuPy's default ~/.cupy/kernel_cache), which holds the compiled code."""
    return os.path.join(_value("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache"), "burst_hpc")


TEST_HOOK_VERIFY_PAUSE = "BURST_HPC_TEST_HOOK_VERIFY_PAUSE"


def test_hook_verify_pause():
    """Seconds every rank sleeps as verification starts: a test hook (tests/test_jobsafety.py signals
    a job inside its verification), not a setting; 0 unless set."""
    value = _value(TEST_HOOK_VERIFY_PAUSE)
    return float(value) if value else 0.0
