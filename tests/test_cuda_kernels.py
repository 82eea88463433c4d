"""GPU tests of the CUDA block kernels (skipped without CuPy or without a GPU).

Rule (FlashAttention style): against a float64 oracle, the max-abs error of our result must be
at most 2x (forward) / 3x (gradients) the error of a plain same-precision implementation
(bf16/fp16 matmul -> softmax -> matmul, each step rounded to the input type, computed here with
CuPy), plus a small floor. Inputs are fresh random draws on every run (no fixed seed); outputs are
poisoned before each call (NaN in o for rows that must be written, random values in the gradient
accumulators, which must be added to).

The float64 oracle runs on the GPU (cupy float64, the same formulas as burst_hpc.reference; a test
below ties the two together on a small case) because the NumPy einsum oracle is too slow at S=4097.

Every test runs once per kernel family this GPU runs (``kernel_families()``: sm90 then sm80 on Hopper);
the family leads the test id, e.g. ``test_forward[sm90-17-64-True-32-8]``.
"""
import itertools
import sys

import numpy as np
import pytest

from burst_hpc.device import gpu_count  # noqa: E402

cupy = pytest.importorskip("cupy")
_NGPU = gpu_count()
pytestmark = pytest.mark.skipif(_NGPU < 1, reason="no GPU")

import burst_hpc  # noqa: E402
from burst_hpc.plan import masks  # noqa: E402
from burst_hpc.backends import cuda, get_backend  # noqa: E402
from burst_hpc.errors import BackendError  # noqa: E402
from burst_hpc.reference import attention_backward_reference  # noqa: E402
from burst_hpc.tolerance import plain_attention  # noqa: E402
from burst_testing import plain_mask  # noqa: E402

BF16 = np.dtype("bfloat16")
_FAMILIES = cuda.kernel_families() if _NGPU else ()
_family = None  # the family of the running test (set by the fixture below)


@pytest.fixture(scope="module", autouse=True, params=_FAMILIES)
def family(request):
    """Run the module's tests on one kernel family: the block calls through ``_be()`` and the public API
    through $BURST_HPC_KERNELS."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BURST_HPC_KERNELS", request.param)
        mp.setattr(sys.modules[__name__], "_family", request.param)
        yield request.param


def _be():
    return cuda.CudaBackend.instance(family=_family)


# ---------------------------------------------------------------- oracles (float64 and plain low precision)
def _expand(k, group):
    return cupy.repeat(k, group, axis=2)


def _mask(sq, sk, q_start, k_start):
    qp = q_start + cupy.arange(sq)
    kp = k_start + cupy.arange(sk)
    return kp[None, :] > qp[:, None]


def ref_forward(q, k, v, scale, causal, q_start=0, k_start=0, dtype=cupy.float64, rnd=None):
    """(o, lse, p): dtype float64 -> the oracle; rnd=low-precision rounding for the plain version."""
    rnd = rnd or (lambda x: x)
    group = q.shape[2] // k.shape[2]
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    k, v = _expand(k, group), _expand(v, group)
    s = rnd(cupy.einsum("bqhd,bkhd->bhqk", q, k) * scale)
    if causal:
        s = cupy.where(_mask(q.shape[1], k.shape[1], q_start, k_start), -cupy.inf, s)
    m = s.max(-1, keepdims=True)
    ms = cupy.where(cupy.isneginf(m), 0, m)
    e = cupy.exp(s - ms)
    tot = e.sum(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = (cupy.log(tot) + ms)[..., 0]
    p = rnd(e / cupy.where(tot > 0, tot, 1))
    o = rnd(cupy.einsum("bhqk,bkhd->bqhd", p, v))
    return o, lse, p


def ref_backward(do, q, k, v, scale, causal, q_start=0, k_start=0, dtype=cupy.float64, rnd=None):
    rnd = rnd or (lambda x: x)
    group = q.shape[2] // k.shape[2]
    o, _, p = ref_forward(q, k, v, scale, causal, q_start, k_start, dtype, rnd)
    q, k, v, do = (x.astype(dtype) for x in (q, k, v, do))
    ke, ve = _expand(k, group), _expand(v, group)
    dv = rnd(cupy.einsum("bhqk,bqhd->bkhd", p, do))
    dp = rnd(cupy.einsum("bqhd,bkhd->bhqk", do, ve))
    delta = cupy.einsum("bqhd,bqhd->bhq", do, o.astype(dtype))[..., None]
    ds = rnd(p * (dp - delta))
    dq = rnd(cupy.einsum("bhqk,bkhd->bqhd", ds, ke) * scale)
    dk = rnd(cupy.einsum("bhqk,bqhd->bkhd", ds, q) * scale)
    b, sk, hq, d = dk.shape
    dk = dk.reshape(b, sk, hq // group, group, d).sum(3)
    dv = dv.reshape(b, sk, hq // group, group, d).sum(3)
    return dq, dk, dv


def _rounder(dtype):
    return lambda x: x.astype(dtype).astype(cupy.float32)


def _rand(shape, dtype, scale=1.0):
    return (cupy.random.standard_normal(shape, dtype=cupy.float32) * scale).astype(dtype)


def _maxerr(a, b):
    a = a.astype(cupy.float64)
    b = b.astype(cupy.float64)
    return float(cupy.abs(a - b).max()) if a.size else 0.0


def _check(name, ours, plain, ref, factor, rel_floor=2.0 ** -10):
    assert bool(cupy.isfinite(ours).all()), f"{name}: non-finite values"
    e_ours, e_plain = _maxerr(ours, ref), _maxerr(plain, ref)
    floor = 1e-5 + rel_floor * (float(cupy.abs(ref).max()) if ref.size else 0.0)
    assert e_ours <= factor * e_plain + floor, f"{name}: error {e_ours:.3e} > {factor} x {e_plain:.3e} + {floor:.2e}"


def _run_forward(q, k, v, scale, causal, q_start=0, k_start=0, o=None, lse=None):
    b, sq, hq, d = q.shape
    if o is None:
        o = cupy.full((b, sq, hq, d), cupy.nan, cupy.float32)  # poison: every visible row must be written
        lse = cupy.full((b, hq, sq), -cupy.inf, cupy.float32)
    _be().forward_block(q, k, v, o, lse, scale=scale, **plain_mask(causal), q_start=q_start, k_start=k_start)
    return o, lse


def _visible_rows(sq, sk, causal, q_start, k_start):
    if not causal:
        return cupy.ones(sq, bool) if sk else cupy.zeros(sq, bool)
    return (q_start + cupy.arange(sq)) >= k_start


# ---------------------------------------------------------------- forward
HEADS_SMALL = [(32, 8), (32, 1)]
HEADS_LARGE = [(8, 2), (8, 1)]  # S = 4097: fewer heads (4:1 GQA and MQA) keep the float64 oracle fast


def _fwd_cases():
    for s in (1, 17, 128, 1000, 4097):
        heads = HEADS_LARGE if s > 1000 else HEADS_SMALL
        for d in (64, 128, 256):
            for causal in (False, True):
                for hq, hkv in heads:
                    yield s, d, causal, hq, hkv


@pytest.mark.parametrize("s,d,causal,hq,hkv", list(_fwd_cases()))
def test_forward(s, d, causal, hq, hkv):
    b = 2
    q, k, v = (_rand((b, s, h, d), BF16) for h in (hq, hkv, hkv))
    scale = d ** -0.5
    o, lse = _run_forward(q, k, v, scale, causal)
    ref_o, ref_lse, _ = ref_forward(q, k, v, scale, causal)
    pl_o, _, _ = ref_forward(q, k, v, scale, causal, dtype=cupy.float32, rnd=_rounder(BF16))
    _check("o", o, pl_o, ref_o, 2)
    assert _maxerr(lse, ref_lse) < 1e-3 * max(1.0, float(cupy.abs(ref_lse).max()))


@pytest.mark.parametrize("s,d,causal,hq,hkv", list(_fwd_cases()))
def test_backward(s, d, causal, hq, hkv):
    _check_backward(s, d, causal, hq, hkv)


def _check_backward(s, d, causal, hq, hkv, b=2):
    """One backward_block against the float64 oracle (3x the plain bf16 error), gradients added to poison."""
    q, k, v, do = (_rand((b, s, h, d), BF16) for h in (hq, hkv, hkv, hq))
    scale = d ** -0.5
    be = _be()
    o, lse = _run_forward(q, k, v, scale, causal)
    delta = be.delta(do, o)
    # poison: accumulators start from random values and must be *added* to
    init = [cupy.random.standard_normal(x.shape, dtype=cupy.float32) for x in (q, k, v)]
    dq, dk, dv = (x.copy() for x in init)
    be.backward_block(q, k, v, do, lse, delta, dq, dk, dv, scale=scale, **plain_mask(causal))
    ref = ref_backward(do, q, k, v, scale, causal)
    plain = ref_backward(do, q, k, v, scale, causal, dtype=cupy.float32, rnd=_rounder(BF16))
    for name, got, i0, r, p in zip(("dq", "dk", "dv"), (dq, dk, dv), init, ref, plain):
        _check(name, got - i0, p, r, 3)


def _offset_problem(shape, causal, q_start):
    """bfloat16 (q, k, v) of ``shape`` (B, Sq, Sk, Hq, Hkv, D), the queries at ``q_start``, their scale, the
    float64 oracle's (o, lse) and the plain bfloat16 computation's o."""
    b, sq, sk, hq, hkv, d = shape
    q, k, v = (_rand((b, n, h, d), BF16) for n, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    scale = d ** -0.5
    ref_o, ref_lse, _ = ref_forward(q, k, v, scale, causal, q_start=q_start)
    pl_o, _, _ = ref_forward(q, k, v, scale, causal, q_start=q_start, dtype=cupy.float32, rnd=_rounder(BF16))
    return q, k, v, scale, ref_o, ref_lse, pl_o


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_every_sm90_tile_height(d, causal):
    """Each tile height the sm90 forward instantiates (D = 64: two and three consumer warpgroups), forced,
    merged into a running (o, lse) with a causal offset: the host picks one per shape, so the matrix above
    need not meet them all."""
    if _family != "sm90":
        pytest.skip("tile heights are a property of the sm90 forward")  # the sm80 forward has one
    be = _be()
    q_start = 200
    q, k, v, scale, ref_o, ref_lse, pl_o = _offset_problem((2, 333, 517, 6, 2, d), causal, q_start)
    heights = be.kernels.tile_heights(d)
    assert heights, f"no sm90 forward shape for D={d}"
    for rows in heights:
        be.kernels.forced_tile_height = rows
        try:  # two halves of the keys merged, as two ring steps would
            o, lse = _run_forward(q, k[:, :300], v[:, :300], scale, causal, q_start=q_start)
            _run_forward(q, k[:, 300:], v[:, 300:], scale, causal, q_start=q_start, k_start=300, o=o, lse=lse)
        finally:
            be.kernels.forced_tile_height = None
        _check(f"o (BM={rows})", o, pl_o, ref_o, 2)
        assert _maxerr(lse, ref_lse) < 1e-3 * max(1.0, float(cupy.abs(ref_lse).max())), f"lse (BM={rows})"


@pytest.mark.parametrize("causal", [False, True])
def test_sm90_tile_counter_resets_on_every_stream(causal):
    """The sm90 forward's tile counter is made once per stream and zeroed by the kernel itself: calls after
    the first (the same stream, then another) must still run every tile, and leave the counter at zero."""
    if _family != "sm90":
        pytest.skip("the tile counter belongs to the persistent sm90 forward")
    be = _be()
    b, s, hq, hkv, d = 1, 1000, 32, 8, 128  # 256 tiles: more than one per SM, so CTAs draw from the counter
    q, k, v = (_rand((b, s, h, d), BF16) for h in (hq, hkv, hkv))
    scale = d ** -0.5
    ref_o, _, _ = ref_forward(q, k, v, scale, causal)
    pl_o, _, _ = ref_forward(q, k, v, scale, causal, dtype=cupy.float32, rnd=_rounder(BF16))
    side = cupy.cuda.Stream(non_blocking=True)
    for stream in (cupy.cuda.get_current_stream(), cupy.cuda.get_current_stream(), side, side):
        with stream:
            o, _ = _run_forward(q, k, v, scale, causal)
            stream.synchronize()
            assert cupy.asnumpy(be.kernels.tile_counter()).tolist() == [0, 0], "the counter was left non-zero"
        _check("o", o, pl_o, ref_o, 2)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_forward_key_splits(d, causal):
    """The sm90 forward with each query tile's key range cut across CTAs (forced: 2 and 3 parts, more parts
    than some causal tiles have key tiles), merged into a running (o, lse) with a causal offset; every tile
    height; the parts' locks are back at zero after each call."""
    if _family != "sm90":
        pytest.skip("key splits belong to the persistent sm90 forward")
    be = _be()
    q_start = 700
    q, k, v, scale, ref_o, ref_lse, pl_o = _offset_problem((1, 333, 1100, 4, 2, d), causal, q_start)
    for rows in be.kernels.tile_heights(d):
        for parts in (2, 3):
            be.kernels.forced_tile_height, be.kernels.forced_key_splits = rows, parts
            try:  # two halves of the keys merged, as two ring steps would
                o, lse = _run_forward(q, k[:, :600], v[:, :600], scale, causal, q_start=q_start)
                _run_forward(q, k[:, 600:], v[:, 600:], scale, causal, q_start=q_start, k_start=600, o=o, lse=lse)
                cupy.cuda.get_current_stream().synchronize()
                assert not cupy.asnumpy(be.kernels.tile_locks(1)).any(), "a lock was left taken"
            finally:
                be.kernels.forced_tile_height = be.kernels.forced_key_splits = None
            _check(f"o (BM={rows}, {parts} parts)", o, pl_o, ref_o, 2)
            assert _maxerr(lse, ref_lse) < 1e-3 * max(1.0, float(cupy.abs(ref_lse).max())), f"lse (BM={rows})"


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("ctas", [None, 2])
def test_sm90_forward_cross_tile(d, causal, ctas):
    """The sm90 forward with and without its cross-tile step (a tile's last P V with the next tile's first
    Q K^T), every tile height, merged halves with a causal offset, on all SMs (256+ tiles) and on 2 CTAs (many tiles each)."""
    if _family != "sm90":
        pytest.skip("the cross-tile step belongs to the persistent sm90 forward")
    be = _be()
    b, sq, sk, hq, hkv = 1, 1000, 700, 32, 8
    q, k, v = (_rand((b, n, h, d), BF16) for n, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    scale, k_start = d ** -0.5, 300  # causal: the first 300 queries see nothing
    ref_o, ref_lse, _ = ref_forward(q, k, v, scale, causal, k_start=k_start)
    pl_o, _, _ = ref_forward(q, k, v, scale, causal, k_start=k_start, dtype=cupy.float32, rnd=_rounder(BF16))
    visible = _visible_rows(sq, sk, causal, 0, k_start)
    default = be.kernels.cross_tile
    for rows, cross in itertools.product(be.kernels.tile_heights(d), (False, True)):
        be.kernels.forced_tile_height, be.kernels.cross_tile, be.kernels.max_ctas = rows, cross, ctas
        try:
            o, lse = _run_forward(q, k[:, :300], v[:, :300], scale, causal, k_start=k_start)
            _run_forward(q, k[:, 300:], v[:, 300:], scale, causal, k_start=k_start + 300, o=o, lse=lse)
        finally:
            be.kernels.forced_tile_height, be.kernels.cross_tile, be.kernels.max_ctas = None, default, None
        _check(f"o (BM={rows}, cross-tile {cross})", o[:, visible], pl_o[:, visible], ref_o[:, visible], 2)
        assert bool(cupy.isnan(o[:, ~visible]).all()), "rows that see nothing were written"
        assert _maxerr(lse[..., visible], ref_lse[..., visible]) < 1e-3 * max(1.0, float(cupy.abs(ref_lse).max()))


# ---------------------------------------------------------------- D = 256: the sm90 backward's wide kernels
# The families with a native D = 256 backward kernel (backward_block routes D = 256 there): the tests below
# run on these (parametrized, not skipped).
_NATIVE_D256 = [f for f in _FAMILIES if f == "sm90"]


def _d256_cases():
    for s in (1, 77, 1000):
        for causal in (False, True):
            yield s, causal, 4, 4
    for causal in (False, True):  # GQA on few CTAs: the group is split over CTAs (dK, dV added by reductions)
        yield 300, causal, 8, 2


@pytest.mark.parametrize("family", _NATIVE_D256, indirect=True)
@pytest.mark.parametrize("s,causal,hq,hkv", list(_d256_cases()))
def test_backward_d256(family, s, causal, hq, hkv):
    """The D = 256 shapes the matrix above lacks: tiny heads, a GQA group split over CTAs."""
    _check_backward(s, 256, causal, hq, hkv)


@pytest.mark.parametrize("family", _NATIVE_D256, indirect=True)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_backward_d256_interval(family, dtype):
    """The interval kernels at D = 256: documents (two of one token) under a sliding window, against the
    float64 oracle with the rule of tests/test_cuda_masks.py."""
    _check_interval_backward(np.dtype(dtype), 256, 4, 2)


def _check_interval_backward(dt, d, hq, hkv, window=(150, 0)):
    seed = int(np.random.SeedSequence().entropy % 2**63)
    rng = np.random.default_rng(seed)
    seqlen = 700
    cu = np.array([0, 1, 2, 130, 451, 700])
    mask = masks.make(seqlen, True, window, cu)
    q, k, v, do = (rng.standard_normal((2, seqlen, h, d)).astype(dt) for h in (hq, hkv, hkv, hq))
    dev = [cupy.asarray(x) for x in (q, k, v, do)]
    scale = d ** -0.5
    be = _be()
    o = cupy.zeros((2, seqlen, hq, d), cupy.float32)
    lse = cupy.full((2, hq, seqlen), -cupy.inf, cupy.float32)
    be.forward_block(*dev[:3], o, lse, scale=scale, masked=True, mask=mask)
    acc = [cupy.zeros(x.shape, cupy.float32) for x in (q, k, v)]
    be.backward_block(*dev, lse, be.delta(dev[3], o), *acc, scale=scale, masked=True, mask=mask)
    kw = dict(causal=True, window=window, cu_seqlens=cu)
    plain = plain_attention(q, k, v, do, True, None, dt, window, cu)
    for name, got, want, base in zip(("dq", "dk", "dv"), acc, attention_backward_reference(do, q, k, v, **kw),
                                     plain[2:]):
        err = float(np.abs(cupy.asnumpy(got).astype(np.float64) - want).max())
        floor = 3e-3 * max(1.0, float(np.abs(want).max()))
        assert err <= 3 * float(np.abs(base - want).max()) + floor, f"seed={seed} {name}"


# ---------------------------------------------------------------- the sm90 backward's tile orders
@pytest.mark.parametrize("family", _NATIVE_D256, indirect=True)  # the sm90 family
@pytest.mark.parametrize("heavy_first", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mode", ["causal", "interval", "interval walking up"])
def test_sm90_backward_tile_orders(family, heavy_first, d, mode):
    """Each backward CTA order (Sm90Kernels.heavy_first: documents heaviest first and a short causal grid's key
    blocks in pieces, or head slot after head slot) against the float64 oracle: causal with a GQA group split
    over CTAs, and interval masks whose key blocks see very different numbers of query tiles (the host's
    ranges), their CTAs walking down (short documents: the default) or up (walk_down_blocks 0, the walk of
    long documents)."""
    kernels = _be().kernels
    defaults = kernels.heavy_first, kernels.walk_down_blocks
    kernels.heavy_first = heavy_first
    if mode == "interval walking up":
        kernels.walk_down_blocks = 0
    try:
        if mode == "causal":
            _check_backward(1000, d, True, 8, 2)
        else:
            _check_interval_backward(BF16, d, 8, 2, window=None)  # documents: the heavy-first order
    finally:
        kernels.heavy_first, kernels.walk_down_blocks = defaults


# ---------------------------------------------------------------- strided views, offsets, merging
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_views_offsets_and_merge(d, causal):
    """Two key blocks at global offsets merged into one running (o, lse), all arrays strided views,
    then the backward over the same two blocks adds into view accumulators."""
    b, hq, hkv = 2, 8, 2
    sq, sk1, sk2 = 333, 200, 517
    q_start, k_start = 450, 100  # keys 100..816, queries 450..782: diagonal tiles, hidden tiles, tails
    scale = d ** -0.5
    qbig = _rand((b, sq + 40, hq, d), BF16)
    q = qbig[:, 17:17 + sq]  # a view along S
    kvbig = _rand((b, sk1 + sk2, 2, hkv, d), BF16)  # k and v interleaved: non-contiguous heads
    k_all, v_all = kvbig[:, :, 0], kvbig[:, :, 1]
    obig = cupy.full((b, sq + 10, hq, d), cupy.nan, cupy.float32)
    lbig = cupy.full((b, hq, sq + 10), -cupy.inf, cupy.float32)
    o, lse = obig[:, 5:5 + sq], lbig[:, :, 5:5 + sq]
    be = _be()
    # the later key block first: the merge order must not matter
    be.forward_block(q, k_all[:, sk1:], v_all[:, sk1:], o, lse, scale=scale, **plain_mask(causal),
                     q_start=q_start, k_start=k_start + sk1)
    be.forward_block(q, k_all[:, :sk1], v_all[:, :sk1], o, lse, scale=scale, **plain_mask(causal),
                     q_start=q_start, k_start=k_start)
    ref_o, ref_lse, _ = ref_forward(q, k_all, v_all, scale, causal, q_start, k_start)
    pl_o, _, _ = ref_forward(q, k_all, v_all, scale, causal, q_start, k_start, cupy.float32, _rounder(BF16))
    _check("o", o, pl_o, ref_o, 2)
    assert _maxerr(lse, ref_lse) < 1e-3 * float(cupy.abs(ref_lse).max())
    assert bool(cupy.isnan(obig[:, :5]).all()) and bool(cupy.isnan(obig[:, 5 + sq:]).all()), "wrote outside the view"

    do = _rand((b, sq + 3, hq, d), BF16)[:, 3:]
    delta = be.delta(do, o)
    dqb = cupy.random.standard_normal((b, sq + 8, hq, d), dtype=cupy.float32)
    dkvb = cupy.random.standard_normal((b, sk1 + sk2, 2, hkv, d), dtype=cupy.float32)
    init = (dqb.copy(), dkvb.copy())
    dq, dk, dv = dqb[:, 8:], dkvb[:, :, 0], dkvb[:, :, 1]
    for lo, hi in ((0, sk1), (sk1, sk1 + sk2)):
        be.backward_block(q, k_all[:, lo:hi], v_all[:, lo:hi], do, lse, delta, dq[:, :], dk[:, lo:hi], dv[:, lo:hi],
                          scale=scale, **plain_mask(causal), q_start=q_start, k_start=k_start + lo)
    ref = ref_backward(do, q, k_all, v_all, scale, causal, q_start, k_start)
    plain = ref_backward(do, q, k_all, v_all, scale, causal, q_start, k_start, cupy.float32, _rounder(BF16))
    got = (dq - init[0][:, 8:], dk - init[1][:, :, 0], dv - init[1][:, :, 1])
    for name, g, r, p in zip(("dq", "dk", "dv"), got, ref, plain):
        _check(name, g, p, r, 3)
    assert bool((dqb[:, :8] == init[0][:, :8]).all()), "dq written outside its view"


def test_fully_masked_rows_untouched():
    """Queries before every key of the block: (o, lse) must stay exactly as they were."""
    b, h, d = 1, 2, 64
    q, k, v = (_rand((b, n, h, d), BF16) for n in (130, 64, 64))
    o = cupy.random.standard_normal((b, 130, h, d), dtype=cupy.float32)
    lse = cupy.random.standard_normal((b, h, 130), dtype=cupy.float32)
    o0, l0 = o.copy(), lse.copy()
    _be().forward_block(q, k, v, o, lse, scale=0.125, **plain_mask(True), q_start=0, k_start=100)
    vis = (cupy.arange(130) >= 100)
    assert bool((o[:, ~vis] == o0[:, ~vis]).all()) and bool((lse[:, :, ~vis] == l0[:, :, ~vis]).all())
    assert not bool((o[:, vis] == o0[:, vis]).all())
    # a block wholly hidden is a no-op
    _be().forward_block(q, k, v, o, lse, scale=0.125, **plain_mask(True), q_start=0, k_start=1000)
    assert bool(cupy.isfinite(o).all())


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_other_input_types(dtype):
    """fp16 runs the fp16 kernels; float32 is converted once to bf16 (documented in docs/KERNELS.md)."""
    dt = np.dtype(dtype)
    low = np.dtype(np.float16) if dt == np.float16 else BF16
    b, s, hq, hkv, d = 2, 300, 4, 2, 128
    q, k, v, do = (_rand((b, s, h, d), dt) for h in (hq, hkv, hkv, hq))
    o, lse = _run_forward(q, k, v, d ** -0.5, True)
    ref_o, _, _ = ref_forward(q, k, v, d ** -0.5, True)
    pl_o, _, _ = ref_forward(q.astype(low), k.astype(low), v.astype(low), d ** -0.5, True, dtype=cupy.float32,
                             rnd=_rounder(low))
    _check("o", o, pl_o, ref_o, 2)
    be = _be()
    dq, dk, dv = (cupy.zeros(x.shape, cupy.float32) for x in (q, k, v))
    be.backward_block(q, k, v, do, lse, be.delta(do, o), dq, dk, dv, scale=d ** -0.5, **plain_mask(True))
    ref = ref_backward(do, q, k, v, d ** -0.5, True)
    plain = ref_backward(*(x.astype(low) for x in (do, q, k, v)), d ** -0.5, True, dtype=cupy.float32,
                         rnd=_rounder(low))
    for name, g, r, p in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, plain):
        _check(name, g, p, r, 3)


def test_api_end_to_end(family):
    """burst_hpc.attention / attention_backward take CuPy bf16 arrays and return CuPy arrays."""
    b, s, hq, hkv, d = 2, 257, 8, 2, 64
    q, k, v, do = (_rand((b, s, h, d), BF16) for h in (hq, hkv, hkv, hq))
    assert get_backend(q).family == family  # the public API runs the family $BURST_HPC_KERNELS names
    o, lse = burst_hpc.attention(q, k, v, causal=True)
    assert isinstance(o, cupy.ndarray) and o.dtype == BF16 and lse.dtype == np.float32
    dq, dk, dv = burst_hpc.attention_backward(do, q, k, v, o, lse, causal=True)
    assert isinstance(dq, cupy.ndarray) and dq.dtype == BF16 and dk.shape == k.shape
    ref_o, _, _ = ref_forward(q, k, v, d ** -0.5, True)
    assert _maxerr(o, ref_o) < 2e-2
    ref = ref_backward(do, q, k, v, d ** -0.5, True)
    for g, r in zip((dq, dk, dv), ref):
        assert _maxerr(g, r) < 3e-2 * max(1.0, float(cupy.abs(r).max()))


def test_oracle_matches_numpy_reference():
    """The GPU float64 oracle used above is the project's float64 NumPy oracle."""
    b, s, hq, hkv, d = 1, 37, 4, 2, 64
    q, k, v, do = (_rand((b, s, h, d), BF16) for h in (hq, hkv, hkv, hq))
    o, lse, _ = ref_forward(q, k, v, 0.1, True, 5, 9)
    hq_ = [cupy.asnumpy(x) for x in (q, k, v, do)]
    ro, rl = burst_hpc.attention_reference(*hq_[:3], causal=True, scale=0.1, q_start=5, k_start=9)
    assert np.allclose(cupy.asnumpy(o), ro, atol=1e-12) and np.allclose(cupy.asnumpy(lse), rl, atol=1e-12)
    g = ref_backward(do, q, k, v, 0.1, True, 5, 9)
    rg = burst_hpc.attention_backward_reference(hq_[3], *hq_[:3], causal=True, scale=0.1, q_start=5, k_start=9)
    for a, r in zip(g, rg):
        assert np.allclose(cupy.asnumpy(a), r, atol=1e-10)


@pytest.mark.skipif(not _NGPU or cuda.gpu_capability() != (9, 0), reason="needs a Hopper GPU (sm_90)")
def test_hopper_default_family(monkeypatch):
    """On Hopper the sm90 family is the default; BURST_HPC_KERNELS=sm80 forces the mma.sync family."""
    monkeypatch.delenv("BURST_HPC_KERNELS")
    assert cuda.default_family() == "sm90"
    assert get_backend(cupy.zeros(1)).family == "sm90"
    monkeypatch.setenv("BURST_HPC_KERNELS", "sm80")
    assert cuda.default_family() == "sm80"
    assert get_backend(cupy.zeros(1)).family == "sm80"


@pytest.mark.parametrize("d", [64, 160])  # a native width, and a head wider than the kernels
def test_unsupported_input_dtype(d):
    q = cupy.zeros((1, 8, 2, d), cupy.float64)
    o = cupy.zeros((1, 8, 2, d), cupy.float32)
    lse = cupy.full((1, 2, 8), -cupy.inf, cupy.float32)
    with pytest.raises(BackendError, match="takes bfloat16, float16 or float32 inputs; got float64"):
        _be().forward_block(q, q, q, o, lse, scale=0.1)


# ---------------------------------------------------------------- torch SDPA as a second oracle
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_against_torch_sdpa(d, causal):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    b, s, hq, hkv = 2, 1000, 8, 2
    q, k, v, do = (_rand((b, s, h, d), BF16) for h in (hq, hkv, hkv, hq))

    def t(x):  # bf16 cupy -> torch (B, H, S, D) through raw int16 bits
        u = x.view(cupy.int16)
        return torch.as_tensor(u, device="cuda").view(torch.bfloat16).transpose(1, 2)

    tq, tk, tv, tdo = (t(x).detach().clone().requires_grad_(True) for x in (q, k, v, do))
    to = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=True)
    to.backward(tdo.detach())
    torch.cuda.synchronize()

    def c(x):  # torch (B, H, S, D) -> cupy float32 (B, S, H, D)
        return cupy.asarray(x.detach().float().transpose(1, 2).contiguous())

    o, lse = _run_forward(q, k, v, d ** -0.5, causal)
    be = _be()
    dq, dk, dv = (cupy.zeros(x.shape, cupy.float32) for x in (q, k, v))
    be.backward_block(q, k, v, do, lse, be.delta(do, o), dq, dk, dv, scale=d ** -0.5, **plain_mask(causal))
    ref_o, _, _ = ref_forward(q, k, v, d ** -0.5, causal)
    _check("o vs torch", o, c(to), ref_o, 2)
    ref = ref_backward(do, q, k, v, d ** -0.5, causal)
    for name, g, tg, r in zip(("dq", "dk", "dv"), (dq, dk, dv), (tq.grad, tk.grad, tv.grad), ref):
        _check(name + " vs torch", g, c(tg), r, 3)


# ---------------------------------------------------------------- the block contract's first / last flags
def _poison(shape, dtype):
    return cupy.full(shape, cupy.nan, dtype)


@pytest.mark.parametrize("s,d,hq,hkv", [(17, 64, 4, 2), (300, 128, 8, 2), (1000, 256, 4, 1), (1000, 128, 4, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_one_pair_writes_its_output(s, d, hq, hkv, causal):
    """first and out together (one pair, as on one GPU): no float32 o at all, o and lse written over poison."""
    b = 2
    q, k, v = (_rand((b, s, h, d), BF16) for h in (hq, hkv, hkv))
    scale = d ** -0.5
    out, lse = _poison(q.shape, BF16), _poison((b, hq, s), cupy.float32)
    _be().forward_block(q, k, v, None, lse, scale=scale, **plain_mask(causal), first=True, out=out)
    ref_o, ref_lse, _ = ref_forward(q, k, v, scale, causal)
    pl_o, _, _ = ref_forward(q, k, v, scale, causal, dtype=cupy.float32, rnd=_rounder(BF16))
    _check("o", out, pl_o, ref_o, 2)
    assert _maxerr(lse, ref_lse) < 1e-3 * max(1.0, float(cupy.abs(ref_lse).max()))


@pytest.mark.parametrize("d", [64, 128])
def test_forward_first_then_last_pair(d):
    """Two key blocks of one query block: the first pair writes the float32 (o, lse) over poison without
    reading them, the last merges into them and writes only the 16-bit output; rows the first pair does not
    see (causal, keys after them) start empty, and a query tile that sees no key of the first block at all is
    written too."""
    b, s, hq, hkv = 1, 700, 4, 2
    q, k, v = (_rand((b, s, h, d), BF16) for h in (hq, hkv, hkv))
    scale, half = d ** -0.5, 400  # the first key block, keys 300.. (rows 0..299 see none of it)
    o, lse, out = _poison(q.shape, cupy.float32), _poison((b, hq, s), cupy.float32), _poison(q.shape, BF16)
    be = _be()
    be.forward_block(q, k[:, 300:half], v[:, 300:half], o, lse, scale=scale, **plain_mask(True), k_start=300,
                     first=True)
    assert bool(cupy.isneginf(lse[:, :, :300]).all())  # nothing yet: o is ignored there
    pieces = ((0, 300), (half, s))
    for i, (k0, k1) in enumerate(pieces):
        be.forward_block(q, k[:, k0:k1], v[:, k0:k1], o, lse, scale=scale, **plain_mask(True), k_start=k0,
                         out=out if i == len(pieces) - 1 else None)
    ref_o, ref_lse, _ = ref_forward(q, k, v, scale, True)
    pl_o, _, _ = ref_forward(q, k, v, scale, True, dtype=cupy.float32, rnd=_rounder(BF16))
    _check("o", out, pl_o, ref_o, 2)
    assert _maxerr(lse, ref_lse) < 1e-3 * max(1.0, float(cupy.abs(ref_lse).max()))


def test_forward_first_pair_rows_that_see_nothing():
    """first with a query block wholly before the keys: every row written (o = 0, lse = -inf), none read."""
    b, h, d = 1, 2, 64
    q, k, v = (_rand((b, n, h, d), BF16) for n in (300, 64, 64))
    out, lse = _poison(q.shape, BF16), _poison((b, h, 300), cupy.float32)
    _be().forward_block(q, k, v, None, lse, scale=0.125, **plain_mask(True), k_start=200, first=True, out=out)
    vis = cupy.arange(300) >= 200
    assert bool((out[:, ~vis].astype(cupy.float32) == 0).all()) and bool(cupy.isneginf(lse[:, :, ~vis]).all())
    ref_o, ref_lse, _ = ref_forward(q, k, v, 0.125, True, 0, 200)
    assert _maxerr(out[:, vis], ref_o[:, vis]) < 2e-2 and bool(cupy.isfinite(lse[:, :, vis]).all())


@pytest.mark.parametrize("s,d,hq,hkv", [(300, 128, 8, 2), (1000, 64, 4, 4), (1000, 128, 4, 4), (500, 256, 2, 2),
                                        (4097, 128, 8, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_one_pair_writes_its_gradients(s, d, hq, hkv, causal):
    """first and last together with o for delta (one pair, as on one GPU): no float32 accumulator passed, the
    16-bit gradients written over poison (hq == hkv: dK, dV straight from the kernel; GQA at small sizes:
    added across CTAs, then converted)."""
    b = 1
    q, k, v, do = (_rand((b, s, h, d), BF16) for h in (hq, hkv, hkv, hq))
    scale = d ** -0.5
    be = _be()
    o, lse = _poison(q.shape, BF16), _poison((b, hq, s), cupy.float32)
    be.forward_block(q, k, v, None, lse, scale=scale, **plain_mask(causal), first=True, out=o)
    dq, dk, dv = (_poison(x.shape, BF16) for x in (q, k, v))
    be.backward_block(q, k, v, do, lse, None, None, None, None, scale=scale, **plain_mask(causal), o=o, first_q=True,
                      first_kv=True, dq_out=dq, dk_out=dk, dv_out=dv)
    ref = ref_backward(do, q, k, v, scale, causal)
    plain = ref_backward(do, q, k, v, scale, causal, dtype=cupy.float32, rnd=_rounder(BF16))
    for name, got, r, p in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, plain):
        _check(name, got, p, r, 3)


def test_backward_first_and_last_pairs_of_a_ring():
    """Pairs of a 2 x 2 grid of blocks, as a ring visits them: each accumulator's first pair writes over
    poison, its last converts into the 16-bit output (the keys' second pair adds, then converts; the queries'
    first pair leaves float32)."""
    b, s, hq, hkv, d = 1, 600, 4, 2, 128
    q, k, v, do = (_rand((b, s, h, d), BF16) for h in (hq, hkv, hkv, hq))
    scale, half = d ** -0.5, 256
    be = _be()
    o, lse = burst_hpc.attention(q, k, v)
    delta = be.delta(do, o)
    dq = _poison(q.shape, cupy.float32)
    dk, dv = _poison(k.shape, cupy.float32), _poison(v.shape, cupy.float32)
    outs = [_poison(x.shape, BF16) for x in (q, k, v)]
    blocks = (slice(0, half), slice(half, s))
    for i, qb in enumerate(blocks):
        for j, kb in enumerate(blocks):
            be.backward_block(q[:, qb], k[:, kb], v[:, kb], do[:, qb], lse[:, :, qb], delta[:, :, qb], dq[:, qb],
                              dk[:, kb], dv[:, kb], scale=scale, q_start=qb.start, k_start=kb.start,
                              first_q=j == 0, first_kv=i == 0, dq_out=outs[0][:, qb] if j == 1 else None,
                              dk_out=outs[1][:, kb] if i == 1 else None, dv_out=outs[2][:, kb] if i == 1 else None)
    ref = ref_backward(do, q, k, v, scale, False)
    plain = ref_backward(do, q, k, v, scale, False, dtype=cupy.float32, rnd=_rounder(BF16))
    for name, got, r, p in zip(("dq", "dk", "dv"), outs, ref, plain):
        _check(name, got, p, r, 3)


def test_api_float32_inputs_write_float32_outputs(family):
    """float32 inputs: the outputs are the kernels' float32 accumulators themselves."""
    b, s, hq, hkv, d = 1, 300, 4, 2, 64
    q, k, v, do = (_rand((b, s, h, d), cupy.float32) for h in (hq, hkv, hkv, hq))
    o, lse = burst_hpc.attention(q, k, v, causal=True)
    dq, dk, dv = burst_hpc.attention_backward(do, q, k, v, o, lse, causal=True)
    assert o.dtype == dq.dtype == dk.dtype == np.float32
    ref_o, _, _ = ref_forward(q, k, v, d ** -0.5, True)
    assert _maxerr(o, ref_o) < 2e-2
    for g, r in zip((dq, dk, dv), ref_backward(do, q, k, v, d ** -0.5, True)):
        assert _maxerr(g, r) < 3e-2 * max(1.0, float(cupy.abs(r).max()))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward_one_pair_keys_no_query_sees(d):
    """A first and last pair whose last key block no query sees: its dK, dV outputs are written as zeros; and
    whose first query tiles see no key: their dq rows are zeros."""
    b, sq, sk, h = 1, 300, 300, 2
    q, do = (_rand((b, sq, h, d), BF16) for _ in range(2))
    k, v = (_rand((b, sk, h, d), BF16) for _ in range(2))
    scale, k_start = d ** -0.5, 200
    be = _be()
    o, lse = _poison(q.shape, BF16), _poison((b, h, sq), cupy.float32)
    be.forward_block(q, k, v, None, lse, scale=scale, **plain_mask(True), k_start=k_start, first=True, out=o)
    dq, dk, dv = (_poison(x.shape, BF16) for x in (q, k, v))
    be.backward_block(q, k, v, do, lse, None, None, None, None, scale=scale, **plain_mask(True), k_start=k_start, o=o,
                      first_q=True, first_kv=True, dq_out=dq, dk_out=dk, dv_out=dv)
    ref = ref_backward(do, q, k, v, scale, True, 0, k_start)
    plain = ref_backward(do, q, k, v, scale, True, 0, k_start, dtype=cupy.float32, rnd=_rounder(BF16))
    for name, got, r, p in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, plain):
        _check(name, got, p, r, 3)
    assert bool((dk[:, sq - k_start:].astype(cupy.float32) == 0).all())
    assert bool((dq[:, :k_start].astype(cupy.float32) == 0).all())


@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("vector", [False, True])
def test_delta_paths(d, vector):
    """attn_delta element by element and with 16-byte loads (vector_delta), on strided views too."""
    be = _be()
    do, o = (_rand((2, 300, 6, d), BF16) for _ in range(2))
    views = (do, o), (do[:, 1:], o[:, 1:]), (do[:, :, ::2], o[:, :, ::2])
    old, be.vector_delta = be.vector_delta, vector
    try:
        for a, b in views:
            want = cupy.einsum("bshd,bshd->bhs", a.astype(cupy.float64), b.astype(cupy.float64))
            assert _maxerr(be.delta(a, b), want) < 1e-4 * max(1.0, float(cupy.abs(want).max()))
    finally:
        be.vector_delta = old


@pytest.mark.parametrize("d", [128, 3])
@pytest.mark.parametrize("dtype", [BF16, np.dtype("float16"), np.dtype("float32")], ids=["bf16", "fp16", "f32"])
def test_rows_sum_adds_every_partial_and_converts_once(rng, d, dtype):
    """attn_rows_sum (the packed backward's dK/dV home) against the NumPy backend's rows_sum: rows with no,
    one and several partials, a batch of 2, rows of 8-element vectors and of single ones (Hkv * D = 6)."""
    from burst_hpc.backends.numpy_backend import NumpyBackend

    batch, keys, rows, h = 2, 50, 37, 2
    own = rng.permutation(keys)[:rows].astype(np.int64)
    senders = [rng.choice(rows, size=n, replace=False) for n in (11, 0, 25, 3)]
    blocks = np.cumsum([0] + [len(s) for s in senders])
    flat = np.concatenate(senders).astype(np.int64)
    at = np.concatenate([batch * lo + np.arange(hi - lo) for lo, hi in zip(blocks[:-1], blocks[1:])]).astype(np.int64)
    step = np.repeat(np.diff(blocks), np.diff(blocks)).astype(np.int32)
    order = np.argsort(flat, kind="stable")
    ptr = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=rows))]).astype(np.int32)
    src = rng.standard_normal((batch, keys, h, d)).astype(np.float32)
    parts = rng.standard_normal((batch * blocks[-1], h, d)).astype(np.float32)
    table = own, ptr, at[order], step[order]
    want = np.empty((batch, rows, h, d), np.float64)
    NumpyBackend().rows_sum(src.astype(np.float64), *table, parts.astype(np.float64), want)
    got = cupy.full((batch, rows, h, d), cupy.nan, dtype)
    _be().rows_sum(cupy.asarray(src), *(cupy.asarray(x) for x in table), cupy.asarray(parts), got)
    exact = want.astype(np.float32).astype(dtype).astype(np.float64)   # one rounding, from float32
    tol = 0 if dtype == np.float32 else float(np.abs(want).max()) * 2.0 ** -7
    assert np.abs(cupy.asnumpy(got).astype(np.float64) - exact).max() <= max(tol, 1e-5)
    assert np.ptp(np.diff(ptr)) >= 2   # rows with none and with several partials


@pytest.mark.parametrize("d", [128, 3])
@pytest.mark.parametrize("dtype", [BF16, np.dtype("float16"), np.dtype("float32")], ids=["bf16", "fp16", "f32"])
def test_rows_copy_moves_exactly_the_listed_rows(rng, d, dtype):
    """attn_rows_copy (the packed passes' placing and gathering of rows) against NumPy's fancy indexing: a batch
    of 2, indices on either side, both and neither, 16-byte rows and 6- or 12-byte ones; other rows untouched."""
    from burst_hpc.backends.numpy_backend import NumpyBackend

    batch, n_src, n_dst, h = 2, 40, 57, 2
    src = rng.standard_normal((batch, n_src, h, d)).astype(dtype)
    picks = rng.permutation(n_src)[:23].astype(np.int64)
    places = rng.permutation(n_dst)[:23].astype(np.int64)
    for src_rows, dst_rows, dst_len in ((picks, None, 23), (None, places[:n_src], n_dst), (picks, places, n_dst),
                                        (None, None, n_src)):
        src_rows = None if src_rows is None else src_rows[:len(places) if dst_rows is None else len(dst_rows)]
        start = rng.standard_normal((batch, dst_len, h, d)).astype(dtype)
        want = start.copy()
        NumpyBackend().rows_copy(src, src_rows, want, dst_rows)
        got = cupy.asarray(start)
        _be().rows_copy(cupy.asarray(src), None if src_rows is None else cupy.asarray(src_rows), got,
                        None if dst_rows is None else cupy.asarray(dst_rows))
        assert np.array_equal(cupy.asnumpy(got).view(np.uint8), want.view(np.uint8))
