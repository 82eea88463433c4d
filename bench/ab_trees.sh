#!/usr/bin/env bash
# A/B of two source trees' kernels and launches in one GPU call, the trees interleaved:
#   bash bench/ab_trees.sh BASE NEW [ROUNDS]
# BASE, NEW: source trees on the GPU machine. The device call gets one checkout's working tree, so send the
# other along in it as untracked files, e.g. on the development machine, in the checkout:
#   mkdir ab-base && git archive main | tar -x -C ab-base      (then: bash bench/ab_trees.sh ab-base .)
# Each round runs, from each tree in turn and with that tree's own scripts:
# - bench/forward_ab.py: the sm90 forward, D = 128, 4k and 16k, full and causal, sampled as the benchmarks
#   sample (5 calls between two events, the first recorded on an idle GPU: the first call's host time is in
#   the number), then with --gpu-only (the calls queued behind a busy kernel: the GPU's time alone); a tree
#   that is slower in the first and not in the second is slower on the host (bench/host_time.py reads that
#   without a GPU);
# - bench/bench_kernels.py --families sm90 --no-torch: fwd, bwd, fwd+bwd at the same shapes.
# Lines start with the tree's label: base, base-gpu, new, new-gpu (forward_ab.py: label D S causal TFLOP/s).
set -eu -o pipefail
base=$(cd "$1" && pwd)
new=$(cd "$2" && pwd)
rounds=${3:-2}
export PYTHONUNBUFFERED=1
for round in $(seq "$rounds"); do
  for label in base new; do
    if [ "$label" = base ]; then tree=$base; else tree=$new; fi
    echo "== round $round: $label ($tree)"
    (
      cd "$tree"
      export PYTHONPATH=$tree
      python3 bench/forward_ab.py "$label" --dims 128 --seqs 4096,16384 --reps 9
      python3 bench/forward_ab.py "$label-gpu" --dims 128 --seqs 4096,16384 --reps 9 --gpu-only
      python3 bench/bench_kernels.py --families sm90 --dims 128 --seqs 4096,16384 --no-torch --reps 7 \
        | sed "s/^/$label /"
    )
  done
done
