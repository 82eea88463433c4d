"""The README's examples run as written: every ```bash and ```python block, through a real mpiexec
where the block needs one, so they cannot rot. The bash block's sizes shrink (named below); the
python blocks run unchanged. docs/USAGE.md's python blocks for the files (reading results back,
the file API) run on the command block's files."""
import shutil
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_cli import BIN, ENV, MPIEXEC, needs_mpiexec

README = Path(__file__).resolve().parents[1] / "README.md"
USAGE = README.parent / "docs" / "USAGE.md"
# what the bash block runs at a test's size instead of a cluster's: (as written, in the test)
SHRINK = [("--seqlen 1048576", "--seqlen 256"), ("mpiexec -n 8", f"{MPIEXEC} -n 2")]


def blocks(language, path=README):
    return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(), re.M | re.S)


def _run(cmd, cwd, timeout=300):
    env = dict(ENV, PATH=f"{BIN}{os.pathsep}{ENV.get('PATH', '')}")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_readme_has_the_examples_this_file_runs():
    assert len(blocks("bash")) == 1 and len(blocks("python")) == 2


@needs_mpiexec
def test_readme_command_block_runs(tmp_path):
    (script,) = blocks("bash")
    for written, small in SHRINK:
        assert written in script, f"README's command block no longer has {written!r}: update SHRINK"
        script = script.replace(written, small)
    r = _run(["bash", "-e", "-o", "pipefail", "-c", script], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "0 failed" in r.stdout and "verify=PASS(full)" in r.stdout, r.stdout
    assert (tmp_path / "out.h5").exists() and "; backward" in r.stderr and "set-up done in" in r.stderr
    assert "  seconds: read " in r.stdout and " total " in r.stdout, r.stdout

    # USAGE.md on these files: reading the bfloat16 results back, and the file API on two ranks
    (reading,) = [code for code in blocks("python", USAGE) if "ml_dtypes" in code]
    r = _run([sys.executable, "-c", reading + "\nassert o.dtype == ml_dtypes.bfloat16 and np.isfinite(o32).all()\n"
              "assert lse.shape == (1, 32, 256) and part.shape == (100, 32, 128)"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    (api,) = [code for code in blocks("python", USAGE) if "OutputFile.create" in code]
    (tmp_path / "api").mkdir()
    shutil.copy(tmp_path / "in.h5", tmp_path / "api" / "in.h5")
    (tmp_path / "api" / "example.py").write_text(api)
    r = _run([MPIEXEC, "-n", "2", sys.executable, "example.py"], tmp_path / "api")
    assert r.returncode == 0 and (tmp_path / "api" / "out.h5").exists(), r.stdout + r.stderr


@needs_mpiexec
@pytest.mark.parametrize("index", [0, 1])
def test_readme_python_block_runs(tmp_path, index):
    code = blocks("python")[index]
    (tmp_path / "example.py").write_text(code)
    if "mpi4py" in code:  # the sharded example: under mpiexec on two ranks, checked against one device
        r = _run([MPIEXEC, "-n", "2", sys.executable, "example.py"], tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        (line,) = [line for line in r.stdout.splitlines() if line.startswith("max |o - one-device o|:")]
        assert float(line.split(":")[1]) < 1e-5, line
    else:
        r = _run([sys.executable, "example.py"], tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr


@needs_mpiexec
def test_readme_mpiexec_line_for_a_laptop_runs_as_written(tmp_path):
    """Open MPI refuses root and more ranks than cores unless told; the README's Install section says
    how, on a line a laptop or container user copies, and that line runs here without the Makefile's
    environment (as root, and with more ranks than cores on a machine of 2)."""
    version = subprocess.run([MPIEXEC, "--version"], capture_output=True, text=True, timeout=60).stdout
    (line,) = [line.strip() for line in README.read_text().split("\n## Install\n")[1].split("\n## ")[0].splitlines()
               if line.startswith("    mpiexec --allow-run-as-root --oversubscribe ")]
    if "Open MPI" not in version:
        pytest.skip("the flags are Open MPI's; this mpiexec is another MPI's")
    env = {k: v for k, v in ENV.items() if not k.startswith(("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_MCA_rmaps", "PRTE_MCA"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    r = subprocess.run(["bash", "-c", line.replace("mpiexec", MPIEXEC, 1)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and "0 failed" in r.stdout, r.stdout + r.stderr


def test_readme_make_test_line_names_the_ranks_the_makefile_runs():
    makefile = (README.parent / "Makefile").read_text()
    mpi_ranks, node_ranks = (re.search(rf"^{name} \?= (.*)$", makefile, re.M).group(1).split()
                             for name in ("MPI_RANKS", "NODE_RANKS"))
    said = " ".join(line.strip().lstrip("#").strip() for line in README.read_text().splitlines()
                    if line.startswith(("    make test", "                  #")))
    assert f"mpi_tests/ on {mpi_ranks[0]}-{mpi_ranks[-1]} ranks" in said, said
    assert f"on {', '.join(node_ranks[:-1])} and {node_ranks[-1]} ranks as simulated nodes" in said, said


def test_head_dims_the_docs_say_run_natively_are_the_kernels():
    """README and 'run --help' say which head dims the kernels run natively as the kernel sources list them."""
    from burst_hpc.backends.cuda.contract import native_widths
    from burst_hpc.cli_parser import FILE_FORMAT

    everywhere, hopper = native_widths("sm80", "fwd"), native_widths("sm90", "fwd")
    assert native_widths("sm80", "bwd") == everywhere and native_widths("sm90", "bwd") == hopper
    extra = [d for d in hopper if d not in everywhere]
    said = (f"{' and '.join(map(str, everywhere))} run natively, and on Hopper (sm90) {' and '.join(map(str, extra))} "
            "as well")
    wide = f"above {hopper[-1]} on Hopper, above {everywhere[-1]} on other GPUs"
    for text in (README.read_text(), FILE_FORMAT):
        flat = " ".join(text.split())
        assert said in flat and wide in flat, flat[flat.find("Head dims"):][:400]
