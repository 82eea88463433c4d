"""Local block backends: the seam between the ring engine and the device (DESIGN.md layer 5).

Every backend implements the same three calls over one (query block, key block) pair.
Shapes follow BSHD: q (B, Sq, Hq, D); k, v (B, Sk, Hkv, D) with Hq % Hkv == 0, query head h
reading key/value head h // (Hq // Hkv). Inputs may be strided views along S (a zigzag half).

    forward_block(q, k, v, o, lse, *, scale, masked=False, mask=None, q_start=0, k_start=0, first=False, out=None)
        o   float accumulator (B, Sq, Hq, D), the running *normalised* output
        lse float accumulator (B, Hq, Sq), the running natural-log sum-exp (-inf: nothing yet)
        Attends q to this key block and merges the result into (o, lse) in place (GAO merge).
        masked: the pair needs its mask applied (False: every key is visible to every query, and
        ``mask`` is not read: the pair may be several runs fused in local memory). ``mask`` is the
        call's masks.Mask, on global positions: query q_start + i sees the keys k_start + j inside
        mask.rows(q_start, Sq)'s bounds (lo[i] <= k_start + j < hi[i]); its ``kind`` says how the
        kernels apply it ('causal': key position k_start + j > q_start + i hidden, in closed form;
        'intervals': documents, windows and the rest of the interval model, from lo and hi).

    backward_block(q, k, v, do, lse, delta, dq, dk, dv, *, scale, masked=False, mask=None, q_start=0, k_start=0,
                   o=None, first_q=False, first_kv=False, dq_out=None, dk_out=None, dv_out=None)
        lse, delta (B, Hq, Sq): the final forward lse and rowsum(do * o); delta None: the backend
        computes it from ``o`` (the forward's output, like do) in its own pre-pass.
        Adds this block pair's gradients into dq (B, Sq, Hq, D) and dk, dv (B, Sk, Hkv, D).

    delta(do, o) -> (B, Hq, S) accumulator-type rowsum(do * o)

    rows_copy(src, src_rows, dst, dst_rows)
        dst[:, dst_rows] = src[:, src_rows], rows of contiguous (B, S, ...) arrays of one dtype; an index None
        is the first rows in order, as many as the other lists (both None: all of src's); src_rows, dst_rows
        int64 arrays on the device (the packed passes place and gather keys and gradients with it).

    rows_sum(src, own, ptr, at, step, parts, out)
        The packed backward's gradients of a rank's own keys, from every rank's share, converted once:
        out[b, r] = src[b, own[r]] + the sum over j in [ptr[r], ptr[r+1]) of parts[at[j] + b * step[j]].
        src (B, K, ...) and parts (rows, ...) float accumulators, out (B, S, ...) contiguous in the inputs'
        dtype or the accumulator's; own, at int64 and ptr (S + 1 offsets), step int32 arrays on the device.

A pass tells a block call where the pair stands among the pairs that write the same rows (its query
rows for o, lse and dq; its keys for dk, dv), so that nothing outside the kernels fills or converts:
    first (forward), first_q, first_kv: the pair is the first to write these rows: the accumulators hold
        nothing yet; their contents are ignored (the caller need not fill them) and overwritten.
    out (forward), dq_out, dk_out and dv_out (together): the pair is the last to write these rows: the
        final result goes to ``out`` (an array like q, or like k, in the inputs' dtype or any the backend
        takes), converted once where it is last written, and the accumulator's contents are undefined
        afterwards. The forward's lse is written at every pair.
    An accumulator may be None when its pair is both the first and the last (one pair alone, as on one
    device): then nothing float32 need exist outside the kernels.

Accumulators are float32 (float64 when the inputs are float64, NumPy only). ``forward_ends`` and
``backward_ends`` run these flags around a block call that only merges or adds (the NumPy backend, and
the CUDA paths whose kernels do not take them).
"""
from ..dtypes import accum_dtype
from ..errors import BackendError


def _accumulator(xp, acc, out, first, name):
    """The accumulator a merging / adding block call writes: ``acc`` (None: a new one for ``out``'s rows,
    allowed only when the pair is the first and the last)."""
    if acc is not None:
        return acc
    if out is None or not first:
        raise BackendError(f"{name} may be None only for a pair that is the first and the last (first and out given)")
    return xp.empty(out.shape, accum_dtype(out.dtype))


def forward_ends(xp, run, o, lse, *, first=False, out=None, spend=False):
    """The block contract's ``first`` and ``out`` around ``run(o, lse)``, a forward that merges into a
    running (o, lse): at the first pair (o, lse) start empty (0, -inf: rows that see nothing keep them), at
    the last the final output is converted into ``out``. ``spend``: then fill the caller's o with NaN, as
    the contract allows (the NumPy backend: a pass that reads it again fails its tests)."""
    given = o is not None
    o = _accumulator(xp, o, out, first, "o")
    if first:
        o.fill(0)
        lse.fill(-xp.inf)
    run(o, lse)
    if out is not None:
        out[...] = o
        if spend and given:
            o.fill(xp.nan)


def backward_ends(xp, run, delta_of, do, o, delta, dq, dk, dv, *, first_q=False, first_kv=False, dq_out=None,
                  dk_out=None, dv_out=None, spend=False):
    """The block contract's ``o``, ``first_q``, ``first_kv`` and outputs around ``run(delta, dq, dk, dv)``, a
    backward that adds into float accumulators: delta from ``delta_of(do, o)`` when not given, the
    accumulators of a first pair zeroed, those of a last pair converted into their outputs (``spend``: then
    the caller's accumulators filled with NaN, as forward_ends)."""
    if delta is None:
        if o is None:
            raise BackendError("backward_block needs delta or o")
        delta = delta_of(do, o)
    if (dk_out is None) != (dv_out is None):
        raise BackendError("dk_out and dv_out go together")
    grads = []
    for acc, out, first, name in ((dq, dq_out, first_q, "dq"), (dk, dk_out, first_kv, "dk"),
                                  (dv, dv_out, first_kv, "dv")):
        acc = _accumulator(xp, acc, out, first, name)
        if first:
            acc.fill(0)
        grads.append(acc)
    run(delta, *grads)
    for acc, out, given in zip(grads, (dq_out, dk_out, dv_out), (dq, dk, dv)):
        if out is not None:
            out[...] = acc
            if spend and given is not None:
                acc.fill(xp.nan)

def get_backend(array, name=None):
    """The backend for ``array``'s kind: NumPy arrays -> numpy, CuPy arrays -> cuda. ``name`` may also
    be a backend object (for example ``CudaBackend.instance(family="sm80")``), used as it is."""
    from ..errors import BackendError

    if name is not None and not isinstance(name, str):
        return name

    is_cupy = type(array).__module__.startswith("cupy")
    if name is None:
        name = "cuda" if is_cupy else "numpy"
    if name == "numpy":
        if is_cupy:
            raise BackendError("the numpy backend takes NumPy arrays; got a CuPy array")
        from .numpy_backend import NumpyBackend

        return NumpyBackend()
    if name == "cuda":
        if not is_cupy:
            raise BackendError("the cuda backend takes CuPy arrays; convert with cupy.asarray first")
        from .cuda import CudaBackend

        return CudaBackend.instance()
    raise BackendError(f"unknown backend {name!r}; use 'numpy' or 'cuda'")
