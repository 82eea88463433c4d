#!/usr/bin/env bash
# --verify on the GPU (the default for a cuda run) against the passes at the README's job shape on one GPU
# (issue 25: at most 10% of the passes at S >= 128k), then `burst-hpc verify` of the same output later on
# the GPU (256 sampled tokens). Two runs: the first fills CuPy's kernel cache (CUPY_CACHE_DIR, fresh
# here), the second is the measurement; the summary lines give fwd, bwd and verify seconds.
#   bash bench/device_verify.sh [SEQLEN]      (default 131072; logs and files under $OUT when set, else ./out)
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
S=${1:-131072}
LOG=${OUT:-out}; mkdir -p "$LOG"
DATA=$(mktemp -d)
export CUPY_CACHE_DIR=$DATA/cupy-cache
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$LOG/verify_gpu.txt"
python3 -m burst_hpc gen "$DATA/in.h5" --seqlen "$S" --heads 32 --kv-heads 8 --head-dim 128 --dtype bf16 --with-grad --quiet
for pass in cold warm; do
  rm -f "$DATA/out.h5"
  mpirun -np 1 python3 -m burst_hpc run "$DATA/in.h5" "$DATA/out.h5" --causal --backward --warmup --verify --progress \
    > "$LOG/verify_run_$pass.txt" 2>&1
  echo "$pass: exit $?"
  grep -E "^\[burst-hpc.*verify:|^burst-hpc run:" "$LOG/verify_run_$pass.txt"
done
echo "== burst-hpc verify of the published output, on the GPU (256 rows+cols)"
mpirun -np 1 python3 -m burst_hpc verify "$DATA/in.h5" "$DATA/out.h5" --backend cuda 2>&1 | tee "$LOG/verify_later.txt" | tail -2
rm -rf "$DATA"
