"""The tables of docs/RING.md, "Packed documents": each layout's balance from the schedule's own
account (burst_hpc.schedule_work) for documents up to S/4 (MagiAttention's benchmark) and for
long-tailed (lognormal, median 2k tokens) lengths, three seeds each, 8k tokens per rank; and the
cost model's prediction step by step (costmodel.pass_prediction, H100 rates, 8 GPUs a node) in
MagiAttention's setting (bf16, D = 128, Hq = 64, Hkv = 8). No GPU needed.

    python bench/document_tables.py [--ranks 8,16,32,64] [--seeds 3]
"""
import argparse

import numpy as np

import burst_hpc
from burst_hpc.plan import costmodel, masks
from burst_hpc.plan.accounting import visible_pairs
from burst_hpc.plan.rates import GPU_RATES
from burst_hpc.plan.tables import kernel_words
from burst_hpc.plan.layout import make_layout
from burst_hpc.plan.workload import documents

LAYOUTS = ("contiguous", "zigzag", "balanced")
PREDICTED = LAYOUTS + ("chunks", "chunks, flat")   # chunks: the cost model's (by nodes, its chunk); flat: placement.place over one node


def document_set(kind, seqlen, seed):
    rng = np.random.default_rng(seed)
    if kind == "up to S/4":
        return documents(rng, seqlen, "capped", longest=seqlen // 4)
    return documents(rng, seqlen, "lognormal", median=2048)


def balance_table(kind, ranks_list, seeds, causal, tokens):
    lines = [f"\n{kind}, {'causal' if causal else 'not causal'} (mean of {seeds} seeds; busiest: the busiest rank's "
             f"work over the mean; critical path: the busiest rank of every step, summed, over the mean)\n",
             "| ranks | " + " | ".join(f"{layout}: busiest / critical path" for layout in LAYOUTS) + " |",
             "|---|" + "---|" * len(LAYOUTS)]
    for ranks in ranks_list:
        seqlen = tokens * ranks
        cells = []
        for layout in LAYOUTS:
            busiest, critical = [], []
            for seed in range(seeds):
                work = burst_hpc.schedule_work(seqlen, ranks, causal=causal, layout=layout,
                                               cu_seqlens=document_set(kind, seqlen, seed))
                mean = work.sum() / ranks
                busiest.append(work.sum(axis=0).max() / mean)
                critical.append(work.max(axis=1).sum() / mean)
            cells.append(f"{np.mean(busiest):.2f} / {np.mean(critical):.2f}")
        lines.append(f"| {ranks} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# MagiAttention's published figures in this setting (8 x H100 a node; docs/source/blog/cp_benchmark.md and the
# charts under assets/magi_attn/exp/distributed/h100/varlen_causal_mask/): GPUs -> (forward, backward) TFLOP/s per GPU
MAGI_PUBLISHED = {8: (458, 360), 16: (426, 371), 32: (315, 333), 64: (237, 264)}


def prediction_table(ranks_list, tokens, per_node=8, rates_name="H100"):
    rates = GPU_RATES[rates_name]
    lines = [f"\nPredicted, documents up to S/4 (seed 0), causal, bf16, D = 128, Hq = 64, Hkv = 8, {tokens} tokens "
             f"per GPU, {per_node} GPUs a node, {rates_name} rates ({kernel_words(rates)}, "
             f"{rates.intra_gbps:g} GB/s NVLink, {rates.inter_gbps:g} GB/s network, the built-in fixed costs): TFLOP/s "
             f"per GPU over the visible pairs at the slowest rank's pace, forward / backward, each layout with the "
             f"scheme scheme='auto' runs it with; MagiAttention's published figures beside them\n",
             "| GPUs | " + " | ".join(f"{layout}: fwd / bwd (scheme)" for layout in PREDICTED) +
             " | MagiAttention (published) fwd / bwd |",
             "|---|" + "---|" * (len(PREDICTED) + 1)]
    for ranks in ranks_list:
        seqlen = tokens * ranks
        mask = masks.make(seqlen, True, None, document_set("up to S/4", seqlen, 0))
        problem = costmodel.Problem(1, seqlen, 64, 8, 128, 2, mask)
        cluster = costmodel.Cluster(max(1, ranks // per_node), min(ranks, per_node))
        flops = 4.0 * visible_pairs(mask) * 64 * 128 / ranks / 1e12
        cells = []
        by_nodes = costmodel.cluster_layouts(problem, cluster, rates)
        for layout in PREDICTED:
            placed = by_nodes[layout] if layout != "chunks, flat" else make_layout("chunks", seqlen, ranks, mask)
            scheme = costmodel.pick(problem, cluster, rates, placed)
            preds = [costmodel.pass_prediction(scheme, problem, cluster, rates, placed, b) for b in (False, True)]
            cells.append(f"{flops / preds[0].time:.0f} / {flops * 2.5 / preds[1].time:.0f} ({scheme})")
        magi = MAGI_PUBLISHED.get(ranks)
        lines.append(f"| {ranks} | " + " | ".join(cells) + f" | {'%d / %d' % magi if magi else '-'} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="8,16,32,64")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--tokens-per-rank", type=int, default=8192)
    ap.add_argument("--predicted", action="store_true", help="the prediction table alone")
    ap.add_argument("--rates", default="H100", choices=sorted(GPU_RATES), help="built-in rates to predict with")
    args = ap.parse_args(argv)
    ranks = [int(x) for x in args.ranks.split(",")]
    if not args.predicted:
        for kind in ("up to S/4", "lognormal"):
            for causal in (True, False):
                print(balance_table(kind, ranks, args.seeds, causal, args.tokens_per_rank))
    print(prediction_table(ranks, args.tokens_per_rank, rates_name=args.rates))


if __name__ == "__main__":
    main()
