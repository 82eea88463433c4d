"""GPU tests: non-finite inputs propagate through the CUDA kernels (DESIGN.md, "What every call promises";
issue 24), once per kernel family this GPU runs (sm90 then sm80 on Hopper; the family leads the test id),
in bfloat16 and float16. Skipped without CuPy or without a GPU. Run on the GPU machine with
``python3 -m pytest -q tests/test_cuda_nonfinite.py``.

What the kernels promise (docs/KERNELS.md, "Non-finite inputs"), against the float64 oracle:
- forward, a NaN or Inf in q or k: o and lse are non-finite exactly where the oracle's are, under every
  mask (scores are masked by a select before the softmax, and only a row sum of 0 / an lse of -inf
  means "nothing seen");
- a NaN or Inf in v, and every gradient: non-finite at least where the oracle's are. Inside a partly
  masked tile (a diagonal, a window or document edge) a kernel's matrix products multiply a hidden
  pair's weight 0 by the NaN (0 x NaN = NaN), so it can also reach that tile's other rows or keys.
  With no mask (no partly masked tile) they match the oracle exactly, and so they do across documents
  whose bounds fall on tile bounds (multiples of 384 tokens): a NaN never crosses such a document;
- wherever both are finite, ours is close to the oracle;
- the epilogue's merge into a running (o, lse): a NaN row stays NaN when a later key block merges
  into it, and a NaN block result makes a finite running row NaN.
Fresh random inputs and positions every run; the seed is in every message.
"""
import numpy as np
import pytest

from burst_hpc.device import gpu_count  # noqa: E402

cupy = pytest.importorskip("cupy")
_NGPU = gpu_count()
pytestmark = pytest.mark.skipif(_NGPU < 1, reason="no GPU")

import burst_hpc  # noqa: E402
from burst_hpc.plan import masks  # noqa: E402
from burst_hpc.backends import cuda  # noqa: E402
from burst_hpc.reference import attention_backward_reference, attention_reference  # noqa: E402

from burst_testing import BF16, assert_finite_like, plain_mask, poke_nonfinite  # noqa: E402

FP16 = np.dtype(np.float16)
VALUES = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}
NAMES = ("o", "lse", "dq", "dk", "dv")
TOL = {BF16: 0.05, FP16: 0.02}  # of max(1, max |oracle|), where both are finite: the pattern is the test


@pytest.fixture(scope="module", autouse=True, params=cuda.kernel_families() if _NGPU else ())
def family(request):
    """Run the module's tests on one kernel family (the API reads $BURST_HPC_KERNELS)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BURST_HPC_KERNELS", request.param)
        yield request.param


def _seeded():
    seed = int(np.random.SeedSequence().entropy % 2**63)
    return np.random.default_rng(seed), seed


def _mask_kwargs(rng, kind, seqlen):
    if kind == "full":
        return {}
    if kind == "causal":
        return {"causal": True}
    if kind == "window":
        return {"window": (int(rng.integers(20, 150)), int(rng.integers(0, 70)))}
    return {"causal": True, "cu_seqlens": masks.random_documents(rng, seqlen, 5)}  # "documents"


def _api(q, k, v, do, kw):
    """(o, lse, dq, dk, dv) as host arrays from burst_hpc.attention / attention_backward on the GPU."""
    dev = [cupy.asarray(x) for x in (q, k, v, do)]
    o, lse = burst_hpc.attention(*dev[:3], **kw)
    grads = burst_hpc.attention_backward(dev[3], *dev[:3], o, lse, **kw)
    return tuple(cupy.asnumpy(x) for x in (o, lse, *grads))


def _oracle(q, k, v, do, kw):
    return (*attention_reference(q, k, v, **kw), *attention_backward_reference(do, q, k, v, **kw))


CASES = [  # (where, value, mask, seqlen, head_dim, dtype)
    *[(w, val, m, s, d, BF16) for w in "qkv" for val in VALUES
      for m, s, d in (("full", 333, 128), ("causal", 517, 64), ("window", 450, 128), ("documents", 600, 64))],
    *[(w, "nan", m, 300, 128, FP16) for w in "qkv" for m in ("causal", "documents")],
    ("k", "nan", "causal", 300, 256, BF16),  # sm90's native D = 256 kernels
    ("q", "inf", "full", 200, 256, BF16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}={c[1]}_{c[2]}_S{c[3]}_d{c[4]}_{c[5].name}")
def test_nonfinite_follows_the_oracle(case):
    where, value, mask, seqlen, d, dtype = case
    rng, seed = _seeded()
    kw = _mask_kwargs(rng, mask, seqlen)
    q, k, v, do = (rng.standard_normal((1, seqlen, h, d)).astype(dtype) for h in (4, 2, 2, 4))
    spots = poke_nonfinite(rng, {"q": q, "k": k, "v": v}[where], VALUES[value], int(rng.integers(1, 3)))
    ctx = f"seed={seed} {where}[{spots}]={value} {kw}"
    ref = _oracle(q, k, v, do, kw)
    assert any((~np.isfinite(r)).any() for r in ref), ctx + ": the case tests nothing"
    for name, got, want in zip(NAMES, _api(q, k, v, do, kw), ref):
        exact = mask == "full" or name == "lse" or (name == "o" and where != "v")
        assert_finite_like(name, got, want, TOL[dtype], ctx, superset=not exact)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_never_crosses_documents_on_tile_bounds(where, causal):
    """Documents of 384 and 768 tokens (every tile height and width divides 384): a NaN in one leaves the
    others finite and close to the oracle, forward and backward; without causal masking no tile is partly
    masked, so every output matches the oracle's pattern exactly."""
    rng, seed = _seeded()
    cu = np.array([0, 384, 1152, 1536])
    doc = int(rng.integers(0, 3))
    d = int(rng.choice([64, 128]))
    q, k, v, do = (rng.standard_normal((1, 1536, h, d)).astype(BF16) for h in (4, 2, 2, 4))
    x = {"q": q, "k": k, "v": v}[where]
    x[0, int(rng.integers(cu[doc], cu[doc + 1])), int(rng.integers(0, x.shape[2])), int(rng.integers(0, d))] = np.nan
    kw = {"causal": causal, "cu_seqlens": cu}
    ctx = f"seed={seed} NaN in {where}, document {doc}, D={d} causal={causal}"
    inside = np.arange(cu[doc], cu[doc + 1])
    outside = np.setdiff1d(np.arange(1536), inside)
    for name, got, want in zip(NAMES, _api(q, k, v, do, kw), _oracle(q, k, v, do, kw)):
        axis = 2 if name == "lse" else 1
        assert_finite_like(name, np.take(got, outside, axis=axis), np.take(want, outside, axis=axis), TOL[BF16],
                           f"{ctx} (other documents)")
        assert_finite_like(name, np.take(got, inside, axis=axis), np.take(want, inside, axis=axis), TOL[BF16],
                           f"{ctx} (its document)", superset=causal)


@pytest.mark.parametrize("nan_first", [True, False])
def test_running_nan_survives_the_epilogue_merge(family, nan_first):
    """Two causal key blocks merged by the kernels' epilogue into one running (o, lse): the first block's
    keys hold a NaN, the rows past the cut see both blocks, and the NaN block is merged first (a finite
    part then meets a running NaN lse: not "nothing merged yet") or last (a NaN row sum meets a finite
    running row: not "nothing visible"). The rows that see the NaN are NaN after both, the others match
    the oracle."""
    rng, seed = _seeded()
    seqlen, d, cut = 700, 128, int(rng.integers(200, 500))
    be = cuda.CudaBackend.instance(family=family)
    q, k, v = (rng.standard_normal((1, seqlen, h, d)).astype(BF16) for h in (4, 2, 2))
    k[0, int(rng.integers(0, cut)), 1, int(rng.integers(0, d))] = np.nan
    o = cupy.zeros((1, seqlen, 4, d), cupy.float32)
    lse = cupy.full((1, 4, seqlen), -cupy.inf, cupy.float32)
    blocks = [(0, cut), (cut, seqlen)]
    for k0, k1 in blocks if nan_first else blocks[::-1]:
        be.forward_block(cupy.asarray(q), cupy.asarray(k[:, k0:k1]), cupy.asarray(v[:, k0:k1]), o, lse,
                         scale=d ** -0.5, **plain_mask(True), q_start=0, k_start=k0)
    ctx = f"seed={seed} cut {cut}, NaN block merged first: {nan_first}"
    ref_o, ref_lse = attention_reference(q, k, v, causal=True)
    assert np.isnan(ref_lse[:, :, cut:]).any() and np.isfinite(ref_lse).any(), ctx
    assert_finite_like("o", cupy.asnumpy(o), ref_o, TOL[BF16], ctx)
    assert_finite_like("lse", cupy.asnumpy(lse), ref_lse, TOL[BF16], ctx)
