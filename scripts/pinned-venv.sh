# Sourced by the install-*.sh scripts: one pinned distribution in a venv of its own.
#
# pinned_venv LABEL VENV DIST VERSION IMPORT [REMOVE ...]
#   Leaves VENV alone when DIST==VERSION is installed there and `import IMPORT` works
#   (idempotent); otherwise creates the venv if needed, installs DIST==VERSION, uninstalls the
#   REMOVE distributions (dependencies that break the import), and checks the import.
pinned_venv() {
    local label=$1 venv=$2 dist=$3 version=$4 module=$5
    shift 5
    local py="$venv/bin/python" t0
    t0=$(date +%s)
    log() { echo "== $label [$(($(date +%s) - t0))s]: $*"; }
    local check="import sys; from importlib.metadata import version
assert version('$dist') == '$version', version('$dist')
import $module"
    if [ -x "$py" ] && "$py" -c "$check" >/dev/null 2>&1; then
        log "$dist==$version already importable in $venv; nothing to do"
        return 0
    fi
    if [ ! -x "$py" ]; then
        log "creating venv $venv"
        python3 -m venv "$venv"
    fi
    export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
    log "pip install $dist==$version"
    "$py" -m pip install --progress-bar off "$dist==$version"
    if [ $# -gt 0 ]; then
        log "removing $* (they break 'import $module')"
        "$py" -m pip uninstall -y "$@" || true
    fi
    log "checking 'import $module'"
    "$py" -c "$check; print('$dist', version('$dist'))"
    log "done: $venv"
}
