"""The run's report (issue 25, items 2 and 4): the set-up timed apart from the passes, the phases on
the summary line, in --json and in the output's attributes, all agreeing; --json refused before any
work; progress lines inside a long pass, counted in visible pairs."""
import json
import re
import time
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
from mpi4py import MPI
import burst_hpc

from burst_hpc.plan import decomposition, masks
from burst_hpc import config
from burst_hpc.engine import passes
from burst_hpc.job import report
from burst_hpc.backends.numpy_backend import NumpyBackend
from burst_hpc.plan.callplan import Backward, checked_call, plan_arrays
from burst_hpc.plan.layout import make_layout
from burst_hpc.job.run import RunOptions, run
from burst_hpc.job.progress import PassMeter, Progress
from burst_hpc.plan.schedule import BlockPair

from test_cli import burst, leftovers, mpirun, needs_mpiexec

SECONDS = ["read", "setup", "forward", "backward", "write", "verify", "total"]


def _gen(path, seqlen, dtype="float32", heads=4, kv_heads=2, head_dim=16):
    r = burst("gen", path, "--seqlen", seqlen, "--heads", heads, "--kv-heads", kv_heads, "--head-dim", head_dim,
              "--dtype", dtype, "--seed", 3, "--with-grad")
    assert r.returncode == 0, r.stderr


def _summary_seconds(line):
    """{phase: seconds or None} from the summary line's 'seconds: read 0.012 ... total 0.300'."""
    text = line.split("seconds: ")[1].split("  ")[0].split()
    return {name: None if value == "-" else float(value) for name, value in zip(text[::2], text[1::2])}


@needs_mpiexec
def test_summary_json_and_attributes_agree(tmp_path):
    src, dst, js = tmp_path / "in.h5", tmp_path / "out.h5", tmp_path / "run.json"
    _gen(src, 96, "bfloat16")
    r = mpirun(2, "run", src, dst, "--causal", "--backward", "--verify", "--backend", "numpy", "--json", js)
    assert r.returncode == 0, r.stdout + r.stderr
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("burst-hpc run:")]
    facts = json.loads(js.read_text())
    seconds = facts["seconds"]
    assert list(_summary_seconds(line)) == SECONDS and sorted(seconds) == sorted(SECONDS)
    for name, value in _summary_seconds(line).items():
        assert value == pytest.approx(seconds[name], abs=6e-4), (name, line)
    assert all(seconds[name] > 0 for name in SECONDS), seconds
    assert seconds["total"] >= sum(seconds[name] for name in report.PHASES)
    # the choices are the run's, as the summary line says them
    # the job shards the file itself, by the layout the cost model picks for it
    picked = burst_hpc.choose_layout(96, 2, causal=True, heads=4, kv_heads=2, head_dim=16, dtype="bfloat16",
                                     backend="numpy").kind
    choices = (facts["backend"], facts["layout"], facts["transport"], facts["scheme"])
    assert choices == ("numpy", picked, "host", "gather" if picked == "chunks" else "ring")
    for needle in ("backend=numpy", f"layout={picked}", "transport=host", "verify=PASS"):
        assert needle in line
    sizes = facts["sizes"]
    assert (sizes["seqlen"], sizes["heads"], sizes["kv_heads"], sizes["head_dim"], sizes["dtype"], sizes["ranks"]) == \
        (96, 4, 2, 16, "bfloat16", 2)
    assert facts["causal"] is True and facts["backward"] is True and facts["warmup"] is False
    assert facts["verify"]["outcome"] == "pass" and set(facts["verify"]["max_err"]) == {"o", "lse", "dq", "dk", "dv"}
    assert facts["device"].startswith("cpu") and facts["versions"]["burst_hpc"] and facts["versions"]["mpi"]
    for name, short in (("forward", "fwd"), ("backward", "bwd")):
        assert facts["tflops"][name] == pytest.approx(facts["flops"][name] / seconds[name] / 1e12)
        # per rank (per GPU on a cuda run): the job's rate over the ranks, in the summary too
        assert facts["tflops_per_rank"][name] == pytest.approx(facts["tflops"][name] / 2)
        assert f"{short} {seconds[name]:.3f}s {facts['tflops'][name]:.3g} TFLOP/s " \
               f"({facts['tflops_per_rank'][name]:.3g}/rank)" in line, line
        # each rank's pass: its block kernels within it, the rest exposed
        assert len(facts["ranks"]) == 2
        for entry in facts["ranks"]:
            assert 0 < entry[f"{name}_compute_s"] <= entry[f"{name}_s"], entry
            assert entry[f"{name}_exposed"] == pytest.approx(1 - entry[f"{name}_compute_s"] / entry[f"{name}_s"])
    assert facts["verify"]["rows"] == 96 // 2 and facts["verify"]["predicted_s"] > 0   # full: every token of a rank
    # the same facts in the output's attributes
    with h5py.File(dst, "r") as f:
        for name in SECONDS:
            assert f.attrs[f"seconds_{name}"] == pytest.approx(seconds[name]), name
        for name in ("forward", "backward"):
            assert f.attrs[f"tflops_{name}"] == pytest.approx(facts["tflops"][name])
        assert f.attrs["run_scheme"].decode() == facts["scheme"] and f.attrs["run_backend"] == "numpy"
        assert f.attrs["run_device"] == facts["device"] and not f.attrs["run_warmup"]
        assert json.loads(f.attrs["run_versions"]) == facts["versions"]
        # the sizes, mask and choices as the report has them, the mask read back as verify reads it
        assert {name: f.attrs[name] for name in ("batch", "seqlen", "heads", "kv_heads", "head_dim", "dtype")} == \
            {name: sizes[name] for name in ("batch", "seqlen", "heads", "kv_heads", "head_dim", "dtype")}
        assert (f.attrs["run_ranks"], f.attrs["run_layout"], f.attrs["source"]) == (2, picked, facts["input"])
        assert report.recorded_mask(dict(f.attrs)) == (True, None, pytest.approx(16 ** -0.5))
    assert not leftovers(tmp_path)


def test_an_output_reads_back_the_mask_it_was_made_with():
    """report.output_attrs writes the mask, report.recorded_mask (burst-hpc verify) reads it: one schema."""
    spec = SimpleNamespace(batch=1, seqlen=64, heads=4, kv_heads=2, head_dim=16, dtype=np.dtype(np.float32),
                           cu_seqlens=np.array([0, 40, 64]))
    choices = {"layout": "contiguous", "transport": "host", "backend": "numpy"}
    for causal, window in ((True, None), (False, (8, 0)), (False, (-1, 3))):
        options = RunOptions("in.h5", "out.h5", causal=causal, window=window)
        facts = report.start(options, spec, 2, choices, "cpu x86_64", {"burst_hpc": "0"}, 100, (1.0, None))
        attrs = report.output_attrs(facts, 0.25)
        assert report.recorded_mask(attrs) == (causal, window, 0.25)
        assert attrs["documents"] == 2 and attrs["run_layout"] == "contiguous"
    assert report.recorded_mask({}) == (None, None, None)   # written by another program: nothing recorded


@needs_mpiexec
@pytest.mark.parametrize("where", ["missing directory", "a directory", "the output"])
def test_json_that_cannot_be_written_is_refused_before_any_work(tmp_path, where):
    src, dst = tmp_path / "in.h5", tmp_path / "out.h5"
    _gen(src, 32)
    path = {"missing directory": tmp_path / "nowhere" / "run.json", "a directory": tmp_path,
            "the output": dst}[where]
    r = mpirun(2, "run", src, dst, "--backend", "numpy", "--json", path, "--progress")
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.count("burst-hpc: error:") == 1 and "--json" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "read " not in r.stderr  # no work: not even the read
    assert not dst.exists() and not leftovers(tmp_path) and not (tmp_path / "nowhere").exists()


def test_json_path_check_tries_the_directory(tmp_path):
    report.check_json_path(str(tmp_path / "ok.json"))
    assert list(tmp_path.iterdir()) == []  # the probe is gone
    (tmp_path / "old.json").write_text("{}")
    report.check_json_path(str(tmp_path / "old.json"))  # an existing report is replaced at the end
    with pytest.raises(Exception, match="--json"):
        report.check_json_path(str(tmp_path / "in.h5"), (str(tmp_path / "in.h5"),))


class FirstUseCosts(NumpyBackend):
    """A backend whose first call of each kind (direction, mask or not) costs PAUSE seconds, as a GPU's
    first launch of a kernel instance loads (or compiles) it."""
    PAUSE = 0.4

    def __init__(self):
        super().__init__()
        self.loaded = set()
        self.calls = []

    def _first_use(self, direction, masked):
        if (direction, masked) not in self.loaded:
            self.loaded.add((direction, masked))
            time.sleep(self.PAUSE)

    def forward_block(self, q, k, v, o, lse, **kw):
        self.calls.append(("fwd", q.shape[1], k.shape[1]))
        self._first_use("fwd", kw["masked"])
        super().forward_block(q, k, v, o, lse, **kw)

    def backward_block(self, q, k, v, do, lse, delta, dq, dk, dv, **kw):
        self.calls.append(("bwd", q.shape[1], k.shape[1]))
        self._first_use("bwd", kw["masked"])
        super().backward_block(q, k, v, do, lse, delta, dq, dk, dv, **kw)


@pytest.mark.parametrize("warmup", [False, True])
def test_first_use_costs_go_to_the_setup_not_the_passes(tmp_path, monkeypatch, warmup):
    """Without --warmup the passes no longer pay for first use: the set-up's rehearsal meets every
    kind of block pair the passes run (here each first use costs 0.4 s, the passes far less)."""
    src, dst = tmp_path / "in.h5", tmp_path / "out.h5"
    _gen(src, 512)
    backend = FirstUseCosts()
    monkeypatch.setattr(decomposition, "get_backend", lambda q: backend)
    outcome = run(RunOptions(str(src), str(dst), causal=True, backward=True, backend="numpy", warmup=warmup,
                             progress=False), MPI.COMM_SELF)
    seconds = outcome.report["seconds"]
    assert {"fwd", "bwd"} <= {direction for direction, _ in backend.loaded}
    assert seconds["setup"] >= len(backend.loaded) * FirstUseCosts.PAUSE
    assert seconds["forward"] < FirstUseCosts.PAUSE and seconds["backward"] < FirstUseCosts.PAUSE, seconds
    assert outcome.forward_s == seconds["forward"] and outcome.report["warmup"] is warmup
    assert f"setup {seconds['setup']:.3f}" in outcome.summary


def _plan(seqlen, causal, backend, heads=2, d=8, layout="contiguous", dtype=np.float32, scheme="auto"):
    """A one-rank plan ('auto': the packed passes, one block call a pass; 'ring': the ring's)."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, seqlen, heads, d)).astype(dtype)
    k, v, do = (rng.standard_normal(q.shape).astype(dtype) for _ in range(3))
    plan = plan_arrays(MPI.COMM_SELF, q, checked_call(1, q, k, v, causal, None, make_layout(layout, seqlen, 1), "auto",
                                                      backward=Backward(do, ring="kv"), scheme=scheme))
    plan.backend = backend
    return plan, q, k, v, do


@pytest.mark.parametrize("scheme", ["ring", "auto"])
def test_rehearsal_runs_each_kind_of_pair_once_on_its_first_keys(scheme):
    """The ring's rehearsal runs each kind of pair on its first keys; the packed passes' (one call a pass) the
    call on its first query rows."""
    backend = FirstUseCosts()
    backend.PAUSE = 0
    plan, q, k, v, do = _plan(1024, True, backend, layout="zigzag", scheme=scheme)
    o, lse = plan.passes.forward(q, k, v, rehearse=True)
    plan.passes.backward("kv", do, q, k, v, o, lse, rehearse=True)
    rehearsed = list(backend.calls)
    backend.calls.clear()
    o, lse = plan.passes.forward(q, k, v)
    plan.passes.backward("kv", do, q, k, v, o, lse)
    cut, kept = (2, 1) if scheme == "ring" else (1, 2)   # (pass, rows, keys): what the rehearsal cuts and keeps
    assert rehearsed and all(call[cut] <= passes.REHEARSAL_KEYS for call in rehearsed)
    assert {(c[0], c[kept]) for c in rehearsed} == {(c[0], c[kept]) for c in backend.calls}
    assert len(rehearsed) <= len(backend.calls)
    if scheme == "auto":
        assert len(backend.calls) == 2 and all(c[1] == 1024 for c in backend.calls)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("last_pairs", [False, True])
def test_row_parts_of_the_meter_change_no_bit(causal, last_pairs, monkeypatch):
    """The NumPy backend's pairs cut into row parts for the meter give the same bits, also where the last
    pair of some rows writes the outputs (BURST_HPC_RING_LAST_PAIRS, 16-bit inputs): a pair's row parts
    share its keys, so only its last part may finish dk and dv."""
    if last_pairs:
        monkeypatch.setenv("BURST_HPC_RING_LAST_PAIRS", "1")
    plan, q, k, v, do = _plan(1000, causal, NumpyBackend(block_q=32, block_k=64),
                              dtype=np.float16 if last_pairs else np.float32)
    progress = Progress(False, 60)
    meter = PassMeter(progress, "forward", np)
    whole = plan.passes.forward(q, k, v)
    cut = plan.passes.forward(q, k, v, meter=meter)
    assert meter.finished == meter.total > 0
    grads = plan.passes.backward("kv", do, q, k, v, *whole)
    meter = PassMeter(progress, "backward", np)
    grads_cut = plan.passes.backward("kv", do, q, k, v, *whole, meter=meter)
    assert meter.finished == meter.total
    for a, b in zip(whole + grads, cut + grads_cut):
        assert np.array_equal(a, b)


def test_block_pair_visible_counts_the_mask():
    causal = masks.make(110, True)
    pair = BlockPair(slice(0, 10), slice(0, 8), 100, 96, True)  # query 100 + i sees keys <= 100 + i
    brute = sum(1 for i in range(10) for j in range(8) if 96 + j <= 100 + i)
    assert pair.visible(causal) == brute
    assert sum(pair.rows(lo, min(10, lo + 3)).visible(causal) for lo in range(0, 10, 3)) == brute
    assert BlockPair(slice(0, 10), slice(0, 8), 0, 0, False).visible(causal) == 80


class SlowNumpy(NumpyBackend):
    """A slow CPU: each call of a pair (or part of one) takes 20 ms."""

    def forward_block(self, *args, **kw):
        time.sleep(0.02)
        super().forward_block(*args, **kw)


def test_progress_lines_come_by_time_inside_one_long_step(capsys):
    """One rank: the whole pass is one ring step of one block pair; the lines still come every
    interval, counted in visible pairs, with an ETA, and never more often than the interval."""
    plan, q, k, v, _ = _plan(2048, False, SlowNumpy(block_q=16))
    progress = Progress(True, 0.1)
    start = time.perf_counter()
    plan.passes.forward(q, k, v, meter=progress.meter("forward", np))
    elapsed = time.perf_counter() - start
    lines = [x for x in capsys.readouterr().err.splitlines() if "] forward: " in x]
    shares = [float(re.search(r"forward: ([\d.]+)% of rank 0's visible pairs", x).group(1)) for x in lines]
    assert len(lines) >= 5 and len(lines) <= elapsed / 0.1 + 1, lines
    assert shares == sorted(shares) and 0 < shares[-1] <= 100 and all(", ETA " in x for x in lines), lines
    assert Progress(False, 0.1).meter("forward", np) is None  # rank != 0 or --quiet: no meter at all


def test_progress_interval_setting(monkeypatch):
    monkeypatch.setenv("BURST_HPC_PROGRESS_SECONDS", "0.5")
    assert config.progress_seconds() == 0.5
    for bad in ("0", "-1", "nan", "soon"):
        monkeypatch.setenv("BURST_HPC_PROGRESS_SECONDS", bad)
        with pytest.raises(Exception, match="BURST_HPC_PROGRESS_SECONDS"):
            config.progress_seconds()
