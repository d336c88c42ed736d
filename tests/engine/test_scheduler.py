"""Hand-computed step-by-step expectations for the vLLM-V1-style scheduler.

Small block sizes and budgets keep the arithmetic checkable by hand; each test says in comments
how its numbers follow from the rules (docs/engine.md, "Scheduling semantics").
"""

from __future__ import annotations

import numpy as np

from agentab.engine.hashing import synthetic_output_ids
from agentab.engine.scheduler import Scheduler, SchedulerConfig
from agentab.engine.spec_decode import SpecConfig


def prompt(n: int, start: int) -> np.ndarray:
    """n distinct token ids from `start` (distinct starts give prompts sharing no block)."""
    return np.arange(start, start + n, dtype=np.int64)


def step(s: Scheduler):
    """One scheduling step and its update; returns (ids and tokens scheduled, emitted, plan)."""
    plan = s.schedule()
    ids = [s.slot_req[x].id for x in plan.slots.tolist()]
    sched = dict(zip(ids, plan.num_sched.tolist(), strict=True))
    reqs, counts, finished = s.update(plan)
    emitted = {r.id: n for r, n in zip(reqs, counts, strict=True)}
    return sched, emitted, plan, [r.id for r in finished]


def make(**kw) -> Scheduler:
    return Scheduler(SchedulerConfig(**kw))


def test_budget_split_running_first_then_waiting():
    s = make(num_blocks=100, block_size=4, max_num_batched_tokens=10)
    s.add("A", prompt(6, 1000), 3)
    # step 1: A alone, whole 6-token prompt; prefill complete -> its first token
    assert step(s)[:2] == ({"A": 6}, {"A": 1})
    s.add("B", prompt(12, 2000), 2)
    # step 2: running A first (1 decode token), then B gets the other 9 of the budget (chunk)
    sched, emitted, plan, _ = step(s)
    assert sched == {"A": 1, "B": 9} and emitted == {"A": 1}
    assert plan.num_prefill_tokens == 9 and plan.num_decode_tokens == 1
    # step 3: A 1, B its last 3 prompt tokens -> A's 3rd token (finished), B's first
    sched, emitted, _, finished = step(s)
    assert sched == {"A": 1, "B": 3} and emitted == {"A": 1, "B": 1} and finished == ["A"]
    # step 4: B decodes its second and last token
    assert step(s)[0] == {"B": 1}
    assert not s.has_work()


def test_chunked_prefill_of_a_long_prompt():
    s = make(num_blocks=100, block_size=4, max_num_batched_tokens=10)
    req = s.add("L", prompt(25, 1), 2)
    expected = [(10, 3, 2), (10, 5, 5), (5, 7, 6)]  # (chunk, blocks held, blocks cached)
    for i, (chunk, held, cached) in enumerate(expected):
        sched, emitted, _, _ = step(s)
        assert sched == {"L": chunk}
        assert emitted == ({"L": 1} if i == 2 else {})  # a token only when the prompt is done
        assert s.state.nblocks[req.slot] == held  # ceil(computed / 4)
        assert s.state.ncached[req.slot] == cached  # floor(computed / 4) full blocks
    assert step(s)[:2] == ({"L": 1}, {"L": 1})


def test_admission_blocks_when_blocks_run_out_head_of_line():
    s = make(num_blocks=10, block_size=4, max_num_batched_tokens=100)
    s.add("A", prompt(20, 1), 4)  # 5 blocks
    assert step(s)[0] == {"A": 20}
    s.add("B", prompt(24, 100), 1)  # needs 6 blocks: only 5 free
    s.add("C", prompt(4, 200), 1)  # would fit (1 block) but waits behind B
    # A's first decode step holds ceil(21/4) = 6 blocks -> 4 free: B (6) still does not fit
    for _ in range(3):
        sched, _, plan, finished = step(s)
        assert sched == {"A": 1} and plan.num_waiting == 2
    assert finished == ["A"]  # A's 4th token; its blocks are freed
    # now B is admitted, and C behind it (B takes 6 blocks, C 1 of the remaining 4)
    assert step(s)[0] == {"B": 24, "C": 4}


def test_preemption_of_latest_and_readmission_with_own_prefix_hit():
    s = make(num_blocks=8, block_size=4, max_num_batched_tokens=100)
    a = s.add("A", prompt(8, 1), 10)
    b = s.add("B", prompt(8, 100), 10)
    assert step(s)[0] == {"A": 8, "B": 8}  # 2 blocks each
    # step s >= 2 computes token 8 + s - 2 and needs ceil((8 + s - 1) / 4) blocks: a 3rd block
    # at s = 2, a 4th at s = 6 (all 8 used), a 5th at s = 10 -> no free block
    for _ in range(2, 10):
        sched, _, plan, _ = step(s)
        assert sched == {"A": 1, "B": 1} and plan.preempted == []
    assert s.pool.num_free == 0
    # step 10: A cannot grow; the most recently admitted running request (B) is preempted,
    # its 4 blocks go to the LRU tail B3, B2, B1, B0; A's new block evicts the head (B3).
    # Nothing is admitted in a step that preempted. A emits its 10th token and finishes.
    sched, _, plan, finished = step(s)
    assert sched == {"A": 1} and plan.preempted == ["B"] and finished == ["A"]
    assert list(s.waiting) == [b] and b.num_output == 9 and a.slot == -1
    # step 11: B re-admitted: 8 prompt + 9 output = 17 tokens, hit at most (17-1)//4 = 4
    # blocks, of which B0..B2 survive (B3 was evicted): 12 cached, 5 recomputed; the re-prefill
    # samples B's 10th and last token. Its reported cached_tokens stays that of its first
    # admission (0); the preempted hit is counted apart.
    sched, emitted, _, finished = step(s)
    assert sched == {"B": 5} and emitted == {"B": 1} and finished == ["B"]
    assert b.cached_tokens == 0
    assert s.counters["num_preemptions"] == 1
    assert s.counters["prefix_cache_preempted_queries"] == 17
    assert s.counters["prefix_cache_preempted_hits"] == 12
    assert s.counters["prefix_cache_queries"] == 16 and s.counters["prefix_cache_hits"] == 0


def run_to_end(s: Scheduler) -> None:
    while s.has_work():
        step(s)


def test_cached_tokens_of_a_three_turn_session():
    s = make(num_blocks=1000, block_size=16, max_num_batched_tokens=8192)
    p1 = prompt(50, 1)
    r1 = s.add("t1", p1, 20)
    run_to_end(s)
    # turn 1 computed 50 + 19 tokens (the last sampled token is never fed back): 4 full blocks
    assert r1.cached_tokens == 0
    p2 = np.concatenate([p1, synthetic_output_ids(p1, 20), prompt(10, 5000)])  # 80 tokens
    r2 = s.add("t2", p2, 15)
    run_to_end(s)
    assert r2.cached_tokens == 64  # 4 blocks of turn 1's prompt + output
    p3 = np.concatenate([p2, synthetic_output_ids(p2, 15), prompt(6, 6000)])  # 101 tokens
    r3 = s.add("t3", p3, 5)
    run_to_end(s)
    assert r3.cached_tokens == 80  # turn 2 computed 80 + 14 = 94 tokens: 5 full blocks
    # a prompt that is entirely cached still recomputes its last token: 64 tokens -> 48 hit
    r4 = s.add("t4", p3[:64], 1)
    run_to_end(s)
    assert r4.cached_tokens == 48
    assert s.counters["prefix_cache_queries"] == 50 + 80 + 101 + 64
    assert s.counters["prefix_cache_hits"] == 0 + 64 + 80 + 48


def test_lru_eviction_order_under_pressure():
    s = make(num_blocks=10, block_size=4, max_num_batched_tokens=100)
    a = s.add("A", prompt(12, 1), 1)  # blocks 0, 1, 2 (head of the initial queue)
    run_to_end(s)
    b = s.add("B", prompt(12, 100), 1)  # blocks 3, 4, 5
    run_to_end(s)
    # frees are tail first: queue = 6 7 8 9 | A: 2 1 0 | B: 5 4 3
    assert s.pool.free_order() == [6, 7, 8, 9, 2, 1, 0, 5, 4, 3]
    c = s.add("C", prompt(24, 200), 1)  # 6 blocks: 6 7 8 9, then A's 2 and 1 are evicted
    run_to_end(s)
    assert len(s.pool.lookup(a.hashes)) == 1  # A's first block survived
    assert len(s.pool.lookup(b.hashes)) == 3  # B untouched
    assert len(s.pool.lookup(c.hashes)) == 6
    assert s.pool.evictions == 2
    # C's blocks went back tail first behind B's
    assert s.pool.free_order() == [0, 5, 4, 3, 1, 2, 9, 8, 7, 6]
    b2 = s.add("B2", prompt(12, 100), 1)  # hits B0 B1 (at most 11 tokens), takes block 0
    run_to_end(s)
    a2 = s.add("A2", prompt(12, 1), 1)  # A0 was just evicted by B2: no hit
    run_to_end(s)
    assert (b2.cached_tokens, a2.cached_tokens) == (8, 0)


def test_spec_decode_token_counts_per_step_fixed_length():
    spec = SpecConfig(num_draft_tokens=3, acceptance_length=3)
    s = make(num_blocks=100, block_size=4, max_num_batched_tokens=100, spec=spec)
    s.add("S", prompt(5, 1), 9)
    # step 1: prefill 5 -> 1 token; then verify steps of 1 + 3 = 4 tokens emitting 3 each,
    # the last capped at max_tokens: 1 + 3 + 3 + 2 = 9
    got = [step(s)[:2] for _ in range(4)]
    assert got == [
        ({"S": 5}, {"S": 1}),
        ({"S": 4}, {"S": 3}),
        ({"S": 4}, {"S": 3}),
        ({"S": 4}, {"S": 2}),
    ]
    c = s.counters
    assert c["spec_decode_num_drafts"] == 3
    assert c["spec_decode_num_draft_tokens"] == 9
    assert c["spec_decode_num_accepted_tokens"] == 6  # 2 per verify, counted before the cap
    assert c["generation_tokens"] == 9


def test_spec_decode_per_position_probabilities():
    """vLLM's synthetic verify loop: conditional rates c_i = p_i / p_{i-1} (float32), one
    uniform per draft position, the first rejection ends the loop."""
    from agentab.engine.spec_decode import position_uniforms, request_key

    probs = (0.9, 0.5, 0.2)
    spec = SpecConfig(num_draft_tokens=3, acceptance_probs=probs, seed=7)
    s = make(num_blocks=1000, block_size=16, max_num_batched_tokens=100, spec=spec)
    s.add("P", prompt(5, 1), 1000)
    step(s)
    u = position_uniforms(7, np.array([request_key("P")], dtype=np.uint64), np.arange(50), 3)
    cond = [np.float32(0.9), np.float32(0.5 / 0.9), np.float32(0.2 / 0.5)]
    want = []
    for row in u:
        accepted = 0
        while accepted < 3 and row[accepted] < cond[accepted]:
            accepted += 1
        want.append(accepted + 1)
    got = [step(s)[1]["P"] for _ in range(50)]
    assert got == want
    assert s.counters["spec_decode_num_accepted_tokens"] == sum(want) - 50
    # the unconditional rates are reproduced on average
    acc = spec.accepted(np.uint64(request_key("P")), np.arange(200000), np.int64(3))
    for i, p in enumerate(probs):
        assert abs((acc > i).mean() - p) < 0.005, i


def test_partial_drafts_when_the_budget_runs_out():
    spec = SpecConfig(num_draft_tokens=3, acceptance_length=4)
    s = make(num_blocks=100, block_size=4, max_num_batched_tokens=6, spec=spec)
    s.add("X", prompt(3, 1), 50)
    s.add("Y", prompt(3, 100), 50)
    assert step(s)[:2] == ({"X": 3, "Y": 3}, {"X": 1, "Y": 1})
    # budget 6: X verifies 1 + 3; Y gets the remaining 2 = 1 + 1 draft (a partial verify)
    sched, emitted, plan, _ = step(s)
    assert sched == {"X": 4, "Y": 2} and emitted == {"X": 4, "Y": 2}
    assert plan.drafts.tolist() == [3, 1]


def test_preemption_takes_the_latest_admitted_first_and_prepends():
    s = make(num_blocks=6, block_size=4, max_num_batched_tokens=100)
    for name, start in (("A", 1), ("B", 100), ("C", 200)):
        s.add(name, prompt(4, start), 20)
    assert step(s)[0] == {"A": 4, "B": 4, "C": 4}  # 1 block each
    # each step computes token 4 + (step - 2); a request needs ceil((computed + 1) / 4) blocks:
    # 2 blocks from step 2 (all 6 used), a 3rd at step 6 (computed 8 + 1 = 9)
    for _ in range(2, 6):
        assert step(s)[2].preempted == []
    sched, _, plan, _ = step(s)  # step 6: A needs a block -> C (latest) goes, frees 2
    assert plan.preempted == ["C"] and sched == {"A": 1, "B": 1}
    assert [r.id for r in s.waiting] == ["C"]
    for _ in range(7, 10):  # C cannot come back: 0 free blocks and B, A keep growing
        assert step(s)[0] == {"A": 1, "B": 1}
    sched, _, plan, _ = step(s)  # step 10: A needs its 4th block -> B is now the latest
    assert plan.preempted == ["B"] and sched == {"A": 1}
    assert [r.id for r in s.waiting] == ["B", "C"]  # preempted requests go to the head
    assert s.counters["num_preemptions"] == 2


def test_a_verify_step_at_the_end_of_a_request_fits_its_block_table():
    """The last verify steps of a request reach 2k tokens past its last one (k drafts and k
    lookahead slots): its block table must hold them, whatever the power-of-two growth gives."""
    spec = SpecConfig(num_draft_tokens=7, acceptance_length=1)
    s = make(num_blocks=1000, block_size=4, max_num_batched_tokens=512, spec=spec)
    s.add("R", prompt(199, 1), 50)  # 249 tokens + 7 = 256: exactly the first table's 64 columns
    emitted = 0
    while s.has_work():
        emitted += sum(step(s)[1].values())
    assert emitted == 50
