"""GPU selection: one rank per GPU, by node-local rank; the array module and device of an array; and how
to get CuPy, the GPU path's one extra."""

# the packages of pyproject.toml's extras cuda12 and cuda13 (burst-hpc itself is not on the public index)
HOW_TO_GET_CUPY = ("install the CuPy wheel for the driver's CUDA major version (nvidia-smi shows it): "
                   "pip install 'cupy-cuda12x>=13' (CUDA 12) or 'cupy-cuda13x>=13' (CUDA 13)")


def select_device(comm=None):
    """Make GPU (node-local rank mod GPU count) current for this rank; returns its id.

    Call it before creating CuPy arrays: CuPy allocates on the current device."""
    import cupy
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        local_rank = local.rank
    finally:
        local.Free()
    device = local_rank % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(device).use()
    return device


def gpu_count():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver
        return 0


def gpus_shared(comm, device=None):
    """Collective: True on every rank when two ranks use the same GPU (NCCL refuses that).

    ``device``: this rank's CuPy device, or None for a rank with no device data."""
    from mpi4py import MPI

    mine = None if device is None else (MPI.Get_processor_name(), device.pci_bus_id)
    used = [where for where in comm.allgather(mine) if where is not None]
    return len(set(used)) < len(used)


def array_module(x):
    """The array module of ``x``: CuPy for a CuPy array, else NumPy."""
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy
    import numpy

    return numpy


def array_device(x):
    """A CuPy array's device, as a context to enter; nothing to enter for a NumPy array."""
    import contextlib

    return x.device if type(x).__module__.startswith("cupy") else contextlib.nullcontext()


def to_host(x):
    """A NumPy array of ``x``: a copy from the GPU for a CuPy array, ``x`` itself for a NumPy array."""
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy.asnumpy(x)
    import numpy

    return numpy.asarray(x)


def sync(xp):
    """Wait for the GPU's queued work (nothing on NumPy)."""
    if xp.__name__ != "numpy":
        xp.cuda.Device().synchronize()
