"""--verify and ``burst-hpc verify``: our outputs against the float64 oracle, by the tolerance rule
(:mod:`burst_hpc.tolerance`), on every token when the problem is small, else on sampled tokens of every
rank, each as a query row and as a key column.

The check runs where the job runs (CuPy arrays on the GPU): each rank streams over its own tokens once,
adding their share to every rank's samples' sums (:mod:`.verify_sums`); what that costs is predicted
beforehand (:mod:`.verify_cost`), so a job sizes its sample to a budget.
The outcome is recorded in the output file's attributes (see :func:`pending_attrs`):
``verify`` ("not run", "not finished", "pass" or "fail"), ``verify_mode`` and, per output X,
``verify_max_err_X`` and ``verify_tol_X`` (NaN where X was not checked).
"""
import math
import time

import numpy as np

from ..collective import agree, describe
from ..device import array_module, sync, to_host
from ..dtypes import dtype_name, nonfinite
from ..errors import BurstError, FileError, ShapeError
from ..io.format import fixed_text, modify_attrs
from ..plan import masks
from ..tolerance import max_abs, max_err, passes, plain_error, tolerance
from .report import recorded_mask
from .verify_cost import Blocks, Rates, block_width, device_kind, measure
from .verify_sums import Samples, Tokens, as_float64, finish

FULL_LIMIT = 1 << 22  # B * Hq * S * S at most this: every row, every output, checked in full
ROWS = 256          # samples per rank unless told (the run job picks fewer when they would cost too much)
LEAST_ROWS = 16     # the job's budget never takes the sample below this
BUDGET = {"numpy": 0.5, "cuda": 0.08}      # the job's verification: at most this share of its passes' time
MARGIN = 0.8        # the sample is sized to this share of the budget: the prediction errs by up to 20%
SAMPLE_ELEMENTS = 1 << 24   # B * Hq * D * samples of all ranks at most (each row sum is that big)
PROGRESS_S = 5.0


def nonfinite_summary(outputs, comm):
    """Collective: the run summary's account of NaN and Inf in the outputs (NumPy or CuPy), summed over the ranks:
    ``["nonfinite o=N lse=M ..."]`` naming each output that holds any, or ``[]`` when all are finite.
    An lse of -inf is a row that sees nothing, not counted. Inputs holding NaN or Inf
    (``--allow-nonfinite``) propagate into the rows that see them, and this says how far."""
    counts = []
    for name, x in outputs.items():
        bad = nonfinite(x)
        if name == "lse":
            bad &= ~array_module(x).isneginf(x)
        counts.append(int(bad.sum()))
    counts = comm.allreduce(np.array(counts, np.int64))
    found = [f"{name}={int(n)}" for name, n in zip(outputs, counts) if n]
    return ["nonfinite " + " ".join(found)] if found else []


_MEASURED = {}   # (shapes, dtype, gradients, backend) -> this process's fitted costs


def calibrate(spec, scale, backward, xp):
    """The check's :class:`Rates` on this rank's device (each rank its own: the budget and the prediction
    take the slowest rank's result) for the problem's batch, heads, head dim and dtype; measured once
    per process and shape (:func:`measure`)."""
    key = (spec.batch, spec.heads, spec.kv_heads, spec.head_dim, dtype_name(spec.dtype), bool(backward), device_kind(xp))
    if key not in _MEASURED:
        _MEASURED[key] = measure(spec, scale, backward, xp)
    fitted = _MEASURED[key]
    return Rates(tuple(map(float, fitted[0])), tuple(map(float, fitted[1])) if backward else None)


def failures(report):
    """'o: max error 5.0e-01 > tolerance 3.9e-03; ...' for each output that failed, '' when none."""
    said = []
    for name in report["failed"]:
        err, tol = report["err"][name], report["tol"][name]
        why = "NaN or Inf where the float64 oracle has none (or the reverse)" if not math.isfinite(err) else \
            f"max error {err:.2e} > tolerance {tol:.2e}"
        said.append(f"{name}: {why}")
    return "; ".join(said)


def check(tokens, spec, comm, mask, scale, backward=False, rows=ROWS, seed=0, xp=np, budget_s=None, announce=None,
          progress=None, rates=None):
    """Check a rank's outputs against the float64 oracle, on sampled tokens; collective.

    Parameters
    ----------
    tokens : verify_sums.Tokens
        This rank's tokens of the input (q, k, v, do) and of the output (o, lse, dq, dk, dv).
    spec : io.InputSpec
        The input's shapes and dtype.
    mask, scale
        The run's masks.Mask (the oracle takes its ``arguments``) and softmax scale.
    backward : bool
        Check dq (sampled rows), dk and dv (sampled key columns) too.
    rows : int
        Tokens each rank samples, each checked as a query row and a key column; every token when the
        problem is small (B Hq S^2 <= FULL_LIMIT). With ``budget_s`` it is the most: fewer (down to
        LEAST_ROWS) when the predicted time would pass ``budget_s`` seconds.
    xp : module
        numpy, or cupy to check on this rank's GPU (float64 on the device).
    announce, progress : callable or None
        Take lines: ``announce`` the predicted cost before the check starts, ``progress`` a line every
        few seconds while it runs (rank 0 passes them; other ranks None).
    rates : verify_cost.Rates or None
        The check's costs on this machine (None: :func:`calibrate` here, its cost counted in the check's).

    Returns
    -------
    dict
        'ok', 'mode', 'failed' (names), 'err', 'tol', 'plain' ({name: float}), 'rows' (samples per
        rank: every token of a rank when full),
        'predicted_s' (announced before the loop: the seconds spent so far, the loop's blocks as
        :class:`verify_cost.Blocks` counts them, the reads) and 'seconds': the same on every rank.
    """
    run = _Check(tokens, spec, comm, mask, scale, backward, xp)
    rates = calibrate(spec, scale, backward, xp) if rates is None else rates
    count, mine, mode = run.sample_size(rows, budget_s, rates)
    run.gather_samples(mine, seed)
    first, predicted = run.predict(rates)
    if announce is not None:
        what = f"{mine} rows and {mine} key columns" if backward else f"{mine} rows"
        announce(f"verify: {what} per rank against {spec.seqlen} tokens ({mode}, {'GPU' if xp is not np else 'CPU'} "
                 f"float64), about {predicted:.2g}s")
    samples = run.stream(first, progress)
    err, err_plain, tol = run.compare(samples)
    failed = [n for n in run.names if not passes(err[n], tol[n])]
    sync(xp)
    return {"ok": not failed, "mode": mode, "failed": failed, "err": err, "tol": tol, "plain": err_plain,
            "rows": mine, "predicted_s": predicted, "seconds": time.perf_counter() - run.start}


class _Check:
    """One rank's part of :func:`check`, phase by phase; each phase that can fail on some ranks ends
    where the ranks agree on the verdict, so a failure raises the same error on every rank."""

    def __init__(self, tokens, spec, comm, mask, scale, backward, xp):
        self.start = time.perf_counter()
        self.tokens, self.spec, self.comm, self.xp = tokens, spec, comm, xp
        self.mask, self.scale, self.backward = mask, scale, backward
        self.names = ["o", "lse"] + (["dq", "dk", "dv"] if backward else [])
        self.n_local = len(tokens.positions)
        self.full = spec.batch * spec.heads * spec.seqlen ** 2 <= FULL_LIMIT

    def allreduce(self, value, op):
        """``value`` reduced over the ranks by the MPI operation named ``op`` ("MAX", "MIN")."""
        if self.comm.size == 1:
            return value
        from mpi4py import MPI

        return self.comm.allreduce(value, op=getattr(MPI, op))

    def blocks(self, samples):
        return Blocks(self.tokens.positions, block_width(self.spec, samples, self.xp), self.mask)

    def sample_size(self, rows, budget_s, rates):
        """(samples per rank asked, this rank's samples, the mode's text): at most ``rows`` and what the
        samples' sums may hold, fewer where the budget says so; every token when the problem is small."""
        spec, size, positions = self.spec, self.comm.size, self.tokens.positions
        count = min(rows, max(1, SAMPLE_ELEMENTS // (spec.batch * spec.heads * spec.head_dim * size)))
        if budget_s is not None and not self.full:
            blocks = self.blocks(count * size)
            grid = np.unique(positions[np.linspace(0, self.n_local - 1, min(self.n_local, 1024)).astype(np.int64)])
            grids = self.comm.allgather(grid) if size > 1 else [grid]
            fits = blocks.budget_rows(rates, grids, MARGIN * budget_s - (time.perf_counter() - self.start), count)
            count = max(min(LEAST_ROWS, count), self.allreduce(fits, "MIN"))
        mine = self.n_local if self.full else min(count, self.n_local)
        every = self.full or self.allreduce(int(mine == self.n_local), "MIN") == 1
        mode = "full" if every else f"sampled {count} {'rows+cols' if self.backward else 'rows'}/rank"
        return count, mine, mode

    def gather_samples(self, mine, seed):
        """This rank's samples (``ours``: its outputs there; ``own``: its inputs, o and lse as float64),
        then every rank's inputs at every rank's samples (``gathered``) and where each rank's start."""
        rng = np.random.default_rng([seed, self.comm.rank])
        idx = np.arange(self.n_local) if mine == self.n_local else np.sort(rng.choice(self.n_local, mine, replace=False))
        failure, self.ours, self.own = None, {}, {}
        try:
            if mine:
                inputs = ["q", "k", "v"] + (["do"] if self.backward else [])
                got = self.tokens.take(inputs + self.names + (["o"] if "o" not in self.names else []), idx)
                self.ours = {n: to_host(got[n]) for n in self.names}
                self.own = {n: to_host(as_float64(got[n], np)) for n in inputs + ["o", "lse"]}
                if self.backward:
                    self.own["delta"] = (self.own["do"] * self.own["o"]).sum(-1).transpose(0, 2, 1)  # (B, Hq, n)
        except Exception as e:  # noqa: BLE001
            failure = e if isinstance(e, BurstError) else \
                BurstError(f"verification could not read its samples: {describe(e)}")
        agree(self.comm, failure)
        part = (self.tokens.positions[idx], {n: self.own[n] for n in self.own if n != "o"})
        parts = self.comm.allgather(part) if self.comm.size > 1 else [part]
        offsets = np.cumsum([0] + [len(pos) for pos, _ in parts])
        self.own_slice = slice(offsets[self.comm.rank], offsets[self.comm.rank + 1])
        parts = [(pos, arrays) for pos, arrays in parts if len(pos)]
        axis = {"lse": 2, "delta": 2}
        self.gathered = {"positions": np.concatenate([pos for pos, _ in parts])}
        for n in [n for n in ("q", "k", "v", "do", "lse", "delta") if parts and n in parts[0][1]]:
            self.gathered[n] = np.concatenate([arrays[n] for _, arrays in parts], axis=axis.get(n, 1))
        self.total = len(self.gathered["positions"])

    def predict(self, rates):
        """(the first block, read and timed; the predicted seconds of the check, the slowest rank's):
        what was spent, the loop's blocks with these samples, the reads."""
        failure, first, predicted = None, None, 0.0
        self.loop = self.blocks(self.total)
        self.reading = ["k", "v"] + (["q", "do", "o", "lse"] if self.backward else [])
        try:
            spans = self.loop.spans
            if self.total and spans:
                began = time.perf_counter()
                first = self.tokens.read(self.reading, *spans[0])
                read_s = (time.perf_counter() - began) * self.n_local / (spans[0][1] - spans[0][0])
                predicted = (time.perf_counter() - self.start + read_s
                             + sum(self.loop.seconds(rates, self.gathered["positions"])))
        except Exception as e:  # noqa: BLE001
            failure = e if isinstance(e, BurstError) else BurstError(f"verification could not read: {describe(e)}")
        agree(self.comm, failure)
        return first, self.allreduce(predicted, "MAX")

    def stream(self, first, progress):
        """This rank's tokens, a block at a time (``first``: the first block, read): every sample's sums
        (None without samples)."""
        failure, samples = None, None
        try:
            if self.total:
                samples = Samples(self.gathered, self.spec, self.mask, self.scale, self.xp)
                shown = time.perf_counter()
                with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
                    for lo, hi in self.loop.spans:
                        pos = self.tokens.positions[lo:hi]
                        block, first = first or self.tokens.read(self.reading, lo, hi), None
                        samples.add_keys(pos, block["k"], block["v"])
                        if self.backward:
                            samples.add_queries(pos, block["q"], block["do"], block["lse"], block["o"])
                        if progress is not None and time.perf_counter() - shown > PROGRESS_S:
                            shown = self.show(progress, hi)
        except Exception as e:  # noqa: BLE001
            failure = e if isinstance(e, BurstError) else BurstError(f"verification could not run: {describe(e)}")
        agree(self.comm, failure)
        return samples

    def show(self, progress, done_tokens):
        """A progress line; returns when it was shown."""
        sync(self.xp)
        shown, done = time.perf_counter(), done_tokens / self.n_local
        spent = shown - self.start
        progress(f"verify: {100 * done:.0f}% of rank 0's tokens, {spent:.1f}s, ETA {spent / done * (1 - done):.1f}s")
        return shown

    def compare(self, samples):
        """({output: our max error}, {output: the plain computation's}, {output: the tolerance}), the
        same on every rank: the sums reduced to the samples' owners give the oracle's values and the plain
        computation's there."""
        names, failure = self.names, None
        err, err_plain, ref_max = {n: 0.0 for n in names}, {n: 0.0 for n in names}, {n: 0.0 for n in names}
        reduced = samples.reduced(self.comm) if self.total else None
        try:
            if self.ours:
                with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
                    ref, plain = finish(reduced, self.own_slice, self.own, self.spec, self.scale, self.backward)
                for n in names:
                    err[n] = max_err(self.ours[n], ref[n])
                    err_plain[n] = plain_error(n, plain[n], ref[n], self.spec.dtype)
                    ref_max[n] = max_abs(ref[n])
        except Exception as e:  # noqa: BLE001
            failure = BurstError(f"verification could not compare: {describe(e)}")
        agree(self.comm, failure)
        err, err_plain, ref_max = ({n: self.allreduce(x[n], "MAX") for n in names} for x in (err, err_plain, ref_max))
        rounding = self.allreduce(0.0 if samples is None else samples.lse_rounding * samples.lse_max, "MAX")
        tol = {n: tolerance(n, err_plain[n], ref_max[n], self.spec.dtype, rounding) for n in names}
        return err, err_plain, tol


def verify_resident(inputs, outputs, positions, spec, comm, mask, scale, rows=ROWS, seed=0, budget_s=None,
                    announce=None, progress=None, rates=None):
    """Collective: the run job's check of the shards it holds (``inputs`` q, k, v (do) and ``outputs``
    o, lse (dq, dk, dv), NumPy or CuPy arrays in local layout order; ``positions`` their global token
    indices) under the run's ``mask`` (a masks.Mask), on the device they are on. See :func:`check`."""
    arrays = dict(inputs, **outputs)
    xp = array_module(arrays["q"])
    return check(Tokens.resident(arrays, positions), spec, comm, mask, scale, "dq" in outputs, rows, seed, xp,
                 budget_s, announce, progress, rates)


def verify_output(input_path, output_path, comm, causal=None, window=None, backward=None, rows=ROWS, seed=0,
                  xp=np, announce=None, progress=None, scale=None):
    """Collective: check a published output against its input, on any number of ranks (each reads
    its share of the tokens, once). ``causal``, ``window``, ``scale`` and ``backward`` left None are
    taken from what the output records (a ``burst-hpc run`` output records them); given, they must
    agree with it. An output that records no mask (no ``causal`` attribute: written by another
    program) is refused unless ``causal`` is given (its window then ``window``, None: none; its
    scale ``scale``, None: head_dim**-0.5). ``backward`` None: when the output holds dq, dk and dv.
    See :func:`check`."""
    from .. import io

    error, spec, files, opened = None, None, {}, []
    try:
        out = io.open_input(output_path)
        opened.append(out)
        attrs = {key: (value.decode() if isinstance(value, bytes) else value) for key, value in out.attrs.items()}
        causal, window, scale = _as_recorded(output_path, recorded_mask(attrs), causal, window, scale)
        backward = all(n in out for n in ("dq", "dk", "dv")) if backward is None else backward
        need = ["q", "k", "v"] + (["do"] if backward else [])
        spec = io.inspect_input(input_path, need)
        files = _output_datasets(out, output_path, input_path, spec, backward)
        inp = io.open_input(input_path)
        opened.append(inp)
        files.update({n: inp[n] for n in need})
        scale = spec.head_dim ** -0.5 if scale is None else scale
        mask = masks.make(spec.seqlen, causal, window, spec.cu_seqlens)
    except Exception as e:  # noqa: BLE001
        error = e if isinstance(e, BurstError) else FileError(f"cannot verify {output_path}: {describe(e)}")
    try:
        agree(comm, error)
        start, stop = comm.rank * spec.seqlen // comm.size, (comm.rank + 1) * spec.seqlen // comm.size
        return check(Tokens.stored(files, start, stop), spec, comm, mask, scale, backward, rows, seed, xp, None,
                     announce, progress)
    finally:
        for f in opened:
            f.close()


def _as_recorded(output_path, recorded, causal, window, scale):
    """(causal, window, scale) of the check: those given, which must agree with what the output
    records (``recorded``: report.recorded_mask), else the recorded ones (scale None: not recorded)."""
    recorded_causal, recorded_window, recorded_scale = recorded
    if recorded_causal is None and causal is None:
        raise FileError(f"{output_path} does not record the mask it was computed with (no attribute 'causal': "
                        "not written by burst-hpc run); say it: --causal or --no-causal (and --window L[,R] if it "
                        "had one)")
    for what, given, value, known in (("--causal", causal, recorded_causal, recorded_causal is not None),
                                      ("--window", window, recorded_window, recorded_causal is not None),
                                      ("--scale", scale, recorded_scale, recorded_scale is not None)):
        if given is not None and known and given != value:
            raise FileError(f"{output_path} was written with {what[2:]} = {value}, not {given}: leave {what} "
                            "out to check it as it was written")
    causal = recorded_causal if causal is None else causal
    window = recorded_window if window is None and recorded_causal is not None else window
    return causal, window, scale if scale is not None else recorded_scale


def _output_datasets(out, output_path, input_path, spec, backward):
    """{name: dataset} of the outputs the check reads from open file ``out``, each of the shape the
    input ``spec`` gives it."""
    names = ["o", "lse"] + (["dq", "dk", "dv"] if backward else [])
    for name in names:
        if name not in out:
            hint = " (it was written without --backward)" if name in ("dq", "dk", "dv") else ""
            raise FileError(f"{output_path}: dataset {name!r} is missing{hint}; it holds {', '.join(sorted(out))}")
        if tuple(out[name].shape) != spec.shape(name):
            raise ShapeError(f"{output_path}: {name} has shape {tuple(out[name].shape)}, but {input_path} "
                             f"needs {spec.shape(name)}: is it the output of this input?")
    return {name: out[name] for name in names}


# --------------------------------------------------------------------------- the outcome in the file

# fixed-size values, made with the file: recording the outcome later rewrites their bytes in place
# and never changes the file's structure, so a job killed while recording cannot damage its output
STATUS_BYTES, MODE_BYTES = 12, 40


def pending_attrs(outputs, requested):
    """The verification attributes a ``run`` output is created with: ``verify = "not finished"`` and
    room for the outcome when ``requested`` (a job stopped before :func:`record` leaves them so, which
    is the truth), else ``verify = "not run"``. ``outputs``: the names of the output datasets."""
    if not requested:
        return {"verify": fixed_text("not run", STATUS_BYTES)}
    attrs = {"verify": fixed_text("not finished", STATUS_BYTES), "verify_mode": fixed_text("", MODE_BYTES)}
    for name in outputs:
        attrs[f"verify_max_err_{name}"] = np.float64(np.nan)
        attrs[f"verify_tol_{name}"] = np.float64(np.nan)
    return attrs


def record(path, report):
    """Write ``report`` (from :func:`check`) into the attributes of the published output ``path``
    (one process). The attributes were made by :func:`pending_attrs`; only their values change,
    ``verify`` last."""
    values = {"verify_mode": fixed_text(report["mode"], MODE_BYTES)}
    for name in report["err"]:
        values[f"verify_max_err_{name}"] = np.float64(report["err"][name])
        values[f"verify_tol_{name}"] = np.float64(report["tol"][name])
    values["verify"] = fixed_text("pass" if report["ok"] else "fail", STATUS_BYTES)
    modify_attrs(path, values)


def recorded(path):
    """The verification attributes of an output file, as plain Python values ({} without them)."""
    import h5py

    with h5py.File(path, "r") as f:
        return {key: (value.decode() if isinstance(value, bytes) else value.item() if isinstance(value, np.generic)
                      else value) for key, value in f.attrs.items() if key.startswith("verify")}
