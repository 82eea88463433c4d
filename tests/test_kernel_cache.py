"""The kernel cache without CuPy (backends/cuda/compile.py): what a build compiles, the key, one compile per
cache directory whatever the processes and threads sharing it, BURST_HPC_NO_JIT, and the `compile` and
`info` verbs, on a fake compiler (tests/fake_compiler.py) that counts its compiles. The per-node sharing
under MPI: mpi_tests/test_kernel_cache.py; the builds through nvcc: test_kernel_contract.py."""
import multiprocessing
import shutil
import threading

import pytest

from burst_hpc import cli
from burst_hpc.backends.cuda import compile as compiling
from burst_hpc.backends.cuda import contract
from burst_hpc.backends.cuda.backend import kernel_builds
from burst_hpc.backends.cuda.compile import Build, KernelCache, call_builds, prepare
from burst_hpc.errors import BackendError
from fake_compiler import FakeCompiler

FWD90 = contract.SOURCES["sm90", "fwd"]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cupy"))
    monkeypatch.delenv("BURST_HPC_NO_JIT", raising=False)
    return tmp_path / "cupy" / "burst_hpc"


def fake(tmp_path, **kw):
    return FakeCompiler(tmp_path / "store", tmp_path / "compiles.log", **kw)


def one_instance(source=FWD90, head_dim=128, dtype="bf16", mask="causal"):
    (inst,) = [i for i in contract.instances(source) if i[:3] == (dtype, head_dim, mask)][:1]
    return Build(source, inst)


# ---- what a build compiles ----------------------------------------------------------------------------------
def test_a_build_selects_its_instance_or_the_table_with_defines_before_the_source():
    build = one_instance()
    code = build.code(contract.cuda_dir())
    assert code.startswith("#define BH_SELECT_DTYPE bf16\n#define BH_SELECT_MASK causal\n#define BH_SELECT_SHAPE 128, 2\n")
    assert '#line 1 "cuda/contract.cuh"' in code and "#include" not in code.split("\n", 4)[3]  # headers pasted in
    assert build.name() == "attn_fwd_sm90-bf16-d128-causal-128x2"
    table = Build(FWD90)
    assert table.code(contract.cuda_dir()).startswith("#define BH_TABLE_ONLY\n") and table.name() == "attn_fwd_sm90-table"


def test_a_call_needs_the_tables_and_only_its_instances():
    builds = call_builds("sm90", {"bf16"}, {64}, ("full", "causal"), ("fwd", "bwd"))
    names = [b.name() for b in builds]
    assert names == ["attn_fwd_sm90-table", "attn_fwd_sm90-bf16-d64-full-64x2", "attn_fwd_sm90-bf16-d64-causal-64x2",
                     "attn_fwd_sm90-bf16-d64-full-64x3", "attn_fwd_sm90-bf16-d64-causal-64x3",  # both tile heights
                     "attn_bwd_sm90-table", "attn_bwd_sm90-bf16-d64-full-64", "attn_bwd_sm90-bf16-d64-causal-64",
                     "attn_delta-table"]
    # head dims routed as a call routes them: 100 runs the 128 kernels zero-padded, 512 the kernel-free path
    padded = kernel_builds("sm80", {"f16"}, [100], ("interval",), ("fwd",))
    assert [b.name() for b in padded] == ["attn_fwd-table", "attn_fwd-f16-d128-interval-128"]
    assert [b.name() for b in kernel_builds("sm80", {"f16"}, [512], ("full",), ("fwd",))] == ["attn_fwd-table"]


def test_the_key_covers_the_selection_every_header_and_the_options(tmp_path, cache_dir):
    sources = tmp_path / "cuda"
    shutil.copytree(contract.cuda_dir(), sources)
    compiler = fake(tmp_path)
    cache = KernelCache(compiler, sources=sources)
    build = one_instance()
    path = cache.entry(build)[0]
    assert path.parent == cache_dir and path.name.startswith(build.name() + "-")
    assert KernelCache(compiler, sources=sources).entry(one_instance(mask="full"))[0] != path
    (sources / "sm90_pipeline.cuh").write_text((sources / "sm90_pipeline.cuh").read_text() + "\n// changed\n")
    assert KernelCache(compiler, sources=sources).entry(build)[0] != path  # a header edit is a new entry

    class OtherOptions(FakeCompiler):
        def options(self, source):
            return super().options(source) + ("-lineinfo",)

    assert KernelCache(OtherOptions(tmp_path, tmp_path / "log"), sources=sources).entry(build)[0] != path


# ---- one compile per cache directory -------------------------------------------------------------------------
def test_a_build_is_compiled_once_then_loaded_and_listed(tmp_path, cache_dir):
    compiler = fake(tmp_path)
    cache = KernelCache(compiler)
    build = one_instance()
    assert not cache.compiled(build)
    assert cache.module(build) == {"module": build.name(), "compiled here": True}
    again = KernelCache(compiler)  # another process's view
    assert again.compiled(build) and again.ensure(build) == ("cached", None)
    assert again.module(build) == {"module": build.name(), "compiled here": False}
    assert [c[0] for c in compiler.compiles()] == [build.name()]
    (entry,) = compiling.entries()
    assert entry["build"] == build.name() and entry["target"] == "sm_90a" and entry["toolchain"] == "fake 1.0"
    text = "\n".join(compiling.describe_cache())
    assert str(cache_dir) in text and "attn_fwd_sm90.cu for sm_90a (fake 1.0): bf16-d128-causal-128x2" in text


def _race(store, log, directory, start, results):
    compiler = FakeCompiler(store, log, delay=0.5)
    start.wait()
    results.put(KernelCache(compiler, directory=directory).ensure(one_instance())[0])


def test_processes_racing_on_one_cache_directory_compile_once(tmp_path, cache_dir):
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(tmp_path / "store", tmp_path / "compiles.log", cache_dir, start, results))
             for _ in range(4)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    hows = sorted(results.get(timeout=5) for _ in procs)
    assert len(fake(tmp_path).compiles()) == 1
    assert [c[0] for c in compiling.compiles(cache_dir)] == [one_instance().name()]  # the cache's own log
    assert hows[0] == "compiled" and set(hows[1:]) <= {"waited", "cached"}
    assert "waited" in hows  # the second look: they queued on the lock while it compiled


def test_threads_of_one_process_compile_once(tmp_path, cache_dir):
    cache = KernelCache(fake(tmp_path, delay=0.3))
    hows = []
    threads = [threading.Thread(target=lambda: hows.append(cache.ensure(one_instance())[0])) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(hows) == ["compiled", "waited", "waited"] and len(cache.compiler.compiles()) == 1


@pytest.mark.skipif((multiprocessing.cpu_count() or 1) < 2, reason="one CPU: one compile thread")
def test_prepare_compiles_a_call_s_builds_at_once(tmp_path, cache_dir):
    builds = call_builds("sm90", {"bf16"}, {128}, ("full", "causal"), ("fwd",))
    meet = threading.Barrier(2, timeout=10)  # a compile waits here for a second one: serial compiles fail
    cache = KernelCache(fake(tmp_path, meet=meet))
    done = prepare(cache, builds[:2])
    assert done == {b.name(): "compiled" for b in builds[:2]}
    meet.reset()
    cache.compiler.meet = None
    assert prepare(cache, builds) == {builds[0].name(): "cached", builds[1].name(): "cached", builds[2].name(): "compiled"}
    assert sorted(c[0] for c in cache.compiler.compiles()) == sorted(b.name() for b in builds)


def test_a_compile_error_is_a_backend_error(tmp_path, cache_dir):
    build = one_instance()
    cache = KernelCache(fake(tmp_path, fail=build.name()))
    with pytest.raises(BackendError, match="compiling kernels failed: RuntimeError: nvrtc: error in attn_fwd_sm90"):
        prepare(cache, [build])
    assert not cache.compiled(build)  # no entry for a failed compile: the next call tries again


# ---- BURST_HPC_NO_JIT ---------------------------------------------------------------------------------------
def test_no_jit_fails_fast_naming_the_command_that_builds_the_kernels(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("BURST_HPC_NO_JIT", "1")
    cache = KernelCache(fake(tmp_path))
    builds = kernel_builds("sm90", {"bf16"}, [128], ("full", "causal"), ("fwd", "bwd"))
    command = "burst-hpc compile --family sm90 --head-dim 128 --dtype bf16"
    with pytest.raises(BackendError, match=f"BURST_HPC_NO_JIT=1 and the kernel cache {cache_dir} lacks .*: {command}$"):
        prepare(cache, builds)
    with pytest.raises(BackendError, match=command):
        cache.module(builds[1])
    assert cache.compiler.compiles() == []


def test_the_compile_verb_fills_the_cache_that_no_jit_then_reads(tmp_path, cache_dir, monkeypatch, capsys):
    compiler = fake(tmp_path)
    monkeypatch.setattr(compiling, "default_cache", lambda: KernelCache(compiler))
    # the fixed costs compile measures next launch real kernels (on a GPU): not this fake compiler's
    monkeypatch.setattr("burst_hpc.plan.calibrate.calibrate", lambda *a, **k: ("fake", {"step_us": 1.0}, "here"))
    assert cli.main(["compile", "--family", "sm90", "--head-dim", "128", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    wanted = kernel_builds("sm90", {"bf16"}, [128], ("full", "causal", "interval"), ("fwd", "bwd"))
    assert f"kernel cache {cache_dir}: {len(wanted)} build(s) of sm90: {len(wanted)} compiled, 0 already there" in out
    assert sorted(c[0] for c in compiler.compiles()) == sorted(b.name() for b in wanted)
    monkeypatch.setenv("BURST_HPC_NO_JIT", "1")
    call = kernel_builds("sm90", {"bf16"}, [100], ("full", "interval"), ("fwd", "bwd"))  # padded to 128
    assert set(prepare(KernelCache(compiler), call).values()) == {"cached"}
    assert cli.main(["info"]) == 0
    info = capsys.readouterr().out
    assert f"kernel cache: {cache_dir} ({len(wanted)} build(s);" in info and "BURST_HPC_NO_JIT=1: no compiling" in info
    assert "attn_bwd_sm90.cu for sm_90a (fake 1.0): bf16-d128-causal-128, bf16-d128-full-128" in info


def test_the_compile_verb_refuses_bad_choices(tmp_path, cache_dir, monkeypatch, capsys):
    monkeypatch.setattr(compiling, "default_cache", lambda: KernelCache(fake(tmp_path)))
    for argv in (["--family", "sm90", "--head-dim", "0"], ["--family", "sm70"], ["--dtype", "f64"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["compile", *argv])
        assert exit_.value.code == 2
    assert "argument --dtype: the cuda backend takes bfloat16, float16 or float32 inputs; got float64" in \
        capsys.readouterr().err
    assert fake(tmp_path).compiles() == []
