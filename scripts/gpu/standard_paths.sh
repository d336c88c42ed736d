#!/usr/bin/env bash
# One device call for the standard paths: `kernels check` at batch 1-64 on every path
# (standard-eager, standard = torch.compile + Triton fused MoE, specialized), then `kernels
# bench` at batch 1, 8, 64 on the same three; JSON and logs under $OUT, a short table last.
# On the GPU machine, from the repo root:  source .gpu/setup.sh && bash scripts/gpu/standard_paths.sh
# Check at context 512 (CHECK_CONTEXT), bench at 4096 (CONTEXT), as run_all.sh does. Each step
# has its own limit (CHECK_TIMEOUT 300 s, BENCH_TIMEOUT 150 s), so the call ends within 8 minutes
# and what a step printed before its limit stays in its log.
set -uo pipefail
source scripts/gpu/prologue.sh
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton, cutlass; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
} 2>&1 | tee "$OUT/env.log"
start=$SECONDS
timeout "${CHECK_TIMEOUT:-300}" python3 -m agentab.kernels.check --preset k2-tp8-shard \
  --batch "${CHECK_BATCHES:-1-64}" --context "${CHECK_CONTEXT:-512}" \
  --paths standard-eager,standard,specialized --out "$OUT/check.json" 2>&1 | tee "$OUT/check.log"
check_rc=${PIPESTATUS[0]}
echo "check: rc=$check_rc, $((SECONDS - start)) s" | tee -a "$OUT/check.log"
start=$SECONDS
timeout "${BENCH_TIMEOUT:-150}" python3 -m agentab.kernels.bench --preset k2-tp8-shard \
  --batch "${BENCH_BATCHES:-1,8,64}" --context "${CONTEXT:-4096}" \
  --out "$OUT/results.json" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "bench: rc=$bench_rc, $((SECONDS - start)) s" | tee -a "$OUT/bench.log"
python3 scripts/gpu/standard_paths_table.py "$OUT/check.json" "$OUT/results.json" 2>&1 |
  tee "$OUT/table.log"
exit $(( check_rc || bench_rc ))
