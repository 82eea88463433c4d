#!/usr/bin/env bash
# Full multi-GPU ring check in one command on a GPU machine (one rank per GPU). Stages:
#   1. GPU ring tests with the machine's plain MPI (not CUDA-aware: auto must not pick mpi); RING_SKIP_PLAIN=1 skips
#   2. the mpi-transport tests with the CUDA-aware setup of .devcarry (BURST_HPC_CUDA_AWARE=1)
#   3. the ring benchmark at RING_TOKENS tokens per GPU (default 32768), every transport
#   4. when RING_LONG is set: one causal forward+backward at RING_LONG tokens per GPU
# The tables land in $OUT/ring.md and are printed last.
# Usage (from the repo root): bash bench/device_ring.sh [NUM_GPUS]
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OUT=${OUT:-out}; mkdir -p "$OUT"
N=${1:-$(nvidia-smi -L | wc -l)}
status=0
common="-np $N --bind-to none -x PYTHONPATH -x PYTHONUNBUFFERED -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS"
tests="python3 -m mpi4py -m pytest -q -p no:cacheprovider mpi_tests/test_ring_gpu.py"

if [ -z "${RING_SKIP_PLAIN:-}" ]; then
  echo "== 1. GPU ring tests, plain MPI, $N ranks"
  timeout 300 mpirun $common $tests 2>&1 | tee "$OUT/ring_tests_plain.log" | grep -E "passed|failed|Error" | sort | uniq -c || status=1
fi

[ -f .devcarry/env.sh ] || { echo "no .devcarry: CUDA-aware stages skipped"; exit $status; }
source .devcarry/env.sh
export BURST_HPC_CUDA_AWARE=1
aware="$common -x LD_LIBRARY_PATH -x UCX_MODULE_DIR -x UCX_TLS -x BURST_HPC_CUDA_AWARE"

echo "== 2. mpi-transport tests, CUDA-aware MPI (UCX), $N ranks"
timeout 240 mpirun $aware $tests -k "not nccl and not staged" 2>&1 | tee "$OUT/ring_tests_cuda_aware.log" | grep -E "passed|failed|Error" | sort | uniq -c || status=1

echo "== 3. ring benchmark, ${RING_TOKENS:=32768} tokens per GPU"
timeout 300 mpirun $aware python3 -m mpi4py bench/bench_ring.py --out "$OUT/ring.md" --tokens-per-rank "$RING_TOKENS" \
  --causal --transports "${RING_TRANSPORTS:-nccl,mpi,staged}" --single ${RING_BENCH_ARGS:-} > "$OUT/ring_bench.log" 2>&1 || status=1
tail -3 "$OUT/ring_bench.log"

if [ -n "${RING_LONG:-}" ]; then
  echo "== 4. long causal forward+backward, $RING_LONG tokens per GPU"
  timeout 300 mpirun $aware python3 -m mpi4py bench/bench_ring.py --out "$OUT/ring.md" --tokens-per-rank "$RING_LONG" \
    --causal --transports nccl --layouts zigzag --passes fwd,fwdbwd --modes full --iters 1 --warmup 0 \
    > "$OUT/ring_long.log" 2>&1 || status=1
  tail -3 "$OUT/ring_long.log"
fi
cat "$OUT/ring.md" 2>/dev/null
exit $status
