"""Running the compiled kernels (agentab.engine.loops_numba, transitions_numba) as plain Python,
for tests that compare the two.

Each kernel is one implementation: numba compiles it, and without numba the same function runs
as Python. `plain_python` swaps every compiled kernel for its Python function (`py_func`) for
the duration of a `with` block, so one test can run the same operations both ways.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from agentab.engine import loops_numba, transitions_numba

KERNELS = [name for name, fn in vars(loops_numba).items() if hasattr(fn, "py_func")]
# the transitions' kernels and the pool kernels they call (swapped in their module too)
TRANSITION_KERNELS = [
    name for name, fn in vars(transitions_numba).items() if hasattr(fn, "py_func")
]


@contextmanager
def plain_python(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with monkeypatch.context() as m, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy scalars' wrapping uint64 math
        for name in KERNELS:
            m.setattr(loops_numba, name, getattr(loops_numba, name).py_func)
        for name in TRANSITION_KERNELS:
            m.setattr(transitions_numba, name, getattr(transitions_numba, name).py_func)
        yield
