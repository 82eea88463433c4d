"""Scaling table from bench_ring.py JSON lines on stdin.

    python bench/scaling_table.py WEAK_TOKENS_PER_GPU STRONG_TOKENS_IN_ALL < scaling.log

weak: the same tokens per GPU; efficiency = TFLOP/s per GPU at P / at 1 GPU.
strong: the same tokens in all; efficiency = T(1 GPU) / (P * T(P GPUs))."""
import json
import sys


def main():
    weak, strong = int(sys.argv[1]), int(sys.argv[2])
    rows = [json.loads(line) for line in sys.stdin if line.startswith("{")]
    print("| scaling | pass | GPUs | transport | tokens in all | tokens/GPU | time (s) | TFLOP/s/GPU | efficiency | peak GiB/rank |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for pass_ in ("fwd", "fwdbwd"):
        for kind in ("weak", "strong"):
            group = [r for r in rows if r["pass"] == pass_ and
                     (r["tokens"] // r["P"] == weak if kind == "weak" else r["tokens"] == strong)]
            base = next((r for r in group if r["P"] == 1), None)
            for r in sorted(group, key=lambda r: (r["P"], r["transport"])):
                if base is None:
                    eff = "-"
                elif kind == "weak":
                    eff = format(r["tflops_per_gpu"] / base["tflops_per_gpu"], ".1%")
                else:
                    eff = format(base["full"] / (r["P"] * r["full"]), ".1%")
                print(f"| {kind} | {pass_} | {r['P']} | {r['transport']} | {r['tokens']} | {r['tokens'] // r['P']} | "
                      f"{r['full']:.3f} | {r['tflops_per_gpu']:.0f} | {eff} | {r['peak_gib']:.1f} |")


if __name__ == "__main__":
    main()
