#!/usr/bin/env bash
# One call on a multi-GPU machine: the GPU ring tests one rank per GPU, then where a documents call's host time
# goes (bench/call_overhead.py, cuda backend, MagiAttention's setting at 8k tokens per GPU) at N and 1 GPUs,
# with the kernels and as host work alone (--host-only). Bounded by BUDGET seconds (default 400).
#   BUDGET=400 bash bench/device_overhead.sh
DEFAULT_BUDGET=400 source "$(dirname "$0")/device_common.sh"
if [ -z "${SKIP_RING:-}" ]; then
  echo "== GPU ring tests, $N ranks ($SECONDS s)"
  timeout $(left 150) mpirun -np $N $common python3 -m mpi4py -m pytest -q -p no:cacheprovider mpi_tests/test_ring_gpu.py > $LOG/ring.txt 2>&1
  grep -aE "passed|failed" $LOG/ring.txt | sort | uniq -c; grep -aE "FAILED|Error" $LOG/ring.txt | sort -u | head -8
fi
shape="--tokens-per-rank 8192 --heads 64 --kv-heads 8 --head-dim 128 --backward --ways api --calls 20 --profile 25"
for P in $N 1; do
  for layout in ${LAYOUTS:-chunks contiguous}; do
    for host in "" "--host-only"; do
      echo "== call_overhead P=$P $layout $host ($SECONDS s)"
      timeout $(left 60) mpirun -np $P $common python3 -m mpi4py bench/call_overhead.py --backend cuda --layout $layout $shape $host > /tmp/overhead.txt 2>&1
      grep -a "^call_overhead" /tmp/overhead.txt; echo "== P=$P $layout $host" >> $LOG/overhead.txt; cat /tmp/overhead.txt >> $LOG/overhead.txt
    done
  done
done
