#!/usr/bin/env bash
# One command on a GPU machine: compile report, GPU tests, kernel benchmark; short table last.
#   bash bench/device_check.sh [--quick]      (logs under $OUT when set, else ./out)
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
LOG=${OUT:-out}; mkdir -p "$LOG"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$LOG/gpu.txt"
echo "== nvcc resource report"
# sm90 sources: the arch-specific target (nvcc 13's plain -arch=sm_90a emits no sm_90a code)
for f in cuda/*.cu; do
  case "$f" in *sm90*) arch=-gencode=arch=compute_90a,code=sm_90a ;; *) arch=-arch=sm_90 ;; esac
  nvcc $arch -std=c++17 -Xptxas -v -c "$f" -o /dev/null 2>&1
done \
  | grep -E "Function properties|registers|spill" > "$LOG/ptxas.txt"; grep -c spill "$LOG/ptxas.txt" >/dev/null
echo "== pytest"
timeout 420 python3 -m pytest -q --maxfail=8 --timeout 300 -p no:cacheprovider tests/test_cuda_kernels.py 2>&1 | tee "$LOG/pytest.txt" | tail -30
echo "== bench"
timeout 300 python3 bench/bench_kernels.py --md "$LOG/bench.md" ${1:-} 2>&1 | tee "$LOG/bench.txt" | grep -v '^|' 
echo "== summary"
grep -E "passed|failed|error" "$LOG/pytest.txt" | tail -1
cat "$LOG/bench.md" 2>/dev/null
