# Sourced by the multi-GPU device scripts (device_documents.sh, device_overhead.sh, device_final.sh): the
# environment their mpirun jobs share, $LOG (their output folder: $OUT on the device machine, else ./out), the
# GPU count $N, the mpirun options $common, and left SECONDS: at most SECONDS, and no more than is left of
# the BUDGET (default: $DEFAULT_BUDGET) counted from here, so every step ends inside the call's limit.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUPY_CACHE_DIR=/tmp/cc4
LOG=${OUT:-out}; mkdir -p $LOG
END=$((SECONDS + ${BUDGET:-$DEFAULT_BUDGET}))
left() { local l=$((END - SECONDS)); [ $l -lt 2 ] && l=2; [ $l -lt $1 ] && echo $l || echo $1; }
N=$(nvidia-smi -L | wc -l); nvidia-smi -L | head -1; echo "GPUs: $N"
common="--bind-to none -x PYTHONPATH -x PYTHONUNBUFFERED -x NCCL_NVLS_ENABLE -x CUPY_CACHE_DIR"
