"""The decode graphs' packed inputs (one int64 buffer per padded batch size), checked on the CPU:
real rows first, padding rows decoding token 0 into the scratch block, pending tokens named by
the previous step's row."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from agentab.engine.local.cuda import GraphInputs, graph_sizes  # noqa: E402
from agentab.engine.outputs import StepInputs  # noqa: E402


def test_graph_sizes_are_vllms_padded_batches():
    assert graph_sizes(16) == [1, 2, 4, 8, 16]
    assert graph_sizes(20) == [1, 2, 4, 8, 16, 24]


def test_a_step_and_its_padding_land_in_their_segments():
    b, m, bs, scratch = 4, 6, 16, 99
    st = GraphInputs(b, m, torch.device("cpu"))
    inputs = StepInputs(
        token_ids=np.array([11, 12, 13]),
        positions=np.array([40, 7, 0]),
        starts=np.array([0, 1, 2, 3]),
        context_lens=np.array([41, 8, 1]),
        block_tables=np.array([[5, 6, 7], [8, 0, 0], [9, 0, 0]]),
        slot_mapping=np.array([7 * bs + 8, 8 * bs + 7, 9 * bs]),
        is_decode=np.array([True, True, True]),
        block_size=bs,
        prev_rows=np.array([-1, 0, -1]),
    )
    st.fill(inputs, scratch * bs, scratch, split_len=64, pool_scratch=1000)
    assert st.token_ids.tolist() == [11, 12, 13, 0]
    assert st.dest.tolist() == [0, 1, 2, 1000]  # row i's id for the next step; padding: scratch
    slots = [7 * bs + 8, 8 * bs + 7, 9 * bs, scratch * bs]
    assert st.pos_slots64.tolist() == [[40, 7, 0, 0], slots]
    assert st.new_slots.tolist() == slots
    assert st.prev_rows.tolist() == [-1, 0, -1, -1]
    assert st.split_len.tolist() == [64]
    assert st.block_table[:3, :3].tolist() == [[5, 6, 7], [8, 0, 0], [9, 0, 0]]
    assert st.block_table[3, 0].item() == scratch
    # a smaller step next: the rows it no longer has become padding again
    inputs.token_ids, inputs.positions = np.array([21]), np.array([41])
    inputs.starts, inputs.context_lens = np.array([0, 1]), np.array([42])
    inputs.block_tables, inputs.slot_mapping = np.array([[5, 6, 7]]), np.array([7 * bs + 9])
    inputs.is_decode, inputs.prev_rows = np.array([True]), np.array([2])
    st.fill(inputs, scratch * bs, scratch, split_len=128, pool_scratch=1000)
    assert st.token_ids.tolist() == [21, 0, 0, 0]
    assert st.dest.tolist() == [0, 1000, 1000, 1000]
    assert st.prev_rows.tolist() == [2, -1, -1, -1]
    assert st.new_slots.tolist() == [7 * bs + 9] + [scratch * bs] * 3
    assert st.block_table[1:, 0].tolist() == [scratch] * 3


def test_verify_token_rows_carry_their_rows_block_table_and_the_drafts_pool_places():
    """A verify row of 1 + 2 tokens is three graph rows at consecutive positions with the same
    block table; its drafts are read from the pool, its first token is pending."""
    from agentab.engine.local.cuda import TokenRows

    b, m, bs, scratch = 4, 3, 16, 50
    st = GraphInputs(b, m, torch.device("cpu"))
    rows = TokenRows(
        token_ids=np.array([7, 0, 0]),
        positions=np.array([20, 21, 22]),
        slots=np.array([3 * bs + 4, 3 * bs + 5, 3 * bs + 6]),
        prev=np.array([0, 513, 514]),
        dest=np.array([1024, 1024, 1024]),
        block_tables=np.array([[2, 3], [2, 3], [2, 3]]),
    )
    st.fill_rows(rows, scratch * bs, scratch, split_len=64, pool_scratch=1024)
    assert st.pos_slots64.tolist() == [[20, 21, 22, 0], [52, 53, 54, scratch * bs]]
    assert st.prev_rows.tolist() == [0, 513, 514, -1]
    assert st.block_table[:, :2].tolist() == [[2, 3], [2, 3], [2, 3], [scratch, 0]]
    wide = TokenRows(rows.token_ids, rows.positions, rows.slots, rows.prev, rows.dest,
                     np.zeros((3, m + 1), dtype=np.int64))  # fmt: skip
    with pytest.raises(RuntimeError, match="needs 4 blocks; graphs hold 3"):
        st.fill_rows(wide, scratch * bs, scratch, split_len=64, pool_scratch=1024)
