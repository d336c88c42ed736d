#!/usr/bin/env bash
# One device call: kernel versions 8 / 9 / 10 timed, checked, the winner benched (scripts/gpu/ab.py).
# On the GPU machine, from the repo root:  source .gpu/setup.sh && bash scripts/gpu/ab_run.sh
# AB_BUDGET_S (default 400) bounds the measuring; logs and JSON land in $OUT.
set -uo pipefail
source scripts/gpu/prologue.sh
export PYTHONWARNINGS=ignore::DeprecationWarning
python3 scripts/gpu/ab.py 2>&1 | tee "$OUT/ab.log"
exit "${PIPESTATUS[0]}"
