"""burst-hpc check: the installed self-test. Its CPU part through the real command (one process and
under mpiexec), and its verdict: a wrong or crashing backend makes a FAIL row and exit status 3."""
import numpy as np
import pytest
from mpi4py import MPI

from burst_hpc import cli, device
from burst_hpc.cli_delivery import EXIT_MISMATCH
from burst_hpc.job import selfcheck
from burst_hpc.backends import numpy_backend
from test_cli import burst, mpirun, needs_mpiexec

GPU = device.gpu_count() > 0


def _rows(stdout, prefix):
    return [line for line in stdout.splitlines() if line.startswith(prefix)]


def test_check_one_process():
    r = burst("check")
    assert r.returncode == 0, r.stdout + r.stderr
    kernels = _rows(r.stdout, "kernels ")
    n = len(selfcheck.KERNEL_CASES) * len(selfcheck.DTYPES) * 2
    if GPU:
        from burst_hpc.backends.cuda import kernel_families

        n *= len(kernel_families())
    assert len(kernels) == n, r.stdout
    assert all(" PASS " in line for line in kernels), r.stdout
    for needle in ("causal", "full", "bfloat16", "float16", "Hkv=1", "D=80", "S=77"):
        assert needle in r.stdout
    if not GPU:
        assert "no GPU visible: checked the NumPy backend" in r.stdout and "kernels numpy" in r.stdout
    assert f"{len(kernels)} passed, 0 failed" in r.stdout and not _rows(r.stdout, "ring ")


def test_check_replays_a_seed():
    """--seed gives the same inputs, so the same errors: a failure seen once can be run again."""
    first, again = (burst("check", "--seed", "12345") for _ in range(2))
    assert first.returncode == again.returncode == 0, first.stdout + first.stderr
    assert "seed 12345" in first.stdout
    assert _rows(first.stdout, "kernels ") == _rows(again.stdout, "kernels ")


@needs_mpiexec
@pytest.mark.skipif(GPU, reason="CPU ring rows (a GPU machine checks its device transports)")
def test_check_under_mpiexec_runs_the_ring():
    r = mpirun(2, "check")
    assert r.returncode == 0, r.stdout + r.stderr
    ring = _rows(r.stdout, "ring host")
    assert len(ring) == 6 and all(" PASS " in line for line in ring), r.stdout
    assert any("zigzag q-ring" in line and "causal" in line for line in ring)
    assert any("balanced kv-ring" in line and "causal" in line for line in ring)
    assert any("contiguous kv-ring" in line and "full" in line for line in ring)
    assert r.stdout.count("burst-hpc check:") == 1  # the table comes from rank 0 only


class _Wrong(numpy_backend.NumpyBackend):
    """A backend with a small error in o: the rule must catch it."""

    def forward_block(self, q, k, v, o, lse, out=None, **kwargs):
        super().forward_block(q, k, v, o, lse, out=out, **kwargs)
        (o if out is None else out)[:, -1] += 0.05   # the block contract: a last pair writes out, not o


class _Crashing(numpy_backend.NumpyBackend):
    def backward_block(self, *args, **kwargs):
        raise RuntimeError("kernel launch failed")


def test_wrong_or_crashing_backend_fails(monkeypatch):
    rng = np.random.default_rng(0)
    rows = selfcheck.kernel_rows([("wrong", _Wrong()), ("crash", _Crashing()), ("ok", numpy_backend.NumpyBackend())],
                                 rng)
    by = {label: [r for r in rows if r[0] == f"kernels {label}"] for label in ("wrong", "crash", "ok")}
    assert all(r[4] > 1 and r[5] == "o" for r in by["wrong"]), by["wrong"]
    assert all(r[4] == float("inf") and "kernel launch failed" in r[5] for r in by["crash"])
    assert all(r[4] <= 1 for r in by["ok"])

    monkeypatch.setattr(device, "gpu_count", lambda: 0)
    monkeypatch.setattr(numpy_backend, "NumpyBackend", _Wrong)
    lines = []
    assert selfcheck.main(MPI.COMM_SELF, out=lines.append) is False
    text = "\n".join(lines)
    assert " FAIL " in text and "0 passed" in text and text.rstrip().endswith("FAIL")
    assert cli.main(["check"]) == EXIT_MISMATCH
