"""Fixes to Triton's interpreter, so the CPU tests run the project's Triton kernels as the GPU
does. Applied once, and only when the interpreter is on (TRITON_INTERPRET=1 before triton is
imported)."""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl


def patch() -> None:
    """Three fixes to Triton 3.6's interpreter (CPU tests only; compiled kernels are untouched).

    - bf16 `tl.dot`: the interpreter keeps bf16 values as their uint16 bit patterns (numpy has
      no bf16) and its dot multiplied those integers (a dot of N(0,1) values came out ~1e10).
      Widening bf16 to fp32 is exact (the bits shifted up by 16), so the patched dot computes
      what the GPU's bf16 MMA with fp32 accumulation does, up to summation order.
    - fp32 -> bf16 casts truncated; the GPU rounds to nearest even, and so does the patch (a
      truncated activation and output made a 0.7% error against an fp32 reference that
      rounding to nearest brings to the bf16 floor).
    - Scalar kernel arguments are 1-element arrays, which `int()` refuses from numpy 2.4 on, so
      a loop bounded by one (`range(0, n, step)`) failed; `__index__` reads the element.
    """
    if not triton.knobs.runtime.interpret:
        return
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "widens_bf16", False):
        return
    original_dot = builder.create_dot
    original_cast = builder.cast_impl
    original_tensor_patch = interpreter._patch_lang_tensor

    def widen(h: Any) -> Any:
        if h.dtype.scalar != tl.bfloat16:
            return h
        bits = h.data.astype(np.uint32) << np.uint32(16)
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        return original_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):  # type: ignore[no-untyped-def]
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = src.data.astype(np.float32).view(np.uint32)
            bits = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
            return interpreter.TensorHandle((bits >> np.uint32(16)).astype(np.uint16), tl.bfloat16)
        return original_cast(self, src, dst_type)

    def patch_lang_tensor(tensor, scope):  # type: ignore[no-untyped-def]
        original_tensor_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    create_dot.widens_bf16 = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
    interpreter._patch_lang_tensor = patch_lang_tensor
