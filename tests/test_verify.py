"""The sampled check (burst_hpc.job.verify.check) on one process: its sums equal the float64 oracle under
every mask, corrupted outputs fail naming what failed, NaN and Inf that match the oracle pass, the
predicted cost is announced, and the run job's budget sizes the sample."""
import re
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from burst_hpc import tolerance
from burst_hpc.job import verify, verify_cost, verify_sums, verify_warm
from burst_hpc.dtypes import bfloat16
from burst_hpc.plan import masks
from burst_hpc.reference import attention_backward_reference, attention_reference

B, S, HQ, HKV, D, SCALE = 2, 40, 4, 2, 8, 0.3
MASKS = {"none": (False, None, None), "causal": (True, None, None), "window": (True, (5, 0), None),
         "documents+window": (False, (3, 4), np.array([0, 11, 30, 40]))}


def _spec(dtype, cu_seqlens=None):
    return SimpleNamespace(batch=B, seqlen=S, heads=HQ, kv_heads=HKV, head_dim=D, dtype=np.dtype(dtype),
                           cu_seqlens=cu_seqlens)


def _problem(dtype, mask, seed=0, poke=None):
    """Inputs and the oracle's outputs in the stored dtypes (lse float32 unless ``dtype`` is float64)."""
    causal, window, cu = MASKS[mask]
    rng = np.random.default_rng(seed)
    q, do = (rng.standard_normal((B, S, HQ, D)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((B, S, HKV, D)).astype(dtype) for _ in range(2))
    inputs = {"q": q, "k": k, "v": v, "do": do}
    if poke is not None:
        name, index, value = poke
        inputs[name][index] = value
    with np.errstate(invalid="ignore"):
        o, lse = attention_reference(q, k, v, causal, SCALE, window=window, cu_seqlens=cu)
        dq, dk, dv = attention_backward_reference(do, q, k, v, causal, SCALE, window=window, cu_seqlens=cu)
    lse_type = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    outputs = {"o": o.astype(dtype), "lse": lse.astype(lse_type), "dq": dq.astype(dtype), "dk": dk.astype(dtype),
               "dv": dv.astype(dtype)}
    return inputs, outputs, (causal, window, cu)


def _check(inputs, outputs, mask_args, dtype, rows=S, **kwargs):
    causal, window, cu = mask_args
    return verify.verify_resident(inputs, outputs, np.arange(S), _spec(dtype, cu), MPI.COMM_SELF,
                                  masks.make(S, causal, window, cu), SCALE, rows=rows, **kwargs)


@pytest.fixture(params=["full", "sampled"])
def sampled(request, monkeypatch):
    """Both modes, with key blocks of 7 tokens (several blocks, one ragged)."""
    monkeypatch.setattr(verify_cost, "BLOCK_ELEMENTS", {"numpy": 7 * B * HQ * S, "cuda": 7 * B * HQ * S})
    if request.param == "sampled":
        monkeypatch.setattr(verify, "FULL_LIMIT", 10)
    return request.param == "sampled"


@pytest.mark.parametrize("mask", MASKS)
def test_the_sums_equal_the_oracle(mask, sampled):
    """float64 outputs equal to the oracle: every error is float64 rounding (the reference is exact)."""
    inputs, outputs, mask_args = _problem(np.float64, mask)
    report = _check(inputs, outputs, mask_args, np.float64, rows=13 if sampled else S)
    assert report["ok"], report
    assert report["mode"] == ("sampled 13 rows+cols/rank" if sampled else "full")
    for name in ("o", "lse", "dq", "dk", "dv"):
        assert report["err"][name] < 1e-12, (name, report["err"])


@pytest.mark.parametrize("mask", ["causal", "documents+window"])
@pytest.mark.parametrize("name,where", [("o", (0, 5)), ("lse", (1, slice(None), 5)), ("dq", (0, 5)),
                                        ("dk", (1, 7)), ("dv", (0, 30))])
def test_a_corrupted_output_fails_by_name(mask, name, where, sampled):
    """One token of one output off by 0.5 (lse: one row of every head): that output fails, and no other but
    dk and dv when o or lse is off (their reference takes delta and P from the output's o and lse)."""
    inputs, outputs, mask_args = _problem(bfloat16, mask)
    report = _check(inputs, outputs, mask_args, bfloat16, rows=S)  # every token sampled, also when 'sampled'
    assert report["ok"], report
    outputs[name] = outputs[name].copy()
    outputs[name][where] += np.asarray(0.5, outputs[name].dtype)
    report = _check(inputs, outputs, mask_args, bfloat16, rows=S)
    assert name in report["failed"], report
    assert set(report["failed"]) <= {name} | ({"dk", "dv"} if name in ("o", "lse") else set()), report
    assert re.search(rf"(^|; ){name}: max error \S+ > tolerance \S+", verify.failures(report)), verify.failures(report)


@pytest.mark.parametrize("poke", [("k", (0, 9, 1, 3), np.nan), ("v", (1, 20, 0, 2), np.inf),
                                  ("q", (0, 33, 2, 0), np.nan), ("do", (1, 12, 3, 5), np.nan)])
def test_nonfinite_outputs_that_match_the_oracle_pass(poke, sampled):
    """Inputs holding NaN or Inf (causal, documents): the oracle's outputs, NaN where it has NaN, pass;
    the same outputs with NaN in a row the oracle keeps finite fail, as non-finite."""
    inputs, outputs, mask_args = _problem(np.float32, "causal", poke=poke)
    assert any(not np.isfinite(x).all() for x in outputs.values())
    assert all(np.isfinite(x[:, :9]).all() for n, x in outputs.items() if n in ("o", "dq"))  # rows before the poke
    report = _check(inputs, outputs, mask_args, np.float32, rows=S)
    assert report["ok"], report
    outputs["o"] = outputs["o"].copy()
    outputs["o"][0, 2, 1, 1] = np.nan
    report = _check(inputs, outputs, mask_args, np.float32, rows=S)
    assert report["failed"][0] == "o" and set(report["failed"]) <= {"o", "dk"}, report  # dk: its delta takes o
    assert "o: NaN or Inf where the float64 oracle has none" in verify.failures(report), report


def test_forward_only_checks_o_and_lse(sampled):
    inputs, outputs, mask_args = _problem(bfloat16, "window")
    report = _check({n: inputs[n] for n in "qkv"}, {n: outputs[n] for n in ("o", "lse")}, mask_args, bfloat16, rows=9)
    assert report["ok"] and sorted(report["err"]) == ["lse", "o"], report


def test_the_predicted_cost_is_announced_first(monkeypatch):
    monkeypatch.setattr(verify, "FULL_LIMIT", 10)
    inputs, outputs, mask_args = _problem(bfloat16, "causal")
    lines = []
    report = _check(inputs, outputs, mask_args, bfloat16, rows=11, announce=lines.append)
    assert report["ok"] and len(lines) == 1, lines
    assert re.fullmatch(r"verify: 11 rows and 11 key columns per rank against 40 tokens \(sampled 11 rows\+cols/rank, "
                        r"CPU float64\), about \d\S*s", lines[0]), lines
    assert report["predicted_s"] > 0


def test_the_budget_sizes_the_sample(monkeypatch):
    """The run job's budget: a tiny one takes LEAST_ROWS samples, an ample one the most asked for."""
    monkeypatch.setattr(verify, "FULL_LIMIT", 10)
    monkeypatch.setattr(verify, "LEAST_ROWS", 5)
    inputs, outputs, mask_args = _problem(bfloat16, "none")
    assert _check(inputs, outputs, mask_args, bfloat16, rows=30, budget_s=1e-12)["mode"] == "sampled 5 rows+cols/rank"
    assert _check(inputs, outputs, mask_args, bfloat16, rows=30, budget_s=1e6)["mode"] == "sampled 30 rows+cols/rank"


@pytest.mark.parametrize("dtype", [bfloat16, np.float16, np.float32])
def test_rounding_matches_numpy_casts(dtype):
    x = np.random.default_rng(3).standard_normal(100000) * np.logspace(-40, 38, 100000)
    x = np.concatenate([x, [np.inf, -np.inf, np.nan, 0.0, -0.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 65504.0, 1e-39]])
    _, rnd = verify_sums.rounder(dtype, np)
    with np.errstate(over="ignore"):
        want = x.astype(np.float32).astype(dtype).astype(np.float32)
        assert np.array_equal(rnd(x), want, equal_nan=True)


def test_max_err_counts_nonfinite_against_nonfinite_as_no_error():
    ref = np.array([1.0, np.nan, np.inf, -np.inf])
    assert tolerance.max_err(np.array([1.5, np.inf, np.nan, -np.inf]), ref) == 0.5
    assert tolerance.max_err(np.array([1.0, 0.0, np.inf, -np.inf]), ref) == np.inf
    assert tolerance.max_err(np.array([np.nan, np.nan, np.inf, -np.inf]), ref) == np.inf
    assert tolerance.max_err(np.array([-np.inf, np.nan, np.inf, -np.inf]), ref) == np.inf


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_a_plain_nan_is_credited_with_the_outputs_rounding(dtype):
    """Where a poisoned input leaves the plain computation NaN and the oracle finite, the plain error there is
    the oracle's rounding to the output dtype (not 0, which would leave the tolerance its floor alone: a
    bfloat16 dv of magnitude 4-8 rounds by up to 0.0156 against a floor of ~0.014)."""
    from burst_hpc.dtypes import parse_dtype

    rng = np.random.default_rng()
    ref = rng.uniform(4, 8, 64)
    ulp = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}[dtype] * 8   # one ulp in [4, 8)
    nan = np.full_like(ref, np.nan)
    err = tolerance.plain_error("dv", nan, ref, dtype)
    rounded = np.abs(ref.astype(parse_dtype(dtype)).astype(np.float64) - ref)
    assert err == rounded.max() and 0 < err <= ulp / 2
    assert tolerance.plain_error("dv", ref + 0.5, ref, dtype) == pytest.approx(0.5)
    # an entry non-finite in both says nothing; lse keeps float32's rounding whatever the inputs
    assert tolerance.plain_error("o", np.array([np.nan, 1.0]), np.array([np.inf, 1.0]), dtype) == 0.0
    assert tolerance.plain_error("lse", nan, ref, dtype) == np.abs(ref.astype(np.float32) - ref).max()


def _gpu():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("no GPU")
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("no GPU")
    return cupy


@pytest.mark.parametrize("mask", ["causal", "documents+window"])
def test_on_the_gpu_as_on_the_cpu(mask, monkeypatch):
    """CuPy shards (a cuda run's): the check runs on the device and finds what the CPU finds, a corrupted
    dk included; NaN that match the oracle pass there too."""
    cupy = _gpu()
    monkeypatch.setattr(verify, "FULL_LIMIT", 10)
    for dtype, poke in ((bfloat16, None), (np.float32, ("k", (0, 9, 1, 3), np.nan))):
        inputs, outputs, mask_args = _problem(dtype, mask, poke=poke)
        outputs["dk"] = outputs["dk"].copy()
        for bad in (False, True):
            if bad:
                outputs["dk"][1, 7] += np.asarray(0.5, outputs["dk"].dtype)
            cpu = _check(inputs, outputs, mask_args, dtype, rows=17)
            gpu = _check({n: cupy.asarray(x) for n, x in inputs.items()},
                         {n: cupy.asarray(x) for n, x in outputs.items()}, mask_args, dtype, rows=17)
            assert gpu["ok"] == cpu["ok"] == (not bad) and gpu["failed"] == cpu["failed"], (gpu, cpu)
            for name in cpu["err"]:
                assert gpu["err"][name] == pytest.approx(cpu["err"][name], rel=1e-6, abs=1e-12), name
                assert gpu["tol"][name] == pytest.approx(cpu["tol"][name], rel=0.25), name  # float32 sums differ


def test_alone_runs_the_sampled_check(monkeypatch):
    """The check on the one-process communicator (burst-hpc compile's warming, no MPI library)."""
    from burst_hpc.collective import Alone

    monkeypatch.setattr(verify, "FULL_LIMIT", 10)
    inputs, outputs, (causal, window, cu) = _problem(bfloat16, "documents+window")
    report = verify.verify_resident(inputs, outputs, np.arange(S), _spec(bfloat16, cu), Alone(),
                                    masks.make(S, causal, window, cu), SCALE, rows=9)
    assert report["ok"] and report["mode"] == "sampled 9 rows+cols/rank", report


def test_warming_checks_its_problems(monkeypatch):
    """verify_warm.warm's problems pass their own check (here on the host, one shape; burst-hpc compile runs
    every one on the GPU)."""
    monkeypatch.setattr(verify_warm, "WARM_SHAPES", verify_warm.WARM_SHAPES[1:2])
    assert verify_warm.warm([bfloat16], xp=np) > 0


WARMED = """
import os, sys
import numpy as np
sys.path.insert(0, {tests!r})
import test_verify as t
from burst_hpc.job import verify, verify_warm
from burst_hpc.dtypes import bfloat16
import cupy

def compiled():
    return {{os.path.join(d, f) for d, _, fs in os.walk(os.environ["CUPY_CACHE_DIR"]) for f in fs}}

verify_warm.warm([bfloat16])
before = compiled()
verify.FULL_LIMIT = 10
inputs, outputs, mask_args = t._problem(bfloat16, "documents+window", seed=3)
report = t._check({{n: cupy.asarray(x) for n, x in inputs.items()}}, {{n: cupy.asarray(x) for n, x in outputs.items()}},
                  mask_args, bfloat16, rows=11)
assert report["ok"], report
print("warmed", len(before), "new", sorted(compiled() - before))
"""


def test_after_warming_a_verification_compiles_nothing(tmp_path):
    """burst-hpc compile warms --verify's CuPy kernels: a job's check at another shape, with a mask and
    gradients, then compiles nothing new into CUPY_CACHE_DIR."""
    import os
    import subprocess
    import sys

    _gpu()
    env = dict(os.environ, CUPY_CACHE_DIR=str(tmp_path / "cupy"))
    script = WARMED.format(tests=os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"warmed [1-9]\d* new \[\]", line), line


# --------------------------------------------------------------------------- what the check costs (its model)

MASK_CASES = {"none": (False, None, None), "causal": (True, None, None), "window": (True, (8, 0), None),
              "window both sides": (False, (5, 3), None), "documents": (True, None, np.array([0, 7, 30, 41, 64])),
              "documents+window": (False, (4, -1), np.array([0, 20, 64]))}


@pytest.mark.parametrize("mask", MASK_CASES)
def test_meets_is_the_dense_masks_any(mask):
    """reference.meets (one test per sample) finds the samples the dense mask finds: rows that see a key of
    a run, keys a query of the run sees."""
    from burst_hpc.reference import meets, visible

    causal, window, cu = MASK_CASES[mask]
    positions = np.random.default_rng(1).choice(64, 40, replace=False)
    for start, stop in ((0, 64), (0, 1), (10, 19), (30, 31), (50, 64), (6, 8)):
        run = np.arange(start, stop)
        rows = visible(positions, run, causal, window, cu).any(1)
        cols = visible(run, positions, causal, window, cu).any(0)
        assert np.array_equal(meets(positions, start, stop, causal, window, cu), rows), (start, stop)
        assert np.array_equal(meets(positions, start, stop, causal, window, cu, as_keys=True), cols), (start, stop)


def test_blocks_are_runs_of_consecutive_tokens():
    """A zigzag shard's two chunks are never mixed in one block; every token is in one block."""
    positions = np.concatenate([np.arange(16, 32), np.arange(96, 112)])   # rank 1 of 4, zigzag, S = 128
    spans = verify_cost.block_spans(positions, 6)
    assert spans == [(0, 6), (6, 12), (12, 16), (16, 22), (22, 28), (28, 32)]
    for lo, hi in spans:
        assert np.all(np.diff(positions[lo:hi]) == 1)


@pytest.mark.parametrize("mask", MASK_CASES)
def test_the_prediction_counts_what_the_loop_runs(mask):
    """Blocks.seconds adds, per block, the fixed parts of each pass that has an active sample, its part
    per active sample and its per-pair part times the block's tokens times its active samples: the
    rectangles the loop computes, found as the dense mask finds them."""
    from burst_hpc.reference import visible

    causal, window, cu = MASK_CASES[mask]
    positions = np.concatenate([np.arange(8, 16), np.arange(48, 56)])   # zigzag, rank 1 of 4
    blocks = verify_cost.Blocks(positions, 5, masks.make(64, causal, window, cu))
    samples = np.array([0, 3, 9, 17, 30, 33, 50, 63])
    rates = verify_cost.Rates(keys=(1.0, 10.0, 3.0, 100.0), queries=(1000.0, 1e4, 3e3, 1e5))
    fixed, pairs = blocks.seconds(rates, samples)
    want_fixed = want_pairs = 0.0
    for lo, hi in blocks.spans:
        keys = positions[lo:hi]
        rows = visible(samples, keys, causal, window, cu).any(1).sum()
        cols = visible(keys, samples, causal, window, cu).any(0).sum()
        want_fixed += (1.0 + 10.0 * len(keys)) * (rows > 0) + (1000.0 + 1e4 * len(keys)) * (cols > 0)
        want_pairs += (3.0 + 100.0 * len(keys)) * rows + (3e3 + 1e5 * len(keys)) * cols
    assert fixed == pytest.approx(want_fixed) and pairs == pytest.approx(want_pairs)


def test_the_prediction_scales_with_samples_and_the_mask():
    """Pairs scale with samples x keys: every sample is active in every block without a mask (the whole
    rectangle), twice the samples twice the pairs; causal about half of it, a narrow window far less."""
    positions = np.arange(1024, 2048)
    rates = verify_cost.Rates(keys=(0.0, 0.0, 0.0, 1.0), queries=(0.0, 0.0, 0.0, 1.0))
    samples = np.linspace(0, 4095, 64).astype(np.int64)

    def pairs(causal, window, samples=samples, width=128):
        return verify_cost.Blocks(positions, width, masks.make(4096, causal, window)).seconds(rates, samples)[1]

    full = pairs(False, None)
    assert full == 2 * 64 * 1024                                     # rows and columns, every one active
    assert pairs(False, None, np.concatenate([samples, samples])) == 2 * full
    assert 0.4 * full < pairs(True, None) < 0.6 * full
    assert pairs(True, (16, 0)) < 0.15 * full                        # a sample meets a block or two
    assert pairs(True, (16, 0), width=16) < pairs(True, (16, 0), width=128)   # smaller blocks, tighter rectangles
    keys_only = verify_cost.Rates(keys=(0.0, 0.0, 0.0, 1.0))              # forward only: no columns
    assert verify_cost.Blocks(positions, 128, masks.make(4096)).seconds(keys_only, samples)[1] == 64 * 1024


def test_the_budget_takes_the_samples_that_fit():
    """budget_rows: (budget - the blocks' fixed parts) / the expected seconds of one sample of each rank,
    at most asked; each rank's samples come from its own tokens, which matters under a window."""
    grids = [np.arange(0, 512, 8), np.arange(512, 1024, 8)]            # 2 ranks, contiguous
    blocks = verify_cost.Blocks(np.arange(512, 1024), 128, masks.make(1024))   # rank 1: 4 blocks, no mask: all active
    rates = verify_cost.Rates(keys=(1.0, 0.0, 0.0, 1e-3))                   # 1 s a block, 1 ms a (token, sample) pair
    per_sample = 512 * 1e-3 * 2                                        # 2 ranks draw as many each
    assert blocks.budget_rows(rates, grids, 4.0 + 10 * per_sample, 100) == 10
    assert blocks.budget_rows(rates, grids, 4.0 + 10 * per_sample, 7) == 7
    assert blocks.budget_rows(rates, grids, 1.0, 100) == 0            # the floor (LEAST_ROWS) is the check's
    # a narrow window: rank 1's samples meet one of its blocks (3 of its 64 grid points two), rank 0's none:
    # (64 + 3) blocks of 128 tokens over 64 samples, at 1 ms a pair
    windowed = verify_cost.Blocks(np.arange(512, 1024), 128, masks.make(1024, True, (8, 0)))
    assert windowed.budget_rows(rates, grids, 4.0 + 10 * per_sample, 1000) == int(10 * per_sample / (67 * 0.128 / 64))


def test_calibration_fits_per_block_token_and_pair(monkeypatch):
    """measure recovers the four parts of each pass from its timed blocks: on a clock that a block of c
    tokens and T samples advances by exactly a + t c + s T + p T c, the fit is exact."""
    truth = {"keys": (2e-3, 3e-6, 13e-6, 5e-8), "queries": (4e-3, 7e-6, 17e-6, 11e-8)}
    now = [0.0]

    def ticking(name):
        def add(self, pos, *arrays):
            a, t, s, p = truth[name]
            now[0] += a + t * len(pos) + s * len(self.positions) + p * len(self.positions) * len(pos)
        return add

    monkeypatch.setattr(verify_sums.Samples, "add_keys", ticking("keys"))
    monkeypatch.setattr(verify_sums.Samples, "add_queries", ticking("queries"))
    monkeypatch.setattr(verify_cost.time, "perf_counter", lambda: now[0])
    fitted = verify_cost.measure(_spec(bfloat16), SCALE, True, np)
    assert fitted == pytest.approx(np.array([truth["keys"], truth["queries"]]), rel=1e-6)
