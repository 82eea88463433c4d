"""Every rank runs the same tests in the same order. A failure on one rank would leave the
others waiting in a collective, so the failing rank prints its report and aborts the job."""
import sys

import pytest
from mpi4py import MPI


@pytest.fixture
def comm():
    return MPI.COMM_WORLD


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        rank = MPI.COMM_WORLD.rank
        sys.stderr.write(f"\n[rank {rank}] FAILED {item.nodeid}\n{report.longreprtext}\n")
        sys.stderr.flush()
        if MPI.COMM_WORLD.size > 1:
            MPI.COMM_WORLD.Abort(1)
