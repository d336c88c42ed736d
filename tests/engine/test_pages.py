"""agentab.engine.pages: large zero-filled buffers from their own anonymous mapping."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from agentab.engine import pages

_MAPS = hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS")


def _owner(a: np.ndarray) -> object:
    """The object at the end of an array's chain of bases (what owns its memory)."""
    base: object = a
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


@pytest.mark.skipif(not _MAPS, reason="no anonymous private mappings here")
def test_large_array_is_its_own_zeroed_mapping() -> None:
    a = pages.zeros((1 << 18, 2), np.uint64)  # 4 MB: numpy's huge page threshold
    assert a.shape == (1 << 18, 2) and a.dtype == np.uint64
    assert isinstance(_owner(a), mmap.mmap)
    assert a.flags.c_contiguous and a.flags.writeable
    assert int(a.sum()) == 0
    a[:, 1].view(np.int64)[:] = -1
    a[5, 0] = 7
    assert int(a[5, 0]) == 7 and int(a[:, 1].view(np.int64).sum()) == -(1 << 18)


def test_small_array_is_numpys() -> None:
    b = pages.zeros(1000, np.int32)
    assert b.flags.owndata and b.dtype == np.int32 and b.shape == (1000,)
    assert int(np.count_nonzero(b)) == 0
    c = pages.zeros((0, 64), np.int64)
    assert c.shape == (0, 64)


def test_grown_slot_arrays_keep_contents() -> None:
    from agentab.engine.slots import SlotState

    st = SlotState.empty(16, 64)
    st.block_table[3, :5] = [1, 2, 3, 4, 5]
    st.keys[3] = np.uint64(2**63 + 1)
    st.grow(128, 8192)  # 8 MB tables: mapped
    assert st.block_table.shape == (128, 8192)
    if _MAPS:
        assert isinstance(_owner(st.block_table), mmap.mmap)
    assert st.block_table[3, :6].tolist() == [1, 2, 3, 4, 5, 0]
    assert int(st.keys[3]) == 2**63 + 1 and int(st.block_table.sum()) == 15
