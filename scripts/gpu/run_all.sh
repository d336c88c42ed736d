#!/usr/bin/env bash
# One device call: build (compile) + check + bench the decoder layer, full logs under $OUT.
# On the GPU machine, from the repo root:  bash scripts/gpu/run_all.sh
# Environment overrides: CHECK_BATCHES (default 1-64), BENCH_BATCHES (1,2,4,8,16,32,64),
# CONTEXT (4096), CHECK_CONTEXT (512), STANDARD_EXTRA (128,256,512), CHECK_TIMEOUT (s, 300).
set -uo pipefail
source scripts/gpu/prologue.sh
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, cutlass; print("torch", torch.__version__, "cuda", torch.version.cuda)'
} 2>&1 | tee "$OUT/env.log"
timeout "${CHECK_TIMEOUT:-300}" python3 -m agentab.kernels.check --preset k2-tp8-shard \
  --batch "${CHECK_BATCHES:-1-64}" --context "${CHECK_CONTEXT:-512}" --out "$OUT/check.json" \
  2>&1 | tee "$OUT/check.log"
check_rc=${PIPESTATUS[0]}
python3 -m agentab.kernels.bench --preset k2-tp8-shard --batch "${BENCH_BATCHES:-1,2,4,8,16,32,64}" \
  --context "${CONTEXT:-4096}" --standard-extra "${STANDARD_EXTRA-128,256,512}" \
  --out "$OUT/results.json" --profile-out "$OUT/h200-tp1-kimi-shard.toml" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "check rc=$check_rc bench rc=$bench_rc"
tail -n 3 "$OUT/check.log"
exit $(( check_rc || bench_rc ))
