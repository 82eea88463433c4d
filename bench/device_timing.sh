#!/usr/bin/env bash
# Honest timings on one GPU (issue 25): `burst-hpc run` at S=131072 Hq=32 Hkv=8 D=128 bf16, causal, forward
# and backward, three times: with an empty kernel cache, then warm without --warmup, then with --warmup.
# Each writes its report (--json); the check: without --warmup (cold cache or warm) the forward and backward
# TFLOP/s are within 5% of the --warmup run's (the set-up, timed apart, holds the first-use costs, compiles
# included). Exits 1 when they are not.
#   bash bench/device_timing.sh [SEQLEN]      (reports under $OUT when set, else ./out)
set -eu -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
LOG=${OUT:-out}; mkdir -p "$LOG"
S=${1:-131072}
echo "== pytest tests/test_report_gpu.py (the rehearsal loads every module the passes use; the meter's events)"
tests_ok=1
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_report_gpu.py 2>&1 | tee "$LOG/timing_pytest.txt" \
  | tail -3 || tests_ok=0
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export CUPY_CACHE_DIR=$WORK/cache   # empty: the first run compiles what it needs
python3 -m burst_hpc gen "$WORK/in.h5" --seqlen "$S" --heads 32 --kv-heads 8 --head-dim 128 --dtype bf16 \
  --with-grad --quiet
for run in cold nowarmup warmup; do
  flags=(); [ "$run" = warmup ] && flags=(--warmup)
  echo "== $run"
  python3 -m burst_hpc run "$WORK/in.h5" "$WORK/out.h5" --causal --backward --backend cuda --overwrite \
    --json "$LOG/timing_$run.json" "${flags[@]}" --progress 2>&1 | tee "$LOG/timing_$run.txt"
done
rm -f "$WORK/out.h5"
timing_ok=1
python3 - "$LOG" <<'PY' || timing_ok=0
import json, sys
log = sys.argv[1]
runs = {name: json.load(open(f"{log}/timing_{name}.json")) for name in ("cold", "nowarmup", "warmup")}
phases = ("read", "setup", "forward", "backward", "write", "verify", "total")
print("| run | " + " | ".join(phases) + " | fwd TFLOP/s | bwd TFLOP/s |")
print("|---" * (len(phases) + 3) + "|")
for name, r in runs.items():
    cells = ["-" if r["seconds"][p] is None else f"{r['seconds'][p]:.3f}" for p in phases]
    print(f"| {name} | " + " | ".join(cells) + f" | {r['tflops']['forward']:.1f} | {r['tflops']['backward']:.1f} |")
print(f"device: {runs['warmup']['device']}; versions: {runs['warmup']['versions']}")
ok = True
for name in ("cold", "nowarmup"):
    for p in ("forward", "backward"):
        ratio = runs[name]["tflops"][p] / runs["warmup"]["tflops"][p]
        print(f"{name} {p}: {ratio:.3f} of the --warmup run's TFLOP/s")
        ok &= ratio >= 0.95
print("timing check:", "PASS" if ok else "FAIL (a pass without --warmup is more than 5% slower)")
sys.exit(0 if ok else 1)
PY
[ "$tests_ok" = 1 ] && [ "$timing_ok" = 1 ]
