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


def node_ranks(comm):
    """How many ranks of ``comm`` share this node (collective)."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return local.size
    finally:
        local.Free()


def gpu_count():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver
        return 0


def gpus_shared(comm):
    """Collective: True on every rank when some node runs more ranks than it has GPUs."""
    from mpi4py import MPI

    return comm.allreduce(node_ranks(comm) > max(1, gpu_count()), op=MPI.LOR)
