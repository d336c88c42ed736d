#!/usr/bin/env bash
# One device call: explore.py (read ceilings, PDL trigger A/B, checks), then Nsight
# Compute on the CuTe DSL kernels at batch 1 and 64. Logs under $OUT.
set -uo pipefail
source scripts/gpu/prologue.sh
export PYTHONWARNINGS=ignore::DeprecationWarning
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.log"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ] && [ "${NCU_FIRST:-1}" = 1 ]; then
  # NCU_SKIP/NCU_COUNT pick launches among the CuTe DSL kernels (batch 1 launches 8, then
  # batch 64 launches 2): the default 6/4 profiles moe_up and moe_down at both batch sizes.
  AGENTAB_KERNELS_VERSION=${NCU_VERSION:-14} timeout "${NCU_TIMEOUT:-150}" "$NCU" --clock-control none \
    -k regex:^kernel_cutlass --launch-skip "${NCU_SKIP:-6}" --launch-count "${NCU_COUNT:-4}" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 scripts/gpu/ncu_layer.py > "$OUT/ncu.txt" 2>&1
  echo "ncu rc=$? ($(wc -l < "$OUT/ncu.txt") lines)"
  grep -E "^  kernel_cutlass|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|No Eligible" "$OUT/ncu.txt" | cut -c1-110 | head -80
fi
if [ "${PERSIST:-0}" = 1 ]; then  # the persistent-layer read ceiling
  timeout "${PERSIST_TIMEOUT:-240}" python3 scripts/gpu/persistent_read.py 2>&1 | tee "$OUT/persistent_read.log"
fi
[ "${EXPLORE:-1}" = 1 ] && python3 scripts/gpu/explore.py 2>&1 | tee "$OUT/explore.log" | grep -v "^\[" ; tail -n 4 "$OUT/explore.log"
