"""Every rank runs the same tests in the same order. A failure on one rank would leave the
others waiting in a collective, so the failing rank prints its report and aborts the job."""
import sys
import time

import pytest
from mpi4py import MPI


@pytest.fixture
def comm():
    return MPI.COMM_WORLD


@pytest.fixture
def alltoall_zigzag():
    """bench/alltoall_zigzag.py, the alternative the balanced schedule is measured against."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "alltoall_zigzag.py"
    spec = importlib.util.spec_from_file_location("alltoall_zigzag", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        rank = MPI.COMM_WORLD.rank
        # pytest captures stderr while a test runs: the report must get past it before the abort ends the job
        with item.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
            sys.stderr.write(f"\n[rank {rank}] FAILED {item.nodeid}\n{report.longreprtext}\n")
            sys.stderr.flush()
        if MPI.COMM_WORLD.size > 1:
            time.sleep(1)   # mpirun forwards the report before the abort kills the job
            MPI.COMM_WORLD.Abort(1)
