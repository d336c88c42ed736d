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
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
source "$ROOT/scripts/pinned-venv.sh"
pinned_venv install-aiperf "${1:-$ROOT/.venv-aiperf}" aiperf 0.13.0 aiperf.dataset
