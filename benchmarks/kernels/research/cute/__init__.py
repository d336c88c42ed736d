"""CuTe DSL research kernels (sm_90a): the persistent GEMV chain and its parts, the cp.async-ring
GEMV and the stand-alone MLA preparation. They compile on a CPU like the production kernels."""
