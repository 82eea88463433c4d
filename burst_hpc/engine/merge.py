"""GAO: merging partial attention results of the same queries over disjoint key sets.

    lse = logaddexp(lse_a, lse_b)
    o   = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse)

Both exponents are <= 0, so nothing overflows; where both parts are empty (lse = -inf) the
weights are exp(-inf) = 0 and o stays 0. Only lse = -inf means empty: a NaN lse (a part whose
rows saw a NaN or Inf input) is not, so the merged lse and o are NaN there, and stay NaN through
every later merge. Works on NumPy and CuPy arrays alike.
"""
import contextlib

from ..device import array_module


def merge_weights(lse_a, lse_b):
    """(lse, w_a, w_b) for merging two parts; lse arrays of any matching shape."""
    xp = array_module(lse_a)
    # NumPy warns of an 'invalid value' where an lse is NaN: a NaN it propagates, as it should
    with _errstate(xp, invalid="ignore"):
        lse = xp.logaddexp(lse_a, lse_b)
        # where both parts are empty lse is -inf; subtract 0 instead so the weights are exp(-inf) = 0
        finite = xp.where(xp.isneginf(lse), 0, lse)
        return lse, xp.exp(lse_a - finite), xp.exp(lse_b - finite)


def _errstate(xp, **kwargs):
    """numpy.errstate(**kwargs) for NumPy arrays; nothing for CuPy (which never warns)."""
    return xp.errstate(**kwargs) if xp.__name__ == "numpy" else contextlib.nullcontext()


def merge(o_a, lse_a, o_b, lse_b):
    """Merged (o, lse) of two parts. o: (B, S, H, D), lse: (B, H, S)."""
    xp = array_module(o_a)
    lse, w_a, w_b = merge_weights(lse_a, lse_b)
    w_a = w_a.transpose(0, 2, 1)[..., None]
    w_b = w_b.transpose(0, 2, 1)[..., None]
    # a part with lse = -inf holds nothing and its o is ignored, as the kernels do: a running o that was
    # never written may hold anything (NaN poison included)
    empty_a = xp.isneginf(lse_a).transpose(0, 2, 1)[..., None]
    empty_b = xp.isneginf(lse_b).transpose(0, 2, 1)[..., None]
    return xp.where(empty_a, 0, o_a * w_a) + xp.where(empty_b, 0, o_b * w_b), lse


def merge_into(o, lse, o_b, lse_b):
    """Merge the part (o_b, lse_b) into the running (o, lse) in place (both may be views)."""
    merged_o, merged_lse = merge(o, lse, o_b, lse_b)
    o[...] = merged_o
    lse[...] = merged_lse
