#!/usr/bin/env bash
# What limits each sm90 pass: one launch of the forward and of the backward per case under ncu (no clock
# control: the GPU's own clocks), the SM and DRAM throughput, issue activity and the leading warp stall
# reasons. The table in docs/BENCHMARKS.md ("What limits each pass") comes from this.
#   bash bench/ncu_read.sh ["D S causal" ...]      (default: the four cases below)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
M=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__throughput.avg.pct_of_peak_sustained_elapsed
M=$M,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active
for stall in wait barrier long_scoreboard dispatch_stall math_pipe_throttle; do
  M=$M,smsp__warp_issue_stalled_${stall}_per_warp_active.pct
done
cases=("$@")
[ ${#cases[@]} -eq 0 ] && cases=("128 4096 0" "128 16384 0" "128 16384 1" "64 4096 0")
for c in "${cases[@]}"; do
  set -- $c
  causal=$([ "$3" = 1 ] && echo --causal)
  for kern in "attn_fwd_sm90_" "attn_bwd_sm90_(bf16|f16)"; do
    echo "== ${kern%%_(*} D=$1 S=$2 causal=$3"
    timeout 120 ncu --clock-control none -k "regex:^${kern}" --launch-skip 1 --launch-count 1 --metrics "$M" \
      python3 bench/one_call.py --family sm90 --d "$1" --s "$2" $causal 2>&1 \
      | grep -E "^\s+(sm__|gpu__|dram__|smsp__)" | awk '{print $1, $(NF-1), $NF}'
  done
done
