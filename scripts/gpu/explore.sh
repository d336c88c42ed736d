#!/usr/bin/env bash
# Session 3's device call: explore.py (read ceilings, PDL trigger A/B, checks), then Nsight
# Compute on the CuTe DSL kernels at batch 1 and 64. Logs under $OUT.
set -uo pipefail
OUT=${OUT:-out}
export OUT
mkdir -p "$OUT"
source .gpu/setup.sh || exit 1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore::DeprecationWarning
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.log"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ] && [ "${NCU_FIRST:-1}" = 1 ]; then
  AGENTAB_KERNELS_VERSION=${NCU_VERSION:-9} timeout "${NCU_TIMEOUT:-150}" "$NCU" --clock-control none \
    -k regex:^kernel_cutlass --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
    python3 scripts/gpu/ncu_layer.py > "$OUT/ncu.txt" 2>&1
  echo "ncu rc=$? ($(wc -l < "$OUT/ncu.txt") lines)"
  grep -E "^  kernel_cutlass|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|No Eligible" "$OUT/ncu.txt" | cut -c1-110 | head -80
fi
python3 scripts/gpu/explore.py 2>&1 | tee "$OUT/explore.log" | grep -v "^\[" ; tail -n 4 "$OUT/explore.log"
