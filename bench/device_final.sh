#!/usr/bin/env bash
# One short call on a 4-GPU machine: every GPU test at once (the single-GPU files one group a GPU, beside the
# GPU ring tests one rank a GPU; correctness only, so they share the GPUs), then the packed-documents table
# timed as MagiAttention times (bench_documents.py --timing queued) at 4 GPUs. Bounded by BUDGET seconds.
#   BUDGET=300 bash bench/device_final.sh
DEFAULT_BUDGET=300 source "$(dirname "$0")/device_common.sh"
i=0
for group in "tests/test_cuda_kernels.py" "tests/test_cuda_masks.py" "tests/test_cuda_padding.py tests/test_cuda_nonfinite.py tests/test_report_gpu.py" "tests/test_verify.py tests/test_kernel_cache.py"; do
  CUDA_VISIBLE_DEVICES=$((i % N)) timeout $(left 200) python3 -m pytest -q -p no:cacheprovider $group > $LOG/pytest$i.txt 2>&1 &
  i=$((i+1))
done
timeout $(left 200) mpirun -np $N $common bash -c 'python3 -u -m mpi4py -m pytest -s -q -p no:cacheprovider mpi_tests/test_ring_gpu.py > /tmp/ring$OMPI_COMM_WORLD_RANK.txt 2>&1'
wait
for f in $LOG/pytest*.txt; do echo "$f: $(tail -1 $f)"; grep -E "^FAILED|^ERROR" $f | head -5; done
sed 's/\x1b\[[0-9;]*m//g' /tmp/ring0.txt | grep -v "^[.s]*$" | tail -25 > $LOG/ring.txt; echo "ring: $(tail -1 $LOG/ring.txt)"
grep -aE "FAILED|Error" $LOG/ring.txt | head -8
echo "== documents table, $N GPUs ($SECONDS s)"
cd bench
timeout $(left 90) mpirun -np $N $common python3 -m mpi4py bench_documents.py --timing queued --iters 10 --out $LOG/documents.md > $LOG/documents_$N.txt 2>&1; echo "rc=$? ($SECONDS s)"
grep -v "^{" $LOG/documents.md; grep -a "Error\|Traceback" $LOG/documents_$N.txt | head -5
