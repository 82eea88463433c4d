#!/usr/bin/env bash
# Scaling on one multi-GPU machine: the ring benchmark on 1, 2, 4 (, 8) GPUs, causal bf16,
# H=32, D=128: weak scaling at SCALE_WEAK tokens per GPU and strong scaling at SCALE_STRONG
# tokens in all. Tables land in $OUT/scaling.md.
# Usage (from the repo root, .devcarry carried): bash bench/device_scaling.sh "1 2 4"
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; mkdir -p "$OUT"
source .devcarry/env.sh
export BURST_HPC_CUDA_AWARE=1
GPUS=${1:-"1 2 4"}
WEAK=${SCALE_WEAK:-32768}
STRONG=${SCALE_STRONG:-262144}
status=0
for n in $GPUS; do
  transports=${SCALE_TRANSPORTS:-nccl,mpi}
  [ "$n" = 1 ] && transports=nccl   # one rank: nothing travels
  for tokens in "$WEAK" $((STRONG / n)); do
    echo "== $n GPU(s), $tokens tokens per GPU"
    timeout 400 mpirun -np "$n" --bind-to none -x PYTHONPATH -x PYTHONUNBUFFERED -x NCCL_NVLS_ENABLE \
      -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x LD_LIBRARY_PATH -x UCX_MODULE_DIR -x UCX_TLS \
      -x BURST_HPC_CUDA_AWARE python3 -m mpi4py bench/bench_ring.py --out "$OUT/scaling.md" --tokens-per-rank "$tokens" \
      --causal --layouts zigzag --transports "$transports" --modes full --iters 2 --warmup 1 \
      >> "$OUT/scaling.log" 2>&1 || { status=1; tail -5 "$OUT/scaling.log"; }
  done
done
python3 bench/scaling_table.py "$WEAK" "$STRONG" < "$OUT/scaling.log" | tee "$OUT/scaling_summary.md"
exit $status
