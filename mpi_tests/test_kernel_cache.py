"""compile.prepare across ranks, on a fake compiler that logs every compile (tests/fake_compiler.py): a node's
ranks share a call's builds out and compile each once; nodes sharing a cache directory (a shared file
system) compile each once in all; an error or BURST_HPC_NO_JIT is the same error on every rank. Nodes are
emulated with ranks_per_node (as BURST_HPC_RANKS_PER_NODE does)."""
import importlib.util
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from burst_hpc.backends.cuda.backend import kernel_builds
from burst_hpc.backends.cuda.compile import KernelCache, compiles, prepare
from burst_hpc.errors import BackendError

_spec = importlib.util.spec_from_file_location("fake_compiler",
                                               Path(__file__).resolve().parents[1] / "tests" / "fake_compiler.py")
fake_compiler = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_compiler)

BUILDS = kernel_builds("sm90", {"bf16"}, [128], ("full", "causal", "interval"), ("fwd", "bwd"))  # 9 builds


@pytest.fixture
def shared(comm, monkeypatch):
    """A directory every rank sees (rank 0's temporary directory), removed after the test."""
    monkeypatch.delenv("BURST_HPC_NO_JIT", raising=False)
    path = Path(comm.bcast(tempfile.mkdtemp(prefix="burst-cache-") if comm.rank == 0 else None))
    yield path
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(path)


def cache(path, comm, directory, **kw):
    compiler = fake_compiler.FakeCompiler(path / "store", path / "compiles.log", rank=comm.rank, delay=0.05, **kw)
    return KernelCache(compiler, directory=directory)


def test_a_node_s_ranks_compile_each_build_once_sharing_them_out(comm, shared):
    mine = cache(shared, comm, shared / "cache")
    done = prepare(mine, BUILDS, comm, ranks_per_node=comm.size)
    assert set(done) == {b.name() for i, b in enumerate(BUILDS) if i % comm.size == comm.rank}
    comm.Barrier()
    compiles = mine.compiler.compiles()
    assert sorted(name for name, _, _ in compiles) == sorted(b.name() for b in BUILDS)
    assert all(int(rank) == [b.name() for b in BUILDS].index(name) % comm.size for name, rank, _ in compiles)
    for build in BUILDS:  # every rank loads every module the others compiled
        assert mine.module(build)["module"] == build.name()
    comm.Barrier()


def test_nodes_with_their_own_cache_directories_compile_once_each(comm, shared):
    mine = cache(shared, comm, shared / f"node{comm.rank}")
    prepare(mine, BUILDS, comm, ranks_per_node=1)
    comm.Barrier()
    counts = Counter((name, rank) for name, rank, _ in mine.compiler.compiles())
    assert counts == Counter({(b.name(), str(r)): 1 for b in BUILDS for r in range(comm.size)})


def test_nodes_sharing_a_cache_directory_compile_once_in_all(comm, shared):
    mine = cache(shared, comm, shared / "cache")
    done = prepare(mine, BUILDS, comm, ranks_per_node=1)  # every rank a node: each takes every build
    comm.Barrier()
    assert Counter(name for name, _, _ in mine.compiler.compiles()) == Counter(b.name() for b in BUILDS)
    assert Counter(c[0] for c in compiles(shared / "cache")) == Counter(b.name() for b in BUILDS)
    assert set(done.values()) <= {"compiled", "waited", "cached"} and len(done) == len(BUILDS)


def test_a_compile_error_on_one_rank_is_raised_on_every_rank(comm, shared):
    failing = BUILDS[(comm.size - 1) % len(BUILDS)]  # compiled by the last rank of the node
    mine = cache(shared, comm, shared / "cache", fail=failing.name())
    with pytest.raises(BackendError) as error:
        prepare(mine, BUILDS, comm, ranks_per_node=comm.size)
    texts = comm.allgather(str(error.value))
    assert len(set(texts)) == 1 and f"nvrtc: error in {failing.name()}" in texts[0]


def test_no_jit_is_the_same_error_on_every_rank_before_any_compile(comm, shared, monkeypatch):
    monkeypatch.setenv("BURST_HPC_NO_JIT", "1")
    mine = cache(shared, comm, shared / "cache")
    with pytest.raises(BackendError) as error:
        prepare(mine, BUILDS, comm, ranks_per_node=comm.size)
    texts = comm.allgather(str(error.value))
    assert len(set(texts)) == 1 and texts[0].endswith("burst-hpc compile --family sm90 --head-dim 128 --dtype bf16")
    assert mine.compiler.compiles() == []


def test_kernels_made_ready_on_another_communicator_are_made_ready_again(comm):
    """CudaBackend.prepare is collective on the call's communicator and skips what it made ready before: on that
    communicator. Ranks that prepared a set on a communicator of their own must still take part when every rank
    prepares it on the world (skipping there alone would leave the others waiting in the collective)."""
    import types

    from burst_hpc.backends.cuda.backend import CudaBackend
    from burst_hpc.plan import masks

    entered = []
    stub = types.SimpleNamespace(family="sm90", modules=types.SimpleNamespace(
        prepare=lambda builds, on: entered.append(on) or {}))
    mask = masks.Mask(1024, True)
    alone = comm.Split(color=int(comm.rank < max(1, comm.size // 2)), key=comm.rank)
    try:
        if comm.rank < max(1, comm.size // 2):
            CudaBackend.prepare(stub, alone, "bfloat16", 128, mask, ("fwd",))
        entered.clear()
        CudaBackend.prepare(stub, comm, "bfloat16", 128, mask, ("fwd",))
        assert comm.allgather(entered == [comm]) == [True] * comm.size
        CudaBackend.prepare(stub, comm, "bfloat16", 128, mask, ("fwd",))   # made ready on it: skipped
        assert entered == [comm]
    finally:
        alone.Free()
