#!/usr/bin/env bash
# `agentab ab` with the local engine on the H200 at one concurrency, over one or more device calls.
# The GPU machine has no polars / orjson / msgspec and a call carries at most 64 MiB, which the
# CuTe DSL kit (.gpu) nearly fills, so their wheels travel in a call of their own first:
#   call 1 (carry [".pyk"]):  bash scripts/gpu/local_ab.sh install
#   call 2 (carry [".gpu"]), within the machine's idle window:  CONCURRENCY=8 bash scripts/gpu/local_ab.sh
# (.pyk: `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux_2_17_x86_64 -d .pyk polars polars-runtime-32 orjson msgspec`, versions as here.)
# The experiment dir lives in out/ (git-ignored, kept on a warm machine between calls), so an A/B
# longer than one call runs as several: MAX_RUNS=N runs N more runs and stops; the same command
# again resumes (`agentab ab` keeps completed runs). Each call archives the dir to $OUT (run dirs
# nest too deep to come back as files); RESTORE=path.tgz unpacks such an archive first when the
# machine is a fresh one. EXTRA_SED edits the experiment file (e.g. a longer window); EXPERIMENT
# names another one (default examples/local-k2-h200.toml; examples/local-k2-h200-c1.toml for
# concurrency 1).
#   `bash scripts/gpu/local_ab.sh calibrate` (carry [".gpu"]) instead fits a simulator profile to
# the same engine (`agentab calibrate --engine-config`, both decode paths, the engine's own step
# counters) and writes it with its fit report under $OUT.
# Each call logs the GPU's name and UUID to $OUT/env-*.log: an A/B spread over several calls (or
# machines) then shows which device ran which of its runs.
set -uo pipefail
if [ "${1:-}" = install ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pysite .pyk/*.whl
  PYTHONPATH=/tmp/pysite python3 -c "import polars, orjson, msgspec; print('polars', polars.__version__)"
  exit
fi
[ -d /tmp/pysite/polars ] || { echo "run 'bash scripts/gpu/local_ab.sh install' (carry .pyk) first" >&2; exit 2; }
export PYTHONPATH=/tmp/pysite${PYTHONPATH:+:$PYTHONPATH}
source .gpu/setup.sh
# the compiled CuTe DSL kernels, kept beside the experiment dir: a warm machine's later servers
# load them instead of compiling (~25 s a start)
export AGENTAB_CACHE_DIR=${AGENTAB_CACHE_DIR:-$PWD/out/cache}
if [ "${1:-}" = calibrate ]; then
  nvidia-smi --query-gpu=name,uuid,memory.used,memory.total --format=csv | tee "$OUT/env-calibrate.log"
  # ENGINE_CONFIG with a speculative_config also times its drafter (no drafter assumption
  # then: ALLOW=none), e.g. ENGINE_CONFIG=examples/local-k2-h200-c8-spec.toml; the drafter's
  # part also runs the mixed phases whose decode rows verify (spec_decode.mixed_verify_row_us)
  # BATCHES=1,2,4,8,16,32,64 (the draft-free servers reach the verify steps' token counts)
  # ONLY=standard (then ONLY=specialized,drafter in a second call) splits a calibration that
  # would outlast one call: each part writes its measurements (h200-local-k2-tp8-shard-<ONLY>.fit.json)
  # and `agentab calibrate --refit A.fit.json --refit B.fit.json -o PROFILE.toml` fits them here
  allow=${ALLOW:-spec_decode.drafter_step_us}
  name=h200-local-k2-tp8-shard${ONLY:+-${ONLY//,/-}}
  timeout "${AB_TIMEOUT:-580}" python3 -m agentab calibrate --engine-config "${ENGINE_CONFIG:-examples/local-k2-h200.toml}" \
    --specialized --contexts "${CONTEXTS:-256,8192}" ${BATCHES:+--batches "$BATCHES"} \
    $([ "$allow" = none ] || [ -n "${ONLY:-}" ] || echo --allow-assumed "$allow") ${ONLY:+--only "$ONLY"} \
    -o "$OUT/$name.toml" 2>&1 | tee "$OUT/calibrate${ONLY:+-${ONLY//,/-}}.log"
  exit "${PIPESTATUS[0]}"
fi
c=${CONCURRENCY:-1}
mkdir -p out
exp="out/local-k2-h200-c$c.toml"
dir="out/ab-c$c"
sed -e "s/^concurrency = .*/concurrency = $c/" -e "0,/^name = /s/^name = .*/name = \"local-k2-h200-c$c\"/" \
  ${EXTRA_SED:+-e "$EXTRA_SED"} "${EXPERIMENT:-examples/local-k2-h200.toml}" > "$exp"
cp "$exp" "$OUT/"
if [ ! -d "$dir" ] && [ -n "${RESTORE:-}" ]; then
  tar xzf "$RESTORE" -C out && echo "restored $dir from $RESTORE"
fi
nvidia-smi --query-gpu=name,uuid,memory.used,memory.total --format=csv | tee -a "$OUT/env-c$c.log"
timeout "${AB_TIMEOUT:-580}" python3 -m agentab ab "$exp" -o "$dir" --progress \
  ${MAX_RUNS:+--max-runs "$MAX_RUNS"} 2>&1 | tee "$OUT/ab-c$c.log"
rc=${PIPESTATUS[0]}
nvidia-smi --query-gpu=memory.used --format=csv | tee -a "$OUT/env-c$c.log"
tar czf "$OUT/ab-c$c-runs.tgz" -C out "ab-c$c"
cp "$dir"/report.md "$dir"/comparison.json "$OUT/" 2>/dev/null
ls -la "$OUT"
exit "$rc"
