"""Each transition of a request's lifecycle (agentab.engine.request), one test each.

The scheduler changes a request's status only in its transition methods; each test drives the
scheduler into one transition and checks the status and what goes with it (slot, blocks,
queues, counters). Numbers follow from the rules in docs/engine.md, "Scheduling semantics".
"""

from __future__ import annotations

import numpy as np
import pytest

from agentab.engine.request import InvalidTransition, Request, RequestStatus
from agentab.engine.scheduler import Scheduler, SchedulerConfig
from agentab.engine.slots import SlotState

S = RequestStatus


def prompt(n: int, start: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


def make(**kw) -> Scheduler:
    return Scheduler(SchedulerConfig(**kw))


def test_add_queues_a_waiting_request() -> None:
    s = make(num_blocks=20, block_size=4)
    req = s.add("A", prompt(6, 1), 3)
    assert req.status is S.WAITING and not req.is_running and req.finish_reason is None
    assert list(s.waiting) == [req] and s.requests == {"A": req} and req.slot == -1


def test_admission_moves_waiting_to_running() -> None:
    s = make(num_blocks=20, block_size=4)
    req = s.add("A", prompt(6, 1), 3)
    plan = s.schedule()
    assert req.status is S.RUNNING and req.is_running
    assert plan.slots.tolist() == [req.slot] and s.run.tolist() == [req.slot]
    assert not s.waiting and s.state.nblocks[req.slot] == 2  # ceil(6 / 4)


def _pressure() -> tuple[Scheduler, Request, Request]:
    """Two requests that outgrow 8 blocks: B, admitted last, is preempted at step 10."""
    s = make(num_blocks=8, block_size=4, max_num_batched_tokens=100)
    a = s.add("A", prompt(8, 1), 10)
    b = s.add("B", prompt(8, 100), 10)
    for _ in range(9):
        s.update(s.schedule())
    assert a.is_running and b.is_running and s.pool.num_free == 0
    return s, a, b


def test_preemption_moves_running_to_preempted_at_the_waiting_head() -> None:
    s, _, b = _pressure()
    plan = s.schedule()
    assert plan.preempted == ["B"]
    assert b.status is S.PREEMPTED and b.slot == -1 and b.num_preemptions == 1
    assert list(s.waiting) == [b] and b.num_output == 9  # its progress is kept
    assert s.counters["num_preemptions"] == 1


def test_readmission_moves_preempted_to_running() -> None:
    s, _, b = _pressure()
    s.update(s.schedule())  # B preempted, A finishes
    plan = s.schedule()
    assert b.status is S.RUNNING and plan.slots.tolist() == [b.slot]
    assert s.counters["prefix_cache_preempted_queries"] == 17  # 8 prompt + 9 output


def test_last_token_moves_running_to_finished_length() -> None:
    s = make(num_blocks=20, block_size=4)
    req = s.add("A", prompt(6, 1), 2)
    s.update(s.schedule())  # prefill: first token
    free = s.pool.num_free
    _, _, finished = s.update(s.schedule())  # second and last token
    assert finished == [req] and req.status is S.FINISHED_LENGTH
    assert req.finish_reason == "length" and req.slot == -1 and req.num_output == 2
    assert "A" not in s.requests and not s.has_work()
    assert s.pool.num_free == free + 2  # its two blocks returned
    assert s.counters["request_success"] == 1


@pytest.mark.parametrize("where", ["waiting", "running", "preempted"])
def test_abort_moves_any_unfinished_request_to_finished_aborted(where: str) -> None:
    if where == "preempted":
        s, _, req = _pressure()
        s.update(s.schedule())
        assert req.status is S.PREEMPTED
    else:
        s = make(num_blocks=20, block_size=4)
        req = s.add("B", prompt(6, 1), 3)
        if where == "running":
            s.update(s.schedule())
            assert req.status is S.RUNNING
    assert s.abort(req.id) is req
    assert req.status is S.FINISHED_ABORTED and req.finish_reason == "abort"
    assert req not in s.waiting and req.id not in s.requests and req.slot == -1
    assert len(s.run) == 0  # (the only other request, if any, finished)
    assert s.counters["request_abort"] == 1
    assert s.abort(req.id) is None  # gone


def test_transitions_outside_the_lifecycle_are_refused() -> None:
    req = Request("X", np.zeros(4, dtype=np.int64), 4, 1)
    with pytest.raises(InvalidTransition, match="WAITING -> PREEMPTED"):
        req.move_to(S.PREEMPTED)
    with pytest.raises(InvalidTransition):
        req.move_to(S.FINISHED_LENGTH)  # only a running request generates its last token
    req.move_to(S.RUNNING)
    req.move_to(S.FINISHED_STOPPED)  # a model's stop token (no engine stops early yet)
    assert req.finish_reason == "stop" and req.status.is_finished
    for status in S:
        with pytest.raises(InvalidTransition):
            req.move_to(status)  # a finished request stays finished


def test_slot_state_grows_every_array_and_keeps_contents() -> None:
    st = SlotState.empty(2, 3)
    st.computed[1] = 7
    st.keys[0] = np.uint64(2**63 + 5)
    st.in_decode[1] = True
    st.block_table[1, 2] = 9
    st.grow(4, 8)
    assert st.capacity == 4 and st.columns == 8
    assert st.computed.tolist() == [0, 7, 0, 0] and st.computed.dtype == np.int64
    assert st.keys[0] == np.uint64(2**63 + 5) and st.keys.dtype == np.uint64
    assert st.in_decode.tolist() == [False, True, False, False]
    assert st.block_table.shape == st.hash_table.shape == (4, 8)
    assert st.block_table[1, 2] == 9 and st.hash_table.dtype == np.uint64
