#!/usr/bin/env bash
# One call on a multi-GPU machine (issue 36): the GPU tests split over the GPUs, the GPU ring tests one rank per
# GPU, the documents table (bench/bench_documents.py) at N, 2 and 1 GPUs and at 32k tokens per GPU, the
# randomized check on the GPU. Every step is bounded by a deadline (BUDGET seconds, default 530), so the call
# ends inside the machine's per-call limit; the tables land in $OUT/documents.md (else ./out).
#   BUDGET=520 bash bench/device_documents.sh
DEFAULT_BUDGET=530 source "$(dirname "$0")/device_common.sh"
echo "== GPU pytest, one file group per GPU"
i=0
for group in "tests/test_cuda_kernels.py" "tests/test_cuda_masks.py" "tests/test_cuda_padding.py tests/test_cuda_nonfinite.py tests/test_report_gpu.py" "tests/test_verify.py tests/test_kernel_cache.py"; do
  CUDA_VISIBLE_DEVICES=$((i % N)) timeout $(left 170) python3 -m pytest -q -p no:cacheprovider $group > $LOG/pytest$i.txt 2>&1 &
  i=$((i+1))
done
wait
for f in $LOG/pytest*.txt; do echo "$f: $(tail -1 $f)"; grep -E "^FAILED" $f | head -5; done
echo "== GPU ring tests, $N ranks ($SECONDS s)"
timeout $(left 100) mpirun -np $N $common python3 -m mpi4py -m pytest -q -p no:cacheprovider mpi_tests/test_ring_gpu.py > $LOG/ring.txt 2>&1; grep -aE "passed|failed" $LOG/ring.txt | sort | uniq -c; grep -aE "FAILED" $LOG/ring.txt | sort -u | head -8
echo "== documents table, $N GPUs ($SECONDS s)"
cd bench
timeout $(left 130) mpirun -np $N $common python3 -m mpi4py bench_documents.py --out $LOG/documents.md > $LOG/documents_$N.txt 2>&1; echo "P=$N rc=$? ($SECONDS s)"; tail -3 $LOG/documents_$N.txt | grep -v "^|" | head -3
timeout $(left 60) mpirun -np $N $common python3 -m mpi4py bench_documents.py --tokens-per-rank 32768 --dists uniform --passes fwd,fwdbwd --out $LOG/documents.md > $LOG/documents_32k.txt 2>&1; echo "32k rc=$? ($SECONDS s)"
cd ..
echo "== randomized on the GPU, $N ranks ($SECONDS s)"
timeout $(left 70) mpirun -np $N $common python3 -m mpi4py mpi_tests/randomized.py --backend cuda --dtype bfloat16 --seed 7000 --count ${RANDOM_CASES:-20} > $LOG/random.txt 2>&1; grep -aE "^randomized:|^FAIL" $LOG/random.txt | tail -4
cd bench
for P in 2 1; do
  timeout $(left 50) mpirun -np $P --bind-to none -x PYTHONPATH -x NCCL_NVLS_ENABLE -x CUPY_CACHE_DIR python3 -m mpi4py bench_documents.py --out $LOG/documents.md > $LOG/documents_$P.txt 2>&1; echo "P=$P rc=$? ($SECONDS s)"
done
grep -v "^{" $LOG/documents.md
