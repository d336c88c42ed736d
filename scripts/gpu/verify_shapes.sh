#!/usr/bin/env bash
# One device call for speculative decoding's verify shapes: `agentab engine verify-bench` at each context of
# CONTEXTS (default 4096 32768): the decode batch sizes BENCH_BATCHES (1,2,4,8,16,32,64) and the
# verify shapes --verify VERIFY (3,5,7: drafts per row) x --verify-rows VERIFY_ROWS (1,2,4,8), on
# PATHS (standard,specialized: the compiled standard path and the decoder), one process a context
# (docs/kernels.md, "Verify shapes"). JSON and logs under $OUT: verify-context-<C>.json / .log.
# On the GPU machine, from the repo root:  source .gpu/setup.sh && bash scripts/gpu/verify_shapes.sh
# Each context has its own limit (BENCH_TIMEOUT, 180 s); what a run printed before it stays in
# its log, and the JSON is written when the run ends.
set -uo pipefail
source scripts/gpu/prologue.sh
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton, cutlass; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
  git rev-parse HEAD 2>/dev/null || true
} 2>&1 | tee "$OUT/env.log"
rc=0
for ctx in ${CONTEXTS:-4096 32768}; do
  start=$SECONDS
  timeout "${BENCH_TIMEOUT:-180}" python3 -m agentab.engine.local.verify_bench --preset k2-tp8-shard \
    --batch "${BENCH_BATCHES:-1,2,4,8,16,32,64}" --context "$ctx" \
    --paths "${PATHS:-standard,specialized}" \
    --verify "${VERIFY:-3,5,7}" --verify-rows "${VERIFY_ROWS:-1,2,4,8}" \
    --out "$OUT/verify-context-$ctx.json" 2>&1 | tee "$OUT/verify-context-$ctx.log"
  step_rc=${PIPESTATUS[0]}
  echo "context $ctx: rc=$step_rc, $((SECONDS - start)) s" | tee -a "$OUT/verify-context-$ctx.log"
  rc=$(( rc || step_rc ))
done
exit $rc
