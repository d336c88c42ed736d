"""The AgentX-style generator: determinism, prefix-consistent hash ids, joins, caps, calibration."""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import pytest

from agentab.errors import AgentabError
from agentab.workloads import Request, Subagent, Workload, load
from agentab.workloads.generator import GeneratorConfig, generate, load_config
from agentab.workloads.stats import summarize

CFG = load_config("agentx-coding")


@pytest.fixture(scope="module")
def wl() -> Workload:
    return generate(CFG, 60, 42)


def agent_lists(items) -> list[list[Request]]:
    own = [i for i in items if isinstance(i, Request)]
    out = [own]
    for i in items:
        if isinstance(i, Subagent):
            out.extend(agent_lists(i.items))
    return out


def test_deterministic_per_seed_and_prefix_stable() -> None:
    a = generate(CFG, 4, 7)
    assert a.content_hash == generate(CFG, 4, 7).content_hash
    assert a.content_hash != generate(CFG, 4, 8).content_hash
    # session i depends only on (seed, i): a smaller run is a prefix of a larger one
    assert generate(CFG, 2, 7).sessions == a.sessions[:2]
    assert [s.id for s in a.sessions] == [f"agentx-7-{i:05d}" for i in range(4)]


def test_hash_ids_follow_prefix_growth(wl: Workload) -> None:
    resets = growth = 0
    for s in wl.sessions:
        bs = s.block_size
        for reqs in agent_lists(s.items):
            for r in reqs:
                assert len(r.hash_ids) == r.in_tokens // bs  # every full block has an id
                assert r.in_tokens + r.out_tokens <= CFG.context_cap
            for prev, r in pairwise(reqs):
                if r.hash_ids[: len(prev.hash_ids)] == prev.hash_ids:
                    # pure suffix growth: previous prompt + previous output + a new suffix,
                    # so the ids cover at least the blocks of prompt + output
                    growth += 1
                    assert r.in_tokens > prev.in_tokens + prev.out_tokens
                    assert len(r.hash_ids) >= (prev.in_tokens + prev.out_tokens) // bs
                else:
                    # a reset/compaction keeps the session's system+tools prefix blocks
                    resets += 1
                    n = (s.system_tokens + s.tool_tokens) // bs if r.kind == "parent" else 1
                    assert r.hash_ids[:n] == reqs[0].hash_ids[:n]
    assert growth > 10_000
    assert 0.005 < resets / (growth + resets) < 0.03  # ~98% of turns are pure suffix growth


def test_ids_are_local_and_unique_per_new_block(wl: Workload) -> None:
    s = wl.sessions[0]
    first_use: dict[int, int] = {}
    for r in s.all_requests():
        for pos, h in enumerate(r.hash_ids):
            # an id always sits at the same position: it names one block of one prefix chain
            assert first_use.setdefault(h, pos) == pos


def test_foreground_subagents_are_joined_by_the_next_parent_turn(wl: Workload) -> None:
    joined = background = 0
    for s in wl.sessions:
        items = s.items
        last_t = -1.0
        for k, item in enumerate(items):
            if isinstance(item, Request):
                assert item.t >= last_t
                last_t = item.t
                continue
            assert all(r.t >= item.t for r in item.requests())
            if item.background:
                background += 1
                assert item.status == "async_launched" and item.total_tokens is None
                continue
            later = [i for i in items[k + 1 :] if isinstance(i, Request)]
            if later:
                joined += 1
                assert later[0].t >= item.end
                last = list(item.requests())[-1]
                assert item.end >= last.t + last.api_time
    assert joined > 50 and background > 5


def test_calibration_against_published_statistics(wl: Workload) -> None:
    got = summarize(wl)
    # AA-AgentPerf: ISL ~5k-131k, mean ~27k; OSL median ~150, P95 ~2k
    assert 22_000 < got["input_tokens"]["mean"] < 33_000
    assert got["input_tokens"]["max"] <= CFG.context_cap
    assert 120 <= got["output_tokens"]["p50"] <= 180
    # AgentX/Weka corpus: ~251 requests per session
    assert 180 < got["requests"] / got["sessions"] < 330
    # AgentX traces: ~98% pure suffix growth; pauses from sub-second to minutes
    assert 0.97 < got["suffix_growth_ratio"] < 0.995
    assert got["pause_s"]["p50"] < 2.0 and got["pause_s"]["max"] > 120.0
    assert got["theoretical_cache_hit_ratio"] > 0.9
    assert got["subagent_requests"] > 0


def test_context_cap_forces_compaction() -> None:
    cfg = replace(CFG, context_cap=20_000, reset_prob=0.0)
    small = generate(cfg, 3, 1)
    assert max(r.in_tokens + r.out_tokens for s in small.sessions for r in s.all_requests()) <= (
        20_000
    )
    assert summarize(small)["suffix_growth_ratio"] < 0.99  # compactions happened


def test_toml_overrides_and_errors(tmp_path: Path) -> None:
    toml = tmp_path / "g.toml"
    toml.write_text('suffix_median = 100\nsubagent_types = ["Review"]\nblock_size = 16\n')
    cfg = load_config("agentx-coding", toml)
    assert (cfg.suffix_median, cfg.subagent_types, cfg.block_size) == (100.0, ("Review",), 16)
    assert {s.block_size for s in generate(cfg, 2, 0).sessions} == {16}
    toml.write_text("suffix_mediam = 100\n")
    with pytest.raises(AgentabError, match="unknown generator parameter 'suffix_mediam'"):
        load_config("agentx-coding", toml)
    toml.write_text('block_size = "64"\n')
    with pytest.raises(AgentabError, match="'block_size' must be an integer"):
        load_config("agentx-coding", toml)
    toml.write_text("reset_prob = 1.5\n")
    with pytest.raises(AgentabError, match="'reset_prob' is a probability"):
        load_config("agentx-coding", toml)
    toml.write_text("reset_prob = \n")
    with pytest.raises(AgentabError, match="invalid TOML"):
        load_config("agentx-coding", toml)
    with pytest.raises(AgentabError, match="unknown preset 'nope'"):
        load_config("nope")
    with pytest.raises(AgentabError, match="--sessions must be >= 1"):
        generate(GeneratorConfig(), 0, 1)


def test_generate_command_writes_a_round_trippable_file(tmp_path: Path, cli) -> None:
    out = tmp_path / "g.jsonl"
    assert cli("workload", "generate", "--sessions", "3", "--seed", "5", "-o", str(out)) == 0
    assert load(out).content_hash == generate(CFG, 3, 5).content_hash
