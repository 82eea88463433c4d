"""The burst-hpc command through real mpiexec subprocesses: runs, every bad-input case, and the
guarantee that nothing appears under the output's name unless the run finished."""
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

import burst_hpc
from burst_hpc import io
from burst_hpc.dtypes import bfloat16
from burst_hpc.plan import masks
from burst_hpc.reference import attention_reference

BIN = Path(sys.executable).parent


def _mpiexec():
    found = os.environ.get("MPIEXEC") or (str(BIN / "mpiexec") if (BIN / "mpiexec").exists() else None)
    return found or shutil.which("mpiexec")


MPIEXEC = _mpiexec()
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1", PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
           PYTHONUNBUFFERED="1")
needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")


def burst(*args, timeout=120):
    """``python -m burst_hpc ARGS`` as one process (no launcher)."""
    return subprocess.run([sys.executable, "-m", "burst_hpc", *map(str, args)], env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def mpirun(n, *args, timeout=180):
    """``mpiexec -n N python -m burst_hpc ARGS``."""
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "burst_hpc", *map(str, args)]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)


def leftovers(directory):
    return glob.glob(os.path.join(directory, "*.tmp*"))


def test_info():
    r = burst("info")
    assert r.returncode == 0, r.stderr
    for needle in ("burst-hpc 0.", "MPI:", "CUDA-aware MPI:", "NCCL:", "GPUs:", "transport auto:"):
        assert needle in r.stdout, r.stdout


def test_gen_is_chunk_independent_and_tagged(tmp_path):
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    r = burst("gen", a, "--seqlen", 3000, "--batch", 2, "--heads", 4, "--kv-heads", 2, "--head-dim", 16,
              "--dtype", "bf16", "--seed", 5, "--with-grad")
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout
    # the same data whatever the write size: blocks have their own seeds
    io.generate(b, 2, 3000, 4, 2, 16, bfloat16, seed=5, with_grad=True, max_elements=1000)
    x, y = io.read_global(a), io.read_global(b)
    assert sorted(x) == ["do", "k", "q", "v"]
    for name in x:
        assert x[name].dtype == bfloat16 and np.array_equal(x[name].view(np.uint16), y[name].view(np.uint16))
    with h5py.File(a, "r") as f:
        assert f["q"].dtype == np.uint16 and f["q"].attrs["dtype"] == "bfloat16"
        assert f["q"].chunks is not None and f["k"].shape == (2, 3000, 2, 16)
        assert f.attrs["burst_hpc_version"] and f.attrs["seqlen"] == 3000
    assert not leftovers(tmp_path)


def test_gen_rejects_bad_arguments(tmp_path):
    r = burst("gen", tmp_path / "x.h5", "--seqlen", 64, "--dtype", "int8")
    assert r.returncode == 2 and r.stderr.count("burst-hpc: error:") == 1 and "unsupported dtype" in r.stderr
    r = burst("gen", tmp_path / "x.h5", "--seqlen", 64, "--heads", 6, "--kv-heads", 4)
    assert r.returncode == 1 and "multiple of key/value heads" in r.stderr
    assert not os.listdir(tmp_path)


@needs_mpiexec
@pytest.mark.parametrize("ranks,causal,dtype,layout", [(2, True, "bfloat16", None), (3, False, "float32", None),
                                                      (3, True, "float32", "balanced")])
def test_run_writes_and_verifies(tmp_path, ranks, causal, dtype, layout):
    src, dst = tmp_path / "in.h5", tmp_path / "out.h5"
    seqlen = (47 if layout == "balanced" else 48) * ranks  # balanced splits like contiguous: S % P == 0
    assert burst("gen", src, "--seqlen", seqlen, "--heads", 4, "--kv-heads", 2, "--head-dim", 16, "--dtype", dtype,
                 "--seed", 1, "--with-grad").returncode == 0
    flags = ["--backward", "--verify", "--backend", "numpy"] + (["--causal"] if causal else [])
    flags += ["--layout", layout] if layout else []
    r = mpirun(ranks, "run", src, dst, *flags)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("burst-hpc run:")]
    assert len(lines) == 1, r.stdout  # one summary line, from rank 0
    line = lines[0]
    # the job's default: the layout choose_layout names for it (it shards the file itself)
    layout = layout or burst_hpc.choose_layout(seqlen, ranks, causal=causal, heads=4, kv_heads=2, head_dim=16,
                                               dtype=dtype, backend="numpy").kind
    for needle in (f"tokens={seqlen}", f"ranks={ranks}", f"layout={layout}", "TFLOP/s",
                   "transport=host", "verify=PASS(full)", "dk="):
        assert needle in line, line
    # the file holds the outputs in global token order, whatever the layout
    data = io.read_global(src)
    out = io.read_global(dst)
    o_ref, lse_ref = attention_reference(data["q"], data["k"], data["v"], causal)
    assert out["o"].dtype == np.dtype(bfloat16 if dtype == "bfloat16" else dtype)
    assert out["lse"].dtype == np.float32 and out["lse"].shape == (1, 4, seqlen)
    assert np.abs(out["lse"] - lse_ref).max() < 1e-3
    assert np.abs(out["o"].astype(np.float64) - o_ref).max() < (3e-2 if dtype == "bfloat16" else 1e-4)
    assert out["dk"].shape == (1, seqlen, 2, 16)
    with h5py.File(dst, "r") as f:
        assert bool(f.attrs["causal"]) == causal and f.attrs["run_ranks"] == ranks
        assert f.attrs["run_layout"] == layout
        assert abs(f.attrs["scale"] - 16 ** -0.5) < 1e-12 and f.attrs["burst_hpc_version"]
    assert not leftovers(tmp_path)


@needs_mpiexec
def test_packed_run_with_window_writes_and_verifies(tmp_path):
    """gen --documents writes cu_seqlens; run masks documents and a window, verified against the oracle."""
    src, dst = tmp_path / "in.h5", tmp_path / "out.h5"
    seqlen = 96
    r = burst("gen", src, "--seqlen", seqlen, "--heads", 2, "--head-dim", 16, "--dtype", "float32", "--seed", 4,
              "--with-grad", "--documents", 6)
    assert r.returncode == 0 and "cu_seqlens" in r.stdout, r.stderr
    r = mpirun(2, "run", src, dst, "--causal", "--window", "20", "--backward", "--verify", "--backend", "numpy")
    assert r.returncode == 0, r.stdout + r.stderr
    line = [line for line in r.stdout.splitlines() if line.startswith("burst-hpc run:")][0]
    data, out = io.read_global(src), io.read_global(dst)
    cu = data["cu_seqlens"]
    # the default layout: the one choose_layout names for this job (the job shards the file itself)
    layout = burst_hpc.choose_layout(seqlen, 2, causal=True, cu_seqlens=cu, window=(20, 0), heads=2, kv_heads=2,
                                     head_dim=16, dtype="float32", backend="numpy").kind
    for needle in ("documents=6", "window=20,0", f"layout={layout}", "verify=PASS(full)"):
        assert needle in line, line
    assert cu[0] == 0 and cu[-1] == seqlen and len(cu) == 7
    o_ref, _ = attention_reference(data["q"], data["k"], data["v"], True, window=(20, 0), cu_seqlens=cu)
    assert np.abs(out["o"] - o_ref).max() < 1e-5
    with h5py.File(dst, "r") as f:
        assert f.attrs["window"] == "20,0" and f.attrs["documents"] == 6


@needs_mpiexec
def test_the_work_line_counts_what_each_rank_computes(tmp_path):
    """The job's stage line gives each rank's share of the visible pairs as its scheme's schedule computes them:
    the balanced schedule moves work off the ranks whose queries see most (their shards alone are uneven)."""
    src, dst = tmp_path / "in.h5", tmp_path / "out.h5"
    seqlen, cu = 256, np.array([0, 8, 256])   # rank 1 holds most of the visible pairs: its queries see both halves
    write_input(src, **random_qkv(seqlen), cu_seqlens=cu)
    shares = {}
    for layout in ("contiguous", "balanced"):
        r = mpirun(2, "run", src, dst, "--causal", "--backend", "numpy", "--layout", layout, "--progress",
                   "--overwrite")
        assert r.returncode == 0, r.stdout + r.stderr
        shares[layout] = float(re.search(r"per-rank work max/mean ([\d.]+) \(ring\)", r.stderr).group(1))
    work = masks.pair_work(masks.make(seqlen, True, None, cu), burst_hpc.make_layout("contiguous", seqlen, 2)).sum(1)
    assert shares["contiguous"] == pytest.approx(work.max() / work.mean(), abs=1e-3) and shares["contiguous"] > 1.4
    assert shares["balanced"] < 1.1   # its shards alone: the same as contiguous


def write_input(path, **arrays):
    with h5py.File(path, "w") as f:
        for name, a in arrays.items():
            f[name] = a


def random_qkv(seqlen, dtype=np.float32, hq=2, hkv=1, d=8):
    rng = np.random.default_rng(0)
    return {"q": rng.standard_normal((1, seqlen, hq, d)).astype(dtype),
            "k": rng.standard_normal((1, seqlen, hkv, d)).astype(dtype),
            "v": rng.standard_normal((1, seqlen, hkv, d)).astype(dtype)}


BAD_INPUTS = {
    "missing-file": (None, [], "does not exist"),
    "missing-dataset": (lambda: {k: a for k, a in random_qkv(16).items() if k != "v"}, [], "dataset 'v' is missing"),
    "missing-do": (lambda: random_qkv(16), ["--backward"], "dataset 'do' is missing"),
    "shape-mismatch": (lambda: dict(random_qkv(16), k=random_qkv(16, hkv=3)["k"]), [], "k and v must have the same shape"),
    "heads-mismatch": (lambda: dict(random_qkv(16, hq=3, hkv=2)), [], "multiple of key/value heads"),
    "unsupported-dtype": (lambda: {k: a.astype(np.int16) for k, a in random_qkv(16).items()}, [], "unsupported dtype int16"),
    "no-split": (lambda: random_qkv(17), ["--causal"], "does not split over 2 ranks"),   # in any layout
    "bad-documents": (lambda: dict(random_qkv(16), cu_seqlens=np.array([0, 5, 5, 16])), ["--causal"],
                      "dataset 'cu_seqlens': cu_seqlens must be strictly increasing"),
    "short-documents": (lambda: dict(random_qkv(16), cu_seqlens=np.array([0, 5, 12])), [],
                        "must start at 0 and end at the sequence length 16"),
}


@needs_mpiexec
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_fails_cleanly(tmp_path, case):
    make, flags, message = BAD_INPUTS[case]
    src, dst = tmp_path / "in.h5", tmp_path / "out.h5"
    if make is not None:
        write_input(src, **make())
    r = mpirun(2, "run", src, dst, *flags)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.count("burst-hpc: error:") == 1, r.stderr  # one message, not one per rank
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert not dst.exists() and not leftovers(tmp_path)


@needs_mpiexec
@pytest.mark.parametrize("where", ["missing-dir", "is-a-directory", "same-as-input"])
def test_unwritable_output_fails_cleanly(tmp_path, where):
    src = tmp_path / "in.h5"
    write_input(src, **random_qkv(16))
    dst = {"missing-dir": tmp_path / "nowhere" / "out.h5", "is-a-directory": tmp_path, "same-as-input": src}[where]
    before = sorted(os.listdir(tmp_path))
    r = mpirun(2, "run", src, dst)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.count("burst-hpc: error:") == 1 and "output" in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path)) == before and not leftovers(tmp_path)


@needs_mpiexec
def test_killed_run_leaves_no_output(tmp_path):
    """A run killed while computing leaves nothing under the output's name (only its temporary)."""
    src, dst = tmp_path / "in.h5", tmp_path / "out.h5"
    assert burst("gen", src, "--seqlen", 8192, "--heads", 4, "--head-dim", 64, "--dtype", "float32").returncode == 0
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "burst_hpc", "run", str(src), str(dst), "--backward-ring", "q",
           "--backend", "numpy"]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + 60
        while not leftovers(tmp_path) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        if not leftovers(tmp_path):
            how = f"ended with {proc.returncode}:\n{proc.stderr.read().decode()[-3000:]}" if proc.poll() is not None \
                else "still runs"
            raise AssertionError(f"the temporary output never appeared; the run {how}")
        assert proc.poll() is None, "the run finished before it could be interrupted; make it larger"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
    assert not dst.exists()


@needs_mpiexec
def test_console_script_under_mpiexec(tmp_path):
    script = BIN / "burst-hpc"
    if not script.exists():
        pytest.skip("burst-hpc console script not installed in this environment")
    src, dst = tmp_path / "in.h5", tmp_path / "out.h5"
    write_input(src, **random_qkv(32, np.float64))
    r = subprocess.run([MPIEXEC, "-n", "2", str(script), "run", str(src), str(dst), "--causal", "--verify",
                        "--layout", "contiguous", "--backend", "numpy", "--warmup"], env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verify=PASS" in r.stdout and dst.exists()
