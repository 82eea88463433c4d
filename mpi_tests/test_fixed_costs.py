"""The cost model's fixed costs measured across ranks (plan/calibrate.py, `burst-hpc compile --backend
numpy` under mpiexec): every rank gets the same figures, a message's latency is measured between
ranks 0 and 1 over the host transport, one file is kept and every rank's rates read it."""
import shutil
import tempfile

import pytest

from burst_hpc.cli import main
from burst_hpc.plan import calibrate
from burst_hpc.plan.rates import rates_for


@pytest.fixture
def cache(comm, monkeypatch):
    path = comm.bcast(tempfile.mkdtemp(prefix="burst-fixed-") if comm.rank == 0 else None)
    monkeypatch.setenv("CUPY_CACHE_DIR", path)
    yield path
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def test_every_rank_measures_and_reads_the_same_fixed_costs(comm, cache):
    model, costs, path = calibrate.calibrate("numpy", comm if comm.size > 1 else None)
    assert model == "cpu" and path == calibrate.path("cpu") and path.startswith(cache)
    assert comm.allgather(costs) == [costs] * comm.size
    assert ("intra_latency_us" in costs) == (comm.size > 1)
    assert all(v >= 0 for v in costs.values()) and costs["fwd_launch_us"] > 0
    comm.Barrier()
    assert calibrate.load("cpu") == costs
    rates = rates_for("numpy")
    assert all(getattr(rates, name) == value for name, value in costs.items())


def test_compile_verb_under_mpiexec(comm, cache, capsys):
    assert main(["compile", "--backend", "numpy"]) == 0
    out = capsys.readouterr().out
    assert ("fixed costs of cpu" in out) == (comm.rank == 0)
    assert comm.allgather(calibrate.load("cpu")) == [calibrate.load("cpu")] * comm.size
