"""Programmatic dependent launch (PDL) inside the CuTe DSL kernels, in one place.

Every kernel of the specialized path is launched with `use_pdl=True`: it may start while its
predecessor still runs, loads only constants (weights, norm gammas) before `pdl_wait()`, and
calls `pdl_done()` after its last stores, when its own dependent may launch. Triggering at the
end (not right after the wait) leaves the dependent's CTAs off the SMs while this grid still
streams its weights; a grid completes only after its wait returned, so completion stays
transitive along the chain.
"""

import cutlass.cute as cute


@cute.jit
def pdl_wait():
    """Wait until the predecessor grid finished and its writes are visible."""
    cute.arch.griddepcontrol_wait()


@cute.jit
def pdl_done():
    """The kernel's last stores are issued: the dependent grid may launch now."""
    cute.arch.griddepcontrol_launch_dependents()
