"""`burst-hpc verify`: a published output checked later, with a rank count other than the job's: it
passes on a good output, fails (exit 3, naming what failed) on a corrupted one, prints its predicted
cost first, and refuses options that contradict what the output records."""
import re
import shutil

import h5py
import numpy as np
import pytest

from burst_hpc import io
from burst_hpc.io.format import to_stored
from test_cli import burst, mpirun, needs_mpiexec

# B * Hq * S^2 above verify.FULL_LIMIT: the check samples tokens (64 of each rank's 512 or more)
SEQLEN, ROWS = 1536, "64"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A causal forward + backward run on 2 ranks, published without verification."""
    tmp = tmp_path_factory.mktemp("verify")
    src, dst = tmp / "in.h5", tmp / "out.h5"
    assert burst("gen", src, "--seqlen", SEQLEN, "--heads", 2, "--kv-heads", 1, "--head-dim", 8, "--with-grad",
                 "--seed", 3, "--quiet").returncode == 0
    r = mpirun(2, "run", src, dst, "--causal", "--backward", "--backend", "numpy", "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    return src, dst


def _corrupt(path, name, tokens):
    """Add 1 to output ``name`` at ``tokens`` (a slice of the token axis)."""
    with h5py.File(path, "r+") as f:
        ds = f[name]
        data = io.read_global(path, [name])[name]
        data[:, tokens] += np.asarray(1, data.dtype)
        ds[...] = to_stored(data)


@needs_mpiexec
@pytest.mark.parametrize("ranks", [1, 3])
def test_a_good_output_passes(job, ranks):
    src, dst = job
    r = mpirun(ranks, "verify", src, dst, "--rows", ROWS)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"burst-hpc verify: PASS {dst} (sampled 64 rows+cols/rank, {ranks} rank(s)" in r.stdout, r.stdout
    for name in ("o=", "lse=", "dq=", "dk=", "dv="):
        assert name in r.stdout, r.stdout
    # the predicted cost, once, before the check
    assert r.stderr.count(f"verify: 64 rows and 64 key columns per rank against {SEQLEN} tokens") == 1, r.stderr


@needs_mpiexec
@pytest.mark.parametrize("ranks,name,tokens", [(1, "o", slice(100, 700)), (3, "dk", slice(300, 1300)),
                                               (2, "dv", slice(0, 800))])
def test_a_corrupted_output_fails_naming_it(job, tmp_path, ranks, name, tokens):
    src, good = job
    dst = tmp_path / "out.h5"
    shutil.copy(good, dst)
    _corrupt(dst, name, tokens)
    r = mpirun(ranks, "verify", src, dst, "--rows", ROWS, "--quiet")
    assert r.returncode == 3, r.stdout + r.stderr
    assert f"burst-hpc verify: FAIL {dst}" in r.stdout, r.stdout
    assert r.stderr.count("verification failed: ") == 1 and f"{name}: max error" in r.stderr, r.stderr


@needs_mpiexec
def test_options_that_contradict_the_output_are_refused(job):
    src, dst = job
    r = mpirun(2, "verify", src, dst, "--window", "8")
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.count("was written with window = None, not (8, 0)") == 1, r.stderr


@needs_mpiexec
def test_a_forward_output_has_no_gradients_to_check(tmp_path):
    src, dst = tmp_path / "in.h5", tmp_path / "out.h5"
    assert burst("gen", src, "--seqlen", 64, "--heads", 2, "--head-dim", 8, "--quiet").returncode == 0
    assert mpirun(2, "run", src, dst, "--backend", "numpy", "--quiet").returncode == 0
    r = mpirun(2, "verify", src, dst, "--quiet")
    assert r.returncode == 0 and "PASS" in r.stdout and "dq=" not in r.stdout and "(full," in r.stdout, r.stdout
    r = mpirun(2, "verify", src, dst, "--backward")
    assert r.returncode == 1 and r.stderr.count("dataset 'do' is missing") == 1, r.stderr


@needs_mpiexec
@pytest.mark.parametrize("ranks,layout,rows", [(3, "zigzag", "32"), (2, "balanced", None)])
def test_run_verifies_sampled_tokens_of_its_shards(tmp_path, job, ranks, layout, rows):
    """run --verify on a problem too large for the full check: sampled tokens of each rank's shards (its
    layout's token order), the predicted cost first; without --verify-rows the budget sizes the sample."""
    src, _ = job
    dst = tmp_path / "out.h5"
    r = mpirun(ranks, "run", src, dst, "--causal", "--backward", "--backend", "numpy", "--verify", "--layout", layout,
               *(["--verify-rows", rows] if rows else []))
    assert r.returncode == 0, r.stdout + r.stderr
    count = re.search(r"verify=PASS\(sampled (\d+) rows\+cols/rank\) \d+\.\d+s max_err/tol o=", r.stdout)
    assert count, r.stdout
    assert count.group(1) == rows if rows else 16 <= int(count.group(1)) <= 256, r.stdout
    assert r.stderr.count(f"verify: {count.group(1)} rows and {count.group(1)} key columns per rank against "
                          f"{SEQLEN} tokens") == 1, r.stderr


@needs_mpiexec
def test_a_window_is_taken_from_the_output(job, tmp_path):
    """A sliding-window output: checked under the window it records, with the flag or without it."""
    src, _ = job
    dst = tmp_path / "out.h5"
    r = mpirun(2, "run", src, dst, "--causal", "--window", "100", "--backward", "--backend", "numpy", "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    for flags in ([], ["--causal", "--window", "100"]):
        r = mpirun(3, "verify", src, dst, "--rows", ROWS, "--quiet", *flags)
        assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
    r = mpirun(3, "verify", src, dst, "--window", "50", "--quiet")
    assert r.returncode == 1 and "was written with window = (100, 0), not (50, 0)" in r.stderr, r.stderr


def _without_attributes(src, dst):
    """A copy of output ``src`` holding its datasets alone, as another program might write it."""
    with h5py.File(src, "r") as f, h5py.File(dst, "w") as g:
        for name in f:
            g.create_dataset(name, data=f[name][...])
            g[name].attrs.update(f[name].attrs)   # a bfloat16 dataset's own dtype attribute stays


@needs_mpiexec
def test_an_output_that_records_no_mask_is_refused_unless_it_is_said(job, tmp_path):
    """No guess: without the causal attribute the check refuses (one line, exit 1) until --causal or
    --no-causal says the mask; said right it passes, said wrong it fails."""
    src, good = job
    dst = tmp_path / "bare.h5"
    _without_attributes(good, dst)
    r = mpirun(2, "verify", src, dst, "--rows", ROWS, "--quiet")
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.count("does not record the mask it was computed with") == 1, r.stderr
    assert "--causal or --no-causal" in r.stderr, r.stderr
    r = mpirun(2, "verify", src, dst, "--rows", ROWS, "--quiet", "--causal")
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
    r = mpirun(1, "verify", src, dst, "--rows", ROWS, "--quiet", "--no-causal")
    assert r.returncode == 3 and "FAIL" in r.stdout, r.stdout + r.stderr


@needs_mpiexec
def test_verify_takes_the_scale(job, tmp_path):
    """A run with --scale 0.5: checked with the scale it records, or the same given; another scale given is
    refused. Without attributes --scale is the only way to say it (the default head_dim**-0.5 fails)."""
    src, _ = job
    dst, bare = tmp_path / "out.h5", tmp_path / "bare.h5"
    r = mpirun(2, "run", src, dst, "--causal", "--backward", "--scale", "0.5", "--backend", "numpy", "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    for flags in ([], ["--scale", "0.5"]):
        r = mpirun(2, "verify", src, dst, "--rows", ROWS, "--quiet", *flags)
        assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
    r = mpirun(2, "verify", src, dst, "--scale", "0.3", "--quiet")
    assert r.returncode == 1 and r.stderr.count("was written with scale = 0.5, not 0.3") == 1, r.stderr
    _without_attributes(dst, bare)
    r = mpirun(1, "verify", src, bare, "--rows", ROWS, "--quiet", "--causal", "--scale", "0.5")
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
    r = mpirun(1, "verify", src, bare, "--rows", ROWS, "--quiet", "--causal")
    assert r.returncode == 3 and "FAIL" in r.stdout, r.stdout + r.stderr
