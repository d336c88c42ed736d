#!/usr/bin/env bash
# One device call: Nsight Compute on the CuTe DSL kernels of the decoder layer at batch 1 and
# 64 (scripts/gpu/ncu_layer.py). Report under $OUT/ncu.txt, a summary printed.
# NCU_SKIP/NCU_COUNT pick launches among the CuTe DSL kernels (batch 1 launches 8, then batch 64
# launches 2): the default 6/4 profiles moe_up and moe_down at both batch sizes.
set -uo pipefail
source scripts/gpu/prologue.sh
export PYTHONWARNINGS=ignore::DeprecationWarning
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.log"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -z "$NCU" ]; then
  echo "ncu: Nsight Compute not found (PATH or /opt/nvidia/nsight-compute)" >&2
  exit 1
fi
timeout "${NCU_TIMEOUT:-150}" "$NCU" --clock-control none \
  -k regex:^kernel_cutlass --launch-skip "${NCU_SKIP:-6}" --launch-count "${NCU_COUNT:-4}" \
  --section SpeedOfLight --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
  python3 scripts/gpu/ncu_layer.py > "$OUT/ncu.txt" 2>&1
rc=$?
echo "ncu rc=$rc ($(wc -l < "$OUT/ncu.txt") lines)"
grep -E "^  kernel_cutlass|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|No Eligible" "$OUT/ncu.txt" | cut -c1-110 | head -80
exit "$rc"
