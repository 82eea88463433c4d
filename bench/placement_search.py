"""How much the cost model thinks a better placement of the chunks could gain: a random local search over swaps of
two chunks between ranks, each candidate priced by costmodel.pass_prediction (forward + backward, the gather
scheme's packed passes on one node), from the placement the chunks layout makes (placement.place, the model's
chunk: costmodel.cluster_layouts). bench_documents.py's document sets (seed 0, documents up to S/4), bf16, Hq 64,
Hkv 8, D 128, the built-in rates of --gpu; no GPU needed.

    python3 bench/placement_search.py [--dist magi] [--ranks 4] [--tokens-per-rank 8192] [--rounds 40]
                                      [--save found.json]

Prints the predicted TFLOP/s per GPU (forward, backward, forward+backward) of the start and of each better
placement found, then each rank's visible pairs, the share of them its early rows hold (packing.Packing.early)
and the key rows it receives and sends, for both placements; --save writes the one found (JSON: dist, ranks,
tokens a GPU, chunk, each rank's chunk indices) for a run on GPUs to place by. A search, not a solver: each round
prices CANDIDATES random swaps and keeps the best if it is faster; the layout's own placement balances each rank's
area and the keys it receives by a rule.
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from burst_hpc.plan import costmodel, masks  # noqa: E402
from burst_hpc.plan.accounting import visible_pairs  # noqa: E402
from burst_hpc.plan.layout import Layout  # noqa: E402
from burst_hpc.plan.packing import packing  # noqa: E402
from burst_hpc.plan.placement import Placement  # noqa: E402
from burst_hpc.plan.rates import GPU_RATES  # noqa: E402

import bench_documents  # noqa: E402

CANDIDATES = 25   # swaps priced a round


def layout_of(owned, seqlen, chunk):
    """The chunks Layout of ``owned`` (each rank's chunk indices)."""
    placed = Placement(chunk, tuple(tuple(sorted(c)) for c in owned), (0,) * len(owned), (0,) * len(owned))
    return Layout("chunks", seqlen, len(owned), tuple(placed.pieces(r) for r in range(len(owned))), chunk=chunk)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dist", default="magi", choices=("uniform", "magi"))
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tokens-per-rank", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--gpu", default="H200")
    ap.add_argument("--seed", type=int, default=0, help="the search's random swaps")
    ap.add_argument("--save", default=None, help="write the placement found here (JSON)")
    args = ap.parse_args(argv)
    rates, size = GPU_RATES[args.gpu], args.ranks
    seqlen = size * args.tokens_per_rank
    mask = masks.make(seqlen, True, None, bench_documents.document_set(args.dist, seqlen, 0, seqlen // 4))
    problem = costmodel.Problem(1, seqlen, 64, 8, 128, 2, mask)
    cluster = costmodel.Cluster(1, size)
    placed = costmodel.cluster_layouts(problem, cluster, rates, ("chunks",))["chunks"]
    chunk = placed.chunk
    owned = [[a // chunk + i for a, n in placed.runs[r] for i in range(n // chunk)] for r in range(size)]
    tflop = 4.0 * visible_pairs(mask) * 64 * 128 / size / 1e12

    def priced(owned):
        layout = layout_of(owned, seqlen, chunk)
        return tuple(costmodel.pass_prediction("gather", problem, cluster, rates, layout, b).time for b in (False, True))

    def rates_of(fwd, bwd):
        return f"{tflop / fwd:.0f} / {2.5 * tflop / bwd:.0f} / {3.5 * tflop / (fwd + bwd):.0f}"

    print(f"{args.dist} lengths, {size} GPUs, {args.tokens_per_rank} tokens a GPU, chunk {chunk}: predicted TFLOP/s "
          "per GPU forward / backward / forward+backward")
    best = priced(owned)
    print(f"start: {rates_of(*best)}")
    start, rng = owned, np.random.default_rng(args.seed)
    for round_ in range(args.rounds):
        tried = []
        for _ in range(CANDIDATES):
            a, b = rng.choice(size, 2, replace=False)
            i, j = rng.integers(len(owned[a])), rng.integers(len(owned[b]))
            swapped = [list(x) for x in owned]
            swapped[a][i], swapped[b][j] = owned[b][j], owned[a][i]
            tried.append((priced(swapped), swapped))
        seconds, swapped = min(tried, key=lambda x: sum(x[0]))
        if sum(seconds) < sum(best):
            owned, best = swapped, seconds
            print(f"round {round_}: {rates_of(*best)}", flush=True)
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"dist": args.dist, "ranks": size, "tokens_per_rank": args.tokens_per_rank, "chunk": chunk,
                       "owned": [sorted(int(c) for c in chunks) for chunks in owned]}, f)
    for name, chunks in (("start", start), ("found", owned)):
        layout = layout_of(chunks, seqlen, chunk)
        print(name)
        for r in range(size):
            p = packing(mask, layout, r)
            early = sum(int(p.pairs[b] - p.pairs[a]) for a, b in p.split(len(p.lo))[0])
            print(f"  rank {r}: visible pairs {p.pairs[-1] / 1e6:.1f}M, early {early / max(p.pairs[-1], 1):.2f}, "
                  f"receives {sum(len(s) for _, s in p.receives)} rows, sends {sum(len(s) for _, s in p.sends)}")


if __name__ == "__main__":
    sys.exit(main())
