#!/usr/bin/env bash
# The evidence of issue 12 on a GPU machine, one part per call, each printing its summary table last.
# JSON lines land in $OUT/evidence_<part>_<GPUs>.jsonl (bench/evidence.py says what they hold); logs
# beside them. Re-draw the plots from any set of them: python3 bench/plot_evidence.py $OUT/*.jsonl
#
#   bash bench/device_evidence.sh PART [GPUS] [METHOD]
#
# GPUS: ranks to use (default: every GPU of the machine). Parts:
#   tests      the baselines on the GPU against the float64 oracle (mpi_tests/test_baselines_gpu.py)
#   accuracy   ours, the baselines and torch CP: max error of o, dq, dk, dv against the float64 reference
#              on one seeded input (ACC_TOKENS=16384 in all, bf16, causal, GQA 32/8); run it for each P
#   peer       ours against torch CP (cuDNN, flash), PEER_TOKENS per GPU, MHA and GQA at D=128, MHA at D=64
#   baselines  ours against untiled RingAttention, all-gather K/V and Ulysses, BASE_TOKENS per GPU
#   scaling    our ring at GPUS ranks: weak (SCALE_WEAK=32768 per GPU) and strong (SCALE_STRONG=262144
#              in all), SCALE_SHAPES (H:Hkv:D), nccl (+ CUDA-aware mpi when .devcarry is carried)
#   bytes      bytes sent per rank per call, q-ring and kv-ring, MHA and GQA, against DESIGN.md
#   memory     peak memory per rank of every method at MEM_TOKENS per GPU (forward+backward)
#   longest    the longest causal forward+backward of METHOD (default: all, one after another),
#              doubling tokens per GPU from LONG_START=65536 to LONG_MAX=524288 until it fails
#   layouts    causal layouts of our ring at LAYOUT_TOKENS=32768 per GPU: balanced, zigzag, contiguous and
#              all-to-all around zigzag, full and compute-only, with the one-GPU time (--single) for 1/P
#   masks      packed documents (MASK_TOKENS=262144 in all from MASK_DOCS=64 documents) against dense
#              causal and the documents' own work, and a WINDOW=4096 causal window at 32768 per GPU
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUPY_TF32=1  # the untiled baseline multiplies in float32: on tensor cores (TF32)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OUT=${OUT:-out}; mkdir -p "$OUT"
PART=${1:?usage: device_evidence.sh PART [GPUS] [METHOD]}
N=${2:-$(nvidia-smi -L | wc -l)}
NAME="evidence_${PART}_${N}${3:+_$3}"  # a longest run of one METHOD keeps its own file
JSON="$OUT/$NAME.jsonl"; LOG="$OUT/$NAME.log"
: > "$JSON"
status=0
envs="-x PYTHONPATH -x PYTHONUNBUFFERED -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x CUPY_TF32"
transports=nccl
if [ -f .devcarry/env.sh ]; then  # CUDA-aware MPI for our ring's mpi transport (docs/BENCHMARKS.md)
  source .devcarry/env.sh
  export BURST_HPC_CUDA_AWARE=1
  envs="$envs -x LD_LIBRARY_PATH -x UCX_MODULE_DIR -x UCX_TLS -x BURST_HPC_CUDA_AWARE"
  [ "$N" -gt 1 ] && transports=nccl,mpi
fi

failed() {  # after a command failed or timed out (rc 124): say so, keep going
  local rc=$?; status=1; echo "$1: failed (rc $rc)"; tail -3 "$LOG.part" 2>/dev/null || tail -3 "$LOG"
}
ours() {  # ours and the baselines: bench/bench_baselines.py ARGS, with a time limit
  local limit=$1; shift
  timeout "$limit" mpirun -np "$N" --bind-to none $envs python3 -m mpi4py bench/bench_baselines.py --out "$JSON" "$@" \
    >> "$LOG" 2>&1 || failed "bench_baselines $*"
}
peer() {  # torch CP: bench/peer_torch_cp.py ARGS (its own process group over NCCL; MPI only launches it)
  local limit=$1; shift
  MASTER_PORT=$((29500 + RANDOM % 400)) timeout "$limit" mpirun -np "$N" --bind-to none $envs -x MASTER_PORT \
    python3 bench/peer_torch_cp.py --out "$JSON" "$@" >> "$LOG" 2>&1 || failed "peer_torch_cp $*"
}
ring() {  # our ring alone: bench/bench_ring.py ARGS; its JSON lines go to $JSON
  local limit=$1; shift
  timeout "$limit" mpirun -np "$N" --bind-to none $envs python3 -m mpi4py bench/bench_ring.py --causal --layouts zigzag "$@" \
    > "$LOG.part" 2>&1 || failed "bench_ring $*"
  cat "$LOG.part" >> "$LOG"; grep '^{' "$LOG.part" >> "$JSON"; rm -f "$LOG.part"
}
shape_args() {  # H:Hkv:D -> bench arguments
  IFS=: read -r h hk d <<< "$1"; echo "--heads $h --kv-heads $hk --head-dim $d"
}

echo "== evidence: $PART on $N GPU(s), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
case "$PART" in
  tests)
    timeout 240 mpirun -np "$N" --bind-to none $envs python3 -m mpi4py -m pytest -q -p no:cacheprovider \
      mpi_tests/test_baselines_gpu.py > "$LOG" 2>&1 || failed "test_baselines_gpu"
    grep -aE "passed|failed|Error" "$LOG" | sort | uniq -c
    exit $status ;;
  accuracy)
    acc="--accuracy --tokens ${ACC_TOKENS:-16384} --heads 32 --kv-heads 8 --head-dim 128"
    ours 240 $acc --causal
    peer 240 $acc ;;
  peer)
    for shape in 32:32:128 32:8:128 32:32:64; do
      ours 150 --tokens-per-rank "${PEER_TOKENS:-8192,32768}" $(shape_args $shape) --causal --methods burst
      peer 150 --tokens-per-rank "${PEER_TOKENS:-8192,32768}" $(shape_args $shape)
    done ;;
  baselines)
    for shape in 32:32:128 32:8:128; do
      ours 200 --tokens-per-rank "${BASE_TOKENS:-4096,16384}" $(shape_args $shape) --causal
    done ;;
  scaling)
    for shape in ${SCALE_SHAPES:-32:32:128 32:8:128 32:32:64}; do
      for tokens in "${SCALE_WEAK:-32768}" $(( ${SCALE_STRONG:-262144} / N )); do
        ring 200 --tokens-per-rank "$tokens" $(shape_args $shape) --transports "$transports" --modes full --iters 2 --warmup 1
      done
    done ;;
  bytes)
    for shape in 32:32:128 32:8:128; do
      ring 120 --tokens-per-rank 8192 $(shape_args $shape) --transports nccl --modes full --iters 1 --warmup 0 \
        --backward-ring q
      ring 120 --tokens-per-rank 8192 $(shape_args $shape) --transports nccl --modes full --iters 1 --warmup 0 \
        --backward-ring kv --passes fwdbwd
    done ;;
  memory)
    ours 240 --tokens-per-rank "${MEM_TOKENS:-16384,65536}" --causal --passes fwdbwd --iters 1 --warmup 0
    peer 150 --tokens-per-rank "${MEM_TOKENS:-16384,65536}" --passes fwdbwd --iters 1 --warmup 0 ;;
  longest)
    for method in ${3:-burst untiled-ring allgather-kv ulysses torch-cp-cudnn torch-cp-flash}; do
      for ((tokens = ${LONG_START:-65536}; tokens <= ${LONG_MAX:-524288}; tokens *= 2)); do
        before=$(wc -l < "$JSON"); warm=$(( tokens < 262144 ))  # a warm-up call only where it is cheap
        case "$method" in
          torch-cp-*) peer 300 --tokens-per-rank "$tokens" --backends "${method#torch-cp-}" --passes fwdbwd --iters 1 --warmup $warm ;;
          *) ours 300 --tokens-per-rank "$tokens" --methods "$method" --causal --passes fwdbwd --iters 1 --warmup $warm ;;
        esac
        # stop at the first length that failed, timed out or wrote an error row
        [ "$(wc -l < "$JSON")" -gt "$before" ] && ! tail -1 "$JSON" | grep -q '"error"' || break
      done
    done ;;
  layouts)
    timeout 560 mpirun -np "$N" --bind-to none $envs python3 -m mpi4py bench/bench_ring.py --causal --single \
      --tokens-per-rank "${LAYOUT_TOKENS:-32768}" --layouts balanced,zigzag,contiguous,alltoall --transports nccl \
      --modes full,compute --iters 2 --out "$OUT/$NAME.md" > "$LOG" 2>&1 || failed "bench_ring layouts"
    grep '^{' "$LOG" >> "$JSON"; cat "$OUT/$NAME.md" 2>/dev/null
    exit $status ;;
  masks)
    timeout 420 mpirun -np "$N" --bind-to none $envs python3 -m mpi4py bench/bench_masks.py packed \
      --tokens "${MASK_TOKENS:-262144}" --documents "${MASK_DOCS:-64}" --layouts contiguous,zigzag,balanced \
      --out "$OUT/$NAME.md" > "$LOG" 2>&1 || failed "bench_masks packed"
    timeout 300 mpirun -np "$N" --bind-to none $envs python3 -m mpi4py bench/bench_masks.py window \
      --tokens-per-rank 32768 --window "${WINDOW:-4096}" --out "$OUT/$NAME.md" >> "$LOG" 2>&1 || failed "bench_masks window"
    grep '^{' "$LOG" >> "$JSON"; cat "$OUT/$NAME.md" 2>/dev/null
    exit $status ;;
  *) echo "unknown part $PART"; exit 2 ;;
esac
python3 bench/plot_evidence.py --table "$PART" "$JSON" || status=1
exit $status
