"""Work and traffic of one ring call, per step and rank, read off the schedule (no GPU needed):
visible (query, key) pairs computed, in units of one full chunk pair (n x n tokens), and bytes
received, for the zigzag and balanced layouts (causal), forward and both backward rings.

    python bench/schedule_traffic.py --ranks 4 --tokens-per-rank 32768 --heads 32 --head-dim 128
"""
import argparse

import evidence
from burst_hpc.plan.layout import make_layout
from burst_hpc.plan.schedule import steps, visit_pairs


def token_bytes(heads, kv_heads, dim, itemsize):
    """Bytes per token of each (what, side) a transfer can carry (accumulators are float32)."""
    return {("data", "kv"): 2 * kv_heads * dim * itemsize,
            ("data", "q", "fwd"): heads * dim * itemsize,
            ("data", "q", "bwd"): 2 * heads * dim * itemsize + 8 * heads,    # q, do, lse, delta
            ("partial", "q", "fwd"): heads * dim * 4 + 4 * heads,            # o, lse
            ("partial", "q", "bwd"): heads * dim * 4,                        # dq
            ("partial", "kv", "bwd"): 2 * kv_heads * dim * 4}                # dk, dv


def visible(q_start, nq, k_start, nk):
    """Causally visible (query, key) pairs of a block: row a sees keys k_start..min(a, end)."""
    return sum(max(0, min(nk, a - k_start + 1)) for a in range(q_start, q_start + nq))


def table(layout, size, local, near, returns, sizes, pass_):
    """[(step, [work per rank], [bytes received per rank])]"""
    seqlen = local * size
    placed = make_layout(layout, seqlen, size)
    plans = [steps(placed, True, r, near, returns) for r in range(size)]
    rows = []
    for t in range(len(plans[0])):
        work, received = [], []
        for r in range(size):
            step = plans[r][t]
            done = 0
            for v in step.visits:
                qp, kp = (placed.pieces(x) for x in (v.q_shard, v.kv_shard))
                for p in visit_pairs(qp, kp, True, v.rows):
                    nq, nk = p.q.stop - p.q.start, p.k.stop - p.k.start
                    done += visible(p.q_start, nq, p.k_start, nk) if p.causal else nq * nk
            work.append(done / local ** 2)
            received.append(sum((local if m.rows is None else m.rows[1] - m.rows[0])
                                * (sizes.get((m.what, m.side)) or sizes[m.what, m.side, pass_]) for m in step.recvs))
        rows.append((t, work, received))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    evidence.problem_arguments(ap, dtype=False)
    ap.add_argument("--itemsize", type=int, default=2, help="bytes per element of q, k, v (bf16: 2)")
    args = ap.parse_args()
    sizes = token_bytes(args.heads, args.kv_heads or args.heads, args.head_dim, args.itemsize)
    P, n = args.ranks, args.tokens_per_rank
    print(f"P={P}, {n} tokens per rank, Hq={args.heads}, Hkv={args.kv_heads or args.heads}, D={args.head_dim}, "
          f"{args.itemsize}-byte inputs; work in full chunk pairs (n x n), MB received per rank (min-max)\n")
    print("| pass | layout | step | work per rank (min-max) | MB received per rank (min-max) |\n|---|---|---|---|---|")
    for pass_, near, returns in (("fwd", "kv", ("q",)), ("bwd kv-ring", "kv", ("kv", "q")),
                                 ("bwd q-ring", "q", ("kv", "q"))):
        for layout in ("zigzag", "balanced"):
            total_work, total_mb = 0.0, 0.0
            for t, work, received in table(layout, P, n, near, returns, sizes, pass_[:3]):
                mb = [b / 1e6 for b in received]
                total_work += max(work)
                total_mb += max(mb)
                print(f"| {pass_} | {layout} | {t} | {min(work):.3f}-{max(work):.3f} | {min(mb):.0f}-{max(mb):.0f} |")
            print(f"| {pass_} | {layout} | sum of the busiest | {total_work:.3f} | {total_mb:.0f} |")


if __name__ == "__main__":
    main()
