"""--verify: our outputs against the float64 oracle, on every row when small, on sampled
windows of query rows when the full reference is too large.

Error of our result against the float64 oracle must stay within FACTOR x the error of a plain
computation in the input precision (scores, probabilities and products rounded to the input dtype,
float32 accumulation, as a PyTorch-style implementation does) plus a floor:
    max|ours - ref| <= FACTOR[name] * max|plain - ref| + ATOL[dtype] * max(1, max|ref|)
FACTOR is 2 for o and lse, 3 for dq, dk, dv (FlashAttention's test convention). An error that is
not finite (NaN or Inf anywhere in our output where the oracle is finite) fails whatever the tolerance.
The outcome is recorded in the output file's attributes (see :func:`pending_attrs`):
``verify`` ("not run", "not finished", "pass" or "fail"), ``verify_mode`` and, per output X,
``verify_max_err_X`` and ``verify_tol_X`` (NaN where X was not checked).
"""
import math
import time

import numpy as np

from .collective import agree, describe
from .dtypes import dtype_name
from .errors import BurstError
from .reference import visible

FACTOR = {"o": 2.0, "lse": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}
ATOL = {"float64": 1e-10, "float32": 1e-5, "float16": 1e-4, "bfloat16": 1e-3}
LSE_ATOL = 5e-7  # lse is stored as float32 whatever the inputs
FULL_LIMIT = 1 << 22  # B * Hq * S * S at most this: every row, every output, checked in full
KEY_CHUNK = 1 << 21  # elements of one (B, Hq, rows, keys) score block in the sampled check


def _compute_type(lowp):
    return np.float64 if lowp is None or np.dtype(lowp) == np.float64 else np.float32


def _rounder(lowp, ct):
    if lowp is None:
        return lambda x: x
    return lambda x: x.astype(lowp).astype(ct)


def _expand(x, heads, ct):
    return np.repeat(x.astype(ct), heads // x.shape[2], axis=2)


def _scores(q, k, scale, causal, q_start, k_start, rnd, window=None, cu_seqlens=None):
    s = rnd(np.einsum("bqhd,bkhd->bhqk", q, k) * scale)
    if causal or window is not None or cu_seqlens is not None:
        seen = visible(q_start + np.arange(q.shape[1]), k_start + np.arange(k.shape[1]), causal, window, cu_seqlens)
        s = np.where(seen, s, -np.inf)
    return s


def plain_attention(q, k, v, do=None, causal=False, scale=None, lowp=None, window=None, cu_seqlens=None):
    """(o, lse, dq, dk, dv) by the textbook formulas; in float64 when ``lowp`` is None, else as a plain
    same-precision implementation: products rounded to ``lowp``, float32 arithmetic in between."""
    ct = _compute_type(lowp)
    rnd = _rounder(lowp, ct)
    heads, group = q.shape[2], q.shape[2] // k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qc, kc, vc = q.astype(ct), _expand(k, heads, ct), _expand(v, heads, ct)
    s = _scores(qc, kc, scale, causal, 0, 0, rnd, window, cu_seqlens)
    lse = _logsumexp(s)
    p = rnd(np.exp(s - np.where(np.isneginf(lse), 0, lse)[..., None]))
    o = rnd(np.einsum("bhqk,bkhd->bqhd", p, vc))
    if do is None:
        return o, lse, None, None, None
    doc = do.astype(ct)
    dv = np.einsum("bhqk,bqhd->bkhd", p, doc)
    dp = rnd(np.einsum("bqhd,bkhd->bhqk", doc, vc))
    delta = np.einsum("bqhd,bqhd->bhq", doc, o)
    ds = rnd(p * (dp - delta[..., None]))
    dq = rnd(np.einsum("bhqk,bkhd->bqhd", ds, kc) * scale)
    dk = np.einsum("bhqk,bqhd->bkhd", ds, qc) * scale
    b, n, _, d = k.shape
    return o, lse, dq, rnd(dk.reshape(b, n, -1, group, d).sum(3)), rnd(dv.reshape(b, n, -1, group, d).sum(3))


def _logsumexp(s):
    m = s.max(-1)
    safe = np.where(np.isneginf(m), 0, m)
    with np.errstate(divide="ignore"):
        return np.log(np.exp(s - safe[..., None]).sum(-1)) + safe


def window_attention(q, do, key_blocks, causal, scale, q_start, lowp=None, window=None, cu_seqlens=None):
    """(o, lse, dq) of a window of query rows against keys that arrive in blocks.

    q, do (B, W, Hq, D) (do may be None); ``key_blocks()`` yields (k_start, k, v) blocks covering the
    keys, read again for each of the (up to) three passes, so memory stays at one score block.
    float64 and exact when ``lowp`` is None; else the plain same-precision computation."""
    ct = _compute_type(lowp)
    rnd = _rounder(lowp, ct)
    heads = q.shape[2]
    qc = q.astype(ct)
    lse = np.full((q.shape[0], heads, q.shape[1]), -np.inf, ct)
    for k0, k, _ in key_blocks():
        lse = np.logaddexp(lse, _logsumexp(_scores(qc, _expand(k, heads, ct), scale, causal, q_start, k0, rnd,
                                                   window, cu_seqlens)))
    safe = np.where(np.isneginf(lse), 0, lse)[..., None]

    def probabilities(k0, k):
        kc = _expand(k, heads, ct)
        return kc, rnd(np.exp(_scores(qc, kc, scale, causal, q_start, k0, rnd, window, cu_seqlens) - safe))

    o = np.zeros(q.shape, ct)
    for k0, k, v in key_blocks():
        _, p = probabilities(k0, k)
        o += np.einsum("bhqk,bkhd->bqhd", p, _expand(v, heads, ct))
    o = rnd(o)
    if do is None:
        return o, lse, None
    doc = do.astype(ct)
    delta = np.einsum("bqhd,bqhd->bhq", doc, o)[..., None]
    dq = np.zeros(q.shape, ct)
    for k0, k, v in key_blocks():
        kc, p = probabilities(k0, k)
        dp = rnd(np.einsum("bqhd,bkhd->bhqk", doc, _expand(v, heads, ct)))
        dq += np.einsum("bhqk,bkhd->bqhd", rnd(p * (dp - delta)), kc) * scale
    return o, lse, rnd(dq)


def tolerance(name, plain_err, ref_max, dtype):
    """The allowed max error of output ``name``: FACTOR x the plain computation's error + the floor."""
    atol = max(ATOL[dtype_name(dtype)], LSE_ATOL if name == "lse" else 0.0)
    return FACTOR[name] * plain_err + atol * max(1.0, ref_max)


def passes(err, tol):
    """The rule holds; a non-finite error (or tolerance) fails."""
    return math.isfinite(err) and math.isfinite(tol) and err <= tol


def max_err(ours, ref):
    ours = np.asarray(ours, np.float64)
    ref = np.asarray(ref, np.float64)
    both_inf = np.isneginf(ours) & np.isneginf(ref)
    diff = np.where(both_inf, 0.0, np.abs(ours - ref))
    diff = np.where(np.isnan(diff), np.inf, diff)
    return float(diff.max()) if diff.size else 0.0


def max_abs(ref):
    ref = np.asarray(ref, np.float64)
    finite = ref[np.isfinite(ref)]
    return float(np.abs(finite).max()) if finite.size else 0.0


def nonfinite_summary(outputs, comm):
    """Collective: the run summary's account of NaN and Inf in the outputs, summed over the ranks:
    ``["nonfinite o=N lse=M ..."]`` naming each output that holds any, or ``[]`` when all are finite.
    An lse of -inf is a row that sees nothing, not counted. Inputs holding NaN or Inf
    (``--allow-nonfinite``) propagate into the rows that see them, and this says how far."""
    counts = []
    for name, x in outputs.items():
        bad = ~np.isfinite(x)
        if name == "lse":
            bad &= ~np.isneginf(x)
        counts.append(int(np.count_nonzero(bad)))
    counts = comm.allreduce(np.array(counts, np.int64))
    found = [f"{name}={int(n)}" for name, n in zip(outputs, counts) if n]
    return ["nonfinite " + " ".join(found)] if found else []


def verify(path, spec, ours, comm, layout, causal, scale, rows=256, seed=0, progress=None, window=None):
    """Check this rank's outputs ``ours`` (host arrays, local layout order) against the float64 oracle.

    Collective. Full check (every row of every output) when B*Hq*S*S <= FULL_LIMIT; otherwise
    ``rows`` query rows per rank in random windows, checking o, lse (and dq when present) with the
    keys read from ``path`` in blocks. Returns {'ok', 'mode', 'err', 'tol'} (the same on every rank).
    Documents (the input's cu_seqlens) and ``window`` mask the oracle as they masked the run.
    """
    from mpi4py import MPI

    from . import io
    from .layout import layout_indices, pieces
    from .reference import attention_backward_reference, attention_reference

    names = [n for n in ("o", "lse", "dq", "dk", "dv") if n in ours]
    masked = dict(window=window, cu_seqlens=spec.cu_seqlens)
    full = spec.batch * spec.heads * spec.seqlen ** 2 <= FULL_LIMIT
    lowp = spec.dtype
    err, err_plain, ref_max = {}, {}, {}
    failure = None
    try:
        if full:
            data = io.read_global(path, ["q", "k", "v"] + (["do"] if "dq" in ours else []))
            q, k, v, do = data["q"], data["k"], data["v"], data.get("do")
            ref = dict(zip(("o", "lse"), attention_reference(q, k, v, causal, scale, **masked)))
            if do is not None:
                ref.update(zip(("dq", "dk", "dv"), attention_backward_reference(do, q, k, v, causal, scale, **masked)))
            plain = dict(zip(("o", "lse", "dq", "dk", "dv"), plain_attention(q, k, v, do, causal, scale, lowp,
                                                                               **masked)))
            idx = layout_indices(spec.seqlen, comm.rank, comm.size, layout)
            for name in names:
                axis = 2 if name == "lse" else 1
                mine = np.take(ref[name], idx, axis=axis)
                err[name] = max_err(ours[name], mine)
                err_plain[name] = max_err(np.take(plain[name], idx, axis=axis).astype(
                    np.float32 if name == "lse" else lowp), mine)
                ref_max[name] = max_abs(mine)
        else:
            names = [n for n in names if n in ("o", "lse", "dq")]
            for n in names:
                err[n] = err_plain[n] = ref_max[n] = 0.0
            rng = np.random.default_rng([seed, comm.rank])
            runs = pieces(spec.seqlen, comm.rank, comm.size, layout)
            per_run = max(1, rows // len(runs))
            width = max(1, min(per_run, KEY_CHUNK // (spec.batch * spec.heads * 128)))
            with io.open_input(path) as f:
                dsq, dsk, dsv = f["q"], f["k"], f["v"]
                dsdo = f["do"] if "dq" in ours else None
                block = max(128, KEY_CHUNK // (spec.batch * spec.heads * width))
                offset = 0
                windows = []
                for start, n in runs:
                    for _ in range(max(1, per_run // width)):
                        w = min(width, n)
                        g0 = start + int(rng.integers(0, n - w + 1))
                        windows.append((g0, w, offset + g0 - start))
                    offset += n
                for i, (g0, w, local0) in enumerate(windows):
                    if progress is not None:
                        progress(f"verify window {i + 1}/{len(windows)} on rank 0: rows {g0}..{g0 + w - 1}")
                    q = io.read_slab(dsq, (slice(None), slice(g0, g0 + w)), spec.dtype)
                    do = io.read_slab(dsdo, (slice(None), slice(g0, g0 + w)), spec.dtype) if dsdo is not None else None
                    k_end = g0 + w if causal else spec.seqlen

                    def key_blocks():
                        for k0 in range(0, k_end, block):
                            k1 = min(k_end, k0 + block)
                            yield (k0, io.read_slab(dsk, (slice(None), slice(k0, k1)), spec.dtype),
                                   io.read_slab(dsv, (slice(None), slice(k0, k1)), spec.dtype))

                    ref = dict(zip(("o", "lse", "dq"), window_attention(q, do, key_blocks, causal, scale, g0, **masked)))
                    plain = dict(zip(("o", "lse", "dq"), window_attention(q, do, key_blocks, causal, scale, g0, lowp,
                                                                          **masked)))
                    for name in names:
                        axis = 2 if name == "lse" else 1
                        sel = (slice(None),) * axis + (slice(local0, local0 + w),)
                        err[name] = max(err[name], max_err(ours[name][sel], ref[name]))
                        err_plain[name] = max(err_plain[name], max_err(plain[name].astype(
                            np.float32 if name == "lse" else lowp), ref[name]))
                        ref_max[name] = max(ref_max[name], max_abs(ref[name]))
    except Exception as e:  # noqa: BLE001
        failure = e if isinstance(e, BurstError) else BurstError(f"verification could not run: {describe(e)}")
    agree(comm, failure)
    err = {n: comm.allreduce(err[n], op=MPI.MAX) for n in names}
    err_plain = {n: comm.allreduce(err_plain[n], op=MPI.MAX) for n in names}
    ref_max = {n: comm.allreduce(ref_max[n], op=MPI.MAX) for n in names}
    tol = {n: tolerance(n, err_plain[n], ref_max[n], spec.dtype) for n in names}
    ok = all(passes(err[n], tol[n]) for n in names)
    return {"ok": ok, "mode": "full" if full else f"sampled {rows} rows/rank", "err": err, "tol": tol,
            "plain": err_plain}


# --------------------------------------------------------------------------- the outcome in the file

# fixed-size values, made with the file: recording the outcome later rewrites their bytes in place
# and never changes the file's structure, so a job killed while recording cannot damage its output
STATUS_BYTES, MODE_BYTES = 12, 40


def _fixed(text, size):
    return np.array(text.encode("ascii"), dtype=f"S{size}")


def pending_attrs(outputs, requested):
    """The verification attributes a ``run`` output is created with: ``verify = "not finished"`` and
    room for the outcome when ``requested`` (a job stopped before :func:`record` leaves them so, which
    is the truth), else ``verify = "not run"``. ``outputs``: the names of the output datasets."""
    if not requested:
        return {"verify": _fixed("not run", STATUS_BYTES)}
    attrs = {"verify": _fixed("not finished", STATUS_BYTES), "verify_mode": _fixed("", MODE_BYTES)}
    for name in outputs:
        attrs[f"verify_max_err_{name}"] = np.float64(np.nan)
        attrs[f"verify_tol_{name}"] = np.float64(np.nan)
    return attrs


def record(path, report, tries=5):
    """Write ``report`` (from :func:`verify`) into the attributes of the published output ``path``
    (one process). The attributes were made by :func:`pending_attrs`; only their values change.
    Tried a few times: a reader that has the file open holds HDF5's lock on it for a moment."""
    import h5py

    for attempt in range(tries):
        try:
            with h5py.File(path, "r+") as f:
                f.attrs.modify("verify_mode", _fixed(report["mode"][:MODE_BYTES], MODE_BYTES))
                for name in report["err"]:
                    f.attrs.modify(f"verify_max_err_{name}", np.float64(report["err"][name]))
                    f.attrs.modify(f"verify_tol_{name}", np.float64(report["tol"][name]))
                f.attrs.modify("verify", _fixed("pass" if report["ok"] else "fail", STATUS_BYTES))  # last
            return
        except OSError:
            if attempt == tries - 1:
                raise
            time.sleep(0.5)


def recorded(path):
    """The verification attributes of an output file, as plain Python values ({} without them)."""
    import h5py

    with h5py.File(path, "r") as f:
        return {key: (value.decode() if isinstance(value, bytes) else value.item() if isinstance(value, np.generic)
                      else value) for key, value in f.attrs.items() if key.startswith("verify")}
