"""Tables and plots of the evidence from the JSON lines the benchmarks emit (bench/evidence.py).

    python3 bench/plot_evidence.py --table all out/*.jsonl            # markdown tables on stdout
    python3 bench/plot_evidence.py --png-dir docs/evidence out/*.jsonl  # PNG files (needs matplotlib)

Tables: time (per method, with the ratio to our ring at the same case), scaling (weak: TFLOP/s per GPU
over the 1-GPU figure; strong: T1 / (P x TP)), bytes (measured against DESIGN.md, q-ring against
kv-ring in the backward), longest (per method), accuracy (max error against the reference, and its
growth over P = 1). Plots: time and TFLOP/s per GPU against tokens, one file per shape; scaling
efficiency against GPUs; error against world size. Lines not starting with "{" are skipped, so logs
with JSON lines in them can be passed as they are.
"""
import argparse
import collections
import json
import pathlib

PASSES = ("fwd", "fwdbwd")
ERRORS = ("err_o", "err_dq", "err_dk", "err_dv")


def read(paths):
    rows = []
    for path in paths:
        for line in pathlib.Path(path).read_text().splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                row.setdefault("kind", "time")
                row.setdefault("method", "burst")
                rows.append(row)
    return rows


def shape(row):
    return f"H={row.get('heads', '?')} Hkv={row.get('kv_heads', row.get('heads', '?'))} D={row.get('head_dim', '?')}"


def case(row):
    """What makes two timing rows comparable: same GPUs, tokens, shape and pass."""
    return row["P"], row["tokens"], shape(row), row["pass"]


def timed_rows(rows):
    """Timing rows that ran, the last of each (method, transport, case) kept."""
    kept = {}
    for row in rows:
        if row["kind"] == "time" and "full" in row and "error" not in row:
            kept[(row["method"], row.get("transport"), row.get("ring")) + case(row)] = row
    return list(kept.values())


def table_time(rows):
    ours = {}  # our ring's time per case: over nccl where it ran over several transports
    for r in sorted(timed_rows(rows), key=lambda r: r.get("transport") == "nccl"):
        if r["method"] == "burst":
            ours[case(r)] = r["full"]
    out = ["| method | GPUs | shape | tokens | tokens/GPU | pass | time (s) | TFLOP/s/GPU | time / ours | peak GiB/rank | bytes/rank |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(timed_rows(rows), key=lambda r: (shape(r), r["P"], r["tokens"], r["pass"], r["method"])):
        ratio = f"{r['full'] / ours[case(r)]:.2f}x" if case(r) in ours else "-"
        method = r["method"] + (f" {r['ring']}-ring" if r["pass"] == "fwdbwd" and "ring" in r else "")
        method += "" if r.get("transport", "nccl") == "nccl" else f" ({r['transport']})"
        sent = f"{r['bytes_sent'] / 2**20:.0f} MiB" if "bytes_sent" in r else "-"
        out.append(f"| {method} | {r['P']} | {shape(r)} | {r['tokens']} | {r['tokens'] // r['P']} | {r['pass']} | "
                   f"{r['full']:.3f} | {r['tflops_per_gpu']:.0f} | {ratio} | {r.get('peak_gib', float('nan')):.1f} | {sent} |")
    failures = sorted({(r["method"], r["P"], r["tokens"], shape(r), r["error"]) for r in rows if "error" in r})
    out += [f"\nDid not run: {m}, {p} GPU(s), {t} tokens, {s}: {e}" for m, p, t, s, e in failures]
    return "\n".join(out)


def scaling(rows):
    """(kind, shape, transport, pass, P, tokens, efficiency) of our ring. Weak: the same tokens per GPU
    as a 1-GPU row; strong: the same tokens in all. A 1-GPU row is listed (100%) where it is the base."""
    ring = [r for r in timed_rows(rows) if r["method"] == "burst"]
    bases = {(b["tokens"], shape(b), b["pass"]): b for b in ring if b["P"] == 1}
    weak_sizes = {(r["tokens"] // r["P"], shape(r), r["pass"]) for r in ring if r["P"] > 1}
    strong_sizes = {(r["tokens"], shape(r), r["pass"]) for r in ring if r["P"] > 1}
    result = []
    for r in ring:
        per_gpu, in_all = (r["tokens"] // r["P"], shape(r), r["pass"]), (r["tokens"], shape(r), r["pass"])
        where = (shape(r), r["transport"], r["pass"], r["P"], r["tokens"])
        if per_gpu in bases and per_gpu in weak_sizes:
            result.append(("weak",) + where + (r["tflops_per_gpu"] / bases[per_gpu]["tflops_per_gpu"],))
        if in_all in bases and in_all in strong_sizes:
            result.append(("strong",) + where + (bases[in_all]["full"] / (r["P"] * r["full"]),))
    return sorted(result)


def table_scaling(rows):
    out = ["| scaling | shape | transport | pass | GPUs | tokens in all | efficiency |", "|---|---|---|---|---|---|---|"]
    out += [f"| {k} | {s} | {t} | {p} | {n} | {tokens} | {eff:.1%} |" for k, s, t, p, n, tokens, eff in scaling(rows)]
    return "\n".join(out)


def table_bytes(rows):
    """Per (shape, P, tokens): forward bytes, backward bytes of each ring (fwdbwd - fwd), DESIGN.md's."""
    sent = {}
    for r in rows:
        if r["method"] == "burst" and "bytes_sent" in r and "bytes_design" in r:
            sent[(shape(r), r["P"], r["tokens"], r["pass"], r["ring"])] = (r["bytes_sent"], r["bytes_design"])
    out = ["| shape | GPUs | tokens/GPU | ring | backward bytes/rank (measured) | DESIGN.md (P-1 steps) | measured / DESIGN | "
           "q-ring / kv-ring |", "|---|---|---|---|---|---|---|---|"]
    for (s, p, tokens, pass_, ring), (total, design) in sorted(sent.items()):
        fwd = sent.get((s, p, tokens, "fwd", "kv"))
        if pass_ != "fwdbwd" or fwd is None:
            continue
        bwd, bwd_design = total - fwd[0], design - fwd[1]
        other = sent.get((s, p, tokens, "fwdbwd", "kv" if ring == "q" else "q"))
        q_over_kv = "-"
        if other is not None:
            other_bwd = other[0] - fwd[0]
            q_bwd, kv_bwd = (bwd, other_bwd) if ring == "q" else (other_bwd, bwd)
            q_over_kv = f"{q_bwd / kv_bwd:.3f}" if kv_bwd else "-"
        ratio = f"{bwd / bwd_design:.3f}" if bwd_design else "-"
        out.append(f"| {s} | {p} | {tokens // p} | {ring} | {bwd / 2**20:.1f} MiB | {bwd_design / 2**20:.1f} MiB | {ratio} | {q_over_kv} |")
    return "\n".join(out)


def table_longest(rows):
    out = ["| method | GPUs | shape | longest that ran: tokens in all (per GPU) | time (s) | peak GiB/rank | first that did not |",
           "|---|---|---|---|---|---|---|"]
    groups = collections.defaultdict(list)
    for r in rows:
        if r["kind"] == "time" and r["pass"] == "fwdbwd":
            groups[(r["method"], r["P"], shape(r))].append(r)
    for (method, p, s), group in sorted(groups.items()):
        ran = [r for r in group if "error" not in r]
        failed = [r for r in group if "error" in r]
        best = max(ran, key=lambda r: r["tokens"], default=None)
        first_fail = min(failed, key=lambda r: r["tokens"], default=None)
        cell = f"{best['tokens']} ({best['tokens'] // p})" if best else "none"
        timing = f"{best['full']:.2f} | {best.get('peak_gib', float('nan')):.1f}" if best else "- | -"
        fail = f"{first_fail['tokens']}: {first_fail['error'][:60]}" if first_fail else "-"
        out.append(f"| {method} | {p} | {s} | {cell} | {timing} | {fail} |")
    return "\n".join(out)


def accuracy_rows(rows):
    kept = {}
    for r in rows:
        if r["kind"] == "accuracy":
            kept[(r["method"], r["P"], r["tokens"], shape(r))] = r
    return [kept[key] for key in sorted(kept)]


def table_accuracy(rows):
    acc = accuracy_rows(rows)
    first = {(r["method"], r["tokens"], shape(r)): r for r in acc if r["P"] == 1 and "error" not in r}
    out = ["| method | GPUs | tokens | shape | max error o | dq | dk | dv | worst of the four vs P=1 |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in acc:
        if "error" in r:
            out.append(f"| {r['method']} | {r['P']} | {r['tokens']} | {shape(r)} | {r['error'][:80]} | | | | |")
            continue
        base = first.get((r["method"], r["tokens"], shape(r)))
        growth = f"{max((r[e] / base[e] for e in ERRORS if base[e]), default=float('nan')):.2f}x" if base else "-"
        out.append(f"| {r['method']} | {r['P']} | {r['tokens']} | {shape(r)} | " +
                   " | ".join(f"{r[e]:.2e}" for e in ERRORS) + f" | {growth} |")
    return "\n".join(out)


TABLES = {"time": table_time, "scaling": table_scaling, "bytes": table_bytes, "longest": table_longest,
          "accuracy": table_accuracy}
# what each part of bench/device_evidence.sh prints last
PART_TABLES = {"peer": ["time"], "baselines": ["time"], "memory": ["time"], "scaling": ["time", "scaling"],
               "bytes": ["bytes"], "longest": ["longest", "time"], "accuracy": ["accuracy"], "all": list(TABLES)}


def plot(rows, png_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullLocator

    def gpu_axis(ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        ax.xaxis.set_minor_locator(NullLocator())

    png_dir = pathlib.Path(png_dir)
    png_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(png_dir / name, dpi=110)
        plt.close(fig)
        written.append(png_dir / name)

    timed = timed_rows(rows)
    for s in sorted({shape(r) for r in timed}):
        fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
        for col, pass_ in enumerate(PASSES):
            lines = collections.defaultdict(list)
            for r in timed:
                if shape(r) == s and r["pass"] == pass_:
                    lines[(r["method"], r.get("transport", "nccl"), r["P"], r.get("ring", "") if pass_ == "fwdbwd" else "")].append(r)
            for (method, transport, p, ring), line in sorted(lines.items()):
                line.sort(key=lambda r: r["tokens"])
                label = f"{method}{' ' + ring + '-ring' if ring else ''}{'' if transport == 'nccl' else ' ' + transport}, {p} GPU"
                tokens = [r["tokens"] for r in line]
                axes[0][col].plot(tokens, [r["full"] for r in line], marker="o", label=label)
                axes[1][col].plot(tokens, [r["tflops_per_gpu"] for r in line], marker="o", label=label)
            axes[0][col].set(title=f"{pass_}, {s}", ylabel="time per call (s)", yscale="log")
            axes[1][col].set(xlabel="tokens in all", ylabel="TFLOP/s per GPU", ylim=(0, None))
            axes[0][col].legend(fontsize=7)
            for ax in axes[:, col]:
                ax.set_xscale("log", base=2)
                ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1024:g}k"))
                ax.xaxis.set_minor_locator(NullLocator())
        save(fig, f"time_{s.replace('=', '').replace(' ', '_')}.png")

    eff = scaling(rows)
    if eff:
        fig, ax = plt.subplots(figsize=(7, 5))
        lines = collections.defaultdict(list)
        for kind, s, transport, pass_, p, _, value in eff:
            lines[(kind, s, transport, pass_)].append((p, value))
        for (kind, s, transport, pass_), points in sorted(lines.items()):
            points.sort()
            ax.plot([p for p, _ in points], [v * 100 for _, v in points], marker="o",
                    label=f"{kind} {pass_} {s} {transport}")
        ax.axhline(95, color="grey", linestyle=":")
        ax.set(xlabel="GPUs", ylabel="scaling efficiency (%)", title="our ring: weak and strong scaling")
        gpu_axis(ax)
        ax.legend(fontsize=6)
        save(fig, "scaling_efficiency.png")

    acc = [r for r in accuracy_rows(rows) if "error" not in r]
    if acc:
        fig, axes = plt.subplots(1, 4, figsize=(15, 4), sharey=True)
        for ax, key in zip(axes, ERRORS):
            lines = collections.defaultdict(list)
            for r in acc:
                lines[(r["method"], shape(r))].append(r)
            for (method, s), line in sorted(lines.items()):
                line.sort(key=lambda r: r["P"])
                ax.plot([r["P"] for r in line], [r[key] for r in line], marker="o", label=f"{method} {s}")
            ax.set(title=key.replace("err_", "max error of "), xlabel="world size P", yscale="log")
            gpu_axis(ax)
        axes[0].set_ylabel("max |x - float64 reference|")
        axes[0].legend(fontsize=7)
        save(fig, "accuracy_vs_world_size.png")
    return written


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="JSON lines (or logs holding them)")
    ap.add_argument("--table", choices=sorted(PART_TABLES), help="print the tables of this part (or all)")
    ap.add_argument("--png-dir", help="write the PNG plots here")
    args = ap.parse_args(argv)
    rows = read(args.files)
    for name in PART_TABLES.get(args.table, []):
        print(f"\n{TABLES[name](rows)}")
    if args.png_dir:
        for path in plot(rows, args.png_dir):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
