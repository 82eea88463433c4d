"""Write and read GB/s per rank of burst-hpc's two HDF5 paths against the raw file system.

    mpiexec -n P python bench/io_bench.py [--mb-per-rank 128] [--dir DIR] [--reps 3]

Every rank owns a contiguous run of tokens of one float32 dataset (1, S, 16, 128), MB-per-rank
of it, as `burst-hpc run` writes its output:
- raw:    the same bytes with os.pwrite / os.preadv (into a new array) at the rank's offset of one plain file;
- tokens: io.OutputFile through rank-ordered token passing (the PyPI h5py path);
- mpio:   io.OutputFile through parallel HDF5 (only where h5py has MPI: `make setup-phdf5`).
Write time is from a barrier before the first byte to a barrier after the file is complete (the
slowest rank; for HDF5 it includes creating the file and publishing it); read time is each rank
reading its own tokens back (page cache warm: just written). No fsync on any path. GB/s per
rank = bytes per rank / time, the best of --reps. Rank 0 prints one Markdown row per path.
"""
import argparse
import os
import shutil
import tempfile
import time

import numpy as np
from mpi4py import MPI

from burst_hpc import io
from burst_hpc.plan.layout import make_layout

H, D = 16, 128
ROW = H * D * 4  # bytes per token


def timed(comm, fn):
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    comm.Barrier()
    return time.perf_counter() - t0


def raw(comm, path, data, offset):
    def write():
        if comm.rank == 0:
            open(path, "wb").close()
        comm.Barrier()
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, memoryview(data).cast("B"), offset)
        finally:
            os.close(fd)

    def read():
        buf = np.empty_like(data)  # a new array, as an HDF5 read returns
        fd = os.open(path, os.O_RDONLY)
        try:
            got = os.preadv(fd, [memoryview(buf).cast("B")], offset)
        finally:
            os.close(fd)
        assert got == data.nbytes

    return write, read


def hdf5(comm, path, data, seqlen, mpio):
    spec = {"o": ((1, seqlen, H, D), np.float32)}
    layout = make_layout("contiguous", seqlen, comm.size)

    def write():
        os.environ["BURST_HPC_HDF5_MPIO"] = "1" if mpio else "0"
        if comm.rank == 0 and os.path.exists(path):
            os.remove(path)
        comm.Barrier()
        out = io.OutputFile.create(path, comm, spec, overwrite=True)
        assert out.mpio == mpio
        try:
            out.write({"o": data}, layout)
            out.commit()
        except BaseException:
            out.abort()
            raise

    def read():
        import h5py

        kwargs = {"driver": "mpio", "comm": comm} if mpio else {}
        with h5py.File(path, "r", **kwargs) as f:
            got = io.read_tokens(f["o"], layout.slabs(comm.rank), np.float32)
        assert got.shape == data.shape

    return write, read


def main():
    import h5py

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb-per-rank", type=int, default=128)
    parser.add_argument("--dir", default=None, help="where to write (default: a new directory under /tmp)")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    tokens = max(1, args.mb_per_rank * 2**20 // ROW)
    seqlen = tokens * comm.size
    base = (args.dir or tempfile.mkdtemp(prefix="burst-iobench-")) if comm.rank == 0 else None
    base = comm.bcast(base, root=0)
    rng = np.random.default_rng(comm.rank)
    data = rng.standard_normal((1, tokens, H, D), np.float32)
    paths = [("raw", raw(comm, os.path.join(base, "raw.bin"), data, comm.rank * data.nbytes))]
    paths.append(("HDF5 token passing", hdf5(comm, os.path.join(base, "tokens.h5"), data, seqlen, False)))
    if h5py.get_config().mpi and comm.size > 1:
        paths.append(("HDF5 mpio", hdf5(comm, os.path.join(base, "mpio.h5"), data, seqlen, True)))
    rows = []
    for name, (write, read) in paths:
        tw = min(timed(comm, write) for _ in range(args.reps))
        tr = min(timed(comm, read) for _ in range(args.reps))
        gb = data.nbytes / 1e9
        rows.append(f"| {name} | {comm.size} | {gb * 1e3:.0f} | {gb / tw:.2f} | {gb * comm.size / tw:.2f} | "
                    f"{gb / tr:.2f} | {gb * comm.size / tr:.2f} |")
    if comm.rank == 0:
        print(f"h5py {h5py.__version__}, HDF5 {h5py.version.hdf5_version}, parallel: {h5py.get_config().mpi}; "
              f"{MPI.Get_library_version().splitlines()[0].strip(chr(0)).strip()}; dir {base}")
        print("| path | ranks | MB per rank | write GB/s per rank | write GB/s total | read GB/s per rank | read GB/s total |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(rows), flush=True)
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
