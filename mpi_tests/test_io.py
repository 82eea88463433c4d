"""HDF5 round trips under 1..4 ranks: each rank reads only its tokens and writes only its tokens.

Every test is collective: all ranks run it, in the same order, and every rank checks that the
same error reaches it when one is expected.
"""
import glob
import os
import shutil
import tempfile

import numpy as np
import pytest

from burst_hpc import io
from burst_hpc.dtypes import bfloat16
from burst_hpc.errors import BurstError, DTypeError, FileError, LayoutError, ShapeError
from burst_hpc.plan import masks
from burst_hpc.plan.layout import LAYOUTS, make_layout, shard


@pytest.fixture
def workdir(comm):
    path = tempfile.mkdtemp(prefix="burst-io-") if comm.rank == 0 else None
    path = comm.bcast(path, root=0)
    yield path
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def _global_inputs(comm, seqlen, dtype, seed=3):
    rng = np.random.default_rng(seed)
    b, hq, hkv, d = 2, 4, 2, 8
    arrays = {"q": rng.standard_normal((b, seqlen, hq, d)), "k": rng.standard_normal((b, seqlen, hkv, d)),
              "v": rng.standard_normal((b, seqlen, hkv, d)), "do": rng.standard_normal((b, seqlen, hq, d))}
    return {n: a.astype(dtype) for n, a in arrays.items()}


def _write_inputs(comm, path, arrays):
    if comm.rank == 0:
        io.write_global(path, arrays)
    comm.Barrier()


def _placed(kind, seqlen, size):
    """The Layout of ``kind``, placed by causal documents (the chunks layout places tokens by them; the
    other layouts ignore them)."""
    mask = masks.make(seqlen, causal=True, cu_seqlens=np.array([0, 3, seqlen // 2 + 1, seqlen]))
    return make_layout(kind, seqlen, size, mask)


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [bfloat16, np.float16, np.float32, np.float64], ids=lambda d: np.dtype(d).name)
def test_round_trip(comm, workdir, layout, dtype):
    seqlen = 8 * comm.size
    arrays = _global_inputs(comm, seqlen, dtype)
    src = os.path.join(workdir, f"in-{layout}.h5")
    _write_inputs(comm, src, arrays)

    layout = _placed(layout, seqlen, comm.size)
    spec, shards = io.read_shards(src, comm, layout, names=("q", "k", "v", "do"))
    assert (spec.batch, spec.seqlen, spec.heads, spec.kv_heads, spec.head_dim) == (2, seqlen, 4, 2, 8)
    assert spec.dtype == np.dtype(dtype) and spec.has_grad
    for name, part in shards.items():
        assert _same(part, shard(arrays[name], comm.rank, comm.size, layout)), name

    # write the shards back (o := q's shard, dq/dk/dv := do/k/v, lse := a rank-and-position code)
    dst = os.path.join(workdir, f"out-{layout.kind}.h5")
    lse_global = np.arange(2 * 4 * seqlen, dtype=np.float32).reshape(2, 4, seqlen)
    out = io.OutputFile.create(dst, comm, io.output_datasets(spec, backward=True), {"causal": False}, inputs=[src])
    assert not os.path.exists(dst)
    try:
        out.write({"o": shards["q"], "lse": shard(lse_global, comm.rank, comm.size, layout, axis=2),
                   "dq": shards["do"], "dk": shards["k"], "dv": shards["v"]}, layout)
        assert not os.path.exists(dst)
        out.commit()
    except BaseException:
        out.abort()
        raise
    assert os.path.exists(dst)
    result = io.read_global(dst)
    assert _same(result["o"], arrays["q"]) and _same(result["dq"], arrays["do"])
    assert _same(result["dk"], arrays["k"]) and _same(result["dv"], arrays["v"])
    assert _same(result["lse"], lse_global)
    if comm.rank == 0:
        import h5py

        with h5py.File(dst, "r") as f:
            assert f.attrs["format"] == io.FORMAT and f.attrs["burst_hpc_version"]
            assert f["o"].chunks is not None
            if np.dtype(dtype) == bfloat16:
                assert f["o"].dtype == np.uint16 and f["o"].attrs["dtype"] == "bfloat16"
    comm.Barrier()
    assert not glob.glob(os.path.join(workdir, "*.tmp*"))


def _expect_same_error(comm, cls, fragment, fn):
    with pytest.raises(cls) as info:
        fn()
    message = str(info.value)
    assert fragment in message, message
    assert getattr(info.value, "agreed", False)
    messages = comm.allgather(message)
    assert len(set(messages)) == 1, messages


@pytest.mark.parametrize("layout", LAYOUTS)
def test_read_shards_with_spec_does_not_inspect_again(comm, workdir, monkeypatch, layout):
    """read_shards(spec=...) reads the same shards as without it, and never inspects the file again."""
    from burst_hpc.io import read

    seqlen = 8 * comm.size
    arrays = _global_inputs(comm, seqlen, bfloat16)
    src = os.path.join(workdir, f"spec-{layout}.h5")
    _write_inputs(comm, src, arrays)
    names = ("q", "k", "v", "do")
    spec = io.inspect_input(src, names)

    def inspected_again(*args, **kwargs):
        raise AssertionError("the input was inspected again")

    monkeypatch.setattr(read, "_inspect", inspected_again)
    monkeypatch.setattr(read, "inspect_input", inspected_again)
    layout = _placed(layout, seqlen, comm.size)
    got, shards = io.read_shards(src, comm, layout, names, spec=spec)
    assert got is spec
    for name in names:
        assert _same(shards[name], shard(arrays[name], comm.rank, comm.size, layout)), name

    narrow = io.InputSpec(src, spec.batch, seqlen, spec.heads, spec.kv_heads, spec.head_dim, spec.dtype,
                          ("q", "k", "v"), {})
    _expect_same_error(comm, FileError, "'do' is missing",
                       lambda: io.read_shards(src, comm, layout, names, spec=narrow))


def test_missing_file_and_dataset(comm, workdir):
    contiguous = make_layout("contiguous", 4 * comm.size, comm.size)
    _expect_same_error(comm, FileError, "does not exist",
                       lambda: io.read_shards(os.path.join(workdir, "nope.h5"), comm, contiguous))
    src = os.path.join(workdir, "nodo.h5")
    arrays = _global_inputs(comm, 4 * comm.size, np.float32)
    del arrays["do"]
    _write_inputs(comm, src, arrays)
    _expect_same_error(comm, FileError, "'do' is missing",
                       lambda: io.read_shards(src, comm, contiguous, names=("q", "k", "v", "do")))


def test_bad_inputs(comm, workdir):
    arrays = _global_inputs(comm, 4 * comm.size, np.float32)
    contiguous = make_layout("contiguous", 4 * comm.size, comm.size)
    bad_shape = dict(arrays, k=arrays["k"][:, :-1], v=arrays["v"][:, :-1])
    src = os.path.join(workdir, "shape.h5")
    _write_inputs(comm, src, bad_shape)
    _expect_same_error(comm, ShapeError, "tokens", lambda: io.read_shards(src, comm, contiguous))

    src = os.path.join(workdir, "int.h5")
    _write_inputs(comm, src, {n: a.astype(np.int32) for n, a in arrays.items()})
    _expect_same_error(comm, DTypeError, "unsupported dtype int32", lambda: io.read_shards(src, comm, contiguous))

    odd = _global_inputs(comm, 2 * comm.size + 1, np.float32)
    src = os.path.join(workdir, "odd.h5")
    _write_inputs(comm, src, odd)
    # a Layout of another length, or a name (the edge makes names into Layouts, make_layout): refused alike
    _expect_same_error(comm, LayoutError, f"is of {2 * comm.size} tokens",
                       lambda: io.read_shards(src, comm, make_layout("zigzag", 2 * comm.size, comm.size)))
    _expect_same_error(comm, LayoutError, "layout must be a Layout", lambda: io.read_shards(src, comm, "zigzag"))
    if comm.size == 1:   # one rank owns the whole sequence: any length splits
        assert io.read_shards(src, comm, make_layout("zigzag", 3, 1))[1]["q"].shape[1] == 3


def test_unwritable_output_leaves_nothing(comm, workdir):
    spec = io.InputSpec("x", 1, 4 * comm.size, 2, 1, 4, np.dtype(np.float32), ("q", "k", "v"), {})
    missing_dir = os.path.join(workdir, "no-such-dir", "out.h5")
    _expect_same_error(comm, FileError, "does not exist",
                       lambda: io.OutputFile.create(missing_dir, comm, io.output_datasets(spec, False)))
    assert not os.path.exists(os.path.dirname(missing_dir))


def test_failed_write_leaves_nothing(comm, workdir):
    """One rank hands a wrong shard: every rank gets the error, no output, no temporary file."""
    seqlen = 4 * comm.size
    spec = io.InputSpec("x", 1, seqlen, 2, 1, 4, np.dtype(np.float32), ("q", "k", "v"), {})
    dst = os.path.join(workdir, "broken.h5")
    out = io.OutputFile.create(dst, comm, io.output_datasets(spec, False))
    local = seqlen // comm.size
    bad_rank = comm.size - 1
    o = np.zeros((1, local + (1 if comm.rank == bad_rank else 0), 2, 4), np.float32)
    lse = np.zeros((1, 2, local), np.float32)

    def write():
        try:
            out.write({"o": o, "lse": lse}, make_layout("contiguous", seqlen, comm.size))
            out.commit()
        except BaseException:
            out.abort()
            raise

    _expect_same_error(comm, BurstError, f"rank {bad_rank}", write)
    comm.Barrier()
    assert not os.path.exists(dst)
    assert not glob.glob(os.path.join(workdir, "*.tmp*"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mpio_and_token_passing_write_the_same(comm, workdir, layout, monkeypatch):
    """With an MPI-enabled h5py both write paths give the same datasets, bit for bit (and the
    token-passing path alone elsewhere); no temporary file is left by either."""
    import h5py

    seqlen = 8 * comm.size
    arrays = _global_inputs(comm, seqlen, bfloat16)
    spec = io.InputSpec("x", 2, seqlen, 4, 2, 8, np.dtype(bfloat16), ("q", "k", "v", "do"), {})
    lse = np.arange(2 * 4 * seqlen, dtype=np.float32).reshape(2, 4, seqlen)
    layout = _placed(layout, seqlen, comm.size)
    paths = {}
    for mpio in ([False, True] if h5py.get_config().mpi else [False]):
        monkeypatch.setenv("BURST_HPC_HDF5_MPIO", "1" if mpio else "0")
        dst = os.path.join(workdir, f"out-{layout.kind}-{mpio}.h5")
        out = io.OutputFile.create(dst, comm, io.output_datasets(spec, backward=True))
        assert out.mpio == (mpio and comm.size > 1)
        try:
            out.write({"o": shard(arrays["q"], comm.rank, comm.size, layout),
                       "lse": shard(lse, comm.rank, comm.size, layout, axis=2),
                       "dq": shard(arrays["do"], comm.rank, comm.size, layout),
                       "dk": shard(arrays["k"], comm.rank, comm.size, layout),
                       "dv": shard(arrays["v"], comm.rank, comm.size, layout)}, layout)
            out.commit()
        except BaseException:
            out.abort()
            raise
        paths[mpio] = dst
    results = {mpio: io.read_global(path) for mpio, path in paths.items()}
    for got in results.values():
        assert _same(got["o"], arrays["q"]) and _same(got["dk"], arrays["k"]) and _same(got["lse"], lse)
    if len(results) == 2:
        for name in results[False]:
            assert _same(results[False][name], results[True][name]), name
    comm.Barrier()
    assert not glob.glob(os.path.join(workdir, "*.tmp*"))
