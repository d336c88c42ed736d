# Sourced first by the device scripts (run from the repo root on the GPU machine): $OUT
# (default out) exported and created, the CuTe DSL kit on the path (exits the caller without
# it), unbuffered Python so logs arrive as they happen.
OUT=${OUT:-out}
export OUT
mkdir -p "$OUT"
source .gpu/setup.sh || exit 1
export PYTHONUNBUFFERED=1
