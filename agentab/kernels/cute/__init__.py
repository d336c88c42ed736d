"""CuTe DSL kernels of the specialized decode path (Hopper, sm_90a).

Each kernel module has a `build_*` function that traces the kernel for one shape (every size a
compile-time constant, so loops unroll and loads vectorize) and `compile_*` that compiles it once
with TVM-FFI and fake tensors: the result is called with torch tensors on torch's current stream
and can be captured in a CUDA graph. Compiling needs no GPU (`CUTE_DSL_ARCH=sm_90a`). Compiled
kernels are kept on disk across processes (`cache`).
"""

# First: `common` names the compile target before any kernel module imports cutlass, whose
# settings are read once, at its import (later, a machine without a GPU would get sm_100a).
from agentab.kernels.cute import common as common
