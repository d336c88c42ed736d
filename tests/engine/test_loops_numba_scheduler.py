"""The scheduler's kernels (agentab.engine.loops_numba) compiled against the same functions run as
plain Python, op by op.

The scheduler has one implementation of each step phase: a kernel in agentab.engine.loops_numba,
compiled by numba. The same random stream of requests, steps, decode windows and aborts runs
through a scheduler with the compiled kernels and through one whose kernels are their plain
Python functions (`py_func`, what runs without numba); after every operation their plans,
per-slot arrays, block pools and emission logs must be equal. The hashing kernels are
compared with the numpy functions they stand in for.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from agentab.engine import loops_numba
from agentab.engine.hashing import (
    PrefixHashes,
    chain_hashes_raw,
    output_ids_from_seed,
    prompt_seed,
)
from agentab.engine.options import DecodeBackend
from agentab.engine.scheduler import Scheduler, SchedulerConfig
from agentab.engine.spec_decode import SpecConfig
from tests.engine.kernels import KERNELS, TRANSITION_KERNELS, plain_python

SLOT_ARRAYS = ("computed", "ntokens", "output", "maxtok", "nblocks", "ncached", "nhashed")
SLOT_ARRAYS += ("spec_idx", "keys", "in_decode", "block_table", "hash_table")
POOL_ARRAYS = ("ref", "hash", "gen", "_tkey", "_tblk", "shared")
POOL_SCALARS = ("_head", "_entries", "num_free", "evictions", "_used", "_next_gen")


def _state(s: Scheduler) -> tuple:
    slots = tuple(getattr(s.state, name).tobytes() for name in SLOT_ARRAYS)
    pool = tuple(getattr(s.pool, name).tobytes() for name in POOL_ARRAYS)
    scalars = tuple(getattr(s.pool, name) for name in POOL_SCALARS)
    log = s.log
    assert log is not None
    used = log.n - log.base
    emissions = (log.base, log.n, log.times[:used].tobytes(), log.counts[:, :used].tobytes())
    waiting = [r.id for r in s.waiting]
    reqs = sorted(
        (
            r.id,
            r.status,
            r.slot,
            r.num_output,
            r.cached_tokens,
            r.num_preemptions,
            r.tokens.tobytes(),
        )
        for r in s.requests.values()
    )
    per_pos = s.accepted_per_pos.tolist()
    return (slots, pool, scalars, emissions, s.run.tolist(), waiting, reqs, s.counters, per_pos)


def _plan_fields(plan) -> tuple:
    if plan is None:
        return (None,)
    out = []
    for value in vars(plan).values():
        out.append(value.tolist() if isinstance(value, np.ndarray) else value)
    return tuple(out)


def _outcome(result) -> object:
    """Comparable form of what a scheduler call returned (requests by id)."""
    if isinstance(result, tuple | list):
        return [_outcome(x) for x in result]
    if hasattr(result, "id") and hasattr(result, "tokens"):
        return result.id
    if isinstance(result, np.ndarray):
        return result.tolist()
    return result


def _config(case: str) -> SchedulerConfig:
    if case == "drafts":
        spec = SpecConfig(num_draft_tokens=3, acceptance_probs=(0.9, 0.6, 0.3), seed=5)
        return SchedulerConfig(
            num_blocks=220, block_size=4, max_num_seqs=6, max_num_batched_tokens=40, spec=spec
        )
    if case == "specialized":
        return SchedulerConfig(
            num_blocks=400,
            block_size=4,
            max_num_seqs=8,
            max_num_batched_tokens=48,
            decode_backend=DecodeBackend.LATENCY_SPECIALIZED,
            specialized_max_padded=8,
            specialized_max_requests_by_q=(8,),
        )
    # "pressure": few blocks, so admission blocks and running requests get preempted
    return SchedulerConfig(num_blocks=60, block_size=4, max_num_seqs=5, max_num_batched_tokens=24)


def _step(s: Scheduler, t: float) -> tuple:
    """One scheduled step, applied with its end time logged."""
    plan = s.schedule()
    if plan.total_tokens == 0:
        return _plan_fields(plan), None
    s.log_times(np.array([t]))
    return _plan_fields(plan), s.update(plan)


def _window(s: Scheduler, steps: int, frac: float, t: float) -> tuple | None:
    """A decode window of up to `steps` steps, of which a fraction `frac` is committed."""
    w = s.plan_window(steps)
    if w is None:
        return None
    m = min(1 + int(frac * w.num_steps), w.num_steps)
    s.log_times(t + 0.001 * np.arange(1, m + 1))
    return _plan_fields(w), m, s.commit_window(w, m)


def _run_ops(case: str, seed: int) -> list[tuple]:
    """A random stream of operations on one scheduler: each one's result and the state after."""
    rng = np.random.default_rng(seed)
    s = Scheduler(_config(case))
    s.collect_timelines()
    # conversations: a new turn extends an earlier prompt (prefix hits, hash reuse)
    contexts = [rng.integers(1, 500, size=int(rng.integers(5, 30))) for _ in range(4)]
    t, n_req = 0.0, 0
    trace = []
    for _ in range(500):
        action = int(rng.integers(10))
        call: Callable[[], object]
        if action < 2 and len(s.requests) < 9:
            c = int(rng.integers(len(contexts)))
            grown = rng.integers(1, 500, size=int(rng.integers(1, 12)))
            contexts[c] = np.concatenate([contexts[c], grown])[:60]
            args = (f"r{n_req}", contexts[c].copy(), int(rng.integers(1, 40)))
            n_req += 1
            op, call = "add", lambda a=args: s.add(*a)
        elif action == 2 and s.requests:
            rid = sorted(s.requests)[int(rng.integers(len(s.requests)))]
            op, call = "abort", lambda r=rid: s.abort(r)
        elif action < 6:
            t += 0.01
            op, call = "step", lambda t=t: _step(s, t)
        else:
            steps, frac = int(rng.integers(2, 9)), float(rng.random())
            op, call = "window", lambda a=(steps, frac, t): _window(s, *a)
        trace.append((op, _outcome(call()), _state(s)))
    return trace


@pytest.mark.parametrize("case", ["pressure", "drafts", "specialized"])
@pytest.mark.parametrize("seed", range(3))
def test_compiled_kernels_match_their_plain_python_op_by_op(
    monkeypatch, case: str, seed: int
) -> None:
    fast = _run_ops(case, seed)
    with plain_python(monkeypatch):
        plain = _run_ops(case, seed)
    assert len(fast) == len(plain)
    for a, b in zip(fast, plain, strict=True):
        assert a == b, a[0]
    assert sum(op == "add" for op, _, _ in fast) > 50
    if case == "pressure":
        assert fast[-1][2][-2]["num_preemptions"] > 0  # the pressure path ran


@pytest.mark.skipif(not loops_numba.ENABLED, reason="numba not in use")
def test_every_kernel_is_compiled() -> None:
    assert len(KERNELS) >= 20
    fused = {"admit_head", "admit_row", "schedule_running", "commit_rows", "leave_rows"}
    assert fused | {"release_rows"} <= set(TRANSITION_KERNELS)


def test_hash_kernels_match_the_numpy_functions() -> None:
    rng = np.random.default_rng(7)
    for n in (0, 5, 16, 47, 160, 1000):
        tokens = rng.integers(1, 32000, size=n).astype(np.int32)
        for first, prev in ((0, 0), (3, 0x1234567890ABCDEF)):
            keys, raws = chain_hashes_raw(tokens, 16, first, prev)
            nb = n // 16
            got_k = np.empty(nb, dtype=np.uint64)
            got_r = np.empty(nb, dtype=np.uint64)
            shifted = np.concatenate([np.zeros(first * 16, dtype=np.int32), tokens])
            last = loops_numba.chain_into(
                shifted, first, first + nb, 16, np.uint64(prev), got_k, got_r
            )
            assert got_k.tolist() == keys.tolist() and got_r.tolist() == raws.tolist()
            assert int(last) == (int(raws[-1]) if nb else prev)
        _, raws = chain_hashes_raw(tokens, 16)
        raw = int(raws[-1]) if len(raws) else 0
        want = output_ids_from_seed(prompt_seed(tokens, raw, (n // 16) * 16), 37)
        buf = np.zeros(n + 37, dtype=np.int64)
        buf[:n] = tokens
        loops_numba.synthetic_output(buf, n, (n // 16) * 16, np.uint64(raw), 32000)
        assert buf[n:].tolist() == want.tolist()
    a = np.arange(10)
    b = a.copy()
    b[6] = -1
    assert loops_numba.first_diff(a, b, 10) == 6 and loops_numba.first_diff(a, b, 6) == 6


def test_prefix_hashes_reuse_matches_hashing_from_scratch(monkeypatch) -> None:
    """PrefixHashes gives chain_hashes_raw's keys for prompts that share, extend or part from
    a remembered one, compiled and as plain Python."""
    rng = np.random.default_rng(3)
    base = rng.integers(1, 32000, size=200)
    prompts = [base[:100], base[:180], np.concatenate([base[:50], [7, 7, 7]]), base[:16], base]

    def check() -> None:
        memo = PrefixHashes(16)
        for p in prompts:
            keys, raws = memo.hashes(p, keep=p.astype(np.int64))
            want_keys, want_raws = chain_hashes_raw(p, 16)
            assert keys.tolist() == want_keys.tolist() and raws.tolist() == want_raws.tolist()

    check()
    with plain_python(monkeypatch):
        check()
