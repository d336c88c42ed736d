"""The compiled kernels (agentab.engine.loops_numba): compiled against their plain-Python run, and
against the numpy code of the same arithmetic where there is one.

The block pool's operations run on two pools, one with the compiled kernels and one with their
Python functions (`tests.engine.kernels.plain_python`, what runs without numba); the simulation
test runs a whole simulation with AGENTAB_NUMBA=0 and with numba in subprocesses and compares
every record byte for byte.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from agentab.engine import loops_numba
from agentab.engine.kv_cache import BlockPool
from agentab.engine.spec_decode import SpecConfig
from agentab.rundir import scan_metrics, scan_records
from agentab.workloads.generator import generate, load_config
from agentab.workloads.native import dump_native
from tests.engine.kernels import plain_python

ROOT = Path(__file__).resolve().parents[2]


def _state(pool: BlockPool) -> tuple:
    tail = pool._head + pool._entries  # the free queue's buffer up to its tail
    queue = (pool._qids[:tail].tolist(), pool._qgens[:tail].tolist())
    arrays = (pool.ref, pool.hash, pool.gen, pool._tkey, pool._tblk, pool.shared)
    scalars = (pool._head, pool._entries, pool.num_free, pool.evictions, pool._used)
    return (*(a.tobytes() for a in arrays), scalars, queue, pool._table_size)


def _both(monkeypatch, pools: tuple[BlockPool, BlockPool], op: str, *args):
    """Run `op` on the compiled pool and on the plain-Python one; both results."""

    def call(pool: BlockPool):
        return getattr(pool, op)(*[a.copy() if isinstance(a, np.ndarray) else a for a in args])

    out = [call(pools[0])]
    with plain_python(monkeypatch):
        out.append(call(pools[1]))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_pool_kernels_leave_the_same_state_compiled_and_plain(monkeypatch, seed: int) -> None:
    """Allocation, registration (duplicate keys, keys of evicted blocks, table rebuilds),
    lookups and frees give the same ids, and the same queue and table, step by step."""
    rng = np.random.default_rng(seed)
    pools = (BlockPool(300), BlockPool(300))
    held: list[np.ndarray] = []
    keyspace = rng.integers(1, 2**63, size=120, dtype=np.int64).astype(np.uint64) | np.uint64(1)
    for _ in range(400):
        action = rng.integers(4)
        if action == 0 and pools[0].num_free:
            n = int(rng.integers(1, min(40, pools[0].num_free) + 1))
            a, b = _both(monkeypatch, pools, "allocate", n)
            assert a.tolist() == b.tolist()
            held.append(a)
        elif action == 1 and held:
            ids = held[int(rng.integers(len(held)))]
            keys = keyspace[rng.integers(0, len(keyspace), size=len(ids))]  # duplicates too
            _both(monkeypatch, pools, "register", ids, keys)
        elif action == 2:
            keys = keyspace[rng.permutation(len(keyspace))[: int(rng.integers(1, 60))]]
            cached = [pools[0].hash[ids] for ids in held]
            cached = [k[: np.argmin(k != 0)] if (k == 0).any() else k for k in cached]
            cached = [k for k in cached if len(k)]
            if cached and rng.random() < 0.7:  # a held row's keys: leading hits
                keys = np.concatenate([cached[int(rng.integers(len(cached)))], keys[:3]])
            a, b = _both(monkeypatch, pools, "lookup", keys)
            assert a.tolist() == b.tolist()
            # guessed blocks (a holder of the key, shared or not; any block; none) change
            # nothing: the same hits and free count as probing every key
            want = pools[0].lookup_free(keys, np.zeros(0, dtype=np.int64))
            holders = [np.flatnonzero(pools[0].hash == key) for key in keys]
            for _ in range(3):
                guess = rng.integers(-1, 300, size=int(rng.integers(1, len(keys) + 3)))
                for i in range(min(len(keys), len(guess))):
                    if len(holders[i]) and rng.random() < 0.8:
                        guess[i] = rng.choice(holders[i])
                for got in _both(monkeypatch, pools, "lookup_free", keys, guess):
                    assert (got[0].tolist(), got[1]) == (want[0].tolist(), want[1])
        elif held:
            ids = held.pop(int(rng.integers(len(held))))
            _both(monkeypatch, pools, "free", ids[::-1])
        assert _state(pools[0]) == _state(pools[1])


def test_block_table_kernels_match_the_ragged_numpy_updates() -> None:
    rng = np.random.default_rng(5)
    table = rng.integers(0, 1000, size=(8, 32), dtype=np.int64)
    hashes = rng.integers(1, 2**63, size=(8, 32), dtype=np.int64).astype(np.uint64)
    nblocks = rng.integers(0, 10, size=8, dtype=np.int64)
    slots = np.array([5, 0, 3, 7], dtype=np.int64)
    need = np.array([2, 0, 5, 1], dtype=np.int64)
    ids = np.arange(100, 108, dtype=np.int64)
    expect_table, expect_n, at = table.copy(), nblocks.copy(), 0
    for s, c in zip(slots, need, strict=True):
        expect_table[s, expect_n[s] : expect_n[s] + c] = ids[at : at + c]
        expect_n[s] += c
        at += c
    loops_numba.fill_rows(table, nblocks, slots, need, ids)
    assert (table == expect_table).all() and (nblocks == expect_n).all()

    ncached = np.array([1, 0, 4, 2, 0, 3, 0, 9], dtype=np.int64)
    full = np.array([6, 0, 2, 4], dtype=np.int64)
    got_ids, got_keys = loops_numba.newly_full(table, hashes, ncached.copy(), slots, full)
    want_ids = [table[s, j] for s, f in zip(slots, full, strict=True) for j in range(ncached[s], f)]
    want_keys = [
        hashes[s, j] for s, f in zip(slots, full, strict=True) for j in range(ncached[s], f)
    ]
    assert got_ids.tolist() == want_ids and got_keys.tolist() == want_keys


def test_a_simulation_without_numba_gives_the_same_records(tmp_path: Path) -> None:
    """Plain-Python kernels (AGENTAB_NUMBA=0) and the default path, under KV-cache pressure with
    preemptions and drafts (every kernel runs), write identical records."""
    workload = tmp_path / "w.jsonl"
    dump_native(generate(load_config("agentx-coding"), 24, 3), workload)
    frames = []
    for flag in ("0", "1"):
        out = tmp_path / f"run{flag}"
        cmd = [sys.executable, "-m", "agentab", "simulate", str(workload), "--out", str(out)]
        cmd += ["--quiet", "--profile", "gb300-tp16-kimi-k3", "--concurrency", "12"]
        cmd += ["--duration", "120", "--kv-blocks", "9000", "--max-num-seqs", "8"]
        cmd += ["--num-draft-tokens", "3", "--acceptance-length", "2.5", "--scrape-metrics"]
        env = {**os.environ, "AGENTAB_NUMBA": flag, "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-2000:]
        frames.append(scan_records(out).collect())
        metrics = scan_metrics(out).collect()
        preemptions = metrics.filter(pl.col("name") == "vllm:num_preemptions_total")["value"]
        assert preemptions.max() > 0  # the pressure path ran
    assert frames[0].height > 20
    assert frames[0].equals(frames[1])


@pytest.mark.parametrize(
    "spec",
    [
        SpecConfig(7, acceptance_probs=(0.9, 0.82, 0.74, 0.66, 0.58, 0.5, 0.42), seed=3),
        SpecConfig(7, acceptance_length=3.8),
        SpecConfig(2, acceptance_probs=(0.5, 0.0), seed=1 << 70),
    ],
)
def test_compiled_acceptance_draws_equal_the_numpy_ones(monkeypatch, spec) -> None:
    """SpecConfig.accepted through the compiled verify loop gives numpy's draws exactly, for a
    window's broadcast (steps, rows) matrices and a step's rows alike, partial verifies too."""
    from agentab.engine import spec_decode

    rng = np.random.default_rng(7)
    keys = rng.integers(0, 2**63, size=(1, 40), dtype=np.int64).astype(np.uint64) * np.uint64(2)
    index = rng.integers(0, 500, size=(1, 40)) + np.arange(30)[:, None]
    drafts = rng.integers(0, spec.num_draft_tokens + 2, size=(1, 40))
    cases = [(keys, index, drafts), (keys[0], index[3], drafts[0]), (keys[0, :1], 5, 1)]
    got = [spec.accepted(*case) for case in cases]
    monkeypatch.setattr(spec_decode.loops_numba, "ENABLED", False)
    want = [spec.accepted(*case) for case in cases]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == np.int64 and g.shape == w.shape
        assert np.array_equal(g, w)
    assert 0 < int(got[0].sum()) < got[0].size * spec.num_draft_tokens


@pytest.mark.parametrize(
    "spec",
    [
        SpecConfig(7, acceptance_probs=(0.9, 0.82, 0.74, 0.66, 0.58, 0.5, 0.42), seed=3),
        SpecConfig(2, acceptance_probs=(1.0, 0.0)),
    ],
)
def test_a_steps_rows_draw_what_the_broadcast_draws_give(monkeypatch, spec) -> None:
    """SpecConfig.accepted on a step's rows (1-D, the plan's dtypes: no broadcasting) equals
    its broadcast form with and without the compiled loop, prefill rows (0 drafts) and counters
    past 2**31 included."""
    from agentab.engine import spec_decode

    rng = np.random.default_rng(11)
    keys = rng.integers(0, 2**63, size=64, dtype=np.int64).astype(np.uint64) * np.uint64(2)
    index = rng.integers(0, 2**40, size=64, dtype=np.int64)
    drafts = rng.integers(0, spec.num_draft_tokens + 1, size=64).astype(np.int64)
    got = spec.accepted(keys, index, drafts)
    want = spec.accepted(keys[None], index[None], drafts[None])[0]
    monkeypatch.setattr(spec_decode.loops_numba, "ENABLED", False)
    for g in (got, spec.accepted(keys, index, drafts)):
        assert g.dtype == np.int64 and g.shape == (64,)
        assert np.array_equal(g, want)
    assert np.array_equal(want, spec.accepted(keys, index, drafts))
    assert int(got[drafts == 0].sum()) == 0 < int(got.sum())


@pytest.mark.parametrize(
    "spec",
    [
        SpecConfig(7, acceptance_probs=(0.9, 0.82, 0.74, 0.66, 0.58, 0.5, 0.42), seed=3),
        SpecConfig(7, acceptance_length=6),  # rates of 0 and 1: every draw decided
    ],
)
def test_a_windows_draws_are_the_verify_steps_accepted_drafts(monkeypatch, spec) -> None:
    """window_steps draws each step's acceptances as it reaches the step: the rows it planned
    are SpecConfig.accepted of the slots' keys at their verify indices plus the step, compiled
    and as plain Python, and it stops at the first finish (rows past it are never drawn)."""
    k = spec.num_draft_tokens
    rng = np.random.default_rng(11)
    slots = 12
    keys = rng.integers(0, 2**63, size=slots, dtype=np.int64).astype(np.uint64) * np.uint64(2)
    spec_idx = rng.integers(0, 300, size=slots).astype(np.int64)
    run = np.array([7, 2, 9, 0, 5], dtype=np.int64)
    B, horizon = len(run), 40
    computed = rng.integers(100, 900, size=slots).astype(np.int64)
    nblocks = -(-computed // 16) + 1
    remaining = np.array([300, 250, 120, 400, 310], dtype=np.int64)
    want = spec.accepted(keys[run][None, :], spec_idx[run] + np.arange(horizon)[:, None], k)
    seed, cond, whole = spec.draws()
    outs = []
    for fn in (loops_numba.window_steps, loops_numba.window_steps.py_func):
        acc = np.full((horizon, B), -7, dtype=np.int64)
        cum = np.empty((horizon, B), dtype=np.int64)
        emitted = np.empty((horizon, B), dtype=np.int64)
        context = np.empty(horizon, dtype=np.int64)
        with plain_python(monkeypatch):  # the plain function calls the plain verify_run
            n = fn(run, computed, remaining, nblocks, acc, keys, spec_idx, seed, cond, whole,
                   k, 16, 10_000, cum, emitted, context)  # fmt: skip
        outs.append((n, acc))
    (n, acc), (n_plain, acc_plain) = outs
    assert n == n_plain and 2 < n < horizon
    assert np.array_equal(acc[:n], want[:n]) and np.array_equal(acc_plain, acc)
    assert (acc[n:] == -7).all()  # the steps after the first finish were not drawn
    assert (cum[n - 1] >= remaining).any() and not (cum[n - 2] >= remaining).any()


def test_a_rebuild_at_the_same_size_clears_the_table_in_place() -> None:
    """A rebuild that keeps the table's size reuses its buffer (a new one would fault every page
    in again) and leaves the table exactly as inserting the live blocks into a new pool's does."""
    rng = np.random.default_rng(3)
    pool = BlockPool(300)
    keys = rng.integers(1, 2**63, size=200, dtype=np.int64).astype(np.uint64) | np.uint64(1)
    ids = pool.allocate(200)
    pool.register(ids, keys)
    pool.free(ids[:150])
    pool.allocate(250)  # evicts 150 of the freed blocks: their entries go dead
    before, size = pool._tkey, pool._table_size
    pool._rebuild(0)
    live = np.flatnonzero(pool.hash)
    assert len(live) == 50 and pool._table_size == size == 4096
    assert np.shares_memory(pool._tkey, before)
    fresh = BlockPool(300)
    fresh._insert(live.astype(np.int64), pool.hash[live])
    assert pool._tkey.tobytes() == fresh._tkey.tobytes()
    assert pool._tblk.tobytes() == fresh._tblk.tobytes()
    assert pool._used == fresh._used == 50 and (pool._tblk == -1).sum() == size - 50


def test_window_horizon_writes_the_rows_remaining_output_and_computed_tokens() -> None:
    """window_horizon returns the smallest remaining output of the decoding rows and writes
    each row's remaining output and computed tokens (what the window's plan reads); a row not
    decoding with one token to compute gives 0."""
    run = np.array([4, 1, 6], dtype=np.int64)
    in_decode = np.ones(8, dtype=np.bool_)
    computed = np.arange(100, 108, dtype=np.int64)
    ntokens = computed + 1
    maxtok = np.full(8, 50, dtype=np.int64)
    output = np.array([0, 9, 0, 0, 44, 0, 13, 0], dtype=np.int64)
    for fn in (loops_numba.window_horizon, loops_numba.window_horizon.py_func):
        remaining = np.full(3, -1, dtype=np.int64)
        computed0 = np.full(3, -1, dtype=np.int64)
        args = (run, in_decode, ntokens, computed, maxtok, output, remaining, computed0)
        assert fn(*args) == 6
        assert remaining.tolist() == [6, 41, 37]
        assert computed0.tolist() == [104, 101, 106]
        in_decode[1] = False
        assert fn(*args) == 0
        in_decode[1] = True
        ntokens[6] += 1  # row 6 has two tokens to compute: a normal step
        assert fn(*args) == 0
        ntokens[6] -= 1
