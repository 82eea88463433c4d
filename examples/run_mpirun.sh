#!/usr/bin/env bash
# A plain mpirun job: generate an input once, then run causal forward + backward over N ranks.
#   usage: bash examples/run_mpirun.sh [RANKS] [SEQLEN] [BACKEND]
#   e.g.   bash examples/run_mpirun.sh 8 1048576 cuda      (one rank per GPU on an 8-GPU node)
# Set MPIRUN to your launcher (default: mpirun on PATH) and add its options in MPIRUN_ARGS,
# e.g. MPIRUN_ARGS="--hostfile hosts --map-by ppr:8:node --bind-to none".
set -euo pipefail

RANKS=${1:-4}
SEQLEN=${2:-8192}
BACKEND=${3:-auto}
MPIRUN=${MPIRUN:-mpirun}
WORK=${WORK:-$PWD/burst-run}
mkdir -p "$WORK"

# 1. inputs: q, k, v and the output gradient do, bfloat16, written chunk by chunk (one process)
if [ ! -f "$WORK/input.h5" ]; then
  burst-hpc gen "$WORK/input.h5" --batch 1 --seqlen "$SEQLEN" --heads 32 --kv-heads 8 --head-dim 128 \
    --dtype bfloat16 --seed 0 --with-grad
fi

# 2. the run: each rank reads only its own tokens and writes only its own token ranges;
#    output.h5 appears only when every rank has finished. --verify then samples query rows on
#    large inputs and checks them against the float64 oracle; its outcome goes into output.h5's
#    attribute verify (h5dump -a verify output.h5); exit status 3 on mismatch.
# shellcheck disable=SC2086
"$MPIRUN" -n "$RANKS" ${MPIRUN_ARGS:-} burst-hpc run "$WORK/input.h5" "$WORK/output.h5" \
  --causal --backward --backend "$BACKEND" --verify --progress --overwrite
