"""Round trips: generate -> export AgentX JSON -> import gives the identical content hash; the
same through native JSONL and through `agentab workload convert`."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from agentab.errors import AgentabError
from agentab.workloads import Workload, load, save
from agentab.workloads.agentx import REQUEST_FIELDS, SESSION_FIELDS, SUBAGENT_FIELDS
from agentab.workloads.generator import generate, load_config

from .conftest import DATA


@pytest.fixture(scope="module")
def wl() -> Workload:
    return generate(load_config("agentx-coding"), 6, 11)


@pytest.mark.parametrize("name", ["dir", "w.jsonl", "w.jsonl.gz"])
def test_generated_agentx_round_trip(wl: Workload, tmp_path: Path, name: str) -> None:
    save(wl, tmp_path / name, "agentx")
    back = load(tmp_path / name)
    assert back.content_hash == wl.content_hash
    assert back.sessions == wl.sessions


def test_generated_native_round_trip(wl: Workload, tmp_path: Path) -> None:
    save(wl, tmp_path / "w.jsonl")
    assert load(tmp_path / "w.jsonl").content_hash == wl.content_hash
    # native is much smaller than AgentX JSON (hash ids stored as deltas)
    save(wl, tmp_path / "x.jsonl", "agentx")
    assert (tmp_path / "w.jsonl").stat().st_size * 5 < (tmp_path / "x.jsonl").stat().st_size


def test_agentx_export_uses_only_the_weka_schema(wl: Workload, tmp_path: Path) -> None:
    """AIPerf's Weka loader forbids unknown fields: the export writes only known ones."""
    save(wl, tmp_path / "d", "agentx")
    files = sorted((tmp_path / "d").iterdir())
    assert [f.name for f in files] == [f"{i:04d}_agentx-11-{i:05d}.json" for i in range(6)]

    def check(entries: list[dict]) -> None:
        for e in entries:
            if e["type"] == "subagent":
                assert set(e) == SUBAGENT_FIELDS
                check(e["requests"])
            else:
                assert set(e) <= REQUEST_FIELDS and e["type"] in ("n", "s")

    for f in files:
        doc = orjson.loads(f.read_bytes())
        assert set(doc) <= SESSION_FIELDS and doc["hash_id_scope"] == "local"
        check(doc["requests"])


def test_convert_command(tmp_path: Path, cli) -> None:
    src = DATA / "agentx"
    assert (
        cli("workload", "convert", str(src), "-o", str(tmp_path / "n.jsonl"), "--to", "native") == 0
    )
    assert (
        cli(
            "workload",
            "convert",
            str(tmp_path / "n.jsonl"),
            "-o",
            str(tmp_path / "x"),
            "--to",
            "agentx",
        )
        == 0
    )
    assert load(tmp_path / "x").content_hash == load(src).content_hash
    one = tmp_path / "one.json"
    assert (
        cli("workload", "convert", str(src / "joins.json"), "-o", str(one), "--to", "agentx") == 0
    )
    assert load(one).content_hash == load(src / "joins.json").content_hash


def test_export_refusals_and_lossy_warning(tmp_path: Path) -> None:
    wl = load(DATA / "agentx")
    with pytest.raises(AgentabError, match=r"a \.json file holds one AgentX session"):
        save(wl, tmp_path / "two.json", "agentx")
    save(wl, tmp_path / "d", "agentx")
    with pytest.raises(AgentabError, match="directory already holds trace files"):
        save(wl, tmp_path / "d", "agentx")
    moon = load(DATA / "mooncake" / "sample.jsonl")
    with pytest.warns(UserWarning, match="cannot hold session arrival_s"):
        save(moon, tmp_path / "m.jsonl", "agentx")
    back = load(tmp_path / "m.jsonl")
    assert [s.hash_scope for s in back.sessions] == ["global"] * 3
    assert [s.arrival_s for s in back.sessions] == [0.0] * 3
