#!/usr/bin/env bash
# One device call (carry [".gpu"]) for the CuTe DSL compile cache on the H200, from the repo root:
#   bash scripts/gpu/compile_cache.sh
# 1. bench: cold vs warm compile of a local-engine start's kernels
#    (benchmarks/bench_cute_compile_cache.py, over a temporary cache folder of its own)
# 2. check: `kernels check --paths specialized` twice over one emptied cache folder
#    (out/cache-check): the first process compiles and stores every kernel, the second loads them
#    all and runs them against the fp32 reference in CUDA graphs; both must pass
# 3. smoke: the local engine's smoke stage (4 layers, both backends, tokens compared) twice over
#    the same folder; each start's log says what it compiled and loaded
#    ("agentab local engine: ... compiled N CuTe DSL kernels in X s (M from cache ...)")
# STEPS picks some (default bench,check,smoke; all three may pass the 10-minute limit of a call:
# STEPS=bench,check first, then STEPS=smoke within the machine's idle window: its first start
# then finds the MoE kernels the checks stored and compiles the rest (the engine's GEMVs read a
# paged cache), its second loads all). Logs and JSON under $OUT.
set -uo pipefail
source scripts/gpu/prologue.sh
steps=${STEPS:-bench,check,smoke}
rc=0
nvidia-smi --query-gpu=name,driver_version --format=csv 2>&1 | tee "$OUT/env.log"
if [[ ,$steps, == *,bench,* ]]; then
  timeout 200 python3 benchmarks/bench_cute_compile_cache.py --modes cold,warm,warm,off \
    -o "$OUT/compile-cache-h200.json" 2>&1 | tee "$OUT/bench.log"
  rc=$(( rc || PIPESTATUS[0] ))
fi
export AGENTAB_CACHE_DIR=$PWD/out/cache-check
if [[ ,$steps, == *,check,* ]]; then
  rm -rf "$AGENTAB_CACHE_DIR"
  for i in 1 2; do
    start=$SECONDS
    timeout 150 python3 -m agentab.kernels.check --preset k2-tp8-shard --batch "${CHECK_BATCHES:-1,2,4,8}" \
      --context 512 --paths specialized --out "$OUT/check-$i.json" 2>&1 | tee "$OUT/check-$i.log"
    rc=$(( rc || PIPESTATUS[0] ))
    echo "check $i: $((SECONDS - start)) s, $(find "$AGENTAB_CACHE_DIR" -name '*.o' | wc -l) entries" |
      tee -a "$OUT/check-$i.log"
  done
fi
if [[ ,$steps, == *,smoke,* ]]; then
  for i in 1 2; do
    start=$SECONDS
    STAGES=smoke timeout 240 python3 scripts/gpu/local_engine.py 2>&1 | tee "$OUT/smoke-$i.log"
    rc=$(( rc || PIPESTATUS[0] ))
    echo "smoke $i: $((SECONDS - start)) s" | tee -a "$OUT/smoke-$i.log"
    cp "$OUT/local_engine.json" "$OUT/smoke-$i.json" 2>/dev/null
  done
  grep -h "CuTe DSL kernels" "$OUT"/smoke-*.log
fi
exit $rc
