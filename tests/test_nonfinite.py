"""Non-finite inputs propagate (DESIGN.md, "What every call promises"; issue 24): a NaN or Inf in q, k
or v reaches exactly the outputs the float64 oracle says it reaches, on the NumPy backend: block calls
with small tiles (many partly masked tiles), key blocks merged into a running (o, lse), the public API.
Rows that see nothing keep o = 0, lse = -inf. The oracle itself is checked against naive loops over the
visible pairs. Fresh random inputs and positions every run; the seed is in every message.
"""
import numpy as np
import pytest

from burst_hpc import attention, attention_backward
from burst_hpc.plan import masks
from burst_hpc.backends.numpy_backend import NumpyBackend
from burst_hpc.reference import attention_backward_reference, attention_reference

from burst_testing import BF16, FP32, assert_finite_like, plain_mask, poke_nonfinite, qkv, randn
from test_reference import naive_backward, naive_forward

# no NumPy warning either: the arithmetic of NaN and Inf is expected, not a sign of a bug
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

VALUES = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}
MASKS = ["full", "causal", "window", "causal_window", "documents", "causal_documents"]
NAMES = ("o", "lse", "dq", "dk", "dv")


def _mask_kwargs(rng, kind, seqlen):
    """The oracle's keywords for one kind of mask on a sequence of ``seqlen`` tokens."""
    kw = {"causal": kind.startswith("causal")}
    if kind.endswith("window"):
        kw["window"] = (int(rng.integers(0, 9)), -1 if kw["causal"] is False and rng.random() < 0.3 else
                        int(rng.integers(0, 4)))
    if kind.endswith("documents"):
        kw["cu_seqlens"] = masks.random_documents(rng, seqlen, int(rng.integers(2, 6)))
    return kw


def _block_call(be, q, k, v, do, scale, kw, q_start=0, k_start=0):
    """(o, lse, dq, dk, dv) from one forward_block and one backward_block of ``be``."""
    mask = masks.make(q.shape[1], kw.get("causal", False), kw.get("window"), kw.get("cu_seqlens"))
    o = np.zeros(q.shape, np.float32)
    lse = np.full((q.shape[0], q.shape[2], q.shape[1]), -np.inf, np.float32)
    where = dict(scale=scale, masked=not mask.is_full, mask=mask, q_start=q_start, k_start=k_start)
    be.forward_block(q, k, v, o, lse, **where)
    grads = [np.zeros(x.shape, np.float32) for x in (q, k, v)]
    be.backward_block(q, k, v, do, lse, be.delta(do, o), *grads, **where)
    return (o, lse, *grads)


def _oracle(q, k, v, do, scale, kw, q_start=0, k_start=0):
    o, lse = attention_reference(q, k, v, scale=scale, q_start=q_start, k_start=k_start, **kw)
    return (o, lse, *attention_backward_reference(do, q, k, v, scale=scale, q_start=q_start, k_start=k_start, **kw))


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_block_calls_follow_the_oracle(where, value, mask, rng, seed):
    """One forward_block and one backward_block over tiles of 16 keys / 16 or 24 rows: every output is
    non-finite exactly where the oracle's is, and close to it everywhere else."""
    seqlen = int(rng.integers(40, 90))
    hq, hkv = [(4, 2), (6, 2), (3, 1)][int(rng.integers(0, 3))]
    d = int(rng.choice([8, 12]))
    kw = _mask_kwargs(rng, mask, seqlen)
    q, k, v = qkv(rng, 2, seqlen, seqlen, hq, hkv, d, FP32)
    do = randn(rng, q.shape, FP32)
    spots = poke_nonfinite(rng, {"q": q, "k": k, "v": v}[where], VALUES[value], int(rng.integers(1, 3)))
    scale = d ** -0.5
    ctx = f"seed={seed} {where}[{spots}]={value} S={seqlen} heads={hq}:{hkv} D={d} {kw}"
    ours = _block_call(NumpyBackend(int(rng.choice([16, 24])), 16), q, k, v, do, scale, kw)
    ref = _oracle(q, k, v, do, scale, kw)
    assert any((~np.isfinite(r)).any() for r in ref), ctx + ": the case tests nothing"
    for name, got, want in zip(NAMES, ours, ref):
        assert_finite_like(name, got, want, 1e-4, ctx)


@pytest.mark.parametrize("mask", ["full", "causal", "causal_documents"])
@pytest.mark.parametrize("where", ["q", "k"])
def test_key_blocks_merged_in_any_order(where, mask, rng, seed):
    """The keys in 2-3 blocks (k_start offsets), each block's forward merged into one running (o, lse) in
    a random order, then each block's backward added up: a NaN part stays NaN whatever comes after it,
    and a finite part never turns a NaN row back."""
    seqlen, hq, hkv, d = int(rng.integers(30, 70)), 4, 2, 8
    kw = _mask_kwargs(rng, mask, seqlen)
    q, k, v = qkv(rng, 1, seqlen, seqlen, hq, hkv, d, FP32)
    do = randn(rng, q.shape, FP32)
    spots = poke_nonfinite(rng, {"q": q, "k": k}[where], np.nan, 1)
    cuts = [0, *sorted(rng.choice(np.arange(1, seqlen), int(rng.integers(1, 3)), replace=False).tolist()), seqlen]
    order = rng.permutation(len(cuts) - 1).tolist()
    ctx = f"seed={seed} {where}[{spots}]=nan cuts={cuts} order={order} {kw}"
    mask_ = masks.make(seqlen, kw["causal"], None, kw.get("cu_seqlens"))
    causal = not mask_.is_full
    be = NumpyBackend(16, 16)
    o = np.zeros(q.shape, np.float32)
    lse = np.full((1, hq, seqlen), -np.inf, np.float32)
    for i in order:
        k0, k1 = cuts[i], cuts[i + 1]
        be.forward_block(q, k[:, k0:k1], v[:, k0:k1], o, lse, scale=d ** -0.5, masked=causal, k_start=k0, mask=mask_)
    grads = [np.zeros(x.shape, np.float32) for x in (q, k, v)]
    delta = be.delta(do, o)
    for i in order:
        k0, k1 = cuts[i], cuts[i + 1]
        be.backward_block(q, k[:, k0:k1], v[:, k0:k1], do, lse, delta, grads[0], grads[1][:, k0:k1],
                          grads[2][:, k0:k1], scale=d ** -0.5, masked=causal, k_start=k0, mask=mask_)
    for name, got, want in zip(NAMES, (o, lse, *grads), _oracle(q, k, v, do, d ** -0.5, kw)):
        assert_finite_like(name, got, want, 1e-4, ctx)


def test_rows_that_see_nothing_keep_zero_and_minus_inf(rng, seed):
    """A causal block whose first rows see no key, with NaN in keys hidden from them (and from every
    row) and in a key some rows see: the rows that see nothing keep o = 0, lse = -inf, zero dq, never
    NaN; the rows that see the NaN key are NaN."""
    sq, sk, d = 40, 40, 8
    q, k, v = qkv(rng, 1, sq, sk, 2, 1, d, FP32)
    do = randn(rng, q.shape, FP32)
    k_start = 10  # query rows 0..9 see nothing
    seen_key = int(rng.integers(0, 20))  # local key, seen by rows >= k_start + seen_key
    k[0, seen_key, 0, 3] = np.nan
    k[0, sk - 5:, 0, :] = np.nan  # keys 45.. (global): after every query
    v[0, sk - 5:, 0, :] = np.nan
    ours = _block_call(NumpyBackend(16, 16), q, k, v, do, d ** -0.5, {"causal": True}, 0, k_start)
    o, lse, dq = ours[:3]
    ctx = f"seed={seed} NaN at key {seen_key}"
    assert np.all(o[:, :k_start] == 0) and np.isneginf(lse[:, :, :k_start]).all(), ctx
    assert np.all(dq[:, :k_start] == 0), ctx
    assert np.isnan(lse[:, :, k_start + seen_key:]).all() and np.isfinite(lse[:, :, k_start:k_start + seen_key]).all(), ctx
    for name, got, want in zip(NAMES, ours, _oracle(q, k, v, do, d ** -0.5, {"causal": True}, 0, k_start)):
        assert_finite_like(name, got, want, 1e-4, ctx)


@pytest.mark.parametrize("mask", ["causal", "window", "causal_documents"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_public_api_in_bfloat16(where, mask, rng, seed):
    """attention / attention_backward on bfloat16 inputs (the default tiles): NaN in the outputs where the
    oracle has it, in the input dtype, lse float32."""
    seqlen, hq, hkv, d = int(rng.integers(130, 200)), 4, 1, 16
    kw = _mask_kwargs(rng, mask, seqlen)
    q, k, v = qkv(rng, 1, seqlen, seqlen, hq, hkv, d, BF16)
    do = randn(rng, q.shape, BF16)
    spots = poke_nonfinite(rng, {"q": q, "k": k, "v": v}[where], np.nan, 2)
    ctx = f"seed={seed} {where}[{spots}]=nan S={seqlen} {kw}"
    o, lse = attention(q, k, v, **kw)
    grads = attention_backward(do, q, k, v, o, lse, **kw)
    assert o.dtype == BF16 and lse.dtype == np.float32 and all(g.dtype == BF16 for g in grads), ctx
    for name, got, want in zip(NAMES, (o, lse, *grads), _oracle(q, k, v, do, None, kw)):
        assert_finite_like(name, got, want, 0.03, ctx)


@pytest.mark.parametrize("causal,q_start,k_start", [(False, 0, 0), (True, 0, 0), (True, 5, 2), (True, 2, 4)])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_oracle_matches_naive_loops_on_nan(where, causal, q_start, k_start, rng, seed):
    """The oracle's NaN pattern and values against naive loops over the visible pairs alone (no mask
    multiplies anything there): NaN in q, k or v, GQA, causal blocks with offsets."""
    q, k, v = qkv(rng, 2, 6, 7, 4, 2, 3)
    do = randn(rng, q.shape)
    spots = poke_nonfinite(rng, {"q": q, "k": k, "v": v}[where], np.nan, 1)
    scale = float(rng.uniform(0.3, 1.2))
    ctx = f"seed={seed} {where}[{spots}]=nan causal={causal} q_start={q_start} k_start={k_start}"
    kw = dict(causal=causal, scale=scale, q_start=q_start, k_start=k_start)
    want = (*naive_forward(q, k, v, causal, scale, q_start, k_start),
            *naive_backward(do, q, k, v, causal, scale, q_start, k_start))
    got = (*attention_reference(q, k, v, **kw), *attention_backward_reference(do, q, k, v, **kw))
    for name, g, w in zip(NAMES, got, want):
        assert_finite_like(name, g, w, 1e-11, ctx)


def test_oracle_inf_rules(rng, seed):
    """The Inf cases the oracle settles by IEEE arithmetic over the visible pairs: a +Inf score makes its
    row NaN (inf - inf); a -Inf score gives its key weight 0; a row whose every visible score is -Inf
    has o = 0, lse = -inf, like a row that sees nothing, and a NaN dq (0 times the Inf key)."""
    q, k, v = qkv(rng, 1, 4, 4, 1, 1, 2)
    k[0, 0, 0] = [np.inf, 0.0]
    q[0, :, 0, 0] = [-1.0, 1.0, -1.0, 1.0]  # scores with key 0: -inf, +inf, -inf, +inf
    do = randn(rng, q.shape)
    o, lse = attention_reference(q, k, v, causal=True)
    dq, _, _ = attention_backward_reference(do, q, k, v, causal=True)
    ctx = f"seed={seed}"
    assert np.isnan(lse[0, 0, [1, 3]]).all() and np.isnan(o[0, [1, 3]]).all(), ctx
    # row 0 sees key 0 alone
    assert lse[0, 0, 0] == -np.inf and np.all(o[0, 0] == 0) and np.isnan(dq[0, 0, 0, 0]), ctx
    # row 2: key 0 has weight 0, the rest is attention over keys 1..2
    o2, lse2 = attention_reference(q[:, 2:3], k[:, 1:3], v[:, 1:3])
    np.testing.assert_allclose(o[0, 2], o2[0, 0], rtol=1e-13, err_msg=ctx)
    np.testing.assert_allclose(lse[0, 0, 2], lse2[0, 0, 0], rtol=1e-13, err_msg=ctx)


def test_nan_stays_inside_its_document(rng, seed):
    """Packed documents: a NaN anywhere in one document leaves every output of the others finite, on
    the oracle and on the backend, forward and backward (hidden pairs add nothing)."""
    seqlen = 60
    cu = np.array([0, 17, 18, 41, 60])
    q, k, v = qkv(rng, 1, seqlen, seqlen, 2, 1, 8, FP32)
    do = randn(rng, q.shape, FP32)
    doc = int(rng.integers(0, 4))
    lo, hi = cu[doc], cu[doc + 1]
    for x in (q, k, v):
        x[0, int(rng.integers(lo, hi)), 0, int(rng.integers(0, 8))] = np.nan
    kw = {"causal": bool(rng.random() < 0.5), "cu_seqlens": cu}
    ctx = f"seed={seed} NaN in document {doc} [{lo}, {hi}) {kw}"
    outside = np.r_[0:lo, hi:seqlen]
    for result in (_block_call(NumpyBackend(16, 16), q, k, v, do, 8 ** -0.5, kw), _oracle(q, k, v, do, 8 ** -0.5, kw)):
        for name, x in zip(NAMES, result):
            axis = 2 if name == "lse" else 1
            assert np.isfinite(np.take(x, outside, axis=axis)).all(), f"{ctx}: {name} leaked"
            assert not np.isfinite(np.take(x, np.arange(lo, hi), axis=axis)).all(), f"{ctx}: {name} lost the NaN"


def test_fully_masked_calls_are_untouched_by_nan(rng, seed):
    """Keys all after every query (a hidden block pair): a NaN in them changes nothing."""
    q, k, v = qkv(rng, 1, 9, 7, 2, 1, 4, FP32)
    for x in (k, v):
        x[...] = np.nan
    be = NumpyBackend(16, 16)
    o = randn(rng, q.shape, FP32)
    lse = randn(rng, (1, 2, 9), FP32)
    saved = o.copy(), lse.copy()
    be.forward_block(q, k, v, o, lse, scale=0.5, **plain_mask(True), q_start=0, k_start=20)
    for got, want in zip((o, lse), saved):
        np.testing.assert_array_equal(got, want, err_msg=f"seed={seed}")
