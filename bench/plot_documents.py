"""A plot of the packed-documents tables (bench/bench_documents.py's JSON rows): TFLOP/s per GPU of each layout,
forward, backward alone and forward+backward, measured (bars) and predicted by the cost model (ticks), one panel
for each (GPUs, tokens per GPU, document distribution), MagiAttention's published 8 x H100 figures at 8k tokens a
GPU beside them (their setting: forward 458, backward 360).

    python3 bench/plot_documents.py bench/data/documents-2026-11-26.jsonl --png docs/plots/documents.png
"""
import argparse
import json
import pathlib

PASSES = ("fwd", "bwd", "fwdbwd")
PUBLISHED = {"fwd": 458, "bwd": 360}   # MagiAttention, 8 x H100, 8k tokens a GPU, documents up to S/4


def read(paths):
    return [json.loads(line) for path in paths for line in pathlib.Path(path).read_text().splitlines()
            if line.startswith("{")]


def panels(rows):
    """{(P, tokens per GPU, dist, device): [rows in their order]}."""
    found = {}
    for row in rows:
        found.setdefault((row["P"], row["tokens"] // row["P"], row["dist"], row["device"]), []).append(row)
    return found


def draw(rows, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = panels(rows)
    fig, axes = plt.subplots(len(found), 1, figsize=(11.5, 3.0 * len(found)), squeeze=False)
    for ax, ((P, per_gpu, dist, device), group) in zip(axes[:, 0], sorted(found.items())):
        width = 0.8 / len(PASSES)
        for i, pass_ in enumerate(PASSES):
            xs = [j + (i - 1) * width for j in range(len(group))]
            ax.bar(xs, [r[f"{pass_}_tflops_per_gpu"] for r in group], width, label=pass_)
            ax.scatter(xs, [r[f"{pass_}_predicted_tflops_per_gpu"] for r in group], marker="_", s=200, color="k",
                       label="predicted" if i == 0 else None, zorder=3)
        if per_gpu == 8192:
            for pass_, value in PUBLISHED.items():
                ax.axhline(value, ls="--", lw=1, color="C0" if pass_ == "fwd" else "C1",
                           label=f"MagiAttention {pass_}, 8 x H100 (published)")
        ax.set_xticks(range(len(group)))
        ax.set_xticklabels([f"{r['layout']}\n({r['scheme']}){' *' if r['default'] else ''}" for r in group])
        ax.set_ylabel("TFLOP/s per GPU")
        ax.set_title(f"{P} x {device}, {per_gpu // 1024}k tokens a GPU, documents: {dist} (* the default layout)",
                     fontsize=10)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    pathlib.Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90, bbox_inches="tight")
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="+", help="files with bench_documents.py's JSON rows (other lines skipped)")
    ap.add_argument("--png", required=True)
    args = ap.parse_args(argv)
    draw(read(args.rows), args.png)


if __name__ == "__main__":
    main()
