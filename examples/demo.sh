#!/usr/bin/env bash
# The main job: generate a small input, run causal forward + backward over 4 MPI ranks with
# burst-hpc, verify against the float64 oracle, and show the result.
#   usage: bash examples/demo.sh [MPIEXEC] [PYTHON]      (make demo passes both)
# Uses the CUDA backend when a GPU is usable (installing CuPy into the environment if needed),
# NumPy otherwise. Overrides: DEMO_BACKEND=numpy|cuda, DEMO_RANKS, DEMO_SEQLEN, DEMO_DIR.
set -euo pipefail

MPIEXEC=${1:-mpiexec}
PY=${2:-python3}
RANKS=${DEMO_RANKS:-4}
DIR=${DEMO_DIR:-out/demo}
BIN=$(dirname "$PY")
if [ -x "$BIN/burst-hpc" ]; then BURST=("$BIN/burst-hpc"); else BURST=("$PY" -m burst_hpc); fi

# a laptop or CI runner has fewer cores than ranks: let Open MPI oversubscribe
export OMPI_MCA_rmaps_base_oversubscribe=${OMPI_MCA_rmaps_base_oversubscribe:-1}
export PRTE_MCA_rmaps_default_mapping_policy=${PRTE_MCA_rmaps_default_mapping_policy:-:oversubscribe}
export PYTHONUNBUFFERED=1

gpu_usable() { "$PY" -c 'import cupy, sys; sys.exit(0 if cupy.cuda.runtime.getDeviceCount() > 0 else 1)' 2>/dev/null; }

BACKEND=${DEMO_BACKEND:-}
if [ -z "$BACKEND" ]; then
  BACKEND=numpy
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    if ! gpu_usable; then
      # a GPU but no CuPy in this environment: install the wheel matching the driver's CUDA major version
      major=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -n1)
      pkg="cupy-cuda12x>=13"; [ "${major:-12}" -ge 13 ] 2>/dev/null && pkg="cupy-cuda13x>=13"
      echo "demo: GPU found, installing $pkg into $(dirname "$BIN")"
      "$PY" -m pip install -q "$pkg" || echo "demo: could not install CuPy; falling back to NumPy"
    fi
    gpu_usable && BACKEND=cuda
  fi
fi

if [ "$BACKEND" = cuda ]; then
  # kernels compile on first use: a warm-up pass keeps that out of the reported times
  SEQLEN=${DEMO_SEQLEN:-16384}; HEADS=8; KV_HEADS=2; HEAD_DIM=64; EXTRA=(--warmup)
else
  SEQLEN=${DEMO_SEQLEN:-1024}; HEADS=4; KV_HEADS=2; HEAD_DIM=64; EXTRA=()
fi

mkdir -p "$DIR"
IN="$DIR/input.h5"
OUT="$DIR/output.h5"
rm -f "$OUT"

echo "== burst-hpc info"
"${BURST[@]}" info
echo
echo "== generate $IN (seqlen $SEQLEN, $HEADS query heads, $KV_HEADS kv heads, head_dim $HEAD_DIM, bfloat16)"
"${BURST[@]}" gen "$IN" --seqlen "$SEQLEN" --heads "$HEADS" --kv-heads "$KV_HEADS" --head-dim "$HEAD_DIM" \
  --dtype bfloat16 --seed "${DEMO_SEED:-$RANDOM}" --with-grad --overwrite
echo
echo "== $MPIEXEC -n $RANKS burst-hpc run $IN $OUT --causal --backward --verify --backend $BACKEND"
status=0
"$MPIEXEC" -n "$RANKS" "${BURST[@]}" run "$IN" "$OUT" --causal --backward --verify --backend "$BACKEND" --progress \
  ${EXTRA[@]+"${EXTRA[@]}"} \
  || status=$?
if [ "$status" -ne 0 ]; then
  echo "demo: FAILED (exit status $status)" >&2
  exit "$status"
fi
echo
echo "== result: $OUT"
"$PY" - "$OUT" <<'PYEOF'
import sys

import h5py

with h5py.File(sys.argv[1], "r") as f:
    for name, ds in f.items():
        tag = ds.attrs.get("dtype", ds.dtype)
        print(f"  {name:4s} {str(ds.shape):22s} {tag}")
    print("  attributes: " + ", ".join(f"{k}={v.decode() if isinstance(v, bytes) else v}"
                                       for k, v in sorted(f.attrs.items())))
PYEOF
echo "demo: OK"
