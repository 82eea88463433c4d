#!/usr/bin/env bash
# Full multi-GPU ring check in one command on a GPU machine (one rank per GPU):
#   1. GPU ring tests with the machine's plain MPI (not CUDA-aware: auto must not pick mpi)
#   2. the same with the CUDA-aware setup of .devcarry (transport mpi enabled)
#   3. the ring benchmark (RING_BENCH_ARGS), table appended to $OUT/ring.md
# Usage (from the repo root): bash bench/device_ring.sh [NUM_GPUS]
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OUT=${OUT:-out}; mkdir -p "$OUT"
N=${1:-$(nvidia-smi -L | wc -l)}
status=0
common="-np $N --bind-to none -x PYTHONPATH -x PYTHONUNBUFFERED -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS"

echo "== GPU ring tests, plain MPI, $N ranks"
timeout 600 mpirun $common python3 -m mpi4py -m pytest -q -p no:cacheprovider mpi_tests/test_ring_gpu.py 2>&1 \
  | tee "$OUT/ring_tests_plain.log" | tail -4 || status=1

if [ -f .devcarry/env.sh ]; then
  (
    source .devcarry/env.sh
    export BURST_HPC_CUDA_AWARE=1
    echo "== GPU ring tests, CUDA-aware MPI (UCX), $N ranks"
    timeout 600 mpirun $common -x LD_LIBRARY_PATH -x UCX_MODULE_DIR -x UCX_TLS -x BURST_HPC_CUDA_AWARE \
      python3 -m mpi4py -m pytest -q -p no:cacheprovider mpi_tests/test_ring_gpu.py 2>&1 \
      | tee "$OUT/ring_tests_cuda_aware.log" | tail -4
    echo "== ring benchmark: ${RING_BENCH_ARGS:-}"
    timeout 900 mpirun $common -x LD_LIBRARY_PATH -x UCX_MODULE_DIR -x UCX_TLS -x BURST_HPC_CUDA_AWARE \
      python3 -m mpi4py bench/bench_ring.py --out "$OUT/ring.md" ${RING_BENCH_ARGS:-} 2>&1 | tee "$OUT/ring_bench.log" | grep -v '^{'
  ) || status=1
fi
exit $status
