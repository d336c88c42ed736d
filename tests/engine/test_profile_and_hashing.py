"""Profile validation (one-line errors naming file and key) and the vectorized block hashes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from agentab.engine.hashing import block_hashes
from agentab.engine.kv_cache import BlockPool
from agentab.engine.profile import builtin_profiles, load_profile
from agentab.errors import AgentabError

PROFILES = Path(__file__).resolve().parents[2] / "agentab/engine/profiles"
GB300 = PROFILES / "gb300-tp16-kimi-k3.toml"


def test_builtin_profiles_load():
    assert builtin_profiles() == ["gb300-tp16-kimi-k3", "h200-tp1-kimi-shard"]
    p = load_profile("gb300-tp16-kimi-k3")
    assert (p.gpu_count, p.tp, p.num_layers, p.status) == (16, 16, 56, "published-derived")
    assert p.content_hash == hashlib.sha256(GB300.read_bytes()).hexdigest()
    assert load_profile("h200-tp1-kimi-shard").status == "measured"
    assert load_profile(GB300).content_hash == p.content_hash


@pytest.mark.parametrize("name", ["gb300-tp16-kimi-k3", "h200-tp1-kimi-shard"])
def test_every_profile_parameter_is_commented(name):
    """Each key line carries a comment or sits under one (the provenance rule of docs/engine.md)."""
    lines = (PROFILES / f"{name}.toml").read_text().splitlines()
    for i, line in enumerate(lines):
        if "=" in line and not line.lstrip().startswith("#"):
            assert "#" in line or lines[i - 1].lstrip().startswith("#"), line


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("num_layers = 56\n", "num_layers = 0\n", "num_layers: 0 out of range"),
        ("num_layers = 56\n", "num_layerz = 56\n", "num_layers: missing"),
        ("tp = 16", "foo = 1\ntp = 16", "foo: unknown key"),
        ("capacity_blocks = 373380", "capacity_blocks = 1.5", "kv_cache.capacity_blocks: must be"),
        ("step_fixed_us = 52.3", "step_fixed_us = -1", "decode.standard.step_fixed_us"),
        (
            "max_requests_by_q = [64, 32, 19, 16, 12, 10, 8, 8]",
            "max_requests_by_q = [64]",
            "8 entries",
        ),
        ('status = "published-derived"', 'status = "guess"', "status: must be one of"),
    ],
)
def test_bad_profile_is_one_line_error(tmp_path, old, new, message):
    text = GB300.read_text()
    assert old in text
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace(old, new, 1))
    with pytest.raises(AgentabError) as err:
        load_profile(bad)
    assert str(bad) in str(err.value) and message in str(err.value)
    assert "\n" not in str(err.value)


def test_layer_table_must_match_tokens(tmp_path):
    text = GB300.read_text().replace("  69.0, ", "  ", 1)
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    with pytest.raises(AgentabError, match=r"decode\.specialized\.layer_time_us: needs one value"):
        load_profile(bad)


def test_block_hash_identifies_the_whole_prefix():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 32000, size=1000)
    b = a.copy()
    b[500] += 1  # differs in block 31 (tokens 496..511)
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert len(ha) == 62  # full blocks only
    assert (ha[:31] == hb[:31]).all() and not (ha[31:] == hb[31:]).any()
    # same block content after a different prefix gets a different key (chained)
    c = np.concatenate([a[16:32], a[16:32]])
    hc = block_hashes(c, 16)
    assert hc[0] != hc[1]
    # a prefix hashes the same on its own
    assert (block_hashes(a[:320], 16) == ha[:20]).all()
    assert (ha != 0).all() and len(set(ha.tolist())) == 62


def test_block_hash_matches_a_sequential_chained_reference():
    """Equality of keys coincides with equality of whole prefixes, as with vLLM's chain."""
    rng = np.random.default_rng(1)
    base = rng.integers(0, 50, size=64)
    prompts = [base.copy() for _ in range(20)]
    for p in prompts[1:]:
        p[rng.integers(0, 64)] = rng.integers(0, 50)
    ref = {}
    for p in prompts:
        keys = block_hashes(p, 8)
        parent = b""
        for j in range(8):
            parent = hashlib.sha256(parent + p[8 * j : 8 * j + 8].tobytes()).digest()
            assert ref.setdefault(parent, int(keys[j])) == int(keys[j])
    assert len(set(ref.values())) == len(ref)


def test_block_pool_lookup_stops_at_first_miss():
    pool = BlockPool(200)
    keys = block_hashes(np.arange(16 * 150), 16)
    ids = pool.allocate(150)
    pool.register(ids, keys)
    assert (pool.lookup(keys) == ids).all()
    pool.register(ids[100:101], np.array([12345], dtype=np.uint64))  # block 100 now misses
    assert (pool.lookup(keys) == ids[:100]).all()
    pool.free(ids[::-1])
    assert pool.num_free == 200
    got = pool.allocate(60)  # 50 never-used blocks first, then the tail of the freed chain
    assert got[:50].tolist() == list(range(150, 200))
    assert got[50:].tolist() == ids[::-1][:10].tolist()
    assert len(pool.lookup(keys)) == 100  # blocks 140..149 evicted, block 100 changed


def test_block_pool_table_matches_a_dict_model_under_churn():
    """Random allocate/register/free cycles: every lookup equals a plain-dict reference."""
    rng = np.random.default_rng(5)
    pool = BlockPool(64)  # a small table so rebuilds and probe chains happen often
    chains = [block_hashes(rng.integers(0, 3, size=16 * 40), 16) for _ in range(6)]
    held: list[np.ndarray] = []
    for _ in range(400):
        chain = chains[rng.integers(len(chains))]
        n = int(rng.integers(1, 30))
        if n <= pool.num_free and rng.random() < 0.6:
            hits = pool.lookup(chain[:n])
            pool.touch(hits)
            new = pool.allocate(n - len(hits))
            pool.register(new, chain[len(hits) : n])
            held.append(np.concatenate([hits, new]))
        elif held:
            pool.free(held.pop(int(rng.integers(len(held))))[::-1])
        ref = {int(h): b for b, h in enumerate(pool.hash.tolist()) if h}
        for c in chains:
            want = []
            for h in c.tolist():
                if h not in ref:
                    break
                want.append(ref[h])
            assert pool.lookup(c).tolist() == want


def test_prefix_hashes_equal_hashing_each_prompt_from_scratch():
    """Prompts that extend, cut or change a remembered one get chain_hashes' keys exactly."""
    from agentab.engine.hashing import PrefixHashes, chain_hashes_raw

    rng = np.random.default_rng(7)
    memo = PrefixHashes(16, max_entries=3)
    base = rng.integers(1, 32000, size=16 * 60 + 5).astype(np.int32)
    variants = [
        base[:100],
        base,  # extends the last one
        np.concatenate([base, rng.integers(1, 32000, size=77).astype(np.int32)]),
        base[: 16 * 20],  # shorter: every block shared
        np.concatenate([base[:331], [7], base[332:]]).astype(np.int32),  # differs mid-block 20
        np.concatenate([[9], base[1:]]).astype(np.int32),  # another first block: a new entry
        base[:15],  # no full block
        base,
    ]
    for _ in range(3):  # other families evict the first one (max_entries=3)
        variants.append(rng.integers(1, 32000, size=16 * 5).astype(np.int32))
    variants.append(base)
    for prompt in variants:
        keys, raw = memo.hashes(prompt)
        want_keys, want_raw = chain_hashes_raw(prompt, 16)
        assert keys.tolist() == want_keys.tolist()
        assert raw.tolist() == want_raw.tolist()
    assert len(memo._memo) == 3
