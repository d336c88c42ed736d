"""Programmatic dependent launch (PDL) inside the CuTe DSL kernels, in one place.

Every kernel of the specialized path is launched with `use_pdl=True`: it may start while its
predecessor still runs, loads only constants (weights, norm gammas) before `pdl_wait()`, and
calls `pdl_done()` when its own dependent may start. Where that trigger sits is
`common.pdl_mode()` ($AGENTAB_KERNELS_PDL), read here at trace time, so a kernel never spells
the choice itself.
"""

import cutlass
import cutlass.cute as cute

from agentab.kernels.cute.common import pdl_mode


@cute.jit
def pdl_wait():
    """Wait until the predecessor grid finished and its writes are visible; in "early" mode
    also let the dependent grid launch now."""
    cute.arch.griddepcontrol_wait()
    if cutlass.const_expr(pdl_mode() == "early"):
        cute.arch.griddepcontrol_launch_dependents()


@cute.jit
def pdl_done():
    """The kernel's last stores are issued: in "end" mode the dependent grid may launch now."""
    if cutlass.const_expr(pdl_mode() != "early"):
        cute.arch.griddepcontrol_launch_dependents()
