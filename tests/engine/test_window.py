"""A decode window (agentab.engine.window) equals the same steps taken one at a time, exactly.

Two copies of one scheduler state: one plans a window and commits its first m steps, the other
schedules and applies m single steps. Every single step must be the window's step (rows, path,
padding, tokens emitted, price to the last bit), and both schedulers must end in the same state:
slot arrays, block pool, emission log, requests and counters. Block ids are labels: a window
allocates each row's new blocks together, steps interleave them by step, so the same free
blocks end up in other rows' tables; what a block holds, and where, is compared instead.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from agentab.engine.executor import SimExecutor
from agentab.engine.options import DecodeBackend
from agentab.engine.profile import load_profile
from agentab.engine.scheduler import Scheduler, SchedulerConfig
from agentab.engine.spec_decode import SpecConfig
from tests.engine.test_loops_numba_scheduler import SLOT_ARRAYS, _state

CASES = {
    "plain": SpecConfig(),
    "drafts": SpecConfig(num_draft_tokens=3, acceptance_probs=(0.9, 0.6, 0.3), seed=5),
    "fixed-length": SpecConfig(num_draft_tokens=7, acceptance_length=6),
}


def _decoding(spec: SpecConfig, specialized: bool) -> Scheduler:
    """A scheduler whose eight requests have all finished their prompts and decode."""
    cfg = SchedulerConfig(
        num_blocks=400, block_size=4, max_num_seqs=16, max_num_batched_tokens=256, spec=spec
    )
    if specialized:
        cfg = SchedulerConfig(**{**vars(cfg), "decode_backend": DecodeBackend.LATENCY_SPECIALIZED})
    s = Scheduler(cfg)
    s.collect_timelines()
    rng = np.random.default_rng(1)
    for i in range(8):
        s.add(f"r{i}", rng.integers(1, 500, size=int(rng.integers(5, 40))), 20 + 7 * i)
    t = 0.0
    while not s.state.in_decode[s.run].all() or len(s.run) < 8:
        t += 1.0
        plan = s.schedule()
        s.log_times(np.array([t]))
        s.update(plan)
    return s


def _same_state(a: Scheduler, b: Scheduler) -> None:
    """Equal states up to which block id holds which content (see the module docstring)."""
    for name in SLOT_ARRAYS:
        if name != "block_table":
            assert (getattr(a.state, name) == getattr(b.state, name)).all(), name
    for s in (a, b):
        assert s.log is not None
    held = []
    for s in (a, b):
        rows = [s.state.block_table[x, : s.state.nblocks[x]] for x in s.run.tolist()]
        held.append(
            (
                [s.pool.hash[r].tolist() for r in rows],  # each row's blocks' keys, in order
                [s.pool.ref[r].tolist() for r in rows],
            )
        )
    assert held[0] == held[1]
    # everything else: the pool's counts and queue, the log, requests and counters
    sa, sb = _state(a), _state(b)
    assert sa[2:] == sb[2:]


def _run_out_alike(a: Scheduler, b: Scheduler) -> None:
    """Both run to the end with the same next turns (prompts that extend the requests' own
    prompts and outputs, so they hit blocks either side labels differently): every step and
    every counter must be the same."""
    for s in (a, b):
        for i, req in enumerate(sorted(s.requests.values(), key=lambda r: r.id)[:4]):
            s.add(f"next{i}", np.concatenate([req.tokens, [7, 8, 9]]), 5)
    t = 2000.0
    while a.has_work() or b.has_work():
        t += 1.0
        plans = [s.schedule() for s in (a, b)]
        assert plans[0].num_sched.tolist() == plans[1].num_sched.tolist()
        assert plans[0].slots.tolist() == plans[1].slots.tolist()
        out = []
        for s, plan in zip((a, b), plans, strict=True):
            s.log_times(np.array([t]))
            reqs, counts, done = s.update(plan)
            out.append(([r.id for r in reqs], counts, [r.id for r in done]))
        assert out[0] == out[1]
    assert a.counters == b.counters and a.counters["prefix_cache_hits"] > 0
    assert a.accepted_per_pos.tolist() == b.accepted_per_pos.tolist()
    if a.k:  # vLLM's per-position counter: position 0 counts every verify row that accepted
        assert a.accepted_per_pos[0] > 0
        assert a.accepted_per_pos.sum() == a.counters["spec_decode_num_accepted_tokens"]


@pytest.mark.parametrize("specialized", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_a_window_equals_its_steps_one_at_a_time(case: str, specialized: bool) -> None:
    spec = CASES[case]
    executor = SimExecutor(load_profile("gb300-tp16-kimi-k3"), spec.num_draft_tokens, spec)
    base = _decoding(spec, specialized)
    probe = copy.deepcopy(base).plan_window(256)
    assert probe is not None and probe.num_steps >= 3  # ends at the first finish
    for m in (1, 2, probe.num_steps // 2, probe.num_steps):
        windowed, stepped = copy.deepcopy(base), copy.deepcopy(base)
        w = windowed.plan_window(256)
        assert w is not None
        seconds = executor.window_seconds(w)
        times = 1000.0 + np.cumsum(seconds)[:m]
        windowed.log_times(times)
        win_reqs = windowed.requests_of(w.slots)
        win_finished = windowed.commit_window(w, m)
        finished = []
        for j in range(m):
            plan = stepped.schedule()
            assert plan.slots.tolist() == w.slots.tolist()
            assert (plan.path, plan.padded_tokens) == (w.path, w.padded_tokens)
            assert executor.step_seconds(plan) == seconds[j]  # the same price, bit for bit
            stepped.log_times(times[j : j + 1])
            reqs, counts, done = stepped.update(plan)
            got = dict(zip([r.id for r in reqs], counts, strict=True))
            want = {r.id: int(n) for r, n in zip(win_reqs, w.emitted[j], strict=True) if n}
            assert got == want
            finished += done
        assert [r.id for r in win_finished] == [r.id for r in finished]
        _same_state(windowed, stepped)
        _run_out_alike(windowed, stepped)
        if m == probe.num_steps:
            assert win_finished  # a window ends at its first finish


def test_no_window_while_a_prompt_is_computed_or_the_waiting_head_fits() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=400, block_size=4, max_num_batched_tokens=256))
    s.collect_timelines()
    s.add("a", np.arange(1, 30), 50)
    assert s.plan_window(256) is None  # nothing runs yet
    s.log_times(np.array([1.0]))
    s.update(s.schedule())  # the prompt in one chunk: decoding now
    assert s.plan_window(256) is not None
    s.add("b", np.arange(100, 120), 5)
    assert s.plan_window(256) is None  # b would be admitted: a normal step must run
