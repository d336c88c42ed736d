"""Every string field of a trace is bounded (MAX_STRING_CHARS characters, MAX_STRINGS elements
per list): each is copied into every record of its requests, so one corrupt megabyte-long id
would grow a run by gigabytes. The error names the file, line and field, never the value."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agentab.errors import AgentabError
from agentab.workloads import load, save
from agentab.workloads.checks import MAX_STRING_CHARS, MAX_STRINGS
from agentab.workloads.generator import generate, load_config

LONG = "x" * (MAX_STRING_CHARS + 1)


def agentx_session(**changes: Any) -> dict[str, Any]:
    """A valid AgentX session (one request, one subagent) with `changes` at the given paths:
    `request__model` sets the first request's model, `subagent__agent_id` the subagent's."""
    session: dict[str, Any] = {
        "id": "s1",
        "block_size": 4,
        "models": ["m"],
        "requests": [
            {"t": 0.0, "type": "n", "in": 8, "out": 2, "hash_ids": [1, 2], "model": "m",
             "input_types": ["text"], "output_types": ["text"], "stop": "end_turn"},
            {"t": 1.0, "type": "subagent", "agent_id": "a1", "subagent_type": "Explore",
             "status": "completed", "duration_ms": 1000, "models": ["m"],
             "requests": [{"t": 1.5, "type": "n", "in": 4, "out": 1, "hash_ids": [9]}]},
        ],
    }  # fmt: skip
    for key, value in changes.items():
        where, _, field = key.rpartition("__")
        target = {
            "": session,
            "request": session["requests"][0],
            "subagent": session["requests"][1],
        }[where]
        target[field] = value
    return session


@pytest.mark.parametrize(
    ("change", "where", "field"),
    [
        ({"id": LONG}, "", "'id'"),
        ({"hash_id_scope": LONG}, ": session 's1'", "'hash_id_scope'"),
        ({"request__model": LONG}, ": session 's1': request 0", "'model'"),
        ({"request__stop": LONG}, ": session 's1': request 0", "'stop'"),
        ({"request__input_types": ["text", LONG]}, ": session 's1': request 0", "'input_types'"),
        ({"subagent__agent_id": LONG}, ": session 's1': request 1", "'agent_id'"),
        ({"subagent__subagent_type": LONG}, ": session 's1': request 1", "'subagent_type'"),
        ({"subagent__status": LONG}, ": session 's1': request 1", "'status'"),
        ({"models": ["m", LONG]}, ": session 's1'", "'models'"),
    ],
)
def test_a_long_agentx_string_names_the_file_line_and_field(
    tmp_path: Path, change: dict[str, Any], where: str, field: str
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(agentx_session()) + "\n" + json.dumps(agentx_session(**change)))
    with pytest.raises(AgentabError) as exc:
        load(path)
    message = str(exc.value)
    if field == "'hash_id_scope'":  # checked against its two values: shown cut short
        assert message.startswith(f"{path}:2{where}: field 'hash_id_scope' must be 'local' or ")
        assert message.endswith(f"... ({MAX_STRING_CHARS + 3:,} characters)")
        return
    assert message == (
        f"{path}:2{where}: field {field} is {MAX_STRING_CHARS + 1:,} characters long; at most "
        f"{MAX_STRING_CHARS:,} are accepted (an id or a name; is the field corrupt?)"
    )


def test_too_many_strings_in_a_list(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(agentx_session(request__output_types=["text"] * (MAX_STRINGS + 1))))
    with pytest.raises(AgentabError) as exc:
        load(path)
    assert str(exc.value) == (
        f"{path}: session 's1': request 0: field 'output_types' holds {MAX_STRINGS + 1:,} "
        f"strings; at most {MAX_STRINGS:,} are accepted"
    )


def test_strings_at_the_bound_are_read(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    at = "y" * MAX_STRING_CHARS
    path.write_text(json.dumps(agentx_session(id=at, request__model=at)))
    (session,) = load(path).sessions
    assert session.id == at and next(session.requests()).model == at


def native_with_long_session_id(tmp_path: Path, length: int) -> Path:
    """A native trace of two generated sessions, the second's id `length` characters long."""
    good = tmp_path / "good.jsonl"
    save(generate(load_config("agentx-coding"), 2, 1), good)
    header, first, second = good.read_text().splitlines()
    data = json.loads(second)
    data["id"] = "s" * length
    path = tmp_path / "long-id.jsonl"
    path.write_text("\n".join([header, first, json.dumps(data)]) + "\n")
    return path


def test_a_100_mb_session_id_stops_ab_at_once_in_little_memory(tmp_path: Path) -> None:
    """The case that grew `ab` past 6 GiB: now one line before any run, the process staying
    within a small multiple of the file."""
    trace = native_with_long_session_id(tmp_path, 100 * 2**20)
    experiment = tmp_path / "exp.toml"
    experiment.write_text(
        'name = "long-id"\nrepeats = 1\n[workload]\npath = "long-id.jsonl"\n[gpus]\ncount = 16\n'
        '[replay]\nconcurrency = 2\nduration_s = 60.0\n[engine]\nkind = "simulator"\n'
        'profile = "gb300-tp16-kimi-k3"\n[[arms]]\ndecode_backend = "auto"\n[[arms]]\n'
        'decode_backend = "latency_specialized"\n'
    )
    out = tmp_path / "out"
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    result = subprocess.run(
        [sys.executable, "-m", "agentab", "ab", str(experiment), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    assert result.returncode == 2
    assert result.stderr == (
        f"agentab: error: {trace}:3: field 'id' is {100 * 2**20:,} characters long; at most "
        f"{MAX_STRING_CHARS:,} are accepted (an id or a name; is the field corrupt?)\n"
    )
    assert peak_kib < 1.5 * 2**20 or peak_kib <= before  # under 1.5 GiB (was over 6 GiB)
    assert not (out / "auto").exists()
