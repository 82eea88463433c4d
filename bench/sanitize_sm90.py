"""Every sm90 kernel instance (forward and backward, D = 64, 128 and 256, each forward tile height, full,
causal and interval masks, bf16 and fp16) once on small shapes, for compute-sanitizer:

    compute-sanitizer --tool racecheck --error-exitcode 1 python3 bench/sanitize_sm90.py
    compute-sanitizer --tool synccheck --error-exitcode 1 python3 bench/sanitize_sm90.py
    (--forward-only: the forward kernels alone; --backward-only: the backward instances, each once, after
    the forward at one tile height)

The forward runs on 3 CTAs, so each takes several tiles, and runs five times: plain, with its key range
cut in two (key splits), with the cross-tile step switched from its default, with the query heads of a K/V group
packed into its tiles (PackGQA, under the interval mask) switched from its default, and as the block contract's
first and last pair (its 16-bit output from the epilogue). The backward also runs as a first and last pair
(delta and dq's zeros in the pre-pass; dK, dV straight from the registers where one CTA holds the group). The backward runs in both CTA orders (in order, walking up; the host's
heavy-first order: documents heaviest first, walking down, a short causal grid's key blocks in pieces). Shapes: lengths that are not
multiples of the tiles, GQA, two key blocks per CTA walk, a split GQA group (dK/dV atomics) and a causal
offset. The results are checked loosely against a float64 oracle
(the GPU tests check them tightly), so a kernel that the sanitizer slows down or perturbs still has to
compute the right thing.
"""
import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from burst_hpc.plan import masks
from burst_hpc import reference  # noqa: E402
from burst_hpc.backends.cuda import CudaBackend  # noqa: E402


def main():
    forward_only, backward_only = "--forward-only" in sys.argv[1:], "--backward-only" in sys.argv[1:]
    be = CudaBackend.instance(family="sm90")
    default_order, default_down = be.kernels.heavy_first, be.kernels.walk_down_blocks
    be.kernels.max_ctas = 3  # the forward's CTAs take several tiles each: tile boundaries, counter, locks
    rng = np.random.default_rng()
    worst = 0.0
    for dtype in (np.dtype("bfloat16"), np.dtype(np.float16)):
        for d, rows in ((d, rows) for d in be.native_widths("fwd")
                        for rows in be.kernels.tile_heights(d)[:1 if backward_only else None]):
            be.kernels.forced_tile_height = rows
            for mode in ("full", "causal", "interval"):
                causal = mode != "full"
                b, sq, sk, hq, hkv = (1, 900, 1000, 8, 1) if mode == "interval" else (1, 200, 300, 4, 2)
                # interval: documents and a window over the 1000 positions, the queries the last 900: the last
                # document, 840 rows, is a run of forward tiles of its own (plan/tiles.forward_tiles); 8 query
                # heads a K/V head, packed into the forward's tiles (PackGQA)
                window, cu = ((40, 0), np.array([0, 90, 137, 160, 1000])) if mode == "interval" else (None, None)
                mask = masks.make(sk, True, window, cu)
                q, k, v, do = (rng.standard_normal((b, n, h, d)).astype(np.float32)
                               for n, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq)))
                dq_, dk_, dv_ = (cupy.zeros(x.shape, np.float32) for x in (q, k, v))
                dev = [cupy.asarray(x).astype(dtype) for x in (q, k, v, do)]
                o = cupy.zeros((b, sq, hq, d), np.float32)
                lse = cupy.full((b, hq, sq), -np.inf, np.float32)
                scale = d ** -0.5
                q_start = sk - sq if causal else 0  # the last queries see every key
                be.forward_block(*dev[:3], o, lse, scale=scale, masked=causal, q_start=q_start, mask=mask)
                # the same with each query tile's keys cut in two parts (key splits), and with the cross-tile
                # step (16-bit probabilities round differently per part: the results agree to about 1e-3)
                for name, value in (("forced_key_splits", 2), ("cross_tile", not be.kernels.cross_tile),
                                    ("pack_gqa", not be.kernels.pack_gqa)):
                    o2, lse2 = cupy.zeros_like(o), cupy.full_like(lse, -np.inf)
                    default = getattr(be.kernels, name)
                    setattr(be.kernels, name, value)
                    try:
                        be.forward_block(*dev[:3], o2, lse2, scale=scale, masked=causal, q_start=q_start, mask=mask)
                    finally:
                        setattr(be.kernels, name, default)
                    err = float(cupy.abs(o2 - o).max() / max(float(cupy.abs(o).max()), 1e-6))
                    worst = max(worst, err)
                    if not np.isfinite(err) or err > 1e-2:
                        print(f"FAIL {dtype.name} d{d} BM{rows} {mode}: {name} differs by {err:.2e}")
                        return 1
                # the block contract's first and last pair at once: the 16-bit output from the epilogue
                out, lse3 = cupy.empty(q.shape, dtype), cupy.empty_like(lse)
                be.forward_block(*dev[:3], None, lse3, scale=scale, masked=causal, q_start=q_start, mask=mask,
                                 first=True, out=out)
                err = float(cupy.abs(out.astype(np.float32) - o).max() / max(float(cupy.abs(o).max()), 1e-6))
                worst = max(worst, err)
                if not np.isfinite(err) or err > 1e-2:
                    print(f"FAIL {dtype.name} d{d} BM{rows} {mode}: first + out differs by {err:.2e}")
                    return 1
                if forward_only:
                    continue
                delta = be.delta(dev[3], o)
                host = [cupy.asnumpy(x.astype(np.float32)).astype(np.float64) for x in dev]
                kw = dict(causal=causal, scale=scale, q_start=q_start, window=window, cu_seqlens=cu)
                ref_o, _ = reference.attention_reference(*host[:3], **kw)
                grads = reference.attention_backward_reference(host[3], *host[:3], **kw)
                for order in (False, True):   # in order walking up; heavy first walking down (documents)
                    be.kernels.heavy_first = order
                    be.kernels.walk_down_blocks = default_down if order else 0
                    for x in (dq_, dk_, dv_):
                        x.fill(0)
                    be.backward_block(*dev, lse, delta, dq_, dk_, dv_, scale=scale, masked=causal, q_start=q_start,
                                      mask=mask)
                    cupy.cuda.Device().synchronize()
                    for name, got, want in zip(("o", "dq", "dk", "dv"), (o, dq_, dk_, dv_), (ref_o, *grads)):
                        err = float(np.abs(cupy.asnumpy(got) - want).max() / max(np.abs(want).max(), 1e-6))
                        worst = max(worst, err)
                        tag = f"{dtype.name} d{d} BM{rows} {mode} {'heavy first' if order else 'in order'} {name}"
                        print(f"{tag:42s} rel max err {err:.2e}")
                        if not np.isfinite(err) or err > 5e-2:
                            print(f"FAIL {tag}")
                            return 1
                be.kernels.heavy_first, be.kernels.walk_down_blocks = default_order, default_down
                # the first and last pair: delta and dq's zeros in the pre-pass, dK / dV in 16 bits from the
                # registers (one query head per kv head: one CTA holds the group) or converted, dQ converted
                for hq_, hkv_ in ((hq, hkv), (hkv, hkv)):
                    qh, doh = dev[0][:, :, :hq_], dev[3][:, :, :hq_]
                    oh, lseh = out[:, :, :hq_].copy(), lse3[:, :hq_].copy()
                    outs = [cupy.empty(x.shape, dtype) for x in (qh, dev[1], dev[2])]
                    be.backward_block(qh, dev[1], dev[2], doh, lseh, None, None, None, None, scale=scale,
                                      masked=causal, q_start=q_start, mask=mask, o=oh, first_q=True, first_kv=True,
                                      dq_out=outs[0], dk_out=outs[1], dv_out=outs[2])
                    cupy.cuda.Device().synchronize()
                    if hq_ == hq:
                        for name, got, want in zip(("dq", "dk", "dv"), outs, grads):
                            err = float(np.abs(cupy.asnumpy(got.astype(np.float32)) - want).max()
                                        / max(np.abs(want).max(), 1e-6))
                            worst = max(worst, err)
                            if not np.isfinite(err) or err > 5e-2:
                                print(f"FAIL {dtype.name} d{d} {mode} first + last {name}: {err:.2e}")
                                return 1
                    elif not all(bool(cupy.isfinite(x).all()) for x in outs):
                        print(f"FAIL {dtype.name} d{d} {mode} first + last, one head per group: not finite")
                        return 1
    print(f"sanitize_sm90: every instance ran; worst relative error {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
