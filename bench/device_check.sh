#!/usr/bin/env bash
# One command on a one-GPU machine: GPU tests (kernels, masks, head dims; the GPU ring tests with 2 ranks
# sharing the GPU), compute-sanitizer racecheck and synccheck over every sm90 kernel instance, kernel
# benchmark incl. a wide head, the kernel cache's compile-once checks; short summary last. Exits non-zero
# when a test fails or the sanitizer reports anything.
#   bash bench/device_check.sh [--quick]      (logs under $OUT when set, else ./out)
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
LOG=${OUT:-out}; mkdir -p "$LOG"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$LOG/gpu.txt"

# Compiling once (docs/KERNELS.md "Compiling"): the first call of each pass with an empty kernel cache against
# one with a full cache (each in a fresh process, S=16k H=32/8 D=128 bf16 causal), 8 ranks sharing the GPU
# compiling each build once, BURST_HPC_NO_JIT, and `burst-hpc compile` filling a cache ahead. About 2 minutes;
# COMPILE_ONLY=1 runs this section alone.
compile_check() {
  local c1 c8 c0 ok=0
  c1=$(mktemp -d) c8=$(mktemp -d) c0=$(mktemp -d)
  echo "== compile once: cold vs warm kernel cache, one rank (bench/first_call.py)"
  CUPY_CACHE_DIR=$c1 timeout 200 python3 bench/first_call.py --label cold --json "$LOG/first_cold.json" 2>&1 \
    | tee "$LOG/first_call.txt" || ok=1
  CUPY_CACHE_DIR=$c1 timeout 100 python3 bench/first_call.py --label warm --json "$LOG/first_warm.json" \
    --against "$LOG/first_cold.json" 2>&1 | tee -a "$LOG/first_call.txt" || ok=1
  echo "== compile once: 8 ranks sharing this GPU, empty cache, then again (nothing compiled the second time)"
  for label in "8 ranks cold" "8 ranks warm"; do
    CUPY_CACHE_DIR=$c8 timeout 240 mpirun -np 8 -x CUPY_CACHE_DIR -x PYTHONPATH python3 -m mpi4py \
      bench/first_call.py --seqlen 32768 --label "$label" --check-once 2>&1 | tee -a "$LOG/first_call.txt" \
      | grep -E "^first_call|^  " || ok=1
  done
  echo "== BURST_HPC_NO_JIT=1: an empty cache fails at once naming the command; burst-hpc compile fills it"
  if CUPY_CACHE_DIR=$c0 BURST_HPC_NO_JIT=1 timeout 60 python3 bench/first_call.py --label no-jit > "$LOG/no_jit.txt" 2>&1; then
    echo "NO_JIT ran on an empty cache (expected an error)"; ok=1
  fi
  grep -o "BURST_HPC_NO_JIT=1 and the kernel cache.*" "$LOG/no_jit.txt" | head -1
  CUPY_CACHE_DIR=$c0 timeout 200 python3 -m burst_hpc compile --family sm90 --head-dim 128 --dtype bf16 2>&1 \
    | tee -a "$LOG/no_jit.txt" || ok=1
  CUPY_CACHE_DIR=$c0 BURST_HPC_NO_JIT=1 timeout 100 python3 bench/first_call.py --label "no-jit after compile" \
    2>&1 | tee -a "$LOG/no_jit.txt" | grep -E "^first_call|^  " || ok=1
  CUPY_CACHE_DIR=$c0 python3 -m burst_hpc info 2>&1 | grep -A8 "^kernel cache"
  rm -rf "$c1" "$c8" "$c0"
  return $ok
}
if [ "${COMPILE_ONLY:-0}" = 1 ]; then compile_check; exit $?; fi
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
compile_check > "$LOG/compile_check.txt" 2>&1; compiled_ok=$?
grep -E "^first_call|^  |NO_JIT" "$LOG/compile_check.txt"
echo "== the job at S = 131072: honest timings (bench/device_timing.sh), --verify's cost (bench/device_verify.sh)"
timeout 400 bash bench/device_timing.sh > "$LOG/timing.txt" 2>&1; timing_ok=$?
grep -E "^\||of the --warmup|timing check" "$LOG/timing.txt"
timeout 300 bash bench/device_verify.sh > "$LOG/verify.txt" 2>&1
grep -oE "^(cold|warm): exit [0-9]+|verify=[A-Z]+\([^)]*\) [0-9.]+s|seconds: .*total [0-9.]+|burst-hpc verify: [A-Z]+" "$LOG/verify.txt"
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
[ "$sanitized" = 0 ] && [ "$tests_ok" = 1 ] && [ "$random_ok" = 1 ] && [ "$compiled_ok" = 0 ] && [ "$timing_ok" = 0 ]
