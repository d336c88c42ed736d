# Sourced first by the device scripts (run from the repo root on the GPU machine): $OUT
# (default out) exported and created, the CuTe DSL kit on the path (exits the caller without
# it), unbuffered Python so logs arrive as they happen, and the compiled CuTe DSL kernels cached
# in the repo's out/cache (git-ignored, kept on a warm machine between calls, where the home
# folder is not).
OUT=${OUT:-out}
export OUT
mkdir -p "$OUT"
source .gpu/setup.sh || exit 1
export PYTHONUNBUFFERED=1
export AGENTAB_CACHE_DIR=${AGENTAB_CACHE_DIR:-$PWD/out/cache}
