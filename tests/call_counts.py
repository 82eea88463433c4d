"""Counting calls to the functions that must run once per plan, not once per call (tests/test_plancache.py
and mpi_tests/test_plancache.py): a structural check of a repeated call's host work, with no timing."""
from burst_hpc.engine import packed, passes, ring
from burst_hpc.plan.decomposition import Decomposition

# what a plan works out once for its passes (engine/passes.py, _Program): the schedule's steps, the engine's
# route through them and the block pairs of every visit; the gather scheme on one node (engine/packed.py) its
# packing instead; a repeated call must decide none of it again
ONCE_PER_PLAN = ((Decomposition, "steps"), (passes, "_pairs"), (ring, "lifetimes"), (packed, "packing"))


def counted(monkeypatch, *where):
    """{name: calls so far} of each (owner, name) in ``where``, counted from now on."""
    counts = {}
    for owner, name in where:
        kept = getattr(owner, name)
        counts[name] = 0

        def call(*args, _kept=kept, _name=name, **kwargs):
            counts[_name] += 1
            return _kept(*args, **kwargs)

        monkeypatch.setattr(owner, name, call)
    return counts
