"""Shard a global array over the ranks, gather it back with MPI, compare on every rank.

Runs under mpiexec with any number of ranks; every rank runs the same tests in the same order.
Randomness comes from rank 0 (seed and array broadcast), so every rank sees the same inputs;
all collectives happen before any assertion, so a failing check never leaves a rank waiting.
"""
import secrets

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

from burst_hpc.plan.layout import LAYOUTS, layout_indices, shard, unshard

PLAIN = dict(causal=True, cu_seqlens=None, window=None)   # the mask the chunks layout is placed by

BF16 = np.dtype(ml_dtypes.bfloat16)


def _global_array(comm, dtype, axis, ndim=4):
    """Rank 0 draws a seed and a random array whose ``axis`` splits under both layouts; bcast."""
    if comm.rank == 0:
        seed = secrets.randbits(63)
        rng = np.random.default_rng(seed)
        shape = [int(n) for n in rng.integers(1, 4, ndim)]
        shape[axis] = 2 * comm.size * int(rng.integers(1, 5))
        x = rng.standard_normal(shape).astype(dtype)
        meta = (seed, tuple(shape))
    else:
        meta = None
    seed, shape = comm.bcast(meta, root=0)
    if comm.rank != 0:
        x = np.empty(shape, dtype)
    comm.Bcast(x.view(np.uint8), root=0)  # bytes: MPI has no bfloat16 type
    return seed, x


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, BF16], ids=["fp32", "fp64", "bf16"])
@pytest.mark.parametrize("axis", [1, 0, 3])
def test_shard_allgather_unshard(comm, layout, dtype, axis):
    seed, x = _global_array(comm, dtype, axis)
    ctx = f"seed={seed} rank={comm.rank}/{comm.size} layout={layout} shape={x.shape} axis={axis}"
    mine = np.ascontiguousarray(shard(x, comm.rank, comm.size, layout, axis=axis, **PLAIN))
    # buffer path: fixed-size shards gathered as raw bytes (works for bfloat16 too)
    recv = np.empty((comm.size,) + mine.shape, mine.dtype)
    comm.Allgather(mine.view(np.uint8), recv.reshape(comm.size, -1).view(np.uint8))
    # object path, and the owned token indices, gathered alongside
    objects = comm.allgather(mine)
    indices = comm.allgather(layout_indices(x.shape[axis], comm.rank, comm.size, layout, **PLAIN))

    back = unshard(list(recv), layout, axis=axis, **PLAIN)
    assert back.dtype == x.dtype and back.shape == x.shape, ctx
    np.testing.assert_array_equal(back.view(np.uint8), x.view(np.uint8), err_msg=ctx)
    np.testing.assert_array_equal(unshard(objects, layout, axis=axis, **PLAIN).view(np.uint8), x.view(np.uint8),
                                  err_msg=ctx)
    np.testing.assert_array_equal(np.sort(np.concatenate(indices)), np.arange(x.shape[axis]), err_msg=ctx)
    np.testing.assert_array_equal(mine.view(np.uint8), np.take(x, indices[comm.rank], axis=axis).view(np.uint8),
                                  err_msg=ctx)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_to_root_and_agree(comm, layout):
    """comm.gather to rank 0, which unshards and checks; every rank learns the verdict."""
    seed, x = _global_array(comm, np.float64, 1)
    mine = shard(x, comm.rank, comm.size, layout, **PLAIN)   # the chunks layout places tokens by the mask
    parts = comm.gather(mine, root=0)
    verdict = None
    if comm.rank == 0:
        verdict = bool(np.array_equal(unshard(parts, layout, **PLAIN), x))
    verdict = comm.bcast(verdict, root=0)
    assert verdict, f"seed={seed} size={comm.size} layout={layout}: gathered shards do not rebuild the array"


def test_ranks_agree_on_the_seed(comm):
    """The broadcast randomness really is the same everywhere (guards the other tests' premise)."""
    seed, x = _global_array(comm, np.float32, 1)
    digests = comm.allgather((seed, x.tobytes()))
    assert all(d == digests[0] for d in digests), f"rank {comm.rank}: ranks saw different inputs"


@pytest.mark.parametrize("source,target", [("contiguous", "zigzag"), ("zigzag", "balanced"), ("zigzag", "zigzag")])
@pytest.mark.parametrize("axis", [1, 2])
def test_relayout_moves_shards_between_layouts(comm, source, target, axis):
    from burst_hpc.plan.layout import make_layout, relayout
    from burst_hpc.transport import make_transport

    seed, x = _global_array(comm, BF16, axis)
    t = make_transport("host", comm, np)
    mine = shard(x, comm.rank, comm.size, source, axis=axis)
    placed = {kind: make_layout(kind, x.shape[axis], comm.size) for kind in (source, target)}
    moved = relayout(mine, placed[source], placed[target], t, axis=axis)
    back = relayout(moved, placed[target], placed[source], t, axis=axis)
    ctx = f"seed={seed} rank={comm.rank}/{comm.size} {source}->{target} axis={axis}"
    np.testing.assert_array_equal(moved.view(np.uint16), shard(x, comm.rank, comm.size, target, axis=axis).view(np.uint16),
                                  err_msg=ctx)
    np.testing.assert_array_equal(back.view(np.uint16), mine.view(np.uint16), err_msg=ctx)
