#!/usr/bin/env bash
# Nsight Compute on the sm90 attention kernels at one benchmark shape: stall
# reasons, pipe and shared-memory use, and the hottest SASS lines.
#
#   bash scripts/gpu_profile.sh AOT_DIR [profile_case.py args...]
#
# Builds like gpu_check.sh (its "none" stage), profiles the second (warm)
# forward and backward launch and writes reports and text pages under $OUT.
set -uo pipefail
AOT_DIR=${1:?usage: gpu_profile.sh AOT_DIR [case args]}
shift
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
bash "$(dirname "$0")/gpu_check.sh" "$AOT_DIR" none >/dev/null || exit 1
tag=$(echo "$*" | tr -c 'a-z0-9' '_')
for kernel in FlashFwdSm90 FlashBwdSm90; do
  report="$OUT/${kernel}_${tag}"
  ncu --clock-control none --kernel-name "regex:$kernel" --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section SourceCounters --import-source no -f -o "$report" \
      python3 scripts/profile_case.py "$@" >"$report.log" 2>&1
  ncu --import "$report.ncu-rep" --page details >"$report.txt" 2>&1
  ncu --import "$report.ncu-rep" --page source --csv --print-source sass >"$report.sass.csv" 2>&1
  grep -E "Duration|Warp Cycles Per Issued|Issue Slots Busy|Stall|Bank Conflicts|Pipe|Throughput" \
      "$report.txt" | head -60
done
