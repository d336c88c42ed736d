#!/usr/bin/env bash
# One device call: `agentab ab` with the local engine on the H200 at one concurrency.
# On the GPU machine, from the repo root:  CONCURRENCY=8 bash scripts/gpu/local_ab.sh
# Writes the experiment dir (runs, servers' logs, report.md / comparison.json) under $OUT.
set -uo pipefail
source .gpu/setup.sh
c=${CONCURRENCY:-1}
exp="$OUT/local-k2-h200-c$c.toml"
sed -e "s/^concurrency = .*/concurrency = $c/" -e "s/^name = .*/name = \"local-k2-h200-c$c\"/" \
  ${EXTRA_SED:+-e "$EXTRA_SED"} examples/local-k2-h200.toml > "$exp"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/env-c$c.log"
python3 -m agentab ab "$exp" -o "$OUT/ab-c$c" --progress 2>&1 | tee "$OUT/ab-c$c.log"
rc=${PIPESTATUS[0]}
nvidia-smi --query-gpu=memory.used --format=csv | tee -a "$OUT/env-c$c.log"
exit "$rc"
