"""GPU selection: one rank per GPU, by node-local rank."""


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
