"""The running set's per-request state, as named arrays indexed by slot.

Why arrays: the simulator must do no Python work per running request per step (docs/engine.md,
"Speed on the virtual clock"), so what a step reads and writes of each running request lives
in numpy arrays by slot, and a step is a few array operations or one compiled loop
(agentab.engine.loops_numba) over them, whatever the batch size. Why one declared structure:
every array is named, typed and documented here, and `grow` resizes them all together, so
neither a reader nor mypy has to find where an array comes from.

A RUNNING request (request.Request) owns one slot from its admission until it finishes, is
preempted or aborted; its row is meaningless otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import numpy.typing as npt

from agentab.engine import pages

I64Array = npt.NDArray[np.int64]
U64Array = npt.NDArray[np.uint64]
BoolArray = npt.NDArray[np.bool_]


@dataclass(eq=False)
class SlotState:
    """Per-slot arrays (`cap` rows) and per-slot block tables (`cap` x `cols`)."""

    computed: I64Array  # tokens whose KV is computed or scheduled in a step applied so far
    ntokens: I64Array  # tokens known: prompt plus output emitted so far
    output: I64Array  # output tokens emitted
    maxtok: I64Array  # the request's max_tokens
    nblocks: I64Array  # KV blocks held (the used prefix of the block table's row)
    ncached: I64Array  # leading blocks registered in the prefix cache
    nhashed: I64Array  # leading blocks whose prefix keys are known (hash_table)
    spec_idx: I64Array  # verify steps run so far (the acceptance draws' counter)
    keys: U64Array  # the request's 64-bit key (spec_decode.request_key)
    # a RUNNING request's phase: False while its prompt (after a preemption: its prompt and
    # output so far) is being computed, True once that completed and it decodes
    in_decode: BoolArray
    block_table: I64Array  # (cap, cols): block ids, in token order
    hash_table: U64Array  # (cap, cols): prefix keys of the blocks

    @classmethod
    def empty(cls, cap: int, cols: int) -> SlotState:
        return cls(**{f.name: _zeros(f.name, cap, cols) for f in fields(cls)})

    @property
    def capacity(self) -> int:
        return len(self.computed)

    @property
    def columns(self) -> int:
        return int(self.block_table.shape[1])

    def grow(self, cap: int, cols: int) -> None:
        """Resize to `cap` slots and `cols` block columns (neither smaller), keeping contents."""
        old_cap, old_cols = self.capacity, self.columns
        for f in fields(self):
            old = getattr(self, f.name)
            if old.ndim == 1 and cap == old_cap:
                continue
            new = _zeros(f.name, cap, cols)
            if old.ndim == 1:
                new[:old_cap] = old
            else:
                new[:old_cap, :old_cols] = old
            setattr(self, f.name, new)


_DTYPES: dict[str, type[np.generic]] = {"keys": np.uint64, "hash_table": np.uint64}
_DTYPES["in_decode"] = np.bool_
_TABLES = frozenset({"block_table", "hash_table"})


def _zeros(name: str, cap: int, cols: int) -> np.ndarray:
    shape = (cap, cols) if name in _TABLES else (cap,)
    return pages.zeros(shape, _DTYPES.get(name, np.int64))
