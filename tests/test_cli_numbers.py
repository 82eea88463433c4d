"""plan, gen and run check their numbers (issue 24, item 7): zero, negative, NaN, infinite or
overflowing sizes, rates and windows are refused with one "burst-hpc: error:" line and a non-zero
exit status, never a traceback, a silent default or a table of NaN; inputs so large that the
kernels' sums overflow are refused before any work."""
import re

import h5py
import ml_dtypes
import numpy as np
import pytest

from burst_hpc import io
from burst_hpc.errors import FileError, TopologyError
from burst_hpc.plan.layout import make_layout
from burst_hpc.plan.topology import arrange
from test_cli import leftovers, write_input, burst, mpirun, needs_mpiexec

HUGE = "99999999999999999999"


def _refused(r, needle, code, launched=False):
    """One error line, no traceback. From one process it is the last line on stderr, after nothing
    but argparse's usage (under mpiexec the launcher adds its own note on the exit status)."""
    lines = r.stderr.strip().splitlines()
    ours = [line for line in lines if line.startswith("burst-hpc: error:")]
    assert len(ours) == 1, r.stderr
    if not launched:
        assert lines[-1] == ours[0] and all(line.startswith(("usage: ", " ")) for line in lines[:-1]), r.stderr
    assert needle in ours[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    assert r.returncode == code, r.stdout + r.stderr


PLAN = ["plan", "--seqlen", "4096"]
WHOLE, SEED = "a whole number > 0", "a whole number >= 0"
RATE, LATENCY = "a finite number > 0", "a finite number >= 0"
WINDOW = "a window size: a whole number >= 0, or -1 for unbounded"
LARGEST = ", more than the largest"


def _bad(flag, value, expected, more=""):
    """(``--flag value``, the error line that refuses it)."""
    return ["--" + flag, value], f"argument --{flag}: expected {expected}; got '{value}'{more}"


POSITIVE_PLAN_FLAGS = ("seqlen", "heads", "kv-heads", "head-dim", "batch", "documents", "nodes", "ranks-per-node")
BAD_PLAN_ARGS = [_bad(flag, "0", WHOLE) for flag in POSITIVE_PLAN_FLAGS] + [
    _bad("seqlen", "-4096", WHOLE), _bad("seqlen", HUGE, WHOLE, LARGEST), _bad("heads", "nan", WHOLE),
    _bad("gpus-per-node", "-8", WHOLE), _bad("fwd-tflops", "0", RATE), _bad("fwd-tflops", "nan", RATE),
    _bad("bwd-tflops", "-1", RATE), _bad("intra-gbps", "inf", RATE), _bad("inter-gbps", "1e999", RATE),
    _bad("inter-latency-us", "-1", LATENCY), _bad("intra-latency-us", "nan", LATENCY), _bad("window", "-2", WINDOW),
    _bad("window", HUGE, WINDOW, LARGEST),
    (["--inter-gbps", "0", "--nodes", "2"], f"argument --inter-gbps: expected {RATE}; got '0'"),
    (["--dtype", "int8"], "argument --dtype: unsupported dtype 'int8'; use one of float16, bfloat16, float32, float64"),
]


@pytest.mark.parametrize("args,needle", BAD_PLAN_ARGS, ids=[" ".join(a) for a, _ in BAD_PLAN_ARGS])
def test_plan_refuses_bad_numbers_on_the_command_line(args, needle):
    _refused(burst(*PLAN, *args), needle, 2)


BAD_PLAN_PROBLEMS = [
    # the balanced layout splits like contiguous: S a multiple of P (not of 2P), and it is checked
    (["--seqlen", "1000", "--nodes", "3", "--layout", "balanced"],
     "sequence length 1000 does not split over 24 ranks with the balanced layout: it must be a multiple of 24"),
    (["--seqlen", "22", "--gpus-per-node", "3", "--causal"],   # in no layout (zigzag's row alone would say why)
     "sequence length 22 does not split over 3 ranks with the contiguous layout: it must be a multiple of 3"),
    (["--gpus-per-node", "3", "--causal", "--layout", "zigzag"],   # S = 4096 on 3 ranks: what fits, what to pad to
     "sequence length 4096 does not split over 3 ranks with the zigzag layout: it must be a multiple of 6 (two chunks "
     "a rank); the balanced and contiguous layouts need only a multiple of 3: pad the sequence to 4098, which splits "
     "with every layout"),
    (["--heads", "6", "--kv-heads", "4"], "--heads 6 must be a multiple of --kv-heads 4"),
    (["--documents", "5000"], "--documents 5000: more documents than the 4096 tokens of --seqlen"),
    (["--cu-seqlens", "/nonexistent/offsets.txt"], "cannot read cu_seqlens from /nonexistent/offsets.txt"),
    (["--fwd-tflops", "1e300", "--fwd-launch-us", "0"], "the cost model leaves the floating-point range with these sizes and rates"),
]


@pytest.mark.parametrize("args,needle", BAD_PLAN_PROBLEMS, ids=[" ".join(a) for a, _ in BAD_PLAN_PROBLEMS])
def test_plan_refuses_problems_it_cannot_model(args, needle):
    _refused(burst(*PLAN, *args), needle, 1)


@pytest.mark.parametrize("args", [["--dtype", "BF16"], ["--intra-latency-us", "0"], ["--window", "-1"],
                                  ["--seqlen", "21", "--gpus-per-node", "3", "--causal", "--layout", "balanced"],
                                  ["--kv-heads", "8", "--nodes", "2", "--documents", "4"]])
def test_plan_accepts_edge_values(args):
    r = burst(*PLAN, *args)
    assert r.returncode == 0 and not r.stderr, r.stdout + r.stderr
    table = r.stdout.split("| ring |")[1]
    assert "nan" not in table and "inf" not in table and float(table.split("|")[0]) > 0, r.stdout
    assert "pick: layout " in r.stdout


def test_plan_from_real_document_lengths(tmp_path):
    """--cu-seqlens (text, .npy, HDF5 input) and drawn --doc-lengths: the table from the schedule's
    own account, the balanced layout's critical path near the mean."""
    offsets = np.array([0, 3000, 3100, 3500, 4096])
    (tmp_path / "cu.txt").write_text(" ".join(map(str, offsets)))
    np.save(tmp_path / "cu.npy", offsets)
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f.create_dataset("cu_seqlens", data=offsets)
    tables = []
    for source in ("cu.txt", "cu.npy", "in.h5"):
        r = burst(*PLAN, "--causal", "--gpus-per-node", "4", "--cu-seqlens", tmp_path / source)
        assert r.returncode == 0 and not r.stderr, r.stdout + r.stderr
        tables.append(r.stdout)
    assert tables[0] == tables[1] == tables[2]
    rows = {line.split("|")[1].strip(): line.split("|")[3:] for line in tables[0].splitlines() if "| ring |" in line}
    assert float(rows["balanced"][6]) <= 1.10 < float(rows["contiguous"][6])   # critical path / mean
    r = burst(*PLAN, "--causal", "--documents", "7", "--doc-lengths", "lognormal", "--seed", "3")
    assert r.returncode == 0 and "| balanced |" in r.stdout, r.stdout + r.stderr


BAD_GEN_ARGS = [_bad(flag, "0", WHOLE) for flag in ("kv-heads", "seqlen", "head-dim", "documents")] + [
    _bad("heads", "-8", WHOLE), _bad("batch", HUGE, WHOLE, LARGEST), _bad("seed", "-1", SEED), _bad("seed", HUGE, SEED)]


@pytest.mark.parametrize("args,needle", BAD_GEN_ARGS, ids=[" ".join(a) for a, _ in BAD_GEN_ARGS])
def test_gen_refuses_bad_numbers(tmp_path, args, needle):
    _refused(burst("gen", tmp_path / "in.h5", "--seqlen", 16, "--head-dim", 8, *args), needle, 2)
    assert not list(tmp_path.iterdir())


def test_gen_takes_dtype_names_in_any_case(tmp_path):
    r = burst("gen", tmp_path / "in.h5", "--seqlen", 16, "--head-dim", 8, "--dtype", "BF16", "--kv-heads", 2)
    assert r.returncode == 0, r.stderr
    assert "Hq=8 Hkv=2" in r.stdout and "bfloat16" in r.stdout, r.stdout
    with h5py.File(tmp_path / "in.h5", "r") as f:
        assert f["q"].attrs["dtype"] == "bfloat16" and f["k"].shape == (1, 16, 2, 8)


def test_gen_says_sizes_in_human_units(tmp_path):
    """A file larger than any disk: refused before any write, the sizes in KB/MB/GB/TB/PB, not millions of MB
    (3 tensors x 1e12 tokens x 8 heads x 64 x 2 bytes, and the file's own, about 3.1e15 bytes)."""
    r = burst("gen", tmp_path / "in.h5", "--seqlen", 10 ** 12, "--heads", 8, "--head-dim", 64, "--quiet")
    _refused(r, "not enough space for output", 1)
    assert re.search(r"it needs about 3\.\d+ PB, .* has \d+(\.\d+)? [KMGTP]?B free", r.stderr), r.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("nbytes,text", [(0, "0 B"), (999, "999 B"), (1000, "1 KB"), (4194304, "4.19 MB"),
                                         (83.7e9, "83.7 GB"), (1.09167254967e17, "109 PB"), (2.5e12, "2.5 TB")])
def test_sizes_have_one_way_to_be_said(nbytes, text):
    from burst_hpc.errors import size_text

    assert size_text(nbytes) == text


BAD_RUN_ARGS = [
    (["--window", HUGE], f"argument --window: expected a window size: a whole number >= 0, or -1 for unbounded; "
                         f"got '{HUGE}', more than the largest accepted, {2 ** 62}"),
    (["--window=-3"], "argument --window: expected a window size: a whole number >= 0, or -1 for unbounded; got '-3'"),
    (["--window", "5,x"], "argument --window: expected a window size"),
    (["--window", "1,2,3"], "argument --window: expected L or L,R"),
    (["--ranks-per-node", "0"], "argument --ranks-per-node: expected a whole number > 0; got '0'"),
    (["--verify-seed=-1"], "argument --verify-seed: expected a whole number >= 0"),
]


@pytest.mark.parametrize("args,needle", BAD_RUN_ARGS, ids=[" ".join(a) for a, _ in BAD_RUN_ARGS])
def test_run_refuses_bad_numbers(tmp_path, args, needle):
    _refused(burst("run", tmp_path / "in.h5", tmp_path / "out.h5", *args), needle, 2)


def test_arrange_says_ranks_per_node_must_be_positive():
    for bad in (0, -2):
        with pytest.raises(TopologyError, match=f"ranks_per_node must be positive; got {bad}"):
            arrange(["h"] * 4, ranks_per_node=bad)


def test_info_prints_text_only():
    r = burst("info")
    assert r.returncode == 0, r.stderr
    assert "\0" not in r.stdout  # Open MPI's library version string ends in one
    assert all(line.isprintable() for line in r.stdout.splitlines()), r.stdout


# ------------------------------------------------------------------ inputs too large for the sums

def _shards(scale=1.0, names=("q", "k", "v"), seqlen=32, dtype=np.float32):
    rng = np.random.default_rng(0)
    shards = {name: rng.standard_normal((1, seqlen, 2, 8)).astype(dtype) for name in names}
    for name, factor in (scale if isinstance(scale, dict) else {"q": scale, "k": scale}).items():
        shards[name] = (shards[name].astype(np.float64) * factor).astype(dtype)
    return shards


@pytest.mark.parametrize("scale,needle", [
    (1e30, r"dataset 'q' holds values up to \S+e\+30 in magnitude and 'k' up to \S+e\+30: the scores scale \* q.k "
           r"may reach \S+e\+61"),
    ({"v": 3e37}, r"dataset 'v' holds values up to \S+e\+3[78] in magnitude: the output's running sum over the keys"),
    ({"do": 1e19, "v": 1e19}, r"dataset 'do' holds values up to \S+ in magnitude and 'v' up to \S+: the backward's do.v"),
])
def test_check_finite_refuses_inputs_whose_sums_overflow(scale, needle):
    shards = _shards(scale, ("q", "k", "v", "do"))
    with pytest.raises(FileError) as info:
        io.check_finite("in.h5", shards, None, make_layout("contiguous", 32, 1))
    text = str(info.value)
    assert text.startswith("in.h5: ") and re.search(needle, text) and "float32 sums overflow at 3.4e+38" in text, text
    assert "--allow-nonfinite" in text and info.value.agreed


def test_check_finite_keeps_large_inputs_that_fit():
    whole = make_layout("contiguous", 32, 1)
    io.check_finite("in.h5", _shards(1e17), None, whole)       # scores up to ~1e36
    io.check_finite("in.h5", _shards(1e30, dtype=np.float64), None, whole)  # float64 sums
    with pytest.raises(FileError, match="scores"):  # a larger --scale moves the bound
        io.check_finite("in.h5", _shards(1e17), None, whole, scale=1e4)


@needs_mpiexec
def test_run_refuses_inputs_whose_scores_overflow(tmp_path):
    src, dst = tmp_path / "in.h5", tmp_path / "out.h5"
    data = _shards(1e30, seqlen=32)
    write_input(src, **data)
    r = mpirun(2, "run", src, dst, "--backend", "numpy")
    _refused(r, f"{src}: dataset 'q' holds values up to", 1, launched=True)
    assert "RuntimeWarning" not in r.stderr and not dst.exists() and not leftovers(tmp_path)
    r = mpirun(2, "run", src, dst, "--backend", "numpy", "--allow-nonfinite", "--quiet")
    assert r.returncode == 0 and dst.exists(), r.stdout + r.stderr  # the user's call: it runs


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, "bfloat16"])
def test_largest_magnitudes_match_the_absolute_maximum(dtype):
    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    rng = np.random.default_rng()
    x = (rng.standard_normal((2, 9001, 3, 5)) * 100).astype(dtype)
    x[1, rng.integers(9001), 2, 4] = -3000.0   # the largest magnitude is negative, in the last batch
    assert io.largest_magnitudes({"q": x, "k": x[:, :0]}) == {"q": float(np.abs(x.astype(np.float64)).max()), "k": 0.0}


@pytest.mark.parametrize("dtype", [np.float16, np.float32, "bfloat16"])
def test_nonfinite_finds_nan_and_both_infinities(dtype):
    from burst_hpc.dtypes import nonfinite

    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    rng = np.random.default_rng()
    x = (rng.standard_normal((3, 40, 2)) * 1e4).astype(dtype)   # large finite values stay finite
    for value in (np.nan, np.inf, -np.inf):
        x.flat[rng.integers(x.size)] = value
    assert np.array_equal(nonfinite(x), ~np.isfinite(x.astype(np.float64)))


SPELLINGS = {"bfloat16": ["bfloat16", "BF16", "bf16"], "float16": ["float16", "f16", "fp16", "half", "Float16"],
             "float32": ["float32", "f32", "FP32"], "float64": ["float64", "f64", "fp64"]}


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_every_verb_takes_the_same_dtype_spellings(name):
    """gen, plan and compile parse --dtype in one place (dtypes.parse_dtype's names and aliases); compile
    refuses only what the kernels do not run (float64), naming the dtypes they take."""
    from burst_hpc.cli_parser import build_parser
    from burst_hpc.dtypes import ALIASES, SUPPORTED_NAMES

    assert set(SPELLINGS) == set(SUPPORTED_NAMES)
    assert set(ALIASES) <= {spelling.lower() for spellings in SPELLINGS.values() for spelling in spellings}
    parser = build_parser()
    for spelling in SPELLINGS[name]:
        assert parser.parse_args(["gen", "x.h5", "--seqlen", "8", "--dtype", spelling]).dtype == name
        assert parser.parse_args([*PLAN, "--dtype", spelling]).dtype == name
        if name != "float64":
            assert parser.parse_args(["compile", "--dtype", spelling, "--dtype", "bf16"]).dtype == [name, "bfloat16"]
    if name == "float64":
        r = burst("compile", "--dtype", SPELLINGS[name][1])
        _refused(r, "argument --dtype: the cuda backend takes bfloat16, float16 or float32 inputs; got float64", 2)
