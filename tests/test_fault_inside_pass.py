"""An error raised on one rank inside a pass ends every rank promptly, with the error shown: the API
(a step callback that raises on one rank, mid-ring) and the CLI (a block kernel that raises on one
rank). Before, the other ranks waited in the ring's transfers forever."""
import glob
import os
import subprocess
import sys
import textwrap

import pytest

from test_cli import ENV, MPIEXEC, burst, needs_mpiexec

API_JOB = textwrap.dedent("""
    import sys
    import numpy as np
    from mpi4py import MPI
    import burst_hpc
    comm, failing, stage = MPI.COMM_WORLD, int(sys.argv[1]), sys.argv[2]
    rng = np.random.default_rng(comm.rank)
    q, k, v = (rng.standard_normal((1, 16, 2, 8)) for _ in range(3))

    def fail_mid_ring(done, total):
        if comm.rank == failing and done == 2:
            raise RuntimeError("injected failure")

    kw = dict(comm=comm, causal=True, layout="zigzag")
    o, lse = burst_hpc.burst_attention(q, k, v, on_step=fail_mid_ring if stage == "forward" else None, **kw)
    burst_hpc.burst_attention_backward(q, q, k, v, o, lse, on_step=fail_mid_ring, **kw)
    print("finished", comm.rank, flush=True)
""")

# the real CLI, with one rank's block kernel failing at its second call (argv[1] "setup": in the set-up's
# rehearsal; "forward": in the forward pass, whose block pairs have more keys than the rehearsal's)
CLI_JOB = textwrap.dedent("""
    import os, sys
    from burst_hpc.backends import numpy_backend
    from burst_hpc.engine.passes import REHEARSAL_KEYS
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    stage = sys.argv.pop(1)
    calls = []
    forward_block = numpy_backend.NumpyBackend.forward_block

    def failing(self, q, k, *args, **kwargs):
        if stage == "setup" or k.shape[1] > REHEARSAL_KEYS:
            calls.append(1)
        if rank == 1 and len(calls) == 2:
            raise FloatingPointError("injected kernel failure")
        return forward_block(self, q, k, *args, **kwargs)

    numpy_backend.NumpyBackend.forward_block = failing
    from burst_hpc.cli import main
    sys.exit(main())
""")


def _launch(ranks, args, timeout=90):
    return subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, *args], env=dict(ENV, OPENBLAS_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=timeout)


@needs_mpiexec
@pytest.mark.parametrize("ranks,failing,stage", [(2, 1, "forward"), (3, 0, "backward"), (4, 2, "forward")])
def test_api_error_on_one_rank_ends_every_rank(tmp_path, ranks, failing, stage):
    script = tmp_path / "job.py"
    script.write_text(API_JOB)
    result = _launch(ranks, [str(script), str(failing), stage])  # a hang fails by timeout
    assert result.returncode != 0
    what = "burst_attention" if stage == "forward" else "burst_attention_backward"
    assert (f"burst-hpc: error: rank {failing} failed inside {what}: RuntimeError: injected failure"
            in result.stderr), result.stderr[-3000:]
    assert "finished" not in result.stdout


@needs_mpiexec
@pytest.mark.parametrize("stage,what,layout", [("setup", "the set-up of the passes", "zigzag"),
                                               ("forward", "the forward pass", "zigzag"),
                                               ("forward", "the forward pass", "chunks")])   # the packed gather
def test_cli_error_on_one_rank_ends_every_rank_and_leaves_no_file(tmp_path, stage, what, layout):
    src, out = tmp_path / "in.h5", tmp_path / "out.h5"
    # S/(2P) = 300 tokens per zigzag chunk: every pair of the pass has more keys than the rehearsal's
    assert burst("gen", src, "--batch", 1, "--seqlen", 1800, "--heads", 2, "--head-dim", 8).returncode == 0
    script = tmp_path / "cli_job.py"
    script.write_text(CLI_JOB)
    # zigzag: the rehearsal's second block call is in the set-up; chunks (the packed gather): one block call a pass
    result = _launch(3, [str(script), stage, "run", src, out, "--causal", "--layout", layout])
    assert result.returncode != 0
    assert (f"burst-hpc: error: rank 1 failed inside {what}: FloatingPointError: injected kernel failure"
            in result.stderr), result.stderr[-3000:]
    assert not out.exists()
    assert glob.glob(str(out) + ".tmp*") == []


def test_one_rank_alone_raises_as_usual():
    from burst_hpc.collective import one_fails_all

    class One:
        rank, size = 0, 1

    with pytest.raises(RuntimeError, match="plain"):
        with one_fails_all(One(), "a pass"):
            raise RuntimeError("plain")
