#!/usr/bin/env bash
# Install AIPerf into its own venv, for the `aiperf`-marked tests that run AIPerf's own trace
# loader on what `agentab workload convert --to agentx` writes.
#
# Usage: scripts/install-aiperf.sh [VENV_DIR]     (default: .venv-aiperf in the repo root)
#
# Why a separate venv: AIPerf pins its own versions of many libraries (pydantic, zmq, numpy, ...)
# that must not leak into agentab's environment. The tests find it through AGENTAB_AIPERF_PYTHON
# or this default. Idempotent: a venv that already imports the pinned AIPerf is left alone.
set -euo pipefail
AIPERF_VERSION="0.13.0"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-aiperf}"
PY="$VENV/bin/python"
t0=$(date +%s)
log() { echo "== install-aiperf [$(($(date +%s) - t0))s]: $*"; }

have_aiperf() {
    [ -x "$PY" ] && "$PY" - "$AIPERF_VERSION" <<'PYEOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
assert version("aiperf") == sys.argv[1], version("aiperf")
import aiperf.dataset  # noqa: F401
PYEOF
}

if have_aiperf; then
    log "aiperf==$AIPERF_VERSION already importable in $VENV; nothing to do"
    exit 0
fi

if [ ! -x "$PY" ]; then
    log "creating venv $VENV"
    python3 -m venv "$VENV"
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
log "pip install aiperf==$AIPERF_VERSION"
"$PY" -m pip install --progress-bar off "aiperf==$AIPERF_VERSION"
log "checking 'import aiperf.dataset'"
"$PY" -c "import aiperf, aiperf.dataset; from importlib.metadata import version; print('aiperf', version('aiperf'))"
log "done: $VENV"
