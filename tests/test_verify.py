"""The sampled check (burst_hpc.verify.check) on one process: its sums equal the float64 oracle under
every mask, corrupted outputs fail naming what failed, NaN and Inf that match the oracle pass, the
predicted cost is announced, and the run job's budget sizes the sample."""
import re
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from burst_hpc import verify
from burst_hpc.dtypes import bfloat16
from burst_hpc.reference import visible
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
    return verify.verify_resident(inputs, outputs, np.arange(S), _spec(dtype, cu), MPI.COMM_SELF, causal, SCALE,
                                  window, rows=rows, **kwargs)


@pytest.fixture(params=["full", "sampled"])
def sampled(request, monkeypatch):
    """Both modes, with key blocks of 7 tokens (several blocks, one ragged)."""
    monkeypatch.setattr(verify, "BLOCK_ELEMENTS", {"numpy": 7 * B * HQ * S, "cuda": 7 * B * HQ * S})
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
                        r"CPU float64\), about \d+\.\ds", lines[0]), lines
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
    _, rnd = verify.rounder(dtype, np)
    with np.errstate(over="ignore"):
        want = x.astype(np.float32).astype(dtype).astype(np.float32)
        assert np.array_equal(rnd(x), want, equal_nan=True)


def test_max_err_counts_nonfinite_against_nonfinite_as_no_error():
    ref = np.array([1.0, np.nan, np.inf, -np.inf])
    assert verify.max_err(np.array([1.5, np.inf, np.nan, -np.inf]), ref) == 0.5
    assert verify.max_err(np.array([1.0, 0.0, np.inf, -np.inf]), ref) == np.inf
    assert verify.max_err(np.array([np.nan, np.nan, np.inf, -np.inf]), ref) == np.inf
    assert verify.max_err(np.array([-np.inf, np.nan, np.inf, -np.inf]), ref) == np.inf


def _gpu():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("no GPU")
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("no GPU")
    return cupy


@pytest.mark.parametrize("blocks", ["as memory allows", "of 16 tokens"])
@pytest.mark.parametrize("mask", ["causal", "documents+window"])
def test_on_the_gpu_as_on_the_cpu(mask, blocks, monkeypatch):
    """CuPy shards (a cuda run's): the check runs on the device and finds what the CPU finds, a corrupted
    dk included; NaN that match the oracle pass there too. In one block, and in blocks that touch some
    of the samples (index arrays on the device)."""
    cupy = _gpu()
    monkeypatch.setattr(verify, "FULL_LIMIT", 10)
    if blocks == "of 16 tokens":
        monkeypatch.setattr(verify, "BLOCK_ELEMENTS", {"numpy": 16 * B * HQ * 17, "cuda": 16 * B * HQ * 17})
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


@pytest.mark.parametrize("mask", MASKS)
def test_the_plan_names_the_samples_each_block_touches(mask, monkeypatch):
    """Blocks of local tokens in any order (a striped layout's), host masks cut small: each block's rows
    are the samples that see one of its keys, its cols the samples one of its queries sees."""
    monkeypatch.setattr(verify, "PLAN_ELEMENTS", 20)
    causal, window, cu = MASKS[mask]
    local = np.random.default_rng(1).permutation(S)[:23]
    samples = np.array([0, 3, 17, 29, 39])
    blocks = verify.plan(local, samples, 6, causal, window, cu, backward=True)
    assert [(lo, hi) for lo, hi, _, _ in blocks] == [(0, 6), (6, 12), (12, 18), (18, 23)]
    for lo, hi, rows, cols in blocks:
        want_rows = [i for i, p in enumerate(samples) if any(visible([p], [t], causal, window, cu)[0, 0]
                                                                for t in local[lo:hi])]
        want_cols = [i for i, p in enumerate(samples) if any(visible([t], [p], causal, window, cu)[0, 0]
                                                                for t in local[lo:hi])]
        assert list(rows) == want_rows and list(cols) == want_cols, (lo, rows, cols)
    forward = verify.plan(local, samples, 6, causal, window, cu, backward=False)
    assert all(len(cols) == 0 for _, _, _, cols in forward)


def test_the_cost_counts_busy_blocks_tokens_and_pairs():
    """fixed per block that touches a sample, per token of such blocks, per pair (rows and columns
    averaged when backward: the calibration times both against the same tokens)."""
    cost = verify.Cost(2.0, 3.0, 5.0)
    blocks = [(0, 10, [0, 1], []), (10, 20, [], []), (20, 25, [0], [0, 1, 2])]
    assert cost.seconds(blocks, backward=True) == 2 * 2 + 3 * 15 + 5 * (10 * 2 + 5 * 4) / 2
    assert cost.seconds(blocks[:2], backward=False) == 2 + 3 * 10 + 5 * 20


def test_each_input_is_read_once_and_untouched_blocks_not_at_all(monkeypatch):
    """The sampled check, causal, blocks of 16 tokens: keys are read up to the block of the last sample
    (a later key is seen by no sample), queries from the block of the first (an earlier query sees no
    sample); no token of any input is read twice."""
    monkeypatch.setattr(verify, "FULL_LIMIT", 10)
    monkeypatch.setattr(verify, "BLOCK_ELEMENTS", {"numpy": 16 * B * HQ * 3, "cuda": 16 * B * HQ * 3})
    inputs, outputs, _ = _problem(bfloat16, "causal")
    tokens = verify.Tokens.resident(dict(inputs, **outputs), np.arange(S))
    reads, sampled, read, take = [], [], tokens.read, tokens.take
    tokens.read = lambda names, lo, hi: reads.append((tuple(names), lo, hi)) or read(names, lo, hi)
    tokens.take = lambda names, idx: sampled.extend(idx) or take(names, idx)
    report = verify.check(tokens, _spec(bfloat16), MPI.COMM_SELF, True, SCALE, backward=True, rows=3, seed=1)
    assert report["ok"] and report["mode"] == "sampled 3 rows+cols/rank", report
    first, last = min(sampled), max(sampled)
    assert last < 32 and first >= 16, sampled  # the seed leaves an untouched block on both sides
    for name, want in (("k", range(0, 32)), ("q", range(16, S))):
        got = [t for names, lo, hi in reads if name in names for t in range(lo, hi)]
        assert sorted(got) == list(want), (name, reads)


@pytest.mark.parametrize("dtype", [bfloat16, "bits", np.float16, np.float32])
def test_as_float64_reads_strided_views_exactly(dtype):
    x = np.random.default_rng(2).standard_normal((2, 5, 3, 4)).astype(np.float32)
    held = x.astype(bfloat16).view(np.uint16) if dtype == "bits" else x.astype(dtype)
    want = (x.astype(bfloat16) if dtype == "bits" else held).astype(np.float64).transpose(0, 2, 1, 3)
    got = verify.as_float64(held.transpose(0, 2, 1, 3), np)
    assert got.dtype == np.float64 and got.flags.c_contiguous and np.array_equal(got, want)


def test_finite_reads_bfloat16_bits():
    x = np.ones((3, 4), np.float32)
    assert verify.finite(x) and verify.finite(x.astype(bfloat16).view(np.uint16))
    for bad in (np.inf, -np.inf, np.nan):
        y = x.copy()
        y[2, 1] = bad
        assert not verify.finite(y) and not verify.finite(y.astype(bfloat16)), bad
        assert not verify.finite(y.astype(bfloat16).view(np.uint16)), bad


def test_the_gpu_kernels_match_numpy():
    """The one-pass kernels: bfloat16 rounding bit for bit as NumPy's path, bfloat16 bits and float16
    from strided views to C-contiguous float64 exactly, do.o of bfloat16 views, the mask on the device
    as on the host."""
    cupy = _gpu()
    x = np.random.default_rng(3).standard_normal(100000) * np.logspace(-40, 38, 100000)
    x = np.concatenate([x, [np.inf, -np.inf, np.nan, 0.0, -0.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 65504.0, 1e-39]])
    with np.errstate(over="ignore"):
        want = verify.rounder(bfloat16, np)[1](x)
    got = verify.rounder(bfloat16, cupy)[1](cupy.asarray(x)).get()
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))
    y = np.random.default_rng(4).standard_normal((2, 9, 4, 8)).astype(bfloat16)
    for held in (y.view(np.uint16), y.astype(np.float16)):
        view = cupy.asarray(held).transpose(0, 2, 1, 3)
        got = verify.as_float64(view, cupy)
        assert got.flags.c_contiguous and np.array_equal(got.get(), verify.as_float64(held.transpose(0, 2, 1, 3), np))
    a, b = (np.random.default_rng(seed).standard_normal((2, 9, 4, 8)).astype(bfloat16) for seed in (5, 6))
    bits, typed = cupy.asarray(a.view(np.uint16)), cupy.asarray(b.view(np.uint16)).view(np.dtype(bfloat16))
    got = verify.row_dot(bits[:, 2:7], typed[:, 2:7], cupy)
    want = verify.row_dot(a[:, 2:7], b[:, 2:7], np)
    assert got.shape == (2, 5, 4) and np.allclose(got.get(), want, rtol=1e-14, atol=0)
    for causal, window, cu in MASKS.values():
        q, k = np.array([0, 5, 17, 39]), np.arange(3, 40, 2)
        on_device = visible(cupy.asarray(q), cupy.asarray(k), causal, window, None if cu is None else cupy.asarray(cu))
        assert np.array_equal(on_device.get(), visible(q, k, causal, window, cu))


def test_the_gpu_cost_model_and_blocks():
    """The calibration on the GPU gives finite costs, per pair positive; a block fits the free memory."""
    cupy = _gpu()
    spec = SimpleNamespace(batch=1, seqlen=1 << 17, heads=32, kv_heads=8, head_dim=128, dtype=np.dtype(bfloat16),
                           cu_seqlens=None)
    cost = verify.cost_model(spec, 128 ** -0.5, True, cupy, MPI.COMM_SELF, causal=True)
    assert all(np.isfinite([cost.fixed, cost.per_token, cost.per_pair])) and cost.per_pair > 0, vars(cost)
    tokens = verify.block_tokens(spec, 16, cupy)
    assert 16 <= tokens and tokens * 32 * (48 * 128 + 64 * 16) <= cupy.cuda.runtime.memGetInfo()[0] + \
        cupy.get_default_memory_pool().free_bytes()
