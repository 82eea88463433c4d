#!/usr/bin/env bash
# One command on a one-GPU machine: GPU tests (kernels, masks, head dims; the GPU ring tests with 2 ranks
# sharing the GPU), compute-sanitizer racecheck and synccheck over every sm90 kernel instance, kernel
# benchmark incl. a wide head; short summary last. Exits non-zero when a test fails or the sanitizer
# reports anything.
#   bash bench/device_check.sh [--quick]      (logs under $OUT when set, else ./out)
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
LOG=${OUT:-out}; mkdir -p "$LOG"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$LOG/gpu.txt"
echo "== pytest (kernels, masks, head dims; every kernel family this GPU runs)"
timeout 330 python3 -m pytest -q --maxfail=8 --timeout 300 -p no:cacheprovider \
  tests/test_cuda_kernels.py tests/test_cuda_masks.py tests/test_cuda_padding.py tests/test_cuda_nonfinite.py \
  tests/test_verify.py 2>&1 | tee "$LOG/pytest.txt" | tail -15
echo "== GPU ring tests, 2 ranks on this GPU (transports that share a GPU)"
timeout 150 mpirun -np 2 python3 -m mpi4py -m pytest -q -p no:cacheprovider mpi_tests/test_ring_gpu.py \
  mpi_tests/test_baselines_gpu.py 2>&1 | tee "$LOG/ring.txt" | grep -E "passed|failed|error" | tail -4
echo "== randomized differential check on the GPU (mpi_tests/randomized.py: ranks sharing the GPU, bf16/fp16)"
random_ok=1
for spec in "1 bfloat16 0" "2 bfloat16 1000" "3 float16 2000" "4 bfloat16 3000"; do
  set -- $spec
  timeout 400 mpirun -np $1 python3 -m mpi4py mpi_tests/randomized.py --backend cuda --dtype $2 --seed $3 \
    --count ${RANDOM_CASES:-60} > "$LOG/random_$1.txt" 2>&1 || random_ok=0
  grep -aE "^randomized:|^FAIL|^     " "$LOG/random_$1.txt" | tail -6
done
echo "== compute-sanitizer: every sm90 instance on small shapes (bench/sanitize_sm90.py)"
sanitized=0
for tool in racecheck synccheck; do
  timeout 240 compute-sanitizer --tool $tool --error-exitcode 1 --show-backtrace no \
    python3 bench/sanitize_sm90.py > "$LOG/$tool.txt" 2>&1 || sanitized=1
  grep -E "SUMMARY|sanitize_sm90:" "$LOG/$tool.txt" | sed "s/^/$tool: /"
done
echo "== bench"
timeout 260 python3 bench/bench_kernels.py --md "$LOG/bench.md" ${1:-} 2>&1 | tee "$LOG/bench.txt" | grep -v '^|'
timeout 60 python3 bench/bench_kernels.py --dims 256 --seqs 4096 --reps 3 --md "$LOG/bench_wide.md" > "$LOG/bench_wide.txt" 2>&1
echo "== summary"
grep -E "passed|failed|error" "$LOG/pytest.txt" | tail -1
grep -E "passed|failed|error" "$LOG/ring.txt" | tail -2
grep -ahE "^randomized:" "$LOG"/random_*.txt
grep -hE "SUMMARY" "$LOG/racecheck.txt" "$LOG/synccheck.txt"
cat "$LOG/bench.md" "$LOG/bench_wide.md" 2>/dev/null
tests_ok=$(grep -cE "[0-9]+ failed|[0-9]+ error" "$LOG/pytest.txt" "$LOG/ring.txt" | awk -F: '{n += $2} END {print n == 0}')
[ "$sanitized" = 0 ] && [ "$tests_ok" = 1 ] && [ "$random_ok" = 1 ]
